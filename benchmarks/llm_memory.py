"""Memory and time of a causal-LM training step, baseline against what a user would pick
instead: gradient checkpointing, our presets, and (on CUDA, when installed) Liger-Kernel.

    python benchmarks/llm_memory.py                      # llama, gpt2, qwen2 built-ins
    python benchmarks/llm_memory.py --quick              # the -tiny configs
    python benchmarks/llm_memory.py --device cuda --batch 16 --seq 1024

One table per model (random weights from the built-in transformers configs, random tokens
with labels), every row a fresh model from the same seed: forward under the precision's
context, the model's own loss (so the fused loss counts), backward, AdamW step (fused on
CUDA). Columns:
- peak: on CUDA the allocator's peak over the timed steps; on CPU the bytes autograd keeps
  for the backward (distinct storages, parameters aside) plus the largest activation-shaped
  tensor the step creates (the logits' float32 log-probabilities in eager transformers, one
  chunk with the fused loss; parameter-shaped casts and gradients left out), since torch
  keeps no CPU allocator peak;
- step time: median of `--repeats` steps after one warm-up;
- the loss of the last step.
Ratios are against the baseline measured in the same run. In bfloat16 on a CPU without
native bfloat16, matrix products run through float32 kernels (measure.float32_matmuls): the
bytes are exact, the times are not those of native kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from measure import (  # noqa: E402
    at_peak,
    emulate_bf16_matmuls,
    float32_matmuls,
    live_at_peak,
    table,
)

from actdesign.runtime import account, compress, models  # noqa: E402
from actdesign.runtime.memory.profile import PRECISIONS, forward_context  # noqa: E402

ROWS = ["baseline", "checkpointing", "fewbit3+msnorm", "fewbit3+msnorm+checkpointing", "llm",
        "llm+actnn2", "llm+fewbit3", "llm+checkpointing", "liger"]
LIGER = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2"}


class LargestTemporary(TorchDispatchMode):
    """The largest activation-shaped tensor any op creates while it is on: the CPU stand-in
    for the step's transient peak. Tensors shaped like a parameter (weight casts, gradients)
    are left out: every setup has them, and they are no activation."""

    def __init__(self, model):
        super().__init__()
        self.skip = {tuple(p.shape) for p in model.parameters()}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def build(name: str, row: str, device: str):
    """A fresh model for the row (the same weights for every row), or None if n/a."""
    model, _ = models.build(name, seed=0)
    model.to(device).train()
    if row == "liger":
        family = name.removesuffix("-tiny")
        if not device.startswith("cuda") or family not in LIGER:
            return None
        try:
            import liger_kernel.transformers as liger
        except ImportError:
            return None
        getattr(liger, LIGER[family])(model=model)
        return model
    if row.endswith("checkpointing"):
        with warnings.catch_warnings():  # the method's newer name varies by version
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        row = row.removesuffix("checkpointing").rstrip("+")
    if row and row != "baseline":
        compress(model, row, allow_more=True)  # measured, whatever it keeps
    return model


def measure(model, inputs, device, precision, repeats, emulate, snapshot=None, explain=None):
    """(peak bytes, median step seconds, last loss). On CUDA with `snapshot` (a path), the
    allocator's history of the timed steps is dumped there, for pytorch.org/memory_viz; with
    `explain` (a list), lines saying what is allocated at one more step's peak are added."""
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    def loss_fn():
        with forward_context(precision, device):
            return models.loss_of(models.call(model, inputs))

    def forward_backward():
        loss = loss_fn()
        loss.backward()
        return loss

    def step():
        loss = forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with float32_matmuls(emulate):
        step()  # warm-up: kernels compile, optimizer state exists
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            if snapshot:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - start)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            if snapshot:
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
            if explain is not None:
                try:
                    explain.extend(at_peak(step))
                except Exception as exc:  # noqa: BLE001  (seen: torch 2.11's history recorder
                    # under checkpointing's recompute); the row's own figures stand
                    explain.append(f"  (what is allocated at the peak: not measured, "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        else:
            with LargestTemporary(model) as largest:
                saved, out = account(model, loss_fn)
                out.backward()
            opt.zero_grad(set_to_none=True)
            peak = saved.total + largest.largest
            if explain is not None:  # CUDA's fused AdamW makes no temporaries; CPU's does
                explain.extend(live_at_peak(forward_backward)[1])
                opt.zero_grad(set_to_none=True)
    return peak, statistics.median(times), loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="+")
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    parser.add_argument("--native-cpu-bf16", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--at-peak", action="store_true",
                        help="after each model's table, the largest blocks allocated at each "
                        "row's peak, with the code that allocated them (CPU: the tensors "
                        "alive at the peak of forward and backward, measure.live_at_peak)")
    parser.add_argument("--snapshot", metavar="DIR",
                        help="CUDA: dump each row's allocator history to DIR/<model>_<row>.pickle")
    args = parser.parse_args()
    names = args.models or [f"{m}-tiny" if args.quick else m for m in ("llama", "gpt2", "qwen2")]
    emulate = emulate_bf16_matmuls(args.device, args.precision, args.native_cpu_bf16)
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{where}, {args.precision}, batch {args.batch} x {args.seq} tokens, torch "
          f"{torch.__version__}; peak: "
          + ("CUDA allocator" if cuda else "saved for backward + largest temporary")
          + ("; bf16 matmuls via float32 kernels" if emulate else ""), flush=True)
    for name in names:
        print(f"\n{name}")
        row = table(["setup", "peak MiB", "peak ratio", "step ms", "time ratio", "last loss"],
                    args.markdown, width=12, first=22)
        base, explained = None, []
        for setup in args.rows:
            model = build(name, setup, args.device)
            if model is None:
                continue
            inputs = models.example_batch(model, args.batch, args.seq)
            snapshot = None
            if args.snapshot and cuda:
                Path(args.snapshot).mkdir(parents=True, exist_ok=True)
                snapshot = str(Path(args.snapshot) / f"{name}_{setup}.pickle")
            explain = [] if args.at_peak else None
            peak, seconds, loss = measure(model, inputs, args.device, args.precision,
                                          args.repeats, emulate, snapshot, explain)
            if explain:
                explained.append(f"{setup}:\n" + "\n".join(explain))
            base = base or (peak, seconds)
            row([setup, f"{peak / 2**20:,.1f}", f"{peak / base[0]:.3f}",
                 f"{seconds * 1e3:,.1f}", f"{seconds / base[1]:.2f}", f"{loss:.4f}"])
            del model
            if cuda:
                torch.cuda.empty_cache()
        if explained:
            print(f"\nWhat is allocated at each setup's peak ({name}):\n" + "\n".join(explained))


if __name__ == "__main__":
    main()
