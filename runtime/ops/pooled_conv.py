"""Pooled activations for the backward pass of convolutions (compressed backprop).

The forward is the exact convolution. For the weight gradient the layer keeps avg_pool(x, p),
1/p² of x, and expands it back (nearest) in the backward. The input gradient needs only the
weights and stays exact.
"""

from __future__ import annotations

import torch.nn.functional as F

from actdesign.errors import ActdesignError

from .compressed import CompressedConv2d


class PooledConv2d(CompressedConv2d):
    """nn.Conv2d whose weight gradient uses x average-pooled p×p: 1/p² of the saved bytes."""

    def __init__(self, *args, p: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(p, int) or p < 1:
            raise ActdesignError(f"pool size p must be an integer >= 1, got {p!r}")
        self.p = p

    def compress(self, x):
        return (F.avg_pool2d(x, self.p, ceil_mode=True) if self.p > 1 else x,)

    def restore(self, saved, shape, dtype):
        (pooled,) = saved
        if self.p == 1:
            return pooled
        full = pooled.repeat_interleave(self.p, 2).repeat_interleave(self.p, 3)
        return full[..., :shape[2], :shape[3]]  # ceil_mode pooled past the edge

    def extra_repr(self):
        return super().extra_repr() + f", p={self.p}"
