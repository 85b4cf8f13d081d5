"""The planner on conv nets: it builds on the lossless `cnn`, its sites are the chains ActNN's
codes join (a norm's codes, the masks after it and the convs rebuilding their input from
them: one choice of bits), and at `cnn+actnn2`'s peak it plans less gradient error, measured,
whose real step fits."""

import copy
import sys
from dataclasses import replace
from pathlib import Path

import timm
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

sys.path.insert(0, str(Path(__file__).parent))
from convnets import trained_like  # noqa: E402

from actdesign.runtime import compress  # noqa: E402
from actdesign.runtime.apply import policy as policy_mod  # noqa: E402
from actdesign.runtime.memory import cards, planner  # noqa: E402
from actdesign.runtime.memory.steps import step  # noqa: E402
from actdesign.runtime.methods import METHODS  # noqa: E402


def _resnet():
    torch.manual_seed(0)
    # trained-like norms: timm zero-initialises a block's last one, which makes every
    # gradient inside the block zero, and every option's error with it
    return trained_like(timm.create_model("resnet18", num_classes=10)).train()


def _images(batch, seed):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _names(site):
    return [*site.layers, *(n for n, _ in site.sources)]


def test_a_sites_norms_and_masks_are_the_chain_its_convs_rebuild_their_input_from():
    sites = planner.find_sites(_resnet(), _images(2, 0), "cnn")
    of = {name: s for s in sites for name in _names(s)}
    names = [n for s in sites for n in _names(s)]
    assert len(names) == len(set(names))  # each layer in one site: one rule names it
    # inside a block: its first norm, the ReLU after it and the conv reading that
    inner = of["layer1.0.conv2"]
    assert inner.layers == ("layer1.0.conv2",) and inner.block == "layer1.0"
    assert inner.sources == (("layer1.0.bn1", "channel_norm"), ("layer1.0.act1", "activation"))
    # a residual stream: the blocks' last norms and the shortcut's, their ReLUs, read by the
    # next blocks' first convs and the next stage's shortcut: one site across blocks
    stream = of["layer2.1.conv1"]
    assert stream.block is None
    assert set(stream.layers) == {"layer2.1.conv1", "layer3.0.conv1", "layer3.0.downsample.0"}
    assert {n for n, _ in stream.sources} == {"layer2.0.bn2", "layer2.0.act2",
                                              "layer2.0.downsample.1", "layer2.1.bn2",
                                              "layer2.1.act2"}
    # the stem's norm: its ReLU and the max pool read it, no conv: a norm's own site
    assert of["bn1"].kind == "channel_norm" and of["bn1"].sources == (("act1", "activation"),)


def test_only_the_joined_chain_saves_what_its_codes_replace():
    """A conv's codes alone save nothing (it keeps the norm's input, kept anyway), a norm's
    alone keep more (the exact conv keeps its input whole): the site's bits move together."""
    model, x = _resnet(), _images(4, 0)
    site = next(s for s in planner.find_sites(model, x, "cnn") if s.name.startswith("layer2.0.{"))
    shapes = planner.ShapeSteps(model, x, "fp32", "cpu")

    def saved(rules):
        return shapes.run(planner.policy_of(rules, "cnn")).saved.total

    lossless = saved([])
    joined = saved(planner.site_rules(site, "actnn", {"bits": 2}))
    conv_alone = saved(planner.site_rules(replace(site, sources=()), "actnn", {"bits": 2}))
    norm_alone = saved([{"target": "channel_norm", "name": "layer2.0.bn1", "apply": "actnn",
                         "bits": 2}])
    assert joined < lossless <= conv_alone < norm_alone


def test_a_norm_keeps_codes_only_where_it_is_a_batch_norm():
    actnn = METHODS["actnn"]
    assert actnn.takes(nn.BatchNorm2d(4)) and not actnn.takes(nn.GroupNorm(2, 4))


def test_at_the_joined_presets_peak_the_plan_has_less_error_and_its_real_step_fits():
    torch.manual_seed(0)  # torchvision's ResNet-10: a block a stage, one ReLU a block
    model = trained_like(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)).train()
    batches = [_images(2, 1 + i) for i in range(2)]
    example = _images(8, 0)
    costs = planner.measure_costs(model, batches, example, "fp32", cards.card("h200"), "cpu",
                                  "test", planner.Clock(None))
    assert costs.base == "cnn"
    preset = policy_mod.load("cnn+actnn2")
    budget = planner.ShapeSteps(model, example, "fp32", "cpu").run(preset).peak
    # its own modelled time, a plan's limit
    slowdown = planner.explain.preset_solution(costs, preset).time / costs.problem.base_time
    plan = planner.solve_verified(model, example, costs, budget, slowdown * (1 + 1e-9), "fp32",
                                  "cpu", planner.Clock(None))
    assert plan.solution.error > 0  # lossy: the lossless plans do not fit this budget
    assert costs.reference.error(plan.policy) < costs.reference.error(preset)
    trial = copy.deepcopy(model)
    compress(trial, plan.policy, allow_more=True)
    step(trial, example, "fp32")  # the ops' tables made once
    trial.zero_grad(set_to_none=True)
    assert step(trial, example, "fp32")[1] <= budget


def test_a_norm_with_a_zero_scale_is_named_before_planning():
    """timm's random initialisation zeroes each block's last norm: every gradient before it in
    the block is zero, and every option's error there with it, so the plan says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 64, 3)).train()
    nn.init.zeros_(model[4].weight)
    said = []
    planner.plan(model, [torch.randn(2, 3, 8, 8) for _ in range(2)], "1GiB", precision="fp32",
                 kernels="cpu", progress=said.append, explain=False)
    assert any("warning: 1 norm(s) have a zero scale (4, ...)" in line for line in said)
