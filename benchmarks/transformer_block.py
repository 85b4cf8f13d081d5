"""Saved-activation bytes, peak and speed of a pre-norm transformer block (attention and a
GELU MLP) with the activation-side methods, all measured in one run against the plain block.
The peak is tensor by tensor (measure.live_at_peak): the bytes a training step's tensors
occupy at once at their most, parameters and input aside.

Variants: the plain block; its GELU replaced by the 3-bit stepwise table or by the 2-bit
piecewise-linear fit (ReGELU2-style); its LayerNorms replaced by MS-LayerNorms, whose
readers keep the norm's x̂ and rebuild its output in their backward; and the combinations.

Run: .venv/bin/python benchmarks/transformer_block.py [--markdown] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn.functional as F
from measure import live_at_peak, median_time, saved_storages, table
from torch import nn

from actdesign import runtime, spec
from actdesign.designer import fit_stepwise
from actdesign.designer.pwl import fit_pwl


class Block(nn.Module):
    def __init__(self, d, heads, act):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), act, nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def saved_bytes(model, x) -> int:
    """Distinct storages autograd keeps for one forward, parameters aside."""
    return sum(saved_storages(model, x, skip=model.parameters())[0].values())


def training_step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def step_time(model, x, repeats) -> float:
    return median_time(lambda: training_step(model, x), repeats, warmup=True)[0]


def step_peak(model, x) -> int:
    """The peak bytes of the tensors one training step makes (parameters and input aside),
    tensor by tensor (measure.live_at_peak): what a device allocator would add to them."""
    return live_at_peak(lambda: training_step(model, x))[0]


def variants(d, heads):
    gelu3 = runtime.load(spec.from_fit(fit_stepwise("gelu", 3)))
    regelu2 = runtime.load(spec.from_pwl(fit_pwl("gelu", 2)))
    torch.manual_seed(0)
    base = Block(d, heads, nn.GELU())

    def make(act=None, ms=False):
        block = copy.deepcopy(base)
        if act is not None:
            block.act = act.Module()
        if ms:  # MS norms, and q, k, v and fc1 keeping their x̂
            runtime.compress(block, "msnorm", example_inputs=torch.randn(2, 3, d))
        return block

    return {"baseline (LayerNorm, GELU)": make(),
            "+ GELU 3-bit table": make(gelu3),
            "+ ReGELU2-style 2-bit pwl": make(regelu2),
            "+ MS-LayerNorm": make(ms=True),
            "GELU 3-bit + MS-LayerNorm": make(gelu3, ms=True),
            "2-bit pwl + MS-LayerNorm": make(regelu2, ms=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smaller block, fewer repeats")
    args = parser.parse_args()
    d, heads, batch, seq = (128, 4, 4, 64) if args.quick else (512, 8, 8, 256)
    repeats = 3 if args.quick else 9
    x = torch.randn(batch, seq, d)
    tokens = batch * seq
    print(f"Block: d={d}, {heads} heads, MLP 4d, batch {batch} x {seq} tokens, float32, CPU "
          f"({os.cpu_count()} cores, torch {torch.__version__})\n")
    header = ["variant", "saved KiB/token", "vs baseline", "saved", "peak MiB", "peak ratio",
              "fwd+bwd ms", "time ratio"]
    row = table(header, args.markdown, first=28)
    base_bytes = base_peak = base_time = None
    for name, model in variants(d, heads).items():
        nbytes = saved_bytes(model, x)
        peak = step_peak(model, x)
        seconds = step_time(model, x, repeats)
        base_bytes, base_peak = base_bytes or nbytes, base_peak or peak
        base_time = base_time or seconds
        row([name, f"{nbytes / tokens / 1024:.2f}", f"{nbytes / base_bytes:.1%}",
             f"{1 - nbytes / base_bytes:.1%}", f"{peak / 2**20:.1f}", f"{peak / base_peak:.3f}",
             f"{seconds * 1e3:.1f}", f"{seconds / base_time:.2f}"])


if __name__ == "__main__":
    main()
