"""What the benchmark scripts share: median timing, saved-byte counting, table rows, and fast
bfloat16 matrix products on CPUs without native bfloat16."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path


def median_time(fn, repeats: int, warmup: bool = False) -> tuple[float, object]:
    """Median wall time of `repeats` calls (seconds) and the last call's result."""
    if warmup:
        fn()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def saved_storages(fn, *args, skip=()) -> tuple[dict, object]:
    """({storage: bytes} autograd keeps for fn(*args)'s backward, each storage once, the
    storages of the tensors in `skip` (parameters) aside; fn's result)."""
    import torch

    skipped = {t.untyped_storage().data_ptr() for t in skip}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skipped:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return storages, out


def at_peak(step, top=6) -> list[str]:
    """What is allocated when one call of step() peaks on the GPU: the CUDA allocator's
    history of the call replayed; the largest blocks then, each with the frame that allocated
    it (the first one outside torch itself). Lines of text."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step()
    torch.cuda.synchronize()
    events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, at = total, dict(live)
    lines = [f"  peak {(before + peak) / 2**20:.1f} MiB: {before / 2**20:.1f} allocated before, "
             f"{peak / 2**20:.1f} during the step; the largest blocks then:"]
    for e in sorted(at.values(), key=lambda e: -e["size"])[:top]:
        frames = e.get("frames") or [{}]
        where = next((f for f in frames if "/torch/" not in f.get("filename", "")), frames[0])
        lines.append(f"    {e['size'] / 2**20:8.1f} MiB  {where.get('name', '?')} "
                     f"({Path(where.get('filename', '?')).name}:{where.get('line', '?')})")
    return lines


def live_at_peak(step, top=6) -> tuple[int, list[str]]:
    """The CPU's stand-in for at_peak, which needs the CUDA allocator: (the peak bytes of the
    storages that aten ops create during one call of step(), lines saying what is alive then).

    Every storage an op makes is counted from its creation until its last reference dies (a
    weak reference on the storage, as torch's own MemTracker does), views and in-place
    results once; the largest alive at the peak are listed with the op and the frame that
    made them. What is allocated outside aten (numpy buffers of the CPU kernels, library
    workspaces) is not seen; the CUDA paths of our ops make no such buffers. Triton's
    interpreter (TRITON_INTERPRET=1, to follow the CUDA paths on a CPU) keeps a kernel's
    arguments in a reference cycle, so there the collector runs before every op."""
    import gc
    import os
    import traceback
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live, refs, state = {}, {}, {"now": 0, "peak": 0, "at": {}}

    def freed(key, _ref):
        size = live.pop(key, (0,))[0]
        refs.pop(key, None)
        state["now"] -= size

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if interpreted:
                gc.collect()
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in live or key in inputs or not storage.nbytes():
                    continue  # counted already, or a view or in-place result of an input
                where = "?"
                if storage.nbytes() >= 2**20:  # where the large ones come from
                    frames = [f for f in traceback.extract_stack()[:-1]
                              if "/torch/" not in f.filename]
                    if frames:
                        where = f"{frames[-1].name} ({Path(frames[-1].filename).name}:" \
                                f"{frames[-1].lineno})"
                live[key] = (storage.nbytes(), func.__name__, where)
                refs[key] = weakref.ref(storage, lambda ref, key=key: freed(key, ref))
                state["now"] += storage.nbytes()
                if state["now"] > state["peak"]:
                    state["peak"], state["at"] = state["now"], dict(live)
            return out

    with Track():
        step()
    lines = [f"  peak {state['peak'] / 2**20:.1f} MiB made during the step; the largest "
             "alive then:"]
    for size, op, where in sorted(state["at"].values(), key=lambda e: -e[0])[:top]:
        lines.append(f"    {size / 2**20:8.1f} MiB  {op} in {where}")
    return state["peak"], lines


def table(header: list[str], markdown: bool, width: int = 16, first: int = 0):
    """Print the header (and a markdown separator); return the function printing a row.
    Plain rows: the first column left-aligned in `first` characters (if set), the others
    right-aligned in `width`."""
    def row(cells):
        if markdown:
            return print("| " + " | ".join(cells) + " |", flush=True)
        head = f"{cells[0]:<{first}}" if first else f"{cells[0]:>{width}}"
        print(head + "".join(f"{c:>{width}}" for c in cells[1:]), flush=True)

    row(header)
    if markdown:
        row(["---"] * len(header))
    return row


def emulate_bf16_matmuls(device: str, precision: str, native: bool = False) -> bool:
    """Whether to use float32_matmuls: a bfloat16 run on a CPU with AVX2 at most, where
    torch's bfloat16 matrix products run 15-100x slower than float32 ones."""
    import torch

    return (device == "cpu" and precision != "fp32" and not native
            and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"))


def float32_matmuls(enabled: bool = True):
    """A context in which every bfloat16 matrix product (mm, addmm, bmm, baddbmm; mm into
    `out`) takes its bfloat16 operands to float32, multiplies with float32 accumulation and
    rounds the result to bfloat16 once: what a bfloat16 GEMM with float32 accumulation
    computes (GPUs, recent CPUs), to summation order. Step times under it are not those of
    native kernels."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    if not enabled:
        return contextlib.nullcontext()
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    def bf16(a):
        return getattr(a, "dtype", None) == torch.bfloat16

    class Float32Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in matmuls and any(bf16(a) for a in args):
                wide = [a.float() if bf16(a) else a for a in args]
                return func(*wide, **kwargs).to(torch.bfloat16)
            if func is aten.mm.out and bf16(kwargs["out"]):
                return kwargs["out"].copy_(self.__torch_dispatch__(aten.mm.default, types, args))
            return func(*args, **kwargs)

    return Float32Matmuls()
