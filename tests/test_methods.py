"""One method, one place: each method is declared whole in one module of runtime/methods, and
compress, estimate, the planner and its explanations read the registry, not the names.

A method written here alone, registered and named nowhere else, is validated in a policy,
applied by compress, listed in its report, priced by estimate and offered by plan.
"""

import ast
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, estimate, load_policy
from actdesign.runtime.memory import cards, planner
from actdesign.runtime.memory.footprint import family_of
from actdesign.runtime.methods import METHODS, Method, Option, register
from actdesign.runtime.methods.base import integer
from actdesign.runtime.ops.compressed import CompressedLinear

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"


def _trees():
    return {p: ast.parse(p.read_text()) for p in RUNTIME.rglob("*.py")}


def test_every_method_is_defined_once_in_its_own_module_of_methods():
    defined = Counter()
    for tree in _trees().values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign) and [getattr(t, "id", None)
                                                     for t in stmt.targets] == ["name"] \
                        and isinstance(stmt.value, ast.Constant):
                    defined[stmt.value.value] += 1
    assert len(METHODS) >= 13
    for name, method in METHODS.items():
        assert defined[name] == 1, name
        assert type(method).__module__.startswith("actdesign.runtime.methods."), name
        assert method.name == name


def _apply_operand(node) -> bool:
    """`x.apply` or `x["apply"]`: a rule's method."""
    return (isinstance(node, ast.Attribute) and node.attr == "apply") or (
        isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        and node.slice.value == "apply")


def _names(node) -> set:
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}


def test_no_module_tells_a_method_by_a_name_written_out():
    """Nowhere does code compare a rule's method with a name written as a string (what a
    method does is asked of the method): the presets alone name methods, as data."""
    found = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(_apply_operand(o) for o in operands) and any(_names(o) & set(METHODS)
                                                                    for o in operands):
                    found.append(f"{path.relative_to(RUNTIME)}:{node.lineno}")
    assert found == []


def test_a_name_is_registered_once():
    class Again(Method):
        name = "keep"

    with pytest.raises(ValueError, match="registered already"):
        register(Again)


# --- a method written here alone --------------------------------------------------------------

class HalfLinear(CompressedLinear):
    """nn.Linear keeping its input in float16 for the weight gradient."""

    @staticmethod
    def compress(x):
        return (x.to(torch.float16),)

    @staticmethod
    def restore(saved, shape, dtype):
        return saved[0].to(dtype)


class HalfInput(Method):
    name = "halfinput"
    targets = ("linear",)
    options = {"scale": Option(1, integer(1, 4))}
    offers = {"linear": ({"scale": 1},)}

    def replacement(self, name, module, rule, draft):
        return HalfLinear.from_module(module), "HalfLinear (its input kept in float16)"


RULES = {"rules": [{"target": "linear", "apply": "halfinput"}]}


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(METHODS, HalfInput.name, HalfInput())


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).train()


def test_a_method_is_unknown_until_registered():
    with pytest.raises(ActdesignError, match="apply must be one of"):
        load_policy(RULES)


def test_a_registered_method_is_validated_applied_and_reported(registered):
    with pytest.raises(ActdesignError, match=r"rules\[0\]\.scale must be an integer in 1\.\.4"):
        load_policy({"rules": [{"target": "linear", "apply": "halfinput", "scale": 9}]})
    with pytest.raises(ActdesignError, match="'halfinput' does not apply to 'conv2d'"):
        load_policy({"rules": [{"target": "conv2d", "apply": "halfinput"}]})
    model, x = mlp(), torch.randn(4, 16)
    report = compress(model, RULES, example_inputs=x)
    assert [c.new for c in report.replaced] == ["HalfLinear (its input kept in float16)"] * 2
    assert isinstance(model[0], HalfLinear) and isinstance(model[2], HalfLinear)
    assert report.after.total < report.before.total
    assert family_of(load_policy(RULES), checkpointing=False) == "eager"


def test_a_registered_method_is_priced_by_estimate(registered):
    model, x = mlp(), torch.randn(32, 16)
    result = estimate(model, 32, 1, "fp32", policies=["none", RULES], example_inputs=x)
    none, half = result.rows
    # each Linear's float32 input (32 x 16, then 32 x 64) kept in float16: half its bytes
    assert none.saved_bytes - half.saved_bytes == (32 * 16 + 32 * 64) * 4 // 2


def test_a_registered_method_is_offered_and_priced_by_plan(registered, monkeypatch):
    assert ("halfinput", {"scale": 1}) in planner.options("linear")
    # on `llm`: under `cnn` (fewer bytes here) the second layer rebuilds its input from the
    # GELU's, which a copy of its own would not beat
    monkeypatch.setattr(planner.costs, "BASES", ("llm",))
    model = mlp()
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    costs = planner.measure_costs(model, batches, torch.randn(32, 16), "fp32",
                                  cards.card("h200"), "cuda", "test", planner.Clock(None))
    offered = {o.name for s in costs.problem.sites for o in s.options}
    assert "halfinput1" in offered
    error = next(o.error for s in costs.problem.sites for o in s.options
                 if o.name == "halfinput1")
    assert 0 < error < 1e-5  # float16's rounding of the input, in the weight gradient
