"""Bytes autograd keeps for one training step under bf16 autocast, with the MS norms keeping
their 16-bit output (rounding as eager does) against keeping a 16-bit x̂ (their former
forward, which rounds twice), and against the plain model, measured in the same run.

    python benchmarks/norm_bytes.py [--markdown]

Models: `convergence.py`'s LLaMA and GPT at its default size (d = 128, 4 layers, 4 heads)
on its training batch shape (16 x 128 tokens), float32 weights.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from convergence import DEFAULT, Setting, build, saved_bytes  # noqa: E402
from gradient_bias import xhat_first  # noqa: E402
from measure import table  # noqa: E402

from actdesign.runtime import compress  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    setting = Setting("cpu", "bf16-autocast")
    tokens = torch.randint(0, 256, (DEFAULT.batch, DEFAULT.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    row = table(["model", "policy", "plain MiB", "x̂ kept MiB", "y kept MiB", "y / x̂"],
                args.markdown, width=14, first=8)
    for arch in ("llama", "gpt"):
        torch.manual_seed(0)
        base = build(arch, DEFAULT).train()
        plain = saved_bytes(base, batch, setting)
        for policy in ("msnorm", "llm"):
            got = {}
            for kept in ("x̂", "y"):
                model = copy.deepcopy(base)
                with xhat_first() if kept == "x̂" else contextlib.nullcontext():
                    compress(model, policy, example_inputs=(batch[0],), allow_more=True)
                    got[kept] = saved_bytes(model, batch, setting)
            row([arch, policy, f"{plain / 2**20:.2f}", f"{got['x̂'] / 2**20:.2f}",
                 f"{got['y'] / 2**20:.2f}", f"{got['y'] / got['x̂']:.4f}"])


if __name__ == "__main__":
    main()
