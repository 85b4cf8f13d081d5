"""`plan` on the built-in tiny LLMs: its costs, whether real steps of its plans fit their
budgets, how well it predicts their gradient error, whether it beats the presets at their own
bytes, and the solver's speed on a 32-block problem. No GPU: every step runs on this CPU.

    python benchmarks/plan.py                   # llama-tiny, qwen2-tiny, gpt2-tiny, 20 budgets
    python benchmarks/plan.py --quick           # llama-tiny, 5 budgets
    python benchmarks/plan.py --models gpt2-tiny --budgets 8 --markdown

For each model: the costs are measured once (calibration: 4 batches of 2 x 64, seeds 1-4;
target shape 4 x 128; bf16 autocast); then, at each maximum slowdown and each of --budgets
budgets from the solver's smallest modelled peak to the uncompressed model's peak, the plan
checked by shape-only steps (`solve_verified`) is run for real: one CPU training step of a
compressed copy gives its saved bytes and activation peak (a violation: peak > budget), and
the gradient error measured on the calibration batches is set against the plan's predicted
one. Then each preset's exact peak and measured error, and the plan's measured error at the
preset's peak as budget.

The shape-only steps price our ops' CPU paths by default, those the real CPU steps run;
`--kernels cuda` prices the GPU paths (as `actdesign plan` does), whose peak a CPU step need
not match: there, the eager rotation keeps float32 tensors a GPU kernel does not make.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.designer import plan as solver  # noqa: E402
from actdesign.errors import ActdesignError  # noqa: E402
from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory import cards, planner
from actdesign.runtime.memory.steps import step  # noqa: E402

MODELS = ["llama-tiny", "qwen2-tiny", "gpt2-tiny"]
# conv nets: norms as after training (timm's zero-initialised last norm of a block would make
# every gradient above it zero), calibration 2 batches of 2 images; --image-size, --batch
VISION = ["timm:resnet18", "timm:resnet50"]
PRECISION = {"value": "bf16-autocast"}
# the shape-only steps' paths of our ops: the real steps here run the CPU ones (--kernels
# cuda prices the GPU paths, as `actdesign plan` does, and so differs from a CPU step's peak)
KERNELS = {"value": "cpu"}
DEVICE = "h200"  # the time model's
SLOWDOWNS = [1.10, 1.5]  # --slowdowns


def mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def setup(name: str, image_size: int, batch: int):
    """(model, calibration batches, target-shape example, what calibrates)."""
    if name in VISION:
        model, make = models.build(name, image_size=image_size)
        trained_like(model.train())
        torch.manual_seed(1)
        batches = [make(2, 0) for _ in range(2)]
        return model, batches, make(batch, 0), f"2 batches of 2 random {image_size}² images"
    model, _ = models.build(name)
    model.train()
    batches = [models.example_batch(model, 2, 64, seed=1 + i) for i in range(4)]
    return model, batches, models.example_batch(model, 4, 128), \
        "4 random-token batches of 2 x 64"


def trained_like(model, seed=0):
    """Norm scales in 0.8-1.2 and shifts in ±0.1, as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.8, 1.2, generator=gen)
                m.bias.uniform_(-0.1, 0.1, generator=gen)


def real_step(model, example, policy) -> tuple[int, int]:
    """(saved bytes, activation peak) of a real CPU training step of a compressed copy, in
    the steady state: after one step has made the ops' look-up tables (once per process)."""
    trial = copy.deepcopy(model)
    compress(trial, policy, allow_more=True)  # a trial, measured
    step(trial, example, PRECISION["value"])
    trial.zero_grad(set_to_none=True)  # as the optimizer leaves it
    saved, peak = step(trial, example, PRECISION["value"])
    return saved.total, peak


def verified(model, example, costs, budget, slowdown):
    return planner.solve_verified(model, example, costs, budget, slowdown, PRECISION["value"],
                                  KERNELS["value"], planner.Clock(None))


def costs_report(name, costs, marks, markdown):
    print(f"\n{name}: {len(costs.sites)} sites, {len(costs.blocks)} blocks; uncompressed "
          f"saved {mib(costs.baseline_saved)} MiB, peak {mib(costs.baseline_peak)} MiB; "
          f"lossless ({costs.base}) saved {mib(costs.lossless_saved)} MiB")
    row = table(["site kind", "sites", "passes per batch"], markdown, width=18, first=14)
    for kind, passes in costs.passes.items():
        row([kind, str(sum(s.kind == kind for s in costs.sites)), str(passes)])
    print("seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()))


def budgets_report(name, model, example, costs, slowdown, count, markdown):
    """The plan at `count` budgets, each run for real; returns (violations, ratios)."""
    p = costs.problem
    low = solver.smallest_peak(p, slowdown * p.base_time).peak
    high = max(costs.baseline_peak, low)
    print(f"\n{name}, max slowdown {slowdown:.2f}: {count} budgets from the smallest modelled "
          f"peak {mib(low)} MiB to the uncompressed peak {mib(high)} MiB")
    row = table(["budget MiB", "real saved MiB", "real peak MiB", "peak/budget", "fits",
                 "predicted err", "measured err", "measured/pred", "seconds"], markdown,
                width=15)
    violations, ratios, refused = 0, [], 0
    for i in range(count):
        budget = int(low + (high - low) * i / max(count - 1, 1))
        start = time.perf_counter()
        try:
            result = verified(model, example, costs, budget, slowdown)
        except ActdesignError as exc:
            refused += 1
            row([mib(budget), "refused", "-", "-", "-", "-", "-", "-",
                 f"{time.perf_counter() - start:.1f}"])
            print(f"  ({' '.join(str(exc).split())})")
            continue
        saved, peak = real_step(model, example, result.policy)
        violations += peak > budget
        predicted = result.solution.error
        measured = costs.reference.error(result.policy)
        ratio = measured / predicted if predicted > 0 else None
        if ratio is not None:
            ratios.append(ratio)
        row([mib(budget), mib(saved), mib(peak), f"{peak / budget:.4f}",
             "yes" if peak <= budget else "NO", f"{predicted:.3g}", f"{measured:.3g}",
             f"{ratio:.3f}" if ratio is not None else "- (lossless)",
             f"{time.perf_counter() - start:.1f}"])
    summary = (f"{violations} violations in {count - refused} plans, {refused} refused")
    if ratios:
        summary += (f"; measured/predicted error: median {statistics.median(ratios):.3f}, "
                    f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} lossy plans")
    print(summary)
    return violations, ratios


def dominance_report(name, model, example, costs, markdown):
    """Each preset's exact peak and measured error; the plan's measured error at that peak."""
    anchor = verified(model, example, costs, costs.baseline_peak, max(SLOWDOWNS))
    print(f"\n{name}: the presets at their exact peaks; the plan with the preset's peak as "
          "budget (measured errors, calibration batches)")
    header = ["preset", "peak MiB", "preset err", "its time"]
    for s in ("its", *SLOWDOWNS):
        header += [f"plan err {s if s == 'its' else f'{s:.2f}x'}", "plan/preset"]
    row = table(header, markdown, width=15, first=24)
    best = {}  # preset -> the plan's least error / the preset's, over the slowdowns
    violations = 0  # the plans whose real step peaks over the preset's peak
    lossy = []
    for preset in planner.PRESETS[costs.base]:
        try:
            policy = planner.preset_policy(costs, preset)
            point = planner.measure_policy(anchor, model, example, PRECISION["value"], policy,
                                           preset, KERNELS["value"])
        except ActdesignError as exc:
            row([preset, "error", " ".join(str(exc).split()),
                 *["-"] * (1 + 2 * (1 + len(SLOWDOWNS)))])
            continue
        own = max(1.0, planner.explain.preset_solution(costs, policy).time
                  / costs.problem.base_time)  # its modelled step time, as the plan's
        cells = [preset, mib(point.peak), f"{point.error:.3g}", f"{own:.3f}x"]
        if point.error > 0:
            lossy.append(preset)
        for s in (own * (1 + 1e-9), *SLOWDOWNS):
            try:
                mine = verified(model, example, costs, point.peak, s).policy
            except ActdesignError:
                cells += ["refused", "-"]
                continue
            violations += real_step(model, example, mine)[1] > point.peak
            mine = costs.reference.error(mine)
            ratio = mine / point.error if point.error > 0 else 1.0 if mine == 0 else np.inf
            best[preset] = min(best.get(preset, np.inf), ratio)
            cells += [f"{mine:.3g}", "equal" if point.error == mine == 0 else f"{ratio:.3f}"]
        row(cells)
    lossy = [p for p in lossy if p in best]
    print(f"the plan's error <= the preset's at {sum(r <= 1 for r in best.values())} of "
          f"{len(best)} presets; <= 0.8x at {sum(best[p] <= 0.8 for p in lossy)} of the "
          f"{len(lossy)} lossy ones; {violations} budget violations (real steps)")


def large_problem(seed=0, blocks=32, sites=8, options=12):
    """Realistic magnitudes: bytes 1e6..1e9, all distinct; errors 1e-6..1e-1, higher where
    fewer bytes are kept; times 1e-4..1e-2 s on a 1 s step (the solver tests' problem)."""
    rng = np.random.default_rng(seed)
    block_list = [solver.Block(f"layers.{b}", int(rng.integers(1e6, 1e8)),
                               int(rng.integers(1e7, 1e9)), rng.uniform(2e-3, 1e-2))
                  for b in range(blocks)]
    site_list = []
    for b in range(blocks):
        for i in range(sites):
            keep = int(rng.integers(1e7, 1e9))
            kept = [solver.Option("keep", keep, 0.0, 0.0)]
            for k in range(1, options):
                share = rng.uniform(0.01, 1.0)
                kept.append(solver.Option(f"o{k}", int(keep * share) + int(rng.integers(0, 1000)),
                                          10 ** rng.uniform(-6, -1) * (1 - share),
                                          10 ** rng.uniform(-4, -2)))
            site_list.append(solver.Site(f"layers.{b}.s{i}", kept, b))
    return solver.Problem(site_list, block_list, 10**9, 5 * 10**8, 1.0)


def solver_speed(count, markdown, max_time=1.05):
    """`solve` on the 32-block synthetic problem at budgets from its smallest peak to 2.5x."""
    problem = large_problem()
    start = time.perf_counter()
    least = solver.smallest_peak(problem, max_time).peak
    first = time.perf_counter() - start
    print(f"\nsolver: 32 blocks x 8 sites x 12 options, max time {max_time}x; smallest peak "
          f"{least / 2**30:.3f} GiB found in {first:.2f} s")
    row = table(["budget/least", "seconds", "error", "LP bound", "error/bound"], markdown,
                width=14)
    seconds = []
    for budget in np.geomspace(least, 2.5 * least, count).astype(np.int64):
        start = time.perf_counter()
        plan = solver.solve(problem, int(budget), max_time)
        seconds.append(time.perf_counter() - start)
        assert plan.peak <= budget and plan.time <= max_time
        bound = solver.relaxed_error(problem, int(budget), max_time)
        row([f"{budget / least:.3f}", f"{seconds[-1]:.2f}", f"{plan.error:.4g}",
             f"{bound:.4g}", f"{plan.error / bound:.4f}" if bound > 0 else "-"])
    print(f"solve: median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS + VISION)
    parser.add_argument("--image-size", type=int, default=224, help="conv nets' images")
    parser.add_argument("--batch", type=int, default=64, help="conv nets' target batch")
    parser.add_argument("--precision", default="bf16-autocast")
    parser.add_argument("--slowdowns", type=float, nargs="+", default=SLOWDOWNS,
                        help="the plans' time limits, beside each preset's own")
    parser.add_argument("--no-budgets", action="store_true",
                        help="only the presets' peaks as budgets (a real step each)")
    parser.add_argument("--budgets", type=int, help="budgets per model and slowdown (20)")
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 5 budgets")
    parser.add_argument("--solver-budgets", type=int, default=10)
    parser.add_argument("--skip-solver", action="store_true")
    parser.add_argument("--kernels", choices=["cpu", "cuda"], default="cpu",
                        help="our ops' paths the shape-only steps price")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    KERNELS["value"], PRECISION["value"] = args.kernels, args.precision
    SLOWDOWNS[:] = args.slowdowns
    names = args.models or (MODELS[:1] if args.quick else MODELS)
    count = args.budgets or (5 if args.quick else 20)
    totals = {}
    for name in names:
        model, batches, example, calibration = setup(name, args.image_size, args.batch)
        clock = planner.Clock(None)
        costs = planner.measure_costs(model, batches, example, PRECISION["value"],
                                      cards.card(DEVICE), KERNELS["value"], calibration, clock)
        costs_report(name, costs, clock.marks, args.markdown)
        for slowdown in SLOWDOWNS if not args.no_budgets else ():
            totals[name, slowdown] = budgets_report(name, model, example, costs, slowdown,
                                                    count, args.markdown)
        dominance_report(name, model, example, costs, args.markdown)
    print("\nsummary: violations (real peak > budget) and measured/predicted error")
    row = table(["model", "slowdown", "violations", "median ratio", "min", "max"],
                args.markdown, width=13, first=12)
    for (name, slowdown), (violations, ratios) in totals.items():
        stats = ([f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}",
                  f"{max(ratios):.3f}"] if ratios else ["-"] * 3)
        row([name, f"{slowdown:.2f}", str(violations), *stats])
    if not args.skip_solver:
        solver_speed(args.solver_budgets, args.markdown)


if __name__ == "__main__":
    main()
