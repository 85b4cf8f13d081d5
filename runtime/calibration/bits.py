"""Calibration for quantized layers: ActNN's gradient-variance weights C, then exact bits.

For every QLinear/QConv2d and sample n of the user's batches:

    C_{l,n} = (K_l / (4 g_l)) · (G / P_l) · Σ_j R_{l,n,j}² · ||∇y_{l,n}||²

with R the per-group ranges of the layer's input, K the kernel taps (1 for Linear), g the
conv groups and P the elements per sample divided by the input channels. The variance the
codes add to the weight gradient is Σ C / (2^b - 1)², so `allocate` minimises it under the
memory budget Σ w·b with w the elements per sample.

Layers keeping one tensor's codes (the readers of a coded MS norm, `QMSLayerNorm` or
`QMSRMSNorm`) are one item: one bit width for the norm and all its readers, C their sum, w
the tensor's elements once. Its name lists the readers, comma-separated; a bits file gives
each of them those bits. MS-GLU's codes of up(x) keep the rule's bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actdesign.designer.allocate import allocate, save_bits, save_stats
from actdesign.errors import ActdesignError

from ..models import batches as batch_forms
from ..ops.norms import _QMSNorm
from ..ops.quantized import QConv2d, QLinear
from ..ops.sharing import whole


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

    `batches` yields batches in any form of `models.batches`: a tensor, a dict of keyword
    inputs, a tuple of positional inputs or an (inputs, targets) pair; the loss is the
    cross-entropy against the targets, else the model's own. `loss(model, batch)` overrides
    it. per="layer" gives each layer one bit width
    (for any later batch); per="sample" takes a single batch and gives each (layer, sample) its
    own, as ActNN does each step. The stats and the bits can be written as JSON.
    """
    if per not in ("layer", "sample"):
        raise ActdesignError(f"per must be 'layer' or 'sample', got {per!r}")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QLinear | QConv2d)}
    if not layers:
        raise ActdesignError("the model has no QLinear or QConv2d layers to calibrate")
    norms = {name: m for name, m in model.named_modules() if isinstance(m, _QMSNorm)}
    found = {name: [] for name in layers}  # per batch: C per sample
    sizes = {}
    pending = {}
    made = {}  # id(output) -> (coded norm, output), this batch's
    source = {}  # layer -> the coded norm whose codes it keeps

    def norm_hook(name):
        def hook(module, inputs, output):
            made[id(output)] = name, output
        return hook

    def forward_hook(name):
        def hook(module, inputs, output):
            (x,) = inputs
            data = whole(x)
            norm, y = made.get(id(data), (None, None))
            if y is data and norms[norm].group_size == module.group_size:
                source[name] = norm  # it keeps the norm's codes once its bits are the norm's
            sizes[name] = math.prod(x.shape[1:])
            pending[name] = _layer_constants(module, x) * _range_squares(x, module.group_size)

            def grad_hook(g):
                grad_norms = g.detach().float().reshape(g.shape[0], -1).square().sum(1)
                found[name].append((pending.pop(name) * grad_norms).double())
            output.register_hook(grad_hook)
        return hook

    handles = [m.register_forward_hook(forward_hook(name)) for name, m in layers.items()]
    handles += [m.register_forward_hook(norm_hook(name)) for name, m in norms.items()]
    count = 0
    try:
        for batch in batch_forms.iterate(batches):
            count += 1
            if per == "sample" and count > 1:
                raise ActdesignError("per-sample calibration takes exactly one batch")
            model.zero_grad(set_to_none=True)
            value = (loss or batch_forms.loss)(model, batch)
            value.backward()
            made.clear()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if count == 0 or any(not v for v in found.values()):
        raise ActdesignError("calibration saw no batch reaching every quantized layer")

    groups = {}  # the layers of one item: those keeping one norm's codes, or one layer
    for name in layers:
        groups.setdefault(source.get(name, name), []).append(name)
    # C of each item, its layers' summed: one value (over all batches), or one per sample
    item_c = {key: sum(sum(c.sum() for c in found[name]) for name in group).reshape(1)
              if per == "layer" else sum(found[name][0] for name in group)
              for key, group in groups.items()}
    items = [(",".join(group) + (f"/{n}" if per == "sample" else ""), float(c), sizes[group[0]])
             for key, group in groups.items() for n, c in enumerate(item_c[key].tolist())]
    C = torch.tensor([c for _, c, _ in items], dtype=torch.float64).numpy()
    w = torch.tensor([s for _, _, s in items], dtype=torch.float64).numpy()
    result = allocate(C, w, avg_bits * float(w.sum()))
    if stats_path:
        save_stats(stats_path, items)
    bits, start = {}, 0
    for key, group in groups.items():
        n = item_c[key].numel()
        chosen = torch.as_tensor(result.bits[start:start + n], dtype=torch.int8)
        chosen = int(chosen) if per == "layer" else chosen
        start += n
        for m in [layers[name] for name in group] + ([norms[key]] if key in norms else []):
            m.bits = chosen
        bits.update(dict.fromkeys(group, chosen))
    if bits_path:
        save_bits(bits_path, result, {name: b if isinstance(b, int) else b.tolist()
                                      for name, b in bits.items()}, avg_bits=avg_bits)
    return bits
