"""Memory-sharing norms: gradients (of x, γ and β), the Triton kernels, one stored copy of x̂
for the norm and its readers, and the rebuild of the norm's output bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import LeanLinear, MSLayerNorm, MSRMSNorm, compress, ms_norm, norm_ops
from actdesign.runtime.ops.sharing import kept_for, rebuild

NORMS = {"layer": (MSLayerNorm, nn.LayerNorm), "rms": (MSRMSNorm, nn.RMSNorm)}


def reference_and_shared(kind, d=24, out=10, dtype=torch.float64, seed=0):
    """(torch's norm and a Linear, the MS norm holding the same parameters and a LeanLinear)."""
    torch.manual_seed(seed)
    ms_cls, ref_cls = NORMS[kind]
    norm = ref_cls(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if kind == "layer":
            norm.bias.normal_()
    ref = nn.Sequential(norm, nn.Linear(d, out).to(dtype))
    shared = nn.Sequential(ms_norm(norm), LeanLinear.from_module(ref[1]))
    assert isinstance(shared[0], ms_cls) and shared[0].weight is norm.weight
    return ref, shared


def grads_of(model, x, g):
    model.zero_grad()
    xi = x.clone().requires_grad_(True)
    y = model(xi)
    y.backward(g)
    return [y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_gradients_match_norm_affine_linear(kind, dtype, tol):
    """Against autograd through torch's norm with its affine and the Linear: the output and
    the gradients of x, γ, β and the Linear. float32 sums of 24 terms: a few ulp; float64:
    rounding only."""
    ref, shared = reference_and_shared(kind, dtype=dtype)
    x = torch.randn(3, 7, 24, dtype=dtype)
    g = torch.randn(3, 7, 10, dtype=dtype)
    expected = grads_of(ref, x, g)
    got = grads_of(shared, x, g)
    assert [n for n, _ in shared.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 64, 100])
def test_triton_kernels_match_the_torch_path(kind, dtype, d, monkeypatch):
    ops = norm_ops()
    x = (torch.randn(5, d, dtype=torch.float64) * 3 + 1).to(dtype)
    g = torch.randn(5, d, dtype=torch.float64).to(dtype)
    w = torch.rand(d, dtype=torch.float64).add(0.5).to(dtype)
    b = torch.randn(d, dtype=torch.float64).to(dtype)
    results, given = {}, None
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        y, rstd = ops.OPS[kind][0](x, 1e-5, dtype)
        given = given or (y, rstd)  # the backward of both from the same x̂ and rstd
        dx, sums = ops.backward_impl(kind, *given, g, w, affine_grads=True)
        results[backend] = (y, rstd, ops.OPS[kind][1](*given, g), ops.affine(given[0], w, b),
                            dx, sums)
    (y0, r0, dx0, a0, dxw0, s0), (y1, r1, dx1, a1, dxw1, s1) = results["torch"], \
        results["triton"]
    # Both compute in float32; only the order of the row sums differs.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(r1, r0, rtol=1e-5, atol=0)
    torch.testing.assert_close(y1.double(), y0.double(), rtol=2 * eps, atol=2 * eps)
    # x̂·γ + β from the same x̂: float32 math, one rounding to the dtype (the torch path
    # rounds the product and the sum in float32, a fused multiply-add once).
    torch.testing.assert_close(a1.double(), a0.double(), rtol=eps, atol=eps)
    for dx_1, dx_0 in ((dx1, dx0), (dxw1, dxw0)):
        scale = dx_0.double().abs().max().item() + 1
        torch.testing.assert_close(dx_1.double(), dx_0.double(), rtol=4 * eps,
                                   atol=4 * eps * scale)
    # Σ g·x̂ and Σ g over 5 rows in float32, summed in another order.
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-5 * (s0.abs().max().item() + 1))


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("autocast", [False, True])
def test_one_copy_serves_the_norm_and_every_reader(kind, autocast, saved):
    d, rows = 32, 6
    ref = NORMS[kind][1](d)
    norm = ms_norm(ref)
    dense = [nn.Linear(d, d) for _ in range(3)]
    lean = [LeanLinear.from_module(m) for m in dense]
    params = [p for m in dense for p in m.parameters()] + list(ref.parameters())
    x = torch.randn(rows, d, requires_grad=True)

    def block(norm, readers):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = norm(x)
                return sum(r(y) for r in readers)
        return run

    storages = saved(block(norm, lean), x, params)
    itemsize = 2 if autocast else 4
    # One tensor of x's size, once, in the dtype the Linear layers compute in (x̂ in float32,
    # y itself under autocast), and rstd: nothing else, never x, and no bfloat16 copies of
    # the weights under autocast.
    assert sorted(storages.values()) == sorted([rows * 4, rows * d * itemsize])
    plain = saved(block(norm, dense), x, params)
    if autocast:  # plain Linear layers keep the same y, and bfloat16 copies of their weights
        assert sum(plain.values()) - sum(storages.values()) == 3 * d * d * itemsize
    else:  # they keep y, one more copy beside x̂
        assert sum(plain.values()) - sum(storages.values()) >= rows * d * itemsize
    # torch's own norm keeps x besides.
    eager = saved(block(ref, lean), x, params)
    assert sum(eager.values()) - sum(storages.values()) >= rows * d * itemsize
    # A reader whose weight is frozen keeps nothing at all; with every reader frozen, only
    # the norm's own x̂ and rstd remain.
    for m in lean:
        m.weight.requires_grad_(False)
    assert sorted(saved(block(norm, lean), x, params).values()) == \
        sorted([rows * 4, rows * d * itemsize])
    frozen = saved(block(ref, lean), x, params)
    assert sum(frozen.values()) < sum(eager.values())


class LlamaStyleRMSNorm(nn.Module):
    """An RMSNorm that rounds x̂ to its input's dtype before the gain, as LLaMA's does."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        xhat = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * xhat.to(x.dtype)


def trained_like(norm, seed=0, spread=0.01):
    """γ = 1 ± spread, as trained norms have (a gain error of the forward shows there), and
    β ~ N(0, 0.1²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + spread * (2 * torch.rand(norm.weight.shape, generator=g) - 1))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.1 * torch.randn(norm.bias.shape, generator=g))
    return norm


EAGER_NORMS = {"layer": lambda d: nn.LayerNorm(d), "rms": lambda d: nn.RMSNorm(d, eps=1e-6),
               "rms-default-eps": lambda d: nn.RMSNorm(d),  # float32's eps, even in bf16
               "llama": lambda d: LlamaStyleRMSNorm(d)}


@pytest.mark.parametrize("kind", sorted(EAGER_NORMS))
@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_output_is_eagers_and_its_readers_keep_one_copy(kind, mode, backend, monkeypatch):
    """y is eager's, bit for bit on the torch path, at γ within 1 ± 0.01 (where a second
    rounding of x̂ would show). Where y is as wide as x̂, or the norm rounds x̂ to y's dtype
    itself, the readers keep x̂ and rebuild y bit for bit; where y is rounded to 16 bits from
    the float32 x̂·γ + β, they keep y itself, which the norm keeps too."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
    ref = trained_like(EAGER_NORMS[kind](40))
    ref = ref.to(torch.bfloat16 if mode == "bf16" else torch.float32)
    norm = ms_norm(ref)
    assert norm.round_input == (kind == "llama")
    x = torch.randn(3, 5, 40, dtype=norm.weight.dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        y, expected = norm(x), ref(x)
    assert y.dtype == (torch.float32 if mode == "fp32" else torch.bfloat16)
    eps = torch.finfo(y.dtype).eps
    if backend == "torch" and not (mode == "fp32" and kind == "layer"):
        assert torch.equal(y, expected.to(y.dtype))
    else:  # float32 sums in another order than torch's (the Triton kernels; torch's layer
        # norm kernel in float32, where x̂·γ + β from x̂ is kept): a few float32 roundings,
        # which move a 16-bit y by one unit where eager's float32 value lies next to a tie
        torch.testing.assert_close(y, expected.to(y.dtype), rtol=eps if mode != "fp32" else
                                   8 * eps, atol=eps)
    keeps_xhat = mode == "fp32" or (mode == "bf16" and kind == "llama")
    for view in (y, y[:, 0:], y.reshape(-1, 40)):
        kept, extras, make = kept_for(view)
        if not keeps_xhat:
            assert make is None and kept is view
            continue
        assert make is not None and kept.untyped_storage().data_ptr() != \
            y.untyped_storage().data_ptr()
        assert torch.equal(rebuild(kept, extras, make, view.shape, y.dtype), view)
    if keeps_xhat:
        assert kept_for(y[:, 1:])[2] is None  # a part of y: kept as it is
        y.mul_(2)  # changed in place: the offer no longer holds
        assert kept_for(y)[2] is None
    else:
        kept = y.grad_fn.saved_tensors[0]  # the norm keeps its output itself
        assert kept.data_ptr() == y.data_ptr() and kept.shape == y.shape


def test_sharing_a_two_block_pre_norm_transformer_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    g = torch.randn(2, 9, 32, dtype=torch.float64)
    ours = copy.deepcopy(model)
    report = compress(ours, "msnorm", example_inputs=x)
    assert sum(isinstance(m, MSLayerNorm) for m in ours.modules()) == 4, str(report)
    assert sum(isinstance(m, LeanLinear) for m in ours.modules()) == 8  # q, k, v, fc1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                   ours.state_dict().values(), strict=True))
    for a, b in zip(grads_of(ours, x, g), grads_of(model, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_norms_no_ms_norm_computes_are_refused():
    with pytest.raises(ActdesignError, match="no MS norm computes a BatchNorm1d"):
        ms_norm(nn.BatchNorm1d(8))
    with pytest.raises(ActdesignError, match="last dimension"):
        ms_norm(nn.LayerNorm((4, 8)))


class Block(nn.Module):
    """A pre-norm transformer block: attention and a GELU MLP, each behind a LayerNorm."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k,
                                                                               self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class OffsetRMSNorm(nn.Module):
    """Another library's RMSNorm, as Gemma and Qwen3-Next write it: x̂·(1 + w), w from 0."""

    def __init__(self, d, eps=1e-6, offset=1.0, gate=False):
        super().__init__()
        self.weight, self.eps, self.offset, self.gate = nn.Parameter(torch.zeros(d)), eps, \
            offset, gate

    def forward(self, x, gate=None):
        if self.gate:
            x = x * torch.sigmoid(gate)
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return x * (self.offset + self.weight)


def test_an_rms_norm_is_taken_by_what_it_computes():
    torch.manual_seed(0)
    norm = OffsetRMSNorm(16).double()
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    ours = ms_norm(norm)  # γ = 1 + w, found on a probe
    assert ours.unit_offset and ours.weight is norm.weight
    x = torch.randn(5, 16, dtype=torch.float64)
    g = torch.randn(5, 16, dtype=torch.float64)
    for a, b in zip(grads_of(ours, x, g), grads_of(norm, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Another offset, another eps (the probe has rows whose mean square is eps) and a gated
    # norm are refused.
    for other in (OffsetRMSNorm(16, offset=0.5), OffsetRMSNorm(16, gate=True)):
        with pytest.raises(ActdesignError, match="checked on a probe|one tensor"):
            ms_norm(other)
    wrong_eps = OffsetRMSNorm(16)
    wrong_eps.forward = lambda x: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-2)
    with pytest.raises(ActdesignError, match="checked on a probe"):
        ms_norm(wrong_eps)


def test_bad_inputs():
    norm = MSLayerNorm(8)
    with pytest.raises(ValueError, match="got an input of shape"):
        norm(torch.randn(3, 7))
    with pytest.raises(TypeError, match="must be float16"):
        norm(torch.ones(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_opcheck(kind):
    forward, backward = norm_ops().OPS[kind]
    x = torch.randn(4, 3, 16, requires_grad=True)
    torch.library.opcheck(forward, (x, 1e-5, torch.float32))
    y, rstd = forward(x.detach(), 1e-5, torch.float32)
    torch.library.opcheck(backward, (y, rstd, torch.randn(4, 3, 16)))


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_compile_of_a_shared_block_matches_eager(autocast):
    """Compiled, the forward is eager's (bit for bit under autocast, where both round y once
    from float32); the gradients agree to float32 rounding, or under autocast to bf16's (the
    compiled backward runs from float32 x̂, the eager one from y)."""
    torch.manual_seed(1)
    block = Block()
    x = torch.randn(2, 5, 32)
    compress(block.ln1, "msnorm")  # nothing: a module is never replaced by itself
    wrapped = nn.Sequential(block)
    compress(wrapped, "msnorm", example_inputs=x)
    assert isinstance(block.ln1, MSLayerNorm) and isinstance(block.q, LeanLinear)
    results = []
    for model in (block, torch.compile(block)):
        block.zero_grad()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(xi)
        y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, block.q.weight.grad.clone(),
                        block.ln1.weight.grad.clone(), block.ln2.bias.grad.clone()))
    tol = 4 * torch.finfo(torch.bfloat16).eps if autocast else 1e-5
    if autocast:
        assert torch.equal(results[1][0], results[0][0])
    for eager, compiled in zip(*results, strict=True):
        scale = eager.abs().max().item()
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_eager_autograd_skips_the_custom_op_dispatch(kind, monkeypatch):
    ops = norm_ops()
    forward, backward = ops.OPS[kind]
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.rand(40).add(0.5).requires_grad_(True)
    g = torch.randn(6, 40)
    xhat, rstd = forward(x.detach(), 1e-5, torch.float32)
    y_ref = xhat * w.detach()
    dx_ref = backward(xhat, rstd, g * w.detach())

    def refuse(*args):
        raise AssertionError("custom op called in eager mode")

    monkeypatch.setitem(ops.OPS, kind, (refuse, refuse))
    y = ops.apply(kind, x, 1e-5, weight=w)
    kept = y.grad_fn.saved_tensors
    assert torch.equal(kept[0], xhat) and kept[2] is w  # x̂, rstd and γ: never x, never y
    y.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, (g * xhat).sum(0), rtol=1e-6, atol=1e-6)
