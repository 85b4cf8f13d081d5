"""Gradient bias against float64: does a policy's gradient under bf16 autocast differ from
eager's by more than rounding noise, batch after batch in the same direction?

    python benchmarks/gradient_bias.py [--markdown] [--batches 32] [--models llama,qwen2,gpt2]

Per batch i, against the float64 model's gradient: eager bf16 autocast's error e0_i, and a
variant's extra error d_i = e_i - e0_i. Independent noise averages out: |mean d| is about
sqrt(mean |d_i|² / n). The bias ratio |mean d| / sqrt(mean |d_i|² / n) is about 1 for noise
and grows with a part that is the same in every batch. t is the t statistic of d_i projected
on the mean float64 gradient (a bias along the descent direction shows there). Variants:

- control: eager in two micro-batches, rounding alone (the yardstick);
- one bf16 cast: eager whose norms' outputs are cast to bf16 once, so that their readers'
  input gradients are summed in bf16, as any model sharing a 16-bit tensor does;
- msnorm, llm: the policies;
- msnorm, x̂ first: the MS norms rounding x̂ to bf16 before the gain, the forward they had
  before they rounded as eager does (a staircase in γ: the bias this measures).

Models: the built-in tiny configs (2 layers, width 64), norm weights within 1 ± 0.01 and
biases ~ N(0, 0.1²), as trained norms have, dropout off; batches of 4 x 32 tokens drawn with
Zipf's frequencies, as text has them, so the gradient has a mean to align with.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

from actdesign.runtime import compress, models, norm_ops  # noqa: E402


def near_one(model, spread=0.01, seed=0):
    """Norm weights within 1 ± spread (w within ±spread where γ = 1 + w), biases ~ N(0, 0.1²):
    as trained norms have. Dropout off, so that runs compare."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
            if type(m).__name__.endswith(("LayerNorm", "RMSNorm")):
                w, b = getattr(m, "weight", None), getattr(m, "bias", None)
                if isinstance(w, torch.Tensor):
                    offset = 0.0 if float(w.float().mean()) == 0.0 else 1.0  # 1 + w from 0
                    w.copy_(offset + spread * (2 * torch.rand(w.shape, generator=g) - 1))
                if isinstance(b, torch.Tensor):
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def zipf_batches(vocab, n, shape=(4, 32), seed=1):
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab)
    return [1 + torch.multinomial(zipf, shape[0] * shape[1], replacement=True,
                                  generator=gen).view(shape) for _ in range(n)]


def gradient(model, batch, dtype=None, micro=1):
    """The parameter gradient of the mean loss over `batch` (float64 for the reference, bf16
    autocast otherwise), in `micro` micro-batches."""
    model.zero_grad()
    for part in batch.chunk(micro):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
            loss = model(input_ids=part, labels=part).loss
        (loss * len(part) / len(batch)).backward()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def bias_ratio(extra):
    """|mean of the per-batch extra errors| over what independent noise gives."""
    n = len(extra)
    mean = torch.stack(extra).mean(0)
    noise = math.sqrt(sum(float(e.square().sum()) for e in extra) / n / n)
    return float(mean.norm()) / noise if noise else 0.0  # no extra error at all


def projected_t(extra, direction):
    """The t statistic of the extra errors projected on `direction` (a unit vector)."""
    p = torch.stack([e @ direction for e in extra])
    spread = float(p.std())
    return float(p.mean()) / (spread / math.sqrt(len(p))) if spread else 0.0


def one_bf16_cast(model):
    """Eager, with every norm's output cast to bf16 once under autocast (its readers then
    share one bf16 tensor and their input gradients are summed in bf16)."""
    for m in model.modules():
        if type(m).__name__.endswith(("LayerNorm", "RMSNorm")):
            m.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16)
                                    if torch.is_autocast_enabled("cpu") else out)
    return model


@contextlib.contextmanager
def xhat_first():
    """MS norms that round x̂ to the output dtype before the gain (their former forward)."""
    ops = norm_ops()
    keeps_output = ops.keeps_output
    ops.keeps_output = lambda *args, **kwargs: False
    try:
        yield
    finally:
        ops.keeps_output = keeps_output


def bias_of(build, make, batches=16, micro=1):
    """(bias ratio, t) of the model `make(build())` makes (None: eager in `micro`
    micro-batches) over eager bf16 autocast, against float64."""
    reference = near_one(build()).double().train()
    eager = near_one(build()).train()
    variant = near_one(build()).train() if make else eager
    data = zipf_batches(eager.config.vocab_size, batches)
    if make:
        make(variant, data[0])
    extra, grads = [], []
    for batch in data:
        exact = gradient(reference, batch, torch.float64)
        base = gradient(eager, batch) - exact
        extra.append(gradient(variant, batch, micro=micro) - exact - base)
        grads.append(exact)
    direction = torch.stack(grads).mean(0)
    return bias_ratio(extra), projected_t(extra, direction / direction.norm())


def policy(name):
    def make(model, batch):
        compress(model, name, example_inputs={"input_ids": batch, "labels": batch},
                 allow_more=True)
    return make


# name -> (what makes the variant from eager, micro-batches, the context it runs in)
VARIANTS = {"control (2 micro-batches)": (None, 2, contextlib.nullcontext),
            "one bf16 cast": (lambda model, batch: one_bf16_cast(model), 1,
                              contextlib.nullcontext),
            "msnorm": (policy("msnorm"), 1, contextlib.nullcontext),
            "llm": (policy("llm"), 1, contextlib.nullcontext),
            "msnorm, x̂ first": (policy("msnorm"), 1, xhat_first)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--models", default="llama,qwen2,gpt2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.batches} batches of 4 x 32 tokens; torch {torch.__version__}, one thread")
    row = table(["model", "variant", "bias ratio", "t along the gradient"], args.markdown,
                width=22, first=34)
    for name in args.models.split(","):
        def build(name=name):
            return models.build(f"{name}-tiny")[0]
        for variant, (make, micro, context) in VARIANTS.items():
            with context():
                ratio, t = bias_of(build, make, args.batches, micro)
            same = ratio == 0.0  # eager's gradient, bit for bit: no extra error to test
            row([f"{name}-tiny", variant, "none" if same else f"{ratio:.2f}",
                 "–" if same else f"{t:+.2f}"])


if __name__ == "__main__":
    main()
