"""Designer: computes provably optimal tables, fits and bit allocations, offline (numba)."""

from .stepwise import StepwiseFit, fit_stepwise
from .weights import Histogram, Normal, Uniform, load_empirical

__all__ = ["Histogram", "Normal", "StepwiseFit", "Uniform", "fit_stepwise", "load_empirical"]
