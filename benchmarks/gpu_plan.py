"""The planned model on a device: is its peak within the budget, and its step time within
the plan's maximum slowdown of the lossless policy's, and how near the planner's predicted
step time is the measured one?

    python benchmarks/gpu_plan.py --device cuda                      # llama-1b, 1 x 4096
    python benchmarks/gpu_plan.py --device cpu --model llama-tiny --seq 128 --budget 0.5

The model has random float32 weights from a config (nothing downloaded); the plan is made by
`planner.plan` on 2 calibration batches of 1 x 512 with the GPU kernels' peak, then one fresh
copy per row (lossless `llm`, the plan) takes 2 warm-up and --repeats timed steps under bf16
autocast with AdamW. Peak: the allocator's peak over the timed steps, less what was held
before the first (weights, gradients, optimizer state), on CUDA; the activation peak of
`steps.step` on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory import planner, steps  # noqa: E402


def build(name, device):
    return models.build(name, seed=0, device=device)[0].to(device).train()


def run(model, policy, inputs, device, repeats):
    """(peak bytes, median step seconds) of a compressed copy."""
    trial = copy.deepcopy(model)
    compress(trial, policy, allow_more=True)  # a trial, measured
    if device == "cpu":
        _, peak = steps.step(trial, inputs, "bf16-autocast")
        return peak, float("nan")
    optimizer = torch.optim.AdamW(trial.parameters(), lr=1e-5)
    times = []
    for i in range(2 + repeats):
        if i == 2:
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = models.loss_of(models.call(trial, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return torch.cuda.max_memory_allocated() - held, statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--budget", default="0.3", help="a size or a fraction (see plan)")
    parser.add_argument("--max-slowdown", type=float, default=1.10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--card", default="h200", choices=planner.cards.NAMES,
                        help="the card whose costs the plan's time model reads")
    args = parser.parse_args()
    model = build(args.model, args.device)
    batches = [models.example_batch(model, 1, 512, seed=1 + i) for i in range(2)]
    inputs = models.example_batch(model, args.batch, args.seq)
    kernels = "cuda" if args.device.startswith("cuda") else "cpu"
    plan = planner.plan(model, batches, args.budget, example_inputs=inputs,
                        max_slowdown=args.max_slowdown, kernels=kernels, device=args.card,
                        progress=lambda m: print(m, file=sys.stderr))
    print(plan.table())
    base_peak, base_time = run(model, planner.policy_of([]), inputs, args.device, args.repeats)
    peak, step_time = run(model, plan.policy, inputs, args.device, args.repeats)
    print(f"\n{args.model}, {args.batch} x {args.seq}, bf16 autocast, on {args.device}")
    print(f"{'row':<10}{'peak MiB':>12}{'step ms':>10}{'time x':>8}")
    print(f"{'llm':<10}{base_peak / 2**20:>12.1f}{base_time * 1e3:>10.1f}{1:>8.3f}")
    print(f"{'plan':<10}{peak / 2**20:>12.1f}{step_time * 1e3:>10.1f}"
          f"{step_time / base_time:>8.3f}")
    within = peak <= plan.budget
    fast = "not timed on the CPU" if args.device == "cpu" else \
        "within" if step_time <= args.max_slowdown * base_time else "OVER"
    predicted = plan.solution.time / plan.costs.problem.base_time
    print(f"budget {plan.budget / 2**20:.1f} MiB: peak {'within' if within else 'OVER'}; "
          f"predicted peak {plan.peak_bytes / 2**20:.1f} MiB; time "
          f"{fast} {args.max_slowdown:.2f}x (predicted {predicted:.3f}x)")
    print(f"predicted step time, {plan.costs.card.describe()}: llm "
          f"{plan.costs.problem.base_time * 1e3:.1f} ms (measured/predicted "
          f"{base_time / plan.costs.problem.base_time:.3f}), plan "
          f"{plan.solution.time * 1e3:.1f} ms (measured/predicted "
          f"{step_time / plan.solution.time:.3f}; goal within 15%)")

if __name__ == "__main__":
    main()
