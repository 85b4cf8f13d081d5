"""Convolutional chains that keep one tensor per norm: what the backward reads of every other
activation-sized tensor is rebuilt from it.

In Conv → BN → act → Conv eager PyTorch keeps the BN's input c, and then the activation's
input or output and the next convolution's input: two or three tensors the size of c.
Everything after c is elementwise in c (the norm's output, from its statistics), so each of
those readers can keep instead the *recipe* that makes its tensor again from c, with eager's
own ops: the same bits. Here:

- a recipe is a tree of ops over leaves, tensors something keeps anyway (a BN's input, a max
  pool's output, the image): `Recipe`. It rides on the tensor it makes through the
  sharing protocol (`sharing.offer`), so every reader that reads offers keeps the recipe's
  leaves, which are kept anyway, in place of the tensor (`LeanConv2d`, `QConv2d`...);
- a BatchNorm in training keeps what eager's keeps (c and its statistics) and offers its
  output as a recipe from c (`offering_forward`);
- an activation, or a norm without state (GroupNorm, a channels-first LayerNorm, a frozen
  BatchNorm), keeps only the recipe of its input (or the input itself) and computes its own
  backward by running its forward again on it with autograd: eager's backward, bit for bit
  (`recomputed_forward`);
- a max pool keeps, in place of its input and an int64 index per output, the offset of the
  maximum in its window, one byte (`pooled_forward`); its output is a leaf of the recipes
  after it (a quarter of its input or less, kept by its readers);
- residual adds, squeeze-excite products, stochastic depth's scaling, ReLUs, paddings and
  casts written as tensor ops in a block's forward pass recipes on (`TrackedOps`, entered
  around the model's forward pass), so a block's output is rebuilt from what its norms keep,
  and a layer's autocast copy of its input from the input's recipe.

Under ActNN (`cnn+actnn2`) a batch norm keeps codes of x̂ in place of its input, and offers
its output as a recipe from them, an approximation (`Recipe.bits`): a ReLU's 1-bit mask, a
residual add and a convolution's codes of a tensor nothing else offers (`QConv2d`) carry it on,
and only readers that keep codes of as many bits or fewer take it (`sharing.kept_for`).

A rebuilt tensor has the original's bits and strides (an approximation only where a leaf is
codes). Rebuilding runs elementwise ops (and a BatchNorm's statistics once more); a residual
block's output is rebuilt through the blocks before it in its stage, a few passes each.
Under torch.compile and inside a checkpoint nothing is offered: the compiler or the checkpoint
decides what to keep.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .sharing import Whole, in_checkpoint, keep, kept_for, offer, restore


class Recipe:
    """How a tensor is made again: `fn(*args, **kwargs)` under the autocast state it was made
    in, each argument a leaf (an index into the leaves), another Recipe node or a constant.
    Holds no tensors: the leaves travel beside it (`sharing.offer`'s extras). Called as an
    offer's `make`, it rebuilds the tensor with the original's strides: the original's bits,
    or where a leaf is codes (`bits`, the fewest bits of any), an approximation of it that
    only readers keeping codes take. `loose`: the bytes of the leaves that no producer
    offered (a tensor a tracked op read), which may be kept for this recipe alone."""

    def __init__(self, fn, args, kwargs, autocast, stride, shape=None, bits=None, loose=0):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.autocast, self.stride, self.shape = autocast, stride, shape
        self.bits, self.loose = bits, loose
        self.versions = None  # the leaves' versions when offered

    def __call__(self, _primary, *leaves, dtype=None):
        if self.versions is not None and tuple(t._version for t in leaves) != self.versions:
            raise RuntimeError("a tensor a recipe rebuilds from was changed in place after the "
                               "recipe was made: the rebuilt tensor would not be the original")
        out = self.value(leaves)
        if out.stride() != self.stride:  # a reader's kernels may take another path on others
            out = torch.empty_strided(out.shape, self.stride, dtype=out.dtype,
                                      device=out.device).copy_(out)
        return out

    def value(self, leaves):
        """The tensor made again. The deepest arguments are made first: while one is made,
        only those made before it are held (a residual stream rebuilt through its blocks
        holds one tensor a block, not every block's other input). Where the first argument
        was made here and nothing else holds it, an op with an in-place form writes into it
        (the same kernel, so the same bits): a residual add holds two tensors, not three."""
        items = [*enumerate(self.args), *self.kwargs.items()]
        made = {}
        for key, a in sorted(items, key=lambda item: -_depth(item[1])):
            made[key] = leaves[a.index] if isinstance(a, Leaf) else \
                a.value(leaves) if isinstance(a, Recipe) else a
        args = [made[i] for i in range(len(self.args))]
        kwargs = {k: made[k] for k in self.kwargs}
        fn = self.fn
        if self.args and isinstance(self.args[0], Recipe) and _owned(args[0], leaves):
            fn = _in_place_form(fn, args) or fn
        device, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            return fn(*args, **kwargs)

    @functools.cached_property
    def depth(self) -> int:
        return 1 + max(map(_depth, (*self.args, *self.kwargs.values())), default=0)


def _depth(a) -> int:
    return a.depth if isinstance(a, Recipe) else 0


_IN_PLACE_FORMS = {torch.add: torch.Tensor.add_, torch.sub: torch.Tensor.sub_,
                   torch.mul: torch.Tensor.mul_, torch.div: torch.Tensor.div_,
                   torch.relu: torch.relu_}


def _root(t):
    return t if t._base is None else t._base


def _owned(t, leaves) -> bool:
    """Whether t, made by a recipe's node, is held by nothing else: no leaf's storage."""
    return isinstance(t, torch.Tensor) and all(_root(t) is not _root(leaf) for leaf in leaves)


def _in_place_form(fn, args):
    """fn's form writing into its first argument where its result has that argument's shape
    and dtype (no broadcast to a larger shape, no promotion); a function may name its own
    (`fn.in_place`, which the function's maker vouches for)."""
    own = getattr(fn, "in_place", None)
    if own is not None:
        return own
    form = _IN_PLACE_FORMS.get(fn)
    first, others = args[0], args[1:]
    if form is None or torch.broadcast_shapes(
            first.shape, *(a.shape for a in others if isinstance(a, torch.Tensor))) != first.shape:
        return None
    return form if all(torch.result_type(first, a) == first.dtype for a in others) else None


class Leaf:
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def recipe_of(t):
    """(its Recipe, its leaves) where `t` carries a recipe, else None. A view of a tensor
    carrying one, element for element (`sharing.kept_for`), carries it reshaped."""
    if not isinstance(t, torch.Tensor):
        return None
    primary, leaves, make = kept_for(t, passing_on=True)
    if not isinstance(make, Recipe) or primary is not None:
        return None
    if make.shape != tuple(t.shape):
        make = Recipe(torch.reshape, (make, tuple(t.shape)), {}, make.autocast,
                      tuple(t.stride()), tuple(t.shape), make.bits, make.loose)
    return make, leaves


def build(fn, args, kwargs=None, found=None, kept=()) -> tuple[Recipe, tuple] | None:
    """(the Recipe computing fn(*args, **kwargs), its leaves): each tensor argument by its
    own recipe where it carries one (`found`: the recipes read before an in-place op ran),
    else as a leaf (loose, unless the caller keeps it anyway: `kept`); None where no
    argument carries a recipe (nothing would be shared)."""
    kwargs = kwargs or {}
    found = found if found is not None else {id(a): recipe_of(a) for a in _tensors(args, kwargs)}
    if not any(found.values()):
        return None
    leaves, at = [], {}

    def leaf(t):
        if id(t) not in at:
            at[id(t)] = len(leaves)
            leaves.append(t)
        return Leaf(at[id(t)])

    def arg(a):
        if not isinstance(a, torch.Tensor):
            return a
        got = found.get(id(a))
        return _moved(got[0], got[1], leaf) if got else leaf(a)

    made = [got[0] for got in found.values() if got]
    loose = sum(t.numel() * t.element_size() for t in _tensors(args, kwargs)
                if not found.get(id(t)) and not any(t is k for k in kept))
    return (Recipe(fn, tuple(map(arg, args)), {k: arg(v) for k, v in kwargs.items()},
                   _autocast_state(), None, bits=min((r.bits for r in made if r.bits),
                                                     default=None),
                   loose=loose + sum(r.loose for r in made)), tuple(leaves))


def _moved(node, own, leaf):
    """A recipe's nodes with its leaves (`own`) renumbered by `leaf`. Not a closure in
    `build`: a function that calls itself from its own closure is a reference cycle, which
    would hold the leaves until the garbage collector runs."""
    if isinstance(node, Leaf):
        return leaf(own[node.index])
    if not isinstance(node, Recipe):
        return node
    return Recipe(node.fn, tuple(_moved(a, own, leaf) for a in node.args),
                  {k: _moved(v, own, leaf) for k, v in node.kwargs.items()}, node.autocast,
                  node.stride, node.shape, node.bits, node.loose)


def offer_recipe(y, built) -> None:
    """Tell y's readers how to make y again (`built`, from `build`)."""
    if built is None or not isinstance(y, torch.Tensor):
        return
    recipe, leaves = built
    recipe.stride, recipe.shape = y.stride(), tuple(y.shape)
    recipe.versions = tuple(t._version for t in leaves)
    offer(y, None, leaves, recipe, chained=True)


def shares_recipes(in_function=False) -> bool:
    """Whether the chain shares recipes here: gradients wanted (always, asked `in_function`,
    an autograd Function's forward, where they are off), not compiling (the compiler decides
    what to keep), not inside a checkpoint (`in_checkpoint`)."""
    return (in_function or torch.is_grad_enabled()) and not torch.compiler.is_compiling() \
        and not in_checkpoint()


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _autocast_state():
    device = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
    return device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


# --- ops written in a block's forward -------------------------------------------------------

# the tensor ops a block's forward writes that recipes pass through, and their out-of-place form
_IN_PLACE = {torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_,
             torch.relu_, torch.Tensor.relu_}
_TRACKED = {
    torch.Tensor.add: torch.add, torch.Tensor.add_: torch.add, torch.add: torch.add,
    torch.Tensor.sub: torch.sub, torch.Tensor.sub_: torch.sub, torch.sub: torch.sub,
    torch.Tensor.mul: torch.mul, torch.Tensor.mul_: torch.mul, torch.mul: torch.mul,
    torch.Tensor.div: torch.div, torch.Tensor.div_: torch.div, torch.div: torch.div,
    torch.relu: torch.relu, torch.relu_: torch.relu, torch.Tensor.relu: torch.relu,
    torch.Tensor.relu_: torch.relu, F.relu: torch.relu, F.pad: F.pad,
    torch.Tensor.to: torch.Tensor.to, torch.Tensor.float: torch.Tensor.float,
    torch.Tensor.bfloat16: torch.Tensor.bfloat16, torch.Tensor.half: torch.Tensor.half,
}


class TrackedOps(TorchFunctionMode):
    """While open, the result of a tracked op (`_TRACKED`) on a tensor carrying a recipe
    carries the recipe of that op; an in-place op's result (its input, changed) carries the
    recipe of what it now holds. A product of two tensors keeps, for its backward, each
    factor's recipe where it carries one (`_Product`), not the factor. Nothing is computed
    otherwise than it would be."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        redo = _TRACKED.get(func)
        if redo is None or in_checkpoint():
            return func(*args, **kwargs)
        found = {id(a): recipe_of(a) for a in _tensors(args, kwargs)}  # before it changes them
        in_place = func in _IN_PLACE or (func is F.relu and kwargs.get("inplace", False))
        if redo is torch.mul and not in_place and not kwargs and len(args) == 2 \
                and all(isinstance(a, torch.Tensor) for a in args) and any(found.values()) \
                and any(a.requires_grad for a in args):
            out = _Product.apply(*args)
        else:
            out = func(*args, **kwargs)
        if in_place and not found.get(id(args[0])):
            return out  # it changed a tensor no recipe makes: its old value is gone
        if func is F.relu:
            kwargs = {}  # (inplace=True): rebuilt out of place
        offer_recipe(out, build(redo, args, kwargs, found))
        return out


class _Product(torch.autograd.Function):
    """a·b keeping, for its backward, each factor the other's gradient reads as what makes it
    again (its recipe's leaves, or itself); the gradients are eager's: grad·other, summed to
    the factor's shape where it was broadcast."""

    @staticmethod
    def forward(ctx, a, b):
        out = torch.mul(a, b)
        kept, ctx.how, ctx.counts = [], [], []
        for factor, other_needs in ((a, ctx.needs_input_grad[1]), (b, ctx.needs_input_grad[0])):
            saved, how = keep(factor, Whole) if other_needs else ((), None)
            kept += saved
            ctx.how.append(how)
            ctx.counts.append(len(saved))
        ctx.save_for_backward(*kept)
        ctx.shapes, ctx.dtypes = (a.shape, b.shape), (a.dtype, b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved, factors = ctx.saved_tensors, []
        for i, (how, count) in enumerate(zip(ctx.how, ctx.counts, strict=True)):
            part, saved = saved[:count], saved[count:]
            factors.append(None if how is None else
                           restore(part, how, Whole, ctx.shapes[i], ctx.dtypes[i]))
        a, b = factors
        grad_a = (grad * b).sum_to_size(ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        grad_b = (grad * a).sum_to_size(ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def tracked_forward(cls):
    """cls.forward run with `TrackedOps` open, where recipes can be shared (gradients wanted,
    not compiling); its signature is cls.forward's."""
    forward = cls.forward
    if forward not in _TRACKED_FORWARDS:
        @functools.wraps(forward)
        def tracking(self, *args, **kwargs):
            if not shares_recipes():
                return forward(self, *args, **kwargs)
            with TrackedOps():
                return forward(self, *args, **kwargs)

        _TRACKED_FORWARDS[forward] = tracking
    return _TRACKED_FORWARDS[forward]


_TRACKED_FORWARDS: dict = {}


def is_tracked_forward(forward) -> bool:
    return getattr(forward, "__func__", None) in _TRACKED_FORWARDS.values()


# --- modules that keep a recipe ---------------------------------------------------------------

class _Recomputed(torch.autograd.Function):
    """y = run(x), keeping what makes x again (its recipe's leaves, or x), and for the
    backward running `run` again with autograd on the rebuilt x: eager's own backward."""

    @staticmethod
    def forward(ctx, x, run, *params):
        with torch.no_grad():
            y = run(x)
        kept, ctx.how = keep(x, Whole)  # exact: never an offer made from codes
        ctx.save_for_backward(*kept, *params)
        ctx.run, ctx.count, ctx.shape, ctx.dtype = run, len(kept), x.shape, x.dtype
        make = ctx.how[0]
        if isinstance(make, Recipe):  # y's recipe: x's, one op further
            offer_recipe(y, build(run, (x,)))
        elif make is None:  # x is kept here: y is made again from it
            offer_recipe(y, leaf_recipe(run, (x,)))
        return y

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        kept, params = saved[:ctx.count], saved[ctx.count:]
        x = restore(kept, ctx.how, Whole, ctx.shape, ctx.dtype)
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[2:], strict=True) if need]
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(ctx.needs_input_grad[0])
            inputs = ([leaf] if ctx.needs_input_grad[0] else []) + wanted
            got = list(torch.autograd.grad(ctx.run(leaf), inputs, grad, allow_unused=True))
        grad_x = got.pop(0) if ctx.needs_input_grad[0] else None
        grads = iter(got)
        return grad_x, None, *(next(grads) if need else None
                               for need in ctx.needs_input_grad[2:])


def recomputed_forward(cls):
    """The forward of a module without state (an activation, GroupNorm, a channels-first
    LayerNorm, a frozen BatchNorm) that keeps for its backward only what makes its input
    again, and runs cls.forward again in the backward; out of place where the module would
    work in place (`inplace`)."""
    forward = cls.forward
    if forward not in _RECOMPUTED_FORWARDS:
        @functools.wraps(forward)
        def recomputing(self, x, *args, **kwargs):
            if args or kwargs or not isinstance(x, torch.Tensor) or not shares_recipes():
                return forward(self, x, *args, **kwargs)
            twin = self
            if getattr(self, "inplace", False):
                twin = copy.copy(self)  # the same parameters, out of place
                twin.inplace = False

            def run(t):
                return forward(twin, t)

            params = [p for p in self.parameters() if p.requires_grad]
            if not (x.requires_grad or params):
                return forward(self, x)
            return _Recomputed.apply(x, run, *params)

        _RECOMPUTED_FORWARDS[forward] = recomputing
    return _RECOMPUTED_FORWARDS[forward]


_RECOMPUTED_FORWARDS: dict = {}


def is_recomputed_forward(forward) -> bool:
    return getattr(forward, "__func__", None) in _RECOMPUTED_FORWARDS.values()


def _batch_norm_again(x, weight, bias, eps):
    """A BatchNorm's training output again, from the batch's own statistics computed again
    (the same reduction, so the same bits), the running statistics left alone."""
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def offering_forward(cls):
    """The forward of a BatchNorm (torch's, or a subclass of it such as one with its
    activation inside) that computes and keeps what eager's does, and offers the output of
    each batch norm it runs on its input as a recipe from that input: with the batch's own
    statistics, from them computed again; with its running statistics, from those. A
    synchronised norm's statistics come from its group, not from `F.batch_norm`: nothing is
    offered then."""
    forward = cls.forward
    if forward not in _OFFERING_FORWARDS:
        @functools.wraps(forward)
        def offering(self, x, *args, **kwargs):
            if not shares_recipes():
                return forward(self, x, *args, **kwargs)
            with _OfferedNorms(x):
                return forward(self, x, *args, **kwargs)

        _OFFERING_FORWARDS[forward] = offering
    return _OFFERING_FORWARDS[forward]


class _OfferedNorms(TorchFunctionMode):
    """While open, the output of `F.batch_norm` on `x` carries its recipe from x."""

    def __init__(self, x):
        super().__init__()
        self.x = x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        y = func(*args, **kwargs)
        if func is F.batch_norm and args and args[0] is self.x:
            call = batch_norm_call(args, kwargs)
            norm = (call["input"], call.get("weight"), call.get("bias"), call.get("eps", 1e-5))
            if call.get("training", False):
                offer_recipe(y, leaf_recipe(_batch_norm_again, norm))
            else:
                offer_recipe(y, leaf_recipe(F.batch_norm, (
                    norm[0], call["running_mean"], call["running_var"], *norm[1:3], False,
                    0.0, norm[3])))
        return y


def batch_norm_call(args, kwargs) -> dict:
    """`F.batch_norm`'s arguments by name, as a call passed them."""
    return dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training",
                     "momentum", "eps"), args, strict=False), **kwargs)


_OFFERING_FORWARDS: dict = {}


def is_offering_forward(forward) -> bool:
    return getattr(forward, "__func__", None) in _OFFERING_FORWARDS.values()


def leaf_recipe(fn, args, bits=None):
    """The recipe of fn(*args), every tensor argument a leaf (kept anyway: a norm's input, or
    its codes of `bits` bits)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    at = {id(t): i for i, t in enumerate(leaves)}
    nodes = tuple(Leaf(at[id(a)]) if isinstance(a, torch.Tensor) else a for a in args)
    return Recipe(fn, nodes, {}, _autocast_state(), None, bits=bits), tuple(leaves)


# --- max pooling ------------------------------------------------------------------------------

class _PooledOffsets(torch.autograd.Function):
    """max_pool2d keeping, per output, the offset of its maximum in its window (a byte) in
    place of the input and an int64 index."""

    @staticmethod
    def forward(ctx, x, pool):
        y, index = F.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                                pool.ceil_mode, return_indices=True)
        geometry = _geometry(pool, x.shape)
        offsets = _offsets(index, geometry)
        ctx.save_for_backward(offsets)
        ctx.geometry, ctx.x_shape = geometry, x.shape
        ctx.channels_last = x.is_contiguous(memory_format=torch.channels_last) \
            and not x.is_contiguous()
        # y is not offered as a recipe: it is a quarter of x or less, and made again it would
        # need x made again, a transient four times its size
        return y

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.geometry[:5]
        index = _index(offsets, ctx.geometry)
        out = torch.empty(ctx.x_shape, dtype=grad.dtype, device=grad.device,
                          memory_format=torch.channels_last if ctx.channels_last
                          else torch.contiguous_format)
        shape_only = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(ctx.x_shape)
        torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
            grad, shape_only, kernel, stride, padding, dilation, ceil_mode, index,
            grad_input=out)  # the input's values are not read: only its shape
        return out, None


def pooled_forward(cls):
    """The forward of an nn.MaxPool2d keeping the offsets of its maxima (`_PooledOffsets`)."""
    forward = cls.forward
    if forward not in _POOLED_FORWARDS:
        @functools.wraps(forward)
        def pooling(self, x):
            if not (shares_recipes() and x.requires_grad) or x.dim() != 4:
                return forward(self, x)
            return _PooledOffsets.apply(x, self)

        _POOLED_FORWARDS[forward] = pooling
    return _POOLED_FORWARDS[forward]


_POOLED_FORWARDS: dict = {}


def is_pooled_forward(forward) -> bool:
    return getattr(forward, "__func__", None) in _POOLED_FORWARDS.values()


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _geometry(pool, shape):
    """(kernel, stride, padding, dilation, ceil_mode, input height, input width)."""
    stride = pool.stride if pool.stride not in (None, ()) else pool.kernel_size
    return (_pair(pool.kernel_size), _pair(stride), _pair(pool.padding), _pair(pool.dilation),
            pool.ceil_mode, shape[-2], shape[-1])


def window_cells(pool) -> int:
    kernel = _pair(pool.kernel_size)
    return kernel[0] * kernel[1]


def _starts(index, geometry):
    """The first row and column of each output's window, broadcast like `index`."""
    _, stride, padding, _, _, _, _ = geometry
    rows = torch.arange(index.shape[-2], device=index.device) * stride[0] - padding[0]
    cols = torch.arange(index.shape[-1], device=index.device) * stride[1] - padding[1]
    return rows.view(-1, 1), cols.view(1, -1)


def _offsets(index, geometry, slices=8):
    """Each maximum's offset in its window, a byte, from max_pool2d's int64 index: made an
    eighth of the batch at a time, in place, so the forward holds two int64 transients of an
    eighth of the index (a whole one each was the forward's peak on a ResNet)."""
    kernel, _, _, dilation, _, _, width = geometry
    rows, cols = _starts(index, geometry)
    out = torch.empty_like(index, dtype=torch.uint8)
    step = -(-index.shape[0] // slices)
    for i in range(0, index.shape[0], step):
        part = index[i:i + step]
        row, col = part.div(width, rounding_mode="floor"), part.remainder(width)
        row.sub_(rows).div_(dilation[0], rounding_mode="floor").mul_(kernel[1])
        col.sub_(cols).div_(dilation[1], rounding_mode="floor")
        out[i:i + step] = row.add_(col)
    return out


def _index(offsets, geometry):
    """The int64 index max_pool2d returned, from the offsets: two int64 tensors at most."""
    kernel, _, _, dilation, _, _, width = geometry
    rows, cols = _starts(offsets, geometry)
    col = offsets.long()
    row = col.div(kernel[1], rounding_mode="floor")
    col.remainder_(kernel[1]).mul_(dilation[1]).add_(cols)
    row.mul_(dilation[0]).add_(rows).mul_(width).add_(col)
    return row  # in the offsets' (the output's) memory format
