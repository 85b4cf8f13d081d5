"""Train a small LLaMA in full: plain, with `llm`, and with `llm` plus recomputed layers.

    python examples/train_llm.py                     # 300 steps of 8 x 128 tokens
    python examples/train_llm.py --precision bf16-autocast --plot out/train_llm_bf16.png

Every run starts from the same random weights (the built-in `llama-tiny` config, nothing
downloaded) and trains every weight with AdamW in a plain PyTorch loop on the same batches of
an embedded text. `llm` is lossless; the third run adds the `checkpoint` rule, which recomputes
each decoder layer in the backward and keeps only its input (exact too: the recompute replays
the random generators). Printed: the bytes one training step keeps for its backward and its
activation peak (recomputation included), measured in this run for each, and the loss curves
side by side; the plot shows them too.
"""

from __future__ import annotations

import torch
import toy_lm

from actdesign.runtime import compress, models
from actdesign.runtime.apply.policy import FORMAT, PRESETS

RECOMPUTE_LAYERS = {"target": "block", "name": "model.layers.*", "apply": "checkpoint"}
POLICIES = {
    "plain": None,
    "llm": "llm",
    "llm + checkpointing": {"format": FORMAT, "rules": [RECOMPUTE_LAYERS, *PRESETS["llm"]]},
}


def train(model, data: torch.Tensor, batch: int, lr: float, precision: str) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # made after compress
    losses = []
    for ids in data.split(batch):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    args = toy_lm.parse(__doc__.splitlines()[0], 1e-3, "out/train_llm.png")
    plot = args.plot
    data = toy_lm.windows(toy_lm.DICKENS + toy_lm.AUSTEN, args.steps * args.batch, args.seq,
                          args.seed)

    curves, memories = {}, {}
    for name, policy in POLICIES.items():
        model, _ = models.build("llama-tiny", seed=args.seed)  # the same weights every run
        model.train()
        if policy is not None:
            report = compress(model, policy)  # before the optimizer is made
            print(f"{name}: {len(report.replaced)} modules replaced, "
                  f"{len(report.skipped)} left alone")
        memories[name] = toy_lm.memory(model, data[:args.batch], args.precision)
        torch.manual_seed(args.seed)
        curves[name] = train(model, data, args.batch, args.lr, args.precision)

    print(f"\nllama-tiny, every weight trained, batch {args.batch} x {args.seq} tokens, "
          f"{args.precision}, {args.steps} steps, seed {args.seed}")
    toy_lm.print_memory(memories)
    print()
    toy_lm.print_curves(curves, args.every)
    toy_lm.print_gaps(curves)
    saved, base_saved = memories["llm + checkpointing"][0], memories["plain"][0]
    toy_lm.plot_curves(curves, plot, f"llama-tiny, full training, {args.precision}: llm + "
                       f"checkpointing keeps {saved / base_saved:.0%} of the saved bytes")


if __name__ == "__main__":
    toy_lm.run_main(main)
