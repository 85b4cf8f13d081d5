"""Benchmark of the generated kernels against torch's own ops, in the same run.

1. Few-bit ops against torch's activation. For each activation, size and dtype: forward and
   backward time (median), their ratio to torch, and the bytes saved for backward per element
   (torch keeps the input; we keep b bits). CPU runs the numba kernels; CUDA the Triton
   kernels, with the achieved bandwidth as a share of a device-to-device copy's (measured in
   the same run, read + write), and a bit-for-bit check of codes and gradients against the
   CPU reference. Bytes moved: forward reads x, writes y and the codes; backward reads the
   codes and g, writes dx.
2. Host cost: forward + backward of every op on small tensors, calls back to back, against
   the torch computation it replaces: the host's cost per call.
3. MS norms with γ (and β) against F.layer_norm / F.rms_norm with theirs, forward and
   backward (dx, dγ, dβ), for d = 768 to 8192; 2^27 elements on CUDA (--quick: 2^24), 2^20
   on CPU; and the rebuild of y = x̂·γ + β that each reader runs in its backward.
4. The LLM ops in bf16 against the eager code they replace: MS-GLU's elementwise forward and
   backward against silu(g) * u with autograd; the rotary kernels against eager's rotation
   under autocast (CUDA only: elsewhere eager's ops run); the fused linear cross-entropy
   (forward + backward, with its peak above the inputs) against logits + F.cross_entropy, its
   own torch path and, when installed on CUDA, Liger-Kernel's; ActNN's 2-bit quantize and
   dequantize against a copy of the input.

Goals on CUDA (bf16 and fp32, 2^24 to 2^27 elements): few-bit forward <= 1.10x torch,
backward <= 0.85x; MS norms <= 1.0x torch; every kernel, forward and backward, at >= 70% of
the copy bandwidth from 2^24 elements in bf16; small-tensor forward + backward <= 1.5x
torch's per call.

Run: .venv/bin/python benchmarks/runtime.py [--quick] [--markdown] [--device cpu|cuda|all]
         [--acts gelu,silu,tanh] [--bits 1,2,3,4,8]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from measure import emulate_bf16_matmuls, float32_matmuls, median_time, saved_storages, table

from actdesign import runtime, spec
from actdesign.designer import fit_stepwise
from actdesign.runtime.ops.glu import glu_ops
from actdesign.runtime.ops.lm_loss import fused_linear_cross_entropy
from actdesign.runtime.ops.rope import reference as eager_rotation
from actdesign.runtime.ops.rope import rotary

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
BITS = (1, 2, 3, 4, 8)


def saved_bytes(fn, x) -> int:
    """Bytes of distinct storages autograd saves for fn(x)'s backward."""
    return sum(saved_storages(fn, x)[0].values())


def timer(device):
    if device == "cuda":
        def measure(fn, repeats):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def measure(fn, repeats):
            return median_time(fn, repeats, warmup=True)[0]
    return measure


def bench(fn, ops, n, dtype, device, repeats):
    measure = timer(device)
    x = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(n, device=device, dtype=dtype)
    row = {}
    for who, f in (("torch", fn), ("ours", ops.apply)):
        y = f(x)
        fwd = measure(lambda f=f: f(x), repeats)
        bwd = measure(lambda y=y: torch.autograd.grad(y, x, g, retain_graph=True), repeats)
        row[who] = (fwd, bwd, saved_bytes(f, x) / n)
    return row


def exact_on_device(ops, n, dtype, device) -> bool:
    """The device kernels give the CPU reference's codes and gradients, bit for bit."""
    x = torch.randn(n, device=device, dtype=dtype) * 2
    g = torch.randn(n, device=device, dtype=dtype)
    y, packed = ops._forward_op(x)
    _, packed_ref = ops._forward_torch(x.cpu())
    dx_ref = ops._backward_torch(packed_ref, g.cpu())
    return torch.equal(packed.cpu(), packed_ref) and torch.equal(
        ops._backward_op(packed, g).cpu(), dx_ref)


def bandwidth_gbs(n, itemsize, bits, fwd, bwd):
    """Achieved GB/s: forward reads x, writes y and codes; backward reads codes and g, writes dx."""
    moved_fwd = n * (2 * itemsize + bits / 8)
    moved_bwd = n * (2 * itemsize + bits / 8)
    return moved_fwd / fwd / 1e9, moved_bwd / bwd / 1e9


def peak_bandwidth_gbs():
    props = torch.cuda.get_device_properties(0)
    clock = getattr(props, "memory_clock_rate", 0)  # kHz
    width = getattr(props, "memory_bus_width", 0)  # bits
    return 2 * clock * 1e3 * width / 8 / 1e9 if clock and width else None


def copy_gbs(device, repeats, n=2**27):
    """What a device-to-device copy moves (read + write), GB/s: the practical ceiling."""
    src = torch.empty(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timer(device)(lambda: dst.copy_(src), repeats) / 1e9


def run(device, sizes, dtypes, bits_list, acts, repeats, markdown):
    print(f"\n## {device.upper()}\n")
    copy = None
    if device == "cuda":
        peak, copy = peak_bandwidth_gbs(), copy_gbs(device, repeats)
        print(f"Device: {torch.cuda.get_device_name(0)}; peak memory bandwidth "
              f"{peak:.0f} GB/s; " if peak else f"Device: {torch.cuda.get_device_name(0)}; ",
              end="")
        print(f"device-to-device copy {copy:.0f} GB/s (read + write)\n")
    header = ["act", "bits", "dtype", "n", "torch fwd ms", "ours fwd ms", "fwd ratio",
              "torch bwd ms", "ours bwd ms", "bwd ratio", "fwd+bwd ratio", "saved B/elem torch",
              "saved B/elem ours"]
    if device == "cuda":
        header += ["fwd GB/s", "bwd GB/s", "fwd % copy", "bwd % copy", "exact"]
    line = table(header, markdown, width=13)
    totals = []
    for name in acts:
        fn = ACTIVATIONS[name]
        for bits in bits_list:
            ops = runtime.load(spec.from_fit(fit_stepwise(name, bits)))
            for dtype in dtypes:
                for n in sizes:
                    r = bench(fn, ops, n, dtype, device, repeats)
                    (tf, tb, ts), (of, ob, os_) = r["torch"], r["ours"]
                    totals.append((of + ob) / (tf + tb))
                    cells = [name, str(bits), str(dtype).replace("torch.", ""),
                             f"2^{n.bit_length() - 1}",
                             f"{tf * 1e3:.3f}", f"{of * 1e3:.3f}", f"{of / tf:.2f}",
                             f"{tb * 1e3:.3f}", f"{ob * 1e3:.3f}", f"{ob / tb:.2f}",
                             f"{(of + ob) / (tf + tb):.2f}", f"{ts:.3f}", f"{os_:.3f}"]
                    if device == "cuda":
                        gf, gb = bandwidth_gbs(n, torch.finfo(dtype).bits // 8, bits, of, ob)
                        exact = exact_on_device(ops, n, dtype, device)
                        cells += [f"{gf:.0f}", f"{gb:.0f}", f"{100 * gf / copy:.0f}%",
                                  f"{100 * gb / copy:.0f}%", "yes" if exact else "NO"]
                    line(cells)
    print(f"\nmedian fwd+bwd ratio over {len(totals)} rows: {statistics.median(totals):.2f} "
          f"(max {max(totals):.2f})")
    small_tensors(device, markdown)
    norms(device, dtypes[:2], max(sizes) if device == "cuda" else 2**20, repeats, markdown, copy)
    llm_ops(device, max(sizes) if device == "cuda" else 2**20, repeats, markdown, copy)


def per_call_us(device, fn, calls):
    """Wall time per call of `calls` back-to-back calls: the host's cost where kernels are short."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def small_tensors(device, markdown):
    """Host cost: forward + backward of each op on small tensors (2^10 elements, or a few rows),
    calls back to back, against the torch computation it replaces, under bf16 autocast
    where the op runs there. Where kernels are this short the GPU waits for the host, so
    this is the host's cost per call (goal on CUDA: <= 1.5x torch's)."""
    print("\nHost cost per call: forward + backward on small tensors, calls back to back "
          "(goal on CUDA: ours <= 1.5x torch)\n")
    line = table(["op", "torch us", "ours us", "ratio"], markdown, width=12, first=30)
    for name, eager, ours in host_cost_pairs(device):
        t, o = (statistics.median(per_call_us(device, f, 200) for _ in range(5))
                for f in (eager, ours))
        line([name, f"{t:.0f}", f"{o:.0f}", f"{o / t:.2f}"])


def host_cost_pairs(device):
    """(name, torch's step, ours) for every op, each a function of no arguments running one
    forward and backward on small tensors."""
    import copy

    from torch import nn

    from actdesign.runtime.ops.compressed import LeanLinear
    from actdesign.runtime.ops.glu import MSGLU
    from actdesign.runtime.ops.quantized import QLinear

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, grad=True):
        t = torch.randn(*shape, device=device, generator=gen)
        return t.requires_grad_(grad)

    def step(f, *inputs, autocast=False):
        def run():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = f(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o.float().sum() for o in out])
        return run

    fewbit = runtime.load(spec.from_fit(fit_stepwise("gelu", 3)))
    norms = runtime.norm_ops()
    x, w = rand(8, 128), rand(128).detach().add(1).requires_grad_()
    yield ("few-bit GELU (2^10)", step(F.gelu, rand(1024)), step(fewbit.apply, rand(1024)))
    yield ("MS RMSNorm (8 x 128)", step(lambda t: F.rms_norm(t, (128,), w, 1e-6), x),
           step(lambda t: norms.apply("rms", t, 1e-6, weight=w), x))
    mlp = _GatedMLP(128, 256).to(device)
    yield ("MS-GLU MLP (8 x 128, 256)", step(mlp, x, autocast=True),
           step(MSGLU.from_module(copy.deepcopy(mlp)), x, autocast=True))
    q, k = rand(1, 2, 8, 64), rand(1, 2, 8, 64)
    cos, sin = rand(1, 8, 64, grad=False), rand(1, 8, 64, grad=False)
    yield ("rotation q, k (2 x 8 x 64)",
           step(lambda a, b: eager_rotation(a, b, cos, sin), q, k, autocast=True),
           step(lambda a, b: rotary(a, b, cos, sin), q, k, autocast=True))
    linear = nn.Linear(128, 128).to(device)
    yield ("lean Linear (8 x 128)", step(linear, x, autocast=True),
           step(LeanLinear.from_module(copy.deepcopy(linear)), x, autocast=True))
    yield ("ActNN 2-bit Linear (8 x 128)", step(linear, x, autocast=True),
           step(QLinear.from_module(copy.deepcopy(linear), bits=2), x, autocast=True))
    hidden, head = rand(8, 128), rand(1000, 128)
    targets = torch.randint(0, 1000, (8,), device=device, generator=gen)
    yield ("loss (8 tokens, 1000 vocab)",
           step(lambda h, v: F.cross_entropy(h @ v.T, targets), hidden, head, autocast=True),
           step(lambda h, v: fused_linear_cross_entropy(h, v, shift_labels=targets), hidden,
                head, autocast=True))


class _GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)), as LLaMA's MLP computes it."""

    def __init__(self, d, inner):
        super().__init__()
        self.gate_proj, self.up_proj = (torch.nn.Linear(d, inner, bias=False) for _ in "gu")
        self.down_proj = torch.nn.Linear(inner, d, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def fwd_bwd(measure, repeats, f, x, g):
    """Median forward and backward times of y = f(x), or of y = f(*x) and the gradients of
    every tensor of x that needs one."""
    inputs = x if isinstance(x, tuple) else (x,)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    y = f(*inputs)
    return (measure(lambda: f(*inputs), repeats),
            measure(lambda: torch.autograd.grad(y, wanted, g, retain_graph=True), repeats))


def norms(device, dtypes, total, repeats, markdown, copy):
    """MS norms against torch's, with γ (and β): y = norm(x); dx, dγ and dβ from g, on
    tensors of `total` elements; and the readers' rebuild of y from x̂."""
    print("\nMS norms against F.layer_norm / F.rms_norm (with γ and β), forward and backward "
          "(dx, dγ, dβ), and a reader's rebuild of y\n")
    ops = runtime.norm_ops()
    torch_norms = {"layer": lambda x, w, b, d: F.layer_norm(x, (d,), w, b, eps=1e-5),
                   "rms": lambda x, w, b, d: F.rms_norm(x, (d,), w, eps=1e-5)}
    measure = timer(device)
    header = ["norm", "dtype", "rows x d", "torch fwd ms", "ours fwd ms", "fwd ratio",
              "torch bwd ms", "ours bwd ms", "bwd ratio", "rebuild ms"]
    if copy:
        header += ["fwd % copy", "bwd % copy", "rebuild % copy"]
    line = table(header, markdown, width=13)
    for kind, reference in torch_norms.items():
        for dtype in dtypes:
            for d in (768, 1024, 2048, 4096, 8192):
                x = torch.randn(total // d, d, device=device, dtype=dtype, requires_grad=True)
                w = torch.rand(d, device=device, dtype=dtype).add(0.5).requires_grad_(True)
                b = torch.randn(d, device=device, dtype=dtype).requires_grad_(kind == "layer")
                bias = b if kind == "layer" else None
                g = torch.randn_like(x)
                cells = [kind, str(dtype).replace("torch.", ""), f"{total // d} x {d}"]
                (tf, tb), (of, ob) = (
                    fwd_bwd(measure, repeats, f, (x, w, bias), g) for f in (
                        functools.partial(reference, d=d),
                        functools.partial(ms_norm, ops, kind)))
                xhat = ops.OPS[kind][0](x.detach(), 1e-5, dtype)[0]
                rebuild = measure(functools.partial(ops.affine, xhat, w, bias), repeats)
                cells += [f"{tf * 1e3:.3f}", f"{of * 1e3:.3f}", f"{of / tf:.2f}",
                          f"{tb * 1e3:.3f}", f"{ob * 1e3:.3f}", f"{ob / tb:.2f}",
                          f"{rebuild * 1e3:.3f}"]
                if copy:  # forward reads x, writes x̂, reads it and writes y; backward reads
                    moved = x.nbytes  # x̂ and g, writes dx; the rebuild reads x̂, writes y
                    cells += [f"{100 * 4 * moved / of / 1e9 / copy:.0f}%",
                              f"{100 * 3 * moved / ob / 1e9 / copy:.0f}%",
                              f"{100 * 2 * moved / rebuild / 1e9 / copy:.0f}%"]
                line(cells)


def ms_norm(ops, kind, x, w, b):
    return ops.apply(kind, x, 1e-5, weight=w, bias=b)


def llm_ops(device, n, repeats, markdown, copy):
    """MS-GLU, the rotation and the fused loss in bf16 against the eager code they replace."""
    print("\nLLM ops, bf16: ours against the eager computation it replaces\n")
    measure = timer(device)
    header = ["op", "shape", "eager fwd ms", "ours fwd ms", "fwd ratio", "eager bwd ms",
              "ours bwd ms", "bwd ratio"] + (["fwd % copy", "bwd % copy"] if copy else [])
    line = table(header, markdown, width=13, first=16)

    def row(name, shape, eager, ours, moved_fwd, moved_bwd):
        (ef, eb), (of, ob) = eager, ours
        cells = [name, shape, f"{ef * 1e3:.3f}", f"{of * 1e3:.3f}", f"{of / ef:.2f}",
                 f"{eb * 1e3:.3f}", f"{ob * 1e3:.3f}", f"{ob / eb:.2f}"]
        if copy:
            cells += [f"{100 * moved_fwd / of / 1e9 / copy:.0f}%",
                      f"{100 * moved_bwd / ob / 1e9 / copy:.0f}%"]
        line(cells)

    glu_row(device, n, measure, repeats, row)
    if device == "cuda":  # elsewhere the rotation is eager's own ops
        rope_row(device, measure, repeats, row)
    actnn_row(device, n, measure, repeats, row)
    loss_rows(device, measure, repeats, markdown)


def glu_row(device, n, measure, repeats, row):
    """MS-GLU's elementwise half (SiLU) against eager's silu(g) * u and its autograd."""
    glu = glu_ops()
    g, u, dh = (torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (g, u)]
    h = F.silu(leaves[0]) * leaves[1]
    eager = (measure(lambda: F.silu(g) * u, repeats),
             measure(lambda: torch.autograd.grad(h, leaves, dh, retain_graph=True), repeats))
    ours = (measure(lambda: glu.forward(g, u, "silu"), repeats),
            measure(lambda: glu.backward(g, u, dh, "silu"), repeats))
    # forward reads g, u and writes h; backward reads g, u, dh and writes dg, du and h
    row("MS-GLU silu", f"2^{n.bit_length() - 1}", eager, ours, 3 * g.nbytes, 6 * g.nbytes)


def actnn_row(device, n, measure, repeats, row, m=4096):
    """ActNN's 2-bit codes of a bf16 (n/m, m) input: quantize against a copy of the input
    (what eager keeps it as), dequantize against reading a copy back."""
    ops = runtime.actnn_ops()
    x = torch.randn(n // m, m, device=device, dtype=torch.bfloat16)
    bits = torch.full((n // m,), 2, dtype=torch.int8)
    packed, lo, width = ops.quantize(x, bits, 0, 256)
    copied = (measure(lambda: x.clone(), repeats),) * 2
    ours = (measure(lambda: ops.quantize(x, bits, 0, 256), repeats),
            measure(lambda: ops.dequantize(packed, lo, width, bits, m, 256, x.dtype), repeats))
    # quantize reads x and writes the codes, lo and range; dequantize reads them, writes x
    moved = x.nbytes + packed.nbytes + lo.nbytes + width.nbytes
    row("ActNN 2-bit", f"{n // m}x{m}", copied, ours, moved, moved)


def rope_row(device, measure, repeats, row, batch=16, seq=1024, heads=12, dim=64):
    """q and k as attention makes them, float32 cos/sin; eager casts the rotation to bf16."""
    q, k = (torch.randn(batch, seq, heads, dim, device=device).transpose(1, 2).bfloat16()
            .requires_grad_() for _ in range(2))
    cos, sin = (torch.randn(batch, seq, dim, device=device) for _ in range(2))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    times = []
    for fn in (lambda: [t.bfloat16() for t in eager_rotation(q, k, cos, sin)],
               lambda: rotary(q, k, cos, sin)):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn()
            fwd = measure(fn, repeats)
        bwd = measure(lambda out=out: torch.autograd.grad(out, (q, k), (gq, gk),
                                                          retain_graph=True), repeats)
        times.append((fwd, bwd))
    moved = 2 * 2 * q.nbytes  # q and k read and written once, bf16; cos and sin are small
    row("RoPE q, k", f"{batch}x{heads}x{seq}x{dim}", *times, moved, moved)


def loss_rows(device, measure, repeats, markdown):
    """The fused linear cross-entropy, bf16 hidden states and weight, forward + backward."""
    tokens, d, vocab = (16384, 768, 32000) if device == "cuda" else (2048, 256, 8000)
    print(f"\nLinear cross-entropy, {tokens} tokens x d = {d} x vocabulary {vocab}, bf16, "
          "forward + backward\n")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(vocab, d, device=device, generator=gen) / d**0.5).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    setups = {"eager (logits, float32 CE)": lambda h, w: F.cross_entropy((h @ w.T).float(),
                                                                         targets),
              "ours": lambda h, w: fused_linear_cross_entropy(h, w, shift_labels=targets)}
    if device == "cuda":  # elsewhere ours is the torch path
        setups["ours, torch path"] = lambda h, w: _with_backend("torch", h, w, targets)
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            liger = LigerFusedLinearCrossEntropyLoss()
            setups["Liger-Kernel"] = lambda h, w: liger(w, h, targets)
        except ImportError:
            pass
    line = table(["setup", "fwd+bwd ms", "time ratio", "peak MiB", "loss"], markdown,
                 width=12, first=28)
    base = None
    for name, fn in setups.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step(fn=fn, h=h, w=w):
            return torch.autograd.grad(fn(h, w), (h, w))

        try:
            with float32_matmuls(emulate_bf16_matmuls(device, "bf16")):
                seconds = measure(step, repeats)
                peak = peak_mib(device, step)
                loss = fn(h, w).item()
        except Exception as exc:  # an optional extra that fails must not hide the others
            print(f"{name}: failed: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        base = base or seconds
        line([name, f"{seconds * 1e3:.2f}", f"{seconds / base:.2f}", peak, f"{loss:.5f}"])


def _with_backend(backend, h, w, targets):
    previous = os.environ.get("ACTDESIGN_BACKEND")
    os.environ["ACTDESIGN_BACKEND"] = backend
    try:
        return fused_linear_cross_entropy(h, w, shift_labels=targets)
    finally:
        os.environ.pop("ACTDESIGN_BACKEND")
        if previous is not None:
            os.environ["ACTDESIGN_BACKEND"] = previous


def peak_mib(device, fn) -> str:
    """The CUDA allocator's peak during fn, above what was allocated before; "-" on CPU."""
    if device != "cuda":
        return "-"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - before) / 2**20:.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, bits and repeats")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--acts", default=",".join(ACTIVATIONS),
                        help=f"comma-separated, from {', '.join(ACTIVATIONS)}")
    parser.add_argument("--bits", help="comma-separated bit widths (default: 1,2,3,4,8; "
                        "--quick: 3)")
    args = parser.parse_args()
    acts = args.acts.split(",")
    if unknown := set(acts) - set(ACTIVATIONS):
        parser.error(f"unknown activation {sorted(unknown)[0]!r}")
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    bits_list = [int(b) for b in args.bits.split(",")] if args.bits else (
        (3,) if args.quick else BITS)
    if args.device in ("cpu", "all"):
        sizes = [2**16, 2**20] if args.quick else [2**16, 2**18, 2**20, 2**22, 2**24]
        run("cpu", sizes, [torch.float32, torch.bfloat16], bits_list, acts,
            3 if args.quick else 9, args.markdown)
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        sizes = [2**16, 2**24] if args.quick else [2**16, 2**20, 2**24, 2**27]
        run("cuda", sizes, [torch.bfloat16, torch.float32, torch.float16], bits_list, acts,
            20 if args.quick else 50, args.markdown)


if __name__ == "__main__":
    main()
