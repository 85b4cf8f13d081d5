"""One training step attributed to families of ops: for each, the kernels it launches, the
host time it takes and, on a GPU, its device time.

    python benchmarks/step_profile.py --model llama --batch 16 --seq 1024 \\
        --policy eager llm llm+checkpointing --device cuda --json out/step_profile.json
    python benchmarks/step_profile.py --model llama-tiny --batch 2 --seq 64   # CPU

Families: norms, rotation (the rotary embedding and q/k's rotation), GLU (the MLP's
elementwise part: act(gate)·up, or its activation), attention (what the attention module
computes besides its projections and the rotation), Linear (projections, LoRA adapters
included), loss (the head's product and the cross-entropy), casts (dtype conversions),
optimizer (AdamW's step), other (embeddings, residual adds, dropout, ...). An op belongs to
the innermost module or function of a family running when it is called; a backward op to
the family whose forward made its autograd node. A fused op counts once, in the family of
its module: MS-GLU's fused down projection is GLU, not Linear.

A row is a policy (`eager`, `none` or, with --lora, `peft`: no policy; a preset, presets
joined by '+', a policy file), optionally with `+checkpointing` (transformers' gradient
checkpointing), or `liger` (Liger-Kernel's patch for the architecture, CUDA only, where
installed). With --lora R the model's weights are bf16 and PEFT LoRA adapters of rank R sit
on its seven projections (dropout --dropout), compressed after PEFT as we recommend.

Columns, per row and family:
- launches: the kernels a CUDA step launches, counted per dispatched aten op that computes
  (views and allocations launch nothing) plus each Triton launch of our generated ops
  (actdesign.launches). It is counted in a shape-only step on fake tensors whose ops take
  their Triton paths, on the CPU and on the GPU alike, after one warm-up step.
- host ms: the host's time in the family's ops (self time, torch.profiler), from one real
  step on the device after warm-up; on the CPU this includes the computing itself.
- device ms (GPU only): the time of the kernels the family's ops launched.
- kernels (GPU only): the kernels the profiler saw, beside `launches`.
The step time is the median of --repeats unprofiled steps.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign import launches as launch_log  # noqa: E402
from actdesign.errors import ActdesignError  # noqa: E402
from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory.profile import PRECISIONS, bf16_weights, forward_context  # noqa: E402
from actdesign.runtime.memory.setups import fake_model, with_checkpointing  # noqa: E402
from actdesign.runtime.ops.fake import shapes_only  # noqa: E402
from actdesign.runtime.ops.hooks import observer  # noqa: E402
from actdesign.runtime.ops.known_modules import (
    ROTARY,
    is_activation,
    is_gated_mlp,
    is_hf_conv1d,
    is_lora_linear,
    is_norm,
)

FAMILIES = ("norms", "rotation", "glu", "attention", "linear", "loss", "casts", "optimizer",
            "other")
# Ops whose family is theirs wherever they run (the head's cross-entropy runs in the
# model's own forward, outside any module of a family).
_OP_FAMILIES = {"_to_copy": "casts", "_log_softmax": "loss", "_log_softmax_backward_data": "loss",
                "nll_loss_forward": "loss", "nll_loss_backward": "loss", "nll_loss": "loss",
                "cross_entropy_loss": "loss"}
# Dispatched ops that launch no kernel: allocations, aliases (views are found by schema) and
# the profiler's ranges (the optimizer's step opens one).
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "_unsafe_view", "lift_fresh", "set_", "resize_", "_reshape_alias",
              "promote_types", "result_type", "_record_function_enter_new",
              "_record_function_exit"}
_MARK = "family::"


def module_family(module: nn.Module, head: nn.Module | None) -> str | None:
    """The family of a module's own ops, or None where they belong to the module around it."""
    name = type(module).__name__
    if module is head or name == "FusedLossHead":
        return "loss"
    if isinstance(module, nn.Linear) or is_hf_conv1d(module) or is_lora_linear(module):
        return "linear"
    if is_norm(module) or name.startswith(("MSLayerNorm", "MSRMSNorm", "QMSLayerNorm",
                                           "QMSRMSNorm")):
        return "norms"
    if is_gated_mlp(module) or name in ("MSGLU", "MSActivation") or is_activation(module) \
            or type(module).__module__.startswith("actdesign_ops_"):
        return "glu"
    if name.endswith("RotaryEmbedding"):
        return "rotation"
    if name.endswith(("Attention", "Attention2")):
        return "attention"
    return None


class Scopes:
    """Which family runs now. Forward: the innermost module or rotation function of a family
    on the stack. Backward: the family of the autograd node running, noted when the scope
    that made it closed (the nodes its outputs reach, short of its inputs' and nodes noted
    before). With `ranges`, each scope is a torch.profiler range named family::<family>."""

    def __init__(self, model: nn.Module, ranges: bool = False):
        self.stack: list[str] = []
        self.nodes: dict[tuple, str] = {}  # (node name, sequence number) -> family
        self.ranges = ranges
        self._open: list = []
        self._undo: list = []
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for module in model.modules():
            family = module_family(module, head)
            if family is not None:
                self._undo.append(module.register_forward_pre_hook(
                    observer(self._enter_hook(family)), with_kwargs=True))
                self._undo.append(module.register_forward_hook(
                    observer(lambda module, args, output: self.leave(output)),
                    always_call=True))
        self._wrap_rotations(model)

    def close(self):
        for undo in reversed(self._undo):
            undo() if callable(undo) else undo.remove()

    def family_now(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        return "other" if node is None else self.nodes.get(_key(node), "other")

    # --- scopes -------------------------------------------------------------------------

    def enter(self, family: str, inputs) -> None:
        self.stack.append(family)
        stops = {_key(t.grad_fn) for t in _tensors(inputs) if t.grad_fn is not None}
        self._open.append((family, stops))
        if self.ranges:
            rng = torch.profiler.record_function(_MARK + family)
            rng.__enter__()
            self._open[-1] += (rng,)

    def leave(self, outputs) -> None:
        family, stops, *rng = self._open.pop()
        if rng:
            rng[0].__exit__(None, None, None)
        self.stack.pop()
        todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            key = _key(node)
            if key in self.nodes or key in stops or not hasattr(node, "next_functions"):
                continue
            self.nodes[key] = family
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def _enter_hook(self, family):
        def hook(module, args, kwargs):
            self.enter(family, (args, kwargs))
        return hook

    def _wrap_rotations(self, model):
        """q and k's rotation: the apply_rotary_pos_emb each attention forward calls by name
        (transformers' own, or the one our attached forwards see) runs as a rotation scope."""
        seen = set()
        for module in model.modules():
            scope = _globals_of(module.forward)
            if scope is None or id(scope) in seen or not callable(scope.get(ROTARY)):
                continue
            seen.add(id(scope))
            original = scope[ROTARY]

            def rotation(*args, _original=original, **kwargs):
                self.enter("rotation", (args, kwargs))
                out = None
                try:
                    out = _original(*args, **kwargs)
                finally:
                    self.leave(out)
                return out

            scope[ROTARY] = rotation
            self._undo.append(lambda scope=scope, original=original:
                              scope.__setitem__(ROTARY, original))

    @contextlib.contextmanager
    def optimizer(self):
        self.enter("optimizer", ())
        try:
            yield
        finally:
            self.leave(None)


def _key(node) -> tuple:
    return (node.name(), node._sequence_nr())


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, tuple | list):
        for v in tree:
            yield from _tensors(v)


def _globals_of(forward):
    """The globals of the innermost function a bound forward runs, or None."""
    fn = getattr(forward, "__func__", forward)
    while hasattr(fn, "__wrapped__") and not isinstance(fn, type):
        inner = fn.__wrapped__
        fn = getattr(inner, "__func__", inner)
    return getattr(fn, "__globals__", None)


class LaunchCounter(TorchDispatchMode):
    """Kernel launches by family: aten ops that compute, and Triton launches noted."""

    def __init__(self, scopes: Scopes):
        super().__init__()
        self.scopes = scopes
        self.by_family = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace != "prim" and not func.is_view and name not in _NO_KERNEL:
            self.by_family[_OP_FAMILIES.get(name) or self.scopes.family_now()] += 1
        return func(*args, **(kwargs or {}))

    def triton_launch(self):
        self.by_family[self.scopes.family_now()] += 1


# --- rows ----------------------------------------------------------------------------------

LIGER = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
         "mistral": "apply_liger_kernel_to_mistral"}


@dataclass(frozen=True)
class Setup:
    """What every row of a table shares: the model, the shape, the precision and, with
    `lora` (a rank), PEFT LoRA adapters on the seven projections over bf16 weights."""
    model: str
    batch: int
    seq: int
    precision: str = "bf16-autocast"
    lora: int | None = None
    dropout: float = 0.05  # the adapters' lora_dropout
    compiled: bool = False  # torch.compile(model): the step time and peak alone


def split_row(row: str) -> tuple[str, bool]:
    """(the policy, with transformers' gradient checkpointing or not) of a row; `eager` and
    `peft` (LoRA rows) are no policy."""
    checkpointing = row == "checkpointing" or row.endswith("+checkpointing")
    policy = row.removesuffix("checkpointing").rstrip("+") or "none"
    return ("none" if policy in ("eager", "peft") else policy), checkpointing


def build(setup: Setup, row: str, device: str = "cpu", fake: bool = False):
    """A fresh model for the row (on fake tensors with `fake`, inside `shapes_only`), or None
    where the row does not apply (Liger off CUDA or not installed)."""
    bf16 = setup.lora is not None or bf16_weights(setup.precision)
    if fake:
        model = fake_model(setup.model, models.config_of(setup.model),
                           "bf16" if bf16 else "fp32", _lora_config(setup))
    else:
        model = models.build(setup.model, seed=0, device=device)[0].train()
        if bf16:
            model.to(torch.bfloat16)
    if row == "liger":
        try:
            import liger_kernel.transformers as liger
        except ImportError:
            return None
        family = setup.model.removesuffix("-tiny").removesuffix("-1b")
        if family not in LIGER or not device.startswith("cuda"):
            return None
        getattr(liger, LIGER[family])(model=model)
        return with_lora(model, setup)
    policy, checkpointing = split_row(row)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with_checkpointing(setup.model, model)
    if not fake:  # (a fake model has its adapters already)
        model = with_lora(model, setup)
    if policy != "none":
        compress(model, policy)  # after PEFT: the recommended order
    return model


def _lora_config(setup: Setup):
    if setup.lora is None:
        return None
    from lora_memory import lora_config

    return lora_config(setup.dropout, setup.lora)


def with_lora(model, setup: Setup):
    if setup.lora is None:
        return model
    import peft

    return peft.get_peft_model(model, _lora_config(setup))


def _inputs(model, setup: Setup):
    inputs = models.example_batch(model, setup.batch, setup.seq)
    if setup.precision == "bf16":
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                  for k, v in inputs.items()}
    return inputs


def _step(model, inputs, optimizer, precision, device, scopes=None):
    with forward_context(precision, device):
        loss = models.loss_of(models.call(model, inputs))
    loss.backward()
    with scopes.optimizer() if scopes is not None else contextlib.nullcontext():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def count_launches(setup: Setup, row: str) -> dict | None:
    """{family: launches} of one training step (after a warm-up step) on fake tensors taking
    our ops' Triton paths; None where the row does not apply (Liger, whose kernels need real
    CUDA tensors)."""
    if row == "liger" or setup.compiled:
        return None
    with shapes_only("cuda", skip_repeats=False):  # every launch counted
        model = build(setup, row, fake=True)
        inputs = _inputs(model, setup)
        optimizer = _optimizer(model)
        _step(model, inputs, optimizer, setup.precision, "cpu")  # warm-up: state, tables
        scopes = Scopes(model)
        counter = LaunchCounter(scopes)
        try:
            with launch_log.listening(counter.triton_launch), counter:
                _step(model, inputs, optimizer, setup.precision, "cpu", scopes)
        finally:
            scopes.close()
    return {f: counter.by_family.get(f, 0) for f in FAMILIES}


def time_step(setup: Setup, row: str, device: str, repeats: int) -> dict | None:
    """The real step on the device: its median time, and one profiled step's host (and
    device) time and kernels by family. None where the row does not apply."""
    model = build(setup, row, device)
    if model is None:
        return None
    inputs = _inputs(model, setup)
    step_model = torch.compile(model) if setup.compiled else model
    optimizer = _optimizer(model)
    precision = setup.precision
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _step(step_model, inputs, optimizer, precision, device)  # warm-up: compiles, state
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = _step(step_model, inputs, optimizer, precision, device)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    if setup.compiled:  # the compiler's fused kernels belong to no one family
        return {"step_ms": 1e3 * statistics.median(times), "loss": loss.item(),
                "peak_mib": peak, "families": {f: {} for f in FAMILIES}}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    scopes = Scopes(model, ranges=True)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            _step(model, inputs, optimizer, precision, device, scopes)
            sync()
        families = attribute(prof.events(), scopes, cuda)
    finally:
        scopes.close()
    return {"step_ms": 1e3 * statistics.median(times), "loss": loss.item(), "peak_mib": peak,
            "families": families}


def attribute(events, scopes: Scopes, cuda: bool) -> dict:
    """{family: {"host_ms", and on CUDA "device_ms" and "kernels"}} of a profiled step."""
    out = {f: collections.Counter() for f in FAMILIES}
    family_of = {}
    for e in events:  # parents come before their children
        parent = family_of.get(id(e.cpu_parent)) if e.cpu_parent is not None else None
        op = e.name.removeprefix("aten::")
        if e.name.startswith(_MARK):
            family = e.name.removeprefix(_MARK)
        elif op in _OP_FAMILIES:
            family = _OP_FAMILIES[op]
        elif e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr >= 0:
            node = e.name.split(": ", 1)[-1]
            family = scopes.nodes.get((node, e.sequence_nr), parent or "other")
        else:
            family = parent or "other"
        family_of[id(e)] = family
        out[family]["host_ms"] += e.self_cpu_time_total / 1e3
        if cuda:
            out[family]["device_ms"] += _self_device_us(e) / 1e3
            out[family]["kernels"] += len(e.kernels)
    return {f: dict(v) for f, v in out.items()}


def _self_device_us(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)


def profile_rows(setup: Setup, rows, device, repeats, count=True, say=print) -> list[dict]:
    results = []
    for row in rows:
        say(f"{setup.model} {row}: counting launches")
        launches = count_launches(setup, row) if count else None
        say(f"{setup.model} {row}: timing")
        timed = time_step(setup, row, device, repeats)
        if timed is None:
            say(f"{setup.model} {row}: skipped (Liger-Kernel runs on CUDA, where installed)")
            continue
        families = timed["families"]
        for f in FAMILIES:
            if launches is not None:
                families[f]["launches"] = launches[f]
        result = {"policy": row, "step_ms": timed["step_ms"], "loss": timed["loss"],
                  "launches": None if launches is None else sum(launches.values())}
        for key in ("host_ms", "device_ms", "kernels"):
            if key != "host_ms" and not device.startswith("cuda"):
                continue
            found = [v[key] for v in families.values() if key in v]
            result[key] = sum(found) if found else None
        if device.startswith("cuda"):
            result["peak_mib"] = timed["peak_mib"]
        result["families"] = families
        results.append(result)
    return results


def print_tables(rows, markdown, cuda):
    """The families' tables, then the rows' (the figures a reader compares first, last)."""
    def cell(value, fmt):
        return "-" if value is None else fmt.format(value)

    metrics = [("launches", "{:.0f}"), ("host_ms", "{:.2f}")]
    metrics += [("device_ms", "{:.2f}")] if cuda else []
    for key, fmt in metrics:
        print(f"\n{key.replace('_', ' ')} by family")
        line = table(["row", *FAMILIES], markdown, width=10, first=26)
        for r in rows:
            line([r["policy"], *(cell(r["families"][f].get(key), fmt) for f in FAMILIES)])
    print()
    base = rows[0] if rows else None
    header = ["row", "step ms", "time ratio", "launches", "host ms"]
    header += ["device ms", "kernels", "peak MiB"] if cuda else []
    line = table(header, markdown, width=11, first=26)
    for r in rows:
        cells = [r["policy"], f"{r['step_ms']:.1f}", f"{r['step_ms'] / base['step_ms']:.2f}",
                 cell(r["launches"], "{}"), cell(r["host_ms"], "{:.1f}")]
        if cuda:
            cells += [cell(r["device_ms"], "{:.1f}"), cell(r["kernels"], "{}"),
                      f"{r['peak_mib']:,.0f}"]
        line(cells)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--policy", nargs="+", default=["eager", "llm"], metavar="ROW")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    parser.add_argument("--lora", type=int, metavar="R",
                        help="PEFT LoRA adapters of rank R on the seven projections, bf16 "
                        "weights (rows: peft, llm, ...)")
    parser.add_argument("--dropout", type=float, default=0.05, help="the adapters' dropout")
    parser.add_argument("--no-count", dest="count", action="store_false",
                        help="leave the launches out (they are the same on any machine)")
    parser.add_argument("--compile", action="store_true",
                        help="time torch.compile(model) instead (no launches, no families)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", metavar="F", help="write the rows as JSON to F")
    args = parser.parse_args(argv)
    setup = Setup(args.model, args.batch, args.seq, args.precision, args.lora, args.dropout,
                  args.compile)
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    lora = f", LoRA r={args.lora} (dropout {args.dropout}), bf16 weights" if args.lora else ""
    print(f"{args.model}, {args.batch} x {args.seq}, {args.precision}{lora}, {where}, torch "
          f"{torch.__version__}", flush=True)
    try:
        rows = profile_rows(setup, args.policy, args.device, args.repeats, args.count,
                            say=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    except ActdesignError as exc:
        sys.exit(f"step_profile: {exc}")
    print_tables(rows, args.markdown, cuda)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "batch": args.batch, "seq": args.seq,
             "precision": args.precision, "lora": args.lora, "device": where, "rows": rows},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
