"""compress, profile and calibrate on transformers models built tiny from configs (random
weights, nothing downloaded): GPT-2, LLaMA, BERT and ViT."""

import copy
import json

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import MSLayerNorm, MSRMSNorm, account, compress, models
from actdesign.runtime.calibration.policy import calibrate_policy
from actdesign.runtime.memory.profile import PRECISIONS, profile

transformers = pytest.importorskip("transformers")

ARCHS = ["gpt2-tiny", "llama-tiny", "bert-tiny", "vit-tiny"]
# Norms an MS norm does not replace, and why: BERT is post-norm (every norm output also feeds
# a residual or dropout) except the last one, read only by the MLM head's decoder, tied to the
# embedding (a tied reader shares x̂ as any other: GPT-2's final norm too).
REFUSED = {
    "gpt2-tiny": {},
    "llama-tiny": {},
    "bert-tiny": {"bert.embeddings.LayerNorm": "dropout",
                  "bert.encoder.layer.0.attention.output.LayerNorm": "add",
                  "bert.encoder.layer.0.output.LayerNorm": "add",
                  "bert.encoder.layer.1.attention.output.LayerNorm": "add"},
    "vit-tiny": {},
}


def build(name, dtype=torch.float64):
    model, _ = models.build(name)
    return model.to(dtype).eval()  # eval: dropout off, so two forwards are comparable


def batch(model, n=2, seq=12, seed=0):
    inputs = models.example_batch(model, n, seq, seed=seed)
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def logits(model, inputs):
    return model(**inputs).logits


@pytest.mark.parametrize("name", ARCHS)
def test_fewbit_msnorm_keeps_the_forward_and_trains(name):
    model = build(name)
    inputs = batch(model)
    ref = logits(model, inputs)
    before = {type(m).__name__ for m in model.modules()}
    act2cls = dict(transformers.activations.ACT2CLS)
    report = compress(model, "fewbit3+msnorm")
    skipped = {n: why for n, _, why in report.skipped}
    assert set(skipped) == set(REFUSED[name])
    assert all(REFUSED[name][n] in why for n, why in skipped.items())
    norms = [m for m in model.modules() if isinstance(m, MSLayerNorm | MSRMSNorm)]
    acts = [m for m in model.modules() if type(m).__module__.startswith("actdesign_ops_")]
    assert len(norms) == sum(c.new.startswith("MS") for c in report.replaced) > 0
    assert len(acts) >= 2
    # Sharing is exact and a table's forward is the activation itself: float64 round-off,
    # except that LlamaRMSNorm normalises in float32 even in a float64 model (a few float32
    # ulps of each logit's scale).
    scale = ref.abs().max().item()
    tol = 64 * torch.finfo(torch.float32).eps if name == "llama-tiny" else 1e-12
    torch.testing.assert_close(logits(model, inputs), ref, rtol=0, atol=tol * scale)
    again = compress(model, "fewbit3+msnorm")  # idempotent: nothing new to replace
    assert again.replaced == [] and {n for n, _, _ in again.skipped} == set(REFUSED[name])
    model.train()
    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad and p.grad is not None)
    # The library's own activation table is untouched: a new model gets its classes again.
    fresh = {type(m).__name__ for m in build(name).modules()}
    assert fresh == before
    assert all(v is transformers.activations.ACT2CLS[k] for k, v in act2cls.items())


@pytest.mark.parametrize("name", ARCHS)
def test_exact_sparse_copy_gives_exact_gradients(name):
    """Back Razor keeping 100% of the input restores x exactly: every gradient must match the
    uncompressed model's, which checks the Linear/Conv1D/Conv2d wrappers' math in float64."""
    model = build(name)
    inputs = batch(model)
    ref = copy.deepcopy(model)
    report = compress(model, {"rules": [{"target": t, "apply": "backrazor", "ratio": 0.0}
                                        for t in ("linear", "conv2d")]},
                      allow_more=True)  # every value and its index: more than the input
    assert len(report.replaced) >= 8 and not report.skipped
    for m in (model, ref):
        m(**inputs).loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", ARCHS)
def test_actnn_and_backrazor_train(name):
    for policy in ("actnn2", "backrazor90"):
        model = build(name, torch.float32).train()
        compress(model, policy)
        loss = model(**models.example_batch(model, 2, 12)).loss
        loss.backward()
        assert torch.isfinite(loss)


@pytest.mark.parametrize("name", ARCHS)
def test_accounting_matches_the_saved_tensor_hooks(name, saved):
    model = build(name, torch.float32).train()
    compress(model, "fewbit3+msnorm")
    inputs = models.example_batch(model, 2, 12)
    torch.manual_seed(0)
    ours, _ = account(model, lambda: model(**inputs).loss)
    torch.manual_seed(0)
    # Parameters and buffers (BERT's token_type_ids) are model state, not activations.
    state = [*model.parameters(), *model.buffers()]
    theirs = saved(lambda x: model(**x).loss, inputs, state)
    assert ours.total == sum(theirs.values()) > 0
    assert sum(ours.by_module.values()) == ours.total


@pytest.mark.parametrize("name", ARCHS)
def test_profile_reports_a_saving(name):
    result = profile(name, "fewbit3+msnorm+actnn2", batch=2, seq=16, repeats=1)
    data = result.to_dict()
    assert data["compressed"]["saved_bytes"] < data["baseline"]["saved_bytes"]
    assert data["baseline"]["saved_bytes"] == sum(data["baseline"]["saved_by_module"].values())
    assert 0 < data["saved_ratio"] < 1 and data["time_ratio"] > 0
    json.dumps(data)
    table = result.table()
    assert "total" in table and "step time" in table


def test_profile_precisions():
    """bf16 weights and inputs save the least; autocast also keeps the bf16 copies of the
    weights it casts, which at this tiny shape outweigh the activations it halves."""
    results = {p: profile("llama-tiny", "fewbit3+msnorm+actnn2", batch=2, seq=16, repeats=1,
                          precision=p).to_dict() for p in PRECISIONS}
    assert profile("llama-tiny", "none", batch=1, seq=4, repeats=1).precision == "fp32"
    fp32, autocast, bf16 = (results[p] for p in ("fp32", "bf16-autocast", "bf16"))
    assert [r["precision"] for r in results.values()] == list(PRECISIONS)
    assert bf16["baseline"]["saved_bytes"] < min(autocast["baseline"]["saved_bytes"],
                                                 fp32["baseline"]["saved_bytes"])
    for r in results.values():
        assert 0 < r["saved_ratio"] < 1
    with pytest.raises(ActdesignError, match="precision must be one of"):
        profile("llama-tiny", "none", precision="fp16")


@pytest.mark.parametrize("name", ARCHS)
def test_calibrated_policy_beats_the_normal_table_and_compresses(name, tmp_path):
    model = build(name, torch.float32)
    batches = [models.example_batch(model, 2, 12, seed=s) for s in range(2)]
    result = calibrate_policy(model, batches, "fewbit3+actnn2")
    assert result.tables and result.bits
    for t in result.tables:  # each layer's own table is optimal under its own density
        assert t.error <= t.error_normal * (1 + 1e-9)
    path = tmp_path / "policy.json"
    path.write_text(result.policy.to_json())
    report = compress(model, str(path))
    assert not [s for s in report.skipped if "tied" not in s[2]]
    assert model(**batches[0]).loss.isfinite()
