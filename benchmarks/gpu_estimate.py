"""The estimate against a real training step: `actdesign estimate`'s activation peak and saved
bytes for the built-in llama, beside what one step of the real model allocates and saves.

    python benchmarks/gpu_estimate.py --device cuda --markdown      # 4 x 1024, bf16 autocast
    python benchmarks/gpu_estimate.py --device cpu --batch 1 --seq 64

For each setup (a policy, `+checkpointing` for gradient checkpointing without reentrance) a
fresh model (float32 weights, the same seed) is compressed with the policy and takes one
warm-up step; then one step (forward, loss, backward; no optimizer step) is measured:
- on CUDA, the allocator's peak minus what was allocated before the step (weights, inputs),
  and the same with the gradients aside, as the estimate counts its peak: the step's
  allocator history replayed without the blocks that end up as the parameters' gradients;
- on CPU, steps.step's peak on the real tensors (the storages the step makes that are
  alive at once, gradients aside), which torch's CPU allocator cannot tell;
- the bytes saved for the backward, counted as `profile` counts them.
The estimate runs the same model name, shape, precision, policy and checkpointing on fake
tensors, our ops allocating as their kernels on that device do (kernels="cuda" or "cpu").
A setup the estimate refuses shows a note number; the notes, under the table, give the
errors.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.errors import ActdesignError  # noqa: E402
from actdesign.runtime import account, compress, models  # noqa: E402
from actdesign.runtime.memory.estimate import estimate  # noqa: E402
from actdesign.runtime.memory.profile import PRECISIONS, forward_context  # noqa: E402
from actdesign.runtime.memory.setups import with_checkpointing  # noqa: E402
from actdesign.runtime.memory.steps import step  # noqa: E402

SETUPS = ["none", "checkpointing", "llm", "llm+actnn2", "fewbit3+msnorm", "actnn2"]


def parse_setup(setup: str) -> tuple[str, bool]:
    """(policy, checkpointing) of a setup name such as `llm+checkpointing`."""
    parts = setup.split("+")
    return "+".join(p for p in parts if p != "checkpointing") or "none", "checkpointing" in parts


def build(name, policy, checkpointing, device):
    model, _ = models.build(name, seed=0)
    model.to(device).train()
    if policy != "none":
        compress(model, policy, allow_more=True)  # measured, whatever it keeps
    if checkpointing:  # after compress, as the estimate does
        with_checkpointing(name, model)
    return model


def cuda_step(model, loss_fn) -> tuple[int, int, int]:
    """(allocator peak minus what was allocated before, the same with the gradients aside,
    saved bytes) of one forward and backward on CUDA."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    saved, out = account(model, loss_fn)
    out.backward()
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    # the blocks alive at the end at a gradient's address are the gradients: replay without
    grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
    live = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = i
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    skip = {i for addr, i in live.items() if addr in grads}
    sizes, now, aside = {}, 0, 0
    for i, e in enumerate(events):
        if e["action"] == "alloc" and i not in skip:
            sizes[e["addr"]] = e["size"]
            now += e["size"]
            aside = max(aside, now)
        elif e["action"] == "free_completed" and e["addr"] in sizes:
            now -= sizes.pop(e["addr"])
    return peak, aside, saved.total


def measure(model, inputs, device, precision) -> tuple[int | None, int, int]:
    """(CUDA peak or None, peak with the gradients aside, saved bytes) of one step after one
    warm-up step."""
    def loss_fn():
        with forward_context(precision, device):
            return models.loss_of(models.call(model, inputs))

    loss_fn().backward()  # warm-up: kernels compile, lazy state is created
    model.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        return cuda_step(model, loss_fn)
    saved, peak = step(model, inputs, precision)  # the CPU's own forward context
    return None, peak, saved.total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    parser.add_argument("--setups", nargs="+", default=SETUPS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(0) if cuda else "CPU (steps.step on real tensors)"
    print(f"{args.model}, {args.batch} x {args.seq}, {args.precision}, {where}, torch "
          f"{torch.__version__}: one training step measured against the estimate (MiB)",
          flush=True)
    row = table(["setup", *(["CUDA peak"] if cuda else []), "peak, grads aside",
                 "estimated peak", "measured/estimated", "saved", "estimated saved",
                 "measured/estimated"],
                args.markdown, width=18, first=18)
    errors = []
    for setup in args.setups:
        start = time.perf_counter()
        policy, checkpointing = parse_setup(setup)
        model = build(args.model, policy, checkpointing, args.device)
        inputs = models.example_batch(model, args.batch, args.seq)
        peak, aside, saved = measure(model, inputs, args.device, args.precision)
        del model, inputs
        if cuda:
            torch.cuda.empty_cache()
        try:
            e = estimate(args.model, args.batch, args.seq, args.precision, policies=[policy],
                         checkpointing=checkpointing, kernels="cuda" if cuda else "cpu").rows[0]
            est = [f"{e.peak_bytes / 2**20:,.1f}", f"{aside / e.peak_bytes:.3f}",
                   f"{saved / 2**20:,.1f}", f"{e.saved_bytes / 2**20:,.1f}",
                   f"{saved / e.saved_bytes:.3f}"]
        except ActdesignError as exc:
            error = " ".join(str(exc).split())
            errors += [error] * (error not in errors)
            est = [f"error [{errors.index(error) + 1}]", "-", f"{saved / 2**20:,.1f}", "-", "-"]
        row([setup, *([f"{peak / 2**20:,.1f}"] if cuda else []), f"{aside / 2**20:,.1f}", *est])
        print(f"  ({setup}: {time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    for i, error in enumerate(errors, 1):
        print(f"[{i}] {error}")


if __name__ == "__main__":
    main()
