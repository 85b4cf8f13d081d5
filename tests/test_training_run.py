"""Lossless means the same training run: a model compressed with a lossless preset keeps its
parameters (names, values, order, objects), so the optimizer, weight decay, gradient clipping
and checkpoints see what they would have seen, and 20 steps of AdamW follow the untouched
model's steps."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from actdesign.runtime import compress, models

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from lms import NAMES, architecture, perturb_norms  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable`:FutureWarning")
BUILTINS = ("llama-tiny", "qwen2-tiny", "gpt2-tiny", "bert-tiny", "vit-tiny")
SETUPS = ("msnorm", "llm", "llm+checkpointing")


def model_named(name):
    model = architecture(name) if name in NAMES else models.build(name)[0].train()
    return perturb_norms(model)


def batch(model, step, seq=16):
    inputs = models.example_batch(model, 2, seq, seed=step)
    if "input_ids" in inputs and "labels" in inputs:
        inputs["labels"][0, : step % 5] = -100  # padded labels, a different count each step
    return inputs


def train(model, steps=20, dtype=None):
    """Per-step losses of AdamW with weight decay and gradient clipping."""
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        loss = model(**batch(model, step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def zero_gradient(name, model):
    """Parameters whose exact gradient is zero: a key projection's bias (softmax ignores a
    shift shared by a row). In float32 their gradient is rounding noise, which AdamW turns
    into steps of the learning rate's size, different in any two runs that round differently.
    Returns a mask of the elements to compare, or None for all."""
    if name.endswith(("k_proj.bias", "attention.self.key.bias")):
        return False
    if name.endswith("c_attn.bias"):  # GPT-2: q, k and v biases in one; k is the middle third
        mask = torch.ones(3, model.config.n_embd, dtype=torch.bool)
        mask[1] = False
        return mask.flatten()
    if name.endswith("query_key_value.bias"):  # GPT-NeoX: per head, q, k and v interleaved
        heads = model.config.num_attention_heads
        mask = torch.ones(heads, 3, model.config.hidden_size // heads, dtype=torch.bool)
        mask[:, 1] = False
        return mask.flatten()
    return None


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", BUILTINS + NAMES)
def test_twenty_steps_are_the_untouched_models_steps(name, setup):
    model = model_named(name)
    ours = copy.deepcopy(model)
    report = compress(ours, setup.split("+")[0])
    assert report.replaced
    if setup.endswith("checkpointing"):
        for m in (model, ours):
            m.gradient_checkpointing_enable()
    before = [(n, p.clone()) for n, p in model.named_parameters()]
    expected, got = train(model), train(ours)
    # Per step, float32 rounding only: the same function of the same parameters.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for (n, a), (_, b), (_, start) in zip(model.named_parameters(), ours.named_parameters(),
                                          before, strict=True):
        assert not torch.equal(a, start) or a.grad is None, n  # it trained
        keep = zero_gradient(n, model)
        if keep is False:
            continue
        a, b = (a, b) if keep is None else (a.flatten()[keep], b.flatten()[keep])
        assert (a - b).norm() <= 1e-4 * a.norm(), n


@pytest.mark.parametrize("name", BUILTINS + NAMES)
@pytest.mark.parametrize("policy", ["msnorm", "llm", "llm+actnn2", "fewbit3+msnorm+actnn2"])
def test_the_state_dict_is_the_untouched_models(name, policy):
    model = model_named(name)
    ours = copy.deepcopy(model)
    compress(ours, policy)
    want, got = model.state_dict(), ours.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [p.requires_grad for p in ours.parameters()] == \
        [p.requires_grad for p in model.parameters()]
    # Either way round, a checkpoint loads strictly and gives the same function.
    plain = model_named(name)
    plain.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(model.state_dict(), strict=True)
    inputs = batch(model, 0)
    model.eval(), ours.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).loss, model(**inputs).loss, rtol=0, atol=0)
        torch.testing.assert_close(ours(**inputs).loss, model(**inputs).loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_bf16_weights_follow_the_untouched_bf16_run_within_its_rounding(name):
    """With bfloat16 weights the MS norm's forward rounds as LLaMA's norm does (x̂ to bf16,
    then γ·x̂ once), and the Linear layers are the same products: the first forward is
    bit-identical. The backward sums in another order, so the runs part by rounding: each bf16
    run is its rounding away from the float32 run, so the two are at most twice the eager bf16
    run's distance from it apart (the triangle inequality)."""
    model = model_named(name)
    ours = copy.deepcopy(model).bfloat16()
    compress(ours, "msnorm")
    inputs = batch(model, 0)
    with torch.no_grad():
        want = model.bfloat16()(**inputs).logits
        assert torch.equal(ours(**inputs).logits, want)
    fp32 = train(model_named(name))
    eager16, ours16 = train(model), train(ours)
    assert (ours16 - eager16).abs().max() <= 2 * (eager16 - fp32).abs().max()
    assert (ours16 - eager16).abs().max() <= 0.05 * eager16.abs().max()  # bf16: 2^-8 a step
