"""Memory Mosaics v1: the GPT2-like language model of thesis ch. 3 (§3.2, §3.4, §3.5, Fig 3.7).

A transformer with no positions and no W_q, where self-attention and the MLP are replaced by
associative memories (per head h, hs = C/H, x the LayerNorm-ed residual stream):

    contextual memory (one per head, H per block; replaces self-attention)
        k~_t = W_phi x_t               S_t = sum_{j<=t} exp(-beta_h (t-j)) k~_j     (leaky average)
        k_t  = S_t/|S_t| * exp(min(10 s_h, clamp))                                   (queries = keys)
        v~_t = W_psi x_t               vbar_t = c_h v~_t + (1-c_h) v~_{t+1},  v~_T = 0 (peeks ahead)
        v_t  = vbar_t/|vbar_t| * exp(10 u_h)
        y_t  = sum_{j<t} softmax_j(k_t . k_j) v_j ,   y_0 = 0                        (j = t excluded)
    persistent memory (replaces the MLP): own key extractor, query scale squared,
        y_t  = softmax(k_t . M_k^T) M_v * exp(10 u_h)  over P learned slots per head

then heads are concatenated and mixed by c_proj. beta_h = 10|p_h|; the "x10" reparameterisation of
every per-head scalar (p, s, u) is `config.scalar_scale`. Block (pre-LN):
x += CtxMem(LN1 x); x += PersistMem(LN2 x). Final LN, tied head, logits x 1/sqrt(C) ("library").

Design points (implementation spec §1, §7, §9):
- Memory is O(T): the leaky average is a chunked scan (L x L decay matrix per chunk plus a carried
  state, recursively over chunk ends, in fp32); no T x T tensor is built outside SDPA.
- Attention dropout (ic_dropout) off CUDA runs over query blocks of `dropout_block` rows, each
  recomputed in the backward pass (same RNG state, so the same mask): CPU SDPA with dropout_p > 0
  would build and keep T x T weights. Same distribution as dropout on the whole matrix.
- Key and value normalisation (x / (|x| + eps) * per-head scale) is one autograd node with a
  hand-written backward (`scaled_unit`), the value look-ahead one lerp: fewer elementwise passes.
- The diagonal is excluded with the one-position shift: SDPA(q = k[1:], k = k[:-1], v = v[:-1],
  causal). Works at any length: nothing is sized by a block size.
- Incremental decoding keeps a `MemoryMosaicsCache` (past keys, finished values, the newest raw
  value, which still needs the next token, and the two leaky states); HF `generate` uses it.
- Converters from the official checkpoints live in `owai.models.memory_mosaics_convert`.
- Importing this module registers model_type "owai_memory_mosaics" with AutoConfig and
  AutoModelForCausalLM, so `from_pretrained` needs no trust_remote_code.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.modeling_outputs import CausalLMOutputWithPast

from owai.errors import OwaiError
from owai.models.hf_cache import (CACHE_FIELD, StateCache, causal_lm_loss, forward_cache, own_generation_cache,
                                   refuse_unread_inputs, with_cache)

# ---------------------------------------------------------------------------------------------
# config


class MemoryMosaicsConfig(PreTrainedConfig):
    """Hyper-parameters; defaults are the thesis's BabiStories GPT2-small setting (123,588,336 params).

    init / logit_scale / key_clamp / key_scale_max_exp select between the two official codebases:
    "library" (Library/memory_mosaics, the paper runs) and "nano" (nanoMosaics).
    """

    model_type = "owai_memory_mosaics"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
    keys_to_ignore_at_inference = [CACHE_FIELD]

    vocab_size: int = 50304
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    pmem_size: int | None = None  # persistent slots per head; None -> int(3.5 * n_embd) (2688 for C=768)
    pmem_count: int = 1  # >1 averages several independent persistent memories (paper: 1)
    bias: bool = False  # biases in every Linear and LayerNorm
    ic_dropout: float = 0.05  # dropout on attention weights (contextual and persistent)
    # the contextual memory's own attention dropout; None = ic_dropout (Library regular). 0 is the
    # Library's eft model, which trained the thesis's BabiStories runs: its SDPA call has no dropout.
    contextual_dropout: float | None = None
    hd_dropout: float = 0.05  # residual (hidden) dropout after each c_proj
    pre_ln: bool = True  # False: post-LN blocks x = LN1 x; x += Ctx(x); x = LN2 x; x += Pmem(x)
    attn_only: bool = False  # drop the persistent memories (and ln_2)
    layer_norm_eps: float = 1e-5
    scalar_scale: float = 10.0  # per-head scalars are stored /10 and used x10 (a learning-rate trick)
    leaky_init: tuple[float, float] | list[float] = (0.5, 5.0)  # leaky rates beta_h: linspace over heads
    kernel_beta_init: float = 0.1  # stored s_h; key scale exp(10 s) = e at init
    value_scale_init: float = -0.05  # stored u_h; value/output scale exp(10 u) = 0.607 at init
    key_scale_max_exp: float = 5.0  # clamp on the key-scale exponent (Library 5; nano log(2^16-1))
    key_clamp: str = "library"  # "library": exp(pow*min(10s, max)); "nano": exp(min(pow*10s, max))
    norm_eps: float = 1e-10  # added to the L2 norms of keys and values (as nano; Library has none)
    logit_scale: str = "inv_sqrt_dim"  # "inv_sqrt_dim": logits / sqrt(C) (Library); "none" (nano)
    init: str = "library"  # "library": fan-in normal init; "nano": nanoGPT 0.02 init
    leaky_chunk: int = 16  # chunk length of the O(T) leaky-average scan (speed only; 16 was fastest on CPU)
    # Attention dropout off CUDA: queries in blocks of this many rows, each block recomputed in the
    # backward pass, so training memory stays O(T) (CPU SDPA with dropout builds T x T). 0: SDPA's own.
    dropout_block: int = 512
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.pmem_size is None and isinstance(self.n_embd, int):
            self.pmem_size = int(3.5 * self.n_embd)
        if isinstance(self.leaky_init, (list, tuple)):
            self.leaky_init = tuple(float(b) for b in self.leaky_init)
        self._check()

    def _check(self) -> None:
        """Raise OwaiError (one line) for impossible settings."""
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "pmem_size", "pmem_count", "leaky_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OwaiError(f"memory mosaics config: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise OwaiError(f"memory mosaics config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not isinstance(self.dropout_block, int) or isinstance(self.dropout_block, bool) or self.dropout_block < 0:
            raise OwaiError(f"memory mosaics config: dropout_block must be an integer >= 0, got {self.dropout_block!r}")
        if self.leaky_chunk < 2:
            raise OwaiError(f"memory mosaics config: leaky_chunk must be >= 2, got {self.leaky_chunk}")
        for name, allowed in (("init", ("library", "nano")), ("logit_scale", ("inv_sqrt_dim", "none")),
                              ("key_clamp", ("library", "nano"))):
            if getattr(self, name) not in allowed:
                raise OwaiError(f"memory mosaics config: {name}={getattr(self, name)!r}, expected one of {allowed}")
        for name in ("ic_dropout", "hd_dropout", "contextual_dropout"):
            if getattr(self, name) is not None and not 0.0 <= float(getattr(self, name)) < 1.0:
                raise OwaiError(f"memory mosaics config: {name} must be in [0, 1), got {getattr(self, name)}")
        if not (isinstance(self.leaky_init, tuple) and len(self.leaky_init) == 2 and min(self.leaky_init) >= 0):
            raise OwaiError(f"memory mosaics config: leaky_init must be two rates >= 0, got {self.leaky_init!r}")
        if self.scalar_scale <= 0 or self.norm_eps < 0 or self.layer_norm_eps < 0:
            raise OwaiError("memory mosaics config: scalar_scale must be > 0 and norm_eps, layer_norm_eps >= 0")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


# ---------------------------------------------------------------------------------------------
# the O(T) leaky average


def _decay_matrix(beta: torch.Tensor, length: int) -> torch.Tensor:
    """(H, L, L) lower-triangular exp(-beta_h (i - j)) for j <= i, 0 above the diagonal."""
    i = torch.arange(length, device=beta.device)
    lag = i[:, None] - i[None, :]  # (L, L)
    decay = torch.exp(-beta[:, None, None] * lag.clamp(min=0).to(beta.dtype))  # exponent <= 0: no overflow
    return decay * (lag >= 0).to(beta.dtype)


def _carry_weights(beta: torch.Tensor, length: int) -> torch.Tensor:
    """(H, L) exp(-beta_h (i + 1)): weight of the state entering a run of L steps at step i."""
    steps = torch.arange(1, length + 1, device=beta.device, dtype=beta.dtype)
    return torch.exp(-beta[:, None] * steps)


def leaky_average(
    x: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None = None, chunk: int = 64
) -> torch.Tensor:
    """Causal leaky sum S_t = sum_{j<=t} exp(-beta_h (t-j)) x_j  [+ exp(-beta_h (t+1)) state].

    x (B, H, T, D) (fp32 advised), beta (H,) >= 0, state (B, H, D) = S_{-1} from earlier tokens or
    None. Chunked scan: inside a chunk of `chunk` steps a dense (L x L) decay matrix, then the
    chunk-end sums obey the same recurrence with per-step decay exp(-beta L), solved recursively
    (depth log_L T). Memory O(B H T D + H L^2); never the overflowing rescaled cumsum.
    """
    B, H, T, D = x.shape
    if T <= chunk:  # one chunk: direct
        out = torch.einsum("hij,bhjd->bhid", _decay_matrix(beta, T), x)  # (B, H, T, D)
        if state is not None:
            out = out + _carry_weights(beta, T)[None, :, :, None] * state[:, :, None, :]
        return out
    n = -(-T // chunk)  # number of chunks
    pad = n * chunk - T
    xc = (F.pad(x, (0, 0, 0, pad)) if pad else x).reshape(B, H, n, chunk, D)  # zeros at the end: causal, harmless
    decay = _decay_matrix(beta, chunk)  # (H, L, L)
    # chunk-end sums with a zero entry state (the decay matrix's last row), then the true states at the
    # chunk ends: the same recurrence with per-step decay exp(-beta L)
    local_ends = torch.einsum("hj,bhcjd->bhcd", decay[:, -1], xc)  # (B, H, n, D)
    # n chunk ends: one dense (n x n) pass up to 64 of them (T <= 64 chunk), a recursion only beyond;
    # each recursion level is some twenty small ops, which cost more than their flops on a busy CPU
    ends = leaky_average(local_ends, beta * chunk, state, max(chunk, 64))  # (B, H, n, D)
    first = state[:, :, None] if state is not None else torch.zeros_like(ends[:, :, :1])
    entry = torch.cat([first, ends[:, :, :-1]], dim=2)  # (B, H, n, D) state entering each chunk
    # one product does the in-chunk sums and adds the entering state: the state is an extra input row
    # with weights exp(-beta (i + 1)) (fewer full-size passes than a separate multiply-add)
    rows = torch.cat([entry[:, :, :, None], xc], dim=3)  # (B, H, n, 1 + L, D)
    weights = torch.cat([_carry_weights(beta, chunk)[:, :, None], decay], dim=2)  # (H, L, 1 + L)
    out = torch.einsum("hij,bhcjd->bhcid", weights, rows).reshape(B, H, n * chunk, D)
    return out[:, :, :T] if pad else out


# ---------------------------------------------------------------------------------------------
# fused normalisation and blocked attention dropout


def _unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (|x| + eps), |x| the L2 norm over the last dim."""
    return x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + eps)


def _unit_adjoint(norm: torch.Tensor, xg: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of unit(x) = x / (n + eps) for an incoming g is g a - x b, per row, with
    a = 1 / (n + eps) and b = (x . g) / (n (n + eps)^2): (a, b) from n = |x| and x . g (both (..., 1)).
    A zero row (as the backwards' padding adds) passes g / eps on, as autograd's norm does, and 0
    where g is 0 too, whatever eps. One adjoint for v1's scaled unit and v2's values (v2's keys divide by
    max(|x|, eps): owai.models.memory_mosaics_v2._KeysAndQueries)."""
    d = (norm + eps).clamp_min(1e-30)
    return 1 / d, torch.where(norm > 0, xg / (norm * d * d), 0.0)


class _ScaledUnit(torch.autograd.Function):
    """y = x * s / (|x| + eps), |x| the L2 norm over the last dim, s broadcast against (..., 1).

    One autograd node with a hand-written backward: the generic graph (norm, add, div, mul, and their
    backward functions) makes several more full passes over x; this makes two forward (norm, scale)
    and two backward (one dot product, one fused multiply-add). Saves x and (..., 1) statistics.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        # Statistics in >= fp32 whatever autocast does (CUDA autocast computes norms in fp32 and
        # matmul-type ops in bf16, so x, scale and the incoming gradient can each arrive in another
        # dtype); the output takes the promoted input dtype, as the plain expression would.
        wide = _wide(x)
        norm = torch.linalg.vector_norm(wide, dim=-1, keepdim=True)  # (..., 1), >= fp32
        inv = 1.0 / (norm + eps)
        ctx.save_for_backward(x, scale, norm)
        ctx.eps = eps
        return _as(wide * (scale.to(wide.dtype) * inv), torch.promote_types(x.dtype, scale.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, scale, norm = ctx.saved_tensors
        wide = _wide(x)
        g = grad.to(wide.dtype)  # the gradient of the output, in whatever dtype autograd hands it
        s = scale.to(wide.dtype)
        dot = torch.linalg.vecdot(g, wide).unsqueeze(-1)  # (..., 1) <g, x>
        a, c = _unit_adjoint(norm, dot, ctx.eps)  # d/dx [x s / (n + eps)] g = s (g a - x c)
        grad_x = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.addcmul(g * (s * a), -s * c, wide).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_scale = dot * a  # (..., 1); reduced to scale's shape below
            dims = [i for i, (got, want) in enumerate(zip(grad_scale.shape, scale.shape)) if want == 1 and got != 1]
            grad_scale = (grad_scale.sum(dim=dims, keepdim=True) if dims else grad_scale).to(scale.dtype)
        return grad_x, grad_scale, None


def scaled_unit(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (|x| + eps) * scale over the last dim; scale (1, H, 1, 1) for x (B, H, T, D). Same values as
    the plain expression; one fused autograd node."""
    return _ScaledUnit.apply(x, scale.to(x.dtype), float(eps))


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None, p: float) -> torch.Tensor:
    """softmax(q k^T) with dropout p, times v; scale 1. offset None: no mask; else query row i sees
    key rows j <= i + offset."""
    scores = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    if offset is not None:
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        scores = scores.masked_fill(j > i + offset, float("-inf"))
    return F.dropout(scores.softmax(dim=-1), p, training=True) @ v


def blocked_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, block: int,
                              causal: bool, checkpoint: bool = True) -> torch.Tensor:
    """SDPA(q, k, v, scale=1, dropout_p=p) [causal: query i sees keys j <= i + Lk - Lq] in O(block x Lk)
    memory: queries in blocks of `block` rows, each block's weights dropped out independently (the same
    distribution as dropout on the whole matrix) and, with `checkpoint`, recomputed in the backward
    pass from the same RNG state instead of being kept. A causal block reads only its visible keys."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    outs = []
    for start in range(0, Lq, block):
        stop = min(start + block, Lq)
        offset = Lk - Lq + start  # row 0 of this block sees keys j <= offset
        visible = Lk if not causal else offset + (stop - start)
        args = (q[..., start:stop, :], k[..., :visible, :], v[..., :visible, :], offset if causal else None, p)
        if checkpoint and torch.is_grad_enabled() and Lq > block:  # one block: nothing to gain
            outs.append(torch.utils.checkpoint.checkpoint(_attention_block, *args, use_reentrant=False))
        else:
            outs.append(_attention_block(*args))
    return torch.cat(outs, dim=-2)


def _blocked_dropout(config: "MemoryMosaicsConfig", p: float, device: torch.device) -> bool:
    """Whether attention dropout p takes the blocked path: training with dropout, off CUDA (CUDA's
    fused SDPA kernels drop out without a T x T matrix), and not switched off."""
    return p > 0 and config.dropout_block > 0 and device.type != "cuda"


# ---------------------------------------------------------------------------------------------
# modules


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (the paper runs use weight only)."""

    def __init__(self, ndim: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp16/bf16 -> fp32; fp64 stays fp64) for scans and normalisations."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, with no `.to` at all where it has it already. Under torch.compile in torch 2.11 an
    autograd.Function's output made by a `.to` that changes nothing got a zero gradient, silently
    (2.13 is right; the lent GPU machines run 2.11): the Functions here and in Memory Mosaics v2
    return their outputs through this."""
    return x if x.dtype == dtype else x.to(dtype)


class LeakyKeyExtractor(nn.Module):
    """Keys: linear map, per-head leaky average, L2 normalisation, per-head bandwidth scale."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.config = config
        H = config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_phi
        self.leak = nn.Parameter(torch.empty(H))  # p_h: leaky rate beta_h = 10 |p_h|
        self.scale = nn.Parameter(torch.empty(H))  # s_h: key scale exp(10 s_h), clamped

    def forward(self, x: torch.Tensor, power: int, state: torch.Tensor | None = None):
        """x (B, T, C) -> keys (B, H, T, hs) in the projection dtype, new leaky state (B, H, hs) (>= fp32)."""
        cfg = self.config
        B, T, C = x.shape
        raw = self.proj(x).view(B, T, cfg.n_head, cfg.head_size).transpose(1, 2)  # (B, H, T, hs)
        wide = _wide(raw)
        beta = cfg.scalar_scale * self.leak.to(wide.dtype).abs()  # (H,)
        # the scan's einsums stay in fp32: CUDA autocast would run them in bf16
        with torch.autocast(wide.device.type, enabled=False):
            summed = leaky_average(wide, beta, state, cfg.leaky_chunk)  # (B, H, T, hs), >= fp32
        exponent = cfg.scalar_scale * self.scale.to(wide.dtype)  # (H,)
        if cfg.key_clamp == "library":  # clamp each side's exponent, then raise to `power`
            exponent = power * exponent.clamp(max=cfg.key_scale_max_exp)
        else:  # nano: clamp the whole exponent
            exponent = (power * exponent).clamp(max=cfg.key_scale_max_exp)
        keys = scaled_unit(summed, exponent.exp().view(1, -1, 1, 1), cfg.norm_eps)
        return keys.to(raw.dtype), summed[:, :, -1]


class LookAheadValueExtractor(nn.Module):
    """Values: v_t = normalise(c_h W_psi x_t + (1 - c_h) W_psi x_{t+1}) * exp(10 u_h)."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.config = config
        H = config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_psi
        self.mix = nn.Parameter(torch.empty(H))  # c_h, unconstrained
        self.scale = nn.Parameter(torch.empty(H))  # u_h: value scale exp(10 u_h)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> v~ = W_psi x as (B, H, T, hs)."""
        B, T, C = x.shape
        return self.proj(x).view(B, T, self.config.n_head, self.config.head_size).transpose(1, 2)

    def finish(self, raw: torch.Tensor) -> torch.Tensor:
        """raw v~ of n+1 consecutive positions (B, H, n+1, hs) -> finished values of the first n."""
        cfg = self.config
        now, ahead = _wide(raw[:, :, :-1]), _wide(raw[:, :, 1:])
        mixed = torch.lerp(ahead, now, self.mix.view(1, -1, 1, 1).to(now.dtype))  # c v~_t + (1-c) v~_{t+1}, one pass
        scale = (cfg.scalar_scale * self.scale.to(mixed.dtype)).exp().view(1, -1, 1, 1)
        return scaled_unit(mixed, scale, cfg.norm_eps).to(raw.dtype)


class ContextMemory(nn.Module):
    """H contextual associative memories (replaces causal self-attention)."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.config = config
        self.key = LeakyKeyExtractor(config)
        self.value = LookAheadValueExtractor(config)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True  # special init
        self.resid_dropout = nn.Dropout(config.hd_dropout)

    def forward(self, x: torch.Tensor, cache: dict | None = None, past: int = 0, want_row: bool = False):
        """x (B, T, C) at positions past..past+T-1 -> y (B, T, C); row (B, H, T) if want_row (past = 0).

        cache (per-layer dict, updated in place) holds, for the `past` earlier positions:
        keys (B, H, past, hs), values (B, H, past-1, hs), v_last (B, H, hs) = raw v~ of position
        past-1, key_state (B, H, hs) fp32.
        """
        B, T, C = x.shape
        H, hs = self.config.n_head, self.config.head_size
        keys, key_state = self.key(x, power=1, state=cache.get("key_state") if past else None)  # (B, H, T, hs)
        raw = self.value.raw(x)  # (B, H, T, hs)
        if past:  # the newest cached position gets its value now that x_past is known
            keys_all = torch.cat([cache["keys"], keys], dim=2)  # (B, H, past+T, hs)
            newly_finished = self.value.finish(torch.cat([cache["v_last"][:, :, None], raw], dim=2))  # past-1..
            values = torch.cat([cache["values"], newly_finished], dim=2)  # (B, H, past+T-1, hs)
        else:
            keys_all, values = keys, self.value.finish(raw)  # values (B, H, T-1, hs) for positions 0..T-2
        if cache is not None:
            cache.update(keys=keys_all, values=values, v_last=raw[:, :, -1], key_state=key_state)

        # query t attends keys j <= t-1. Shift: drop the last key, and query 0 when nothing is stored.
        first = 0 if past else 1
        queries, mem_keys = keys[:, :, first:], keys_all[:, :, :-1]  # (B, H, Lq, hs), (B, H, Lk, hs)
        Lq, Lk = queries.shape[2], mem_keys.shape[2]
        if Lq == 0:  # a lone first token: empty memory
            y = x.new_zeros(B, H, 0, hs)
        else:
            contextual = self.config.ic_dropout if self.config.contextual_dropout is None else self.config.contextual_dropout
            sdpa = dict(dropout_p=contextual if self.training else 0.0, scale=1.0)
            if _blocked_dropout(self.config, sdpa["dropout_p"], x.device):  # causal, bottom-right aligned
                y = blocked_dropout_attention(queries, mem_keys, values, sdpa["dropout_p"], self.config.dropout_block,
                                              causal=True)
            elif Lq == Lk:  # square: query i (position i+first) sees keys j <= i
                y = F.scaled_dot_product_attention(queries, mem_keys, values, is_causal=True, **sdpa)
            elif Lq == 1:  # one decoding step sees every stored pair
                y = F.scaled_dot_product_attention(queries, mem_keys, values, **sdpa)
            else:  # several new tokens after a cache: causal aligned to the bottom-right corner
                mask = causal_lower_right(Lq, Lk)
                y = F.scaled_dot_product_attention(queries, mem_keys, values, attn_mask=mask, **sdpa)
        if first:
            y = torch.cat([y.new_zeros(B, H, 1, hs), y], dim=2)  # position 0: exactly 0
        y = self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))

        row = None
        if want_row:  # softmax row of the last query over keys j < T-1, 0 at j = T-1
            scores = torch.einsum("bhd,bhjd->bhj", _wide(keys[:, :, -1]), _wide(keys[:, :, :-1]))
            row = F.pad(scores.softmax(dim=-1), (0, 1))  # (B, H, T)
        return y, row


class PersistentMemory(nn.Module):
    """H persistent associative memories with P learned (key, value) slots each (replaces the MLP)."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.config = config
        shape = (config.pmem_count, config.n_head, config.pmem_size, config.head_size)
        self.key = LeakyKeyExtractor(config)
        self.mem_k = nn.Parameter(torch.empty(shape))  # (count, H, P, hs)
        self.mem_v = nn.Parameter(torch.empty(shape))  # (count, H, P, hs)
        self.out_scale = nn.Parameter(torch.empty(config.n_head))  # u_h: output scale exp(10 u_h)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.resid_dropout = nn.Dropout(config.hd_dropout)

    def forward(self, x: torch.Tensor, cache: dict | None = None, past: int = 0) -> torch.Tensor:
        """x (B, T, C) -> y (B, T, C). cache holds pmem_state (B, H, hs) fp32."""
        cfg = self.config
        B, T, C = x.shape
        keys, state = self.key(x, power=2, state=cache.get("pmem_state") if past else None)  # (B, H, T, hs)
        if cache is not None:
            cache["pmem_state"] = state
        dropout = cfg.ic_dropout if self.training else 0.0
        # The slots are shared by the whole batch and there is no mask, so the batch folds into the
        # query length: one (B*T) x P attention per head, no slots copied per sequence (the
        # Library's expand to B) and no per-sequence slot gradients to reduce.
        H, hs = cfg.n_head, cfg.head_size
        queries = keys.transpose(0, 1).reshape(1, H, B * T, hs)  # (1, H, B*T, hs)
        y = 0.0
        for i in range(cfg.pmem_count):
            mk, mv = self.mem_k[i : i + 1].to(keys.dtype), self.mem_v[i : i + 1].to(keys.dtype)  # (1, H, P, hs)
            if _blocked_dropout(cfg, dropout, x.device):
                y = y + blocked_dropout_attention(queries, mk, mv, dropout, cfg.dropout_block, causal=False)
            else:
                y = y + F.scaled_dot_product_attention(queries, mk, mv, dropout_p=dropout, scale=1.0)  # (1, H, B*T, hs)
        wide = torch.promote_types(keys.dtype, torch.float32)
        scale = (cfg.scalar_scale * self.out_scale.to(wide)).exp().view(H, 1, 1, 1).to(keys.dtype)
        y = y.view(H, B, T, hs) / cfg.pmem_count * scale  # (H, B, T, hs)
        return self.resid_dropout(self.c_proj(y.permute(1, 2, 0, 3).reshape(B, T, C)))


class MemoryMosaicsBlock(nn.Module):
    """One block: a contextual memory layer then a persistent memory layer, each residual."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.pre_ln, self.attn_only = config.pre_ln, config.attn_only
        self.ln_1 = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps)
        self.ctx = ContextMemory(config)
        if not config.attn_only:
            self.ln_2 = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps)
            self.pmem = PersistentMemory(config)

    def forward(self, x: torch.Tensor, cache: dict | None = None, past: int = 0, want_row: bool = False):
        if self.pre_ln:
            y, row = self.ctx(self.ln_1(x), cache, past, want_row)
            x = x + y
            if not self.attn_only:
                x = x + self.pmem(self.ln_2(x), cache, past)
        else:
            x = self.ln_1(x)
            y, row = self.ctx(x, cache, past, want_row)
            x = x + y
            if not self.attn_only:
                x = self.ln_2(x)
                x = x + self.pmem(x, cache, past)
        return x, row


class MemoryMosaicsModel(nn.Module):
    """Token embedding (no positions), blocks, final LayerNorm."""

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([MemoryMosaicsBlock(config) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, config.bias, config.layer_norm_eps)


# ---------------------------------------------------------------------------------------------
# generation cache


class MemoryMosaicsCache(StateCache):
    """Incremental-decoding state, one dict per layer: keys, values, v_last, key_state (see
    ContextMemory.forward) and pmem_state (the persistent memory's leaky key sum).

    Keeps all past contextual keys/values (like a KV cache; O(T) memory) plus O(1) recurrent state:
    the newest raw value (its look-ahead needs the next token) and the two leaky key sums.
    Not a transformers `Cache`: the model builds it in `_prepare_cache_for_generation`.
    """


# ---------------------------------------------------------------------------------------------
# the causal LM


class MemoryMosaicsForCausalLM(PreTrainedModel, GenerationMixin):
    """Memory Mosaics v1 LM with a (tied) head. forward -> CausalLMOutputWithPast, logits (B, T, V) fp32."""

    config_class = MemoryMosaicsConfig
    config: MemoryMosaicsConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}
    _no_split_modules = ["MemoryMosaicsBlock"]
    _is_stateful = True  # the leaky states cannot be rolled back (no assisted decoding)

    def __init__(self, config: MemoryMosaicsConfig) -> None:
        super().__init__(config)
        self.model = MemoryMosaicsModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()  # init (`_init_weights`) and tie

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Spec §1.4. library: N(0, 1/fan_in) Linear, c_proj 1/sqrt(C L), tied embedding 1/sqrt(C).
        nano: 0.02, c_proj 0.02/sqrt(2L), embedding 0.02. Both: M_k, M_v ~ N(0, 1/hs), per-head scalars."""
        cfg = self.config
        nano = cfg.init == "nano"
        if isinstance(module, nn.Linear):
            if module is self.lm_head and cfg.tie_word_embeddings:
                return  # it is the embedding matrix: initialised there
            if getattr(module, "is_residual_proj", False):
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if nano else 1 / math.sqrt(module.in_features * cfg.n_layer)
            else:
                std = 0.02 if nano else 1 / math.sqrt(module.in_features)
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            # library: the reference inits the embedding with std 1, then the tied head's Linear init wins
            std = 0.02 if nano else (1 / math.sqrt(cfg.n_embd) if cfg.tie_word_embeddings else 1.0)
            hf_init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LayerNorm):
            hf_init.ones_(module.weight)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, LeakyKeyExtractor):
            lo, hi = cfg.leaky_init
            rates = torch.linspace(lo, hi, cfg.n_head, device=module.leak.device) / cfg.scalar_scale
            hf_init.copy_(module.leak, rates.to(module.leak.dtype))
            hf_init.constant_(module.scale, cfg.kernel_beta_init)
        elif isinstance(module, LookAheadValueExtractor):
            hf_init.uniform_(module.mix, 0.0, 1.0)
            hf_init.constant_(module.scale, cfg.value_scale_init)
        elif isinstance(module, PersistentMemory):
            std = 1 / math.sqrt(cfg.head_size)
            hf_init.normal_(module.mem_k, mean=0.0, std=std)
            hf_init.normal_(module.mem_v, mean=0.0, std=std)
            hf_init.constant_(module.out_scale, cfg.value_scale_init)

    # -- forward -------------------------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> logits (B, T, V), at least fp32. The Library's 1/sqrt(C) logit scale is
        applied to the (B, T, C) input of the head, the same product at a V/C smaller cost."""
        if self.config.logit_scale == "inv_sqrt_dim":
            x = x * (1.0 / math.sqrt(self.config.n_embd))
        return _wide(self.lm_head(x))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: MemoryMosaicsCache | None = None,
        use_cache: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = True,
        past_key_values: MemoryMosaicsCache | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, T) -> logits (B, T, V) for every position (the last `logits_to_keep` only, if
        given: what `generate` asks of a prompt, whose float32 (T, V) logits a long prompt would
        otherwise fill memory with); loss if labels (shifted inside, ignore_index -100). With a cache
        (`cache`, or its older name `past_key_values`), or use_cache=True, the input continues the
        cached sequence and the cache is updated in place and returned."""
        refuse_unread_inputs("memory mosaics", input_ids, kwargs)
        if logits_to_keep and labels is not None:
            raise OwaiError("memory mosaics: labels need every position's logits; drop logits_to_keep")
        if attention_mask is not None and not torch.compiler.is_compiling() and not bool(attention_mask.all()):
            raise OwaiError("memory mosaics: padded attention_mask is not supported, use batches of equal length")
        cache = forward_cache(cache, past_key_values, use_cache, MemoryMosaicsCache, MemoryMosaicsCache, "memory mosaics")
        past = 0
        if cache is not None:
            past = cache.get_seq_length()
            if not cache.layers:
                cache.layers = [{} for _ in self.model.h]
            elif past and cache.layers[0]["keys"].shape[0] != input_ids.shape[0]:
                raise OwaiError("memory mosaics: batch size differs from the cache's")

        x = self.model.wte(input_ids)  # (B, T, C); no position embedding
        for i, block in enumerate(self.model.h):
            x, _ = block(x, cache.layers[i] if cache is not None else None, past)
        x = self.model.ln_f(x)
        logits = self._logits(x[:, -logits_to_keep:] if logits_to_keep else x)  # (B, T, V)
        if cache is not None:
            cache.seen_tokens = past + input_ids.shape[1]

        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        out_cache = cache if use_cache else None
        if return_dict is False:
            return tuple(v for v in (loss, logits, out_cache) if v is not None)
        return with_cache(CausalLMOutputWithPast, out_cache, loss=loss, logits=logits)

    def leaky_lambdas(self) -> torch.Tensor:
        """(n_layer, H) leaky-average coefficients lambda = exp(-10 |p_h|) of the contextual keys
        (Fig B.7 relates each head's attention width to it)."""
        cfg = self.config
        return torch.stack([(-cfg.scalar_scale * b.ctx.key.leak.detach().float().abs()).exp() for b in self.model.h])

    @torch.no_grad()
    def last_token_attention(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """(n_layer, B, H, T): each contextual memory's attention weights of the LAST position over all
        positions (rows sum to 1 over j < T-1; 0 at j = T-1, the excluded diagonal). One row only."""
        x = self.model.wte(input_ids)
        rows = []
        for block in self.model.h:
            x, row = block(x, want_row=True)
            rows.append(row)
        return torch.stack(rows)  # (n_layer, B, H, T)

    # -- generation ----------------------------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """HF generate hook: give generation our own MemoryMosaicsCache instead of a DynamicCache."""
        own_generation_cache(generation_config, model_kwargs, MemoryMosaicsCache, "memory mosaics")


# register for AutoConfig / AutoModelForCausalLM (no trust_remote_code: `import owai.models.memory_mosaics`)
AutoConfig.register(MemoryMosaicsConfig.model_type, MemoryMosaicsConfig, exist_ok=True)
AutoModelForCausalLM.register(MemoryMosaicsConfig, MemoryMosaicsForCausalLM, exist_ok=True)
