"""Memory and time of a LoRA fine-tuning step through PEFT: PEFT alone, PEFT with gradient
checkpointing, and PEFT then our presets (each with and without checkpointing); on CUDA also
Liger-Kernel under PEFT and, when installed, Unsloth.

    python benchmarks/lora_memory.py                       # llama built-in, 1 x 1024 tokens
    python benchmarks/lora_memory.py --quick               # llama-tiny, 1 x 64
    python benchmarks/lora_memory.py --model llama-1b --seq 4096 --device cuda

The model: random weights from a transformers config (nothing downloaded), bf16 weights
(`--weights`; `--4bit`: QLoRA, the base loaded in 4 bits by bitsandbytes), LoRA r = 16 on
all seven projections with float32 adapters (PEFT's default), one table per `--dropout`.
Every row is a fresh model from the same seed; a step is forward under bf16 autocast, the
model's own loss, backward and AdamW on the adapters. Columns:
- peak: on CUDA the allocator's peak over the timed steps; on CPU the bytes saved for the
  backward plus the largest activation-shaped temporary (as in llm_memory.py);
- saved: the bytes autograd keeps for the backward, and their ratio to PEFT's;
- vs no LoRA: saved bytes against the same setup on the same model without adapters (all
  weights trainable): what the adapters' path adds (`--skip-full` leaves it out);
- step time (median of `--repeats` after a warm-up) and the last loss.
Every row runs in a process of its own: nothing an earlier row allocated (models, optimizer
state, the allocator's cache) is held when the next one peaks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_memory import LIGER, measure  # noqa: E402
from measure import emulate_bf16_matmuls, table  # noqa: E402

from actdesign.runtime import account, compress, models  # noqa: E402
from actdesign.runtime.memory.profile import forward_context  # noqa: E402

ROWS = ["peft", "peft+checkpointing", "llm", "llm+checkpointing", "llm+fewbit3",
        "llm+fewbit3+checkpointing", "llm+actnn2", "llm+actnn2+checkpointing", "liger",
        "unsloth"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(name: str, weights: torch.dtype, device: str, four_bit: bool = False):
    """The model, or with `four_bit` QLoRA's: loaded in 4 bits (NF4, bf16 compute) by
    bitsandbytes from the same weights saved to a temporary folder, prepared by PEFT."""
    # built where it runs: a CPU initialisation of a billion weights is slow
    model, _ = models.build(name, seed=0, device=device)
    model = model.to(device, weights).train()
    if not four_bit:
        return model
    import peft
    import transformers

    quantized = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.bfloat16)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quantized, dtype=weights, device_map=device)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False).train()


def lora_config(dropout: float, rank: int):
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                           target_modules=TARGETS, task_type="CAUSAL_LM")


def build(name, row, device, weights, dropout, rank, adapters=True, four_bit=False):
    """A fresh model for the row, or None where the row does not run here."""
    import peft

    checkpointing = row.endswith("checkpointing")
    preset = row.removesuffix("checkpointing").rstrip("+")
    if preset == "unsloth":
        return None if four_bit or not adapters else _unsloth(name, device, weights, dropout,
                                                               rank)
    if four_bit and not adapters:
        return None  # 4-bit weights are frozen: there is no run without adapters
    model = base_model(name, weights, device, four_bit)
    if preset == "liger":
        family = name.removesuffix("-tiny").removesuffix("-1b")
        try:
            import liger_kernel.transformers as liger
        except ImportError:
            return None
        if not device.startswith("cuda") or family not in LIGER:
            return None
        getattr(liger, LIGER[family])(model=model)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapters:
        model = peft.get_peft_model(model, lora_config(dropout, rank))
    if preset not in ("peft", "liger"):
        compress(model, preset)  # PEFT first, then compress: the recommended order
    return model


def _unsloth(name, device, weights, dropout, rank):
    """Unsloth's model with its own LoRA, loaded from the same random weights saved to a
    temporary folder; None where Unsloth is not installed or cannot run (CPU)."""
    if not device.startswith("cuda"):
        return None
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        return None
    try:
        with tempfile.TemporaryDirectory() as folder:
            base_model(name, weights, "cpu").save_pretrained(folder)
            model, _ = FastLanguageModel.from_pretrained(folder, dtype=weights,
                                                         load_in_4bit=False)
        return FastLanguageModel.get_peft_model(model, r=rank, lora_alpha=2 * rank,
                                                lora_dropout=dropout, target_modules=TARGETS,
                                                use_gradient_checkpointing=False).train()
    except Exception as exc:  # noqa: BLE001  (a row that cannot run is reported, not fatal)
        print(f"unsloth: not run ({type(exc).__name__}: {exc})")
        return None


def saved_bytes(model, inputs, device):
    with forward_context("bf16-autocast", device), torch.enable_grad():
        saved, out = account(model, lambda: models.loss_of(models.call(model, inputs)))
    del out
    return saved.total


def run_row(args, setup, dropout) -> dict | None:
    """One row's figures, measured in this process; None where the row does not run here."""
    name, seq = args.model, args.seq
    weights = torch.bfloat16 if args.weights == "bf16" else torch.float32
    emulate = emulate_bf16_matmuls(args.device, "bf16-autocast")
    model = build(name, setup, args.device, weights, dropout, args.rank, four_bit=args.four_bit)
    if model is None:
        return None
    inputs = models.example_batch(model, args.batch, seq)
    saved = saved_bytes(model, inputs, args.device)
    peak, seconds, loss = measure(model, inputs, args.device, "bf16-autocast", args.repeats,
                                  emulate)
    del model
    full = None if args.skip_full else build(name, setup, args.device, weights, dropout,
                                             args.rank, adapters=False,
                                             four_bit=args.four_bit)
    alone = None if full is None else saved_bytes(full, inputs, args.device)
    return {"peak": peak, "saved": saved, "saved_without_lora": alone, "seconds": seconds,
            "loss": loss}


_ROW = "lora_memory row: "  # how a row's process hands its figures back


def in_fresh_process(setup, dropout) -> dict | None:
    """A row measured in a process of its own, so that no row's memory (models, optimizer
    state, the allocator's cache) reaches the next one's peak."""
    argv = [a for a in sys.argv[1:] if a != "--markdown"]
    done = subprocess.run([sys.executable, __file__, *argv, "--row", setup, "--dropout",
                           str(dropout)], stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_ROW)]
    if done.returncode or not lines:
        print(f"{setup}: its process failed (exit {done.returncode})")
        return None
    return json.loads(lines[-1].removeprefix(_ROW))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="a built-in, such as llama-1b")
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.05, 0.0])
    parser.add_argument("--weights", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--4bit", dest="four_bit", action="store_true",
                        help="QLoRA: the base loaded in 4 bits by bitsandbytes")
    parser.add_argument("--skip-full", action="store_true",
                        help="leave out the 'vs no LoRA' column (a second model per row)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one row, in this process
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    args.model = args.model or ("llama-tiny" if args.quick else "llama")
    args.seq = args.seq or (64 if args.quick else 1024)
    if args.row:
        print(_ROW + json.dumps(run_row(args, args.row, args.dropout[0])), flush=True)
        return
    cuda = args.device.startswith("cuda")
    emulate = emulate_bf16_matmuls(args.device, "bf16-autocast")
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    weights_are = "4-bit NF4" if args.four_bit else args.weights
    print(f"{where}, {args.model}, {weights_are} weights under bf16 autocast, LoRA "
          f"r={args.rank} on {len(TARGETS)} projections, batch {args.batch} x {args.seq} "
          f"tokens, torch {torch.__version__}; every row in a fresh process; peak: "
          + ("CUDA allocator" if cuda else "saved for backward + largest temporary")
          + ("; bf16 matmuls via float32 kernels" if emulate else ""), flush=True)
    for dropout in args.dropout:
        print(f"\nlora_dropout {dropout}")
        row = table(["setup", "peak MiB", "peak ratio", "saved MiB", "saved ratio",
                     "vs no LoRA", "step ms", "time ratio", "last loss"],
                    args.markdown, width=11, first=26)
        base = None
        for setup in args.rows:
            r = in_fresh_process(setup, dropout)
            if r is None:
                continue
            base = base or r
            alone = "" if r["saved_without_lora"] is None \
                else f"{r['saved'] / r['saved_without_lora']:.3f}"
            row([setup, f"{r['peak'] / 2**20:,.1f}", f"{r['peak'] / base['peak']:.3f}",
                 f"{r['saved'] / 2**20:,.1f}", f"{r['saved'] / base['saved']:.3f}", alone,
                 f"{r['seconds'] * 1e3:,.1f}", f"{r['seconds'] / base['seconds']:.2f}",
                 f"{r['loss']:.4f}"])


if __name__ == "__main__":
    main()
