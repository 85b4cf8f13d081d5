"""Designer: computes provably optimal tables, fits and bit allocations, offline (numba).

Names are imported on first use: reading a weight or a cached table must not load numba.
"""

from importlib import import_module

_HOME = {"StepwiseFit": "stepwise", "fit_stepwise": "stepwise", "Histogram": "weights",
         "Normal": "weights", "Uniform": "weights", "load_empirical": "weights"}
__all__ = sorted(_HOME)


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_HOME[name]}", __name__), name)
