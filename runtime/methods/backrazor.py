"""`backrazor`: a Linear or Conv2d layer keeps, per sample, only the largest (1 - ratio) of
its input's magnitudes for the weight gradient, as a 1-bit mask and the values (Back Razor;
`ops.sparse`). The forward and the input gradient stay exact."""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.sparse import SparseConv2d, SparseLinear
from .base import Method, Option, boolean, register


def fraction(value, where, base=None):
    """A number in [0, 1), kept as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ActdesignError(f"{where} must be a number in [0, 1), got {value!r}")
    return float(value)


@register
class BackRazor(Method):
    name = "backrazor"
    copies_conv_input = True
    targets = ("linear", "conv2d")
    options = {"ratio": Option(0.9, fraction), "int8": Option(False, boolean)}
    offers = {kind: ({"ratio": 0.5}, {"ratio": 0.9}) for kind in ("linear", "conv2d")}

    def replacement(self, name, module, rule, draft):
        cls = SparseConv2d if isinstance(module, nn.Conv2d) else SparseLinear
        ratio, int8 = rule.option("ratio"), rule.option("int8")
        new = cls.from_module(module, ratio=ratio, int8=int8)
        kept = f"top {1 - ratio:.0%}" + (", int8" if int8 else "")
        return new, f"{cls.__name__} ({kept} of the input saved)"
