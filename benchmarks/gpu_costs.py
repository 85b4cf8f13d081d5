"""A card's costs for the planner's time model, measured on the card: written as JSON in the
format `runtime/memory/cards.py` reads (runtime/memory/cards/<name>.json, committed to the
repository).

    python benchmarks/gpu_costs.py --card h200 --out out/h200.json [--install]

Measured, in one run:
- bytes_per_s: a device-to-device copy of 2^27 float32 (read and write);
- host_bytes_per_s: pinned copies of 2^28 bytes between host and card, the slower way;
- flops_per_s: a whole lossless (`llm`) training step of --model at --batch x --seq under
  bf16 autocast (forward, backward, fused AdamW), its forward and backward FLOPs (torch's
  FlopCounterMode on one step) over its median time;
- option_s_per_byte: for each lossy option the planner offers, the time its kernels add per
  byte of the input they compress, on 2^24 bf16 elements: for an activation, the few-bit or
  piecewise-linear op's forward and backward against torch's GELU; for a Linear layer, the
  compression and restoration of its input (what the lossless layer does not do).
--install also writes the file into runtime/memory/cards/ of this checkout, so that an installed
copy (`pip install .`) plans with it in the same session.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from actdesign import runtime, spec  # noqa: E402
from actdesign.designer import fit_stepwise  # noqa: E402
from actdesign.runtime import compress, models
from actdesign.runtime.memory import planner  # noqa: E402
from actdesign.runtime.methods import option_label  # noqa: E402
from actdesign.runtime.ops.quantized import QLinear  # noqa: E402
from actdesign.runtime.ops.sparse import SparseLinear  # noqa: E402
from actdesign.runtime.ops.tables import table  # noqa: E402
from runtime import copy_gbs, timer  # noqa: E402


def step_rate(name, batch, seq, device, repeats) -> float:
    """FLOPs per second of the lossless policy's whole training step."""
    from torch.utils.flop_counter import FlopCounterMode

    model = models.build(name, seed=0, device=device)[0].train()
    compress(model, planner.LOSSLESS)
    inputs = models.example_batch(model, batch, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = models.loss_of(models.call(model, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    counter = FlopCounterMode(display=False)
    with counter:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = models.loss_of(models.call(model, inputs))
        loss.backward()
    optimizer.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return counter.get_total_flops() / statistics.median(times)


def option_costs(device, repeats, n=2**24, width=4096) -> dict:
    """{option label: added seconds per byte of bf16 input}, for every option planner.options
    offers that this run measures."""
    measure = timer(device)
    x = torch.randn(n // width, width, device=device, dtype=torch.bfloat16)
    out = {}
    act = x.clone().requires_grad_()
    g = torch.randn_like(act)

    def fwd_bwd(f):
        y = f(act)
        return measure(lambda: f(act), repeats) + measure(
            lambda: torch.autograd.grad(y, act, g, retain_graph=True), repeats)

    eager = fwd_bwd(F.gelu)
    for method, options in planner.options("activation"):
        bits = options["bits"]
        fitted = spec.from_fit(fit_stepwise("gelu", bits)) if method == "fewbit" \
            else table("pwl", "gelu", bits)
        ops = runtime.load(fitted)
        out[option_label(method, options)] = (fwd_bwd(ops.apply) - eager) / x.nbytes
    linear = torch.nn.Linear(width, width, bias=False, device=device)
    for method, options in planner.options("linear"):
        layer = (QLinear if method == "actnn" else SparseLinear).from_module(
            copy.deepcopy(linear), **options)
        saved = layer.compress(x)
        seconds = measure(lambda layer=layer: layer.compress(x), repeats) + measure(
            lambda layer=layer, saved=saved: layer.restore(saved, x.shape, x.dtype), repeats)
        out[option_label(method, options)] = seconds / x.nbytes
    return out


def host_rates(repeats, size=2**28) -> tuple[float, float]:
    """(host to card, card to host) bytes per second of a pinned copy of `size` bytes."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    card = torch.empty(size, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((card, host), (host, card)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(repeats * size / (time.perf_counter() - start))
    return rates[0], rates[1]


def measure_card(model, batch, seq, device="cuda", repeats=10, n=2**24, width=4096,
                 copied=2**27) -> dict:
    """The costs of the card `device` runs on, as runtime/memory/cards.py reads them: options priced
    on `n` elements `width` wide, the copy of `copied` float32."""
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    return {"device": where, "model": model, "shape": f"{batch} x {seq}",
            "date": str(datetime.date.today()), "torch": torch.__version__,
            "bytes_per_s": copy_gbs(device, repeats, copied) * 1e9,
            **({"host_bytes_per_s": min(host_rates(repeats))} if device == "cuda" else {}),
            "flops_per_s": step_rate(model, batch, seq, device, repeats),
            "option_s_per_byte": option_costs(device, repeats, n, width)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", required=True, choices=planner.cards.NAMES,
                        help="the name plan's --device gives this card")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--install", action="store_true",
                        help="also write it to runtime/memory/cards/ of this checkout")
    args = parser.parse_args()
    result = measure_card(args.model, args.batch, args.seq, repeats=args.repeats)
    text = json.dumps(result, indent=1) + "\n"
    paths = [Path(args.out)]
    if args.install:
        paths.append(Path(__file__).parents[1] / "runtime/memory/cards" / f"{args.card}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text, end="")
    print(f"peak bf16 FLOP rate reached by a whole step: "
          f"{result['flops_per_s'] / planner.cards.VENDOR[args.card][0]:.0%}")


if __name__ == "__main__":
    main()
