"""Benchmark of the generated few-bit op against torch's own activation, in the same run.

For each activation, size and dtype: forward and backward time (median), their ratio to
torch, and the bytes saved for backward per element (torch keeps the input; we keep b bits).
CPU runs the numba kernels; CUDA, when present, the Triton kernels, with achieved bandwidth
and a bit-for-bit check of their codes and gradients against the CPU reference.

Run: .venv/bin/python benchmarks/runtime.py [--quick] [--markdown] [--device cpu|cuda|all]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
import torch.nn.functional as F
from measure import median_time, saved_storages, table

from actdesign import runtime, spec
from actdesign.designer import fit_stepwise

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
BITS = (1, 2, 3, 4, 8)


def saved_bytes(fn, x) -> int:
    """Bytes of distinct storages autograd saves for fn(x)'s backward."""
    return sum(saved_storages(fn, x)[0].values())


def timer(device):
    if device == "cuda":
        def measure(fn, repeats):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def measure(fn, repeats):
            return median_time(fn, repeats, warmup=True)[0]
    return measure


def bench(fn, ops, n, dtype, device, repeats):
    measure = timer(device)
    x = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(n, device=device, dtype=dtype)
    row = {}
    for who, f in (("torch", fn), ("ours", ops.apply)):
        y = f(x)
        fwd = measure(lambda f=f: f(x), repeats)
        bwd = measure(lambda y=y: torch.autograd.grad(y, x, g, retain_graph=True), repeats)
        row[who] = (fwd, bwd, saved_bytes(f, x) / n)
    return row


def exact_on_device(ops, n, dtype, device) -> bool:
    """The device kernels give the CPU reference's codes and gradients, bit for bit."""
    x = torch.randn(n, device=device, dtype=dtype) * 2
    g = torch.randn(n, device=device, dtype=dtype)
    y, packed = ops._forward_op(x)
    _, packed_ref = ops._forward_torch(x.cpu())
    dx_ref = ops._backward_torch(packed_ref, g.cpu())
    return torch.equal(packed.cpu(), packed_ref) and torch.equal(
        ops._backward_op(packed, g).cpu(), dx_ref)


def bandwidth_gbs(n, itemsize, bits, fwd, bwd):
    """Achieved GB/s: forward reads x, writes y and codes; backward reads codes and g, writes dx."""
    moved_fwd = n * (2 * itemsize + bits / 8)
    moved_bwd = n * (2 * itemsize + bits / 8)
    return moved_fwd / fwd / 1e9, moved_bwd / bwd / 1e9


def peak_bandwidth_gbs():
    props = torch.cuda.get_device_properties(0)
    clock = getattr(props, "memory_clock_rate", 0)  # kHz
    width = getattr(props, "memory_bus_width", 0)  # bits
    return 2 * clock * 1e3 * width / 8 / 1e9 if clock and width else None


def run(device, sizes, dtypes, bits_list, repeats, markdown):
    print(f"\n## {device.upper()}\n")
    if device == "cuda":
        peak = peak_bandwidth_gbs()
        print(f"Device: {torch.cuda.get_device_name(0)}; peak memory bandwidth "
              f"{peak:.0f} GB/s" if peak else f"Device: {torch.cuda.get_device_name(0)}")
    header = ["act", "bits", "dtype", "n", "torch fwd ms", "ours fwd ms", "fwd ratio",
              "torch bwd ms", "ours bwd ms", "bwd ratio", "fwd+bwd ratio", "saved B/elem torch",
              "saved B/elem ours"]
    if device == "cuda":
        header += ["fwd GB/s", "bwd GB/s", "exact"]
    line = table(header, markdown, width=13)
    totals = []
    for name, fn in ACTIVATIONS.items():
        for bits in bits_list:
            ops = runtime.load(spec.from_fit(fit_stepwise(name, bits)))
            for dtype in dtypes:
                for n in sizes:
                    r = bench(fn, ops, n, dtype, device, repeats)
                    (tf, tb, ts), (of, ob, os_) = r["torch"], r["ours"]
                    totals.append((of + ob) / (tf + tb))
                    cells = [name, str(bits), str(dtype).replace("torch.", ""),
                             f"2^{n.bit_length() - 1}",
                             f"{tf * 1e3:.3f}", f"{of * 1e3:.3f}", f"{of / tf:.2f}",
                             f"{tb * 1e3:.3f}", f"{ob * 1e3:.3f}", f"{ob / tb:.2f}",
                             f"{(of + ob) / (tf + tb):.2f}", f"{ts:.3f}", f"{os_:.3f}"]
                    if device == "cuda":
                        gf, gb = bandwidth_gbs(n, torch.finfo(dtype).bits // 8, bits, of, ob)
                        exact = exact_on_device(ops, n, dtype, device)
                        cells += [f"{gf:.0f}", f"{gb:.0f}", "yes" if exact else "NO"]
                    line(cells)
    print(f"\nmedian fwd+bwd ratio over {len(totals)} rows: {statistics.median(totals):.2f} "
          f"(max {max(totals):.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, bits and repeats")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = parser.parse_args()
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    bits_list = (3,) if args.quick else BITS
    if args.device in ("cpu", "all"):
        sizes = [2**16, 2**20] if args.quick else [2**16, 2**18, 2**20, 2**22, 2**24]
        run("cpu", sizes, [torch.float32, torch.bfloat16], bits_list, 3 if args.quick else 9,
            args.markdown)
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        sizes = [2**16, 2**20] if args.quick else [2**16, 2**18, 2**20, 2**22, 2**24]
        run("cuda", sizes, [torch.float32, torch.bfloat16, torch.float16], bits_list,
            20 if args.quick else 100, args.markdown)


if __name__ == "__main__":
    main()
