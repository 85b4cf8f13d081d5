"""`fused_ce`: a transformers causal LM computes its training loss chunk by chunk with the
fused linear cross-entropy (`ops.lm_loss`), so no logits are kept. Exact within float32
rounding, checked on a probe batch where there is one; refused where the loss cannot be
reproduced (a head with a bias, soft-capped logits, a forward computing its loss otherwise)."""

from __future__ import annotations

import torch
from torch import nn

from actdesign.errors import ActdesignError

from ..ops.fake import is_fake
from ..ops.known_modules import is_causal_lm
from ..ops.lm_loss import FusedLossHead, fused_forward, probe_losses
from .base import Method, Option, integer, optional, register
from .edits import BoundMethod, Edit, apply_all


def plan_fused_loss(model: nn.Module, chunk_size: int | None = None, probe=None):
    """(the head's name, the edits that make a transformers causal LM compute its training
    loss, the forward given `labels`, with fused_linear_cross_entropy). Without labels it
    behaves exactly as before. Nothing is changed here. Refused when the loss cannot be
    reproduced: a head with a bias, logit soft-capping in the config, or (with `probe`, a dict
    of inputs with labels) a probe the fused forward refuses or whose loss differs from the
    model's own. The forward's own code runs unchanged, labels included, with the head
    returning the hidden states in place of the logits and `loss_function` computing the fused
    loss from them: what the forward adds to the loss (a MoE router's auxiliary loss, say),
    it adds itself, and a scale it applies to the logits goes to the hidden states."""
    if not is_causal_lm(model):
        raise ActdesignError("the fused loss needs a transformers causal LM (*ForCausalLM, "
                             "*LMHeadModel)")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        adapted = " (PEFT trains it: a LoRA adapter or modules_to_save on the head)" \
            if type(head).__module__.startswith("peft.") else ""
        raise ActdesignError(f"its output embedding is a {type(head).__name__}{adapted}, "
                             "not an nn.Linear: the fused loss reads the head's weight alone")
    if head.bias is not None:
        raise ActdesignError("its head has a bias, which the fused loss does not add")
    # What the forward does to the logits after the head, it does here to the hidden states:
    # right for a scale (Cohere, Granite), wrong for soft-capping. The probe catches the rest.
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        raise ActdesignError("its config sets final_logit_softcapping, a transform of the "
                             "logits the fused loss does not reproduce")
    original = model.forward
    if "unfused_forward" in model.__dict__ or getattr(original, "__self__", None) is not model:
        raise ActdesignError("its forward is already replaced on the instance")
    if probe is not None:
        expected, got = probe_losses(model, head, chunk_size, probe)
    # On fake tensors (an estimate) the fused forward runs, so what it refuses is refused,
    # but there are no values to compare: a loss computed otherwise goes unseen there.
    if probe is not None and not is_fake(expected):
        tolerance = 64 * torch.finfo(expected.dtype).eps * max(1.0, abs(expected.item()))
        if not abs(got.item() - expected.item()) <= tolerance:  # NaN fails too
            raise ActdesignError(f"on a probe batch the fused loss ({got.item():.6g}) differs "
                                 f"from the model's own ({expected.item():.6g}): its forward "
                                 "computes its loss other than by loss_function from the "
                                 "head's logits")
    name = next(n for n, m in model.named_modules() if m is head)
    parent, _, attr = name.rpartition(".")
    fused = FusedLossHead.from_module(head, chunk_size=chunk_size)
    # The original kept on the model, not in a closure, so that a deep copy runs its own.
    return name, [Edit(model.get_submodule(parent), attr, fused),
                  Edit(model, "unfused_forward", original),
                  Edit(model, "forward", BoundMethod(model, fused_forward, original.__func__))]


def attach_fused_loss(model: nn.Module, chunk_size: int | None = None, probe=None) -> str:
    """Apply `plan_fused_loss` to the model; returns the head's name."""
    name, edits = plan_fused_loss(model, chunk_size, probe)
    apply_all(edits)
    return name


@register
class FusedCE(Method):
    name = "fused_ce"
    targets = ("head",)
    options = {"chunk_size": Option(None, optional(integer(1, 1 << 30)))}
    family = "llm"

    def made(self, module) -> bool:
        return isinstance(module.get_output_embeddings(), FusedLossHead)

    def check(self, name, module, rule, draft) -> None:
        draft.planned[name] = plan_fused_loss(module, rule.option("chunk_size"),
                                              _with_labels(draft.inputs))

    def replace(self, name, module, rule, draft) -> None:
        head, fused = draft.planned[name]  # the model itself: its forward computes the loss
        draft.edits += fused
        draft.covered.add(module.get_output_embeddings())
        head = f"{name}.{head}" if name else head  # the causal LM may be inside
        draft.said(head, "Linear", "FusedLossHead (the loss is computed chunk by chunk: no "
                                   "logits kept)")


def _with_labels(inputs):
    """The probe inputs of a causal LM with labels (its own, or the input ids), or None."""
    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        return None
    return {"labels": inputs["input_ids"], **inputs}
