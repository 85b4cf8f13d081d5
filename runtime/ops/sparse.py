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

from actdesign.errors import ActdesignError

from .compressed import CompressedConv2d, CompressedLinear


def _bits(device) -> torch.Tensor:
    """Each bit's value in a byte (made where it is used: under a shape-only run too)."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as ceil(n/8) bytes, element i at bit i % 8 of byte i // 8."""
    flat = mask.reshape(-1)
    padded = F.pad(flat.to(torch.uint8), (0, -flat.numel() % 8)).view(-1, 8)
    return (padded * _bits(mask.device)).sum(1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = packed[:, None] & _bits(packed.device)
    return (bits != 0).view(-1)[:n]


class SparseCopy:
    """The kept part of x: a packed mask and the kept values, per sample."""

    def __init__(self, x: torch.Tensor, ratio: float, int8: bool):
        samples = x.shape[0]
        flat = x.detach().reshape(samples, -1)
        keep = max(1, math.ceil((1 - ratio) * flat.shape[1])) if flat.shape[1] else 0
        mask = torch.zeros(flat.shape, dtype=torch.bool, device=x.device)
        index = flat.abs().topk(keep, dim=1).indices.sort(dim=1).values if keep else \
            torch.zeros(samples, 0, dtype=torch.long, device=x.device)
        mask.scatter_(1, index, True)
        # row-major: each sample's kept values (a gather, not flat[mask]: the shapes are known
        # without the values, so a shape-only step can run it)
        values = flat.gather(1, index)
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


class _SparseInput:
    """What SparseLinear and SparseConv2d share: the ratio, the value format, the copy."""

    def _setup(self, ratio: float, int8: bool):
        if not 0 <= ratio < 1:
            raise ActdesignError(f"ratio must be in [0, 1), got {ratio!r}")
        self.ratio, self.int8 = float(ratio), bool(int8)

    def compress(self, x):
        return SparseCopy(x, self.ratio, self.int8).tensors()

    def restore(self, saved, shape, dtype):
        mask, values, *scale = saved
        return SparseCopy.dense(shape, dtype, mask, values, scale[0] if scale else None)

    def extra_repr(self):
        return super().extra_repr() + f", ratio={self.ratio}, int8={self.int8}"


class SparseLinear(_SparseInput, CompressedLinear):
    """nn.Linear whose weight gradient uses each sample's largest (1 - ratio) of |x|."""

    def __init__(self, in_features, out_features, bias=True, *, ratio=0.9, int8=False,
                 device=None, dtype=None):
        CompressedLinear.__init__(self, in_features, out_features, bias, device, dtype)
        self._setup(ratio, int8)


class SparseConv2d(_SparseInput, CompressedConv2d):
    """nn.Conv2d whose weight gradient uses each sample's largest (1 - ratio) of |x|."""

    def __init__(self, *args, ratio=0.9, int8=False, **kwargs):
        CompressedConv2d.__init__(self, *args, **kwargs)
        self._setup(ratio, int8)
