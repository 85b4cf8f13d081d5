"""`actdesign profile` and `actdesign calibrate`: a user's model and data, built-in configs,
JSON and plots, and one-line refusals that leave no files behind."""

import json
import textwrap

import pytest

from actdesign.cli import main

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


def run(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    out, err = capsys.readouterr()
    return info.value.code, out, err


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
    rules = json.loads((user / "policy.json").read_text())["rules"]
    assert rules[0]["name"] == "3" and rules[0]["spec"]["objective"]["weight"]["type"] == \
        "empirical"
    code, out, err = run(capsys, "profile", "--model", "usermodels:build", "--policy",
                         "policy.json", "--batch", "4", "--seq", "10", "--repeats", "1")
    assert code == 0, err


ERRORS = {
    "unknown builtin": (["profile", "--model", "gpt5"], "unknown model 'gpt5'"),
    "missing module": (["profile", "--model", "nosuchpkg.models:build"], "cannot import"),
    "missing function": (["profile", "--model", "usermodels:nothing"], "has no function"),
    "missing file": (["profile", "--model", "nowhere.py:build"], "not found"),
    "not a model": (["profile", "--model", "usermodels:not_a_model"], "not a torch module"),
    "bad syntax": (["profile", "--model", "usermodels:"], "expected package.module:function"),
    "bad policy": (["profile", "--model", "usermodels:build", "--policy", "fewbit9"],
                   "unknown policy"),
    "bad precision": (["profile", "--model", "usermodels:build", "--precision", "fp16"],
                      "'fp16' is not one of 'fp32', 'bf16-autocast', 'bf16'"),
    "bad policy file": (["profile", "--model", "usermodels:build", "--policy", "p.json"],
                        "not found"),
    "bad data": (["calibrate", "--model", "usermodels:build", "--data", "usermodels:not_batches",
                  "--out", "out.json"], "not an iterable"),
    "bad calibrate policy": (["calibrate", "--model", "usermodels:build", "--data",
                              "usermodels:batches", "--policy", "x+y", "--out", "out.json"],
                             "unknown policy"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_errors_are_one_line_and_write_nothing(capsys, user, case):
    argv, message = ERRORS[case]
    before = sorted(p.name for p in user.iterdir())
    code, out, err = run(capsys, *argv, *(["--plot", "x.png", "--json", "x.json"]
                                          if argv[0] == "profile" else []))
    assert code == 2, err
    assert err.startswith("actdesign: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err
    after = sorted(p.name for p in user.iterdir() if p.name != "__pycache__")
    assert after == [n for n in before if n != "__pycache__"]
