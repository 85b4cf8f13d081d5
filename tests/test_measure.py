"""The benchmarks' tensor-level peak (measure.live_at_peak), on steps whose peak is known."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from measure import live_at_peak  # noqa: E402

MIB = 2**20


def test_the_peak_counts_what_is_alive_at_once():
    kept = []

    def step():
        a = torch.ones(MIB // 4)  # 1 MiB of float32
        b = torch.ones(2 * MIB // 4)
        b.add_(1)  # in place: no new storage
        a.view(-1, 4).t().mul_(2)  # a view: no new storage
        kept.append(torch.ones(MIB // 4))  # outlives the step: counted while it runs
        del a, b
        torch.ones(4 * MIB // 4)  # made after a and b died: 1 + 4 MiB alive at once

    peak, lines = live_at_peak(step)
    assert peak == 5 * MIB  # not 1 + 2 + 1 + 4: a and b were freed
    assert "4.0 MiB  ones.default in step" in lines[1]
    assert "1.0 MiB  ones.default" in lines[2] and len(lines) == 3


def test_autograd_keeps_its_saved_tensors_alive_until_the_backward():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(1024, 256)

    def step():
        h = torch.tanh(x @ w)  # tanh keeps its output: 1 MiB, the product is freed
        h.sum().backward()

    peak, _ = live_at_peak(step)
    assert peak >= 2 * MIB  # x @ w and tanh's output at once
    assert peak <= 3 * MIB + w.nbytes  # plus at most one more 1 MiB and the weight gradient
