"""Memory Mosaics v1, issue #26 items 7-9: the fused key/value normalisation (same values and gradients
as the plain expression), attention dropout in O(block x T) memory on CPU (no T x T tensor kept for the
backward pass, unbiased, mask replayed exactly by the recomputation), and Library checkpoints with a
value shift other than 1 refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import owai.models.memory_mosaics as mm
from owai.errors import OwaiError
from owai.models.memory_mosaics import (
    MemoryMosaicsConfig,
    MemoryMosaicsForCausalLM,
    blocked_dropout_attention,
    scaled_unit,
)
from owai.models.memory_mosaics_convert import convert_official_state_dict, load_official_checkpoint
from naive_memory_mosaics import NaiveMemoryMosaics, random_official_state_dict

TINY = dict(vocab_size=61, n_layer=2, n_embd=32, n_head=4, pmem_size=24, leaky_chunk=16, ic_dropout=0.0, hd_dropout=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest)


def _plain_unit(x, scale, eps):
    return x / (x.norm(dim=-1, keepdim=True) + eps) * scale


# ------------------------------------------------------------------ item 7: fused normalisation


@pytest.mark.parametrize("eps", [0.0, 1e-10, 0.3])
def test_scaled_unit_equals_plain_expression_with_gradients(eps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(1, 3, 1, 1, generator=g, dtype=torch.float64).add(0.5).requires_grad_()
    upstream = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    got = scaled_unit(x, scale, eps)
    want = _plain_unit(x, scale, eps)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    got_grads = torch.autograd.grad((got * upstream).sum(), (x, scale))
    want_grads = torch.autograd.grad((want * upstream).sum(), (x, scale))
    for a, b in zip(got_grads, want_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_scaled_unit_compiled_keeps_its_gradients():
    """Under torch.compile (train.compile's blocks) the fused node gives its eager gradients in float32,
    where its output dtype is its input's. torch 2.11's compile gave this node zero gradients while its
    forward ended in a `.to` that changed nothing (benchmarks/lent_torch.sh runs this test under 2.11)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=g, requires_grad=True)
    scale = torch.rand(1, 3, 1, 1, generator=g).add(0.5).requires_grad_()
    upstream = torch.randn(2, 3, 5, 4, generator=g)
    grads = [torch.autograd.grad((fn(x, scale, 1e-6) * upstream).sum(), (x, scale))
             for fn in (scaled_unit, torch.compile(scaled_unit, backend="aot_eager", fullgraph=True))]
    for eager, compiled in zip(*grads):
        assert eager.abs().max() > 0
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


def test_model_gradients_equal_the_plain_graph(monkeypatch):
    """Float64 training gradients of every parameter: fused extractors == plain autograd expression."""
    torch.manual_seed(0)
    model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**TINY)).double()
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    fused = grads()
    monkeypatch.setattr(mm, "scaled_unit", _plain_unit)
    plain = grads()
    assert set(fused) == set(plain)
    for name in fused:
        torch.testing.assert_close(fused[name], plain[name], atol=1e-12, rtol=1e-9, msg=name)


# ------------------------------------------------------------------ item 8: blocked attention dropout


def _qkv(B, H, Lq, Lk, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (Lq, Lk, Lk)]


@pytest.mark.parametrize("Lq,Lk,causal", [(37, 37, True), (5, 37, True), (37, 24, False)])
@pytest.mark.parametrize("block", [1, 8, 64])
def test_blocked_attention_without_dropout_equals_sdpa(Lq, Lk, causal, block):
    q, k, v = _qkv(2, 3, Lq, Lk)
    got = blocked_dropout_attention(q, k, v, 0.0, block, causal)
    mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq) if causal else None  # bottom-right causal
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_blocked_dropout_recomputation_replays_the_same_mask():
    """The checkpointed blocks redraw exactly the forward's dropout masks in the backward pass."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 50, 50, seed=3))
    results = []
    for checkpoint in (True, False):
        torch.manual_seed(7)
        out = blocked_dropout_attention(q, k, v, 0.3, 16, True, checkpoint=checkpoint)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_blocked_dropout_is_unbiased_and_drops_weights():
    q, k, v = _qkv(1, 1, 6, 6, D=3, seed=5)
    n = 4000
    qs, ks, vs = (t.expand(n, -1, -1, -1) for t in (q, k, v))
    torch.manual_seed(0)
    dropped = blocked_dropout_attention(qs, ks, vs, 0.2, 4, True)
    clean = blocked_dropout_attention(q, k, v, 0.0, 4, True)
    assert not torch.allclose(dropped[0], clean[0])
    torch.testing.assert_close(dropped.mean(0, keepdim=True), clean, atol=0.03, rtol=0)


def test_training_with_dropout_keeps_no_t_by_t_tensor_for_backward():
    """CPU SDPA with dropout_p > 0 keeps (B, H, T, T) weights for the backward pass; the blocked path
    keeps only its inputs. Largest tensor saved for backward, training at T = 256 with blocks of 32."""
    T = 256
    torch.manual_seed(0)
    model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**{**TINY, "ic_dropout": 0.1, "dropout_block": 32})).train()
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel())
        return t

    ids = torch.randint(0, 61, (1, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()  # the recomputation works
    assert all(p.grad is not None for p in model.parameters())
    H = model.config.n_head
    assert largest[0] < H * T * T // 4, largest[0]


def test_dropout_block_zero_uses_sdpa_and_bad_value_is_refused():
    assert not mm._blocked_dropout(MemoryMosaicsConfig(**{**TINY, "dropout_block": 0}), 0.1, torch.device("cpu"))
    assert mm._blocked_dropout(MemoryMosaicsConfig(**TINY), 0.1, torch.device("cpu"))
    with pytest.raises(OwaiError, match="dropout_block"):
        MemoryMosaicsConfig(**{**TINY, "dropout_block": -1})


# ------------------------------------------------------------------ item 9: v_shift != 1


@pytest.mark.parametrize("shift", [0, 2])
def test_library_checkpoint_with_other_value_shift_is_refused(tmp_path, shift):
    sd = random_official_state_dict("library")
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "model_args": {"v_shift": shift, "pre_ln": True}}, path)
    with pytest.raises(OwaiError, match=f"v_shift={shift} is not supported") as err:
        load_official_checkpoint(path)
    assert "\n" not in str(err.value)
    with pytest.raises(OwaiError, match="v_shift"):
        convert_official_state_dict({"model": sd, "model_args": {"v_shift": shift}})
    with pytest.raises(OwaiError, match="v_shift"):
        convert_official_state_dict(sd, v_shift=shift)


def test_library_checkpoint_with_value_shift_one_loads(tmp_path):
    sd = random_official_state_dict("library", seed=2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "model_args": {"v_shift": 1, "v_kernel_size": 2, "att_shift": 0}}, path)
    model = load_official_checkpoint(path, norm_eps=0.0).double()
    ids = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, NaiveMemoryMosaics(sd, "library").logits(ids), atol=1e-8, rtol=0)


# ------------------------------------------------------------------ mixed precision (issue #35)

LOW = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("x_dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_scaled_unit_backward_takes_any_dtype_mix(x_dtype, scale_dtype):
    """The dtype mixes CUDA autocast produces: x in bf16/fp16 (its einsums run in low precision) with
    an fp32 scale, so the output (and the gradient autograd hands back) is fp32 while the saved x is
    not. The first GPU backward crashed here (vecdot of an fp32 gradient with a bf16 x)."""
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    s64 = torch.rand(1, 3, 1, 1, generator=g, dtype=torch.float64).add(0.5)
    x = x64.to(x_dtype).requires_grad_()
    scale = s64.to(scale_dtype).requires_grad_()
    out = mm._ScaledUnit.apply(x, scale, 1e-6)
    assert out.dtype == torch.promote_types(x_dtype, scale_dtype)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    gx, gs = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), (x, scale))
    assert gx.dtype == x_dtype and gs.dtype == scale_dtype
    xr, sr = x.detach().double().requires_grad_(), scale.detach().double().requires_grad_()
    want = torch.autograd.grad((_plain_unit(xr, sr, 1e-6) * upstream).sum(), (xr, sr))
    tol = 1e-5 if x_dtype == scale_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gx.double(), want[0], atol=tol * 10, rtol=tol)
    torch.testing.assert_close(gs.double(), want[1], atol=tol * 10, rtol=tol)


def test_v1_backward_under_cuda_autocast_dtype_policy(monkeypatch):
    """A whole v1 training step with CUDA autocast's dtype policy reproduced on CPU: linear layers and
    einsums give bf16, norms give fp32 (CPU autocast keeps norms in bf16, which is why CPU tests
    missed the crash). Loss finite, every parameter gets a finite gradient."""
    real_norm, real_einsum = torch.linalg.vector_norm, torch.einsum

    def norm_fp32(x, *args, **kwargs):  # CUDA autocast: linalg_vector_norm runs in fp32
        return real_norm(x.float() if torch.is_autocast_enabled("cpu") else x, *args, **kwargs)

    def einsum_low(eq, *ops):  # CUDA autocast: einsum (a matmul) runs in bf16
        if torch.is_autocast_enabled("cpu"):
            ops = tuple(o.to(torch.bfloat16) for o in ops)
        return real_einsum(eq, *ops)

    monkeypatch.setattr(torch.linalg, "vector_norm", norm_fp32)
    monkeypatch.setattr(torch, "einsum", einsum_low)
    torch.manual_seed(0)
    model = MemoryMosaicsForCausalLM(MemoryMosaicsConfig(**TINY))
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
