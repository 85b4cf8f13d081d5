"""The MS activation (runtime/ops/msact.py): GPT-2's gelu_new keeping only its input, eager's
bits on every path, one kernel each way, and the `llm` preset on GPT-2."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, models
from actdesign.runtime.ops.glu import glu_ops
from actdesign.runtime.ops.msact import MSActivation

sys.path.insert(0, str(Path(__file__).parent))
from conftest import module_step  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.activations import GELUActivation, NewGELUActivation  # noqa: E402

SQRT_2_OVER_PI = 0.7978845608028654


def grads(module, x, dy):
    return module_step(module, x, dy)[:2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_path_is_eager_bit_for_bit(dtype):
    """The torch path runs eager's ops forward and autograd's steps backward, in its order:
    the output and the input gradient are eager's bits."""
    ours = MSActivation.from_module(NewGELUActivation())
    x = (torch.randn(1 << 14, dtype=torch.float64) * 3).to(dtype)
    dy = torch.randn(1 << 14, dtype=torch.float64).to(dtype)
    (y0, dx0), (y1, dx1) = grads(NewGELUActivation(), x, dy), grads(ours, x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)


def r(v, dtype):
    """v rounded to `dtype`, back in float64 (a float32 value: exact)."""
    return v.to(torch.float32).to(dtype).double()


def cuda_eager(x, dy, dtype):
    """What eager computes on CUDA for 16-bit x, op by op (tanh correctly rounded to float32):
    every op rounds to x's dtype; pow(x, 3) is (x·x)·x in 16-bit arithmetic, and so is
    tanh_backward's dt·(1 - t·t); autograd sums x's gradients as (from the cube's path + the
    inner sum's) + from 0.5·x."""
    x, dy = x.double(), dy.double()
    kappa, c = (torch.tensor(v, dtype=torch.float32).double() for v in (0.044715, SQRT_2_OVER_PI))
    cube = r(r(x * x, dtype) * x, dtype)
    inner = r(x + r(kappa * cube, dtype), dtype)
    z = r(c * inner, dtype)
    t = r(torch.tanh(z), dtype)
    y = r(r(0.5 * x, dtype) * r(1.0 + t, dtype), dtype)
    d_half = r(dy * r(1.0 + t, dtype), dtype)
    d_opt = r(dy * r(0.5 * x, dtype), dtype)
    d_z = r(d_opt * r(1.0 - r(t * t, dtype), dtype), dtype)
    d_inner = r(d_z * c, dtype)
    d_cube = r(d_inner * kappa, dtype)
    d_from_cube = r(d_cube * r(3.0 * r(x * x, dtype), dtype), dtype)
    dx = r(r(d_inner + d_from_cube, dtype) + r(d_half * 0.5, dtype), dtype)
    return y, dx, z


def near_a_rounding_edge(z, dtype):
    """Where tanh(z)'s float32 value lies within 8 float32 ulps of a midpoint between two
    values of `dtype`: there the last bits of the platform's tanh (CUDA's, or the
    interpreter's own formula here) decide t."""
    t = torch.tanh(z)
    binade = torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(1e-30))))
    step = torch.finfo(dtype).eps / 2 * binade
    mid = (t / step).floor() * step + step / 2
    return (t - mid).abs() <= 8 * torch.finfo(torch.float32).eps * t.abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_round_as_cuda_eager_does(dtype, monkeypatch):
    """The Triton kernels (interpreted) against CUDA eager's steps computed here one at a time
    in float64, so each rounding is that of a float32 op: equal bit for bit, but where tanh's
    own last bits decide a 16-bit rounding (fewer than 1% of the elements; the kernels call
    CUDA's tanh on the GPU, benchmarks/gpu_check.py compares them there)."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    ops = glu_ops()
    x = (torch.randn(1 << 14, dtype=torch.float64) * 3).to(dtype)
    dy = torch.randn(1 << 14, dtype=torch.float64).to(dtype)
    y, dx = ops.activation(x), ops.activation_backward(x, dy)
    y_ref, dx_ref, z = cuda_eager(x, dy, dtype)
    decided = ~near_a_rounding_edge(z, dtype)
    assert decided.float().mean() > 0.99
    assert torch.equal(y.double()[decided], y_ref[decided])
    assert torch.equal(dx.double()[decided], dx_ref[decided])


def test_the_kernels_take_16_bit_floats_only(monkeypatch):
    """In float32 a kernel's fused multiply-adds would round where eager does not: the torch
    path runs, eager's bits."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    x, dy = torch.randn(1000) * 3, torch.randn(1000)
    (y0, dx0), (y1, dx1) = grads(NewGELUActivation(), x, dy), \
        grads(MSActivation.from_module(NewGELUActivation()), x, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)


def gpt2_mlp(dtype=torch.float32):
    config = transformers.GPT2Config(n_embd=64, n_inner=256, resid_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.models.gpt2.modeling_gpt2.GPT2MLP(256, config).to(dtype)


def test_only_the_input_is_kept_and_the_reader_shares_it(saved):
    """Eager keeps x (for pow), tanh's output, 0.5·x, 1 + tanh and the down projection's
    input: five values per element; compressed, x alone, read by the down projection too."""
    eager = gpt2_mlp()
    ours = copy.deepcopy(eager)
    compress(ours, "llm")
    assert type(ours.act).__name__ == "MSActivation"
    h = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)  # a norm's bf16 output

    ours_kept = saved(ours, h, list(ours.parameters()), autocast=True)
    assert sorted(ours_kept.values()) == [8 * 64 * 2, 8 * 256 * 2]  # h, and c_fc's output
    eager_kept = saved(eager, h, list(eager.parameters()), autocast=True)
    weights = 2 * 64 * 256 * 2  # autocast's bf16 weight copies (addmm keeps no bias)
    assert sum(eager_kept.values()) - weights == 8 * 64 * 2 + 5 * 8 * 256 * 2


@pytest.mark.parametrize("mode", ["float32", "autocast", "bf16"])
def test_a_gpt2_mlp_is_eager_bit_for_bit(mode):
    """c_proj rebuilds its input from the x the activation keeps: the same bits as eager's."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    eager = gpt2_mlp(dtype)
    ours = copy.deepcopy(eager)
    compress(ours, "llm")
    x = torch.randn(3, 5, 64, dtype=dtype)
    dy = torch.randn(3, 5, 64)
    (y0, dx0, g0), (y1, dx1, g1) = (module_step(m, x, dy, mode == "autocast")
                                    for m in (eager, ours))
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(torch.equal(a, b) for a, b in zip(g1, g0, strict=True))


def test_other_activations_are_left_alone_with_the_reason():
    with pytest.raises(ActdesignError, match="NewGELUActivation only"):
        MSActivation.from_module(GELUActivation())
    with pytest.raises(ActdesignError, match="NewGELUActivation only"):
        MSActivation.from_module(torch.nn.GELU(approximate="tanh"))


def test_a_changed_formula_is_refused(monkeypatch):
    """The probe compares the module's own forward with ours, bit for bit."""
    class NewGELUActivation(torch.nn.Module):  # same name, another formula
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh")

    NewGELUActivation.__module__ = "transformers.activations"
    with pytest.raises(ActdesignError, match="not the eager gelu_new"):
        MSActivation.from_module(NewGELUActivation())


def test_llm_with_fewbit_gives_the_activation_its_table():
    """msact is a fallback of `llm`: a lossy activation rule joined to it wins."""
    model, _ = models.build("gpt2-tiny")
    compress(model, "llm+fewbit3")
    acts = {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.act")}
    assert "MSActivation" not in acts and len(acts) == 1


def test_opcheck_and_compile():
    ops = glu_ops()
    x, dy = torch.randn(6, 10), torch.randn(6, 10)
    torch.library.opcheck(ops.activation_op, (x,))
    torch.library.opcheck(ops.activation_backward_op, (x, dy))
    eager = gpt2_mlp()
    ours = copy.deepcopy(eager)
    compress(ours, "llm")
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    h = torch.randn(2, 64, requires_grad=True)
    y = compiled(h)
    y.sum().backward()
    assert torch.equal(y, eager(h))


def test_a_second_derivative_is_refused():
    x = torch.randn(8, requires_grad=True)
    y = MSActivation()(x * 1)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        dx.sum().backward()
