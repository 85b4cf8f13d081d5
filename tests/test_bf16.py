"""Every method in 16-bit precision: under `torch.autocast` with float32 weights, and with
bfloat16/float16 weights. The compressed layers follow nn.Linear's and nn.Conv2d's dtype
rules, the few-bit ops and MS norms keep their promises, and every preset trains every
built-in model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actdesign.runtime import (
    LeanLinear,
    MSLayerNorm,
    MSRMSNorm,
    PooledConv2d,
    QConv2d,
    QLinear,
    SparseConv2d,
    SparseLinear,
)

HALF = [torch.bfloat16, torch.float16]
# (mode, dtype): autocast over float32 weights and inputs, or the module and input in dtype.
MODES = [(mode, dtype) for mode in ("autocast", "weights") for dtype in HALF]


def run(mode, dtype):
    """The context a forward runs in: autocast on, or nothing."""
    return torch.autocast("cpu", dtype=dtype, enabled=mode == "autocast")


def prepare(mode, dtype, module, x):
    if mode == "weights":
        return module.to(dtype), x.to(dtype)
    return module, x


def step(module, x, g, mode, dtype):
    """(y, dx, [parameter grads]) of one forward under `mode` and a backward outside it."""
    module.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    with run(mode, dtype):
        y = module(xi)
    y.backward(g.to(y.dtype))
    return y.detach(), xi.grad, [p.grad for p in module.parameters()]


LINEARS = {
    "LeanLinear exact": LeanLinear.from_module,
    "QLinear": lambda m: QLinear.from_module(m, bits=2),
    "SparseLinear": lambda m: SparseLinear.from_module(m, ratio=0.5),
    "SparseLinear exact": lambda m: SparseLinear.from_module(m, ratio=0.0),
}
CONVS = {
    "QConv2d": lambda m: QConv2d.from_module(m, bits=3),
    "SparseConv2d": lambda m: SparseConv2d.from_module(m, ratio=0.5, int8=True),
    "SparseConv2d exact": lambda m: SparseConv2d.from_module(m, ratio=0.0),
    "PooledConv2d": lambda m: PooledConv2d.from_module(m, p=2),
    "PooledConv2d exact": lambda m: PooledConv2d.from_module(m, p=1),
}


def layer_case(name):
    torch.manual_seed(0)
    if name in LINEARS:
        ref, x = nn.Linear(48, 20), torch.randn(3, 5, 48)
        return ref, LINEARS[name](copy.deepcopy(ref)), x
    ref, x = nn.Conv2d(4, 6, 3, padding=1), torch.randn(2, 4, 8, 10)
    return ref, CONVS[name](copy.deepcopy(ref)), x


@pytest.mark.parametrize("mode, dtype", MODES)
@pytest.mark.parametrize("name", [*LINEARS, *CONVS])
def test_compressed_layers_follow_the_dense_layers_dtype_rules(name, mode, dtype):
    ref, layer, x = layer_case(name)
    ref, x = prepare(mode, dtype, ref, x)
    layer, _ = prepare(mode, dtype, layer, x)
    consumed = []
    compress = layer.compress
    layer.compress = lambda t: consumed.append(t.dtype) or compress(t)
    g = torch.randn(ref(x).shape)
    y0, dx0, grads0 = step(ref, x, g, mode, dtype)
    y1, dx1, grads1 = step(layer, x, g, mode, dtype)
    # The forward and the input gradient are the dense layer's own computation on the same
    # 16-bit operands: identical, dtype included (dx in x's dtype, through autocast's cast).
    assert y1.dtype == y0.dtype == dtype and torch.equal(y1, y0)
    assert dx1.dtype == dx0.dtype == x.dtype and torch.equal(dx1, dx0)
    # The compressed copy is taken from the tensor the matmul consumed, in the compute dtype.
    assert consumed == [dtype]
    for p, g0, g1 in zip(layer.parameters(), grads0, grads1, strict=True):
        assert g1.dtype == g0.dtype == p.dtype and torch.isfinite(g1).all()
    if name.endswith("exact"):  # the restored copy is x itself: the weight gradient is exact
        for g0, g1 in zip(grads0, grads1, strict=True):
            assert torch.equal(g1, g0)


def test_no_16_bit_weight_copy_waits_for_the_backward(saved):
    """Eager autocast keeps the bfloat16 copy of every Linear weight until the backward; the
    compressed layers keep the parameter and cast again there."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 32)
    x = torch.randn(4, 64, requires_grad=True)
    params = list(dense.parameters())

    eager = saved(dense, x, params, autocast=True)
    lean = saved(LeanLinear.from_module(dense), x, params, autocast=True)
    assert sorted(eager.values()) == [4 * 64 * 2, 32 * 64 * 2]  # x and W in bfloat16
    assert list(lean.values()) == [4 * 64 * 2]  # x only


@pytest.mark.parametrize("mode, dtype", MODES)
def test_fewbit_op_is_the_activation_and_its_table(ops_for, mode, dtype):
    """Activations are not autocast ops: the forward runs in x's dtype, as torch's own does,
    and the backward is levels[code]·g whatever the context."""
    ops = ops_for("gelu", bits=3)
    x = torch.randn(4, 300) * 3
    x = x.to(dtype) if mode == "weights" else x
    g = torch.randn(x.shape).to(x.dtype)
    xi = x.clone().requires_grad_(True)
    with run(mode, dtype):
        y = ops.apply(xi)
        expected = F.gelu(x)
    y.backward(g)
    assert y.dtype == expected.dtype == x.dtype and torch.equal(y.detach(), expected)
    assert torch.equal(xi.grad, ops._backward_op(ops._forward_op(x)[1], g))


def ms_reference(kind, x, g):
    """y, dx and rstd of the norm in float64 from x and the 16-bit g."""
    xd = x.detach().double().requires_grad_(True)
    centred = xd if kind == "rms" else xd - xd.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
    y = centred * rstd
    y.backward(g.double())
    return y.detach(), xd.grad, rstd.detach()


@pytest.mark.parametrize("mode, dtype", MODES)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_ms_norms_round_y_once_and_differentiate_through_it(kind, mode, dtype):
    """Under autocast the norm emits y in the autocast dtype (what the Linear layers after it
    compute in); with 16-bit inputs, in theirs. y is the float32 result rounded once: within
    half an ulp (u) of the exact y, plus float32 slack. The backward reads that stored y, so
    dx = rstd·(g - mean(g) - y·mean(g·y)) sees y(1 + δ), |δ| ≤ u: an error of at most
    rstd·u·|y_i|·(|mean(g·y)| + mean|g·y|) per element, to first order."""
    norm = (MSLayerNorm if kind == "layer" else MSRMSNorm)(96)
    torch.manual_seed(0)
    x = torch.randn(16, 96) * 3 + 1
    x = x.to(dtype) if mode == "weights" else x
    g = torch.randn(16, 96).to(dtype)
    xi = x.clone().requires_grad_(True)
    with run(mode, dtype):
        y = norm(xi)
    y.backward(g)
    assert y.dtype == dtype and xi.grad.dtype == x.dtype
    y_ref, dx_ref, rstd = ms_reference(kind, x, g)
    u = torch.finfo(dtype).eps / 2
    slack = 64 * torch.finfo(torch.float32).eps
    assert ((y.double() - y_ref).abs() <= u * y_ref.abs() + slack * (1 + y_ref.abs())).all()
    gy = g.double() * y_ref
    bound = rstd * u * y_ref.abs() * (gy.mean(-1, keepdim=True).abs() + gy.abs().mean(-1, True))
    scale = rstd * g.double().abs().amax(-1, keepdim=True)
    fp32 = slack * scale * (1 + y_ref.abs())
    if mode == "weights":  # dx itself is rounded to x's 16-bit dtype
        fp32 = fp32 + u * dx_ref.abs()
    assert ((xi.grad.double() - dx_ref).abs() <= 1.01 * bound + fp32).all()


# --- every preset on every built-in model -----------------------------------------------------

transformers = pytest.importorskip("transformers")
from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.apply.policy import PRESETS  # noqa: E402

ARCHS = ["gpt2-tiny", "llama-tiny", "bert-tiny", "vit-tiny"]
# the presets, and the joined ones where norms keep codes shared with their readers
PRESET_NAMES = [p for p in PRESETS if p != "none"] + ["fewbit3+msnorm+actnn2", "llm+actnn2"]


def model_and_batch(name, mode, dtype):
    model, _ = models.build(name)
    inputs = models.example_batch(model, 2, 12)
    if mode == "weights":
        model.to(dtype)
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return model, inputs


def forward_backward(model, inputs, mode, dtype):
    """(loss, logits, {parameter name: grad}) of one step, all as float64 for comparison."""
    model.zero_grad(set_to_none=True)
    with run(mode, dtype):
        out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().double(), out.logits.detach().double(), grads


@pytest.mark.parametrize("mode", ["autocast", "weights"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("name", ARCHS)
def test_every_preset_trains_every_model_in_bf16(name, preset, mode):
    dtype = torch.bfloat16
    model, inputs = model_and_batch(name, mode, dtype)
    compress(model.train(), preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step runs on updated weights
        optimizer.zero_grad(set_to_none=True)
        with run(mode, dtype):
            loss = model(**inputs).loss
        loss.backward()
        assert torch.isfinite(loss)
        for n, p in model.named_parameters():
            if p.grad is not None:
                assert p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), n
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def flat(grads, names):
    return torch.cat([grads[n].flatten() for n in names])


@pytest.mark.parametrize("mode", ["autocast", "weights"])
@pytest.mark.parametrize("name", ARCHS)
def test_lossless_presets_match_the_model_within_bf16_rounding(name, mode):
    """The forward of fewbit3, regelu2 and msnorm is the model's own, and msnorm's gradients
    too. In bf16 both runs carry rounding errors, so each is measured against the model in
    float64: the compressed run's logits (and msnorm's gradients) must be at most twice as
    far from float64 as the uncompressed bf16 run's, two roundings of the same size. The loss
    is the cross-entropy of those logits, which moves by at most 2·max|Δlogit|."""
    dtype = torch.bfloat16
    reference, inputs = model_and_batch(name, "float64", dtype)
    base = copy.deepcopy(reference).eval()
    reference = reference.double().eval()
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    loss64, logits64, grads64 = forward_backward(reference, wide, "float64", dtype)
    if mode == "weights":
        base.to(dtype)
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    loss0, logits0, grads0 = forward_backward(base, inputs, mode, dtype)
    for preset in ("fewbit3", "regelu2", "msnorm"):
        model = copy.deepcopy(base)
        assert compress(model, preset).replaced
        loss, logits, grads = forward_backward(model, inputs, mode, dtype)
        assert (logits - logits64).norm() <= 2 * (logits0 - logits64).norm(), preset
        slack = 4 * torch.finfo(torch.float32).eps * loss0.abs()
        assert (loss - loss0).abs() <= 2 * (logits - logits0).abs().max() + slack, preset
        if preset == "msnorm":  # the same parameters, the norms' own too
            names = list(grads)
            assert names == list(grads64)
            assert (flat(grads, names) - flat(grads64, names)).norm() \
                <= 2 * (flat(grads0, names) - flat(grads64, names)).norm()


@pytest.mark.parametrize("mode", ["autocast", "weights"])
@pytest.mark.parametrize("name", ARCHS)
def test_exact_copies_give_the_models_own_bf16_gradients(name, mode):
    """Back Razor keeping all of x and pooling 1x1 restore x itself: every Linear, Conv1D
    and Conv2d wrapper then computes exactly what the dense layer does in bf16, bit for bit."""
    dtype = torch.bfloat16
    base, inputs = model_and_batch(name, mode, dtype)
    base.eval()
    model = copy.deepcopy(base)
    rules = [{"target": "conv2d", "apply": "pooled", "pool": 1},
             {"target": "linear", "apply": "backrazor", "ratio": 0.0}]
    assert compress(model, {"rules": rules}, allow_more=True).replaced  # copies: more bytes
    loss0, logits0, grads0 = forward_backward(base, inputs, mode, dtype)
    loss, logits, grads = forward_backward(model, inputs, mode, dtype)
    assert torch.equal(loss, loss0) and torch.equal(logits, logits0)
    assert grads.keys() == grads0.keys()
    assert all(torch.equal(grads[n], grads0[n]) for n in grads)
