"""The longest sequence or the largest batch whose step fits a card, by shape-only steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.fake import shapes_only
from .setups import fake_copy, fake_model

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


def longest(price, size: int, dimension: str, step: int, cap: int | None) -> Longest:
    """The largest multiple of `step`, up to `cap`, whose step's total with margins is within
    `size`: doubling from one step until one does not fit, then bisecting between the last
    that fits and the first that does not, in whole steps. Exact at the boundary: the answer
    was priced and fits, the answer plus one step was priced and does not. It assumes what a
    step needs grows with the dimension (more tokens hold more), as it does for every model
    here."""
    def needed(value):
        return price(value).needed_bytes

    limit = min(cap or _LARGEST, _LARGEST)
    top = limit // step * step
    if top < step or needed(step) > size:
        return Longest(dimension, step, 0, None, needed(step) if top >= step else None, cap)
    low, high = step, None
    while high is None:
        if low * 2 > top:
            if top == low or needed(top) <= size:
                return Longest(dimension, step, top, needed(top), None, cap or limit)
            high = top
        elif needed(low * 2) <= size:
            low *= 2
        else:
            high = low * 2
    while high - low > step:
        middle = low + (high - low) // step // 2 * step
        if needed(middle) <= size:
            low = middle
        else:
            high = middle
    return Longest(dimension, step, low, needed(low), needed(high))


def sequence_cap(setup) -> int | None:
    """The longest sequence a model with learned position embeddings takes (GPT-2's
    n_positions, BERT's max_position_embeddings), or None for rotary and other positions
    that extend: an nn.Embedding of exactly that many rows is a learned position table."""
    config = setup.config if setup.config is not None else getattr(setup.module, "config", None)
    limits = {getattr(config, key, None) for key in ("n_positions", "max_position_embeddings")}
    limits = {n for n in limits if isinstance(n, int) and n > 0}
    if not limits:
        return None
    with shapes_only(setup.kernels) as mode:
        model = fake_copy(setup.module, mode) if setup.module is not None else \
            fake_model(setup.name, config)
    tables = [m.num_embeddings for name, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding) and "position" in name.lower()
              or isinstance(m, torch.nn.Embedding) and name.endswith("wpe")]
    learned = [n for n in tables if n in limits]
    return min(learned) if learned else None
