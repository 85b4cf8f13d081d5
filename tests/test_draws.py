"""ActNN's stochastic rounding follows torch's generator: after `torch.manual_seed(s)` a step
draws the same codes, in one process or in two, and checkpointing's recompute, which replays
the generator, draws the codes of the step without it."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from actdesign.runtime import compress
from actdesign.runtime.models import example_batch, loss_of


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(x))))


class Net(nn.Module):
    """Two blocks with dropout, each checkpointed when asked, so draws interleave with masks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.checkpointing = None  # None, or use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.checkpointing is None else checkpoint(
                block, x, use_reentrant=self.checkpointing)
        return x.square().mean()


def net():
    torch.manual_seed(0)
    model = Net()
    compress(model, "actnn2")
    return model


def step_grads(model, seed=7, autocast=False) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(16, 64, requires_grad=True)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x)
    loss.backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


def test_a_seeded_step_draws_the_same_codes_each_time():
    model = net()
    first, again = step_grads(model), step_grads(model)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    other = step_grads(model, seed=8)  # another seed, other codes (and masks)
    assert not torch.equal(first[1], other[1])


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_recomputes_the_same_codes(use_reentrant, autocast):
    """The recompute replays the generator, so it draws what the step without checkpointing
    drew: the gradients are bit for bit those of the plain step, in bf16 autocast too."""
    model = net()
    plain = step_grads(model, autocast=autocast)
    model.checkpointing = use_reentrant
    for a, b in zip(plain, step_grads(model, autocast=autocast), strict=True):
        assert torch.equal(a, b)


def test_a_seeded_llm_step_is_the_same_in_another_process():
    """llm+actnn2 on a tiny LLaMA with dropout: two seeded steps of one model here, and of
    another in a fresh process, give the same loss and gradients, bit for bit."""
    code = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_draws import llm_steps
print(json.dumps(llm_steps()))
"""
    here = llm_steps()
    assert here[0] == here[1]
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", code.format(tests=tests)], capture_output=True,
                         text=True, timeout=600, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def llm_steps(seed=3) -> list[list[float]]:
    """The loss and a float64 digest of every gradient of two steps of one llm+actnn2 model,
    each after torch.manual_seed(seed)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config).train()
    compress(model, "llm+actnn2")
    batch = example_batch(model, 2, 16)
    steps = []
    for _ in range(2):
        torch.manual_seed(seed)
        model.zero_grad()
        loss = loss_of(model(**batch))
        loss.backward()
        digests = [float(p.grad.double().square().sum()) + float(p.grad.double().sum())
                   for p in model.parameters() if p.grad is not None]
        steps.append([loss.item()] + digests)
    return steps
