"""The spec file: the designer's output and every later stage's input.

A spec is JSON and data only. It is validated on load; later stages read numbers from it and
resolve the activation through the registry or the expression language, never executing it.

    {
      "format": "actdesign.spec/1",
      "kind": "stepwise",
      "bits": 3,
      "activation": {"name": "gelu"}            or {"expr": "x*sigmoid(1.702*x)"},
      "borders": [...2^bits - 1 ascending...],
      "levels": [...2^bits...],
      "objective": {"weight": {"type": "normal", "mean": 0.0, "std": 1.0}, "grid": 2048},
      "error": {"E": ..., "relative": ..., ...},
      "provenance": {"actdesign": "0.1.0", "created": "2026-11-29T09:00:00Z"}
    }
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .activation import Activation
from .activation import from_dict as activation_from_dict
from .errors import ActdesignError
from .files import loads_json, read_json, write_atomic

FORMAT = "actdesign.spec/1"
KINDS = ("stepwise", "pwl")
MAX_BITS = 8
_TOP_KEYS = {"format", "kind", "bits", "activation", "borders", "levels", "objective", "error",
             "provenance", "pwl"}


@dataclass(frozen=True)
class Spec:
    kind: str
    bits: int
    activation: dict
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    objective: dict
    error: dict
    provenance: dict
    pwl: dict | None = None  # kind "pwl": {"a", "c", "left": [α, β], "right": [γ, δ]}

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "kind": self.kind, "bits": self.bits,
               "activation": dict(self.activation), "borders": list(self.borders),
               "levels": list(self.levels), "objective": self.objective,
               "error": self.error, "provenance": self.provenance}
        if self.pwl is not None:
            out["pwl"] = self.pwl
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def resolve_activation(self) -> Activation:
        return activation_from_dict(self.activation)


def from_fit(fit) -> Spec:
    """The spec of a designer result (a StepwiseFit)."""
    error = {"E": fit.error, "relative": fit.relative_error, "reference": fit.reference,
             "quadrature_bound": fit.error_estimate, "grid_E": fit.grid_error,
             "stationarity": fit.stationarity}
    return validate({
        "format": FORMAT, "kind": "stepwise", "bits": fit.bits,
        "activation": fit.activation.to_dict(),
        "borders": [float(v) for v in fit.borders], "levels": [float(v) for v in fit.levels],
        "objective": {"weight": fit.weight.to_dict(), "grid": fit.grid_size},
        "error": {k: float(v) for k, v in error.items()},
        "provenance": _provenance(),
    })


def from_pwl(fit) -> Spec:
    """The spec of a piecewise-linear fit (a PwlFit): borders = c, levels = β + cumsum(a)."""
    return validate({
        "format": FORMAT, "kind": "pwl", "bits": fit.bits,
        "activation": fit.activation.to_dict(),
        "borders": [float(v) for v in fit.borders], "levels": [float(v) for v in fit.levels],
        "objective": {"weight": fit.weight.to_dict()},
        "error": {"objective": fit.objective, "quadrature_bound": fit.objective_estimate,
                  "max_abs": fit.max_abs},
        "pwl": {"a": [float(v) for v in fit.coefficients], "c": [float(v) for v in fit.knots],
                "left": [float(v) for v in fit.left], "right": [float(v) for v in fit.right]},
        "provenance": _provenance(),
    })


def _provenance() -> dict:
    now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return {"actdesign": __version__, "created": now}


def behaviour(spec: Spec) -> dict:
    """The spec's data without its provenance (who made it, when): what generated code may
    depend on, so that the same table always makes the same op module."""
    out = spec.to_dict()
    del out["provenance"]
    return out


def behaviour_json(spec: Spec) -> str:
    return json.dumps(behaviour(spec), sort_keys=True, allow_nan=False)


def validate(data, origin: str = "spec") -> Spec:
    """Check every field of a parsed spec; raise ActdesignError naming the first bad one."""
    v = _Validator(origin)
    v.require(isinstance(data, dict), "", "must be a JSON object")
    unknown = sorted(set(data) - _TOP_KEYS)
    v.require(not unknown, "", f"unknown field(s) {', '.join(unknown)}")
    missing = sorted(_TOP_KEYS - set(data) - {"error", "provenance", "pwl"})
    v.require(not missing, "", f"missing field(s) {', '.join(missing)}")
    fmt = data["format"]
    v.require(fmt == FORMAT, "format", f"is {fmt!r}; this actdesign reads {FORMAT!r}")
    v.require(data["kind"] in KINDS, "kind", f"must be one of {', '.join(KINDS)}")
    bits = v.integer(data["bits"], "bits", 1, MAX_BITS)
    act = data["activation"]
    v.require(isinstance(act, dict) and len(act) == 1 and set(act) <= {"name", "expr"},
              "activation", 'must be {"name": builtin} or {"expr": text}')
    (key, text), = act.items()
    v.require(isinstance(text, str), f"activation.{key}", "must be a string")
    try:
        activation_from_dict(act)
    except ActdesignError as exc:
        raise ActdesignError(f"{origin}: activation: {exc}") from None
    borders = v.numbers(data["borders"], "borders", 2**bits - 1)
    for i in range(1, len(borders)):
        v.require(borders[i] > borders[i - 1], f"borders[{i}]",
                  "borders must be strictly ascending")
    levels = v.numbers(data["levels"], "levels", 2**bits)
    objective = _objective(v, data["objective"])
    error = data.get("error", {})
    v.require(isinstance(error, dict), "error", "must be an object")
    for k, val in error.items():
        v.number(val, f"error.{k}")
    prov = data.get("provenance", {})
    v.require(isinstance(prov, dict) and all(isinstance(x, str) for x in prov.values()),
              "provenance", "must be an object of strings")
    pwl = _pwl(v, data.get("pwl"), borders, levels) if data["kind"] == "pwl" else None
    v.require(data["kind"] == "pwl" or "pwl" not in data, "pwl", "belongs to kind pwl only")
    return Spec(data["kind"], bits, dict(act), tuple(borders), tuple(levels), objective,
                dict(error), dict(prov), pwl)


def _pwl(v: _Validator, pwl, borders, levels) -> dict:
    """h~ = α + βx + Σ a_i max(x - c_i, 0): c must be the borders, and the levels β + cumsum(a)."""
    v.require(isinstance(pwl, dict) and set(pwl) == {"a", "c", "left", "right"}, "pwl",
              "kind pwl needs a pwl object with exactly a, c, left and right")
    a = v.numbers(pwl["a"], "pwl.a", len(borders))
    c = v.numbers(pwl["c"], "pwl.c", len(borders))
    _, beta = v.numbers(pwl["left"], "pwl.left", 2)
    v.numbers(pwl["right"], "pwl.right", 2)
    v.require(c == borders, "pwl.c", "must equal borders")
    expected = [beta]
    for coefficient in a:  # the running sum, as the designer forms it
        expected.append(expected[-1] + coefficient)
    scale = 1.0 + max(abs(x) for x in expected)
    v.require(all(abs(x - y) <= 1e-12 * scale for x, y in zip(levels, expected, strict=True)),
              "levels", "must be pwl.left[1] plus the running sums of pwl.a")
    return pwl


def _objective(v: _Validator, obj) -> dict:
    v.require(isinstance(obj, dict) and "weight" in obj, "objective", "must hold a weight")
    w = obj["weight"]
    v.require(isinstance(w, dict), "objective.weight", "must be an object")
    kind = w.get("type")
    path = "objective.weight"
    if kind == "normal":
        v.require(set(w) == {"type", "mean", "std"}, path, "normal needs exactly mean and std")
        v.number(w["mean"], f"{path}.mean")
        v.require(v.number(w["std"], f"{path}.std") > 0, f"{path}.std", "must be > 0")
    elif kind in ("uniform", "flat"):
        v.require(set(w) == {"type", "domain"}, path, f"{kind} needs exactly domain")
        lo, hi = v.numbers(w["domain"], f"{path}.domain", 2)
        v.require(lo < hi, f"{path}.domain", "needs L < R")
    elif kind == "empirical":
        v.require(set(w) - {"source"} == {"type", "edges", "counts"}, path,
                  "empirical needs edges and counts")
        edges = v.numbers(w["edges"], f"{path}.edges")
        counts = v.numbers(w["counts"], f"{path}.counts", len(edges) - 1)
        v.require(len(counts) >= 1, f"{path}.counts", "needs at least one bin")
        v.require(all(b > a for a, b in zip(edges, edges[1:], strict=False)), f"{path}.edges",
                  "must be strictly ascending")
        v.require(min(counts) >= 0 and sum(counts) > 0, f"{path}.counts",
                  "must be >= 0 with a positive total")
        v.require(isinstance(w.get("source", ""), str), f"{path}.source", "must be a string")
    else:
        v.require(False, f"{path}.type", "must be normal, uniform, flat or empirical")
    from .designer.weights import from_dict as weight_from_dict

    try:  # the weight's own limits (bins, scale), as every later stage will build it
        weight_from_dict(w)
    except ActdesignError as exc:
        raise ActdesignError(f"{v.origin}: {path}: {exc}") from None
    if "grid" in obj:
        v.integer(obj["grid"], "objective.grid", 1, 2**20)
    v.require(set(obj) <= {"weight", "grid"}, "objective", "has unknown fields")
    return obj


class _Validator:
    def __init__(self, origin):
        self.origin = origin

    def require(self, ok, path, why):
        if not ok:
            where = f" {path}" if path else ""
            raise ActdesignError(f"{self.origin}:{where} {why}")

    def number(self, value, path) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        self.require(ok, path, f"must be a number, got {type(value).__name__}")
        try:
            value = float(value)  # a huge Python int overflows here
        except OverflowError:
            value = math.inf
        self.require(math.isfinite(value), path, "must be finite")
        return value

    def integer(self, value, path, lo, hi) -> int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        self.require(ok, path, f"must be an integer, got {type(value).__name__}")
        self.require(lo <= value <= hi, path, f"must be in {lo}..{hi}, got {value}")
        return value

    def numbers(self, values, path, length=None) -> list[float]:
        self.require(isinstance(values, list), path, "must be a list of numbers")
        if length is not None:
            self.require(len(values) == length, path,
                         f"must have {length} entries, got {len(values)}")
        return [self.number(x, f"{path}[{i}]") for i, x in enumerate(values)]


def loads(text: str, origin: str = "spec") -> Spec:
    return validate(loads_json(text, origin), origin)


def load(source) -> Spec:
    """A Spec from a path, a dict or a Spec."""
    if isinstance(source, Spec):
        return source
    if isinstance(source, dict):
        return validate(source)
    return validate(read_json(source, "spec"), str(source))


def save(spec: Spec, path) -> Path:
    return write_atomic(path, spec.to_json())
