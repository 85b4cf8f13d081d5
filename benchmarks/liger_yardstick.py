"""Liger-Kernel's public bf16 mini-model convergence check, run on a CPU against the `llm`
policy: does a model compressed with `compress(model, "llm")` train like the eager model?

Liger-Kernel tests its fused ops by training one small model per architecture twice from the
same seed, eager and patched, for 32 AdamW steps with bfloat16 weights, then comparing the 32
losses and the final parameters element by element: |a - b| <= atol + rtol * |b|, with b the
patched run's value (loss atol 1e-2, rtol 5e-2; parameters atol 1e-2, rtol 1e-2 in its bf16
tests). This script runs the same protocol with the eager transformers model against the same
model after `compress(model, "llm")`, for the LLaMA 3, Qwen2, Qwen3, Mistral, Gemma, Gemma 2
and Phi-3 mini configs. Each model is built from its config (random weights from seed 42, no
download), cast to bfloat16 (`model.to(torch.bfloat16)`) and trained with
`torch.optim.AdamW(lr=1e-4)` (torch's other defaults) on `model(input_ids, attention_mask,
labels=input_ids).loss`.

Sizes: Liger's configs (d = 896-1024, 4 layers, vocabulary 32,000) are too slow for a
2-core CPU at one thread, so the width is divided by `--shrink` (default 4: hidden size,
intermediate size and an explicit head_dim), keeping Liger's depth, heads, key-value heads,
vocabulary, norm eps, rope theta, tying, attention implementation and 16 sequences per step;
sequences are `--seq` tokens (default 64). The table of sizes puts both side by side.

Data: Liger reads a pre-tokenised Tiny Shakespeare; nothing can be downloaded here, so the
text is the Python standard library's own source (the top-level `*.py` files of
`sysconfig.get_paths()["stdlib"]`, sorted by name, concatenated), read as little-endian
16-bit words, each taken modulo the vocabulary: a deterministic token stream with a skewed
distribution like real tokens. Step i reads the next 16 windows of `--seq` tokens, in order
(Liger's loader does not shuffle either).

Reported per model: the largest loss difference over the 32 steps and its margin
|a - b| / (atol + rtol * |b|) (below 1 passes Liger's check), the same for the final
parameters (the worst element's margin and how many elements exceed 1), and the verdict.
Both tolerances are loose for this protocol: at a loss of 10 nats the loss check allows 0.51,
and in 32 AdamW steps at lr 1e-4 a weight moves by a few 1e-3, below the parameter atol
alone. So the table adds the runs' parameter distance against the distance training moved
them, |eager - compressed| / |eager - initial| (2-norms over all parameters): 0 is bit for bit
the eager run, about 1.4 (the square root of 2) for two runs whose moves are uncorrelated.
Differences are computed in float64 from the bf16 values. Liger also compares the top-k
log-probabilities of the last step's logits; the fused loss computes no logits in training,
so that check has no counterpart here.

bfloat16 matrix products run natively (this CPU has AVX512-BF16, where they are faster than
`measure.float32_matmuls`); `--float32-matmuls` routes them through float32 kernels instead,
for CPUs without native bfloat16.

Run: .venv/bin/python benchmarks/liger_yardstick.py [--models mini_llama3,mini_qwen2]
         [--markdown] [--shrink 4] [--seq 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from measure import float32_matmuls, table  # noqa: E402

LOSS_TOL = (1e-2, 5e-2)  # (atol, rtol): Liger-Kernel's bf16 mini-model loss tolerance
PARAM_TOL = (1e-2, 1e-2)  # (atol, rtol): its tolerance on the final parameters
STEPS, BATCH, LR, SEED = 32, 16, 1e-4, 42  # Liger's steps, batch, learning rate and seed
WIDTHS = ("hidden_size", "intermediate_size", "head_dim")  # what --shrink divides

# Liger-Kernel's bf16 mini configs, the fields that set sizes or numerics (token ids, cache
# and the like left out). Gemma 1 says hidden_act="gelu" as Liger's does.
MODELS = {
    "mini_llama3": ("Llama", dict(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, attn_implementation="sdpa")),
    "mini_qwen2": ("Qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=32000, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attn_implementation="sdpa")),
    "mini_qwen3": ("Qwen3", dict(  # head_dim: Qwen3Config's default, which Liger leaves
        hidden_size=896, intermediate_size=4864, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, num_hidden_layers=4, vocab_size=32000, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, attn_implementation="sdpa")),
    "mini_mistral": ("Mistral", dict(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, tie_word_embeddings=False, attn_implementation="sdpa")),
    "mini_gemma1": ("Gemma", dict(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=4,
        head_dim=256, num_hidden_layers=4, vocab_size=32000, hidden_act="gelu",
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)),
    "mini_gemma2": ("Gemma2", dict(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=4,
        head_dim=256, num_hidden_layers=4, vocab_size=32000,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, attn_implementation="eager")),
    "mini_phi3": ("Phi3", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=8, num_key_value_heads=None,
        num_hidden_layers=4, vocab_size=32064, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="eager")),
}


@dataclass(frozen=True)
class Scale:
    """How the CPU run shrinks Liger's setting."""

    shrink: int = 4  # hidden size, intermediate size and head_dim divided by it
    seq: int = 64
    batch: int = BATCH
    steps: int = STEPS
    vocab: int | None = None  # None: Liger's
    layers: int | None = None  # None: Liger's


@dataclass
class Outcome:
    """One model's two runs compared under Liger's tolerances."""

    losses: tuple[list[float], list[float]]  # (eager, compressed)
    loss_diff: float  # the largest |a - b| over the steps
    loss_margin: float  # the largest |a - b| / (atol + rtol |b|)
    param_diff: float
    param_margin: float
    params_outside: int  # elements whose margin exceeds 1 (or that are NaN in one run only)
    params: int  # elements compared
    drift: float  # |eager - compressed| / |eager - initial|, over all parameters (2-norms)
    report: object  # compress's Report
    seconds: tuple[float, float]

    @property
    def passed(self) -> bool:
        return self.loss_margin < 1 and self.params_outside == 0


def sizes(name: str, scale: Scale) -> dict:
    """The config fields of the CPU run: Liger's, shrunk."""
    fields = dict(MODELS[name][1])
    for key in WIDTHS:
        if fields.get(key):
            fields[key] //= scale.shrink
    if scale.vocab:
        fields["vocab_size"] = scale.vocab
    if scale.layers:
        fields["num_hidden_layers"] = scale.layers
    return fields


def build(name: str, scale: Scale):
    """The model built from its config with seed 42, in bfloat16 and training mode; an
    ActdesignError naming what this transformers lacks."""
    import transformers

    from actdesign.errors import ActdesignError

    arch = MODELS[name][0]
    config_class = getattr(transformers, arch + "Config", None)
    model_class = getattr(transformers, arch + "ForCausalLM", None)
    if config_class is None or model_class is None:
        raise ActdesignError(f"transformers {transformers.__version__} has no {arch}ForCausalLM")
    config = config_class(max_position_embeddings=max(4096, scale.seq), attention_dropout=0.0,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          **sizes(name, scale))
    torch.manual_seed(SEED)  # the same weights for both runs
    return model_class(config).to(torch.bfloat16).train()


def stdlib_tokens(vocab: int, count: int) -> torch.Tensor:
    """The first `count` tokens of the standard library's source: 16-bit little-endian words
    modulo the vocabulary."""
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= 2 * count:
            break
    if len(data) < 2 * count:
        raise SystemExit(f"the standard library's source holds {len(data) // 2} tokens, "
                         f"{count} needed: use a smaller --seq")
    words = torch.frombuffer(data[:2 * count], dtype=torch.uint16).to(torch.int64)
    return words % vocab


def batches(vocab: int, scale: Scale) -> list[torch.Tensor]:
    """Every step's (batch, seq) token ids, consecutive windows in order."""
    tokens = stdlib_tokens(vocab, scale.steps * scale.batch * scale.seq)
    return list(tokens.view(scale.steps, scale.batch, scale.seq))


def train(model, steps: list[torch.Tensor], fast_matmuls: bool) -> list[float]:
    """Liger's loop: AdamW, zero_grad, the model's own loss, backward, step; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    with float32_matmuls(fast_matmuls):
        for ids in steps:
            optimizer.zero_grad()
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def margins(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """|a - b| / (atol + rtol |b|) elementwise in float64: Liger's check passes where it is at
    most 1. NaN in one tensor only is infinitely far; NaN in both is a match, as for Liger."""
    a, b = a.double(), b.double()
    out = (a - b).abs() / (atol + rtol * b.abs())
    both = a.isnan() & b.isnan()
    return torch.where(both, 0.0, torch.nan_to_num(out, nan=math.inf))


def compare(name: str, scale: Scale, fast_matmuls: bool = False) -> Outcome:
    """Train the eager model and the `llm`-compressed one; compare as Liger does. An
    ActdesignError (a missing architecture, compress's refusal) propagates, one line."""
    from actdesign.runtime import compress

    eager = build(name, scale)
    initial = {key: p.detach().clone() for key, p in eager.named_parameters()}
    steps = batches(eager.config.vocab_size, scale)
    start = time.perf_counter()
    eager_losses = train(eager, steps, fast_matmuls)
    eager_seconds = time.perf_counter() - start

    model = build(name, scale)
    start = time.perf_counter()
    report = compress(model, "llm")
    losses = train(model, steps, fast_matmuls)
    seconds = time.perf_counter() - start

    a, b = torch.tensor(eager_losses), torch.tensor(losses)
    loss_margins = margins(a, b, *LOSS_TOL)
    ours = dict(model.named_parameters())
    theirs = dict(eager.named_parameters())
    if ours.keys() != theirs.keys():  # compress keeps every parameter under its name
        raise SystemExit(f"{name}: parameter names differ after compress: "
                         f"{sorted(ours.keys() ^ theirs.keys())[:4]}")
    worst_diff, worst_margin, outside, count, apart, moved = 0.0, 0.0, 0, 0, 0.0, 0.0
    with torch.no_grad():
        for key, p in theirs.items():
            m = margins(p, ours[key], *PARAM_TOL)
            worst_diff = max(worst_diff, (p.double() - ours[key].double()).abs().max().item())
            worst_margin = max(worst_margin, m.max().item())
            outside += int((m > 1).sum())
            count += p.numel()
            apart += (p.double() - ours[key].double()).square().sum().item()
            moved += (p.double() - initial[key].double()).square().sum().item()
    return Outcome((eager_losses, losses), (a.double() - b.double()).abs().max().item(),
                   loss_margins.max().item(), worst_diff, worst_margin, outside, count,
                   math.sqrt(apart / moved) if moved else math.inf, report,
                   (eager_seconds, seconds))


def head_dim(fields: dict) -> int:
    return fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def describe(fields: dict, scale: Scale | None) -> str:
    """d / ff / heads (kv) x head_dim / layers / vocab / batch x seq, compactly."""
    heads = fields["num_attention_heads"]
    kv = fields["num_key_value_heads"] or heads
    tokens = f"{scale.batch}x{scale.seq}" if scale else f"{BATCH}x(dataset)"
    return (f"{fields['hidden_size']}/{fields['intermediate_size']}/{heads}({kv})"
            f"x{head_dim(fields)}/{fields['num_hidden_layers']}/{fields['vocab_size']}/{tokens}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--shrink", type=int, default=Scale.shrink,
                        help="divide Liger's hidden, intermediate and head sizes by this")
    parser.add_argument("--seq", type=int, default=Scale.seq, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--float32-matmuls", action="store_true",
                        help="bf16 products through float32 kernels (CPUs without bf16)")
    args = parser.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if unknown := [n for n in names if n not in MODELS]:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.shrink < 1 or args.seq < 2 or args.threads < 1:
        parser.error("--shrink and --threads must be at least 1, --seq at least 2")
    scale = Scale(shrink=args.shrink, seq=args.seq)
    if odd := [n for n in names if head_dim(sizes(n, scale)) % 2]:
        parser.error(f"--shrink {args.shrink} gives {', '.join(odd)} an odd head size; rotary "
                     "embeddings need an even one")
    torch.set_num_threads(args.threads)
    import transformers

    from actdesign.errors import ActdesignError

    transformers.logging.set_verbosity_error()
    print(f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} thread), torch "
          f"{torch.__version__}, transformers {transformers.__version__}; bf16 weights, "
          f"AdamW lr {LR:g}, {STEPS} steps, seed {SEED}; eager against compress(model, 'llm'); "
          f"data: stdlib source as 16-bit words mod vocab\n", flush=True)

    print("Sizes: d / ff / heads (kv heads) x head_dim / layers / vocab / batch x seq")
    row = table(["model", "Liger-Kernel", "here"], args.markdown, width=34, first=14)
    for name in names:
        row([name, describe(MODELS[name][1], None), describe(sizes(name, scale), scale)])

    print(f"\nLiger's tolerances: loss atol {LOSS_TOL[0]:g} rtol {LOSS_TOL[1]:g}, parameters "
          f"atol {PARAM_TOL[0]:g} rtol {PARAM_TOL[1]:g}; margin = |a-b| / (atol + rtol |b|), "
          "< 1 passes", flush=True)
    row = table(["model", "loss 1st->32nd", "max loss diff", "loss margin", "max param diff",
                 "param margin", "params outside", "vs movement", "llm replaced", "result",
                 "seconds"],
                args.markdown, width=15, first=14)
    failed, skipped = [], []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            out = compare(name, scale, args.float32_matmuls)
        except ActdesignError as e:
            skipped.append(f"{name}: {e}")
            row([name] + ["-"] * 8 + ["skipped", "-"])
            continue
        print(out.report, file=sys.stderr)
        failed += [] if out.passed else [name]
        row([name, f"{out.losses[0][0]:.2f}->{out.losses[0][-1]:.2f}", f"{out.loss_diff:.2e}",
             f"{out.loss_margin:.3f}", f"{out.param_diff:.2e}", f"{out.param_margin:.3f}",
             f"{out.params_outside}/{out.params}", f"{out.drift:.3f}",
             f"{len(out.report.replaced)} ({len(out.report.skipped)} kept)",
             "pass" if out.passed else "FAIL", f"{sum(out.seconds):.0f}"])
    for line in skipped:
        print(f"skipped {line}")
    print(f"\nfailed: {', '.join(failed) or 'none'}; vs movement: |eager - llm| / |eager - "
          "initial| over all parameters (the runs' distance against how far training moved "
          "them); llm replaced: modules compress replaced (and left alone, reasons on stderr); "
          "seconds: both runs, compress included")


if __name__ == "__main__":
    main()
