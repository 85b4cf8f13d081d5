"""The fused loss of `llm` adds what a model adds to its loss (a MoE router's load-balancing
loss), as the model's own forward adds it, however it is switched on; and refuses, at forward,
what a model does to its logits that the fused loss cannot follow."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, models
from actdesign.runtime.methods.fused_ce import attach_fused_loss
from actdesign.runtime.ops.lm_loss import FusedLossHead

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from lms import MOE, architecture  # noqa: E402

COEF = 0.5  # large, so that a dropped or doubled auxiliary loss cannot hide in a tolerance


def run(model, inputs, autocast=False, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("switch", ["call", "config-before", "config-after"])
@pytest.mark.parametrize("name", MOE)
def test_router_aux_loss_is_added_as_the_model_adds_it(name, switch, autocast):
    """Loss, auxiliary loss and every gradient as the untouched model's. In float32 the
    tolerances of the fused loss on any causal LM (test_llm.py): the forward before the head is
    exact, the cross-entropy sums in another order. Under autocast both products round to bf16
    in other orders, so the gradients are held to float64's instead: no further from it than
    twice the untouched model's own error, as for any fused loss under autocast."""
    model = architecture(name, router_aux_loss_coef=COEF)
    if switch == "config-before":
        model.config.output_router_logits = True
    ours = copy.deepcopy(model)
    inputs = models.example_batch(model, 2, 16)
    inputs["labels"][0, :3] = -100
    report = compress(ours, "llm", example_inputs=inputs)  # probed with the term on or off
    assert isinstance(ours.get_output_embeddings(), FusedLossHead), str(report)
    if switch == "config-after":
        model.config.output_router_logits = ours.config.output_router_logits = True
    kwargs = {"output_router_logits": True} if switch == "call" else {}
    out0, grads0 = run(model, inputs, autocast, **kwargs)
    out1, grads1 = run(ours, inputs, autocast, **kwargs)
    assert out1.logits is None  # never materialised
    assert out0.aux_loss is not None and torch.equal(out1.aux_loss, out0.aux_loss)
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-5, atol=0)
    assert grads1.keys() == grads0.keys()
    assert any("gate" in n or "router" in n for n in grads0)  # the router learns
    if not autocast:
        for n, g in grads1.items():
            torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)
        return
    exact = copy.deepcopy(model)
    exact.set_experts_implementation("eager")  # grouped_mm has no float64
    _, grads64 = run(exact.double(), inputs, **kwargs)
    for n, g in grads1.items():
        assert g.dtype == torch.float32
        x = grads64[n]
        assert (g.double() - x).norm() <= 2 * (grads0[n].double() - x).norm() + 1e-12, n


def bamba(z_loss):
    config = transformers.BambaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_chunk_size=8, z_loss_coefficient=z_loss)
    torch.manual_seed(0)
    return transformers.BambaForCausalLM(config).train()


def test_a_z_loss_on_the_logits_is_refused_at_forward():
    """Bamba adds z-loss, the logits' log-sum-exp squared, to its loss: the fused loss never
    has the logits, so that forward is refused, naming what it does; compress refuses it too
    when it can probe. Without the term the same model trains as it did."""
    if not hasattr(transformers, "BambaForCausalLM"):
        pytest.skip("this transformers has no Bamba")
    model = bamba(1e-3)
    inputs = models.example_batch(model, 2, 16)
    attach_fused_loss(model)  # no probe: the forward refuses
    with pytest.raises(ActdesignError, match=r"cannot follow this forward: it uses "
                                             r"logits\.logsumexp"):
        model(**inputs)
    probed = bamba(1e-3)
    report = compress(probed, "llm")  # probed on a batch of its own
    assert not isinstance(probed.lm_head, FusedLossHead)  # lean at most: it reads an MS norm
    assert any("logits.logsumexp" in why for _, _, why in report.skipped), str(report)
    plain = bamba(0.0)
    ours = copy.deepcopy(plain)
    compress(ours, "llm", example_inputs=inputs)
    assert isinstance(ours.lm_head, FusedLossHead)
    out0, grads0 = run(plain, inputs)
    out1, grads1 = run(ours, inputs)
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-5, atol=0)
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_loss_function_of_its_own_is_refused_at_forward():
    """A loss_function set on the model (label smoothing, say) is not the cross-entropy the
    fused loss computes."""
    model = architecture("Mixtral")
    compress(model, "llm")
    inputs = models.example_batch(model, 2, 16)

    def smoothed(logits, labels, vocab_size, **kwargs):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten(), label_smoothing=0.1)

    model.loss_function = smoothed
    with pytest.raises(ActdesignError, match="its loss_function is smoothed, not transformers' "
                                             "ForCausalLMLoss"):
        model(**inputs)
    del model._loss_function  # the model's own again
    assert model(**inputs).loss.isfinite()
