"""Pooled activations for the backward pass of convolutions (compressed backprop).

The forward is the exact convolution. For the weight gradient the layer keeps avg_pool(x, p),
1/p² of x, and expands it back (nearest) in the backward. The input gradient needs only the
weights and stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError


class _PooledConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, conv, p):
        stride, padding, dilation, groups = conv
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        pooled = F.avg_pool2d(x, p, ceil_mode=True) if p > 1 else x
        ctx.save_for_backward(pooled, weight)
        ctx.conv, ctx.p, ctx.shape, ctx.has_bias = conv, p, x.shape, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        pooled, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(ctx.shape, weight, g, stride, padding,
                                                dilation, groups)
        if ctx.needs_input_grad[1]:
            x = pooled
            if ctx.p > 1:  # nearest expansion, cropped where ceil_mode padded
                x = pooled.repeat_interleave(ctx.p, 2).repeat_interleave(ctx.p, 3)
                x = x[..., :ctx.shape[2], :ctx.shape[3]]
            grad_w = torch.nn.grad.conv2d_weight(x, weight.shape, g, stride, padding,
                                                 dilation, groups)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None


class PooledConv2d(nn.Conv2d):
    """nn.Conv2d whose weight gradient uses x average-pooled p×p: 1/p² of the saved bytes."""

    def __init__(self, *args, p: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(p, int) or p < 1:
            raise ActdesignError(f"pool size p must be an integer >= 1, got {p!r}")
        if self.padding_mode != "zeros":
            raise ActdesignError("PooledConv2d supports zero padding only")
        if isinstance(self.padding, str):
            raise ActdesignError("PooledConv2d needs numeric padding, not 'same'/'valid'")
        self.p = p

    @classmethod
    def from_module(cls, conv: nn.Conv2d, p: int = 2) -> PooledConv2d:
        """A PooledConv2d sharing conv's weight and bias."""
        if not isinstance(conv, nn.Conv2d):
            raise ActdesignError(f"from_module needs an nn.Conv2d, got {type(conv).__name__}")
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                  conv.padding, conv.dilation, conv.groups, conv.bias is not None,
                  conv.padding_mode, p=p, device="meta")
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def forward(self, x):
        if x.dim() != 4:
            raise ValueError(f"PooledConv2d expects (N, C, H, W) input, got {tuple(x.shape)}")
        conv = (self.stride, self.padding, self.dilation, self.groups)
        return _PooledConv.apply(x, self.weight, self.bias, conv, self.p)

    def extra_repr(self):
        return super().extra_repr() + f", p={self.p}"
