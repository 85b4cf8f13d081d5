"""Printing sympy trees as torch and Triton code: correct math, only whitelisted names."""

import ast

import numpy as np
import pytest
import sympy as sp
import torch
import torch.nn.functional as F

from actdesign.activation import BUILTINS, resolve
from actdesign.codegen.printers import TORCH, TRITON, literal, print_code
from actdesign.errors import ActdesignError
from actdesign.expr import X

EXPRESSIONS = [b.name for b in BUILTINS] + [
    "x**5 - 3*x**-2", "x**0.5", "x**-0.5", "2**x", "exp(x) - 1", "log(1 + x**2)",
    "where(x > 0 and x < 1 or x < -2, x, -x)", "min(max(x, -1), 2)", "atan(x)", "erfc(x)",
    "sinh(x) + cosh(x)", "abs(x)*sigmoid(x)",
]


def run_torch(code, x):
    scope = {"torch": torch, "F": F, "x": x}
    for line in code.lines:
        exec(line, scope)  # printer output only: names checked by test_only_known_names
    return eval(code.result, scope)


@pytest.mark.parametrize("formula", EXPRESSIONS)
def test_torch_printing_matches_numpy_in_float64(formula):
    act = resolve(formula)
    x = torch.linspace(-7, 7, 2001, dtype=torch.float64) + 1e-3
    y = run_torch(print_code(act.f_expr, TORCH), x)
    exact = act.f(x.numpy())
    ok = np.isclose(torch.as_tensor(y).numpy(), exact, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert ok.all()


@pytest.mark.parametrize("formula", EXPRESSIONS)
@pytest.mark.parametrize("dialect", [TORCH, TRITON])
def test_only_known_names(formula, dialect):
    code = print_code(resolve(formula).f_expr, dialect)
    allowed = {"x", "torch", "F", "tl"} | {f.split("(")[0] for f in dialect.functions.values()}
    for text in (*code.lines, code.result):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id not in allowed:
                assert node.id[0] in "ts" and node.id[1:].isdigit(), node.id  # temporaries
            assert not isinstance(node, ast.Constant) or isinstance(node.value, float | int)


def test_literals_are_exact():
    for v in (0.1, -1.0 / 3, 2.0**-1074, 1.7976931348623157e308, 1e-300):
        assert float(literal(v)) == v
    with pytest.raises(ActdesignError):
        literal(float("inf"))


def test_unknown_nodes_are_refused_not_printed():
    with pytest.raises(ActdesignError, match="cannot generate code"):
        print_code(sp.gamma(X), TRITON)
    with pytest.raises(ActdesignError, match="otherwise"):
        print_code(sp.Piecewise((X, X > 0)), TORCH)
