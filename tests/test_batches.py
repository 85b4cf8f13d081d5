"""The batch forms: every form reaches `calibrate`, `calibrate_policy` and `plan`'s loss read
one way (a tensor, a dict of keyword inputs, a tuple of positional inputs, an (inputs,
targets) pair), in float32 and under bfloat16 autocast; anything else is refused in one
line naming the forms."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import QLinear, calibrate, models
from actdesign.runtime.calibration.policy import calibrate_policy
from actdesign.runtime.models import batches


class Net(nn.Module):
    """A classifier taking one input, `x`: a pair is (inputs, targets) for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.act, self.b = QLinear(8, 32), nn.GELU(), QLinear(32, 5)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def square(model, x):
    return model(x).float().square().mean()


def stats_of(model, data, tmp_path, autocast, loss=None):
    """The calibration's C per layer (and the bits) for `data`, on a fresh model."""
    path = tmp_path / "stats.json"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        bits = calibrate(model, data, avg_bits=3, loss=loss, stats_path=path)
    return bits, [it["C"] for it in json.loads(path.read_text())["items"]]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_every_form_gives_the_calibration_of_its_explicit_loss(tmp_path, autocast):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 8, generator=g) for _ in range(3)]  # 2 rows: no longer unpacked
    ys = [torch.randint(0, 5, (2,), generator=g) for _ in range(3)]
    # The inputs alone: the mean square of the output, as the explicit loss computes it.
    want = stats_of(Net(), [(x,) for x in xs], tmp_path, autocast,
                    loss=lambda m, b: square(m, b[0]))
    assert all(c > 0 for c in want[1])
    for form in (xs, [(x,) for x in xs], [[x] for x in xs], [{"x": x} for x in xs]):
        assert stats_of(Net(), form, tmp_path, autocast) == want
    # A pair the forward cannot take whole: cross-entropy against the targets.
    pairs = list(zip(xs, ys, strict=True))
    want = stats_of(Net(), pairs, tmp_path, autocast,
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert stats_of(Net(), pairs, tmp_path, autocast) == want
    assert stats_of(Net(), [list(p) for p in pairs], tmp_path, autocast) == want


BAD = [("text", "got a str"), (None, "got None"), (3, "got a int"),
       ((torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)), "does not take this batch"),
       ({"y": torch.randn(2, 8)}, "does not take this batch"),
       ((torch.randn(2, 8), "labels"), "does not take this batch")]


@pytest.mark.parametrize("batch, says", BAD, ids=[s for _, s in BAD])
def test_other_forms_are_refused_in_one_line_naming_the_forms(batch, says):
    for run in (lambda: calibrate(Net(), [batch]),
                lambda: calibrate_policy(Net(), [batch], "fewbit3"),
                lambda: batches.loss(Net(), batch)):
        with pytest.raises(ActdesignError, match=says) as info:
            run()
        message = str(info.value)
        assert "\n" not in message and batches.FORMS in message


def test_one_batch_given_as_the_batches_is_refused():
    for one in (torch.randn(2, 8), {"x": torch.randn(2, 8)}):
        with pytest.raises(ActdesignError, match="one batch .* put it in a list"):
            calibrate(Net(), one)
    with pytest.raises(ActdesignError, match="not an iterable of batches"):
        calibrate(Net(), 3)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_calibrate_policy_takes_tensors_and_pairs(autocast):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=g) for _ in range(2)]
    ys = [torch.randint(0, 5, (16,), generator=g) for _ in range(2)]

    def plain():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 5))

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        alone = calibrate_policy(plain(), xs, "fewbit3+actnn2")
        paired = calibrate_policy(plain(), list(zip(xs, ys, strict=True)), "fewbit3+actnn2")
    # The activation sees the same inputs either way: the same table.
    def tables(result):
        return [(t.name, t.spec.borders, t.spec.levels, t.error) for t in result.tables]

    assert tables(alone) == tables(paired) and len(alone.tables) == 1
    assert set(alone.bits) == set(paired.bits) == {"0", "2"}


def test_a_transformers_batch_and_its_positional_pair():
    """A dict with labels gives the model's own loss; a tuple the forward takes whole is
    positional, not (inputs, targets)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # no dropout: equal outputs
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    assert torch.equal(batches.loss(model, {"input_ids": ids, "labels": ids}),
                       model(input_ids=ids, labels=ids).loss)
    assert torch.equal(batches.call(model, (ids,)).logits, model(ids).logits)
    # GPT-2's forward takes a second positional input: the pair is its positional inputs
    args, kwargs, targets = batches.parts(model, (ids, mask))
    assert targets is None and args == (ids, mask) and kwargs == {}
    assert models.call is batches.call  # the one reading, wherever batches are run
