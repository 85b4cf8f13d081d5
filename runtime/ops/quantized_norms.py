"""ActNN's batch norm: the forward is eager's (the same op, the same running statistics), and
for the backward it keeps b-bit per-group stochastic codes (`InputCodes`) of the normalized
input x̂ = (x - mean)·invstd, with the statistics the forward used, exact. The backward is
eager's formula on x made again from the dequantized x̂: the input gradient and γ's read x
only through x̂.

Codes of x̂, not of x: a group of 256 elements spans several channels where a feature map is
small (a 7×7 map holds 49 per channel), and channels differ in mean and scale. Codes of x
would then take their step from the widest channel in the group, a step that can exceed a
narrow channel's whole spread; in x̂ every channel has unit scale, so the step is the same
fraction of every channel's spread.

A module keeps codes where its forward calls `F.batch_norm` on its own input: torch's batch
norms and their subclasses (timm's with the activation inside, say), the module's class and
parameters untouched (`quantized_norm_forward` is set on the instance).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .chains import batch_norm_call, leaf_recipe, offer_recipe, shares_recipes
from .fake import on_host
from .quantized import InputCodes


class _QuantizedBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps,
                codes, offers):
        out, mean, invstd, reserve, impl = torch.ops.aten._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, training, momentum, eps,
            torch.backends.cudnn.enabled)
        center, scale = _statistics(x, mean, invstd, running_mean, running_var, eps)
        kept = _normalized_codes(codes, x, center, scale)
        ctx.save_for_backward(*kept, weight, running_mean, running_var, mean, invstd, reserve,
                              center, scale)
        ctx.codes, ctx.count, ctx.shape, ctx.dtype = codes, len(kept), x.shape, x.dtype
        ctx.training, ctx.eps, ctx.impl = training, eps, impl
        ctx.channels_last = x.dim() == 4 and not x.is_contiguous() \
            and x.is_contiguous(memory_format=torch.channels_last)
        if offers and shares_recipes(in_function=True):  # readers keeping codes keep these
            offer_recipe(out, leaf_recipe(_output_again, (
                *kept, weight, bias, codes, x.shape, out.dtype), bits=codes.bits))
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        kept, (weight, running_mean, running_var, mean, invstd, reserve, center, scale) = \
            saved[:ctx.count], saved[ctx.count:]
        x = ctx.codes.restore(kept, ctx.shape, ctx.dtype).div_(scale).add_(center)  # x̂ -> x
        if ctx.channels_last:  # the layout eager's backward had
            x = x.contiguous(memory_format=torch.channels_last)
        needs = ctx.needs_input_grad
        grad_x, grad_w, grad_b = torch.ops.aten._batch_norm_impl_index_backward(
            ctx.impl, x, grad, weight, running_mean, running_var, mean, invstd, ctx.training,
            ctx.eps, [needs[0], needs[1], needs[2]], reserve)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def _output_again(packed, lo, width, bits, weight, bias, codes, shape, dtype):
    """The norm's output made again from its codes of x̂: x̂·γ + β, unbiased as the codes are,
    its step x̂'s scaled by γ."""
    y = codes.restore((packed, lo, width, bits), shape, dtype)
    channels = (1, -1) + (1,) * (len(shape) - 2)
    if weight is not None:
        y = y.mul_(weight.to(dtype).view(channels))
    return y if bias is None else y.add_(bias.to(dtype).view(channels))


def _statistics(x, mean, invstd, running_mean, running_var, eps):
    """The mean and inverse deviation the forward normalized x with, in x's dtype (x̂ is made
    in it, no wider copy of x) and shaped to broadcast over its channels: the batch's in
    training (eval's are not returned), else the running ones."""
    if mean.numel() == 0:
        mean, invstd = running_mean, (running_var + eps).rsqrt()
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)


def _normalized_codes(codes, x, center, scale, slices=8):
    """Codes of x̂ = (x - center)·scale, made a slice of the batch at a time (a sample's codes
    are its own): x̂ is then a transient of an eighth of x, where a whole copy would raise the
    forward's peak by x."""
    step = -(-x.shape[0] // slices)
    parts = [codes.compress(torch.sub(x[i:i + step], center).mul_(scale))
             for i in range(0, x.shape[0], step)]
    if len(parts) == 1:
        return parts[0]
    packed, lo, width, bits = zip(*parts, strict=True)
    with on_host():  # the bits are the host's, on fake tensors too
        bits = torch.cat(bits)
    return torch.cat(packed), torch.cat(lo), torch.cat(width), bits


class _QuantizedNorms(TorchFunctionMode):
    """While open, `F.batch_norm` on `x` keeps codes of x (`_QuantizedBatchNorm`), and
    where it `offers`, its output carries a recipe from them."""

    def __init__(self, x, codes, offers):
        super().__init__()
        self.x, self.codes, self.offers = x, codes, offers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.batch_norm or not args or args[0] is not self.x:
            return func(*args, **kwargs)
        call = batch_norm_call(args, kwargs)
        return _QuantizedBatchNorm.apply(
            call["input"], call.get("weight"), call.get("bias"), call["running_mean"],
            call["running_var"], call.get("training", False), call.get("momentum", 0.1),
            call.get("eps", 1e-5), self.codes, self.offers)


def quantized_norm_forward(cls, bits: int, group_size: int, offers: bool = False):
    """cls.forward, its batch norm keeping b-bit codes of its input while gradients are
    wanted (and not under torch.compile, which keeps what it decides). Where it `offers` (in
    a convolutional chain), its output carries the recipe that makes it again from the codes,
    which its readers keeping codes of as many bits or fewer keep in place of their own."""
    forward = cls.forward
    codes = InputCodes(bits, group_size)

    @functools.wraps(forward)
    def quantized(self, x, *args, **kwargs):
        if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad) \
                or torch.compiler.is_compiling():
            return forward(self, x, *args, **kwargs)
        with _QuantizedNorms(x, codes, offers):
            return forward(self, x, *args, **kwargs)

    quantized.actdesign_codes, quantized.actdesign_offers = codes, offers
    return quantized


def is_quantized_norm_forward(forward) -> bool:
    return hasattr(getattr(forward, "__func__", None), "actdesign_codes")


def offers_from_codes(forward) -> bool:
    """Whether a batch norm's forward offers its output as a recipe from its codes."""
    return getattr(getattr(forward, "__func__", None), "actdesign_offers", False)
