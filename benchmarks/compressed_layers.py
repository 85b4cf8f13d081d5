"""Compressed Linear/Conv inputs on real data: the same small CNN and MLP trained on
scikit-learn's digits (8×8 images, 10 classes, shipped with the package), in one run, with
exact layers and with each compression.

For each variant: the bytes saved for backward by the compressed layers (and their ratio to
the exact layers'), the step time against exact, and the test accuracy (mean over seeds).

Run: .venv/bin/python benchmarks/compressed_layers.py [--markdown] [--quick]
(needs scikit-learn: pip install -e '.[bench]')
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from measure import saved_storages, table
from torch import nn

from actdesign.runtime import PooledConv2d, QConv2d, QLinear, SparseLinear, calibrate


def data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(y))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 64, 64), nn.ReLU(), nn.Linear(64, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 10))


def convert(model, kind, arg):
    """Replace every Linear/Conv2d the variant compresses; returns the compressed names."""
    names = []
    for name, m in list(model.named_children()):
        new = None
        if kind == "q" and isinstance(m, nn.Linear | nn.Conv2d):
            cls = QLinear if isinstance(m, nn.Linear) else QConv2d
            new = cls.from_module(m, bits=arg)
        elif kind == "sparse" and isinstance(m, nn.Linear):
            new = SparseLinear.from_module(m, ratio=arg)
        elif kind == "pooled" and isinstance(m, nn.Conv2d):
            new = PooledConv2d.from_module(m, p=arg)
        if new is not None:
            setattr(model, name, new)
            names.append(name)
    return names


def saved_bytes(model, x, names):
    """(bytes the named layers keep for backward, bytes their inputs take): the first from
    distinct storages first saved while each layer runs, parameters aside; the second is what
    an exact nn.Linear/nn.Conv2d keeps, its input."""
    seen, kept, inputs = set(), 0, 0
    for name, m in model.named_children():
        storages, out = saved_storages(m, x, skip=model.parameters())
        fresh = {ptr: n for ptr, n in storages.items() if ptr not in seen}
        seen |= set(storages)
        if name in names:
            kept += sum(fresh.values())
            inputs += x.numel() * x.element_size()
        x = out
    return kept, inputs


def train(model, train_set, test_set, epochs, seed):
    torch.manual_seed(seed)
    x, y = train_set
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    times = []
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(64):
            start = time.perf_counter()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
    with torch.no_grad():
        accuracy = (model(test_set[0]).argmax(1) == test_set[1]).float().mean().item()
    return accuracy, statistics.median(times)


VARIANTS = [("exact", None, None), ("QLinear/QConv2d 8-bit", "q", 8),
            ("QLinear/QConv2d 4-bit", "q", 4), ("QLinear/QConv2d 2-bit", "q", 2),
            ("2-bit, allocated", "q-alloc", 2), ("SparseLinear 0.9", "sparse", 0.9),
            ("PooledConv2d p=2", "pooled", 2)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one seed, fewer epochs")
    args = parser.parse_args()
    seeds, epochs = ((0,), 8) if args.quick else ((0, 1, 2), 30)
    train_set, test_set = data()
    header = ["model", "variant", "compressed layers", "saved KiB", "vs exact", "step ms",
              "time ratio", "test accuracy"]
    print(f"digits: {len(train_set[1])} train, {len(test_set[1])} test; {epochs} epochs, "
          f"batch 64, Adam; seeds {list(seeds)}\n")
    row = table(header, args.markdown, width=18, first=5)
    probe = train_set[0][:64].clone()  # its own storage, not the whole training set's
    for model_name, build in (("CNN", cnn), ("MLP", mlp)):
        base_step = None
        for label, kind, arg in VARIANTS:
            if (kind, model_name) in (("pooled", "MLP"), ("sparse", "CNN")):
                continue
            accs, steps = [], []
            for seed in seeds:
                torch.manual_seed(seed)
                model = build()
                names = [n for n, m in model.named_children()
                         if isinstance(m, nn.Linear | nn.Conv2d)]
                if kind == "q-alloc":
                    convert(model, "q", arg)
                    calibrate(model, [(train_set[0][:256], train_set[1][:256])],
                              avg_bits=arg)
                elif kind is not None:
                    names = convert(model, kind, arg)
                nbytes, exact_bytes = saved_bytes(model, probe, names)
                if kind is None:  # an exact layer keeps its input (maybe shared with a ReLU)
                    nbytes = exact_bytes
                acc, step = train(model, train_set, test_set, epochs, seed)
                accs.append(acc)
                steps.append(step)
            step = statistics.median(steps)
            base_step = base_step or step
            row([model_name, label, ",".join(names), f"{nbytes / 1024:.1f}",
                       f"{exact_bytes / nbytes:.1f}x fewer" if kind else "1.0x",
                       f"{step * 1e3:.2f}",
                       f"{step / base_step:.2f}", f"{100 * statistics.mean(accs):.2f}%"])


if __name__ == "__main__":
    main()
