"""Shared set-up. Triton runs its kernels on CPU tensors in the interpreter, which must be
switched on before Triton is first imported; generated modules go to a per-session cache."""

import contextlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).parent))  # the tests' helpers (lms, bounds), any order

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy.stats import norm  # noqa: E402


def synthetic_spec(activation="gelu", bits=3, seed=0) -> dict:
    """A valid spec without running the designer: normal-quantile borders, distinct levels."""
    rng = np.random.default_rng(seed)
    k = 2**bits
    borders = norm.ppf(np.arange(1, k) / k) * 1.3
    levels = np.sort(rng.uniform(-0.2, 1.2, k))
    act = {"name": activation} if activation.isidentifier() else {"expr": activation}
    return {"format": "actdesign.spec/1", "kind": "stepwise", "bits": bits, "activation": act,
            "borders": [float(v) for v in borders], "levels": [float(v) for v in levels],
            "objective": {"weight": {"type": "normal", "mean": 0.0, "std": 1.0}}}


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    os.environ["ACTDESIGN_CACHE_DIR"] = str(tmp_path_factory.mktemp("ops-cache"))


@pytest.fixture(scope="session")
def make_spec():
    return synthetic_spec


@pytest.fixture(scope="session")
def ops_for():
    """The loaded op module of a synthetic spec, memoized by the runtime."""
    from actdesign import runtime

    def load(activation="gelu", bits=3, seed=0):
        return runtime.load(synthetic_spec(activation, bits, seed))

    return load


def saved_storages(fn, x, params=(), autocast=False) -> dict:
    """{storage: bytes} of what autograd keeps for fn(x)'s backward, parameters aside, each
    storage once; with `autocast`, fn runs under CPU bfloat16 autocast."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    # enabled=False would switch off an autocast the caller opened: enter it only when asked
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        fn(x)
    return storages


def module_step(module, x, dy, autocast=False):
    """(output, input gradient, parameter gradients) of module on a copy of x, backward from
    dy; the input is not a leaf, as inside a model (autocast casts it per layer)."""
    import torch

    leaf = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(leaf * 1)
    y.backward(dy.to(y.dtype))
    return y.detach(), leaf.grad, [p.grad for p in module.parameters()]


@pytest.fixture(scope="session")
def saved():
    return saved_storages


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `actdesign *argv`, run in this process."""
    from actdesign.cli import main

    with pytest.raises(SystemExit) as info:
        main(list(argv))
    out, err = capsys.readouterr()
    return info.value.code, out, err
