"""MS activation: an MLP's activation that keeps only its input, y = act(x), for a backward
that also serves the layer reading y.

Eager GPT-2's gelu_new, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), is eight ops whose
autograd nodes keep x, tanh's output, 0.5·x and 1 + tanh, and the down projection keeps y:
five values per element. The MS activation keeps x alone and offers y to its reader as a
recipe from that x (`sharing`), so the down projection rebuilds y in its backward instead of
keeping it: one value. It computes eager's ops with eager's roundings, in one kernel each way
for 16-bit CUDA tensors (`templates/glu_ops.py.jinja`), eager's own ops elsewhere: the results
are eager's.
"""

from __future__ import annotations

import torch
from torch import nn

from actdesign.errors import ActdesignError

from .fake import on_host
from .glu import glu_ops
from .sharing import offer

# the transformers activation class whose eager ops the kernels reproduce
REPRODUCED = "NewGELUActivation"


class MSActivation(nn.Module):
    """gelu_new(x), keeping x only, its output offered to its reader as a recipe from x."""

    @classmethod
    def from_module(cls, m: nn.Module) -> MSActivation:
        """The MS activation computing what `m` computes; a probe checks it bit for bit."""
        if type(m).__name__ != REPRODUCED or not type(m).__module__.startswith("transformers"):
            raise ActdesignError(f"the MS activation reproduces transformers' {REPRODUCED} "
                                 "only")
        new = cls()
        _check_probe(m, new)
        return new

    def forward(self, x):
        return _MSActivation.apply(x)

    def extra_repr(self):
        return "act=gelu_new"


class _MSActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = glu_ops().activation(x)
        ctx.save_for_backward(x)
        offer(y, None, (x,), _rebuild)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative is refused, not wrong
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return glu_ops().activation_backward(x, dy)


def _rebuild(_, x, dtype):
    """y from the x the MS activation keeps: the offer's recipe."""
    return glu_ops().activation(x).to(dtype)


def _check_probe(m, new):
    """m's own forward against ours, bit for bit, on float32 and bfloat16 rows of the CPU (an
    activation holds no tensors to place; real ones also inside a shapes-only run)."""
    with on_host(), torch.no_grad():
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
        for dtype in (torch.float32, torch.bfloat16):
            if not torch.equal(new(x.to(dtype)), m(x.to(dtype))):
                raise ActdesignError("its forward is not the eager gelu_new it is named for")
