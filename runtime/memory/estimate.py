"""Memory of one training step from a model's config alone: no weights, no GPU.

The model is built and run (one forward and backward, at the real batch and sequence length)
under torch's FakeTensorMode: every tensor has a shape, a dtype and a storage size, and none
holds data. The saved bytes are counted as `profile` counts them (runtime.accounting: distinct
storages, parameters and buffers aside, weight copies apart), with the kernels torch picks on
the CPU.

The activation peak is exact for what it covers: the largest sum, over the step, of the
storages made by the step that are alive at once (every tensor the forward and the backward
make, recomputation included), parameters' gradients aside. It does not model an allocator's
rounding or caching, nor the optimizer step's temporaries. Weights, gradients and optimizer
state are a line of their own; the total adds all of them to the activation peak, as if every
gradient were alive at the peak (they all are when the optimizer steps).

Every policy is estimated: `compress` runs on the fake model as on a real one (its checks that
compare numbers run on real copies of the modules they check; a fused loss's probe runs, but
its value cannot be compared). Our ops launch no kernel on fake tensors; they allocate what
their CUDA kernels allocate (`kernels="cuda"`, the default) or what their CPU paths do
(`kernels="cpu"`, float32 working copies included), so the peak follows the step it estimates.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from actdesign.errors import ActdesignError
from actdesign.options import parse_size

from .. import models
from ..apply import policy as policy_mod
from ..apply.accounting import account, storage_key
from ..apply.compress import compress
from ..ops.offload import host_bytes
from . import cards, footprint
from .profile import OUTPUT_ROW, _to, bf16_weights, check_precision, forward_context, size_unit


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


class _Live(TorchDispatchMode):
    """Every storage an op makes, as (allocation, +bytes) when first seen and (allocation,
    -bytes) when freed; storages it was told of (weights, inputs) are not followed."""

    def __init__(self, known):
        super().__init__()
        self.known = set(known)
        self.live: dict[int, tuple[int, int]] = {}  # storage_key -> (allocation, bytes)
        self.events: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out

    def _see(self, t):
        key = storage_key(t)
        if key in self.known or key in self.live:
            return
        storage = t.untyped_storage()
        allocation = len(self.events)
        self.live[key] = (allocation, storage.nbytes())
        self.events.append((allocation, storage.nbytes()))
        weakref.finalize(storage, self._free, key)

    def _free(self, key):
        allocation, n = self.live.pop(key)
        self.events.append((allocation, -n))

    def _allocations(self, keys) -> set[int]:
        return {self.live[k][0] for k in keys if k in self.live}

    def alive_at_peak(self, leave_out=()) -> set[int]:
        """The allocations alive when the most bytes were (the first such moment),
        allocations in `leave_out` aside."""
        leave_out = self._allocations(leave_out)
        events = [(a, n) for a, n in self.events if a not in leave_out]
        now = best = end = 0
        for i, (_, n) in enumerate(events):
            now += n
            if now > best:
                best, end = now, i + 1
        alive = set()
        for allocation, n in events[:end]:
            if n > 0:
                alive.add(allocation)
            else:
                alive.discard(allocation)
        return alive

    def peak(self, leave_out=(), between=None, rounded=False) -> int:
        """The most bytes alive at once, allocations in `leave_out` aside; with `between`, a
        pair of event counts, the most alive from the first to the second; with `rounded`,
        each block rounded up as the CUDA allocator rounds it."""
        leave_out = self._allocations(leave_out)
        start, end = between or (0, len(self.events))
        now = peak = 0
        for i, (allocation, n) in enumerate(self.events[:end]):
            if allocation not in leave_out:
                now += (footprint.rounded(n) if n > 0 else -footprint.rounded(-n)) \
                    if rounded else n
                if i + 1 >= start:  # after event i, `i + 1` events have happened
                    peak = max(peak, now)
        return peak


class _CpuKernels(TorchDispatchMode):
    """Fake kernels made to give what torch's CPU kernels give, where they differ."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
            # MoE experts: the CPU kernel takes float32, the fake one bfloat16 only
            a, b, *rest = args
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).float()
        out = func(*args, **kwargs)
        norm = _NORMS.get(func)
        if norm is not None and _mixed(args, norm):
            # the kernels make mean and rstd in float32 for a bfloat16 input with float32
            # weights (autocast), the fake kernels in the input's dtype
            out = (out[0], out[1].float(), out[2].float())
        return out


# the norms whose statistics the kernels keep in float32, and where their weight argument is
_NORMS = {torch.ops.aten.native_layer_norm.default: 2, torch.ops.aten.native_batch_norm.default: 1}


def _mixed(args, weight_at) -> bool:
    x, weight = args[0], args[weight_at] if len(args) > weight_at else None
    return weight is not None and weight.dtype == torch.float32 != x.dtype


def _distinct(tensors) -> dict[int, torch.Tensor]:
    return {storage_key(t): t for t in tensors}


# the kernels whose allocations the activation peak follows, for our own ops (torch's own ops
# are torch's CPU kernels either way: their allocations match CUDA's for a training step)
KERNELS = ("cuda", "cpu")


@dataclass
class _Setup:
    name: str  # how the model is named in the output
    config: object  # a transformers config to build from, or None
    module: torch.nn.Module | None  # a model object to copy, or None
    batch: int
    seq: int
    precision: str
    checkpointing: bool
    optimizer: str
    lora: int | None
    kernels: str
    card: cards.Card | None
    four_bit: bool
    example: object = None  # real inputs to run instead of random tokens
    cpu_offload: bool = False


class _ShapesOnly(FakeTensorMode):
    """Fake tensors that tell our ops which kernels' allocations to follow."""

    def __init__(self, kernels):
        super().__init__()
        self.cpu_kernels = kernels == "cpu"


def estimate(model, batch: int, seq: int, precision: str = "bf16-autocast",
             policies=("none",), checkpointing: bool = False, optimizer: str = "adamw",
             gpu_memory=None, progress=None, lora: int | None = None, kernels: str = "cuda",
             card: str | None = None, four_bit: bool = False,
             example_inputs=None, longest: str | None = None,
             step: int | None = None, cpu_offload: bool = False) -> Estimate:
    """Estimate one training step at `batch` x `seq`, in `precision` (one of PRECISIONS),
    with gradient checkpointing or not: saved bytes by module, activation peak, weights,
    gradients and `optimizer` state (footprint.OPTIMIZERS), the margins a card needs beyond
    them, and whether it all fits in `gpu_memory` (a size such as "24GiB" or bytes, or a list
    of them). `model`: a name `models.config_of` takes (a built-in, a local config or
    directory, hf:<repo id>), a transformers config (or its dict), or a model object (copied
    onto fake tensors; the object itself is untouched). One row per policy (a preset, presets
    joined by '+', a policy dict or file). With `lora`, a rank: PEFT LoRA adapters of that
    rank on every Linear layer but the head (alpha 2 x rank, no dropout), the adapters alone
    trained, compressed as the policy says; with `four_bit` too, over a bitsandbytes NF4 base
    (QLoRA), modelled: its weights at 4 bits and the largest dequantized weight added to the
    peak. `kernels`: whose allocations the peak follows for our ops, the CUDA kernels' (their
    outputs alone) or the CPU paths' (their float32 working copies too). `card`: whose
    measured margins to use (cards.NAMES); without one, or unmeasured, they are assumed.
    `example_inputs`: a batch (real tensors, any form models.batches reads) to run in place
    of random tokens at `batch` x `seq`, as a model object other than a transformers model
    needs. `longest`: "seq" or "batch", to search instead for the largest multiple of `step`
    (default 256 tokens, 1 sequence) along it whose step fits each `gpu_memory` size, by
    shape-only steps (`Longest`); each row is then the step at the first size's answer.
    `cpu_offload`: FSDP2's CPUOffloadPolicy, every block, the output embedding and the rest
    each a unit: the weights, gradients and optimizer state are on the host, and the card
    holds two units' unsharded weights (the one running and the one prefetched) and one's
    gradients, the largest (modelled)."""
    check_precision(precision)
    for value, what in ((batch, "batch"), (seq, "sequence length")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ActdesignError(f"the {what} must be a positive integer, got {value!r}")
    if lora is not None and not (isinstance(lora, int) and lora >= 1):
        raise ActdesignError(f"the LoRA rank must be a positive integer, got {lora!r}")
    if four_bit and lora is None:
        raise ActdesignError("a 4-bit base is QLoRA: give a LoRA rank too (--lora R --4bit)")
    if optimizer not in footprint.OPTIMIZERS:
        raise ActdesignError(f"optimizer must be one of {', '.join(footprint.OPTIMIZERS)}, "
                             f"got {optimizer!r}")
    if kernels not in KERNELS:
        raise ActdesignError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if longest not in (None, *SEARCHED):
        raise ActdesignError(f"longest must be one of {', '.join(SEARCHED)}, got {longest!r}")
    step = SEARCHED.get(longest, 1) if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ActdesignError(f"the search's step must be a positive integer, got {step!r}")
    if longest is not None and example_inputs is not None:
        raise ActdesignError(f"the longest {longest} is searched on random tokens of each "
                             "shape: example_inputs fix the shape, leave them out")
    if longest is not None and gpu_memory is None:
        raise ActdesignError(f"the longest {longest} is searched against a card: give its "
                             "memory (--gpu-memory)")
    policies = [policies] if isinstance(policies, str | dict) else list(policies)
    loaded = [policy_mod.load(p) for p in policies]  # a bad one refused before any build
    sizes = _sizes(gpu_memory)
    priced_by = None if card is None else cards.card(card)
    start = time.perf_counter()

    def say(message):
        if progress is not None:
            progress(f"[{time.perf_counter() - start:6.1f} s] {message}")

    label, config, module, warnings = _source(model)
    setup = _Setup(label, config, module, batch, seq, precision, checkpointing, optimizer,
                   lora, kernels, priced_by, four_bit, example_inputs, cpu_offload)
    vision = getattr(config, "image_size", None)
    if longest == "seq" and vision:
        raise ActdesignError(f"model {label!r} takes {vision}x{vision} images: it has no "
                             "sequence to lengthen (search the batch instead)")
    rows, built = [], {}
    for name, policy in zip(policies, loaded, strict=True):
        say(f"building {label} on fake tensors")
        if longest is None:
            rows.append(_priced(setup, _label(name, policy), policy, say, built))
            fits = {given: rows[-1].needed_bytes <= n for given, n in sizes}
        else:
            rows.append(_searched(setup, _label(name, policy), policy, say, built, longest,
                                  step, sizes))
            fits = {given: answer.value > 0 for given, answer in rows[-1].longest.items()}
        rows[-1].fits = next(iter(fits.values())) if len(fits) == 1 else fits or None
    if longest == "seq":
        shape = f"batch {batch}, the longest sequence that fits (steps of {step:,})"
    elif longest == "batch":
        shape = f"the largest batch that fits (steps of {step:,}), sequence {seq}"
    else:
        shape = f"batch {batch}, " + (f"{vision}x{vision} images" if vision
                                      else f"sequence {seq}")
    return Estimate(label, shape, precision, checkpointing, optimizer, sizes, lora, kernels,
                    rows, built, warnings, card, four_bit, cpu_offload)


SEARCHED = {"seq": 256, "batch": 1}  # what `longest` searches, and its default step
_LARGEST = 2**31  # where a search stops whatever the model


def _priced(setup: _Setup, name, policy, say, built) -> Row:
    """`_estimate_fake`, its failures one line each."""
    try:
        return _estimate_fake(setup, name, policy, say, built)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise ActdesignError(f"model {setup.name!r} cannot be estimated: it reads the "
                             f"values of a tensor ({exc.func}), which fake tensors do not "
                             "have") from None
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        # a config that builds a model whose own forward fails (sizes that do not fit)
        raise ActdesignError(f"model {setup.name!r}: its training step fails: "
                             f"{models._reason(exc)}; check its config") from None


def _searched(setup: _Setup, name, policy, say, built, dimension, step, sizes) -> Row:
    """The row at the longest `dimension` that fits the first size, with every size's
    answer (`Row.longest`)."""
    cap = _sequence_cap(setup) if dimension == "seq" else None
    if cap is not None and step > cap:
        raise ActdesignError(f"the search's step {step:,} is longer than the {cap:,} positions "
                             f"model {setup.name!r} learned: give a smaller --step")
    priced = {}

    def price(value) -> Row:
        if value not in priced:
            say(f"{name}: {dimension} {value:,}")
            priced[value] = _priced(replace(setup, **{dimension: value}), name, policy,
                                    lambda message: None, built)
        return priced[value]

    answers = {given: _longest(price, size, dimension, step, cap) for given, size in sizes}
    for answer in answers.values():
        answer.steps = len(priced)
    first = next(iter(answers.values()))
    return replace(price(first.value or step), longest=answers)


def _longest(price, size: int, dimension: str, step: int, cap: int | None) -> Longest:
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


def _sequence_cap(setup: _Setup) -> int | None:
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


def _label(given, policy) -> str:
    return given if isinstance(given, str) else policy.label


def _sizes(gpu_memory) -> list[tuple[str, int]]:
    """[(a size as given, its bytes)] of one size or a list of them."""
    if gpu_memory is None:
        return []
    given = [gpu_memory] if isinstance(gpu_memory, str | int) else list(gpu_memory)
    out = []
    for size in given:
        if isinstance(size, bool) or not isinstance(size, str | int):
            raise ActdesignError(f"a GPU memory size is a string such as 80GB, got {size!r}")
        if isinstance(size, int):
            if size <= 0:
                raise ActdesignError(f"the GPU memory {size!r} must be positive")
            out.append((f"{size:,} bytes", size))
        else:
            out.append((size.strip(), parse_size(size, "GPU memory")))
    return out


def _source(model) -> tuple[str, object, torch.nn.Module | None, list[str]]:
    """(its name in the output, a config to build from, a model object to copy, warnings about
    the config) of what `estimate` was given."""
    if isinstance(model, torch.nn.Module):
        return type(model).__name__, getattr(model, "config", None), model, []
    if isinstance(model, str):
        config = models.config_of(model)
        if config is None:
            raise ActdesignError(f"model {model!r}: estimate builds a model from its config; "
                                 "give a built-in, a local config.json or hf:<repo id>, or the "
                                 "model object from Python")
        return model, config, None, models.defaulted(model, config)
    if isinstance(model, dict):
        return _source_of_dict(model)
    if type(model).__module__.startswith("transformers.") and hasattr(model, "model_type"):
        return f"{model.model_type} config", model, None, []
    raise ActdesignError("estimate takes a model name, a transformers config (or its dict) or "
                         f"a model object, not {type(model).__name__}")


def _source_of_dict(data: dict):
    transformers = models._transformers("a config dict")
    kind = data.get("model_type")
    if not isinstance(kind, str):
        raise ActdesignError("a config dict needs its model_type, such as 'llama'")
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except Exception as exc:  # noqa: BLE001  (transformers' validators raise their own types)
        raise ActdesignError(f"the {kind} config dict cannot be used: "
                             f"{models._reason(exc)}") from None
    return f"{kind} config", config, None, []


@contextlib.contextmanager
def shapes_only(kernels: str = "cuda"):
    """Fake tensors for a shape-only step, following `kernels`' allocations for our ops (see
    `estimate`): build the model inside (`fake_model`, `fake_copy`) and run its step
    inside. Yields the fake mode."""
    with _ShapesOnly(kernels) as mode, _CpuKernels(), _unpacked_sequences():
        yield mode


def fake_model(name: str, config, precision: str = "fp32", lora=None):
    """The model of a config on fake tensors, in training mode (call inside `shapes_only`):
    in bfloat16 where the precision says (`bf16_weights`), with PEFT LoRA adapters when given
    `lora`, a rank (see `_with_lora`) or a peft.LoraConfig."""
    with _no_initialization(), _conversions_in_place():
        model = models._from_config(name, config).train()
        return _converted(model, name, precision, lora)


def fake_copy(module: torch.nn.Module, mode, precision: str = "fp32", lora=None):
    """A copy of `module` whose parameters and buffers are fake tensors of `mode` (shared ones
    shared), in training mode, converted as `fake_model` converts; the module is untouched."""
    memo = {}
    with unset_fake_temporarily():  # the real tensors read as they are, in the mode or not
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in memo:
                fake = mode.from_tensor(t.detach())
                memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else fake
    with _conversions_in_place():
        return _converted(copy.deepcopy(module, memo).train(), type(module).__name__,
                          precision, lora)


def _converted(model, name, precision, lora):
    if bf16_weights(precision):
        model.to(torch.bfloat16)
    if lora is not None:
        model = _with_lora(name, model, lora)
    return model


def _estimate_fake(setup: _Setup, name, policy: policy_mod.Policy, say, built: dict) -> Row:
    with shapes_only(setup.kernels) as mode:
        if setup.module is not None:
            model = fake_copy(setup.module, mode, setup.precision, setup.lora)
        else:
            model = fake_model(setup.name, setup.config, setup.precision, setup.lora)
        built.update(_built(model))
        if policy.rules:
            say(f"compressing with {policy.label}")
            compress(model, policy)
        if setup.checkpointing:
            _checkpointing(setup.name, model)
        if setup.example is None:
            inputs = models.example_batch(model, setup.batch, setup.seq)
        else:
            with unset_fake_temporarily():
                inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor)
                                  else t, setup.example)
        if setup.precision == "bf16":
            inputs = _to(inputs, "cpu", torch.bfloat16)
        weights = _distinct((*model.parameters(), *model.buffers()))
        trainable = _distinct(p for p in model.parameters() if p.requires_grad)
        quantized = _quantized(model) if setup.four_bit else {}
        in_flight = _in_flight(model) if setup.cpu_offload else 0
        say("one training step")
        peaks = {}
        with host_bytes() as host:
            saved, peak = step(model, inputs, setup.precision, peaks=peaks)
    nbytes = {k: t.untyped_storage().nbytes() for k, t in weights.items()}
    grads = [nbytes[k] for k in trainable]
    weights_bytes = sum(nbytes.values())
    if quantized:  # the base's Linear weights at 4 bits; one dequantized at a time
        weights_bytes -= sum(nbytes[k] - footprint.nf4_bytes(t.numel())
                             for k, t in quantized.items())
        transient = max(nbytes[k] for k in quantized)
        peak, peaks["rounded"] = peak + transient, peaks["rounded"] + transient
    rounding = peaks["rounded"] - peak + sum(footprint.rounded(n) - n
                                             for n in (*nbytes.values(), *grads))
    margins = footprint.margins(setup.card, footprint.family_of(policy, setup.checkpointing),
                                peak, rounding)
    optimizer = footprint.optimizer_bytes(setup.optimizer, trainable.values())
    held = host[0] + (weights_bytes + sum(grads) + optimizer if in_flight else 0)
    return Row(name, saved.by_module, saved.total, saved.constant, peak, weights_bytes,
               sum(grads), optimizer, margins, host_bytes=held, in_flight_bytes=in_flight,
               peak_kept_bytes=peaks["kept"])


def _in_flight(model) -> int:
    """FSDP2 with CPU offload, on one card: the most bytes its units hold there at once, two
    units' unsharded weights (the one running, the next prefetched) and one's gradients
    before they go to the host. The units: each block (an element of a layer list), the
    output embedding, and the rest (the root)."""
    base = models.transformers_model(model) or model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    units = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList)
             for c in m.children()]  # a list nested in a unit adds no bytes: `seen`
    seen, sizes = set(), []
    for unit in [*units, *([head] if head is not None else []), model]:
        params = [p for p in unit.parameters() if storage_key(p) not in seen]
        seen.update(storage_key(p) for p in params)
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        sizes.append((weights, grads))
    weights = sorted((w for w, _ in sizes), reverse=True)
    return sum(weights[:2]) + max(g for _, g in sizes)


def _built(model) -> dict:
    """What was built, for the one-line echo: architecture, parameters, layers, width and
    vocabulary (adapters aside)."""
    base = models.transformers_model(model) or model
    config = getattr(base, "config", None)
    parameters = sum(t.numel() for n, t in _named_distinct(base) if "lora_" not in n)
    return {"architecture": type(base).__name__, "parameters": parameters,
            **{key: getattr(config, attr, None) for key, attr in (
                ("layers", "num_hidden_layers"), ("width", "hidden_size"),
                ("vocabulary", "vocab_size"))}}


def _named_distinct(model):
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if storage_key(p) not in seen:
            seen.add(storage_key(p))
            yield name, p


def _quantized(model) -> dict:
    """The weights a 4-bit base holds at 4 bits: every frozen Linear's but the head's (as
    transformers quantizes them), by storage."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    return {storage_key(m.weight): m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
            and (head_weight is None or storage_key(m.weight) != storage_key(head_weight))}


def fake_step(model, example, policy: policy_mod.Policy, precision: str,
              kernels: str = "cuda", counter=None, window_peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one training step of a copy of `model` (the given
    module, untouched) on fake tensors, compressed by `policy`, on inputs shaped as `example`
    (real tensors: a tensor, a tuple or a dict). `counter`, a dispatch mode such as torch's
    FlopCounterMode, watches the step. `window_peaks`: as `step`'s."""
    mode = _ShapesOnly(kernels)
    inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                      example)
    with mode, _CpuKernels(), _unpacked_sequences():
        copy_ = fake_copy(model, mode, precision)
        if precision == "bf16":
            inputs = _to(inputs, "cpu", torch.bfloat16)
        if policy.rules:
            compress(copy_, policy)
        with counter if counter is not None else contextlib.nullcontext():
            return step(copy_, inputs, precision, window_peaks)


def step(model, inputs, precision, window_peaks=None, peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one forward and backward of `model` on `inputs`, fake
    or real tensors alike: the peak is the most bytes alive at once of the storages the step
    makes, the parameters' gradients aside. `window_peaks`, a dict keyed by module names, gets
    for each the most bytes alive while its backward ran (from its output's gradient to its
    input's), where it ran once. `peaks`, a dict, gets "rounded": the peak with every block
    rounded up as the CUDA allocator rounds it."""
    weights = _distinct((*model.parameters(), *model.buffers()))
    given = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]  # any batch form
    live = _Live((*weights, *_distinct(given)))
    marks = {name: {"calls": 0, "events": []} for name in window_peaks or ()}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(_marking(live, marks[name]))
               for name in marks]

    def loss():
        with forward_context(precision, "cpu"):
            return models.loss_of(models.call(model, inputs))

    try:
        with live:
            saved, out = account(model, loss)
            # what the forward kept, by allocation: every saved storage is alive now, so its
            # key names it (a key freed later may name another storage)
            kept = {live.live[k][0]: n for k, n in saved.storages.items() if k in live.live}
            out.backward()
            del out
    finally:
        for h in handles:
            h.remove()
    grads = _distinct(p.grad for p in model.parameters() if p.grad is not None)
    for name, window in marks.items():
        if window["calls"] == 1 and len(window["events"]) == 2:
            window_peaks[name] = live.peak(grads, between=window["events"])
    if peaks is not None:
        peaks["rounded"] = live.peak(grads, rounded=True)
        alive = live.alive_at_peak(grads)
        peaks["kept"] = sum(n for a, n in kept.items() if a in alive)
    return saved, live.peak(grads)


def _marking(live: _Live, window: dict):
    """A forward hook noting the event counts when the gradient of the module's first output
    arrives and when that of its first input leaves: its backward's window."""
    def hook(module, args, output):
        window["calls"] += 1
        ends = [next((t for t in tree_leaves(x) if isinstance(t, torch.Tensor)), None)
                for x in (output, args)]
        if window["calls"] == 1 and all(t is not None and t.requires_grad for t in ends):
            for t in ends:
                t.register_hook(lambda g: window["events"].append(len(live.events)))
    return hook


@contextlib.contextmanager
def _no_initialization():
    """transformers' weight initialization skipped (fake tensors have no values to set, and
    some initializations read them); the weights are still tied."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        yield
        return
    real = PreTrainedModel.__dict__.get("initialize_weights")
    if real is None:
        yield
        return
    PreTrainedModel.initialize_weights = lambda self: None
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights = real


@contextlib.contextmanager
def _unpacked_sequences():
    """transformers cannot read fake position ids, so takes each row for several packed
    sequences and builds the full attention mask that a real batch skips (SDPA's is_causal
    instead): a mask the real step never saves. The batches here hold one sequence a row."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    real = getattr(masking_utils, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


@contextlib.contextmanager
def _conversions_in_place():
    """Module.to, .float() and the like working on fake tensors, whose parameters torch's
    own conversion cannot swap: each tensor replaced by its converted copy in every module
    holding it (tied ones by one copy), as a parameter where it was one."""
    def apply(self, fn, recurse=True):
        copies = {}
        for module in self.modules() if recurse else (self,):
            for store in (module._parameters, module._buffers):
                for key, t in store.items():
                    if t is not None and id(t) not in copies:
                        new = fn(t)
                        if isinstance(t, torch.nn.Parameter) and new is not t:
                            new = torch.nn.Parameter(new, t.requires_grad)
                        copies[id(t)] = new
                    if t is not None:
                        store[key] = copies[id(t)]
        return self

    real = torch.nn.Module._apply
    torch.nn.Module._apply = apply
    try:
        yield
    finally:
        torch.nn.Module._apply = real


def _with_lora(name, model, lora):
    """PEFT LoRA adapters of rank `lora` on every Linear layer but the head (alpha 2 x rank,
    no dropout), or as `lora` says, a peft.LoraConfig."""
    try:
        import peft
    except ImportError:
        raise ActdesignError("--lora needs PEFT: pip install peft") from None
    config = lora if isinstance(lora, peft.LoraConfig) else peft.LoraConfig(
        r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules="all-linear")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ActdesignError(f"model {name!r}: PEFT cannot add LoRA adapters: "
                             f"{str(exc).splitlines()[0]}") from None


def _checkpointing(name, model):
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ActdesignError(f"model {name!r} ({type(model).__name__}) does not support "
                             "gradient checkpointing")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # its newer name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
