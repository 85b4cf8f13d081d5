"""compress plans first, then applies assignments only: a dry run changes nothing, and a
fault anywhere (in any probe, in any assignment, in the closing probe) leaves the model
exactly as it was: state dict, module tree, forwards, attributes, hooks, flags."""

import copy
import importlib

import pytest
import torch
from torch import nn

from actdesign.runtime import compress, models
from actdesign.runtime.apply import policy
from actdesign.runtime.methods import edits, fused_ce
from actdesign.runtime.methods import rope as rope_method
from actdesign.runtime.ops import glu, norms

compress_module = importlib.import_module("actdesign.runtime.apply.compress")

pytest.importorskip("transformers")

CASES = [("llama-tiny", "llm+actnn2"), ("gpt2-tiny", "fewbit3+msnorm+actnn2")]
# and a PEFT LoRA model, whose layers get instance forwards and new base layers; and the
# decoder layers recomputed, which get instance forwards too
RECOMPUTED = {"rules": [*policy.load("llm+actnn2").to_dict()["rules"],
                        {"target": "block", "apply": "checkpoint"}]}
APPLIED = CASES + [("llama-tiny+lora", "llm+actnn2"), ("llama-tiny", RECOMPUTED)]
# Every function that runs the model, a part of it or a module's code on a probe.
PROBES = [(compress_module, "account"), (compress_module, "record_saves"),
          (compress_module, "norm_consumers"), (models, "call"), (fused_ce, "probe_losses"),
          (glu, "_check_probe"), (norms, "_probe_formula"), (rope_method, "is_standard")]


class Injected(RuntimeError):
    pass


def snapshot(model):
    """Everything compress could change, as comparable values."""
    modules = list(model.named_modules(remove_duplicate=False))
    return {
        "tree": [(n, id(m), type(m)) for n, m in modules],
        "attributes": [(n, {k: id(v) for k, v in vars(m).items()}) for n, m in modules],
        "hooks": [(n, [dict(getattr(m, h)) for h in vars(m) if h.endswith("_hooks")])
                  for n, m in modules],
        "modes": [m.training for _, m in modules],
        "parameters": [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(after, before):
    for key in before:
        if key == "state":
            assert list(after[key]) == list(before[key])
            assert all(torch.equal(after[key][k], v) for k, v in before[key].items())
        else:
            assert after[key] == before[key], key


def counting(monkeypatch, owner, name, fail_at=None):
    """Wrap owner.name to count its calls and raise Injected at call `fail_at`."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Injected(f"{name}, call {fail_at}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def model_for(name):
    model = models.build(name.removesuffix("+lora"))[0].train()
    model.lm_head.register_forward_hook(lambda *args: None)  # a user's hook stays
    if name.endswith("+lora"):
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]))
    return model


def test_compress_draws_no_random_numbers_of_the_run():
    """The probes run dropout and ActNN layers draw their seeds, but the generator is as it
    was: the training run after compress draws what it would have drawn."""
    model = model_for("gpt2-tiny")
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    compress(model, "fewbit3+msnorm+actnn2")
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name, policy", APPLIED)
def test_a_dry_run_reports_the_plan_and_changes_nothing(name, policy):
    model = model_for(name)
    before = snapshot(model)
    planned = compress(model, policy, dry_run=True)
    assert_same(snapshot(model), before)
    done = compress(copy.deepcopy(model), policy)
    assert [(c.name, c.new) for c in planned.replaced] == [(c.name, c.new)
                                                         for c in done.replaced]
    assert planned.skipped == done.skipped and planned.after.total == done.after.total


@pytest.mark.parametrize("name, policy", CASES)
def test_a_fault_in_any_probe_leaves_the_model_as_it_was(name, policy, monkeypatch):
    model = model_for(name)
    before = snapshot(model)
    counts = {}
    with monkeypatch.context() as m:
        for owner, fn in PROBES:
            counts[fn] = counting(m, owner, fn)
        compress(copy.deepcopy(model), policy)
    used = {fn for fn, calls in counts.items() if calls[0]}
    # LLaMA's llm+actnn2 runs every kind of probe; GPT-2's policy those on the whole model
    assert used == ({fn for _, fn in PROBES} if name == "llama-tiny" else
                    {"account", "record_saves", "norm_consumers", "call"})
    for owner, fn in PROBES:
        for k in range(1, counts[fn][0] + 1):
            with monkeypatch.context() as m:
                counting(m, owner, fn, fail_at=k)
                with pytest.raises(Injected):
                    compress(model, policy)
            assert_same(snapshot(model), before)


@pytest.mark.parametrize("name, policy", CASES)
def test_a_fault_in_any_module_call_leaves_the_model_as_it_was(name, policy, monkeypatch):
    """Faults inside the probes' forwards, with their hooks and modes in place, sampled
    evenly over every module call compress makes. A probe that finds a module's own code
    failing (a norm's, a rotation's) refuses that module, with the reason: then the rest
    applies, and the fault is in the report."""
    model = model_for(name)
    before = snapshot(model)
    with monkeypatch.context() as m:
        calls = counting(m, nn.Module, "__call__")
        compress(copy.deepcopy(model), policy)
    raised = 0
    for k in torch.linspace(1, calls[0], 24).round().int().unique().tolist():
        with monkeypatch.context() as m:
            counting(m, nn.Module, "__call__", fail_at=k)
            try:
                report = compress(model, policy)
            except Injected:
                raised += 1
                assert_same(snapshot(model), before)
                continue
        assert any("Injected" in why for _, _, why in report.skipped), str(report)
        model = model_for(name)
        before = snapshot(model)
    assert raised >= 16


@pytest.mark.parametrize("name, policy", APPLIED)
def test_a_fault_in_any_assignment_takes_back_those_made(name, policy, monkeypatch):
    model = model_for(name)
    before = snapshot(model)
    with monkeypatch.context() as m:
        applied = counting(m, edits.Edit, "apply")
        compress(copy.deepcopy(model), policy)
    assert applied[0] > 10
    for k in range(1, applied[0] + 1):
        with monkeypatch.context() as m:
            counting(m, edits.Edit, "apply", fail_at=k)
            with pytest.raises(Injected):
                compress(model, policy)
        assert_same(snapshot(model), before)
    # and the whole plan applied, then a fault in the closing probe: all taken back
    with monkeypatch.context() as m:
        counting(m, compress_module, "account", fail_at=2)
        with pytest.raises(Injected):
            compress(model, policy)
    assert_same(snapshot(model), before)
    compress(model, policy)  # and then it applies
    assert snapshot(model)["tree"] != before["tree"]
