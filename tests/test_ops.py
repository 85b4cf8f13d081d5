"""The generated op on CPU: packed layout, exact codes, forward, backward, autograd, compile.

The numba kernels (the CPU default) and the torch path (the reference) are both checked
against independent references: a bit-by-bit bitstream and exact border counts.
"""

import gc
import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actdesign import runtime

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [0, 1, 7, 8, 9, 13, 1001]


@pytest.fixture(params=["numba", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", request.param)
    return request.param


def bitstream(codes, bits: int) -> bytes:
    """The layout, bit by bit: element i holds bits [i*bits, (i+1)*bits), little-endian."""
    out = bytearray((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        for b in range(bits):
            if int(c) >> b & 1:
                pos = i * bits + b
                out[pos // 8] |= 1 << (pos % 8)
    return bytes(out)


def exact_codes(ops, x: torch.Tensor) -> np.ndarray:
    """How many borders are <= x, compared exactly in float64; NaN gets 0."""
    xd = x.detach().double().reshape(-1).numpy()
    with np.errstate(invalid="ignore"):
        codes = (xd[:, None] >= np.array(ops.BORDERS)[None, :]).sum(1)
    return np.where(np.isnan(xd), 0, codes)


def probe(ops, dtype, n=600, seed=0) -> torch.Tensor:
    """Random values plus every border rounded down, up and to nearest in `dtype`, and
    non-finite values: the inputs where a code is easiest to get wrong."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2
    b = torch.tensor(ops.BORDERS, dtype=torch.float64)
    near = torch.cat([b.to(dtype).double(), torch.nextafter(b.to(dtype), torch.tensor(
        math.inf, dtype=dtype)).double() if dtype != torch.bfloat16 else b, b])
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e4, -1e4])
    return torch.cat([x, near, special.double()]).to(dtype)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_pack_is_the_little_endian_bitstream(ops_for, bits, n):
    ops = ops_for(bits=bits)
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = ops.pack(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert bytes(packed.tolist()) == bitstream(codes.tolist(), bits)
    assert torch.equal(ops.unpack(packed, n), codes)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", FLOATS)
def test_codes_count_the_borders_exactly(ops_for, backend, bits, dtype):
    ops = ops_for(bits=bits)
    x = probe(ops, dtype)
    y, packed = ops._forward_op(x)
    assert bytes(packed.tolist()) == bitstream(exact_codes(ops, x), bits)
    assert y.dtype == dtype and y.shape == x.shape


@pytest.mark.parametrize("dtype", FLOATS)
def test_codes_with_borders_crowded_closer_than_bfloat16_spacing(make_spec, backend, dtype):
    """Many borders inside one bucket of the float32 table (same top 16 bits) and between
    neighbouring 16-bit values."""
    data = make_spec("gelu", 8)
    data["borders"] = sorted(float(v) for v in np.r_[np.linspace(-3, 0.99, 60),
                                                     1 + np.linspace(0, 0.01, 150)[1:],
                                                     np.linspace(1.02, 4, 46)])
    ops = runtime.load(data)
    x = torch.cat([probe(ops, dtype), 1 + torch.rand(5000, dtype=torch.float64) * 0.012])
    x = x.to(dtype)
    assert bytes(ops._forward_op(x)[1].tolist()) == bitstream(exact_codes(ops, x), 8)


@pytest.mark.parametrize("n", SIZES)
def test_odd_sizes_pack_like_the_reference(ops_for, backend, n):
    ops = ops_for(bits=3)
    x = torch.randn(n)
    assert bytes(ops._forward_op(x)[1].tolist()) == bitstream(exact_codes(ops, x), 3)


@pytest.mark.parametrize("bits", [1, 3, 5, 8])
@pytest.mark.parametrize("dtype", FLOATS)
def test_backward_is_exactly_level_times_grad(ops_for, backend, bits, dtype):
    ops = ops_for(bits=bits)
    x = probe(ops, dtype)
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    dx = ops._backward_op(ops._forward_op(x)[1], g)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    levels = torch.tensor(ops.LEVELS, dtype=compute)
    expected = (levels[torch.from_numpy(exact_codes(ops, x))] * g.to(compute)).to(dtype)
    assert dx.dtype == dtype and torch.equal(dx, expected)


TORCH_ACTIVATIONS = {
    "relu": F.relu, "leaky_relu": F.leaky_relu, "relu6": F.relu6, "elu": F.elu, "celu": F.celu,
    "selu": F.selu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "mish": F.mish, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "softplus": F.softplus, "softsign": F.softsign, "logsigmoid": F.logsigmoid,
    "tanhshrink": F.tanhshrink, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "hardtanh": F.hardtanh,
}


@pytest.mark.parametrize("name", sorted(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_torchs_own_activation(ops_for, backend, name, dtype):
    ops = ops_for(name, bits=2)
    x = torch.linspace(-8, 8, 1001, dtype=dtype, requires_grad=True)
    expected = TORCH_ACTIVATIONS[name](x.detach())
    assert torch.equal(ops.apply(x), expected)
    with torch.no_grad():  # the plain activation: no codes
        assert torch.equal(ops.apply(x), expected)


@pytest.mark.parametrize("formula", ["x*sigmoid(1.702*x)", "max(x, 0)**2", "atan(x)*x",
                                     "x*erfc(-x/sqrt(2))/2", "where(x > 0, x, expm1(x))",
                                     "x*tanh(softplus(x))", "log1p(exp(x))", "x**3/(1+x**2)"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_expression_forward_is_accurate(ops_for, backend, formula, dtype):
    from actdesign.activation import resolve

    ops = ops_for(formula, bits=2)
    x = torch.linspace(-6, 6, 997, dtype=torch.float64).to(dtype).requires_grad_(True)
    exact = torch.from_numpy(resolve(formula).f(x.detach().double().numpy()))
    # Computed in float32 (float64 for float64), then rounded once to the dtype.
    eps = torch.finfo(dtype).eps
    compute_eps = 2.0**-52 if dtype == torch.float64 else 2.0**-23
    tol = (eps + 64 * compute_eps) * (exact.abs() + x.detach().double().abs() + 1)
    for y in (ops.apply(x), ops.apply(x.detach())):  # with codes, and the plain activation
        assert ((y.detach().double() - exact).abs() <= tol).all()


def test_autograd_shapes_and_strides(ops_for, backend):
    ops = ops_for(bits=3)
    base = torch.randn(6, 5, 4, dtype=torch.float64)
    for x in (base, base.transpose(0, 2), base[:, ::2], base[0, 0, 0], base[:0]):
        xl = x.detach().clone().requires_grad_(True)
        y = ops.apply(xl)
        assert y.shape == x.shape
        g = torch.randn(x.shape, dtype=x.dtype)
        y.backward(g)
        levels = torch.tensor(ops.LEVELS, dtype=torch.float64)
        codes = torch.from_numpy(exact_codes(ops, x)).reshape(x.shape)
        assert torch.equal(xl.grad, levels[codes] * g)


def test_non_finite_inputs(ops_for, backend):
    ops = ops_for(bits=2)
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0], requires_grad=True)
    y = ops.apply(x)
    assert torch.equal(y.detach().isnan(), F.gelu(x.detach()).isnan())
    assert torch.equal(y.detach().nan_to_num(), F.gelu(x.detach()).nan_to_num())
    y.backward(torch.ones(4))
    lv = ops.LEVELS
    expected = torch.tensor([lv[0], lv[-1], lv[0], lv[exact_codes(ops, x)[3]]])
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("bad", [torch.arange(5), torch.ones(3, dtype=torch.bool),
                                 torch.ones(2, dtype=torch.complex64)])
def test_non_float_inputs_get_a_clear_error(ops_for, bad):
    ops = ops_for(bits=3)
    with pytest.raises(TypeError, match="must be float16, bfloat16, float32 or float64"):
        ops.apply(bad)
    with pytest.raises(TypeError, match="expected a tensor"):
        ops.apply([1.0, 2.0])


def test_unknown_backend_is_refused(ops_for, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="ACTDESIGN_BACKEND must be"):
        ops_for(bits=3).apply(torch.ones(3, requires_grad=True))


@pytest.mark.parametrize("bits", [1, 3, 7])
def test_backward_saves_only_the_packed_codes(ops_for, backend, bits):
    ops = ops_for(bits=bits)
    saved = []

    def pack_hook(t):
        saved.append(t)
        return t

    w = torch.randn(1001, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        y = ops.apply(w * 2)
    assert len(saved) == 1
    (codes,) = saved
    assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(1001 * bits / 8)
    assert codes.untyped_storage().nbytes() == math.ceil(1001 * bits / 8)
    assert [t.data_ptr() for t in y.grad_fn.saved_tensors] == [codes.data_ptr()]


def test_without_autograd_nothing_is_saved_or_packed(ops_for, monkeypatch):
    ops = ops_for(bits=3)
    calls = []
    monkeypatch.setattr(ops, "_forward_op", lambda x: calls.append(x))
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(ops.apply(x), F.gelu(x))
    assert torch.equal(ops.apply(x.detach()), F.gelu(x.detach()))
    assert calls == []


def test_the_input_is_not_kept_alive(ops_for, backend):
    ops = ops_for(bits=3)
    w = torch.randn(4096, requires_grad=True)
    x = w * 2  # an intermediate: only the graph could keep it
    ref = weakref.ref(x)
    y = ops.apply(x)
    del x
    gc.collect()
    assert ref() is None
    y.sum().backward()
    assert w.grad.shape == w.shape


def test_opcheck(ops_for):
    ops = ops_for(bits=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(37, 3, dtype=dtype, requires_grad=True)
        torch.library.opcheck(ops._forward_op, (x,))
        packed = ops._forward_op(x.detach())[1]
        torch.library.opcheck(ops._backward_op, (packed, torch.randn(37, 3, dtype=dtype)))


def test_torch_compile_matches_eager(ops_for):
    ops = ops_for("gelu", bits=3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), ops.Module(), torch.nn.Linear(32, 4))
    compiled = torch.compile(model)
    x = torch.randn(8, 16)
    outputs = []
    for m in (model, compiled):
        m.zero_grad()
        y = m(x)
        y.square().sum().backward()
        outputs.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
    (y0, g0), (y1, g1) = outputs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_module_is_a_drop_in_replacement(ops_for):
    ops = ops_for("silu", bits=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ops.Module())
    assert "Module('silu', bits=2, stepwise)" in repr(model)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), F.silu(model[0](x)))


def test_a_second_import_of_the_same_file_reuses_the_op(make_spec, tmp_path):
    from actdesign.codegen.render import write

    path = tmp_path / "twice_ops.py"
    write(make_spec("elu", 2, seed=7), path)
    modules = []
    for name in ("twice_a", "twice_b"):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    a, b = modules
    x = torch.randn(50, requires_grad=True)
    assert a.OP == b.OP and torch.equal(a.apply(x), b.apply(x))
    assert runtime.load(make_spec("elu", 2, seed=7)).OP == a.OP


def test_eager_autograd_skips_the_custom_op_dispatch(ops_for, monkeypatch):
    # Eager calls run the kernels under a plain autograd.Function; only torch.compile needs the
    # custom op. Same codes, same gradient.
    ops = ops_for("gelu", bits=3)
    x = torch.randn(1000, requires_grad=True)
    g = torch.randn(1000)
    expected = ops._backward_op(ops._forward_op(x.detach())[1], g)

    def refuse(*args):
        raise AssertionError("custom op called in eager mode")

    monkeypatch.setattr(ops, "_forward_op", refuse)
    monkeypatch.setattr(ops, "_backward_op", refuse)
    y = ops.apply(x)
    assert torch.equal(y, F.gelu(x.detach()))
    y.backward(g)
    assert torch.equal(x.grad, expected)


def test_double_backward_is_refused(ops_for):
    ops = ops_for("gelu", bits=3)
    x, v = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    (dx,) = torch.autograd.grad(ops.apply(x), x, v, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


def test_the_first_cpu_call_says_it_compiles_on_stderr(tmp_path):
    """numba compiles an op's CPU kernels on their first call (seconds): past half a second a
    line on stderr says so, and when they are ready; later calls print nothing."""
    code = textwrap.dedent("""
        import sys
        import torch
        from actdesign import runtime
        sys.path.insert(0, TESTS)
        from conftest import synthetic_spec
        ops = runtime.load(synthetic_spec("gelu", 2, seed=5))
        x = torch.randn(64, requires_grad=True)
        ops.apply(x).sum().backward()
        print("first done", file=sys.stderr, flush=True)
        ops.apply(x).sum().backward()
    """).replace("TESTS", repr(os.path.dirname(__file__)))
    env = {**os.environ, "ACTDESIGN_CACHE_DIR": str(tmp_path), "ACTDESIGN_BACKEND": "numba"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1] == "first done", lines
    assert any("compiling the CPU kernels" in line for line in lines[:-1])
    assert "CPU kernels ready in" in lines[-2]
