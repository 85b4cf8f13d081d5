"""LoRA fine-tuning through PEFT: `compress` on a PeftModel trains as PEFT alone does (the same
gradients, dropout masks and trajectory), keeps the adapters' names and meaning (a saved
adapter loads onto the untouched base), keeps almost nothing for the adapters' path, and
refuses, with the reason, what it cannot do exactly. Real PEFT, no mocks."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from actdesign.errors import ActdesignError
from actdesign.runtime import account, compress, models

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from lms import perturb_norms  # noqa: E402

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(name="llama-tiny", dtype=torch.float32, b_std=0.05, seed=0, **config):
    """A tiny random causal LM with LoRA adapters; B drawn (not PEFT's zeros), so that every
    adapter gradient is nonzero and a wrong one shows."""
    model = perturb_norms(models.build(name, seed=seed)[0]).to(dtype).train()
    settings = dict(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=SEVEN)
    model = peft.get_peft_model(model, peft.LoraConfig(**{**settings, **config}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    return model


def batch(model, seq=16):
    return models.example_batch(model, 2, seq)


def step(model, inputs, seed=3, autocast=False):
    """(loss, {name: gradient}) of one forward and backward, dropout drawn from `seed`."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(ours, theirs, inputs, *, rtol, autocast=False):
    """The loss within rtol, and every gradient within rtol of its norm."""
    (loss1, grads1), (loss0, grads0) = step(ours, inputs, autocast=autocast), \
        step(theirs, inputs, autocast=autocast)
    torch.testing.assert_close(loss1, loss0, rtol=rtol, atol=0)
    assert grads1.keys() == grads0.keys() and grads0
    for n, g in grads0.items():
        assert (grads1[n] - g).float().norm() <= rtol * g.float().norm(), n


def lean_layers(model):
    return [n for n, m in model.named_modules() if "forward" in m.__dict__
            and type(m.__dict__["forward"]).__name__ == "LeanLoRA"]


# --- exactness ------------------------------------------------------------------------------

def test_llm_on_a_peft_model_gives_peft_s_loss_and_gradients_with_dropout():
    """fp32, dropout 0.1, LoRA on all seven projections. The roundings differ from PEFT's
    only where the fused loss and the MS norms sum in another order: a few float32 ulps
    (seen: about 1e-7), so 1e-5 on the loss and 1e-4 on each gradient."""
    model = lora_model()
    ours = copy.deepcopy(model)
    report = compress(ours, "llm")
    assert not report.skipped
    assert len(lean_layers(ours)) == 14
    assert list(ours.state_dict()) == list(model.state_dict())
    assert_same_step(ours, model, batch(model), rtol=1e-5)


def test_twenty_steps_of_adamw_follow_peft_s_trajectory():
    model = lora_model()
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    inputs = batch(model)
    runs = []
    for m in (model, ours):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3,
                                weight_decay=0.1)
        torch.manual_seed(7)  # one generator stream for all 20 steps' dropout masks
        losses = []
        for _ in range(20):
            loss = m(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((torch.tensor(losses, dtype=torch.float64),
                     {n: p.detach() for n, p in m.named_parameters() if "lora_" in n}))
    (losses0, params0), (losses1, params1) = runs
    assert losses0[-1] < losses0[0] - 0.05  # it trains
    torch.testing.assert_close(losses1, losses0, rtol=1e-5, atol=0)
    for n, p in params0.items():
        assert (params1[n] - p).norm() <= 1e-4 * p.norm(), n


@pytest.mark.parametrize("config", [
    dict(r=4, lora_alpha=32, lora_dropout=0.0),
    dict(r=16, lora_alpha=8, use_rslora=True, lora_dropout=0.2),
    dict(target_modules=["q_proj", "v_proj"], lora_dropout=0.05),
    dict(target_modules=["down_proj", "o_proj"], lora_bias=True),
], ids=["no-dropout", "rslora", "q-v-only", "down-o-with-bias"])
def test_lora_settings_train_as_peft(config):
    model = lora_model(**config)
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    assert lean_layers(ours)
    assert_same_step(ours, model, batch(model), rtol=1e-5)


def test_gpt2_conv1d_layers_with_fan_in_fan_out():
    model = lora_model("gpt2-tiny", target_modules=["c_attn", "c_proj", "c_fc"],
                       fan_in_fan_out=True)
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    assert len(lean_layers(ours)) == 8
    assert_same_step(ours, model, batch(model), rtol=1e-5)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_bf16_weights_under_autocast_are_peft_bit_for_bit(dropout):
    """bf16 weights, float32 adapters (PEFT's default), autocast: the adapter path runs
    PEFT's own ops with the same mask, bit for bit. With MS norms the forward is still bit
    for bit (they emit what the eager norms emit); their backward rounds once in float32
    where eager rounds each op to bf16, so the gradients move: all together, by less than
    bf16 moves eager's from float32's. Without dropout the lean path skips PEFT's cast of x
    to float32, which A's product casts back: the same bits."""
    model = lora_model(dtype=torch.bfloat16, lora_dropout=dropout)
    inputs = batch(model)
    lean = copy.deepcopy(model)
    compress(lean, {"rules": [{"target": "linear", "apply": "lean"}]})
    assert len(lean_layers(lean)) == 14
    (loss1, grads1), (loss0, grads0) = (step(m, inputs, autocast=True) for m in (lean, model))
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())
    shared = copy.deepcopy(model)
    compress(shared, "msnorm")
    assert len(lean_layers(shared)) == 10  # the norms' readers
    loss2, grads2 = step(shared, inputs, autocast=True)
    assert torch.equal(loss2, loss0)
    _, exact = step(copy.deepcopy(model).float(), inputs)
    ours = torch.cat([(grads2[n] - g).float().flatten() for n, g in grads0.items()])
    bf16 = torch.cat([(g.float() - exact[n]).flatten() for n, g in grads0.items()])
    assert ours.norm() < bf16.norm()


def test_bf16_adapters_on_bf16_weights():
    """Adapters in bf16 (autocast_adapter_dtype=False), no autocast: bf16 roundings, in
    PEFT's order. The fused loss sums in float32 where eager rounds to bf16, so the
    gradients differ by bf16 roundings (eps 2^-8): 2e-2 of each gradient's norm."""
    model = lora_model(dtype=torch.bfloat16)
    model = peft.get_peft_model(perturb_norms(models.build("llama-tiny")[0]).to(torch.bfloat16),
                                peft.LoraConfig(r=8, target_modules=SEVEN, lora_dropout=0.1),
                                autocast_adapter_dtype=False)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    assert_same_step(ours, model, batch(model), rtol=2e-2)


def test_fp32_weights_under_autocast_stay_within_bf16_s_own_noise():
    """fp32 weights under autocast: an MS norm emits bf16 (what its Linear readers cast to
    anyway), rounding x̂ and then x̂·γ, where the eager norm emits float32, which PEFT's
    dropout scales before its own cast to bf16. Roundings of bf16 apart, then: the loss and
    all gradients together move from eager's by less than autocast moves eager's from
    float32's."""
    model = lora_model()
    inputs = batch(model)
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    (loss1, grads1), (loss0, grads0) = (step(m, inputs, autocast=True) for m in (ours, model))
    loss, exact = step(model, inputs)
    assert (loss1 - loss0).abs() < (loss0 - loss).abs()
    moved = torch.cat([(grads1[n] - g).flatten() for n, g in grads0.items()])
    noise = torch.cat([(g - exact[n]).flatten() for n, g in grads0.items()])
    assert moved.norm() < noise.norm()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_replays_the_same_masks(reentrant):
    """Checkpointing runs each layer's forward again before its backward, from the same
    generator state; the reentrant kind runs the first forward without gradients (PEFT's own
    forward then), the lean path in the second."""
    model = lora_model()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    assert_same_step(ours, model, batch(model), rtol=1e-5)


@pytest.mark.parametrize("preset", ["llm+actnn2", "llm+fewbit3"])
def test_lossy_presets_compose(preset):
    """The forward stays exact; every LoRA layer takes the lean path. Under ActNN the layers
    reading a norm keep its shared codes of x̂; o_proj keeps attention's output, which
    attention keeps anyway, and down_proj MS-GLU's g and u: no codes of their own. (ActNN
    draws its rounding from the generator, as dropout draws its masks: with LoRA dropout on,
    the later masks would be other draws than the untouched model's, so it is off here.)"""
    model = lora_model(lora_dropout=0.1 if preset == "llm+fewbit3" else 0.0)
    ours = copy.deepcopy(model)
    report = compress(ours, preset)
    assert len(lean_layers(ours)) == 14 and not report.skipped
    coded = {c.name.rsplit(".", 1)[1] for c in report.replaced if "2-bit codes" in c.new
             and c.old == "lora.Linear"}
    assert coded == ({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
                     if preset == "llm+actnn2" else set())
    (loss1, grads1), (loss0, grads0) = (step(m, batch(model)) for m in (ours, model))
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=0)
    assert grads1.keys() == grads0.keys()
    assert all(torch.isfinite(g).all() for g in grads1.values())


def test_actnn_codes_reach_only_a_s_gradient_and_it_stays_unbiased():
    """One LoRA layer keeping 2-bit codes of x: B's gradient and the input's are exact (they
    read no x); A's is unbiased: over 400 seeds (each a dropout mask, then the codes drawn
    after it), the mean of its difference to the exact gradient under the same mask is within
    4 standard errors of zero."""
    net = nn.Sequential(nn.Linear(64, 48))
    model = peft.get_peft_model(net, peft.LoraConfig(r=4, target_modules=["0"],
                                                     lora_dropout=0.1))
    with torch.no_grad():
        model.base_model.model[0].lora_B["default"].weight.normal_()
    ours = copy.deepcopy(model)
    compress(ours, {"rules": [{"target": "linear", "apply": "actnn", "bits": 2,
                               "group_size": 64}]})
    assert len(lean_layers(ours)) == 1
    x = torch.randn(8, 64)
    g_out = torch.randn(8, 48)

    def grads(m, seed):
        torch.manual_seed(seed)  # the mask, drawn first, is the seed's in either model
        xi = x.clone().requires_grad_()
        m.zero_grad()
        m(xi).backward(g_out)
        layer = m.base_model.model[0]
        return (layer.lora_A["default"].weight.grad.clone(),
                layer.lora_B["default"].weight.grad.clone(), xi.grad)

    errors = []
    for seed in range(400):
        (exact_a, exact_b, exact_x), (a, b, dx) = grads(model, seed), grads(ours, seed)
        torch.testing.assert_close(b, exact_b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dx, exact_x, rtol=1e-6, atol=1e-7)
        errors.append((a - exact_a).double())
    errors = torch.stack(errors)
    assert errors[0].norm() > 0  # the codes are lossy
    standard = (errors.var(0).sum() / len(errors)).sqrt()
    assert errors.mean(0).norm() <= 4 * standard


@pytest.mark.parametrize("method", ["lean", "actnn"])
def test_a_non_contiguous_input_gets_its_own_mask(method):
    """The generator fills a dropout mask in the memory order of the tensor dropped: a layer
    reading a transposed view replays the mask in that layout (ActNN codes restore a
    contiguous x, which is laid out again). The input's gradient, and B's, read only the
    mask: exact under either rule; A's too where x is kept as it is."""
    class Transposing(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 24)

        def forward(self, x):
            return self.proj(x.transpose(0, 1))

    model = peft.get_peft_model(Transposing(), peft.LoraConfig(
        r=4, target_modules=["proj"], lora_dropout=0.3))
    with torch.no_grad():
        model.base_model.model.proj.lora_B["default"].weight.normal_()
    ours = copy.deepcopy(model)
    compress(ours, {"rules": [{"target": "linear", "apply": method, "group_size": 32}
                              if method == "actnn" else {"target": "linear", "apply": method}]})
    assert len(lean_layers(ours)) == 1
    x = torch.randn(6, 5, 32)
    results = []
    for m in (ours, model):
        torch.manual_seed(0)
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        layer = m.base_model.model.proj
        results.append((xi.grad, layer.lora_B["default"].weight.grad,
                        layer.lora_A["default"].weight.grad))
    (dx1, b1, a1), (dx0, b0, a0) = results
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b1, b0, rtol=1e-6, atol=1e-6)
    if method == "lean":
        torch.testing.assert_close(a1, a0, rtol=1e-6, atol=1e-6)


# --- what is kept ---------------------------------------------------------------------------

def saved(model, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return account(model, lambda: model(**inputs).loss)[0].total


def test_the_adapter_path_adds_only_a_per_token_and_nothing_for_dropout():
    """Against the same preset on the model without adapters (every weight trainable): LoRA
    adds a = A(drop(x)), r bf16 values per token and adapted layer, and nothing for the
    dropout mask. Without adapters the embedding keeps its token ids (8 bytes per token) and
    the first norm its rstd (4 bytes per token): with frozen weights nothing before the first
    adapter needs a gradient."""
    inputs = batch(lora_model(), seq=32)
    tokens = inputs["input_ids"].numel()
    plain = perturb_norms(models.build("llama-tiny")[0].train())
    compress(plain, "llm")
    kept = {}
    for dropout in (0.0, 0.1):
        model = lora_model(lora_dropout=dropout)
        compress(model, "llm")
        kept[dropout] = saved(model, inputs)
    assert kept[0.1] == kept[0.0]
    adapters = 14 * tokens * 8 * 2  # 14 layers, r = 8, bf16
    assert kept[0.0] == saved(plain, inputs) + adapters - tokens * (8 + 4)


def test_a_frozen_base_that_is_not_a_linear_is_called_as_a_module():
    """A quantized base (bitsandbytes' Linear4bit on CUDA) stands here as an int8 module PEFT
    takes through its custom-module registry: the lean path calls it, keeps nothing for it.
    A norm before it stays as it is: such a base may read its input's dtype, which an MS norm
    would change under autocast."""
    from peft.tuners import lora

    class Int8Linear(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            w = linear.weight.detach()
            scale = w.abs().amax(1, keepdim=True) / 127
            self.register_buffer("q", torch.round(w / scale).to(torch.int8))
            self.scale = nn.Parameter(scale, requires_grad=False)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return nn.functional.linear(x, (self.q * self.scale).to(x.dtype))

    net = nn.Sequential(nn.LayerNorm(32), Int8Linear(nn.Linear(32, 48)), nn.GELU(),
                        Int8Linear(nn.Linear(48, 32)))
    config = peft.LoraConfig(r=4, target_modules=["1", "3"], lora_dropout=0.1)
    config._register_custom_module({Int8Linear: lora.Linear})
    model = peft.get_peft_model(net, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ours = copy.deepcopy(model)
    x = torch.randn(4, 6, 32)
    report = compress(ours, "msnorm", x)
    assert not lean_layers(ours) and "outside a Linear layer" in report.skipped[0][2]
    report = compress(ours, {"rules": [{"target": "linear", "apply": "lean"}]}, x)
    assert len(lean_layers(ours)) == 2 and not report.skipped
    assert not compress(ours, {"rules": [{"target": "linear", "apply": "lean"}]}).replaced
    base = ours.base_model.model[1].base_layer
    assert type(base) is Int8Linear
    calls = base.calls
    results = []
    for m in (ours, model):
        torch.manual_seed(0)
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.square().sum().backward()
        results.append((out, xi.grad, [p.grad for n, p in m.named_parameters() if "lora" in n]))
    assert base.calls == calls + 1
    (out1, dx1, g1), (out0, dx0, g0) = results
    assert torch.equal(out1, out0) and torch.equal(dx1, dx0)
    assert all(torch.equal(a, b) for a, b in zip(g1, g0, strict=True))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    perturb_norms(models.build("llama-tiny")[0]).save_pretrained(folder)
    return folder


def qlora_model(folder, dropout, compute=torch.bfloat16):
    """QLoRA as users build it: the model loaded in 4 bits (NF4, bf16 compute) by
    bitsandbytes on the CPU, prepared by PEFT (float32 norms and head), LoRA on top."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantized,
                                                 device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)  # A's initialisation
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_dropout=dropout,
                                                       target_modules=SEVEN))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


@pytest.mark.parametrize("autocast", [False, True])
def test_qlora_on_bitsandbytes_4bit_layers_trains_as_peft(saved_llama, autocast):
    """PEFT's 4-bit LoRA layers cast in their own order (x to the adapter's dtype only
    without CUDA autocast, the path's output back to the base's dtype before the sum): the
    lean path follows it. The 4-bit base is called as a module; MS-GLU calls the LoRA layers
    as modules too. The norms stay as they are: a 4-bit layer returns its input's dtype,
    which an MS norm would change. compress's probes
    keep the model's mode: an eval forward makes bitsandbytes repack its weights for CPU
    inference, which moved the later losses by 1e-5. In float32 the fused loss sums in
    another order: the loss within 1e-5. Under autocast the final MS norm rounds x̂ and then
    x̂·γ to bf16 (the head casts to bf16 anyway): the loss within bf16's eps."""
    model, ours = (qlora_model(saved_llama, 0.1) for _ in range(2))
    layer = ours.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "Linear4bit" and type(layer.base_layer).__name__ == \
        "Linear4bit"
    report = compress(ours, "llm")
    assert len(lean_layers(ours)) == 14
    assert sum(c.new.startswith("MSGLU") for c in report.replaced) == 2  # on 4-bit layers
    assert all("outside a Linear layer" in why for name, _, why in report.skipped
               if name.endswith("layernorm")), str(report)
    inputs = batch(model)
    (loss1, grads1), (loss0, grads0) = (step(m, inputs, autocast=autocast)
                                        for m in (ours, model))
    assert grads1.keys() == grads0.keys() and len(grads0) == 28
    torch.testing.assert_close(loss1, loss0, rtol=2**-8 if autocast else 1e-5, atol=0)
    # The base layers compute in bf16 either way, so a float32 reordering upstream can flip
    # their roundings: our gradients must move by less than bf16 moves PEFT's own, from the
    # float32 step (autocast) or from the same adapters on float32-compute base layers.
    _, exact = step(model, inputs) if autocast else \
        step(qlora_model(saved_llama, 0.1, torch.float32), inputs)
    moved = torch.cat([(grads1[n] - g).flatten() for n, g in grads0.items()])
    assert moved.norm() < torch.cat([(g - exact[n]).flatten() for n, g in grads0.items()]).norm()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        kept = [account(m, lambda m=m: m(**inputs).loss)[0].total for m in (ours, model)]
    assert kept[0] < 0.6 * kept[1]


# --- portable adapters ----------------------------------------------------------------------

def test_a_saved_adapter_loads_onto_the_untouched_base(tmp_path):
    model = lora_model()
    compress(model, "llm")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = batch(model)
    for _ in range(3):
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path)
    base = perturb_norms(models.build("llama-tiny")[0])
    loaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    model.eval()
    with torch.no_grad():
        got, want = loaded(**inputs).logits, model(**inputs).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # and loaded for more training, it compresses too
    again = peft.PeftModel.from_pretrained(perturb_norms(models.build("llama-tiny")[0]),
                                           tmp_path, is_trainable=True).train()
    reference = copy.deepcopy(again)
    compress(again, "llm")
    assert len(lean_layers(again)) == 14
    assert_same_step(again, reference, inputs, rtol=1e-5)


def test_a_compressed_peft_model_copies_and_pickles():
    """The lean forward lives on each layer instance: a deep copy, or a model saved whole with
    torch.save, runs its own layers' path (and its own rotations and fused loss), with the
    same results, bit for bit."""
    import io

    model = lora_model()
    compress(model, "llm")
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        layer = other.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.__dict__["forward"].layer is layer
        assert_same_step(other, model, batch(model), rtol=0)


def test_peft_s_own_modes_run_peft_s_forward():
    """Merged, disabled, several adapters at once, a mixed batch: PEFT's own forward, exact."""
    model = lora_model()
    model.add_adapter("other", peft.LoraConfig(r=4, target_modules=SEVEN, lora_dropout=0.0))
    ours = copy.deepcopy(model)
    compress(ours, "llm")
    inputs = batch(model)
    with model.disable_adapter(), ours.disable_adapter():
        torch.testing.assert_close(ours(**inputs).loss, model(**inputs).loss, rtol=1e-5,
                                   atol=0)
    for m in (model, ours):
        m.base_model.set_adapter(["default", "other"])
    assert_same_step(ours, model, inputs, rtol=1e-5)
    for m in (model, ours):
        m.base_model.set_adapter("default")
        m.eval()
    names = ["default", "other"]
    with torch.no_grad():
        got, want = (m(**inputs, adapter_names=names).logits for m in (ours, model))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for m in (model, ours):
        m.merge_adapter()
    with torch.no_grad():
        got, want = (m(**inputs).logits for m in (ours, model))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["dora", "head", "modules_to_save", "embedding", "ia3"])
def test_what_is_not_exact_is_refused_in_the_report_and_the_rest_applies(case):
    if case == "ia3":
        model = peft.get_peft_model(perturb_norms(models.build("llama-tiny")[0]).train(),
                                    peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                   feedforward_modules=["down_proj"]))
    else:
        config = {"dora": dict(use_dora=True, target_modules=["q_proj", "v_proj"]),
                  "head": dict(target_modules=SEVEN + ["lm_head"]),
                  "modules_to_save": dict(modules_to_save=["lm_head"]),
                  "embedding": dict(target_modules=SEVEN + ["embed_tokens"])}[case]
        model = lora_model(**config)
    ours = copy.deepcopy(model)
    report = compress(ours, "llm")
    why = {name: reason for name, _, reason in report.skipped}
    expected = {"dora": "LoRA variant", "head": "the fused loss reads the head's weight",
                "modules_to_save": "modules_to_save", "embedding": "LoRA on Embedding layers",
                "ia3": "only LoRA is supported"}[case]
    assert any(expected in reason for reason in why.values()), why
    assert report.replaced  # the rest applies
    assert list(ours.state_dict()) == list(model.state_dict())
    assert_same_step(ours, model, batch(model), rtol=1e-5)


# --- the other order ------------------------------------------------------------------------

def test_get_peft_model_after_compress_is_exact_or_refused_at_forward():
    """Adapters PEFT puts on a compressed model: MS-GLU calls its down projection as a module,
    so a LoRA there trains (PEFT's own forward, exact in float32); the fused loss reads the
    head's weight, so an adapter on the head is refused at the forward."""
    plain = perturb_norms(models.build("llama-tiny")[0].train())
    compressed = copy.deepcopy(plain)
    compress(compressed, "llm")
    config = dict(r=4, lora_dropout=0.1, target_modules=SEVEN)
    ours = peft.get_peft_model(compressed, peft.LoraConfig(**config))
    model = peft.get_peft_model(plain, peft.LoraConfig(**config))
    ours.load_state_dict(model.state_dict())
    with torch.no_grad():
        for m in (ours, model):
            torch.manual_seed(1)
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    assert_same_step(ours, model, batch(model), rtol=1e-5)
    head = peft.get_peft_model(copy.deepcopy(compressed), peft.LoraConfig(
        r=4, target_modules=["lm_head"]))
    with pytest.raises(ActdesignError, match="wrapped after compress"):
        head(**batch(model))
