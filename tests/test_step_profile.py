"""The step profile (benchmarks/step_profile.py): kernel launches per training step, counted
on fake tensors that take our ops' Triton paths, and the script's JSON contract."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import step_profile  # noqa: E402

from actdesign.runtime import models  # noqa: E402
from actdesign.runtime.ops.lm_loss import MIN_CHUNK_LOGITS  # noqa: E402

pytest.importorskip("transformers")

SHAPE = (16, 1024)  # the training shape, on the built-in configs (12 layers, d = 768)


@pytest.fixture(scope="module")
def counts():
    memo = {}

    def count(name, row):
        if (name, row) not in memo:
            memo[name, row] = step_profile.count_launches(step_profile.Setup(name, *SHAPE), row)
        return memo[name, row]
    return count


# The families where `llm` replaces chains of eager's elementwise ops with a kernel each way:
# MS norms, the rotation, MS-GLU (and lean layers' fewer casts); GPT-2's gelu_new.
FEWER = {"llama": ("norms", "rotation", "casts"), "qwen2": ("norms", "rotation", "casts"),
         "gpt2": ("glu",)}


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_llm_launches_no_more_kernels_than_eager(counts, name):
    """What `llm` adds: the fused loss's chunks (7 launches each, and 8 for the labels and
    the mean), the lean layers' weight casts in the backward, MS LayerNorm's second reduction
    launch (dγ, dβ) and the down projection's rebuilt input (GPT-2)."""
    eager, llm = counts(name, "eager"), counts(name, "llm")
    assert sum(llm.values()) <= sum(eager.values())
    for family in FEWER[name]:
        assert llm[family] < eager[family], family
    vocab = models.config_of(name).vocab_size
    chunk = -(-max(SHAPE[0] * SHAPE[1] * 768, MIN_CHUNK_LOGITS) // vocab)
    assert llm["loss"] == 7 * -(-SHAPE[0] * SHAPE[1] // chunk) + 8


def test_the_count_sees_triton_launches_and_skips_views(counts):
    """Each Triton launch of our generated ops is counted in its family: the rotation's one
    launch per layer and direction, beside the rotary embedding's own ops."""
    llm = counts("llama", "llm")
    assert 2 * 12 <= llm["rotation"] <= 2 * 12 + 8
    tiny = step_profile.count_launches(step_profile.Setup("llama-tiny", 2, 8), "llm")
    assert 2 * 2 <= tiny["rotation"] <= 2 * 2 + 8


def test_the_script_writes_its_contract(tmp_path):
    out = tmp_path / "profile.json"
    step_profile.main(["--model", "llama-tiny", "--batch", "2", "--seq", "16", "--policy",
                       "eager", "llm", "llm+checkpointing", "--repeats", "1",
                       "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["eager", "llm", "llm+checkpointing"]
    for r in rows:
        assert set(r["families"]) == set(step_profile.FAMILIES)
        assert r["launches"] == sum(f["launches"] for f in r["families"].values()) > 0
        assert r["host_ms"] == pytest.approx(sum(f["host_ms"] for f in r["families"].values()))
        assert r["host_ms"] > 0 and "device_ms" not in r
    eager, llm, checkpointed = rows
    assert llm["families"]["norms"]["launches"] < eager["families"]["norms"]["launches"]
    # the recompute runs the blocks' forward again in the backward
    assert checkpointed["launches"] > llm["launches"]


def test_the_families_of_a_real_step_add_up_to_its_host_time():
    """On the CPU the profiled step's self times, by family, cover every op; the optimizer's
    are its own family."""
    timed = step_profile.time_step(step_profile.Setup("llama-tiny", 2, 16), "llm", "cpu", 1)
    fam = timed["families"]
    assert fam["optimizer"]["host_ms"] > 0 and fam["norms"]["host_ms"] > 0
    assert fam["loss"]["host_ms"] > 0 and fam["attention"]["host_ms"] > 0
    assert torch.isfinite(torch.tensor(timed["loss"]))


def test_the_speed_goals_read_the_rows_of_one_run():
    import speed_goals

    rows = [{"policy": p, "step_ms": t, "peak_mib": m} for p, t, m in (
        ("eager", 100.0, 1000.0), ("llm", 90.0, 400.0), ("liger", 80.0, 500.0),
        ("checkpointing", 120.0, 600.0), ("llm+checkpointing", 130.0, 300.0))]
    found = {g: (r, limit) for _, g, r, limit in speed_goals.goals(
        {"model": "llama", "batch": 16, "seq": 1024, "rows": rows})}
    assert found["time vs eager"] == (0.9, 1.0)
    assert found["time vs Liger"] == (90 / 80, 1.0)
    assert found["peak vs Liger"] == (0.8, 0.85)
    assert found["checkpointed time"] == (130 / 120, 1.05)
    assert "actnn2 on llm" not in found and "LoRA time vs PEFT" not in found
    lora = speed_goals.goals({"model": "llama-1b", "batch": 1, "seq": 4096, "lora": 16,
                              "rows": [rows[0] | {"policy": "peft"}, rows[1]]})
    assert [g for _, g, _, _ in lora] == ["LoRA time vs PEFT", "LoRA peak vs PEFT"]
