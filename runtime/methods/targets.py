"""The kinds of module a policy rule targets (`TARGETS`), what kind a module is
(`target_of`), and the PEFT layers compress leaves alone (`peft_refusal`)."""

from __future__ import annotations

from torch import nn

from ..ops.known_modules import (
    LORA_LINEARS,
    MAX_POOLS,
    is_activation,
    is_causal_lm,
    is_channel_norm,
    is_conv2d,
    is_gated_mlp,
    is_hf_conv1d,
    is_lora_linear,
    is_norm,
    is_peft,
    is_rotary_attention,
)

TARGETS = ("activation", "norm", "linear", "conv2d", "glu", "attention", "head", "block",
           "channel_norm", "pool")


def peft_refusal(m: nn.Module) -> str | None:
    """Why compress leaves a PEFT layer (and what it holds) as it is, or None when it is not
    one, or is a LoRA layer compress supports."""
    if is_lora_linear(m):
        return None
    if is_peft(m, "AuxiliaryTrainingWrapper"):
        return ("PEFT trains a copy of it (modules_to_save or trainable tokens) and its "
                "wrapper picks which copy runs: left as it is")
    if not is_peft(m, "BaseTunerLayer"):
        return None
    if type(m).__module__.startswith("peft.tuners.lora"):
        if (type(m).__module__, type(m).__name__) in LORA_LINEARS:
            return ("a LoRA variant (DoRA or another) computes more than base(x) + s·B(A(x)): "
                    "PEFT's own forward runs")
        return (f"LoRA on {type(m).__name__} layers (only Linear layers take the lean LoRA "
                "path): PEFT's own forward runs")
    return (f"a PEFT {type(m).__module__.split('.')[2]} adapter layer (only LoRA is "
            "supported): PEFT's own forward runs")
def target_of(m: nn.Module, parent: nn.Module | None = None) -> str | None:
    """'activation', 'norm' (a layer or RMS norm over the last dimension), 'channel_norm'
    (over the channels of a map: batch, group, channels-first layer norms), 'pool' (a max
    pool), 'linear' (a PEFT LoRA layer too), 'conv2d', 'glu', 'attention' (rotary), 'head' (a
    causal LM, whose loss and head are one), 'block' (see `is_block`; `parent` holds m), or
    None for a module no policy touches."""
    if is_causal_lm(m):
        return "head"
    if is_gated_mlp(m):
        return "glu"
    if is_rotary_attention(m):
        return "attention"
    if type(m) is nn.Linear or is_hf_conv1d(m) or is_lora_linear(m):
        return "linear"
    if is_conv2d(m):
        return "conv2d"
    if is_channel_norm(m):
        return "channel_norm"
    if type(m) in MAX_POOLS:
        return "pool"
    if is_norm(m):
        return "norm"
    if is_activation(m):
        return "activation"
    if is_block(m, parent):  # last: a module of another kind keeps that kind
        return "block"
    return None
def is_block(m: nn.Module, parent: nn.Module | None) -> bool:
    """A unit of recomputation: an element of an nn.ModuleList (a transformer's layers), or an
    element of an nn.Sequential with parameters and submodules of its own (a CNN's stages);
    one that has a forward (a list in a list has none)."""
    if type(m).forward is nn.Module.forward:
        return False
    if isinstance(parent, nn.ModuleList):
        return True
    return isinstance(parent, nn.Sequential) and next(m.children(), None) is not None \
        and next(m.parameters(), None) is not None
