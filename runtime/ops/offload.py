"""Block inputs kept in host memory: what a recomputed block keeps for its backward (its
inputs, `recompute`) moves to host memory in the forward and comes back for the block's
backward, so the device holds one block's worth at a time.

Applied as a saved-tensors hook around the checkpoint: the checkpoint saves its inputs
through the hook, while everything saved inside the block goes to the checkpoint's own hook
(the innermost hook wins), which keeps nothing. On CUDA the copies run on a side stream into
pinned memory, the forward going on meanwhile; in the backward, once a block's recompute has
run, the copy back of the inputs of the block before it (whose backward runs next) starts,
so they are on the device by the time they are read, and not while the recompute peaks.
On the CPU the copy is a plain one, host to host, read back as it is. A copy is exact, so
the step is the checkpointed step's, bit for bit.

A tensor several blocks take (transformers' rotary cos and sin, a mask) is copied once per
forward: later blocks reuse its host copy while the same tensor object, unchanged (its
version counter), is alive, and in the backward its device copy, once fetched, serves every
block that takes it. Parameters and buffers stay where they are.

Shape-only steps (fake tensors) copy nothing: the host copy is counted (`host_bytes`) and
the device tensor is made again, empty, when the backward needs it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from .fake import is_fake

_STATE = threading.local()  # the forward's host copies and counters


class _Held:
    """A block input on the host, and its way back. One several blocks take (`shared`) keeps
    its device copy once fetched, for the blocks whose backward reads it next."""

    def __init__(self, tensor: torch.Tensor):
        self.device, self.dtype = tensor.device, tensor.dtype
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.nbytes = tensor.numel() * tensor.element_size()
        # a shape-only step keeps no reference to the device tensor, so it dies as a real
        # one would once copied
        self.host = None if is_fake(tensor) else _to_host(tensor)
        self.back = None  # the device copy, once prefetched
        self.shared = False
        self.fetched = False  # by its block's backward: a prefetch leaves it alone then

    def fetch(self) -> torch.Tensor:
        if self.back is None:
            self.back = self._copy_back()
        out, self.fetched = self.back, True
        if not self.shared:
            self.back = None
        if out.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(_side_stream(out.device))
        return out

    def prefetch(self) -> None:
        if self.back is None and not self.fetched:
            self.back = self._copy_back()

    def _copy_back(self) -> torch.Tensor:
        if self.host is None:  # shape-only: made again, inside the step's fake mode
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                       device=self.device)
        if self.device.type != "cuda":
            return self.host
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out = self.host.to(self.device, non_blocking=True)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out


class _Block:
    """What one block's checkpoint put on the host, and the block before it (weakly): its
    backward runs next, so its inputs are fetched while this one's runs."""

    def __init__(self, previous):
        self.held: list[_Held] = []
        self.previous = None if previous is None else weakref.ref(previous)

    def prefetch_previous(self) -> None:
        previous = None if self.previous is None else self.previous()
        if previous is not None:
            for held in previous.held:
                held.prefetch()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cuda":
        return tensor.detach().clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    stream = _side_stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        host.copy_(tensor.detach(), non_blocking=True)
    tensor.record_stream(stream)  # not reused before the copy is done
    return host


def _side_stream(device) -> torch.cuda.Stream:
    streams = _STATE.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _pack(tensor: torch.Tensor):
    if isinstance(tensor, torch.nn.Parameter) or not tensor.is_floating_point() \
            or tensor.numel() == 0:
        return tensor  # weights stay; integer positions and masks are small
    block = _STATE.block
    copies = _STATE.__dict__.setdefault("copies", {})
    found = copies.get(id(tensor))
    if found is not None and found[0]() is tensor and found[1] == tensor._version:
        found[2].shared = True
        return found[2]
    held = _Held(tensor)
    _count(held.nbytes)
    key = id(tensor)
    copies[key] = (weakref.ref(tensor, lambda _: copies.pop(key, None)), tensor._version, held)
    block.held.append(held)
    return held


def _unpack(packed):
    return packed.fetch() if isinstance(packed, _Held) else packed


@contextlib.contextmanager
def offloaded():
    """The saved-tensors hooks that keep what one block's checkpoint saves on the host; yields
    the block's record, whose `prefetch_previous` its recompute calls once it has run."""
    block = _Block(_STATE.__dict__.get("last"))
    _STATE.last, outer = block, _STATE.__dict__.get("block")
    _STATE.block = block
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield block
    finally:
        _STATE.block = outer


def _count(nbytes: int) -> None:
    counter = _STATE.__dict__.get("counter")
    if counter is not None:
        counter[0] += nbytes


@contextlib.contextmanager
def host_bytes():
    """Counts the bytes of block inputs copied to the host while open: yields [bytes]. In one
    training step that is what the host holds at most, since every input waits there until
    the backward has read it."""
    previous = _STATE.__dict__.get("counter")
    _STATE.counter = [0]
    try:
        yield _STATE.counter
    finally:
        _STATE.counter = previous
