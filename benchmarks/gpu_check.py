"""One short device check, for a machine with a GPU: correctness of the Triton kernels (few-bit
ops, MS norms, ActNN quantization) against the CPU reference, bit for bit where the layout
promises it (MS norms against float64), a PEFT LoRA model's gradients with dropout against
PEFT's (the replayed mask on the device's generator), and the peak memory and step time of
a transformer block with and without the activation-side methods, in bf16 autocast; then
GPT-2 and LLaMA profiles under two policies, in bf16 autocast and in fp32.

Run: .venv/bin/python benchmarks/gpu_check.py [--device cuda|cpu]
(On CPU it exercises the same script against the numba and torch paths.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from actdesign import runtime, spec
from actdesign.designer import fit_stepwise

sys.path.insert(0, str(Path(__file__).parent))
from measure import at_peak  # noqa: E402
from transformer_block import Block, saved_bytes  # noqa: E402


def check_fewbit(ops, device):
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(2**20 + 3, dtype=torch.float64) * 2).to(dtype)
        g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
        y, packed = ops._forward_op(x.to(device))
        _, packed_ref = ops._forward_torch(x)
        dx = ops._backward_op(packed, g.to(device)).cpu()
        same = torch.equal(packed.cpu(), packed_ref) and torch.equal(
            dx, ops._backward_torch(packed_ref, g))
        err = (y.cpu().double() - ops._activation_torch(x).double()).abs().max().item()
        print(f"few-bit {dtype}: codes and grads exact: {same}; forward max |err| {err:.2e}")
        ok &= same
    return ok


def check_norms(device):
    """Each MS-norm path (the device's kernels, the torch path on CPU) against a float64
    reference: y within one rounding of the output dtype plus float32 slack; dx, which reads
    the stored y, within the bound that y's rounding allows (see tests/test_bf16.py)."""
    ok = True
    norms = runtime.norm_ops()
    for kind in norms.KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(512, 1000) * 3).to(dtype)
            g = torch.randn(512, 1000).to(dtype)
            xd, gd = x.double(), g.double()
            centred = xd if kind == "rms" else xd - xd.mean(-1, keepdim=True)
            rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
            y64 = centred * rstd
            gy = gd * y64
            dx64 = rstd * (gd - y64 * gy.mean(-1, keepdim=True)
                           - (0 if kind == "rms" else gd.mean(-1, keepdim=True)))
            u = torch.finfo(dtype).eps / 2
            slack = 64 * torch.finfo(torch.float32).eps
            y_tol = u * y64.abs() + slack * (1 + y64.abs())
            dx_tol = (1.01 * rstd * u * y64.abs() * (gy.mean(-1, True).abs()
                                                     + gy.abs().mean(-1, True))
                      + slack * rstd * gd.abs().amax(-1, True) * (1 + y64.abs())
                      + u * dx64.abs())
            paths = {device: (x.to(device), g.to(device))}
            if device != "cpu":
                paths["cpu torch path"] = (x, g)
            for where, (xx, gg) in paths.items():
                y, r = norms.OPS[kind][0](xx, 1e-5, dtype)
                dx = norms.OPS[kind][1](y, r, gg)
                y_err = ((y.cpu().double() - y64).abs() / y_tol).max().item()
                dx_err = ((dx.cpu().double() - dx64).abs() / dx_tol).max().item()
                close = y_err <= 1 and dx_err <= 1
                print(f"MS {kind} norm {dtype} ({where}): against float64, worst error / bound: "
                      f"y {y_err:.2f}, dx {dx_err:.2f}: {close}")
                ok &= close
    return ok


def check_rebuild(device):
    """An MS norm module with the device's kernels: where it keeps x̂ (float32), a reader's
    rebuild of its output is the forward's, bit for bit; where it keeps its 16-bit output
    (bf16 weights), the readers keep that same y. dγ, summed over bands of rows in float32
    from x̂ (read back from y in bf16), matches float64 within the rounding of what it reads:
    eps·Σ|g|·(|x̂| + 1), channels with |β| > |γ| kept apart."""
    from actdesign.runtime.ops.sharing import kept_for, rebuild

    ok = True
    for cls in (torch.nn.LayerNorm, torch.nn.RMSNorm):
        for dtype, autocast in ((torch.float32, False), (torch.bfloat16, False),
                                (torch.float32, True)):
            ref = cls(1000).to(device)
            with torch.no_grad():
                ref.weight.uniform_(0.99, 1.01)
                if getattr(ref, "bias", None) is not None:
                    ref.bias.normal_(0, 0.1)
            norm = runtime.ms_norm(ref.to(dtype))
            x = (torch.randn(4096, 1000, device=device) * 3).to(dtype).requires_grad_(True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                y, eager = norm(x), ref(x).detach()
            # eager's value, to one unit of y's dtype in the size of the terms x·rstd·γ, β and
            # y (float32 sums in another order)
            xd = x.detach().double()
            bias = getattr(ref, "bias", None)
            terms = (eager.double().abs() + ref.weight.double().abs() * xd.abs()
                     * torch.rsqrt(xd.square().mean(-1, keepdim=True))
                     + (0 if bias is None else 2 * bias.double().abs()))
            units = ((y.detach().double() - eager.to(y.dtype).double()).abs()
                     / (torch.finfo(y.dtype).eps * terms)).max().item()
            kept, extras, make = kept_for(y)
            same = torch.equal(rebuild(kept, extras, make, y.shape, y.dtype), y) \
                if make is not None else kept.data_ptr() == y.data_ptr()
            g = torch.randn_like(y)
            y.backward(g)
            centred = xd if cls is torch.nn.RMSNorm else xd - xd.mean(-1, keepdim=True)
            xhat = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5)
            want = (g.double() * xhat).sum(0)
            err = ((norm.weight.grad.double() - want).abs()
                   / (g.double().abs() * (xhat.abs() + 1)).sum(0)).max().item()
            # 16-bit y within one unit of eager's (float32 y: the sums' order, reported only)
            close = err <= torch.finfo(y.dtype).eps and (units <= 1 or y.dtype == torch.float32)
            kept_what = "rebuilt y bit for bit" if make is not None else "readers keep y itself"
            print(f"MS {cls.__name__} {dtype}{' autocast' if autocast else ''}: y against "
                  f"eager's: {units:.2f} units; {kept_what}: {same}; dγ against float64, worst "
                  f"error / Σ|g|(|x̂| + 1): {err:.1e}: {close}")
            ok &= same and close
    return ok


def check_actnn(device):
    ops = runtime.actnn_ops()
    x = torch.randn(64, 5000)
    bits = torch.randint(1, 9, (64,), dtype=torch.int8)
    packed, lo, width = ops.quantize(x.to(device), bits.to(device), 7, 256)
    ref = ops._quantize_torch(x, bits, ops.mix32(7), 256)
    same = sum(int(torch.equal(a.cpu(), b)) for a, b in zip((packed, lo, width), ref,
                                                                 strict=True)) == 3
    codes = (packed.cpu() == ref[0]).float().mean().item()
    print(f"ActNN quantize: identical to the CPU reference: {same} ({codes:.6%} of code bytes)")
    return same


def check_actnn_draws(device):
    """ActNN's codes follow the device's generator: a seeded step twice, and with
    checkpointing (whose recompute replays the generator), gives the same gradients."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                 torch.nn.Dropout(0.1), torch.nn.Linear(1024, 256)).to(device)
    runtime.compress(layers, "actnn2")
    x = torch.randn(64, 256, device=device)

    def grads(checkpointed):
        torch.manual_seed(3)
        layers.zero_grad()
        out = checkpoint(layers, x, use_reentrant=False) if checkpointed else layers(x)
        out.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    first, again, recomputed = grads(False), grads(False), grads(True)
    same = all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(first, again, recomputed, strict=True))
    print(f"ActNN draws: a seeded step repeats bit for bit, checkpointed too: {same}")
    return same


def check_llm_ops(device):
    """MS-GLU's kernels against the torch path (the bound of tests/test_llm.py) and the fused
    loss against eager transformers' loss, on the device."""
    from actdesign.runtime.ops.glu import glu_ops
    from actdesign.runtime.ops.lm_loss import fused_linear_cross_entropy

    ok = True
    ops = glu_ops()
    for kind in ops.KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            g = (torch.randn(2**20, dtype=torch.float64) * 3).to(dtype)
            u, dh = torch.randn_like(g), torch.randn_like(g)
            ref = (ops._forward_torch(g, u, kind), *ops._backward_torch(g, u, dh, kind))
            got = (ops.forward(g.to(device), u.to(device), kind),
                   *ops.backward(g.to(device), u.to(device), dh.to(device), kind))
            eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
            worst = max(((a.cpu().double() - b.double()).abs()
                         / (2 * eps * b.double().abs() + 16 * eps32 * b.double().abs().max()))
                        .max().item() for a, b in zip(got, ref, strict=True))
            print(f"MS-GLU {kind} {dtype}: worst error / bound {worst:.2f}: {worst <= 1}")
            ok &= worst <= 1
    ok &= check_gelu_new(device)
    tokens, d, vocab = (4096, 768, 32000) if device == "cuda" else (256, 64, 4000)
    hidden = torch.randn(tokens, d, device=device)
    weight = torch.randn(vocab, d, device=device) * 0.05
    labels = torch.randint(0, vocab, (tokens,), device=device)
    for autocast in (False, True):
        results = []
        for how in ("float64", "eager", "fused"):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            if how == "float64":  # of what the product consumes
                cast = torch.bfloat16 if autocast else torch.float32
                h = h.detach().to(cast).double().requires_grad_(True)
                w = w.detach().to(cast).double().requires_grad_(True)
            enabled = autocast and how != "float64"
            with torch.autocast(device, dtype=torch.bfloat16, enabled=enabled):
                if how == "fused":
                    loss = fused_linear_cross_entropy(h, w, labels)
                else:
                    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[1:]
                    logits = h @ w.T
                    loss = torch.nn.functional.cross_entropy(
                        logits.double() if how == "float64" else logits.float(), shifted)
            loss.backward()
            results.append([t.double() for t in (loss.detach(), h.grad, w.grad)])
        exact, eager, fused = results
        ratios = [((f - x).norm() / ((e - x).norm() + 1e-6 * x.norm())).item()
                  for x, e, f in zip(exact, eager, fused, strict=True)]
        # as accurate as eager: at most twice its distance to float64 (tests/test_llm.py),
        # float32 round-off of the scale as a floor
        good = all(r <= 2 for r in ratios)
        print(f"fused loss, autocast={autocast}: error against float64 / eager's (loss, dhidden, "
              f"dweight) {', '.join(f'{r:.2f}' for r in ratios)}: {good}")
        ok &= good
    return ok


def check_gelu_new(device):
    """The MS activation against eager GPT-2's gelu_new on the device, output and input
    gradient, bit for bit (the kernels reproduce CUDA's roundings and call its tanh)."""
    from transformers.activations import NewGELUActivation

    from actdesign.runtime.ops.msact import MSActivation

    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(2**22, dtype=torch.float64) * 3).to(dtype).to(device)
        dy = torch.randn(2**22, dtype=torch.float64).to(dtype).to(device)
        results = []
        for module in (NewGELUActivation(), MSActivation()):
            leaf = x.clone().requires_grad_(True)
            y = module(leaf * 1)
            y.backward(dy)
            results.append((y.detach(), leaf.grad))
        (y0, dx0), (y1, dx1) = results
        differ = ((y1 != y0).sum() + (dx1 != dx0).sum()).item()
        print(f"MS activation gelu_new {dtype}: {differ} elements differ from eager's: "
              f"{differ == 0}")
        ok &= differ == 0
    return ok


def block_memory(device, ops):
    d, batch, seq = (1024, 8, 1024) if device == "cuda" else (256, 4, 128)
    x = torch.randn(batch, seq, d, device=device)
    torch.manual_seed(0)
    base = Block(d, 16, torch.nn.GELU()).to(device)
    compressed = Block(d, 16, ops.Module()).to(device)
    compressed.load_state_dict(base.state_dict())
    runtime.compress(compressed, "msnorm", example_inputs=x[:1, :8])  # q, k, v, fc1 share x̂
    for name, model in (("baseline", base), ("GELU 3-bit + MS-LayerNorm", compressed)):
        def step(model=model):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(5):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / 5 * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
        with torch.autocast(device, dtype=torch.bfloat16):
            saved = saved_bytes(model, x) / 2**20
        print(f"{name}: saved {saved:.1f} MiB, peak {peak:.1f} MiB, step {ms:.2f} ms")
        if device == "cuda":
            print("\n".join(at_peak(step)))


def models(device):
    """GPT-2 small and a 12-layer LLaMA, one step each in bf16 autocast and in fp32: saved
    bytes, peak and time, against the baseline in the same precision."""
    from actdesign.runtime.memory.profile import profile

    quick = device == "cpu"
    for precision in ("bf16-autocast", "fp32"):
        for name in ("gpt2-tiny", "llama-tiny") if quick else ("gpt2", "llama"):
            step = {}
            for policy in ("fewbit3+msnorm", "fewbit3+msnorm+actnn2", "llm", "llm+actnn2"):
                r = profile(name, policy, 8, 64 if quick else 512, device,
                            repeats=1 if quick else 5, precision=precision)
                d = r.to_dict()
                step[policy] = r.compressed.step_s
                print(f"{name} {policy} {precision}: saved {d['saved_ratio']:.3f}, peak "
                      f"{r.baseline.peak / 2**30:.2f} -> {r.compressed.peak / 2**30:.2f} GiB "
                      f"({d['peak_ratio']:.3f}, {r.peak_kind}), step "
                      f"{r.baseline.step_s * 1e3:.1f} -> {r.compressed.step_s * 1e3:.1f} ms "
                      f"({d['time_ratio']:.2f})", flush=True)
            for base in ("fewbit3+msnorm", "llm"):
                print(f"{name} {precision}: actnn2 on top of {base} costs "
                      f"{step[base + '+actnn2'] / step[base] - 1:+.0%} of the step "
                      f"(goal: at most +15% in bf16)", flush=True)


def check_lora(device):
    """PEFT LoRA with dropout on the device: the lean path replays the device generator's
    mask and PEFT's ops, so with bf16 weights under autocast the loss and every adapter
    gradient are PEFT's bit for bit."""
    try:
        import copy

        import peft
    except ImportError:
        print("LoRA: peft is not installed here: skipped")
        return True
    model, _ = runtime.models.build("llama-tiny")
    model = peft.get_peft_model(model.to(device, torch.bfloat16).train(), peft.LoraConfig(
        r=8, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ours = copy.deepcopy(model)
    runtime.compress(ours, {"rules": [{"target": "linear", "apply": "lean"}]})
    inputs = runtime.models.example_batch(model, 2, 64)
    runs = []
    for m in (model, ours):
        torch.manual_seed(3)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(**inputs).loss
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss0, grads0), (loss1, grads1) = runs
    same = torch.equal(loss0, loss1) and grads0.keys() == grads1.keys() \
        and all(torch.equal(grads1[n], g) for n, g in grads0.items())
    print(f"LoRA, dropout 0.1, bf16 autocast: loss and {len(grads0)} adapter gradients "
          f"PEFT's bit for bit: {same}")
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
    ops = runtime.load(spec.from_fit(fit_stepwise("gelu", 3)))
    ok = check_fewbit(ops, device) & check_norms(device) & check_rebuild(device) \
        & check_actnn(device) & check_actnn_draws(device) \
        & check_llm_ops(device) & check_lora(device)
    block_memory(device, ops)
    models(device)
    print("all exact checks passed" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
