"""Fine-tune a small LLaMA with PEFT LoRA in transformers' Trainer, alone and with `llm`.

    python examples/finetune_lora.py                 # 300 steps of 8 x 128 tokens
    python examples/finetune_lora.py --precision bf16-autocast --plot out/lora_bf16.png

The base model is the built-in `llama-tiny` config (random weights, nothing downloaded),
trained in full for a moment on one embedded text; the LoRA adapters then learn another.
Both runs start from that base with the same adapters and train them on the same batches with
the same seed. The only difference: the second compresses the PEFT model with the lossless
`llm` policy before the Trainer is built. Printed: the bytes one training step keeps for its
backward and its activation peak, measured in this run for each, and the two loss curves side
by side; the plot shows them too. The curves agree to rounding (float32's; under bf16
autocast also the MS norms' one extra bf16 rounding), which Adam's normalised steps let grow
slowly over a long run.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import warnings

import torch
import toy_lm
import transformers

from actdesign.runtime import compress, models

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# bitsandbytes, which PEFT and transformers' Trainer import, warns that it cannot fetch an
# optional CPU kernel from the Hub: nothing here uses it
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


class LossLog(transformers.TrainerCallback):
    """Every step's training loss, as the Trainer logs it."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def base_model(steps: int, batch: int, seq: int, seed: int):
    """The model to fine-tune: the built-in llama-tiny (random weights, nothing downloaded),
    trained in full on the Dickens text first, so that it knows English bytes; a random
    model's frozen head could not express what the adapters learn."""
    model, _ = models.build("llama-tiny", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for ids in toy_lm.windows(toy_lm.DICKENS, steps * batch, seq, seed).split(batch):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def lora_model(base, rank: int, seed: int):
    """A copy of `base` with LoRA adapters on all seven projections; PEFT freezes the rest."""
    import peft  # here: after the line that quiets bitsandbytes

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05,
                             target_modules=TARGETS, task_type="CAUSAL_LM")
    torch.manual_seed(seed)  # PEFT draws the adapters' A from torch's generator
    return peft.get_peft_model(copy.deepcopy(base), config)


def train(model, data: torch.Tensor, args, folder: str) -> list[float]:
    rows = [{"input_ids": ids, "labels": ids} for ids in data]
    settings = transformers.TrainingArguments(
        output_dir=folder, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, lr_scheduler_type="constant", seed=args.seed, logging_steps=1,
        bf16=args.precision == "bf16-autocast", use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True)
    log = LossLog()
    trainer = transformers.Trainer(model=model, args=settings, train_dataset=rows,
                                   callbacks=[log])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # ours prints
    trainer.train()
    return log.losses


def main():
    def lora_options(parser):
        parser.add_argument("--rank", type=toy_lm.positive, default=16)
        parser.add_argument("--base-steps", type=toy_lm.positive, default=100,
                            help="steps of full training before the fine-tune")

    args = toy_lm.parse(__doc__.splitlines()[0], 3e-3, "out/finetune_lora.png", lora_options)
    plot = args.plot
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    base = base_model(args.base_steps, args.batch, args.seq, args.seed)
    data = toy_lm.windows(toy_lm.AUSTEN, args.steps * args.batch, args.seq, args.seed)

    curves, memories = {}, {}
    for name in ("PEFT", "PEFT + llm"):
        model = lora_model(base, args.rank, args.seed)
        if name == "PEFT + llm":
            report = compress(model, "llm")  # PEFT first, then compress, then the Trainer
            print(f"{name}: {len(report.replaced)} modules replaced, "
                  f"{len(report.skipped)} left alone")
        memories[name] = toy_lm.memory(model, data[:args.batch], args.precision)
        with tempfile.TemporaryDirectory() as folder:
            curves[name] = train(model, data, args, folder)

    print(f"\nllama-tiny, LoRA r={args.rank} on {len(TARGETS)} projections, batch {args.batch}"
          f" x {args.seq} tokens, {args.precision}, {args.steps} steps, seed {args.seed}")
    toy_lm.print_memory(memories)
    (base_saved, _), (saved, _) = memories.values()
    print(f"PEFT + llm keeps {toy_lm.mib(base_saved - saved)} less for the backward\n")
    toy_lm.print_curves(curves, args.every)
    toy_lm.print_gaps(curves)
    title = (f"llama-tiny + LoRA r={args.rank}, {args.precision}: PEFT alone vs PEFT + llm "
             f"({saved / base_saved:.0%} of the saved bytes)")
    toy_lm.plot_curves(curves, plot, title)


if __name__ == "__main__":
    toy_lm.run_main(main)
