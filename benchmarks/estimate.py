"""What `actdesign estimate` says full-size LLMs need for one training step, from their
published configs (benchmarks/configs): no weights, no GPU.

    python benchmarks/estimate.py --check                 # speed and footprint at 8 x 4096
    python benchmarks/estimate.py --markdown              # the table for RESULTS.md
    python benchmarks/estimate.py --configs llama-3.1-8b --shapes 1x4096 --setups none llm
    python benchmarks/estimate.py --layer                 # one full-width layer, built for real

--check runs `actdesign estimate` at 8 x 4096 in bf16 autocast, each policy in a fresh
process, and reports its wall time and peak resident memory against the goals (under 60 s,
under 2 GiB): a peak far under the weights' bytes shows that no weight was allocated.

--layer builds one decoder layer of the config (its vocabulary too) for real on this CPU and
measures one training step at 1 x 256 against the estimate of the same one-layer config:
saved bytes and activation peak, with our ops' CPU paths (kernels="cpu"), as the real step
runs them.

The table has one row per setup and one column per shape; a cell is the total (weights,
gradients, AdamW state and the activation peak) in GiB, the activation peak in brackets, and
the smallest of the 24, 48 and 80 GB GPUs (10**9 bytes) the total fits in. A setup is a
policy (none, llm, llm+actnn2, ...) with `checkpointing` and `lora` (PEFT LoRA of rank
--lora-rank on every linear projection) added as parts of its name. Full-finetuning rows
run in --precision (default bf16 autocast: float32 weights); LoRA rows with bfloat16
weights. A setup the estimate refuses shows a note number; the notes, under the
table, give the errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.errors import ActdesignError  # noqa: E402
from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory.estimate import estimate  # noqa: E402
from actdesign.runtime.memory.profile import PRECISIONS  # noqa: E402
from actdesign.runtime.memory.steps import step  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
NAMES = ["llama-3.1-8b", "qwen2.5-7b", "mistral-7b"]  # directories in CONFIGS
SETUPS = ["none", "checkpointing", "llm", "llm+checkpointing", "llm+actnn2", "fewbit3+msnorm",
          "lora", "lora+checkpointing", "lora+llm"]
SHAPES = ["1x4096", "4x4096", "8x4096", "1x32768"]
GPUS_GB = (24, 48, 80)  # GB: 10**9 bytes, as GPU memory is sold
GOALS = (60.0, 2 * 2**30)  # --check: seconds, peak resident bytes


def config_path(name: str) -> str:
    """A config by its directory name in benchmarks/configs, or a path as it is."""
    return str(CONFIGS / name) if (CONFIGS / name).is_dir() else name


def shape_of(text: str) -> tuple[int, int]:
    batch, _, seq = text.partition("x")
    return int(batch), int(seq)


def parse_setup(setup: str) -> tuple[str, bool, bool]:
    """(policy, checkpointing, lora) of a setup name such as `lora+llm+checkpointing`."""
    parts = setup.split("+")
    rest = [p for p in parts if p not in ("checkpointing", "lora")]
    return "+".join(rest) or "none", "checkpointing" in parts, "lora" in parts


def run_setup(config: str, batch: int, seq: int, setup: str, precision: str, rank: int):
    """The estimate's row for one setup, or the one-line error it gave."""
    policy, checkpointing, lora = parse_setup(setup)
    if lora:
        precision = "bf16"
    try:
        return estimate(config, batch, seq, precision, policies=[policy],
                        checkpointing=checkpointing, lora=rank if lora else None).rows[0]
    except ActdesignError as exc:
        return " ".join(str(exc).split())


def cell(row, errors: list[str]) -> str:
    """A row's cell; an error's a note number, its text kept once in `errors`."""
    if isinstance(row, str):
        if row not in errors:
            errors.append(row)
        return f"error [{errors.index(row) + 1}]"
    fits = next((f"{gb} GB" for gb in GPUS_GB if row.total_bytes <= gb * 10**9),
                f"> {GPUS_GB[-1]} GB")
    return f"{row.total_bytes / 2**30:.1f} ({row.peak_bytes / 2**30:.1f}), {fits}"


def results_table(args):
    shapes = [shape_of(s) for s in args.shapes]
    print(f"Estimated memory of one training step (AdamW): total GiB (activation peak GiB), "
          f"and the smallest of {', '.join(map(str, GPUS_GB))} GB (10**9 bytes) it fits in. "
          f"Full finetuning in {args.precision}; LoRA rank {args.lora_rank}, bf16 weights.",
          flush=True)
    for name in args.configs or NAMES:
        print(f"\n{name}")
        row = table(["setup", *args.shapes], args.markdown, width=26, first=20)
        errors = []
        for setup in args.setups:
            start = time.perf_counter()
            cells = [cell(run_setup(config_path(name), b, s, setup, args.precision,
                                    args.lora_rank), errors) for b, s in shapes]
            row([setup, *cells])
            print(f"  ({setup}: {time.perf_counter() - start:.1f} s)", file=sys.stderr,
                  flush=True)
        for i, error in enumerate(errors, 1):
            print(f"[{i}] {error}")


def check(args):
    """Each policy's estimate in a fresh process: wall seconds, peak resident memory."""
    batch, seq = shape_of(args.check_shape)
    precision = "bf16-autocast"
    for name in args.configs or ["llama-3.1-8b"]:
        print(f"{name}, {batch} x {seq}, {precision}: `actdesign estimate` in a fresh process; "
              f"goals: under {GOALS[0]:.0f} s, under {GOALS[1] / 2**30:.0f} GiB resident")
        row = table(["policy", "seconds", "peak RSS GiB", "weights GiB", "RSS / weights",
                     "goals"], args.markdown, width=14, first=16)
        for policy in args.check_policies:
            seconds, rss, result = fresh_estimate(config_path(name), batch, seq, precision,
                                                  policy)
            if isinstance(result, str):
                row([policy, f"{seconds:.1f}", f"{rss / 2**30:.2f}", "-", "-",
                     f"error: {result}"])
                continue
            weights = result["weights_bytes"]
            met = seconds < GOALS[0] and rss < GOALS[1]
            row([policy, f"{seconds:.1f}", f"{rss / 2**30:.2f}", f"{weights / 2**30:.1f}",
                 f"{rss / weights:.3f}", "met" if met else "missed"])


def layer_check(args):
    """One decoder layer at full width: the estimate against a real step on this CPU."""
    name = (args.configs or ["llama-3.1-8b"])[0]
    batch, seq = shape_of(args.layer_shape)
    config = models.config_of(config_path(name))
    config.num_hidden_layers = 1
    print(f"{name}, one decoder layer (hidden {config.hidden_size}, FFN "
          f"{config.intermediate_size}, vocabulary {config.vocab_size}), {batch} x {seq}: "
          "one real training step on this CPU against the estimate (MiB); goal: within 1%")
    row = table(["policy", "precision", "saved", "estimated", "ratio", "peak", "estimated",
                 "ratio"], args.markdown, width=12, first=16)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        for precision in ("fp32", "bf16-autocast"):
            for policy in args.check_policies:
                e = estimate(tmp, batch, seq, precision, [policy], kernels="cpu").rows[0]
                saved, peak = real_step(tmp, config, policy, batch, seq, precision)
                row([policy, precision, f"{saved / 2**20:,.2f}", f"{e.saved_bytes / 2**20:,.2f}",
                     f"{saved / e.saved_bytes:.4f}", f"{peak / 2**20:,.2f}",
                     f"{e.peak_bytes / 2**20:,.2f}", f"{peak / e.peak_bytes:.4f}"])


def real_step(path, config, policy, batch, seq, precision):
    """(saved bytes, activation peak) of one real training step after a warm-up one."""
    torch.manual_seed(0)
    model = models.from_config(path, config).train()
    if policy != "none":
        compress(model, policy, example_inputs=models.example_batch(model, 2, 8),
                 allow_more=True)  # measured, whatever it keeps
    inputs = models.example_batch(model, batch, seq)
    step(model, inputs, precision)  # the ops build their lookup tables once
    model.zero_grad(set_to_none=True)
    saved, peak = step(model, inputs, precision)
    return saved.total, peak


def fresh_estimate(config, batch, seq, precision, policy):
    """(wall seconds, peak resident bytes, the JSON row or the CLI's error line) of the CLI's
    estimate in a new Python process; os.wait4 gives that one child's own peak."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "estimate.json", Path(tmp) / "stderr"
        command = [sys.executable, "-m", "actdesign.cli", "estimate", "--model", config,
                   "--batch", str(batch), "--seq", str(seq), "--precision", precision,
                   "--policy", policy, "--json", str(out)]
        start = time.perf_counter()
        with open(err, "w") as stderr:
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        rss = usage.ru_maxrss * 1024  # KiB on Linux
        if child.returncode:
            lines = err.read_text().strip().splitlines() or [f"exit {child.returncode}"]
            return seconds, rss, lines[-1].removeprefix("actdesign: error: ")
        return seconds, rss, json.loads(out.read_text())["rows"][0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+",
                        help=f"directories in {CONFIGS} or config paths (default: all three; "
                        "--check: llama-3.1-8b)")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="BATCHxSEQ")
    parser.add_argument("--setups", nargs="+", default=SETUPS)
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast",
                        help="of the full-finetuning rows (LoRA rows: bf16)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="time and peak resident memory of the estimate itself")
    parser.add_argument("--check-shape", default="8x4096")
    parser.add_argument("--check-policies", nargs="+", default=["none", "llm"],
                        help="of --check and --layer")
    parser.add_argument("--layer", action="store_true",
                        help="one decoder layer built for real against its estimate")
    parser.add_argument("--layer-shape", default="1x256")
    args = parser.parse_args()
    (check if args.check else layer_check if args.layer else results_table)(args)


if __name__ == "__main__":
    main()
