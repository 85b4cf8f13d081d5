"""benchmarks/liger_yardstick.py on tiny configs: the `llm` policy passes Liger-Kernel's bf16
mini-model check (32 AdamW steps with bf16 weights, eager against compressed).

The tolerances are Liger-Kernel's own, as published in its bf16 convergence tests (loss atol
1e-2 and rtol 5e-2 per step, final parameters atol 1e-2 and rtol 1e-2), not ours: they are
what a fused-kernel library accepts as "trains the same" in bf16, where one rounding of a
weight is 2^-8 relative and AdamW's first steps move every weight by about the learning rate
(1e-4) whatever the gradient's size."""

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import liger_yardstick as yardstick  # noqa: E402

# Liger's widths shrunk until a run takes a second or two: LLaMA (untied, every norm read by
# Linear layers) and Qwen3 (tied head, q/k norms left alone).
TINY = {name: yardstick.Scale(shrink=16, seq=16, vocab=512, layers=2)
        for name in ("mini_llama3", "mini_qwen3")}


@pytest.fixture
def one_thread():
    """One thread, as the benchmark runs; the session's count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(TINY))
def test_llm_passes_ligers_bf16_check(name, one_thread):
    out = yardstick.compare(name, TINY[name])
    assert len(out.losses[0]) == len(out.losses[1]) == yardstick.STEPS
    assert out.report.replaced  # compressed: the comparison is not eager against eager
    assert all(math.isfinite(x) for x in out.losses[0] + out.losses[1])
    assert out.losses[0][-1] < out.losses[0][0] - 0.1  # it trains: the check is not vacuous
    assert out.loss_margin < 1, out.losses
    assert out.params_outside == 0, (out.param_margin, out.param_diff)
    assert out.passed
    # Liger's parameter atol exceeds what 32 steps at lr 1e-4 move a weight, so the check
    # above cannot see a wrong gradient; the distance between the runs against the distance
    # training moved them can: about sqrt(2) where the two runs' moves are uncorrelated.
    assert out.drift < 1


def test_margin_is_ligers_tolerance_ratio():
    a = torch.tensor([1.0, 2.0, float("nan"), float("nan"), 10.0])
    b = torch.tensor([1.02, 2.0, float("nan"), 1.0, 10.6])
    m = yardstick.margins(a, b, 1e-2, 5e-2)
    assert m[0].item() == pytest.approx(0.02 / (0.01 + 0.05 * 1.02), rel=1e-6)
    assert m[1].item() == 0.0
    assert m[2].item() == 0.0  # NaN in both runs: a match, as Liger counts it
    assert m[3].item() == math.inf  # NaN in one run only: always outside
    assert m[4].item() == pytest.approx(0.6 / (0.01 + 0.05 * 10.6), rel=1e-6) and m[4] > 1


def test_tokens_are_the_stdlib_source():
    tokens = yardstick.stdlib_tokens(32000, 1000)
    again = yardstick.stdlib_tokens(32000, 1000)
    assert torch.equal(tokens, again) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 32000
    assert len(set(tokens.tolist())) > 100  # text, not a constant
    steps = yardstick.batches(512, TINY["mini_llama3"])
    assert len(steps) == yardstick.STEPS and steps[0].shape == (yardstick.BATCH, 16)
