"""The Triton kernels, run by the interpreter on CPU tensors, against the torch path.

conftest.py switches TRITON_INTERPRET on before Triton is imported. Codes and gradients must
match the torch path bit for bit; the forward is checked against float64 math.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actdesign.activation import BUILTINS, resolve

HALF_AND_SINGLE = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 8, 13, 33, 1031, 4096, 2 * 4096 + 5]  # 4096: one whole program (ROWS * 32);
# the last spans three programs, the third holding the tail


def run(ops, backend, monkeypatch, fn, *args):
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
    return fn(*args)


def inputs(ops, dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 2).to(dtype)
    b = torch.tensor(ops.BORDERS, dtype=torch.float64).to(dtype)  # values on the borders
    m = min(n, b.numel())
    x[:m] = b[:m]
    if n > 12:
        x[-3:] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    return x


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE)
@pytest.mark.parametrize("n", SIZES)
def test_codes_and_gradients_match_the_torch_path(ops_for, monkeypatch, bits, dtype, n):
    ops = ops_for(bits=bits)
    x = inputs(ops, dtype, n, seed=bits)
    g = torch.randn(n, dtype=torch.float64).to(dtype)
    y_ref, packed_ref = run(ops, "torch", monkeypatch, ops._forward_op, x)
    y, packed = run(ops, "triton", monkeypatch, ops._forward_op, x)
    assert packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(packed, packed_ref)
    dx_ref = run(ops, "torch", monkeypatch, ops._backward_op, packed_ref, g)
    dx = run(ops, "triton", monkeypatch, ops._backward_op, packed, g)
    assert torch.equal(dx, dx_ref)
    # The forward: torch's own gelu, within one rounding of the dtype (both compute in fp32).
    finite = x.isfinite()
    eps = torch.finfo(dtype).eps
    err = (y[finite].double() - y_ref[finite].double()).abs()
    assert (err <= eps * y_ref[finite].double().abs() + 1e-6).all()


def test_autograd_through_the_kernels(ops_for, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    ops = ops_for(bits=3)
    x = torch.randn(3, 5, 7).transpose(0, 2).requires_grad_(True)
    y = ops.apply(x)
    y.backward(torch.ones_like(y))
    codes = torch.searchsorted(torch.tensor(ops.BORDERS_F32), x.detach().contiguous(), right=True)
    assert torch.equal(x.grad, torch.tensor(ops.LEVELS, dtype=torch.float32)[codes])
    assert torch.equal(ops.apply(torch.empty(0, 4)), torch.empty(0, 4))


PRINTED = [b.name for b in BUILTINS] + [
    "atan(x)*x", "x*erfc(-x/sqrt(2))/2", "sinh(x)/(1 + cosh(x))", "log1p(exp(x))",
    "where(x > 1 and x < 2, x**1.5, x**7/100)", "exp(-x**2)*x", "min(max(x, -1), 2)",
    "x/(1 + abs(x))", "tanh(x)*tanh(x/2)", "erf(x)*sigmoid(x)",
]


@pytest.mark.parametrize("formula", PRINTED)
def test_triton_activation_is_accurate_in_float32(ops_for, monkeypatch, formula):
    """f printed from the sympy tree, run by the kernel: a few float32 roundings off."""
    ops = ops_for(formula, bits=1)
    x = torch.linspace(-9, 9, 4001, dtype=torch.float32)
    y, _ = run(ops, "triton", monkeypatch, ops._forward_op, x)
    exact = resolve(formula).f(x.double().numpy())
    with np.errstate(invalid="ignore"):
        df = np.abs(resolve(formula).df(x.double().numpy()))
    # Each float32 operation rounds once, and intermediates are about as large as x or f:
    # allow 16 roundings of |f|, |x| and of the propagated input rounding |x f'|.
    xa = np.abs(x.double().numpy())
    tol = 16 * 2.0**-24 * (np.abs(exact) + xa * (1 + df))
    err = np.abs(y.double().numpy() - exact)
    ok = (err <= tol) | (np.isnan(exact) & np.isnan(y.numpy()))
    assert ok.all(), (x[~ok][:5], y[~ok][:5], exact[~ok][:5])


def test_triton_gelu_tanh_matches_torch(ops_for, monkeypatch):
    ops = ops_for("gelu_tanh", bits=2)
    x = torch.linspace(-7, 7, 3001)
    y, _ = run(ops, "triton", monkeypatch, ops._forward_op, x)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), rtol=4e-7, atol=4e-7)
