"""Memory-sharing norms (MS-BP) as modules, and folding a norm's affine into the Linear layers
that follow it.

An MS norm has no affine parameters and keeps, for its backward, only its output y and one
rstd per row. The Linear layers reading y keep that same tensor for their weight gradient, so
y is stored once. Under autocast the norm emits y in the autocast dtype, the dtype those
Linear layers compute in, so autocast makes no second copy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from actdesign.codegen.render import render_norms
from actdesign.errors import ActdesignError

from .cache import generated
from .quantized import _QuantizedInput
from .targets import is_hf_conv1d, linear_like


def norm_ops():
    """The generated MS-norm module (kernels and ops), rendered and imported once."""
    return generated(render_norms)


class _MSNorm(nn.Module):
    kind = ""

    def __init__(self, normalized_shape: int, eps: float = 1e-5):
        super().__init__()
        if isinstance(normalized_shape, tuple | list):
            if len(normalized_shape) != 1:
                raise ValueError("MS norms normalise over the last dimension only")
            (normalized_shape,) = normalized_shape
        self.normalized_shape = int(normalized_shape)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.normalized_shape,):
            raise ValueError(f"{type(self).__name__}({self.normalized_shape}) got an input of "
                             f"shape {tuple(x.shape)}")
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else x.dtype
        return self._normalize(x, out_dtype)

    def _normalize(self, x, out_dtype):
        return norm_ops().apply(self.kind, x, self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class MSLayerNorm(_MSNorm):
    """y = (x - mean) / sqrt(var + eps) over the last dimension; saves y and rstd only."""

    kind = "layer"


class MSRMSNorm(_MSNorm):
    """y = x / sqrt(mean(x²) + eps) over the last dimension; saves y and rstd only."""

    kind = "rms"


class _QMSNorm(_QuantizedInput, _MSNorm):
    """An MS norm keeping b-bit ActNN codes of y in place of y (lossy: ActNN policies).

    The QLinear layers reading y keep the same codes for their weight gradients (see
    `_QuantizedInput.share`), so the block keeps b bits per element of y, not 16 or 32. The
    backward runs the MS-BP formula on the dequantized ŷ, which is unbiased. Its noise reaches
    the input gradient through the projection term ŷ·mean(g·ŷ) only: a row mean, about
    1/sqrt(d) of g where g and y are uncorrelated. That term's diagonal ŷ_i·g_i·ŷ_i/d has
    the mean (y_i² + Var ŷ_i)·g_i/d, so E[dx_i] = dx_i - rstd·g_i·Var(ŷ_i)/d: a shrink by
    Var(ŷ_i)/d, which no function of the codes can undo."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, bits=2, group_size=256):
        _MSNorm.__init__(self, normalized_shape, eps)
        self._setup(bits, group_size)

    @staticmethod
    def from_norm(norm: _MSNorm, *, bits=2, group_size=256) -> _QMSNorm:
        """The MS norm `norm` computes, keeping b-bit codes of its output."""
        cls = QMSLayerNorm if norm.kind == "layer" else QMSRMSNorm
        coded = cls(norm.normalized_shape, norm.eps, bits=bits, group_size=group_size)
        for name, buffer in norm.named_buffers(recurse=False):  # the identity affine, if any
            coded.register_buffer(name, buffer, persistent=False)
        return coded

    def _normalize(self, x, out_dtype):
        if torch.is_grad_enabled() and x.requires_grad:
            return _KeepingCodes.apply(x, self, out_dtype)
        return super()._normalize(x, out_dtype)  # nothing to keep


class QMSLayerNorm(_QMSNorm, MSLayerNorm):
    """MSLayerNorm keeping b-bit codes of its output."""


class QMSRMSNorm(_QMSNorm, MSRMSNorm):
    """MSRMSNorm keeping b-bit codes of its output."""


class _KeepingCodes(torch.autograd.Function):
    """An MS norm whose backward reads rstd and the codes of y; y goes to its readers with
    the codes attached."""

    @staticmethod
    def forward(ctx, x, norm, out_dtype):
        forward, _ = norm_ops().IMPLS[norm.kind]
        y, rstd = forward(x, norm.eps, out_dtype)
        codes = norm.compress(y)
        norm.share(y, codes)
        ctx.save_for_backward(rstd, *codes)
        ctx.norm, ctx.shape, ctx.dtype, ctx.input_dtype = norm, y.shape, y.dtype, x.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        rstd, *codes = ctx.saved_tensors
        y = ctx.norm.restore(codes, ctx.shape, ctx.dtype)
        _, backward = norm_ops().IMPLS[ctx.norm.kind]
        return backward(y, rstd, grad_y.to(ctx.input_dtype)), None, None


def fold_norm_affine(norm: nn.Module, linears, *, feeds_residual: bool = False) -> _MSNorm:
    """Move a LayerNorm's or RMSNorm's γ (and β) into the Linear layers that read its output,
    exactly: W' = W·diag(γ), b' = b + W·β. Returns the MS norm to put in the norm's place.

    `linears` must be every consumer of the norm's output (the q/k/v projections of a pre-norm
    attention block, the first MLP layer). In a post-norm block the output also feeds the
    residual, which would lose γ and β: say so with `feeds_residual=True`, and the fold is
    refused rather than producing a different model. Linear weights shared with other modules
    (tied weights) change with the fold. A norm without γ and β needs no layers.
    """
    if feeds_residual:
        raise ActdesignError("this norm's output also feeds the residual (a post-norm block): "
                             "its γ and β cannot move into the Linear layers alone; keep the "
                             "norm, or use a pre-norm block")
    kind, d, eps, gamma, beta, unit = _affine(norm)
    linears = list(linears)
    affine = gamma is not None or beta is not None
    if (affine and not linears) or not all(linear_like(m) for m in linears):
        raise ActdesignError("fold_norm_affine needs the nn.Linear layers that read the norm")
    for m in linears:
        inputs = m.weight.shape[0 if is_hf_conv1d(m) else 1]
        if inputs != d:
            raise ActdesignError(f"a Linear with {inputs} inputs cannot follow a norm "
                                 f"over {d} features")
    with torch.no_grad():
        for m in linears:
            weight = m.weight.T if is_hf_conv1d(m) else m.weight  # (out, in) either way
            if beta is not None:
                shift = weight.double() @ beta.double()
                if m.bias is None:
                    m.bias = nn.Parameter(shift.to(weight.dtype))
                else:
                    m.bias.add_(shift.to(m.bias.dtype))
            if gamma is not None:
                weight.mul_(gamma.to(weight.dtype)[None, :])
    ms = (MSLayerNorm if kind == "layer" else MSRMSNorm)(d, eps)  # no parameters to move
    # Code that reads a norm's affine itself (nn.TransformerEncoderLayer's inference path
    # does) finds the original's at the values that make it the identity: the norm it is.
    # Buffers, not parameters, and not saved: the folded Linear layers hold the trained γ.
    for name, value in (("weight", unit), ("bias", 0.0)):
        original = getattr(norm, name, None)
        if isinstance(original, torch.Tensor):
            ms.register_buffer(name, torch.full_like(original, value, requires_grad=False),
                               persistent=False)
    return ms


def _affine(norm: nn.Module):
    """(kind, features, eps, γ or None, β or None, the weight's value for γ = 1) of a
    supported norm."""
    if isinstance(norm, nn.LayerNorm):
        shape, eps, kind = norm.normalized_shape, norm.eps, "layer"
    elif isinstance(norm, nn.RMSNorm) or (type(norm).__name__.endswith("RMSNorm")
                                          and hasattr(norm, "weight")):
        weight = norm.weight
        shape = tuple(weight.shape) if weight is not None else tuple(norm.normalized_shape)
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
        if eps is None:  # nn.RMSNorm's default
            eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
        kind = "rms"
    else:
        raise ActdesignError(f"cannot fold a {type(norm).__name__}: supported are nn.LayerNorm, "
                             "nn.RMSNorm and RMSNorm modules computing x·rsqrt(mean(x²)+eps)·w")
    if len(shape) != 1:
        raise ActdesignError("MS norms normalise over the last dimension only")
    gamma = getattr(norm, "weight", None)
    beta = getattr(norm, "bias", None) if kind == "layer" else None
    unit = 1.0  # the value of its weight at which the norm multiplies by 1
    if kind == "rms" and not isinstance(norm, nn.RMSNorm):
        gamma, unit = _rms_scale(norm, shape[0], float(eps))
    return kind, shape[0], float(eps), gamma, beta, unit


def _rms_scale(norm: nn.Module, d: int, eps: float):
    """The γ that another library's RMSNorm multiplies x·rsqrt(mean(x²)+eps) by, found by
    what it computes on a probe: its weight w (LLaMA), 1 + w (Gemma, Qwen3-Next) or nothing
    (no weight); and the weight's value at which γ = 1. Anything else, a gate or another eps
    among them, is refused."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, d, generator=gen, dtype=torch.float64)
    x[2:] *= eps ** 0.5 if eps > 0 else 1e-3  # rows whose mean square is eps: eps shows
    probe = _float32_copy(norm)
    try:
        with torch.no_grad():
            got = probe(x.float())
    except Exception as exc:  # noqa: BLE001  (any failure means: not a norm we know)
        raise ActdesignError(f"its forward does not take one tensor x ({type(exc).__name__}: "
                             f"{exc})") from None
    normalised = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    w, own = getattr(probe, "weight", None), getattr(norm, "weight", None)
    if w is not None:
        w, own = w.detach(), own.detach()
        wide = own.to(torch.promote_types(own.dtype, torch.float32))  # as Gemma: 1 + w.float()
    # (γ, γ of the probe, the weight's value for γ = 1)
    candidates = [(None, 1.0, 1.0)] if w is None else [(own, w, 1.0), (1.0 + wide, 1.0 + w, 0.0)]
    for gamma, probed, unit in candidates:
        want = normalised * (probed.double() if torch.is_tensor(probed) else probed)
        # float32 math: a few roundings of 2^-24 each; another formula misses by far more
        if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
            return gamma, unit
    raise ActdesignError("it does not compute x·rsqrt(mean(x²)+eps)·γ with γ its weight, 1 + "
                         "its weight or 1 (checked on a probe)")


def _float32_copy(norm: nn.Module) -> nn.Module:
    """The norm in float32 on the CPU, for a probe; the model's own module is not touched."""
    return copy.deepcopy(norm).to("cpu", torch.float32)
