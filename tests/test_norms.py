"""Memory-sharing norms: gradients, the Triton kernels, one stored copy of y, and the fold."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import MSLayerNorm, MSRMSNorm, fold_norm_affine, norm_ops

NORMS = {"layer": (MSLayerNorm, nn.LayerNorm), "rms": (MSRMSNorm, nn.RMSNorm)}


def reference_and_folded(kind, d=24, out=10, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    ms_cls, ref_cls = NORMS[kind]
    norm = ref_cls(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if kind == "layer":
            norm.bias.normal_()
    ref = nn.Sequential(norm, nn.Linear(d, out).to(dtype))
    folded = nn.Sequential(nn.Identity(), nn.Linear(d, out).to(dtype))
    folded[1].load_state_dict(ref[1].state_dict())
    folded[0] = fold_norm_affine(norm, [folded[1]])
    assert isinstance(folded[0], ms_cls)
    return ref, folded


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_gradients_match_norm_affine_linear(kind, dtype, tol):
    """Against autograd through torch's norm with its affine and the Linear. float32 sums of
    24 terms: a few ulp; float64: rounding only."""
    ref, folded = reference_and_folded(kind, dtype=dtype)
    x = torch.randn(3, 7, 24, dtype=dtype)
    g = torch.randn(3, 7, 10, dtype=dtype)
    grads = []
    for model in (ref, folded):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(g)
        grads.append((y.detach(), xi.grad))
    (y0, dx0), (y1, dx1) = grads
    torch.testing.assert_close(y1, y0, rtol=tol, atol=tol)
    torch.testing.assert_close(dx1, dx0, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 64, 100])
def test_triton_kernels_match_the_torch_path(kind, dtype, d, monkeypatch):
    ops = norm_ops()
    x = (torch.randn(5, d, dtype=torch.float64) * 3 + 1).to(dtype)
    g = torch.randn(5, d, dtype=torch.float64).to(dtype)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        y, rstd = ops.OPS[kind][0](x, 1e-5, dtype)
        results[backend] = (y, rstd, ops.OPS[kind][1](y, rstd, g))
    (y0, r0, dx0), (y1, r1, dx1) = results["torch"], results["triton"]
    # Both compute in float32; only the order of the row sums differs.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(r1, r0, rtol=1e-5, atol=0)
    torch.testing.assert_close(y1.double(), y0.double(), rtol=2 * eps, atol=2 * eps)
    scale = dx0.double().abs().max().item() + 1
    torch.testing.assert_close(dx1.double(), dx0.double(), rtol=4 * eps, atol=4 * eps * scale)


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("autocast", [False, True])
def test_one_copy_of_y_serves_the_norm_and_every_linear(kind, autocast, saved):
    d, rows = 32, 6
    norm = NORMS[kind][0](d)
    q, k, v = (nn.Linear(d, d) for _ in range(3))
    params = list(q.parameters()) + list(k.parameters()) + list(v.parameters())
    x = torch.randn(rows, d, requires_grad=True)

    def block(norm):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = norm(x)
                return q(y) + k(y) + v(y)
        return run

    storages = saved(block(norm), x, params)
    itemsize = 2 if autocast else 4
    # y (once, in the dtype the Linear layers compute in) and rstd: nothing else, never x.
    # Under autocast the Linear layers also keep their weights' bfloat16 copies.
    weights = [d * d * 2] * 3 if autocast else []
    assert sorted(storages.values()) == sorted([rows * 4, rows * d * itemsize, *weights])
    baseline = nn.LayerNorm(d) if kind == "layer" else nn.RMSNorm(d)
    more = saved(block(baseline), x, params + list(baseline.parameters()))
    assert sum(more.values()) - sum(storages.values()) >= rows * d * itemsize  # x, at least


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


def test_folding_a_two_block_pre_norm_transformer_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    g = torch.randn(2, 9, 32, dtype=torch.float64)

    def run():
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(g)
        return y.detach(), xi.grad

    y0, dx0 = run()
    for block in model:
        block.ln1 = fold_norm_affine(block.ln1, [block.q, block.k, block.v])
        block.ln2 = fold_norm_affine(block.ln2, [block.fc1])
    assert all(not isinstance(m, nn.LayerNorm) for m in model.modules())
    y1, dx1 = run()
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx1, dx0, rtol=1e-12, atol=1e-12)


def test_folds_that_would_change_the_model_are_refused():
    norm = nn.LayerNorm(8)
    with pytest.raises(ActdesignError, match="post-norm"):
        fold_norm_affine(norm, [nn.Linear(8, 4)], feeds_residual=True)
    with pytest.raises(ActdesignError, match="cannot follow"):
        fold_norm_affine(norm, [nn.Linear(6, 4)])
    with pytest.raises(ActdesignError, match="cannot fold a BatchNorm1d"):
        fold_norm_affine(nn.BatchNorm1d(8), [nn.Linear(8, 4)])
    with pytest.raises(ActdesignError, match="last dimension"):
        fold_norm_affine(nn.LayerNorm((4, 8)), [nn.Linear(8, 4)])


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


def test_an_rms_norm_is_folded_by_what_it_computes():
    torch.manual_seed(0)
    norm = OffsetRMSNorm(16).double()
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    linear = nn.Linear(16, 8).double()
    x = torch.randn(5, 16, dtype=torch.float64)
    want = linear(norm(x))
    folded = fold_norm_affine(norm, [linear])  # γ = 1 + w, found on a probe
    torch.testing.assert_close(linear(folded(x)), want, rtol=1e-12, atol=1e-12)
    # Code reading the norm's weight finds the value at which it multiplies by 1: w = 0.
    assert torch.equal(folded.weight, torch.zeros(16, dtype=torch.float64))
    # Another offset, another eps (the probe has rows whose mean square is eps) and a gated
    # norm are refused, the Linear untouched.
    for other in (OffsetRMSNorm(16, offset=0.5), OffsetRMSNorm(16, gate=True)):
        with pytest.raises(ActdesignError, match="checked on a probe|one tensor"):
            fold_norm_affine(other, [linear])
    wrong_eps = OffsetRMSNorm(16)
    wrong_eps.forward = lambda x: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-2)
    before = linear.weight.clone()
    with pytest.raises(ActdesignError, match="checked on a probe"):
        fold_norm_affine(wrong_eps, [linear])
    assert torch.equal(linear.weight, before)


def test_bad_inputs():
    norm = MSLayerNorm(8)
    with pytest.raises(ValueError, match="got an input of shape"):
        norm(torch.randn(3, 7))
    with pytest.raises(TypeError, match="must be float16"):
        norm(torch.ones(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_opcheck(kind):
    forward, backward, _ = norm_ops().OPS[kind]
    x = torch.randn(4, 3, 16, requires_grad=True)
    torch.library.opcheck(forward, (x, 1e-5, torch.float32))
    y, rstd = forward(x.detach(), 1e-5, torch.float32)
    torch.library.opcheck(backward, (y, rstd, torch.randn(4, 3, 16)))


def test_torch_compile_of_a_folded_block_matches_eager():
    torch.manual_seed(1)
    block = Block()
    block.ln1 = fold_norm_affine(block.ln1, [block.q, block.k, block.v])
    block.ln2 = fold_norm_affine(block.ln2, [block.fc1])
    x = torch.randn(2, 5, 32)
    results = []
    for model in (block, torch.compile(block)):
        block.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, block.q.weight.grad.clone()))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_eager_autograd_skips_the_custom_op_dispatch(kind, monkeypatch):
    ops = norm_ops()
    forward, backward, eager = ops.OPS[kind]
    x = torch.randn(6, 40, requires_grad=True)
    g = torch.randn(6, 40)
    y_ref, rstd = forward(x.detach(), 1e-5, torch.float32)
    dx_ref = backward(y_ref, rstd, g)

    def refuse(*args):
        raise AssertionError("custom op called in eager mode")

    monkeypatch.setitem(ops.OPS, kind, (refuse, refuse, eager))
    y = ops.apply(kind, x, 1e-5)
    assert y.grad_fn.saved_tensors[0].data_ptr() == y.data_ptr()  # y itself is kept
    y.backward(g)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref)
