"""The `actdesign` command. Commands parse, call the library and print; nothing more.

Errors a user can cause print one line on stderr and exit with code 2, without a traceback.
torch and triton are never imported by `list`, `fit`, `show` or `gen-kernel`, and sympy only
where an expression is parsed or a kernel printed. Long steps say so on stderr (--quiet
silences them); stdout holds the results alone.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import click

from .errors import ActdesignError
from .options import PRECISIONS

_FORCE = click.option("--force", is_flag=True,
                      help="Overwrite an output that is not an actdesign output of the same "
                           "kind, or replace a symbolic link.")


_QUIET = click.option("--quiet", "-q", is_flag=True,
                      help="No progress lines on stderr (results on stdout are the same).")


ANNOUNCE_AFTER = 0.5  # seconds


@contextlib.contextmanager
def _step(what: str, quiet: bool):
    """A line on stderr once a step has run ANNOUNCE_AFTER seconds, and one with its seconds
    when it ends. The delay keeps a request refused at once to its one-line error."""
    if quiet:
        yield
        return
    start, said = time.perf_counter(), []

    def say():
        said.append(True)
        click.echo(f"{what} ...", err=True)

    announce = threading.Timer(ANNOUNCE_AFTER, say) if ANNOUNCE_AFTER > 0 else None
    if announce is None:
        say()
    else:
        announce.daemon = True
        announce.start()
    try:
        yield
    finally:
        if announce is not None:
            announce.cancel()
            announce.join()  # a line already on its way is out before the next one
    if said:
        click.echo(f"{what}: done in {time.perf_counter() - start:.1f} s", err=True)


def _check_out(path, kind, force):
    """Refuse a bad output path before any work: see files.check_writable."""
    from .files import check_writable

    if path is not None:
        check_writable(path, kind, force)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="actdesign")
def cli():
    """Design, generate and run memory-efficient backward passes for PyTorch training."""


@cli.command("list")
def list_cmd():
    """Every built-in activation, one line each."""
    from .activation import BUILTINS

    for b in BUILTINS:
        aliases = f"; alias {', '.join(b.aliases)}" if b.aliases else ""
        click.echo(f"{b.name:<13} {b.formula}  ({b.summary}{aliases})")


def _weight(spec: str, mean: float | None, std: float | None, domain):
    from actdesign.designer.weights import Normal, Uniform, load_empirical

    kind, _, arg = spec.partition(":")
    if kind != "normal" and (mean is not None or std is not None):
        raise ActdesignError("--mean and --std apply to --weight normal only")
    if kind != "uniform" and domain is not None:
        raise ActdesignError("--domain applies to --weight uniform only")
    if kind == "normal" and not arg:
        return Normal(0.0 if mean is None else mean, 1.0 if std is None else std)
    if kind == "uniform" and not arg:
        if domain is None:
            raise ActdesignError("--weight uniform needs --domain L R")
        return Uniform(*domain)
    if kind == "empirical" and arg:
        return load_empirical(arg)
    raise ActdesignError(f"unknown --weight {spec!r}; use normal, uniform or empirical:FILE")


@cli.command()
@click.argument("activation")
@click.option("--bits", "-b", type=click.IntRange(1, 8), required=True,
              help="Bits per element: the table has 2^bits levels.")
@click.option("--kind", type=click.Choice(["stepwise", "pwl"]), default="stepwise",
              show_default=True,
              help="stepwise: the optimal step function for f'. pwl: the best piecewise-linear "
                   "h~ = L(x) + sum a_i max(x - c_i, 0) for f itself (bits 1..4).")
@click.option("--weight", "-w",
              help="Input distribution: normal, uniform (with --domain) or empirical:FILE "
                   "(.npy of recorded values, or .npz with 'edges' and 'counts'). Default: "
                   "normal for stepwise; for pwl, unweighted on [-B, B] (see --tail-tol).")
@click.option("--tail-tol", type=float, default=1e-10, show_default=True,
              help="pwl, unweighted: B is set so the tails beyond ±B add less than this.")
@click.option("--mean", type=float, help="Mean of the normal weight [0].")
@click.option("--std", type=float, help="Standard deviation of the normal weight [1].")
@click.option("--domain", type=(float, float), metavar="L R", help="Uniform weight on [L, R].")
@click.option("--grid", type=int, help="Candidate-grid cells for the exact stage "
                                       "[max(2048, 32 * 2^bits)].")
@click.option("--out", "-o", type=click.Path(dir_okay=False), help="Write the spec here.")
@click.option("--no-cache", is_flag=True,
              help="Fit again even if this very table was fitted before (and keep the new one).")
@_QUIET
@_FORCE
def fit(activation, bits, kind, weight, tail_tol, mean, std, domain, grid, out, no_cache, quiet,
        force):
    """Fit an optimal few-bit table for ACTIVATION: a step function for f' (stepwise), or a
    piecewise-linear f whose derivative is one (pwl).

    ACTIVATION is a built-in name (see 'actdesign list') or an expression in x, such as
    "x*sigmoid(1.702*x)". A table fitted before for the same request is read back from the
    cache (see --no-cache).
    """
    from . import fit_cache

    _check_out(out, "spec", force)
    options = {"activation": activation, "bits": bits, "kind": kind, "weight": weight,
               "tail_tol": tail_tol, "mean": mean, "std": std,
               "domain": None if domain is None else list(domain), "grid": grid}
    recalled = None if no_cache else fit_cache.recall(options)
    if recalled is not None:
        _report(*recalled, out)
        return

    from . import builtin_tables
    from . import spec as spec_mod
    from .activation import resolve
    from .report import describe

    act = resolve(activation)
    if kind == "pwl" and grid is not None:
        raise ActdesignError("--grid applies to --kind stepwise only")
    unweighted = kind == "pwl" and (weight, mean, std, domain) == (None,) * 4
    w = None if unweighted else _weight(weight or "normal", mean, std, domain)
    request = fit_cache.request(act, bits, kind, w, grid, tail_tol if kind == "pwl" else None)
    spec = None if no_cache else fit_cache.load(request) or builtin_tables.for_request(
        act, bits, kind, w, grid, tail_tol)
    if spec is not None:
        text = describe(spec)
        fit_cache.remember(options, request, text)
        _report(spec.to_json(), text, out)
        return
    if kind == "pwl":
        from .designer.pwl import fit_pwl

        with _step(f"fitting a {bits}-bit piecewise-linear {act.label}", quiet):
            spec = spec_mod.from_pwl(fit_pwl(act, bits, w, tail_tol))
    else:
        from .designer.stepwise import MAX_GRID, _integer, default_grid, fit_stepwise

        # Checked before the progress line: a refused request prints its error alone.
        _integer("grid", default_grid(bits) if grid is None else grid, 2 * 2**bits, MAX_GRID)
        long_fit = bits >= 6 or (grid or 0) > 8192
        with _step(f"fitting a {bits}-bit table for {act.label}'", quiet or not long_fit):
            if long_fit and not quiet and sys.stderr.isatty():
                with click.progressbar(length=2**bits - 1, label="optimal grid partition",
                                       file=sys.stderr) as bar:
                    result = fit_stepwise(act, bits, w, grid, lambda done, total: bar.update(1))
            else:
                result = fit_stepwise(act, bits, w, grid)
        spec = spec_mod.from_fit(result)
    fit_cache.store(request, spec)
    text = describe(spec)
    fit_cache.remember(options, request, text)
    _report(spec.to_json(), text, out)


def _report(spec_text: str, text: str, out):
    """Write the spec, print its table (titled by the file): the same for a fit and a recall."""
    from .files import write_atomic

    if out is not None:
        write_atomic(out, spec_text)
    click.echo(f"{out}: {text}" if out else text)
    if out is not None:
        click.echo(f"\nwrote {out}")


@cli.command()
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--plot", type=click.Path(dir_okay=False), metavar="PNG",
              help="Also draw f', the table and the error into this PNG file.")
@_FORCE
def show(spec_file, plot, force):
    """Print a spec's borders, levels and error as a readable table."""
    from . import report
    from .spec import load

    _check_out(plot, "plot", force)
    spec = load(spec_file)
    click.echo(report.describe(spec, spec_file))
    if plot is not None:
        report.plot(spec, plot)
        click.echo(f"\nwrote {plot}")


@cli.command("gen-kernel")
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--out", "-o", type=click.Path(dir_okay=False), metavar="FILE.py",
              help="Write the module here [SPEC's directory, <name>_ops.py].")
@_FORCE
def gen_kernel(spec_file, out, force):
    """Generate a self-contained op module (Triton kernels, torch op, nn.Module) from SPEC."""
    import keyword
    import re
    from pathlib import Path

    from .codegen.render import write
    from .spec import load

    if out is None:
        stem = re.sub(r"\W", "_", Path(spec_file).stem)
        out = str(Path(spec_file).with_name(f"{stem}_ops.py"))
    elif not out.endswith(".py"):
        raise ActdesignError(f"--out {out!r} must end in .py, so Python can import it")
    module = Path(out).stem
    if not module.isidentifier() or keyword.iskeyword(module):
        raise ActdesignError(f"cannot import {out!r}: {module!r} is not a valid Python module "
                             "name; give --out a name like my_ops.py")
    spec = load(spec_file)
    _check_out(out, "module", force)
    write(spec, out)
    click.echo(f"wrote {out}: {spec.bits}-bit codes; the op stores {spec.bits / 8:g} bytes per "
               "element for backward, against 2 for a bf16 input (4 for float32)")
    click.echo(f"use it: import {Path(out).stem}  (or actdesign.runtime.load({spec_file!r}))")


@cli.command()
@click.argument("stats_file", metavar="STATS", type=click.Path(dir_okay=False))
@click.option("--avg-bits", type=click.FloatRange(1, 8), required=True,
              help="The budget: this many bits per unit of weight on average.")
@click.option("--out", "-o", type=click.Path(dir_okay=False), help="Write the bits here.")
@_FORCE
def allocate(stats_file, avg_bits, out, force):
    """Bits per item minimising Σ C/(2^b-1)² under Σ w·b <= avg-bits·Σ w, exactly.

    STATS is {"format": "actdesign.stats/1", "items": [{"name", "C", "w"}, ...]}, as
    calibration writes it. Also prints the published heap greedy for comparison.
    """
    import numpy as np

    from .designer.allocate import allocate, greedy_heap, load_stats, save_bits, variance

    _check_out(out, "bits", force)
    names, C, w = load_stats(stats_file)
    budget = avg_bits * float(w.sum())
    start = time.perf_counter()
    result = allocate(C, w, budget)
    seconds = time.perf_counter() - start
    greedy = variance(C, greedy_heap(C, w, budget))
    better = (greedy - result.variance) / greedy if greedy > 0 else 0.0
    click.echo(f"{len(names)} items, budget {budget:.6g} ({avg_bits:g} bits on average), "
               f"used {result.used:.6g}")
    click.echo(f"variance {result.variance:.10g} (exact, {seconds:.3f} s); published greedy "
               f"{greedy:.10g}: ours {100 * better:.4g}% lower")
    counts = np.bincount(result.bits, minlength=9)[1:]
    click.echo("bits: " + ", ".join(f"{b}: {c}" for b, c in enumerate(counts, 1) if c))
    if out is not None:
        save_bits(out, result, {n: int(b) for n, b in zip(names, result.bits, strict=True)},
                  avg_bits=avg_bits, greedy_variance=greedy)
        click.echo(f"wrote {out}")


_MODEL_HELP = ("A built-in transformers config (gpt2, llama, qwen2, bert, vit, or their -tiny "
               "variants); a local Hugging Face model directory or its config.json; "
               "hf:<repo id> (its config from the local Hub cache); timm:<name> or "
               "torchvision:<name> (an image classifier); all these build the "
               "architecture with random weights, nothing downloaded. Or "
               "package.module:function / file.py:function (the current directory "
               "importable) returning a model, or (model, make_batch(batch, seq)).")


class _Defined(click.Choice):
    """The values the code defining them gives (`values()`), read when an option is parsed
    or its help shown: the defining modules import torch, which `fit` and the others never
    pay for."""

    def __init__(self, values):
        self._values = values
        super().__init__(())

    @property
    def choices(self):
        return tuple(self._values())

    @choices.setter
    def choices(self, _):
        pass


def _cards():
    from .runtime.memory.cards import NAMES

    return NAMES


def _optimizers():
    from .runtime.memory.footprint import OPTIMIZERS

    return OPTIMIZERS


def _kernels():
    from .runtime.memory.estimate import KERNELS

    return KERNELS


class _PresetsHelp(click.Option):
    """An option whose help ends with the policy presets, read from the policy module only
    when the help is shown (it imports torch)."""

    def get_help_record(self, ctx):
        from .runtime.apply.policy import PRESETS

        self.help = (f"A preset ({', '.join(PRESETS)}), presets joined by '+', or a policy "
                     ".json file.")
        return super().get_help_record(ctx)


_IMAGE_SIZE = click.option(
    "--image-size", type=click.IntRange(1), metavar="PIXELS",
    help="The side of the square images an image model takes [its config's or timm's own "
         "size, else 224].")


@cli.command()
@click.option("--model", "-m", "model_name", required=True, help=_MODEL_HELP)
@click.option("--policy", "-p", default="fewbit3", show_default=True, cls=_PresetsHelp)
@click.option("--batch", type=click.IntRange(1), default=8, show_default=True)
@click.option("--seq", type=click.IntRange(1), default=256, show_default=True,
              help="Sequence length (text models).")
@_IMAGE_SIZE
@click.option("--device", default=None, help="cpu or cuda [cuda when available].")
@click.option("--precision", type=click.Choice(PRECISIONS),
              default=None, help="fp32; bf16-autocast (float32 weights, the forward under "
                                 "bfloat16 autocast); bf16 (bfloat16 weights and inputs) "
                                 "[bf16-autocast on CUDA, fp32 on CPU].")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Timed steps per model (after one warm-up step); the median and the "
                   "range are reported.")
@click.option("--per-module", is_flag=True, help="One row per module, not per layer pattern.")
@click.option("--plot", type=click.Path(dir_okay=False), metavar="PNG",
              help="Also draw the saved bytes by module as a bar chart.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True),
              metavar="FILE", help="Also write the measurements as JSON ('-': stdout only).")
@_FORCE
def profile(model_name, policy, batch, seq, image_size, device, precision, repeats, per_module,
            plot, json_out, force):
    """One training step of a model, baseline and compressed with POLICY: bytes saved for the
    backward by module, peak memory and step time. Progress goes to stderr; --json records
    exact bytes."""
    import json

    import torch

    from .files import write_atomic
    from .runtime import load_policy
    from .runtime.memory.profile import plot as draw
    from .runtime.memory.profile import profile as run

    _check_out(plot, "plot", force)
    _check_out(json_out if json_out != "-" else None, "json", force)
    load_policy(policy)  # a bad policy fails before the model is built
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = run(model_name, policy, batch, seq, device, repeats, precision=precision,
                 progress=lambda message: click.echo(message, err=True),
                 image_size=image_size)
    text = json.dumps(result.to_dict(), indent=1)
    if json_out == "-":
        click.echo(text)
        return
    click.echo(result.table(per_module))
    skipped = result.report.skipped
    for name, kind, why in skipped[:8]:
        click.echo(f"left alone {name} ({kind}): {why}")
    if len(skipped) > 8:
        click.echo(f"... and {len(skipped) - 8} more (--json lists all)")
    if plot is not None:
        draw(result, plot, per_module)
        click.echo(f"wrote {plot}")
    if json_out is not None:
        write_atomic(json_out, text + "\n")
        click.echo(f"wrote {json_out}")


@cli.command()
@click.option("--model", "-m", "model_name", required=True,
              help="A built-in transformers config, a local Hugging Face model directory or "
                   "its config.json, hf:<repo id>, timm:<name> or torchvision:<name>: built "
                   "on fake tensors, no weights.")
@click.option("--batch", type=click.IntRange(1), default=8, show_default=True)
@click.option("--seq", type=click.IntRange(1), default=256, show_default=True,
              help="Sequence length (text models).")
@_IMAGE_SIZE
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16-autocast",
              show_default=True,
              help="fp32; bf16-autocast (float32 weights, the forward under bfloat16 "
                   "autocast); bf16-weights-autocast (bfloat16 weights under autocast: "
                   "Trainer's bf16=True on a model loaded in bfloat16); bf16 (bfloat16 "
                   "weights and inputs).")
@click.option("--policy", "-p", "policies", multiple=True, default=("none",),
              show_default=True,
              help="Repeatable, one row each: a preset, presets joined by '+' or a policy file.")
@click.option("--checkpointing", is_flag=True, help="With gradient checkpointing.")
@click.option("--lora", type=click.IntRange(1), metavar="RANK",
              help="PEFT LoRA adapters of this rank on every Linear layer but the head; only "
                   "they are trained.")
@click.option("--4bit", "four_bit", is_flag=True,
              help="With --lora: QLoRA, the base in bitsandbytes' 4-bit NF4 (modelled).")
@click.option("--optimizer", type=_Defined(_optimizers), default="adamw", show_default=True,
              help="Whose state the total counts: AdamW, bitsandbytes' 8-bit AdamW, SGD "
                   "without momentum, or none.")
@click.option("--gpu-memory", "gpu_memory", multiple=True, metavar="SIZE",
              help="Repeatable: say whether the total with its margins fits in this much "
                   "memory, such as 24GiB or 80GB.")
@click.option("--card", type=_Defined(_cards),
              help="The card whose measured margins (CUDA context, fragmentation) to use; "
                   "without one, or where it is not measured, they are assumed.")
@click.option("--kernels", type=_Defined(_kernels), default="cuda", show_default=True,
              help="Whose allocations the peak follows for actdesign's ops: their CUDA "
                   "kernels' or their CPU paths'.")
@click.option("--offload", "cpu_offload", is_flag=True,
              help="FSDP2's CPU offload: the weights, gradients and optimizer state on the "
                   "host; the card holds the units in flight (modelled).")
@click.option("--max-seq", "max_seq", is_flag=True,
              help="Find the longest sequence (at --batch) whose step fits each --gpu-memory.")
@click.option("--max-batch", "max_batch", is_flag=True,
              help="Find the largest batch (at --seq) whose step fits each --gpu-memory.")
@click.option("--step", type=click.IntRange(1), metavar="N",
              help="The search's step: the answer is a multiple of it, and one step more "
                   "does not fit [256 tokens, 1 sequence].")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True),
              metavar="FILE", help="Also write the estimate as JSON ('-': stdout only).")
@_FORCE
def estimate(model_name, batch, seq, image_size, precision, policies, checkpointing, lora,
             four_bit, optimizer, gpu_memory, card, kernels, cpu_offload, max_seq, max_batch,
             step, json_out, force):
    """Estimate the memory of one training step from a model's config, without its weights
    or a GPU: bytes saved for the backward by module, the activation peak, weights,
    gradients and optimizer state, and the margins a card needs beyond them. Progress goes
    to stderr."""
    import json

    from .files import write_atomic
    from .options import parse_size

    _check_out(json_out if json_out != "-" else None, "json", force)
    for size in gpu_memory:  # every option read before any model is built
        parse_size(size, "GPU memory")
    if four_bit and lora is None:
        raise ActdesignError("--4bit is QLoRA: give --lora RANK too")
    if max_seq and max_batch:
        raise ActdesignError("search one of --max-seq and --max-batch at a time")
    longest = "seq" if max_seq else "batch" if max_batch else None
    if longest is not None and not gpu_memory:
        raise ActdesignError(f"--max-{longest} searches against a card: give --gpu-memory SIZE")
    if longest is None and step is not None:
        raise ActdesignError("--step is the step of --max-seq or --max-batch: give one")
    from .runtime.apply import policy as policy_mod
    from .runtime.memory.estimate import estimate as run

    for p in policies:
        policy_mod.load(p)
    result = run(model_name, batch, seq, precision, policies, checkpointing, optimizer,
                 list(gpu_memory) or None, lambda message: click.echo(message, err=True),
                 lora, kernels, card, four_bit, longest=longest, step=step,
                 cpu_offload=cpu_offload, image_size=image_size)
    text = json.dumps(result.to_dict(), indent=1)
    if json_out == "-":
        click.echo(text)
        return
    click.echo(result.table())
    if json_out is not None:
        write_atomic(json_out, text + "\n")
        click.echo(f"wrote {json_out}")


@cli.command("calibrate")
@click.option("--model", "-m", "model_name", required=True, help=_MODEL_HELP)
@click.option("--data", required=True, metavar="MODULE:FUNCTION",
              help="package.module:function or file.py:function returning an iterable of "
                   "batches: model inputs as a tensor, a tuple or a dict of keywords.")
@click.option("--bits", "-b", type=click.IntRange(1, 8), default=None,
              help="Bits of the activation tables [3, or the policy's].")
@click.option("--policy", "-p", default=None,
              help="The base policy whose fewbit activations and actnn layers are calibrated "
                   "[fewbit<bits>].")
@click.option("--actnn-bits", type=click.FloatRange(1, 8), default=None,
              help="Average bits for the ActNN allocation [the policy's actnn bits].")
@click.option("--out", "-o", type=click.Path(dir_okay=False), required=True,
              help="Write the calibrated policy here.")
@_FORCE
def calibrate_cmd(model_name, data, bits, policy, actnn_bits, out, force):
    """Fit a table per activation layer to the inputs it sees on your data (and allocate ActNN
    bits exactly); write one policy that compress and profile accept."""
    from .runtime import load_policy
    from .runtime import models as model_mod
    from .runtime.apply.policy import save
    from .runtime.calibration.policy import calibrate_policy

    _check_out(out, "policy", force)
    base = load_policy(policy or f"fewbit{bits or 3}")
    batches = model_mod.load_callable(data, "data")
    model, _ = model_mod.build(model_name)
    result = calibrate_policy(model, lambda: _batches(batches, data), base, bits=bits,
                              actnn_bits=actnn_bits,
                              progress=lambda message: click.echo(message, err=True))
    click.echo(result)
    save(result.policy, out)
    click.echo(f"wrote {out}: {len(result.policy.rules)} rules")


@cli.command("plan")
@click.option("--model", "-m", "model_name", required=True, help=_MODEL_HELP
              + " A local Hugging Face directory with safetensors weights is calibrated on "
                "those weights.")
@click.option("--batch", type=click.IntRange(1), required=True, help="Training batch size.")
@click.option("--seq", type=click.IntRange(1), default=256, show_default=True,
              help="Training sequence length (text models).")
@_IMAGE_SIZE
@click.option("--precision", type=click.Choice(PRECISIONS),
              default="bf16-autocast", show_default=True)
@click.option("--budget", required=True, metavar="SIZE|FRACTION",
              help="The activation peak allowed: a size such as 20GiB or 12.5MiB, or a "
                   "fraction of the uncompressed model's saved bytes such as 0.35.")
@click.option("--data", metavar="MODULE:FUNCTION",
              help="package.module:function or file.py:function returning an iterable of "
                   "calibration batches [random tokens in the model's vocabulary].")
@click.option("--calibration-batches", type=click.IntRange(1, 64), default=4,
              show_default=True, help="Random calibration batches, without --data.")
@click.option("--calibration-shape", type=(click.IntRange(1), click.IntRange(1)),
              default=(2, 128), show_default=True, metavar="BATCH SEQ",
              help="Their shape, without --data.")
@click.option("--max-slowdown", type=click.FloatRange(1), default=1.10, show_default=True,
              help="The step time allowed, against the lossless policy's (modelled).")
@click.option("--card", "--device", "device_name", type=_Defined(_cards), default="h200",
              show_default=True,
              help="The GPU whose costs give the time (measured on it where the repository "
                   "holds its measurements, else its peak FLOP rate and bandwidth).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), required=True,
              help="Write the planned policy here (compress and estimate accept it).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the report: predicted bytes, peak and error, per site.")
@click.option("--plot", type=click.Path(dir_okay=False), metavar="PNG",
              help="Also draw the error-memory front, with the presets marked.")
@_FORCE
def plan_cmd(model_name, batch, seq, image_size, precision, budget, data, calibration_batches,
             calibration_shape, max_slowdown, device_name, out, json_out, plot, force):
    """Plan the least gradient error that fits a memory budget: every site's method and bits,
    and which blocks to recompute, from exact shape-only steps at the training shape and
    gradient errors measured on calibration batches. Progress goes to stderr."""
    import json

    from .files import write_atomic
    from .options import parse_budget
    from .runtime import models as model_mod
    from .runtime.apply.policy import save
    from .runtime.memory import planner

    _check_out(out, "policy", force)
    for path, kind in ((json_out, "json"), (plot, "plot")):
        _check_out(path, kind, force)
    parse_budget(budget)  # refused at once, before any model is built or measured

    def say(message):
        click.echo(message, err=True)

    source = model_mod.load_callable(data, "data") if data is not None else None  # first
    model, make_batch = model_mod.build(model_name, say=say, image_size=image_size)
    trained = model_mod.with_weights(model_name, model)
    model = (trained or model).float().train()
    if source is not None:
        batches = list(_batches(source, data))
        calibration = f"{len(batches)} batches of {data}"
    else:
        b, s = calibration_shape
        batches = [model_mod.example_batch(model, b, s, make_batch, seed=1 + i)
                   for i in range(calibration_batches)]
        calibration = (f"{calibration_batches} batches of random tokens in the model's "
                       f"vocabulary ({b} x {s}), no --data")
    calibration += ", on its trained weights" if trained is not None else \
        ", on random weights (no trained weights given)"
    example = model_mod.example_batch(model, batch, seq, make_batch)
    result = planner.plan(model, batches, budget, example_inputs=example, precision=precision,
                          max_slowdown=max_slowdown, device=device_name,
                          calibration=calibration, progress=say)
    click.echo(result.table())
    save(result.policy, out)
    click.echo(f"wrote {out}")
    if json_out is not None:
        write_atomic(json_out, json.dumps(result.report(), indent=1) + "\n")
        click.echo(f"wrote {json_out}")
    if plot is not None:
        planner.draw_front(result, model, batches, example, precision, plot, progress=say)
        click.echo(f"wrote {plot}")


def _batches(function, name):
    from .runtime.models.batches import iterate

    return iterate(function(), f"what data {name!r} returned")


def main(argv=None) -> None:
    """Entry point: one-line errors with exit code 2, never a traceback for user mistakes."""
    try:
        # Not cli.main: it turns Ctrl-C into a bare Abort after printing a blank line.
        with cli.make_context("actdesign", sys.argv[1:] if argv is None else list(argv)) as ctx:
            code = cli.invoke(ctx)
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("actdesign: aborted", err=True)
        sys.exit(1)
    except (click.ClickException, ActdesignError) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        click.echo(f"actdesign: error: {' '.join(message.split())}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("actdesign: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
