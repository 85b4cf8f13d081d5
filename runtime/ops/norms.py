"""Memory-sharing norms (MS-BP) as modules that keep their parameters.

An MS norm computes y = x̂·γ + β, x̂ the normalised input, rounded as the norm it replaces
rounds, and keeps for its backward one rstd per row and one tensor the size of x, never x:
- in float32 (and where the norm rounds x̂ to y's dtype before the gain, as LLaMA's does in
  bf16), x̂ itself. The layers reading y (LeanLinear, QLinear, MS-GLU's projections, the fused
  loss) keep a reference to that same x̂ and rebuild y in their backward, bit for bit.
- where y is rounded to 16 bits from a float32 x̂·γ + β (under autocast, say), y itself, the
  very tensor its readers keep; the backward reads x̂ back from it. A 16-bit x̂ would make
  the forward round twice, a gain error the same in every step: a bias eager does not have.
Either way one copy serves the block. γ and β stay the norm's own parameters, under their own
names: the state dict, the optimizer and the training run are the untouched model's. Under
autocast the norm emits y in the autocast dtype, the dtype its readers compute in, so no cast
makes a second copy, and y's bits are those eager's readers compute from.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from actdesign.codegen.render import render_norms
from actdesign.errors import ActdesignError

from .cache import generated
from .fake import any_fake, is_fake, on_host, real_copy
from .quantized import _QuantizedInput
from .sharing import offer_affine


def norm_ops():
    """The generated MS-norm module (kernels and ops), rendered and imported once."""
    return generated(render_norms)


class _MSNorm(nn.Module):
    """y = x̂·γ + β over the last dimension; γ is `weight` (or 1 + `weight` with
    `unit_offset`, as Gemma's norms compute), 1 without one; β is `bias`, 0 without one."""

    kind = ""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, weight=None, bias=None,
                 unit_offset: bool = False, round_input: bool = False, native: bool = False):
        super().__init__()
        if isinstance(normalized_shape, tuple | list):
            if len(normalized_shape) != 1:
                raise ValueError("MS norms normalise over the last dimension only")
            (normalized_shape,) = normalized_shape
        self.normalized_shape = int(normalized_shape)
        self.eps = float(eps)
        self.register_parameter("weight", weight)  # the original's own, or None
        self.register_parameter("bias", bias)
        self.unit_offset = unit_offset
        self.round_input = round_input  # x̂ rounded to x's dtype before the gain (LLaMA's)
        self.native = native  # torch's layer norm, whose own kernel gives y its bits on CPU
        self._apart = None  # (parameters' versions, the channels y cannot give x̂ back for)

    @classmethod
    def from_norm(cls, norm: nn.Module) -> _MSNorm:
        """The MS norm computing what `norm` computes (an nn.LayerNorm, nn.RMSNorm, or another
        library's layer or RMS norm, found by a probe), holding the same parameters under the
        same names. Refused with the reason for anything else."""
        kind, d, eps, options = _affine(norm)
        return (MSLayerNorm if kind == "layer" else MSRMSNorm)(d, eps, **options)

    def gamma(self):
        """γ as a tensor, or None for 1. 1 + w is formed in float32 at least, as Gemma does."""
        if self.weight is None or not self.unit_offset:
            return self.weight
        return 1.0 + self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.normalized_shape,):
            raise ValueError(f"{type(self).__name__}({self.normalized_shape}) got an input of "
                             f"shape {tuple(x.shape)}")
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else x.dtype
        return self._normalize(x, out_dtype, self.gamma(), self.bias)

    def _normalize(self, x, out_dtype, gamma, bias):
        def offered(y, xhat):
            offer_affine(y, xhat, gamma, bias)

        ops = norm_ops()
        affine = gamma is not None or bias is not None
        apart = None  # (under torch.compile, which keeps what it chooses, not needed)
        if ops.keeps_output(x.dtype, out_dtype, gamma, bias, self.round_input) \
                and not torch.compiler.is_compiling():
            apart = self._channels_apart(ops, gamma, bias, out_dtype)
        return ops.apply(self.kind, x, self.eps, out_dtype, gamma, bias,
                         on_output=offered if affine else None, round_input=self.round_input,
                         apart=apart, native=self.native)

    def _channels_apart(self, ops, gamma, bias, out_dtype):
        """`channels_apart`, found again only when γ or β changed (it reads them on the host)."""
        key = (out_dtype, gamma.device if gamma is not None else bias.device) + tuple(
            None if p is None else (p._version, 0 if is_fake(p) else p.data_ptr())
            for p in (self.weight, self.bias))
        if self._apart is None or self._apart[0] != key:
            self._apart = key, ops.channels_apart(gamma, bias, out_dtype)
        return self._apart[1]

    def extra_repr(self) -> str:
        affine = "" if self.weight is None else \
            ", γ = 1 + weight" if self.unit_offset else ", γ = weight"
        return f"{self.normalized_shape}, eps={self.eps}{affine}" + \
            (", β = bias" if self.bias is not None else "") + \
            (", x̂ rounded to x's dtype first" if self.round_input else "")


class MSLayerNorm(_MSNorm):
    """(x - mean) / sqrt(var + eps)·γ + β over the last dimension; keeps rstd and x̂ (or y)."""

    kind = "layer"


class MSRMSNorm(_MSNorm):
    """x / sqrt(mean(x²) + eps)·γ over the last dimension; keeps rstd and x̂ (or y)."""

    kind = "rms"


def ms_norm(norm: nn.Module) -> _MSNorm:
    """The MS norm for `norm`, sharing its parameters: see `_MSNorm.from_norm`."""
    return _MSNorm.from_norm(norm)


class _QMSNorm(_QuantizedInput, _MSNorm):
    """An MS norm keeping b-bit ActNN codes of x̂ in place of x̂ (lossy: ActNN policies).

    The QLinear layers reading y keep the same codes (see `_QuantizedInput.share`) and rebuild
    ŷ = affine(x̂̂) from them, so the block keeps b bits per element, not 16 or 32. The
    backward runs the MS-BP formula on the dequantized x̂̂, which is unbiased, and dγ = Σ g·x̂̂
    is unbiased too. The noise reaches the input gradient through the projection term
    x̂̂·mean(h·x̂̂) only (h = γ·g): a row mean, about 1/sqrt(d) of h where h and x̂ are
    uncorrelated. That term's diagonal x̂̂_i·h_i·x̂̂_i/d has the mean (x̂_i² + Var x̂̂_i)·h_i/d,
    so E[dx_i] = dx_i - rstd·h_i·Var(x̂̂_i)/d: a shrink by Var(x̂̂_i)/d, which no function of
    the codes can undo."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, bits=2, group_size=256,
                 **affine):
        _MSNorm.__init__(self, normalized_shape, eps, **affine)
        self._setup(bits, group_size)

    @staticmethod
    def from_norm(norm: _MSNorm, *, bits=2, group_size=256) -> _QMSNorm:
        """The MS norm `norm` computes, with its parameters, keeping b-bit codes of x̂."""
        cls = QMSLayerNorm if norm.kind == "layer" else QMSRMSNorm
        return cls(norm.normalized_shape, norm.eps, bits=bits, group_size=group_size,
                   weight=norm.weight, bias=norm.bias, unit_offset=norm.unit_offset,
                   round_input=norm.round_input, native=norm.native)

    def _normalize(self, x, out_dtype, gamma, bias):
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (x, gamma, bias)):
            return _KeepingCodes.apply(x, gamma, bias, self, out_dtype)
        return super()._normalize(x, out_dtype, gamma, bias)  # nothing to keep codes for


class QMSLayerNorm(_QMSNorm, MSLayerNorm):
    """MSLayerNorm keeping b-bit codes of x̂."""


class QMSRMSNorm(_QMSNorm, MSRMSNorm):
    """MSRMSNorm keeping b-bit codes of x̂."""


class _KeepingCodes(torch.autograd.Function):
    """An MS norm whose backward reads rstd and the codes of x̂; x̂ carries the codes to the
    readers of y, and y tells them of x̂."""

    @staticmethod
    def forward(ctx, x, gamma, bias, norm, out_dtype):
        ops = norm_ops()
        xhat, rstd = ops.IMPLS[norm.kind][0](x, norm.eps, out_dtype)
        codes = norm.compress(xhat)
        norm.share(xhat, codes)
        y = xhat
        if gamma is not None or bias is not None:
            y = ops.affine(xhat, gamma, bias, out_dtype)
            offer_affine(y, xhat, gamma, bias)
        ctx.save_for_backward(rstd, gamma, *codes)
        ctx.norm, ctx.shape, ctx.dtype, ctx.input_dtype = norm, y.shape, y.dtype, x.dtype
        ctx.param_dtypes = tuple(None if t is None else t.dtype for t in (gamma, bias))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        rstd, gamma, *codes = ctx.saved_tensors
        xhat = ctx.norm.restore(codes, ctx.shape, ctx.dtype)
        want = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ops = norm_ops()
        dx, sums = ops.backward_impl(ctx.norm.kind, xhat, rstd, grad_y, gamma, want,
                                     ctx.input_dtype)
        return dx, *ops.param_grads(sums, ctx.param_dtypes, ctx.needs_input_grad[1:3]), None, None


def _affine(norm: nn.Module):
    """(kind, features, eps, the MS norm's keywords: weight and bias (or None), unit_offset
    (γ = 1 + weight), round_input (x̂ rounded to x's dtype before the gain), native (torch's
    layer norm kernel gives its bits)) of a supported norm: torch's own by their attributes,
    any other by what it computes."""
    if type(norm) in (nn.LayerNorm, nn.RMSNorm):
        shape, weight = tuple(norm.normalized_shape), norm.weight
        eps = norm.eps
        if eps is None:  # nn.RMSNorm's default: the eps of the dtype it computes in
            dtype = weight.dtype if weight is not None else torch.float32
            eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
        kind = "layer" if type(norm) is nn.LayerNorm else "rms"
        if len(shape) != 1:
            raise ActdesignError("MS norms normalise over the last dimension only")
        return kind, shape[0], float(eps), dict(weight=weight, bias=getattr(norm, "bias", None),
                                                native=kind == "layer")
    if type(norm).__module__.startswith("torch."):  # batch, group, instance norms
        raise ActdesignError(f"no MS norm computes a {type(norm).__name__}: supported are "
                             "layer and RMS norms over the last dimension")
    return _probe_formula(norm)


# eps values tried where a norm names none (OLMo's LayerNorm, say): common choices
_EPS = (1e-5, 1e-6, 1e-12, 1e-8, float(torch.finfo(torch.float32).eps))


def _probe_formula(norm: nn.Module):
    """`_affine` of another library's norm, found by what it computes on a probe: y = x̂·γ + β
    over the last dimension, x̂ normalised as a layer norm (x - mean) or an RMS norm does,
    γ its weight, 1 + its weight (Gemma, Nemotron) or 1 (no weight), β its bias or 0 (no
    bias), eps its own or a common value. The probe's copy holds random parameters, so a
    parameter the norm does not use, or uses otherwise, shows. Anything else, a gated norm
    among them, is refused with the reason."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    for what, p in (("weight", weight), ("bias", bias)):
        if p is not None and not isinstance(p, nn.Parameter):
            raise ActdesignError(f"its {what} is not a parameter, which an MS norm needs")
    shape = tuple(weight.shape) if weight is not None else getattr(norm, "normalized_shape", ())
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1 or (bias is not None and tuple(bias.shape) != shape):
        raise ActdesignError("MS norms normalise over the last dimension only, with one γ and "
                             "β per feature")
    d = shape[0]
    named = [float(v) for v in (getattr(norm, k, None) for k in ("eps", "variance_epsilon"))
             if isinstance(v, float | int) and not isinstance(v, bool)]
    candidates = list(dict.fromkeys(named + list(_EPS)))
    with on_host():  # the probe is real, also for a norm on fake tensors
        return _probe_values(norm, d, candidates, weight, bias)


def _probe_values(norm, d, candidates, weight, bias):
    gen = torch.Generator().manual_seed(0)
    # rows whose variance and mean square are about each eps tried, so eps shows; an offset,
    # so the mean does
    x = torch.randn(len(candidates) + 2, d, generator=gen, dtype=torch.float64) + 0.5
    x[2:] *= torch.tensor(candidates, dtype=torch.float64).sqrt()[:, None]
    probe = _float32_copy(norm)
    with torch.no_grad():
        w, b = (getattr(probe, k, None) for k in ("weight", "bias"))
        w, b = (None if t is None else t.detach() for t in (w, b))
        if w is not None:
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
        if b is not None:
            b.copy_(torch.rand(b.shape, generator=gen) - 0.5)
        try:
            got = probe(x.float())
        except Exception as exc:  # noqa: BLE001  (any failure means: not a norm we know)
            raise ActdesignError(f"its forward does not take one tensor x "
                                 f"({type(exc).__name__}: {exc})") from None
        gates = [k for k in _extra_inputs(norm) if _changes(probe, x.float(), got, k, gen)]
    if gates:
        raise ActdesignError(f"its forward takes {', '.join(map(repr, gates))} besides the "
                             "input, which changes its output: a gated norm, which no MS norm "
                             "computes")
    if isinstance(got, torch.Tensor) and got.shape == x.shape:
        got = got.double()
        gammas = [(None, False)] if w is None else [(w.double(), False), (1 + w.double(), True)]
        for kind in ("rms", "layer"):
            for eps in candidates:
                xhat = _normalized(x, kind, eps)
                for gamma, unit_offset in gammas:
                    want = xhat if gamma is None else xhat * gamma
                    want = want if b is None else want + b.double()
                    # float32 math: a few roundings of 2^-24 each; another formula misses by
                    # far more
                    if torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                        return kind, d, eps, dict(
                            weight=weight, bias=bias, unit_offset=unit_offset,
                            round_input=_rounds_input(norm, x.float(), kind, eps, unit_offset),
                            native=kind == "layer" and not unit_offset and torch.equal(
                                got.float(), F.layer_norm(x.float(), (d,), w, b, eps)))
    raise ActdesignError("it computes neither a layer norm nor an RMS norm x̂·γ + β with γ its "
                         "weight, 1 + its weight or 1 and β its bias or 0 (checked on a probe)")


def _normalized(x, kind, eps):
    """x̂ of a layer or RMS norm over the last dimension, in x's dtype."""
    centred = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    return centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)


def _rounds_input(norm, x, kind, eps, unit_offset) -> bool:
    """Whether the norm rounds x̂ to its input's dtype before the gain, as LLaMA's RMSNorm does
    (`weight * x̂.to(input_dtype)`): its bfloat16 copy's output on a bfloat16 probe equals that
    and not the once-rounded x̂·γ + β. Weights near 1, as trained, tell them apart."""
    probe = _float32_copy(norm).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(probe, name, None)
            if p is not None:
                offset = 1.0 if name == "weight" and not unit_offset else 0.0
                p.copy_(offset + 0.01 * torch.randn(p.shape, generator=gen))
        xb = x.to(torch.bfloat16)
        got = probe(xb).float()
        xhat = _normalized(xb.float(), kind, eps)
        w, b = (getattr(probe, k, None) for k in ("weight", "bias"))
        gamma = 1.0 if w is None else w.float() + (1.0 if unit_offset else 0.0)
        beta = 0.0 if b is None else b.float()
        once = (xhat * gamma + beta).to(torch.bfloat16).float()
        twice = (xhat.to(torch.bfloat16).float() * gamma + beta).to(torch.bfloat16).float()
    return bool(torch.equal(got, twice) and not torch.equal(got, once))


def _changes(probe, x, got, name, gen) -> bool:
    """Whether passing a random tensor as input `name` changes the probe's output."""
    try:
        other = probe(x, **{name: torch.randn(x.shape, generator=gen)})
    except Exception:  # noqa: BLE001  (it takes something else there: not a plain norm)
        return True
    return not (isinstance(other, torch.Tensor) and torch.equal(other, got))


def _extra_inputs(norm: nn.Module) -> list[str]:
    """The names of the inputs its forward takes besides x (a gate, say)."""
    try:
        params = list(inspect.signature(norm.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params[1:] if p.kind in named]


def _float32_copy(norm: nn.Module) -> nn.Module:
    """The norm in float32 on the CPU, for a probe; the model's own module is not touched.
    A norm on fake tensors gets real ones (the probe sets their values)."""
    return (real_copy(norm)[0] if any_fake(norm) else copy.deepcopy(norm)).to("cpu",
                                                                               torch.float32)
