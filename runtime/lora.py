"""LoRA layers of PEFT whose adapter path keeps almost nothing for the backward.

A PEFT LoRA layer computes z = base(x) + s·B(A(drop(x))), x cast to the adapter's dtype
first. Eager PyTorch keeps, per layer, the dropped input (and on CPU the dropout's float
noise), a 16-bit cast of it under autocast, and A's output. The lean forward keeps:
- nothing for the base layer, frozen: it is called as a module (a quantized base runs too),
  and a Linear base is a LeanLinear, which keeps nothing when its weight is frozen;
- a = A(drop(x)), r values per token, for B's gradient;
- for A's gradient, what x's producer keeps anyway (an MS norm's x̂, MS-GLU's g and u: see
  `sharing`), or x itself, or ActNN codes of it under an ActNN rule;
- the dropout mask as the random generator's state before it was drawn (the way
  torch.utils.checkpoint replays dropout): 16 bytes on CUDA, 5 KB on the CPU, for the whole
  layer, where 1 bit per element would be d/8 bytes per token, several times what `a` takes.

The backward replays the adapter's forward ops on the rebuilt x under the same autocast
state and generator state, and lets autograd differentiate them: the same ops, the same
roundings, the same mask, so the gradients are eager PEFT's. The replay costs A's and B's
products again, r/d_out of the base layer's.

The lean forward is set on the layer instance, which stays PEFT's own class: merging,
saving, `disable_adapter()` and adapter switching work as before. Whenever the layer is not
in the plain state (adapters merged or disabled, several active at once, a mixed batch,
hooks on A or B, no gradient wanted), PEFT's own forward runs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .accounting import hooked
from .compressed import LeanLinear
from .edits import Edit
from .sharing import keep, restore
from .targets import is_hf_conv1d


class LeanLoRA:
    """The forward of one PEFT LoRA layer (set on the instance): `lora.Linear`, or QLoRA's
    `Linear4bit` and `Linear8bitLt` on bitsandbytes' layers. `keeper` says how
    x is kept for A's gradient: LeanLinear (x, or what its producer offers) or an
    `InputCodes` (ActNN codes)."""

    def __init__(self, layer: nn.Module, keeper):
        self.layer, self.keeper = layer, keeper

    def __call__(self, x, *args, **kwargs):
        layer = self.layer
        adapter = None if args or kwargs or not torch.is_grad_enabled() else _plain(layer)
        if adapter is None:
            return type(layer).forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x)
        a, b = layer.lora_A[adapter], layer.lora_B[adapter]
        # PEFT casts x to the adapter's dtype; its bitsandbytes layers only without (CUDA)
        # autocast, and then cast the path's output back before adding it
        quantized = type(layer).__module__.endswith(".bnb")
        converts = not (quantized and torch.is_autocast_enabled())
        cast = a.weight.dtype if converts and getattr(layer, "cast_input_dtype_enabled", True) \
            else None
        drop = layer.lora_dropout[adapter]
        p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
        device = x.device.type
        if not p and torch.is_autocast_enabled(device) \
                and torch.get_autocast_dtype(device) == x.dtype:
            cast = None  # A's product casts x back: a round trip through float32, a no-op
        path = _AdapterPath.apply(x, a.weight, b.weight, b.bias, layer.scaling[adapter],
                                  cast, float(p), self.keeper)
        if quantized:
            return result + (path.to(result.dtype) if converts else path)
        return (result + path).to(result.dtype)  # as PEFT adds and casts


def _plain(layer) -> str | None:
    """The one active adapter when the layer computes base(x) + s·B(A(drop(x))) with plain
    modules, else None (PEFT's own forward then runs)."""
    if layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    (name,) = active
    a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    plain = all(type(m) is nn.Linear and not hooked(m) for m in (a, b)) and a.bias is None \
        and (type(drop) is nn.Identity or (type(drop) is nn.Dropout and not drop.inplace
                                           and drop.p < 1 and not hooked(drop)))
    return name if plain else None


def plan_lora(layer: nn.Module, keeper=LeanLinear) -> list[Edit]:
    """The edits giving a PEFT LoRA layer (`targets.is_lora_linear`) the lean forward: its
    base layer, when an nn.Linear or a transformers Conv1D, becomes a LeanLinear holding the
    same parameters (frozen, it keeps nothing); any other base (a quantized one) stays and is
    called as it is. Nothing is changed here."""
    edits = []
    base = layer.base_layer
    if type(base) is nn.Linear or is_hf_conv1d(base):
        edits.append(Edit(layer, "base_layer", LeanLinear.from_module(base)))
    return edits + [Edit(layer, "forward", LeanLoRA(layer, keeper))]


def _rng_state(device):
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def _replayed_rng(device, state):
    """The default generator of `device` at `state` while open; the generators as they were
    after (as torch.utils.checkpoint replays dropout)."""
    cpu = device.type == "cpu"
    with torch.random.fork_rng(devices=[] if cpu else [device], device_type=device.type):
        if cpu:
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield


def _a_half(x, a_weight, cast, p):
    """A(drop(x)) as PEFT computes it: x cast to the adapter's dtype, dropped, A applied."""
    if cast is not None and x.dtype != cast:
        x = x.to(cast)
    return F.linear(F.dropout(x, p, True) if p else x, a_weight)


def _b_half(a, b_weight, b_bias, scaling):
    return F.linear(a, b_weight, b_bias) * scaling


class _AdapterPath(torch.autograd.Function):
    """s·B(A(drop(x))), keeping a = A(drop(x)), what `keeper` keeps of x, and the generator
    state; the backward replays both halves under autograd."""

    @staticmethod
    def forward(ctx, x, a_weight, b_weight, b_bias, scaling, cast, p, keeper):
        device = x.device
        ctx.rng = _rng_state(device) if p else None
        a = _a_half(x, a_weight, cast, p)  # under the caller's autocast, as PEFT runs
        out = _b_half(a, b_weight, b_bias, scaling)
        saved, ctx.how = (), None
        if ctx.needs_input_grad[1]:  # A's gradient reads x
            saved, ctx.how = keep(x, keeper)
        ctx.save_for_backward(a, a_weight, b_weight, b_bias, *saved)
        ctx.keeper, ctx.shape, ctx.dtype = keeper, x.shape, x.dtype
        ctx.stride, ctx.device = x.stride(), device
        ctx.scaling, ctx.cast, ctx.p = scaling, cast, p
        ctx.autocast = torch.is_autocast_enabled(device.type), \
            torch.get_autocast_dtype(device.type)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, a_weight, b_weight, b_bias, *saved = ctx.saved_tensors
        wants = ctx.needs_input_grad
        grads = [None] * 8
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device.type, dtype, enabled=enabled):
            leaves = [_leaf(a, True), _leaf(b_weight, wants[2]), _leaf(b_bias, wants[3])]
            out = _b_half(*leaves, ctx.scaling)
            found = _grad(out, leaves, grad)
            grads[2:4] = found[1:]
            if wants[0] or wants[1]:
                x = None  # dx reads the mask only: zeros stand in for x
                if wants[1]:
                    x = restore(saved, ctx.how, ctx.keeper, ctx.shape, ctx.dtype)
                if x is None or x.stride() != ctx.stride:
                    # x's own layout: the generator fills the mask in memory order
                    x = torch.empty_strided(ctx.shape, ctx.stride, dtype=ctx.dtype,
                                            device=ctx.device).copy_(0 if x is None else x)
                leaves = [_leaf(x, wants[0]), _leaf(a_weight, wants[1])]
                with _replayed_rng(ctx.device, ctx.rng) if ctx.p else contextlib.nullcontext():
                    a_again = _a_half(*leaves, ctx.cast, ctx.p)
                grads[0:2] = _grad(a_again, leaves, found[0])
        return tuple(grads)


def _leaf(t, wanted):
    return None if t is None else t.detach().requires_grad_(bool(wanted))


def _grad(out, leaves, grad):
    """d out / d leaf for the leaves that want it (None for the others)."""
    want = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, want, grad) if want else ())
    return [next(got) if t is not None and t.requires_grad else None for t in leaves]
