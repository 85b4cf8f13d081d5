"""Rendering op modules: deterministic, parseable, and deaf to anything but numbers in a spec."""

import ast
import importlib.util
import json
import subprocess
import sys

import pytest

from actdesign.codegen.render import render, write
from actdesign.errors import ActdesignError

HOSTILE = '"""\nimport os; os.system("touch /tmp/pwned")  # \'\\'


def test_rendering_is_deterministic(make_spec):
    spec = make_spec("gelu", 3)
    first = render(spec)
    assert render(spec) == first
    again = subprocess.run(
        [sys.executable, "-c", "import json, sys\nfrom actdesign.codegen.render import render\n"
         "sys.stdout.write(render(json.loads(sys.stdin.read())))"],
        input=json.dumps(spec), capture_output=True, text=True, check=True).stdout
    assert again == first


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_bit_width_renders_valid_python(make_spec, bits):
    source = render(make_spec("silu", bits))
    ast.parse(source)
    assert f"BITS = {bits}\n" in source and "actdesign::fewbit_silu_" in source


def test_op_names_differ_when_anything_in_the_code_differs(make_spec):
    def op(spec):
        return next(line for line in render(spec).splitlines() if line.startswith("OP = "))

    base = make_spec("gelu", 3)
    other_level = json.loads(json.dumps(base))
    other_level["levels"][2] += 1e-12
    names = {op(base), op(other_level), op(make_spec("silu", 3)), op(make_spec("gelu", 2))}
    assert len(names) == 4
    provenance = dict(base, provenance={"created": "yesterday"})
    assert op(provenance) == op(base)  # same code, same op


def test_strings_in_a_spec_stay_data(make_spec, tmp_path):
    spec = make_spec("gelu", 2)
    spec["provenance"] = {"note": HOSTILE, HOSTILE: "x"}
    spec["objective"]["weight"] = {"type": "empirical", "edges": [0.0, 1.0], "counts": [1.0],
                                   "source": HOSTILE}
    source = render(spec)
    tree = ast.parse(source)
    # The only place a string from the spec can appear is the SPEC literal, as JSON text.
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "SPEC"]
    text = "".join(c.value for c in assign.value.args)
    # Provenance is not embedded: the code depends on what the spec computes only.
    assert json.loads(text) == {k: v for k, v in spec.items() if k != "provenance"} | {
        "error": {}}
    inside = {id(n) for n in ast.walk(assign)}
    for node in ast.walk(tree):
        if id(node) not in inside and isinstance(node, ast.Constant):
            assert "pwned" not in str(node.value)
    path = tmp_path / "hostile_ops.py"
    write(spec, path)
    loader = importlib.util.spec_from_file_location("hostile_ops", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)  # importing runs nothing of the strings
    assert module.SPEC["objective"]["weight"]["source"] == HOSTILE


def test_expression_text_never_reaches_the_source(make_spec):
    spec = make_spec("x*sigmoid(1.702*x)  # \"\"\" evil comment", 2)
    source = render(spec)
    assert "evil" not in source.split("SPEC = json.loads(")[0]
    assert "evil" not in source.split("\n)\n", 1)[1]


@pytest.mark.parametrize("change, message", [
    ({"bits": 99}, "bits must be in 1..8"),
    ({"bits": "3"}, "bits must be an integer"),
    ({"borders": ["0.1"] * 7}, r"borders\[0\] must be a number"),
    ({"levels": "__import__('os')"}, "levels must be a list"),
    ({"activation": {"name": "os.system"}}, "unknown activation"),
    ({"activation": {"expr": "__import__('os').system('true')"}}, "names with '__'"),
    ({"activation": {"expr": "x.__class__"}}, "not allowed"),
    ({"kind": "quantized"}, "kind must be one of"),
    ({"kind": "pwl"}, "needs a pwl object"),
    ({"borders": [1e39] * 7}, "strictly ascending"),
    ({"levels": [1e39] * 8}, "outside the float32 range"),
])
def test_hostile_specs_are_refused_before_rendering(make_spec, change, message):
    with pytest.raises(ActdesignError, match=message):
        render(make_spec("gelu", 3) | change)
