"""`actdesign estimate`: one training step on fake tensors counts the saved bytes `profile`
measures on real ones, allocates no weight, and refuses bad input in one line (every policy:
test_estimate_policies.py)."""

import json
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from actdesign import runtime
from actdesign.errors import ActdesignError
from actdesign.runtime import models
from actdesign.runtime import profile as profile_mod
from actdesign.runtime.estimate import _checkpointing, estimate, parse_size, step

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli as run  # noqa: E402


def measured(name, batch, seq, precision, checkpointing):
    """profile's own measurement of one real training step (saved bytes, weight copies)."""
    model, _ = models.build(name)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)  # the inputs are token ids: nothing else to cast
    if checkpointing:
        _checkpointing(name, model)
    inputs = models.example_batch(model, batch, seq)
    run = profile_mod._measure(model, inputs, "cpu", precision, 1, 0, lambda message: None)
    return run


# Two shapes; bert-tiny too (cheap). The fake step runs the same CPU kernels and builds the
# same attention masks, so the counts agree to the byte (the promise is 1%): a mask the real
# step skips (gpt2 with checkpointing, 2 x 16 x 16 bytes) stays under 1% at (2, 16).
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "bert-tiny"])
@pytest.mark.parametrize("shape", [(2, 16), (3, 40)])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_saved_bytes_match_profile(name, shape, precision, checkpointing):
    row = estimate(name, *shape, precision, checkpointing=checkpointing).rows[0]
    run = measured(name, *shape, precision, checkpointing)
    assert row.saved_bytes == run.total
    assert row.constant == run.constant
    assert row.saved == run.saved
    assert row.peak_bytes >= row.saved_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_vision_model_matches_profile(precision, checkpointing):
    """ViT's weight initialization reads values: it is skipped on fake tensors."""
    row = estimate("vit-tiny", 2, 1, precision, checkpointing=checkpointing).rows[0]
    run = measured("vit-tiny", 2, 1, precision, checkpointing)
    assert (row.saved_bytes, row.saved) == (run.total, run.saved)


def test_tied_weights_count_once():
    row = estimate("qwen2-tiny", 2, 16).rows[0]
    model, _ = models.build("qwen2-tiny")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    n = sum(p.numel() for p in model.parameters())  # each tied parameter once
    assert row.gradients_bytes == 4 * n


def test_weights_gradients_and_adamw_state():
    result = runtime.estimate("llama-tiny", 2, 16)  # the Python entry point
    assert result.optimizer == "adamw"
    row = result.rows[0]
    model, _ = models.build("llama-tiny")
    n = sum(p.numel() for p in model.parameters())
    assert row.gradients_bytes == 4 * n
    assert row.optimizer_bytes == 2 * 4 * n  # AdamW: exp_avg and exp_avg_sq, float32
    assert row.weights_bytes == 4 * n + sum(b.nbytes for b in model.buffers())
    assert row.total_bytes == (row.peak_bytes + row.weights_bytes + row.gradients_bytes
                               + row.optimizer_bytes)
    bf16 = estimate("llama-tiny", 2, 16, "bf16").rows[0]
    assert bf16.gradients_bytes == 2 * n


def test_peak_holds_the_logits_gradient():
    """gpt2-tiny's largest backward transient is the loss's gradient of the logits, a float32
    batch x seq x vocab tensor made while everything saved is still alive."""
    batch, seq, vocab = 4, 64, 512
    row = estimate("gpt2-tiny", batch, seq).rows[0]
    assert row.peak_bytes >= row.saved_bytes + batch * seq * vocab * 4


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_peak_matches_the_real_step(name, precision, checkpointing):
    """On fake tensors, storages live and die as on real ones: the same count of what is alive
    at once gives the same peak for a real step."""
    row = estimate(name, 3, 40, precision, checkpointing=checkpointing).rows[0]
    model, _ = models.build(name)
    model.train()
    if checkpointing:
        _checkpointing(name, model)
    _, peak = step(model, models.example_batch(model, 3, 40), precision)
    assert row.peak_bytes == peak


def test_no_parameter_is_allocated(monkeypatch):
    seen = []
    real = models._from_config

    def spy(name, config):
        model = real(name, config)
        seen.append(model)
        return model

    monkeypatch.setattr(models, "_from_config", spy)
    estimate("qwen2-tiny", 2, 16)
    (model,) = seen
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert all(isinstance(b, FakeTensor) for b in model.buffers())


def test_full_size_config_is_fast_and_allocates_nothing(tmp_path):
    import time

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 128256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    start = time.perf_counter()
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    result = estimate(str(path), 1, 4096, "bf16-autocast", gpu_memory="24GiB")
    assert time.perf_counter() - start < 60  # a few seconds alone; shared CPUs
    # the weights alone are ~2.4e9 float32 bytes: none of them was allocated
    row = result.rows[0]
    assert row.weights_bytes > 2 * 10**9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 500 * 1024
    assert row.fits is False  # weights, gradients and AdamW state alone are 4 x 2.4e9 bytes


def test_cli_table_and_json(capsys, tmp_path):
    out_file = tmp_path / "e.json"
    code, out, err = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq",
                         "16", "--policy", "none", "--policy", "llm+actnn2", "--checkpointing",
                         "--gpu-memory", "24GiB", "--json", str(out_file))
    assert code == 0, err
    assert "activation peak" in out and "optimizer state (AdamW" in out and "yes" in out
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "llm+actnn2"]
    assert rows[1]["saved_bytes"] < rows[0]["saved_bytes"]
    keys = {"policy", "saved_bytes", "peak_bytes", "weights_bytes", "gradients_bytes",
            "optimizer_bytes", "total_bytes", "fits"}
    assert keys <= set(rows[0])
    assert all(isinstance(rows[0][k], int) for k in keys - {"policy", "fits"})
    assert rows[0]["fits"] is True
    code, out, err = run(capsys, "estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq",
                         "16", "--json", str(out_file))
    assert code == 0, err  # its own output is replaced
    assert json.loads(out_file.read_text())["rows"][0]["fits"] is None
    code, out, err = run(capsys, "estimate", "--model", "gpt2-tiny", "--json", "-")
    assert code == 0 and json.loads(out)["rows"][0]["policy"] == "none"
    out_file.write_text("{}")
    code, out, err = run(capsys, "estimate", "--model", "gpt2-tiny", "--json", str(out_file))
    assert code == 2 and "pass --force" in err and out_file.read_text() == "{}"


def test_policy_file_and_lora_from_the_cli(capsys, tmp_path):
    from actdesign.runtime import policy

    path = tmp_path / "mine.json"
    path.write_text(json.dumps(policy.load("fewbit3+msnorm").to_dict()))
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq",
                         "16", "--policy", str(path), "--policy", "fewbit3+msnorm", "--json",
                         "-")
    assert code == 0, err
    a, b = json.loads(out)["rows"]
    assert a["policy"] == str(path) and b["policy"] == "fewbit3+msnorm"
    assert {k: v for k, v in a.items() if k != "policy"} == \
        {k: v for k, v in b.items() if k != "policy"}
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq",
                         "16", "--precision", "bf16", "--lora", "4", "--json", "-")
    assert code == 0, err
    result = json.loads(out)
    assert result["lora_rank"] == 4 and result["rows"][0]["gradients_bytes"] < 10**6
    assert result["kernels"] == "cuda"
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq",
                         "16", "--kernels", "cpu", "--json", "-")
    assert code == 0 and json.loads(out)["kernels"] == "cpu"


@pytest.mark.parametrize("argv, words", [
    (["--policy", "none", "--policy", "fewbit9"], "unknown policy 'fewbit9'"),
    (["--policy", "missing.json"], "policy file 'missing.json' not found"),
    (["--lora", "0"], "Invalid value for '--lora'"),
    (["--gpu-memory", "lots"], "cannot read the size 'lots'"),
    (["--model", "usermodels:build"], "from its config"),
])
def test_cli_refusals_are_one_line(capsys, tmp_path, argv, words):
    out_file = tmp_path / "e.json"
    base = {"--model": "gpt2-tiny", "--batch": "2", "--seq": "8"}
    for flag in argv[::2]:
        base.pop(flag, None)
    args = [x for kv in base.items() for x in kv] + argv + ["--json", str(out_file)]
    code, out, err = run(capsys, "estimate", *args)
    assert code == 2
    assert err.startswith("actdesign: error: ") and words in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out_file.exists()


def test_python_refusals():
    with pytest.raises(ActdesignError, match="unknown policy 'msnorm3'"):
        estimate("gpt2-tiny", 2, 16, policies=("none", "msnorm3"))
    with pytest.raises(ActdesignError, match="LoRA rank must be a positive integer"):
        estimate("gpt2-tiny", 2, 16, lora=0)
    with pytest.raises(ActdesignError, match="kernels must be one of cuda, cpu"):
        estimate("gpt2-tiny", 2, 16, kernels="tpu")
    with pytest.raises(ActdesignError, match="optimizer must be one of adamw"):
        estimate("gpt2-tiny", 2, 16, optimizer="sgd")
    with pytest.raises(ActdesignError, match="precision must be one of"):
        estimate("gpt2-tiny", 2, 16, precision="fp16")


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    with pytest.raises(ActdesignError, match="24GiB"):
        parse_size("24 parsecs")
