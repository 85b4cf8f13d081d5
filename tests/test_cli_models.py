"""`actdesign profile` and `actdesign calibrate`: a user's model and data, built-in configs,
JSON and plots, and one-line refusals that leave no files behind."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli as run  # noqa: E402

USER_CODE = textwrap.dedent('''
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 64),
                              nn.GELU(), nn.Linear(64, 50))
        return model, lambda batch, seq: (torch.randint(0, 50, (batch, seq)),)

    def batches():
        g = torch.Generator().manual_seed(1)
        return [(torch.randint(0, 50, (4, 10), generator=g),) for _ in range(3)]

    def not_a_model():
        return 42

    def not_batches():
        return 42
''')


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_profile_user_model_table_json_and_plot(capsys, user):
    code, out, err = run(capsys, "profile", "--model", "usermodels:build", "--policy",
                         "fewbit3+msnorm", "--batch", "4", "--seq", "10", "--repeats", "1",
                         "--plot", "mem.png", "--json", "mem.json")
    assert code == 0, err
    assert "total" in out and "step time" in out and "wrote mem.png" in out
    assert (user / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((user / "mem.json").read_text())
    assert data["compressed"]["saved_bytes"] < data["baseline"]["saved_bytes"]
    # the norm, the Linear reading it (it keeps the norm's x̂) and the activation
    assert {c["name"] for c in data["compress"]["replaced"]} == {"1", "2", "3"}


def test_profile_json_to_stdout_and_file_builder(capsys, user):
    code, out, err = run(capsys, "profile", "--model", "usermodels.py:build", "--policy",
                         "none", "--batch", "2", "--seq", "4", "--repeats", "1", "--json", "-")
    assert code == 0, err
    data = json.loads(out)
    assert data["saved_ratio"] == 1.0 and data["compress"]["replaced"] == []
    assert data["precision"] == "fp32"  # the default on CPU


def test_profile_builtin_config(capsys):
    code, out, err = run(capsys, "profile", "--model", "gpt2-tiny", "--policy", "fewbit3+msnorm",
                         "--batch", "2", "--seq", "16", "--repeats", "1", "--per-module",
                         "--precision", "bf16-autocast")
    assert code == 0, err
    assert "gpt2-tiny, policy fewbit3+msnorm, batch 2, sequence 16, bf16-autocast, on cpu" in out
    assert "transformer.h.1.mlp.act" in out
    # The final norm is shared with the head, which is tied to the embedding: nothing is
    # left alone, and the head keeps nothing of its own. Its input, 2 x 16 x 64 bfloat16, is
    # 4 KiB; the weight's bfloat16 copy is counted with the weight copies.
    assert "left alone" not in out
    assert [float(v) for v in out.split("\nlm_head ")[1].split()[:2]] == [4.0, 0.0]


def test_calibrate_writes_a_policy_compress_accepts(capsys, user):
    code, out, err = run(capsys, "calibrate", "--model", "usermodels:build", "--data",
                         "usermodels:batches", "--bits", "3", "--policy",
                         "fewbit3+msnorm+actnn2", "--out", "policy.json")
    assert code == 0, err
    assert "E, N(0,1) table" in out and "ActNN bits" in out
    # Progress goes to stderr, one line per phase and per table; stdout is the result only.
    phases = err.splitlines()
    assert phases[0] == "fitting table 1/1: 3, 3 bit(s)"
    assert phases[1].startswith("allocating ActNN bits (2 on average)")
    assert not any(line in out for line in phases)
    rules = json.loads((user / "policy.json").read_text())["rules"]
    assert rules[0]["name"] == "3" and rules[0]["spec"]["objective"]["weight"]["type"] == \
        "empirical"
    code, out, err = run(capsys, "profile", "--model", "usermodels:build", "--policy",
                         "policy.json", "--batch", "4", "--seq", "10", "--repeats", "1")
    assert code == 0, err


ERRORS = {
    "unknown builtin": (["profile", "--model", "gpt5"], "unknown model 'gpt5'"),
    "missing module": (["profile", "--model", "nosuchpkg.models:build"], "cannot import"),
    "directory without a config": (["profile", "--model", "."], "no config.json"),
    "missing function": (["profile", "--model", "usermodels:nothing"], "has no function"),
    "missing file": (["profile", "--model", "nowhere.py:build"], "not found"),
    "not a model": (["profile", "--model", "usermodels:not_a_model"], "not a torch module"),
    "bad syntax": (["profile", "--model", "usermodels:"], "expected package.module:function"),
    "bad policy": (["profile", "--model", "usermodels:build", "--policy", "fewbit9"],
                   "unknown policy"),
    "bad precision": (["profile", "--model", "usermodels:build", "--precision", "fp16"],
                      "'fp16' is not one of 'fp32', 'bf16-autocast', "
                      "'bf16-weights-autocast', 'bf16'"),
    "bad policy file": (["profile", "--model", "usermodels:build", "--policy", "p.json"],
                        "not found"),
    "bad data": (["calibrate", "--model", "usermodels:build", "--data", "usermodels:not_batches",
                  "--out", "out.json"], "not an iterable"),
    "bad calibrate policy": (["calibrate", "--model", "usermodels:build", "--data",
                              "usermodels:batches", "--policy", "x+y", "--out", "out.json"],
                             "unknown preset 'x' in policy 'x+y'"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_errors_are_one_line_and_write_nothing(capsys, user, case):
    argv, message = ERRORS[case]
    before = sorted(p.name for p in user.iterdir())
    code, out, err = run(capsys, *argv, *(["--plot", "x.png", "--json", "x.json"]
                                          if argv[0] == "profile" else []))
    assert code == 2, err
    # one error line, after any progress lines (a builder's result is checked once it ran)
    *progress, line = err.splitlines()
    assert all(re.match(r"\[ *\d+\.\d s\] building ", p) for p in progress), err
    assert line.startswith("actdesign: error: ") and err.endswith("\n"), err
    assert message in line and "Traceback" not in err
    after = sorted(p.name for p in user.iterdir() if p.name != "__pycache__")
    assert after == [n for n in before if n != "__pycache__"]


# Model names: local directories, config files, the Hub cache, packages in the current directory


def llama_tiny_config(**extra):
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    intermediate_size=256, num_key_value_heads=2,
                                    vocab_size=512, **extra)


TINY = ["--policy", "fewbit3+msnorm", "--batch", "1", "--seq", "8", "--repeats", "1",
        "--json", "-"]


def test_local_directory_and_config_json_build_the_architecture(capsys, tmp_path):
    llama_tiny_config().save_pretrained(tmp_path / "dir")  # no architectures: the causal LM
    llama_tiny_config(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "file")
    code, out, err = run(capsys, "profile", "--model", "llama-tiny", *TINY)
    assert code == 0, err
    builtin = json.loads(out)
    for name in (tmp_path / "dir", tmp_path / "file" / "config.json"):
        code, out, err = run(capsys, "profile", "--model", str(name), *TINY)
        assert code == 0, err
        data = json.loads(out)
        assert data["model"] == str(name)
        # the same config as llama-tiny's: the same model, the same bytes
        assert data["baseline"]["saved_by_module"] == builtin["baseline"]["saved_by_module"]
        assert data["compressed"]["saved_bytes"] == builtin["compressed"]["saved_bytes"]


def test_hub_name_offline_is_one_line_naming_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    code, out, err = run(capsys, "profile", "--model", "hf:nobody/not-cached")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "not in the local Hugging Face cache" in err
    assert "hf download nobody/not-cached config.json" in err
    # a repo id without hf: says to add it
    code, out, err = run(capsys, "profile", "--model", "nobody/not-cached")
    assert code == 2 and err.count("\n") == 1 and "write hf:nobody/not-cached" in err, err


def test_hub_name_reads_the_config_from_the_cache(tmp_path):
    # The cache as huggingface_hub lays it out; a fresh process reads HF_HOME at import.
    repo = tmp_path / "hub" / "hub" / "models--someone--tiny-llama"
    llama_tiny_config().save_pretrained(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = os.environ | {"HF_HOME": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "actdesign.cli", "profile", "--model",
                           "hf:someone/tiny-llama", *TINY], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert "model.layers.1.mlp.act_fn" in data["baseline"]["saved_by_module"]


def test_package_module_from_the_current_directory(capsys, tmp_path, monkeypatch):
    # As the `actdesign` script runs: the current directory is not on sys.path by itself.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    (tmp_path / "cwd_pkg").mkdir()
    (tmp_path / "cwd_pkg" / "__init__.py").write_text("")
    (tmp_path / "cwd_pkg" / "models.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    try:
        code, out, err = run(capsys, "profile", "--model", "cwd_pkg.models:build", *TINY)
        assert code == 0, err
        assert json.loads(out)["model"] == "cwd_pkg.models:build"
        code, out, err = run(capsys, "calibrate", "--model", "cwd_pkg.models:build", "--data",
                             "cwd_pkg.models:batches", "--out", "policy.json")
        assert code == 0, err
        assert (tmp_path / "policy.json").is_file()
    finally:
        for name in ("cwd_pkg", "cwd_pkg.models"):
            sys.modules.pop(name, None)


# What profile prints


def test_profile_progress_on_stderr_and_pure_json_on_stdout(capsys):
    code, out, err = run(capsys, "profile", "--model", "llama-tiny", "--policy", "llm",
                         "--batch", "2", "--seq", "16", "--repeats", "3", "--precision",
                         "bf16-autocast", "--json", "-")
    assert code == 0, err
    data = json.loads(out)  # nothing else on stdout
    for stage in ("building llama-tiny", "compressing a copy with llm",
                  "baseline: warm-up step", "baseline: step 3 of 3", "compressed: step 1 of 3"):
        assert stage in err
    # exact bytes: weight copies apart from activations, which sum to the total
    import torch

    from actdesign.runtime import models

    model, _ = models.build("llama-tiny")
    copies = sum(2 * m.weight.numel() for m in model.modules()
                 if isinstance(m, torch.nn.Linear))  # bfloat16: 2 bytes each
    base = data["baseline"]
    assert base["weight_copy_bytes"] == copies
    assert base["activation_bytes"] + copies == base["saved_bytes"]
    assert sum(base["saved_by_module"].values()) == base["activation_bytes"]
    assert len(base["step_seconds_all"]) == 3
    assert base["step_seconds"] == sorted(base["step_seconds_all"])[1]
    assert "time_warning" in data
    # weight copies are the same for any batch
    code, out, err = run(capsys, "profile", "--model", "llama-tiny", "--policy", "llm",
                         "--batch", "1", "--seq", "16", "--repeats", "1", "--precision",
                         "bf16-autocast", "--json", "-")
    assert json.loads(out)["baseline"]["weight_copy_bytes"] == copies


def test_profile_table_names_its_rows(capsys):
    code, out, err = run(capsys, "profile", "--model", "llama-tiny", "--policy", "llm",
                         "--batch", "2", "--seq", "16", "--repeats", "3", "--precision",
                         "bf16-autocast")
    assert code == 0, err
    assert "(model)" not in out and "\n(output and loss) " in out
    assert "\nweight copies (once per step) " in out and "\nactivations " in out
    assert "step time, ms: median" in out and "  min-max of 3" in out
    assert "baseline KiB" in out  # all figures under 1 MiB


def test_profile_help_lists_every_preset(capsys):
    from actdesign.runtime.apply.policy import PRESETS

    code, out, err = run(capsys, "profile", "--help")
    assert code == 0
    listed = re.search(r"A preset \(([^)]*)\)", " ".join(out.split())).group(1)
    assert listed.split(", ") == list(PRESETS)
