"""The planner's time model: a card's measured costs where the repository holds them, else
its vendor sheet's roofline."""

import json

import pytest

from actdesign.errors import ActdesignError
from actdesign.runtime.memory import cards

MEASURED = {"device": "NVIDIA H200", "model": "llama-1b", "shape": "1 x 4096",
            "date": "2026-12-06", "flops_per_s": 400e12, "bytes_per_s": 3.9e12,
            "option_s_per_byte": {"actnn2": 2e-12}}


@pytest.fixture
def measured_h200(tmp_path, monkeypatch):
    (tmp_path / "h200.json").write_text(json.dumps(MEASURED))
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    return cards.card("h200")


def test_an_unmeasured_card_is_its_roofline_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(cards, "CARDS", tmp_path)  # no file: not measured
    card = cards.card("h200")
    assert card.measured is None and "not measured" in card.describe()
    assert card.step_time(989e12, 4.8e12) == pytest.approx(1 + 2)
    assert card.recompute_time(989e12, 4.8e12) == pytest.approx(1 + 1)
    assert card.option_time("actnn2", 4.8e12, 1.2e12) == pytest.approx(2 * 6e12 / 4.8e12)


def test_a_measured_card_prices_a_step_at_its_measured_rate(measured_h200):
    card = measured_h200
    assert "NVIDIA H200, llama-1b at 1 x 4096 (2026-12-06)" in card.describe()
    assert card.step_time(400e12, 10**9) == pytest.approx(1)  # the rate covers the bytes
    assert card.recompute_time(200e12, 10**9) == pytest.approx(0.5)
    assert card.option_time("actnn2", 10**9, 2.5 * 10**8) == pytest.approx(2e-3)
    # an option the card was not measured for: the bytes it moves at the measured bandwidth
    assert card.option_time("fewbit3", 10**9, 3 * 10**8) == pytest.approx(2 * 1.3e9 / 3.9e12)


def test_the_planner_prices_with_the_measured_card(tmp_path, monkeypatch):
    """The same costs measured twice, with the roofline and with the measured card: the
    lossless step's FLOPs read off both agree, and each ActNN 2-bit option costs its input's
    bytes times the measured rate per byte."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner import KERNELS, PRECISION, setup

    from actdesign.runtime.memory import planner

    model, batches, example = setup("cnn")
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    roofline = planner.measure_costs(model, batches, example, PRECISION, cards.card("h200"),
                                     KERNELS, "test", planner.Clock(None))
    (tmp_path / "h200.json").write_text(json.dumps(MEASURED))
    measured = planner.measure_costs(model, batches, example, PRECISION, cards.card("h200"),
                                     KERNELS, "test", planner.Clock(None))
    flops = measured.problem.base_time * MEASURED["flops_per_s"]
    peak, bandwidth = cards.VENDOR["h200"]
    assert roofline.problem.base_time == pytest.approx(
        flops / peak + 2 * roofline.lossless_saved / bandwidth)
    priced = 0
    for site in measured.problem.sites:
        keep = site.options[0].bytes
        for option in site.options:
            if option.name == "actnn2":
                assert option.time == pytest.approx(2e-12 * keep)
                priced += 1
    assert priced
    assert "measured on NVIDIA H200" in measured.card.describe()


def test_an_unknown_card_is_refused():
    with pytest.raises(ActdesignError, match="device must be one of"):
        cards.card("v100")


def test_the_gpu_stage_writes_what_the_planner_reads(tmp_path, monkeypatch):
    """benchmarks/gpu_costs.py's measurements, taken here on the CPU at a small size, in the
    file format cards.py reads: every option the planner offers for activations and Linear
    layers is priced."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_costs

    from actdesign.runtime.memory import planner
    from actdesign.runtime.methods import option_label

    measured = gpu_costs.measure_card("llama-tiny", 1, 16, "cpu", repeats=1, n=2**12,
                                      width=256, copied=2**12)
    (tmp_path / "h200.json").write_text(json.dumps(measured))
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    card = cards.card("h200")
    assert card.measured and card.flops_per_s > 0 and card.bytes_per_s > 0
    labels = {option_label(m, o) for kind in ("activation", "linear")
              for m, o in planner.options(kind)}
    assert set(card.option_s_per_byte) == labels


def test_a_card_measured_for_its_margins_alone_keeps_its_roofline(tmp_path, monkeypatch):
    """benchmarks/gpu_margins.py may run without gpu_costs.py: the file then holds the margins
    alone, which estimate reads, while the planner's time stays the roofline."""
    (tmp_path / "h100.json").write_text(json.dumps({
        "device": "NVIDIA H100", "model": "llama", "shape": "8 x 1024", "date": "2026-12-06",
        "context_bytes": 700 * 2**20, "fragmentation": {"eager": 0.03, "llm": 0.05}}))
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    card = cards.card("h100")
    assert card.measured is None and card.flops_per_s == cards.VENDOR["h100"][0]
    assert card.margins("llm") == (700 * 2**20, 0.05, True)
    assert card.margins("checkpointing") == (700 * 2**20, cards.ASSUMED_FRAGMENTATION, False)
