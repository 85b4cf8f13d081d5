"""The modules the ops know, by class: which built-in activation a module computes, and
which are norms, gated MLPs, transformers' Conv1D and causal LMs, PEFT's LoRA layers and
attention calling a rotary embedding. Classes are matched exactly, so a subclass that changes
the forward is never mistaken for its parent; `transformers` and `peft` classes are matched by
name and module, so neither need be installed. Other libraries' norms and transformers'
activations are known by their class names: what they compute is checked when they are
replaced, and the report says why where nothing we have computes it.
"""

from __future__ import annotations

import re
import types

from torch import nn


def _gelu(m):
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate)


def _when(name, **defaults):
    """The built-in `name` if the module's attributes have torch's default values."""
    def check(m):
        return name if all(getattr(m, k, None) == v for k, v in defaults.items()) else None
    return check


# torch.nn classes -> the built-in activation they compute (None: not a built-in).
_TORCH_ACTIVATIONS = {
    nn.GELU: _gelu, nn.SiLU: "silu", nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.Mish: "mish", nn.ReLU6: "relu6", nn.SELU: "selu", nn.Softsign: "softsign",
    nn.LogSigmoid: "logsigmoid", nn.Tanhshrink: "tanhshrink", nn.Hardswish: "hardswish",
    nn.Hardsigmoid: "hardsigmoid",
    nn.ELU: _when("elu", alpha=1.0), nn.CELU: _when("celu", alpha=1.0),
    nn.LeakyReLU: _when("leaky_relu", negative_slope=0.01),
    nn.Softplus: _when("softplus", beta=1.0, threshold=20.0),
    nn.Hardtanh: _when("hardtanh", min_val=-1.0, max_val=1.0),
}
# transformers.activations classes, by name.
_HF_ACTIVATIONS = {
    "GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu", "SiLUActivation": "silu", "MishActivation": "mish",
    "ReLUSquaredActivation": "squared_relu", "AccurateGELUActivation": "gelu_tanh",
    "BloomGelu": "gelu_tanh",  # x·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))/2
}
# timm.layers' activation classes that call torch's functions as a built-in does, by name
_TIMM_ACTIVATIONS = {"GELU": "gelu", "GELUTanh": "gelu_tanh"}
_TIMM_ACTIVATION_MODULES = ("timm.layers.activations", "timm.layers.activations_me")
# torch.nn activations no built-in computes: targeted, so a policy's report names them.
_OTHER_TORCH_ACTIVATIONS = (nn.PReLU, nn.RReLU, nn.Threshold, nn.Hardshrink, nn.Softshrink)
# transformers' activation classes: those of its activations module, and by name elsewhere.
_HF_ACTIVATION_NAME = re.compile(r"(Activation|Gelu|GELU|SiLU|Swish)$")


def activation_name(m: nn.Module) -> str | None:
    """The built-in activation a module computes, or None if it is not one we know."""
    found = _TORCH_ACTIVATIONS.get(type(m))
    if found is None and _from_timm(m):
        found = _TIMM_ACTIVATIONS.get(type(m).__name__)
    if found is None and _from_transformers(m):
        found = _HF_ACTIVATIONS.get(type(m).__name__)
        if type(m).__name__ == "GELUActivation" and getattr(m, "act", None) is not None \
                and getattr(m.act, "__name__", "gelu") not in ("gelu", "_gelu_python"):
            found = None
    return found(m) if callable(found) else found


def _from_transformers(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


def _from_timm(m: nn.Module) -> bool:
    return type(m).__module__ in _TIMM_ACTIVATION_MODULES


def is_activation(m: nn.Module) -> bool:
    """An activation class, whether or not it computes a built-in (the report says why not):
    torch's, timm's, and transformers' (its activations module, and classes named like one)."""
    return has_builtin(m) or type(m) in _OTHER_TORCH_ACTIVATIONS or _from_timm(m) or (
        _from_transformers(m) and (type(m).__module__ == "transformers.activations"
                                   or _HF_ACTIVATION_NAME.search(type(m).__name__) is not None))


def has_builtin(m: nn.Module) -> bool:
    """An activation class that computes a built-in with some settings (nn.ELU, say)."""
    return type(m) in _TORCH_ACTIVATIONS or (_from_transformers(m)
                                             and type(m).__name__ in _HF_ACTIVATIONS) \
        or (_from_timm(m) and type(m).__name__ in _TIMM_ACTIVATIONS)


def is_conv2d(m: nn.Module) -> bool:
    """An nn.Conv2d, or a subclass that computes what it does (another initialisation, say:
    transformers' EfficientNetDepthwiseConv2d): nn.Conv2d's own forward and padding."""
    cls = type(m)
    return cls is nn.Conv2d or (isinstance(m, nn.Conv2d) and cls.forward is nn.Conv2d.forward
                                and cls._conv_forward is nn.Conv2d._conv_forward)


def is_hf_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D: a Linear layer storing its weight as (in, out)."""
    return type(m).__name__ == "Conv1D" and _from_transformers(m) \
        and getattr(m, "weight", None) is not None and m.weight.dim() == 2


# Norm classes of other libraries, by name: whether an MS norm computes one is decided by
# what it computes on a probe (runtime.norms), and the report says why where none does.
_NORM_NAME = re.compile(r"LayerNorm|RMSNorm|Norm$")
_NORM_ATTRIBUTES = ("weight", "normalized_shape", "eps", "variance_epsilon")


def is_norm(m: nn.Module) -> bool:
    """nn.LayerNorm, nn.RMSNorm, and other libraries' modules named like a layer or RMS norm
    with a norm's attributes (torch's batch, group and instance norms are not targets, nor
    are ours)."""
    if type(m) in (nn.LayerNorm, nn.RMSNorm):
        return True
    if type(m).__module__.startswith(("torch.", "actdesign.", "actdesign_ops_")):
        return False
    return _NORM_NAME.search(type(m).__name__) is not None \
        and any(hasattr(m, a) for a in _NORM_ATTRIBUTES)


# other libraries' channels-first layer norms and frozen batch norms, by name
_CHANNEL_NORM_NAME = re.compile(r"(LayerNorm2d|FrozenBatchNorm2d)$")


def is_channel_norm(m: nn.Module) -> bool:
    """A norm over the channels of (N, C, ...) maps: torch's batch norms (sync-batch norms
    and subclasses too, timm's with the activation inside say), group norms, and other
    libraries' channels-first layer norms and frozen batch norms (by name, or a layer norm
    set to data_format "channels_first")."""
    if isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m) is nn.GroupNorm:
        return True
    if type(m).__module__.startswith(("torch.", "actdesign.", "actdesign_ops_")):
        return False
    return _CHANNEL_NORM_NAME.search(type(m).__name__) is not None \
        or (_NORM_NAME.search(type(m).__name__) is not None
            and getattr(m, "data_format", None) == "channels_first")


MAX_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
             nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


def is_gated_mlp(m: nn.Module) -> bool:
    """Shaped like a gated MLP: gate_proj, up_proj, down_proj Linear layers (or PEFT LoRA
    layers on them) and an act_fn module (whether it computes down(act(gate(x)) * up(x)) is
    checked when it is replaced)."""
    return all(_projection(getattr(m, n, None)) for n in ("gate_proj", "up_proj", "down_proj")) \
        and isinstance(getattr(m, "act_fn", None), nn.Module)


def _projection(m) -> bool:
    return type(m) is nn.Linear or is_lora_linear(m)


def is_peft(m: nn.Module, class_name: str) -> bool:
    """Whether m is an instance of PEFT's class of that name."""
    return any(cls.__name__ == class_name and cls.__module__.startswith("peft.")
               for cls in type(m).__mro__)


# PEFT's LoRA layers computing base(x) + s·B(A(drop(x))): on any base, and on bitsandbytes'
# quantized ones (QLoRA), which cast in their own order.
LORA_LINEARS = {("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.bnb", "Linear4bit"),
                ("peft.tuners.lora.bnb", "Linear8bitLt")}


def is_lora_linear(m: nn.Module) -> bool:
    """A PEFT LoRA layer computing base(x) + s·B(A(drop(x))) for each adapter, with no LoRA
    variant (DoRA and the like) on any adapter."""
    return (type(m).__module__, type(m).__name__) in LORA_LINEARS \
        and not getattr(m, "lora_variant", None) and not any(getattr(m, "use_dora", {}).values())


def is_causal_lm(m: nn.Module) -> bool:
    """A transformers causal LM: its loss is computed from its output embedding's logits."""
    return _from_transformers(m) and type(m).__name__.endswith(("ForCausalLM", "LMHeadModel")) \
        and hasattr(m, "get_output_embeddings") and hasattr(m, "base_model_prefix")


ROTARY = "apply_rotary_pos_emb"


def rotary_function_of(m: nn.Module):
    """The module-level apply_rotary_pos_emb that a module's class forward (under its
    decorators) calls by name, or None."""
    forward = type(m).forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    if not isinstance(forward, types.FunctionType) or ROTARY not in forward.__code__.co_names:
        return None
    return forward.__globals__.get(ROTARY)


def is_rotary_attention(m: nn.Module) -> bool:
    """An attention module of a transformers model that rotates q and k by calling its
    modeling file's apply_rotary_pos_emb (and whose forward is still its class's)."""
    return _from_transformers(m) and "forward" not in m.__dict__ \
        and rotary_function_of(m) is not None


def linear_like(m: nn.Module) -> bool:
    """Layers that can read an MS norm's x̂: y = x·Wᵀ + b over the last dimension, casting x
    to the autocast dtype as the norm emits it: nn.Linear, ours, transformers' Conv1D, and a
    LoRA layer on one (its adapter path reads x̂ too). Subclasses of nn.Linear elsewhere (a
    quantized one returns its input's dtype) are not: an MS norm would change that dtype."""
    exact = type(m) is nn.Linear or is_hf_conv1d(m) \
        or (isinstance(m, nn.Linear) and type(m).__module__.startswith("actdesign."))
    return exact or (is_lora_linear(m) and linear_like(m.base_layer))
