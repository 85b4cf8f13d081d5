"""Sparse saved inputs (Back Razor): Linear and Conv2d layers whose weight gradient uses, per
sample, only the largest (1 - ratio) fraction of |x|.

The forward is dense and exact. For the backward the layer keeps a packed 1-bit mask
(n/8 bytes) and the kept values, in the input dtype or as 8-bit codes with one float32 scale
per sample. The input gradient needs only the weights and stays exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as ceil(n/8) bytes, element i at bit i % 8 of byte i // 8."""
    flat = mask.reshape(-1)
    padded = F.pad(flat.to(torch.uint8), (0, -flat.numel() % 8)).view(-1, 8)
    return (padded * _BITS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = packed[:, None] & _BITS.to(packed.device)
    return (bits != 0).view(-1)[:n]


class SparseCopy:
    """The kept part of x: a packed mask and the kept values, per sample."""

    def __init__(self, x: torch.Tensor, ratio: float, int8: bool):
        samples = x.shape[0]
        flat = x.detach().reshape(samples, -1)
        keep = max(1, math.ceil((1 - ratio) * flat.shape[1])) if flat.shape[1] else 0
        mask = torch.zeros(flat.shape, dtype=torch.bool, device=x.device)
        if keep:
            mask.scatter_(1, flat.abs().topk(keep, dim=1).indices, True)
        values = flat[mask].view(samples, keep)  # row-major: each sample's kept values
        self.shape, self.dtype, self.int8 = x.shape, x.dtype, int8
        self.mask = pack_mask(mask)
        if int8:  # symmetric 8-bit, one scale per sample
            self.scale = values.abs().amax(1, keepdim=True).float().clamp_min(1e-30) / 127
            self.values = torch.round(values.float() / self.scale).to(torch.int8)
        else:
            self.scale, self.values = None, values.clone()

    def tensors(self):
        return (self.mask, self.values) + ((self.scale,) if self.int8 else ())

    @staticmethod
    def dense(shape, dtype, mask, values, scale):
        """The densified copy: kept values in place, zeros elsewhere."""
        n = math.prod(shape)
        out = torch.zeros(n, dtype=dtype, device=values.device)
        kept = values.float() * scale if scale is not None else values
        out[unpack_mask(mask, n)] = kept.reshape(-1).to(dtype)
        return out.view(shape)


class _SparseLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        y = layer.dense_forward(x, weight, bias)
        copy = SparseCopy(x, layer.ratio, layer.int8)
        ctx.save_for_backward(weight, *copy.tensors())
        ctx.layer, ctx.shape, ctx.dtype, ctx.has_bias = layer, x.shape, x.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        weight, mask, values, *scale = ctx.saved_tensors
        layer = ctx.layer
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = layer.input_grad(ctx.shape, weight, g)
        if ctx.needs_input_grad[1]:
            x = SparseCopy.dense(ctx.shape, ctx.dtype, mask, values, scale[0] if scale else None)
            grad_w = layer.weight_grad(x, weight, g)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(tuple(i for i in range(g.dim()) if i != layer.channel_dim(g)))
        return grad_x, grad_w, grad_b, None


class _Sparse:
    """What SparseLinear and SparseConv2d share: the ratio, the value format, from_module."""

    def _setup(self, ratio: float, int8: bool):
        if not 0 <= ratio < 1:
            raise ActdesignError(f"ratio must be in [0, 1), got {ratio!r}")
        self.ratio, self.int8 = float(ratio), bool(int8)

    def forward(self, x):
        return _SparseLayer.apply(x, self.weight, self.bias, self)

    def extra_repr(self):
        return super().extra_repr() + f", ratio={self.ratio}, int8={self.int8}"


class SparseLinear(_Sparse, nn.Linear):
    """nn.Linear whose weight gradient uses each sample's largest (1 - ratio) of |x|."""

    def __init__(self, in_features, out_features, bias=True, *, ratio=0.9, int8=False,
                 device=None, dtype=None):
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self._setup(ratio, int8)

    @classmethod
    def from_module(cls, linear: nn.Linear, ratio=0.9, int8=False) -> SparseLinear:
        if not isinstance(linear, nn.Linear):
            raise ActdesignError(f"from_module needs an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, ratio=ratio,
                  int8=int8, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    @staticmethod
    def dense_forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def input_grad(shape, weight, g):
        return g @ weight

    @staticmethod
    def weight_grad(x, weight, g):
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])

    @staticmethod
    def channel_dim(g):
        return g.dim() - 1


class SparseConv2d(_Sparse, nn.Conv2d):
    """nn.Conv2d whose weight gradient uses each sample's largest (1 - ratio) of |x|."""

    def __init__(self, *args, ratio=0.9, int8=False, **kwargs):
        nn.Conv2d.__init__(self, *args, **kwargs)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise ActdesignError("SparseConv2d supports numeric zero padding only")
        self._setup(ratio, int8)

    @classmethod
    def from_module(cls, conv: nn.Conv2d, ratio=0.9, int8=False) -> SparseConv2d:
        if not isinstance(conv, nn.Conv2d):
            raise ActdesignError(f"from_module needs an nn.Conv2d, got {type(conv).__name__}")
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                  conv.padding, conv.dilation, conv.groups, conv.bias is not None,
                  conv.padding_mode, ratio=ratio, int8=int8, device="meta")
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def dense_forward(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def input_grad(self, shape, weight, g):
        return torch.nn.grad.conv2d_input(shape, weight, g, self.stride, self.padding,
                                          self.dilation, self.groups)

    def weight_grad(self, x, weight, g):
        return torch.nn.grad.conv2d_weight(x, weight.shape, g, self.stride, self.padding,
                                           self.dilation, self.groups)

    @staticmethod
    def channel_dim(g):
        return 1
