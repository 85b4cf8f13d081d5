"""The `actdesign` command: success paths, error paths, imports and the numba cache."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from bounds import within  # noqa: E402
from conftest import run_cli as run  # noqa: E402
from conftest import synthetic_spec  # noqa: E402


def test_list(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 21 and lines[0].startswith("relu ")
    assert any(line.startswith("silu ") and "swish" in line for line in lines)


def test_fit_and_show(capsys, tmp_path):
    out_file = tmp_path / "gelu3.json"
    code, out, err = run(capsys, "fit", "gelu", "--bits", "3", "--out", str(out_file))
    assert code == 0 and err == ""
    assert "3 bit(s), gelu" in out and "E = " in out and f"wrote {out_file}" in out
    data = json.loads(out_file.read_text())
    assert data["bits"] == 3 and len(data["borders"]) == 7
    code, out, _ = run(capsys, "show", str(out_file), "--plot", str(tmp_path / "g.png"))
    assert code == 0 and out.count("\n") > 10 and "code" in out
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fit_variants(capsys, tmp_path):
    values = np.random.default_rng(0).normal(0.3, 1.2, 50_000)
    np.save(tmp_path / "preacts.npy", values)
    edges = np.linspace(-4, 4, 65)
    np.savez(tmp_path / "hist.npz", edges=edges, counts=np.histogram(values, edges)[0])
    cases = [
        (["silu", "--bits", "2", "--weight", "uniform", "--domain", "-10", "10"], "uniform"),
        (["x*sigmoid(1.702*x)", "--bits", "3"], "normal"),
        (["tanh", "--bits", "4", "--weight", f"empirical:{tmp_path / 'preacts.npy'}"],
         "empirical"),
        (["gelu", "--bits", "2", "--weight", f"empirical:{tmp_path / 'hist.npz'}"],
         "empirical"),
        (["mish", "--bits", "1", "--mean", "0.5", "--std", "2"], "normal"),
    ]
    for i, (args, weight_type) in enumerate(cases):
        out_file = tmp_path / f"spec{i}.json"
        code, _, err = run(capsys, "fit", *args, "--out", str(out_file))
        assert code == 0, err
        assert json.loads(out_file.read_text())["objective"]["weight"]["type"] == weight_type
    code, out, _ = run(capsys, "fit", "relu", "--bits", "2")  # no --out: print only
    assert code == 0 and "distinct levels" in out


ERROR_CASES = {
    "unknown activation": ["fit", "gelux", "--bits", "3"],
    "unsafe expression": ["fit", "__import__('os').system('true')", "--bits", "3"],
    "bits too high": ["fit", "gelu", "--bits", "9"],
    "bits zero": ["fit", "gelu", "--bits", "0"],
    "missing bits": ["fit", "gelu"],
    "bad domain": ["fit", "silu", "--bits", "2", "--weight", "uniform", "--domain", "3", "-3"],
    "nan domain": ["fit", "silu", "--bits", "2", "--weight", "uniform", "--domain", "nan", "1"],
    "uniform without domain": ["fit", "silu", "--bits", "2", "--weight", "uniform"],
    "domain with normal": ["fit", "silu", "--bits", "2", "--domain", "-1", "1"],
    "bad std": ["fit", "silu", "--bits", "2", "--std", "0"],
    "unknown weight": ["fit", "silu", "--bits", "2", "--weight", "cauchy"],
    "missing empirical": ["fit", "tanh", "--bits", "2", "--weight", "empirical:nope.npy"],
    "small grid": ["fit", "tanh", "--bits", "8", "--grid", "10"],
    "unknown option": ["fit", "tanh", "--bits", "2", "--colour", "red"],
    "missing spec": ["show", "nope.json"],
    "pwl with grid": ["fit", "gelu", "--kind", "pwl", "--bits", "2", "--grid", "100"],
    "pwl bits": ["fit", "gelu", "--kind", "pwl", "--bits", "5"],
    "pwl no asymptote": ["fit", "x**2", "--kind", "pwl", "--bits", "2"],
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_errors_are_one_line_with_exit_code_2(capsys, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *ERROR_CASES[case], "--out", "result.json") \
        if ERROR_CASES[case][0] == "fit" else run(capsys, *ERROR_CASES[case])
    assert code == 2
    assert err.startswith("actdesign: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == []  # no output, partial or otherwise


# Hostile inputs and outputs, each with the cause its one line must name.
HOSTILE_CASES = {
    "huge mean": (["fit", "gelu", "--bits", "2", "--mean", "1e300"], "out of range"),
    "tiny std": (["fit", "gelu", "--bits", "2", "--std", "1e-300"], "out of range"),
    "huge domain": (["fit", "gelu", "--bits", "2", "--weight", "uniform", "--domain", "1e300",
                     "2e300"], "out of range"),
    "folded exponent": (["fit", "(x**64)**64", "--bits", "2"], "after simplification"),
    "empty out": (["fit", "gelu", "--bits", "2", "--out", ""], "output path is empty"),
    # A FIFO stands for devices too: before, os.replace put a file in the device's place.
    "fifo out": (["fit", "gelu", "--bits", "2", "--out", "fifo"], "not a regular file"),
    "non-module out": (["gen-kernel", "s.json", "--out", "3d-ops.py"], "valid Python module"),
    "keyword out": (["gen-kernel", "s.json", "--out", "class.py"], "valid Python module"),
    "show /dev/zero": (["show", "/dev/zero"], "not a regular file"),
    "empirical /dev/zero": (["fit", "gelu", "--bits", "2", "--weight", "empirical:/dev/zero"],
                            "not a regular file"),
}


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=list(HOSTILE_CASES))
def test_hostile_inputs_are_one_line_with_exit_code_2(capsys, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    argv, message = HOSTILE_CASES[case]
    (tmp_path / "s.json").write_text(json.dumps(synthetic_spec("relu", 1)))
    os.mkfifo(tmp_path / "fifo")
    with within(10.0, case):  # each once took minutes, or read without end
        code, out, err = run(capsys, *argv)
    assert code == 2 and message in err, err
    assert err.startswith("actdesign: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "s.json"]
    assert (tmp_path / "fifo").is_fifo()


def test_fit_pwl_show_and_gen_kernel(capsys, tmp_path, monkeypatch):
    import actdesign.cli

    monkeypatch.setattr(actdesign.cli, "ANNOUNCE_AFTER", 0)  # however quick the fit is
    out_file = tmp_path / "regelu2.json"
    code, out, err = run(capsys, "fit", "gelu", "--kind", "pwl", "--bits", "2", "--out",
                         str(out_file), "--no-cache")
    assert code == 0 and "pwl table, 2 bit(s), gelu" in out
    # A long step: one line as it starts and one when it ends, on stderr only.
    started, ended = err.splitlines()
    assert started == "fitting a 2-bit piecewise-linear gelu ..."
    assert ended.startswith("fitting a 2-bit piecewise-linear gelu: done in ")
    assert ended.endswith(" s") and "fitting" not in out
    data = json.loads(out_file.read_text())
    assert data["kind"] == "pwl" and data["borders"] == data["pwl"]["c"]
    assert data["objective"]["weight"]["type"] == "flat"
    code, out, _ = run(capsys, "show", str(out_file), "--plot", str(tmp_path / "r.png"))
    assert code == 0 and "objective" in out
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert run(capsys, "gen-kernel", str(out_file))[0] == 0


def test_gen_kernel(capsys, tmp_path, monkeypatch):
    spec_file = tmp_path / "gelu-2.json"
    assert run(capsys, "fit", "gelu", "--bits", "2", "--out", str(spec_file))[0] == 0
    code, out, err = run(capsys, "gen-kernel", str(spec_file))
    assert code == 0 and err == ""
    assert f"wrote {tmp_path / 'gelu_2_ops.py'}" in out
    assert "stores 0.25 bytes per element for backward, against 2 for a bf16 input" in out
    code, _, _ = run(capsys, "gen-kernel", str(spec_file), "--out", str(tmp_path / "g_ops.py"))
    assert code == 0
    assert (tmp_path / "g_ops.py").read_text() == (tmp_path / "gelu_2_ops.py").read_text()
    monkeypatch.syspath_prepend(str(tmp_path))
    import g_ops

    spec = json.loads(spec_file.read_text())
    del spec["provenance"]  # an op module carries what the table does, not when it was made
    assert g_ops.BITS == 2 and g_ops.SPEC == spec


def test_gen_kernel_errors_leave_files_alone(capsys, tmp_path):
    spec_file = tmp_path / "s.json"
    assert run(capsys, "fit", "relu", "--bits", "1", "--out", str(spec_file))[0] == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(json.loads(spec_file.read_text()) | {"bits": "1; import os"}))
    keep = tmp_path / "keep_ops.py"
    keep.write_text("# mine\n")
    cases = [([str(tmp_path / "nope.json")], "not found"),
             ([str(bad), "--out", str(keep)], "bits must be an integer"),
             ([str(spec_file), "--out", str(tmp_path / "x.txt")], "must end in .py"),
             ([str(spec_file), "--out", str(tmp_path / "no" / "o.py")], "does not exist"),
             ([str(tmp_path / "keep_ops.py")], "not valid JSON")]
    before = sorted(tmp_path.iterdir())
    for argv, message in cases:
        code, out, err = run(capsys, "gen-kernel", *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert sorted(tmp_path.iterdir()) == before and keep.read_text() == "# mine\n"


def test_bad_data_files(capsys, tmp_path):
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "garbage.npy").write_bytes(b"not numpy at all")
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    np.save(tmp_path / "nan.npy", np.array([0.0, np.nan, 1.0]))
    np.savez(tmp_path / "nohist.npz", values=np.arange(3.0))
    (tmp_path / "bad.json").write_text('{"format": "actdesign.spec/1"}')
    for name in ("objects.npy", "garbage.npy", "strings.npy", "nan.npy", "nohist.npz"):
        code, _, err = run(capsys, "fit", "tanh", "--bits", "2", "--weight",
                           f"empirical:{tmp_path / name}", "--out", str(tmp_path / "o.json"))
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (name, err)
    assert not (tmp_path / "o.json").exists()
    code, _, err = run(capsys, "show", str(tmp_path / "bad.json"))
    assert code == 2 and "missing field" in err


def test_unwritable_outputs_fail_before_work(capsys, tmp_path):
    code, _, err = run(capsys, "fit", "gelu", "--bits", "3", "--out",
                       str(tmp_path / "no" / "such" / "dir.json"))
    assert code == 2 and "does not exist" in err
    spec_file = tmp_path / "s.json"
    assert run(capsys, "fit", "gelu", "--bits", "1", "--out", str(spec_file))[0] == 0
    code, out, err = run(capsys, "show", str(spec_file), "--plot", str(tmp_path / "x" / "p.png"))
    assert code == 2 and out == "" and "does not exist" in err
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, _, err = run(capsys, "fit", "gelu", "--bits", "1", "--out", str(locked / "a.json"))
        assert code == 2 and "permission" in err


def _python(code, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_console_script_exit_codes(tmp_path):
    bad = _python("from actdesign.cli import main; main(['fit', 'nope', '--bits', '3'])")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("actdesign: error: unknown activation 'nope'; run "
                                  "'actdesign list' for built-ins, or give an expression in x "
                                  "such as 'x*sigmoid(1.702*x)'")
    ok = _python("from actdesign.cli import main; main(['--version'])")
    assert ok.returncode == 0 and "0.1.0" in ok.stdout


def test_fit_list_show_gen_kernel_never_import_torch_or_triton(tmp_path):
    """A finder that records any attempt to import torch or triton, even a guarded one."""
    result = _python(f"""
        import sys
        attempts = []
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "triton"):
                    attempts.append(name)
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from actdesign.cli import main
        for argv in (["list"], ["fit", "gelu", "--bits", "2", "--out", r"{tmp_path}/g.json"],
                     ["show", r"{tmp_path}/g.json", "--plot", r"{tmp_path}/g.png"],
                     ["gen-kernel", r"{tmp_path}/g.json"]):
            try:
                main(argv)
            except SystemExit as exc:
                assert exc.code == 0, exc.code
        print("attempts:", attempts)
    """)
    assert result.returncode == 0, result.stderr
    assert "attempts: []" in result.stdout


HEAVY = ("sympy", "torch", "torch._dynamo", "numba")


def _modules_after(code, tmp_path, heavy=HEAVY):
    """The heavy modules a fresh process holds after running `code`."""
    result = _python(code + f"\nimport sys\nprint(' '.join(sorted(m for m in {heavy!r} "
                     "if m in sys.modules)))",
                     {"ACTDESIGN_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1].split()


def test_commands_import_only_what_they_use(tmp_path):
    def command(*argv):
        return f"from actdesign.cli import main\ntry:\n    main({list(argv)!r})\n" \
               "except SystemExit as exc:\n    assert exc.code == 0, exc.code"

    spec = str(tmp_path / "g.json")
    assert _modules_after(command("list"), tmp_path) == []
    # A built-in's table the presets use is shipped: a file read. Another one needs numba
    # for the DP, never sympy; its repeat is a file read.
    assert _modules_after(command("fit", "gelu", "--bits", "3", "--out", spec), tmp_path) \
        == []
    assert _modules_after(command("fit", "gelu", "--bits", "5", "--out", spec, "--force"),
                          tmp_path) == ["numba"]
    # The same command again reads the table and the text it printed: not even numpy.
    assert _modules_after(command("fit", "gelu", "--bits", "5", "--out", spec, "--force"),
                          tmp_path, HEAVY + ("numpy", "scipy")) == []
    assert (tmp_path / "cache" / "fits").is_dir()
    assert _modules_after(command("show", spec), tmp_path) == []
    # An expression is parsed by sympy; a kernel prints the activation's sympy tree.
    assert _modules_after(command("fit", "x*sigmoid(x)", "--bits", "1"), tmp_path) \
        == ["numba", "sympy"]
    assert _modules_after(command("gen-kernel", spec), tmp_path) == ["sympy"]


def test_importing_the_runtime_leaves_torch_dynamo_and_sympy_alone(tmp_path):
    assert _modules_after("import actdesign.runtime", tmp_path) == ["numba", "torch"]


def test_second_fit_does_not_recompile(tmp_path):
    script = """
        from actdesign.activation import resolve
        from actdesign.designer import fit_stepwise, partition
        fit_stepwise(resolve("gelu"), 2)
        kernels = (partition._first_level, partition._next_level)
        print(sum(sum(k.stats.cache_hits.values()) for k in kernels),
              sum(sum(k.stats.cache_misses.values()) for k in kernels))
    """
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    first, second = _python(script, env), _python(script, env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.split() == ["0", "2"]  # compiled and cached
    assert second.stdout.split() == ["2", "0"]  # loaded from the cache, nothing compiled


def test_long_fit_shows_a_progress_bar_on_a_terminal(tmp_path):
    import pty

    master, slave = pty.openpty()
    proc = subprocess.run(
        [sys.executable, "-c", "from actdesign.cli import main; main()", "fit", "gelu",
         "--bits", "6", "--out", str(tmp_path / "g.json")],
        stdout=subprocess.PIPE, stderr=slave, timeout=300)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.returncode == 0
    assert b"optimal grid partition" in b"".join(chunks)
    # Not on a pipe: the same fit through a pipe prints no bar, only its start and end lines,
    # and with --quiet not even those.
    announce_at_once = "import actdesign.cli as c; c.ANNOUNCE_AFTER = 0; c.main()"
    command = [sys.executable, "-c", announce_at_once, "fit", "gelu", "--bits", "6",
               "--no-cache"]
    piped = subprocess.run(command, capture_output=True, timeout=300, text=True)
    assert piped.returncode == 0
    assert piped.stderr.startswith("fitting a 6-bit table for gelu' ...\n")
    assert "done in" in piped.stderr and "optimal grid partition" not in piped.stderr
    quiet = subprocess.run([*command, "--quiet"], capture_output=True, timeout=300, text=True)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == piped.stdout


def _spec(capsys, path, bits="1"):
    assert run(capsys, "fit", "relu", "--bits", bits, "--out", str(path))[0] == 0
    return path


def test_hostile_data_files_fail_fast(capsys, tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    spec = json.loads(_spec(capsys, tmp_path / "s.json").read_text())
    edges = np.linspace(-4, 4, 5002).tolist()
    spec["objective"]["weight"] = {"type": "empirical", "edges": edges, "counts": [1.0] * 5001}
    (tmp_path / "bins.json").write_text(json.dumps(spec))
    (tmp_path / "deep.json").write_text("[" * 100000)
    cases = [(["show", str(fifo)], "not a regular file"),
             (["fit", "tanh", "--bits", "2", "--weight", f"empirical:{fifo}"],
              "not a regular file"),
             (["show", str(tmp_path / "bins.json")], "1..4096 bins"),
             (["gen-kernel", str(tmp_path / "bins.json")], "1..4096 bins"),
             (["show", str(tmp_path / "deep.json")], "not valid JSON")]
    for argv, message in cases:
        with within(10.0, " ".join(argv)):  # a FIFO open blocks forever
            code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_outputs_replace_only_their_own_kind(capsys, tmp_path):
    spec_file = _spec(capsys, tmp_path / "s.json")
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(precious)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = [(["fit", "relu", "--bits", "1", "--out", str(precious)], "pass --force"),
               (["fit", "relu", "--bits", "1", "--out", str(link)], "symbolic link"),
               (["fit", "relu", "--bits", "1", "--out", str(spec_file.parent)], "directory"),
               (["fit", "relu", "--bits", "1", "--out", str(fifo)], "not a regular file"),
               (["show", str(spec_file), "--plot", str(precious)], "pass --force"),
               (["gen-kernel", str(spec_file), "--out", str(tmp_path / "link.py")], ""),
               (["allocate", str(spec_file), "--avg-bits", "2", "--out", str(precious)],
                "pass --force")]
    (tmp_path / "link.py").symlink_to(precious)
    for argv, message in refused:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert precious.read_text() == "mine" and link.is_symlink() and fifo.is_fifo()
    # Our own outputs of the same kind are replaced freely.
    assert run(capsys, "fit", "relu", "--bits", "2", "--out", str(spec_file))[0] == 0
    plot = tmp_path / "p.png"
    for _ in range(2):
        assert run(capsys, "show", str(spec_file), "--plot", str(plot))[0] == 0
    # With --force, the link itself is replaced, never its target.
    assert run(capsys, "fit", "relu", "--bits", "1", "--out", str(link), "--force")[0] == 0
    assert not link.is_symlink() and precious.read_text() == "mine"
    assert json.loads(link.read_text())["bits"] == 1
    assert run(capsys, "fit", "relu", "--bits", "1", "--out", str(precious), "--force")[0] == 0
    assert json.loads(precious.read_text())["bits"] == 1


def test_a_hand_edited_module_needs_force(capsys, tmp_path):
    spec_file = _spec(capsys, tmp_path / "s.json")
    module = tmp_path / "s_ops.py"
    assert run(capsys, "gen-kernel", str(spec_file))[0] == 0
    assert run(capsys, "gen-kernel", str(spec_file))[0] == 0  # unedited: regenerated
    module.write_text(module.read_text() + "# tuned by hand\n")
    code, _, err = run(capsys, "gen-kernel", str(spec_file))
    assert code == 2 and "not an actdesign module" in err and "--force" in err
    assert module.read_text().endswith("# tuned by hand\n")
    assert run(capsys, "gen-kernel", str(spec_file), "--force")[0] == 0
    assert not module.read_text().endswith("# tuned by hand\n")


def test_ctrl_c_exits_130(capsys, monkeypatch):
    import actdesign.activation

    def interrupted(text):
        raise KeyboardInterrupt

    monkeypatch.setattr(actdesign.activation, "resolve", interrupted)
    code, out, err = run(capsys, "fit", "gelu", "--bits", "2", "--no-cache")
    assert (code, out, err) == (130, "", "actdesign: interrupted\n")


def test_pwl_asymptotes_are_bounded(capsys):
    # sympy's limit of x + tanh(tanh(tanh(tanh(tanh(x))))) never returns.
    text = "x + " + "tanh(" * 5 + "x" + ")" * 5
    with within(20.0, "pwl asymptotes"):  # 5 s a side at most
        code, out, err = run(capsys, "fit", text, "--kind", "pwl", "--bits", "2", "--quiet")
    assert code == 2 and out == "" and err.count("\n") == 1 and "asymptotes" in err, err


def test_the_commands_read_their_choices_from_the_code_defining_them(capsys):
    """No list of cards, optimizers or kernels is written in the CLI: estimate and plan offer
    what cards, footprint and estimate define, and refuse a bad card the same way."""
    import click

    from actdesign.cli import cli
    from actdesign.runtime.memory import cards, footprint
    from actdesign.runtime.memory.estimate import KERNELS

    def choices(command, option):
        param = next(p for p in cli.commands[command].params if option in p.opts)
        assert isinstance(param.type, click.Choice)
        return param.type.choices

    assert choices("estimate", "--card") == choices("plan", "--card") == cards.NAMES
    assert choices("estimate", "--optimizer") == tuple(footprint.OPTIMIZERS)
    assert choices("estimate", "--kernels") == KERNELS
    refusals = set()
    for argv in (["estimate", "-m", "llama-tiny"], ["plan", "-m", "llama-tiny", "--batch", "1",
                                                    "--budget", "0.5", "-o", "p.json"]):
        code, _, err = run(capsys, *argv, "--card", "h1000")
        assert code == 2 and len(err.strip().splitlines()) == 1
        refusals.add(err.split("': ", 1)[-1].strip())  # after the option's name
    assert len(refusals) == 1 and "'h1000' is not one of 'h100', 'h200'" in refusals.pop()
