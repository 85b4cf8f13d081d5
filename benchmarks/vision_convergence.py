"""Convergence on real images: scikit-learn's digits (8×8, 10 classes, shipped with it),
upsampled to 32×32, a small timm ResNet (resnet10t, random weights), the same start and batches
for every policy, over several seeds.

    python benchmarks/vision_convergence.py                      # eager, cnn, actnn2; 3 seeds
    python benchmarks/vision_convergence.py --epochs 2 --seeds 0

Per epoch: the mean training loss, and the test accuracy on the held-out fifth. The lossless
preset's curve must be eager's (its steps are eager's to the bit); a lossy one's should lie
within the spread of eager's curves over the seeds: at every epoch its mean loss within
eager's spread (max - min over the seeds) of eager's mean loss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.runtime import compress  # noqa: E402


def digits(size):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = len(y) * 4 // 5
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def run(policy, seed, train, test, epochs, batch):
    """[(mean training loss, test accuracy)] per epoch."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("resnet10t", num_classes=10).train()
    if policy != "none":
        compress(model, policy, train[0][:2])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(epochs):
        model.train()
        order, losses = torch.randperm(len(train[1]), generator=g), []
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train[0][idx]), train[1][idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (model(test[0]).argmax(1) == test[1]).float().mean().item()
        curve.append((statistics.fmean(losses), accuracy))
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["none", "cnn", "actnn2"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    train, test = digits(args.size)
    curves = {(p, s): run(p, s, train, test, args.epochs, args.batch)
              for s in args.seeds for p in args.policies}
    print(f"digits at {args.size}², timm resnet10t, AdamW 2e-3, batch {args.batch}, seeds "
          f"{args.seeds}: mean training loss / test accuracy per epoch (mean over seeds; "
          "eager's spread over seeds in brackets)")
    row = table(["policy", *(f"epoch {e + 1}" for e in range(args.epochs)), "same as eager",
                 "within eager's spread"], args.markdown, width=22, first=10)
    eager = [[curves["none", s][e][0] for s in args.seeds] for e in range(args.epochs)] \
        if "none" in args.policies else None
    for p in args.policies:
        cells = []
        for e in range(args.epochs):
            loss = [curves[p, s][e][0] for s in args.seeds]
            acc = [curves[p, s][e][1] for s in args.seeds]
            cell = f"{statistics.fmean(loss):.4f} / {statistics.fmean(acc):.3f}"
            if p == "none" and len(args.seeds) > 1:
                cell += f" [{max(loss) - min(loss):.4f}]"
            cells.append(cell)
        same = all(curves[p, s] == curves["none", s] for s in args.seeds) \
            if "none" in args.policies else "-"
        within = all(abs(statistics.fmean(curves[p, s][e][0] for s in args.seeds)
                         - statistics.fmean(eager[e])) <= max(eager[e]) - min(eager[e])
                     for e in range(args.epochs)) if eager and len(args.seeds) > 1 else "-"
        row([p, *cells, str(same), str(within)])


if __name__ == "__main__":
    main()
