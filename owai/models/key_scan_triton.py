"""Memory Mosaics v2's gated key scan (eq 4.4) as a Triton kernel, forward and backward: scan_impl "triton".

The recurrence kbar_t = g_t k~_t + lambda_t kbar_{t-1} (per head a scalar gate g and decay lambda, a
vector state) is kept as kbar_t = r_t exp(m_t) with

    m_t = max(log g_t, log lambda_t + m_{t-1})           (the largest term's log weight: max-plus)
    r_t = exp(log g_t - m_t) k~_t + exp(log lambda_t + m_{t-1} - m_t) r_{t-1}

so both coefficients are <= 1 and nothing overflows whatever the gates (the same log-space idea as
memory_mosaics_v2._log_space_scan, whose (c x c) matrices this replaces with a sequential loop).
A document start sets log lambda_t = -inf: nothing is carried over.

Chunked over time, so each program walks about sqrt(T) positions: (1) every chunk of c positions is
scanned from nothing and only its end kept; (2) the chunk ends are scanned with the chunk's summed
log decay (the same recurrence one level up); (3) every chunk is scanned again from its entering
state and every row stored. Grid (batch x heads, chunks); a program holds one head's whole vector.

Backward (exact, through (r, m)): with L~(kbar, m) = L(kbar e^-m, m) the gradient splits into
  - the adjoint of the linear recurrence, scaled as Ghat_t = e^{m_t} dL/dkbar_t:
      Ghat_t = dL/dr_t + b_{t+1} Ghat_{t+1},  b_t = exp(log lambda_t + m_{t-1} - m_t) <= 1,
    the same kernel run on reversed time (its log-scale stays 0);
  - the max-plus adjoint of m: Mbar_t = c_t + [lambda won at t+1] Mbar_{t+1}, c_t = dL/dm_t - <dL/dr_t, r_t>,
    the same kernel on a vector of size 1.

Without CUDA the kernel runs in Triton's interpreter (exact, slow): the CPU tests check it that way.
The interpreter must be chosen before triton is first imported (TRITON_INTERPRET=1); this module sets
it when it imports triton on a machine without CUDA.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

import torch

from owai.errors import OwaiError

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: Triton's interpreter

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MIN_CHUNK = 16


def available() -> bool:
    """Whether scan_impl "triton" can run here (triton importable)."""
    return triton is not None


def require(device: torch.device) -> None:
    """Raise OwaiError unless the Triton scan can run on `device`."""
    if triton is None:
        raise OwaiError("memory mosaics v2: scan_impl triton needs the triton package (pip install triton)")
    if device.type != "cuda" and not _interpreting():
        raise OwaiError("memory mosaics v2: scan_impl triton on the CPU runs in Triton's interpreter: "
                        "start with TRITON_INTERPRET=1")


def _interpreting() -> bool:
    """Whether the kernel was built for Triton's interpreter (decided when triton was first imported)."""
    return type(_scan_kernel).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _scan_kernel(K, LG, LD, S_DIR, S_LOG, R, M,
                     H, T, HS, C, NC,
                     sk_b, sk_h, sk_t, sg_b, sg_h, sg_t, sd_b, sd_h, sd_t,
                     HAS_STATE: tl.constexpr, STORE_ALL: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (row, head) and one chunk of positions [chunk*C, chunk*C + C): the recurrence from the
        chunk's entering state (S_DIR/S_LOG[bh, chunk], or nothing), every row stored (R (BH, T, HS),
        M (BH, T)) or only the chunk's end (R (BH, NC, HS), M (BH, NC)). Inputs any float dtype,
        arithmetic float32; K's last dimension contiguous."""
        bh = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        d = tl.arange(0, BLOCK_D)
        dmask = d < HS
        if HAS_STATE:
            r = tl.load(S_DIR + (bh * NC + chunk) * HS + d, mask=dmask, other=0.0).to(tl.float32)
            m = tl.load(S_LOG + bh * NC + chunk).to(tl.float32)
        else:
            r = tl.zeros([BLOCK_D], dtype=tl.float32)
            m = tl.full([], float("-inf"), tl.float32)
        t0 = chunk * C
        steps = tl.minimum(C, T - t0)
        k_ptr = K + b * sk_b + h * sk_h
        g_ptr = LG + b * sg_b + h * sg_h
        l_ptr = LD + b * sd_b + h * sd_h
        for i in range(steps):
            t = t0 + i
            own = tl.load(g_ptr + t * sg_t).to(tl.float32)  # log g_t
            carried = tl.load(l_ptr + t * sd_t).to(tl.float32) + m  # log lambda_t + m_{t-1}
            k = tl.load(k_ptr + t * sk_t + d, mask=dmask, other=0.0).to(tl.float32)
            top = tl.maximum(own, carried)
            r = tl.exp(own - top) * k + tl.exp(carried - top) * r
            m = top
            if STORE_ALL:
                tl.store(R + (bh * T + t) * HS + d, r, mask=dmask)
                tl.store(M + bh * T + t, m)
        if not STORE_ALL:
            tl.store(R + (bh * NC + chunk) * HS + d, r, mask=dmask)
            tl.store(M + bh * NC + chunk, m)


def block_size(head_size: int) -> int:
    """The kernel's vector width for a head size: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_size))


def num_warps(block: int) -> int:
    """Warps per program: one (row, head) vector of `block` floats needs few threads."""
    return 1 if block <= 64 else 2


def compile_options(block: int) -> dict[str, int | bool]:
    """The kernel's compile options. FP fusion (a * b + c as one rounded FMA) is asked for, not left
    to triton's default, which Triton 3.10 turns off: the recurrence's update is two such products,
    and inductor asks for fusion in the kernels it compiles around this one."""
    return {"num_warps": num_warps(block), "enable_fp_fusion": True}


def _launch(k: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, entering: tuple | None, chunk: int,
            store_all: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of `_scan_kernel` over chunks of `chunk` positions; entering = (dir (B, H, NC, HS),
    log (B, H, NC)) per chunk or None."""
    B, H, T, HS = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    n_chunks = -(-T // chunk)
    rows = n_chunks if not store_all else T
    R = torch.empty(B, H, rows, HS, dtype=torch.float32, device=k.device)
    M = torch.empty(B, H, rows, dtype=torch.float32, device=k.device)
    if entering is None:
        s_dir, s_log = R, M  # unused (HAS_STATE false)
    else:
        s_dir, s_log = entering[0].float().contiguous(), entering[1].float().contiguous()
    block = block_size(HS)
    _scan_kernel[(B * H, n_chunks)](
        k, log_gate, log_decay, s_dir, s_log, R, M, H, T, HS, chunk, n_chunks,
        k.stride(0), k.stride(1), k.stride(2), log_gate.stride(0), log_gate.stride(1), log_gate.stride(2),
        log_decay.stride(0), log_decay.stride(1), log_decay.stride(2),
        HAS_STATE=entering is not None, STORE_ALL=store_all, BLOCK_D=block, **compile_options(block))
    return R, M


def _scan(k: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, state_dir: torch.Tensor | None,
          state_log: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, m) of every position (module docstring), from the state (dir (B, H, HS), log (B, H)) or nothing."""
    B, H, T, _ = k.shape
    chunk = max(MIN_CHUNK, math.isqrt(max(T - 1, 0)) + 1)  # ceil(sqrt(T)): about as many chunks as positions per chunk
    state = None if state_dir is None else (state_dir[:, :, None], state_log[:, :, None])
    if T <= chunk:
        return _launch(k, log_gate, log_decay, state, T, True)
    ends, end_log = _launch(k, log_gate, log_decay, None, chunk, False)  # (B, H, NC, HS), (B, H, NC)
    n_chunks = ends.shape[2]
    pad = n_chunks * chunk - T
    chunk_decay = torch.nn.functional.pad(log_decay.float(), (0, pad)).view(B, H, n_chunks, chunk).sum(-1)  # -inf: a reset inside
    end_dir, end_m = _scan(ends, end_log, chunk_decay, state_dir, state_log)  # the recurrence at each chunk's end
    return _launch(k, log_gate, log_decay, _before(end_dir, end_m, state_dir, state_log), chunk, True)


def _before(rows: torch.Tensor, log_scale: torch.Tensor, state_dir: torch.Tensor | None,
            state_log: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence's value before each of N positions, (B, H, N, HS) and (B, H, N) float32: the
    entering state (nothing: zeros at log-scale -inf) at the first, then rows and log_scale shifted by one."""
    B, H, _, HS = rows.shape
    first_dir = rows.new_zeros(B, H, 1, HS) if state_dir is None else state_dir[:, :, None].float()
    first_log = log_scale.new_full((B, H, 1), float("-inf")) if state_log is None else state_log[:, :, None].float()
    return torch.cat([first_dir, rows[:, :, :-1]], dim=2), torch.cat([first_log, log_scale[:, :, :-1]], dim=2)


@torch.library.custom_op("owai::gated_key_scan", mutates_args=())
def gated_scan(k: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor, state_dir: Optional[torch.Tensor],
               state_log: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(r (B, H, T, HS), m (B, H, T)) float32 with kbar_t = r_t exp(m_t) (module docstring). k (B, H, T, HS)
    any float dtype; log_gate, log_decay (B, H, T) float32, log_decay -inf where a document starts;
    state (B, H, HS), (B, H) or None."""
    require(k.device)
    return _scan(k, log_gate, log_decay, state_dir, state_log)


@gated_scan.register_fake
def _(k, log_gate, log_decay, state_dir, state_log):
    B, H, T, HS = k.shape
    return k.new_empty(B, H, T, HS, dtype=torch.float32), k.new_empty(B, H, T, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    k, log_gate, log_decay, state_dir, state_log = inputs
    ctx.has_state = state_dir is not None
    ctx.save_for_backward(k, log_gate, log_decay, state_dir, state_log, *output)


def _reverse_scan(grad: torch.Tensor, log_coef: torch.Tensor) -> torch.Tensor:
    """x_t = grad_t + exp(log_coef_{t+1}) x_{t+1} for t = T-1..0 (log_coef <= 0): the scan on reversed time
    with log g = 0, whose log-scale stays 0."""
    B, H, T = log_coef.shape
    shifted = torch.cat([log_coef.new_full((B, H, 1), float("-inf")), log_coef[:, :, 1:].flip(2)], dim=2)
    rows, m = gated_scan(grad.flip(2), log_coef.new_zeros(B, H, T), shifted, None, None)
    return (rows * m.exp()[..., None]).flip(2)


def _backward(ctx, grad_rows: torch.Tensor | None, grad_log: torch.Tensor | None):
    k, log_gate, log_decay, state_dir, state_log, rows, m = ctx.saved_tensors
    grad_rows = torch.zeros_like(rows) if grad_rows is None else grad_rows.float()
    grad_log = torch.zeros_like(m) if grad_log is None else grad_log.float()
    rows_prev, m_prev = _before(rows, m, state_dir, state_log)
    own, carried = log_gate.float(), log_decay.float() + m_prev
    a, b = torch.exp(own - m), torch.exp(carried - m)  # each row's two coefficients, <= 1

    ghat = _reverse_scan(grad_rows, carried - m)  # e^{m_t} dL/dkbar_t
    d_k = (a[..., None] * ghat).to(k.dtype)
    d_gate = a * (ghat * k.float()).sum(-1)
    d_decay = b * (ghat * rows_prev).sum(-1)

    lam_won = carried > own  # where m_t = log lambda_t + m_{t-1}
    c = grad_log - (grad_rows * rows).sum(-1)  # dL/dm_t with kbar held
    mbar = _reverse_scan(c[..., None], torch.where(lam_won, 0.0, float("-inf")))[..., 0]
    d_gate = d_gate + torch.where(lam_won, 0.0, mbar)
    d_decay = d_decay + torch.where(lam_won, mbar, 0.0)
    d_dir = d_log = None
    if ctx.has_state:
        d_dir = (b[:, :, 0, None] * ghat[:, :, 0]).to(state_dir.dtype)
        d_log = (b[:, :, 0] * (ghat[:, :, 0] * state_dir.float()).sum(-1)
                 + torch.where(lam_won[:, :, 0], mbar[:, :, 0], 0.0)).to(state_log.dtype)
    return d_k, d_gate.to(log_gate.dtype), d_decay.to(log_decay.dtype), d_dir, d_log


gated_scan.register_autograd(_backward, setup_context=_setup_context)


def triton_log_space_scan(raw: torch.Tensor, log_gate: torch.Tensor, log_decay: torch.Tensor,
                          local_start: torch.Tensor | None, state: tuple[torch.Tensor, torch.Tensor] | None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """memory_mosaics_v2._log_space_scan's contract (rows, log-scale with kbar = rows exp(log-scale);
    local_start (B, T) each position's document start relative to position 0) through the kernel."""
    T = raw.shape[2]
    log_decay = log_decay.float()
    if local_start is not None:  # a document starting at t carries nothing over
        starts = local_start == torch.arange(T, device=raw.device)  # (B, T)
        log_decay = log_decay.masked_fill(starts[:, None, :], float("-inf"))
    state_dir, state_log = (None, None) if state is None else state
    return gated_scan(raw, log_gate.float(), log_decay, state_dir, state_log)
