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
from actdesign.options import parse_size
from actdesign.runtime import models
from actdesign.runtime.memory import profile as profile_mod
from actdesign.runtime.memory.estimate import estimate
from actdesign.runtime.memory.setups import with_checkpointing
from actdesign.runtime.memory.steps import step

sys.path.insert(0, os.path.dirname(__file__))
from bounds import within  # noqa: E402
from conftest import run_cli as run  # noqa: E402


def measured(name, batch, seq, precision, checkpointing):
    """profile's own measurement of one real training step (saved bytes, weight copies)."""
    model, _ = models.build(name)
    model.train()
    if profile_mod.bf16_weights(precision):
        model.to(torch.bfloat16)  # the inputs are token ids: nothing else to cast
    if checkpointing:
        with_checkpointing(name, model)
    inputs = models.example_batch(model, batch, seq)
    run = profile_mod._measure(model, inputs, "cpu", precision, 1, 0, lambda message: None)
    return run


# Two shapes; bert-tiny too (cheap). The fake step runs the same CPU kernels and builds the
# same attention masks, so the counts agree to the byte (the promise is 1%): a mask the real
# step skips (gpt2 with checkpointing, 2 x 16 x 16 bytes) stays under 1% at (2, 16).
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "bert-tiny"])
@pytest.mark.parametrize("shape", [(2, 16), (3, 40)])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights-autocast", "bf16"])
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
        with_checkpointing(name, model)
    _, peak = step(model, models.example_batch(model, 3, 40), precision)
    assert row.peak_bytes == peak


def test_no_parameter_is_allocated(monkeypatch):
    seen = []
    real = models.from_config

    def spy(name, config):
        model = real(name, config)
        seen.append(model)
        return model

    monkeypatch.setattr(models, "from_config", spy)
    estimate("qwen2-tiny", 2, 16)
    (model,) = seen
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert all(isinstance(b, FakeTensor) for b in model.buffers())


def test_full_size_config_is_fast_and_allocates_nothing(tmp_path):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 128256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with within(60.0, "a full-size estimate"):  # CPU time: a few seconds
        result = estimate(str(path), 1, 4096, "bf16-autocast", gpu_memory="24GiB")
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
    from actdesign.runtime.apply import policy

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
    (["--gpu-memory", "lots"], "cannot read the GPU memory 'lots'"),
    (["--gpu-memory", "20"], "the GPU memory '20' needs a unit: GB, GiB, MB or MiB"),
    (["--gpu-memory", "24GiB", "--gpu-memory", "0GB"], "the GPU memory '0GB' must be positive"),
    (["--gpu-memory", "-1GB"], "the GPU memory '-1GB' must be positive"),
    (["--gpu-memory", "20 parsecs"], "unknown unit 'parsecs'"),
    (["--policy", "llm+actn2"], "unknown preset 'actn2' in policy 'llm+actn2' (did you mean "
                                "'actnn2'?)"),
    (["--4bit"], "--4bit is QLoRA: give --lora RANK too"),
    (["--model", "/no/such/dir"], "model '/no/such/dir': no such directory"),
    (["--model", "./missing/config.json"], "no such file"),
    # options are read before any model is built: a bad size, not the bad model, is said
    (["--model", "/no/such/dir", "--gpu-memory", "0GB"], "'0GB' must be positive"),
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
    with pytest.raises(ActdesignError, match="optimizer must be one of adamw, adamw8bit"):
        estimate("gpt2-tiny", 2, 16, optimizer="lion")
    with pytest.raises(ActdesignError, match="precision must be one of"):
        estimate("gpt2-tiny", 2, 16, precision="fp16")
    with pytest.raises(ActdesignError, match="a 4-bit base is QLoRA"):
        estimate("gpt2-tiny", 2, 16, four_bit=True)
    with pytest.raises(ActdesignError, match="the batch must be a positive integer"):
        estimate("gpt2-tiny", 0, 16)
    with pytest.raises(ActdesignError, match="estimate takes a model name, a transformers "):
        estimate(3, 2, 16)
    with pytest.raises(ActdesignError, match="is not a multiple of the number of attention"):
        estimate({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}, 2, 16)


def test_parse_size():
    from actdesign.options import parse_budget

    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("512MiB") == 2**29
    for text, words in (("24 parsecs", "unknown unit 'parsecs'"), ("20", "needs a unit"),
                        ("0GB", "must be positive"), ("-3GiB", "must be positive"),
                        ("lots", "cannot read")):
        with pytest.raises(ActdesignError, match=words):
            parse_size(text)
    assert parse_budget("0.35") == 0.35 and parse_budget("2.4MiB") == int(2.4 * 2**20)
    assert parse_budget(1.0) == 1.0 and parse_budget(123) == 123
    for text, words in (("-1", r"in \(0, 1\]"), ("0", r"in \(0, 1\]"), ("1.5", "give a unit"),
                        ("0GB", "must be positive"), (0, "must be positive"),
                        (True, "a size or a fraction")):
        with pytest.raises(ActdesignError, match=words):
            parse_budget(text)


def test_the_total_fits_with_its_margins_and_says_by_how_much(capsys):
    """`fits` compares the total with its margins (allocator rounding and fragmentation, the
    CUDA context), each size given answered in one call; unmeasured margins say so."""
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq",
                         "16", "-p", "none", "-p", "llm", "--gpu-memory", "1.2GiB",
                         "--gpu-memory", "1GiB", "--json", "-")
    assert code == 0, err
    result = json.loads(out)
    for row in result["rows"]:
        m = row["margins"]
        assert m["context_bytes"] == 2**30 and m["measured"] is False  # assumed
        assert m["fragmentation_bytes"] == int(0.10 * row["peak_bytes"])
        assert 0 < m["rounding_bytes"] < 10**6
        assert row["margin_bytes"] == m["rounding_bytes"] + m["fragmentation_bytes"] + \
            m["context_bytes"]
        assert row["total_with_margin_bytes"] == row["total_bytes"] + row["margin_bytes"]
        # the total alone fits in 1 GiB; with its margins it does not
        assert row["total_bytes"] < 2**30 < row["total_with_margin_bytes"] < 1.2 * 2**30
        assert row["fits"] == {"1.2GiB": True, "1GiB": False}
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "2", "--seq",
                         "16", "--gpu-memory", "1.2GiB", "--gpu-memory", "1GiB")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("fits in")]
    assert lines[0].startswith("fits in 1.2GiB (GiB, margins assumed)")
    assert lines[0].endswith("yes, 0.20 left")
    assert lines[1].startswith("fits in 1GiB (GiB, margins assumed)")
    assert lines[1].endswith("no, 0.00 over")
    assert "margins (assumed: no card named):" in out


def test_a_measured_card_gives_its_margins(tmp_path, monkeypatch):
    from actdesign.runtime.memory import cards

    (tmp_path / "h100.json").write_text(json.dumps({
        "device": "NVIDIA H100", "model": "llama-1b", "shape": "1 x 4096", "date": "2026-12-06",
        "flops_per_s": 4e14, "bytes_per_s": 3e12, "context_bytes": 600 * 2**20,
        "fragmentation": {"eager": 0.02, "llm": 0.04, "checkpointing": 0.08}}))
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    result = estimate("llama-tiny", 2, 16, policies=["none", "llm"], checkpointing=False,
                      card="h100", gpu_memory="80GB")
    eager, llm = (r.margins for r in result.rows)
    assert eager.measured and eager.context == 600 * 2**20
    assert eager.share == 0.02 and llm.share == 0.04
    assert "margins (measured on h100)" in result.table()
    checkpointed = estimate("llama-tiny", 2, 16, policies=["llm"], checkpointing=True,
                            card="h100").rows[0].margins
    assert checkpointed.share == 0.08
    unmeasured = estimate("llama-tiny", 2, 16, card="h200").rows[0].margins
    assert not unmeasured.measured and unmeasured.context == 2**30


def test_optimizers_and_precisions_users_run():
    """AdamW keeps two moments in the parameter's dtype, 8-bit AdamW two bytes (and a float32
    scale per 256) for tensors of 4,096 elements or more, SGD and none nothing. bf16 weights
    under autocast halve the weights, as bf16 does, and keep autocast's saved bytes."""
    rows = {o: estimate("llama-tiny", 2, 16, optimizer=o).rows[0]
            for o in ("adamw", "adamw8bit", "sgd", "none")}
    weights = rows["adamw"].gradients_bytes  # float32: every parameter is trained
    assert rows["adamw"].optimizer_bytes == 2 * weights
    assert rows["sgd"].optimizer_bytes == rows["none"].optimizer_bytes == 0
    assert weights / 4 < rows["adamw8bit"].optimizer_bytes < weights / 1.5
    fp32 = estimate("llama-tiny", 2, 16, precision="bf16-autocast").rows[0]
    bf16 = estimate("llama-tiny", 2, 16, precision="bf16-weights-autocast").rows[0]
    assert bf16.weights_bytes < 0.51 * fp32.weights_bytes
    assert bf16.optimizer_bytes == fp32.optimizer_bytes // 2


def test_estimate_and_plan_share_their_default_precision():
    from actdesign.cli import cli

    defaults = {name: next(p.default for p in cli.commands[name].params
                           if p.name == "precision") for name in ("estimate", "plan")}
    assert defaults == {"estimate": "bf16-autocast", "plan": "bf16-autocast"}
    assert estimate("gpt2-tiny", 2, 16).precision == "bf16-autocast"


def test_the_config_is_echoed_and_a_missing_size_is_warned(tmp_path, capsys):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(capsys, "estimate", "--model", str(tmp_path), "--batch", "1",
                         "--seq", "8")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("LlamaForCausalLM: ") and "layers 32, width 64, vocabulary 100" \
        in lines[0]
    assert any("sets no num_hidden_layers: transformers' default for LlamaConfig, 32" in line
               for line in lines if line.startswith("warning: "))
    config["num_hidden_layers"], config["num_key_value_heads"] = 2, 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = estimate(str(tmp_path), 1, 8)
    assert result.warnings == [] and result.config["layers"] == 2
    assert result.config["parameters"] == sum(
        p.numel() for p in models.build(str(tmp_path))[0].parameters())


def test_python_takes_a_name_a_config_or_a_model_object():
    """The same model by name, by its config, by the config's dict and as an object: the same
    bytes; the object itself is left as it was."""
    model = models.build("llama-tiny")[0]
    config = models.config_of("llama-tiny")
    data = config.to_dict()
    kinds = {"name": "llama-tiny", "config": config, "dict": data, "object": model}
    rows = {k: estimate(v, 2, 16, policies=["llm"]).rows[0] for k, v in kinds.items()}
    first = rows["name"]
    for k, row in rows.items():
        assert (row.saved_bytes, row.peak_bytes, row.weights_bytes) == \
            (first.saved_bytes, first.peak_bytes, first.weights_bytes), k
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"  # untouched
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    row = estimate(mlp, 1, 1, policies=["none", "fewbit3"], precision="fp32",
                   example_inputs=torch.randn(16, 32)).rows
    assert row[1].saved_bytes < row[0].saved_bytes


def test_long_module_names_keep_their_informative_end(capsys):
    code, out, err = run(capsys, "estimate", "--model", "llama-tiny", "--batch", "1", "--seq",
                         "8", "--lora", "4")
    assert code == 0, err
    names = [line[:48].rstrip() for line in out.splitlines() if "lora_A" in line]
    assert names and all(n.endswith(".lora_A.default") or n.endswith("lora_A") for n in names)
    assert all(n.startswith("…") or n.startswith("base_model") for n in names)


def test_qlora_holds_its_base_in_four_bits():
    lora = estimate("llama-tiny", 2, 16, lora=4, precision="bf16-weights-autocast").rows[0]
    qlora = estimate("llama-tiny", 2, 16, lora=4, precision="bf16-weights-autocast",
                     four_bit=True).rows[0]
    model = models.build("llama-tiny")[0]
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "lm_head")
    nf4 = linears // 2 + 4 * (linears // 64)  # every one a multiple of 64 here
    assert lora.weights_bytes - qlora.weights_bytes == 2 * linears - nf4
    largest = max(m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert qlora.peak_bytes == lora.peak_bytes + 2 * largest  # one weight dequantized
    assert qlora.saved_bytes == lora.saved_bytes


def test_the_cli_offers_every_card_and_optimizer_the_library_knows():
    """The CLI lists them itself (it imports no torch to start); they must stay the same."""
    from actdesign.cli import cli
    from actdesign.runtime.memory import cards, footprint

    params = {p.name: p for p in cli.commands["estimate"].params}
    assert tuple(params["card"].type.choices) == cards.NAMES
    assert tuple(params["optimizer"].type.choices) == tuple(footprint.OPTIMIZERS)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name, tile, chunk, policy", [
    ("llama-tiny", 5, 7, "llm+offload"), ("llama-tiny", 3, 4, "llm+actnn2"),
    ("qwen2-tiny", 6, 11, "llm")])
def test_a_step_that_skips_repeated_tiles_and_chunks_prices_what_running_them_all_does(
        precision, name, tile, chunk, policy, monkeypatch):
    """Sequence tiles and loss chunks of two sizes each: on fake tensors the repeats are left
    out (a step of any length costs about a few tiles'), and the saved bytes, the peak and
    each block's backward window are those of the step that runs every one."""
    from actdesign.runtime.apply import policy as policy_mod
    from actdesign.runtime.memory import steps
    from actdesign.runtime.ops import fake

    rules = policy_mod.load({"rules": [
        {"target": "glu", "apply": "msglu", "tile": tile},
        {"target": "head", "apply": "fused_ce", "chunk_size": chunk},
        *policy_mod.load(policy).to_dict()["rules"]]})
    model, _ = models.build(name)
    example = models.example_batch(model.train(), 2, 41)
    got = []
    for skip in (True, False):
        monkeypatch.setattr(steps, "ShapesOnly",
                            lambda kernels, skip_repeats, skip=skip: fake.ShapesOnly(kernels,
                                                                                     skip))
        windows = dict.fromkeys(("model.layers.0", "model.layers.1"))
        saved, peak = steps.fake_step(model, example, rules, precision, "cuda",
                                      window_peaks=windows)
        got.append((saved.by_module, saved.total, peak, windows))
    assert got[0] == got[1]
    assert None not in got[0][3].values()
