"""Time bounds guard only what a user writes: a built-in's asymptotes, derivatives and tables
come from closed forms or shipped data, so no bound is in their path, and a bound that fires
on a user's expression is an error, never a module left alone."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli  # noqa: E402

from actdesign.activation import BUILTINS, resolve
from actdesign.errors import TooSlow

transformers = pytest.importorskip("transformers")

from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.apply.policy import PRESETS  # noqa: E402
from actdesign.runtime.methods.fewbit import FewBit  # noqa: E402

MODELS = [n for n in models.BUILTIN if n.endswith("-tiny")]


def reports(names) -> dict:
    out = {}
    for name in names:
        base, _ = models.build(name)
        for preset in PRESETS:
            model = models.build(name)[0] if out else base
            out[f"{name} {preset}"] = str(compress(model.train(), preset))
    return out


# In a fresh process and a fresh cache: every table, kernel and parse happens under bounds of
# a microsecond, which any sympy call overruns.
COLD = """
import json, sys
from actdesign import expr
from actdesign.designer import pwl
expr.PARSE_SECONDS = pwl.ASYMPTOTE_SECONDS = 1e-6
sys.path.insert(0, {tests!r})
from test_time_bounds import reports
print(json.dumps(reports({names!r})))
"""


def test_every_preset_reports_the_same_on_every_built_in_whatever_the_bounds(tmp_path):
    tests = os.path.dirname(__file__)
    env = dict(os.environ, ACTDESIGN_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", COLD.format(tests=tests, names=MODELS)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    cold = json.loads(done.stdout.strip().splitlines()[-1])
    assert cold == reports(MODELS)
    assert any("stepwise table" in text for text in cold.values())  # tables were made


def test_built_in_asymptotes_are_sympys_limits(monkeypatch):
    from actdesign import closed_forms, expr
    from actdesign.designer import pwl

    monkeypatch.setattr(pwl, "ASYMPTOTE_SECONDS", 600.0)  # a busy machine is no reason here
    monkeypatch.setattr(expr, "PARSE_SECONDS", 600.0)
    for b in BUILTINS:
        act = resolve(b.name)
        symbolic = resolve(f"1*({b.formula})")  # the formula as an expression: sympy's limits
        assert symbolic.name is None
        expected = closed_forms.ASYMPTOTES[b.name]
        if expected is None:
            with pytest.raises(Exception, match="no linear asymptote"):
                pwl.asymptotes(symbolic)
            continue
        assert pwl.asymptotes(act) == expected == pwl.asymptotes(symbolic), b.name


def test_a_bound_on_a_users_expression_is_an_error_not_a_reason(monkeypatch, capsys):
    from actdesign import expr

    monkeypatch.setattr(expr, "PARSE_SECONDS", 1e-6)
    expr.parse.cache_clear()
    code, _, err = run_cli(capsys, "fit", "x*sigmoid(1.5*x) + 0.01*x", "--bits", "2",
                           "--no-cache")
    assert code == 2 and "sympy needs more than" in err and len(err.strip().splitlines()) == 1

    def slow(self, name, module, rule, draft):
        raise TooSlow("the expression took too long")

    monkeypatch.setattr(FewBit, "replacement", slow)
    model, _ = models.build("llama-tiny")
    with pytest.raises(TooSlow):
        compress(model, "fewbit3")
    assert not any(m.__class__.__module__.startswith("actdesign") for m in model.modules())
