"""`estimate --max-seq` / `--max-batch`: the longest sequence (largest batch) whose training
step fits a card, found by shape-only steps. Exact at the boundary: the answer fits and the
answer plus one step does not, and the steps priced there are real CPU steps' to the byte."""

import json
import os
import re
import sys

import pytest

from actdesign import ActdesignError
from actdesign.runtime import estimate, models
from actdesign.runtime.apply import policy as P

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli  # noqa: E402
from test_estimate_policies import real_step  # noqa: E402

MiB = 2**20


def priced(name, batch, seq, policy, checkpointing, size=None, **search):
    return estimate(name, batch, seq, "fp32", [policy], checkpointing=checkpointing,
                    gpu_memory=size, kernels="cpu", **search).rows[0]


@pytest.mark.parametrize("name, policy, checkpointing", [
    ("llama-tiny", "none", False), ("llama-tiny", "llm", False), ("gpt2-tiny", "llm", True)])
def test_the_longest_sequence_fits_and_one_step_more_does_not(name, policy, checkpointing):
    size = priced(name, 1, 64, policy, checkpointing).needed_bytes + 3 * MiB
    row = priced(name, 1, 64, policy, checkpointing, size, longest="seq", step=16)
    (answer,) = row.longest.values()
    assert answer.value > 64 and answer.value % 16 == 0 and answer.cap is None
    assert row.to_dict()["max_seq"] == answer.value and row.fits is True
    at = priced(name, 1, answer.value, policy, checkpointing, size)
    beyond = priced(name, 1, answer.value + 16, policy, checkpointing, size)
    assert at.needed_bytes == answer.needed == row.needed_bytes <= size
    assert beyond.needed_bytes == answer.over_needed > size
    for seq, estimated in ((answer.value, at), (answer.value + 16, beyond)):
        model, _ = models.build(name)
        _, peak, _ = real_step(name, model, policy, 1, seq, "fp32", checkpointing)
        assert estimated.peak_bytes == peak, seq


def test_the_largest_batch_fits_and_one_more_does_not():
    size = priced("llama-tiny", 1, 32, "llm", False).needed_bytes + 2 * MiB
    row = priced("llama-tiny", 1, 32, "llm", False, size, longest="batch")
    (answer,) = row.longest.values()
    assert answer.step == 1 and answer.value > 1 and row.to_dict()["max_batch"] == answer.value
    assert priced("llama-tiny", answer.value, 32, "llm", False).needed_bytes <= size
    assert priced("llama-tiny", answer.value + 1, 32, "llm", False).needed_bytes > size


def test_learned_positions_cap_the_sequence_and_rotary_ones_do_not():
    big = 64 * 2**30  # far more than the tiny models need at their longest
    gpt2 = priced("gpt2-tiny", 1, 64, "none", False, big, longest="seq", step=256)
    (answer,) = gpt2.longest.values()
    n_positions = models.config_of("gpt2-tiny").n_positions
    assert (answer.value, answer.cap, answer.over_needed) == (n_positions, n_positions, None)
    size = priced("llama-tiny", 1, 64, "none", False).needed_bytes + 200 * MiB
    llama = priced("llama-tiny", 1, 64, "none", False, size, longest="seq", step=256)
    longest = next(iter(llama.longest.values()))
    assert longest.cap is None
    assert longest.value > models.config_of("llama-tiny").max_position_embeddings


def test_every_size_gets_its_answer_and_a_step_too_large_fits_nothing():
    small = priced("llama-tiny", 1, 16, "llm", False).needed_bytes
    sizes = [f"{small + MiB}", f"{small + 4 * MiB}"]
    row = estimate("llama-tiny", 1, 16, "fp32", ["llm"], gpu_memory=[int(s) for s in sizes],
                   kernels="cpu", longest="seq", step=16).rows[0]
    first, second = (a.value for a in row.longest.values())
    assert 16 <= first < second
    assert set(row.to_dict()["max_seq"].values()) == {first, second}
    none = estimate("llama-tiny", 1, 16, "fp32", ["llm"], gpu_memory=small, kernels="cpu",
                    longest="seq", step=1 << 20).rows[0]
    assert next(iter(none.longest.values())).value == 0 and none.fits is False


def test_the_search_refuses_what_it_cannot_answer():
    with pytest.raises(ActdesignError, match="give its memory"):
        estimate("llama-tiny", 1, 16, longest="seq")
    with pytest.raises(ActdesignError, match="no sequence to lengthen"):
        estimate("vit-tiny", 1, 16, gpu_memory="80GB", longest="seq")
    with pytest.raises(ActdesignError, match="step must be a positive integer"):
        estimate("llama-tiny", 1, 16, gpu_memory="80GB", longest="seq", step=0)
    with pytest.raises(ActdesignError, match="longer than the 1,024 positions"):
        estimate("gpt2-tiny", 1, 16, gpu_memory="80GB", longest="seq", step=4096)
    with pytest.raises(ActdesignError, match="example_inputs fix the shape"):
        estimate("llama-tiny", 1, 16, gpu_memory="80GB", longest="batch",
                 example_inputs={"input_ids": models.example_batch(
                     models.build("llama-tiny")[0], 1, 16)["input_ids"]})
    with pytest.raises(ActdesignError, match="longest must be one of"):
        estimate("llama-tiny", 1, 16, gpu_memory="80GB", longest="tokens")


@pytest.mark.parametrize("argv, message", [
    (["--max-seq"], "give --gpu-memory"),
    (["--max-seq", "--max-batch", "--gpu-memory", "80GB"], "one of --max-seq and --max-batch"),
    (["--step", "64"], "--step is the step of"),
    (["--max-seq", "--gpu-memory", "80"], "unit"),
])
def test_the_command_refuses_in_one_line_before_building(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("built a model"))
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-tiny", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_the_command_writes_max_seq_in_each_row(capsys, tmp_path):
    out = tmp_path / "longest.json"
    code, text, _ = run_cli(capsys, "estimate", "--model", "llama-tiny", "--batch", "1",
                            "--precision", "fp32", "-p", "none", "-p", "llm", "--max-seq",
                            "--gpu-memory", "1.03GiB", "--step", "128", "--json", str(out))
    assert code == 0 and "the longest sequence that fits, in steps of 128" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "llm"]
    assert all(r["max_seq"] % 128 == 0 and r["max_seq"] > 0 for r in rows)
    assert rows[1]["max_seq"] >= rows[0]["max_seq"]  # llm keeps less per token


def test_the_peak_says_how_much_of_it_the_forward_kept():
    rows = estimate("llama-tiny", 2, 256, "fp32", ["none", "llm", "llm+offload"],
                    kernels="cpu").rows
    for row in rows:
        assert 0 <= row.peak_kept_bytes <= min(row.saved_bytes, row.peak_bytes), row.policy
    none, llm, offloaded = rows
    # eager keeps nearly all it saves to the peak, llm most; with every block's input on the
    # host the peak is in a block's backward, after the head's and the final norm's
    assert none.peak_kept_bytes > 0.9 * none.saved_bytes
    assert llm.peak_kept_bytes > 0.5 * llm.saved_bytes
    assert offloaded.peak_kept_bytes < 0.1 * llm.peak_kept_bytes


def bisected(needed, size, step, cap=None):
    """The search as it was: doubling from one step, then bisecting, in whole steps."""
    top = (cap or 2**31) // step * step
    if needed(step) > size:
        return 0
    low, high = step, None
    while high is None:
        if low * 2 > top:
            if top == low or needed(top) <= size:
                return top
            high = top
        elif needed(low * 2) <= size:
            low *= 2
        else:
            high = low * 2
    while high - low > step:
        middle = low + (high - low) // step // 2 * step
        if needed(middle) <= size:
            low = middle
        else:
            high = middle
    return low


TILED = {"rules": [{"target": "glu", "apply": "msglu", "tile": 24},
                   {"target": "head", "apply": "fused_ce", "chunk_size": 40},
                   *P.load("llm").to_dict()["rules"]]}


@pytest.mark.parametrize("name, policy, dimension, step, checkpointing", [
    ("llama-tiny", "none", "seq", 16, False), ("llama-tiny", TILED, "seq", 8, False),
    ("gpt2-tiny", "llm", "seq", 16, True), ("llama-tiny", "llm+offload", "batch", 1, False)])
def test_the_search_answers_as_bisection_does(name, policy, dimension, step, checkpointing):
    """Against the doubling and bisection it replaced, over fresh estimates: the same answer
    for sizes across the range, in no more shape-only steps, and fewer past a few steps."""
    fresh = {}

    def needed(value):
        if value not in fresh:
            batch, seq = (1, value) if dimension == "seq" else (value, 16)
            fresh[value] = priced(name, batch, seq, policy, checkpointing).needed_bytes
        return fresh[value]

    base = needed(step)
    for extra in (0, 1, 3, 7, 20):
        size = base + extra * MiB // (4 if dimension == "batch" else 1)
        row = priced(name, 1, 16, policy, checkpointing, size, longest=dimension, step=step)
        (answer,) = row.longest.values()
        tried = set()
        found = bisected(lambda value, tried=tried: tried.add(value) or needed(value), size,
                         step, 1024 if name == "gpt2-tiny" else None)
        assert answer.value == found, (extra, answer)
        assert answer.steps <= len(tried) if extra < 3 else answer.steps < len(tried), extra


def test_a_long_search_says_each_value_it_prices(capsys):
    code, _, err = run_cli(capsys, "estimate", "--model", "llama-tiny", "--batch", "1",
                           "--precision", "fp32", "-p", "llm", "--max-seq", "--gpu-memory",
                           "1.03GiB", "--step", "128")
    lines = [line for line in err.splitlines() if "with margins" in line]
    assert code == 0 and len(lines) >= 3
    assert all(re.search(r"\] llm: seq [\d,]+: [\d.,]+ GiB with margins, (fits|does not "
                         r"fit)$", line) for line in lines), lines
