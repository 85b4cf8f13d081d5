"""Compressed models in the clients people train with: transformers' Trainer with its default
arguments (columns kept by the forward's signature, num_items_in_batch, gradient
accumulation, evaluation with compute_metrics, checkpoints and resuming) and TRL's
SFTTrainer, against the untouched model in the same client. Real packages, no mocks."""

import copy
import inspect
import sys
from pathlib import Path

import pytest
import torch

from actdesign.runtime import compress, models
from actdesign.runtime.memory import planner

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("accelerate")
sys.path.insert(0, str(Path(__file__).parent))
from lms import NAMES, architecture, perturb_norms  # noqa: E402

VOCAB = 512  # llama-tiny's


def llama():
    return perturb_norms(models.build("llama-tiny")[0].train())


def token_rows(n=16, seq=12, seed=2):
    """Padded causal-LM examples, and a text column no forward takes."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[seq - i % 4:] = 0  # right padding, 0 to 3 tokens
        ids[mask == 0] = 0
        rows.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                     "labels": ids.masked_fill(mask == 0, -100).tolist(), "text": f"row {i}"})
    return datasets.Dataset.from_list(rows)


def arguments(out, **overrides):
    """TrainingArguments at their defaults, but for a short CPU run logged every step."""
    settings = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                    save_strategy="no", disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **overrides})


def losses(trainer):
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h],
                        dtype=torch.float64)


def saved_vocabulary_tensors(model, fn):
    """Shapes of the tensors autograd keeps for fn()'s backward that have a dimension of the
    vocabulary's size (parameters aside): logits, or their log-probabilities."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and VOCAB in t.shape:
            found.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return found


@pytest.mark.parametrize("name", ("llama-tiny", "gpt2-tiny") + NAMES)
def test_every_wrapper_keeps_the_signature_and_docstring(name):
    model = architecture(name) if name in NAMES else models.build(name)[0]
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    wrapped = [(n, m) for n, m in ours.named_modules() if "forward" in vars(m)]
    assert wrapped or name == "Cohere"  # Cohere: an interleaved rotation, and no fused loss
    for n, m in wrapped:
        own = type(m).forward.__get__(m)
        assert inspect.signature(m.forward) == inspect.signature(own), n
        assert m.forward.__doc__ == own.__doc__ and m.forward.__name__ == "forward", n


def test_outputs_keep_transformers_contract():
    model = llama()
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    inputs = models.example_batch(model, 2, 10)
    out, want = ours(**inputs), model(**inputs)
    # Training with labels: the loss, first, and no logits under any name.
    assert list(out.keys())[0] == "loss" and "logits" not in out and out.logits is None
    assert out[0] is out.loss and out.past_key_values is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    as_tuple = ours(**inputs, return_dict=False)
    assert as_tuple[1] is None and torch.equal(as_tuple[0], out.loss)
    # Logits whenever they are asked for: eval mode, no labels, no grad.
    for setting in ("eval", "no labels", "no grad"):
        ours.train(setting != "eval")
        model.train(setting != "eval")
        given = {"input_ids": inputs["input_ids"]} if setting == "no labels" else inputs
        with torch.set_grad_enabled(setting != "no grad"):
            out, want = ours(**given), model(**given)
        assert out.logits.shape == want.logits.shape == (2, 10, VOCAB), setting
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["llm", "msnorm"])
def test_trainer_with_default_arguments_trains_as_the_untouched_model(preset, tmp_path):
    model = llama()
    ours = copy.deepcopy(model)
    compress(ours, preset)
    runs = []
    for m in (model, ours):
        trainer = transformers.Trainer(model=m, args=arguments(tmp_path / preset),
                                       train_dataset=token_rows())
        assert trainer.model_accepts_loss_kwargs  # so it passes num_items_in_batch
        trainer.train()
        runs.append(losses(trainer))
    assert len(runs[1]) == 4
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=0)
    if preset == "llm":  # the fused loss keeps nothing of the vocabulary's size; eager does
        step = token_rows()[:2]
        batch = {k: torch.tensor(step[k]) for k in ("input_ids", "attention_mask", "labels")}
        assert saved_vocabulary_tensors(ours, lambda: ours(**batch).loss) == []
        assert saved_vocabulary_tensors(model, lambda: model(**batch).loss) != []


def test_evaluate_gives_compute_metrics_logits_over_the_vocabulary(tmp_path):
    model = llama()
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    shapes, results = [], []

    def metrics(prediction):
        shapes.append(prediction.predictions.shape)
        return {"argmax_mean": float(prediction.predictions.argmax(-1).mean())}

    for m in (model, ours):
        trainer = transformers.Trainer(model=m, args=arguments(tmp_path), eval_dataset=token_rows(
            8), compute_metrics=metrics)
        results.append(trainer.evaluate())
    assert shapes == [(8, 12, VOCAB)] * 2
    assert results[1]["eval_argmax_mean"] == results[0]["eval_argmax_mean"]
    assert results[1]["eval_loss"] == pytest.approx(results[0]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("preset", ["msnorm", "llm"])
def test_a_trainer_checkpoint_resumes_into_a_compressed_or_a_plain_model(preset, tmp_path):
    model = llama()
    plain = copy.deepcopy(model)
    compress(model, preset)

    def trainer_for(m, out):
        args = arguments(out, save_strategy="steps", save_steps=2, learning_rate=1e-3,
                         weight_decay=0.1, seed=3)
        return transformers.Trainer(model=m, args=args, train_dataset=token_rows())

    trainer_for(model, tmp_path / "run").train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    again = copy.deepcopy(plain)
    compress(again, preset)
    for resumed in (copy.deepcopy(plain), again):
        trainer_for(resumed, tmp_path / "resumed").train(resume_from_checkpoint=str(checkpoint))
        for (n, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters(),
                                  strict=True):
            # two steps of float32 rounding apart at most (a plain model's steps differ
            # from the compressed one's by rounding, AdamW takes them as they come)
            assert (a - b).norm() <= 1e-5 * a.norm(), n


def tokenizer():
    """A word-level tokenizer over llama-tiny's vocabulary, made here: nothing downloaded."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as token_models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    inner = Tokenizer(token_models.WordLevel(vocab, unk_token="t1"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="t0",
                                                eos_token="t2", unk_token="t1")


def test_sft_trainer_with_its_defaults_trains_as_the_untouched_model(tmp_path):
    """SFTTrainer patches the model with its own fused head, which reads the head's weight
    and bias; it computes the loss from the hidden states in tiles, with or without our
    compression, and keeps no logits either way."""
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(6, 14, (16,), generator=g)]
    model = llama()
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    runs, kept = [], []
    for m in (model, ours):
        config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4,
                               per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                               disable_tqdm=True)
        trainer = trl.SFTTrainer(model=m, args=config, processing_class=tokenizer(),
                                 train_dataset=datasets.Dataset.from_list(rows))
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
        kept.append(saved_vocabulary_tensors(m, lambda m=m, t=trainer, b=batch:
                                             t.compute_loss(m, b)))
        trainer.train()
        runs.append(losses(trainer))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=0)
    assert kept == [[], []]


@pytest.mark.parametrize("client", ["Trainer", "SFTTrainer"])
def test_a_compressed_peft_model_trains_in_the_client_as_peft_does(client, tmp_path):
    """PEFT first, then compress, then the client: the same losses and the same adapters
    after four steps at a learning rate that moves them, dropout 0.1 (the client seeds the
    run, so the masks are the same); the client saves the adapter alone, under PEFT's
    names."""
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl") if client == "SFTTrainer" else None
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
    runs, adapters = [], []
    for compressed in (False, True):
        model = peft.get_peft_model(llama(), config)
        if compressed:
            report = compress(model, "llm")
            assert sum("lean LoRA" in c.new for c in report.replaced) == 14
        out = tmp_path / str(compressed)
        if client == "Trainer":
            trainer = transformers.Trainer(model=model, args=arguments(out, learning_rate=1e-2),
                                           train_dataset=token_rows())
        else:
            settings = arguments(out, learning_rate=1e-2).to_dict()
            settings = {k: settings[k] for k in ("output_dir", "max_steps", "learning_rate",
                                                 "per_device_train_batch_size", "use_cpu",
                                                 "gradient_accumulation_steps", "logging_steps",
                                                 "report_to", "save_strategy", "disable_tqdm")}
            # SFTConfig checkpoints by default (kept) and runs bf16 autocast (off): Adam's
            # first step is the sign of each gradient, which bf16 rounding flips where a
            # gradient is near zero (bf16 against PEFT: tests/test_lora.py)
            rows = token_rows().remove_columns(["text", "labels", "attention_mask"])
            trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**settings, bf16=False),
                                     processing_class=tokenizer(), train_dataset=rows)
        trainer.train()
        runs.append(losses(trainer))
        trainer.save_model(str(out))
        saved = peft.PeftModel.from_pretrained(llama(), str(out))
        adapters.append({n: p.detach() for n, p in saved.named_parameters() if "lora_" in n})
    assert len(runs[1]) == 4
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=0)
    assert adapters[1].keys() == adapters[0].keys() and len(adapters[0]) == 28
    for n, p in adapters[0].items():
        assert (adapters[1][n] - p).norm() <= 1e-4 * p.norm(), n
        assert p.abs().max() > 0  # trained: B left its zeros


@pytest.mark.parametrize("client", ["Trainer", "SFTTrainer", "PEFT"])
def test_recomputed_blocks_train_in_the_clients_as_the_untouched_model(client, tmp_path):
    """`llm` with every block recomputed (the `checkpoint` rule `actdesign plan` writes): the
    same losses in Trainer, under PEFT LoRA, and in SFTTrainer, which turns transformers'
    own checkpointing on after compress (ours then leaves the block to it: one recompute)."""
    peft = pytest.importorskip("peft") if client == "PEFT" else None
    trl = pytest.importorskip("trl") if client == "SFTTrainer" else None
    runs, calls = [], []
    for compressed in (False, True):
        model = llama()
        if peft is not None:
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"]))
        if compressed:
            blocks = planner.blocks_of(model)
            report = compress(model, planner.policy_of(planner.checkpoint_rules(blocks)))
            assert [c.name for c in report.replaced if "recomputed" in c.new] == blocks
            assert len(blocks) == 2
        count = []
        model.get_decoder().layers[0].self_attn.register_forward_pre_hook(
            lambda *_, count=count: count.append(1))
        if trl is not None:
            g = torch.Generator().manual_seed(0)
            rows = [{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=g).tolist()}
                    for n in torch.randint(6, 14, (16,), generator=g)]
            config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4,
                                   per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                   logging_steps=1, report_to=[], use_cpu=True,
                                   save_strategy="no", disable_tqdm=True)
            trainer = trl.SFTTrainer(model=model, args=config, processing_class=tokenizer(),
                                     train_dataset=datasets.Dataset.from_list(rows))
        else:
            trainer = transformers.Trainer(model=model, args=arguments(tmp_path,
                                                                       learning_rate=1e-2),
                                           train_dataset=token_rows())
        trainer.train()
        runs.append(losses(trainer))
        calls.append(len(count))
        if trl is not None:  # transformers checkpoints the blocks itself
            assert model.model.layers[0].gradient_checkpointing is True
    assert len(runs[1]) == 4
    # 8 micro-batches: a forward each, and a recompute each where the block is recomputed
    assert calls == [16 if trl is not None else 8, 16]
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=0)
