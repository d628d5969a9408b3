"""Memory Mosaics v2's gated key scan: rules that a mutation audit found unpinned.

Each test here failed on a hand-made mutant of owai/models/memory_mosaics_v2.py or
owai/models/key_scan_triton.py that the rest of the suite let pass, and passes on the real code.
Most of the model's tests run with `norm_eps=0` (tests/test_memory_mosaics_v2.py's TINY, to compare
with the reference code), so the epsilon of the key and value norms, in the forward and in the
hand-written backwards, was never exercised with a value that shows. Expected values come from the
docstrings' formulas (keys x / max(|x|, eps), values x / (|x| + eps), eq 4.4's recurrence kbar_t = g_t k~_t + lambda_t kbar_{t-1},
the Triton op's module docstring), computed here with plain autograd in float64, never from owai's
own output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from owai.models import memory_mosaics_v2 as v2
from test_memory_mosaics_v2 import sequential_scan

EPS = 0.25  # large enough that dropping it, or moving it, changes every number well past float64 noise


def plain_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (|x| + eps) over the last dimension: v2's values (eq 4.5's unit norm)."""
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def key_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / max(|x|, eps) over the last dimension: v2's keys (_KeysAndQueries' docstring), Norm(kbar)
    whatever positive factor the scan's row carries, eps guarding a vanishing row only."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


# -- the hand-written backwards against autograd of their plain formulas ----------------------------


@pytest.mark.parametrize("beta_rows", [1, 3], ids=["beta-broadcast", "beta-per-row"])
def test_keys_and_queries_backward_is_autograds_with_an_epsilon(beta_rows):
    """_KeysAndQueries: keys = x / max(|x|, eps), queries = beta keys (its docstring). Its backward
    must equal autograd of that formula for x and beta, with eps > 0 (the model's default is 1e-6;
    the naive-model gradient test runs with eps = 0, so a backward that forgot eps passed), and with
    beta broadcast over the batch or given per row (the naive-model test has batch 1, where taking the
    first row's d beta instead of the batch's sum passed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64)
    x[0, 0, 0] *= 1e-2  # a short row, where eps matters most
    beta = torch.rand(beta_rows, 2, 5, generator=g, dtype=torch.float64) + 0.5
    w_q, w_k = torch.randn(2, *x.shape, generator=g, dtype=torch.float64)

    def grads(fn):
        leaves = [x.clone().requires_grad_(), beta.clone().requires_grad_()]
        queries, keys = fn(*leaves)
        loss = (w_q * queries).sum() + (w_k * keys).sum()
        return [queries.detach(), keys.detach(), *torch.autograd.grad(loss, leaves)]

    def plain(x, beta):
        keys = key_unit(x, EPS)
        return keys * beta[..., None], keys

    got = grads(lambda x, beta: v2._KeysAndQueries.apply(x, beta, EPS, torch.float64))
    want = grads(plain)
    for name, a, b in zip(["queries", "keys", "d x", "d beta"], got, want):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (name, (a - b).abs().max())


@pytest.mark.parametrize("compiling", [False, True], ids=["eager-branch", "compiled-branch"])
def test_finished_values_backward_is_autograds_with_an_epsilon(compiling, monkeypatch):
    """_FinishedValues: unit(gamma v~_t + (1 - gamma) v~_{t+1}) with unit(z) = z / (|z| + eps) (its
    docstring, eq 4.5). Its backward must equal autograd of that formula for v~ and gamma, with
    eps > 0. Both of its branches are checked: the eager one, and the one written for the compiler
    (selected by torch.compiler.is_compiling, here made to answer True eagerly, so the arithmetic
    of that branch runs without inductor; the compiled-against-eager test needs 30 s of compiling)."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64)
    gamma = torch.rand(3, generator=g).double()  # float32 values: the forward mixes with gamma in float32
    weights = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)

    def grads(fn):
        leaves = [raw.clone().requires_grad_(), gamma.clone().requires_grad_()]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad((weights * out).sum(), leaves)]

    def plain(raw, gamma):
        gm = gamma[None, :, None, None]
        return plain_unit(gm * raw[:, :, :-1] + (1 - gm) * raw[:, :, 1:], EPS)

    want = grads(plain)
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = grads(lambda raw, gamma: v2._FinishedValues.apply(raw, gamma, EPS, torch.float64))
    for name, a, b in zip(["values", "d raw", "d gamma"], got, want):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (name, (a - b).abs().max())


# -- one decoding step ---------------------------------------------------------------------------


def test_a_decoding_step_is_eq_4_4s_step_with_the_norms_epsilon():
    """decode_step's key is Norm(g k~ + lambda kbar_prev) with the memory's norm_eps, the row taken
    in log space with the larger exponent factored out (_scan_step's docstring), and its new state
    is (direction, log-scale) of that kbar (gated_key_scan's docstring). The cached-generation tests
    run with norm_eps = 0, so a step that dropped eps from the key's norm passed them."""
    g = torch.Generator().manual_seed(2)
    B, H, hs = 2, 3, 4
    d = H * hs
    dt = torch.float64
    key, value = torch.randn(B, 1, d, generator=g, dtype=dt), torch.randn(B, 1, d, generator=g, dtype=dt)
    # log g = 0 and log lambda + log |kbar_prev| < 0: the larger exponent is 0, so the step's row is kbar
    # itself and the expected key does not depend on how the scan scales its rows (see the last test)
    gate, decay = torch.zeros(B, 1, H, dtype=dt), torch.randn(B, 1, H, generator=g, dtype=dt)
    value_mix, beta1_log, alpha_raw, beta0_raw = torch.rand(4, H, generator=g)
    scan_dir = F.normalize(torch.randn(B, H, hs, generator=g, dtype=dt), dim=-1)
    scan_log = -0.1 - torch.rand(B, H, generator=g, dtype=dt)
    v_pending = torch.randn(B, H, hs, generator=g, dtype=dt)
    log_count = torch.tensor(5.0).log()
    query, new_key, finished, state_dir, state_log, raw_v = v2.decode_step(
        key, gate, decay, value, value_mix, beta1_log, alpha_raw, beta0_raw, scan_dir, scan_log, v_pending,
        log_count, EPS, dt)

    own, carried = gate.view(B, H), -decay.abs().view(B, H) + scan_log  # log g_t, log lambda_t + log |kbar_{t-1}|
    top = torch.maximum(own, carried)
    assert (top == 0).all()
    row = torch.exp(own - top)[..., None] * key.view(B, H, hs) + torch.exp(carried - top)[..., None] * scan_dir
    want_key = key_unit(row, EPS)
    assert torch.allclose(new_key[:, :, 0], want_key, atol=1e-12)
    beta = beta1_log.exp() * 5.0 ** torch.sigmoid(alpha_raw) + F.softplus(beta0_raw)  # beta1 n^alpha + beta0
    assert torch.allclose(query[:, :, 0], want_key * beta[None, :, None].double(), rtol=1e-6)
    kbar_log_norm = top + row.norm(dim=-1).log()  # log |kbar_t|: the state's log-scale
    assert torch.allclose(state_dir, row / row.norm(dim=-1, keepdim=True), atol=1e-12)
    assert torch.allclose(state_log, kbar_log_norm, atol=1e-12)
    gm = value_mix.double()[None, :, None]
    want_value = plain_unit(gm * v_pending + (1 - gm) * value.view(B, H, hs), EPS)  # eq 4.5 for position t-1
    assert torch.allclose(finished[:, :, 0], want_value, atol=1e-7)
    assert torch.equal(raw_v, value.view(B, H, hs))


def test_a_memorys_inputs_use_the_norm_epsilon_for_keys_and_values():
    """memory_inputs hands its norm_eps to both unit norms: the key Norm(kbar) and the finished value
    unit(gamma v~_{t-1} + (1 - gamma) v~_t) (eq 4.5, its docstring). One position, no scan state and
    log g = 0, so kbar is the raw key itself, whatever convention scales the scan's rows; the pending
    value of the position before completes one finished value. The model's tests run with eps = 0."""
    g = torch.Generator().manual_seed(7)
    B, H, hs = 2, 2, 4
    d = H * hs
    key, value = torch.randn(B, 1, d, generator=g, dtype=torch.float64), torch.randn(B, 1, d, generator=g, dtype=torch.float64)
    gate, decay = torch.zeros(B, 1, H, dtype=torch.float64), torch.randn(B, 1, H, generator=g, dtype=torch.float64)
    v_pending = torch.randn(B, H, hs, generator=g, dtype=torch.float64)
    value_mix = torch.rand(H, generator=g)  # float32 values, as the parameter is
    beta1_log, alpha_raw, beta0_raw = torch.randn(3, H, generator=g)
    counts = torch.tensor([[3]])
    queries, keys, finished, _, _ = v2.memory_inputs(
        key, gate, decay, value, v_pending, None, 7, None, 4, "chunked", value_mix, beta1_log, alpha_raw, beta0_raw,
        counts, EPS, torch.float64)
    want_key = key_unit(key.view(B, H, hs), EPS)
    assert torch.allclose(keys[:, :, 0], want_key, atol=1e-12)
    beta = beta1_log.exp() * 3.0 ** torch.sigmoid(alpha_raw) + F.softplus(beta0_raw)  # beta1 n^alpha + beta0
    assert torch.allclose(queries[:, :, 0], want_key * beta[None, :, None].double(), rtol=1e-6)
    gm = value_mix.double()[None, :, None]
    want_value = plain_unit(gm * v_pending + (1 - gm) * value.view(B, H, hs), EPS)
    assert finished.shape == (B, H, 1, hs) and torch.allclose(finished[:, :, 0], want_value, atol=1e-12)


# -- the cache's rows ------------------------------------------------------------------------------


def test_appending_with_autograd_after_a_buffered_prefix_keeps_only_the_stored_rows():
    """_append returns 'the first cache[name + "_rows"] rows of cache[name] followed by new' (its
    docstring). Without autograd the buffer keeps spare rows; a later call with autograd on (a
    prefix cached under no_grad, then a differentiated continuation) must still use only the stored
    rows, not the spare ones after them."""
    g = torch.Generator().manual_seed(3)
    first, second, third = (torch.randn(1, 2, n, 4, generator=g) for n in (3, 1, 2))
    cache: dict = {}
    with torch.no_grad():
        v2._append(cache, "keys", first)
        v2._append(cache, "keys", second)  # grows the buffer past the 4 stored rows
    assert cache["keys"].shape[2] > cache["keys_rows"] == 4
    with torch.enable_grad():
        out = v2._append(cache, "keys", third.requires_grad_())
    assert torch.equal(out, torch.cat([first, second, third], dim=2))
    assert cache["keys_rows"] == 6 and torch.equal(cache["keys"][:, :, :6], out)


# -- owai's Triton kernel ----------------------------------------------------------------------------


def _triton():
    """The Triton module when its kernel runs here in the interpreter (conftest chooses it without CUDA)."""
    ks = pytest.importorskip("owai.models.key_scan_triton")
    if not ks.available():
        pytest.skip("triton is not installed")
    if not ks._interpreting():
        pytest.skip("the kernel runs on CPU tensors only in Triton's interpreter")
    return ks


def test_the_kernels_block_is_a_power_of_two_that_holds_the_head():
    """block_size: 'a power of two, at least 16' (its docstring), and a program holds one head's whole
    key vector (the module docstring), so the block must be at least the head size: tl.arange needs a
    power of two, and a smaller block would drop the key's last components."""
    ks = _triton()
    for head_size in range(1, 300):
        block = ks.block_size(head_size)
        assert block >= max(16, head_size) and block & (block - 1) == 0, (head_size, block)


@pytest.mark.parametrize("head_size", [24, 64])
def test_the_kernel_computes_the_scan_at_head_sizes_above_its_smallest_block(head_size):
    """The kernel's rows at head sizes above 16 (the other tests use 8, which the smallest block
    holds): 24, not a power of two, and 64. Directions against the float64 recurrence written out
    step by step (eq 4.4: kbar_t = g_t k~_t + lambda_t kbar_{t-1}, restarted at a document start)."""
    ks = _triton()
    g = torch.Generator().manual_seed(4)
    T = 20
    raw = torch.randn(1, 2, T, head_size, generator=g)
    log_gate, log_decay = torch.randn(1, 2, T, generator=g), -0.5 * torch.rand(1, 2, T, generator=g)
    local_start = torch.tensor([[0] * 7 + [7] * 13])  # a second document from position 7
    rows, _ = ks.triton_log_space_scan(raw, log_gate, log_decay, local_start, None)
    kbar, want = None, []
    for t in range(T):
        term = log_gate[..., t, None].double().exp() * raw[:, :, t].double()
        if t not in (0, 7):
            term = term + log_decay[..., t, None].double().exp() * kbar
        kbar = term
        want.append(F.normalize(kbar, dim=-1))
    assert torch.allclose(F.normalize(rows.double(), dim=-1), torch.stack(want, 2), atol=1e-5)


def test_the_ops_log_scale_gradient_without_an_entering_state():
    """gated_scan's contract (module docstring: m_t = max(log g_t, log lambda_t + m_{t-1}), r_t as
    written there) from nothing, i.e. r = 0 and m = -inf before position 0, so m_0 = log g_0 whatever
    lambda_0. A loss on r and m separately (the existing test of this gives an entering state):
    the custom backward's gradients equal autograd through the step-by-step recurrence, also where
    lambda_0 > g_0 (where a wrong 'nothing' of log-scale 0 would route m_0's gradient to log lambda_0)."""
    ks = _triton()
    g = torch.Generator().manual_seed(5)
    B, H, T, hs = 2, 2, 12, 4
    raw = torch.randn(B, H, T, hs, generator=g)
    log_gate, log_decay = torch.randn(B, H, T, generator=g), -0.3 * torch.rand(B, H, T, generator=g)
    log_gate[..., 0] = -3.0  # g_0 < lambda_0
    w_rows, w_log = torch.randn(B, H, T, hs, generator=g, dtype=torch.float64), torch.randn(B, H, T, generator=g, dtype=torch.float64)

    def sequential(raw, log_gate, log_decay):  # no entering state: kbar_{-1} = 0, its log-scale -inf
        return sequential_scan(raw, log_gate, log_decay, torch.zeros(B, H, hs, dtype=raw.dtype),
                               torch.full((B, H), float("-inf"), dtype=raw.dtype))

    grads = []
    for fn, dtype in ((sequential, torch.float64), (lambda *a: ks.gated_scan(*a, None, None), torch.float32)):
        leaves = [x.to(dtype).requires_grad_(True) for x in (raw, log_gate, log_decay)]
        rows, m = fn(*leaves)
        ((w_rows * rows.double()).sum() + (w_log * m.double()).sum()).backward()
        grads.append([x.grad.double() for x in leaves])
    for name, a, b in zip(["k~", "log g", "log lambda"], *grads):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-7, name


def test_the_ops_fake_outputs_are_float32_for_bf16_keys():
    """gated_scan returns (r, m) in float32 for k~ of any float dtype (its docstring). Its fake
    implementation, what torch.compile plans with, must say the same for bf16 keys (as autocast
    gives them), or a compiled block would allocate the rows in the wrong dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ks = _triton()
    g = torch.Generator().manual_seed(6)
    args = (torch.randn(1, 2, 5, 8, generator=g).bfloat16(), torch.randn(1, 2, 5, generator=g),
            -torch.rand(1, 2, 5, generator=g), None, None)
    real = ks.gated_scan(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ks.gated_scan(*(None if a is None else mode.from_tensor(a) for a in args))
    for r, f in zip(real, fake):
        assert r.dtype == f.dtype == torch.float32 and r.shape == f.shape


# -- the key norm's epsilon: a function of kbar, whatever the row's scale ---------------------------


def test_with_a_norm_epsilon_the_chunk_and_the_cache_do_not_change_the_logits():
    """Chunk boundaries do not change the result, and a cached continuation equals the full forward
    (the scan's rules), with the model's norm_eps > 0: keys are Norm(kbar), a function of kbar alone.
    The scan's rows are kbar times a positive factor that depends on the chunk (and on the cached
    step's state); with eps added to the norm of those rows (as owai did until the forty-ninth
    session) the effective eps was eps times that factor. float64; eps = 1e-2 makes it visible (the
    default 1e-6 moved the logits by ~5e-7, float64 noise is ~1e-15)."""
    from test_memory_mosaics_v2 import tiny_model

    ids = torch.randint(0, 50, (1, 23), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        for chunk in (4, 7):
            logits.append(tiny_model(norm_eps=1e-2, scan_chunk=chunk)(input_ids=ids).logits)
        model = tiny_model(norm_eps=1e-2, scan_chunk=4)
        out = model(input_ids=ids[:, :12], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for t in range(12, 23):
            parts.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert torch.allclose(logits[1], logits[0], atol=1e-10), (logits[1] - logits[0]).abs().max()
    assert torch.allclose(torch.cat(parts, 1), logits[0], atol=1e-10)
