"""What compress's report says on real tiny transformers models: a dry run gives the bytes the
real run gives, a compressed model says so (and refuses another policy), rules matching no
module are named, and the rotary line says what runs on the model's device and precision."""

import contextlib
import copy

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, load_policy, models

pytest.importorskip("transformers")

PRECISIONS = {"fp32": contextlib.nullcontext,
              "bf16-autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}


def built(name):
    model, _ = models.build(name)
    return model.train()


def layout(model):
    """Every module's name and class, and every parameter and buffer by value."""
    return [(n, type(m)) for n, m in model.named_modules()], \
        {k: v.clone() for k, v in model.state_dict().items()}


def same(model, before) -> bool:
    kinds, state = layout(model)
    return kinds == before[0] and state.keys() == before[1].keys() \
        and all(torch.equal(v, before[1][k]) for k, v in state.items())


def saved_line(report) -> str:
    (line,) = [x for x in str(report).splitlines() if "saved for backward" in x]
    return line


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name, policy", [("llama-tiny", "llm+actnn2"),
                                          ("gpt2-tiny", "fewbit3+msnorm+actnn2")])
def test_a_dry_run_reports_the_bytes_the_real_run_saves(name, policy, precision):
    model = built(name)
    before = layout(model)
    with PRECISIONS[precision]():
        dry = compress(model, policy, dry_run=True)
        assert same(model, before) and not any("_actdesign_policy" in m.__dict__
                                               for m in model.modules())
        real = compress(model, policy)
    assert dry.after is not None and dry.after.total < dry.before.total
    assert saved_line(dry) == saved_line(real)
    assert str(dry) == str(real) and dry.to_dict() == real.to_dict()
    assert not same(model, before)  # the real run did change it


@pytest.mark.parametrize("name, policy", [("llama-tiny", "llm"), ("gpt2-tiny", "fewbit3")])
def test_compressing_again_says_so_and_another_policy_is_refused(name, policy):
    model = built(name)
    compress(model, policy)
    after = layout(model)
    for again in (policy, load_policy(policy)):
        report = compress(model, again)
        assert str(report).splitlines()[0].startswith(
            f"compress ({policy}): already compressed: nothing to do")
        assert report.replaced == [] and report.compressed > 0 and same(model, after)
    for other in ("actnn2", {"rules": [{"target": "linear", "apply": "lean"}]}):
        for dry_run in (False, True):
            with pytest.raises(ActdesignError, match=f"already compressed with policy "
                                                     f"'{policy}'") as info:
                compress(model, other, dry_run=dry_run)
            assert "\n" not in str(info.value) and same(model, after)


def test_the_same_rules_given_another_way_are_the_same_policy():
    model = built("llama-tiny")
    compress(model, "fewbit3+msnorm")
    after = layout(model)
    rules = copy.deepcopy(model._actdesign_policy[1])
    assert compress(model, {"rules": rules}).replaced == [] and same(model, after)


def test_a_compress_that_changed_nothing_leaves_the_model_free_for_another_policy():
    model = built("gpt2-tiny")
    assert compress(model, "pooled2").replaced == []
    assert compress(model, "fewbit3").replaced  # nothing was compressed before


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rules_matching_no_module_are_named(precision):
    gpt2 = built("gpt2-tiny")
    with PRECISIONS[precision]():
        report = compress(gpt2, "pooled2")
    assert report.unmatched == ["rule 1, pooled on conv2d"]
    assert "  matched nothing: rule 1, pooled on conv2d (the model has no such module)" \
        in str(report).splitlines()
    report = compress(built("gpt2-tiny"), "llm")  # GPT-2 has no gated MLP, no rotation
    assert report.unmatched == ["rule 2, msglu on glu", "rule 3, rope on attention"]
    assert report.to_dict()["unmatched_rules"] == report.unmatched
    report = compress(built("llama-tiny"), "llm")
    assert report.unmatched == [] and "matched nothing" not in str(report)
    report = compress(built("llama-tiny"), {"rules": [
        {"target": "linear", "name": "model.layers.*.mlp.*", "apply": "lean"},
        {"target": "linear", "name": "encoder.*", "type": "Linear", "apply": "actnn"},
        {"target": "norm", "type": "LayerNorm", "apply": "msnorm"}]})
    assert report.unmatched == ["rule 2, actnn on linear encoder.* of type Linear",
                                "rule 3, msnorm on norm of type LayerNorm"]


def rotary_lines(report):
    lines = [c.new for c in report.replaced if c.new.startswith("rotary")]
    assert len(lines) == 2  # one per layer
    return set(lines)


def test_the_rotary_line_says_what_runs_on_the_cpu():
    model = built("llama-tiny")
    for weights in (torch.float32, torch.bfloat16):  # the kernel takes any float dtype
        (line,) = rotary_lines(compress(copy.deepcopy(model).to(weights), "llm"))
        assert line == ("rotary embedding: eager's own ops on cpu; one kernel for q and k each "
                        "way on CUDA")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rotary_line_on_cuda_names_the_kernel():
    (line,) = rotary_lines(compress(built("llama-tiny").cuda(), "llm"))
    assert line == "rotary embedding in one kernel for q and k each way"
