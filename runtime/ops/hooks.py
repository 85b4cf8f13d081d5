"""Module hooks that only look: accounting and tracing mark theirs, so that layers taking a
path of their own while their parts carry no hooks (the lean LoRA path, MS-GLU's down
projection) still take it while a step is measured."""

from __future__ import annotations

import torch


def observer(hook):
    """Mark a module hook as one that only looks (it changes nothing): layers that take a
    path of their own only while their parts carry no hooks (the lean LoRA path) ignore it."""
    hook.observes_only = True
    return hook


def hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook that may act (not an `observer`) is on the module: layers that
    compute a part they hold from its weight do so only while none is."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(not getattr(hook, "observes_only", False) for hook in hooks)
