"""Activations: one definition (a formula in the expression language), every backend.

A built-in is a registry entry whose formula later stages parse like any user expression and
print for torch and Triton. Its numpy f, f' and f'' come from a closed-form table
(`closed_forms`) that computes what that sympy tree computes, so fitting a built-in never
imports sympy; an expression is parsed (with sympy) when it is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import closed_forms
from .errors import ActdesignError


@dataclass(frozen=True)
class Builtin:
    name: str
    formula: str
    summary: str
    aliases: tuple[str, ...] = ()
    torch: str = ""  # torch's own implementation, as code in `x`; empty: print the formula


# Formulas follow torch.nn's defaults (leaky_relu slope 0.01, elu/celu alpha 1, selu's
# constants, hardtanh on [-1, 1]).
BUILTINS: tuple[Builtin, ...] = (
    Builtin("relu", "max(x, 0)", "rectified linear unit", torch="F.relu(x)"),
    Builtin("leaky_relu", "where(x >= 0, x, 0.01*x)", "leaky ReLU, negative slope 0.01",
            torch="F.leaky_relu(x)"),
    Builtin("relu6", "clip(x, 0, 6)", "ReLU capped at 6", torch="F.relu6(x)"),
    Builtin("elu", "where(x > 0, x, exp(x) - 1)", "exponential linear unit, alpha 1",
            torch="F.elu(x)"),
    Builtin("celu", "where(x > 0, x, exp(x/1.0) - 1)", "continuously differentiable ELU, alpha 1",
            torch="F.celu(x)"),
    Builtin("selu",
            "1.0507009873554804934193349852946*where(x > 0, x, "
            "1.6732632423543772848170429916717*(exp(x) - 1))",
            "scaled ELU", torch="F.selu(x)"),
    Builtin("gelu", "0.5*x*(1 + erf(x/sqrt(2)))", "Gaussian error linear unit (erf form)",
            ("gelu_erf",), torch="F.gelu(x)"),
    Builtin("gelu_tanh", "0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))",
            "GELU, tanh approximation", ("gelu_new", "gelu_pytorch_tanh"),
            torch="F.gelu(x, approximate='tanh')"),
    Builtin("quick_gelu", "x*sigmoid(1.702*x)", "GELU, sigmoid approximation"),
    Builtin("silu", "x*sigmoid(x)", "sigmoid linear unit", ("swish",), torch="F.silu(x)"),
    Builtin("mish", "x*tanh(softplus(x))", "Mish", torch="F.mish(x)"),
    Builtin("sigmoid", "sigmoid(x)", "logistic sigmoid", torch="torch.sigmoid(x)"),
    Builtin("tanh", "tanh(x)", "hyperbolic tangent", torch="torch.tanh(x)"),
    Builtin("softplus", "softplus(x)", "log(1 + exp(x))", torch="F.softplus(x)"),
    Builtin("softsign", "x/(1 + abs(x))", "softsign", torch="F.softsign(x)"),
    Builtin("logsigmoid", "-softplus(-x)", "log(sigmoid(x))", torch="F.logsigmoid(x)"),
    Builtin("tanhshrink", "x - tanh(x)", "x - tanh(x)", torch="F.tanhshrink(x)"),
    Builtin("hardswish", "x*clip(x + 3, 0, 6)/6", "hard swish", torch="F.hardswish(x)"),
    Builtin("hardsigmoid", "clip(x + 3, 0, 6)/6", "hard sigmoid", torch="F.hardsigmoid(x)"),
    Builtin("hardtanh", "clip(x, -1, 1)", "hard tanh on [-1, 1]", torch="F.hardtanh(x)"),
    Builtin("squared_relu", "max(x, 0)**2", "squared ReLU", ("relu2",)),
)
_BY_NAME = {b.name: b for b in BUILTINS} | {a: b for b in BUILTINS for a in b.aliases}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Activation:
    """A pointwise activation: its formula, sympy tree and numpy callables for f, f', f''."""

    formula: str
    name: str | None = None  # the built-in's canonical name, None for an expression

    def __post_init__(self):
        if self.name is None:
            self.f_expr  # noqa: B018  (a bad expression fails here, where it is given)

    @property
    def label(self) -> str:
        return self.name or self.formula

    @cached_property
    def f_expr(self):
        """The sympy tree, parsed on first use (sympy is imported then)."""
        from . import expr

        return expr.parse(self.formula, bounded=self.name is None)

    @cached_property
    def df_expr(self):
        from . import expr

        return expr.derivatives(self.f_expr)[0]

    @cached_property
    def d2f_expr(self):
        from . import expr

        return expr.derivatives(self.f_expr)[1]

    @cached_property
    def f(self):
        return self._numpy(0, "f_expr")

    @cached_property
    def df(self):
        return self._numpy(1, "df_expr")

    @cached_property
    def d2f(self):
        return self._numpy(2, "d2f_expr")

    def _numpy(self, order: int, tree: str):
        if self.name is not None:
            return closed_forms.vectorised(closed_forms.TABLE[self.name][order])
        from . import expr

        return expr.numpy_function(getattr(self, tree))

    def breakpoints(self, lo: float, hi: float) -> np.ndarray:
        """Where f' may jump or kink inside [lo, hi]."""
        if self.name is not None:
            return closed_forms.breakpoints(self.name, lo, hi)
        from . import expr

        return expr.breakpoints(self.df_expr, lo, hi)

    @property
    def torch_code(self) -> str:
        """torch's own implementation of a built-in as code in `x`; "" when there is none."""
        return _BY_NAME[self.name].torch if self.name else ""

    def to_dict(self) -> dict:
        return {"name": self.name} if self.name else {"expr": self.formula}


def builtin_names() -> list[str]:
    return [b.name for b in BUILTINS]


def resolve(text: str) -> Activation:
    """A built-in name (or alias), or else an expression in x."""
    text = text.strip()
    if text in _BY_NAME:
        b = _BY_NAME[text]
        return Activation(b.formula, b.name)
    if _IDENTIFIER.fullmatch(text) and text != "x":
        raise ActdesignError(
            f"unknown activation {text!r}; run 'actdesign list' for built-ins, "
            "or give an expression in x such as 'x*sigmoid(1.702*x)'")
    return Activation(text)


def from_dict(d: dict) -> Activation:
    """The activation of a spec: {"name": builtin} or {"expr": text}."""
    if "name" in d:
        if d["name"] not in _BY_NAME:
            raise ActdesignError(f"unknown activation {d['name']!r}")
        return resolve(d["name"])
    return Activation(d["expr"])
