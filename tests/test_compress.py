"""compress on plain torch models: what is replaced, exactness, idempotence, weights kept,
refusals listed, and the byte accounting against an independent saved-tensor count."""

import copy

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import (
    MSLayerNorm,
    PooledConv2d,
    QConv2d,
    QLinear,
    QMSLayerNorm,
    SparseLinear,
    account,
    compress,
)


class Block(nn.Module):
    """Pre-norm MLP block with a residual, and a final norm feeding a head."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = x + self.down(self.act(self.up(self.norm(x))))
        return self.head(self.final(x))


def block(dtype=torch.float64):
    torch.manual_seed(0)
    model = Block().to(dtype)
    with torch.no_grad():  # non-trivial affine, so a γ or β handled wrong shows
        for norm in (model.norm, model.final):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return model


def test_fewbit_msnorm_actnn_replace_and_keep_the_forward():
    model = block()
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    ref = model(x)
    weights = {id(p) for p in model.parameters() if p.dim() == 2}
    report = compress(model, "fewbit3+msnorm+actnn2", example_inputs=(x,))
    assert {c.name for c in report.replaced} == {"norm", "up", "act", "down", "final", "head"}
    # Every reader of each norm is quantized, so the norm keeps codes of its output in place
    # of the output, and its readers keep those codes.
    assert type(model.norm) is QMSLayerNorm and type(model.final) is QMSLayerNorm
    assert model.norm.bits == model.final.bits == 2
    assert all(type(m) is QLinear and m.bits == 2 for m in (model.up, model.down, model.head))
    assert type(model.act).__module__.startswith("actdesign_ops_")
    assert weights == {id(p) for p in model.parameters() if p.dim() == 2}  # kept, not copied
    # The MS norm and the few-bit forward are exact up to float64 rounding.
    torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)
    out = model(x.requires_grad_())
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


def test_compress_is_idempotent():
    model = block()
    x = torch.randn(2, 16, dtype=torch.float64)
    compress(model, "fewbit3+msnorm+actnn2", example_inputs=(x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = list(model.modules())
    again = compress(model, "fewbit3+msnorm+actnn2", example_inputs=(x,))
    assert again.replaced == [] and again.skipped == []
    assert list(model.modules()) == modules
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_first_matching_rule_wins_and_keep_excludes():
    model = block()
    policy = {"rules": [
        {"target": "linear", "name": "head", "apply": "keep"},
        {"target": "linear", "name": "up", "apply": "backrazor", "ratio": 0.5},
        {"target": "linear", "apply": "actnn", "bits": 4},
        {"target": "activation", "type": "ReLU", "apply": "fewbit"}]}
    report = compress(model, policy)
    assert type(model.head) is nn.Linear
    assert isinstance(model.up, SparseLinear) and model.up.ratio == 0.5
    assert isinstance(model.down, QLinear) and model.down.bits == 4
    assert type(model.act) is nn.GELU  # the activation rule names another class
    assert [c.name for c in report.replaced] == ["up", "down"]


def test_norms_without_a_probe_are_listed_not_guessed():
    model = block()
    report = compress(model, "msnorm")
    assert type(model.norm) is nn.LayerNorm
    assert {n for n, _, _ in report.skipped} == {"norm", "final"}
    assert all("example_inputs" in why for _, _, why in report.skipped)
    assert report.before is None


def test_affine_free_norm_needs_no_probe():
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 2))
    compress(model, "msnorm")
    assert isinstance(model[0], MSLayerNorm)


class PostNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin, self.tail = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.norm(x)
        return y + self.lin(y)  # the norm's output also feeds the residual


class SharedReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.norm(x)) + self.lin(x)  # the Linear also reads x itself


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.out = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.norm(self.emb(ids)))


class Returned(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.norm(x)
        return self.lin(y), y


class Sliced(nn.Module):
    """Views that keep each row: the readers' rebuild stays exact, so sharing is allowed."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        y = self.norm(x).view(-1, x.shape[-1])
        return self.lin(y[1:, :])


class Permuted(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(self.norm(x)[..., torch.arange(7, -1, -1)])


@pytest.mark.parametrize("cls, inputs, why", [
    (PostNorm, torch.randn(2, 8), "read by add() outside a Linear"),
    (Returned, torch.randn(2, 8), "model output"),
    (Permuted, torch.randn(2, 8), "read by __getitem__() outside a Linear"),
])
def test_norms_whose_output_has_other_uses_are_left_alone(cls, inputs, why):
    """An MS norm emits its output in the dtype its Linear readers compute in, so it replaces
    a norm only where nothing else reads the output."""
    torch.manual_seed(0)
    model = cls()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    ref = model(inputs)
    report = compress(model, "msnorm", example_inputs=(inputs,))
    assert type(model.norm) is nn.LayerNorm
    ((name, kind, reason),) = report.skipped
    assert (name, kind) == ("norm", "LayerNorm") and why in reason
    out = model(inputs)
    for a, b in zip(ref if isinstance(ref, tuple) else (ref,),
                    out if isinstance(out, tuple) else (out,), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls, inputs", [(SharedReader, torch.randn(2, 8)),
                                         (Tied, torch.tensor([[1, 2, 3]]))])
def test_readers_called_on_other_inputs_and_tied_readers_share_exactly(cls, inputs):
    torch.manual_seed(0)
    model = cls().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    inputs = inputs.double() if inputs.is_floating_point() else inputs
    ours = copy.deepcopy(model)
    report = compress(ours, "msnorm", example_inputs=(inputs,))
    assert isinstance(ours.norm, MSLayerNorm) and not report.skipped
    if cls is Tied:
        assert ours.out.weight is ours.emb.weight
    for m in (model, ours):
        m(inputs).square().sum().backward()
    torch.testing.assert_close(ours(inputs), model(inputs), rtol=1e-12, atol=1e-12)
    for (n, a), (_, b) in zip(model.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=n)


def test_row_views_share_exactly():
    torch.manual_seed(0)
    model = Sliced().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-1, 1)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    ref = model(x)
    compress(model, "msnorm", example_inputs=(x,))
    assert isinstance(model.norm, MSLayerNorm)
    torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)


def test_unhandled_modules_are_listed_with_reasons():
    model = nn.Sequential(nn.ELU(alpha=2.0), nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                          nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True))
    report = compress(model, "fewbit3+actnn2")
    reasons = {name: why for name, _, why in report.skipped}
    assert set(reasons) == {"0"} and "match no built-in" in reasons["0"]
    assert isinstance(model[1], QConv2d) and isinstance(model[2], QConv2d)
    assert type(model[0]) is nn.ELU
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    model(x).sum().backward()


def test_specs_for_another_activation_are_refused(make_spec):
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU())
    report = compress(model, {"rules": [{"target": "activation", "apply": "fewbit",
                                         "spec": make_spec("gelu", 3)}]})
    ((_, _, why),) = report.skipped
    assert "for 'gelu'" in why and "computes silu" in why
    report = compress(model, {"rules": [{"target": "activation", "apply": "fewbit",
                                         "spec": "regelu2"}]})
    assert "for 'gelu'" in report.skipped[0][2]
    report = compress(nn.Sequential(nn.GELU()), {"rules": [
        {"target": "activation", "apply": "fewbit", "spec": "regelu2"}]})
    assert "needs a stepwise spec" in report.skipped[0][2]


def test_shared_module_is_replaced_everywhere_and_pooled_conv():
    act = nn.GELU()
    model = nn.Sequential(nn.Conv2d(2, 4, 3), act, nn.Conv2d(4, 4, 3), act)
    compress(model, "fewbit3+pooled2")
    assert model[1] is model[3] and type(model[1]).__module__.startswith("actdesign_ops_")
    assert isinstance(model[0], PooledConv2d) and model[0].p == 2


def test_the_model_itself_is_not_replaced():
    report = compress(nn.GELU(), "fewbit3")
    assert report.skipped[0][0] == "(model)" and "container" in report.skipped[0][2]


def test_report_bytes_match_an_independent_count(saved):
    model = block(torch.float32)
    x = torch.randn(8, 16)
    report = compress(model, "fewbit3+msnorm", example_inputs=(x,))
    params = list(model.parameters())
    assert report.after.total == sum(saved(model, x, params).values())
    text = str(report)
    assert "saved for backward on the probe input" in text and "less" in text
    assert report.to_dict()["probe_saved_bytes"]["after"] == report.after.total
    baseline = block(torch.float32)
    assert report.before.total == sum(saved(baseline, x, list(baseline.parameters())).values())
    by_module, _ = account(model, lambda: model(x))
    assert sum(by_module.by_module.values()) == by_module.total == report.after.total
    # With an input that needs its gradient the norm saves y, and the Linear reading it saves
    # that very storage: it is charged once, to the norm.
    by_module, _ = account(model, lambda: model(x.requires_grad_()))
    assert by_module.by_module["norm"] > 0 and "up" not in by_module.by_module


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ActdesignError, match="unknown policy"):
        compress(block(), "fewbit7")


def test_compressed_linear_output_takes_in_place_ops():
    """The output is not a view, so an inplace activation after the layer works."""
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(inplace=True))
    compress(model, "backrazor90")
    x = torch.randn(4, 3, 16, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.shape == x.shape


def test_actnn_allocation_file_sets_bits_per_layer(tmp_path):
    (tmp_path / "bits.json").write_text('{"format": "actdesign.bits/1", "bits": {"up": 5}}')
    model = block()
    compress(model, {"rules": [{"target": "linear", "apply": "actnn", "bits": 3,
                                "allocation": str(tmp_path / "bits.json")}]})
    assert (model.up.bits, model.down.bits, model.head.bits) == (5, 3, 3)
    (tmp_path / "per_sample.json").write_text('{"format": "actdesign.bits/1", '
                                              '"bits": {"up": [1, 2]}}')
    with pytest.raises(ActdesignError, match="one integer in 1..8"):
        compress(block(), {"rules": [{"target": "linear", "apply": "actnn",
                                      "allocation": str(tmp_path / "per_sample.json")}]})


@pytest.mark.parametrize("policy", ["fewbit3", "actnn2"])
def test_generated_ops_keep_torch_thread_count(policy):
    """numba's parallel loops must not undo a user's torch.set_num_threads."""
    import os
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from torch import nn; from actdesign.runtime import compress\n"
            "m = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 2))\n"
            f"compress(m, {policy!r})\n"
            "m(torch.randn(16, 128, 64, requires_grad=True)).sum().backward()\n"
            "print(torch.get_num_threads())\n")
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    assert out.split() == ["1"]


@pytest.mark.parametrize("policy", ["fewbit3+msnorm", "fewbit3+msnorm+actnn2"])
def test_torch_transformer_layers_run_every_path(policy):
    # nn.TransformerEncoderLayer's inference path reads its norms' weights and biases
    # itself: the MS norms hold the originals'.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                       norm_first=True, activation="gelu")
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    ours = copy.deepcopy(model)
    x = torch.randn(2, 10, 32)
    report = compress(ours, policy, example_inputs=x)
    assert len(ms_norms(ours)) == 2, str(report)  # norm2 of each layer, read by linear1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                   ours.state_dict().values(), strict=True))
    for mode in ("eval", "train"):
        model.train(mode == "train")
        ours.train(mode == "train")
        with torch.no_grad():  # in eval: the fused inference path, with the norms' affine
            torch.testing.assert_close(ours(x), model(x), rtol=1e-5, atol=1e-5)
    y = ours(x)
    y.square().mean().backward()
    assert all(p.grad is not None for p in ours.parameters() if p.requires_grad), str(report)
    # bf16 weights, inference path: the same kernels on the same parameters.
    model.eval()
    ours.eval()
    with torch.no_grad():
        assert torch.equal(ours.bfloat16()(x.bfloat16()), model.bfloat16()(x.bfloat16()))


def ms_norms(model):
    return [m for m in model.modules() if isinstance(m, MSLayerNorm)]


def test_a_norm_whose_reader_the_policy_keeps_is_left_alone():
    """A reader kept as it is would keep the norm's output itself, beside the MS norm's x̂."""
    model = block()
    policy = {"format": "actdesign.policy/1",
              "rules": [{"target": "linear", "name": "up", "apply": "keep"},
                        {"target": "norm", "apply": "msnorm"}]}
    report = compress(model, policy, example_inputs=(torch.randn(2, 16, dtype=torch.float64),))
    assert type(model.norm) is nn.LayerNorm and isinstance(model.final, MSLayerNorm)
    assert ("norm", "LayerNorm", "up, reading it, is kept as it is by the policy") in \
        report.skipped
