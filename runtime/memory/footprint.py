"""What a training step holds on a card besides its activations: the optimizer's state, a
4-bit base's weights, and the margins a real card needs beyond the step's tensors (the
allocator's rounding and fragmentation, the CUDA context and the libraries' workspaces).
`estimate` adds them to its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..methods import METHODS
from . import cards

BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


def rounded(nbytes: int) -> int:
    """The bytes the CUDA caching allocator gives a request of `nbytes`."""
    return -(-nbytes // BLOCK) * BLOCK


def _moments(numel: int, itemsize: int) -> int:
    return 2 * numel * itemsize  # AdamW's two moments, in the parameter's dtype


def _moments_8bit(numel: int, itemsize: int) -> int:
    """bitsandbytes' AdamW8bit: two one-byte moments with a float32 scale per block of 256
    and each moment's 256-entry float32 code book; tensors under 4,096 elements keep their
    moments in float32."""
    if numel < 4096:
        return 2 * numel * 4
    return 2 * (numel + 4 * -(-numel // 256) + 4 * 256)


# optimizer -> (how the table says its state, state bytes of a trainable tensor's numel and
# element size)
OPTIMIZERS = {
    "adamw": ("AdamW", _moments),
    "adamw8bit": ("8-bit AdamW", _moments_8bit),
    "sgd": ("SGD, no momentum", lambda numel, itemsize: 0),
    "none": ("no optimizer", lambda numel, itemsize: 0),
}


def optimizer_bytes(name: str, tensors) -> int:
    """The state `name` keeps for these trainable tensors."""
    state = OPTIMIZERS[name][1]
    return sum(state(t.numel(), t.element_size()) for t in tensors)


def nf4_bytes(numel: int) -> int:
    """A weight in bitsandbytes' 4-bit NF4 (transformers' default QLoRA setting): two values a
    byte and a float32 scale per block of 64."""
    return -(-numel // 2) + 4 * -(-numel // 64)


def family_of(policy, checkpointing: bool) -> str:
    """The policy family whose fragmentation the card's margins use: checkpointing (blocks
    recomputed), llm (our lossless ops), or eager."""
    families = {METHODS[rule.apply].family for rule in policy.rules}
    if checkpointing or "checkpointing" in families:
        return "checkpointing"
    return "llm" if "llm" in families else "eager"


@dataclass
class Margins:
    rounding: int  # every tensor's block rounded up to the allocator's size, exactly
    fragmentation: int  # the allocator's cached, unused blocks at the peak
    context: int  # the CUDA context and the libraries' workspaces
    share: float  # fragmentation as a share of the activation peak
    measured: bool  # context and fragmentation measured on the card, not assumed

    @property
    def total(self) -> int:
        return self.rounding + self.fragmentation + self.context

    def to_dict(self) -> dict:
        return {"rounding_bytes": self.rounding, "fragmentation_bytes": self.fragmentation,
                "context_bytes": self.context, "fragmentation_share": self.share,
                "measured": self.measured}


def margins(card: cards.Card | None, family: str, peak: int, rounding: int) -> Margins:
    """The margins of a step whose activation peak is `peak` bytes and whose tensors' blocks
    round up by `rounding` bytes, on `card` (None: no card named, every margin assumed)."""
    context, share, measured = card.margins(family) if card is not None else (
        cards.ASSUMED_CONTEXT, cards.ASSUMED_FRAGMENTATION, False)
    return Margins(rounding, int(share * peak), context, share, measured)
