"""The fused loss keeps eager's float32 accuracy at any confidence and logit scale.

Against the float64 cross-entropy of float64 logits of the same inputs, the fused loss and
its gradients must stay within twice eager float32's error (F.cross_entropy of the float32
product). Why 2x: both round the same float32 product (the fused one a chunk at a time, its
sums in another order) and subtract the row maximum before any exponential, so their errors
are of the same size, made of independent roundings of the same kind; the factor covers one
being unlucky where the other is lucky, and nothing more. A log-sum-exp kept in absolute
terms (nll = lse - z[t], p = exp(z - lse)) loses eps·|lse| on every token: with logits in
the tens that is several times eager's error at a loss of 0.1 or less, and fails here.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actdesign.runtime.methods.fused_ce import attach_fused_loss
from actdesign.runtime.ops.lm_loss import fused_linear_cross_entropy

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from lms import architecture  # noqa: E402
from loss_accuracy import fit_scale, head_problem, labels_for  # noqa: E402

LOSSES = (10.0, 1.0, 0.1, 0.01)
U = 2**-24  # float32's unit round-off


def loss_and_grads(fn, hidden, weight):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = fn(h, w)
    loss.backward()
    return {"loss": loss.detach(), "hidden": h.grad, "weight": w.grad}


def assert_within_twice_eager(fused, eager, exact):
    for name, x in exact.items():
        x = x.double()
        fused_error = (fused[name].double() - x).norm()
        eager_error = (eager[name].double() - x).norm()
        # and two float32 ulps of the result: a single number (the loss) may be rounded
        # exactly by one computation and an ulp or two off by the other
        slack = 4 * U * x.norm()
        assert fused_error <= 2 * eager_error + slack, (name, fused_error, eager_error)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("offset", [0.0, 50.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_fused_head_loss_is_as_accurate_as_eager(loss, offset, backend, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)  # triton: the CUDA kernels, interpreted
    hidden, weight, labels = head_problem(loss, offset, tokens=64, d=32, vocab=500)
    exact = loss_and_grads(lambda h, w: F.cross_entropy(h @ w.T, labels),
                           hidden.double(), weight.double())
    assert exact["loss"].item() == pytest.approx(loss, rel=1e-3)  # the confidence asked for
    if offset:
        assert (hidden.double() @ weight.double().T).abs().max() > 50  # logits in the tens
    eager = loss_and_grads(lambda h, w: F.cross_entropy(h @ w.T, labels), hidden, weight)
    fused = loss_and_grads(lambda h, w: fused_linear_cross_entropy(
        h, w, shift_labels=labels, chunk_size=24), hidden, weight)
    assert_within_twice_eager(fused, eager, exact)


def tied_gemma():
    return architecture("Gemma", tie_word_embeddings=True)


def run_model(model, inputs, float64=False):
    """The loss and parameter gradients: the model's own loss, or with `float64` the float64
    cross-entropy of its (float64) logits (transformers' loss takes the logits to float32)."""
    model.zero_grad(set_to_none=True)
    if float64:
        logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), inputs["labels"][:, 1:].flatten())
    else:
        loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach()} | grads


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss", LOSSES)
def test_tied_model_loss_and_gradients_are_as_accurate_as_eager(loss, backend, monkeypatch):
    """A Gemma whose head is its embedding: every parameter's gradient, the shared weight's
    included, within twice eager's error. The final norm's γ scales the logits to the
    confidence asked for."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
    model = tied_gemma()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    exact = copy.deepcopy(model).double()
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = exact.model(input_ids=ids).last_hidden_state
        logits = exact.lm_head(hidden)[:, :-1]
        labels = torch.full_like(ids, -100)
        labels[:, 1:] = labels_for(logits, loss)
        a = fit_scale(lambda a: F.cross_entropy(a * logits.flatten(0, 1),
                                                labels[:, 1:].flatten()).item(), loss)
        for m in (model, exact):  # Gemma's norm multiplies by 1 + γ
            m.model.norm.weight.mul_(a).add_(a - 1)
    fused = copy.deepcopy(model)
    attach_fused_loss(fused)
    inputs = {"input_ids": ids, "labels": labels}
    want = run_model(exact, inputs, float64=True)
    assert want["loss"].dtype == torch.float64
    assert want["loss"].item() == pytest.approx(loss, rel=1e-3)
    assert "model.embed_tokens.weight" in want  # the tied weight, under its one name
    assert_within_twice_eager(run_model(fused, inputs), run_model(model, inputs), want)
