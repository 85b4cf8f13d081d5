"""ActNN quantized saved inputs: layout across backends, unbiasedness, the variance model."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import QConv2d, QLinear, actnn_ops


@pytest.mark.parametrize("m", [1, 7, 256, 1000, 5000])  # 5000: programs of 2048, the last partial
@pytest.mark.parametrize("group", [8, 256])
@pytest.mark.parametrize("bits", [[1, 2, 3, 4], [5, 6, 7, 8], [3, 3, 3, 3]])
def test_kernels_match_the_torch_path(m, group, bits, monkeypatch):
    ops = actnn_ops()
    x = torch.randn(4, m) * torch.tensor([1.0, 10.0, 0.0, 1e-3])[:, None]
    b = torch.tensor(bits, dtype=torch.int8)
    out = {}
    for backend in ("torch", "triton", "numba"):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        packed, lo, width = ops.quantize(x, b, 77, group)
        out[backend] = (packed, lo, width, ops.dequantize(packed, lo, width, b, m, group,
                                                          torch.float32))
    for backend in ("triton", "numba"):
        for a, c in zip(out["torch"], out[backend], strict=True):
            assert torch.equal(a, c), backend
    packed, lo, width, xh = out["torch"]
    assert packed.numel() == sum(math.ceil(m * k / 8) for k in bits)
    assert torch.equal(xh[2], x[2])  # a constant sample is exact
    step = width / ((1 << b.long()) - 1)[:, None]
    err = (xh - x).abs() / step.repeat_interleave(group, 1)[:, :m].clamp_min(1e-30)
    assert (err[[0, 1, 3]] < 1 + 1e-4).all()  # within one step of x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dequantized_copy_comes_in_the_asked_dtype_as_the_float32_one_rounded(dtype, monkeypatch):
    # The kernels write the copy in its dtype directly; it is the float32 copy, rounded once.
    ops = actnn_ops()
    x = torch.randn(3, 1000)
    b = torch.tensor([2, 3, 8], dtype=torch.int8)
    packed, lo, width = ops.quantize(x, b, 5, 256)
    expected = ops.dequantize(packed, lo, width, b, 1000, 256, torch.float32).to(dtype)
    for backend in ("torch", "triton", "numba"):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        got = ops.dequantize(packed, lo, width, b, 1000, 256, dtype)
        assert got.dtype == dtype and torch.equal(got, expected), backend


def test_bits_stay_on_the_host():
    # The codes' layout is worked out from host-side bits: no wait for the device per layer.
    layer = QLinear(300, 4, bits=3)
    packed, lo, width, bits = layer.compress(torch.randn(5, 300))
    assert bits.device.type == "cpu" and bits.tolist() == [3] * 5


def predicted_variance(x, bits, group):
    """Per element: step² p (1 - p), p the fractional position of x within its step."""
    n, m = x.shape
    grouped = torch.nn.functional.pad(x, (0, -m % group), value=float("nan")).view(n, -1, group)
    lo = grouped.nan_to_num(float("inf")).amin(-1)
    width = grouped.nan_to_num(float("-inf")).amax(-1) - lo
    step = (width / (2**bits - 1)).repeat_interleave(group, 1)[:, :m]
    pos = (x - lo.repeat_interleave(group, 1)[:, :m]) / step
    frac = pos - pos.floor()
    return step**2 * frac * (1 - frac)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_dequantization_is_unbiased_at_the_predicted_rate(bits):
    torch.manual_seed(0)
    ops = actnn_ops()
    x = torch.randn(2, 600, dtype=torch.float64).float()
    b = torch.full((2,), bits, dtype=torch.int8)
    draws = 2000
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(draws):
        packed, lo, width = ops.quantize(x, b, seed, 256)
        total += ops.dequantize(packed, lo, width, b, 600, 256, torch.float64)
    mean_err = total / draws - x.double()
    var = predicted_variance(x.double(), bits, 256)
    # Σ (mean - x)² / Σ var/K is a chi-square over 1200 elements divided by 1200: 1 ± 0.12.
    ratio = (mean_err**2).sum() / (var.sum() / draws)
    assert 0.8 < ratio < 1.2
    assert (mean_err.abs() <= 6 * (var / draws).sqrt() + 1e-6).all()


def test_weight_gradient_variance_matches_the_model():
    """Var[grad W] summed over W = Σ_n ||g_n||² Σ_i step² p(1-p), measured over many seeds;
    METHODS' C/(2^b - 1)² with p(1-p) <= 1/4 bounds it."""
    torch.manual_seed(1)
    layer = QLinear(600, 8, bits=2)
    x = torch.randn(4, 600)
    g = torch.randn(4, 8)
    draws = []
    for _ in range(600):
        layer.zero_grad()
        layer(x).backward(g)
        draws.append(layer.weight.grad.double().clone())
    stack = torch.stack(draws)
    measured = stack.var(0).sum()
    per_sample = predicted_variance(x.double(), 2, 256).sum(1)
    predicted = (g.double().square().sum(1) * per_sample).sum()
    assert abs(measured / predicted - 1) < 0.1  # 600 draws of 4800 entries: about ±3%
    grouped = torch.nn.functional.pad(x.double(), (0, -600 % 256), value=float("nan")).view(
        4, -1, 256)
    ranges = grouped.nan_to_num(float("-inf")).amax(-1) - grouped.nan_to_num(float("inf")).amin(-1)
    model = (256 / 4 * ranges.square().sum(1) * g.double().square().sum(1)).sum() / 9
    assert measured <= model
    exact = g.T.double() @ x.double()
    assert (stack.mean(0) - exact).abs().max() < 6 * stack.std(0).max() / math.sqrt(600)


def test_forward_and_input_gradient_are_exact():
    torch.manual_seed(2)
    ref = nn.Linear(300, 5)
    q = QLinear.from_module(ref, bits=1)
    x = torch.randn(3, 7, 300)
    g = torch.randn(3, 7, 5)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((ref, q), xs, strict=True)]
    assert torch.equal(ys[0], ys[1])
    for y in ys:
        y.backward(g)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("conv", [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=1),
                                  dict(kernel_size=3, dilation=2, groups=2)])
def test_qconv_weight_gradient_is_close_at_8_bits(conv):
    torch.manual_seed(3)
    ref = nn.Conv2d(4, 6, **conv)
    q = QConv2d.from_module(ref, bits=8)
    x = torch.randn(2, 4, 12, 12)
    g = torch.randn_like(ref(x))
    grads = []
    for m in (ref, q):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        m(xi).backward(g)
        grads.append((xi.grad, ref.weight.grad.clone()))
    (dx0, gw0), (dx1, gw1) = grads
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    # 8 bits: each input off by at most one step, range/255, of its group.
    assert (gw1 - gw0).abs().max() <= g.abs().sum() * (x.max() - x.min()) / 255


def test_saved_bytes_are_codes_plus_group_stats(saved):
    layer = QLinear(1000, 4, bits=torch.tensor([1, 3, 8], dtype=torch.int8))
    x = torch.randn(3, 1000, requires_grad=True)
    groups = math.ceil(1000 / 256)
    codes = sum(math.ceil(1000 * b / 8) for b in (1, 3, 8))
    expected = codes + 3 * groups * 2 * 4 + 3  # + lo and range per group, bits per sample
    assert sum(saved(layer, x, layer.parameters()).values()) == expected


def test_refusals():
    with pytest.raises(ActdesignError, match="group_size"):
        QLinear(4, 4, group_size=100)
    with pytest.raises(ActdesignError, match="bits must be in 1..8"):
        QLinear(4, 4, bits=9)(torch.randn(2, 4))
    with pytest.raises(ActdesignError, match="per-sample bits"):
        QLinear(4, 4, bits=torch.tensor([2, 3, 4]))(torch.randn(2, 4))


def small_cnn():
    torch.manual_seed(5)
    return nn.Sequential(QConv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         QLinear(4 * 8 * 8, 16), nn.ReLU(), QLinear(16, 10))


def test_calibrate_per_layer_sets_exact_bits(tmp_path):
    import json

    from actdesign.designer.allocate import allocate, variance
    from actdesign.runtime import calibrate

    model = small_cnn()
    batches = [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(3)]
    bits = calibrate(model, batches, avg_bits=3, stats_path=tmp_path / "stats.json",
                     bits_path=tmp_path / "bits.json")
    assert set(bits) == {"0", "3", "5"}
    assert bits["0"] == model[0].bits and bits["5"] == model[5].bits
    stats = json.loads((tmp_path / "stats.json").read_text())
    C = [it["C"] for it in stats["items"]]
    w = [it["w"] for it in stats["items"]]
    assert w == [64, 256, 16]  # elements per sample of each layer's input
    chosen = [bits[it["name"]] for it in stats["items"]]
    assert sum(b * s for b, s in zip(chosen, w, strict=True)) <= 3 * sum(w)
    assert variance(C, chosen) == pytest.approx(allocate(C, w, 3.0 * sum(w)).variance)
    x = torch.randn(8, 1, 8, 8)
    model(x).sum().backward()  # the layers train with their new bits


def test_calibrate_matches_the_formula_for_a_linear_layer():
    from actdesign.runtime import calibrate

    torch.manual_seed(6)
    layer = QLinear(600, 3)
    model = nn.Sequential(layer)
    x, target = torch.randn(4, 600), torch.randint(0, 3, (4,))
    calibrate(model, [(x, target)], per="sample", avg_bits=2,
              stats_path=None)
    out = layer(x)
    grad = torch.autograd.grad(F.cross_entropy(out, target), out)[0]
    grouped = F.pad(x, (0, -600 % 256), value=float("nan")).view(4, -1, 256)
    ranges = grouped.nan_to_num(float("-inf")).amax(-1) - grouped.nan_to_num(float("inf")).amin(-1)
    expected = 256 / 4 * ranges.square().sum(1) * grad.square().sum(1)  # K = g = P = 1
    assert layer.bits.shape == (4,)
    from actdesign.designer.allocate import allocate

    ref = allocate(expected.double().numpy(), [600.0] * 4, 2 * 2400.0)
    assert torch.equal(layer.bits.long(), torch.as_tensor(ref.bits))


def test_calibrate_refusals():
    from actdesign.runtime import calibrate

    with pytest.raises(ActdesignError, match="no QLinear"):
        calibrate(nn.Sequential(nn.Linear(2, 2)), [])
    batch = (torch.randn(2, 1, 8, 8), torch.tensor([0, 1]))
    with pytest.raises(ActdesignError, match="exactly one batch"):
        calibrate(small_cnn(), [batch, batch], per="sample")


def test_functional_forms_match_the_layers():
    from actdesign.runtime import qconv2d, qlinear

    torch.manual_seed(7)
    lin, conv = nn.Linear(300, 4), nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    for fn, module, x in ((lambda x: qlinear(x, lin.weight, lin.bias, bits=8), lin,
                           torch.randn(5, 300)),
                          (lambda x: qconv2d(x, conv.weight, conv.bias, 2, 1, 1, 2, bits=8), conv,
                           torch.randn(2, 4, 9, 9))):
        y = fn(x)
        assert torch.equal(y, module(x))
        module.zero_grad()
        y.square().sum().backward()
        approx = module.weight.grad.clone()
        module.zero_grad()
        module(x).square().sum().backward()
        assert (approx - module.weight.grad).abs().max() < 0.05 * module.weight.grad.abs().max()
