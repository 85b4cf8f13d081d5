"""What a user writes on the command line and the commands check before anything is built
(so a bad value is refused at once; no torch here): sizes with their unit (`24GiB`, `80GB`,
`512MiB`), budgets that may instead be a fraction of a baseline, and the precisions."""

from __future__ import annotations

import re

from .errors import ActdesignError

# fp32; bf16-autocast: float32 weights, the forward under bfloat16 autocast;
# bf16-weights-autocast: bfloat16 weights under the same autocast (Trainer's bf16=True on a
# model loaded in bfloat16); bf16: bfloat16 weights and floating inputs, no autocast
PRECISIONS = ("fp32", "bf16-autocast", "bf16-weights-autocast", "bf16")

UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?"


def parse_size(text, what: str = "size") -> int:
    """Bytes in a size such as `24GiB`, `80GB`, `1.5 TiB` or `512MiB` (GB: 10^9 bytes, GiB:
    2^30). A number needs its unit; zero and negative sizes are refused."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", str(text))
    if match is None:
        raise ActdesignError(f"cannot read the {what} {text!r}: write a number and a unit, "
                             "such as 24GiB or 80GB")
    unit = UNITS.get(match.group(2).lower())
    if unit is None:
        raise ActdesignError(f"the {what} {text!r} needs a unit: GB, GiB, MB or MiB (as in "
                             f"{match.group(1)}GiB)" if not match.group(2) else
                             f"unknown unit {match.group(2)!r} in the {what} {text!r}: use "
                             "GB, GiB, MB, MiB, KB, KiB, TB or TiB")
    value = float(match.group(1)) * unit
    if not value >= 1:  # zero, negative, or under a byte
        raise ActdesignError(f"the {what} {text!r} must be positive")
    if value > 2**64:  # past any machine (and past an integer, at infinity)
        raise ActdesignError(f"the {what} {text!r} is too large")
    return int(value)


def parse_budget(text, what: str = "budget"):
    """A budget: bytes (int) for a size with its unit (or, from Python, an int), or a fraction
    (float) in (0, 1] for a bare number (or a Python float)."""
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise ActdesignError(f"the {what} must be a size or a fraction, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ActdesignError(f"the {what} {text!r} must be positive")
        return text
    if isinstance(text, float):
        text = repr(text)
    if re.fullmatch(rf"\s*{_NUMBER}\s*", text):
        fraction = float(text)
        if not 0 < fraction <= 1:
            raise ActdesignError(f"the {what} {text.strip()!r} is a fraction of the "
                                 "uncompressed model's saved bytes, so it must be in (0, 1]; "
                                 "for a size, give a unit (such as 2.5MiB)")
        return fraction
    return parse_size(text, what)
