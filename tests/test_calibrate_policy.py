"""Calibration into a policy: the streaming histogram, and per-layer tables on a plain model."""

import numpy as np
import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import compress
from actdesign.runtime.calibration.policy import StreamingHistogram, calibrate_policy


def test_streaming_histogram_equals_direct_binning_after_growing():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1000, generator=g) * s + m for s, m in ((0.1, 0), (1, 0), (3, 5),
                                                                (0.5, -9))]
    hist = StreamingHistogram(bins=256)
    for c in chunks:
        hist.add(c)
    hist.add(torch.tensor([float("nan"), float("inf")]))  # non-finite values are not counted
    values = torch.cat(chunks).double().numpy()
    weight = hist.weight("test")
    assert weight.counts.sum() == values.size
    assert weight.edges[0] <= values.min() and weight.edges[-1] > values.max()
    direct, _ = np.histogram(values, bins=weight.edges)
    np.testing.assert_array_equal(weight.counts, direct)
    assert hist.counts.numel() == 256  # memory stays bounded


def test_empty_histogram_is_an_error():
    with pytest.raises(ActdesignError, match="no finite values"):
        StreamingHistogram().weight("layer")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act1 = nn.Linear(8, 32), nn.GELU()
        self.b, self.act2 = nn.Linear(32, 32), nn.SiLU()
        self.c = nn.Linear(32, 1)

    def forward(self, x):
        return self.c(self.act2(self.b(self.act1(self.a(x)))))


def test_calibrated_tables_fit_each_layer_better_than_the_normal_table():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.a.weight.mul_(0.5)  # pre-activations narrow and shifted, far from N(0, 1)
        model.a.bias.fill_(1.0)
    batches = [(torch.randn(64, 8),) for _ in range(3)]
    before = [p.clone() for p in model.parameters()]
    result = calibrate_policy(model, batches, "fewbit3+actnn2", bits=2)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
    assert [(t.name, t.activation, t.bits) for t in result.tables] == [
        ("act1", "gelu", 2), ("act2", "silu", 2)]
    for t in result.tables:
        assert t.error < t.error_normal  # optimal under its own density
        assert t.spec.objective["weight"]["type"] == "empirical"
    assert result.tables[0].error < 0.5 * result.tables[0].error_normal  # far from N(0, 1)
    assert set(result.bits) == {"a", "b", "c"}
    assert "sum" in str(result) and "ActNN bits" in str(result)
    report = compress(model, result.policy)
    assert {c.name for c in report.replaced} == {"a", "act1", "b", "act2", "c"}
    assert model.a.bits == result.bits["a"]
    model(torch.randn(4, 8)).sum().backward()


def test_calibration_needs_batches():
    with pytest.raises(ActdesignError, match="no batches"):
        calibrate_policy(Net(), [], "fewbit3")
