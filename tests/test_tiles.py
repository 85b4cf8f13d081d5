"""MS-GLU in sequence tiles (`tile`): the output and the input gradient are the untiled op's
bit for bit, in float32, under bf16 autocast and with bf16 weights; a weight's gradient, a
sum over the tokens, differs only by the rounding of that sum (bounded below from the terms'
magnitudes); the random draws of the forward are replayed in the backward; what it keeps is
its input alone; the tile size follows the documented rule.

The MLPs are 128 wide inside: torch's CPU SiLU computes a chunk's last elements that fill no
pair of SIMD vectors with scalar code, so with a width not a multiple of 64 an element's bits
would depend on where its chunk ends (see `tiles`), which is the kernel's, not the tiles'."""

import copy

import pytest
import torch
import torch.nn.functional as F

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, estimate, models
from actdesign.runtime.apply import policy as P
from actdesign.runtime.ops.glu import MSGLU
from actdesign.runtime.ops.tiles import SMALLEST_AUTO_TILE, spans, tile_rows

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

PRECISIONS = ["fp32", "bf16-autocast", "bf16-weights-autocast", "bf16-weights"]


def mlp(hidden=32, inner=128, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inner,
                                      hidden_act="silu")
    m = LlamaMLP(config)
    with torch.no_grad():  # trained-like: not the initial scale
        for p in m.parameters():
            p.mul_(1.7)
    return m.to(dtype)


def run(module, x, dy, autocast):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(dy)
    return y, x.grad, {n: p.grad for n, p in module.named_parameters()}


def magnitudes(m, x, dy):
    """{weight name: Σ over tokens of |a|·|b|}, the sum each weight's gradient is, in float64:
    down (dy, h), gate (dg, x), up (du, x)."""
    w = {n: p.detach().double() for n, p in m.named_parameters()}
    x, dy = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, dy.shape[-1])
    g, u = x @ w["gate_proj.weight"].T, x @ w["up_proj.weight"].T
    s = torch.sigmoid(g)
    h, dh = F.silu(g) * u, dy @ w["down_proj.weight"]
    dg, du = dh * u * s * (1 + g * (1 - s)), dh * F.silu(g)
    return {"down_proj.weight": dy.abs().T @ h.abs(), "gate_proj.weight": dg.abs().T @ x.abs(),
            "up_proj.weight": du.abs().T @ x.abs()}


def sum_bound(sizes, tokens, tiles, sixteen_bit):
    """How far two summation orders of one gradient can be apart, over Σ|a||b|: each rounds
    the terms' sum in float32 (n·u each), the tiles' partial sums and each side's result are
    rounded to 16 bits where the product or the weight is 16-bit (u = 2^-8 each); 5% for the
    magnitudes being taken in float64 from inputs a 16-bit rounding away."""
    u_out = 2.0**-8 if sixteen_bit else 2.0**-24
    return {n: 1.05 * (3 * u_out + 2 * (tokens + tiles) * 2.0**-24) * s
            for n, s in sizes.items()}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tiles_are_the_untiled_op_bit_for_bit_but_the_weight_sums(precision):
    bf16_weights, autocast = precision.startswith("bf16-weights"), "autocast" in precision
    dtype = torch.bfloat16 if bf16_weights else torch.float32
    base = mlp(dtype=dtype)
    untiled, tiles = MSGLU.from_module(copy.deepcopy(base)), \
        MSGLU.from_module(copy.deepcopy(base), tile=128)  # 3 x 201 tokens: 5 tiles
    torch.manual_seed(1)
    x, dy = torch.randn(3, 201, 32, dtype=dtype), torch.randn(3, 201, 32, dtype=dtype)
    y, dx, grads = run(untiled, x, dy, autocast)
    y_t, dx_t, grads_t = run(tiles, x, dy, autocast)
    assert torch.equal(y, y_t) and torch.equal(dx, dx_t)
    bound = sum_bound(magnitudes(base, x, dy), 603, 5, bf16_weights or autocast)
    for name, g in grads.items():
        diff = (g.double() - grads_t[name].double()).abs()
        assert (diff <= bound[name]).all(), name
    assert any(not torch.equal(g, grads_t[n]) for n, g in grads.items())  # the sums do differ


def test_the_backward_replays_the_forwards_draws():
    """LoRA dropout inside the tiles: each tile's backward reads the masks its forward drew
    (the gradient of the very forward that ran), checked against the tiles run by hand."""
    peft = pytest.importorskip("peft")
    base = mlp()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3,
                             target_modules=["gate_proj", "up_proj", "down_proj"])
    lora = peft.get_peft_model(torch.nn.Sequential(base), config).base_model.model[0]
    for p in lora.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)
    tiles = MSGLU.from_module(copy.deepcopy(lora), tile=40)
    torch.manual_seed(1)
    x, dy = torch.randn(100, 32), torch.randn(100, 32)
    torch.manual_seed(7)
    y, dx, grads = run(tiles, x, dy, False)
    by_hand = copy.deepcopy(tiles)
    torch.manual_seed(7)
    xs = x.clone().requires_grad_()
    parts = [by_hand.untiled(xs[a:b]) for a, b in spans(100, 40)]
    torch.cat(parts).backward(dy)
    assert torch.equal(y, torch.cat(parts)) and torch.equal(dx, xs.grad)
    for name, p in by_hand.named_parameters():
        if p.requires_grad:  # the hand-run sums in the parameters' dtype, float32 too
            assert torch.allclose(grads[name], p.grad, rtol=0,
                                  atol=8 * 100 * 2.0**-24 * p.grad.abs().max().item())


def test_tiles_are_near_equal_and_cover_the_tokens():
    for n, rows in [(603, 128), (4096, 4096), (500_000, 4096), (1, 1), (10, 3)]:
        got = list(spans(n, rows))
        sizes = [b - a for a, b in got]
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(p[1] == q[0] for p, q in zip(got[:-1], got[1:], strict=True))
        assert max(sizes) <= rows and max(sizes) - min(sizes) <= 1
        assert len(got) == -(-n // rows)


def test_a_tiled_mlp_keeps_only_its_input():
    kept = []

    def pack(t):
        kept.append(t)
        return t

    m = MSGLU.from_module(mlp(), tile=16)
    x = torch.randn(2, 50, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    assert len(kept) == 1 and kept[0] is x


@pytest.mark.parametrize("tile, tokens, hidden, rows", [
    ("auto", 500_000, 4096, 4096), ("auto", 500_000, 768, SMALLEST_AUTO_TILE),
    ("auto", 4096, 4096, None), ("auto", 4097, 4096, 4096), (37, 300, 32, 37),
    (37, 37, 32, None), (None, 10**6, 4096, None)])
def test_the_tile_rule(tile, tokens, hidden, rows):
    """auto: as many tokens as the hidden width, at least 1024; one tile runs untiled."""
    assert tile_rows(tile, tokens, hidden) == rows


def test_the_policy_option_and_the_preset():
    rules = P.load("llm+tiled+offload").rules
    first_glu = next(r for r in rules if r.target == "glu")
    assert first_glu.option("tile") == "auto"  # tiled's rule leads whatever the join order
    assert P.load("tiled+llm").rules == P.load("llm+tiled").rules
    assert P.load({"rules": [{"target": "glu", "apply": "msglu", "tile": 512}]}).rules[0] \
        .option("tile") == 512
    for bad in (0, "big", 1.5, True):
        with pytest.raises(ActdesignError, match="tile must be an integer") as info:
            P.load({"rules": [{"target": "glu", "apply": "msglu", "tile": bad}]})
        assert "\n" not in str(info.value)


def llama(precision):
    torch.manual_seed(0)
    model, _ = models.build("llama-tiny")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # γ near but not 1
    if precision.startswith("bf16-weights"):
        model.to(torch.bfloat16)
    return model.train(), models.example_batch(model, 2, 48)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights-autocast"])
@pytest.mark.parametrize("policy", ["llm", "llm+offload"])
def test_in_a_model_only_the_mlp_weight_sums_change(policy, precision):
    """The loss and every gradient but the MLPs' weights are the untiled model's bits: the
    input gradient each tiled MLP passes on is exact."""
    model, inputs = llama(precision)
    tiled = copy.deepcopy(model)
    compress(model, policy)
    compress(tiled, {"rules": [{"target": "glu", "apply": "msglu", "tile": 20},
                               *P.load(policy).to_dict()["rules"]]})
    assert all(m.tile == 20 for m in tiled.modules() if isinstance(m, MSGLU))
    results = []
    for m in (model, tiled):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = models.loss_of(models.call(m, inputs))
        loss.backward()
        results.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    (loss, grads), (loss_t, grads_t) = results
    assert torch.equal(loss, loss_t)
    mlp_weights = [n for n in grads if ".mlp." in n]
    assert mlp_weights
    for name, g in grads.items():
        if name not in mlp_weights:
            assert torch.equal(g, grads_t[name]), name
        else:  # a rounding of the token sum (the bound is in the unit test above)
            scale = g.abs().max().item()
            assert (g - grads_t[name]).abs().max().item() <= 2.0**-6 * scale, name


def test_the_estimate_sees_one_tile_of_intermediates():
    """At 2 x 4096 tokens of a narrow, MLP-heavy model (auto tiles of 1024 tokens) the
    backward's peak drops by most of the gated MLP's (tokens x inner) intermediates."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 1024,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256}
    plain, tiled = estimate(config, 2, 4096, "fp32", ["llm", "llm+tiled"], kernels="cpu").rows
    intermediate = 2 * 4096 * 1024 * 4  # one (tokens x inner) float32 tensor
    assert plain.peak_bytes - tiled.peak_bytes >= 2 * intermediate
    assert tiled.saved_bytes < plain.saved_bytes
