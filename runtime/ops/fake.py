"""Shape-only runs: a model on fake tensors (torch's FakeTensorMode), as `estimate` runs one.

Fake tensors have shapes, dtypes and storage sizes but no values. On them the ops' kernels
are not launched (a generated module's backend is "fake": its Triton path's tensors are
allocated, or with the mode's `cpu_kernels` its CPU path's; nothing is computed); what must
stay real stays real: host-side bookkeeping (bit layouts, seeds) runs
`on_host`, and the checks `compress` makes by comparing numbers run on a real stand-in
(`real_copy`) of the modules they check.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


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
