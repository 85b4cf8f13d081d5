"""One training step, followed allocation by allocation: what it saves for the backward, by
module, and the most bytes alive at once, on real or fake tensors alike (`step`), or on a
fake copy of a model compressed by a policy (`fake_step`)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .. import models
from ..apply import policy as policy_mod
from ..apply.accounting import account, storage_key
from ..apply.compress import compress
from ..ops.fake import CpuKernels, ShapesOnly, unpacked_sequences
from . import footprint
from .profile import _to, forward_context
from .setups import fake_copy


class Live(TorchDispatchMode):
    """Every storage an op makes, as (allocation, +bytes) when first seen and (allocation,
    -bytes) when freed; storages it was told of (weights, inputs) are not followed."""

    def __init__(self, known):
        super().__init__()
        self.known = set(known)
        self.live: dict[int, tuple[int, int]] = {}  # storage_key -> (allocation, bytes)
        self.events: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out

    def _see(self, t):
        key = storage_key(t)
        if key in self.known or key in self.live:
            return
        storage = t.untyped_storage()
        allocation = len(self.events)
        self.live[key] = (allocation, storage.nbytes())
        self.events.append((allocation, storage.nbytes()))
        weakref.finalize(storage, self._free, key)

    def _free(self, key):
        allocation, n = self.live.pop(key)
        self.events.append((allocation, -n))

    def _allocations(self, keys) -> set[int]:
        return {self.live[k][0] for k in keys if k in self.live}

    def alive_at_peak(self, leave_out=()) -> set[int]:
        """The allocations alive when the most bytes were (the first such moment),
        allocations in `leave_out` aside."""
        leave_out = self._allocations(leave_out)
        events = [(a, n) for a, n in self.events if a not in leave_out]
        now = best = end = 0
        for i, (_, n) in enumerate(events):
            now += n
            if now > best:
                best, end = now, i + 1
        alive = set()
        for allocation, n in events[:end]:
            if n > 0:
                alive.add(allocation)
            else:
                alive.discard(allocation)
        return alive

    def peak(self, leave_out=(), between=None, rounded=False) -> int:
        """The most bytes alive at once, allocations in `leave_out` aside; with `between`, a
        pair of event counts, the most alive from the first to the second; with `rounded`,
        each block rounded up as the CUDA allocator rounds it."""
        leave_out = self._allocations(leave_out)
        start, end = between or (0, len(self.events))
        now = peak = 0
        for i, (allocation, n) in enumerate(self.events[:end]):
            if allocation not in leave_out:
                now += (footprint.rounded(n) if n > 0 else -footprint.rounded(-n)) \
                    if rounded else n
                if i + 1 >= start:  # after event i, `i + 1` events have happened
                    peak = max(peak, now)
        return peak


def distinct(tensors) -> dict[int, torch.Tensor]:
    return {storage_key(t): t for t in tensors}


def step(model, inputs, precision, window_peaks=None, peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one forward and backward of `model` on `inputs`, fake
    or real tensors alike: the peak is the most bytes alive at once of the storages the step
    makes, the parameters' gradients aside. `window_peaks`, a dict keyed by module names, gets
    for each the most bytes alive while its backward ran (from its output's gradient to its
    input's), where it ran once. `peaks`, a dict, gets "rounded": the peak with every block
    rounded up as the CUDA allocator rounds it."""
    weights = distinct((*model.parameters(), *model.buffers()))
    given = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]  # any batch form
    live = Live((*weights, *distinct(given)))
    marks = {name: {"calls": 0, "events": []} for name in window_peaks or ()}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(_marking(live, marks[name]))
               for name in marks]

    def loss():
        with forward_context(precision, "cpu"):
            return models.loss_of(models.call(model, inputs))

    try:
        with live:
            saved, out = account(model, loss, given)
            # what the forward kept, by allocation: every saved storage is alive now, so its
            # key names it (a key freed later may name another storage)
            kept = {live.live[k][0]: n for k, n in saved.storages.items() if k in live.live}
            out.backward()
            del out
    finally:
        for h in handles:
            h.remove()
    grads = distinct(p.grad for p in model.parameters() if p.grad is not None)
    for name, window in marks.items():
        if window["calls"] == 1 and len(window["events"]) == 2:
            window_peaks[name] = live.peak(grads, between=window["events"])
    if peaks is not None:
        peaks["rounded"] = live.peak(grads, rounded=True)
        alive = live.alive_at_peak(grads)
        peaks["kept"] = sum(n for a, n in kept.items() if a in alive)
    return saved, live.peak(grads)


def _marking(live: Live, window: dict):
    """A forward hook noting the event counts when the gradient of the module's first output
    arrives and when that of its first input leaves: its backward's window."""
    def hook(module, args, output):
        window["calls"] += 1
        ends = [next((t for t in tree_leaves(x) if isinstance(t, torch.Tensor)), None)
                for x in (output, args)]
        if window["calls"] == 1 and all(t is not None and t.requires_grad for t in ends):
            for t in ends:
                t.register_hook(lambda g: window["events"].append(len(live.events)))
    return hook


def fake_step(model, example, policy: policy_mod.Policy, precision: str,
              kernels: str = "cuda", counter=None, window_peaks=None) -> tuple:
    """(SavedBytes, activation peak) of one training step of a copy of `model` (the given
    module, untouched) on fake tensors, compressed by `policy`, on inputs shaped as `example`
    (real tensors: a tensor, a tuple or a dict). `counter`, a dispatch mode such as torch's
    FlopCounterMode, watches the step. `window_peaks`: as `step`'s."""
    mode = ShapesOnly(kernels, skip_repeats=counter is None)  # a counter sees every op
    inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                      example)
    with mode, CpuKernels(), unpacked_sequences():
        copy_ = fake_copy(model, mode, precision)
        if precision == "bf16":
            inputs = _to(inputs, "cpu", torch.bfloat16)
        if policy.rules:
            compress(copy_, policy, allow_more=True)  # priced, whatever it keeps
        with counter if counter is not None else contextlib.nullcontext():
            return step(copy_, inputs, precision, window_peaks)
