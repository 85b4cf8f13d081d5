"""A per-token module computed in sequence tiles, forward and backward, so that only one
tile's intermediates are alive at a time.

    y = tiled(module.untiled_forward, x, module, rows)

The tokens (every dimension of x but the last, flattened) are cut into tiles of at most
`rows`, of near-equal sizes (`spans`). The
forward runs the module on each tile without autograd and keeps only x (or what x's producer
offers in its place, as an MS norm's x̂). The backward runs each tile's forward again with
autograd, under the forward's autocast state and random generators (so dropout and ActNN's
stochastic rounding draw what the forward drew), and takes that tile's gradients at once.

Each token's row is computed by the same kernels on the same inputs as untiled, so the output
and the input gradient are the untiled module's. Two limits of that, both the kernels' own: on
the CPU, torch's elementwise kernels compute the last elements of a thread's chunk that do not
fill a pair of SIMD vectors with scalar code (another exp), so such an element's bits depend
on where its chunk ends, tiled or not (widths that are multiples of 64, as models' are, keep
the chunks whole vectors); on CUDA, cuBLAS may pick another kernel for a tile's number of rows
than for all of them, which is not checked here (no GPU run yet).

A parameter's gradient is a sum over all the tokens: tiled, it is the sum of the tiles'
gradients, accumulated in float32 (float64 for a float64 parameter) and rounded to the
parameter's dtype once. Untiled, one product sums the same terms in another order, so the two
differ by the rounding of that sum (for float32, a few units in the last place of the largest
tile's gradient; under bf16 autocast each tile's gradient is rounded to bfloat16 before the
sum, where untiled rounds the whole sum once).

The price is the module's forward once more in the backward. The tile size, where the policy
does not give one, follows `tile_rows`. Under torch.compile the module runs untiled: the
compiler chooses what to keep and what to recompute.
"""

from __future__ import annotations

import torch

from actdesign.errors import ActdesignError

from .draws import replayed_rng, rng_state
from .fake import spans_to_run
from .sharing import kept_for, rebuild

SMALLEST_AUTO_TILE = 1024


def tile_rows(tile, tokens: int, hidden: int) -> int | None:
    """The tokens per tile for an input of `tokens` rows of width `hidden`, or None where the
    input is one tile and runs untiled. `tile`: an int (the policy's), or "auto": as many
    tokens as the hidden width, at least SMALLEST_AUTO_TILE, so that a tile's intermediates
    (tokens x the inner width) are about the size of one of the module's weights however long
    the sequence, and the products keep at least a thousand rows."""
    if tile is None:
        return None
    rows = max(SMALLEST_AUTO_TILE, hidden) if tile == "auto" else int(tile)
    return rows if tokens > rows else None


def tiled(forward, x, module, rows: int):
    """forward(x) computed `rows` tokens at a time (see the module's doc). `forward` must be
    per-token (row i of its output depends on row i of x only) and read `module`'s
    parameters, whose gradients are taken."""
    params = _trainable(module)
    if not (torch.is_grad_enabled() and (x.requires_grad or params)) \
            or torch.compiler.is_compiling():
        return forward(x)  # nothing to keep for a backward, or the compiler chooses it
    return _Tiled.apply(forward, module, rows, x, *params)


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def spans(n: int, rows: int):
    """The tiles of n tokens at most `rows` each: as few as that allows, of near-equal sizes
    (never a tile of a few rows: a product over a few rows takes other kernels, whose rows
    may round otherwise)."""
    count = -(-n // rows)
    size, extra = divmod(n, count)
    start = 0
    for i in range(count):
        end = start + size + (i < extra)
        yield start, end
        start = end


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, module, rows, x, *params):
        flat = x.reshape(-1, x.shape[-1])
        device = x.device
        ctx.autocast = (torch.is_autocast_enabled(device.type),
                        torch.get_autocast_dtype(device.type))
        ctx.rng = rng_state(device)
        y = None
        for a, b in spans_to_run(spans(flat.shape[0], rows), flat):
            part = forward(flat[a:b])
            if y is None:
                y = part.new_empty((flat.shape[0], part.shape[-1]))
            y[a:b] = part
            del part
        kept, extras, ctx.make = kept_for(x)  # an MS norm's x̂, where it offers it
        if kept is None:  # a recipe with nothing to slice per tile: keep x itself
            kept, extras, ctx.make = x, (), None
        ctx.save_for_backward(kept, *extras)
        ctx.forward, ctx.module, ctx.rows, ctx.params = forward, module, rows, params
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        kept, *extras = ctx.saved_tensors
        params = _trainable(ctx.module)
        if len(params) != len(ctx.params) or any(
                p is not q for p, q in zip(params, ctx.params, strict=True)):
            raise ActdesignError("the tiled module's trainable parameters changed between its "
                                 "forward and its backward")
        width = ctx.x_shape[-1]
        kept = kept.reshape(-1, kept.shape[-1])
        grad = grad.reshape(-1, grad.shape[-1])
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[4 + i]]
        sums = [None] * len(params)
        dx = torch.empty((kept.shape[0], width), dtype=ctx.x_dtype, device=kept.device) \
            if ctx.needs_input_grad[3] else None
        enabled, dtype = ctx.autocast
        with replayed_rng(kept.device, ctx.rng), torch.enable_grad(), \
                torch.autocast(kept.device.type, dtype=dtype, enabled=enabled):
            for a, b in spans_to_run(spans(kept.shape[0], ctx.rows), kept):
                x = rebuild(kept[a:b], extras, ctx.make, (b - a, width), ctx.x_dtype)
                x = x.detach().requires_grad_(dx is not None)
                inputs = ([x] if dx is not None else []) + [params[i] for i in wanted]
                got = list(torch.autograd.grad(ctx.forward(x), inputs, grad[a:b],
                                               allow_unused=True))
                if dx is not None:
                    dx[a:b] = got.pop(0)
                for i, g in zip(wanted, got, strict=True):
                    if g is None:
                        continue
                    wide = torch.promote_types(g.dtype, torch.float32)  # float32, or float64
                    sums[i] = g.to(wide) if sums[i] is None else sums[i].add_(g)
                del got
        grads = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params, strict=True)]
        return None, None, None, None if dx is None else dx.view(ctx.x_shape), *grads
