"""What `estimate` answers: a row per policy, and the JSON and the table users read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import footprint
from .profile import OUTPUT_ROW, size_unit


@dataclass
class Row:
    policy: str
    saved: dict[str, int]  # module name -> bytes, weight copies aside
    saved_bytes: int  # all saved bytes, weight copies included
    constant: int  # bytes of weight copies
    peak_bytes: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    margins: footprint.Margins | None = None
    fits: bool | dict | None = None  # one size: whether it fits; several: size -> bool
    longest: dict | None = None  # searched: size as given -> Longest
    host_bytes: int = 0  # what waits in host memory, apart from the total (see `host`)
    in_flight_bytes: int = 0  # FSDP2 CPU offload: unsharded weights and gradients on the card
    peak_kept_bytes: int = 0  # of the peak: what the forward kept for the backward

    @property
    def total_bytes(self) -> int:
        """What the card holds: with FSDP2's CPU offload (`in_flight_bytes` > 0), the weights,
        gradients and optimizer state are on the host, and the card holds the units in flight."""
        if self.in_flight_bytes:
            return self.peak_bytes + self.in_flight_bytes
        return self.peak_bytes + self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def margin_bytes(self) -> int:
        return self.margins.total if self.margins is not None else 0

    @property
    def needed_bytes(self) -> int:
        """The total with its margins: what a card must hold."""
        return self.total_bytes + self.margin_bytes

    def to_dict(self) -> dict:
        return {"policy": self.policy, "saved_bytes": self.saved_bytes,
                "peak_bytes": self.peak_bytes, "weights_bytes": self.weights_bytes,
                "gradients_bytes": self.gradients_bytes,
                "optimizer_bytes": self.optimizer_bytes, "total_bytes": self.total_bytes,
                "margin_bytes": self.margin_bytes,
                "margins": None if self.margins is None else self.margins.to_dict(),
                "total_with_margin_bytes": self.needed_bytes,
                "fits": self.fits, "weight_copy_bytes": self.constant,
                "host_bytes": self.host_bytes, "in_flight_bytes": self.in_flight_bytes,
                "peak_kept_bytes": self.peak_kept_bytes,
                "saved_by_module": self.saved,
                **self._longest_dict()}

    def _longest_dict(self) -> dict:
        if not self.longest:
            return {}
        found = {given: answer.value for given, answer in self.longest.items()}
        key = f"max_{next(iter(self.longest.values())).dimension}"
        return {key: next(iter(found.values())) if len(found) == 1 else found,
                "search": {given: answer.to_dict() for given, answer in self.longest.items()}}


@dataclass
class Estimate:
    model: str
    shape: str
    precision: str
    checkpointing: bool
    optimizer: str
    gpu_memory: list  # [(the size as given, bytes)]
    lora: int | None = None
    kernels: str = "cuda"
    rows: list[Row] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # what the model was built as
    warnings: list[str] = field(default_factory=list)
    card: str | None = None
    four_bit: bool = False
    cpu_offload: bool = False

    def to_dict(self) -> dict:
        sizes = [n for _, n in self.gpu_memory]
        return {"format": "actdesign.estimate", "model": self.model, "shape": self.shape,
                "precision": self.precision,
                "checkpointing": self.checkpointing, "lora_rank": self.lora,
                "four_bit": self.four_bit, "cpu_offload": self.cpu_offload,
                "kernels": self.kernels,
                "optimizer": self.optimizer, "card": self.card,
                "config": self.config, "warnings": self.warnings,
                "gpu_memory_bytes": sizes[0] if len(sizes) == 1 else sizes or None,
                "rows": [r.to_dict() for r in self.rows]}

    def table(self) -> str:
        scale, unit = size_unit(max(r.needed_bytes for r in self.rows))
        width = max(16, *(len(r.policy) + 2 for r in self.rows))

        def line(label, values):
            return f"{_shortened(label, 47):<48}" + "".join(f"{v / scale:>{width},.2f}"
                                                           for v in values)

        checkpointing = "with" if self.checkpointing else "without"
        lora = f", LoRA rank {self.lora} on every Linear layer" if self.lora else ""
        lora += " over a 4-bit NF4 base (modelled)" if self.four_bit else ""
        lora += ", FSDP2 CPU offload (modelled)" if self.cpu_offload else ""
        lines = [*([describe(self.config)] if self.config else []),
                 *(f"warning: {w}" for w in self.warnings),
                 f"{self.model}, {self.shape}, {self.precision}{lora}, {checkpointing} "
                 f"gradient checkpointing: estimated on fake tensors ({self.kernels.upper()} "
                 "kernels)",
                 f"{'saved for backward, ' + unit:<48}"
                 + "".join(f"{r.policy:>{width}}" for r in self.rows)]
        patterns: dict[str, list[int]] = {}
        for i, r in enumerate(self.rows):
            for name, n in r.saved.items():
                key = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) or OUTPUT_ROW
                patterns.setdefault(key, [0] * len(self.rows))[i] += n
        lines += [line(name, values) for name, values in patterns.items()]
        if any(r.constant for r in self.rows):
            lines.append(line("weight copies (once per step)", [r.constant for r in self.rows]))
        host = " (on the host)" if self.cpu_offload else ""
        for label, attr in (("saved total", "saved_bytes"), ("activation peak", "peak_bytes"),
                            ("  of it kept by the forward for the backward",
                             "peak_kept_bytes"),
                            ("weights" + host, "weights_bytes"),
                            ("gradients" + host, "gradients_bytes"),
                            (f"optimizer state ({footprint.OPTIMIZERS[self.optimizer][0]})"
                             + host, "optimizer_bytes"),
                            *([("FSDP2 units in flight (weights, grads)", "in_flight_bytes")]
                              if self.cpu_offload else []),
                            ("total on the card", "total_bytes")):
            lines.append(line(label, [getattr(r, attr) for r in self.rows]))
        lines += self._margin_lines(line, width, scale, unit)
        if any(r.host_bytes for r in self.rows):
            lines.append(line("host memory (not on the card)", [r.host_bytes for r in self.rows]))
        if self.rows[0].longest:
            lines += self._longest_lines(width, scale, unit)
        return "\n".join(lines)

    def _longest_lines(self, width, scale, unit) -> list[str]:
        first = next(iter(self.rows[0].longest.values()))
        what = "sequence" if first.dimension == "seq" else "batch"
        lines = [f"the longest {what} that fits, in steps of {first.step:,} (the rows above "
                 f"are at the first size's):"]
        for given, _ in self.gpu_memory:
            answers = [r.longest[given] for r in self.rows]
            lines.append(f"{'  in ' + given:<48}" + "".join(
                f"{a.value:>{width},}" for a in answers))
            beyond = ["the model's limit" if a.over_needed is None else
                      f"{a.over_needed / scale:,.2f}" for a in answers]
            lines.append(f"{f'    one step more needs ({unit})':<48}" + "".join(
                f"{b:>{width}}" for b in beyond))
        return lines

    def _margin_lines(self, line, width, scale, unit) -> list[str]:
        margins = [r.margins for r in self.rows]
        measured = all(m.measured for m in margins)
        source = f"measured on {self.card}" if measured else \
            "assumed: " + ("no card named" if self.card is None else f"{self.card} not measured")
        shares = sorted({f"{m.share:.0%}" for m in margins})
        lines = [f"margins ({source}):",
                 line("  allocator: blocks rounded to 512 bytes", [m.rounding for m in margins]),
                 line(f"  allocator: fragmentation, {'/'.join(shares)} of the peak",
                      [m.fragmentation for m in margins]),
                 line("  CUDA context and library workspaces", [m.context for m in margins]),
                 line("total with margins", [r.needed_bytes for r in self.rows])]
        for given, size in self.gpu_memory:
            cells = []
            for r in self.rows:
                left = size - r.needed_bytes
                verdict = f"yes, {left / scale:,.2f} left" if left >= 0 else \
                    f"no, {-left / scale:,.2f} over"
                cells.append(f" {verdict:>{width - 1}}")  # a space even where it is wide
            assumed = "" if measured else ", margins assumed"
            lines.append(f"{f'fits in {given} ({unit}{assumed})':<48}" + "".join(cells))
        return lines


def describe(config: dict) -> str:
    """The model a config built, in one line."""
    parts = [f"{config['architecture']}: {config['parameters'] / 1e9:,.2f}B parameters"
             if config["parameters"] >= 1e8 else
             f"{config['architecture']}: {config['parameters']:,} parameters"]
    for key, label in (("layers", "layers"), ("width", "width"), ("vocabulary", "vocabulary")):
        if config.get(key) is not None:
            parts.append(f"{label} {config[key]:,}")
    return ", ".join(parts)


def _shortened(name: str, width: int) -> str:
    """A row's name in `width` characters, keeping its informative end (the module)."""
    return name if len(name) <= width else "…" + name[-(width - 1):]
