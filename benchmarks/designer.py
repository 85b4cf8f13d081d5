"""Benchmark of the stepwise designer: fit time, fit quality, and the exact grid DP against the
dense O(N²)-memory DP of the literature on the same prefix sums.

Run: .venv/bin/python benchmarks/designer.py [--markdown] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
from measure import median_time

from actdesign.activation import resolve
from actdesign.designer import Normal, Uniform, fit_stepwise
from actdesign.designer.partition import optimal_partition
from actdesign.designer.stepwise import Problem, default_grid, grid_prefix_sums

ACTIVATIONS = ("gelu", "silu", "tanh", "sigmoid", "hardswish")
BITS = (1, 2, 3, 4, 8)
WEIGHTS = {"normal": Normal(), "uniform[-8,8]": Uniform(-8, 8)}
DP_CELLS = 4096
SAME_RTOL = 1e-9


def prefix_sums(activation, weight, cells: int):
    """The prefix arrays W, F, S that fit_stepwise hands to optimal_partition."""
    problem = Problem(activation, weight)
    return grid_prefix_sums(problem, problem.grid(cells))[1]


def dense_partition(W, F, S, segments: int):
    """Baseline: the full (N+1)×(N+1) segment-cost matrix, then one min-plus step per level."""
    n = W.size - 1
    dW = W[None, :] - W[:, None]  # [j, i] = W[i] - W[j]
    dF = F[None, :] - F[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(dW != 0, (S[None, :] - S[:, None]) - dF * dF / dW, 0.0)
    del dW, dF
    upper = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    cost[~upper] = np.inf  # a segment [j, i) needs j < i
    dp = np.full(n + 1, np.inf)
    dp[0] = 0.0
    back = np.empty((segments, n + 1), dtype=np.int64)
    for k in range(segments):
        M = dp[:, None] + cost
        back[k] = np.argmin(M, axis=0)
        dp = np.min(M, axis=0)
    cuts = [n]
    for k in range(segments - 1, -1, -1):
        cuts.append(int(back[k][cuts[-1]]))
    return np.array(cuts[::-1]), float(dp[n])


def same_cost(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_RTOL * max(abs(a), abs(b), 1e-300)


def fit_row(activation, weight, bits: int, repeats: int) -> dict:
    fit_stepwise(activation, bits, weight)  # warm numba and the sympy-built callables
    seconds, fit = median_time(lambda: fit_stepwise(activation, bits, weight), repeats)
    gain = (fit.grid_error - fit.error) / fit.grid_error if fit.grid_error > 0 else 0.0
    return {"fit_s": seconds, "grid": fit.grid_size, "E": fit.error,
            "rel": fit.relative_error, "gain": gain, "iters": fit.iterations,
            "stat": fit.stationarity}


def dp_row(activation, weight, bits: int, repeats: int, dense_repeats: int) -> dict:
    prefix = prefix_sums(activation, weight, DP_CELLS)
    K = 2**bits
    optimal_partition(*prefix, K)  # warm (numba's on-disk cache still needs loading)
    ours_s, (_, ours_cost) = median_time(lambda: optimal_partition(*prefix, K), repeats)
    row = {"N": prefix[0].size - 1, "ours_s": ours_s, "dense_s": None, "speedup": None,
           "same": None}
    if dense_repeats > 0:
        dense_s, (_, dense_cost) = median_time(lambda: dense_partition(*prefix, K),
                                               dense_repeats)
        row.update(dense_s=dense_s, speedup=dense_s / ours_s,
                   same=same_cost(ours_cost, dense_cost))
    return row


def cli_time(repeats: int) -> float:
    """Warm end-to-end time of `actdesign fit gelu --bits 3 --out FILE` in a fresh process."""
    script = Path(sys.executable).parent / "actdesign"
    cmd = [str(script)] if script.exists() else \
        [sys.executable, "-c", "from actdesign.cli import main; main()"]
    with tempfile.TemporaryDirectory() as tmp:
        args = cmd + ["fit", "gelu", "--bits", "3", "--out", str(Path(tmp) / "gelu3.json")]

        def run():
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)

        run()  # warm the OS file cache and numba's on-disk cache
        return median_time(run, repeats)[0]


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model}, {cores} cores; Python {platform.python_version()}, "
            f"numpy {np.__version__}, numba {numba.__version__}")


COLUMNS = [  # (header, key, format)
    ("activation", "act", "{}"), ("weight", "weight", "{}"), ("bits", "bits", "{}"),
    ("fit ms", "fit_s", "ms"), ("grid", "grid", "{}"), ("iters", "iters", "{}"),
    ("stat", "stat", "{:.0e}"), ("E", "E", "{:.4e}"), ("rel E", "rel", "{:.3e}"),
    ("refine gain", "gain", "pct"),
    ("N", "N", "{}"), ("ours ms", "ours_s", "ms"), ("dense ms", "dense_s", "ms"),
    ("speed-up", "speedup", "{:.0f}x"), ("same", "same", "yesno"),
]


def cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        ms = 1e3 * value
        return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"
    if fmt == "pct":  # exactly 0 stays distinguishable from a tiny gain
        return "0" if value == 0 else f"{100 * value:.2g}%"
    if fmt == "yesno":
        return "yes" if value else "no"
    return fmt.format(value)


def render(rows: list[dict], markdown: bool) -> str:
    headers = [h for h, _, _ in COLUMNS]
    body = [[cell(r[key], fmt) for _, key, fmt in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]

    def line(items):  # text columns left-aligned, numbers right-aligned
        return "  ".join(s.ljust(w) if i < 2 else s.rjust(w)
                         for i, (s, w) in enumerate(zip(items, widths, strict=True)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(b) for b in body])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--quick", action="store_true", help="skip the dense DP for 8 bits")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of fits and our DP")
    p.add_argument("--dense-repeats", type=int, default=None,
                   help="timed repeats of the dense DP [1 for 8 bits, 3 otherwise]")
    p.add_argument("--activations", nargs="+", default=list(ACTIVATIONS), metavar="NAME")
    p.add_argument("--bits", nargs="+", type=int, default=list(BITS), metavar="B")
    p.add_argument("--grid-check", nargs="*", type=int, default=None, metavar="B",
                   help="also compare the default grid with a 4x finer one at these bits")
    return p.parse_args(argv)


def dense_repeats(args, bits: int) -> int:
    if args.quick and bits == 8:
        return 0
    if args.dense_repeats is not None:
        return args.dense_repeats
    return 1 if bits == 8 else 3


def summary(rows: list[dict]) -> str:
    timed = [r for r in rows if r["speedup"] is not None]
    if not timed:
        return "dense DP skipped"
    same = sum(r["same"] for r in timed)
    # K = 2 is a single O(N) pass for us, so 1-bit rows would dominate a plain median.
    multi = [r["speedup"] for r in timed if r["bits"] >= 2]
    multi_text = f"; {statistics.median(multi):.0f}x without 1-bit rows" if multi else ""
    return (f"median speed-up of our DP over the dense DP at N={DP_CELLS}: "
            f"{statistics.median(r['speedup'] for r in timed):.0f}x over {len(timed)} rows"
            f"{multi_text}; same optimum in {same}/{len(timed)} rows")


def grid_check(activations: dict, bits_list) -> str:
    """Refined E from the default grid against a grid 4 times finer: where they differ, the
    problem has near-equal local optima that the coarser grid could not tell apart."""
    lines = ["| activation | weight | bits | grid | E | grid x4 | E (x4) | difference |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, act in activations.items():
        for label, weight in WEIGHTS.items():
            for bits in bits_list:
                fit = fit_stepwise(act, bits, weight)
                finer = fit_stepwise(act, bits, weight, grid=4 * default_grid(bits))
                diff = (fit.error - finer.error) / finer.error
                lines.append(f"| {name} | {label} | {bits} | {fit.grid_size} | "
                             f"{fit.error:.10e} | {finer.grid_size} | {finer.error:.10e} | "
                             f"{diff:+.1e} |")
                print(f"  grid check {name} {label} {bits} bits", file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"machine: {machine()}\n", flush=True)
    cases = [(name, label, bits) for name in args.activations for label in WEIGHTS
             for bits in args.bits]
    activations = {name: resolve(name) for name in args.activations}
    # All fits first: the dense DP's large temporaries should not disturb fit timings.
    rows = []
    for name, label, bits in cases:
        row = {"act": name, "weight": label, "bits": bits}
        rows.append(row | fit_row(activations[name], WEIGHTS[label], bits, args.repeats))
        print(f"  fit {name} {label} {bits} bits", file=sys.stderr, flush=True)
    # The first N² allocations of a process are several times slower; keep them untimed.
    dense_partition(*prefix_sums(activations[cases[0][0]], WEIGHTS[cases[0][1]], DP_CELLS), 1)
    for row in rows:
        name, label, bits = row["act"], row["weight"], row["bits"]
        row |= dp_row(activations[name], WEIGHTS[label], bits, args.repeats,
                      dense_repeats(args, bits))
        print(f"  dp {name} {label} {bits} bits", file=sys.stderr, flush=True)
    print(render(rows, args.markdown))
    print()
    print(summary(rows))
    print(f"warm CLI `actdesign fit gelu --bits 3 --out FILE`: {cli_time(5):.2f} s "
          "(median of 5 after one warm-up)")
    if args.grid_check:
        print("\ndefault grid against a 4x finer one, refined E:")
        print(grid_check(activations, args.grid_check))
    print(f"total benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
