"""`msnorm`: a norm keeps one tensor (x̂, or its 16-bit output) and one rstd per row, never
its input, and the Linear layers reading it keep that same tensor (`ops.norms`,
`ops.sharing`). Its parameters stay its own: nothing is folded.

A norm with an affine is replaced where one probe forward shows that only Linear-like layers
read its output, none of them kept as it is by the policy; its readers then keep its x̂ (and
rebuild their input from it, exactly), or, when every reader is an ActNN layer of one bit
width, its codes of x̂. A reader no other rule replaces becomes lean, so it keeps the norm's
copy and none of its own.
"""

from __future__ import annotations

from actdesign.errors import ActdesignError

from ..ops.compressed import LeanLinear
from ..ops.known_modules import is_lora_linear
from ..ops.norms import _QMSNorm, ms_norm
from .base import Method, register
from .lora import lean_lora


@register
class MSNorm(Method):
    name = "msnorm"
    targets = ("norm",)
    family = "llm"

    def prepare(self, chosen, draft) -> None:
        """Each norm replaced, or left alone with the reason; its readers noted in the draft:
        `exact` (they keep x̂), `sharing` (they keep its codes), `norm_readers` (all)."""
        ms = {}
        for name, (m, _) in chosen.items():  # what no MS norm computes is refused first
            try:
                ms[name] = ms_norm(m)
            except ActdesignError as exc:
                draft.skip(name, m, str(exc))
        plain = {n: m for n, (m, _) in chosen.items() if n in ms and _affine_free(ms[n])}
        affine = {n: m for n, (m, _) in chosen.items() if n in ms and n not in plain}
        if affine and draft.run is None:
            for name, m in affine.items():
                draft.skip(name, m, "sharing its x̂ with the layers reading it needs "
                                    "example_inputs, to see which they are")
            affine = {}
        uses = draft.readers_of(affine) if affine else {}
        for name, m in {**plain, **affine}.items():
            found = [] if name in plain else uses[name]
            if isinstance(found, list):
                kept = [draft.names[r] for r in found if draft.kept_as_is(draft.names[r], r)]
                if kept:
                    found = f"{kept[0]}, reading it, is kept as it is by the policy"
            if isinstance(found, str):
                draft.skip(name, m, found)
                continue
            new = ms[name]
            layouts = {draft.codes.get(r) for r in found}
            what = type(new).__name__
            if found and len(layouts) == 1 and None not in layouts:
                bits, group_size = layouts.pop()
                new = _QMSNorm.from_norm(new, bits=bits, group_size=group_size)
                what = f"{type(new).__name__} ({bits}-bit codes of x̂"
                draft.sharing.update(found)
            else:
                what += " (keeps rstd and x̂, or its output where that is 16-bit"
                draft.exact.update(found)
            draft.norm_readers += found
            into = f", shared with {', '.join(draft.names[r] for r in found)}" if found \
                else ""
            draft.swap(name, m, new, what + into + ")")

    def replace(self, name, module, rule, draft) -> None:
        """Planned with its readers, in `prepare`."""

    def finish(self, draft) -> None:
        for reader in draft.norm_readers:  # no rule replaced it: it keeps the norm's copy
            if reader in draft.new or reader in draft.covered:
                continue
            name = draft.names[reader]
            if is_lora_linear(reader):
                lean_lora(name, reader, draft)
            else:
                draft.swap(name, reader, LeanLinear.from_module(reader),
                           "LeanLinear (keeps the MS norm's own copy, not one of its own)")


def _affine_free(norm) -> bool:
    return getattr(norm, "weight", None) is None and getattr(norm, "bias", None) is None
