"""Print an activation's sympy tree as straight-line Triton or torch code.

The tree comes from the expression compiler (`actdesign.expr`), so the printed code holds only
the names in the dialect tables below, the variable `x`, temporaries and float literals.
Anything else in a tree is refused, never printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy as sp

from actdesign.errors import ActdesignError
from actdesign.expr import X


@dataclass(frozen=True)
class Dialect:
    functions: dict[str, str]  # sympy function name -> format with {0} for its argument
    where: str
    power: str  # a general power b**p, as a format of (b, p)
    helpers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # helper -> needs


# Triton: core `tl` functions where they exist, otherwise helpers from the template
# (`templates/triton_math.py.jinja`), which use libdevice when compiled and core ops when the
# interpreter runs them.
TRITON = Dialect(
    functions={"exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.sqrt({0})",
               "sin": "tl.sin({0})", "cos": "tl.cos({0})", "erf": "tl.erf({0})",
               "sigmoid": "tl.sigmoid({0})", "Abs": "tl.abs({0})", "tanh": "_tanh({0})",
               "sinh": "_sinh({0})", "cosh": "_cosh({0})", "atan": "_atan({0})",
               "erfc": "_erfc({0})", "softplus": "_softplus({0})", "expm1": "_expm1({0})",
               "log1p": "_log1p({0})"},
    where="tl.where({0}, {1}, {2})",
    power="tl.exp({1} * tl.log({0}))",
    helpers={"_tanh": ("_expm1",), "_sinh": ("_expm1",), "_cosh": (), "_atan": (),
             "_erfc": (), "_softplus": ("_log1p",), "_expm1": (), "_log1p": ()},
)

TORCH = Dialect(
    functions={"exp": "torch.exp({0})", "log": "torch.log({0})", "sqrt": "torch.sqrt({0})",
               "sin": "torch.sin({0})", "cos": "torch.cos({0})", "erf": "torch.erf({0})",
               "erfc": "torch.erfc({0})", "sigmoid": "torch.sigmoid({0})",
               "Abs": "torch.abs({0})", "tanh": "torch.tanh({0})", "sinh": "torch.sinh({0})",
               "cosh": "torch.cosh({0})", "atan": "torch.atan({0})",
               "softplus": "torch.logaddexp({0}, torch.zeros_like({0}))",
               "expm1": "torch.expm1({0})", "log1p": "torch.log1p({0})"},
    where="torch.where({0}, {1}, {2})",
    power="torch.pow({0}, {1})",
)

_RELATIONS = {"<": "<", "<=": "<=", ">": ">", ">=": ">="}


@dataclass(frozen=True)
class Code:
    lines: tuple[str, ...]  # assignments to temporaries
    result: str  # the expression of f(x)
    helpers: tuple[str, ...]  # template helpers the code calls, dependencies first


def literal(value) -> str:
    """A float as the shortest Python literal that reads back to exactly the same double."""
    v = float(value)
    if not math.isfinite(v):
        raise ActdesignError(f"cannot print the non-finite number {v!r} into code")
    return repr(v)


def print_code(expr: sp.Expr, dialect: Dialect) -> Code:
    """Straight-line code computing `expr` of the variable `x` in `dialect`."""
    printer = _Printer(dialect)
    replacements, (reduced,) = sp.cse(expr, symbols=sp.numbered_symbols("s"))
    for symbol, sub in replacements:
        printer.lines.append(f"{symbol} = {printer.expr(sub)}")
        printer.names.add(symbol)
    result = printer.expr(reduced)
    return Code(tuple(printer.lines), result, printer.helper_order())


class _Printer:
    def __init__(self, dialect: Dialect):
        self.dialect = dialect
        self.lines: list[str] = []
        self.names: set[sp.Symbol] = {X}
        self.used: set[str] = set()

    def fail(self, e) -> ActdesignError:
        return ActdesignError(f"cannot generate code for {type(e).__name__} in {e}")

    def temp(self, code: str) -> str:
        name = f"t{len(self.lines)}"
        self.lines.append(f"{name} = {code}")
        return name

    def atom(self, e) -> str:
        """`e` as a name or literal, so a format may use it more than once."""
        code = self.expr(e)
        return code if code.isidentifier() or e.is_number else self.temp(code)

    def expr(self, e) -> str:
        if e.is_number:
            return literal(sp.N(e, 30))
        if isinstance(e, sp.Symbol):
            if e not in self.names:
                raise self.fail(e)
            return str(e)
        if isinstance(e, sp.Add):
            return self.sum(e)
        if isinstance(e, sp.Mul):
            return self.product(e)
        if isinstance(e, sp.Pow):
            return self.power(e.base, e.exp)
        if isinstance(e, sp.Piecewise):
            return self.piecewise(e)
        if isinstance(e, sp.core.relational.Relational | sp.logic.boolalg.BooleanFunction):
            return self.condition(e)  # cse may name a condition
        if isinstance(e, sp.log) and isinstance(e.args[0], sp.Add) and sp.S.One in e.args[0].args:
            return self.call("log1p", e.args[0] - 1)  # log(1 + a) loses a when |a| is tiny
        name = type(e).__name__
        if isinstance(e, sp.Function) and name in self.dialect.functions and len(e.args) == 1:
            return self.call(name, e.args[0])
        raise self.fail(e)

    def call(self, name: str, arg) -> str:
        template = self.dialect.functions[name]
        helper = template.split("(")[0]
        if helper in self.dialect.helpers:
            self.used.add(helper)
        return template.format(self.atom(arg))

    def sum(self, e: sp.Add) -> str:
        terms = list(e.args)
        # c*exp(a) - c is c*expm1(a): exact near a = 0, where exp(a) - 1 cancels (elu, selu).
        constant = next((t for t in terms if t.is_number), None)
        for t in terms:
            coef, rest = t.as_coeff_Mul()
            if constant is not None and isinstance(rest, sp.exp) and constant + coef == 0:
                terms.remove(t)
                terms.remove(constant)
                expm1 = self.call("expm1", rest.args[0])
                terms_code = [self.expr(a) for a in terms]
                scaled = expm1 if coef == 1 else f"({literal(sp.N(coef, 30))} * {expm1})"
                return "(" + " + ".join([scaled, *terms_code]) + ")"
        return "(" + " + ".join(self.expr(a) for a in terms) + ")"

    def product(self, e: sp.Mul) -> str:
        coef, factors = e.as_coeff_mul()  # exact constants folded into one number
        constant = sp.Mul(*[f for f in factors if f.is_number]) * coef
        num, den = [], []
        for factor in factors:
            if factor.is_number:
                continue
            if isinstance(factor, sp.Pow) and factor.exp.is_Integer and factor.exp < 0:
                den.append(self.power(factor.base, -factor.exp))
            else:
                num.append(self.expr(factor))
        sign = ""
        if constant == -1:
            sign = "-"
        elif constant != 1:
            num.insert(0, literal(sp.N(constant, 30)))
        text = " * ".join(num) if num else "1.0"
        if den:
            text += " / " + (den[0] if len(den) == 1 else "(" + " * ".join(den) + ")")
        return f"({sign}{text})"

    def power(self, base, exp) -> str:
        if exp.is_Integer and exp > 0:
            return self.integer_power(self.atom(base), int(exp))
        if exp.is_Integer:
            return f"(1.0 / {self.integer_power(self.atom(base), int(-exp))})"
        if exp == sp.Rational(1, 2):
            return self.dialect.functions["sqrt"].format(self.atom(base))
        if exp == sp.Rational(-1, 2):
            return f"(1.0 / {self.dialect.functions['sqrt'].format(self.atom(base))})"
        return self.dialect.power.format(self.atom(base), self.atom(exp))

    def integer_power(self, base: str, n: int) -> str:
        # Square and multiply: x**64 takes 6 squarings, not 63 products.
        result, square = None, base
        while True:
            if n & 1:
                result = square if result is None else self.temp(f"{result} * {square}")
            n >>= 1
            if not n:
                return result
            square = self.temp(f"{square} * {square}")

    def piecewise(self, e: sp.Piecewise) -> str:
        *branches, (last, last_cond) = e.args
        if last_cond is not sp.true:
            raise ActdesignError(f"cannot generate code for {e}: it has no otherwise-branch")
        code = self.expr(last)
        for value, cond in reversed(branches):
            code = self.dialect.where.format(self.condition(cond), self.expr(value), code)
        return code

    def condition(self, c) -> str:
        if isinstance(c, sp.core.relational.Relational) and c.rel_op in _RELATIONS:
            return f"({self.expr(c.lhs)} {_RELATIONS[c.rel_op]} {self.expr(c.rhs)})"
        if isinstance(c, sp.And | sp.Or):
            op = " & " if isinstance(c, sp.And) else " | "
            return "(" + op.join(self.condition(a) for a in c.args) + ")"
        if isinstance(c, sp.Not):
            return f"(~{self.condition(c.args[0])})"
        if isinstance(c, sp.Symbol) and c in self.names:
            return str(c)
        if isinstance(c, sp.logic.boolalg.BooleanFunction):  # e.g. ITE from cse
            nnf = c.to_nnf()
            if nnf != c:
                return self.condition(nnf)
        raise self.fail(c)

    def helper_order(self) -> tuple[str, ...]:
        order: list[str] = []

        def visit(name):
            for dep in self.dialect.helpers[name]:
                visit(dep)
            if name not in order:
                order.append(name)

        for name in sorted(self.used):
            visit(name)
        return tuple(order)
