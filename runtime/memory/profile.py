"""One training step of a model, baseline and compressed: saved bytes by module, peak memory
and step time, in a chosen precision.

Precisions: `fp32`; `bf16-autocast`, float32 weights with the forward under
`torch.autocast(dtype=torch.bfloat16)` and the backward outside it, as torch recommends;
`bf16-weights-autocast`, bfloat16 weights under the same autocast (what transformers' Trainer
with bf16=True runs on a model loaded in bfloat16); and `bf16`, weights and floating inputs in
bfloat16, no autocast. The default is bf16-autocast on CUDA and fp32
on CPU.

Saved bytes are the distinct storages autograd keeps for the backward (parameters aside), each
charged to the module that first saved it; what the model's own forward saves outside its
submodules (its output and loss) is the row "(output and loss)". Weight copies (autocast's
bfloat16 casts) are made once per step whatever the batch, and are counted apart from the
activations, which grow with the batch. Peak memory is CUDA's allocator peak on a GPU; on CPU
it is the saved-bytes account (torch keeps no CPU allocator peak). Times are the median and the
range (min-max) of `repeats` steps after one warm-up step, which also compiles any kernels.
"""

from __future__ import annotations

import contextlib
import copy
import re
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from actdesign.errors import ActdesignError
from actdesign.options import PRECISIONS

from .. import models
from ..apply.accounting import account
from ..apply.compress import Report, compress


def bf16_weights(precision: str) -> bool:
    """Whether the weights are bfloat16: bf16, and bf16-weights-autocast (what transformers'
    Trainer with bf16=True runs on a model loaded in bfloat16)."""
    return precision in ("bf16", "bf16-weights-autocast")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ActdesignError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {precision!r}")
    return precision


def default_precision(device: str) -> str:
    return "bf16-autocast" if device.startswith("cuda") else "fp32"


OUTPUT_ROW = "(output and loss)"  # the model's own forward, outside its submodules


@dataclass
class Run:
    saved: dict[str, int]  # module name -> bytes, weight copies aside
    total: int  # all saved bytes, weight copies included
    peak: int  # bytes; see `peak_kind`
    step_s: float  # the median of `times`
    times: list[float]
    constant: int = 0  # bytes of weight copies, once per step

    @property
    def activations(self) -> int:
        return self.total - self.constant


@dataclass
class Profile:
    model: str
    policy: str
    shape: str
    device: str
    precision: str
    peak_kind: str
    baseline: Run
    compressed: Run
    report: Report

    def rows(self, per_module: bool = False) -> list[tuple[str, int, int]]:
        """(module, baseline bytes, compressed bytes), by module or by module pattern (layer
        numbers replaced by *), in first-seen order."""
        rows: dict[str, list[int]] = {}
        for which, run in enumerate((self.baseline, self.compressed)):
            for name, n in run.saved.items():
                key = name if per_module else re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
                rows.setdefault(key or OUTPUT_ROW, [0, 0])[which] += n
        return [(k, a, b) for k, (a, b) in rows.items()]

    def to_dict(self) -> dict:
        def run(r: Run):
            return {"saved_bytes": r.total, "activation_bytes": r.activations,
                    "weight_copy_bytes": r.constant, "peak_bytes": r.peak,
                    "step_seconds": r.step_s, "step_seconds_all": r.times,
                    "saved_by_module": r.saved}

        return {"model": self.model, "policy": self.policy, "shape": self.shape,
                "device": self.device, "precision": self.precision,
                "peak_kind": self.peak_kind,
                "baseline": run(self.baseline), "compressed": run(self.compressed),
                "saved_ratio": _ratio(self.compressed.total, self.baseline.total),
                "peak_ratio": _ratio(self.compressed.peak, self.baseline.peak),
                "time_ratio": _ratio(self.compressed.step_s, self.baseline.step_s),
                "time_warning": time_warning(self.baseline.times, self.compressed.times),
                "compress": self.report.to_dict()}

    def table(self, per_module: bool = False) -> str:
        a, b = self.baseline, self.compressed
        scale, unit = size_unit(max(a.total, b.total, a.peak, b.peak))

        def row(label, x, y, ratio=True):
            return (f"{label[-47:]:<48}{x / scale:>14,.2f}{y / scale:>16,.2f}"
                    f"{_fmt(_ratio(y, x)) if ratio else '':>8}")

        lines = [f"{self.model}, policy {self.policy}, {self.shape}, {self.precision}, "
                 f"on {self.device}",
                 f"{'saved for backward':<48}{'baseline ' + unit:>14}{'compressed ' + unit:>16}"
                 f"{'ratio':>8}"]
        lines += [row(name, x, y) for name, x, y in self.rows(per_module)]
        if a.constant or b.constant:
            lines.append(row("activations (grow with the batch)", a.activations, b.activations))
            lines.append(row("weight copies (once per step)", a.constant, b.constant))
        lines.append(row("total", a.total, b.total))
        lines.append(row(f"peak memory ({self.peak_kind})", a.peak, b.peak))
        lines.append(f"{'step time, ms: median':<48}{a.step_s * 1e3:>14,.1f}"
                     f"{b.step_s * 1e3:>16,.1f}{_fmt(_ratio(b.step_s, a.step_s)):>8}")
        lines.append(f"{f'  min-max of {len(a.times)}':<48}{_range(a.times):>14}"
                     f"{_range(b.times):>16}")
        if any(name == OUTPUT_ROW for name, _, _ in self.rows()):
            lines.append(f"{OUTPUT_ROW}: saved by the model's own forward, outside its "
                         "submodules: computing its output and loss")
        warning = time_warning(a.times, b.times)
        if warning:
            lines.append(f"warning: {warning}")
        return "\n".join(lines)


def size_unit(largest: int) -> tuple[int, str]:
    """(bytes per unit, unit) for a table whose largest figure is `largest` bytes: GiB from
    1 GiB, MiB from 1 MiB, KiB below (toy models)."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if largest >= scale:
            return scale, unit
    return 2**10, "KiB"


def time_warning(baseline: list[float], compressed: list[float]) -> str | None:
    """A warning when the two medians differ by less than either's spread (max - min): the
    difference shown is then noise as much as it is the policy's."""
    spread = max(max(baseline) - min(baseline), max(compressed) - min(compressed))
    difference = abs(statistics.median(compressed) - statistics.median(baseline))
    if spread <= difference:
        return None
    return (f"the step times differ by {difference * 1e3:,.1f} ms, less than their spread "
            f"({spread * 1e3:,.1f} ms): more --repeats, or a quieter machine, to tell them apart")


def _range(times: list[float]) -> str:
    return f"{min(times) * 1e3:,.1f}-{max(times) * 1e3:,.1f}"


def _ratio(a, b):
    return a / b if b else None


def _fmt(r) -> str:
    return "-" if r is None else f"{r:.3f}"


def profile(model_name: str, policy, batch: int = 8, seq: int = 256, device: str = "cpu",
            repeats: int = 3, seed: int = 0, precision: str | None = None,
            progress=None, image_size: int | None = None) -> Profile:
    """Build the model (a name models.build takes; an image model's images `image_size`
    pixels square), copy it, compress the copy with `policy`, and measure one training step
    of each on the same random batch, in `precision` (one of PRECISIONS; default:
    bf16-autocast on CUDA, fp32 on CPU). `progress(message)`, when given, hears each stage as
    it starts."""
    precision = check_precision(precision or default_precision(device))
    start = time.perf_counter()

    def say(message):
        if progress is not None:
            progress(f"[{time.perf_counter() - start:6.1f} s] {message}")

    model, make_batch = models.build(model_name, seed, say, image_size=image_size)
    model = model.to(device).train()
    inputs = models.example_batch(model, batch, seq, make_batch, seed)
    small = models.example_batch(model, 2, min(seq, 8), make_batch, seed)
    if bf16_weights(precision):
        model.to(torch.bfloat16)
    dtype = torch.bfloat16 if precision == "bf16" else None  # bf16: floating inputs too
    inputs, small = _to(inputs, device, dtype), _to(small, device, dtype)
    compressed = copy.deepcopy(model)
    say(f"compressing a copy with {policy if isinstance(policy, str) else 'the policy'}")
    report = compress(compressed, policy, example_inputs=small, allow_more=True)  # shown
    runs = [_measure(m, inputs, device, precision, repeats, seed,
                     lambda message, which=which: say(f"{which}: {message}"))
            for m, which in ((model, "baseline"), (compressed, "compressed"))]
    vision = getattr(getattr(model, "config", None), "image_size", None) \
        if make_batch is None else getattr(make_batch, "image_size", None)
    side = vision if not isinstance(vision, int) else (vision, vision)
    shape = f"batch {batch}, " + (f"{side[0]}x{side[1]} images" if vision
                                  else f"sequence {seq}")
    return Profile(model_name, report.policy, shape, device, precision,
                   "CUDA allocator" if device.startswith("cuda") else "saved-bytes account",
                   runs[0], runs[1], report)


def _to(inputs, device, dtype=None):
    """Inputs on the device; floating tensors in `dtype` too, when given."""
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device, dtype if dtype is not None and t.is_floating_point() else None)
    return tree_map(move, inputs)


def forward_context(precision: str, device: str):
    """Where the forward runs: under bfloat16 autocast for bf16-autocast and
    bf16-weights-autocast, else as it is."""
    if precision in ("bf16-autocast", "bf16-weights-autocast"):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _measure(model, inputs, device, precision, repeats, seed, say) -> Run:
    def loss():
        with forward_context(precision, device):
            return models.loss_of(models.call(model, inputs))

    def step():
        model.zero_grad(set_to_none=True)
        loss().backward()

    cuda = device.startswith("cuda")
    torch.manual_seed(seed)
    say("warm-up step")
    step()  # warm-up: kernels compile, lazy state is created
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(seed)
    say("counting saved bytes")
    saved, out = account(model, loss)
    out.backward()
    peak = torch.cuda.max_memory_allocated() if cuda else saved.total
    del out
    times = []
    for i in range(repeats):
        say(f"step {i + 1} of {repeats}")
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return Run(saved.by_module, saved.total, peak, statistics.median(times), times,
               saved.constant)


def plot(result: Profile, path, per_module: bool = False) -> None:
    """A horizontal bar chart of saved bytes by module, baseline against compressed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from actdesign.files import check_writable
    from actdesign.report import save_figure

    check_writable(path)
    rows = result.rows(per_module)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [a / 2**20 for _, a, _ in rows], 0.4, label="baseline")
    ax.barh([i - 0.2 for i in y], [b / 2**20 for _, _, b in rows], 0.4,
            label=f"compressed ({result.policy})")
    ax.set_yticks(list(y), [name[-40:] for name, _, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("saved for backward (MiB)")
    ax.set_title(f"{result.model}: {result.shape}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
