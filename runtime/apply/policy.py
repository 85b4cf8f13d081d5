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

What each method does, the targets it takes and its options are its module's
(`runtime/methods/<name>.py`, registered in `methods.METHODS`); this module reads them. A
`block` is a unit of recomputation (`methods.targets.is_block`), for the `checkpoint` method.

A policy is given as a preset name (`fewbit3`), presets joined by `+` (`fewbit3+msnorm`), a
dict, a Policy, or a JSON file. Joined presets keep their rules in order, but a leading
preset's rules first (`tiled` refines what another preset applies: `llm+tiled` tiles the
MS-GLU `llm` makes) and a fallback method's rules last (`lean`, `msact`: the default for the
modules no other preset claims). Files are data only: a path in a rule is relative to the
policy file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from actdesign.errors import ActdesignError
from actdesign.files import read_json, write_atomic

from ..methods import METHODS
from ..methods.targets import TARGETS

FORMAT = "actdesign.policy/1"
PRESETS = {
    "none": [],
    "fewbit3": [{"target": "activation", "apply": "fewbit", "bits": 3}],
    "regelu2": [{"target": "activation", "apply": "pwl", "bits": 2}],
    "msnorm": [{"target": "norm", "apply": "msnorm"}],
    # a convolutional chain's other tensors too: a batch norm's input at 2 bits, a ReLU's
    # 1-bit mask (exact: its derivative has two levels), a max pool's window offsets (exact)
    "actnn2": [{"target": "linear", "apply": "actnn", "bits": 2},
               {"target": "conv2d", "apply": "actnn", "bits": 2},
               {"target": "channel_norm", "apply": "actnn", "bits": 2},
               {"target": "activation", "apply": "fewbit", "bits": 2,
                "type": ["ReLU", "ReLU6", "LeakyReLU", "Hardtanh"]},
               {"target": "pool", "apply": "chain"}],
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
    # convolutional chains keeping one tensor per norm, read by lean layers (the transformer
    # blocks of vision models too), exact to the bit
    "cnn": [{"target": "channel_norm", "apply": "chain"}, {"target": "norm", "apply": "chain"},
            {"target": "activation", "apply": "chain"}, {"target": "pool", "apply": "chain"},
            {"target": "conv2d", "apply": "lean"}, {"target": "linear", "apply": "lean"}],
}
# In presets joined by '+', these rules come first: they refine what another preset applies
# to the same modules (so llm+tiled tiles the MS-GLU llm makes).
_LEADS = ("tiled",)
_BASE_KEYS = {"target", "apply", "name", "type"}


@dataclass(frozen=True)
class Rule:
    target: str
    apply: str
    names: tuple[str, ...] = ("*",)  # globs over the module's qualified name
    types: tuple[str, ...] = ()  # class names; empty: any class of the target kind
    options: tuple[tuple[str, object], ...] = ()

    def option(self, key):
        return dict(self.options)[key]

    def matches(self, name: str, module, target: str) -> bool:
        """Whether the rule names `module`, of kind `target`, at `name`."""
        return self.target == target and any(fnmatchcase(name, g) for g in self.names) \
            and (not self.types or type(module).__name__ in self.types)

    def to_dict(self) -> dict:
        out = {"target": self.target, "apply": self.apply}
        if self.names != ("*",):
            out["name"] = self.names[0] if len(self.names) == 1 else list(self.names)
        if self.types:
            out["type"] = self.types[0] if len(self.types) == 1 else list(self.types)
        defaults = METHODS[self.apply].options
        return out | {k: v for k, v in self.options
                      if v is not None and v != defaults[k].default}


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    label: str = "policy"

    def to_dict(self) -> dict:
        return {"format": FORMAT, "rules": [r.to_dict() for r in self.rules]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def rule_for(self, name: str, module, target: str) -> Rule | None:
        """The first rule for `module`, of kind `target`, at `name`; None where none is."""
        return next((rule for rule in self.rules if rule.matches(name, module, target)), None)


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
            # a fallback method's rules last: the default for the modules no other preset
            # claims (llm+actnn2 quantizes the Linear layers llm would keep lean)
            rules = leads + sorted(rules, key=lambda r: METHODS[r["apply"]].fallback)
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
    declared = METHODS[method]
    if target not in declared.targets:
        raise ActdesignError(f"{where}: {method!r} does not apply to {target!r} modules")
    known = declared.options
    unknown = set(r) - _BASE_KEYS - set(known)
    if unknown:
        raise ActdesignError(f"{where}: unknown key {sorted(unknown)[0]!r} for {method!r}"
                             + (f" (known: {', '.join(sorted(known))})" if known else ""))
    options = {k: o.check(r.get(k, o.default), f"{where}.{k}", base) for k, o in known.items()}
    return Rule(target, method, _strings(r.get("name", "*"), f"{where}.name"),
                _strings(r.get("type", []), f"{where}.type"), tuple(options.items()))


def _strings(value, where) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ActdesignError(f"{where} must be a non-empty string or a list of them")
    return tuple(values)
