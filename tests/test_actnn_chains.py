"""`actnn2` on convolutional networks: every saved tensor of a chain compressed, so the full
tensors are freed. A batch norm keeps 2-bit codes of its input (forward and running
statistics eager's), a ReLU a 1-bit mask (exact), a max pool a byte per output."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from actdesign.runtime import compress
from actdesign.runtime.apply.accounting import account

sys.path.insert(0, str(Path(__file__).parent))
from convnets import trained_like  # noqa: E402


def _bn_step(model, x):
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    return out.detach(), x.grad, [p.grad for p in model.parameters()], list(model.buffers())


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_batch_norm_with_codes_runs_eagers_forward_and_a_gradient_within_its_step(layout):
    torch.manual_seed(0)
    eager = nn.Sequential(trained_like(nn.BatchNorm2d(8))).train()
    ours = copy.deepcopy(eager)
    rules = {"rules": [{"target": "channel_norm", "apply": "actnn", "bits": 8}]}
    assert compress(ours, rules).replaced
    x = torch.randn(4, 8, 6, 6) * 3 + 1
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    want, got = _bn_step(eager, x), _bn_step(ours, x)
    assert torch.equal(want[0], got[0])  # the forward
    assert all(torch.equal(a, b) for a, b in zip(want[3], got[3], strict=True))  # statistics
    # 8-bit codes: x within 1/255 of its group's range, so x̂ within about 1/255 of the
    # range of x̂ (12 here): the gradients move by that fraction of their size, 1/255 * 12
    for a, b in zip((want[1], want[2][0]), (got[1], got[2][0]), strict=True):
        assert (a - b).abs().max() <= 12 / 255 * a.abs().max()
        assert not torch.equal(a, b)  # the codes are read, not x
    assert torch.equal(want[2][1], got[2][1])  # β's gradient reads no x


def test_a_relu_keeps_a_one_bit_mask_with_eagers_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    ours = copy.deepcopy(model)
    report = compress(ours, {"rules": [{"target": "activation", "apply": "fewbit", "bits": 3}]})
    assert "1-bit" in report.replaced[0].new
    x = torch.randn(2, 3, 10, 10)  # no input of the ReLU is exactly 0
    want, got = _bn_step(model, x), _bn_step(ours, x)
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))


def test_actnn2_frees_the_full_tensors_of_a_resnet():
    """On a ResNet every tensor is compressed: ActNN's own bits (2 per element of a conv's or
    a norm's input, 1 per ReLU's), about an eighth of eager's 32 + 32 per element or less."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(4, 3, 64, 64)
    ours = copy.deepcopy(model)
    report = compress(ours, "actnn2", x[:2])
    assert report.skipped == []
    saved = [account(m, lambda m=m: m(x))[0].total for m in (model, ours)]
    assert saved[1] <= saved[0] / 8
    ours(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.parametrize("precision", ["autocast", "bf16 weights"])
def test_a_batch_norm_with_codes_keeps_eagers_forward_in_bf16(precision):
    """bf16 as users train: the codes hold a bf16 input and restore it as bf16; the forward
    and the running statistics stay eager's bits, the gradients move by the code step plus
    bf16's own rounding of the restored input (2^-8 of its size)."""
    torch.manual_seed(0)
    # no conv bias, as before every batch norm: its exact gradient is 0, a batch norm's
    # input gradient summing to 0 per channel, so both runs' values are rounding noise
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False),
                          trained_like(nn.BatchNorm2d(8))).train()
    if precision == "bf16 weights":
        eager = eager.to(torch.bfloat16)
    ours = copy.deepcopy(eager)
    rules = {"rules": [{"target": "channel_norm", "apply": "actnn", "bits": 8}]}
    assert compress(ours, rules).replaced
    x = torch.randn(4, 3, 10, 10, dtype=next(eager.parameters()).dtype) * 3 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        want, got = _bn_step(eager, x), _bn_step(ours, x)
    assert want[0].dtype == torch.bfloat16
    assert torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(want[3], got[3], strict=True))
    step = 12 / 255 + 2 ** -8
    for a, b in zip((want[1], *want[2]), (got[1], *got[2]), strict=True):
        assert (a.float() - b.float()).abs().max() <= step * a.float().abs().max()
    assert not torch.equal(want[1], got[1])  # the codes are read, not x


def test_a_batch_norm_keeps_codes_of_its_normalized_input():
    """Small maps put several channels in one 256-element group, and channels differ in mean
    and scale (offsets up to 150, deviations from 0.1 to 10 here). The codes hold x̂, whose
    channels all have unit scale: x̂ comes back within one 2-bit step of its group's range
    (at most a third of x̂'s own range), so each gradient moves by at most what that step
    gives through eager's formula. Codes of x would take the step of the widest channel."""
    torch.manual_seed(0)
    eager = nn.Sequential(trained_like(nn.BatchNorm2d(16))).train()
    ours = copy.deepcopy(eager)
    assert compress(ours, {"rules": [{"target": "channel_norm", "apply": "actnn",
                                       "bits": 2}]}).replaced
    scale = torch.logspace(-1, 1, 16).view(1, -1, 1, 1)
    offset = torch.linspace(0, 150, 16).view(1, -1, 1, 1)
    x = torch.randn(4, 16, 4, 4) * scale + offset  # 16 elements a channel: 16 channels a group
    want, got = _bn_step(eager, x), _bn_step(ours, x)
    assert torch.equal(want[0], got[0])
    dims = (0, 2, 3)
    xhat = (x - x.mean(dims, keepdim=True)) * (x.var(dims, unbiased=False, keepdim=True)
                                                 + 1e-5).rsqrt()
    step = (xhat.amax() - xhat.amin()) / 3
    g = torch.linspace(-1, 1, x.numel()).view(x.shape)
    gamma = eager[0].weight.detach().view(1, -1, 1, 1)
    invstd = (x.var(dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    # eager's grad_x = invstd·γ·(g - mean g - x̂·mean(g·x̂)), and x̂ off by e, |e| <= step:
    # x̂·mean(g·x̂) moves by at most step·mean|g|·(2·max|x̂| + step); γ's gradient, sum(g·x̂),
    # by step·sum|g|. Round-off on top: float32 sums of a few hundred terms.
    mean_g = g.abs().mean(dims, keepdim=True)
    bound_x = invstd * gamma.abs() * step * mean_g * (2 * xhat.abs().amax() + step)
    bound_gamma = step * g.abs().sum(dims)
    assert ((want[1] - got[1]).abs() <= bound_x * 1.001 + 1e-4).all()
    assert ((want[2][0] - got[2][0]).abs() <= bound_gamma * 1.001 + 1e-4).all()
    assert not torch.equal(want[1], got[1])


def test_a_table_is_left_out_where_its_reader_keeps_what_the_activation_keeps():
    """A ReLU keeps its output, which the convolution reading it keeps too: a 1-bit code of it
    would add bytes, so `fewbit` leaves that ReLU alone and says why. The last ReLU's output
    is read by the average pool, which keeps nothing: its code frees the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).train()
    x = torch.randn(2, 3, 12, 12)
    ours = copy.deepcopy(model)
    report = compress(ours, "fewbit3", x)
    assert [r.name for r in report.replaced] == ["3"]
    assert [(name, "keeps whole anyway" in why) for name, _, why in report.skipped] == [("1", True)]
    saved = [account(m, lambda m=m: m(x))[0].total for m in (model, ours)]
    assert saved[1] < saved[0]
    # with the convolutions coded, nothing else keeps the first ReLU's output: it is coded too
    report = compress(copy.deepcopy(model), "actnn2", x)
    assert {"1", "3"} <= {r.name for r in report.replaced}


def _kept_by_convs(model, x):
    saved = account(model, lambda: model(x))[0]
    return {name: n for name, n in saved.by_module.items()
            if isinstance(model.get_submodule(name), nn.Conv2d) and n}


def test_the_readers_of_one_tensor_keep_one_set_of_codes():
    """A block's input is read by its first conv and its shortcut conv: one set of codes,
    kept by both (the shortcut keeps no bytes of its own)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64)
    compress(model, "actnn2", x)
    kept = _kept_by_convs(model, x)
    assert "layer2.0.conv1" in kept and "layer2.0.downsample.0" not in kept
    assert "layer2.0.conv2" in kept  # actnn2 alone: each conv keeps its input's own codes


def test_a_chain_of_codes_keeps_each_tensor_once():
    """cnn+actnn2: a batch norm's readers make its output again from its codes of x̂ (and a
    ReLU's from its mask), a block's output from its norms' codes and its shortcut's: only
    the first block's input is kept as a convolution's own codes (the image's are the
    caller's). The rest is the norms' codes, the ReLUs' masks and the max pool's offsets."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64)
    alone = copy.deepcopy(model)
    compress(alone, "actnn2", x)
    report = compress(model, "cnn+actnn2", x)
    assert "make its output again from them" in next(r.new for r in report.replaced
                                                      if r.name == "bn1")
    assert set(_kept_by_convs(model, x)) == {"conv1", "layer1.0.conv1"}
    saved = [account(m, lambda m=m: m(x))[0].total for m in (alone, model)]
    assert saved[1] < saved[0] * 0.8


def test_a_chain_of_codes_gives_an_unbiased_weight_gradient():
    """The last conv reads a residual block's output, made again in its backward from the
    second norm's codes of x̂, the ReLU's mask and the codes of the block's input (kept by its
    first conv): linear in the codes, whose rounding is unbiased, so its weight gradient's
    mean over draws is eager's: the squared z-scores of the mean average about 1 (a
    chi-square over the weight's entries), none beyond 5.5. 4-bit codes keep the noise small
    enough that a bias of 1% in the rebuilt tensor shows."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                          trained_like(torchvision.models.resnet.BasicBlock(8, 8)),
                          nn.Conv2d(8, 8, 3)).train()
    ours = copy.deepcopy(eager)
    x = torch.randn(4, 3, 8, 8)
    compress(ours, {"rules": [
        {"target": "conv2d", "apply": "actnn", "bits": 4},
        {"target": "channel_norm", "apply": "actnn", "bits": 4},
        {"target": "activation", "apply": "fewbit", "bits": 1},
        {"target": "channel_norm", "apply": "chain"}]}, x)
    assert set(_kept_by_convs(ours, x)) == {"0", "1.conv1"}  # the image's codes, the block's
    grad = torch.linspace(-1, 1, 4 * 8 * 6 * 6).view(4, 8, 6, 6)

    def last_weight_grad(model, seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        model(x).backward(grad)
        return model[2].weight.grad.clone()

    want = last_weight_grad(eager, 0).double()
    draws = torch.stack([last_weight_grad(ours, s) for s in range(200)]).double()
    assert not torch.equal(draws[0], want)  # made from codes
    z = (draws.mean(0) - want) / (draws.std(0) / len(draws) ** 0.5)
    assert z.square().mean() <= 1 + 5 * (2 / z.numel()) ** 0.5
    assert z.abs().max() <= 5.5


@pytest.mark.parametrize("conv", [{"apply": "lean"}, {"apply": "actnn", "bits": 4}])
def test_a_reader_takes_codes_no_coarser_than_its_own(conv):
    """An exact convolution never keeps a recipe made from codes (its gradient stays eager's),
    nor does one keeping 4-bit codes take a norm's 2-bit ones: each keeps its own."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3), trained_like(nn.BatchNorm2d(8)), nn.ReLU(),
                          nn.Conv2d(8, 4, 3)).train()
    ours = copy.deepcopy(eager)
    x = torch.randn(2, 3, 10, 10)
    compress(ours, {"rules": [{"target": "channel_norm", "apply": "actnn", "bits": 2},
                              {"target": "channel_norm", "apply": "chain"},
                              {"target": "activation", "apply": "fewbit", "bits": 1},
                              {"target": "conv2d", **conv}]}, x)
    assert "3" in _kept_by_convs(ours, x)
    if conv["apply"] == "lean":
        assert torch.equal(_bn_step(eager, x)[2][-2], _bn_step(ours, x)[2][-2])


def test_a_relus_mask_passes_an_exact_recipe_on_exactly():
    """A ReLU under its 1-bit table, after a lossless chain's batch norm: the next conv keeps
    the norm's input and the mask, not the ReLU's output, and every gradient is eager's."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3), trained_like(nn.BatchNorm2d(8)), nn.ReLU(),
                          nn.Conv2d(8, 4, 3)).train()
    ours = copy.deepcopy(eager)
    x = torch.randn(2, 3, 10, 10)
    compress(ours, {"rules": [{"target": "channel_norm", "apply": "chain"},
                              {"target": "activation", "apply": "fewbit", "bits": 1},
                              {"target": "conv2d", "apply": "lean"}]}, x)
    assert "3" not in _kept_by_convs(ours, x)
    want, got = _bn_step(eager, x), _bn_step(ours, x)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))


@pytest.mark.parametrize("precision", ["autocast", "bf16 weights"])
def test_a_chain_of_codes_in_bf16(precision):
    """bf16 as users train: the forward stays eager's bits, the convolutions still keep no
    codes of their own (the recipes make bf16 tensors from the norms' bf16 codes), and the
    step's gradients are finite."""
    torch.manual_seed(0)
    eager = trained_like(torchvision.models.resnet18(num_classes=10)).train()
    if precision == "bf16 weights":
        eager = eager.to(torch.bfloat16)
    ours = copy.deepcopy(eager)
    x = torch.randn(2, 3, 32, 32, dtype=next(eager.parameters()).dtype)
    compress(ours, "cnn+actnn2", x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        assert set(_kept_by_convs(ours, x)) == {"conv1", "layer1.0.conv1"}
        want, got = _bn_step(eager, x), _bn_step(ours, x)
    assert want[0].dtype == torch.bfloat16 and torch.equal(want[0], got[0])
    assert all(torch.isfinite(g).all() for g in got[2])
