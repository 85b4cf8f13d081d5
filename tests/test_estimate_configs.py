"""The benchmark configs (benchmarks/configs) are the published ones: each loads through
models.config_of and estimate counts the model's published number of parameters exactly."""

from pathlib import Path

import pytest
import torch

from actdesign.runtime import models
from actdesign.runtime.memory.estimate import estimate

CONFIGS = Path(__file__).parent.parent / "benchmarks" / "configs"

# name -> (model class, parameters as published: the safetensors' element count)
PUBLISHED = {
    "llama-3.1-8b": ("LlamaForCausalLM", 8_030_261_248),
    "qwen2.5-7b": ("Qwen2ForCausalLM", 7_615_616_512),
    "mistral-7b": ("MistralForCausalLM", 7_248_023_552),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_config_gives_the_published_parameter_count(name):
    path = str(CONFIGS / name)
    config = models.config_of(path)
    assert config.torch_dtype in ("bfloat16", torch.bfloat16)
    with torch.device("meta"):  # the buffers (rotary frequencies) without allocating weights
        model = models.from_config(path, config)
    model_cls, parameters = PUBLISHED[name]
    assert type(model).__name__ == model_cls
    assert sum(p.numel() for p in model.parameters()) == parameters
    row = estimate(path, 1, 16, policies=["none"]).rows[0]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert row.weights_bytes == 4 * parameters + buffers  # fp32 weights, each tied one once
