"""The compression methods and what they target: one module per method, read by compress,
estimate, the planner and the CLI through one registry (`METHODS`, `base`). Imports the ops
and the models below it; the floors above (apply, calibration, memory) read it.

A method's module declares it whole (`base.Method`); its op lives in `ops/` and its kernels
in `templates/`. Importing this package registers every method, in the order below: the
order a policy's error lists them in and the planner offers their options in.
"""

from .base import METHODS, Method, Option, option_label, register  # noqa: I001

# Each registers its method, in the registry's order.
from . import keep, fewbit, pwl, msnorm, actnn, backrazor, pooled  # noqa: F401
from . import lean, msglu, msact, rope, fused_ce, checkpoint, chain  # noqa: F401

__all__ = ["METHODS", "Method", "Option", "option_label", "register"]
