"""runtime.load: one render per spec, a content-addressed cache, safe under concurrency."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from actdesign import runtime, spec


def test_load_accepts_a_path_a_dict_and_a_spec(make_spec, tmp_path):
    data = make_spec("silu", 2, seed=11)
    path = tmp_path / "silu2.json"
    path.write_text(json.dumps(data))
    modules = {id(runtime.load(src)) for src in (data, str(path), path, spec.load(data))}
    assert len(modules) == 1
    ops = runtime.load(data)
    assert ops.SPEC == spec.behaviour(spec.load(data)) and ops.BITS == 2  # no provenance
    assert ops.__file__.startswith(str(runtime.cache_dir()))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", str(tmp_path / "here"))
    assert runtime.cache_dir() == tmp_path / "here"
    monkeypatch.delenv("ACTDESIGN_CACHE_DIR")
    assert "actdesign" in str(runtime.cache_dir())


LOADER = textwrap.dedent("""
    import json, sys, torch
    from actdesign import runtime
    ops = runtime.load(json.loads(sys.argv[1]))
    x = torch.linspace(-3, 3, 11, requires_grad=True)
    ops.apply(x).sum().backward()
    print(ops.__file__, x.grad.tolist())
""")


def load_in_processes(spec_data, cache, count):
    env = dict(os.environ, ACTDESIGN_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, json.dumps(spec_data)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    return {out for out, _ in results}


def test_concurrent_loads_all_succeed(make_spec, tmp_path):
    outputs = load_in_processes(make_spec("gelu", 3, seed=5), tmp_path / "cache", 4)
    assert len(outputs) == 1  # the same file, the same gradients
    assert [p.name for p in (tmp_path / "cache").glob("*.py")] == [
        outputs.pop().split()[0].rsplit("/", 1)[1]]
    assert not list((tmp_path / "cache").glob(".*tmp"))


def test_a_corrupted_cache_file_is_regenerated(make_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_CACHE_DIR", str(tmp_path))
    data = make_spec("tanh", 2, seed=3)
    (first,) = load_in_processes(data, tmp_path, 1)
    path = tmp_path / first.split()[0].rsplit("/", 1)[1]
    good = path.read_text()
    path.write_text(good[: len(good) // 2] + "\nraise SystemExit('corrupted')\n")
    with pytest.warns(UserWarning, match="regenerating the corrupted cache file"):
        ops = runtime.load(data)
    assert path.read_text() == good
    assert ops.apply(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]


def test_a_generated_file_imports_without_actdesign(make_spec, tmp_path):
    from actdesign.codegen.render import write

    write(make_spec("relu6", 1), tmp_path / "relu6_ops.py")
    code = textwrap.dedent("""
        import sys
        sys.modules["actdesign"] = None  # the module must stand on its own
        import torch, relu6_ops
        x = torch.tensor([-1.0, 3.0, 7.0], requires_grad=True)
        relu6_ops.apply(x).sum().backward()
        print(relu6_ops.Module()(x).tolist(), x.grad.tolist())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("[0.0, 3.0, 6.0]")


def test_the_torch_path_works_without_triton(make_spec, tmp_path):
    from actdesign.codegen.render import write

    write(make_spec("gelu", 2), tmp_path / "gelu2_ops.py")
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as on a platform without Triton
        import torch, gelu2_ops
        assert not gelu2_ops.HAVE_TRITON
        x = torch.randn(9, requires_grad=True)
        gelu2_ops.apply(x).sum().backward()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env=env).stdout
    assert out.strip() == "ok"


def test_load_refuses_what_show_refuses(make_spec, tmp_path):
    from actdesign.errors import ActdesignError

    data = make_spec("gelu", 2)
    edges = [i / 1000 for i in range(5002)]
    data["objective"]["weight"] = {"type": "empirical", "edges": edges, "counts": [1.0] * 5001}
    with pytest.raises(ActdesignError, match="1..4096 bins"):
        runtime.load(data)
    data = make_spec("gelu", 2) | {"activation": {"expr": "(x**64)**64"}}
    with pytest.raises(ActdesignError, match="after simplification"):
        runtime.load(data)
    (tmp_path / "deep.json").write_text("[" * 100000)
    with pytest.raises(ActdesignError, match="not valid JSON"):
        runtime.load(tmp_path / "deep.json")
