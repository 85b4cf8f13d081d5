"""The `cnn` preset on the convolutional networks vision users train (torchvision, timm and
transformers, random weights): one tensor kept per norm, and the training step eager's to the
bit: forward, gradients and running statistics, in fp32, under bf16 and fp16 autocast, with
bf16 weights and channels_last."""

import contextlib
import copy
import gc
import sys
from pathlib import Path

import pytest
import timm
import torch
import torchvision
import transformers
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

from actdesign.errors import ActdesignError
from actdesign.runtime import compress
from actdesign.runtime.apply.accounting import account

sys.path.insert(0, str(Path(__file__).parent))
from convnets import trained_like  # noqa: E402


def _tv(name, **kwargs):
    return lambda: getattr(torchvision.models, name)(num_classes=10, **kwargs)


def _hf(config):
    return lambda: transformers.AutoModelForImageClassification.from_config(config)


MODELS = {
    "tv-resnet18": _tv("resnet18"),
    "tv-resnet50": _tv("resnet50"),
    "tv-mobilenet_v2": _tv("mobilenet_v2"),
    "tv-mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "tv-efficientnet_b0": _tv("efficientnet_b0"),
    "tv-convnext_tiny": _tv("convnext_tiny"),
    "tv-resnet18-frozen-bn": _tv("resnet18", norm_layer=FrozenBatchNorm2d),
    "tv-resnet18-group-norm": _tv("resnet18", norm_layer=lambda c: nn.GroupNorm(8, c)),
    "timm-resnet18": lambda: timm.create_model("resnet18", num_classes=10),
    "timm-efficientnet_b0": lambda: timm.create_model("efficientnet_b0", num_classes=10),
    "timm-convnext_atto": lambda: timm.create_model("convnext_atto", num_classes=10),
    "timm-regnety_002": lambda: timm.create_model("regnety_002", num_classes=10),
    "hf-resnet": _hf(transformers.ResNetConfig(depths=[1, 1, 1, 1], num_labels=10)),
    "hf-convnext": _hf(transformers.ConvNextConfig(depths=[1, 1, 1, 1],
                                                   hidden_sizes=[16, 32, 64, 128],
                                                   num_labels=10)),
    "hf-swin": _hf(transformers.SwinConfig(image_size=32, patch_size=4, window_size=4,
                                           embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                           num_labels=10)),
    "hf-vit": _hf(transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, num_labels=10)),
}


def _step(model, x, *, autocast=None, seed=1):
    """(bytes saved for backward, output, gradients, buffers) of one training step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # stochastic depth draws the same
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        saved, out = account(model, lambda: model(x))
    out = getattr(out, "logits", out)
    out.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return saved.total, out.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _same_step(eager, ours, x, autocast=None):
    saved_eager, *want = _step(eager, x, autocast=autocast)
    saved_ours, *got = _step(ours, x, autocast=autocast)
    assert _equal(want[0], got[0]), "forward"
    assert want[1].keys() == got[1].keys()
    assert [n for n in want[1] if not _equal(want[1][n], got[1][n])] == []
    assert [n for n in want[2] if not _equal(want[2][n], got[2][n])] == []
    return saved_ours / saved_eager


def _equal(a, b):
    """The same values, a NaN where eager's has one (an fp16 overflow is eager's too)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def _compressed(name, *, dtype=None, channels_last=False, train=True, size=32):
    torch.manual_seed(0)
    eager = trained_like(MODELS[name]()).train(train)
    x = torch.randn(2, 3, size, size)
    if dtype is not None:
        eager, x = eager.to(dtype), x.to(dtype)
    if channels_last:
        eager, x = eager.to(memory_format=torch.channels_last), \
            x.contiguous(memory_format=torch.channels_last)
    ours = copy.deepcopy(eager)
    report = compress(ours, "cnn", example_inputs=x)
    assert [why for _, _, why in report.skipped] == []
    return eager, ours, x


@pytest.mark.parametrize("name", MODELS)
def test_a_training_step_is_eagers_bit_for_bit_and_keeps_less(name):
    eager, ours, x = _compressed(name)
    assert _same_step(eager, ours, x) < 1
    assert _same_step(eager, ours, x) < 1  # a second step, from the updated statistics


@pytest.mark.parametrize("name", ["tv-resnet18", "tv-efficientnet_b0", "tv-convnext_tiny",
                                  "timm-efficientnet_b0", "hf-convnext"])
@pytest.mark.parametrize("setting", ["bf16-autocast", "fp16-autocast", "bf16-weights",
                                     "channels_last", "eval"])
def test_every_precision_and_layout_is_eagers_bit_for_bit(name, setting):
    eager, ours, x = _compressed(
        name, dtype=torch.bfloat16 if setting == "bf16-weights" else None,
        channels_last=setting == "channels_last", train=setting != "eval",
        size=96 if setting == "fp16-autocast" else 32)  # smaller maps overflow fp16 in eager
    autocast = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}.get(setting)
    _same_step(eager, ours, x, autocast=autocast)


@pytest.mark.parametrize(("name", "most"), [("tv-resnet50", 0.6), ("tv-efficientnet_b0", 0.4),
                                            ("tv-mobilenet_v2", 0.4),
                                            ("timm-efficientnet_b0", 0.4)])
def test_the_lossless_preset_keeps_what_its_goal_allows(name, most):
    """Saved bytes against eager's (storages once, parameters and buffers left out)."""
    eager, ours, x = _compressed(name, size=64)
    assert _same_step(eager, ours, x) <= most


def test_compress_leaves_the_running_statistics_as_they_were():
    model = trained_like(torchvision.models.resnet18(num_classes=10)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    compress(model, "cnn", example_inputs=torch.randn(2, 3, 32, 32))
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())


def test_compressing_twice_changes_nothing_more():
    """A second `compress` with the same preset finds every chain taken: nothing replaced,
    nothing left alone, and the step still eager's bit for bit."""
    eager, ours, x = _compressed("tv-resnet18")
    report = compress(ours, "cnn", example_inputs=x)
    assert (report.replaced, report.skipped) == ([], [])
    _same_step(eager, ours, x)


def test_joins_with_a_quantizing_preset():
    """cnn+actnn2: the quantized layers read the chains' recipes; the step still trains."""
    eager, _, x = _compressed("tv-resnet18")
    ours = copy.deepcopy(eager)
    report = compress(ours, "cnn+actnn2", example_inputs=x)
    assert not report.skipped
    saved, out, grads, _ = _step(ours, x)
    saved_eager, out_eager, grads_eager, _ = _step(eager, x)
    assert saved < saved_eager and torch.equal(out, out_eager)
    assert grads.keys() == grads_eager.keys()


@pytest.mark.parametrize(("module", "why"), [
    (nn.MaxPool2d(2, return_indices=True), "returns its indices"),
    (nn.MaxPool2d(17), "cells"),
    (nn.RReLU(), "draws at random"),
    (nn.MaxPool1d(2), "only nn.MaxPool2d"),
])
def test_what_a_chain_cannot_rebuild_is_left_alone_with_its_reason(module, why):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), module)
    report = compress(model, "cnn")
    assert [(name, why in reason) for name, _, reason in report.skipped] == [("2", True)]


def test_a_policy_that_keeps_more_is_refused_and_changes_nothing():
    """Back Razor keeping every value (ratio 0) keeps each value and its place: more than the
    tensor. The convolutions whose input nothing else keeps copy it, and the step keeps more:
    refused, naming where, unless asked for."""
    model = trained_like(torchvision.models.resnet18(num_classes=10)).train()
    x = torch.randn(2, 3, 64, 64)
    before = copy.deepcopy(model)
    policy = {"rules": [{"target": "conv2d", "apply": "backrazor", "ratio": 0.0}]}
    with pytest.raises(ActdesignError, match=r"keeps more .* more\), where layer1\.0\.conv1 "
                                             r"\(\+4\.0 KiB\), conv1 .*allow_more=True"):
        compress(model, policy, example_inputs=x)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    assert all("forward" not in m.__dict__ for m in model.modules())
    report = compress(copy.deepcopy(model), policy, example_inputs=x, dry_run=True)
    assert report.keeps_more() and "% more" in str(report)
    report = compress(model, policy, example_inputs=x, allow_more=True)
    assert report.keeps_more() and report.replaced


@pytest.mark.parametrize("policy", ["pooled2", "backrazor90"])
def test_a_conv_whose_input_another_op_keeps_whole_keeps_no_copy(policy):
    """On a ResNet each ReLU keeps its output, the next convolution's input: a pooled or
    sparse copy of it would add bytes. Those convolutions stay exact (lean); the others copy."""
    model = trained_like(torchvision.models.resnet18(num_classes=10)).train()
    x = torch.randn(2, 3, 64, 64)
    report = compress(model, policy, example_inputs=x)
    words = {c.name: c.new for c in report.replaced}
    assert "kept whole by another op" in words["layer1.0.conv2"]
    assert "kept whole" not in words["conv1"]  # the image: no other op keeps it
    assert report.after.total < report.before.total


def test_a_step_makes_no_reference_cycle_holding_a_tensor():
    """What a step keeps is freed when the backward is done, not when the garbage collector
    happens to run (the peak would depend on it)."""
    eager, ours, x = _compressed("tv-resnet18")
    while gc.collect():  # an earlier test's garbage (torch.compile's tracing tensors)
        pass
    gc.disable()
    try:
        ours(x).square().mean().backward()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert held == []


def test_a_recipe_writes_in_place_only_into_what_it_made():
    """Rebuilding y + x, y = 2x made again from x: the add writes into the y it made (one
    tensor fewer alive), never into the leaf x, and gives the out-of-place add's bits."""
    from actdesign.runtime.ops.chains import build, leaf_recipe, offer_recipe, recipe_of

    x = torch.randn(3, 5)
    y = x * 2
    offer_recipe(y, leaf_recipe(torch.mul, (x, 2)))
    before = x.clone()
    for args in ((y, x), (x, y)):  # the first argument made, then a leaf
        z = torch.add(*args)
        offer_recipe(z, build(torch.add, args))
        recipe, leaves = recipe_of(z)
        assert torch.equal(recipe(None, *leaves), z)
        assert torch.equal(x, before)
