"""Piecewise-linear fits (`--kind pwl`): objective, max error and fit time, against the
published 2-bit fits (ReGELU2, ReSiLU2) under the published objective, ∫ (h - h~)² dx over
the whole line.

Run: .venv/bin/python benchmarks/pwl.py [--markdown]
"""

from __future__ import annotations

import argparse

from measure import median_time, table

from actdesign.activation import resolve
from actdesign.designer.pwl import fit_pwl, whole_line_objective

PUBLISHED = {  # (a, c) from the published CUDA kernels
    "gelu": ([-0.04922261145617846, 1.0979632065417297, -0.048740595085551286],
             [-3.1858810036855245, -0.001178821281161997, 3.190832613414926]),
    "silu": ([-0.04060357190528599, 1.080925428529668, -0.040321856624382146],
             [-6.3050461001646445, -0.0008684942046214787, 6.325815242089708]),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    header = ["act", "bits", "domain B", "objective (whole line)", "published", "ours/published",
              "max abs error", "fit s"]
    row = table(header, args.markdown, width=24)
    for name in ("gelu", "silu"):
        act = resolve(name)
        for bits in (1, 2, 3, 4):
            seconds, fit = median_time(lambda act=act, bits=bits: fit_pwl(act, bits), 1)
            ours = whole_line_objective(act, fit.knots, fit.coefficients, fit.left)
            theirs, ratio = "", ""
            if bits == 2:
                a, c = PUBLISHED[name]
                published = whole_line_objective(act, c, a, fit.left)
                theirs, ratio = f"{published:.8e}", f"{ours / published:.6f}"
            row([name, str(bits), f"{fit.domain[1]:.3f}", f"{ours:.8e}", theirs, ratio,
                       f"{fit.max_abs:.3e}", f"{seconds:.1f}"])


if __name__ == "__main__":
    main()
