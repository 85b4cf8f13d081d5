"""Shape-only runs: a model on fake tensors (torch's FakeTensorMode), as `estimate` runs one.

Fake tensors have shapes, dtypes and storage sizes but no values. On them the ops' kernels
are not launched (a generated module's backend is "fake": its Triton path's tensors are
allocated, or with the mode's `cpu_kernels` its CPU path's; nothing is computed); what must
stay real stays real: host-side bookkeeping (bit layouts, seeds) runs
`on_host`, and the checks `compress` makes by comparing numbers run on a real stand-in
(`real_copy`) of the modules they check.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def on_host():
    """Real tensors while open, also inside a FakeTensorMode."""
    return unset_fake_temporarily()


def any_fake(module: torch.nn.Module) -> bool:
    return any(is_fake(t) for t in (*module.parameters(), *module.buffers()))


def real_copy(*modules):
    """Copies of `modules` with real tensors of the same shapes and dtypes in place of their
    parameters and buffers (shared ones shared), random normal values scaled by 1/sqrt(the
    last dimension) for floats, zeros otherwise. Call `on_host`."""
    memo = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            if id(t) not in memo:
                real = torch.zeros(t.shape, dtype=t.dtype)
                if real.is_floating_point() and real.dim():
                    real.normal_(0, real.shape[-1] ** -0.5)
                if isinstance(t, torch.nn.Parameter):
                    real = torch.nn.Parameter(real, t.requires_grad)
                memo[id(t)] = real
    return copy.deepcopy(modules, memo)


class ShapesOnly(FakeTensorMode):
    """Fake tensors that tell our ops which kernels' allocations to follow (`cpu_kernels`),
    and whether a loop over rows may leave out the iterations that repeat the one before
    (`skip_repeats`, see `spans_to_run`)."""

    def __init__(self, kernels, skip_repeats: bool = True):
        super().__init__()
        self.cpu_kernels = kernels == "cpu"
        self.skip_repeats = skip_repeats


@contextlib.contextmanager
def shapes_only(kernels: str = "cuda", skip_repeats: bool = True):
    """Fake tensors for a shape-only step, following `kernels`' allocations for our ops (see
    `estimate`): build the model inside (`fake_model`, `fake_copy`) and run its step
    inside. Yields the fake mode. Count ops (FLOPs, launches) with `skip_repeats` off."""
    with ShapesOnly(kernels, skip_repeats) as mode, CpuKernels(), unpacked_sequences():
        yield mode


def spans_to_run(spans, t) -> list:
    """The (start, end) spans of rows a loop runs over `t`: all of them, but on the fake
    tensors of a shape-only step that skips repeats, only the first three and the first two
    after each change of size. In the loops that ask (sequence tiles, the fused loss's
    chunks) an iteration allocates what its size and the state the loop is in say; the first
    iterations set that state up (the outputs and sums the later ones write into, what the
    one before leaves alive until it is replaced), and from then on it depends on the size
    of the iteration before alone. So a left-out span would make and free what the run one
    before it did: the peak, what is kept and what is alive after are the same
    (tests/test_estimate.py compares them), and a step of a million tokens runs about as
    fast as one of a few thousand."""
    spans = list(spans)
    if not (is_fake(t) and getattr(t.fake_mode, "skip_repeats", False)):
        return spans
    sizes = [b - a for a, b in spans]
    return [s for i, s in enumerate(spans) if i < 3 or len(set(sizes[i - 2:i + 1])) > 1]


class CpuKernels(TorchDispatchMode):
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


@contextlib.contextmanager
def no_initialization():
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


class RealSchedules(TorchFunctionMode):
    """While a model is built on fake tensors: `torch.linspace`, and the ops whose tensors are
    all real (its results), run for real, so a schedule the model reads as numbers has them
    (stochastic depth's rates, `torch.linspace(0, rate, depth).tolist()`, in ConvNeXt, Swin,
    EfficientNet...). `faked(model)` then makes fake any such tensor the model kept."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.linspace or (tensors and not any(map(is_fake, tensors))):
            with on_host():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def faked(model: torch.nn.Module, mode) -> torch.nn.Module:
        for m in model.modules():
            for name, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is not None and not is_fake(t):
                    fake = mode.from_tensor(t.detach())
                    table = m._parameters if name in m._parameters else m._buffers
                    table[name] = torch.nn.Parameter(fake, t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else fake
        return model


@contextlib.contextmanager
def unpacked_sequences():
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
def conversions_in_place():
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
