"""Policies: which method applies to which module, as data.

A policy is an ordered list of rules. A rule names a target kind, optionally narrows it by
module class name and by module-name glob, and says what to apply with which options. For
each module the first matching rule wins, so a `keep` rule placed first excludes modules.

    {"format": "actdesign.policy/1", "rules": [
      {"target": "activation", "name": "*.mlp.*", "apply": "fewbit", "bits": 3},
      {"target": "norm", "apply": "msnorm"},
      {"target": "linear", "name": ["*.attn.*"], "type": "Linear", "apply": "keep"},
      {"target": "linear", "apply": "actnn", "bits": 2}
    ]}

A `block` is a unit of recomputation: an element of an nn.ModuleList (a transformer layer,
`model.layers.3`) or an element with parameters and submodules of its own of an nn.Sequential
(a CNN stage), unless it is a target of another kind. `checkpoint` recomputes the blocks a
rule names in the backward, keeping only their inputs (in host memory with `"offload":
true`); the modules inside them are still compressed by their own rules, and the recompute is
exact. The preset `offload` recomputes every block, its input on the host:

    {"target": "block", "name": "model.layers.*", "apply": "checkpoint"}

`msglu` with `"tile"` ("auto", or a number of tokens) runs the gated MLP in sequence tiles,
keeping only its input: the long-sequence option (the preset `tiled`; joined by `+`, its rule
comes first, so `llm+tiled` tiles the MS-GLU that `llm` makes).

`msact` gives an activation outside a gated MLP (GPT-2's gelu_new) one kernel each way and
keeps only its input, which the layer reading its output shares; exact, so `llm` applies it
where no other preset claims the activation.

A policy is given as a preset name (`fewbit3`), presets joined by `+` (`fewbit3+msnorm`), a
dict, a Policy, or a JSON file. Files are data only: a spec named in a rule is a path to a
spec file (relative to the policy file), a built-in table name (`gelu3`: the 3-bit stepwise
table under N(0, 1); `regelu2`: the 2-bit piecewise-linear fit) or an inline spec; without a
spec, the table is fitted for the module's own activation, once, and cached.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from actdesign.errors import ActdesignError
from actdesign.files import read_json, write_atomic

from ..methods.targets import TARGETS

FORMAT = "actdesign.policy/1"
# apply -> (targets it applies to, {option: default})
METHODS = {
    "keep": (TARGETS, {}),
    "fewbit": (("activation",), {"bits": 3, "spec": None}),
    "pwl": (("activation",), {"bits": 2, "spec": None}),
    "msnorm": (("norm",), {}),
    "actnn": (("linear", "conv2d"), {"bits": 2, "group_size": 256, "allocation": None}),
    "backrazor": (("linear", "conv2d"), {"ratio": 0.9, "int8": False}),
    "pooled": (("conv2d",), {"pool": 2}),
    "lean": (("linear",), {}),
    "msglu": (("glu",), {"tile": None}),
    "msact": (("activation",), {}),
    "rope": (("attention",), {}),
    "fused_ce": (("head",), {"chunk_size": None}),
    "checkpoint": (("block",), {"offload": False}),
}
PRESETS = {
    "none": [],
    "fewbit3": [{"target": "activation", "apply": "fewbit", "bits": 3}],
    "regelu2": [{"target": "activation", "apply": "pwl", "bits": 2}],
    "msnorm": [{"target": "norm", "apply": "msnorm"}],
    "actnn2": [{"target": "linear", "apply": "actnn", "bits": 2},
               {"target": "conv2d", "apply": "actnn", "bits": 2}],
    "backrazor90": [{"target": "linear", "apply": "backrazor", "ratio": 0.9},
                    {"target": "conv2d", "apply": "backrazor", "ratio": 0.9}],
    "pooled2": [{"target": "conv2d", "apply": "pooled", "pool": 2}],
    "llm": [{"target": "norm", "apply": "msnorm"}, {"target": "glu", "apply": "msglu"},
            {"target": "attention", "apply": "rope"}, {"target": "head", "apply": "fused_ce"},
            {"target": "linear", "apply": "lean"}, {"target": "activation", "apply": "msact"}],
    # every block recomputed, its input kept in host memory meanwhile
    "offload": [{"target": "block", "apply": "checkpoint", "offload": True}],
    # gated MLPs in sequence tiles, the tile size from the shape
    "tiled": [{"target": "glu", "apply": "msglu", "tile": "auto"}],
}
# In presets joined by '+', these rules come first: they refine what another preset applies
# to the same modules (so llm+tiled tiles the MS-GLU llm makes).
_LEADS = ("tiled",)
# In presets joined by '+', these rules come last: the default for modules no other preset
# claims (so llm+actnn2 quantizes the Linear layers llm would only keep lean, and llm+fewbit3
# gives GPT-2's activation its table).
_FALLBACKS = ("lean", "msact")
_BASE_KEYS = {"target", "apply", "name", "type"}
_TABLE_NAME = re.compile(r"(re)?([a-z][a-z0-9_]*?)([1-8])")


@dataclass(frozen=True)
class Rule:
    target: str
    apply: str
    names: tuple[str, ...] = ("*",)  # globs over the module's qualified name
    types: tuple[str, ...] = ()  # class names; empty: any class of the target kind
    options: tuple[tuple[str, object], ...] = ()

    def option(self, key):
        return dict(self.options)[key]

    def to_dict(self) -> dict:
        out = {"target": self.target, "apply": self.apply}
        if self.names != ("*",):
            out["name"] = self.names[0] if len(self.names) == 1 else list(self.names)
        if self.types:
            out["type"] = self.types[0] if len(self.types) == 1 else list(self.types)
        return out | {k: v for k, v in self.options
                      if v is not None and v != METHODS[self.apply][1][k]}


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    label: str = "policy"

    def to_dict(self) -> dict:
        return {"format": FORMAT, "rules": [r.to_dict() for r in self.rules]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"


def load(source) -> Policy:
    """A Policy from a preset name or `a+b` combination, a dict, a Policy or a JSON file."""
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return validate(source, "policy")
    if isinstance(source, str | Path):
        text = str(source)
        if not text.endswith(".json") and all(p in PRESETS for p in text.split("+")):
            rules = [r for p in text.split("+") for r in PRESETS[p]]
            leads = [r for p in text.split("+") if p in _LEADS for r in PRESETS[p]]
            rules = [r for r in rules if r not in leads]
            rules = leads + sorted(rules, key=lambda r: r["apply"] in _FALLBACKS)  # stable
            return validate({"format": FORMAT, "rules": rules}, text, label=text)
        if not text.endswith(".json"):
            raise ActdesignError(_unknown(text))
        return _load_file(Path(text))
    raise ActdesignError(f"a policy is a preset name, a dict or a .json path, not "
                         f"{type(source).__name__}")


def _unknown(text: str) -> str:
    """Why `text` names no policy: its first part that is no preset, with the nearest."""
    import difflib

    parts = text.split("+")
    bad = next(p for p in parts if p not in PRESETS)
    near = difflib.get_close_matches(bad, PRESETS, n=1)
    what = f"preset {bad!r} in policy {text!r}" if len(parts) > 1 else f"policy {text!r}"
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (f"unknown {what}{hint}: use a preset ({', '.join(PRESETS)}), presets joined by "
            "'+', or a .json file")


def save(policy: Policy, path) -> Path:
    return write_atomic(path, policy.to_json())


def _load_file(path: Path) -> Policy:
    return validate(read_json(path, "policy"), str(path), base=path.parent, label=path.name)


def validate(data, origin: str = "policy", base: Path | None = None,
             label: str | None = None) -> Policy:
    """Check every key and value; spec paths are resolved against `base`."""
    if not isinstance(data, dict):
        raise ActdesignError(f"{origin}: must be a JSON object")
    unknown = set(data) - {"format", "rules"}
    if unknown:
        raise ActdesignError(f"{origin}: unknown key {sorted(unknown)[0]!r}")
    if data.get("format", FORMAT) != FORMAT:
        raise ActdesignError(f"{origin}: format must be {FORMAT!r}, got {data['format']!r}")
    rules = data.get("rules")
    if not isinstance(rules, list):
        raise ActdesignError(f"{origin}: 'rules' must be a list")
    return Policy(tuple(_rule(r, f"{origin}: rules[{i}]", base) for i, r in enumerate(rules)),
                  label or origin)


def _rule(r, where: str, base: Path | None) -> Rule:
    if not isinstance(r, dict):
        raise ActdesignError(f"{where} must be an object")
    target, method = r.get("target"), r.get("apply")
    if target not in TARGETS:
        raise ActdesignError(f"{where}: target must be one of {', '.join(TARGETS)}, "
                             f"got {target!r}")
    if not isinstance(method, str) or method not in METHODS:  # a list or dict is unhashable
        raise ActdesignError(f"{where}: apply must be one of {', '.join(METHODS)}, "
                             f"got {method!r}")
    targets, defaults = METHODS[method]
    if target not in targets:
        raise ActdesignError(f"{where}: {method!r} does not apply to {target!r} modules")
    unknown = set(r) - _BASE_KEYS - set(defaults)
    if unknown:
        raise ActdesignError(f"{where}: unknown key {sorted(unknown)[0]!r} for {method!r}"
                             + (f" (known: {', '.join(sorted(defaults))})" if defaults else ""))
    options = {k: _option(method, k, r.get(k, v), f"{where}.{k}", base)
               for k, v in defaults.items()}
    return Rule(target, method, _strings(r.get("name", "*"), f"{where}.name"),
                _strings(r.get("type", []), f"{where}.type"), tuple(options.items()))


def _strings(value, where) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ActdesignError(f"{where} must be a non-empty string or a list of them")
    return tuple(values)


def _option(method, key, value, where, base):
    def integer(lo, hi):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ActdesignError(f"{where} must be an integer in {lo}..{hi}, got {value!r}")
        return value

    if key == "bits":
        return integer(1, 4 if method == "pwl" else 8)
    if key == "group_size":
        value = integer(8, 1 << 20)
        if value & (value - 1):
            raise ActdesignError(f"{where} must be a power of two, got {value}")
        return value
    if key == "pool":
        return integer(1, 64)
    if key == "chunk_size":
        return None if value is None else integer(1, 1 << 30)
    if key == "tile":
        return value if value is None or value == "auto" else integer(1, 1 << 30)
    if key in ("int8", "offload"):
        if not isinstance(value, bool):
            raise ActdesignError(f"{where} must be true or false, got {value!r}")
        return value
    if key == "ratio":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ActdesignError(f"{where} must be a number in [0, 1), got {value!r}")
        return float(value)
    if key == "spec":
        return _spec_option(value, where, base)
    if key == "allocation":
        return _allocation_option(value, where, base)
    raise AssertionError(key)


def _spec_option(value, where, base):
    """None (fit on the fly), a built-in table name, a spec file path or an inline spec.
    Paths become absolute; inline specs are validated now, so a bad one fails early."""
    from actdesign import spec as spec_mod

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


def _allocation_option(value, where, base):
    """None, or a bits file (`actdesign allocate`, `calibrate`): its per-layer bits override
    `bits` for the layers it names. Read now, so a bad file fails early; kept as a path."""
    from actdesign.designer.allocate import load_bits

    if value is None:
        return None
    if not isinstance(value, str) or not value.endswith(".json"):
        raise ActdesignError(f"{where} must be the path of a .json bits file")
    path = Path(value)
    if base is not None and not path.is_absolute():
        path = base / path
    load_bits(path)
    return str(path.resolve())


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
