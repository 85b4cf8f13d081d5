"""What the benchmark scripts share: median timing, saved-byte counting and table rows."""

from __future__ import annotations

import statistics
import time


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
