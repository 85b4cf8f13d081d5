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
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from actdesign.errors import ActdesignError

from . import models
from . import policy as policy_mod
from .accounting import account, storage_key
from .compress import compress
from .profile import OUTPUT_ROW, _to, check_precision, forward_context, size_unit

# optimizer -> (its name in the table, states per trainable parameter element); each state has
# the parameter's dtype, as torch.optim.AdamW keeps them (float32 unless the weights are bf16).
OPTIMIZERS = {"adamw": ("AdamW", 2)}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size such as `24GiB`, `80GB` or `1.5 TiB` (GB: 10**9 bytes, GiB: 2**30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ActdesignError(f"cannot read the size {text!r}: write a number and a unit, such "
                             "as 24GiB or 80GB")
    return int(float(match.group(1)) * unit)


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
    fits: bool | None = None

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {"policy": self.policy, "saved_bytes": self.saved_bytes,
                "peak_bytes": self.peak_bytes, "weights_bytes": self.weights_bytes,
                "gradients_bytes": self.gradients_bytes,
                "optimizer_bytes": self.optimizer_bytes, "total_bytes": self.total_bytes,
                "fits": self.fits, "weight_copy_bytes": self.constant,
                "saved_by_module": self.saved}


@dataclass
class Estimate:
    model: str
    shape: str
    precision: str
    checkpointing: bool
    optimizer: str
    gpu_memory: int | None
    lora: int | None = None
    kernels: str = "cuda"
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": "actdesign.estimate", "model": self.model, "shape": self.shape,
                "precision": self.precision,
                "checkpointing": self.checkpointing, "lora_rank": self.lora,
                "kernels": self.kernels,
                "optimizer": self.optimizer,
                "gpu_memory_bytes": self.gpu_memory, "rows": [r.to_dict() for r in self.rows]}

    def table(self) -> str:
        scale, unit = size_unit(max(r.total_bytes for r in self.rows))
        width = max(14, *(len(r.policy) + 2 for r in self.rows))

        def line(label, values):
            return f"{label[-47:]:<48}" + "".join(f"{v / scale:>{width},.2f}" for v in values)

        checkpointing = "with" if self.checkpointing else "without"
        lora = f", LoRA rank {self.lora} on every Linear layer" if self.lora else ""
        lines = [f"{self.model}, {self.shape}, {self.precision}{lora}, {checkpointing} "
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
        name, states = OPTIMIZERS[self.optimizer]
        for label, attr in (("saved total", "saved_bytes"), ("activation peak", "peak_bytes"),
                            ("weights", "weights_bytes"), ("gradients", "gradients_bytes"),
                            (f"optimizer state ({name}, {states} per parameter)",
                             "optimizer_bytes"),
                            ("total", "total_bytes")):
            lines.append(line(label, [getattr(r, attr) for r in self.rows]))
        if self.gpu_memory is not None:
            gpu_scale, gpu_unit = size_unit(self.gpu_memory)
            lines.append(f"{f'fits in {self.gpu_memory / gpu_scale:,.2f} {gpu_unit}':<48}"
                         + "".join(f"{'yes' if r.fits else 'no':>{width}}" for r in self.rows))
        return "\n".join(lines)


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

    def peak(self, leave_out=(), between=None) -> int:
        """The most bytes alive at once, allocations in `leave_out` aside; with `between`, a
        pair of event counts, the most alive from the first to the second."""
        leave_out = {self.live[k][0] for k in leave_out if k in self.live}
        start, end = between or (0, len(self.events))
        now = peak = 0
        for i, (allocation, n) in enumerate(self.events[:end]):
            if allocation not in leave_out:
                now += n
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
    name: str
    config: object
    batch: int
    seq: int
    precision: str
    checkpointing: bool
    optimizer: str
    lora: int | None
    kernels: str


class _ShapesOnly(FakeTensorMode):
    """Fake tensors that tell our ops which kernels' allocations to follow."""

    def __init__(self, kernels):
        super().__init__()
        self.cpu_kernels = kernels == "cpu"


def estimate(model_name: str, batch: int, seq: int, precision: str = "fp32",
             policies=("none",), checkpointing: bool = False, optimizer: str = "adamw",
             gpu_memory: int | str | None = None, progress=None,
             lora: int | None = None, kernels: str = "cuda") -> Estimate:
    """Estimate one training step of a model from its config (a name models.config_of takes)
    at `batch` x `seq`, in `precision` (one of PRECISIONS), with gradient checkpointing or
    not: saved bytes by module, activation peak, weights, gradients and `optimizer` state, and
    whether their sum fits in `gpu_memory` (bytes, or a size such as "24GiB") when given. One
    row per policy (a preset, presets joined by '+', a policy dict or file). With `lora`, a
    rank: PEFT LoRA adapters of that rank on every Linear layer but the head (alpha 2 x rank,
    no dropout), the adapters alone trained, compressed as the policy says. `kernels`: whose
    allocations the peak follows for our ops, the CUDA kernels' (their outputs alone) or the
    CPU paths' (their float32 working copies too)."""
    check_precision(precision)
    if lora is not None and not (isinstance(lora, int) and lora >= 1):
        raise ActdesignError(f"the LoRA rank must be a positive integer, got {lora!r}")
    if optimizer not in OPTIMIZERS:
        raise ActdesignError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {optimizer!r}")
    if kernels not in KERNELS:
        raise ActdesignError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    policies = [policies] if isinstance(policies, str) else list(policies)
    loaded = [policy_mod.load(p) for p in policies]  # a bad one refused before any build
    if isinstance(gpu_memory, str):
        gpu_memory = parse_size(gpu_memory)
    start = time.perf_counter()

    def say(message):
        if progress is not None:
            progress(f"[{time.perf_counter() - start:6.1f} s] {message}")

    config = models.config_of(model_name)
    if config is None:
        raise ActdesignError(f"model {model_name!r}: estimate builds a model from its config; "
                             "give a built-in, a local config.json or hf:<repo id>")
    setup = _Setup(model_name, config, batch, seq, precision, checkpointing, optimizer, lora,
                   kernels)
    rows = []
    for name, policy in zip(policies, loaded, strict=True):
        say(f"building {model_name} on fake tensors")
        try:
            rows.append(_estimate_fake(setup, name, policy, say))
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise ActdesignError(f"model {model_name!r} cannot be estimated: it reads the "
                                 f"values of a tensor ({exc.func}), which fake tensors do not "
                                 "have") from None
        if gpu_memory is not None:
            rows[-1].fits = rows[-1].total_bytes <= gpu_memory
    vision = getattr(config, "image_size", None)
    shape = f"batch {batch}, " + (f"{vision}x{vision} images" if vision else f"sequence {seq}")
    return Estimate(model_name, shape, precision, checkpointing, optimizer, gpu_memory, lora,
                    kernels, rows)


@contextlib.contextmanager
def shapes_only(kernels: str = "cuda"):
    """Fake tensors for a shape-only step, following `kernels`' allocations for our ops (see
    `estimate`): build the model inside (`fake_model`) and run its step inside."""
    with _ShapesOnly(kernels), _CpuKernels(), _unpacked_sequences():
        yield


def fake_model(name: str, config, precision: str = "fp32", lora=None):
    """The model of a config on fake tensors, in training mode (call inside `shapes_only`):
    in bfloat16 for precision bf16, with PEFT LoRA adapters when given `lora`, a rank (see
    `_with_lora`) or a peft.LoraConfig."""
    with _no_initialization(), _conversions_in_place():
        model = models._from_config(name, config).train()
        if precision == "bf16":
            model.to(torch.bfloat16)
        if lora is not None:
            model = _with_lora(name, model, lora)
    return model


def _estimate_fake(setup: _Setup, name, policy: policy_mod.Policy, say) -> Row:
    with shapes_only(setup.kernels):
        model = fake_model(setup.name, setup.config, setup.precision, setup.lora)
        if policy.rules:
            say(f"compressing with {policy.label}")
            compress(model, policy)
        if setup.checkpointing:
            _checkpointing(setup.name, model)
        inputs = models.example_batch(model, setup.batch, setup.seq)
        if setup.precision == "bf16":
            inputs = _to(inputs, "cpu", torch.bfloat16)
        weights = _distinct((*model.parameters(), *model.buffers()))
        trainable = _distinct(p for p in model.parameters() if p.requires_grad)
        say("one training step")
        saved, peak = step(model, inputs, setup.precision)
    gradients = sum(t.untyped_storage().nbytes() for t in trainable.values())
    return Row(name, saved.by_module, saved.total, saved.constant, peak,
               sum(t.untyped_storage().nbytes() for t in weights.values()), gradients,
               OPTIMIZERS[setup.optimizer][1] * gradients)


def fake_step(model, example, policy: policy_mod.Policy, precision: str,
              kernels: str = "cuda", counter=None, window_peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one training step of a copy of `model` (the given
    module, untouched) on fake tensors, compressed by `policy`, on inputs shaped as `example`
    (real tensors: a tensor, a tuple or a dict). `counter`, a dispatch mode such as torch's
    FlopCounterMode, watches the step. `window_peaks`: as `step`'s."""
    mode = _ShapesOnly(kernels)
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            fake = mode.from_tensor(t.detach())
            memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else fake
    inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                      example)
    with mode, _CpuKernels(), _unpacked_sequences():
        copy_ = copy.deepcopy(model, memo).train()
        if precision == "bf16":
            with _conversions_in_place():
                copy_.to(torch.bfloat16)
            inputs = _to(inputs, "cpu", torch.bfloat16)
        if policy.rules:
            compress(copy_, policy)
        with counter if counter is not None else contextlib.nullcontext():
            return step(copy_, inputs, precision, window_peaks)


def step(model, inputs, precision, window_peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one forward and backward of `model` on `inputs`, fake
    or real tensors alike: the peak is the most bytes alive at once of the storages the step
    makes, the parameters' gradients aside. `window_peaks`, a dict keyed by module names, gets
    for each the most bytes alive while its backward ran (from its output's gradient to its
    input's), where it ran once."""
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
            out.backward()
            del out
    finally:
        for h in handles:
            h.remove()
    grads = _distinct(p.grad for p in model.parameters() if p.grad is not None)
    for name, window in marks.items():
        if window["calls"] == 1 and len(window["events"]) == 2:
            window_peaks[name] = live.peak(grads, between=window["events"])
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
