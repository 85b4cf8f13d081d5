"""What a card's time costs, for the planner: rates measured on the card itself where the GPU
stage has measured it (`benchmarks/gpu_costs.py`, stored as cards/<name>.json), else the
roofline of its vendor sheet's peak dense bf16 FLOP rate and memory bandwidth.

Measured, a card has:
- `flops_per_s`: a whole lossless training step's FLOPs over its time (forward, backward and
  the optimizer, on the model and shape the file names): the rate a step's FLOPs are turned
  into time at, memory traffic, launches and the optimizer included;
- `bytes_per_s`: a device-to-device copy's bytes (read and write) per second;
- `option_s_per_byte`: for each lossy option the planner offers, the time it adds to a step
  per byte of the input it compresses (its forward and backward kernels against the lossless
  path's), measured on large bf16 tensors. An option it lacks is priced by the roofline's
  bytes;
- `host_bytes_per_s`: a pinned copy between host and card, the slower way (an offloaded block
  input goes out in the forward and back in the backward); else the sheet's PCIe link rate,
  one way.
An offloaded block input is priced at both its copies, whole: an upper bound, since the copies
run on a side stream beside the forward and the backward.
The roofline reads the sheet's peaks: a step costs its FLOPs at the peak rate plus reading
and writing its saved bytes once at the peak bandwidth. It predicts too little (the peak is
not reached); the measured rates are what the planner's time limit should be read against.

A card also holds more than a step's tensors (`estimate`'s margins):
- `context_bytes`: the CUDA context, the libraries' workspaces and whatever else a process
  holds on the card beyond torch's allocations, measured after a training step;
- `fragmentation`: per policy family (eager, llm, checkpointing), the allocator's reserved
  bytes beyond its allocated ones at the peak, over the activation peak, measured on real
  steps.
Unmeasured, they are assumptions (ASSUMED_CONTEXT, ASSUMED_FRAGMENTATION), said as such.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

from actdesign.errors import ActdesignError

# name -> (peak dense bf16 FLOP/s, memory bandwidth in bytes/s), from the vendors' sheets
VENDOR = {"h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12), "a100": (312e12, 2.0e12),
          "l40s": (362e12, 0.864e12), "rtx4090": (165e12, 1.008e12)}
NAMES = tuple(VENDOR)
# name -> its host link, bytes/s one way: PCIe 5.0 x16 (H100, H200) or 4.0 x16, from the sheets
HOST_LINK = {"h100": 64e9, "h200": 64e9, "a100": 32e9, "l40s": 32e9, "rtx4090": 32e9}
# Unmeasured margins: a CUDA context with cuBLAS and attention workspaces takes several
# hundred MiB; the caching allocator's cached-but-free blocks, a tenth of the activations.
ASSUMED_CONTEXT = 2**30
ASSUMED_FRAGMENTATION = 0.10
FAMILIES = ("eager", "llm", "checkpointing")


@dataclass(frozen=True)
class Card:
    name: str
    flops_per_s: float
    bytes_per_s: float
    option_s_per_byte: dict = field(default_factory=dict)
    measured: str | None = None  # the card, model and date it was measured on; None: roofline
    context_bytes: int | None = None  # measured; None: ASSUMED_CONTEXT
    fragmentation: dict = field(default_factory=dict)  # family -> measured share of the peak
    host_bytes_per_s: float = 0.0  # 0: the sheet's link rate (HOST_LINK)

    def margins(self, family: str) -> tuple[int, float, bool]:
        """(context bytes, fragmentation as a share of the activation peak, whether both were
        measured on this card) for a policy family."""
        measured = self.context_bytes is not None and family in self.fragmentation
        return (ASSUMED_CONTEXT if self.context_bytes is None else self.context_bytes,
                self.fragmentation.get(family, ASSUMED_FRAGMENTATION), measured)

    def step_time(self, flops: float, saved_bytes: int) -> float:
        """A step of `flops` FLOPs saving `saved_bytes`: measured, its FLOPs at the measured
        step rate; roofline, its FLOPs at the peak plus its saved bytes written and read."""
        if self.measured:
            return flops / self.flops_per_s
        return flops / self.flops_per_s + 2 * saved_bytes / self.bytes_per_s

    def recompute_time(self, flops: float, input_bytes: int) -> float:
        """A block's forward run again (`flops`: its forward's), writing its input's size."""
        if self.measured:
            return flops / self.flops_per_s
        return flops / self.flops_per_s + input_bytes / self.bytes_per_s

    def option_time(self, label: str, input_bytes: int, kept_bytes: int) -> float:
        """What a lossy option adds to a step at a site whose input is `input_bytes` and
        whose compressed form is `kept_bytes`: measured per byte of input, or the bytes it
        moves (the input read and the codes written, the codes read and the input written)."""
        per_byte = self.option_s_per_byte.get(label)
        if per_byte is not None:
            return per_byte * input_bytes
        return 2 * (input_bytes + kept_bytes) / self.bytes_per_s

    def offload_time(self, input_bytes: int) -> float:
        """A block input's two copies, to the host in the forward and back in the backward."""
        rate = self.host_bytes_per_s or HOST_LINK[self.name]
        return 2 * input_bytes / rate

    def describe(self) -> str:
        if self.measured:
            return f"measured on {self.measured}"
        return f"modelled from {self.name}'s peak FLOP rate and bandwidth (not measured)"


def card(name: str) -> Card:
    """The card of that name: its measured costs where the repository holds them, else its
    vendor sheet's roofline."""
    if name not in VENDOR:
        raise ActdesignError(f"device must be one of {', '.join(NAMES)}, got {name!r}")
    measured = _measured(name)
    if measured is not None:
        return measured
    flops, bandwidth = VENDOR[name]
    return Card(name, flops, bandwidth)


CARDS = resources.files(__package__) / "cards"  # <name>.json: a card's measured costs


def _measured(name: str) -> Card | None:
    path = CARDS / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    context = data.get("context_bytes")
    timed = "flops_per_s" in data  # (a file may hold the margins alone)
    flops, bandwidth = VENDOR[name]
    return Card(name, float(data.get("flops_per_s", flops)),
                float(data.get("bytes_per_s", bandwidth)),
                {k: float(v) for k, v in data.get("option_s_per_byte", {}).items()},
                f"{data['device']}, {data['model']} at {data['shape']} ({data['date']})"
                if timed else None,
                None if context is None else int(context),
                {k: float(v) for k, v in data.get("fragmentation", {}).items()},
                float(data.get("host_bytes_per_s", 0.0)))
