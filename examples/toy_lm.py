"""What the two LLM examples share: a small offline language-modelling task, the measured
memory of one training step, and the side-by-side loss curves (a table and a plot).

The task: next-byte prediction on public-domain texts embedded here (no download), as token
ids 0..127 in the vocabulary of the built-in `llama-tiny` (512). Their structure (spelling,
words, repeated phrases) is learnable, so the loss falls visibly within a few hundred steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from actdesign.errors import ActdesignError
from actdesign.files import check_writable
from actdesign.runtime.memory.steps import step as measured_step

# The openings of Charles Dickens, A Tale of Two Cities (1859), and Jane Austen, Pride and
# Prejudice (1813), in the public domain.
DICKENS = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
    "was the winter of despair, we had everything before us, we had nothing before us, we "
    "were all going direct to Heaven, we were all going direct the other way - in short, the "
    "period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only. There were a king with a large jaw and a queen with a plain face, on "
    "the throne of England; there were a king with a large jaw and a queen with a fair face, "
    "on the throne of France. In both countries it was clearer than crystal to the lords of "
    "the State preserves of loaves and fishes, that things in general were settled for ever. "
)
AUSTEN = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters. "
    '"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield '
    'Park is let at last?" Mr. Bennet replied that he had not. "But it is," returned she; '
    '"for Mrs. Long has just been here, and she told me all about it." Mr. Bennet made no '
    'answer. "Do you not want to know who has taken it?" cried his wife impatiently. "You '
    'want to tell me, and I have no objection to hearing it." This was invitation enough. '
)


def windows(text: str, count: int, seq: int, seed: int) -> torch.Tensor:
    """`count` windows of `seq` byte tokens at random places in `text`: (count, seq)."""
    tokens = torch.tensor(list(text.encode("ascii")))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq, (count,), generator=g)
    return torch.stack([tokens[s:s + seq] for s in starts.tolist()])


def memory(model, ids: torch.Tensor, precision: str) -> tuple[int, int]:
    """(bytes saved for the backward, activation peak) of one real training step on `ids`,
    counted by actdesign's own accounting: distinct storages, parameters and their gradients
    aside. The gradients it leaves are cleared."""
    saved, peak = measured_step(model, {"input_ids": ids, "labels": ids}, precision)
    model.zero_grad(set_to_none=True)
    return saved.total, peak


def plot_path(path: str) -> Path:
    """The plot's path, checked before any training starts; its folder is made if the folder
    above it exists."""
    path = Path(path)
    try:
        path.parent.mkdir(exist_ok=True)
    except OSError as exc:
        raise ActdesignError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return check_writable(path)


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def print_memory(memories: dict[str, tuple[int, int]]) -> None:
    """Each run's (saved for backward, activation peak), and its share of the first run's."""
    base_saved, base_peak = next(iter(memories.values()))
    print(f"{'':<22}{'saved for backward':>24}{'activation peak':>24}")
    for name, (saved, peak) in memories.items():
        print(f"{name:<22}{mib(saved):>15} ({saved / base_saved:6.1%})"
              f"{mib(peak):>15} ({peak / base_peak:6.1%})")


def print_curves(curves: dict[str, list[float]], every: int) -> None:
    """The loss of each run side by side, every `every` steps (each the mean over the steps
    since the last row), and the last step's."""
    names = list(curves)
    print(f"{'step':>6}" + "".join(f"{name:>22}" for name in names))
    steps = len(curves[names[0]])
    marks = sorted({*range(every, steps + 1, every), steps})
    last = 0
    for mark in marks:
        means = [sum(curves[n][last:mark]) / (mark - last) for n in names]
        print(f"{mark:>6}" + "".join(f"{m:>22.4f}" for m in means))
        last = mark


def print_gaps(curves: dict[str, list[float]]) -> None:
    """How far each run's losses are from the first run's: the largest relative difference."""
    first, *others = curves
    for name in others:
        gap = max(abs(a - b) / abs(a) for a, b in zip(curves[first], curves[name], strict=True))
        print(f"largest relative difference of {name}'s losses from {first}'s: {gap:.1e}")


def plot_curves(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from actdesign.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, losses), style in zip(curves.items(), ("-", "--", ":"), strict=False):
        ax.plot(range(1, len(losses) + 1), losses, style, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save_figure(fig, path)
    print(f"wrote {path}")


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse(description: str, lr: float, plot: str, more=None):
    """The options both examples take (`more(parser)` adds a script's own), with --quick's
    sizes applied, torch's threads set and the plot's path checked."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=positive, default=300)
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--seq", type=positive, default=128)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["fp32", "bf16-autocast"], default="fp32")
    parser.add_argument("--every", type=positive, default=25, help="a table row every N steps")
    parser.add_argument("--threads", type=positive, default=1,
                        help="torch's CPU threads (one: the matrices are small, and a busy "
                        "CPU slows several threads far more than one)")
    parser.add_argument("--plot", default=plot)
    parser.add_argument("--quick", action="store_true", help="a test: 30 steps of 4 x 64")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.seq, args.every = 30, 4, 64, 10
    torch.set_num_threads(args.threads)
    args.plot = plot_path(args.plot)
    return args


def run_main(main) -> None:
    """main(), with a user's mistake printed as one line and exit code 2."""
    try:
        main()
    except ActdesignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
