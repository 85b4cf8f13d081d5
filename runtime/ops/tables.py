"""Built-in tables: the shipped ones (`actdesign.builtin_tables`: what the presets and the
planner use), else fitted on first use, then read from the cache directory.

`table("stepwise", "gelu", 3)` is the optimal 3-bit table for GELU' under N(0, 1);
`table("pwl", "gelu", 2)` is the 2-bit piecewise-linear fit (ReGELU2's problem, unweighted).
The file name carries a hash of what shapes the fit, so a new version never reads an old file;
the file is sealed (see cache.py): one edited by hand is fitted again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import threading

from actdesign import __version__, builtin_tables
from actdesign import spec as spec_mod
from actdesign.errors import ActdesignError

from .cache import cache_dir, private_dir, read_verified, seal, write_private

_LOCK = threading.Lock()
_MEMO: dict = {}


def table(kind: str, activation: str, bits: int) -> spec_mod.Spec:
    key = (kind, activation, bits)
    with _LOCK:
        if key not in _MEMO:
            _MEMO[key] = _cached(kind, activation, bits)
        return _MEMO[key]


def _cached(kind, activation, bits) -> spec_mod.Spec:
    shipped = builtin_tables.shipped(kind, activation, bits)
    if shipped is not None:
        return shipped
    digest = hashlib.sha256(json.dumps([kind, activation, bits, __version__]).encode())
    folder = private_dir(private_dir(cache_dir()) / "tables")
    path = folder / f"{kind}_{activation}_{bits}b_{digest.hexdigest()[:16]}.json"
    data = read_verified(path)
    spec = _parsed(data, path)
    if spec is not None:
        return spec
    damaged = path.exists()
    if kind == "pwl":
        from actdesign.designer.pwl import fit_pwl

        spec = spec_mod.from_pwl(fit_pwl(activation, bits))
    else:
        from actdesign.designer import fit_stepwise

        spec = spec_mod.from_fit(fit_stepwise(activation, bits))
    write_private(path, seal(spec.to_json().encode()), replace=damaged)
    # Processes fitting at once all use the table written first.
    return _parsed(read_verified(path), path) or spec


def _parsed(data: bytes | None, path) -> spec_mod.Spec | None:
    if data is None:
        return None
    try:
        return spec_mod.loads(data.decode(), str(path))
    except (ActdesignError, UnicodeDecodeError):
        return None  # sealed but not a spec this version reads: fitted again
