"""The shipped tables: every built-in's stepwise tables at 1 to 4 bits under N(0, 1) and its
2-bit piecewise-linear fit, exactly what the designer computes, read in place of a fit by
`compress`'s presets and by `actdesign fit`."""

import json

import pytest

from actdesign import builtin_tables, spec
from actdesign.activation import BUILTINS, resolve
from actdesign.designer import fit_stepwise, pwl, stepwise
from actdesign.designer.pwl import fit_pwl


@pytest.mark.parametrize("name", [b.name for b in BUILTINS])
def test_every_built_in_ships_what_the_presets_and_the_planner_use(name):
    for bits in builtin_tables.STEPWISE_BITS:
        table = builtin_tables.shipped("stepwise", name, bits)
        assert (table.kind, table.bits, table.activation) == ("stepwise", bits, {"name": name})
        assert table.to_dict()["objective"]["weight"] == {"type": "normal", "mean": 0.0,
                                                          "std": 1.0}
    table = builtin_tables.shipped("pwl", name, 2)
    if name == "squared_relu":  # no linear asymptote: no pwl fit
        assert table is None
    else:
        assert (table.kind, table.bits, table.activation) == ("pwl", 2, {"name": name})
    assert builtin_tables.shipped("stepwise", name, 5) is None


def _same(a, b):
    a, b = a.to_dict(), b.to_dict()
    del a["provenance"], b["provenance"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("kind, name, bits", [
    ("stepwise", "gelu", 3), ("stepwise", "silu", 2), ("stepwise", "relu", 1),
    ("stepwise", "tanh", 4), ("pwl", "gelu", 2), ("pwl", "silu", 2)])
def test_a_shipped_table_is_what_the_designer_fits(kind, name, bits):
    fitted = spec.from_pwl(fit_pwl(name, bits)) if kind == "pwl" \
        else spec.from_fit(fit_stepwise(name, bits))
    _same(builtin_tables.shipped(kind, name, bits), fitted)


def test_presets_and_fit_read_the_shipped_tables_without_fitting(monkeypatch, capsys, tmp_path):
    from actdesign.cli import main
    from actdesign.designer import weights

    def refused(*args, **kwargs):
        raise AssertionError("fitted a shipped table")

    monkeypatch.setattr(stepwise, "fit_stepwise", refused)
    monkeypatch.setattr(pwl, "fit_pwl", refused)
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", str(tmp_path))
    for argv in (["gelu_tanh", "--bits", "3"], ["silu", "--kind", "pwl", "--bits", "2"]):
        with pytest.raises(SystemExit) as done:
            main(["fit", *argv, "-q"])
        assert done.value.code == 0
    from actdesign.runtime.ops import tables

    for kind, name, bits in (("stepwise", "gelu", 3), ("pwl", "gelu_tanh", 2)):
        _same(tables._cached(kind, name, bits), builtin_tables.shipped(kind, name, bits))
    # a request that differs (another weight, grid or bits) is not the shipped one
    act = resolve("gelu")
    assert builtin_tables.for_request(act, 3, "stepwise", weights.Normal(0.0, 2.0), None,
                                      None) is None
    assert builtin_tables.for_request(act, 3, "stepwise", weights.Normal(0.0, 1.0), 4096,
                                      None) is None
    assert builtin_tables.for_request(resolve("x*sigmoid(x)"), 3, "stepwise",
                                      weights.Normal(0.0, 1.0), None, None) is None
