"""What one probe forward pass shows: which layers read a norm's output, and which layers'
inputs autograd keeps for something else anyway.

An MS norm emits its output in the autocast dtype, and its readers keep its x̂ in place of
the output; both are exact only if every use of the norm's output is the input of a
Linear-like layer (which casts to that dtype anyway, and can be made to keep x̂). One probe
forward under a TorchFunctionMode sees every torch call on the output (and on row-preserving
views of it: reshapes and basic indexing that keep the last dimension); a call anywhere else,
or the output being returned from the model, says why the norm stays as it is.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..ops.hooks import observer
from ..ops.known_modules import linear_like
from .accounting import storage_key

# Calls that read only metadata.
_METADATA = {"size", "dim", "shape", "dtype", "device", "ndim", "is_contiguous", "stride",
             "numel", "__len__", "requires_grad", "is_floating_point", "layout", "is_cuda",
             "grad_fn", "is_leaf", "data_ptr", "element_size", "storage_offset", "names",
             "is_complex", "get_device", "_version", "is_sparse", "is_quantized", "is_meta",
             "is_nested", "__format__"}
# Views that keep each row of the last dimension intact when that dimension is kept.
_ROW_VIEWS = {"view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze", "__getitem__",
              "unflatten", "expand"}


def _name(func) -> str:
    owner = getattr(func, "__self__", None)  # a property getter: the descriptor's name
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "__get__")
    return getattr(func, "__name__", repr(func))


def _basic_index_keeps_last(index, dim: int) -> bool:
    """x[index] with ints, slices, None and Ellipsis only, leaving the last dimension whole."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, int | slice) or i is None or i is Ellipsis for i in items):
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return all(i is None for i in after)
    addressed = [i for i in items if i is not None]
    if len(addressed) < dim:
        return True
    return addressed[dim - 1] == slice(None)


class _Probe(TorchFunctionMode):
    def __init__(self, norms: dict):
        super().__init__()
        self.norm_of = {}  # id(tensor) -> norm name, for outputs and their row views
        self.keep = []  # the watched tensors stay alive, so their ids stay unique
        self.width = {}  # norm name -> features
        self.consumers = {name: [] for name in norms}
        self.blocked = {}  # norm name -> why
        self.stack = []  # (module, its first input)

    def watch(self, t, name):
        self.norm_of[id(t)] = name
        self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hits = {self.norm_of[id(t)] for t in leaves if id(t) in self.norm_of}
        if not hits:
            return out
        name = _name(func)
        if name in _METADATA:
            return out
        for norm in hits:
            reader = self._reader(norm)
            if reader is not None:
                if reader not in self.consumers[norm]:
                    self.consumers[norm].append(reader)
            elif name in _ROW_VIEWS and self._keeps_rows(args, out, norm, name):
                self.watch(out, norm)
            else:
                self.blocked.setdefault(norm, f"its output is also read by {name}() outside a "
                                              "Linear layer, which needs the output itself")
        return out

    def _reader(self, norm):
        """The outermost Linear-like module running whose input is the norm's output (a
        LoRA layer, rather than the base layer inside it), or None."""
        return next((m for m, first in self.stack if linear_like(m)
                     and self.norm_of.get(id(first)) == norm), None)

    def _keeps_rows(self, args, out, norm, name) -> bool:
        if not isinstance(out, torch.Tensor) or out.dim() == 0 \
                or out.shape[-1] != self.width[norm]:
            return False
        if name == "__getitem__":
            return _basic_index_keeps_last(args[1], args[0].dim())
        return name != "expand" or out.shape[-1] == args[0].shape[-1]


@contextlib.contextmanager
def _module_hooks(model: torch.nn.Module, pre, post):
    """pre(module, its first input) before and post(module, its output) after every module's
    forward, while the context is open."""
    @observer
    def before(module, args, kwargs):
        pre(module, args[0] if args else next(iter(kwargs.values()), None))

    @observer
    def after(module, args, kwargs, output):
        post(module, output)

    handles = [h for m in model.modules() for h in (
        m.register_forward_pre_hook(before, with_kwargs=True),
        m.register_forward_hook(after, with_kwargs=True, always_call=True))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def norm_consumers(model: torch.nn.Module, norms: dict, run) -> dict:
    """{norm name: [the Linear-like modules reading its output] or a string saying why its
    output has another use}. `norms` maps names to modules; `run()` does one forward of
    `model`."""
    probe = _Probe(norms)
    by_module = {m: n for n, m in norms.items()}

    def pre(module, first):
        probe.stack.append((module, first))

    def post(module, output):
        probe.stack.pop()
        if module in by_module and isinstance(output, torch.Tensor):
            probe.width[by_module[module]] = output.shape[-1]
            probe.watch(output, by_module[module])

    with _module_hooks(model, pre, post), torch.no_grad(), probe:
        output = run()
    for t in tree_leaves(list(output.values()) if isinstance(output, dict) else output):
        if isinstance(t, torch.Tensor) and id(t) in probe.norm_of:
            probe.blocked.setdefault(probe.norm_of[id(t)], "its output is a model output")
    result = {}
    for name in norms:
        if name in probe.blocked:
            result[name] = probe.blocked[name]
        elif name not in probe.width:
            result[name] = "the probe forward did not run it"
        elif not probe.consumers[name]:
            result[name] = "no Linear layer reads its output"
        else:
            result[name] = probe.consumers[name]
    return result


class Saves:
    """Who keeps what on one forward with grad (`record_saves`): the input storage of each
    watched module, and the module stacks that were running when autograd saved each
    storage."""

    def __init__(self):
        self.inputs, self.stacks = {}, {}

    def inputs_kept_elsewhere(self, candidates: set, planned=()) -> set:
        """The modules among `candidates` whose input autograd also keeps for something that
        is not a candidate (attention keeping its output, which the next projection reads; a
        norm keeping its output): a compressed copy of that input would add bytes, not
        replace them. What a module in `planned` saves is not counted: a rule replaces it,
        and it will keep something else."""
        elsewhere = self._elsewhere(candidates, planned)
        return {m for m, key in self.inputs.items()
                if m in candidates and any(map(elsewhere, self.stacks.get(key, ())))}

    def own_kept_elsewhere(self, candidates: set, planned=()) -> set:
        """The modules among `candidates` that keep something of their own (autograd saves it
        while they run innermost) and all of whose keeps another module keeps too (a ReLU's
        output, which the convolution reading it keeps): codes in their place would add
        bytes. `planned`: as `inputs_kept_elsewhere`'s."""
        elsewhere, own = self._elsewhere(candidates, planned), {}
        for key, stacks in self.stacks.items():
            for stack in stacks:
                if stack and stack[-1] in candidates:
                    own.setdefault(stack[-1], set()).add(key)
        return {m for m, keys in own.items()
                if all(any(map(elsewhere, self.stacks[k])) for k in keys)}

    @staticmethod
    def _elsewhere(candidates, planned):
        """Whether a save's module stack holds no candidate or planned module."""
        owners = set(candidates) | set(planned)
        return lambda stack: not any(m in owners for m in stack)


def record_saves(model: torch.nn.Module, watched: set, run) -> Saves:
    """One forward of `run()` with grad, noting the input storage of each module in
    `watched` and the module stack under which autograd saves each storage."""
    saves, stack, alive = Saves(), [], []

    def pre(module, first):
        stack.append(module)
        if module in watched and isinstance(first, torch.Tensor):
            saves.inputs[module] = storage_key(first)
            alive.append(first)  # its address stays its own: no later storage reuses it

    def pack(t):
        saves.stacks.setdefault(storage_key(t), set()).add(tuple(stack))
        return t

    with _module_hooks(model, pre, lambda module, output: stack.pop()), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saves
