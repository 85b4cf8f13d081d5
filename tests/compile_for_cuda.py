"""Compile every kernel of generated modules for CUDA targets, without a GPU.

Run as a script (the test suite runs it in a fresh process, with the interpreter off):
    python tests/compile_for_cuda.py [--norms] SPEC.json [SPEC.json ...]
--norms also compiles the MS-norm, the ActNN quantization, the MS-GLU, the rotary and the
fused loss's kernels.
Prints one line per compiled kernel; exits non-zero on the first failure.
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from actdesign import runtime
from actdesign.runtime.ops.glu import glu_ops
from actdesign.runtime.ops.lm_loss import loss_ops
from actdesign.runtime.ops.rope import rope_ops

TARGETS = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]
# n and nbytes arrive as i32 below 2^31 elements and as i64 above; both must index in int64.
VARIANTS = [("fp32", "i32"), ("fp16", "i32"), ("bf16", "i32"), ("fp32", "i64")]


def kernels(ops, dtype, index, aligned=False):
    """(name, ASTSource) for the forward and backward kernels with `index` ints (i32 or i64);
    `aligned`: pointers and sizes divisible by 16, as Triton specializes large tensors."""
    yield "forward", source(ops._forward_kernel, {
        "x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "packed_ptr": "*u8", "borders_ptr": "*fp32",
        "n": index, "nbytes": index}, aligned=aligned)
    yield "backward", source(ops._backward_kernel, {
        "packed_ptr": "*u8", "g_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}", "levels_ptr": "*fp32",
        "n": index, "nbytes": index}, aligned=aligned)


def source(fn, signature, constexprs=None, aligned=False):
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
             if aligned and kind != "constexpr"}
    return ASTSource(fn, signature, constexprs, attrs)


def norm_kernels(ops, dtype):
    for rms in (False, True):
        yield f"norm rms={rms} forward", ASTSource(ops._forward_kernel, {
            "x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "d": "i32",
            "eps": "fp32", "RMS": "constexpr", "BLOCK": "constexpr"},
            constexprs={"RMS": rms, "BLOCK": 1024})
        yield f"norm rms={rms} forward to y", ASTSource(ops._forward_output_kernel, {
            "x_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": f"*{dtype}",
            "rstd_ptr": "*fp32", "slot_ptr": "*i32", "apart_ptr": f"*{dtype}", "d": "i32",
            "n_apart": "i32", "eps": "fp32", "RMS": "constexpr", "HAS_W": "constexpr",
            "HAS_B": "constexpr", "ROUND_INPUT": "constexpr", "HAS_APART": "constexpr",
            "BLOCK": "constexpr"},
            constexprs={"RMS": rms, "HAS_W": True, "HAS_B": not rms, "ROUND_INPUT": False,
                        "HAS_APART": True, "BLOCK": 1024})
        for affine, from_output in ((False, False), (True, False), (True, True)):
            yield f"norm rms={rms} affine={affine} from_y={from_output} backward", ASTSource(
                ops._backward_kernel, {
                    "y_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "g_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "slot_ptr": "*i32",
                    "apart_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}", "dw_ptr": "*fp32",
                    "db_ptr": "*fp32", "rows": "i32", "d": "i32", "n_apart": "i32",
                    "rows_per_program": "i32", "RMS": "constexpr", "HAS_W": "constexpr",
                    "AFFINE_GRADS": "constexpr", "FROM_OUTPUT": "constexpr",
                    "HAS_B": "constexpr", "HAS_APART": "constexpr", "BLOCK": "constexpr"},
                constexprs={"RMS": rms, "HAS_W": affine, "AFFINE_GRADS": affine,
                            "FROM_OUTPUT": from_output, "HAS_B": from_output and not rms,
                            "HAS_APART": from_output, "BLOCK": 1024})
    yield "norm affine", ASTSource(ops._affine_kernel, {
        "xhat_ptr": f"*{dtype}", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": f"*{dtype}",
        "d": "i32", "HAS_W": "constexpr", "HAS_B": "constexpr", "BLOCK": "constexpr"},
        constexprs={"HAS_W": True, "HAS_B": True, "BLOCK": 1024})


def actnn_kernels(ops, dtype):
    yield "actnn quantize", ASTSource(ops._quantize_kernel, {
        "x_ptr": f"*{dtype}", "bits_ptr": "*i8", "offsets_ptr": "*i64", "packed_ptr": "*u8",
        "lo_ptr": "*fp32", "range_ptr": "*fp32", "m": "i32", "groups": "i32", "blocks": "i32",
        "seed_mix": "i64", "G": "constexpr", "GPP": "constexpr"}, constexprs={"G": 256, "GPP": 8})
    yield "actnn dequantize", ASTSource(ops._dequantize_kernel, {
        "packed_ptr": "*u8", "bits_ptr": "*i8", "offsets_ptr": "*i64", "lo_ptr": "*fp32",
        "range_ptr": "*fp32", "out_ptr": f"*{dtype}", "m": "i32", "groups": "i32",
        "blocks": "i32", "G": "constexpr", "GPP": "constexpr"}, constexprs={"G": 256, "GPP": 8})


def glu_kernels(ops, dtype):
    for kind, act in enumerate(ops.KINDS):
        yield f"glu {act} forward", ASTSource(ops._forward_kernel, {
            "g_ptr": f"*{dtype}", "u_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "n": "i32",
            "KIND": "constexpr", "BLOCK": "constexpr"},
            constexprs={"KIND": kind, "BLOCK": ops.BLOCK})
        yield f"glu {act} backward", ASTSource(ops._backward_kernel, {
            "g_ptr": f"*{dtype}", "u_ptr": f"*{dtype}", "dh_ptr": f"*{dtype}",
            "dg_ptr": f"*{dtype}", "du_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "n": "i32",
            "KIND": "constexpr", "BLOCK": "constexpr"},
            constexprs={"KIND": kind, "BLOCK": ops.BLOCK})
    if dtype in ("fp16", "bf16"):  # gelu_new's kernels take 16-bit floats only
        yield "gelu_new forward", ASTSource(ops._gelu_new_forward_kernel, {
            "x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "n": "i32", "BLOCK": "constexpr"},
            constexprs={"BLOCK": ops.BLOCK})
        yield "gelu_new backward", ASTSource(ops._gelu_new_backward_kernel, {
            "x_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}", "n": "i32",
            "BLOCK": "constexpr"}, constexprs={"BLOCK": ops.BLOCK})


def rope_kernels(ops, dtype):
    """Forward and backward, with float32 cos and sin (autocast over float32 weights) and,
    for a 16-bit dtype, with cos and sin in it (each step rounded to it)."""
    for steps in (False, True) if dtype != "fp32" else (False,):
        angles = dtype if steps else "fp32"
        for backward in (False, True):
            yield f"rope backward={backward} steps={steps}", ASTSource(ops._rotary_kernel, {
                "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "cos_ptr": f"*{angles}",
                "sin_ptr": f"*{angles}", "oq_ptr": f"*{dtype}", "ok_ptr": f"*{dtype}",
                **{k: "i32" for k in ("HQ", "HK", "T", "HALF", "sqb", "sqh", "sqt", "skb",
                                      "skh", "skt", "scb", "sct", "soqb", "soqh", "soqt",
                                      "sokb", "sokh", "sokt")},
                "BACKWARD": "constexpr", "ROUND_STEPS": "constexpr", "HEADS_Q": "constexpr",
                "HEADS_K": "constexpr", "COLS": "constexpr"},
                constexprs={"BACKWARD": backward, "ROUND_STEPS": steps, "HEADS_Q": 16,
                            "HEADS_K": 2, "COLS": 32})


def loss_kernels(ops, dtype, aligned=False):
    """The cross-entropy kernels; `aligned`: the logits and the vocabulary size divisible by
    16, as Triton specializes them for most vocabularies (32000, 151936; not GPT-2's 50257)."""
    for name, fn, last in (("forward", ops._lse_nll_kernel, "nll_ptr"),
                           ("backward", ops._logits_grad_kernel, "grad_ptr")):
        yield f"loss {name}", source(fn, {
            "z_ptr": f"*{dtype}", "targets_ptr": "*i64", "r_ptr": "*fp32", last: "*fp32",
            "V": "i32", "stride": "i32", "ignore_index": "i32", "BLOCK": "constexpr"},
            constexprs={"BLOCK": ops.BLOCK}, aligned=aligned)


def check_loss_vectors(ops):
    """On aligned logits each thread moves its 16 logits per step in 16-byte vectors: the
    forward loads them, the backward loads them twice (the row's maximum, then the gradient)
    and stores their gradient."""
    for name, src in loss_kernels(ops, "bf16", aligned=True):
        ptx = triton.compile(src, target=TARGETS[-1], options={"num_warps": 8}).asm["ptx"]
        passes = 2 if name.endswith("backward") else 1
        assert len(re.findall(r"\bld\.global(\.\w+)*\.v4\.b32", ptx)) == 2 * passes, name
        stores = len(re.findall(r"\bst\.global(\.\w+)*\.v4\.b32", ptx))
        assert stores == (2 if name.endswith("backward") else 0), name
        print(f"{name} bf16 aligned sm_90: vectors: ok", flush=True)


def assert_no_contraction(ptx, name):
    """No product fused into a sum: no float32 FMA; a 16-bit one only as sm_80 computes one
    16-bit op exactly rounded: a product, a·b + (-0), or a sum, a·(±1) + c (eager's 16-bit
    ops round a float32 result once more, which for +, - and × is the same: float32 carries
    more than twice a 16-bit significand and two bits)."""
    assert "fma.rn.f32" not in ptx, name
    constants = dict(re.findall(r"mov\.b16\s+(%rs\d+), (0x[0-9A-F]{4});", ptx))
    unit = {"0x3F80", "0xBF80", "0x3C00", "0xBC00"}  # ±1 in bf16 and in fp16
    fmas = re.findall(r"fma\.rn\.(?:bf16|f16)\s+%rs\d+, (%rs\d+), (%rs\d+), (%rs\d+);", ptx)
    for a, b, c in fmas:
        assert constants.get(c) == "0x8000" or {constants.get(a), constants.get(b)} & unit, (
            name, a, b, c)
    # libdevice's tanh (gelu_new) computes with its own fused multiply-adds, flushing
    # subnormals: `fma.rn.ftz.f32`, an instruction our own ops never compile to
    assert len(re.findall(r"\bfma\.(?!rn\.ftz\.f32)", ptx)) == len(fmas), name


def compile_norms():
    norms, actnn, glu, rope = runtime.norm_ops(), runtime.actnn_ops(), glu_ops(), rope_ops()
    loss = loss_ops()
    check_loss_vectors(loss)
    for target in TARGETS:
        for dtype, _ in VARIANTS[:3]:
            kernels = [*norm_kernels(norms, dtype), *actnn_kernels(actnn, dtype),
                       *glu_kernels(glu, dtype), *rope_kernels(rope, dtype),
                       *loss_kernels(loss, dtype)]
            for name, source in kernels:
                # The rotation's and gelu_new's ops round as eager's do: no FMA.
                exact = name.startswith(("rope", "gelu_new"))
                options = {"enable_fp_fusion": False} if exact else {}
                compiled = triton.compile(source, target=target, options=options)
                assert compiled.asm["cubin"], "no binary"
                if exact:
                    assert_no_contraction(compiled.asm["ptx"], name)
                # Scalar offsets (a row's or a sample's start) are int64, unless a constant;
                # tensor offsets may be int32 only for columns within a row (< BLOCK).
                for offset, kind in re.findall(r"tt\.addptr %\w+, (%\w+) : [^,]+, (\S+)",
                                               compiled.asm["ttir"]):
                    column = kind.startswith("tensor") and name.startswith(
                        ("norm", "rope", "loss"))
                    assert "i64" in kind or column or re.fullmatch(r"%c\d+_i32", offset), (
                        name, offset, kind)
                print(f"{name} {dtype} sm_{target.arch}: ok", flush=True)


def main(paths):
    if paths and paths[0] == "--norms":
        compile_norms()
        paths = paths[1:]
    for path in paths:
        ops = runtime.load(path)
        assert isinstance(ops._forward_kernel, triton.runtime.JITFunction), "not compiled mode"
        for target in TARGETS:
            for dtype, index in VARIANTS:
                for name, source in kernels(ops, dtype, index):
                    compiled = triton.compile(source, target=target)
                    assert compiled.asm["cubin"], "no binary"
                    ptr_math = re.findall(r"tt\.addptr .*", compiled.asm["ttir"])
                    assert ptr_math and all("i64" in line for line in ptr_math), name
                    print(f"{path} bits={ops.BITS} {name} {dtype} n:{index} "
                          f"sm_{target.arch}: ok", flush=True)
        check_memory_instructions(path, ops)


def check_memory_instructions(path, ops):
    """On sizes and pointers Triton specializes as 16-aligned (every large tensor), the data
    moves in 16-byte vectors and the codes in whole 32-bit words: `bits` word accesses per 32
    elements; byte accesses appear only in the tail's branch, 4 per word."""
    for name, src in kernels(ops, "bf16", "i32", aligned=True):
        ptx = triton.compile(src, target=TARGETS[-1]).asm["ptx"]
        data = "ld" if name == "forward" else "st"
        code = "st" if name == "forward" else "ld"
        assert re.search(rf"\b{data}\.global\.v4\.b32", ptx), (name, "data not vectorized")
        tail = re.findall(rf"\b{code}\.global\.b8\b", ptx)
        words = re.findall(rf"\b{code}\.global\.b32\b", ptx)
        # The backward's level look-ups (from 2 bits on) are word loads too: 32 per branch.
        gathers = 64 if name == "backward" and ops.BITS >= 2 else 0
        assert len(words) == ops.BITS + gathers, (name, len(words))
        assert len(tail) == 4 * ops.BITS, (name, len(tail))
        print(f"{path} bits={ops.BITS} {name} bf16 aligned sm_90: vectors and words: ok",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
