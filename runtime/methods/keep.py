"""`keep`: the modules a rule names stay as they are. Placed first, a keep rule takes its
modules out of the rules after it."""

from __future__ import annotations

from .base import Method, register
from .targets import TARGETS


@register
class Keep(Method):
    name = "keep"
    targets = TARGETS

    def replace(self, name, module, rule, draft) -> None:
        raise AssertionError("a keep rule chooses no module")
