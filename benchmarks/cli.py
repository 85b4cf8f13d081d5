"""The command line's latency: wall time of warm commands, where their imports go, the phases
of a 3-bit GELU fit, and a dense numpy dynamic program over the same kind of grid as the
baseline the fit must beat.

(a) `actdesign fit gelu --bits 3` (a cache hit, and a miss with --no-cache), `list` and
    `import actdesign.runtime`, each a fresh process, median of --repeats;
(b) the top-level packages' shares of `python -X importtime` for the fit and the import;
(c) the fit's phases in one process: parse, weight and grid, DP, refine, write;
(d) a dense O(K·N²) numpy DP over N = 4096 cells (every segment cost as one N×N matrix),
    checked to reach the product's optimum, and how many times slower it is than the
    warm fit.

Run: .venv/bin/python benchmarks/cli.py [--repeats 5] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from measure import median_time, table  # noqa: E402

FIT = ["-m", "actdesign.cli", "fit", "gelu", "--bits", "3"]


def wall(args, env, repeats):
    """Median wall seconds of `python args` in a fresh process."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def import_shares(args, env, top=5):
    """[(package, share, seconds)] of `python -X importtime`: every module's own time summed
    by its top-level package, largest first."""
    err = subprocess.run([sys.executable, "-X", "importtime", *args], env=env, check=True,
                         capture_output=True, text=True).stderr
    totals = {}
    for line in err.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) != 3 or not parts[0].strip().isdigit():  # the header line
            continue
        package = parts[2].strip().split(".")[0]
        totals[package] = totals.get(package, 0) + int(parts[0])
    whole = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [(p, t / whole, t / 1e6) for p, t in ranked]


def phases(out: Path):
    """Seconds of each phase of the fit, in this process (median of 3 after a warm-up)."""
    from actdesign import spec as spec_mod
    from actdesign.activation import resolve
    from actdesign.designer import stepwise
    from actdesign.designer.partition import optimal_partition
    from actdesign.designer.weights import Normal

    def once():
        marks = [time.perf_counter()]
        act = resolve("gelu")
        g, dg = act.df, act.d2f  # noqa: F841  (the numpy functions are part of parsing)
        marks.append(time.perf_counter())
        problem = stepwise.Problem(act, Normal())
        problem.reference()
        cuts, prefix = stepwise.grid_prefix_sums(problem, problem.grid(stepwise.default_grid(3)))
        marks.append(time.perf_counter())
        index, _ = optimal_partition(*prefix, 8)
        marks.append(time.perf_counter())
        borders, _, _ = stepwise.refine(problem, cuts[index[1:-1]])
        problem.error(borders, problem.levels(borders))
        marks.append(time.perf_counter())
        spec_mod.save(spec_mod.from_fit(fit), out)
        marks.append(time.perf_counter())
        return np.diff(marks)

    fit = stepwise.fit_stepwise("gelu", 3)
    once()
    runs = np.array([once() for _ in range(3)])
    whole, _ = median_time(lambda: stepwise.fit_stepwise("gelu", 3), 3)
    names = ("parse", "weight, grid, prefix sums", "DP", "refine, error", "write")
    return dict(zip(names, np.median(runs, axis=0), strict=True)), whole


def dense_dp(W, F, S, segments):
    """The textbook DP: every segment's cost as an (N+1)×(N+1) matrix, then K - 1 min-plus
    steps over it. Returns (best cost, seconds)."""
    start = time.perf_counter()
    with np.errstate(divide="ignore", invalid="ignore"):
        dw = W[None, :] - W[:, None]  # [j, i]: the segment of cells j..i-1
        df = F[None, :] - F[:, None]
        cost = np.where(dw > 0, (S[None, :] - S[:, None]) - df * df / dw, 0.0)
    cost = np.maximum(cost, 0.0)
    cost[np.tril_indices_from(cost)] = np.inf  # a segment ends after it starts
    best = cost[0].copy()
    for _ in range(segments - 1):
        best = np.min(best[:, None] + cost, axis=0)
    return float(best[-1]), time.perf_counter() - start


def dense_baseline(cells=4096):
    """(dense seconds, dense optimum, product's optimum) on one 4096-cell grid of the fit."""
    from actdesign.activation import resolve
    from actdesign.designer import stepwise
    from actdesign.designer.partition import optimal_partition
    from actdesign.designer.weights import Normal

    problem = stepwise.Problem(resolve("gelu"), Normal())
    _, prefix = stepwise.grid_prefix_sums(problem, problem.grid(cells))
    _, ours = optimal_partition(*prefix, 8)
    runs = [dense_dp(*prefix, 8) for _ in range(3)]
    return statistics.median(s for _, s in runs), runs[0][0], float(ours)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "ACTDESIGN_CACHE_DIR": folder}
        out = str(Path(folder) / "g.json")
        subprocess.run([sys.executable, *FIT, "--out", out], env=env, check=True,
                       capture_output=True)  # fills the cache and numba's
        hit = wall([*FIT, "--out", out], env, args.repeats)
        miss = wall([*FIT, "--no-cache", "--out", out], env, args.repeats)
        listed = wall(["-m", "actdesign.cli", "list"], env, args.repeats)
        runtime = wall(["-c", "import actdesign.runtime"], env, args.repeats)
        python = wall(["-c", "pass"], env, args.repeats)
        print(f"(a) wall time, fresh process, median of {args.repeats}")
        row = table(["command", "seconds"], args.markdown, width=12, first=44)
        for name, seconds in (("python -c pass", python), ("fit gelu --bits 3 (cache hit)", hit),
                              ("fit gelu --bits 3 --no-cache (miss)", miss), ("list", listed),
                              ("import actdesign.runtime", runtime)):
            row([name, f"{seconds:.3f}"])
        print("\n(b) -X importtime: top-level packages' shares")
        row = table(["run", "package", "share", "seconds"], args.markdown, width=12, first=30)
        for name, run in (("fit (cache hit)", [*FIT, "--out", out]),
                          ("fit --no-cache", [*FIT, "--no-cache", "--out", out]),
                          ("import actdesign.runtime", ["-c", "import actdesign.runtime"])):
            for package, share, seconds in import_shares(run, env):
                row([name, package, f"{share:.1%}", f"{seconds:.3f}"])
        print("\n(c) the fit's phases, in process (median of 3, warm)")
        row = table(["phase", "seconds"], args.markdown, width=12, first=28)
        split, in_process = phases(Path(out))
        for name, seconds in split.items():
            row([name, f"{seconds:.4f}"])
        row(["fit_stepwise('gelu', 3), whole", f"{in_process:.4f}"])
    dense, dense_best, ours = dense_baseline()
    print("\n(d) dense numpy DP, N = 4096 cells, K = 8 (3-bit gelu, normal weight)")
    row = table(["", "value"], args.markdown, width=16, first=40)
    row(["dense DP seconds (median of 3)", f"{dense:.3f}"])
    row(["optimum: dense / product (rel. diff)",
         f"{abs(dense_best - ours) / ours:.1e}"])
    row(["dense DP / in-process fit", f"{dense / in_process:.2f}x"])
    row(["dense DP / CLI fit, cache miss (wall)", f"{dense / miss:.2f}x"])
    row(["dense DP / CLI fit, cache hit (wall)", f"{dense / hit:.2f}x"])
    if not abs(dense_best - ours) <= 1e-9 * ours:
        raise SystemExit("the dense DP and the product disagree on the optimum")


if __name__ == "__main__":
    main()
