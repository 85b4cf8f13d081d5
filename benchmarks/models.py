"""Saved bytes and step time of real model shapes, baseline against each policy.

    python benchmarks/models.py            # GPT-2 small, a 12-layer LLaMA, BERT-base, ViT-B/16
    python benchmarks/models.py --quick    # the -tiny configs
    python benchmarks/models.py --precision bf16-autocast

One training step each (random weights from the built-in transformers configs, random
inputs), measured by `actdesign.runtime.memory.profile` in the chosen precision (as `actdesign
profile --precision`): distinct storages saved for the backward (parameters and buffers
aside), the peak (CUDA allocator on a GPU) and the median step time, against the baseline
measured in the same run. In bfloat16 on a CPU without native bfloat16, matrix products run
through float32 kernels (`measure.float32_matmuls`, unless --native-cpu-bf16): the saved bytes
are exact, the time ratios are not those of native kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from measure import emulate_bf16_matmuls, float32_matmuls, table  # noqa: E402

from actdesign.runtime.memory.profile import PRECISIONS, default_precision, profile  # noqa: E402

POLICIES = ["fewbit3", "regelu2", "msnorm", "fewbit3+msnorm", "actnn2", "backrazor90",
            "fewbit3+msnorm+actnn2"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="+")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="default: bf16-autocast on CUDA, fp32 on CPU")
    parser.add_argument("--native-cpu-bf16", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    precision = args.precision or default_precision(args.device)
    emulate = emulate_bf16_matmuls(args.device, precision, args.native_cpu_bf16)
    print(f"{precision} on {args.device}, batch {args.batch}, sequence {args.seq}"
          + (", bf16 matmuls via float32 kernels" if emulate else ""))
    names = args.models or [f"{m}-tiny" if args.quick else m
                            for m in ("gpt2", "llama", "bert", "vit")]
    row = table(["model", "policy", "baseline MiB", "policy MiB", "saved ratio", "peak ratio",
                 "time ratio", "left alone"], args.markdown, width=14, first=24)
    for name in names:
        for policy in args.policies:
            with float32_matmuls(emulate):
                r = profile(name, policy, args.batch, args.seq, args.device, args.repeats,
                            precision=precision)
            d = r.to_dict()
            row([name, policy, f"{r.baseline.total / 2**20:,.1f}",
                 f"{r.compressed.total / 2**20:,.1f}", f"{d['saved_ratio']:.3f}",
                 f"{d['peak_ratio']:.3f}", f"{d['time_ratio']:.2f}",
                 str(len(r.report.skipped))])


if __name__ == "__main__":
    main()
