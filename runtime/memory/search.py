"""The longest sequence or the largest batch whose step fits a card, by shape-only steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEARCHED = {"seq": 256, "batch": 1}  # what `longest` searches, and its default step
_LARGEST = 2**31  # where a search stops whatever the model


@dataclass
class Longest:
    """The largest multiple of `step` along `dimension` ("seq" or "batch") whose step fits a
    size: `value` fits (0: not even one step does), `value + step` does not (or the model's
    own limit `cap` stopped the search there)."""
    dimension: str
    step: int
    value: int
    needed: int | None  # total with margins at value
    over_needed: int | None  # at value + step; None where the cap stopped the search
    cap: int | None = None  # the model's largest sequence (learned positions), if it stopped
    steps: int = 0  # shape-only steps the search ran

    def to_dict(self) -> dict:
        return {"value": self.value, "step": self.step,
                "total_with_margin_bytes": self.needed,
                "next_total_with_margin_bytes": self.over_needed, "capped_at": self.cap,
                "steps_run": self.steps}


def longest(price, size: int, dimension: str, step: int, cap: int | None,
            say=None) -> Longest:
    """The largest multiple of `step`, up to `cap`, whose step's total with margins (the
    `needed_bytes` of `price(value)`, a shape-only step's row) is within `size`. Exact at the
    boundary: the answer was priced and fits, the answer plus one step was priced and does
    not. It assumes what a step needs grows with the dimension (more tokens hold more), as it
    does for every model here, and uses the shape of that growth: nearly affine over long
    ranges, so the value a line through the nearest priced values puts at `size` is most
    often the answer or a step from it. Each guess stays strictly inside the bracket of the
    largest value known to fit and the smallest known not to; where, inside a bracket, a
    guess of the line comes no nearer `size` than half as near as the end it replaces (the
    total curves there), the next one halves the bracket. So the search never takes many
    more steps than bisection would (about log2 of the answer in steps) and most often takes
    four to six.
    `say(message)` hears each value priced."""
    fits, over = {}, {}  # value -> bytes with margins, of the values that fit and do not

    def measure(value):
        needed = price(value).needed_bytes
        (fits if needed <= size else over)[value] = needed
        if say is not None:
            say(f"{dimension} {value:,}: {needed / 2**30:,.2f} GiB with margins, "
                + ("fits" if needed <= size else "does not fit"))

    limit = min(cap or _LARGEST, _LARGEST)
    top = limit // step * step
    if top < step:
        return Longest(dimension, step, 0, None, None, cap)
    measure(step)
    if over:
        return Longest(dimension, step, 0, None, over[step], cap)
    halve = False
    while True:
        low = max(fits)
        high = min(over, default=None)
        if high is not None and high - low <= step:
            return Longest(dimension, step, low, fits[low], over[high])
        if low == top:
            return Longest(dimension, step, top, fits[top], None, cap or limit)
        guess = _bisected(low, high, step, top) if halve else \
            _extrapolated(fits, over, size, step, top, price(low))
        guess = min(max(guess, low + step), top if high is None else high - step)
        measure(guess)
        landed, replaced = (fits[guess], fits[low]) if guess in fits else \
            (over[guess], over.get(high))
        halve = not halve and high is not None \
            and abs(landed - size) > abs(replaced - size) / 2


def _extrapolated(fits, over, size, step, top, row) -> int:
    """The largest multiple of `step` a line through the two priced values nearest the
    boundary puts within `size`. From one value alone (`row`, its row), the line through it
    and the part of the total that does not grow (weights, gradients, optimizer state, the
    card's context): no steeper than the total grows, it guesses short of the answer."""
    low = max(fits)
    high = min(over, default=None)
    if high is not None:
        (a, na), (b, nb) = (low, fits[low]), (high, over[high])
    elif len(fits) > 1:
        a = max(v for v in fits if v != low)
        (a, na), (b, nb) = (a, fits[a]), (low, fits[low])
    else:
        fixed = row.total_bytes - row.peak_bytes + (row.margins.context if row.margins else 0)
        (a, na), (b, nb) = (0, fixed), (low, fits[low])
    if nb <= na:  # flat where priced: no line to follow
        return min(2 * low, top) if high is None else (low + high) // 2 // step * step
    at = a + (size - na) * (b - a) / (nb - na)
    return int(min(at, top) // step * step)


def _bisected(low, high, step, top) -> int:
    if high is None:
        return min(2 * low, top)
    return low + (high - low) // step // 2 * step


def sequence_cap(setup, model) -> int | None:
    """The longest sequence `model` (built from `setup`) takes where its position embeddings
    are learned (GPT-2's n_positions, BERT's max_position_embeddings), or None for rotary and
    other positions that extend: an nn.Embedding of exactly that many rows is a learned
    position table."""
    config = setup.config if setup.config is not None else getattr(setup.module, "config", None)
    limits = {getattr(config, key, None) for key in ("n_positions", "max_position_embeddings")}
    limits = {n for n in limits if isinstance(n, int) and n > 0}
    if not limits:
        return None
    tables = [m.num_embeddings for name, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding) and "position" in name.lower()
              or isinstance(m, torch.nn.Embedding) and name.endswith("wpe")]
    learned = [n for n in tables if n in limits]
    return min(learned) if learned else None
