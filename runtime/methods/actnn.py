"""`actnn`: a Linear or Conv2d layer keeps its input, for the weight gradient only, as b-bit
per-group stochastic codes (ActNN; `ops.quantized`, `templates/actnn_ops.py.jinja`); so does a
batch norm, for its whole backward, as codes of its normalized input x̂
(`ops.quantized_norms`), its forward eager's.

The codes are shared: the readers of one tensor keep one set (a block's first conv and its
shortcut conv), the readers of an MS norm that all keep codes of one bit width keep the
norm's codes of x̂ (`msnorm`), and a layer whose input another op keeps anyway keeps nothing
of its own (it stays exact, and lean). Where a chain rule names a batch norm too
(`cnn+actnn2`), its readers make its output again from its codes (`ops.chains`). A bits
file (`allocation`, written by `actdesign allocate` or `calibrate`) gives the layers it names
their own bits.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from actdesign.designer.allocate import load_bits
from actdesign.errors import ActdesignError

from ..ops.compressed import LeanLinear
from ..ops.known_modules import is_channel_norm
from ..ops.quantized import InputCodes, QConv2d, QLinear
from ..ops.quantized_norms import is_quantized_norm_forward, quantized_norm_forward
from .base import Method, Option, integer, register
from .chain import Chain
from .edits import BoundMethod, Edit
from .lora import is_lean, kept_elsewhere, plan_lean_lora


def power_of_two(value, where, base=None):
    value = integer(8, 1 << 20)(value, where)
    if value & (value - 1):
        raise ActdesignError(f"{where} must be a power of two, got {value}")
    return value


def allocation_file(value, where, base):
    """None, or a bits file: its per-layer bits override `bits` for the layers it names.
    Read now, so a bad file fails early; kept as a path."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.endswith(".json"):
        raise ActdesignError(f"{where} must be the path of a .json bits file")
    path = Path(value)
    if base is not None and not path.is_absolute():
        path = base / path
    load_bits(path)
    return str(path.resolve())


def bits_of(name, rule) -> tuple[int, int]:
    """(bits, group size) of an ActNN rule for the layer at `name`."""
    bits = rule.option("bits")
    if rule.option("allocation"):
        bits = load_bits(rule.option("allocation")).get(name, bits)
    return bits, rule.option("group_size")


@register
class ActNN(Method):
    name = "actnn"
    copies_conv_input = True
    targets = ("linear", "conv2d", "channel_norm")
    options = {"bits": Option(2, integer(1, 8)), "group_size": Option(256, power_of_two),
               "allocation": Option(None, allocation_file)}
    offers = {kind: tuple({"bits": b} for b in range(1, 9))
              for kind in ("linear", "conv2d", "channel_norm")}

    def takes(self, module) -> bool:
        # of the norms, a batch norm alone keeps codes of its input (`_replace_norm`)
        return not is_channel_norm(module) or isinstance(module, nn.modules.batchnorm._BatchNorm)

    def attached(self, module) -> bool:
        return is_lean(module) or is_quantized_norm_forward(module.__dict__.get("forward"))

    def codes(self, name, module, rule, draft) -> dict:
        return {} if isinstance(module, nn.Conv2d | nn.modules.batchnorm._BatchNorm) \
            else {module: bits_of(name, rule)}

    def replace(self, name, module, rule, draft) -> None:
        if rule.target == "channel_norm":
            self._replace_norm(name, module, rule, draft)
            return
        if not isinstance(module, nn.Conv2d) and (module in draft.kept or module in draft.exact):
            # Its input is kept anyway (by an MS norm, or by attention for its backward):
            # codes of it would add bytes and noise, not save them. The exact layer, lean.
            why = "an MS norm's x̂" if module in draft.exact else "kept by another op"
            draft.swap(name, module, LeanLinear.from_module(module),
                       f"LeanLinear (its input is {why}, kept anyway: no codes)")
            return
        super().replace(name, module, rule, draft)

    def _replace_norm(self, name, module, rule, draft) -> None:
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ActdesignError("only a batch norm keeps codes of its input (its backward "
                                 "reads x through the batch's statistics)")
        if "forward" in module.__dict__:
            raise ActdesignError("its forward is already replaced on the instance")
        bits, group_size = bits_of(name, rule)
        # a chain rule for it too (cnn+actnn2): its codes take its input's place in the chain
        chained = any(r.apply == Chain.name and r.matches(name, module, "channel_norm")
                      for r in draft.policy.rules)
        draft.edits.append(Edit(module, "forward", BoundMethod(
            module, quantized_norm_forward, type(module), bits, group_size, chained)))
        rebuilt = "; its readers keeping codes make its output again from them" if chained \
            else ""
        draft.said(name, type(module).__name__, f"keeps {bits}-bit codes of its input; its "
                                                 f"forward and statistics eager's{rebuilt}")

    def replacement(self, name, module, rule, draft):
        cls = QConv2d if isinstance(module, nn.Conv2d) else QLinear
        bits, group_size = bits_of(name, rule)
        new = cls.from_module(module, bits=bits, group_size=group_size)
        shared = ": the MS norm's codes, shared" if module in draft.sharing else ""
        return new, f"{cls.__name__} ({bits}-bit saved input{shared})"

    def replace_lora(self, name, layer, rule, draft) -> None:
        kept = kept_elsewhere(layer, draft)
        if kept is not None:
            plan_lean_lora(name, layer, LeanLinear, kept, draft)
            return
        bits, group_size = draft.codes[layer]
        of = "the MS norm's x̂, shared" if layer in draft.sharing else "x"
        plan_lean_lora(name, layer, InputCodes(bits, group_size), f"{bits}-bit codes of {of}",
                       draft)
