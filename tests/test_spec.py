"""The spec format: exact round trips, validation, atomic writes."""

import copy
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from actdesign import ActdesignError, spec
from actdesign.activation import resolve
from actdesign.designer import Histogram, Uniform, fit_stepwise

sys.path.insert(0, str(Path(__file__).parent))
from bounds import within  # noqa: E402


@pytest.fixture(scope="module")
def gelu3():
    return spec.from_fit(fit_stepwise(resolve("gelu"), 3))


def test_round_trip_is_exact(tmp_path, gelu3):
    path = spec.save(gelu3, tmp_path / "gelu3.json")
    loaded = spec.load(path)
    assert loaded == gelu3  # every float compares equal: repr round-trips float64
    assert loaded.to_json() == gelu3.to_json()
    assert spec.load(gelu3.to_dict()) == gelu3 and spec.load(gelu3) is gelu3
    data = json.loads(path.read_text())
    assert data["format"] == "actdesign.spec/1" and data["kind"] == "stepwise"
    assert data["activation"] == {"name": "gelu"}
    assert data["objective"]["weight"] == {"type": "normal", "mean": 0.0, "std": 1.0}
    assert set(data["provenance"]) == {"actdesign", "created"}
    assert {"E", "relative", "grid_E", "stationarity"} <= set(data["error"])


def test_expression_and_empirical_specs_round_trip(tmp_path):
    hist = Histogram.from_values(np.random.default_rng(0).normal(size=10_000), "x.npy")
    for fit in (fit_stepwise(resolve("x*sigmoid(1.702*x)"), 2, Uniform(-3, 3)),
                fit_stepwise(resolve("tanh"), 2, hist)):
        s = spec.from_fit(fit)
        assert spec.load(spec.save(s, tmp_path / "s.json")) == s
    assert s.objective["weight"]["source"] == "x.npy"


def _mutations():
    """(name, change) pairs; each change breaks a valid spec dict in one way."""
    def setter(path, value):
        def change(d):
            target = d
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        return change

    return [
        ("bits as string", setter(["bits"], "3")),
        ("bits as bool", setter(["bits"], True)),
        ("bits out of range", setter(["bits"], 9)),
        ("bits disagree with lengths", setter(["bits"], 2)),
        ("too few borders", lambda d: d["borders"].pop()),
        ("too many levels", lambda d: d["levels"].append(1.0)),
        ("unordered borders", lambda d: d["borders"].reverse()),
        ("repeated border", lambda d: d["borders"].__setitem__(1, d["borders"][0])),
        ("string level", setter(["levels", 0], "0.5")),
        ("null level", setter(["levels", 0], None)),
        ("huge level", setter(["levels", 0], 1e400)),
        ("unknown kind", setter(["kind"], "magic")),
        ("wrong format", setter(["format"], "actdesign.spec/99")),
        ("unknown field", setter(["code"], "import os")),
        ("missing field", lambda d: d.pop("levels")),
        ("unknown activation", setter(["activation"], {"name": "nope"})),
        ("unsafe expression", setter(["activation"], {"expr": "__import__('os').getcwd()"})),
        ("two activations", setter(["activation"], {"name": "gelu", "expr": "x"})),
        ("expression not a string", setter(["activation"], {"expr": 3})),
        ("bad weight type", setter(["objective", "weight"], {"type": "cauchy"})),
        ("negative std", setter(["objective", "weight", "std"], -1.0)),
        ("empty domain", setter(["objective", "weight"], {"type": "uniform", "domain": [1, 1]})),
        ("not an object", lambda d: d.clear()),
    ]


@pytest.mark.parametrize("name,change", _mutations(), ids=[m[0] for m in _mutations()])
def test_bad_specs_are_refused(gelu3, name, change):
    data = copy.deepcopy(gelu3.to_dict())
    change(data)
    with pytest.raises(ActdesignError) as info:
        spec.validate(data, "test.json")
    assert str(info.value).startswith("test.json:") and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["{", '{"bits": NaN}', '{"bits": Infinity}', "[]", ""])
def test_bad_json_is_refused(text):
    with pytest.raises(ActdesignError):
        spec.loads(text, "bad.json")


def test_nan_in_a_file_is_refused(tmp_path, gelu3):
    text = gelu3.to_json().replace(str(gelu3.levels[0]), "NaN", 1)
    (tmp_path / "nan.json").write_text(text)
    with pytest.raises(ActdesignError, match="non-finite"):
        spec.load(tmp_path / "nan.json")


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ActdesignError, match="not found"):
        spec.load(tmp_path / "absent.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ActdesignError):
        spec.load(tmp_path / "binary.json")


def test_failed_write_leaves_old_file_and_no_temporaries(tmp_path, gelu3, monkeypatch):
    path = tmp_path / "spec.json"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(ActdesignError, match="No space left"):
        spec.save(gelu3, path)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_unwritable_destination(tmp_path, gelu3):
    with pytest.raises(ActdesignError, match="does not exist"):
        spec.save(gelu3, tmp_path / "missing" / "s.json")
    with pytest.raises(ActdesignError, match="directory"):
        spec.save(gelu3, tmp_path)


def test_hostile_json_is_one_line(tmp_path, gelu3):
    big = "1" + "0" * 400
    text = gelu3.to_json()
    hostile = {
        "400-digit level": text.replace(repr(gelu3.levels[0]), big, 1),
        "400-digit bits": text.replace('"bits": 3', f'"bits": {big}', 1),
        "deep nesting": "[" * 100000,
        "deep nesting, closed": "[" * 500 + "]" * 500,
    }
    for name, bad in hostile.items():
        with pytest.raises(ActdesignError) as info:
            spec.loads(bad, "bad.json")
        assert str(info.value).startswith("bad.json:") and "\n" not in str(info.value), name
    data = gelu3.to_dict()
    data["levels"][0] = 10**400  # a Python int, given as a dict
    with pytest.raises(ActdesignError, match="levels.0. must be finite"):
        spec.validate(data, "d")


def test_weights_are_bounded_where_a_spec_is_read(gelu3):
    data = gelu3.to_dict()
    edges = np.linspace(-4, 4, 5002).tolist()
    data["objective"]["weight"] = {"type": "empirical", "edges": edges, "counts": [1.0] * 5001}
    with pytest.raises(ActdesignError, match="1..4096 bins"):
        spec.validate(data, "s")
    for mean, std in ((1e300, 1.0), (0.0, 1e-300), (1e9, 1e-3)):
        data["objective"]["weight"] = {"type": "normal", "mean": mean, "std": std}
        with pytest.raises(ActdesignError, match="out of range"):
            spec.validate(data, "s")


def test_only_regular_files_are_read(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    # Opening a FIFO without a writer blocks forever; /dev/zero never ends.
    for path in (fifo, "/dev/zero"):
        with within(3.0, str(path)), pytest.raises(ActdesignError, match="not a regular file"):
            spec.load(path)
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(16 * 2**20 + 1)  # sparse: no disk used
    with pytest.raises(ActdesignError, match="larger than 16 MiB"):
        spec.load(big)
