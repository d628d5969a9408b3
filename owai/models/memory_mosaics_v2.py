"""Memory Mosaics v2: the language model of thesis chapter 4 (sec 4.2, Tables 4.2 and 4.8).

No public v2 code exists; this follows the implementation spec (memory_mosaics.md sec 6-7) and the
choices recorded in docs/decisions.md ("Memory Mosaics v2"). Per block (x the RMS-normed residual
stream, per head h, hs = d/H, positions counted within the current document):

    key extractor, one per memory (eq 4.4), computed in log space:
        k~_t = W_phi x_t     log g_t = W_g x_t     log lambda_t = -|W_lambda x_t|       (scalars per head)
        kbar_t = g_t k~_t + lambda_t kbar_{t-1}   (reset at document starts)          k_t = kbar_t/|kbar_t|
    value extractor, one per memory (eq 4.5):
        v~_t = W_psi x_t     v_t = Norm(gamma v~_t + (1 - gamma) v~_{t+1})                (peeks at t+1)
    contextual memory read with adaptive bandwidth (eq 4.2), keys are queries:
        y_t = sum_{j in S_t} softmax_j(beta_t k_t . k_j) v_j,   beta_t = beta1 n_t^alpha + beta0,  n_t = |S_t|
        short-term memory: S_t = {j : t-h+1 <= j <= t-1}  (h = 256; "closed" edge: t-h <= j)
        long-term memory:  S_t = {j : j <= t-m}          (m ~ U[64, 256] in training, 64 at inference;
                                                          "strict" edge: j <= t-m-1)
        both only within t's document; an empty S_t reads 0.
    block:  x += o_short(y_short) + o_long(y_long);   x += SwiGLU(RMSNorm(x))   (persistent memory)

No positional encoding anywhere; untied input and output embeddings; RMSNorm (the Llama stack).
`config.long_term_memory = False` skips the long-term memory (the Tables 4.2/4.3/C.1 ablation; the
evaluation interface flips it at inference). Built with it False, the model has no long-term
parameters at all (Table 4.2's 8.3B row).

Documents: `position_ids` (B, T) restarting at 0 at each document start (HF's packed-sequence
convention) give each query its document start ds_t = t - position_ids[t]; nothing reads across it.
The same rule makes left-padded batches work in `generate`: HF derives position_ids from the
attention mask, so the padding is a document of its own that no real token reads.

Cost: the key scan works in chunks of `scan_chunk` (a chunk x chunk matrix per chunk, in log space;
the chunk ends are scanned the same way one level up, then each chunk's rows are one matmul over its
keys, the value entering it folded into the first: O(T) memory, no T x T decay matrix, no loop).
Memory reads go over query blocks of `query_block` rows against only the keys a block can see (the
short-term window, the long-term prefix); without documents the long-term read is one causal SDPA on delay-shifted tensors (flash
kernels, O(T) memory). Generation keeps a `MemoryMosaicsV2Cache`: the short-term memory only its
last h pairs, the long-term memory all pairs (in a buffer with spare rows: a new token writes one
row), plus each key scan's state and the newest raw value.

Kernels (docs/decisions.md, issue #39): `attn_impl` auto|sdpa|flex and `scan_impl`
auto|chunked|compiled|triton choose how, not what, is computed. On CUDA (auto) reads from position 0 go
through compiled flex_attention with block masks built once per forward from per-block bounds (the
short-term window always, the long-term memory with documents), each memory's work between its
projections and its read (`memory_inputs`: the key scan, the unit norms, the value mix, the
bandwidth) runs as one compiled graph, reads and the cache use the autocast dtype (else the
weights'); decoding steps read their
slice with one unmasked SDPA. `scan_impl: triton` runs the key scan as owai's own Triton kernel
(owai.models.key_scan_triton: a custom op with its backward, also inside compiled blocks). On CPU
the path above is unchanged. `static_decoding` (auto: on CUDA, unsharded models): once `generate`
knows the length, decoding steps run on a `StaticDecoder`, buffers allocated once and reads masked
by a position tensor, each block's matmuls stacked once, so the step (its blocks compiled) is captured
as one CUDA graph and replayed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.modeling_outputs import CausalLMOutputWithPast

from owai.errors import OwaiError, one_line
from owai.models.hf_cache import CACHE_FIELD, causal_lm_loss, forward_cache, refuse_unread_inputs, with_cache
from owai.models.memory_mosaics import MemoryMosaicsCache, _as, _unit, _unit_adjoint, _wide, own_generation_cache

SHORT_EDGES = ("open", "closed")  # open: j >= t-h+1 (thesis main text); closed: j >= t-h (paper appendix)
LONG_EDGES = ("inclusive", "strict")  # inclusive: j <= t-m; strict: j <= t-m-1
# The edges pair: open with inclusive (the main text), closed with strict (the appendix). Together the
# two memories then read every lag once at m = h; open with strict leaves lag h unread there, closed
# with inclusive reads it twice.
ATTN_IMPLS = ("auto", "sdpa", "flex")  # auto: flex on CUDA (training, prefill), sdpa elsewhere
SCAN_IMPLS = ("auto", "chunked", "compiled", "triton")  # auto: the chunked scan as one compiled graph on CUDA
STATIC_DECODING = ("auto", "on", "off")  # auto: on CUDA when generate knows the length (StaticDecoder)
FLEX_BLOCK = 128  # flex_attention's sparse block size (rows and columns)


class MemoryMosaicsV2Config(PreTrainedConfig):
    """Hyper-parameters; defaults are the thesis's Small model (24 layers, d 2048, 16 heads, FFN 6144).

    Invalid values raise OwaiError. The bandwidth initialisation gives beta = beta1 + beta0 ~ e^2 at
    n = 1 (v1's initial key scale, squared), growing as n^alpha with alpha = 0.05 at init.
    """

    model_type = "owai_memory_mosaics_v2"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
    keys_to_ignore_at_inference = [CACHE_FIELD]

    vocab_size: int = 128256
    n_layer: int = 24
    n_embd: int = 2048
    n_head: int = 16
    ffn_hidden: int = 6144
    short_window: int = 256  # h
    short_edge: str = "open"
    long_term_memory: bool = True
    long_delay_train: tuple[int, int] | list[int] = (64, 256)  # m drawn uniformly (inclusive) per training step
    long_delay_eval: int = 64
    long_edge: str = "inclusive"
    beta1_init: float = 7.38905609893065  # e^2
    beta0_init: float = 1e-3
    alpha_init: float = 0.05
    rms_norm_eps: float = 1e-5
    norm_eps: float = 1e-6  # added to value norms; keys divide by max(|kbar|, eps)
    initializer_range: float = 0.02
    scan_chunk: int = 16
    query_block: int = 256
    attn_impl: str = "auto"  # memory reads: ATTN_IMPLS (same function, different kernels)
    scan_impl: str = "auto"  # key scan: SCAN_IMPLS (same function, different kernels)
    static_decoding: str = "auto"  # STATIC_DECODING: generation steps on preallocated buffers, CUDA-graphed
    # (they also hold a copy of each block's matmul weights, ~30 % of the model: "off" where memory is short)
    bag_of_k: int = 0  # > 0: a second head predicting the bag of the next k tokens (sec 4.2.5.1)
    bag_weight: float = 0.3  # alpha of L = L_next + alpha L_bag
    bag_eta: float = 64000.0
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if isinstance(self.long_delay_train, (list, tuple)):
            self.long_delay_train = tuple(int(m) for m in self.long_delay_train)
        self._check()

    def _check(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise OwaiError(f"memory mosaics v2 config: {name} must be an integer >= {minimum}, got {value!r}")

        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "ffn_hidden", "short_window", "long_delay_eval",
                     "query_block"):
            positive_int(name)
        positive_int("scan_chunk", 2)
        positive_int("bag_of_k", 0)
        if self.n_embd % self.n_head:
            raise OwaiError(f"memory mosaics v2 config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.short_edge not in SHORT_EDGES:
            raise OwaiError(f"memory mosaics v2 config: short_edge must be one of {SHORT_EDGES}, got {self.short_edge!r}")
        if self.long_edge not in LONG_EDGES:
            raise OwaiError(f"memory mosaics v2 config: long_edge must be one of {LONG_EDGES}, got {self.long_edge!r}")
        for name, allowed in (("attn_impl", ATTN_IMPLS), ("scan_impl", SCAN_IMPLS), ("static_decoding", STATIC_DECODING)):
            if getattr(self, name) not in allowed:
                raise OwaiError(f"memory mosaics v2 config: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        lo_hi = self.long_delay_train
        if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1]):
            raise OwaiError(f"memory mosaics v2 config: long_delay_train must be [min, max] with 1 <= min <= max, got {lo_hi!r}")
        if not (self.beta1_init > 0 and self.beta0_init > 0 and 0 < self.alpha_init < 1):
            raise OwaiError("memory mosaics v2 config: beta1_init and beta0_init must be > 0 and alpha_init in (0, 1)")
        if not isinstance(self.long_term_memory, bool):
            raise OwaiError(f"memory mosaics v2 config: long_term_memory must be true or false, got {self.long_term_memory!r}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def short_span(self) -> int:
        """Largest lag t - j the short-term memory stores (h-1 open, h closed)."""
        return self.short_window - 1 if self.short_edge == "open" else self.short_window

    def long_lag(self, delay: int) -> int:
        """Smallest lag t - j the long-term memory stores for delay m (m inclusive, m+1 strict)."""
        return delay if self.long_edge == "inclusive" else delay + 1


# ---------------------------------------------------------------------------------------------
# pieces


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def gated_key_scan(raw: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, doc_start: torch.Tensor | None,
                   start: int, state: tuple[torch.Tensor, torch.Tensor] | None, chunk: int, kernel: str = "chunked",
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The gated recurrence kbar_t = g_t k~_t + lambda_t kbar_{t-1} (eq 4.4), up to a positive factor per row.

    raw (B, H, T, hs) = k~ at absolute positions start..start+T-1; log_gate, log_decay (B, H, T) = log g,
    log lambda (<= 0); doc_start (B, T) absolute document start of each position (None: 0); state =
    (direction (B, H, hs), log-scale (B, H)) of kbar at position start-1, or None. Returns the
    directions of kbar (B, H, T, hs) (each row's scale dropped: only Norm(kbar) is used) and the
    new state. kernel "triton": the whole scan as owai.models.key_scan_triton's kernel (same function),
    else `_log_space_scan` (`chunk` positions per chunk), whose rows are bf16 where its matmul runs in
    bf16 under autocast (the state is float32 or wider).
    """
    local_start = None if doc_start is None else doc_start - start  # < 0: the document began before `start`
    if raw.shape[2] == 1 and state is not None:  # a decoding step: the recurrence's one step, a dozen ops
        rows, log_scale = _scan_step(_wide(raw), _wide(log_gate), _wide(log_decay), local_start, state)
    elif kernel == "triton":  # reads raw in its own dtype
        from owai.models.key_scan_triton import triton_log_space_scan

        rows, log_scale = triton_log_space_scan(raw, log_gate, log_decay, local_start, state)
    else:
        rows, log_scale = _log_space_scan(raw, _wide(log_gate), _wide(log_decay), local_start, state, chunk)
    last = _wide(rows[:, :, -1])
    norm = torch.linalg.vector_norm(last, dim=-1).clamp_min(1e-30)
    return rows, (last / norm[..., None], log_scale[:, :, -1] + norm.log())


def _scan_step(raw: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, local_start: torch.Tensor | None,
               state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_log_space_scan` for one position (T = 1) after `state`: g k~ + lambda kbar_prev, in log space
    with the larger exponent factored out. The same function as the chunked scan (tested), without
    its (c x c) machinery: a decoding step is launch-bound, so fewer kernels is faster."""
    own = log_gate  # (B, H, 1): log g_t
    carried = log_decay + state[1][:, :, None]  # (B, H, 1): log lambda_t + log-scale of kbar_{t-1}
    if local_start is not None:  # a document that begins at this position carries nothing over
        carried = carried.masked_fill((local_start >= 0)[:, None, :], float("-inf"))
    top = torch.maximum(own, carried)
    rows = torch.exp(own - top)[..., None] * raw + torch.exp(carried - top)[..., None] * state[0][:, :, None]
    return rows, top


def _log_space_scan(raw: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, local_start: torch.Tensor | None,
                    state: tuple[torch.Tensor, torch.Tensor] | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kbar_t = rows_t * exp(log_scale_t) for t = 0..T-1 of eq 4.4's recurrence, without a Python loop.

    local_start (B, T): index of each position's document start (negative: before position 0, so the
    entering `state` is part of it); None: one document that began before position 0.

    Chunked, in two passes. Inside chunk i, row T weighs the chunk's key t <= T of its document by
    exp(L_T + a_t), a_t = log g_t - L_t (L the in-chunk cumsum of log lambda): a (c x c) matrix that
    is an outer sum of two vectors, so it is never stored wider than the bf16 or float32 operand of
    its matmul. First the value entering each chunk: the recurrence's value at the end of chunk i-1,
    and those chunk ends obey the same recurrence one level up (k~ = a chunk's own sum at its end,
    the matrix's last row; log g its log-scale; log lambda = the chunk's total log decay): this
    function, called on the n-1 chunk ends, gives them all. Then every row as one matmul over the
    chunk's keys, the entering value folded into the first of them (below). Depth log_c(T); memory
    O(B H T c), no T x T matrix. The one matmul writes each row once: a second pass adding the
    entering value would read and write (B, H, T, hs) again, forward and backward; an extra column
    for it would make the matmul's inner size c + 1, which bf16 tensor-core kernels read unaligned.

    Each row is shifted by its largest exponent, so nothing overflows. The shifts (and the chunk
    ends' norms) are constants to autograd: every consumer reads a row only as rows exp(log_scale),
    on which a shift has no effect, so its gradient is exact without them, and the backward skips
    the max's adjoint, which reads the (c x c) matrices twice more. The returned log-scale alone
    therefore carries no gradient.
    """
    B, H, T, hs = raw.shape
    n = -(-T // chunk)
    c = chunk if n > 1 else T
    pad = n * c - T
    if pad:  # zeros after the end: causal, so they change nothing before it; they continue the last document
        raw, log_gate, log_decay = F.pad(raw, (0, 0, 0, pad)), F.pad(log_gate, (0, pad)), F.pad(log_decay, (0, pad))
        if local_start is not None:
            local_start = torch.cat([local_start, local_start[:, -1:].expand(B, pad)], dim=1)
    rc = raw.view(B, H, n, c, hs)
    L = torch.cumsum(log_decay.view(B, H, n, c), dim=-1)  # (B, H, n, c)
    a = log_gate.view(B, H, n, c) - L  # (B, H, n, c): column t's log-weight over L_T
    allowed = torch.ones(c, c, dtype=torch.bool, device=raw.device).tril()  # t <= T
    pos = torch.arange(n * c, device=raw.device).view(n, c)
    if local_start is not None:
        ds = local_start.view(B, 1, n, c)
        allowed = allowed & (pos[None, None, :, None, :] >= ds[..., :, None])  # (B, 1, n, c, c) same document

    # raw is read in its own dtype (the chunk ends' product widens it); the matmuls' operands are made in
    # the dtype autocast would cast them to, each as it is written, else float32 or wider
    on = raw.device.type
    mm = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else torch.promote_types(raw.dtype, L.dtype)

    if n == 1 and state is None:
        return _unpad(*_ChunkRows.apply(L, a, allowed, rc.to(mm)), T, pad)

    # the value entering each chunk: the given state, then the recurrence at the ends of chunks 0..n-2
    entering_dir, entering_log = [], []
    if state is not None:
        entering_dir.append(state[0][:, :, None])
        entering_log.append(state[1][:, :, None])
    else:
        entering_dir.append(L.new_zeros(B, H, 1, hs))
        entering_log.append(L.new_full((B, H, 1), float("-inf")))
    if n > 1:  # each chunk's own sum at its end: the matrix's last row, exp(L_last + a_t)
        last = L[..., :-1, -1:] + a[..., :-1, :]  # (B, H, n-1, c); the last row allows every t of its document
        if local_start is not None:
            last = last.masked_fill(~allowed[:, :, :-1, -1, :], float("-inf"))
        last_top = last.amax(dim=-1).detach()  # (B, H, n-1)
        ends = (torch.exp(last - last_top[..., None])[..., None] * rc[:, :, :-1]).sum(dim=-2)  # (B, H, n-1, hs)
        norm = torch.linalg.vector_norm(ends, dim=-1).clamp_min(1e-30).detach()
        # chunk end j is in chunk end i's document iff j >= floor(ds_i / c)
        ends_start = None if local_start is None else torch.div(ds[:, 0, :-1, -1], c, rounding_mode="floor")
        end_rows, end_log = _log_space_scan(ends / norm[..., None], last_top + norm.log(), L[..., :-1, -1],
                                            ends_start, state, chunk)
        entering_dir.append(end_rows)
        entering_log.append(end_log)
    s_in, sigma_in = torch.cat(entering_dir, dim=2), torch.cat(entering_log, dim=2)  # (B, H, n, hs), (B, H, n)
    if local_start is not None:  # the value enters a chunk only if the chunk's first document began before it
        sigma_in = sigma_in.masked_fill(~(ds[..., 0] < pos[None, None, :, 0]), float("-inf"))
    # The entering value reaches row T with weight exp(L_T + sigma_in) and the chunk's first key with
    # exp(L_T + a_0): both through exp(L_T), and both only for rows of the first key's document. So
    # one key, their weighted sum u with log-weight m, stands in for both in column 0, and the matmul
    # keeps its c x c shape.
    first = a[..., 0]  # (B, H, n)
    m = torch.maximum(first, sigma_in).detach()  # finite (first is)
    u = torch.exp(first - m)[..., None] * rc[..., 0, :] + torch.exp(sigma_in - m)[..., None] * s_in  # (B, H, n, hs)
    columns = torch.cat([m[..., None], a[..., 1:]], dim=-1)  # column 0: L_T + m
    return _unpad(*_ChunkRows.apply(L, columns, allowed, torch.cat([u[..., None, :].to(mm), rc[..., 1:, :].to(mm)], dim=3)),
                  T, pad)


class _ChunkRows(torch.autograd.Function):
    """A chunk's rows: sum over its allowed t of exp(L_T + columns_t - top_T) keys_t, one matmul, with
    top_T row T's largest exponent (the diagonal is always allowed: finite). L, columns (B, H, n, c)
    float32 or wider; allowed (c, c) or (B, 1, n, c, c); keys (B, H, n, c, hs) in the matmul's dtype.
    Returns rows (B, H, n, c, hs) in that dtype and top (B, H, n, c).

    Written out for the backward's sake. The (c x c) weights exist only as the matmul's operand,
    which the backward keeps for the keys' gradient; the exponents' gradient recomputes them, wide,
    from the two vectors inside its two sums instead of keeping a float32 copy, as autograd's exp
    would. top is a constant shift: no gradient reaches it or flows from it (see _log_space_scan).
    """

    @staticmethod
    def forward(ctx: Any, L: torch.Tensor, columns: torch.Tensor, allowed: torch.Tensor, keys: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        expo = (L[..., :, None] + columns[..., None, :]).masked_fill(~allowed, float("-inf"))  # (B, H, n, c, c)
        top = expo.amax(dim=-1)
        weights = torch.exp(expo - top[..., None]).to(keys.dtype)
        ctx.save_for_backward(L, columns, allowed, top, weights, keys)
        ctx.mark_non_differentiable(top)
        return weights @ keys, top

    @staticmethod
    def backward(ctx: Any, d_rows: torch.Tensor, d_top: torch.Tensor | None) -> tuple[Any, ...]:
        L, columns, allowed, top, weights, keys = ctx.saved_tensors
        d_rows = d_rows.to(keys.dtype)
        d_weights = d_rows @ keys.transpose(-1, -2)  # (B, H, n, c, c)
        d_keys = weights.transpose(-1, -2) @ d_rows
        # d exponent = weight x d weight, 0 where not allowed, summed over columns for L and over rows for
        # the columns. The weights are recomputed, wide, inside each sum, so that each reads only the bf16
        # d weights: written twice, in two orders, so that no common-subexpression pass merges them into
        # one float32 buffer (or with the forward's exp, which autograd would have kept)
        below = (L - top)[..., :, None]
        by_row = torch.exp(torch.where(allowed, below + columns[..., None, :], float("-inf"))) * d_weights.to(top.dtype)
        by_column = torch.exp(torch.where(allowed, columns[..., None, :] + below, float("-inf"))) * d_weights.to(top.dtype)
        return by_row.sum(dim=-1), by_column.sum(dim=-2), None, d_keys


def _unpad(rows: torch.Tensor, top: torch.Tensor, T: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, n, c, hs), (B, H, n, c) chunked rows and log-scales -> the first T positions, the rows
    in their matmul's dtype (a bf16 matmul's rows stay bf16: widening them adds no digits, and their
    consumer widens them as it reads them)."""
    B, H, n, c, hs = rows.shape
    rows, top = rows.reshape(B, H, n * c, hs), top.reshape(B, H, n * c)
    return (rows[:, :, :T], top[:, :, :T]) if pad else (rows, top)


def _append(cache: dict, name: str, new: torch.Tensor) -> torch.Tensor:
    """The first cache[name + "_rows"] rows of cache[name] followed by `new` (B, H, n, hs), along dim 2.

    Without autograd the cache keeps spare rows (its capacity doubles when full), so one generated
    token writes one row instead of copying the whole past as torch.cat would: the long-term memory's
    cache grows for the whole generation. With autograd on, a plain cat (no in-place writes).
    """
    rows = cache.get(name + "_rows", 0)
    old = cache.get(name)
    need = rows + new.shape[2]
    if torch.is_grad_enabled():
        buffer = new if old is None else torch.cat([old[:, :, :rows], new], dim=2)
    else:
        buffer = old
        if old is None or old.shape[2] < need:
            buffer = new.new_empty(*new.shape[:2], max(need, 2 * rows), new.shape[3])
            if rows:
                buffer[:, :, :rows] = old[:, :, :rows]
        buffer[:, :, rows:need] = new
    cache[name], cache[name + "_rows"] = buffer, need
    return buffer[:, :, :need]


_COMPILED: dict[str, Any] = {}  # torch.compile'd kernels, created once per process on first use (and failure flags)


def _compiled(name: str) -> Any:
    """torch.compile of flex_attention ("flex"), of gated_key_scan ("scan"), of memory_inputs
    ("inputs"), of decode_step ("decode"), of decode_step_on_input ("decode-input"), of static_block
    ("static") or of static_readable_step ("readable"), created lazily once per process."""
    if name not in _COMPILED:
        if name == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            _COMPILED[name] = torch.compile(flex_attention)
        elif name in ("scan", "inputs"):  # one graph per length (the scan's recursion depth)
            _COMPILED[name] = torch.compile(gated_key_scan if name == "scan" else memory_inputs, dynamic=False)
        elif name == "static":  # one graph per buffer shape, shared by every block and every StaticDecoder of one capacity
            _COMPILED[name] = torch.compile(static_block, fullgraph=True, dynamic=False)
        elif name == "readable":  # one graph per memory kind
            _COMPILED[name] = torch.compile(static_readable_step, fullgraph=True, dynamic=False)
        else:
            # fixed shapes every step; the weights (or the projections) are arguments, so the model's
            # memories share one graph per kind (the readable count becomes symbolic after its first change)
            _COMPILED[name] = torch.compile(decode_step if name == "decode" else decode_step_on_input, fullgraph=True)
    return _COMPILED[name]


def decode_step(key: torch.Tensor, gate: torch.Tensor, decay: torch.Tensor, value: torch.Tensor,
                value_mix: torch.Tensor, beta1_log: torch.Tensor, alpha_raw: torch.Tensor, beta0_raw: torch.Tensor,
                scan_dir: torch.Tensor, scan_log: torch.Tensor, v_pending: torch.Tensor, log_count: torch.Tensor,
                norm_eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The arithmetic of one cached decoding step of a memory (one position, one document), fused.

    key, value (B, 1, d) and gate, decay (B, 1, H): the position's W_phi, W_psi, W_g, W_lambda
    projections (the caller's matmuls: a StaticDecoder does all of a block's as one); the memory's
    per-head parameters; scan_dir (B, H, hs), scan_log (B, H) the key scan's state; v_pending (B, H,
    hs) the previous position's raw value; log_count = log max(n_t, 1), n_t the keys this query can
    read (a 0-d tensor on the device, so no Python number enters the compiled graph). Returns the
    query (bandwidth applied), the new key, the finished value of the previous position (each (B, H,
    1, hs) in `dtype`), the new scan state and the new raw value. The same function as
    ContextualMemory.forward's general path for T = 1 (tested): that path costs ~60 kernels per
    memory, which makes a decoding step launch-bound; compiled, this is a handful.
    """
    B, H, hs = scan_dir.shape
    raw_k = _wide(key.view(B, H, hs))
    own = _wide(gate.view(B, H))  # log g_t
    carried = _wide(-decay.abs().view(B, H)) + scan_log  # log lambda_t + log-scale of kbar_{t-1}
    top = torch.maximum(own, carried)
    row = torch.exp(own - top)[..., None] * raw_k + torch.exp(carried - top)[..., None] * scan_dir  # (B, H, hs)
    norm = torch.linalg.vector_norm(row, dim=-1).clamp_min(1e-30)
    key = _key_unit(row, norm_eps)
    raw_v = _wide(value.view(B, H, hs))
    finished = _unit(torch.lerp(raw_v, v_pending, value_mix.float()[None, :, None].to(raw_v.dtype)), norm_eps)
    beta1, alpha, beta0 = bandwidth_parameters(beta1_log, alpha_raw, beta0_raw)
    beta = beta1 * torch.exp(alpha * log_count) + beta0  # (H,) beta1 n^alpha + beta0
    query = key * beta[None, :, None]
    return (query.to(dtype)[:, :, None], key.to(dtype)[:, :, None], finished.to(dtype)[:, :, None],
            row / norm[..., None], top + norm.log(), raw_v)


def decode_step_on_input(h: torch.Tensor, key_w: torch.Tensor, gate_w: torch.Tensor, decay_w: torch.Tensor,
                         value_w: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, ...]:
    """`decode_step` with the position's four projections of the normed input h (B, 1, d) computed in
    it: the dynamic cache's step, whose matmuls then sit in the same compiled graph."""
    return decode_step(F.linear(h, key_w), F.linear(h, gate_w), F.linear(h, decay_w), F.linear(h, value_w), *rest)


def memory_inputs(key: torch.Tensor, gate: torch.Tensor, decay: torch.Tensor, value: torch.Tensor,
                  v_pending: torch.Tensor | None, doc_start: torch.Tensor | None, past: int,
                  scan_state: tuple[torch.Tensor, torch.Tensor] | None, chunk: int, kernel: str,
                  value_mix: torch.Tensor, beta1_log: torch.Tensor, alpha_raw: torch.Tensor, beta0_raw: torch.Tensor,
                  counts: torch.Tensor, norm_eps: float, dtype: torch.dtype, flex_read: bool = False) -> tuple[Any, ...]:
    """A memory's work between its projections and its read, for T positions at past..past+T-1.

    key, value (B, T, d) and gate, decay (B, T, H): the outputs of W_phi, W_psi, W_g, W_lambda;
    v_pending (B, H, hs) the raw value of position past-1 (a cache's), or None; doc_start (B, T) or
    None; scan_state the key scan's state at past-1, or None; chunk, kernel: gated_key_scan's; the
    bandwidth's parameters; counts (B|1, T) the keys n_t each query can read (`_bandwidth_counts`; a
    tensor, so the long-term memory's delay, drawn per training step, is not a constant of the
    graph and both memories share one); flex_read: the reads go through flex_attention (the memory
    was given flex masks). Returns, in `dtype`: the queries (the keys with the bandwidth beta1 n^alpha
    + beta0 applied, (B, H, T, hs); compiled for flex reads, stored as (B, T, H, hs): flex_attention's
    output takes its queries' layout, so the read is then o_proj's input rows with no copy), the keys,
    the finished values gamma v~_t + (1 - gamma) v~_{t+1} of the positions whose next token is here
    (T - 1 rows, or T with v_pending); then the scan's new state and the last raw value (B, H, hs), in
    float32 or wider.

    One function so that it runs as one compiled graph where the key scan is compiled
    (`memory_inputs_plan`: on CUDA). Eagerly this float32 work (unit norms, the value mix, the
    bandwidth, the casts) is dozens of kernels over (B, H, T, hs) tensors per memory and layer,
    forward and backward; compiled it fuses around the scan, as compiled blocks fuse it.
    """
    B, T, d = key.shape
    H = gate.shape[-1]
    split = lambda z: z.view(B, T, H, d // H).transpose(1, 2)  # noqa: E731  (B, T, d) -> (B, H, T, hs)
    log_gate = gate.transpose(1, 2)  # (B, H, T)
    log_decay = -decay.abs().transpose(1, 2)  # (B, H, T), <= 0
    directions, scan_state = gated_key_scan(split(key), log_gate, log_decay, doc_start, past, scan_state, chunk, kernel)
    beta = bandwidth_of(counts, beta1_log, alpha_raw, beta0_raw)  # (B|1, H, T)
    queries, keys = _KeysAndQueries.apply(directions, beta, norm_eps, dtype)
    if flex_read and torch.compiler.is_compiling():  # in the kernel that writes them: no copy of its own
        queries = queries.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, hs) stored as (B, T, H, hs)
    raw_v = split(value)  # (B, H, T, hs)
    if not torch.compiler.is_compiling():  # eagerly one float32 copy serves both reads; compiled, each read
        raw_v = _wide(raw_v)  # widens (inlined: no float32 copy is kept for the backward)
    if v_pending is not None:  # the pending position past-1 gets its value now that x_past is known
        raw_v = torch.cat([v_pending[:, :, None], _wide(raw_v)], dim=2)  # positions past-1 ..
    finished = _FinishedValues.apply(raw_v, value_mix, norm_eps, dtype)
    return queries, keys, finished, scan_state, _wide(raw_v[:, :, -1])


def _key_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm(kbar) from a key scan row x = kbar times any positive factor: x / max(|x|, eps) over the
    last dim. The factor depends on the chunk and the path (`gated_key_scan`), so eps only guards a
    vanishing row: added to |x| it would act as eps times that factor, and the keys would change with
    the chunk and the cache (docs/decisions.md, forty-ninth session)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(max(eps, 1e-30))


class _KeysAndQueries(torch.autograd.Function):
    """queries = beta keys and keys = x / max(|x|, eps) (`_key_unit`), in `dtype`: x (B, H, T, hs) the
    key scan's rows (bf16 where its matmul ran in bf16), beta (B|1, H, T) the bandwidth (on the query
    side only).

    Its backward written out: autograd's own sums the two incoming gradients into one float32 tensor
    as wide as the rows, then reads it twice more. This one reads the bf16 gradients and rows twice,
    for each row's dot products and then its gradient, and returns that gradient in x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, beta: torch.Tensor, eps: float, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = _key_unit(_wide(x), eps)
        ctx.save_for_backward(x, beta)
        ctx.eps = eps
        return _as(keys * beta[..., None].to(keys.dtype), dtype), _as(keys, dtype)

    @staticmethod
    def backward(ctx: Any, d_queries: torch.Tensor, d_keys: torch.Tensor) -> tuple[Any, ...]:
        x, beta = ctx.saved_tensors
        wide = _wide(x)
        b = beta[..., None].to(wide.dtype)
        dq, dk = d_queries.to(wide.dtype), d_keys.to(wide.dtype)
        norm = torch.linalg.vector_norm(wide, dim=-1, keepdim=True)
        xq = (wide * dq).sum(dim=-1, keepdim=True)
        xg = (wide * dk).sum(dim=-1, keepdim=True) + b * xq  # x . (dk + beta dq), without storing that sum
        d = norm.clamp_min(max(ctx.eps, 1e-30))  # g / |x| - x (x . g) / |x|^3 above eps, g / eps below
        a, c = 1 / d, torch.where(norm >= d, xg / (norm * d * d), 0.0)
        d_beta = (xq * a).squeeze(-1)  # d queries . keys
        if d_beta.shape[0] != beta.shape[0]:  # beta broadcast over the batch
            d_beta = d_beta.sum(dim=0, keepdim=True)
        return ((dk + b * dq) * a - wide * c).to(x.dtype), d_beta.to(beta.dtype), None, None


def _pad_end(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, k) with a zero row appended: F.pad(x, (0, 0, 0, 1)), written as a pad on both sides
    and a slice, because inductor lowers a pad on the right alone as a concatenation, which it may
    store, where a two-sided pad stays a masked read that fuses into its consumer."""
    return F.pad(x, (0, 0, 1, 1))[:, :, 1:]


class _FinishedValues(torch.autograd.Function):
    """The finished values unit(gamma v~_t + (1 - gamma) v~_{t+1}) in `dtype`, (B, H, R - 1, hs), from
    the raw values v~ (B, H, R, hs) and value_mix gamma (H,).

    Its backward written out, as _KeysAndQueries's. Compiled: each row's dot products in one pass over
    the bf16 gradient and raw values, then each raw value's gradient, gamma adj_t + (1 - gamma)
    adj_{t-1}, in a second. The row adjoint is written once for each of its two shifts, from shifted
    inputs, and the mix again in another form, so that no common-subexpression pass stores the
    adjoint or keeps the forward's float32 mix for the backward. Eagerly, where each op is a kernel
    anyway, the adjoint is computed once and shifted."""

    @staticmethod
    def forward(ctx: Any, raw: torch.Tensor, value_mix: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        later, earlier = _wide(raw[:, :, 1:]), _wide(raw[:, :, :-1])
        mixed = torch.lerp(later, earlier, value_mix.float()[None, :, None, None].to(later.dtype))  # as one op
        ctx.save_for_backward(raw, value_mix)
        ctx.eps = eps
        return _as(_unit(mixed, eps), dtype)

    @staticmethod
    def backward(ctx: Any, d_finished: torch.Tensor) -> tuple[Any, ...]:
        raw, value_mix = ctx.saved_tensors
        compiling = torch.compiler.is_compiling()
        wide = raw if compiling else _wide(raw)  # eagerly one float32 copy serves every read
        earlier, later = _wide(wide[:, :, :-1]), _wide(wide[:, :, 1:])  # v~_t and v~_{t+1}, R - 1 rows
        gamma = value_mix.to(earlier.dtype)[None, :, None, None]
        g = d_finished.to(earlier.dtype)
        step = earlier - later  # d mix / d gamma = v~_t - v~_{t+1}
        mixed = later + gamma * step
        norm = torch.linalg.vector_norm(mixed, dim=-1, keepdim=True)
        zg = (mixed * g).sum(dim=-1, keepdim=True)
        a, c = _unit_adjoint(norm, zg, ctx.eps)  # (B, H, R - 1, 1) each
        if not compiling:  # eagerly each op is a kernel: the adjoint once, stored
            end, start = (0, 0, 0, 1), (0, 0, 1, 0)  # d v~_t = gamma adj_t + (1 - gamma) adj_{t-1}
            adjoint = g * a - mixed * c
            d_gamma = (adjoint * step).sum(dim=(0, 2, 3))
            d_raw = F.pad(gamma * adjoint, end) + F.pad((1 - gamma) * adjoint, start)
            return d_raw.to(raw.dtype), d_gamma.to(value_mix.dtype), None, None
        d_gamma = ((g * step).sum(dim=-1, keepdim=True) * a - (mixed * step).sum(dim=-1, keepdim=True) * c).sum(dim=(0, 2, 3))
        # Compiled, each raw value's gradient is one loop over the R positions (the rows' sums above
        # are another, over R - 1: two kernels on a GPU). Every input is shifted from the saved tensors
        # (bf16 under autocast) and widened where it is read, so no float32 copy of the values or the
        # gradient is stored for two kernels to read (Triton's count: docs/results.md, issue #39).
        start = (0, 0, 1, 0)
        rows = raw.to(earlier.dtype)
        adjoint_end = (_pad_end(d_finished).to(rows.dtype) * _pad_end(a)  # adj_t, zero at t = R - 1
                       - torch.lerp(_pad_end(raw[:, :, 1:]).to(rows.dtype), rows, gamma) * _pad_end(c))
        adjoint_start = (F.pad(d_finished, start).to(rows.dtype) * F.pad(a, start)  # adj_{t-1}, zero at t = 0
                         - torch.lerp(rows, F.pad(raw[:, :, :-1], start).to(rows.dtype), gamma) * F.pad(c, start))
        d_raw = gamma * adjoint_end + (1 - gamma) * adjoint_start
        return d_raw.to(raw.dtype), d_gamma.to(value_mix.dtype), None, None


def _compiles_scan(config: MemoryMosaicsV2Config, device: torch.device) -> bool:
    """Whether the key scan (and a decoding step's arithmetic) run compiled: scan_impl "compiled", or
    "auto" or "triton" on CUDA (a decoding step is one position: no scan); never inside a torch.compile."""
    impl = config.scan_impl
    on_cuda = impl in ("auto", "triton") and device.type == "cuda"
    return (impl == "compiled" or on_cuda) and not torch.compiler.is_compiling()


_FAILED_WHAT = {"inputs": "a memory's inputs (the key scan and its elementwise work)", "decode": "the decoding step",
                "readable": "the decoding step's readable slots",
                "decode-input": "the decoding step",
                "static": "the decoding step on static buffers"}


def _run_compiled(name: str, fn: Any, inputs: tuple, compiled: bool) -> Any:
    """fn(*inputs), through _compiled(name) (fn compiled) when `compiled`. Should compiling fail when
    called (a backend error), fn runs eagerly from then on, with one warning: the same function, more
    kernels. (A failure in compiling the backward surfaces in backward().)"""
    if compiled and name + "-failed" not in _COMPILED:
        try:
            return _compiled(name)(*inputs)
        except Exception as err:  # noqa: BLE001 - torch._dynamo's errors vary by release
            _COMPILED[name + "-failed"] = True
            import warnings

            warnings.warn(f"memory mosaics v2: compiling {_FAILED_WHAT[name]} failed ({one_line(err)}); "
                          "running it eagerly", RuntimeWarning, stacklevel=2)
    return fn(*inputs)


def memory_inputs_plan(config: MemoryMosaicsV2Config, device: torch.device, T: int) -> tuple[bool, int, str]:
    """(compile, chunk, kernel) for `memory_inputs` over T new positions on `device` (config.scan_impl):
    whether it runs as one compiled graph, the chunked scan's chunk, and the scan's kernel ("triton"
    or "chunked"). "compiled" compiles everywhere; "auto" on CUDA when T > scan_chunk (training,
    prefill), never for decoding steps; "triton" (owai.models.key_scan_triton's kernel) on CUDA, where
    the elementwise work around the kernel then fuses; "chunked" never. Inside an outer torch.compile
    (compiled blocks) nothing compiles on its own: the plain function is traced into the outer graph.

    A compiled chunked scan uses a chunk of at least ceil(sqrt(T)), so the chunk ends need one level of
    recursion and no more: torch 2.13's inductor miscompiles the scan at three levels (forward and
    gradients wrong, on CPU; tests/test_memory_mosaics_v2.py), and the wider chunk is also the
    fastest compiled one."""
    impl = config.scan_impl
    inside = torch.compiler.is_compiling()
    if impl == "triton":  # one custom op (opaque inside a compiled graph), forward and backward
        from owai.models import key_scan_triton

        key_scan_triton.require(device)
        return device.type == "cuda" and not inside, config.scan_chunk, "triton"
    compiled = inside or impl == "compiled" or (impl == "auto" and device.type == "cuda" and T > config.scan_chunk)
    if not compiled:
        return False, config.scan_chunk, "chunked"
    return not inside, max(config.scan_chunk, math.isqrt(max(T - 1, 0)) + 1), "chunked"  # ceil(sqrt(T)): n <= chunk


def uses_flex(config: MemoryMosaicsV2Config, device: torch.device, past: int) -> bool:
    """Whether memory reads from position 0 (training, evaluation, prefill) go through flex_attention:
    attn_impl "flex", or "auto" on CUDA. Cached steps (past > 0) read through SDPA either way."""
    impl = config.attn_impl
    return past == 0 and (impl == "flex" or (impl == "auto" and device.type == "cuda"))


def flex_block_mask(doc_start: torch.Tensor | None, B: int, T: int, lo_lag: int, hi_lag: int | None,
                    device: torch.device) -> Any:
    """flex_attention's BlockMask for T queries and T keys at positions 0..T-1: query t reads key j iff
    lo_lag <= t - j (<= hi_lag) and j >= ds_t (doc_start (B, T), None: 0).

    Built from per-block bounds ((T/128)^2 per row, no T x T mask): a (query block, key block) pair is
    skipped when no pair in it can be readable, read unmasked when every pair is, masked otherwise.
    lo/hi/ds enter the mask_mod as tensors, so a new delay or new documents do not recompile."""
    from torch.nn.attention.flex_attention import BlockMask

    blk = FLEX_BLOCK
    n = -(-T // blk)
    ds = torch.zeros(B, T, dtype=torch.long, device=device) if doc_start is None else doc_start.to(device, torch.long)
    ds = torch.cat([ds, ds[:, -1:].expand(B, n * blk - T)], dim=1)  # (B, n*blk): mask_mod may index past T
    first = torch.arange(n, device=device) * blk  # (n,) first position of each block
    last = (first + blk).clamp(max=T) - 1  # (n,)
    min_lag = first[:, None] - last[None, :]  # (n, n) query block x key block
    max_lag = last[:, None] - first[None, :]
    hi = T if hi_lag is None else hi_lag  # no lag reaches T
    ds_blocks = ds.view(B, n, blk)
    ds_lo, ds_hi = ds_blocks.amin(-1)[:, :, None], ds_blocks.amax(-1)[:, :, None]  # (B, n, 1) per query block
    some = (max_lag >= lo_lag) & (min_lag <= hi) & (last[None, None, :] >= ds_lo)  # (B, n, n) some pair may read
    whole = last - first + 1 == blk
    every = (min_lag >= lo_lag) & (max_lag <= hi) & (first[None, None, :] >= ds_hi) & whole[:, None] & whole[None, :]
    partial = some & ~every

    def to_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = sel.sum(-1, dtype=torch.int32)[:, None]  # (B, 1, n)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]  # selected first
        return counts.contiguous(), order.contiguous()  # (B, 1, n), (B, 1, n, n)

    lo_t, hi_t = torch.tensor(lo_lag, device=device), torch.tensor(hi, device=device)

    def readable(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lag = q - kv
        return (lag >= lo_t) & (lag <= hi_t) & (kv >= ds[b, q])

    kv_n, kv_i = to_blocks(partial)
    full_n, full_i = to_blocks(every)
    return BlockMask.from_kv_blocks(kv_n, kv_i, full_n, full_i, BLOCK_SIZE=blk, mask_mod=readable, seq_lengths=(T, T))


def flex_masks(config: MemoryMosaicsV2Config, doc_start: torch.Tensor | None, B: int, T: int, delay: int,
               device: torch.device) -> dict[str, Any]:
    """The block masks of one forward from position 0, shared by all layers: the short-term memory's
    window always, the long-term memory's only with documents (without them its read is one causal
    SDPA on delay-shifted tensors, flash kernels)."""
    masks = {"short": flex_block_mask(doc_start, B, T, 1, config.short_span, device)}
    if doc_start is not None and config.long_term_memory:
        masks["long"] = flex_block_mask(doc_start, B, T, config.long_lag(delay), None, device)
    return masks


def _flex_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """flex_attention(q, keys, values) (B, H, T, hs; values T-1 rows), one dtype, scale 1 (the bandwidth
    is in q); a row with nothing readable gives 0. Compiled (once per process) unless already inside torch.compile."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention as flex
    else:
        flex = _compiled("flex")
    # the newest key's value needs the next token (values has one row fewer); that key is never
    # readable (lag >= 1), but flex_attention wants equal lengths: a zero row
    values = F.pad(values, (0, 0, 0, keys.shape[2] - values.shape[2]))
    return flex(q, keys, values, block_mask=block_mask, scale=1.0)


def _bandwidth_counts(t: torch.Tensor, doc_start: torch.Tensor, lo_lag: int, hi_lag: int | None) -> torch.Tensor:
    """n_t = |{j : ds_t <= j, lo_lag <= t - j, (t - j <= hi_lag)}| for absolute query positions t (B|1, T)."""
    newest = t - lo_lag  # largest readable j
    oldest = doc_start if hi_lag is None else torch.maximum(doc_start, t - hi_lag)
    return (newest - oldest + 1).clamp(min=0)


def bandwidth_parameters(beta1_log: torch.Tensor, alpha_raw: torch.Tensor,
                         beta0_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(beta1, alpha, beta0) (H,) fp32 of the bandwidth beta1 n^alpha + beta0, from the memory's raw
    parameters: beta1 = exp(beta1_log) > 0, alpha = sigmoid(alpha_raw) in (0, 1), beta0 = softplus(beta0_raw) > 0."""
    return beta1_log.float().exp(), torch.sigmoid(alpha_raw.float()), F.softplus(beta0_raw.float())


def bandwidth_of(n: torch.Tensor, beta1_log: torch.Tensor, alpha_raw: torch.Tensor, beta0_raw: torch.Tensor) -> torch.Tensor:
    """beta = beta1 n^alpha + beta0 for counts n (B|1, T) -> (B|1, H, T) fp32 (n clamped to >= 1);
    a decoding step (`decode_step`) takes the same parameters with log n."""
    n = n.clamp(min=1).float()[:, None, :]  # (B, 1, T)
    beta1, alpha, beta0 = (p[None, :, None] for p in bandwidth_parameters(beta1_log, alpha_raw, beta0_raw))
    return beta1 * n.pow(alpha) + beta0


# ---------------------------------------------------------------------------------------------
# modules


def read_rows(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A read y (B, H', T, hs) as o_proj's input rows (B, T, H' hs), for a memory's inputs x (B, T, d)
    (H' = H, or a multiple for reads of several memories stacked along the heads). Under autocast
    o_proj computes in the autocast dtype, which a CUDA read already has: y goes in as it is, with no
    float32 round trip of (B, T, d) forward and backward. Without autocast it computes in the
    weights' dtype (x's)."""
    y = y.transpose(1, 2).reshape(*x.shape[:-1], -1)
    return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)


class ContextualMemory(nn.Module):
    """H contextual associative memories of one kind (short- or long-term), with their own extractors."""

    def __init__(self, config: MemoryMosaicsV2Config, kind: str) -> None:
        super().__init__()
        self.config, self.kind = config, kind
        d, H = config.n_embd, config.n_head
        self.key_proj = nn.Linear(d, d, bias=False)  # W_phi
        self.gate_proj = nn.Linear(d, H, bias=False)  # W_g: log g per head
        self.decay_proj = nn.Linear(d, H, bias=False)  # W_lambda: log lambda = -|W_lambda x|
        self.value_proj = nn.Linear(d, d, bias=False)  # W_psi
        self.value_mix = nn.Parameter(torch.empty(H))  # gamma
        self.beta1_log = nn.Parameter(torch.empty(H))  # beta1 = exp(.)
        self.beta0_raw = nn.Parameter(torch.empty(H))  # beta0 = softplus(.)
        self.alpha_raw = nn.Parameter(torch.empty(H))  # alpha = sigmoid(.)
        self.o_proj = nn.Linear(d, d, bias=False)

    def read_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype memory reads (and the generation cache) run in: on CUDA the autocast dtype, else
        the weights' (bf16 evaluation: flash/flex kernels, half the cache); on CPU float32 or wider."""
        weight = self.o_proj.weight.dtype
        if device.type != "cuda":
            return torch.promote_types(weight, torch.float32)
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight

    def lags(self, delay: int) -> tuple[int, int | None]:
        """(smallest, largest or None) lag t - j this memory stores."""
        cfg = self.config
        return (1, cfg.short_span) if self.kind == "short" else (cfg.long_lag(delay), None)

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None, delay: int, cache: dict | None, past: int,
                masks: dict[str, Any] | None = None) -> torch.Tensor:
        """x (B, T, d) at absolute positions past..past+T-1 -> y (B, T, d).

        masks: `flex_masks` of this forward (built once, shared by the layers), or None (SDPA).

        cache (per layer and kind, updated in place) holds for earlier positions: keys (B, H, >= N, hs)
        whose first N = keys_rows rows are the keys at absolute positions k0..k0+N-1, values (B, H, >=
        N-1, hs) likewise (values_rows = N-1: the newest key's value needs the next token), v_pending
        (B, H, hs) raw value of position past-1, scan (direction, log-scale), k0.
        """
        cfg = self.config
        T = x.shape[1]
        if T == 1 and doc_start is None and cache and "scan" in cache and not torch.is_grad_enabled():
            return self._decode(x, cache, past, delay)
        compile_, chunk, kernel = memory_inputs_plan(cfg, x.device, T)
        t = torch.arange(past, past + T, device=x.device)[None]  # (1, T) absolute query positions
        counts = _bandwidth_counts(t, doc_start if doc_start is not None else torch.zeros_like(t), *self.lags(delay))
        # masks: the reads go through flex (uses_flex), for both memories alike, so one graph serves both
        inputs = (*self.projections(x), cache["v_pending"] if cache else None, doc_start, past, cache.get("scan") if cache else None,
                  chunk, kernel, self.value_mix, self.beta1_log, self.alpha_raw, self.beta0_raw, counts,
                  cfg.norm_eps, self.read_dtype(x.device), masks is not None)
        queries, keys, finished, scan_state, v_last = _run_compiled("inputs", memory_inputs, inputs, compile_)
        if cache is not None:
            k0 = cache.get("k0", past)
            keys_all, values_all = _append(cache, "keys", keys), _append(cache, "values", finished)
            if self.kind == "short":  # future queries t >= past+T read j >= past+T-span: drop older pairs
                keep = max(0, (past + T - cfg.short_span) - k0)
                cache.update(keys=cache["keys"][:, :, keep:], values=cache["values"][:, :, keep:], k0=k0 + keep)
                cache["keys_rows"] -= keep
                cache["values_rows"] = max(0, cache["values_rows"] - keep)
            else:
                cache["k0"] = k0
            cache.update(v_pending=v_last, scan=scan_state)
        else:
            keys_all, values_all, k0 = keys, finished, past
        block_mask = masks.get(self.kind) if masks is not None and past == 0 and k0 == 0 else None
        y = self.read(queries, keys_all, values_all, k0, past, doc_start, delay, block_mask)  # (B, H, T, hs)
        return self.output(y, x)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj of a read y (B, H, T, hs), for inputs x (B, T, d) (`read_rows`)."""
        return self.o_proj(read_rows(y, x))

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """W_phi x, W_g x, W_lambda x, W_psi x ((B, T, d), (B, T, H), (B, T, H), (B, T, d)) as one matmul
        over the four weights stacked: x is read once (under autocast also cast, and saved for the
        backward, once rather than four times) and its gradient is one matmul, not four summed. A
        decoding step keeps four (`input_weights`): stacking would copy the weights at every token.
        (A StaticDecoder stacks a block's once, for all its steps.)"""
        d, H = self.config.n_embd, self.config.n_head
        weights, device = self.input_weights(), x.device.type
        if torch.is_autocast_enabled(device) and all(w.dtype == torch.float32 for w in weights):
            # autocast would cast the stacked float32 copy; cast each weight, so that the stacking writes
            # the low-precision copy itself (compiled, one pass over the weights instead of three)
            weights = [w.to(torch.get_autocast_dtype(device)) for w in weights]
        stacked = torch.cat(weights)
        key, gate, decay, value = F.linear(x, stacked).split([d, H, H, d], dim=-1)
        # the narrow gate and decay as their own tensors: a view saved for the backward (|decay| keeps
        # its input) would keep the whole (B, T, 2d + 2H) output alive
        return key, gate.contiguous(), decay.contiguous(), value

    def _decode(self, x: torch.Tensor, cache: dict, past: int, delay: int) -> torch.Tensor:
        """One cached decoding step (T = 1, one document per row, no autograd): the projections with
        `decode_step`'s fused arithmetic (`decode_step_on_input`, compiled where the scan is,
        config.scan_impl), the cache's append, one SDPA over the readable pairs. Same function as the
        general path of `forward` (tested)."""
        cfg = self.config
        lo, hi = self.lags(delay)
        k0 = cache.get("k0", past)
        first, newest = (0 if hi is None else max(0, past - hi)), past - lo  # readable absolute positions
        count = max(1, newest - first + 1)
        if cache.get("count") != count:  # the short-term memory's count stops changing once its window is full
            cache.update(count=count, log_count=torch.tensor(math.log(count), dtype=torch.float32, device=x.device))
        inputs = (x, *self.input_weights(), *self._decode_parameters(), cache["scan"][0], cache["scan"][1],
                  cache["v_pending"], cache["log_count"], cfg.norm_eps, self.read_dtype(x.device))
        query, key, value, scan_dir, scan_log, raw_v = _run_compiled("decode-input", decode_step_on_input, inputs,
                                                                     _compiles_scan(cfg, x.device))
        keys, values = _append(cache, "keys", key), _append(cache, "values", value)
        if self.kind == "short":  # future queries t >= past+1 read j >= past+1-span: drop older pairs
            keep = max(0, (past + 1 - cfg.short_span) - k0)
            cache.update(keys=cache["keys"][:, :, keep:], values=cache["values"][:, :, keep:], k0=k0 + keep)
            cache["keys_rows"] -= keep
            cache["values_rows"] = max(0, cache["values_rows"] - keep)
        else:
            cache["k0"] = k0
        cache.update(v_pending=raw_v, scan=(scan_dir, scan_log))
        lo_index, hi_index = max(0, first - k0), min(values.shape[2], newest + 1 - k0)  # [lo_index, hi_index) of the stored pairs
        if hi_index <= lo_index:
            y = query.new_zeros(query.shape)
        else:
            y = F.scaled_dot_product_attention(query, keys[:, :, lo_index:hi_index], values[:, :, lo_index:hi_index], scale=1.0)
        return self.output(y, x)

    def input_weights(self) -> list[torch.Tensor]:
        """W_phi, W_g, W_lambda, W_psi, in the order every path applies them: stacked per call in
        training and prefill (`projections`), as four matmuls on one row in a dynamic decoding step
        (no copy of the weights), stacked once per block by a StaticDecoder."""
        return [self.key_proj.weight, self.gate_proj.weight, self.decay_proj.weight, self.value_proj.weight]

    def _decode_parameters(self) -> tuple[torch.Tensor, ...]:
        """The per-head parameters `decode_step` takes after the projections."""
        return self.value_mix, self.beta1_log, self.alpha_raw, self.beta0_raw

    def readable_span(self, t: torch.Tensor, delay: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, last): the positions [first, last] this memory reads at position t (0-d tensors)."""
        lo, hi = self.lags(delay)
        return torch.zeros_like(t) if hi is None else (t - hi).clamp(min=0), t - lo

    def static_readable(self, slot_pos: torch.Tensor, t: torch.Tensor, delay: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask (S,), any readable (0-d)): which of a StaticDecoder's S slots this memory reads at
        position t (0-d), as SDPA's additive mask in the read dtype (0 readable, -inf not: what SDPA
        makes of a boolean mask). slot_pos (S,): the position whose key (and, once the next token is
        known, value) a slot holds, -1 for none. The same for every block, so the decoder computes it
        once per step and memory kind, not each block."""
        first, last = self.readable_span(t, delay)
        readable = (slot_pos >= first) & (slot_pos <= last)  # empty slots hold -1
        mask = torch.zeros(readable.shape, dtype=self.read_dtype(t.device), device=t.device)
        return mask.masked_fill(~readable, float("-inf")), readable.any()

    def decode_static(self, projected: tuple[torch.Tensor, ...], state: dict, delay: int,
                      readable: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`_decode` on a StaticDecoder's buffers, for a position's projections (`input_weights` applied):
        the read y (B, H, 1, hs), 0 where nothing is readable, before o_proj (the block applies its
        memories' o_proj as one matmul). No shape, index or Python number depends on the position,
        which is the 0-d tensor state["t"], so the step can be captured as a CUDA graph.

        state: keys, values (B, H, S, hs) with S slots (the long-term memory: one per position; the
        short-term memory: a ring of span + 1), the scan state and pending raw value. readable: this
        step's `static_readable` for those slots, whose positions the decoder writes."""
        t = state["t"]
        slots = state["keys"].shape[2]
        first, last = self.readable_span(t, delay)
        log_count = (last - first + 1).clamp(min=1).float().log()  # of the bandwidth's n (the mask's count)
        inputs = (*projected, *self._decode_parameters(), state["scan_dir"], state["scan_log"], state["v_pending"],
                  log_count, self.config.norm_eps, self.read_dtype(t.device))
        # compiled on its own only where the block is not (a failed compile of static_block)
        query, key, value, scan_dir, scan_log, raw_v = _run_compiled("decode", decode_step, inputs,
                                                                     _compiles_scan(self.config, t.device))
        key_slot, value_slot = (t % slots).view(1), ((t - 1) % slots).view(1)  # position t's key, t-1's finished value
        state["keys"].index_copy_(2, key_slot, key)
        state["values"].index_copy_(2, value_slot, value)
        state["scan_dir"].copy_(scan_dir)
        state["scan_log"].copy_(scan_log)
        state["v_pending"].copy_(raw_v)
        mask, any_readable = readable
        y = F.scaled_dot_product_attention(query, state["keys"], state["values"], attn_mask=mask.view(1, 1, 1, slots),
                                           scale=1.0)
        return torch.where(any_readable, y, 0.0)  # nothing readable: 0 (the masked softmax gave NaN)

    def read(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k0: int, past: int,
             doc_start: torch.Tensor | None, delay: int, block_mask: Any = None) -> torch.Tensor:
        """Memory read for queries q (B, H, T, hs), the bandwidth applied (`memory_inputs`), at absolute
        positions past..past+T-1 over keys/values at k0.. .

        block_mask (this memory's `flex_block_mask`, reads from position 0 only): one flex_attention
        call; otherwise SDPA as below, same function. All three in one dtype (`read_dtype`)."""
        B, H, T, hs = q.shape
        lo, hi = self.lags(delay)
        device = q.device
        t = torch.arange(past, past + T, device=device)[None]  # (1, T)
        ds = doc_start if doc_start is not None else torch.zeros_like(t)
        if block_mask is not None:
            return _flex_read(q, keys, values, block_mask)
        # Compiled (train.compile's blocks), the long-term delay is symbolic from its second value on.
        # Inductor then saved the delay-shifted operands of SDPA for the backward with the strides of the
        # delay it compiled at, and the next delay failed its stride assertion (torch 2.11 and 2.13, in
        # docs/results.md): compiled, no key range or slice depends on the delay but the causal one's,
        # whose operands are made contiguous (their strides then follow their symbolic size)
        compiling = torch.compiler.is_compiling()
        if doc_start is None and hi is None and past == 0 and k0 == 0 and T > lo:
            # one causal SDPA on delay-shifted tensors (flash kernels, O(T) memory): query row
            # i <-> t = i + lo sees keys j <= i
            shifted = (q[:, :, lo:], keys[:, :, : T - lo], values[:, :, : T - lo])
            if compiling:
                shifted = tuple(z.contiguous() for z in shifted)
            y = F.scaled_dot_product_attention(*shifted, is_causal=True, scale=1.0)
            return torch.cat([y.new_zeros(B, H, lo, hs), y], dim=2)
        n_values = values.shape[2]
        if T == 1 and doc_start is None:  # a decoding step: every stored pair in [first, last) is readable
            first, last = 0 if hi is None else max(0, past - hi - k0), min(n_values, past + 1 - lo - k0)
            if last <= first:
                return q.new_zeros(B, H, 1, hs)
            return F.scaled_dot_product_attention(q, keys[:, :, first:last], values[:, :, first:last], scale=1.0)
        outs = []
        for a in range(0, T, self.config.query_block):
            b = min(a + self.config.query_block, T)
            tq = t[:, a:b]  # (1, q)
            # the key index range this block can see (compiled: up to lag 1, the mask tests lag >= lo)
            first = 0 if hi is None else max(0, past + a - hi - k0)
            last = min(n_values, past + b - (1 if compiling else lo) - k0)  # exclusive
            if last <= first:
                outs.append(q.new_zeros(B, H, b - a, hs))
                continue
            j = torch.arange(k0 + first, k0 + last, device=device)[None, None, :]  # (1, 1, K)
            lag = tq[..., None] - j  # (1, q, K)
            allowed = (lag >= lo) & (j >= ds[:, a:b, None])  # (B|1, q, K)
            if hi is not None:
                allowed = allowed & (lag <= hi)
            empty = ~allowed.any(dim=-1, keepdim=True)  # (B|1, q, 1)
            allowed = allowed | (empty & (j == j[..., :1]))  # a row with nothing readable: one dummy key, zeroed below
            y = F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, first:last], values[:, :, first:last],
                                               attn_mask=allowed[:, None], scale=1.0)
            outs.append(y.masked_fill(empty[:, None], 0.0))
        return torch.cat(outs, dim=2)


class SwiGLU(nn.Module):
    """Persistent memory: W_down(silu(W_gate x) * W_up x) (Shazeer 2020)."""

    def __init__(self, config: MemoryMosaicsV2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MemoryMosaicsV2Block(nn.Module):
    """x += short(norm x) + long(norm x);  x += SwiGLU(norm x)."""

    def __init__(self, config: MemoryMosaicsV2Config) -> None:
        super().__init__()
        self.config = config
        self.memory_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.short = ContextualMemory(config, "short")
        self.long = ContextualMemory(config, "long") if config.long_term_memory else None
        self.ffn_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.ffn = SwiGLU(config)

    def memories(self) -> dict[str, ContextualMemory]:
        """The block's memories by kind: the short-term one, and the long-term one where it runs."""
        long = {"long": self.long} if self.long is not None and self.config.long_term_memory else {}
        return {"short": self.short} | long

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None, delay: int, cache: dict | None, past: int,
                masks: dict[str, Any] | None = None) -> torch.Tensor:
        h = self.memory_norm(x)
        if masks is None and uses_flex(self.config, x.device, past):
            masks = flex_masks(self.config, doc_start, x.shape[0], x.shape[1], delay, x.device)
        x = x + sum(memory(h, doc_start, delay, cache.setdefault(kind, {}) if cache is not None else None, past, masks)
                    for kind, memory in self.memories().items())
        return x + self.ffn(self.ffn_norm(x))

    def decode_static(self, x: torch.Tensor, state: dict, delay: int, readable: dict) -> torch.Tensor:
        """`forward` for one decoding step x (B, 1, d) on a StaticDecoder's state: {kind: that memory's
        buffers (`ContextualMemory.decode_static`), "in_proj": the input projections of its memories
        stacked in `memories()` order, each's `input_weights()`, "o_proj": their o_proj weights side
        by side}; readable: {kind: that memory's `static_readable`}, shared by the blocks. The same
        function as `forward` with the dynamic cache (tested); each memory's four input matmuls and
        the memories' o_proj are one matmul each, since a decoding step's matmuls are short and its
        time goes in part to their launches."""
        h = self.memory_norm(x)
        memories = self.memories()
        sizes = [w.shape[0] for memory in memories.values() for w in memory.input_weights()]
        projected = F.linear(h, state["in_proj"]).split(sizes, dim=-1)
        reads = [memory.decode_static(projected[4 * i:4 * i + 4], state[kind], delay, readable[kind])
                 for i, (kind, memory) in enumerate(memories.items())]  # each (B, H, 1, hs)
        x = x + F.linear(read_rows(torch.cat(reads, dim=1), x), state["o_proj"])
        return x + self.ffn(self.ffn_norm(x))


# ---------------------------------------------------------------------------------------------
# generation cache


class MemoryMosaicsV2Cache(MemoryMosaicsCache):
    """Incremental-decoding state: per layer {"short": {...}, "long": {...}} (see ContextualMemory.forward)
    and each row's current document start. v1's cache (beam reordering, batch selection) over nested
    state; not a transformers Cache: built in `_prepare_cache_for_generation`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[dict[str, dict]] = []  # type: ignore[assignment]
        self.doc_start: torch.Tensor | None = None  # (B,) absolute
        self.capacity: int | None = None  # positions a StaticDecoder may hold (generate's max_length)
        self.decoder: StaticDecoder | None = None  # once decoding steps run on it, it holds the state

    def batch_size(self) -> int | None:
        """The rows the cache holds (None while it holds none)."""
        if self.doc_start is not None:
            return self.doc_start.shape[0]

        def rows(obj: Any) -> int | None:
            if isinstance(obj, torch.Tensor):
                return obj.shape[0] if obj.dim() else None
            values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
            return next((n for n in map(rows, values) if n is not None), None)

        return rows(self.layers)

    def _apply(self, fn) -> None:
        if self.decoder is not None:
            raise OwaiError("memory mosaics v2: a cache whose steps run on a StaticDecoder cannot be reordered or "
                            "resized (beam search: static_decoding is off)")

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):  # batch-first; a 0-d tensor (a decoding step's log count) has no batch
                return fn(obj) if obj.dim() else obj
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):  # the cache's layers are a list (of dicts)
                return type(obj)(walk(v) for v in obj)
            return obj

        for i, layer in enumerate(self.layers):  # a layer at a time, as StateCache._apply
            self.layers[i] = walk(layer)
        if self.doc_start is not None:
            self.doc_start = fn(self.doc_start)


class StaticDecoder:
    """Cached decoding steps (one token per row, one document per row, no autograd) on buffers
    allocated once, from a prefilled cache: each memory's pairs sit in fixed slots (the long-term
    memory one per position up to `capacity`, the short-term memory a ring of span + 1), reads are
    one SDPA over all slots with a mask computed from the position tensor, so every step is the same
    kernels on the same addresses. On CUDA each block of the step (`static_block`) is compiled and
    the step is captured once as a CUDA graph, then replayed: a step of the 2B model launches ~3,000 kernels and is
    launch-bound eagerly, and its eager kernels replayed as a graph still took twice the
    transformer's compiled, graphed step (docs/results.md). Each block's decoding matmuls are
    stacked once here, its memories' eight input projections into one weight and their two o_proj
    into another (`MemoryMosaicsV2Block.decode_static`): a copy of those weights, about a third of
    the model's, held while the decoder lives (a snapshot: weights changed afterwards are not seen).
    Every layer caches the same positions, so the slots' positions and each memory's mask over them
    are kept and computed once per step and memory kind (`static_readable_step`), not in each block.
    The same function as the dynamic cache's steps (ContextualMemory._decode; tested)."""

    def __init__(self, model: "MemoryMosaicsV2ForCausalLM", cache: MemoryMosaicsV2Cache, capacity: int) -> None:
        cfg = model.config
        self.model, self.position, self.capacity = model, cache.get_seq_length(), capacity
        if not 0 < self.position < capacity:
            raise OwaiError(f"memory mosaics v2: a static decoder needs a prefilled cache shorter than its capacity "
                            f"({self.position} positions, capacity {capacity})")
        device = model.lm_head.weight.device
        self.t = torch.tensor(self.position, device=device)  # the next position, advanced on the device by each step
        self.layers = []
        self.slot_pos: dict[str, torch.Tensor] = {}  # per memory kind, shared by the blocks (`_slots`)
        with torch.no_grad():
            for block, layer in zip(model.layers, cache.layers):
                memories = block.memories()
                state = {kind: self._slots(memory, layer[kind], capacity) for kind, memory in memories.items()}
                # the block's decoding matmuls stacked once (`MemoryMosaicsV2Block.decode_static`)
                state["in_proj"] = torch.cat([w for memory in memories.values() for w in memory.input_weights()])
                outs = [memory.o_proj.weight for memory in memories.values()]
                state["o_proj"] = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
                self.layers.append(state)
        self.ids = torch.zeros(self.layers[0]["short"]["keys"].shape[0], 1, dtype=torch.long, device=device)  # (B, 1)
        self.graph = self.logits = None
        self.compiled = _compiles_scan(cfg, device)
        if device.type == "cuda":
            self._capture()

    def _slots(self, memory: ContextualMemory, stored: dict, capacity: int) -> dict:
        """One memory's fixed-slot state from its dynamic cache entry."""
        keys, values = stored["keys"][:, :, :stored["keys_rows"]], stored["values"][:, :, :stored["values_rows"]]
        k0 = stored.get("k0", 0)
        B, H, n, hs = keys.shape
        # the long-term memory: one slot per position, rounded up to 64 (aligned rows for the SDPA
        # kernels' masks); the short-term memory: a ring holding positions t - span .. t
        slots = -(-capacity // 64) * 64 if memory.kind == "long" else memory.config.short_span + 1
        positions = torch.arange(k0, k0 + n, device=keys.device)
        index = positions % slots
        state = {"t": self.t, "keys": keys.new_zeros(B, H, slots, hs), "values": keys.new_zeros(B, H, slots, hs)}
        state["keys"][:, :, index] = keys
        state["values"][:, :, index[:values.shape[2]]] = values
        # the position each slot holds (-1: none): the same in every block, since every layer caches the
        # same positions, so one tensor per memory kind serves them all
        slot_pos = torch.full((slots,), -1, dtype=torch.long, device=keys.device)
        slot_pos[index] = positions
        shared = self.slot_pos.setdefault(memory.kind, slot_pos)
        if not torch.equal(shared, slot_pos):
            raise OwaiError(f"memory mosaics v2: the layers' caches hold different positions ({memory.kind}-term memory)")
        state.update(scan_dir=stored["scan"][0].clone(), scan_log=stored["scan"][1].clone(), v_pending=stored["v_pending"].clone())
        return state

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        """One position: the model's blocks on the static state at the evaluation delay, then t += 1.
        ids (B, 1) -> logits (B, 1, V). Each block runs `static_block`, compiled where the scan is
        compiled (config.scan_impl; auto on CUDA), so the captured step replays a few fused kernels
        per memory instead of dozens (the transformer's graphed step is compiled too). One graph
        serves every block, as compiled blocks do in training, so compiling costs one block's
        tracing, not the whole model's."""
        model = self.model
        delay = model.config.long_delay_eval
        readable = {}
        for kind, slot_pos in self.slot_pos.items():  # once per step for all blocks
            inputs = (model.layers[0].memories()[kind], slot_pos, self.t, delay)
            readable[kind] = _run_compiled("readable", static_readable_step, inputs, self.compiled)
        x = model.embed_tokens(ids)
        for block, state in zip(model.layers, self.layers):
            x = _run_compiled("static", static_block, (block, x, state, delay, readable), self.compiled)
        self.t.add_(1)
        return model.lm_head(model.norm(x))

    def _warm_up(self) -> None:
        """One step on the placeholder ids (compiling it, library workspaces), its effect on the
        state undone: the scan states, pending values and position are restored, and the key and value
        rows it wrote are the slots the first real step rewrites. Device-agnostic, so the CPU tests
        check what the capture relies on."""
        small = [(state[k], state[k].clone()) for layer in self.layers for state in layer.values() if isinstance(state, dict)
                 for k in ("scan_dir", "scan_log", "v_pending")] + [(self.t, self.t.clone())]
        self._step(self.ids)
        for tensor, saved in small:
            tensor.copy_(saved)

    def _capture(self) -> None:
        """Record the step as a CUDA graph: the warm-up on a side stream first, then the capture (which
        runs nothing)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._warm_up()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step(self.ids)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, V) of the next position given its tokens ids (B, 1)."""
        if self.position >= self.capacity:
            raise OwaiError(f"memory mosaics v2: generation ran past the static decoder's capacity ({self.capacity} positions)")
        self.position += 1
        if self.graph is None:
            return self._step(ids)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits.clone()


def static_readable_step(memory: ContextualMemory, slot_pos: torch.Tensor, t: torch.Tensor,
                         delay: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A StaticDecoder's slot bookkeeping for one memory kind at position t, shared by its blocks:
    position t's key slot recorded in slot_pos, then `ContextualMemory.static_readable`."""
    slot_pos.index_copy_(0, (t % slot_pos.shape[0]).view(1), t.view(1))
    return memory.static_readable(slot_pos, t, delay)


def static_block(block: "MemoryMosaicsV2Block", x: torch.Tensor, state: dict, delay: int, readable: dict) -> torch.Tensor:
    """One block of a StaticDecoder's step: x (B, 1, d) -> (B, 1, d) on the block's static state
    (`MemoryMosaicsV2Block.decode_static`) at the long-term delay `delay`, reading the slots `readable`
    marks. No shape, index or Python number depends on the position, and the stacked weights are
    arguments, so this compiles to one graph for every position and every block."""
    return block.decode_static(x, state, delay, readable)


@dataclass
class MemoryMosaicsV2Output(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the bag-of-k head's logits (B, T, V) when the model has one."""

    bag_logits: torch.FloatTensor | None = None


# ---------------------------------------------------------------------------------------------
# the causal LM


class MemoryMosaicsV2ForCausalLM(PreTrainedModel, GenerationMixin):
    """Memory Mosaics v2 LM: embedding, blocks, RMSNorm, untied head (+ optional bag-of-k head)."""

    config_class = MemoryMosaicsV2Config
    config: MemoryMosaicsV2Config
    main_input_name = "input_ids"
    _no_split_modules = ["MemoryMosaicsV2Block"]
    _is_stateful = True

    def __init__(self, config: MemoryMosaicsV2Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([MemoryMosaicsV2Block(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.bag_head = nn.Linear(config.n_embd, config.vocab_size, bias=False) if config.bag_of_k else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize, refused with a bag-of-k head when the size changes: that head is sized
        by the vocabulary too, and a resize that left it would train on, or fail to reload, tokens that
        no longer exist. (A call that keeps the size returns the embeddings, as HF callers expect.)"""
        size = self.config.vocab_size if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        if self.bag_head is not None and size != self.config.vocab_size:
            raise OwaiError("memory mosaics v2: resize_token_embeddings is not supported with a bag-of-k head "
                            "(bag_of_k > 0): its head has one row per token too")
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, *args, **kwargs)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Llama's init (N(0, 0.02) for every matrix, RMSNorm 1): the thesis moves the Llama baseline's
        hyper-parameters to v2 unchanged. Per head: gamma ~ U(0, 1), beta1, beta0, alpha from config."""
        cfg = self.config
        if isinstance(module, (nn.Linear, nn.Embedding)):
            hf_init.normal_(module.weight, mean=0.0, std=cfg.initializer_range)
        elif isinstance(module, RMSNorm):
            hf_init.ones_(module.weight)
        elif isinstance(module, ContextualMemory):
            hf_init.uniform_(module.value_mix, 0.0, 1.0)
            hf_init.constant_(module.beta1_log, math.log(cfg.beta1_init))
            hf_init.constant_(module.beta0_raw, math.log(math.expm1(cfg.beta0_init)))
            hf_init.constant_(module.alpha_raw, math.log(cfg.alpha_init / (1 - cfg.alpha_init)))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MemoryMosaicsV2Cache | None = None,
        use_cache: bool | None = None,
        long_delay: int | None = None,
        return_dict: bool | None = True,
        logits_to_keep: int = 0,
        past_key_values: MemoryMosaicsV2Cache | None = None,
        **kwargs: Any,
    ) -> MemoryMosaicsV2Output | tuple:
        """input_ids (B, T) -> logits (B, T, V) (the last `logits_to_keep` only, if given).

        position_ids (B, T): positions within each document (0 at a document start); None = one
        document per row (or, with an attention_mask, positions counted from each row's first
        unmasked token). long_delay: the long-term memory's delay m for this call; None = a draw from
        long_delay_train in training mode, long_delay_eval in eval mode. labels: HF convention
        (shifted inside, -100 ignored); with a bag-of-k head the loss is L_next + bag_weight L_bag.
        cache: as v1's (`past_key_values` is its older name; owai.models.hf_cache).
        """
        cfg = self.config
        refuse_unread_inputs("memory mosaics v2", input_ids, kwargs)
        cache = forward_cache(cache, past_key_values, use_cache, MemoryMosaicsV2Cache, MemoryMosaicsV2Cache,
                              "memory mosaics v2")
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None:
            if not cache.layers:
                cache.layers = [{} for _ in self.layers]
            elif cache.batch_size() not in (None, B):
                raise OwaiError(f"memory mosaics v2: batch size {B} differs from the cache's ({cache.batch_size()})")
        doc_start = self._doc_starts(B, T, past, position_ids, attention_mask, cache, input_ids.device)
        if long_delay is None:
            if self.training:
                lo, hi = cfg.long_delay_train
                long_delay = int(torch.randint(lo, hi + 1, ()).item())
            else:
                long_delay = cfg.long_delay_eval
        if long_delay < 1:
            raise OwaiError(f"memory mosaics v2: long_delay must be >= 1, got {long_delay}")

        decoder = self._static_decoder(cache, T, past, doc_start, long_delay, labels, input_ids.device)
        if decoder is not None:  # a decoding step on preallocated buffers (CUDA: a graph replay)
            logits, bag_logits = decoder.step(input_ids), None
            cache.seen_tokens = past + 1
        else:
            x = self.embed_tokens(input_ids)  # (B, T, d); no positions
            masks = flex_masks(cfg, doc_start, B, T, long_delay, x.device) if uses_flex(cfg, x.device, past) else None
            for i, block in enumerate(self.layers):
                x = block(x, doc_start, long_delay, cache.layers[i] if cache is not None else None, past, masks)
            x = self.norm(x)
            if cache is not None:
                cache.seen_tokens = past + T
                cache.doc_start = doc_start[:, -1] if doc_start is not None else None
            kept = x[:, -logits_to_keep:] if logits_to_keep else x
            logits = self.lm_head(kept)
            bag_logits = self.bag_head(kept) if self.bag_head is not None else None

        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
            if bag_logits is not None and not logits_to_keep:
                from owai.models.bag_of_k import bag_of_k_loss, bag_targets

                bags, valid = bag_targets(labels, cfg.bag_of_k, position_ids)
                loss = loss + cfg.bag_weight * bag_of_k_loss(bag_logits, bags, valid, cfg.bag_eta)
        out_cache = cache if use_cache else None
        if return_dict is False:
            return tuple(v for v in (loss, logits, out_cache) if v is not None)
        return with_cache(MemoryMosaicsV2Output, out_cache, loss=loss, logits=logits, bag_logits=bag_logits)

    def _static_decoder(self, cache: MemoryMosaicsV2Cache | None, T: int, past: int, doc_start: torch.Tensor | None,
                        long_delay: int, labels: torch.Tensor | None, device: torch.device) -> StaticDecoder | None:
        """The cache's StaticDecoder for this call, built at the first eligible step: one new token per row
        after a prefill, one document per row, inference (no labels, no autograd, the evaluation delay),
        a capacity known (generate's max_length, greedy or sampling: no beams) and static_decoding on
        (auto: on CUDA). None: the general path."""
        if cache is None:
            return None
        eligible = (T == 1 and past > 0 and doc_start is None and labels is None and not torch.is_grad_enabled()
                    and long_delay == self.config.long_delay_eval)
        if cache.decoder is not None:
            if not eligible:
                raise OwaiError("memory mosaics v2: a cache whose steps run on a StaticDecoder takes one token per row "
                                "per call, without documents, labels or gradients")
            return cache.decoder
        mode = self.config.static_decoding
        if not (eligible and cache.capacity and (mode == "on" or (mode == "auto" and self._graphs_fit(device)))):
            return None
        try:
            cache.decoder = StaticDecoder(self, cache, cache.capacity)
        except Exception as err:  # noqa: BLE001 - capture and compiler errors vary by release
            if mode == "on" or isinstance(err, OwaiError):
                raise
            # the dynamic cache is untouched until a decoder exists: decode on it, and stop trying
            cache.capacity = None
            _COMPILED["graphs-failed"] = True
            import warnings

            warnings.warn(f"memory mosaics v2: a CUDA-graph decoding step could not be built ({one_line(err)}); "
                          "decoding without one", RuntimeWarning, stacklevel=2)
            return None
        for layer in cache.layers:  # the decoder holds the state from here on: free the dynamic buffers
            layer.clear()
        return cache.decoder

    def _graphs_fit(self, device: torch.device) -> bool:
        """static_decoding auto: on CUDA, for a model that is not sharded (FSDP's hooks gather weights
        with collectives, which a captured graph would replay on one rank only)."""
        if device.type != "cuda" or "graphs-failed" in _COMPILED:
            return False
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return False
        return not any(type(p).__name__ == "DTensor" for p in self.parameters())

    @staticmethod
    def _doc_starts(B: int, T: int, past: int, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    cache: MemoryMosaicsV2Cache | None, device: torch.device) -> torch.Tensor | None:
        """(B, T) absolute document start of each new position, or None (every row one document from 0)."""
        from_mask = None  # positions counted from each row's first unmasked token (left padding)
        if attention_mask is not None and not bool(attention_mask.all()):
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + T:
                raise OwaiError(f"memory mosaics v2: attention_mask must be (batch, {past + T}), got {tuple(attention_mask.shape)}")
            from_mask = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:].to(device)
        if position_ids is None:
            position_ids = from_mask
        if position_ids is not None:
            if position_ids.shape[-1] != T:
                raise OwaiError(f"memory mosaics v2: position_ids must have {T} columns, got {tuple(position_ids.shape)}")
            t = torch.arange(past, past + T, device=device)
            if bool((position_ids < 0).any()):
                raise OwaiError("memory mosaics v2: position_ids must count positions within documents (>= 0)")
            # a position larger than t (HF fills left padding with 1) starts at 0: padding reads padding only
            ds = (t - position_ids.to(device)).clamp(min=0).expand(B, T)
            if from_mask is not None and position_ids is not from_mask:  # the mask decides what is read, as in
                ds = torch.maximum(ds, (t - from_mask).clamp(min=0))  # HF's models: no position reads padding
            if not bool(ds.any()):  # one document per row from position 0: the fast paths apply
                return None
            return ds.contiguous()
        if cache is not None and cache.doc_start is not None:
            return cache.doc_start[:, None].expand(B, T).contiguous()
        return None

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """HF generate hook: our own cache instead of a DynamicCache; without beams, its capacity for a
        StaticDecoder is the generation's max_length."""
        own_generation_cache(generation_config, model_kwargs, MemoryMosaicsV2Cache, "memory mosaics v2")
        cache = model_kwargs.get(CACHE_FIELD)
        if isinstance(cache, MemoryMosaicsV2Cache) and cache.capacity is None and (generation_config.num_beams or 1) == 1:
            cache.capacity = generation_config.max_length

AutoConfig.register(MemoryMosaicsV2Config.model_type, MemoryMosaicsV2Config, exist_ok=True)
AutoModelForCausalLM.register(MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM, exist_ok=True)
