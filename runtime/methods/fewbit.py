"""`fewbit`: an activation keeps a b-bit code of its input, and its backward reads the
derivative from an optimal step table (`designer.stepwise`, `templates/fewbit_ops.py.jinja`).

The table is the rule's `spec`: a built-in table name (`gelu3`: the 3-bit stepwise table
under N(0, 1); `regelu2`: the 2-bit piecewise-linear fit), a spec file or an inline spec;
without one, the table is fitted for the module's own activation, once, and cached.
"""

from __future__ import annotations

import re
from pathlib import Path

from actdesign import spec as spec_mod
from actdesign.activation import resolve
from actdesign.errors import ActdesignError

from ..ops.cache import load
from ..ops.known_modules import activation_name, has_builtin
from ..ops.tables import table
from .base import Method, Option, integer, register

_TABLE_NAME = re.compile(r"(re)?([a-z][a-z0-9_]*?)([1-8])")


def table_name(text: str) -> tuple[str, str, int] | None:
    """('stepwise' | 'pwl', activation, bits) of a built-in table name such as gelu3 or
    regelu2 (re-: the piecewise-linear fit), or None."""
    from actdesign.activation import builtin_names

    m = _TABLE_NAME.fullmatch(text)
    if m is None:
        return None
    names = set(builtin_names())
    pwl, act, bits = m.group(1), m.group(2), int(m.group(3))
    if pwl and act in names and bits <= 4:
        return "pwl", act, bits
    if not pwl and act in names:
        return "stepwise", act, bits
    if pwl and ("re" + act) in names:  # a built-in whose own name starts with "re" (relu)
        return "stepwise", "re" + act, bits
    return None


def spec_option(value, where, base):
    """None (fit on the fly), a built-in table name, a spec file path or an inline spec.
    Paths become absolute; inline specs are validated now, so a bad one fails early."""
    if value is None or isinstance(value, dict):
        if isinstance(value, dict):
            spec_mod.validate(value, where)
        return value
    if not isinstance(value, str) or not value:
        raise ActdesignError(f"{where} must be a table name, a spec path or a spec object")
    if table_name(value) is not None:
        return value
    if not value.endswith(".json"):
        raise ActdesignError(f"{where}: {value!r} is neither a built-in table name (such as "
                             "gelu3 or regelu2) nor a .json spec file")
    path = Path(value)
    if base is not None and not path.is_absolute():
        path = base / path
    spec_mod.load(path)  # fail now, not halfway through compressing a model
    return str(path.resolve())


def _fewest(kind, activation, bits) -> spec_mod.Spec:
    """The table at `bits`, or at the fewest bits whose table is exact already (zero error: a
    derivative of two levels, ReLU's, needs one bit; ReLU6's three need two): more bits
    would keep more and tell nothing more. The tables of up to 4 bits are shipped."""
    for fewer in range(1, min(bits, 5)):
        spec = table(kind, activation, fewer)
        if spec.error.get("E") == 0:
            return spec
    return table(kind, activation, bits)


@register
class FewBit(Method):
    name = "fewbit"
    kind = "stepwise"  # the kind of spec its table is
    targets = ("activation",)
    options = {"bits": Option(3, integer(1, 8)), "spec": Option(None, spec_option)}
    offers = {"activation": tuple({"bits": b} for b in (1, 2, 3, 4))}
    codes_what_it_keeps = True

    def takes(self, module) -> bool:
        return activation_name(module) is not None

    def replacement(self, name, module, rule, draft):
        spec = self.spec_for(module, rule)
        kind = "piecewise-linear" if spec.kind == "pwl" else "stepwise"
        return load(spec).Module(), f"{spec.activation.get('name') or 'expression'} " \
                                    f"{spec.bits}-bit {kind} table"

    def spec_for(self, module, rule) -> spec_mod.Spec:
        """The table for an activation module: the rule's spec, or the built-in one for its
        own activation; refused when it is for another activation or the other kind."""
        own = activation_name(module)
        if own is None and not has_builtin(module):
            trained = ", with trainable parameters," if any(True for _ in module.parameters()) \
                else ""
            raise ActdesignError(f"{type(module).__name__}{trained} computes no built-in "
                                 "activation, which the tables are fitted for")
        if own is None:
            raise ActdesignError(f"its settings ({module.extra_repr() or 'none'}) match no "
                                 "built-in activation")
        given = rule.option("spec")
        if given is None:
            return _fewest(self.kind, own, rule.option("bits"))
        if isinstance(given, str) and table_name(given) is not None:
            kind_given, act, bits = table_name(given)
            spec = table(kind_given, resolve(act).name, bits)
        else:
            spec = spec_mod.load(given)
        named = spec.activation.get("name")
        if named is None or resolve(named).name != own:
            raise ActdesignError(f"its spec is for {named or spec.activation.get('expr')!r}, "
                                 f"but the module computes {own}")
        if spec.kind != self.kind:
            raise ActdesignError(f"'{self.name}' needs a {self.kind} spec, got a {spec.kind} "
                                 "one")
        return spec
