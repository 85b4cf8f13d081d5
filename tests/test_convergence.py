"""The convergence benchmark's noise floor (benchmarks/convergence.py --noise-floor): the
micro-batch control is the baseline's step to rounding, the paired test is the textbook one,
and a quick run trains every arm and prints its tables."""

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import convergence  # noqa: E402


def gradients(model, batch, setting, micro_batches):
    model.zero_grad(set_to_none=True)
    for part in zip(*(t.chunk(micro_batches) for t in batch), strict=True):
        (setting.loss(model, part) / micro_batches).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_two_half_micro_batches_give_the_full_batch_gradient_to_float32_rounding():
    cfg = replace(convergence.QUICK, steps=1)
    text = torch.randint(0, 256, (4096,))
    batch = convergence.train_batches(text, cfg, seed=0)[0]
    setting = convergence.Setting("cpu", "fp32")
    torch.manual_seed(0)
    model = convergence.build("llama", cfg)
    full, halves = (gradients(model, batch, setting, n) for n in (1, 2))
    for f, h in zip(full, halves, strict=True):
        # the same sum in another order: float32 rounding of the gradient's own size
        torch.testing.assert_close(h, f, rtol=1e-5, atol=1e-5 * f.abs().max().item())
    # the halves alone are not the batch: each one's gradient differs from the mean
    half_only = gradients(model, tuple(t[: cfg.batch // 2] for t in batch), setting, 1)
    assert max((a - f).abs().max().item() for a, f in zip(half_only, full, strict=True)) > 1e-3


def test_the_paired_test_is_students_t_on_the_differences():
    differences = [0.5, 1.5, 1.0, 2.0]
    mean, sd = 1.25, math.sqrt((0.5625 + 0.0625 + 0.0625 + 0.5625) / 3)
    t, p = convergence.paired_t(differences)
    assert t == pytest.approx(mean / (sd / math.sqrt(4)), rel=1e-12)
    from scipy import stats

    assert p == pytest.approx(2 * stats.t.sf(t, df=3), rel=1e-12)


def run(*args):
    return subprocess.run([sys.executable, str(BENCHMARKS / "convergence.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_a_quick_noise_floor_trains_every_arm_and_prints_its_tables():
    done = run("--noise-floor", "--quick", "--arch", "llama", "--precision", "bf16-autocast",
               "--seeds", "0", "1", "--steps", "8", "--markdown")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| ") and "---" not in line]
    per_seed = {}
    for cells in rows:
        if cells[0] in ("0", "1"):
            per_seed.setdefault(cells[0], []).append([float(c) for c in cells[1:]])
    assert sorted(per_seed) == ["0", "1"] and all(len(v) == 3 for v in per_seed.values())
    for seed_rows in per_seed.values():
        (base, control, msnorm, *_), (_, _, llm, *_), (lora_base, lora_control, lora_llm,
                                                        *_) = seed_rows
        assert all(0 < loss < math.log(256) for loss in (base, control, msnorm, llm, lora_base,
                                                         lora_control, lora_llm))
        assert lora_base != base  # the adapters trained on top of the trained baseline
    summary = {cells[0]: cells[1:] for cells in rows if cells[0] in convergence.NOISE_VARIANTS}
    assert sorted(summary) == sorted(convergence.NOISE_VARIANTS)
    for cells in summary.values():
        assert all(0 <= float(p) <= 1 for p in (cells[5], cells[7]))


@pytest.mark.parametrize(("args", "message"), [
    (["--quick"], "add --arch llama"),
    (["--quick", "--arch", "llama", "--seeds", "0"], "at least 2 distinct seeds"),
    (["--arch", "llama", "--variants", "llm,lora+nothing"], "unknown variants ['lora+nothing']"),
])
def test_the_noise_floor_refuses_what_it_cannot_test(args, message, monkeypatch, capsys):
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--noise-floor", *args])
    with pytest.raises(SystemExit) as exit_:
        convergence.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    assert torch.get_num_threads() == threads  # refused before anything was set
