"""Long sequences on the card: LoRA on a Llama-8B config at long lengths, its measured peak
against the estimate's, and the step time with block inputs offloaded against without.

    python benchmarks/gpu_long.py --device cuda --markdown          # the GPU stage `long`
    python benchmarks/gpu_long.py --device cpu --model llama-tiny --seqs 256 --lora 4

First the host link: pinned host-to-device and device-to-host copies of 1 GiB, bytes per
second (the rate an offloaded block input moves at; `gpu_costs.py` stores it for the
planner). Then, for each policy and length, a fresh model (the config's shape, bf16 weights,
random values, PEFT LoRA as `estimate --lora` puts it), one warm-up step at the first
length, then one step (forward, backward, AdamW) timed: its `max_memory_allocated` beside
the estimate's total for the same setup (weights, gradients, optimizer state and activation
peak, margins aside), and the step time. Lengths the estimate says do not fit the card are
skipped, as are those past `--seconds`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_costs import host_rates  # noqa: E402
from measure import table  # noqa: E402

from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.apply import policy as P  # noqa: E402
from actdesign.runtime.memory.estimate import estimate  # noqa: E402
from actdesign.runtime.memory.profile import forward_context  # noqa: E402
from actdesign.runtime.memory.setups import with_lora  # noqa: E402

CONFIG = str(Path(__file__).parent / "configs" / "llama-3.1-8b")
PRECISION = "bf16-weights-autocast"
# with and without offloaded block inputs, the MLP tiled in both
POLICIES = {"llm+tiled+offload": "llm+tiled+offload",
            "llm+tiled+checkpoint": {"rules": [*P.load("llm+tiled").to_dict()["rules"],
                                               {"target": "block", "apply": "checkpoint"}]}}


def build(name, policy, lora, device):
    """The config's model on `device`, random bf16 weights, LoRA as the estimate puts it,
    compressed by `policy`."""
    model, _ = models.build(name, device=device)
    model = with_lora(name, model.to(torch.bfloat16), lora).train()
    compress(model, policy, allow_more=True)  # measured, whatever it keeps
    return model


def timed_step(model, inputs, device, optimizer) -> tuple[float, int]:
    """(seconds, max_memory_allocated) of one forward, backward and optimizer step."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with forward_context(PRECISION, device):
        loss = models.loss_of(models.call(model, inputs))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() if cuda else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--lora", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seconds", type=float, default=330,
                        help="start no step past this many seconds of the run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    began = time.perf_counter()
    cuda = args.device.startswith("cuda")
    card = torch.cuda.get_device_name(0) if cuda else "CPU"
    capacity = torch.cuda.get_device_properties(0).total_memory if cuda else None
    if cuda:
        h2d, d2h = host_rates(3, 2**30)
        print(f"host link, pinned 1 GiB copies: host to device {h2d / 1e9:.1f} GB/s, device "
              f"to host {d2h / 1e9:.1f} GB/s", flush=True)
    print(f"{Path(args.model).name}, LoRA r = {args.lora}, batch 1, {PRECISION}, {card}, "
          f"torch {torch.__version__}: one step each (GiB, seconds)", flush=True)
    row = table(["policy", "tokens", "estimated total", "measured", "measured/estimated",
                 "step s"], args.markdown, width=16, first=22)
    times = {}
    for label, policy in POLICIES.items():
        model = build(args.model, policy, args.lora, args.device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        warm = False
        for seq in args.seqs:
            if time.perf_counter() - began > args.seconds:
                row([label, f"{seq:,}", "-", "skipped: time", "-", "-"])
                continue
            e = estimate(args.model, 1, seq, PRECISION, policies=[policy], lora=args.lora,
                         kernels="cuda" if cuda else "cpu",
                         gpu_memory=capacity).rows[0]
            if cuda and not e.fits:
                row([label, f"{seq:,}", f"{e.total_bytes / 2**30:.2f}", "does not fit", "-",
                     "-"])
                continue
            inputs = models.example_batch(model, 1, seq)
            inputs = {k: v.to(args.device) for k, v in inputs.items()}
            if not warm:
                timed_step(model, inputs, args.device, optimizer)
                warm = True
            seconds, peak = timed_step(model, inputs, args.device, optimizer)
            times[label, seq] = seconds
            measured = [f"{peak / 2**30:.2f}", f"{peak / e.total_bytes:.3f}"] if cuda \
                else ["-", "-"]
            row([label, f"{seq:,}", f"{e.total_bytes / 2**30:.2f}", *measured,
                 f"{seconds:.2f}"])
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()
    for seq in args.seqs:
        pair = [times.get((label, seq)) for label in POLICIES]
        if None not in pair:
            print(f"{seq:,} tokens: offload's step / without {pair[0] / pair[1]:.3f} "
                  "(goal <= 1.15)")
    print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
