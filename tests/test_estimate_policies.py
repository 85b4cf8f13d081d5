"""`estimate` under every kind of policy: the saved bytes and the activation peak of one
training step on fake tensors against the same step measured on real ones, compressed the
same way (compress on a small probe batch, then gradient checkpointing, as a user would).
The peak follows our ops' CPU paths here (kernels="cpu"), as the real step runs them; the
CUDA kernels' allocations are checked against a GPU by benchmarks/gpu_estimate.py."""

import pytest
import torch
from lms import MOE, NAMES, architecture

from actdesign.runtime import compress, models
from actdesign.runtime.memory.estimate import estimate
from actdesign.runtime.memory.profile import _to
from actdesign.runtime.memory.setups import with_checkpointing, with_lora
from actdesign.runtime.memory.steps import step

POLICIES = ["none", "llm", "fewbit3+msnorm", "llm+actnn2", "actnn2"]
SHAPES = [(2, 16), (3, 40)]


def real_step(name, model, policy, batch, seq, precision, checkpointing, lora=None):
    """(saved bytes, activation peak, the model trained) of one real step of `model`,
    compressed with `policy`."""
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    if lora is not None:
        model = with_lora(name, model, lora)
    small = models.example_batch(model, 2, min(seq, 8))
    inputs = models.example_batch(model, batch, seq)
    if precision == "bf16":
        small, inputs = _to(small, "cpu", torch.bfloat16), _to(inputs, "cpu", torch.bfloat16)
    if policy != "none":
        compress(model, policy, example_inputs=small)
    if checkpointing:
        with_checkpointing(name, model)
    step(model, inputs, precision)  # once before: the ops build their lookup tables lazily
    model.zero_grad(set_to_none=True)
    saved, peak = step(model, inputs, precision)
    return saved.total, peak, model


def assert_close(estimated, measured):
    """The promise is 1%; storages live and die alike on fake tensors, so in practice the
    counts agree to the byte."""
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "bert-tiny",
                                  "vit-tiny"])
@pytest.mark.parametrize("policy, checkpointing", [(p, False) for p in POLICIES]
                         + [("none", True), ("llm", True)])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("shape", SHAPES)
def test_builtins(name, policy, checkpointing, precision, shape):
    row = estimate(name, *shape, precision, [policy], checkpointing=checkpointing,
                   kernels="cpu").rows[0]
    model, _ = models.build(name)
    saved, peak, _ = real_step(name, model, policy, *shape, precision, checkpointing)
    assert_close(row.saved_bytes, saved)
    assert_close(row.peak_bytes, peak)


@pytest.mark.parametrize("arch", [*NAMES, *MOE])
@pytest.mark.parametrize("policy, checkpointing", [(p, False) for p in POLICIES]
                         + [("none", True)])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_architectures(tmp_path, arch, policy, checkpointing, precision):
    model = architecture(arch)
    model.config.save_pretrained(tmp_path)  # estimate reads the config alone
    for shape in SHAPES:
        row = estimate(str(tmp_path), *shape, precision, [policy],
                       checkpointing=checkpointing, kernels="cpu").rows[0]
        torch.manual_seed(0)
        real = models.from_config(arch, model.config)
        saved, peak, _ = real_step(arch, real, policy, *shape, precision, checkpointing)
        assert_close(row.saved_bytes, saved)
        assert_close(row.peak_bytes, peak)


@pytest.mark.parametrize("policy", ["none", "llm", "llm+actnn2"])
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_lora(policy, precision):
    row = estimate("llama-tiny", 2, 16, precision, [policy], lora=8, kernels="cpu").rows[0]
    model, _ = models.build("llama-tiny")
    saved, peak, model = real_step("llama-tiny", model, policy, 2, 16, precision, False,
                                   lora=8)
    assert_close(row.saved_bytes, saved)
    assert_close(row.peak_bytes, peak)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    assert row.gradients_bytes == sum(p.nbytes for _, p in trained)


@pytest.mark.parametrize("policy", ["llm", "llm+actnn2"])
def test_cuda_kernels_make_no_working_copies(policy):
    """Our CUDA kernels write their outputs alone; the CPU paths also make float32 working
    copies (the fused loss's logits, the rotation's products). The saved bytes are the same."""
    cuda = estimate("llama-tiny", 3, 40, "bf16-autocast", [policy]).rows[0]
    cpu = estimate("llama-tiny", 3, 40, "bf16-autocast", [policy], kernels="cpu").rows[0]
    assert (cuda.saved_bytes, cuda.saved) == (cpu.saved_bytes, cpu.saved)
    assert cuda.peak_bytes < cpu.peak_bytes
