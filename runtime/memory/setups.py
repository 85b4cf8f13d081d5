"""A model set up as `estimate` trains it, on fake tensors: built from a config or copied
(`fake_model`, `fake_copy`), in bfloat16 where the precision says, with PEFT LoRA adapters
(`with_lora`), transformers' gradient checkpointing (`with_checkpointing`), a 4-bit base's
weights (`quantized`) and FSDP2's units in flight with CPU offload (`in_flight`)."""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from actdesign.errors import ActdesignError

from .. import models
from ..apply.accounting import storage_key
from ..ops.fake import RealSchedules, conversions_in_place, no_initialization
from .profile import bf16_weights


def fake_model(name: str, config, precision: str = "fp32", lora=None):
    """The model of a config on fake tensors, in training mode (call inside `shapes_only`):
    in bfloat16 where the precision says (`bf16_weights`), with PEFT LoRA adapters when given
    `lora`, a rank (see `with_lora`) or a peft.LoraConfig."""
    with no_initialization(), conversions_in_place():
        with RealSchedules():
            model = models.from_config(name, config).train()
        model = RealSchedules.faked(model, torch._guards.detect_fake_mode())
        return _converted(model, name, precision, lora)


def fake_copy(module: torch.nn.Module, mode, precision: str = "fp32", lora=None):
    """A copy of `module` whose parameters and buffers are fake tensors of `mode` (shared ones
    shared), in training mode, converted as `fake_model` converts; the module is untouched."""
    memo = {}
    with unset_fake_temporarily():  # the real tensors read as they are, in the mode or not
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in memo:
                fake = mode.from_tensor(t.detach())
                memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else fake
    with conversions_in_place():
        return _converted(copy.deepcopy(module, memo).train(), type(module).__name__,
                          precision, lora)


def _converted(model, name, precision, lora):
    if bf16_weights(precision):
        model.to(torch.bfloat16)
    if lora is not None:
        model = with_lora(name, model, lora)
    return model


def with_lora(name, model, lora):
    """PEFT LoRA adapters of rank `lora` on every Linear layer but the head (alpha 2 x rank,
    no dropout), or as `lora` says, a peft.LoraConfig."""
    # bitsandbytes, which PEFT imports, warns that it cannot fetch an optional CPU kernel from
    # the Hub: a download actdesign never makes, and nothing a user can act on
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import peft
    except ImportError:
        raise ActdesignError("--lora needs PEFT: pip install peft") from None
    config = lora if isinstance(lora, peft.LoraConfig) else peft.LoraConfig(
        r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules="all-linear")
    try:
        with warnings.catch_warnings():  # PEFT reads a property by transformers' old name
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                    FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ActdesignError(f"model {name!r}: PEFT cannot add LoRA adapters: "
                             f"{str(exc).splitlines()[0]}") from None


def with_checkpointing(name, model):
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ActdesignError(f"model {name!r} ({type(model).__name__}) does not support "
                             "gradient checkpointing")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # its newer name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def quantized(model) -> dict:
    """The weights a 4-bit base holds at 4 bits: every frozen Linear's but the head's (as
    transformers quantizes them), by storage."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    return {storage_key(m.weight): m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
            and (head_weight is None or storage_key(m.weight) != storage_key(head_weight))}


def in_flight(model) -> int:
    """FSDP2 with CPU offload, on one card: the most bytes its units hold there at once, two
    units' unsharded weights (the one running, the next prefetched) and one's gradients
    before they go to the host. The units: each block (an element of a layer list), the
    output embedding, and the rest (the root)."""
    base = models.transformers_model(model) or model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    units = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList)
             for c in m.children()]  # a list nested in a unit adds no bytes: `seen`
    seen, sizes = set(), []
    for unit in [*units, *([head] if head is not None else []), model]:
        params = [p for p in unit.parameters() if storage_key(p) not in seen]
        seen.update(storage_key(p) for p in params)
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        sizes.append((weights, grads))
    weights = sorted((w for w, _ in sizes), reverse=True)
    return sum(weights[:2]) + max(g for _, g in sizes)


def built(model) -> dict:
    """What was built, for the one-line echo: architecture, parameters, layers, width and
    vocabulary (adapters aside)."""
    base = models.transformers_model(model) or model
    config = getattr(base, "config", None)
    parameters = sum(t.numel() for n, t in _named_distinct(base) if "lora_" not in n)
    return {"architecture": type(base).__name__, "parameters": parameters,
            **{key: getattr(config, attr, None) for key, attr in (
                ("layers", "num_hidden_layers"), ("width", "hidden_size"),
                ("vocabulary", "vocab_size"))}}


def _named_distinct(model):
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if storage_key(p) not in seen:
            seen.add(storage_key(p))
            yield name, p
