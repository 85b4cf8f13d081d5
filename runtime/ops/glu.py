"""MS-GLU: a gated MLP, down(act(gate(x)) * up(x)), that keeps only g = gate(x) and u = up(x)
for its backward.

Eager PyTorch keeps g (for act), act(g) and u (for the product) and h = act(g)·u (for the
down projection's weight gradient): 4 values per intermediate element. MS-GLU recomputes
act(g) and h inside the backward, elementwise, so the down projection borrows its input from
the GLU's own saved tensors: 2 values, 4 bytes in bf16. The projections' inputs and outputs
are the eager ones, with eager's roundings: the results equal the eager module's.

The three Linear layers keep their names and parameters as LeanLinear layers: no 16-bit
weight copy under autocast; the down projection's weight is cast again in the backward.
PEFT LoRA layers on them stay as they are (compress gives them the lean LoRA path).

The down projection is computed inside MS-GLU's own function only while it is a plain
LeanLinear. Anything else there (a LoRA layer, one PEFT wrapped after compress, a module
with hooks) is called as a module on h, and h is offered to it as a recipe from the g and u
MS-GLU keeps (`sharing`): it keeps no h of its own, and whatever wraps it runs.

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
from .compressed import LeanLinear, autocast_casts, autocast_off
from .draws import same_draws
from .fake import any_fake, on_host, real_copy
from .hooks import hooked
from .known_modules import activation_name, is_gated_mlp, is_lora_linear
from .quantized import QLinear, _QuantizedInput
from .sharing import offer
from .tiles import tile_rows, tiled

ACTIVATIONS = ("silu", "gelu_tanh")


def glu_ops():
    """The generated MS-GLU module (Triton kernels, torch path, custom ops), imported once."""
    return generated(render_glu)


class MSGLU(_QuantizedInput, nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), keeping only gate(x) and up(x), or gate(x)
    and codes of up(x) (`codes`: bits and group size). With `input_codes`, gate_proj and
    up_proj keep codes of x (an MS norm's, where it made them). With `tile` ("auto" or a
    number of tokens), it runs in sequence tiles (`tiles`): it keeps x alone, and one tile's
    intermediates are alive at a time."""

    tile = None  # tokens per tile, "auto" or None (untiled)

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                 act: str, *, codes=None, input_codes=None, tile=None):
        nn.Module.__init__(self)
        if not (tile is None or tile == "auto" or (type(tile) is int and tile > 0)):
            raise ActdesignError(f"tile must be None, 'auto' or a positive int, not {tile!r}")
        if act not in ACTIVATIONS:
            raise ActdesignError(f"MS-GLU supports {' and '.join(ACTIVATIONS)}, not {act}")
        bits, group_size = codes or (None, 256)
        self._setup(bits, group_size)  # bits None: u kept as it is
        self.input_codes = input_codes
        if input_codes is None:
            self.gate_proj, self.up_proj = map(_lean, (gate_proj, up_proj))
        else:
            b, g = input_codes
            self.gate_proj, self.up_proj = (
                m if is_lora_linear(m) else QLinear.from_module(m, bits=b, group_size=g)
                for m in (gate_proj, up_proj))
        self.down_proj = _lean(down_proj)
        self.act, self.tile = act, tile

    @classmethod
    def from_module(cls, mlp: nn.Module, **options) -> MSGLU:
        """The MS-GLU computing what `mlp` computes, sharing its parameters. `mlp` must have
        Linear layers gate_proj, up_proj and down_proj and an act_fn that is SiLU or
        tanh-GELU, and compute down_proj(act_fn(gate_proj(x)) * up_proj(x)), which a probe
        on random inputs checks. `options` go to the constructor."""
        layers = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not is_gated_mlp(mlp):
            raise ActdesignError("a gated MLP needs nn.Linear gate_proj, up_proj and down_proj "
                                 "(or PEFT LoRA layers on them)")
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
        rows = tile_rows(self.tile, x.numel() // max(1, x.shape[-1]), x.shape[-1])
        return self.untiled(x) if rows is None else tiled(self.untiled, x, self, rows)

    def untiled(self, x):
        """The gated MLP on all of x at once."""
        down = self.down_proj
        g, u = self.gate_proj(x), self.up_proj(x)
        codes = None if self.bits is None else self
        if type(down) is not LeanLinear or hooked(down):
            return down(_GLUProduct.apply(g, u, self.act, codes))  # a module call: it runs
        weight = down.weight
        dtype, (bias,) = autocast_casts(weight, down.bias)
        with autocast_off(g.device.type):
            return _GLUDown.apply(g, u, weight, bias, self.act, dtype or weight.dtype, codes)

    def extra_repr(self):
        codes = "" if self.bits is None else f", up(x) as {self.bits}-bit codes, group_size=" \
                                              f"{self.group_size}"
        tile = "" if self.tile is None else f", tile={self.tile}"
        return f"act={self.act}{codes}{tile}"


def _lean(layer):
    """A projection as MS-GLU holds it: a Linear as a LeanLinear, a LoRA layer as it is."""
    return layer if is_lora_linear(layer) else LeanLinear.from_module(layer)


# On fake tensors the check runs on a real copy, at full width: once per kind of MLP.
_CHECKED_ON_COPIES = set()


def _check_probe(mlp, new, gate):
    """The module's own forward against down(act(gate(x)) * up(x)) on random rows."""
    if any_fake(mlp):
        key = (type(mlp), new.act, *((n, p.shape, p.dtype) for n, p in mlp.named_parameters()))
        if key not in _CHECKED_ON_COPIES:
            with on_host():
                real, real_new = real_copy(mlp, new)
                _check_probe(real, real_new, real.gate_proj)
                del real, real_new
            _CHECKED_ON_COPIES.add(key)
        return
    weight = next(p for p in gate.parameters() if p.is_floating_point())  # not a 4-bit one
    x = torch.randn(4, gate.in_features, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():  # the same dropout masks (a LoRA layer's) in both
        expected, got = same_draws(mlp, lambda: mlp(x), lambda: new(x))
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
        u = _restore(ctx.codes, kept, g.shape, ctx.u_dtype)
        grad2 = grad.reshape(-1, grad.shape[-1])
        with autocast_off(grad.device.type):
            w = weight.to(ctx.dtype)
            dh = (grad2 @ w).view(g.shape)
            dg, du, h = glu_ops().elementwise_backward(g, u, dh, ctx.act)
            grad_w = (grad2.T @ h.reshape(-1, h.shape[-1])).to(weight.dtype) \
                if ctx.needs_input_grad[2] else None
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dg, du, grad_w, grad_b, None, None, None


class _GLUProduct(torch.autograd.Function):
    """h = act(g) * u, keeping g and u (or `codes`' compressed u), and offering h to its
    reader as a recipe from them."""

    @staticmethod
    def forward(ctx, g, u, act, codes):
        h = glu_ops().elementwise(g, u, act)
        kept = (u,) if codes is None else codes.compress(u)
        ctx.save_for_backward(g, *kept)
        ctx.act, ctx.codes, ctx.u_dtype = act, codes, u.dtype
        offer(h, None, (g, *kept), _Product(act, codes, u.shape, u.dtype))
        return h

    @staticmethod
    def backward(ctx, dh):
        g, *kept = ctx.saved_tensors
        u = _restore(ctx.codes, kept, g.shape, ctx.u_dtype)
        dg, du, _ = glu_ops().elementwise_backward(g, u, dh, ctx.act)
        return dg, du, None, None


class _Product:
    """h from g and what MS-GLU keeps of u: the offer's recipe (holds no tensors)."""

    def __init__(self, act, codes, shape, u_dtype):
        self.act, self.codes, self.shape, self.u_dtype = act, codes, shape, u_dtype

    def __call__(self, _, g, *kept, dtype):
        u = _restore(self.codes, kept, self.shape, self.u_dtype)
        return glu_ops().elementwise(g, u, self.act).to(dtype)


def _restore(codes, kept, shape, dtype):
    return kept[0] if codes is None else codes.restore(kept, shape, dtype)
