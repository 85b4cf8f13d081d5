"""Train the same small MLP twice, with nn.GELU and with a generated few-bit GELU.

    actdesign fit gelu --bits 3 --out out/gelu3.json
    actdesign gen-kernel out/gelu3.json --out out/gelu3_ops.py
    python examples/train_mlp.py out/gelu3_ops.py

Both runs use the same seed, data and initial weights. Prints the bytes autograd saves for one
training step (all of them, and the activations' share) and the loss curve of each run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn


def import_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def make_mlp(activation) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 512), activation(), nn.Linear(512, 512), activation(),
                         nn.Linear(512, 1))


def teacher_data(steps: int, batch: int):
    """Regression on a fixed random GELU network: a task a GELU MLP can learn well."""
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 1, generator=g) / 8
    xs = torch.randn(steps, batch, 32, generator=g)
    return xs, torch.nn.functional.gelu(xs @ w1) @ w2


def saved_bytes(model, x) -> tuple[int, int]:
    """Bytes autograd keeps for the backward of one step, parameters aside, counting each
    storage once: (the whole model, the activation modules' share)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages, owner = {}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for m in model:
            before = set(storages)
            x = m(x)
            owner[m] = set(storages) - before
    act = sum(storages[p] for m in model if not isinstance(m, nn.Linear) for p in owner[m])
    return sum(storages.values()), act


def train(model, xs, ys, lr=1e-3) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", type=Path, help="a module written by 'actdesign gen-kernel'")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    ops = import_file(args.ops)
    xs, ys = teacher_data(args.steps, args.batch)
    runs = {"nn.GELU": nn.GELU, f"{ops.BITS}-bit {args.ops.stem}": ops.Module}
    results = {}
    for name, activation in runs.items():
        model = make_mlp(activation)
        total, act = saved_bytes(model, xs[0].clone())
        results[name] = (total, act, train(model, xs, ys))
    base_total, base_act, _ = results["nn.GELU"]
    print(f"{'activation':<24} {'saved/step':>12} {'by activations':>19} "
          f"{'loss @1':>9} {'@10%':>9} {'@50%':>9} {'final':>9}")
    for name, (total, act, losses) in results.items():
        marks = [losses[0], losses[len(losses) // 10], losses[len(losses) // 2],
                 sum(losses[-10:]) / 10]
        print(f"{name:<24} {total / 2**20:>9.2f} MiB {act / 2**10:>12.1f} KiB "
              f"({act / base_act:5.1%}) " + " ".join(f"{v:>9.5f}" for v in marks))
    total, act, _ = results[list(runs)[1]]
    print(f"\nsaved for backward, parameters aside: {total / base_total:.1%} of the nn.GELU "
          f"model's; the activations keep {act / base_act:.1%} of what nn.GELU keeps "
          f"({base_act / act:.1f}x less).")


if __name__ == "__main__":
    main()
