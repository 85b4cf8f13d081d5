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

B's product is a lean Linear product of a (it keeps a and B's own weight). A's half is one
autograd Function whose backward runs autograd's own formulas for PEFT's ops, op for op (the
products in the same operand order, the casts back, the dropout's backward), on x rebuilt
and dropped again under the forward's generator state: the same roundings and the same mask,
so the gradients are eager PEFT's. The replay costs a cast and the dropout again, and no
product, no nested autograd.

The lean forward is set on the layer instance, which stays PEFT's own class: merging,
saving, `disable_adapter()` and adapter switching work as before. Whenever the layer is not
in the plain state (adapters merged or disabled, several active at once, a mixed batch,
hooks on A or B, no gradient wanted), PEFT's own forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .compressed import LeanLinear, autocast_off, compressed_call
from .draws import replayed_rng, rng_state
from .hooks import hooked
from .sharing import keep, restore


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
        h = _AdapterInput.apply(x, a.weight, cast, float(p), self.keeper)
        # B's product is a plain lean product of h: it keeps h and its own weight
        path = compressed_call(_PLAIN, h, b.weight, b.bias) * layer.scaling[adapter]
        if quantized:
            return result + (path.to(result.dtype) if converts else path)
        return (result + path).to(result.dtype)  # as PEFT adds and casts


# B's product: a lean Linear's math on the adapter's own B weight (not a module PEFT holds)
_PLAIN = LeanLinear(1, 1, bias=False, device="meta")


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


def _dropout(x, p):
    """(F.dropout(x, p, True), what its backward reads), by the op torch itself runs for it:
    the fused kernel on the devices it takes (its mask), else the composite (its noise)."""
    if x.device.type in _FUSED_DROPOUT and x.numel():
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * noise, noise


_FUSED_DROPOUT = ("cuda", "xpu", "lazy", "privateuseone")  # torch's is_fused_kernel_acceptable


def _dropout_backward(grad, kept, p):
    """The gradient through `_dropout`, as autograd computes it."""
    if kept.dtype == torch.bool:
        return torch.ops.aten.native_dropout_backward(grad, kept, 1.0 / (1.0 - p))
    return grad * kept


class _AdapterInput(torch.autograd.Function):
    """h = A(drop(x)) as PEFT computes it (x cast to the adapter's dtype first, the product
    under the caller's autocast), keeping what `keeper` keeps of x and the generator's state.
    Its backward is autograd's own formulas for those ops, op for op: the same products in
    the same operand order, the casts back, the dropout's backward on its replayed mask."""

    @staticmethod
    def forward(ctx, x, weight, cast, p, keeper):
        device = x.device
        ctx.rng = rng_state(device) if p else None
        xc = x.to(cast) if cast is not None and x.dtype != cast else x
        xd = _dropout(xc, p)[0] if p else xc
        h = F.linear(xd, weight)  # under the caller's autocast, as PEFT runs
        saved, ctx.how = (), None
        if ctx.needs_input_grad[1]:  # A's gradient reads x
            saved, ctx.how = keep(x, keeper)
        ctx.save_for_backward(weight, *saved)
        ctx.keeper, ctx.shape, ctx.dtype, ctx.stride = keeper, x.shape, x.dtype, x.stride()
        ctx.cast, ctx.p, ctx.device = xc.dtype, p, device
        ctx.product = h.dtype  # the product's dtype: autocast's, or the inputs'
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        weight, *saved = ctx.saved_tensors
        wants_x, wants_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        with autocast_off(ctx.device.type):
            w = weight.to(ctx.product)
            g2 = grad.reshape(-1, grad.shape[-1])
            xd, kept = _replay(ctx, saved, rebuild_x=wants_w) if wants_w or ctx.p \
                else (None, None)
            if wants_w:  # mm's backward for its second operand, weight.t(), column-major
                grad_w = g2.t().mm(xd.to(ctx.product).reshape(-1, w.shape[1])).to(weight.dtype)
            if wants_x:
                grad_x = g2.mm(w).view(*ctx.shape[:-1], w.shape[1]).to(ctx.cast)
                if ctx.p:
                    grad_x = _dropout_backward(grad_x, kept, ctx.p)
                grad_x = grad_x.to(ctx.dtype)
        return grad_x, grad_w, None, None, None


def _replay(ctx, saved, rebuild_x):
    """(drop(x), the dropout's mask or noise) again: x rebuilt from what was kept (zeros
    stand in for it where only the mask is wanted), in x's own layout (the generator fills
    the mask in memory order), under the generator state of the forward."""
    x = restore(saved, ctx.how, ctx.keeper, ctx.shape, ctx.dtype) if rebuild_x else None
    if x is None or x.stride() != ctx.stride:
        x = torch.empty_strided(ctx.shape, ctx.stride, dtype=ctx.dtype,
                                device=ctx.device).copy_(0 if x is None else x)
    xc = x.to(ctx.cast)
    if not ctx.p:
        return xc, None
    with replayed_rng(ctx.device, ctx.rng):
        return _dropout(xc, ctx.p)
