"""A convolutional network's training step on a GPU: peak memory and step time for eager,
torch.compile, timm's own checkpointing and the presets, and the estimate beside them.

    python benchmarks/gpu_vision.py --device cuda --markdown     # ResNet-50, 64 x 224², bf16
    python benchmarks/gpu_vision.py --device cuda --max-batch    # the largest batch each fits
    python benchmarks/gpu_vision.py --device cpu --batch 2 --image-size 64 --repeats 1

Each row is a fresh timm model (the same seed), channels_last, its step (forward under
autocast, cross-entropy, backward; no optimizer step) run once to warm up and then timed
`--repeats` times (the median). The peak is the allocator's (`max_memory_allocated`) over one
step, minus what was allocated before it, and the same with the gradients aside as the
estimate counts its activation peak (`gpu_estimate.cuda_step`). The estimate runs the same
name, shape, precision and policy on fake tensors (kernels="cuda"). With --max-batch, each
policy's largest batch on this card by the estimate (the card's memory, margins assumed),
then one real step at that batch: whether it ran, and its peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_estimate import cuda_step  # noqa: E402
from measure import table  # noqa: E402

from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory.estimate import estimate  # noqa: E402
from actdesign.runtime.memory.profile import forward_context  # noqa: E402

ROWS = ["eager", "compile", "checkpointing", "cnn", "actnn2", "cnn+actnn2"]


def build(name, row, size, device, probe):
    torch.manual_seed(0)
    model, make_batch = models.vision_model(name, size)
    model = model.to(device, memory_format=torch.channels_last).train()
    if row not in ("eager", "compile", "checkpointing"):
        compress(model, row, probe(make_batch), allow_more=True)  # measured, whatever it keeps
    if row == "checkpointing":
        model.set_grad_checkpointing(True)
    return torch.compile(model) if row == "compile" else model, make_batch


def images(make_batch, batch, device):
    x = make_batch(batch, 1).to(device).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (batch,), device=device)


def timed_steps(model, x, labels, device, precision, repeats):
    def loss_fn():
        with forward_context(precision, device):
            return torch.nn.functional.cross_entropy(model(x).float(), labels)

    times = []
    for _ in range(repeats + 1):  # the first warms up (compiles, builds lazy state)
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss_fn().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[1:]), loss_fn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="timm:resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", default="bf16-autocast")
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-batch", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    probe = lambda make_batch: make_batch(2, 1).to(args.device)  # noqa: E731
    if args.max_batch:
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 16 * 2**30
        print(f"{args.model}, {args.image_size}², {args.precision}, {where} "
              f"({memory / 2**30:.1f} GiB): the largest batch by the estimate, then one real "
              "step at it", flush=True)
        row = table(["policy", "largest batch", "x eager", "real step", "peak GiB"],
                    args.markdown, width=14, first=14)
        first = None
        for policy in [r for r in args.rows if r in ("eager", "cnn", "actnn2", "cnn+actnn2")]:
            name = "none" if policy == "eager" else policy
            found = estimate(args.model, 1, 1, args.precision, [name], gpu_memory=memory,
                             longest="batch", image_size=args.image_size,
                             kernels="cuda" if cuda else "cpu").rows[0]
            batch = next(iter(found.longest.values())).value
            first = first or batch
            ran, peak = "-", "-"
            if cuda and batch:
                model, make_batch = build(args.model, policy, args.image_size, args.device,
                                          probe)
                try:
                    x, labels = images(make_batch, batch, args.device)
                    torch.cuda.reset_peak_memory_stats()
                    timed_steps(model, x, labels, args.device, args.precision, 1)
                    ran, peak = "ran", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"
                except torch.OutOfMemoryError:
                    ran = "out of memory"
                del model
                torch.cuda.empty_cache()
            row([policy, str(batch), f"{batch / first:.2f}", ran, peak])
        return
    print(f"{args.model}, {args.batch} x {args.image_size}², {args.precision}, channels_last, "
          f"{where}, torch {torch.__version__}", flush=True)
    row = table(["row", "step ms", "x eager", "peak MiB", "x eager", "grads aside",
                 "estimated", "measured/est."], args.markdown, width=13, first=14)
    base = None
    for name in args.rows:
        start = time.perf_counter()
        model, make_batch = build(args.model, name, args.image_size, args.device, probe)
        x, labels = images(make_batch, args.batch, args.device)
        seconds, loss_fn = timed_steps(model, x, labels, args.device, args.precision,
                                       args.repeats)
        if cuda:
            peak, aside, _ = cuda_step(model, loss_fn)
        else:
            peak = aside = 0
        base = base or (seconds, peak or 1)
        est, ratio = "-", "-"
        if name not in ("compile", "checkpointing"):
            e = estimate(args.model, args.batch, 1, args.precision,
                         ["none" if name == "eager" else name], image_size=args.image_size,
                         kernels="cuda" if cuda else "cpu").rows[0]
            est = f"{e.peak_bytes / 2**20:,.0f}"
            ratio = f"{aside / e.peak_bytes:.3f}" if cuda else "-"
        row([name, f"{seconds * 1e3:.1f}", f"{seconds / base[0]:.2f}", f"{peak / 2**20:,.0f}",
             f"{peak / base[1]:.2f}", f"{aside / 2**20:,.0f}", est, ratio])
        del model
        if cuda:
            torch.cuda.empty_cache()
        print(f"  ({name}: {time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
