"""Built-in tables: fitted on first use, then read from the cache directory.

`table("stepwise", "gelu", 3)` is the optimal 3-bit table for GELU' under N(0, 1);
`table("pwl", "gelu", 2)` is the 2-bit piecewise-linear fit (ReGELU2's problem, unweighted).
The file name carries a hash of what shapes the fit, so a new version never reads an old file.
"""

from __future__ import annotations

import hashlib
import json
import threading

from actdesign import __version__
from actdesign import spec as spec_mod
from actdesign.errors import ActdesignError

from .cache import cache_dir

_LOCK = threading.Lock()
_MEMO: dict = {}


def table(kind: str, activation: str, bits: int) -> spec_mod.Spec:
    key = (kind, activation, bits)
    with _LOCK:
        if key not in _MEMO:
            _MEMO[key] = _cached(kind, activation, bits)
        return _MEMO[key]


def _cached(kind, activation, bits) -> spec_mod.Spec:
    digest = hashlib.sha256(json.dumps([kind, activation, bits, __version__]).encode())
    path = cache_dir() / "tables" / f"{kind}_{activation}_{bits}b_" \
                                     f"{digest.hexdigest()[:16]}.json"
    if path.exists():
        try:
            return spec_mod.load(path)
        except ActdesignError:
            pass  # a damaged cache file: fit again and overwrite it
    if kind == "pwl":
        from actdesign.designer.pwl import fit_pwl

        spec = spec_mod.from_pwl(fit_pwl(activation, bits))
    else:
        from actdesign.designer import fit_stepwise

        spec = spec_mod.from_fit(fit_stepwise(activation, bits))
    path.parent.mkdir(parents=True, exist_ok=True)
    spec_mod.save(spec, path)
    return spec
