"""`pooled`: a Conv2d layer keeps its input average-pooled p×p for the weight gradient
(compressed backprop; `ops.pooled_conv`). The forward and the input gradient stay exact."""

from __future__ import annotations

from ..ops.pooled_conv import PooledConv2d
from .base import Method, Option, integer, register


@register
class Pooled(Method):
    name = "pooled"
    copies_conv_input = True
    targets = ("conv2d",)
    options = {"pool": Option(2, integer(1, 64))}
    offers = {"conv2d": ({"pool": 2},)}

    def replacement(self, name, module, rule, draft):
        p = rule.option("pool")
        return PooledConv2d.from_module(module, p=p), f"PooledConv2d (input pooled {p}x{p})"
