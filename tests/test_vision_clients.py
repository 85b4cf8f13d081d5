"""The `cnn` preset in the ways vision users train: timm's own gradient checkpointing,
torch.compile with fullgraph, fp16 autocast with a GradScaler and AdamW over several steps,
channels_last. Each run is the untouched model's, to the bit."""

import copy

import timm
import torch
from torch import nn

from actdesign.runtime import compress


def _train(model, x, steps, autocast=None, scaler=None):
    """The parameters and buffers after `steps` AdamW steps on a fixed batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        torch.manual_seed(i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(x).float().square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _same(a, b):
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


def test_timm_gradient_checkpointing_trains_as_the_untouched_model():
    """Inside timm's checkpoints the chains step aside (the checkpoint keeps the block's
    input alone, and checks that its recomputation saves what the forward did)."""
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).train()
    x = torch.randn(2, 3, 32, 32)
    ours = copy.deepcopy(model)
    compress(ours, "cnn", x)
    for m in (model, ours):
        m.set_grad_checkpointing(True)
    _same(_train(model, x, 2), _train(ours, x, 2))


def test_fp16_autocast_with_a_grad_scaler_and_bf16_autocast_train_as_the_untouched_model():
    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", num_classes=10).train()
    x = torch.randn(4, 3, 96, 96).contiguous(memory_format=torch.channels_last)
    model = model.to(memory_format=torch.channels_last)
    ours = copy.deepcopy(model)
    compress(ours, "cnn", x[:2])
    for dtype, scaler in ((torch.float16, lambda: torch.amp.GradScaler("cpu", init_scale=256)),
                          (torch.bfloat16, lambda: None)):
        eager, compressed = copy.deepcopy(model), copy.deepcopy(ours)
        _same(_train(eager, x, 3, dtype, scaler()), _train(compressed, x, 3, dtype, scaler()))


def test_torch_compile_with_fullgraph_takes_the_compressed_model_without_a_break():
    """Under the compiler the chains step aside (it decides what to keep): one graph, the
    eager model's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                        nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    x = torch.randn(2, 3, 16, 16)
    ours = copy.deepcopy(net)
    assert compress(ours, "cnn", x).replaced
    _same(_train(torch.compile(net, fullgraph=True), x, 1),
          _train(torch.compile(ours, fullgraph=True), x, 1))


def test_one_block_recomputed_reads_its_input_whole_in_both_passes():
    """A checkpointed block whose input carries the block before's recipe: under the step's
    own saved-tensor hooks (as estimate and plan run it) the recompute did not find it where
    the forward took it, saved fewer tensors, and the checkpoint refused. Inside a
    checkpoint no reader takes a chain's recipe made outside."""
    from actdesign.runtime.memory.steps import step

    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).train()
    x = torch.randn(2, 3, 32, 32)
    ours = copy.deepcopy(model)
    compress(ours, {"format": "actdesign.policy/1", "rules": [
        {"target": "block", "name": "layer3.0", "apply": "checkpoint"},
        {"target": "channel_norm", "apply": "chain"}, {"target": "activation", "apply": "chain"},
        {"target": "pool", "apply": "chain"}, {"target": "conv2d", "apply": "lean"}]}, x,
        allow_more=True)
    for m in (model, ours):
        step(m, x, "fp32")
    _same({n: p.grad for n, p in model.named_parameters()},
          {n: p.grad for n, p in ours.named_parameters()})
