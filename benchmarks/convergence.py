"""Convergence of a small character-level GPT trained with each memory-saving method, against
the plain model, on real text: the Python standard library's own source.

Data: the top-level `*.py` files of `sysconfig.get_paths()["stdlib"]` (no test directories,
no site-packages), sorted by name; every 10th file goes to validation, the rest to training,
so the split is by file and the same on every run of one Python version. Tokens are bytes
(vocabulary 256): every file reads without decoding errors, nothing needs a tokenizer, and
ln(256) = 5.55 nats is the loss of a uniform guess.

Every variant starts from the same weights (one model built from the seed, copied), sees the
same training batches in the same order and is evaluated on the same fixed validation batches
every K steps. With several seeds (`--seeds 0 1 2`) the comparison repeats per seed
(weights and batch order change) and the goals are judged on the mean excess over seeds.
Variants other than the baseline are made by `actdesign.runtime.compress` with a policy
preset; `actnn2` then calibrates its bit widths per layer (2 bits on average) on a few
training batches. `plan@P` (with `--arch llama`) is `actdesign plan`'s policy for a budget of
preset P's exact activation peak at the training batch's shape, calibrated on a few training
batches.

Reported per variant: final validation loss and its difference to the baseline's, the bytes
autograd saves for one training step (distinct storages, parameters aside) and their ratio to
the baseline's, the median time of a training step and its ratio, and whether the variant
meets its goal (final validation loss within 1% of the baseline's; 3% for actnn2). The
validation curves (means over seeds) go to one PNG.

Precision (`--precision`, as `actdesign profile`): fp32; bf16-autocast, the forward (training
and validation) under bfloat16 autocast with float32 weights and optimizer; or bf16, weights
and optimizer state in bfloat16. On a CPU without native bfloat16 arithmetic, bfloat16 matrix
products are computed through float32 kernels unless `--native-cpu-bf16`
(`measure.float32_matmuls`): the same numbers to accumulation order, many times faster there.

Noise floor (`--noise-floor`, with `--arch llama`): whether a lossless variant differs from
the baseline by more than a change of rounding does. Per seed (default 8), three arms from the
same weights and batches: the baseline; a control, the baseline with each batch run as two
half micro-batches whose gradients accumulate (the same step, rounded differently); and the
variant. Reported: each arm's final validation loss per seed, variant - baseline and control -
baseline (relative, %), their means and standard deviations over the seeds, and paired t tests
(two-sided) of variant against baseline and of variant against control. `lora+P` runs preset
P on PEFT LoRA (r = 8 on the seven attention and MLP projections, no dropout, lr 1e-3) with
its own baseline and control: each fine-tunes the seed's trained baseline arm, so the frozen
base has learned something to adapt, for as many steps on fresh batches. Sized for one
thread: a LLaMA with d=64, 2 layers, 400 steps of 16 x 64 bytes; msnorm, llm and lora+llm
at 8 seeds take about 25 minutes on one core of a shared 2-core machine.

Run: .venv/bin/python benchmarks/convergence.py [--quick] [--markdown] [--variants a,b]
         [--steps N] [--seeds S ...] [--precision P] [--device D] [--plot out/convergence.png]
         [--noise-floor]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from measure import emulate_bf16_matmuls, float32_matmuls, saved_storages, table
from torch import nn

from actdesign.runtime.memory.profile import (
    PRECISIONS,
    bf16_weights,
    default_precision,
    forward_context,
)

VOCAB = 256  # bytes
VARIANTS = ["baseline", "fewbit3", "regelu2", "msnorm", "fewbit3+msnorm", "regelu2+msnorm",
            "actnn2", "fewbit3+msnorm+actnn2", "backrazor90", "llm", "llm+actnn2",
            "plan@fewbit3+msnorm+actnn2"]
GOALS = {"fewbit3": 0.01, "regelu2": 0.01, "msnorm": 0.01, "fewbit3+msnorm": 0.01,
         "regelu2+msnorm": 0.01, "actnn2": 0.03, "fewbit3+msnorm+actnn2": 0.03, "llm": 0.005,
         "llm+actnn2": 0.03}  # allowed relative excess of the final validation loss, averaged
# over seeds
CALIBRATION_BATCHES = 4


@dataclass
class Config:
    d: int
    layers: int
    heads: int
    seq: int
    batch: int
    steps: int
    lr: float
    eval_every: int
    val_batches: int


DEFAULT = Config(d=128, layers=4, heads=4, seq=128, batch=16, steps=800, lr=3e-3,
                 eval_every=50, val_batches=16)
QUICK = Config(d=32, layers=1, heads=2, seq=32, batch=4, steps=20, lr=3e-3, eval_every=10,
               val_batches=2)


# --- data -----------------------------------------------------------------------------------

def stdlib_text() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train bytes, validation bytes, number of files): every 10th file (by sorted name) is
    validation, so no file is split between the two."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % 10 == 9 else train).extend(path.read_bytes())
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val), len(files)


def windows(text: torch.Tensor, starts: torch.Tensor, seq: int):
    """(inputs, targets) for windows of seq + 1 bytes at `starts` (shape batch)."""
    chunk = text[starts[:, None] + torch.arange(seq + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def train_batches(text, cfg: Config, seed: int) -> list:
    """The training batches of every step, drawn once so every variant sees the same order."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - cfg.seq - 1, (cfg.steps, cfg.batch), generator=gen)
    return [windows(text, s, cfg.seq) for s in starts]


def val_batches(text, cfg: Config) -> list:
    """Fixed validation batches, evenly spaced over the whole validation text."""
    n = cfg.val_batches * cfg.batch
    starts = torch.linspace(0, len(text) - cfg.seq - 1, n).long()
    return [windows(text, s, cfg.seq) for s in starts.view(cfg.val_batches, cfg.batch)]


# --- model ----------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, cfg.d), nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.Sequential(*(Block(cfg.d, cfg.heads) for _ in range(cfg.layers)))
        self.ln_f, self.head = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, VOCAB)  # untied
        for m in self.modules():  # GPT-2's initialisation: small weights train faster
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


@dataclass
class Setting:
    """Where and in which precision the steps run."""

    device: str
    precision: str
    emulate_matmuls: bool = False  # measure.float32_matmuls around every step

    def matmuls(self):
        return float32_matmuls(self.emulate_matmuls)

    def loss(self, model, batch):
        inputs, targets = (t.to(self.device) for t in batch)
        with forward_context(self.precision, self.device):
            if isinstance(model, GPT):
                logits = model(inputs)
                return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            # a transformers causal LM: its own loss, on the same targets (already shifted)
            targets = targets.contiguous()
            return model(input_ids=inputs, labels=targets, shift_labels=targets).loss


# --- variants and training ------------------------------------------------------------------

def make_variant(base: nn.Module, name: str, batches: list, setting: Setting) -> nn.Module:
    """A copy of `base` with the variant's policy applied; actnn2 calibrated on `batches`."""
    model = copy.deepcopy(base)
    if name == "baseline":
        return model
    from actdesign.runtime import calibrate, compress

    policy = planned(model, name.removeprefix("plan@"), batches, setting) \
        if name.startswith("plan@") else name
    report = compress(model, policy, example_inputs=(batches[0][0].to(setting.device),),
                      allow_more=True)  # every preset trains, whatever it keeps
    print(report, file=sys.stderr)
    if name.startswith("actnn"):  # allocate 2 bits on average, exactly per layer
        bits = calibrate(model, batches[:CALIBRATION_BATCHES], avg_bits=2, loss=setting.loss)
        print(f"allocated bits: {bits}", file=sys.stderr)
    return model


def planned(model, preset: str, batches: list, setting: Setting):
    """`actdesign plan`'s policy for a budget of the preset's exact activation peak at the
    training batch's shape, calibrated on the first training batches."""
    from actdesign.runtime.apply import policy
    from actdesign.runtime.memory import planner
    from actdesign.runtime.memory.steps import fake_step

    if isinstance(model, GPT):
        raise SystemExit("plan@ variants need a model computing its own loss: --arch llama")

    def keywords(batch):
        inputs, targets = (t.to(setting.device).contiguous() for t in batch)
        return {"input_ids": inputs, "labels": targets, "shift_labels": targets}

    example = keywords(batches[0])
    kernels = "cuda" if setting.device.startswith("cuda") else "cpu"
    _, budget = fake_step(model, example, policy.load(preset), setting.precision, kernels)
    plan = planner.plan(model, [keywords(b) for b in batches[:CALIBRATION_BATCHES]], budget,
                        example_inputs=example, precision=setting.precision, kernels=kernels)
    print(plan.table(), file=sys.stderr)
    return plan.policy


def saved_bytes(model, batch, setting: Setting) -> int:
    """Bytes of the distinct storages autograd keeps for one training step's backward."""
    return sum(saved_storages(setting.loss, model, batch, skip=model.parameters())[0].values())


@torch.no_grad()
def val_loss(model, batches, setting: Setting) -> float:
    model.eval()
    loss = statistics.fmean(setting.loss(model, b).item() for b in batches)
    model.train()
    return loss


def schedule(cfg: Config):
    """Linear warmup over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, cfg.steps // 20)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(model, cfg: Config, batches, val, setting: Setting,
          micro_batches: int = 1) -> tuple[list, float]:
    """AdamW over the trainable parameters and the batches, each batch run as `micro_batches`
    equal parts whose gradients accumulate (the same step to rounding); returns
    ([(step, validation loss)], median seconds per step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
    curve, times = [(0, val_loss(model, val, setting))], []
    sync = torch.cuda.synchronize if setting.device.startswith("cuda") else lambda: None
    for step, batch in enumerate(batches, 1):
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for part in zip(*(t.chunk(micro_batches) for t in batch), strict=True):
            part_loss = setting.loss(model, part) / micro_batches  # equal parts: the mean
            part_loss.backward()
            loss += part_loss.detach()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        sync()
        times.append(time.perf_counter() - start)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve.append((step, val_loss(model, val, setting)))
            print(f"  step {step}: train {loss.item():.3f}, val {curve[-1][1]:.3f}",
                  file=sys.stderr, flush=True)
    return curve, statistics.median(times)


def plot(curves: dict, path: str, title: str):
    """Left: validation loss from the first evaluation on (the drop from ln(256) hides the
    rest); right: its difference to the baseline's, with the goals as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = dict(curves["baseline"])
    for name, curve in curves.items():
        steps, losses = zip(*curve[1:], strict=True)
        style = {"label": name, "lw": 2 if name == "baseline" else 1}
        ax.plot(steps, losses, **style)
        rel.plot(steps, [100 * (loss / base[s] - 1) for s, loss in curve[1:]], **style)
    for goal in sorted(set(GOALS.values())):
        rel.axhline(100 * goal, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title=title)
    rel.set(xlabel="step", ylabel="difference to baseline (%)",
            title="validation loss vs baseline (dashed: goals)")
    for a in (ax, rel):
        a.grid(alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def build(arch: str, cfg: Config) -> nn.Module:
    """The GPT above, or a LLaMA (RMSNorm, SwiGLU MLP, rotary positions, untied head) of the
    same width and depth from transformers, whose loss the `llm` preset fuses."""
    if arch == "gpt":
        return GPT(cfg)
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg.d, intermediate_size=8 * cfg.d // 3,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
        tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def run_seed(names, cfg: Config, seed: int, setting: Setting, train_text, val_text,
             arch: str = "gpt") -> dict:
    """{variant: (validation curve, saved bytes, median step seconds)} for one seed."""
    batches, val = train_batches(train_text, cfg, seed), val_batches(val_text, cfg)
    torch.manual_seed(seed)
    base = build(arch, cfg).to(setting.device)
    if bf16_weights(setting.precision):
        base.to(torch.bfloat16)
    results = {}
    for name in names:
        print(f"{name}, seed {seed}:", file=sys.stderr, flush=True)
        torch.manual_seed(seed)  # the same random state for every variant's layers
        with setting.matmuls():
            model = make_variant(base, name, batches, setting)
            nbytes = saved_bytes(model, batches[0], setting)
            curve, seconds = train(model, cfg, batches, val, setting)
        results[name] = curve, nbytes, seconds
    return results


def mean_curve(curves: list) -> list:
    return [(step, statistics.fmean(c[i][1] for c in curves))
            for i, (step, _) in enumerate(curves[0])]


# --- noise floor ----------------------------------------------------------------------------

NOISE = Config(d=64, layers=2, heads=4, seq=64, batch=16, steps=400, lr=3e-3, eval_every=400,
               val_batches=16)  # 8 seeds of msnorm, llm and lora+llm in ~25 min on one core
NOISE_VARIANTS = ["msnorm", "llm", "lora+llm"]
NOISE_SEEDS, QUICK_NOISE_SEEDS = 8, 3
LORA_R, LORA_LR = 8, 1e-3
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_BATCH_SEED = 10_000  # the fine-tuning batches' seed is the seed plus this


def with_lora(base: nn.Module) -> nn.Module:
    """A copy of `base` with PEFT LoRA adapters (r = 8, no dropout) on the attention and MLP
    projections; the embeddings, norms and head stay frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(base), LoraConfig(
        r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0, target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM"))


def noise_floor_seed(variants, cfg: Config, seed: int, setting: Setting, train_text,
                     val_text) -> dict:
    """{arm: final validation loss} for one seed. Arms: "baseline", "control" (the baseline
    with every batch run as two half micro-batches, gradients accumulated) and each full
    variant, all from the same weights and batches; then, if a "lora+P" variant is asked,
    "lora baseline", "lora control" and the variants, PEFT LoRA fine-tuning the trained
    baseline on fresh batches."""
    batches, val = train_batches(train_text, cfg, seed), val_batches(val_text, cfg)
    torch.manual_seed(seed)
    base = build("llama", cfg).to(setting.device)
    if bf16_weights(setting.precision):
        base.to(torch.bfloat16)

    def arm(name, model, arm_cfg, arm_batches, micro_batches=1):
        print(f"{name}, seed {seed}:", file=sys.stderr, flush=True)
        with setting.matmuls():
            curve, _ = train(model, arm_cfg, arm_batches, val, setting, micro_batches)
        finals[name] = curve[-1][1]

    finals = {}
    pretrained = copy.deepcopy(base)
    arm("baseline", pretrained, cfg, batches)
    arm("control", copy.deepcopy(base), cfg, batches, micro_batches=2)
    for name in (v for v in variants if not v.startswith("lora+")):
        torch.manual_seed(seed)
        with setting.matmuls():
            model = make_variant(base, name, batches, setting)
        arm(name, model, cfg, batches)
    if lora := [v for v in variants if v.startswith("lora+")]:
        tune_cfg = replace(cfg, lr=LORA_LR)
        tune_batches = train_batches(train_text, cfg, seed + LORA_BATCH_SEED)
        torch.manual_seed(seed)  # the adapters' initial weights, shared by the LoRA arms
        adapted = with_lora(pretrained)
        arm("lora baseline", copy.deepcopy(adapted), tune_cfg, tune_batches)
        arm("lora control", copy.deepcopy(adapted), tune_cfg, tune_batches, micro_batches=2)
        for name in lora:
            with setting.matmuls():
                model = make_variant(adapted, name.removeprefix("lora+"), tune_batches, setting)
            arm(name, model, tune_cfg, tune_batches)
    return finals


def paired_t(differences: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of the paired test that the per-seed differences have mean 0."""
    from scipy import stats

    test = stats.ttest_1samp(differences, 0.0)
    return float(test.statistic), float(test.pvalue)


def noise_floor_tables(variants, per_seed: list[dict], seeds, markdown: bool):
    """Per variant, a row per seed; then the means, standard deviations and paired tests of
    variant - baseline and control - baseline (relative, %) over the seeds."""
    summary = []
    for name in variants:
        prefix = "lora " if name.startswith("lora+") else ""
        base = [r[prefix + "baseline"] for r in per_seed]
        control, variant = ([100 * (r[arm] / b - 1) for r, b in zip(per_seed, base, strict=True)]
                            for arm in (prefix + "control", name))
        print(f"\n{name}: final validation loss per seed ({prefix}baseline and control: "
              f"{'LoRA on the trained baseline' if prefix else 'full training'})\n")
        row = table(["seed", f"{prefix}baseline", f"{prefix}control", name,
                     "control - base %", "variant - base %"], markdown, width=18, first=6)
        for seed, r, c, v in zip(seeds, per_seed, control, variant, strict=True):
            row([str(seed), f"{r[prefix + 'baseline']:.4f}", f"{r[prefix + 'control']:.4f}",
                 f"{r[name]:.4f}", f"{c:+.3f}", f"{v:+.3f}"])
        summary.append((name, control, variant))
    print(f"\nOver {len(seeds)} seeds: mean and sd of the relative differences (%); paired t "
          "tests, two-sided\n")
    row = table(["variant", "control-base", "sd", "variant-base", "sd", "t vs base",
                 "p vs base", "t vs control", "p vs control"], markdown, width=13, first=10)
    for name, control, variant in summary:
        t_base, p_base = paired_t(variant)
        t_control, p_control = paired_t([v - c for v, c in zip(variant, control, strict=True)])
        row([name, f"{statistics.fmean(control):+.3f}", f"{statistics.stdev(control):.3f}",
             f"{statistics.fmean(variant):+.3f}", f"{statistics.stdev(variant):.3f}",
             f"{t_base:+.2f}", f"{p_base:.3f}", f"{t_control:+.2f}", f"{p_control:.3f}"])


def make_setting(args) -> Setting:
    precision = args.precision or default_precision(args.device)
    return Setting(args.device, precision, emulate_matmuls=emulate_bf16_matmuls(
        args.device, precision, args.native_cpu_bf16))


def describe(args, cfg: Config, setting: Setting) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the data and print the run's setup; (train bytes, validation bytes)."""
    train_text, val_text, files = stdlib_text()
    params = sum(p.numel() for p in build(args.arch, cfg).parameters())
    where = (torch.cuda.get_device_name(0) if setting.device.startswith("cuda") else
             f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    print(f"stdlib source: {files} files, {len(train_text) / 1e6:.2f} MB train, "
          f"{len(val_text) / 1e6:.2f} MB validation (every 10th file); byte vocabulary\n"
          f"{args.arch.upper()}: d={cfg.d}, {cfg.layers} layers, {cfg.heads} heads, "
          f"{params / 1e6:.2f}M parameters; batch {cfg.batch} x {cfg.seq} bytes, {cfg.steps} "
          f"steps, AdamW lr {cfg.lr:g}, warmup + cosine; validation {cfg.val_batches} batches "
          f"every {cfg.eval_every} steps; seeds {' '.join(map(str, args.seeds))}; "
          f"{setting.precision}, {where}, torch {torch.__version__}"
          + ("; bf16 matmuls with float32 accumulation via float32 kernels" if
             setting.emulate_matmuls else "") + "\n", flush=True)
    return train_text, val_text


def noise_floor_main(args, parser):
    names = [v.strip() for v in (args.variants or ",".join(NOISE_VARIANTS)).split(",")
             if v.strip()]
    presets = [v for v in VARIANTS if v != "baseline"]
    if unknown := sorted(v for v in names if v.removeprefix("lora+") not in presets):
        parser.error(f"unknown variants {unknown}; choose from {presets}, each optionally "
                     "as lora+P")
    if args.arch != "llama":
        parser.error("--noise-floor trains the LLaMA (PEFT wraps it): add --arch llama")
    args.seeds = args.seeds or list(range(QUICK_NOISE_SEEDS if args.quick else NOISE_SEEDS))
    if len(args.seeds) < 2 or len(set(args.seeds)) < len(args.seeds):
        parser.error("--noise-floor needs at least 2 distinct seeds (default 8) for its tests")
    cfg = replace(QUICK if args.quick else NOISE, **(
        {"steps": args.steps, "eval_every": args.steps} if args.steps else {}))
    torch.set_num_threads(1)  # the timing it is sized for, and one core per run
    setting = make_setting(args)
    began = time.perf_counter()
    train_text, val_text = describe(args, cfg, setting)
    print(f"noise floor: per seed the baseline, a control (each batch as two half "
          f"micro-batches, gradients accumulated) and each variant; lora+P: PEFT LoRA r="
          f"{LORA_R} on {', '.join(LORA_TARGETS)}, lr {LORA_LR:g}, fine-tuning the seed's "
          f"trained baseline for {cfg.steps} steps on fresh batches", flush=True)
    per_seed = [noise_floor_seed(names, cfg, seed, setting, train_text, val_text)
                for seed in args.seeds]
    noise_floor_tables(names, per_seed, args.seeds, args.markdown)
    print(f"\nwall time {time.perf_counter() - began:.0f} s")
    if args.quick:
        print("(--quick is a smoke test: too few steps and seeds for the tests to mean anything)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps (CI)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--variants", help="comma-separated, from: " + ", ".join(VARIANTS)
                        + "; with --noise-floor also lora+P (default there: "
                        + ",".join(NOISE_VARIANTS) + ")")
    parser.add_argument("--steps", type=int, help="training steps (default: by mode)")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="one comparison per seed; goals on the mean excess (default: 0; "
                             f"with --noise-floor 0-{NOISE_SEEDS - 1}, with --quick too "
                             f"0-{QUICK_NOISE_SEEDS - 1})")
    parser.add_argument("--noise-floor", action="store_true",
                        help="baseline, micro-batch control and variant per seed, one thread, "
                             "paired tests (see above)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="default: bf16-autocast on CUDA, fp32 on CPU")
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt",
                        help="the GPT defined here, or a LLaMA from transformers (for llm)")
    parser.add_argument("--native-cpu-bf16", action="store_true",
                        help="on CPU, run torch's own bfloat16 matrix products (see above)")
    parser.add_argument("--plot", default="out/convergence.png")
    args = parser.parse_args()
    if args.noise_floor:
        return noise_floor_main(args, parser)
    names = [v.strip() for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    if unknown := sorted(set(names) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if "baseline" not in names:  # every ratio is against it
        names.insert(0, "baseline")
    args.seeds = args.seeds or [0]
    cfg = replace(QUICK if args.quick else DEFAULT, **(
        {"steps": args.steps} if args.steps else {}))
    setting = make_setting(args)

    began = time.perf_counter()
    train_text, val_text = describe(args, cfg, setting)
    per_seed = [run_seed(names, cfg, seed, setting, train_text, val_text, args.arch)
                for seed in args.seeds]

    header = ["variant", "final val loss", "vs baseline", "per seed", "saved MiB/step",
              "vs baseline", "step ms", "time ratio", "goal"]
    row = table(header, args.markdown, width=15, first=16)
    missed, curves = [], {}
    for name in names:
        finals = [r[name][0][-1][1] for r in per_seed]
        excess = [r[name][0][-1][1] / r["baseline"][0][-1][1] - 1 for r in per_seed]
        nbytes = [r[name][1] / r["baseline"][1] for r in per_seed]
        ratio = [r[name][2] / r["baseline"][2] for r in per_seed]
        curves[name] = mean_curve([r[name][0] for r in per_seed])
        mean_excess = statistics.fmean(excess)
        goal = "-"
        if name in GOALS:
            met = mean_excess <= GOALS[name]
            goal = f"{'met' if met else 'MISSED'}, <= +{GOALS[name]:.1%}"
            missed += [] if met else [name]
        row([name, f"{statistics.fmean(finals):.4f}", f"{mean_excess:+.2%}",
             "/".join(f"{100 * e:+.1f}" for e in excess),
             f"{per_seed[0][name][1] / 2**20:.2f}", f"{statistics.fmean(nbytes):.1%}",
             f"{statistics.median(r[name][2] for r in per_seed) * 1e3:.1f}",
             f"{statistics.median(ratio):.2f}", goal])
    plot(curves, args.plot, f"char-level GPT on stdlib source, {cfg.steps} steps, "
                            f"{setting.precision}, mean of {len(args.seeds)} seed(s)")
    start_loss, base_loss = curves["baseline"][0][1], curves["baseline"][-1][1]
    print(f"\nbaseline (mean over seeds): validation loss {start_loss:.3f} -> {base_loss:.3f} "
          f"(uniform guess {math.log(VOCAB):.3f}); per seed: excess in % for each seed; "
          f"goals missed: {', '.join(missed) or 'none'}; plot: {args.plot}; "
          f"wall time {time.perf_counter() - began:.0f} s")
    if args.quick:
        print("(--quick is a smoke test: too few steps for the goals to mean anything)")


if __name__ == "__main__":
    main()
