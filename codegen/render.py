"""Render a spec into a self-contained op module: Triton kernels, a torch path and a custom op.

Only validated numbers from the spec become code, as exact float literals. The activation's
code comes from the registry (torch's own function) or from printing its sympy tree. The spec
itself is embedded as JSON text in a string literal: data, never code.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from importlib import resources
from typing import TYPE_CHECKING

import jinja2
import numpy as np

from actdesign import __version__
from actdesign import spec as spec_mod
from actdesign.errors import ActdesignError
from actdesign.files import module_header, write_atomic

if TYPE_CHECKING:
    from .printers import Code


RENDERABLE_KINDS = ("stepwise", "pwl")  # both end as borders and levels
_F32_MAX = float(np.finfo(np.float32).max)
_SAFE_LABEL = re.compile(r"[A-Za-z0-9_ .,*+\-/()<>=&|~]+")  # what sympy prints; no quotes


def render(source) -> str:
    """The op module's source for a spec (a path, a dict or a Spec), deterministically."""
    from .printers import TORCH, TRITON, Code, literal, print_code  # sympy: only here

    spec = spec_mod.load(source)
    if spec.kind not in RENDERABLE_KINDS:
        raise ActdesignError(f"cannot generate kernels for a {spec.kind!r} spec")
    for name, values in (("border", spec.borders), ("level", spec.levels)):
        if max(abs(v) for v in values) > _F32_MAX:
            raise ActdesignError(f"a {name} of this spec lies outside the float32 range")
    act = spec.resolve_activation()
    label = act.name or str(act.f_expr)  # printed from the parsed tree, not the spec's text
    if not _SAFE_LABEL.fullmatch(label):
        raise ActdesignError(f"cannot name the activation {label!r} in generated code")
    triton_f = print_code(act.f_expr, TRITON)
    torch_f = Code((), act.torch_code, ()) if act.torch_code else print_code(act.f_expr, TORCH)
    context = {
        "version": __version__,
        "kind": spec.kind,
        "bits": spec.bits,
        "label": label,
        "op_name": op_name(spec, label, triton_f, torch_f),
        "spec_json": _string_lines(spec_mod.behaviour_json(spec)),
        "borders": [literal(v) for v in spec.borders],
        "borders_f32": [literal(_ceil_float32(v)) for v in spec.borders],
        "levels": [literal(v) for v in spec.levels],
        "tuple": _tuple_lines,
        "pack_terms": _pack_terms(spec.bits),
        "words_from_chunks": _regroup(8 * spec.bits, 32, 4, spec.bits, "c"),
        "chunks_from_words": _regroup(32, 8 * spec.bits, spec.bits, 4, "w"),
        "unpack_terms": _unpack_terms(spec.bits),
        "triton_f": triton_f,
        "torch_f": torch_f,
        "torch_native": bool(act.torch_code),
        # ReLU's exact 1-bit table: its code is the mask, so y is made again from x and the code
        "masks": act.name == "relu" and spec.bits == 1 and list(spec.borders) == [0.0]
        and list(spec.levels) == [0.0, 1.0],
    }
    return _parsed(_environment().get_template("fewbit_ops.py.jinja").render(context))


def render_norms() -> str:
    """The MS-norm module's source: kernels and ops of MS-LayerNorm and MS-RMSNorm."""
    return _parsed(_environment().get_template("ms_norm_ops.py.jinja").render(
        version=__version__))


def render_actnn() -> str:
    """The ActNN module's source: group quantization kernels and their torch path."""
    return _parsed(_environment().get_template("actnn_ops.py.jinja").render(version=__version__))


def render_glu() -> str:
    """The MS-GLU module's source: the gated MLP's elementwise kernels and ops."""
    return _parsed(_environment().get_template("glu_ops.py.jinja").render(version=__version__))


def render_rope() -> str:
    """The rotary embedding module's source: forward and backward kernels."""
    return _parsed(_environment().get_template("rope_ops.py.jinja").render(version=__version__))


def render_lm_loss() -> str:
    """The fused linear loss's module source: its cross-entropy kernels and torch path."""
    return _parsed(_environment().get_template("lm_loss_ops.py.jinja").render(
        version=__version__))


def _parsed(source_text: str) -> str:
    try:
        ast.parse(source_text)
    except SyntaxError as exc:  # a template bug, never user input: say where
        raise ActdesignError(
            f"generated code does not parse (line {exc.lineno}): {exc.msg}") from None
    return source_text


def write(source, path) -> str:
    """Render a spec and write the module to `path` atomically, under a header line that
    tells an unedited module from a hand-edited one; returns the source (without it)."""
    text = render(source)
    write_atomic(path, module_header(text) + text)
    return text


def op_name(spec, label: str, triton_f: Code, torch_f: Code) -> str:
    """A torch.library name unique to everything that shapes the generated code."""
    payload = json.dumps([__version__, spec.kind, spec.bits, label, spec.borders, spec.levels,
                          triton_f.lines, triton_f.result, torch_f.lines, torch_f.result])
    digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
    tag = label if label.isidentifier() else "expr"
    return f"fewbit_{tag}_{spec.bits}b_{digest}"


def _string_lines(text: str, width: int = 88) -> str:
    """`text` as adjacent string literals, broken after ", "; repr() escapes every character."""
    chunks, line = [], ""
    for piece in re.split(r"(?<=, )", text):
        if line and len(line) + len(piece) > width:
            chunks.append(line)
            line = ""
        line += piece
    chunks.append(line)
    return "\n".join(f"    {chunk!r}" for chunk in chunks)


def _tuple_lines(literals: list[str], width: int = 92) -> str:
    """Float literals as the body of a tuple, wrapped to lines of at most `width`."""
    lines, line = [], ""
    for item in literals:
        if line and len(line) + len(item) + 2 > width:
            lines.append(line)
            line = ""
        line += item + ", "
    lines.append(line)
    return "\n".join("    " + ln.rstrip() for ln in lines)


def _pack_terms(bits: int) -> list[list[str]]:
    """For each of the `bits` bytes of a group, the codes' bits it holds, as expressions of
    `u`: the group's 8 codes, one byte each (code j in bits [8j, 8j+8) of u)."""
    return [[_shifted(f"((u >> _U({8 * j})) & _MASK)" if j else "(u & _MASK)", j * bits - 8 * k)
             for j in range(8) if -bits < j * bits - 8 * k < 8] for k in range(bits)]


def _unpack_terms(bits: int) -> list[list[str]]:
    """For each code j of a group, the bytes holding its bits, as expressions of p0, p1, ...:
    the group's `bits` bytes."""
    return [[_shifted(f"p{k}", 8 * k - j * bits) for k in range(bits)
             if -8 < 8 * k - j * bits < bits] for j in range(8)]


def _regroup(src: int, dst: int, n_src: int, n_dst: int, name: str) -> list[list[str]]:
    """One bitstream cut two ways: piece j of `src` bits (named name0, name1, ...) sits at bit
    j*src. For each piece k of `dst` bits, the shifted source pieces that overlap it (Triton
    expressions of unsigned integer tensors; the caller masks the result to `dst` bits)."""
    return [[_shifted(f"{name}{j}", j * src - k * dst, wrap=False) for j in range(n_src)
             if -src < j * src - k * dst < dst] for k in range(n_dst)]


def _shifted(value: str, shift: int, wrap: bool = True) -> str:
    if shift and not wrap:
        return f"({value} << {shift})" if shift > 0 else f"({value} >> {-shift})"
    if shift == 0:
        return value
    return f"({value} << _U({shift}))" if shift > 0 else f"({value} >> _U({-shift}))"


def _ceil_float32(v: float) -> float:
    """The smallest float32 >= v (v within the float32 range)."""
    f = np.float32(v)
    if float(f) < v:
        f = np.nextafter(f, np.float32(np.inf))
    return float(f)


def _environment() -> jinja2.Environment:
    root = resources.files("actdesign.templates")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(root)),
                              undefined=jinja2.StrictUndefined, autoescape=False,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
