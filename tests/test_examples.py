"""The LLM examples run as a newcomer runs them, with --quick, each in a fresh process: they
exit 0, measure less memory for the compressed runs, print every run's loss curve, write the
plot, the losses fall, and the lossless runs train as the baseline does."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).parents[1] / "examples"
# Largest relative difference of a lossless run's per-step losses from the baseline's.
# float32: the project's bound for lossless training runs (README, tests/test_training_run.py);
# bf16 autocast: one bf16 step (2^-8), since the MS norm rounds x̂ to bf16 once more than eager.
GAP = {"fp32": 1e-5, "bf16-autocast": 2.0**-8}


def run_example(script: str, tmp_path, *args) -> str:
    """The script's stdout, after checking it exited 0 and wrote its plot."""
    plot = tmp_path / "curves.png"
    # as a user runs it: not under the Triton interpreter the test session switches on
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--quick", "--plot",
                           str(plot), *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the product's own output alone: at most its note that it compiles its kernels
    assert [line for line in done.stderr.splitlines() if "CPU kernels" not in line] == [], \
        done.stderr[-3000:]
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"wrote {plot}" in done.stdout
    return done.stdout


def memory(stdout: str, name: str) -> tuple[float, float]:
    """(saved for backward, activation peak) in MiB, from the run's row of the memory table."""
    rows = [re.match(rf"{re.escape(name)}\s+([\d,.]+) MiB .*?([\d,.]+) MiB", line)
            for line in stdout.splitlines()]
    (row,) = [r for r in rows if r]
    return float(row[1].replace(",", "")), float(row[2].replace(",", ""))


def curves(stdout: str, names: list[str]) -> dict[str, list[float]]:
    """Each run's column of the loss table, checked to have rows at steps 10, 20 and 30."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    assert lines[start].split("step", 1)[1].split() == " ".join(names).split()
    rows = [[float(v) for v in line.split()] for line in lines[start + 1:start + 4]]
    assert [row[0] for row in rows] == [10, 20, 30]
    return {name: [row[1 + i] for row in rows] for i, name in enumerate(names)}


def gaps(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"largest relative difference .*: (\S+)", stdout)]


def check_curves(stdout: str, names: list[str], precision: str) -> None:
    for name, losses in curves(stdout, names).items():
        assert losses[-1] < 0.95 * losses[0], (name, losses)  # visibly learning
    assert len(gaps(stdout)) == len(names) - 1
    assert max(gaps(stdout)) <= GAP[precision]


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_finetune_lora_runs_peft_alone_and_with_llm(precision, tmp_path):
    pytest.importorskip("peft")
    stdout = run_example("finetune_lora.py", tmp_path, "--precision", precision)
    peft, compressed = memory(stdout, "PEFT"), memory(stdout, "PEFT + llm")
    assert compressed[0] < peft[0] and compressed[1] < peft[1]
    check_curves(stdout, ["PEFT", "PEFT + llm"], precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_train_llm_runs_plain_llm_and_llm_with_checkpointing(precision, tmp_path):
    stdout = run_example("train_llm.py", tmp_path, "--precision", precision)
    plain, llm = memory(stdout, "plain"), memory(stdout, "llm")
    recomputed = memory(stdout, "llm + checkpointing")
    assert recomputed[0] < llm[0] < plain[0]
    assert recomputed[1] < llm[1] < plain[1]
    check_curves(stdout, ["plain", "llm", "llm + checkpointing"], precision)


def test_a_bad_argument_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_llm.py"), "--plot",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == f"error: cannot write {str(tmp_path)!r}: it is a directory\n"
