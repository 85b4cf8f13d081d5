"""The MS norms round as eager does: under bf16 autocast and with bf16 weights the forward is
eager's bit for bit, at norm weights near but not at 1 (where rounding x̂ to 16 bits before
the gain would show as a staircase in γ), and the gradients carry no bias beyond rounding
noise. Also the backward from the norm's output y, and the channels y cannot give x̂ back for."""

import math
import os
import sys

import pytest
import torch
from torch import nn

from actdesign.runtime import compress, models, norm_ops

sys.path.insert(0, os.path.dirname(__file__))
from lms import architecture  # noqa: E402

BF16_EPS = torch.finfo(torch.bfloat16).eps


def near_one(model, spread=0.01, seed=0):
    """Norm weights within 1 ± spread (w within ±spread where γ = 1 + w), biases ~ N(0, 0.1²):
    as trained norms have. Dropout off, so that runs compare."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
            if type(m).__name__.endswith(("LayerNorm", "RMSNorm")):
                w, b = getattr(m, "weight", None), getattr(m, "bias", None)
                if isinstance(w, torch.Tensor):
                    offset = 0.0 if float(w.float().mean()) == 0.0 else 1.0  # 1 + w from 0
                    w.copy_(offset + spread * (2 * torch.rand(w.shape, generator=g) - 1))
                if isinstance(b, torch.Tensor):
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


MODELS = {"llama": lambda: models.build("llama-tiny")[0],
          "qwen2": lambda: models.build("qwen2-tiny")[0],
          "gpt2": lambda: models.build("gpt2-tiny")[0],
          **{name.lower(): (lambda name=name: architecture(name))
             for name in ("Mistral", "Qwen3", "Gemma", "Phi3", "Cohere", "StableLm")}}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("policy", ["msnorm", "llm"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_the_forward_is_eagers_bit_for_bit(name, policy, weights):
    """Logits (the head's product of the final norm's output) and every hidden state, under
    bf16 autocast with float32 weights, and with bf16 weights. The MS norms' output is the
    dtype their readers compute in, so the last hidden state, the final norm's output, is
    compared in it."""
    torch.manual_seed(0)
    eager = near_one(MODELS[name]()).to(getattr(torch, weights)).train()
    ours = near_one(MODELS[name]()).to(getattr(torch, weights)).train()
    ids = torch.randint(1, eager.config.vocab_size, (2, 12))
    report = compress(ours, policy, example_inputs={"input_ids": ids, "labels": ids})
    assert any("MS" in type(m).__name__ for m in ours.modules()), str(report)
    outs = []
    for model in (eager, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights == "float32"):
            out = model(input_ids=ids, output_hidden_states=True)
        outs.append([out.logits, *out.hidden_states])
    for a, b in zip(*outs, strict=True):  # the final norm's output: bf16 where eager's readers
        assert torch.equal(a.to(b.dtype), b)  # cast it to bf16


# --- the gradient: no bias beyond rounding ------------------------------------------------

def flat_grad(model):
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def gradient(model, batch, dtype=None, micro=1):
    """The parameter gradient of the mean loss over `batch` (float64 for the reference, bf16
    autocast otherwise), in `micro` micro-batches."""
    model.zero_grad()
    for part in batch.chunk(micro):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
            loss = model(input_ids=part, labels=part).loss
        (loss * len(part) / len(batch)).backward()
    return flat_grad(model)


def bias_ratio(extra):
    """|mean of the per-batch extra errors| over what independent noise gives,
    sqrt(mean |e_i|² / n): about 1 for noise, above for an error the same in every batch."""
    n = len(extra)
    mean = torch.stack(extra).mean(0)
    noise = math.sqrt(sum(float(e.square().sum()) for e in extra) / n / n)
    return float(mean.norm()) / noise if noise else 0.0  # no extra error at all


def projected_t(extra, direction):
    """The t statistic of the extra errors projected on `direction` (a unit vector)."""
    p = torch.stack([e @ direction for e in extra])
    return float(p.mean() / (p.std() / math.sqrt(len(p))))


def bias_of(name, policy, batches=16, spread=0.01):
    """(bias ratio, projected t) of the policy's extra gradient error against float64, and
    the same for eager run as two micro-batches, the rounding-only control."""
    reference = near_one(MODELS[name](), spread).double().train()
    eager = near_one(MODELS[name](), spread).train()
    ours = near_one(MODELS[name](), spread).train()
    gen = torch.Generator().manual_seed(1)
    # Tokens drawn independently with Zipf's frequencies, as text has them: the gradient has
    # a mean across batches for a bias to align with (uniform tokens give it almost none).
    zipf = 1.0 / torch.arange(1, eager.config.vocab_size)
    data = [1 + torch.multinomial(zipf, 4 * 32, replacement=True, generator=gen).view(4, 32)
            for _ in range(batches)]
    compress(ours, policy, example_inputs={"input_ids": data[0], "labels": data[0]})
    extra, control, grads = [], [], []
    for batch in data:
        exact = gradient(reference, batch, torch.float64)
        base = gradient(eager, batch) - exact
        extra.append(gradient(ours, batch) - exact - base)
        control.append(gradient(eager, batch, micro=2) - exact - base)
        grads.append(exact)
    direction = torch.stack(grads).mean(0)
    direction /= direction.norm()
    return (bias_ratio(extra), projected_t(extra, direction)), \
        (bias_ratio(control), projected_t(control, direction))


@pytest.mark.parametrize("policy", ["msnorm", "llm"])
def test_the_gradient_carries_no_bias_beyond_rounding(policy, monkeypatch):
    """Over 16 batches, against float64: the extra gradient error of the policy over eager
    bf16 autocast averages out as independent noise does (bias ratio below 1.3; the
    rounding-only control, eager in two micro-batches, is near 1), and its projection on the
    mean gradient is not significant (|t| < 3, p about 0.01 at 15 degrees of freedom). The old
    forward, x̂ rounded to bf16 before the gain, fails this: a gain error the same in every
    batch (checked below, so the test can fail)."""
    (ratio, t), (control_ratio, _) = bias_of("llama", policy)
    assert control_ratio < 1.3
    assert ratio < 1.3 and abs(t) < 3, (ratio, t)
    if policy == "msnorm":
        monkeypatch.setattr(norm_ops(), "keeps_output", lambda *args, **kwargs: False)
        (old_ratio, _), _ = bias_of("llama", policy)
        assert old_ratio > 1.3


# --- the backward from y, and the channels apart ------------------------------------------

def reference_grads(kind, x, weight, bias, g):
    """(dx, dγ, dβ) of torch's norm in float64."""
    x64 = x.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    b64 = None if bias is None else bias.double().requires_grad_(True)
    d = x.shape[-1]
    if kind == "layer":
        y = torch.nn.functional.layer_norm(x64, (d,), w64, b64, 1e-5)
    else:
        y = torch.nn.functional.rms_norm(x64, (d,), w64, 1e-5)
    y.backward(g.double())
    return x64.grad, w64.grad, None if b64 is None else b64.grad


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_backward_from_the_output(kind, dtype, backend, monkeypatch):
    """dx, dγ and dβ from y against float64, with channels whose x̂ y cannot give back (γ = 0,
    γ subnormal, |β| > |γ|) kept apart. The x̂ read back from y is off by y's rounding,
    u·|y|/|γ| ≤ u·(|x̂| + |β/γ|) with u = eps/2, so each gradient is within eps times the
    sum of the magnitudes of its terms (x̂ near 1, |β/γ| ≤ 1 where read back), plus the
    rounding of dx to the dtype."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
    ops = norm_ops()
    d, rows = 48, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=gen) * 2 + 0.5
    weight = 1 + 0.01 * (2 * torch.rand(d, generator=gen) - 1)
    weight[3], weight[7] = 0.0, 1e-40  # zero and float32-subnormal
    bias = 0.1 * torch.randn(d, generator=gen) if kind == "layer" else None
    if bias is not None:
        weight[11], bias[11] = 0.05, 0.5  # |β| > |γ|: y mostly β
    g = torch.randn(rows, d, generator=gen).to(dtype)
    apart = ops.channels_apart(weight, bias, dtype)
    assert apart.tolist() == ([3, 7, 11] if kind == "layer" else [3, 7])
    y, rstd, kept = ops.forward_output(kind, x, 1e-5, dtype, weight, bias)
    assert kept.shape == (rows, len(apart)) and kept.dtype == dtype
    dx, sums = ops.backward_from_output(kind, y, rstd, g, weight, bias, apart, kept, True)
    ref_dx, ref_dw, ref_db = reference_grads(kind, x, weight, bias, g)
    eps = torch.finfo(dtype).eps
    centred = x.double() - (x.double().mean(-1, keepdim=True) if kind == "layer" else 0)
    rstd64 = torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
    xhat = centred * rstd64
    magnitude = (g.double().abs() * (xhat.abs() + 1)).sum(0)
    assert ((sums[0].double() - ref_dw).abs() <= eps * magnitude + 1e-6).all()
    if ref_db is not None:
        assert ((sums[1].double() - ref_db).abs() <= 1e-5 * g.double().abs().sum(0)).all()
    h = g.double() * weight.double()
    bound = eps * rstd64 * ((h.abs() * (xhat.abs() + 1)).mean(-1, keepdim=True)
                            * (xhat.abs() + 1) + h.abs()) + eps * ref_dx.abs()
    assert ((dx.double() - ref_dx).abs() <= bound).all()
    # Without the channels apart, γ = 0 reads back no x̂ at all.
    none = torch.empty(0, dtype=torch.int64)
    broken, _ = ops.backward_from_output(kind, y, rstd, g, weight, bias, none, kept[:, :0], True)
    assert not torch.isfinite(broken).all()
