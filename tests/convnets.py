"""Helpers for tests of convolutional networks. Not a test module: imported by those tests."""

import torch
from torch import nn


def trained_like(model: nn.Module, seed: int = 0) -> nn.Module:
    """Norm scales near but not 1, shifts near 0, running statistics off their defaults, as
    after training: a γ or β handled wrong shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            for name, low, high in (("weight", 0.8, 1.2), ("bias", -0.1, 0.1),
                                    ("running_var", 0.5, 1.5), ("running_mean", -0.2, 0.2)):
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() \
                        and not isinstance(m, nn.Linear):
                    t.copy_(torch.empty(t.shape).uniform_(low, high, generator=gen))
    return model
