"""scan_impl triton: owai's Triton kernel of v2's gated key scan (owai/models/key_scan_triton.py).

Without CUDA the kernel runs in Triton's interpreter (conftest chooses it before triton is imported),
which executes the same kernel source, so value and gradient are checked here against the
float64 chunked scan; the last test compiles it for sm_80 and sm_90 without a GPU (what the
interpreter does not check), and tests/test_memory_mosaics_v2.py's `gpu` tests run it compiled on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from owai.models.memory_mosaics_v2 import MemoryMosaicsV2Config, MemoryMosaicsV2ForCausalLM, _log_space_scan, _unit, gated_key_scan
from test_memory_mosaics_v2 import sequential_scan

key_scan_triton = pytest.importorskip("owai.models.key_scan_triton")
if not key_scan_triton.available():
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)
if not key_scan_triton._interpreting():  # with CUDA triton compiles, and CPU tensors cannot reach a compiled kernel
    pytest.skip("these tests run the kernel on CPU tensors in Triton's interpreter, which this process does not use "
                "(CUDA, or triton imported before TRITON_INTERPRET=1); on CUDA, test_memory_mosaics_v2.py's gpu tests "
                "run it compiled", allow_module_level=True)

B, H, HS = 2, 2, 8


def inputs(T: int, docs: bool, state: bool, seed: int = 0, dtype=torch.float32):
    """k~, log g, log lambda, absolute document starts (B, T) of positions 10.. (None: one document
    begun earlier), and an entering state (unit direction, log-scale) or None."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(B, H, T, HS, generator=g).to(dtype)
    log_gate = 2 * torch.randn(B, H, T, generator=g)
    log_decay = -0.5 * torch.rand(B, H, T, generator=g)
    doc_start = None
    if docs:  # documents of random lengths; row 1 has one of length 1 at position 3
        new = torch.rand(B, T, generator=g) < 0.06
        new[1, 3] = new[1, 4] = True
        t = torch.arange(T).expand(B, T)
        doc_start = 10 + torch.cummax(torch.where(new, t, -10), dim=1).values
    entering = None
    if state:
        entering = (F.normalize(torch.randn(B, H, HS, generator=g), dim=-1), torch.randn(B, H, generator=g))
    return raw, log_gate, log_decay, doc_start, entering


CASES = [(1, False, True), (5, False, False), (40, True, True)]  # two levels of chunk ends: the slow test at 4,096


@pytest.mark.parametrize("T, docs, state", CASES)
def test_the_kernel_computes_the_chunked_scan(T, docs, state):
    """kbar_t = rows_t exp(log-scale_t): the same direction and log-norm as the float64 chunked scan,
    with document resets, an entering state, T = 1 and several chunks (40: 3 chunks of 16)."""
    raw, log_gate, log_decay, doc_start, entering = inputs(T, docs, state)
    local = None if doc_start is None else doc_start - 10
    wide = None if entering is None else tuple(x.double() for x in entering)
    ref_rows, ref_log = _log_space_scan(raw.double(), log_gate.double(), log_decay.double(), local, wide, 4)
    rows, log_scale = key_scan_triton.triton_log_space_scan(raw, log_gate, log_decay, local, entering)
    assert rows.dtype == log_scale.dtype == torch.float32
    ref_norm, norm = ref_rows.norm(dim=-1), rows.double().norm(dim=-1)
    assert torch.allclose(rows.double() / norm[..., None], ref_rows / ref_norm[..., None], atol=2e-6)
    assert torch.allclose(log_scale.double() + norm.log(), ref_log + ref_norm.log(), atol=5e-6)


def loss_and_grads(kernel: str, raw, log_gate, log_decay, doc_start, entering, weights):
    """A loss on the unit keys and on the returned state (both its parts), and its gradients."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (raw, log_gate, log_decay)]
    state = None if entering is None else tuple(x.detach().clone().requires_grad_(True) for x in entering)
    rows, (direction, log_scale) = gated_key_scan(*leaves, doc_start, 10, state, 4, kernel=kernel)
    w_rows, w_dir, w_log = weights
    loss = ((w_rows * _unit(rows.double(), 1e-6)).sum() + (w_dir * direction.double()).sum()
            + (w_log * log_scale.double()).sum())
    loss.backward()
    return loss.item(), [x.grad for x in leaves + ([] if state is None else list(state))]


@pytest.mark.parametrize("T, docs, state", [(5, False, True), (40, True, True), (70, True, False)])
def test_the_gradient_is_the_chunked_scans(T, docs, state):
    """The custom backward (the reverse-time scan plus the max-plus adjoint of the log-scale) gives the
    float64 chunked scan's autograd gradients for k~, log g, log lambda and the entering state."""
    raw, log_gate, log_decay, doc_start, entering = inputs(T, docs, state, seed=1)
    g = torch.Generator().manual_seed(2)
    weights = (torch.randn(B, H, T, HS, generator=g, dtype=torch.float64), torch.randn(B, H, HS, generator=g, dtype=torch.float64),
               torch.randn(B, H, generator=g, dtype=torch.float64))
    wide = None if entering is None else tuple(x.double() for x in entering)
    ref_loss, ref = loss_and_grads("chunked", raw.double(), log_gate.double(), log_decay.double(), doc_start, wide, weights)
    loss, got = loss_and_grads("triton", raw, log_gate, log_decay, doc_start, entering, weights)
    assert abs(loss - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    assert len(got) == len(ref) == (5 if state else 3)
    for name, a, b in zip(["k~", "log g", "log lambda", "state direction", "state log-scale"], ref, got):
        assert b is not None, name
        assert (a - b.double()).abs().max() <= 1e-5 * a.abs().max() + 1e-7, name
    if docs:  # nothing flows into log lambda where a document starts
        starts = (doc_start - 10) == torch.arange(T)
        assert (got[2].permute(1, 0, 2)[:, starts] == 0).all()


def test_the_op_differentiates_its_log_scale_too():
    """A loss on r and on m separately (gated_key_scan only ever uses r e^m, for which the max-plus
    adjoint cancels): the op's gradient is the step-by-step recurrence's, resets and state included."""
    raw, log_gate, log_decay, doc_start, entering = inputs(40, True, True, seed=5)
    starts = (doc_start - 10) == torch.arange(40)
    log_decay = log_decay.masked_fill(starts[:, None], float("-inf"))
    g = torch.Generator().manual_seed(6)
    w_rows, w_log = torch.randn(B, H, 40, HS, generator=g, dtype=torch.float64), torch.randn(B, H, 40, generator=g, dtype=torch.float64)
    grads = []
    for fn, dtype in ((sequential_scan, torch.float64), (key_scan_triton.gated_scan, torch.float32)):
        leaves = [x.to(dtype).requires_grad_(True) for x in (raw, log_gate, log_decay, *entering)]
        rows, m = fn(*leaves)
        ((w_rows * rows.double()).sum() + (w_log * m.double()).sum()).backward()
        grads.append([x.grad.double().nan_to_num(posinf=0.0, neginf=0.0) for x in leaves])
    for name, a, b in zip(["k~", "log g", "log lambda", "state direction", "state log-scale"], *grads):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-7, name


def test_bf16_keys_keep_their_dtype_and_the_fake_tensor_rules_hold():
    """k~ in bf16 (as autocast gives it) is read as it is and gets a bf16 gradient; torch.library's
    opcheck (schema, fake tensors for torch.compile, autograd registration) passes."""
    raw, log_gate, log_decay, doc_start, entering = inputs(24, True, True, seed=3, dtype=torch.bfloat16)
    local = doc_start - 10
    leaf = raw.clone().requires_grad_(True)
    rows, _ = key_scan_triton.triton_log_space_scan(leaf, log_gate, log_decay, local, entering)
    rows.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16
    ref, _ = key_scan_triton.triton_log_space_scan(raw.float(), log_gate, log_decay, local, entering)
    assert torch.equal(rows, ref)  # bf16 values are exact in float32
    starts = local == torch.arange(24)
    args = (raw.float().requires_grad_(), log_gate.clone().requires_grad_(),
            log_decay.masked_fill(starts[:, None], float("-inf")), entering[0].clone().requires_grad_(), entering[1])
    torch.library.opcheck(key_scan_triton.gated_scan, args, test_utils=("test_schema", "test_faketensor",
                                                                        "test_autograd_registration"))


def test_the_op_traces_whole_into_a_compiled_graph():
    """Inside torch.compile (compiled blocks) the scan is one opaque op: no graph break, and the
    compiled function's value and gradient are the eager ones."""
    raw, log_gate, log_decay, doc_start, entering = inputs(20, True, False, seed=4)

    def keys(r, g, d):
        rows, (_, log_scale) = gated_key_scan(r, g, d, doc_start, 10, None, 4, kernel="triton")
        return _unit(rows, 1e-6).sum(-1).square().sum() + log_scale.sum()

    compiled = torch.compile(keys, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (keys, compiled):
        leaves = [x.clone().requires_grad_(True) for x in (raw, log_gate, log_decay)]
        value = fn(*leaves)
        results.append((value, torch.autograd.grad(value, leaves)))
    (v, grads), (cv, cgrads) = results
    assert torch.allclose(v, cv, rtol=1e-6)
    for a, b in zip(grads, cgrads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~22 s of inductor, cold; on a GPU the `gpu` bf16 training step runs this path
def test_the_kernel_inside_a_memorys_compiled_inputs():
    """Eager blocks on CUDA with scan_impl triton run the op inside `memory_inputs` compiled by
    inductor (the elementwise work fused around it): that graph, here inductor's for the CPU with the
    op in the interpreter, gives the eager chunked function's outputs and gradients, with documents."""
    from owai.models.memory_mosaics_v2 import _bandwidth_counts, _compiled, memory_inputs

    T, d = 40, H * HS
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    gate, decay = 2 * torch.randn(B, T, H, generator=g), 0.5 * torch.randn(B, T, H, generator=g)
    params = [torch.rand(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g)]
    doc_start = inputs(T, True, False)[3] - 10
    counts = _bandwidth_counts(torch.arange(T)[None], doc_start, 3, None)
    weights = torch.linspace(-1, 1, HS)
    results = []
    for fn, kernel in ((memory_inputs, "chunked"), (_compiled("inputs"), "triton")):
        leaves = [t.clone().requires_grad_() for t in (key, gate, decay, value, *params)]
        q, k, v, (_, s_log), _ = fn(*leaves[:4], None, doc_start, 0, None, 7, kernel, *leaves[4:], counts, 1e-6,
                                    torch.float32)
        loss = ((q + k) * weights).sum() + (v * weights).sum() + s_log.sum()
        results.append([q, k, v, *torch.autograd.grad(loss, leaves)])
    for ref, got in zip(*results):
        assert ref.norm() > 0 and (got - ref).norm() <= 1e-5 * ref.norm(), ((got - ref).norm() / ref.norm()).item()


def test_a_model_with_the_triton_scan_is_the_model_with_the_chunked_scan():
    """scan_impl triton against chunked in a whole model: logits, loss gradients (with documents),
    and a prefill plus cached decoding steps against the full forward."""
    cfg = dict(vocab_size=50, n_layer=2, n_embd=16, n_head=2, ffn_hidden=24, short_window=5, long_delay_eval=3)
    torch.manual_seed(0)
    model = MemoryMosaicsV2ForCausalLM(MemoryMosaicsV2Config(**cfg)).float()
    ids = torch.randint(0, 50, (2, 30))
    pos = torch.stack([torch.cat([torch.arange(12), torch.arange(18)]), torch.arange(30)])
    results = {}
    for impl in ("chunked", "triton"):
        model.config.scan_impl = impl
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=pos, labels=ids, long_delay=4)  # both memories read
        out.loss.backward()
        results[impl] = (out.logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    (ref, ref_grads), (got, got_grads) = results["chunked"], results["triton"]
    assert torch.allclose(got, ref, atol=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name
    model.eval()
    with torch.no_grad():
        full = model(input_ids=ids[:1]).logits
        out = model(input_ids=ids[:1, :20], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for t in range(20, 30):
            parts.append(model(input_ids=ids[:1, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.slow  # ~1 min in the interpreter
def test_the_kernel_at_training_length():
    """The `gpu` test's shapes in the interpreter: 4,096 positions in two documents, head size 128
    (the kernel's 128-wide vector), rows and gradients against the float64 chunked scan."""
    g = torch.Generator().manual_seed(0)
    T, hs = 4096, 128
    raw, log_gate, log_decay = torch.randn(1, 2, T, hs, generator=g), 2 * torch.randn(1, 2, T, generator=g), -torch.randn(1, 2, T, generator=g).abs()
    doc_start = torch.arange(T) - torch.cat([torch.arange(1500), torch.arange(2596)])[None]
    weights = torch.linspace(-1, 1, hs, dtype=torch.float64)
    results = []
    for kernel, dtype in (("chunked", torch.float64), ("triton", torch.float32)):
        leaves = [x.to(dtype).requires_grad_(True) for x in (raw, log_gate, log_decay)]
        rows, (_, log_scale) = gated_key_scan(*leaves, doc_start, 0, None, 64, kernel=kernel)
        rows = F.normalize(rows.double(), dim=-1)
        results.append((rows, torch.autograd.grad((rows * weights).sum() + log_scale.double().sum(), leaves)))
    (rows, grads), (got_rows, got_grads) = results
    assert (rows - got_rows).abs().max() < 1e-6
    for a, b in zip(grads, got_grads):
        assert (a - b.double()).norm() <= 1e-5 * a.norm()


# Run in a fresh process with TRITON_INTERPRET=0: in a process whose triton interprets (this one,
# without CUDA), its compiler failed here with errors that changed from run to run.
_COMPILE_FOR = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from owai.models import key_scan_triton as ks

kernel = ks._scan_kernel
assert type(kernel).__name__ == "JITFunction", type(kernel)
pointers = ("K", "LG", "LD", "S_DIR", "S_LOG", "R", "M")  # the other arguments are int32 sizes and strides
# (keys' dtype, entering state, every row stored, head size, arguments equal to 1, which triton's
# launcher turns into constants: the backward's size-1 vector, contiguous gates)
variants = [(k, s, a, 128, {}) for k in ("*bf16", "*fp32") for s in (False, True) for a in (False, True)]
variants.append(("*fp32", False, True, 1, {"HS": 1, "sk_t": 1, "sg_t": 1, "sd_t": 1}))
for arch in map(int, sys.argv[1:]):
    for k_type, has_state, store_all, head_size, ones in variants:
        block = ks.block_size(head_size)
        constants = {"HAS_STATE": has_state, "STORE_ALL": store_all, "BLOCK_D": block, **ones}
        signature = {p.name: "constexpr" if p.name in constants else "*fp32" if p.name in pointers else "i32" for p in kernel.params}
        signature["K"] = k_type
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=ks.compile_options(block))
        assert binary.asm["cubin"] and f".target sm_{arch}" in binary.asm["ptx"], (arch, k_type)
        assert "fma.rn.f32" in binary.asm["ptx"], "the update's products are not fused"
        print("compiled", arch, k_type, has_state, store_all, block, len(binary.asm["cubin"]), "bytes")
"""


def _nvidia_compiler() -> bool:
    """Whether this triton can compile for NVIDIA GPUs without one (its CUDA backend and ptxas)."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return "nvidia" in getattr(triton.backends, "backends", {}) and (bundled.exists() or "TRITON_PTXAS_PATH" in os.environ)


@pytest.mark.skipif(not _nvidia_compiler(), reason="no triton CUDA backend with ptxas")
def test_the_kernel_compiles_to_gpu_machine_code(tmp_path):
    """The interpreter runs the kernel as Python and misses what only the compiler checks (types of
    loop-carried values, block shapes, what lowers to PTX). Here the kernel is compiled ahead of time,
    without a GPU, to machine code for sm_80 (A100) and sm_90 (H100/H200) by triton's own compiler
    and ptxas, in every variant the op launches: keys in bf16 (autocast) and float32 (the chunk ends,
    the backward), with and without an entering state, storing every row or the chunk ends, at head
    size 128, and the backward's vector of size 1 with the arguments equal to 1 as constants. With
    triton's default FP fusion off, as Triton 3.10 has it, the kernel's own options still fuse."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="0")
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR, "80", "90"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 18
