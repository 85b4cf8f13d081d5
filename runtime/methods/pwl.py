"""`pwl`: an activation whose backward reads the derivative of a piecewise-linear fit of it
(Approx-BP's ReGELU2 and ReSiLU2, `designer.pwl`), a b-bit code of its input kept; the forward
stays exact. The same runtime as `fewbit`, with a piecewise-linear spec."""

from __future__ import annotations

from .base import Option, integer, register
from .fewbit import FewBit, spec_option


@register
class PiecewiseLinear(FewBit):
    name = "pwl"
    kind = "pwl"
    options = {"bits": Option(2, integer(1, 4)), "spec": Option(None, spec_option)}
    offers = {"activation": ({"bits": 2},)}
