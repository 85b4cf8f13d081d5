"""compress is idempotent and its reports are complete, on real tiny architectures: every
norm and activation of a kind a rule targets is replaced or left alone with the reason, a
refused gated MLP or head leaves its layers to the other rules in the same pass, norms of
other libraries are MS norms where their formula is one, and what is not a plain module is
refused."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import LeanLinear, MSLayerNorm, compress, models, ms_norm

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from lms import architecture, perturb_norms  # noqa: E402

ARCHITECTURES = ("BitNet", "FalconH1", "Nemotron", "Olmo", "Cohere2", "Bamba", "Bloom")


def trained(name):
    """The tiny model with its norms' parameters away from their initial values (Nemotron's
    γ = 1 + w from w = 0, as it trains)."""
    model = architecture(name)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "NemotronLayerNorm1P":
                m.weight.zero_()
    return perturb_norms(model)


def kinds(model):
    return [(n, type(m)) for n, m in model.named_modules()]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_compressing_twice_changes_nothing(name):
    model = trained(name)
    first = compress(model, "llm")
    before, state = kinds(model), {k: v.clone() for k, v in model.state_dict().items()}
    again = compress(model, "llm")
    assert again.replaced == [], str(again)
    assert str(again).splitlines()[0] == \
        f"compress (llm): already compressed: nothing to do ({len(again.skipped)} left alone)"
    assert kinds(model) == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    # what the second pass finds left alone, the first did too (a reason may name what
    # the first put in place)
    assert {n for n, _, _ in again.skipped} <= {n for n, _, _ in first.skipped}


@pytest.mark.parametrize("name", ["BitNet", "FalconH1"])
def test_a_refused_gated_mlp_leaves_its_layers_to_the_other_rules(name):
    """BitNet's MLP normalises h before down_proj, Falcon-H1's scales gate(x) and the output:
    no MS-GLU. Their layers and BitNet's sub-norm are compressed in the same pass."""
    model = trained(name)
    report = compress(model, "llm")
    skipped = {n: why for n, _, why in report.skipped}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp if name == "BitNet" else layer.feed_forward
        prefix = f"model.layers.{i}.{'mlp' if name == 'BitNet' else 'feed_forward'}"
        assert prefix in skipped
        assert all(type(p) is LeanLinear for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        if name == "BitNet":
            assert type(mlp.ffn_sub_norm).__name__ == "MSRMSNorm"


def in_report(report, name):
    """Whether the module at `name` has a line, or is part of a module replaced whole (a
    refused gated MLP's parts get their own lines)."""
    return name in {n for n, _, _ in report.skipped} or any(
        name == c.name or name.startswith(c.name + ".") for c in report.replaced)


def norms_and_activations(model, activations):
    """Module names of every norm, and of every activation when `activations`, found
    independently of compress: by class name, and transformers' activations module."""
    found = []
    for n, m in model.named_modules():
        cls = type(m)
        norm = "Norm" in cls.__name__ and not cls.__module__.startswith("torch.nn")
        act = cls.__module__ == "transformers.activations" or cls.__name__ == "BloomGelu"
        if norm or isinstance(m, nn.LayerNorm) or (activations and act):
            found.append(n)
    return found


CASES = [(name, "msnorm+fewbit3") for name in ARCHITECTURES if name != "BitNet"] + \
    [(name, "llm") for name in ("BitNet", "FalconH1", "Nemotron", "Olmo", "Cohere2", "Bamba")]


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_every_module_of_a_targeted_kind_has_a_line(name, policy):
    model = trained(name)
    targeted = norms_and_activations(model, "fewbit3" in policy)
    report = compress(model, policy)
    assert targeted
    missing = [n for n in targeted if not in_report(report, n)]
    assert not missing, str(report)
    assert all(why for _, _, why in report.skipped)


@pytest.mark.parametrize("name", ["Bamba", "FalconH1"])
def test_gated_norms_are_refused_with_the_reason(name):
    model = trained(name)
    report = compress(model, "llm")
    gated = {n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNormGated")}
    assert gated
    reasons = {n: why for n, _, why in report.skipped}
    for n in gated:
        assert "'gate'" in reasons[n] and "gated norm" in reasons[n], reasons.get(n)
        assert type(model.get_submodule(n)).__name__.endswith("RMSNormGated")


def grads_of(module, x, g):
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(g)
    return [y, x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize(("name", "cls", "unit_offset", "dtype"), [
    ("Nemotron", "NemotronLayerNorm1P", True, torch.float64),  # (x - mean)·rstd·(1 + w) + b
    ("Olmo", "OlmoLayerNorm", False, torch.float32),  # no parameters, eps 1e-5 in its code
    ("Cohere2", "Cohere2LayerNorm", False, torch.float32),  # eps as variance_epsilon
])
def test_other_layer_norms_are_ms_norms_computing_the_same(name, cls, unit_offset, dtype):
    model = trained(name)
    norm = next(m for m in model.modules() if type(m).__name__ == cls)
    ours = ms_norm(norm)
    assert type(ours) is MSLayerNorm and ours.unit_offset == unit_offset
    assert ours.weight is getattr(norm, "weight", None) and ours.bias is getattr(norm, "bias",
                                                                                   None)
    # The same function: in float64 its rounding only (a few 2^-52); OLMo's and Cohere's
    # norms compute in float32 whatever the input, so there float32's (torch's default
    # float32 tolerances).
    ref, ms = copy.deepcopy(norm).to(dtype), copy.deepcopy(ours).to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 64, generator=gen, dtype=torch.float64) * 2 + 0.3).to(dtype)
    g = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64).to(dtype)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    for a, b in zip(grads_of(ms, x, g), grads_of(ref, x, g), strict=True):
        torch.testing.assert_close(a, b, **tol)


def run_model(model, inputs, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@pytest.mark.parametrize("name", ["Nemotron", "Olmo", "Cohere2"])
def test_their_models_under_msnorm_train_as_the_untouched_ones(name):
    """As tests/test_llm.py checks the other architectures: in float32 the loss is bit for
    bit the model's and the gradients within float32 summation order. Under bf16 autocast the
    loss is as accurate as eager's against float64 (at most twice as far, as test_llm.py's
    autocast checks): the MS norm rounds x̂ to bf16 before γ·x̂ + β, Nemotron's own norm
    rounds x to bf16 before normalising."""
    model = trained(name)
    ours = copy.deepcopy(model)
    report = compress(ours, "msnorm")
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith(
        ("LayerNorm", "LayerNorm1P"))]
    assert {c.name for c in report.replaced} >= set(norms)
    assert all(type(ours.get_submodule(n)) is MSLayerNorm for n in norms)
    inputs = models.example_batch(model, 2, 16)
    loss0, grads0 = run_model(model, inputs)
    loss1, grads1 = run_model(ours, inputs)
    assert torch.equal(loss1, loss0)
    assert grads1.keys() == grads0.keys()
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)
    exact, _ = run_model(copy.deepcopy(model).double(), inputs)
    loss0, _ = run_model(model, inputs, autocast=True)
    loss1, _ = run_model(ours, inputs, autocast=True)
    assert (loss1.double() - exact).abs() <= 2 * (loss0.double() - exact).abs()


def test_bloom_gelu_is_gelu_tanh_and_xielu_is_left_alone_with_the_reason():
    model = trained("Bloom")
    report = compress(model, "fewbit3")
    gelus = {c.name: c.new for c in report.replaced if c.old == "BloomGelu"}
    assert gelus == {f"transformer.h.{i}.mlp.gelu_impl": "gelu_tanh 3-bit stepwise table"
                     for i in range(2)}
    x = torch.linspace(-6, 6, 101)
    bloom = transformers.models.bloom.modeling_bloom.BloomGelu()
    # its constants are sqrt(2/π) and 0.044715 to 8 digits: float32 rounding apart
    torch.testing.assert_close(model.transformer.h[0].mlp.gelu_impl(x), bloom(x), rtol=1e-6,
                               atol=1e-6)
    xielu = nn.Sequential(nn.Linear(4, 4), transformers.activations.XIELUActivation())
    report = compress(xielu, "fewbit3")
    assert report.replaced == []
    ((name, kind, why),) = report.skipped
    assert (name, kind) == ("1", "XIELUActivation")
    assert "computes no built-in activation" in why and "trainable parameters" in why
    assert type(xielu[1]) is transformers.activations.XIELUActivation


def test_a_refused_head_leaves_its_output_layer_to_the_linear_rule():
    """Gemma 2 soft-caps its logits, which the fused loss cannot: its head stays, exact and
    lean, in the first pass."""
    model = architecture("Gemma2")
    report = compress(model, "llm")
    ((why,),) = [[w for n, _, w in report.skipped if n == "(model)"]]
    assert "final_logit_softcapping" in why
    assert type(model.lm_head) is LeanLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert "already compressed" in str(compress(model, "llm"))


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


def test_what_is_not_a_plain_module_is_refused_in_one_line():
    x = torch.randn(2, 4)
    for model, says in ((None, "got None"), ("model.pt", "got a str"), (Small().forward,
                                                                         "got a method"),
                        (torch.jit.script(Small()), "TorchScript"),
                        (torch.jit.trace(Small(), x), "TorchScript")):
        for call in (compress, lambda m, p: compress(m, p, dry_run=True)):
            with pytest.raises(ActdesignError, match=says) as info:
                call(model, "fewbit3")
            assert "\n" not in str(info.value)
    # a scripted part of an eager model is left alone, with the reason; the rest compressed
    model = nn.Sequential(torch.jit.script(Small()), Small())
    report = compress(model, "fewbit3")
    assert [n for n, _, _ in report.skipped] == ["0"] and "TorchScript" in report.skipped[0][2]
    assert [c.name for c in report.replaced] == ["1.act"]


def test_a_policy_matching_nothing_says_so():
    report = compress(nn.Sequential(nn.Linear(4, 4)), "fewbit3")
    assert str(report) == \
        "compress (fewbit3): nothing to do: no module is of a kind the policy compresses\n" \
        "  matched nothing: rule 1, fewbit on activation (the model has no such module)"
    assert report.to_dict()["already_compressed"] == 0
