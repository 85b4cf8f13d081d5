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
import time
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_map

from actdesign.errors import ActdesignError
from actdesign.options import parse_size

from .. import models
from ..apply import policy as policy_mod
from ..apply.compress import compress
from ..ops.fake import shapes_only
from ..ops.offload import host_bytes
from . import cards, footprint, setups
from .profile import _to, check_precision
from .results import Estimate, Row
from .search import SEARCHED, longest, sequence_cap
from .steps import distinct, step

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
    make_batch: object = None  # make_batch(batch, seq): a timm or torchvision model's images
    image_size: int | None = None  # an image model's image side, in pixels


def estimate(model, batch: int, seq: int, precision: str = "bf16-autocast",
             policies=("none",), checkpointing: bool = False, optimizer: str = "adamw",
             gpu_memory=None, progress=None, lora: int | None = None, kernels: str = "cuda",
             card: str | None = None, four_bit: bool = False,
             example_inputs=None, longest: str | None = None,
             step: int | None = None, cpu_offload: bool = False,
             image_size: int | None = None) -> Estimate:
    """Estimate one training step at `batch` x `seq`, in `precision` (one of PRECISIONS),
    with gradient checkpointing or not: saved bytes by module, activation peak, weights,
    gradients and `optimizer` state (footprint.OPTIMIZERS), the margins a card needs beyond
    them, and whether it all fits in `gpu_memory` (a size such as "24GiB" or bytes, or a list
    of them). `model`: a name `models.config_of` takes (a built-in, a local config or
    directory, hf:<repo id>, timm:<name>, torchvision:<name>), a transformers config (or its
    dict), or a model object (copied onto fake tensors; the object itself is untouched). An
    image model takes images `image_size` pixels square (its config's or timm's own size
    when not given, else 224); `seq` is then not read. One row per policy (a preset, presets
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

    if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                   or image_size < 1):
        raise ActdesignError(f"the image size must be a positive integer, got {image_size!r}")
    label, config, module, make_batch, warnings = _source(model, image_size)
    vision = getattr(config, "image_size", None) or getattr(make_batch, "image_size", None)
    setup = _Setup(label, config, module, batch, seq, precision, checkpointing, optimizer,
                   lora, kernels, priced_by, four_bit, example_inputs, cpu_offload, make_batch,
                   vision)
    if longest == "seq" and vision:
        raise ActdesignError(f"model {label!r} takes {_side(vision)} images: it has no "
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
        shape = f"the largest batch that fits (steps of {step:,}), " + (
            f"{_side(vision)} images" if vision else f"sequence {seq}")
    else:
        shape = f"batch {batch}, " + (f"{_side(vision)} images" if vision
                                      else f"sequence {seq}")
    return Estimate(label, shape, precision, checkpointing, optimizer, sizes, lora, kernels,
                    rows, built, warnings, card, four_bit, cpu_offload)


def _priced(setup: _Setup, name, policy, say, built) -> Row:
    """The row of one shape-only step at the setup's shape."""
    with _failures(setup), _pricing(setup, name, policy, say, built) as price:
        return price(setup)


@contextlib.contextmanager
def _failures(setup: _Setup):
    """A step's failures, one line each."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise ActdesignError(f"model {setup.name!r} cannot be estimated: it reads the "
                             f"values of a tensor ({exc.func}), which fake tensors do not "
                             "have") from None
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        # a config that builds a model whose own forward fails (sizes that do not fit)
        raise ActdesignError(f"model {setup.name!r}: its training step fails: "
                             f"{models.reason(exc)}; check its config") from None


def _searched(setup: _Setup, name, policy, say, built, dimension, step, sizes) -> Row:
    """The row at the longest `dimension` that fits the first size, with every size's
    answer (`Row.longest`): one model built and compressed, its step priced at each value
    the search asks for (`search.longest`)."""
    priced = {}
    with _failures(setup), _pricing(setup, name, policy, say, built) as price:
        cap = sequence_cap(setup, price.model) if dimension == "seq" else None
        if cap is not None and step > cap:
            raise ActdesignError(f"the search's step {step:,} is longer than the {cap:,} "
                                 f"positions model {setup.name!r} learned: give a smaller "
                                 "--step")

        def row(value) -> Row:
            if value not in priced:
                priced[value] = price(replace(setup, **{dimension: value}), quiet=True)
            return priced[value]

        answers = {}
        for given, size in sizes:
            what = "longest sequence" if dimension == "seq" else "largest batch"
            say(f"{name}: the {what} within {given}")
            answers[given] = longest(row, size, dimension, step, cap,
                                     lambda message: say(f"{name}: {message}"))
        first = next(iter(answers.values()))
        found = row(first.value or step)
    for answer in answers.values():
        answer.steps = len(priced)
    return replace(found, longest=answers)


class _Pricing:
    """One policy's model on fake tensors, built and compressed once, whose training step is
    priced at any shape: called with a setup, the row of one step at its batch and sequence.
    Each step starts from the state compress left (every module's attributes as they were,
    no gradients), so it prices what a fresh model's step would."""

    def __init__(self, setup: _Setup, name, policy, say, built, mode):
        self.setup, self.name, self.policy, self.say, self.mode = setup, name, policy, say, mode
        if setup.module is not None:
            model = setups.fake_copy(setup.module, mode, setup.precision, setup.lora)
        else:
            model = setups.fake_model(setup.name, setup.config, setup.precision, setup.lora)
        built.update(setups.built(model))
        if policy.rules:
            say(f"compressing with {policy.label}")
            probe = None if setup.make_batch is None else setup.make_batch(2, setup.seq)
            if probe is not None and setup.precision == "bf16":  # as the step's own inputs
                probe = _to(probe, "cpu", torch.bfloat16)
            compress(model, policy, probe, allow_more=True)  # priced, whatever it keeps
        if setup.checkpointing:
            setups.with_checkpointing(setup.name, model)
        self.model = model
        self.state = [(m, dict(vars(m))) for m in model.modules()]

    def __call__(self, setup: _Setup, quiet: bool = False) -> Row:
        for m, state in self.state:
            vars(m).clear()
            vars(m).update(state)
        self.model.zero_grad(set_to_none=True)
        return _estimate_fake(setup, self.name, self.policy,
                              (lambda message: None) if quiet else self.say, self.model,
                              self.mode)


@contextlib.contextmanager
def _pricing(setup: _Setup, name, policy, say, built):
    with shapes_only(setup.kernels) as mode:
        yield _Pricing(setup, name, policy, say, built, mode)


def _estimate_fake(setup: _Setup, name, policy: policy_mod.Policy, say, model, mode) -> Row:
    """The row of one training step of `model` (on fake tensors of `mode`) at `setup`'s shape."""
    if setup.make_batch is not None:  # made in the fake mode: fake images
        inputs = setup.make_batch(setup.batch, setup.seq)
    elif setup.example is None:
        inputs = models.example_batch(model, setup.batch, setup.seq)
    else:
        with unset_fake_temporarily():
            inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor)
                              else t, setup.example)
    if setup.precision == "bf16":
        inputs = _to(inputs, "cpu", torch.bfloat16)
    weights = distinct((*model.parameters(), *model.buffers()))
    trainable = distinct(p for p in model.parameters() if p.requires_grad)
    quantized = setups.quantized(model) if setup.four_bit else {}
    in_flight = setups.in_flight(model) if setup.cpu_offload else 0
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


def _side(size) -> str:
    return f"{size}x{size}" if isinstance(size, int) else "x".join(map(str, size))


def _source(model, image_size=None):
    """(its name in the output, a config to build from, a model object to copy, make_batch
    for a timm or torchvision model, warnings about the config) of what `estimate` was
    given; an image model's config at `image_size` (`models.sized`)."""
    if isinstance(model, torch.nn.Module):
        if image_size is not None:
            raise ActdesignError("a model object takes the inputs given with it "
                                 "(example_inputs), not an image size")
        return type(model).__name__, getattr(model, "config", None), model, None, []
    if models.is_vision_name(model):  # built for real, copied onto fake tensors
        module, make_batch = models.vision_model(model, image_size)
        return model, None, module, make_batch, []
    if isinstance(model, str):
        config = models.config_of(model, image_size)
        if config is None:
            raise ActdesignError(f"model {model!r}: estimate builds a model from its config; "
                                 "give a built-in, a local config.json, hf:<repo id>, "
                                 "timm:<name> or torchvision:<name>, or the model object from "
                                 "Python")
        return model, config, None, None, models.defaulted(model, config)
    if isinstance(model, dict):
        label, config = _source_of_dict(model)
        return label, models.sized(label, config, image_size), None, None, []
    if type(model).__module__.startswith("transformers.") and hasattr(model, "model_type"):
        label = f"{model.model_type} config"
        return label, models.sized(label, model, image_size), None, None, []
    raise ActdesignError("estimate takes a model name, a transformers config (or its dict) or "
                         f"a model object, not {type(model).__name__}")


def _source_of_dict(data: dict):
    transformers = models.require_transformers("a config dict")
    kind = data.get("model_type")
    if not isinstance(kind, str):
        raise ActdesignError("a config dict needs its model_type, such as 'llama'")
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except Exception as exc:  # noqa: BLE001  (transformers' validators raise their own types)
        raise ActdesignError(f"the {kind} config dict cannot be used: "
                             f"{models.reason(exc)}") from None
    return f"{kind} config", config
