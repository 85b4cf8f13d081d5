"""torch.compile(fullgraph=True) of whole `llm` models: no graph break, eager's loss.

aot_eager traces the forward and the backward as torch.compile's other backends do (our
custom ops through their fake and autograd registrations) and runs the traced graphs without
code generation, so the test costs seconds on a CPU."""

import copy

import pytest
import torch

from actdesign.runtime import compress, models

pytest.importorskip("transformers")


def step(model, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "mistral-tiny"])
def test_an_llm_model_compiles_without_graph_breaks(name):
    """Under bf16 autocast, with norm weights near but not 1. The loss is eager's bit for
    bit; the gradients round in other places (the compiled MS norm runs its backward from
    the float32 x̂, eager from its bf16 output, and the compiler's rotation is eager's own
    ops): within two bf16 steps of each gradient's largest entry."""
    model, _ = models.build(name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.99, 1.01)
    compress(model, "llm")
    inputs = models.example_batch(model, 2, 16)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(step(compiled, inputs), step(eager, inputs))
    eps = torch.finfo(torch.bfloat16).eps
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        scale = q.grad.abs().max()
        assert (p.grad - q.grad).abs().max() <= 2 * eps * scale, n
