"""Rotary embedding in one kernel each way: no float32 temporaries under autocast, and one
launch where eager's rotation of q and k launches about twenty.

Where the memory goes. In eager transformers, `apply_rotary_pos_emb(q, k, cos, sin)` computes
q·cos + rotate_half(q)·sin. Autograd keeps only cos and sin (they need no gradient), so no
saved bytes come from it; the cost is transient. Under autocast with float32 weights, cos and
sin are float32, so for every element of q and k the forward makes rotate_half(q) (2 bytes in
bf16), q·cos, rotate_half(q)·sin and their sum (4 bytes each), then attention's autocast
casts the sum to bf16 (2 more); the backward makes the same in reverse. Per layer that is
up to 12 bytes per element of q and k alive at once (the two float32 products and their
sum); in the backward they add to everything the later layers still keep.

`rotary(q, k, cos, sin)`, on CUDA, computes both in one kernel launch, math in registers,
the result written once: under autocast with float32 cos and sin, in the autocast dtype (what
attention casts eager's float32 result to, so the values attention sees are eager's, bit for
bit); with cos and sin in q's own dtype (16-bit weights, or float32 without autocast), in
that dtype, each product and sum rounded as eager's ops round them. The backward is its
adjoint, from cos and sin:

    dq = g·cos + rotate_halfᵀ(g·sin),   rotate_halfᵀ([a, b]) = [b, -a]

Elsewhere (CPU, other dtypes, other shapes, torch.compile, which fuses the eager ops itself)
it runs eager's own ops, and an attached module its model's own function.

`methods.rope.attach_rotary(attention)` makes one attention module use it, generically: the module's
forward must call `apply_rotary_pos_emb` from its modeling file, and that function must compute
the standard rotation (checked on a probe, bit for bit). The module gets its own copy of the
forward (and of the decorators around it) whose global `apply_rotary_pos_emb` is ours; the
modeling file, its other models and other instances are untouched.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from actdesign.codegen.render import render_rope
from actdesign.errors import ActdesignError

from .cache import generated
from .fake import on_host
from .known_modules import ROTARY as NAME

# (class forward, its rotation) -> the copy of the forward that calls ours, one for every
# attached instance. torch.compile then sees one function with one globals dict: its guards
# hold across layers, and the resume functions it installs in those globals at a graph break
# are there for every layer (with a copy per instance, the second layer's lookup failed).
_FORWARDS = {}


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin, unsqueeze_dim=1):
    """Eager transformers' rotation, op for op."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rope_ops():
    """The generated rotary module (Triton kernels), imported once."""
    return generated(render_rope)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, out_dtype):
        ctx.save_for_backward(cos, sin)  # the model's own tensors, shared by every layer
        ctx.dtype = q.dtype  # k's too (`_kernel_runs`)
        return rope_ops().rotate(q, k, cos, sin, out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = (g.contiguous() if g.stride(-1) != 1 else g for g in (dq, dk))
        return (*rope_ops().rotate(dq, dk, cos, sin, ctx.dtype, backward=True), None, None,
                None)


def rotary(q, k, cos, sin, unsqueeze_dim=1):
    """(q, k) rotated as transformers' apply_rotary_pos_emb does: in one kernel each where it
    pays (CUDA under autocast, cos and sin float32), else eager's own ops."""
    if not _kernel_runs(q, k, cos, sin, unsqueeze_dim):
        return reference(q, k, cos, sin, unsqueeze_dim)
    return _kernels(q, k, cos, sin)


def _kernels(q, k, cos, sin):
    """(q, k) rotated by the kernels, in the dtype eager's result reaches attention in: the
    autocast dtype for float32 cos and sin under autocast, else q's."""
    device = q.device.type
    widened = cos.dtype == torch.float32 != q.dtype and torch.is_autocast_enabled(device)
    return _Rotary.apply(q, k, cos, sin,
                         torch.get_autocast_dtype(device) if widened else q.dtype)


def _kernel_runs(q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether the kernels take this call: CUDA, cos and sin spanning q's and k's whole
    head, float32 under autocast or q's own dtype, shapes the kernel fits; eager, not
    compiling."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    device = q.device.type
    same = q.dtype == cos.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    widened = cos.dtype == torch.float32 and torch.is_autocast_enabled(device)
    if torch.compiler.is_compiling() or unsqueeze_dim != 1 or not (same or widened) \
            or not (q.dtype == k.dtype and cos.dtype == sin.dtype
                    and cos.shape == sin.shape
                    and q.shape[-1] == k.shape[-1] == cos.shape[-1]):
        return False
    ops = rope_ops()  # the generated module, loaded only where the kernels may run
    return ops._backend(q) in ops._TRITON_PATH and ops.fits(q, cos) and ops.fits(k, cos)


def _replacement_for(original):
    """Our rotation behind the original's signature. Where the kernels do not run (and for
    anything beyond q, k, cos, sin and unsqueeze_dim, such as position_ids) the original
    runs: its own dtype casts (OLMo 2 casts back to q's dtype) and partial rotations
    (GPT-NeoX rotates the first cos.shape[-1] features) stay as they are."""
    signature = inspect.signature(_plain(original))
    parameters = signature.parameters
    # the call attention makes, (q, k, cos, sin), read without binding the signature
    plain_call = list(parameters)[:4] == ["q", "k", "cos", "sin"]
    unsqueeze = getattr(parameters.get("unsqueeze_dim"), "default", 1)

    def apply_rotary_pos_emb(*args, **kwargs):
        if torch.compiler.is_compiling():  # the compiler fuses eager's ops itself
            return original(*args, **kwargs)
        if plain_call and len(args) == 4 and not kwargs:
            if _kernel_runs(*args, unsqueeze):
                return _kernels(*args)
            return original(*args)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()  # the original's own default unsqueeze_dim
        a = bound.arguments
        if any(v is not None for k, v in a.items()
               if k not in ("q", "k", "cos", "sin", "unsqueeze_dim")) \
                or not {"q", "k", "cos", "sin"} <= a.keys() \
                or not _kernel_runs(a["q"], a["k"], a["cos"], a["sin"],
                                    a.get("unsqueeze_dim", 1)):
            return original(*args, **kwargs)
        return _kernels(a["q"], a["k"], a["cos"], a["sin"])

    return apply_rotary_pos_emb


def _plain(original):
    """The function itself where the `kernels` package made it a hub-kernel module (a module
    instance whose forward calls it, taking *args and **kwargs)."""
    if isinstance(original, nn.Module):
        for cell in type(original).forward.__closure__ or ():
            inner = _contents(cell)
            if isinstance(inner, types.FunctionType) and inner.__name__ == NAME:
                return inner
    return original


def is_standard(original) -> bool:
    """Whether the original computes the standard rotation: the same values as ours, bit for
    bit, on random float32 inputs (real ones, also in a shape-only run)."""
    with on_host():
        return _same_rotation(original)


def _same_rotation(original) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(2))
    cos, sin = (torch.randn(2, 5, 8, generator=gen) for _ in range(2))
    try:
        with torch.no_grad():
            got = original(q, k, cos, sin)
    except Exception:  # noqa: BLE001  (any failure means: not the function we know)
        return False
    want = reference(q, k, cos, sin)
    return isinstance(got, tuple) and len(got) == 2 and all(
        isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w)
        for g, w in zip(got, want, strict=True))


def _with_global(fn, name, value):
    """A copy of fn, and of the functools.wraps decorators around it, whose innermost
    function finds `value` as the global `name`; its other globals are the module's (a
    snapshot of its namespace)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        scope = dict(fn.__globals__)
        scope[name] = value
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        holding = [i for i, c in enumerate(cells) if _contents(c) is inner]
        if len(holding) != 1:
            raise ActdesignError("its forward is wrapped by a decorator that does not keep "
                                 "the function it wraps in its closure")
        replaced = _with_global(inner, name, value)
        closure = tuple(types.CellType(replaced) if i == holding[0] else c
                        for i, c in enumerate(cells))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                 closure)
        new.__wrapped__ = replaced
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
    new.__doc__, new.__annotations__ = fn.__doc__, dict(fn.__annotations__)
    return new


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def rotary_forward(cls, original):
    """The copy of cls.forward that calls our rotation in place of `original`."""
    key = (cls.forward, original)
    if key not in _FORWARDS:
        _FORWARDS[key] = _with_global(cls.forward, NAME, _replacement_for(original))
    return _FORWARDS[key]


def is_rotary_forward(forward) -> bool:
    """Whether an instance's forward is one `methods.rope.plan_rotary` made."""
    return getattr(forward, "__func__", None) in _FORWARDS.values()
