"""Exact bit allocation: brute force, the greedy it replaces, and the stats/bits files."""

import itertools
import json

import numpy as np
import pytest

from actdesign.cli import main
from actdesign.designer.allocate import allocate, greedy_heap, load_stats, variance
from actdesign.errors import ActdesignError


def brute_force(C, w, budget):
    best = (np.inf, None)
    for bits in itertools.product(range(1, 9), repeat=len(C)):
        b = np.array(bits)
        if w @ b <= budget:
            best = min(best, (variance(C, b), bits), key=lambda t: t[0])
    return best[0]


@pytest.mark.parametrize("seed", range(200))
def test_exact_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    C = rng.exponential(1, n) * rng.choice([1, 10, 100], n)
    w = rng.integers(1, 6, n).astype(float)
    budget = float(rng.uniform(w.sum(), 8 * w.sum()))
    result = allocate(C, w, budget)
    assert result.used <= budget
    assert np.all((result.bits >= 1) & (result.bits <= 8))
    assert result.variance == pytest.approx(brute_force(C, w, budget), rel=1e-12, abs=1e-300)
    assert variance(C, greedy_heap(C, w, budget)) >= result.variance * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_equal_weights_match_the_greedy(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 300))
    C = rng.lognormal(0, 2, n)
    w = np.full(n, 7.0)
    budget = float(rng.integers(n, 8 * n + 1)) * 7
    assert allocate(C, w, budget).variance == pytest.approx(
        variance(C, greedy_heap(C, w, budget)), rel=1e-12)


def test_greedy_is_strictly_worse_with_unequal_weights():
    # Greedy lowers bits in order of least variance per unit of weight and stops once under
    # budget: here at [6, 6, 7] (weight 47 of 50). The optimum, [8, 7, 7], uses all 50.
    C, w = np.array([1.0, 1.0, 30.0]), np.array([1.0, 1.0, 5.0])
    budget = 50.0
    ours = allocate(C, w, budget)
    greedy = variance(C, greedy_heap(C, w, budget))
    assert ours.used <= budget and ours.variance < greedy * (1 - 1e-6)
    rng = np.random.default_rng(7)
    worse = 0
    for _ in range(200):
        n = int(rng.integers(2, 6))
        C = rng.exponential(1, n) * rng.choice([1, 10, 100], n)
        w = rng.integers(1, 6, n).astype(float)
        budget = float(rng.uniform(w.sum(), 8 * w.sum()))
        worse += variance(C, greedy_heap(C, w, budget)) > allocate(C, w, budget).variance * (
            1 + 1e-9)
    assert worse >= 40  # unequal weights: the heap greedy misses the optimum often


def test_edges():
    C, w = np.array([1.0, 2.0]), np.array([1.0, 1.0])
    assert list(allocate(C, w, 16.0).bits) == [8, 8]
    assert list(allocate(C, w, 2.0).bits) == [1, 1]
    zero = allocate(np.zeros(3), np.ones(3), 12.0)
    assert zero.variance == 0 and zero.used <= 12.0
    with pytest.raises(ActdesignError, match="below 1 bit"):
        allocate(C, w, 1.5)
    with pytest.raises(ActdesignError, match="finite and > 0"):
        allocate(C, np.array([1.0, 0.0]), 4.0)
    with pytest.raises(ActdesignError, match=">= 0"):
        allocate(np.array([1.0, -1.0]), w, 4.0)


def test_large_instances_are_exact_and_fast_enough():
    """The certificate: the result's value equals the LP bound less a gap that the expanding
    core proved closed; here checked against the LP bound itself."""
    rng = np.random.default_rng(3)
    n = 20_000
    C = rng.lognormal(0, 2, n)
    w = rng.choice(rng.integers(100, 5000, 20), n).astype(float)
    result = allocate(C, w, 2.0 * w.sum())
    greedy = variance(C, greedy_heap(C, w, 2.0 * w.sum()))
    assert result.used <= 2.0 * w.sum() and result.variance <= greedy
    assert 0 <= result.lp_gap <= C.max()


def write_stats(path, items):
    path.write_text(json.dumps({"format": "actdesign.stats/1", "items": items}))
    return path


def test_cli(capsys, tmp_path):
    items = [{"name": f"layer{i % 3}/sample{i}", "C": float(1 + i % 7), "w": [64, 256, 784][i % 3]}
             for i in range(60)]
    stats = write_stats(tmp_path / "stats.json", items)
    with pytest.raises(SystemExit) as info:
        main(["allocate", str(stats), "--avg-bits", "2", "--out", str(tmp_path / "bits.json")])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "published greedy" in out
    data = json.loads((tmp_path / "bits.json").read_text())
    names, C, w = load_stats(stats)
    bits = np.array([data["bits"][name] for name in names])
    assert w @ bits <= 2 * w.sum() and variance(C, bits) == pytest.approx(data["variance"])
    assert data["variance"] <= data["greedy_variance"]


@pytest.mark.parametrize("content, message", [
    ('{"format": "actdesign.stats/1", "items": []}', "at least one item"),
    ('{"format": "x", "items": [{"name": "a", "C": 1, "w": 1}]}', "must be"),
    ('{"format": "actdesign.stats/1", "items": [{"name": "a", "C": "1", "w": 1}]}', "items"),
    ('{"format": "actdesign.stats/1", "items": [{"name": "a", "C": NaN, "w": 1}]}', "JSON"),
    ('{"format": "actdesign.stats/1", "items": [{"name": "a", "C": 1, "w": 1}, '
     '{"name": "a", "C": 1, "w": 1}]}', "unique"),
    ("not json", "JSON"),
])
def test_cli_errors(capsys, tmp_path, content, message):
    (tmp_path / "s.json").write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["allocate", str(tmp_path / "s.json"), "--avg-bits", "2", "--out",
              str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "b.json").exists()
