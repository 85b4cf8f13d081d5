"""Calibration for quantized layers: ActNN's gradient-variance weights C, then exact bits.

For every QLinear/QConv2d and sample n of the user's batches:

    C_{l,n} = (K_l / (4 g_l)) · (G / P_l) · Σ_j R_{l,n,j}² · ||∇y_{l,n}||²

with R the per-group ranges of the layer's input, K the kernel taps (1 for Linear), g the
conv groups and P the elements per sample divided by the input channels. The variance the
codes add to the weight gradient is Σ C / (2^b - 1)², so `allocate` minimises it under the
memory budget Σ w·b with w the elements per sample.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actdesign.designer.allocate import allocate, save_bits, save_stats
from actdesign.errors import ActdesignError

from .quantized import QConv2d, QLinear


def _layer_constants(layer, x):
    """(K/(4g))·(G/P) for this layer and input."""
    channels = x.shape[1] if isinstance(layer, QConv2d) else x.shape[-1]
    per_channel = math.prod(x.shape[1:]) / channels  # P
    if isinstance(layer, QConv2d):
        taps, groups = math.prod(layer.kernel_size), layer.groups
    else:
        taps, groups = 1, 1
    return taps / (4 * groups) * layer.group_size / per_channel


def _range_squares(x, group_size):
    """Σ_j R_j² per sample."""
    flat = x.detach().float().reshape(x.shape[0], -1)
    pad = -flat.shape[1] % group_size
    hi = F.pad(flat, (0, pad), value=float("-inf")).view(x.shape[0], -1, group_size).amax(-1)
    lo = F.pad(flat, (0, pad), value=float("inf")).view(x.shape[0], -1, group_size).amin(-1)
    return (hi - lo).square().sum(1)


def calibrate(model, batches, *, avg_bits: float = 2.0, per: str = "layer", loss=None,
              stats_path=None, bits_path=None) -> dict:
    """Run forward and backward once per batch, collect C, allocate bits exactly and set them
    on the model's QLinear/QConv2d layers. Returns {layer name: bits}.

    `batches` yields (inputs, target) pairs; `loss(model, batch)` overrides the default
    cross-entropy of model(inputs) against target. per="layer" gives each layer one bit width
    (for any later batch); per="sample" takes a single batch and gives each (layer, sample) its
    own, as ActNN does each step. The stats and the bits can be written as JSON.
    """
    if per not in ("layer", "sample"):
        raise ActdesignError(f"per must be 'layer' or 'sample', got {per!r}")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QLinear | QConv2d)}
    if not layers:
        raise ActdesignError("the model has no QLinear or QConv2d layers to calibrate")
    found = {name: [] for name in layers}  # per batch: C per sample
    sizes = {}
    pending = {}

    def forward_hook(name):
        def hook(module, inputs, output):
            (x,) = inputs
            sizes[name] = math.prod(x.shape[1:])
            pending[name] = _layer_constants(module, x) * _range_squares(x, module.group_size)

            def grad_hook(g):
                norms = g.detach().float().reshape(g.shape[0], -1).square().sum(1)
                found[name].append((pending.pop(name) * norms).double())
            output.register_hook(grad_hook)
        return hook

    handles = [m.register_forward_hook(forward_hook(name)) for name, m in layers.items()]
    count = 0
    try:
        for batch in batches:
            count += 1
            if per == "sample" and count > 1:
                raise ActdesignError("per-sample calibration takes exactly one batch")
            model.zero_grad(set_to_none=True)
            if loss is not None:
                value = loss(model, batch)
            else:
                inputs, target = batch
                value = F.cross_entropy(model(inputs), target)
            value.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if count == 0 or any(not v for v in found.values()):
        raise ActdesignError("calibration saw no batch reaching every quantized layer")

    if per == "layer":
        items = [(name, float(sum(c.sum() for c in found[name])), sizes[name])
                 for name in layers]
    else:
        items = [(f"{name}/{n}", float(c), sizes[name])
                 for name in layers for n, c in enumerate(found[name][0].tolist())]
    C = torch.tensor([c for _, c, _ in items], dtype=torch.float64).numpy()
    w = torch.tensor([s for _, _, s in items], dtype=torch.float64).numpy()
    result = allocate(C, w, avg_bits * float(w.sum()))
    if stats_path:
        save_stats(stats_path, items)
    bits = {}
    if per == "layer":
        for (name, _, _), b in zip(items, result.bits, strict=True):
            layers[name].bits = bits[name] = int(b)
    else:
        start = 0
        for name, layer in layers.items():
            n = found[name][0].numel()
            layer.bits = bits[name] = torch.as_tensor(result.bits[start:start + n],
                                                      dtype=torch.int8)
            start += n
    if bits_path:
        save_bits(bits_path, result, {name: b if isinstance(b, int) else b.tolist()
                                      for name, b in bits.items()}, avg_bits=avg_bits)
    return bits
