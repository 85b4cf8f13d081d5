"""The tables the presets and the planner use, fitted once and shipped with actdesign: for
every built-in activation, the optimal stepwise tables at 1 to 4 bits under N(0, 1) (the
default grid) and the 2-bit piecewise-linear fit (unweighted, the default tail tolerance).

A new user's first `fit` of one of these requests, and the first `compress` with a preset,
read the shipped spec instead of fitting it. Shipped specs are data: spec files, validated
as any spec is when read, and exactly what the designer computes for the same request (the
tests fit a sample again and compare). `python -m actdesign.builtin_tables` fits them all
again and writes them here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from . import spec as spec_mod
from .activation import builtin_names

STEPWISE_BITS = (1, 2, 3, 4)
PWL_BITS = (2,)
_FOLDER = "tables"


def _name(kind: str, activation: str, bits: int) -> str:
    return f"{kind}_{activation}_{bits}.json"


def shipped(kind: str, activation: str, bits: int) -> spec_mod.Spec | None:
    """The shipped table of a built-in activation (its canonical name), or None where none
    is shipped (other bits, or a pwl fit it has none of)."""
    if (kind, bits) not in {("stepwise", b) for b in STEPWISE_BITS} | {("pwl", b)
                                                                         for b in PWL_BITS}:
        return None
    path = resources.files(__package__) / _FOLDER / _name(kind, activation, bits)
    if not path.is_file():
        return None
    return spec_mod.loads(path.read_text(), f"the shipped table {_name(kind, activation, bits)}")


def for_request(activation, bits: int, kind: str, weight, grid, tail_tol) -> spec_mod.Spec | None:
    """The shipped table answering a `fit` request, where it is one of the shipped ones:
    a built-in, stepwise under N(0, 1) on the default grid, or pwl unweighted with the
    default tail tolerance."""
    from .designer.pwl import DEFAULT_TAIL_TOL  # (numpy and numba only; no sympy)

    if activation.name is None or grid is not None:
        return None
    if kind == "stepwise" and weight is not None and weight.to_dict() == {
            "type": "normal", "mean": 0.0, "std": 1.0}:
        return shipped(kind, activation.name, bits)
    if kind == "pwl" and weight is None and tail_tol == DEFAULT_TAIL_TOL:
        return shipped(kind, activation.name, bits)
    return None


def write_all(folder: Path) -> list[Path]:
    """Fit every shipped table and write it into `folder` (one spec file each)."""
    from .designer import fit_stepwise
    from .designer.pwl import fit_pwl
    from .errors import ActdesignError
    from .files import write_atomic

    def fitted(kind, name, bits):
        if kind == "pwl":
            return spec_mod.from_pwl(fit_pwl(name, bits))
        return spec_mod.from_fit(fit_stepwise(name, bits))

    written = []
    for name in builtin_names():
        for kind, bits in [("stepwise", b) for b in STEPWISE_BITS] + [("pwl", b)
                                                                       for b in PWL_BITS]:
            try:
                spec = fitted(kind, name, bits)
            except ActdesignError:  # no such fit (a pwl fit of an activation without asymptotes)
                continue
            written.append(write_atomic(folder / _name(kind, name, bits), spec.to_json()))
    return written


if __name__ == "__main__":
    for path in write_all(Path(__file__).parent / _FOLDER):
        print(path)
