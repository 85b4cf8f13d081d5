"""Pooled and sparse saved inputs: exact where the method promises, and their memory."""

import math

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import PooledConv2d, SparseConv2d, SparseLinear
from actdesign.runtime.ops.sparse import pack_mask, unpack_mask


def grads(model, x, g):
    model.zero_grad()
    xi = x.clone().requires_grad_(True)
    y = model(xi)
    y.backward(g)
    return y.detach(), xi.grad, [p.grad.clone() for p in model.parameters()]


CONVS = [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=1),
         dict(kernel_size=(3, 1), dilation=2, padding=(2, 0)), dict(kernel_size=3, groups=2)]


@pytest.mark.parametrize("conv", CONVS)
def test_pooled_conv_with_p1_is_exact(conv):
    torch.manual_seed(0)
    ref = nn.Conv2d(4, 6, **conv).double()
    pooled = PooledConv2d.from_module(ref, p=1)
    x = torch.randn(2, 4, 9, 11, dtype=torch.float64)
    g = torch.randn_like(ref(x))
    for a, b in zip(grads(ref, x, g)[:2], grads(pooled, x, g)[:2], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-13)
    (_, _, (gw0, gb0)), (_, _, (gw1, gb1)) = grads(ref, x, g), grads(pooled, x, g)
    torch.testing.assert_close(gw1, gw0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gb1, gb0, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("p", [2, 3])
def test_pooled_conv_is_exact_on_blockwise_constant_inputs(conv, p):
    torch.manual_seed(1)
    ref = nn.Conv2d(4, 6, **conv).double()
    pooled = PooledConv2d.from_module(ref, p=p)
    blocks = torch.randn(2, 4, 4, 5, dtype=torch.float64)
    x = blocks.repeat_interleave(p, 2).repeat_interleave(p, 3)  # constant on p×p blocks
    g = torch.randn_like(ref(x))
    for a, b in zip(grads(ref, x, g), grads(pooled, x, g), strict=True):
        for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b],
                        strict=True):
            torch.testing.assert_close(v, u, rtol=1e-12, atol=1e-12)


def test_pooled_conv_keeps_one_p_squared_of_x(saved):
    conv = PooledConv2d(8, 8, 3, padding=1, p=2)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    nbytes = sum(saved(conv, x, conv.parameters()).values())
    assert nbytes == x.numel() * 4 // 4  # avg_pool(x, 2): a quarter of x, float32
    with pytest.raises(ActdesignError, match="p must be"):
        PooledConv2d(8, 8, 3, p=0)


def test_mask_packing_round_trips():
    for n in (0, 1, 7, 8, 9, 100):
        mask = torch.rand(n) > 0.5
        packed = pack_mask(mask)
        assert packed.numel() == math.ceil(n / 8) and torch.equal(unpack_mask(packed, n), mask)


def masked_reference(x, ratio):
    """x with all but each sample's largest (1 - ratio) fraction of |x| zeroed."""
    flat = x.reshape(x.shape[0], -1)
    keep = max(1, math.ceil((1 - ratio) * flat.shape[1]))
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(1, flat.abs().topk(keep, dim=1).indices, True)
    return (flat * mask).view(x.shape), keep


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_sparse_linear_weight_grad_is_the_masked_inputs(ratio):
    torch.manual_seed(2)
    ref = nn.Linear(20, 7).double()
    sparse = SparseLinear.from_module(ref, ratio=ratio)
    x = torch.randn(5, 3, 20, dtype=torch.float64)
    g = torch.randn(5, 3, 7, dtype=torch.float64)
    y, dx, (gw, gb) = grads(sparse, x, g)
    y0, dx0, _ = grads(ref, x, g)
    assert torch.equal(y, y0)
    torch.testing.assert_close(dx, dx0, rtol=1e-14, atol=1e-14)  # exact up to matmul order
    masked, _ = masked_reference(x, ratio)
    expected = g.reshape(-1, 7).T @ masked.reshape(-1, 20)
    assert torch.equal(gw, expected)
    assert torch.equal(gb, g.sum((0, 1)))


@pytest.mark.parametrize("conv", CONVS)
def test_sparse_conv_weight_grad_is_the_masked_inputs(conv):
    torch.manual_seed(3)
    ref = nn.Conv2d(4, 6, **conv).double()
    sparse = SparseConv2d.from_module(ref, ratio=0.8)
    x = torch.randn(3, 4, 9, 11, dtype=torch.float64)
    g = torch.randn_like(ref(x))
    _, dx, (gw, _) = grads(sparse, x, g)
    _, dx0, _ = grads(ref, x, g)
    torch.testing.assert_close(dx, dx0, rtol=1e-14, atol=1e-14)
    masked, _ = masked_reference(x, 0.8)
    expected = torch.nn.grad.conv2d_weight(masked, ref.weight.shape, g, ref.stride,
                                           ref.padding, ref.dilation, ref.groups)
    assert torch.equal(gw, expected)


@pytest.mark.parametrize("int8", [False, True])
def test_sparse_memory_is_the_mask_plus_the_kept_values(int8, saved):
    layer = SparseLinear(1000, 10, ratio=0.9, int8=int8)
    x = torch.randn(8, 1000, requires_grad=True)
    keep = math.ceil(0.1 * 1000)
    expected = 8 * 1000 // 8 + 8 * keep * (1 if int8 else 4) + (8 * 4 if int8 else 0)
    assert sum(saved(layer, x, layer.parameters()).values()) == expected


def test_sparse_int8_values_are_close():
    torch.manual_seed(4)
    ref = nn.Linear(64, 8)
    sparse = SparseLinear.from_module(ref, ratio=0.5, int8=True)
    x, g = torch.randn(16, 64), torch.randn(16, 8)
    _, _, (gw, _) = grads(sparse, x, g)
    masked, _ = masked_reference(x, 0.5)
    expected = g.T @ masked
    # 8-bit symmetric codes: each kept value within half a step (max|x|/254) of x.
    step = masked.abs().amax(1, keepdim=True) / 127
    bound = (g.abs().T @ (step / 2).expand_as(masked)) * (masked != 0).any(0)
    assert ((gw - expected).abs() <= bound + 1e-5).all()


def test_refusals():
    with pytest.raises(ActdesignError, match="ratio must be"):
        SparseLinear(4, 4, ratio=1.0)
    with pytest.raises(ActdesignError, match="needs an nn.Linear"):
        SparseLinear.from_module(nn.Conv2d(1, 1, 1))


CONVS = [  # (padding, padding mode, kernel, dilation, groups, stride, bias)
    (1, "zeros", (3, 3), 1, 1, 2, True), ((1, 2), "zeros", (3, 5), 2, 4, 1, False),
    ("same", "zeros", (2, 2), 1, 1, 1, True), ("same", "zeros", (3, 5), 2, 8, 1, False),
    ("valid", "zeros", (3, 3), 1, 1, 1, True), (1, "reflect", (3, 3), 1, 4, 2, False),
    ((1, 2), "replicate", (2, 2), 1, 1, 1, True), ("same", "reflect", (2, 2), 1, 4, 1, True),
    (1, "circular", (3, 5), 2, 1, 1, False), ("same", "circular", (3, 3), 1, 8, 1, True)]


@pytest.mark.parametrize("padding, mode, kernel, dilation, groups, stride, bias", CONVS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_a_lean_conv_is_eager_conv_bit_for_bit(padding, mode, kernel, dilation, groups, stride,
                                               bias, channels_last, precision):
    """Every padding nn.Conv2d takes (numbers, "same", "valid"; zeros, reflect, replicate,
    circular), dilation, groups and stride: the output and all three gradients, values and
    memory format, are eager's."""
    from actdesign.runtime.ops.compressed import LeanConv2d

    torch.manual_seed(0)
    ref = nn.Conv2d(8, 8, kernel, stride, padding, dilation, groups, bias, mode)
    ours = LeanConv2d.from_module(ref)
    x = torch.randn(2, 8, 11, 12)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    got = []
    for m in (ref, ours):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            y = m(xi)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
        got.append([t for t in (y, xi.grad, m.weight.grad, m.bias.grad if bias else None)
                    if t is not None])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_restored_input_is_freed_before_the_input_gradient_is_made(monkeypatch):
    """A Linear layer whose input is restored from codes takes its weight's gradient first
    and frees the restored input before making its input's (g @ W reads no x): the backward
    of the second layer holds one input-sized tensor less than with both gradients taken at
    once (its input's bytes, seen to within 2%: the codes' own buffers)."""
    from actdesign.runtime import compress
    from actdesign.runtime.memory import steps
    from actdesign.runtime.ops import compressed

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(2048, 64)
    compress(model, {"rules": [{"target": "linear", "apply": "actnn", "bits": 2}]},
             allow_more=True)
    layer = type(model[1])
    assert issubclass(layer, compressed.CompressedLinear)
    peaks = []
    for split in (True, False):
        monkeypatch.setattr(layer, "input_grad_reads_no_input", split)
        window = {"1": None}
        steps.step(model, x, "fp32", window_peaks=window)
        peaks.append(window["1"])
    held = x.numel() * x.element_size()  # the second layer's input: x's shape here
    assert held <= peaks[1] - peaks[0] <= 1.02 * held


def test_a_convolutions_input_gradient_makes_an_input_of_its_own():
    """Why a convolution keeps its restored input for both gradients: given a stand-in
    expanded from one zero in place of x, the CPU kernel makes it contiguous inside, an
    input-sized buffer (seen by the allocator, not by any op's outputs). Freeing x first
    would only hide the bytes from an op-level count."""
    from torch.profiler import ProfilerActivity, profile

    x, w, g = torch.randn(4, 16, 32, 32), torch.randn(16, 16, 3, 3), torch.randn(4, 16, 32, 32)

    def allocator_peak(source):
        def backward():
            torch.ops.aten.convolution_backward(g, source, w, None, [1, 1], [1, 1], [1, 1],
                                                False, [0, 0], 1, [True, False, False])
        backward()  # the kernel's one-off buffers first
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            backward()
        events = sorted((e.start_ns(), e.nbytes())
                        for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
        now = peak = 0
        for _, n in events:
            now += n
            peak = max(peak, now)
        return peak

    expanded = allocator_peak(torch.zeros(()).expand(x.shape))
    assert expanded - allocator_peak(x) >= x.numel() * x.element_size()
