"""`checkpoint`: named blocks recomputed in the backward. The gradients are those of the same
compressed model without recomputation, bit for bit, with dropout and ActNN's stochastic
rounding inside the blocks (the recompute replays the generators) and codes shared across a
block's boundary; a recomputed block keeps only its inputs; the model's names, parameters and
state dict are untouched; copies and pickles recompute too; the shape-only estimate follows."""

import copy
import functools
import inspect
import json
import os
import pickle
import sys

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import account, compress, models
from actdesign.runtime.apply import policy as P
from actdesign.runtime.memory.estimate import estimate
from actdesign.runtime.memory.steps import step
from actdesign.runtime.methods.targets import target_of
from actdesign.runtime.ops.recompute import is_checkpoint_forward

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli  # noqa: E402

pytest.importorskip("transformers")

RECOMPUTED = "recomputed in backward (checkpoint)"
CHECKPOINT = {"target": "block", "apply": "checkpoint"}


def llama():
    torch.manual_seed(0)
    config = models.config_of("llama-tiny")
    config.attention_dropout = 0.1  # LLaMA's only dropout: inside the block
    model = models.from_config("llama-tiny", config).train()
    return model, models.example_batch(model, 2, 12)


def gpt2():
    model = models.build("gpt2-tiny")[0].train()
    assert model.config.attn_pdrop > 0 and model.config.resid_pdrop > 0  # GPT-2's defaults
    return model, models.example_batch(model, 2, 12)


def stage(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                         nn.Dropout(0.1))


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(stage(3, 8), stage(8, 16), stage(16, 16), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 4)).train()
    return model, torch.randn(4, 3, 16, 16)


class Chain(nn.Module):
    """MS norms whose readers are across a block's boundary, each way: the first norm is
    outside and read inside block 0, block 0's last norm is read inside block 1, and block 1's
    by the head outside."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d),
            nn.LayerNorm(d)) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.norm(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def chain():
    torch.manual_seed(0)
    return Chain().train(), torch.randn(4, 7, 32)


def with_checkpoint(policy):
    return {"rules": [*P.load(policy).to_dict()["rules"], CHECKPOINT]}


def compressed_pair(build, policy):
    """(the model compressed by `policy`, a copy compressed by it and `checkpoint` on every
    block, the inputs, the copy's report)."""
    model, inputs = build()
    plain = copy.deepcopy(model)
    example = None if isinstance(inputs, dict) else (inputs,)
    compress(plain, policy, example)
    report = compress(model, with_checkpoint(policy), example)
    return plain, model, inputs, report


def train_step(model, inputs, seed, autocast=False):
    """(loss, {name: gradient}) of one seeded forward and backward."""
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = models.loss_of(models.call(model, inputs))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def recomputed(report):
    return [c.name for c in report.replaced if c.new == RECOMPUTED]


CASES = {"llama-llm+actnn2": (llama, "llm+actnn2", ["model.layers.0", "model.layers.1"]),
         "gpt2-fewbit3+msnorm+actnn2": (gpt2, "fewbit3+msnorm+actnn2",
                                        ["transformer.h.0", "transformer.h.1"]),
         "cnn-actnn2": (cnn, "actnn2", ["0", "1", "2"]),
         "cnn-pooled2": (cnn, "pooled2", ["0", "1", "2"]),
         "shared-codes-across-blocks": (chain, "fewbit3+msnorm+actnn2",
                                        ["blocks.0", "blocks.1"])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_gradients_are_bit_identical_to_the_model_without_recomputation(case, autocast):
    build, policy, blocks = CASES[case]
    plain, model, inputs, report = compressed_pair(build, policy)
    assert recomputed(report) == blocks
    assert not report.skipped
    steps = {}
    for seed in (5, 6):
        loss0, grads0 = train_step(plain, inputs, seed, autocast)
        loss1, grads1 = train_step(model, inputs, seed, autocast)
        assert torch.equal(loss1, loss0)
        assert grads1.keys() == grads0.keys()
        for name, g in grads0.items():
            assert torch.equal(grads1[name], g), name
        steps[seed] = grads1
    # the draws inside the blocks (dropout, stochastic rounding) change the gradients: the
    # recompute replayed them, it did not merely find nothing random
    assert any(not torch.equal(steps[5][n], steps[6][n]) for n in steps[5])
    # BatchNorm's running statistics updated once a step, by the forward, not the recompute
    for (name, b0), (_, b1) in zip(plain.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b1, b0), name


def test_shared_codes_cross_the_boundaries():
    """The Chain case shares codes as its docstring says (else it would test less)."""
    _, _, _, report = compressed_pair(chain, "fewbit3+msnorm+actnn2")
    what = {c.name: c.new for c in report.replaced}
    assert what["norm"].endswith("shared with blocks.0.0)")
    assert what["blocks.0.4"].endswith("shared with blocks.1.0)")
    assert what["blocks.1.4"].endswith("shared with head)")


def block_inputs(model, blocks, inputs):
    """{block name: bytes of the distinct storages of its tensor arguments not passed to an
    earlier block}, on one forward."""
    seen, got = set(), {}

    def note(name):
        def hook(module, args, kwargs):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            fresh = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                     for t in leaves if isinstance(t, torch.Tensor)}
            got[name] = sum(n for k, n in fresh.items() if k not in seen)
            seen.update(fresh)
        return hook

    handles = [model.get_submodule(b).register_forward_pre_hook(note(b), with_kwargs=True)
               for b in blocks]
    with torch.no_grad():
        models.call(model, inputs)
    for h in handles:
        h.remove()
    return got


# (not cnn-actnn2: there a block keeps 2 bits or less per element of each tensor, less than
# its input in full, which a recomputed block keeps)
@pytest.mark.parametrize("case", ["llama-llm+actnn2", "cnn-pooled2"])
def test_a_recomputed_block_keeps_its_inputs_only(case):
    build, policy, blocks = CASES[case]
    plain, model, inputs, _ = compressed_pair(build, policy)
    before, _ = account(plain, lambda: models.call(plain, inputs))
    after, _ = account(model, lambda: models.call(model, inputs))
    # keyword tensors too (LLaMA's position embeddings and ids), each storage once
    assert {b: after.by_module[b] for b in blocks} == block_inputs(model, blocks, inputs)
    assert not any(n.startswith(tuple(b + "." for b in blocks)) for n in after.by_module)
    inside = sum(v for n, v in before.by_module.items()
                 if n.startswith(tuple(b + "." for b in blocks)))
    assert after.total < before.total - inside / 2


def test_it_runs_as_it_is_in_eval_mode_and_without_grad():
    plain, model, inputs, _ = compressed_pair(llama, "llm+actnn2")
    plain.eval(), model.eval()
    before, out0 = account(plain, lambda: models.call(plain, inputs))
    after, out1 = account(model, lambda: models.call(model, inputs))
    assert after.by_module == before.by_module  # the blocks' own modules keep what they keep
    assert torch.equal(out1.logits, out0.logits)
    plain.train(), model.train()
    with torch.no_grad():
        torch.manual_seed(1)
        out1 = model(**inputs)
        torch.manual_seed(1)
        out0 = plain(**inputs)
    assert torch.equal(out1.logits, out0.logits)
    # as it is: the key-value cache is written, which a recomputed layer's forward does not do
    assert [layer.keys.shape[-2] for layer in out1.cache.layers] == [12, 12]
    assert all(layer.keys is None for layer in model(**inputs).cache.layers)


def test_names_parameters_and_state_dict_are_untouched():
    model, inputs = llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [(n, id(p)) for n, p in model.named_parameters()]
    names = [n for n, _ in model.named_modules()]
    compress(model, {"rules": [CHECKPOINT]})
    assert [n for n, _ in model.named_modules()] == names
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    layer = model.model.layers[0]
    assert is_checkpoint_forward(layer.__dict__["forward"])
    # the instance forward has the class forward's signature (transformers reads it)
    assert inspect.signature(layer.forward) == inspect.signature(
        type(layer).forward.__get__(layer))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_pickles_recompute_their_own_blocks(how):
    _, model, inputs, _ = compressed_pair(llama, "llm+actnn2")
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    for layer in other.model.layers:
        forward = layer.__dict__["forward"]
        assert is_checkpoint_forward(forward) and forward.__self__ is layer
    saved0, _ = account(model, lambda: model(**inputs))
    saved1, _ = account(other, lambda: other(**inputs))
    assert saved1.by_module == saved0.by_module  # the blocks keep their inputs only
    loss0, grads0 = train_step(model, inputs, 5)
    loss1, grads1 = train_step(other, inputs, 5)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())


def test_a_second_compress_finds_nothing_to_do():
    _, model, inputs, _ = compressed_pair(llama, "llm+actnn2")
    modules = list(model.modules())
    again = compress(model, with_checkpoint("llm+actnn2"))
    assert again.replaced == [] and again.skipped == []
    assert again.compressed > 0 and "already compressed" in str(again)
    assert list(model.modules()) == modules


def test_blocks_transformers_checkpoints_or_whose_forward_is_replaced_are_refused():
    model, inputs = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = compress(model, {"rules": [CHECKPOINT]})
    assert recomputed(report) == []
    assert [(n, why.split(" (")[0]) for n, _, why in report.skipped] == [
        (f"model.layers.{i}", "transformers checkpoints it already") for i in (0, 1)]
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)

    model, inputs = llama()
    layer = model.model.layers[1]
    layer.forward = functools.partial(type(layer).forward, layer)  # someone else's
    report = compress(model, {"rules": [CHECKPOINT]})
    assert recomputed(report) == ["model.layers.0"]
    assert report.skipped == [("model.layers.1", "LlamaDecoderLayer",
                               "its forward is already replaced on the instance")]


def test_transformers_checkpointing_turned_on_later_takes_over():
    """Not recomputed twice over: the layer defers to transformers' own checkpointing."""
    plain, model, inputs, _ = compressed_pair(llama, "llm+actnn2")
    kwargs = {"use_reentrant": False}
    for m in (plain, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    saved0, _ = account(plain, lambda: plain(**inputs))
    saved1, _ = account(model, lambda: model(**inputs))
    assert saved1.by_module == saved0.by_module
    loss0, grads0 = train_step(plain, inputs, 5)
    loss1, grads1 = train_step(model, inputs, 5)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())


def test_a_block_inside_a_recomputed_one_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(stage(3, 8), stage(8, 8)), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 2)).train()
    report = compress(model, {"rules": [CHECKPOINT]})
    assert recomputed(report) == ["0"]
    assert [(n, why) for n, _, why in report.skipped] == [
        ("0.0", "inside 0, which is recomputed already"),
        ("0.1", "inside 0, which is recomputed already")]
    again = compress(model, {"rules": [CHECKPOINT]})
    assert again.replaced == [] and again.skipped == report.skipped
    x = torch.randn(2, 3, 6, 6)
    model(x).square().sum().backward()  # and it trains


@pytest.mark.parametrize("build", [llama, gpt2, cnn, chain])
def test_blocks_are_the_lowest_priority_target(build):
    """Every module keeps the kind it had; the blocks are the layers of a transformer and the
    stages of a CNN, nothing else."""
    model, _ = build()
    modules = dict(model.named_modules())
    blocks = []
    for name, m in modules.items():
        parent = modules[name.rpartition(".")[0]] if name else None
        kind = target_of(m, parent)
        if target_of(m) is not None:
            assert kind == target_of(m), name
        elif kind == "block":
            blocks.append(name)
        else:
            assert kind is None
    assert blocks == {llama: ["model.layers.0", "model.layers.1"],
                      gpt2: ["transformer.h.0", "transformer.h.1"], cnn: ["0", "1", "2"],
                      chain: ["blocks.0", "blocks.1"]}[build]


def test_only_the_offload_preset_recomputes_and_bad_rules_are_one_line():
    assert [name for name, rules in P.PRESETS.items()
            if any(r["target"] == "block" for r in rules)] == ["offload"]
    assert P.load({"rules": [CHECKPOINT]}).rules[0].options == (("offload", False),)
    for rule, words in [({"target": "block", "apply": "checkpoint", "bits": 2},
                         "unknown key 'bits' for 'checkpoint'"),
                        ({"target": "linear", "apply": "checkpoint"},
                         "'checkpoint' does not apply to 'linear' modules"),
                        ({"target": "block", "apply": "actnn"},
                         "'actnn' does not apply to 'block' modules")]:
        with pytest.raises(ActdesignError, match=words) as info:
            P.load({"rules": [rule]})
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_the_estimate_follows_a_real_step(precision):
    """On fake tensors the recomputed layers keep what a real step's keep, and the peak (the
    recompute included) is the real step's."""
    policy = {"rules": [{**CHECKPOINT, "name": "model.layers.*"}]}
    none, ours = estimate("llama-tiny", 3, 40, precision, policies=["none", policy]).rows
    model, _ = models.build("llama-tiny")
    compress(model.train(), policy)
    saved, peak = step(model, models.example_batch(model, 3, 40), precision)
    assert (ours.saved, ours.saved_bytes, ours.peak_bytes) == (saved.by_module, saved.total,
                                                              peak)
    assert ours.peak_bytes < none.peak_bytes and ours.saved_bytes < none.saved_bytes / 2


def test_estimate_cli_with_a_policy_file(capsys, tmp_path):
    path = tmp_path / "recompute.json"
    path.write_text(json.dumps({"format": P.FORMAT, "rules": [
        {"target": "block", "name": "model.layers.*", "apply": "checkpoint"}]}))
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-tiny", "--batch", "2",
                             "--seq", "16", "--policy", "none", "--policy", str(path),
                             "--json", "-")
    assert code == 0, err
    none, ours = json.loads(out)["rows"]
    assert ours["peak_bytes"] < none["peak_bytes"]
    assert ours["saved_bytes"] < none["saved_bytes"]
    assert set(ours["saved_by_module"]) >= {"model.layers.0", "model.layers.1"}
    assert not any(n.startswith("model.layers.0.") for n in ours["saved_by_module"])
