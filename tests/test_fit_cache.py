"""Fitted tables are cached by their full request: a repeat is a file read with the same
output, any option that changes the table gets its own entry, and an entry that is corrupt,
edited or for another request is ignored and the table fitted again."""

import hashlib
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_cli as run  # noqa: E402

from actdesign.designer import stepwise  # noqa: E402


@pytest.fixture
def fits(tmp_path, monkeypatch):
    """An empty cache, and a count of the fits that ran (the grid DP's calls)."""
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    dp = stepwise.grid_optimum

    def counted(*args, **kwargs):
        calls.append(args[2])
        return dp(*args, **kwargs)

    monkeypatch.setattr(stepwise, "grid_optimum", counted)
    return tmp_path / "cache" / "fits", calls


def _fit(capsys, tmp_path, *options):
    out = tmp_path / "s.json"
    # 5 bits: a table no preset uses, so none is shipped and a fit runs
    code, text, err = run(capsys, "fit", "gelu", "--bits", "5", "--out", str(out), *options)
    assert code == 0, err
    return text, out.read_text()


def test_a_repeated_fit_is_read_from_the_cache(capsys, tmp_path, fits):
    folder, calls = fits
    first = _fit(capsys, tmp_path)
    assert len(calls) == 1 and len(list(folder.iterdir())) == 1
    assert _fit(capsys, tmp_path) == first and len(calls) == 1  # same output, no DP
    again = _fit(capsys, tmp_path, "--no-cache")  # fitted anew: the same table, made later
    assert _made(again) == _made(first) and len(calls) == 2


def _made(fit):
    """(the command's output, the spec) without the spec's time of making."""
    text, spec = fit
    spec = json.loads(spec)
    del spec["provenance"]["created"]
    return text, spec


@pytest.mark.parametrize("option", [["--grid", "1024"], ["--std", "2"], ["--mean", "0.5"],
                                    ["--weight", "uniform", "--domain", "-4", "4"]])
def test_options_that_change_the_table_have_their_own_entries(capsys, tmp_path, fits, option):
    folder, calls = fits
    first = _fit(capsys, tmp_path)
    second = _fit(capsys, tmp_path, *option)
    assert second != first and len(calls) == 2 and len(list(folder.iterdir())) == 2
    assert _fit(capsys, tmp_path, *option) == second and len(calls) == 2


def _entry(folder):
    (path,) = folder.iterdir()
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("damage", ["truncated", "levels edited", "resealed, invalid",
                                    "another request", "not json"])
def test_a_damaged_entry_is_ignored_and_fitted_again(capsys, tmp_path, fits, damage):
    folder, calls = fits
    first = _fit(capsys, tmp_path)
    path, entry = _entry(folder)
    spec = json.loads(entry["spec"])
    if damage == "truncated":
        path.write_text(path.read_text()[:200])
    elif damage == "levels edited":  # the seal no longer matches
        spec["levels"][0] += 1.0
        entry["spec"] = json.dumps(spec)
        path.write_text(json.dumps(entry))
    elif damage == "resealed, invalid":  # the seal matches, the spec fails validation
        spec["bits"] = 1
        entry["spec"] = json.dumps(spec)
        entry["seal"] = hashlib.sha256(entry["spec"].encode()).hexdigest()
        path.write_text(json.dumps(entry))
    elif damage == "another request":
        entry["request"]["bits"] = 3
        path.write_text(json.dumps(entry))
    else:
        path.write_text("import os; os.system('echo no')")
    assert _fit(capsys, tmp_path)[0] == first[0] and len(calls) == 2
    assert _fit(capsys, tmp_path)[0] == first[0] and len(calls) == 2  # rewritten, sound again


def test_a_repeated_command_is_recalled_with_the_same_file_and_text(capsys, tmp_path, fits):
    """The command's own entry answers a repeat with the fit's entry, byte for byte; other
    options, another output path or a changed fit entry never reuse it wrongly."""
    folder, calls = fits
    commands = folder.parent / "fit-commands"
    first = _fit(capsys, tmp_path)
    assert len(calls) == 1 and len(list(commands.iterdir())) == 1
    assert _fit(capsys, tmp_path) == first and len(calls) == 1
    other = tmp_path / "t.json"
    code, text, _ = run(capsys, "fit", "gelu", "--bits", "5", "--out", str(other))
    assert code == 0 and text == first[0].replace(str(tmp_path / "s.json"), str(other))
    assert other.read_text() == first[1]
    assert _fit(capsys, tmp_path, "--std", "1") == first and len(calls) == 1  # same table
    assert len(list(commands.iterdir())) == 2 and len(list(folder.iterdir())) == 1


@pytest.mark.parametrize("damage", ["text edited, fit entry kept", "fit entry edited",
                                    "entry outside fits/", "not json"])
def test_a_damaged_command_entry_falls_back_to_the_whole_path(capsys, tmp_path, fits, damage):
    folder, calls = fits
    first = _fit(capsys, tmp_path)
    (command,) = (folder.parent / "fit-commands").iterdir()
    entry = json.loads(command.read_text())
    if damage == "text edited, fit entry kept":  # recalled as edited: the text is the
        entry["text"] = "edited"                  # command's own, and a new fit rewrites it
        command.write_text(json.dumps(entry))
        code, text, _ = run(capsys, "fit", "gelu", "--bits", "5", "--out",
                            str(tmp_path / "s.json"), "--force")
        assert text.startswith(f"{tmp_path / 's.json'}: edited") and len(calls) == 1
        again = _fit(capsys, tmp_path, "--no-cache")  # fitted anew, made later
        assert _made(again) == _made(first) and len(calls) == 2
        assert _made(_fit(capsys, tmp_path)) == _made(first) and len(calls) == 2
        return
    if damage == "fit entry edited":  # still a sound entry, re-read through the whole path
        path, fit_entry = _entry(folder)
        path.write_text(json.dumps(fit_entry, indent=1))
    elif damage == "entry outside fits/":
        entry["entry"] = "../fit-commands/" + command.name
        command.write_text(json.dumps(entry))
    else:
        command.write_text("import os; os.system('echo no')")
    assert _fit(capsys, tmp_path) == first and len(calls) == 1  # validated fit entry read
    assert json.loads(command.read_text())["entry"] == _entry(folder)[0].name  # rewritten
