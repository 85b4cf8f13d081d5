"""Exact bit allocation against the published heap greedy, in one run: time and variance.

Items are (layer, sample) pairs: C log-normal, weights equal, one of 20 per-layer sizes, or
all different; the budget is 2 bits on average.

Run: .venv/bin/python benchmarks/allocate.py [--markdown]
"""

from __future__ import annotations

import argparse

import numpy as np
from measure import median_time, table

from actdesign.designer.allocate import allocate, greedy_heap, variance

WEIGHTS = {
    "equal": lambda rng, n: np.full(n, 256.0),
    "20 layer sizes": lambda rng, n: rng.choice(rng.integers(100, 5000, 20), n).astype(float),
    "all different": lambda rng, n: rng.uniform(50, 1000, n),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    header = ["weights", "items", "exact s", "greedy s", "exact variance", "greedy / exact",
              "core raises"]
    row = table(header, args.markdown, first=16)
    allocate(np.ones(2), np.ones(2), 4.0)  # compile once
    for name, make in WEIGHTS.items():
        for n in (1_000, 10_000, 100_000):
            rng = np.random.default_rng(n)
            C, w = rng.lognormal(0, 2, n), make(rng, n)
            budget = 2.0 * w.sum()
            t_exact, result = median_time(lambda C=C, w=w, b=budget: allocate(C, w, b), 3)
            t_greedy, bits = median_time(lambda C=C, w=w, b=budget: greedy_heap(C, w, b), 1)
            ratio = variance(C, bits) / result.variance
            row([name, f"{n:,}", f"{t_exact:.3f}", f"{t_greedy:.3f}",
                       f"{result.variance:.8e}", f"{ratio:.8f}", str(result.core)])


if __name__ == "__main__":
    main()
