"""Accuracy of the fused LM loss against float64, beside eager float32's, by confidence and
logit scale.

    python benchmarks/loss_accuracy.py [--markdown] [--tokens 256] [--seq 16]

Every row compares with the float64 cross-entropy of the float64 logits of the same float32
inputs. Eager is F.cross_entropy of the float32 product (transformers' loss for the model);
fused is fused_linear_cross_entropy (attach_fused_loss for the model), on the torch path
(ACTDESIGN_BACKEND as set). Columns: the float64 loss; the largest |logit|; the relative
error of the loss; the worst relative error (in norm) of the gradients (hidden states and
head weight; every parameter for the model), eager and fused, and fused/eager.

- A linear head: `--tokens` x 64 hidden states, vocabulary 4000, each hidden state near its
  target's weight row (below log V: the loss falls as the logits grow) or its opposite
  (above); the logits are scaled until the loss is the row's, and shifted by a common offset
  (no change to the loss, but the log-sum-exp and the logits grow by it).
- A tied Gemma (hidden 1024, vocabulary 32000, 2 layers, random weights) on `--seq` tokens;
  its final norm's γ scales the logits to the loss.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.runtime.methods.fused_ce import attach_fused_loss  # noqa: E402
from actdesign.runtime.ops.lm_loss import fused_linear_cross_entropy  # noqa: E402

LOSSES = (10.0, 1.0, 0.1, 0.01)
OFFSETS = (0.0, 30.0, 100.0)


def fit_scale(loss_of, target: float) -> float:
    """The factor a at which the float64 loss_of(a) is `target` (bisection in log a)."""
    lo, hi = 1e-3, 1e3
    rising = loss_of(hi) > loss_of(lo)
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        if (loss_of(mid) > target) == rising:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


def labels_for(logits, loss: float):
    """The most likely class (confidence sets a loss below log V), else a random one."""
    if loss < math.log(logits.shape[-1]):
        return logits.argmax(-1)
    return torch.randint(0, logits.shape[-1], logits.shape[:-1],
                         generator=torch.Generator().manual_seed(1))


def errors(got: dict, exact: dict):
    """(relative error of the loss, worst relative error in norm of the gradients)."""
    loss = abs(got["loss"].double().item() - exact["loss"].item()) / abs(exact["loss"].item())
    grads = max(float((got[n].double() - x).norm() / x.norm())
                for n, x in exact.items() if n != "loss")
    return loss, grads


def head_problem(loss: float, offset: float, tokens: int, d=64, vocab=4000):
    """float32 hidden states (tokens, d + 1) and head weight (vocab, d + 1) whose logits have
    a float64 mean loss `loss`, and the labels; the last feature adds `offset` to every logit
    (no change to the loss, but the log-sum-exp and the logits grow by it)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) / d**0.5
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    # toward the target's row (a margin that grows with the scale) or away from it
    sign = 1.0 if loss < math.log(vocab) else -1.0
    hidden = sign * weight[labels] + torch.randn(tokens, d, generator=g,
                                                 dtype=torch.float64) / (10 * d**0.5)
    a = fit_scale(lambda a: F.cross_entropy(a * hidden @ weight.T, labels).item(), loss)
    hidden = torch.cat([a * hidden, torch.ones(tokens, 1, dtype=torch.float64)], 1)
    weight = torch.cat([weight, torch.full((vocab, 1), offset, dtype=torch.float64)], 1)
    return hidden.float(), weight.float(), labels


def head_case(loss: float, offset: float, tokens: int, d=64, vocab=4000):
    """(exact, eager, fused) loss and gradients of a linear head, and the largest |logit|."""
    hidden, weight, labels = head_problem(loss, offset, tokens, d, vocab)

    def run(fn, h, w):
        h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        value = fn(h, w)
        value.backward()
        return {"loss": value.detach(), "hidden": h.grad, "weight": w.grad}

    def eager(h, w):
        return F.cross_entropy(h @ w.T, labels)

    exact = run(eager, hidden.double(), weight.double())
    largest = (hidden.double() @ weight.double().T).abs().max().item()
    fused = run(lambda h, w: fused_linear_cross_entropy(h, w, shift_labels=labels), hidden,
                weight)
    return exact, run(eager, hidden, weight), fused, largest


def tied_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                         vocab_size=32000, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return GemmaForCausalLM(config).train()


def model_run(model, ids, labels, float64=False):
    """The loss and parameter gradients: the model's own loss, or the float64 cross-entropy of
    its float64 logits (transformers' loss takes the logits to float32)."""
    model.zero_grad(set_to_none=True)
    if float64:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
    else:
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return {"loss": loss.detach()} | {n: p.grad for n, p in model.named_parameters()
                                      if p.grad is not None}


def gemma_cases(seq: int):
    base = tied_gemma()
    ids = torch.randint(1, 32000, (1, seq), generator=torch.Generator().manual_seed(2))
    exact_base = copy.deepcopy(base).double()
    with torch.no_grad():
        logits = exact_base(input_ids=ids).logits[:, :-1].flatten(0, 1)
    for loss in LOSSES:
        labels = torch.full_like(ids, -100)
        labels[:, 1:] = labels_for(logits, loss)
        a = fit_scale(lambda a, t=labels[0, 1:]: F.cross_entropy(a * logits, t).item(), loss)
        model, exact = copy.deepcopy(base), copy.deepcopy(exact_base)
        with torch.no_grad():
            for m in (model, exact):  # Gemma's norm multiplies by 1 + γ
                m.model.norm.weight.mul_(a).add_(a - 1)
        fused = copy.deepcopy(model)
        attach_fused_loss(fused)
        want = model_run(exact, ids, labels, float64=True)
        yield loss, want, model_run(model, ids, labels), model_run(fused, ids, labels), \
            a * logits.abs().max().item()
        del model, exact, fused


def print_row(row, case, loss, exact, eager, fused, largest):
    (el, eg), (fl, fg) = errors(eager, exact), errors(fused, exact)
    row([case, f"{exact['loss'].item():.3g}", f"{largest:.3g}", f"{el:.1e}", f"{fl:.1e}",
         f"{fl / el:.2f}" if el else "-", f"{eg:.1e}", f"{fg:.1e}",
         f"{fg / eg:.2f}" if eg else "-"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the linear head")
    parser.add_argument("--seq", type=int, default=16, help="tokens of the tied Gemma")
    args = parser.parse_args()
    header = ["case", "loss", "max |z|", "loss err eager", "fused", "fused/eager",
              "grad err eager", "fused", "fused/eager"]
    row = table(header, args.markdown, width=15, first=12)
    for loss in LOSSES:
        for offset in OFFSETS:
            exact, eager, fused, largest = head_case(loss, offset, args.tokens)
            print_row(row, f"head +{offset:.0f}", loss, exact, eager, fused, largest)
    for loss, exact, eager, fused, largest in gemma_cases(args.seq):
        print_row(row, "tied Gemma", loss, exact, eager, fused, largest)


if __name__ == "__main__":
    main()
