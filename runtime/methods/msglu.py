"""`msglu`: a gated MLP, down(act(gate(x)) · up(x)), keeps gate(x) and up(x) only, and its
down projection rebuilds its input from them (`ops.glu`). With `tile`, it runs in sequence
tiles keeping its input only (`ops.tiles`): the long-sequence option.

Its layers are planned with it: under ActNN rules the down projection's bits give the codes of
up(x) two bits more, and gate and up keep the MS norm's codes of x where it offers them. A
gated MLP it cannot take is left alone with the reason, and its layers go to the other rules.
"""

from __future__ import annotations

from ..ops.glu import MSGLU
from .base import METHODS, Method, Option, integer, optional, register

PARTS = ("gate_proj", "up_proj", "down_proj")


@register
class MSGLUMethod(Method):
    name = "msglu"
    targets = ("glu",)
    options = {"tile": Option(None, optional(integer(1, 1 << 30), "auto"))}
    family = "llm"

    def check(self, name, module, rule, draft) -> None:
        MSGLU.from_module(module)  # refused: its layers go to the other rules

    def sites(self, name, module) -> dict[str, str]:
        return {f"{name}.{part}": "linear" for part in PARTS}  # its activation is its own

    def codes(self, name, module, rule, draft) -> dict:
        """The codes its layers keep where a rule of their own would give them codes."""
        out = {}
        for part in PARTS:
            layer, qualified = getattr(module, part), f"{name}.{part}"
            own = draft.rule_for(qualified, layer, "linear")
            if own is not None:
                out |= METHODS[own.apply].codes(qualified, layer, own, draft)
        return out

    def replace(self, name, module, rule, draft) -> None:
        super().replace(name, module, rule, draft)
        draft.covered.update(getattr(module, part) for part in PARTS)
        draft.rebuilt[module.down_proj] = "MS-GLU's g and u, which rebuild x"

    def replacement(self, name, module, rule, draft):
        reads_codes = module.gate_proj in draft.sharing and module.up_proj in draft.sharing
        new = MSGLU.from_module(module, codes=_up_codes(draft.codes.get(module.down_proj)),
                                input_codes=draft.codes[module.gate_proj] if reads_codes
                                else None, tile=rule.option("tile"))
        if new.tile is not None:
            tiles = "tiles of as many tokens as its width" if new.tile == "auto" \
                else f"tiles of {new.tile} tokens"
            return new, f"MSGLU ({new.act}; in sequence {tiles}, keeping its input only)"
        kept = "up(x)" if new.bits is None else f"{new.bits}-bit codes of up(x)"
        inputs = f"; gate and up keep the MS norm's {new.input_codes[0]}-bit codes of x" \
            if reads_codes else ""
        return new, f"MSGLU ({new.act}; keeps gate(x) and {kept} only{inputs})"


def _up_codes(down):
    """MS-GLU's codes of up(x), given the down projection's ActNN (bits, group size): two bits
    more, at most 8. û enters the input gradient elementwise, dg = dh·û·act'(g), where a
    norm's codes enter only through a row mean: at 2 bits the rounding noise is about half of
    the MLP's input gradient, at 4 bits (a step 5 times finer) about a tenth; a norm's 2-bit
    codes add about a tenth at d = 128 and a twentieth at d = 768 (tests/test_shared_codes.py;
    the LLaMA convergence in benchmarks/RESULTS.md)."""
    return None if down is None else (min(8, down[0] + 2), down[1])
