"""The op cache is private and verified: directories 0700 and files 0600 whatever the umask, a
directory of another user or writable by others refused, every file read checked (op modules
against their source, tables and numba's kernels against their seal), so a tampered or planted
file is made again and never run; op modules named by content only; $ACTDESIGN_CACHE_DIR
resolved once, an empty one refused."""

import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actdesign import runtime
from actdesign.errors import ActdesignError
from actdesign.runtime.ops import cache, tables


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory (not made yet) and nothing of it memoized in this process."""
    folder = tmp_path / "user" / "ops"
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", str(folder))
    monkeypatch.setattr(tables, "_MEMO", {})
    return folder


def _train_op(ops):
    import torch

    x = torch.linspace(-3, 3, 1000, requires_grad=True)
    ops.apply(x).sum().backward()  # CPU tensors: the numba kernels, cached on disk
    return x.grad


def test_the_cache_is_private_under_umask_000(fresh_cache, make_spec):
    """A table no preset uses (5 bits: none shipped) is fitted and cached."""
    old = os.umask(0)
    try:
        tables.table("stepwise", "gelu", 5)
        _train_op(runtime.load(make_spec(seed=101)))
    finally:
        os.umask(old)
    made = [fresh_cache.parent, *fresh_cache.rglob("*")]
    assert any(p.suffix == ".nbi" for p in made) and any(p.suffix == ".json" for p in made)
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_a_cache_directory_writable_by_others_is_refused_with_the_fix(fresh_cache, make_spec):
    fresh_cache.mkdir(parents=True)
    fresh_cache.chmod(0o777)
    with pytest.raises(ActdesignError, match=f"writable by others: run chmod 700 '{fresh_cache}'"):
        runtime.load(make_spec(seed=102))
    with pytest.raises(ActdesignError, match="writable by others"):
        tables.table("stepwise", "gelu", 5)
    fresh_cache.chmod(0o700)
    runtime.load(make_spec(seed=102))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_cache_directory_of_another_user_is_refused(fresh_cache, make_spec):
    fresh_cache.mkdir(parents=True, mode=0o700)
    os.chown(fresh_cache, os.getuid() + 4321, -1)
    with pytest.raises(ActdesignError, match="belongs to another user; set ACTDESIGN_CACHE_DIR"):
        runtime.load(make_spec(seed=103))


# In a fresh process: load the op of a spec and train it; print the gradient's sum.
_RUN_OP = """
import sys, warnings
warnings.simplefilter("always")
sys.path.insert(0, sys.argv[1])
from actdesign import runtime
from conftest import synthetic_spec
from test_cache import _train_op
print(float(_train_op(runtime.load(synthetic_spec(seed=104))).double().sum()))
"""


def _run_op(folder):
    env = {**os.environ, "ACTDESIGN_CACHE_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-c", _RUN_OP, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip(), done.stderr


class _Planted:
    """A pickle that, when loaded, writes to a file: what a planted cache file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'a').write('ran')",)


def test_tampered_op_modules_and_planted_numba_pickles_never_run(fresh_cache, tmp_path):
    first, _ = _run_op(fresh_cache)
    (module,) = fresh_cache.glob("ops_*.py")
    kernels = sorted((fresh_cache / "__pycache__").glob("*.nb[ic]"))
    assert {p.suffix for p in kernels} == {".nbi", ".nbc"}
    source = module.read_text()
    marker = tmp_path / "ran"
    module.write_text(source + f"\nopen({str(marker)!r}, 'a').write('ran')\n")
    planted = pickle.dumps(_Planted(marker))
    for path in kernels:
        path.write_bytes(planted)

    again, warned = _run_op(fresh_cache)
    assert not marker.exists()
    assert again == first
    assert "regenerating the corrupted cache file" in warned
    assert module.read_text() == source
    for path in kernels:  # compiled again and sealed
        assert path.read_bytes().startswith(b"# actdesign sha256 ")
        assert planted not in path.read_bytes()


def test_a_hand_edited_table_is_fitted_again(fresh_cache, monkeypatch):
    spec = tables.table("stepwise", "gelu", 5)
    (path,) = (fresh_cache / "tables").glob("*.json")
    text = path.read_text()
    assert text.count(repr(spec.levels[0])) == 1
    path.write_text(text.replace(repr(spec.levels[0]), repr(spec.levels[0] + 0.5)))
    monkeypatch.setattr(tables, "_MEMO", {})
    with pytest.warns(UserWarning, match="regenerating the corrupted cache file"):
        again = tables.table("stepwise", "gelu", 5)
    assert again.levels == spec.levels
    assert path.read_text().count(repr(spec.levels[0])) == 1  # rewritten


def test_op_modules_are_named_by_content_only(make_spec):
    data = make_spec(seed=105)
    ops = [runtime.load({**data, "provenance": {"actdesign": "0.1.0", "created": created}})
           for created in ("2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z")]
    assert ops[0] is ops[1] and ops[0].__name__ == runtime.load(data).__name__


_FIT = """
import sys, time
time.sleep(float(sys.argv[1]))
from actdesign import runtime
from actdesign.runtime.ops.tables import table
print(runtime.load(table("stepwise", "gelu", 6)).__name__)
"""


def test_concurrent_fits_of_one_table_leave_one_file(fresh_cache):
    """Two processes fit the same table at once, finishing a second apart (their specs'
    timestamps differ): one table file, one op module, both processes use it."""
    env = {**os.environ, "ACTDESIGN_CACHE_DIR": str(fresh_cache)}
    runs = [subprocess.Popen([sys.executable, "-c", _FIT, delay], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for delay in ("0", "1.5")]
    names = [run.communicate(timeout=600)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert names[0] == names[1] != ""
    assert len(list((fresh_cache / "tables").iterdir())) == 1
    assert len(list(fresh_cache.glob("*.py"))) == 1
    assert not list(fresh_cache.rglob("*.tmp"))


def test_a_relative_cache_dir_is_resolved_once(tmp_path, monkeypatch):
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", f"rel-cache-{time.time_ns()}")
    where = cache.cache_dir()
    monkeypatch.chdir(tmp_path / "second")
    assert cache.cache_dir() == where
    assert where.parent == tmp_path / "first"


def test_an_empty_cache_dir_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", "")
    with pytest.raises(ActdesignError, match="ACTDESIGN_CACHE_DIR is set but empty: unset it"):
        cache.cache_dir()
