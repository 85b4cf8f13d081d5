"""A compressed model saved whole (torch.save) loads and trains in a fresh process whose op
cache is empty, as on another machine: its ops are made again from the specs it carries. The
loaded model saves the same bytes for backward, by module, and takes the same two optimizer
steps as the original, bit for bit: the same code runs on the same numbers. Real torch,
transformers and PEFT; every policy preset."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from actdesign.runtime import account, compress, models
from actdesign.runtime.apply import policy as policy_mod

HERE = Path(__file__).parent


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    return model, (torch.randn(8, 16),)


def convnet():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    return model, (torch.randn(2, 3, 12, 12),)


def causal_lm():
    pytest.importorskip("transformers")
    model = models.build("llama-tiny")[0].train()
    return model, models.example_batch(model, 2, 16)


def lora_lm():
    peft = pytest.importorskip("peft")
    model, inputs = causal_lm()
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B drawn, not PEFT's zeros: every adapter gradient is nonzero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model, inputs


CASES = {"fewbit3": mlp, "regelu2": mlp, "msnorm": mlp, "actnn2": mlp, "backrazor90": mlp,
         "pooled2": convnet, "llm": causal_lm, "llm+actnn2": causal_lm, "peft-llm": lora_lm,
         "recomputed-llm+actnn2": causal_lm}
# cases whose policy is not their name: the decoder layers recomputed, on top of llm+actnn2
POLICIES = {"peft-llm": "llm",
            "recomputed-llm+actnn2": {"rules": [
                *policy_mod.load("llm+actnn2").to_dict()["rules"],
                {"target": "block", "apply": "checkpoint"}]}}


def train(model, inputs) -> dict:
    """Two seeded SGD steps: the saved bytes by module, the losses and the trained weights."""
    torch.manual_seed(3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = {"losses": []}
    for i in range(2):
        opt.zero_grad()
        saved, result = account(model, lambda: models.call(model, inputs))
        loss = models.loss_of(result) if isinstance(inputs, dict) else result.square().mean()
        loss.backward()
        opt.step()
        out["losses"].append(loss.detach())
        if i == 0:
            out["saved"] = saved.by_module
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# Run in the fresh process: load the model, train it, save what train() returns.
CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_pickle import train
model = torch.load(sys.argv[2], weights_only=False)
inputs = torch.load(sys.argv[3], weights_only=False)
torch.save(train(model, inputs), sys.argv[4])
"""


@pytest.mark.parametrize("preset", list(CASES))
def test_a_pickled_compressed_model_trains_in_a_fresh_process_with_an_empty_cache(
        preset, tmp_path):
    model, inputs = CASES[preset]()
    policy = POLICIES.get(preset, preset)
    report = compress(model, policy, None if isinstance(inputs, dict) else inputs)
    assert report.replaced
    torch.save(model, tmp_path / "model.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    want = train(model, inputs)

    cache = tmp_path / "empty-cache"
    env = {**os.environ, "ACTDESIGN_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(HERE), str(tmp_path / "model.pt"),
         str(tmp_path / "inputs.pt"), str(tmp_path / "got.pt")],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt", weights_only=False)

    assert got["saved"] == want["saved"]  # the compressed paths ran, each one
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert torch.equal(a, b)
    assert got["weights"].keys() == want["weights"].keys()
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    assert not (cache / "tables").exists()  # made from the specs carried, nothing fitted
