"""Fitted tables kept by their full request, so fitting the same table again is a file read.

The request is everything that changes a fit: the activation, bits, kind, the weight's data,
the grid, the pwl tail tolerance and the actdesign version. Its sha256 names the entry, a
JSON file in `fits/` of the op cache's directory ($ACTDESIGN_CACHE_DIR, or the user cache
directory). An entry is data only and trusted only after checks: its seal (the sha256 of the
spec's text) must match, it must hold this very request, and the spec must pass the spec
format's validation and agree with the request. Anything else (truncated, edited, foreign)
is ignored, and the table is fitted again and the entry rewritten, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from . import __version__
from .errors import ActdesignError
from .files import loads_json, read_data, write_atomic

FORMAT = "actdesign.fit-cache/1"


def directory() -> Path:
    """Where entries live: beside the op modules, in their own folder."""
    env = os.environ.get("ACTDESIGN_CACHE_DIR")
    if env is not None and env.strip():
        return Path(env).expanduser().absolute() / "fits"
    import platformdirs

    return Path(platformdirs.user_cache_dir("actdesign")) / "fits"


def request(activation, bits: int, kind: str, weight, grid: int | None,
            tail_tol: float | None) -> dict:
    """The request as data: `weight` is a weight object or None (pwl, unweighted)."""
    return {"activation": activation.to_dict(), "formula": activation.formula, "bits": bits,
            "kind": kind, "weight": None if weight is None else weight.to_dict(),
            "grid": grid, "tail_tol": tail_tol, "actdesign": __version__}


def path_for(req: dict) -> Path:
    text = json.dumps(req, sort_keys=True, allow_nan=False)
    return directory() / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def load(req: dict):
    """The cached Spec of a request, or None when there is no sound entry for it."""
    path = path_for(req)
    try:
        data = loads_json(read_data(path, "cached fit", 2**24).decode("utf-8"), str(path))
        if not (isinstance(data, dict) and set(data) == {"format", "request", "seal", "spec"}
                and data["format"] == FORMAT and data["request"] == req
                and isinstance(data["spec"], str)
                and data["seal"] == hashlib.sha256(data["spec"].encode()).hexdigest()):
            return None
        from . import spec as spec_mod

        spec = spec_mod.loads(data["spec"], str(path))
    except (ActdesignError, UnicodeDecodeError):
        return None
    return spec if _answers(spec, req) else None


def _answers(spec, req: dict) -> bool:
    """Whether a valid spec is the table the request asks for."""
    objective = spec.objective
    return (spec.kind == req["kind"] and spec.bits == req["bits"]
            and spec.activation == req["activation"]
            and (req["weight"] is None or objective["weight"] == req["weight"])
            and (req["grid"] is None or objective.get("grid") == req["grid"]))


def store(req: dict, spec) -> None:
    """Keep `spec` for `req`; a cache that cannot be written only costs the next fit."""
    path = path_for(req)
    text = spec.to_json()
    entry = {"format": FORMAT, "request": req, "seal": hashlib.sha256(text.encode()).hexdigest(),
             "spec": text}
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, json.dumps(entry, allow_nan=False) + "\n")
    except (ActdesignError, OSError):
        pass


# A repeated command skips even the parsing: its options as typed name a small entry that
# points at the fit's entry by the sha256 of its bytes, with the text the command printed.
# Reading it back needs neither numpy nor the spec's validation: the fit's entry was
# validated when it was stored or read, and any later change to its file breaks the digest,
# which sends the command down the whole path (parse, validate the entry, or fit again).
COMMAND_FORMAT = "actdesign.fit-command/1"


def _command_path(options: dict) -> Path:
    text = json.dumps(options, sort_keys=True, allow_nan=False)
    return directory().parent / "fit-commands" / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def _recallable(options: dict) -> dict | None:
    """The options with the version, or None for an empirical weight: it names a file whose
    content may change."""
    if str(options.get("weight") or "").startswith("empirical"):
        return None
    return {**options, "actdesign": __version__}


def recall(options: dict) -> tuple[str, str] | None:
    """(spec text, printed table) of a command run before with these very options, or None."""
    options = _recallable(options)
    if options is None:
        return None
    try:
        path = _command_path(options)
        data = loads_json(read_data(path, "cached fit", 2**24).decode("utf-8"), str(path))
        if not (isinstance(data, dict) and data.get("format") == COMMAND_FORMAT
                and data.get("options") == options and isinstance(data.get("text"), str)
                and isinstance(data.get("entry"), str)
                and re.fullmatch(r"[0-9a-f]{64}\.json", data["entry"])):  # in fits/ only
            return None
        raw = read_data(directory() / data["entry"], "cached fit", 2**24)
        if hashlib.sha256(raw).hexdigest() != data.get("digest"):
            return None
        entry = json.loads(raw)
        if not (isinstance(entry, dict) and isinstance(entry.get("spec"), str)):
            return None
    except (ActdesignError, UnicodeDecodeError, TypeError, ValueError):
        return None
    return entry["spec"], data["text"]


def remember(options: dict, req: dict, text: str) -> None:
    """Let a command with these options be answered by `req`'s entry and this text."""
    options = _recallable(options)
    if options is None:
        return
    entry = path_for(req)
    try:
        data = {"format": COMMAND_FORMAT, "options": options, "entry": entry.name,
                "digest": hashlib.sha256(read_data(entry, "cached fit", 2**24)).hexdigest(),
                "text": text}
        path = _command_path(options)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, allow_nan=False) + "\n")
    except (ActdesignError, OSError):
        pass
