"""`estimate` for image models: transformers' vision configs, `timm:` and `torchvision:`
names, at an image size. Its saved bytes and activation peak against the same step on real
tensors, compressed the same way (on a probe batch of 2), with every preset that applies."""

import pytest
import torch
import transformers

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, models
from actdesign.runtime.memory.estimate import _source_of_dict, estimate
from actdesign.runtime.memory.steps import step

CONFIGS = {
    "resnet": {"model_type": "resnet", "depths": [1, 1, 1, 1], "embedding_size": 16,
               "hidden_sizes": [16, 32, 64, 128], "num_labels": 10},
    "convnext": {"model_type": "convnext", "depths": [1, 1, 1, 1],
                 "hidden_sizes": [16, 32, 64, 128], "num_labels": 10, "drop_path_rate": 0.1},
    "swin": {"model_type": "swin", "patch_size": 4, "window_size": 4, "embed_dim": 16,
             "depths": [1, 1], "num_heads": [1, 2], "num_labels": 10},
}
POLICIES = ["none", "cnn", "actnn2", "cnn+actnn2", "fewbit3+pooled2", "cnn+backrazor90"]
# Where torch's fake kernels give a few gradients in the backward other strides than its CPU
# kernels do, the shape-only step makes copies (a transposed gradient made contiguous) that
# the real one does not: its peak is higher (1.6% for Swin here). The saved bytes are exact.
PEAK_STRIDES_DIFFER = {("swin", "none"), ("swin", "fewbit3+pooled2")}


def assert_close(estimated, measured):
    """Storages live and die alike on fake tensors: the counts agree to the byte."""
    assert estimated == measured, (estimated, measured)


def _real(source, size):
    """(model, make_batch) of what `estimate` is given, built for real."""
    if isinstance(source, dict):
        label, config = _source_of_dict(dict(source))
        model = models.from_config(label, models.sized(label, config, size))
        return model, lambda batch, seq: models.example_batch(model, batch, seq)
    return models.vision_model(source, size)


def _measured(source, policy, batch, size, precision):
    torch.manual_seed(0)
    model, make_batch = _real(source, size)
    model.train()
    if policy != "none":
        compress(model, policy, make_batch(2, 8), allow_more=True)
    inputs = make_batch(batch, 8)
    step(model, inputs, precision)  # once before: lookup tables are built lazily
    model.zero_grad(set_to_none=True)
    saved, peak = step(model, inputs, precision)
    return saved.total, peak


@pytest.mark.parametrize("source", ["timm:resnet18", "torchvision:mobilenet_v2",
                                    "timm:efficientnet_b0", *CONFIGS])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_image_models_to_the_byte(source, policy, precision):
    name, source = source, CONFIGS.get(source, source)
    size = 32
    row = estimate(dict(source) if isinstance(source, dict) else source, 3, 1, precision,
                   [policy], kernels="cpu", image_size=size).rows[0]
    saved, peak = _measured(source, policy, 3, size, precision)
    assert_close(row.saved_bytes, saved)
    if (name, policy) in PEAK_STRIDES_DIFFER and precision == "fp32":
        assert row.peak_bytes > peak
        pytest.xfail("torch's fake kernels make other gradient strides here: copies the real "
                     "step does not make")
    assert_close(row.peak_bytes, peak)


@pytest.mark.parametrize("policy", ["none", "cnn", "actnn2", "cnn+actnn2"])
def test_bf16_weights_and_images_to_the_byte(policy):
    """Weights and images in bf16 (`--precision bf16`): the probe compress runs on is bf16 too,
    as the step's own images are."""
    row = estimate("timm:resnet18", 3, 1, "bf16", [policy], kernels="cpu",
                   image_size=32).rows[0]
    torch.manual_seed(0)
    model, make_batch = _real("timm:resnet18", 32)
    model.train().to(torch.bfloat16)
    if policy != "none":
        compress(model, policy, make_batch(2, 8).bfloat16(), allow_more=True)
    inputs = make_batch(3, 8).bfloat16()
    step(model, inputs, "bf16")
    model.zero_grad(set_to_none=True)
    saved, peak = step(model, inputs, "bf16")
    assert_close(row.saved_bytes, saved.total)
    assert_close(row.peak_bytes, peak)


def test_the_image_size_is_the_configs_else_224_and_text_refuses_one():
    assert estimate(dict(CONFIGS["resnet"]), 1, 1, "fp32").shape == "batch 1, 224x224 images"
    assert estimate("vit-tiny", 1, 1, "fp32").shape == "batch 1, 32x32 images"
    assert estimate("timm:resnet18", 1, 1, "fp32", image_size=40).shape \
        == "batch 1, 40x40 images"
    with pytest.raises(ActdesignError, match="reads text, not images"):
        estimate("gpt2-tiny", 1, 8, "fp32", image_size=32)
    with pytest.raises(ActdesignError, match="no sequence to lengthen"):
        estimate("timm:resnet18", 1, 1, "fp32", longest="seq", gpu_memory="1GB")
    with pytest.raises(ActdesignError, match="timm has no model 'resnet5'"):
        estimate("timm:resnet5", 1, 1, "fp32")
    with pytest.raises(ActdesignError, match="no image classifier 'fasterrcnn"):
        estimate("torchvision:fasterrcnn_resnet50_fpn", 1, 1, "fp32")


def test_the_largest_batch_of_an_image_model():
    """--max-batch: the answer fits and one more image does not."""
    result = estimate("timm:resnet18", 1, 1, "fp32", ["none", "cnn"], gpu_memory="1500MB",
                      longest="batch", image_size=64)
    eager, cnn = (row.longest["1500MB"].value for row in result.rows)
    assert 1 <= eager < cnn
    for policy, answer in (("none", eager), ("cnn", cnn)):
        for batch, fits in ((answer, True), (answer + 1, False)):
            row = estimate("timm:resnet18", batch, 1, "fp32", [policy],
                           gpu_memory="1500MB", image_size=64).rows[0]
            assert row.fits is fits


@pytest.mark.parametrize("config", ["ResNetConfig", "ConvNextConfig", "ConvNextV2Config",
                                    "EfficientNetConfig", "MobileNetV1Config",
                                    "MobileNetV2Config", "RegNetConfig", "SwinConfig",
                                    "ViTConfig", "SegformerConfig"])
def test_transformers_vision_configs_are_estimated(config):
    config = getattr(transformers, config)()
    result = estimate(config, 1, 1, "fp32", ["none", "cnn"], image_size=224)
    eager, cnn = result.rows
    assert 0 < cnn.saved_bytes < eager.saved_bytes
