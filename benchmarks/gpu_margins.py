"""A card's memory margins for `estimate`, measured on the card, and the check that an estimate
which fits with little to spare really runs there.

    python benchmarks/gpu_margins.py --card h100 --out out/h100_margins.json [--install]

1. Margins: real bf16-autocast training steps (AdamW) of the built-in llama at 8 x 1024 with no
   policy, `llm`, and `llm` with gradient checkpointing. The CUDA context and the libraries'
   workspaces are what the process holds on the card beyond torch's reserved bytes after the
   steps (`mem_get_info`); a family's fragmentation is the allocator's reserved bytes beyond
   its allocated ones at the peak, over the step's activation peak as `estimate` prices it.
   Written in the format runtime/memory/cards.py reads; --install merges it into
   runtime/memory/cards/.
2. The check: for the 1B LLaMA (full fine-tuning, bf16 autocast, `llm`), the longest sequence
   (a multiple of 512) whose estimate with these margins fits the card's memory; there it
   fits with little to spare. A real step runs there: it must not run out of memory, and
   torch.cuda.max_memory_reserved must stay under the estimate's total with margins.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from actdesign.runtime import compress, models  # noqa: E402
from actdesign.runtime.memory import cards
from actdesign.runtime.memory.estimate import estimate  # noqa: E402
from actdesign.runtime.memory.profile import forward_context  # noqa: E402
from actdesign.runtime.memory.setups import with_checkpointing  # noqa: E402

SETUPS = {"eager": ("none", False), "llm": ("llm", False), "checkpointing": ("llm", True)}


def train_step(name, policy, checkpointing, batch, seq, repeats=2) -> tuple[int, int]:
    """(peak allocated, peak reserved) over `repeats` AdamW steps after a warm-up step."""
    torch.cuda.empty_cache()
    model = models.build(name, seed=0, device="cuda")[0].train()
    if policy != "none":
        compress(model, policy, allow_more=True)  # measured, whatever it keeps
    if checkpointing:
        with_checkpointing(name, model)
    inputs = models.example_batch(model, batch, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for i in range(1 + repeats):
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with forward_context("bf16-autocast", "cuda"):
            loss = models.loss_of(models.call(model, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    del model, optimizer, inputs, loss
    return peaks


def measure(name="llama", batch=8, seq=1024) -> dict:
    fragmentation = {}
    for family, (policy, checkpointing) in SETUPS.items():
        allocated, reserved = train_step(name, policy, checkpointing, batch, seq)
        peak = estimate(name, batch, seq, policies=[policy],
                        checkpointing=checkpointing).rows[0].peak_bytes
        fragmentation[family] = max(0.0, (reserved - allocated) / peak)
        print(f"{family}: allocated {allocated / 2**30:.2f} GiB, reserved "
              f"{reserved / 2**30:.2f} GiB, estimated activation peak {peak / 2**30:.2f} GiB",
              flush=True)
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    return {"device": torch.cuda.get_device_name(0), "model": name,
            "shape": f"{batch} x {seq}", "date": str(datetime.date.today()),
            "torch": torch.__version__, "context_bytes": int(context),
            "fragmentation": fragmentation}


def check(card: str, name="llama-1b", batch=1) -> bool:
    """The longest sequence the estimate fits on this card; a real step there."""
    total = torch.cuda.get_device_properties(0).total_memory

    def needed(seq):
        return estimate(name, batch, seq, policies=["llm"], card=card).rows[0].needed_bytes

    seq, step = 512, 512
    while needed(seq + step) <= total:
        seq, step = seq + step, step * 2
    while step > 512:  # down to the longest multiple of 512 that fits
        step //= 2
        if needed(seq + step) <= total:
            seq += step
    want = needed(seq)
    print(f"{name}, batch {batch}: the estimate fits sequence {seq} with "
          f"{(total - want) / total:.1%} to spare ({want / 2**30:.2f} of "
          f"{total / 2**30:.2f} GiB)", flush=True)
    try:
        _, reserved = train_step(name, "llm", False, batch, seq, repeats=1)
    except torch.OutOfMemoryError:
        print("the real step ran out of memory: the estimate's margins are too small")
        return False
    within = reserved <= want
    print(f"real step: reserved {reserved / 2**30:.2f} GiB, "
          f"{'within' if within else 'OVER'} the estimate with margins")
    return within


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", required=True, choices=cards.NAMES)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--install", action="store_true",
                        help="also merge it into runtime/memory/cards/<card>.json of this checkout")
    args = parser.parse_args()
    margins = measure()
    paths = [Path(args.out)]
    if args.install:
        paths.append(Path(__file__).parents[1] / "runtime/memory/cards" / f"{args.card}.json")
    for path in paths:
        data = json.loads(path.read_text()) if path.exists() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data | margins, indent=1) + "\n")
    print(json.dumps(margins, indent=1))
    if args.install:  # the check prices with the margins just measured
        cards.CARDS = paths[-1].parent
    sys.exit(0 if check(args.card) else 1)


if __name__ == "__main__":
    main()
