"""The safe expression language for activations: text -> sympy expression in `x`.

The text is parsed with `ast` and every node is checked against a whitelist; nothing is ever
passed to `eval`. The result is a sympy expression, from which each backend is printed:
numpy here (`numpy_function`), torch and Triton in later stages.

Grammar: the variable `x`, numbers, the constants `pi` and `e`, the operators `+ - * / **`,
comparisons inside `where`, and the functions in `FUNCTIONS`.
"""

from __future__ import annotations

import ast
import contextlib
import math
import signal
import sys
import threading
import time
from functools import lru_cache

import numpy as np
import sympy as sp

from . import closed_forms
from .errors import ActdesignError, TooSlow

X = sp.Symbol("x", real=True)

MAX_LENGTH = 2000  # characters
MAX_NODES = 400  # AST nodes: keeps sympy's work bounded
MAX_SYNTAX_DEPTH = 100  # nested AST nodes: the builder recurses once per level
MAX_EXPONENT = 64  # |p| in x**p for a numeric p, also after sympy folds (x**64)**64
# Limits on the sympy tree, checked after every step of building it: sympy folds and
# duplicates subtrees (abs(a) holds `a` three times), so the text's size bounds nothing.
MAX_TREE_NODES = 1500  # counting repeated subtrees each time, as printers walk them
MAX_TREE_DEPTH = 20  # printers and lambdify recurse several frames per level
MAX_BRANCHINGS = 24  # Piecewise nodes: each one is a where() in every backend
MAX_DERIVATIVE_NODES = 20000  # f' and f'' are printed into every backend too
MAX_DERIVATIVE_DEPTH = 40
# sympy's assumption queries can still take exponential time on small trees (tanh nested over
# sqrt(x) asks for real and imaginary parts level by level): a budget for the whole parse.
PARSE_SECONDS = 1.0


class sigmoid(sp.Function):  # noqa: N801  (printed as a function name)
    """The logistic function 1/(1+exp(-a)), kept as one symbol for stable numerics."""

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_evalf(self, prec):  # sympy compares constants numerically
        return (1 / (1 + sp.exp(-self.args[0])))._eval_evalf(prec)


class softplus(sp.Function):  # noqa: N801
    """log(1+exp(a)), kept as one symbol for stable numerics."""

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_evalf(self, prec):  # without it, comparing softplus(2) with a number hangs
        return sp.log(1 + sp.exp(self.args[0]))._eval_evalf(prec)


def _condition(rel):
    """A comparison, spelled out branch by branch where a side holds a Piecewise: sympy
    would otherwise rewrite it through sets, in seconds that multiply with each nesting."""
    if not rel.has(sp.Piecewise):
        return rel
    difference = sp.piecewise_fold(rel.lhs - rel.rhs)
    if not isinstance(difference, sp.Piecewise):
        return rel.func(difference, 0)
    parts, earlier = [], []
    for value, cond in difference.args:
        parts.append(sp.And(cond, *[sp.Not(c) for c in earlier], rel.func(value, 0)))
        earlier.append(cond)
    return sp.Or(*parts)


def _piecewise_max(a, b):
    return sp.Piecewise((a, _condition(a >= b)), (b, True))


def _piecewise_min(a, b):
    return sp.Piecewise((a, _condition(a <= b)), (b, True))


def _clip(a, lo, hi):
    if not (lo.is_number and hi.is_number):
        raise ActdesignError("clip(a, lo, hi) needs numeric lo and hi")
    if float(lo) >= float(hi):
        raise ActdesignError("clip(a, lo, hi) needs lo < hi")
    return sp.Piecewise((lo, _condition(a < lo)), (hi, _condition(a > hi)), (a, True))


# name -> (number of arguments, builder). Piecewise-linear helpers become sympy Piecewise, so
# their derivatives and breakpoints are explicit.
FUNCTIONS = {
    "exp": (1, sp.exp),
    "log": (1, sp.log),
    "log1p": (1, lambda a: sp.log(1 + a)),
    "expm1": (1, lambda a: sp.exp(a) - 1),
    "sqrt": (1, sp.sqrt),
    "abs": (1, lambda a: sp.Piecewise((a, _condition(a >= 0)), (-a, True))),
    "tanh": (1, sp.tanh),
    "sinh": (1, sp.sinh),
    "cosh": (1, sp.cosh),
    "sin": (1, sp.sin),
    "cos": (1, sp.cos),
    "atan": (1, sp.atan),
    "erf": (1, sp.erf),
    "erfc": (1, sp.erfc),
    "sigmoid": (1, sigmoid),
    "softplus": (1, softplus),
    "relu": (1, lambda a: _piecewise_max(a, sp.Integer(0))),
    "max": (2, _piecewise_max),
    "min": (2, _piecewise_min),
    "clip": (3, _clip),
    "where": (3, lambda c, a, b: sp.Piecewise((a, c), (b, True))),
}
CONSTANTS = {"pi": sp.pi, "e": sp.E}
# Calls kept exact on constant arguments (gelu's sqrt(2/pi)); any other call of constants is
# folded to a number at once, so sympy never evaluates towers such as exp(exp(exp(2))).
_EXACT_ON_CONSTANTS = {"sqrt", "abs", "relu", "max", "min", "clip", "where"}
# The functions a tree may hold, as every backend prints them. sympy may introduce others
# (sign, DiracDelta from |x|); those are refused.
_PRINTABLE = {"exp", "log", "sin", "cos", "erf", "erfc", "sigmoid", "softplus", "Abs", "tanh",
              "sinh", "cosh", "atan"}
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: None,  # handled separately: bounded exponents
}
_COMPARE = {
    ast.Lt: sp.StrictLessThan,
    ast.LtE: sp.LessThan,
    ast.Gt: sp.StrictGreaterThan,
    ast.GtE: sp.GreaterThan,
}


# What sympy raises on its own internal failures, never for a valid tree.
_SYMPY_FAILURES = (ArithmeticError, AttributeError, IndexError, KeyError, TypeError,
                   ValueError, RecursionError)


class _Builder:
    def __init__(self, text: str):
        self.text = text
        self.shape = _Shape()

    def fail(self, node: ast.AST | None, why: str) -> ActdesignError:
        where = f" at column {node.col_offset + 1}" if node is not None and hasattr(
            node, "col_offset") else ""
        return ActdesignError(f"invalid expression {self.text!r}{where}: {why}")

    def build(self, node: ast.AST, *, condition: bool = False):
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise self.fail(node, f"{_describe(node)} is not allowed")
        try:
            result = method(node)
        except _SYMPY_FAILURES as exc:  # sympy's own bugs on odd constants, e.g. undecidable
            raise self.fail(node, f"sympy cannot build this ({type(exc).__name__})") from None
        why = self.shape.refuse(result, MAX_TREE_NODES, MAX_TREE_DEPTH)
        if why:
            raise self.fail(node, why)
        if _is_condition(result) and not condition:
            raise self.fail(node, "a comparison is only allowed as the condition of where()")
        return result

    def _Constant(self, node):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(node, f"the literal {value!r} is not a number")
        if not math.isfinite(value):
            raise self.fail(node, "numbers must be finite")
        if isinstance(value, int):
            if abs(value) > 2**53:
                raise self.fail(node, "integer literal too large")
            return sp.Integer(value)
        return sp.Float(repr(value), 17)

    def _Name(self, node):
        if node.id == "x":
            return X
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if node.id in FUNCTIONS:
            raise self.fail(node, f"{node.id} is a function; call it as {node.id}(...)")
        raise self.fail(node, f"unknown name {node.id!r}; the variable is x")

    def _UnaryOp(self, node):
        operand = self.build(node.operand)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        raise self.fail(node, f"the operator {type(node.op).__name__} is not allowed")

    def _BinOp(self, node):
        if type(node.op) not in _BINOPS:
            raise self.fail(node, f"the operator {type(node.op).__name__} is not allowed")
        a, b = self.build(node.left), self.build(node.right)
        if isinstance(node.op, ast.Pow):
            return self._power(node, a, b)
        return _BINOPS[type(node.op)](a, b)

    def _power(self, node, base, exponent):
        if base.is_number and exponent.is_number:
            # Fold numerically: exact integer towers such as 9**9**9 would never finish.
            try:
                value = float(base) ** float(exponent)
            except (OverflowError, ZeroDivisionError, TypeError) as exc:
                raise self.fail(node, "power of numbers is out of range") from exc
            if not isinstance(value, float) or not math.isfinite(value):
                raise self.fail(node, "power of numbers is out of range")
            return sp.Float(value, 17)
        if exponent.is_number and abs(float(exponent)) > MAX_EXPONENT:
            raise self.fail(node, f"exponents are limited to |p| <= {MAX_EXPONENT}")
        return base**exponent

    def _Compare(self, node):
        if len(node.ops) != 1:
            raise self.fail(node, "chained comparisons are not allowed; use and/or")
        op = type(node.ops[0])
        if op not in _COMPARE:
            raise self.fail(node, "only < <= > >= comparisons are allowed")
        return _condition(_COMPARE[op](self.build(node.left), self.build(node.comparators[0])))

    def _BoolOp(self, node):
        parts = [self.build(v, condition=True) for v in node.values]
        return sp.And(*parts) if isinstance(node.op, ast.And) else sp.Or(*parts)

    def _Call(self, node):
        if not isinstance(node.func, ast.Name):
            raise self.fail(node, "only plain function names may be called")
        name = node.func.id
        if name not in FUNCTIONS:
            allowed = ", ".join(sorted(FUNCTIONS))
            raise self.fail(node, f"function {name!r} is not allowed; allowed: {allowed}")
        if node.keywords:
            raise self.fail(node, f"{name}() takes no keyword arguments")
        arity, builder = FUNCTIONS[name]
        if len(node.args) != arity:
            raise self.fail(node, f"{name}() takes {arity} argument(s), got {len(node.args)}")
        args = [self.build(a, condition=(name == "where" and i == 0))
                for i, a in enumerate(node.args)]
        if name == "where" and not _is_condition(args[0]):
            raise self.fail(node, "the first argument of where() must be a comparison")
        try:
            result = builder(*args)
        except ActdesignError as exc:
            raise self.fail(node, str(exc)) from None
        if name not in _EXACT_ON_CONSTANTS and not result.free_symbols and not result.is_Number:
            result = self._fold(node, result)
        return result

    def _fold(self, node, constant):
        """A constant call as a number: checked in float64 first, which cannot hang."""
        with np.errstate(all="ignore"):
            value = complex(sp.lambdify((), constant, modules=[_np_special(), "numpy"])())
        if value.imag != 0 or not math.isfinite(value.real):
            raise self.fail(node, "a constant is not a finite real float64 number")
        return sp.Float(constant.evalf(30), 30)


def _is_condition(value) -> bool:
    return isinstance(value, sp.core.relational.Relational | sp.logic.boolalg.BooleanFunction)


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return "attribute access"
    if isinstance(node, ast.Subscript):
        return "subscripting"
    return f"the syntax {type(node).__name__}"


@lru_cache(maxsize=256)
def parse(text: str, bounded: bool = True) -> sp.Expr:
    """Parse an activation expression in `x` into a sympy expression, or raise ActdesignError.
    A user's expression is `bounded`: sympy gets PARSE_SECONDS (TooSlow past them); a
    built-in's formula, ours and known to be quick, is not."""
    if not isinstance(text, str):
        raise ActdesignError("an expression must be a string")
    if len(text) > MAX_LENGTH:
        raise ActdesignError(f"expression longer than {MAX_LENGTH} characters")
    if "__" in text:
        raise ActdesignError(f"invalid expression {text!r}: names with '__' are not allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ActdesignError(
            f"invalid expression {text!r}: syntax error at column {exc.offset or 0}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ActdesignError(f"expression too large (more than {MAX_NODES} syntax nodes)")
    if _syntax_depth(tree) > MAX_SYNTAX_DEPTH:
        raise ActdesignError(f"expression nested too deeply (more than {MAX_SYNTAX_DEPTH} "
                             "levels)")
    slow = (f"invalid expression {text!r}: sympy needs more than {PARSE_SECONDS:g} s to "
            "simplify it; write it more simply")
    with time_limit(PARSE_SECONDS, slow) if bounded else contextlib.nullcontext():
        builder = _Builder(text)
        expr = builder.build(tree.body)
        if expr.has(sp.oo, -sp.oo, sp.zoo, sp.nan):
            raise ActdesignError(f"invalid expression {text!r}: it contains an infinite "
                                 "constant")
        if not expr.has(X):
            raise ActdesignError(f"invalid expression {text!r}: it does not depend on x")
        try:
            both = derivatives(expr)
        except _SYMPY_FAILURES as exc:
            raise ActdesignError(f"invalid expression {text!r}: sympy cannot differentiate it "
                                 f"({type(exc).__name__})") from None
    for order, derivative in zip(("f'", "f''"), both, strict=True):  # printed by every backend
        why = builder.shape.refuse(derivative, MAX_DERIVATIVE_NODES, MAX_DERIVATIVE_DEPTH,
                                   branchings=None)
        if not why and derivative.has(sp.oo, -sp.oo, sp.zoo, sp.nan):  # such as log(0)
            why = "it contains an infinite constant"
        if why:
            raise ActdesignError(f"invalid expression {text!r}: its derivative {order}: {why}")
    return expr


@lru_cache(maxsize=256)
def derivatives(expr: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """(f', f''), computed once: `parse` checks them within its time budget."""
    first = sp.diff(expr, X)
    return first, sp.diff(first, X)


_REPEAT_SECONDS = 0.1


class _Expired(BaseException):  # not an Exception: sympy's broad handlers must not swallow it
    pass


@contextlib.contextmanager
def time_limit(seconds: float, message: str):
    """Raise TooSlow(message) if the block takes more than `seconds` of this process's CPU
    time: the same bound on a quiet machine and on a busy one, where wall time would let
    other processes decide what an expression is allowed.

    It needs SIGPROF, so it bounds the main thread only; elsewhere the block runs unbounded.
    A bound set by the caller that comes first is left to fire; a later one is re-armed.
    """
    outer = signal.getsignal(signal.SIGPROF) if hasattr(signal, "setitimer") else None
    if outer is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_PROF)
    if outer_left and outer_left <= seconds:
        yield
        return

    def expire(signum, frame):
        raise _Expired

    def unraisable(info):  # an alarm that landed in a weakref callback or __del__
        if info.exc_type is not _Expired:
            hook(info)

    start, hook = time.process_time(), sys.unraisablehook
    signal.signal(signal.SIGPROF, expire)
    sys.unraisablehook = unraisable
    try:  # armed inside: a bound shorter than a bytecode fires in here too
        # Repeats: Python drops an exception raised while it runs a weakref callback or
        # __del__, so one alarm alone can be lost and the block run on unbounded.
        signal.setitimer(signal.ITIMER_PROF, seconds, _REPEAT_SECONDS)
        yield
    except _Expired:
        raise TooSlow(message) from None
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, outer)
        sys.unraisablehook = hook
        if outer_left:
            left = outer_left - (time.process_time() - start)
            signal.setitimer(signal.ITIMER_PROF, max(left, 1e-6), outer_interval)


def _syntax_depth(tree: ast.AST) -> int:
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


class _Shape:
    """Size, depth, Piecewise count and largest exponent of sympy trees, memoised per
    subtree so that checking after every step costs time linear in the distinct nodes."""

    def __init__(self):
        self.memo: dict = {}

    def measure(self, expr) -> tuple[int, int, int, float]:
        stack = [expr]
        while stack:  # iterative post-order: no recursion limit on deep trees
            node = stack[-1]
            if node in self.memo:
                stack.pop()
                continue
            todo = [a for a in node.args if a not in self.memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            parts = [self.memo[a] for a in node.args]
            size = 1 + sum(p[0] for p in parts)
            depth = 1 + max((p[1] for p in parts), default=0)
            branchings = isinstance(node, sp.Piecewise) + sum(p[2] for p in parts)
            power = max((p[3] for p in parts), default=0.0, key=lambda p: (math.isnan(p), p))
            if (isinstance(node, sp.Function) and not isinstance(node, sp.Piecewise)
                    and type(node).__name__ not in _PRINTABLE):
                power = math.nan  # a function no backend prints
            elif isinstance(node, sp.Pow) and node.exp.is_Number:
                power = max(power, abs(float(node.exp)))
            elif isinstance(node, sp.Number):
                power = max(power, 0.0 if math.isfinite(float(node)) else math.inf)
            self.memo[node] = (size, depth, branchings, power)
        return self.memo[expr]

    def refuse(self, expr, nodes: int, depth: int, branchings: int | None = MAX_BRANCHINGS):
        """Why `expr` is too large, or "" when it is within the limits."""
        if not isinstance(expr, sp.Basic):
            return ""
        size, deep, branches, power = self.measure(expr)
        if math.isnan(power):
            found = sorted({type(f).__name__ for f in expr.atoms(sp.Function)}
                           - _PRINTABLE - {"Piecewise"})
            return f"sympy rewrote it with {', '.join(found)}, which no backend prints"
        if power == math.inf:
            return "a constant is outside the float64 range"
        if power > MAX_EXPONENT:
            return f"exponents are limited to |p| <= {MAX_EXPONENT} (after simplification)"
        if size > nodes:
            return f"too large after simplification (more than {nodes} nodes)"
        if deep > depth:
            return f"nested too deeply after simplification (more than {depth} levels)"
        if branchings is not None and branches > branchings:
            return f"too many branches (more than {branchings} where/abs/max/min/clip)"
        return ""


# --- numpy backend -------------------------------------------------------------------------

def _np_special():
    import scipy.special

    return {"sigmoid": closed_forms.sigmoid, "softplus": closed_forms.softplus,
            "erf": scipy.special.erf, "erfc": scipy.special.erfc}


def numpy_function(expr: sp.Expr):
    """A vectorised float64 numpy function of x for a sympy expression from `parse`.

    The printed code comes from the validated sympy tree, never from user text. Branches of
    where() are all evaluated, so floating-point warnings are silenced; results are exact for
    the chosen branch.
    """
    return closed_forms.vectorised(sp.lambdify(X, expr, modules=[_np_special(), "numpy"]))


def breakpoints(expr: sp.Expr, lo: float, hi: float) -> np.ndarray:
    """Points in [lo, hi] where a branch condition of `expr` switches, sorted and unique.

    These are where an activation's derivative may jump or kink. Linear and polynomial
    conditions are solved exactly; others are located by a sign scan and bisection.
    """
    points: list[float] = []
    for pw in expr.atoms(sp.Piecewise):
        for _, cond in pw.args:
            for rel in _relationals(cond):
                points.extend(_roots(rel.lhs - rel.rhs, lo, hi))
    pts = np.unique(np.asarray([p for p in points if lo <= p <= hi], dtype=float))
    return pts


def _relationals(cond):
    if isinstance(cond, sp.core.relational.Relational):
        return [cond]
    if isinstance(cond, sp.logic.boolalg.BooleanFunction):
        return [r for arg in cond.args for r in _relationals(arg)]
    return []


def _roots(expr: sp.Expr, lo: float, hi: float) -> list[float]:
    if not expr.has(X):
        return []
    if expr.is_polynomial(X) and _degree_bound(expr) <= MAX_EXPONENT:
        coeffs = [float(c) for c in sp.Poly(expr, X).all_coeffs()]
        if len(coeffs) == 2:
            return [-coeffs[1] / coeffs[0] + 0.0]  # + 0.0 turns -0.0 into 0.0
        return [r.real for r in np.roots(coeffs) if abs(r.imag) <= 1e-12 * (1 + abs(r))]
    fn = numpy_function(expr)
    xs = np.linspace(lo, hi, 20001)
    ys = fn(xs)
    roots = list(xs[ys == 0])
    for k in np.nonzero(np.sign(ys[:-1]) * np.sign(ys[1:]) < 0)[0]:
        roots.append(_bisect(fn, xs[k], xs[k + 1], ys[k]))
    return roots


def _degree_bound(expr) -> float:
    """An upper bound on a polynomial's degree in x, without expanding it: above
    MAX_EXPONENT, roots are found numerically (np.roots on a huge companion matrix would
    take hours and gigabytes)."""
    if expr == X:
        return 1
    if not expr.has(X):
        return 0
    if isinstance(expr, sp.Pow) and expr.exp.is_Integer and expr.exp >= 0:
        return int(expr.exp) * _degree_bound(expr.base)
    if isinstance(expr, sp.Mul):
        return sum(_degree_bound(a) for a in expr.args)
    if isinstance(expr, sp.Add):
        return max(_degree_bound(a) for a in expr.args)
    return math.inf


def _bisect(fn, a: float, b: float, fa: float) -> float:
    for _ in range(200):
        m = 0.5 * (a + b)
        if m in (a, b):
            break
        fm = fn(np.array([m]))[0]
        if fm == 0:
            return m
        if np.sign(fm) == np.sign(fa):
            a, fa = m, fm
        else:
            b = m
    return 0.5 * (a + b)
