"""f, f' and f'' of the built-in activations as numpy code, and where f' jumps or kinks.

The same values the expression language computes from the sympy tree of each built-in's
formula, operation for operation (tests compare them bit for bit), without importing sympy:
fitting a built-in needs only these. Each product and sum is written in the order sympy's
printer writes it, since floating-point rounding depends on that order.
"""

from __future__ import annotations

import numpy as np

_R2 = np.sqrt(2)
_RPI = np.sqrt(np.pi)


def sigmoid(a):
    """1/(1+exp(-a)), without overflow on either side."""
    a = np.asarray(a, dtype=float)
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(a):
    """log(1+exp(a)), without overflow."""
    a = np.asarray(a, dtype=float)
    return np.maximum(a, 0.0) + np.log1p(np.exp(-np.abs(a)))


def vectorised(fn):
    """`fn` as a float64 function of an array, the same shape out as in; where() evaluates
    every branch, so floating-point warnings are silenced."""

    def evaluate(x):
        x = np.asarray(x, dtype=float)
        with np.errstate(all="ignore"):
            out = np.asarray(fn(x), dtype=float)
        return np.broadcast_to(out, x.shape).copy() if out.shape != x.shape else out

    return evaluate


def _erf(a):
    from scipy.special import erf  # only the erf-based built-ins need scipy

    return erf(a)


def _clip(x, lo, hi):
    return np.where(x < lo, lo, np.where(x > hi, hi, x))


def _hard(x):  # clip(x + 3, 0, 6), its branches decided on x itself as sympy's are
    return np.where(x < -3, 0, np.where(x > 3, 6, x + 3))


def _inside(x, lo, hi):  # 1 inside [lo, hi], 0 outside: clip's derivative
    return np.where((x > hi) | (x < lo), 0, 1)


def _gelu(x):
    return 0.5 * x * (_erf(0.5 * _R2 * x) + 1)


def _gelu_d1(x):
    e = np.exp(-1 / 2 * x**2)
    return 0.5 * _R2 * x * e / _RPI + 0.5 * _erf(0.5 * _R2 * x) + 0.5


def _gelu_d2(x):
    e = np.exp(-1 / 2 * x**2)
    return -0.5 * _R2 * x**2 * e / _RPI + 1.0 * _R2 * e / _RPI


def _gelu_tanh_parts(x):
    t = np.tanh(_R2 * (0.044715 * x**3 + x) / _RPI)
    return t, 1 - t**2, 0.134145 * x**2 + 1


def _gelu_tanh(x):
    t, _, _ = _gelu_tanh_parts(x)
    return 0.5 * x * (t + 1)


def _gelu_tanh_d1(x):
    t, sech2, p = _gelu_tanh_parts(x)
    return 0.5 * _R2 * x * sech2 * p / _RPI + 0.5 * t + 0.5


def _gelu_tanh_d2(x):
    t, sech2, p = _gelu_tanh_parts(x)
    return (0.134145 * _R2 * x**2 * sech2 / _RPI - 2.0 * x * sech2 * p**2 * t / np.pi
            + 1.0 * _R2 * sech2 * p / _RPI)


def _quick_gelu_d1(x):
    s = sigmoid(1.702 * x)
    return 1.702 * x * (1 - s) * s + s


def _quick_gelu_d2(x):
    s = sigmoid(1.702 * x)
    return 2.896804 * x * (1 - s)**2 * s - 2.896804 * x * (1 - s) * s**2 + 3.404 * (1 - s) * s


def _silu_d1(x):
    s = sigmoid(x)
    return x * (1 - s) * s + s


def _silu_d2(x):
    s = sigmoid(x)
    return x * (1 - s)**2 * s - x * (1 - s) * s**2 + 2 * (1 - s) * s


def _mish_d1(x):
    t, s = np.tanh(softplus(x)), sigmoid(x)
    return x * (1 - t**2) * s + t


def _mish_d2(x):
    t, s = np.tanh(softplus(x)), sigmoid(x)
    return x * (1 - s) * (1 - t**2) * s - 2 * x * (1 - t**2) * s**2 * t + 2 * (1 - t**2) * s


def _sigmoid_d2(x):
    s = sigmoid(x)
    return (1 - s)**2 * s - (1 - s) * s**2


def _softsign_parts(x):
    return np.where(x >= 0, x, -x) + 1, np.where(x >= 0, 1, -1)  # 1 + |x|, sign(x)


def _softsign_d1(x):
    a, sign = _softsign_parts(x)
    return -x * sign / a**2 + a**(-1.0)


def _softsign_d2(x):
    a, sign = _softsign_parts(x)
    return 2 * x / a**3 - 2 * sign / a**2


def _hardswish_d1(x):
    return 1 / 6 * x * _inside(x, -3, 3) + 1 / 6 * _hard(x)


def _zero(x):
    return 0


# name -> (f, f', f'', the points where f' jumps or kinks)
TABLE = {
    "relu": (lambda x: np.where(x >= 0, x, 0), lambda x: np.where(x >= 0, 1, 0), _zero,
             (0.0,)),
    "leaky_relu": (lambda x: np.where(x >= 0, x, 0.01 * x),
                   lambda x: np.where(x >= 0, 1, 0.01), _zero, (0.0,)),
    "relu6": (lambda x: _clip(x, 0, 6), lambda x: _inside(x, 0, 6), _zero, (0.0, 6.0)),
    "elu": (lambda x: np.where(x > 0, x, np.exp(x) - 1), lambda x: np.where(x > 0, 1, np.exp(x)),
            lambda x: np.where(x > 0, 0, np.exp(x)), (0.0,)),
    "celu": (lambda x: np.where(x > 0, x, np.exp(1.0 * x) - 1),
             lambda x: np.where(x > 0, 1, 1.0 * np.exp(1.0 * x)),
             lambda x: np.where(x > 0, 0, 1.0 * np.exp(1.0 * x)), (0.0,)),
    "selu": (lambda x: 1.0507009873554805 * np.where(
                 x > 0, x, 1.6732632423543772 * np.exp(x) - 1.6732632423543772),
             lambda x: 1.0507009873554805 * np.where(x > 0, 1, 1.6732632423543772 * np.exp(x)),
             lambda x: 1.0507009873554805 * np.where(x > 0, 0, 1.6732632423543772 * np.exp(x)),
             (0.0,)),
    "gelu": (_gelu, _gelu_d1, _gelu_d2, ()),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_d1, _gelu_tanh_d2, ()),
    "quick_gelu": (lambda x: x * sigmoid(1.702 * x), _quick_gelu_d1, _quick_gelu_d2, ()),
    "silu": (lambda x: x * sigmoid(x), _silu_d1, _silu_d2, ()),
    "mish": (lambda x: x * np.tanh(softplus(x)), _mish_d1, _mish_d2, ()),
    "sigmoid": (sigmoid, lambda x: (1 - sigmoid(x)) * sigmoid(x), _sigmoid_d2, ()),
    "tanh": (np.tanh, lambda x: 1 - np.tanh(x)**2,
             lambda x: -(2 - 2 * np.tanh(x)**2) * np.tanh(x), ()),
    "softplus": (softplus, sigmoid, lambda x: (1 - sigmoid(x)) * sigmoid(x), ()),
    "softsign": (lambda x: x / _softsign_parts(x)[0], _softsign_d1, _softsign_d2, (0.0,)),
    "logsigmoid": (lambda x: -softplus(-x), lambda x: sigmoid(-x),
                   lambda x: -(1 - sigmoid(-x)) * sigmoid(-x), ()),
    "tanhshrink": (lambda x: x - np.tanh(x), lambda x: np.tanh(x)**2,
                   lambda x: (2 - 2 * np.tanh(x)**2) * np.tanh(x), ()),
    "hardswish": (lambda x: 1 / 6 * x * _hard(x), _hardswish_d1,
                  lambda x: 1 / 3 * _inside(x, -3, 3), (-3.0, 3.0)),
    "hardsigmoid": (lambda x: 1 / 6 * _hard(x), lambda x: 1 / 6 * _inside(x, -3, 3),
                    _zero, (-3.0, 3.0)),
    "hardtanh": (lambda x: _clip(x, -1, 1), lambda x: _inside(x, -1, 1), _zero, (-1.0, 1.0)),
    "squared_relu": (lambda x: np.where(x >= 0, x**2, 0), lambda x: np.where(x >= 0, 2 * x, 0),
                     lambda x: np.where(x >= 0, 2, 0), (0.0,)),
}


# name -> ((α, β), (γ, δ)): the left and right linear asymptotes α + βx and γ + δx, the exact
# limits sympy finds for the formula (tests compare them); None: there is none (squared_relu).
ASYMPTOTES = {
    "relu": ((0.0, 0.0), (0.0, 1.0)), "leaky_relu": ((0.0, 0.01), (0.0, 1.0)),
    "relu6": ((0.0, 0.0), (6.0, 0.0)), "elu": ((-1.0, 0.0), (0.0, 1.0)),
    "celu": ((-1.0, 0.0), (0.0, 1.0)),
    # -1.0507009873554804934193349852946 * 1.6732632423543772848170429916717, rounded once
    "selu": ((-1.7580993408473768, 0.0), (0.0, 1.0507009873554805)),
    "gelu": ((0.0, 0.0), (0.0, 1.0)), "gelu_tanh": ((0.0, 0.0), (0.0, 1.0)),
    "quick_gelu": ((0.0, 0.0), (0.0, 1.0)), "silu": ((0.0, 0.0), (0.0, 1.0)),
    "mish": ((0.0, 0.0), (0.0, 1.0)), "sigmoid": ((0.0, 0.0), (1.0, 0.0)),
    "tanh": ((-1.0, 0.0), (1.0, 0.0)), "softplus": ((0.0, 0.0), (0.0, 1.0)),
    "softsign": ((-1.0, 0.0), (1.0, 0.0)), "logsigmoid": ((0.0, 1.0), (0.0, 0.0)),
    "tanhshrink": ((1.0, 1.0), (-1.0, 1.0)), "hardswish": ((0.0, 0.0), (0.0, 1.0)),
    "hardsigmoid": ((0.0, 0.0), (1.0, 0.0)), "hardtanh": ((-1.0, 0.0), (1.0, 0.0)),
    "squared_relu": None,
}


def breakpoints(name: str, lo: float, hi: float) -> np.ndarray:
    """Where f' of a built-in may jump or kink inside [lo, hi], sorted."""
    points = TABLE[name][3]
    return np.unique(np.asarray([p for p in points if lo <= p <= hi], dtype=float))
