"""Linear and Conv2d layers whose weight gradient uses a compressed copy of their input.

The forward and the input gradient are exact. A layer says how it compresses x for the
backward (`compress`: x -> tensors to save) and how it restores an approximation
(`restore`: saved tensors -> x^); the weight gradient is then computed from x^.

Under autocast the layers follow nn.Linear's and nn.Conv2d's dtype rules: x, the weight and
the bias are cast to the autocast dtype (so each gradient comes back in its tensor's own
dtype), and the function itself runs with autocast off, forward and backward alike, as torch's
`custom_fwd(cast_inputs=...)` convention does. So the compressed copy is taken from the very
tensor the matmul consumed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError

from .known_modules import is_hf_conv1d
from .sharing import Whole, keep, restore, restores_anew


def compressed_call(layer, x, weight, bias):
    """layer's forward on x with a compressed saved input, under autocast's casts if it is on.

    x and the bias are cast by autograd-tracked casts. The weight is cast inside, in the
    forward and again in the backward, so what is kept for the backward is the parameter
    itself, never a 16-bit copy of it (eager autocast keeps one per layer until the backward:
    2 bytes per parameter). The results are the same, bit for bit."""
    dtype, (x, bias) = autocast_casts(weight, x, bias)
    with autocast_off(x.device.type):
        return _CompressedInput.apply(x, weight, bias, layer, dtype or weight.dtype)


_AUTOCAST_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def autocast_off(device_type: str):
    """A block with autocast off: torch.autocast(enabled=False) where it is on, else nothing
    (entering torch.autocast costs microseconds of Python on every call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_casts(weight, *tensors):
    """What autocast does to the inputs of a lower-precision op (a matmul) with this weight:
    (the dtype to compute in, the other tensors cast to it); (None, tensors) with autocast
    off. Only 16- and 32-bit floats are cast, as autocast does."""
    device = weight.device.type
    if not torch.is_autocast_enabled(device):
        return None, tensors
    dtype = torch.get_autocast_dtype(device)
    cast = tuple(t.to(dtype) if t is not None and t.dtype in _AUTOCAST_FLOATS else t
                 for t in tensors)
    return (dtype if weight.dtype in _AUTOCAST_FLOATS else weight.dtype), cast


class _CompressedInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, dtype):
        y = layer.dense_forward(x, weight.to(dtype), bias)
        saved, ctx.how = (), None
        if ctx.needs_input_grad[1]:  # only the weight gradient reads x; a frozen one, nothing
            # What x's producer keeps anyway (an MS norm's x̂, MS-GLU's g and u), where offered
            saved, ctx.how = keep(x, layer)  # x itself: it may carry codes
        ctx.save_for_backward(weight, *saved)
        ctx.layer, ctx.shape, ctx.dtype, ctx.has_bias = layer, x.shape, x.dtype, bias is not None
        ctx.weight_dtype = dtype
        return y

    @staticmethod
    def backward(ctx, g):
        weight, *saved = ctx.saved_tensors
        layer = ctx.layer
        needs = (*ctx.needs_input_grad[:2], ctx.has_bias and ctx.needs_input_grad[2])
        with autocast_off(g.device.type):  # as in the forward
            cast = weight.to(ctx.weight_dtype)
            x = restore(saved, ctx.how, layer, ctx.shape, ctx.dtype) if needs[1] else None
            if needs[0] and x is not None and restores_anew(ctx.how, layer) \
                    and layer.input_grad_reads_no_input:
                # x made anew (from codes, or rebuilt): the weight's gradient first and x
                # freed before the input's, so x and the input gradient are never alive
                # together (each is eager's computation, bit for bit)
                _, grad_w, grad_b = layer.gradients(x, ctx.shape, cast, g, (False, *needs[1:]))
                del x
                grad_x, _, _ = layer.gradients(None, ctx.shape, cast, g, (True, False, False))
            else:
                grad_x, grad_w, grad_b = layer.gradients(x, ctx.shape, cast, g, needs)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), grad_b, None, None


class CompressedLinear(nn.Linear):
    """The Linear half: math, and a constructor from an nn.Linear (or a transformers Conv1D,
    which stores its weight as (in, out): `transposed`) sharing its parameters."""

    transposed = False
    input_grad_reads_no_input = True  # g @ W

    def forward(self, x):
        return compressed_call(self, x, self.weight, self.bias)

    @classmethod
    def from_module(cls, linear: nn.Module, **options):
        transposed = is_hf_conv1d(linear)
        if not (isinstance(linear, nn.Linear) or transposed):
            raise ActdesignError(f"from_module needs an nn.Linear, got {type(linear).__name__}")
        out_features, in_features = linear.weight.shape[::-1 if transposed else 1]
        new = cls(in_features, out_features, linear.bias is not None, device="meta", **options)
        new.weight, new.bias, new.transposed = linear.weight, linear.bias, transposed
        return new

    def dense_forward(self, x, weight, bias):
        # F.linear returns a view for inputs above 2-D; a custom Function's output must not be
        # one, or in-place ops on it (an inplace ReLU) and FSDP2's hooks break.
        y = F.linear(x.reshape(-1, x.shape[-1]), weight.T if self.transposed else weight, bias)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    def gradients(self, x, shape, weight, g, needs):
        """(input, weight, bias) gradients, each where `needs` asks; `x` is the input, restored
        (None where the weight's gradient is not wanted)."""
        grad_x = self.input_grad(shape, weight, g) if needs[0] else None
        grad_w = self.weight_grad(x, weight, g) if needs[1] else None
        # the rows flattened first, as eager's addmm takes them: a permuted gradient sums in
        # their order
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if needs[2] else None
        return grad_x, grad_w, grad_b

    def input_grad(self, shape, weight, g):
        return g @ (weight.T if self.transposed else weight)

    def weight_grad(self, x, weight, g):
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        return x2.T @ g2 if self.transposed else g2.T @ x2

    def extra_repr(self):
        return super().extra_repr() + (", transposed" if self.transposed else "")


class CompressedConv2d(nn.Conv2d):
    """The Conv2d half: nn.Conv2d's own padding (numbers, "same" or "valid"; zeros, reflect,
    replicate or circular), stride, dilation and groups. The gradients come from one
    convolution_backward over the padded input, as eager's autograd takes them, and then the
    padding's own backward: bit for bit eager's, channels_last too."""

    # Its input gradient needs an input of x's shape and layout: the backends make one (a
    # stand-in expanded from a zero is made contiguous inside the kernel, an input-sized
    # buffer no op returns), so a restored x is kept for both gradients at once.
    input_grad_reads_no_input = False

    def forward(self, x):
        if x.dim() != 4:
            raise ValueError(f"{type(self).__name__} expects (N, C, H, W), got {tuple(x.shape)}")
        if self.padding_mode != "zeros":  # nn.Conv2d pads first, in x's own dtype
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        return compressed_call(self, x, self.weight, self.bias)

    @classmethod
    def from_module(cls, conv: nn.Conv2d, **options):
        if not isinstance(conv, nn.Conv2d):
            raise ActdesignError(f"from_module needs an nn.Conv2d, got {type(conv).__name__}")
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                  conv.padding, conv.dilation, conv.groups, conv.bias is not None,
                  conv.padding_mode, device="meta", **options)
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def dense_forward(self, x, weight, bias):
        padded, padding = self.padded(x)
        return F.conv2d(padded, weight, bias, self.stride, padding, self.dilation, self.groups)

    def padded(self, x):
        """(x with the padding the convolution op applies first, the convolution's own
        padding): "same" pads in the convolution, its odd row or column first, as ATen does.
        (A padding mode other than zeros pads before, in `forward`, as nn.Conv2d does.)"""
        if self.padding_mode != "zeros" or self.padding == "valid":
            return x, (0, 0)
        if self.padding != "same":
            return x, self.padding
        left, pad = [], [0, 0, 0, 0]  # F.pad's order: width first
        for i, (size, dilation) in enumerate(zip(self.kernel_size, self.dilation, strict=True)):
            total = dilation * (size - 1)
            left.append(total // 2)
            pad[2 * (1 - i) + 1] = total - 2 * (total // 2)  # the extra row or column, after
        return (F.pad(x, pad) if any(pad) else x), tuple(left)

    def gradients(self, x, shape, weight, g, needs):
        need_x, need_w, need_b = needs
        # without x (a frozen weight), a stand-in of zeros: the backends read only its shape
        # and layout, and would make an expanded one contiguous inside, unseen
        source = x if x is not None else torch.zeros(shape, dtype=g.dtype, device=g.device)
        with torch.enable_grad():  # the padding's backward is autograd's own
            leaf = source.detach().requires_grad_(need_x)
            padded, padding = self.padded(leaf)
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            g, padded.detach(), weight, [weight.shape[0]] if need_b else None, self.stride,
            padding, self.dilation, False, [0, 0], self.groups, [need_x, need_w, need_b])
        if need_x and padded is not leaf:
            (grad_x,) = torch.autograd.grad(padded, leaf, grad_x)
        return grad_x, grad_w, grad_b


class LeanLinear(Whole, CompressedLinear):
    """nn.Linear, exact, keeping for the backward its input and the weight itself: under
    autocast no 16-bit copy of the weight waits for the backward (2 bytes per parameter)."""


class LeanConv2d(Whole, CompressedConv2d):
    """nn.Conv2d, exact, keeping for the backward its input (or what its producer keeps in its
    place, where it offers it) and the weight itself: under autocast no 16-bit copy of the
    weight waits for the backward."""

