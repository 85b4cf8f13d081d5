"""MS-GLU: a gated MLP, down(act(gate(x)) * up(x)), that keeps only g = gate(x) and u = up(x)
for its backward.

Eager PyTorch keeps g (for act), act(g) and u (for the product) and h = act(g)·u (for the
down projection's weight gradient): 4 values per intermediate element. MS-GLU recomputes
act(g) and h inside the backward, elementwise, so the down projection borrows its input from
the GLU's own saved tensors: 2 values, 4 bytes in bf16. The projections' inputs and outputs
are the eager ones, with eager's roundings: the results equal the eager module's.

The three Linear layers keep their names and parameters as LeanLinear layers: no 16-bit
weight copy under autocast; the down projection's weight is cast again in the backward.

For ActNN policies MS-GLU can keep u as b-bit codes (`codes`): the backward then uses the
unbiased û in h = act(g)·û, which only the down projection's weight gradient reads (ActNN's
own noise on that layer), and in dg = dh·û·act'(g), which stays unbiased because g is
exact but carries û's noise elementwise into the input gradient (compress gives these
codes two bits more than ActNN's); du = dh·act(g) is exact. With `input_codes`, gate_proj
and up_proj are QLinear, keeping the codes of x that an MS norm before them made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actdesign.codegen.render import render_glu
from actdesign.errors import ActdesignError

from .cache import generated
from .compressed import LeanLinear, autocast_casts
from .quantized import QLinear, _QuantizedInput
from .targets import activation_name

ACTIVATIONS = ("silu", "gelu_tanh")


def glu_ops():
    """The generated MS-GLU module (Triton kernels, torch path, custom ops), imported once."""
    return generated(render_glu)


class MSGLU(_QuantizedInput, nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), keeping only gate(x) and up(x), or gate(x)
    and codes of up(x) (`codes`: bits and group size). With `input_codes`, gate_proj and
    up_proj keep codes of x (an MS norm's, where it made them)."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                 act: str, *, codes=None, input_codes=None):
        nn.Module.__init__(self)
        if act not in ACTIVATIONS:
            raise ActdesignError(f"MS-GLU supports {' and '.join(ACTIVATIONS)}, not {act}")
        bits, group_size = codes or (None, 256)
        self._setup(bits, group_size)  # bits None: u kept as it is
        self.input_codes = input_codes
        if input_codes is None:
            self.gate_proj, self.up_proj = map(LeanLinear.from_module, (gate_proj, up_proj))
        else:
            b, g = input_codes
            self.gate_proj, self.up_proj = (QLinear.from_module(m, bits=b, group_size=g)
                                            for m in (gate_proj, up_proj))
        self.down_proj = LeanLinear.from_module(down_proj)  # its weight is read below
        self.act = act

    @classmethod
    def from_module(cls, mlp: nn.Module, **options) -> MSGLU:
        """The MS-GLU computing what `mlp` computes, sharing its parameters. `mlp` must have
        Linear layers gate_proj, up_proj and down_proj and an act_fn that is SiLU or
        tanh-GELU, and compute down_proj(act_fn(gate_proj(x)) * up_proj(x)), which a probe
        on random inputs checks. `options` go to the constructor."""
        layers = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is nn.Linear for m in layers):
            raise ActdesignError("a gated MLP needs nn.Linear gate_proj, up_proj and down_proj")
        gate, up, down = layers
        if not (gate.in_features == up.in_features == down.out_features
                and gate.out_features == up.out_features == down.in_features):
            raise ActdesignError("gate_proj, up_proj and down_proj have shapes that do not "
                                 "form down(act(gate(x)) * up(x))")
        act_fn = getattr(mlp, "act_fn", None)
        act = activation_name(act_fn) if isinstance(act_fn, nn.Module) else None
        if act not in ACTIVATIONS:
            raise ActdesignError(f"its act_fn is {type(act_fn).__name__}, not SiLU or "
                                 "tanh-GELU")
        new = cls(gate, up, down, act, **options)
        _check_probe(mlp, new, gate)
        return new

    def forward(self, x):
        down = self.down_proj
        # The down projection runs inside the GLU's own function, from its weight: a module
        # wrapping it later (a PEFT adapter) would silently not run. Refuse instead.
        if type(down) is not LeanLinear:
            raise ActdesignError(f"MS-GLU's down_proj is a {type(down).__name__}: it was "
                                 "wrapped after compress, and MS-GLU computes it from its "
                                 "weight; wrap the model first (get_peft_model), then compress")
        g, u = self.gate_proj(x), self.up_proj(x)
        weight = down.weight
        dtype, (bias,) = autocast_casts(weight, down.bias)
        with torch.autocast(g.device.type, enabled=False):
            return _GLUDown.apply(g, u, weight, bias, self.act, dtype or weight.dtype,
                                  None if self.bits is None else self)

    def extra_repr(self):
        codes = "" if self.bits is None else f", up(x) as {self.bits}-bit codes, group_size=" \
                                              f"{self.group_size}"
        return f"act={self.act}{codes}"


def _check_probe(mlp, new, gate):
    """The module's own forward against down(act(gate(x)) * up(x)) on random rows."""
    x = torch.randn(4, gate.in_features, dtype=gate.weight.dtype, device=gate.weight.device)
    with torch.no_grad():
        expected, got = mlp(x), new(x)
    scale = expected.abs().max().item() + 1e-30
    if not torch.allclose(got, expected, rtol=0,
                          atol=16 * torch.finfo(expected.dtype).eps * scale):
        raise ActdesignError("its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))")


class _GLUDown(torch.autograd.Function):
    """down(act(g) * u) keeping g, u (or `codes`' compressed u) and the down weight itself;
    h is recomputed."""

    @staticmethod
    def forward(ctx, g, u, weight, bias, act, dtype, codes):
        h = glu_ops().elementwise(g, u, act)
        y = F.linear(h.reshape(-1, h.shape[-1]), weight.to(dtype), bias)
        ctx.save_for_backward(g, weight, *((u,) if codes is None else codes.compress(u)))
        ctx.act, ctx.dtype, ctx.has_bias, ctx.codes = act, dtype, bias is not None, codes
        ctx.u_dtype = u.dtype
        return torch.ops.aten._unsafe_view(y, (*h.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad):
        g, weight, *kept = ctx.saved_tensors
        u = kept[0] if ctx.codes is None else ctx.codes.restore(kept, g.shape, ctx.u_dtype)
        grad2 = grad.reshape(-1, grad.shape[-1])
        with torch.autocast(grad.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            dh = (grad2 @ w).view(g.shape)
            dg, du, h = glu_ops().elementwise_backward(g, u, dh, ctx.act)
            grad_w = (grad2.T @ h.reshape(-1, h.shape[-1])).to(weight.dtype) \
                if ctx.needs_input_grad[2] else None
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dg, du, grad_w, grad_b, None, None, None
