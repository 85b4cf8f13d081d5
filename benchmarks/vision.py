"""Convolutional networks and vision transformers: each preset's saved bytes and activation
peak against eager's, and the largest batch each fits on a card.

    python benchmarks/vision.py                      # batch 4 at 224², fp32
    python benchmarks/vision.py --markdown --batch 64 --models timm:resnet50
    python benchmarks/vision.py --max-batch 16GB --models timm:resnet50

Every number is `estimate`'s, on fake tensors with the CPU paths' allocations
(kernels="cpu"): tests/test_estimate_images.py checks such counts against real CPU steps, to
the byte, for each preset. A ratio above 1 is a policy that keeps more than eager: `compress`
refuses to apply it unless told to (`allow_more=True`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from measure import table  # noqa: E402

from actdesign.runtime.memory.estimate import estimate  # noqa: E402

MODELS = ["timm:resnet18", "timm:resnet50", "torchvision:mobilenet_v2",
          "timm:efficientnet_b0", "torchvision:mobilenet_v3_large", "timm:convnext_tiny",
          "timm:regnety_016", "timm:swin_tiny_patch4_window7_224",
          "timm:vit_base_patch16_224"]
POLICIES = ["cnn", "cnn+actnn2", "actnn2", "fewbit3", "pooled2", "backrazor90", "llm"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-batch", metavar="SIZE",
                        help="The largest batch each fits on a card of this memory instead.")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    policies = ["none", *args.policies]
    what = f"the largest batch in {args.max_batch}" if args.max_batch else \
        f"saved / peak against eager, batch {args.batch}"
    print(f"{what}, {args.image_size}² images, {args.precision}, estimate (CPU paths)",
          flush=True)
    head = "eager batch" if args.max_batch else "eager MiB saved / peak"
    row = table(["model", head, *args.policies], args.markdown, width=14, first=34)
    for name in args.models:
        start = time.perf_counter()
        result = estimate(name, args.batch, 1, args.precision, policies, kernels="cpu",
                          image_size=args.image_size, gpu_memory=args.max_batch,
                          longest="batch" if args.max_batch else None)
        eager, *rows = result.rows
        if args.max_batch:
            first = eager.longest[args.max_batch].value
            cells = [f"{r.longest[args.max_batch].value / first:.2f}x" if first else
                     str(r.longest[args.max_batch].value) for r in rows]
            row([name, str(first), *cells])
        else:
            cells = [f"{r.saved_bytes / eager.saved_bytes:.2f} / "
                     f"{r.peak_bytes / eager.peak_bytes:.2f}" for r in rows]
            row([name, f"{eager.saved_bytes / 2**20:.0f} / {eager.peak_bytes / 2**20:.0f}",
                 *cells])
        print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
