"""ActNN codes shared along a block: an MS norm keeping b-bit codes of its output, which the
QLinear layers reading it keep too, and MS-GLU keeping codes of up(x).

The forwards are exact. Each backward must be the exact backward run on the dequantized copy
it restored (recorded from `restore`), bit for bit: the codes are the only loss. The codes'
own error and unbiasedness are tested in test_quantized.py; here, that the copy is made once
for the whole block, and that the gradients built from it stay unbiased where the method says
so.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from actdesign.runtime import MSLayerNorm, MSRMSNorm, QLinear, QMSLayerNorm, QMSRMSNorm, norm_ops
from actdesign.runtime.ops.glu import MSGLU, _GLUDown
from actdesign.runtime.ops.quantized import _QuantizedInput

NORMS = {"layer": (MSLayerNorm, QMSLayerNorm), "rms": (MSRMSNorm, QMSRMSNorm)}
# (autocast dtype or None, parameter and input dtype)
MODES = [(None, torch.float32), (torch.bfloat16, torch.float32), (None, torch.bfloat16)]


@pytest.fixture
def restored(monkeypatch):
    """Every dequantized copy made during the test, in order."""
    seen = []
    original = _QuantizedInput.restore

    def restore(self, saved, shape, dtype):
        seen.append(original(self, saved, shape, dtype))
        return seen[-1]

    monkeypatch.setattr(_QuantizedInput, "restore", restore)
    return seen


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def code_bytes(samples, per_sample, bits=2, group=256):
    """Codes, a float32 min and range per group, and an int8 bit width, per sample."""
    return samples * (math.ceil(per_sample * bits / 8) + 8 * math.ceil(per_sample / group) + 1)


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("amp, dtype", MODES)
def test_norm_and_readers_keep_one_set_of_codes(kind, amp, dtype, restored, saved):
    torch.manual_seed(0)
    d, batch, seq = 64, 3, 10
    plain, coded = NORMS[kind][0](d), NORMS[kind][1](d, bits=2)
    readers = [QLinear(d, n, bits=2).to(dtype) for n in (16, 16, 48)]
    x = (torch.randn(batch, seq, d) * 2 + 0.5).to(dtype).requires_grad_(True)
    params = [p for m in readers for p in m.parameters()]

    def block(inp):
        with autocast(amp):
            y = coded(inp)
            return y, [m(y) for m in readers]

    kept = saved(block, x, params)
    # Kept: the codes of y once, and rstd per row; no copy of y, no codes per reader.
    assert sum(kept.values()) == code_bytes(batch, seq * d) + 4 * batch * seq
    y, outs = block(x)
    with autocast(amp):
        assert torch.equal(y, plain(x))  # the forward is the MS norm's, bit for bit
    grad_y = []
    y.register_hook(grad_y.append)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)

    # The three readers, then the norm, dequantize one copy.
    assert len(restored) == 4 and all(torch.equal(r, restored[0]) for r in restored)
    y_hat = restored[0]
    for m, g in zip(readers, grads, strict=True):
        w = m.weight.to(y_hat.dtype)
        assert torch.equal(m.weight.grad, m.weight_grad(y_hat, w, g).to(m.weight.dtype))
    forward, backward = norm_ops().OPS[kind][:2]
    _, rstd = forward(x.detach(), 1e-5, y.dtype)
    assert torch.equal(x.grad, backward(y_hat, rstd, grad_y[0].to(x.dtype)))


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_norm_input_gradient_has_only_the_projection_terms_bias(kind):
    """E[dx] over the random rounding is dx - rstd·g·Var(ŷ)/d: ŷ is unbiased, and the
    projection term ŷ·mean(g·ŷ) holds ŷ_i twice in its diagonal, whose mean is y_i² + Var ŷ_i.
    Var ŷ_i = step²·f·(1 - f), f the fractional position of y_i between two levels."""
    torch.manual_seed(6)
    d, bits = 64, 2
    norm = NORMS[kind][1](d, bits=bits)  # one sample: 4 x 64 = one group of 256
    x = torch.randn(2, 4, d, dtype=torch.float64) * 3 + 1
    g = torch.randn_like(x)
    exact = x.clone().requires_grad_(True)
    y = F.layer_norm(exact, (d,), eps=norm.eps) if kind == "layer" else \
        exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + norm.eps)
    y.backward(g)
    y = y.detach()
    centred = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    flat = y.reshape(2, -1).float()  # the quantizer's grid: float32 lo and step per group
    lo = flat.amin(-1, keepdim=True)
    step = ((flat.amax(-1, keepdim=True) - lo) / (2**bits - 1)).double()
    t = (flat.double() - lo.double()) / step
    var = (step**2 * (t - t.floor()) * (1 - t + t.floor())).view_as(y)
    bias = -rstd * g * var / d

    draws = []
    for _ in range(400):  # a fresh seed per call
        xi = x.clone().requires_grad_(True)
        norm(xi).backward(g)
        draws.append(xi.grad)
    draws = torch.stack(draws)
    noise = draws.var(0).sum() / len(draws)
    # Σ (mean - prediction)² / Σ var/K: about 1 for the right prediction. Without the bias
    # term it is 1 + Σ bias² / Σ var/K, about 2-3 here (the bias is ~1% of dx at d = 64).
    assert 0.6 < ((draws.mean(0) - exact.grad - bias)**2).sum() / noise < 1.5
    assert ((draws.mean(0) - exact.grad)**2).sum() / noise > 1.5


def test_a_reader_of_other_bits_makes_its_own_codes(restored, saved):
    torch.manual_seed(1)
    norm, same, other = QMSRMSNorm(64, bits=2), QLinear(64, 8, bits=2), QLinear(64, 8, bits=4)
    x = torch.randn(2, 5, 64, requires_grad=True)

    def block(inp):
        y = norm(inp)
        return same(y) + other(y)

    kept = saved(block, x, [*same.parameters(), *other.parameters()])
    assert sum(kept.values()) == code_bytes(2, 320) + code_bytes(2, 320, bits=4) + 4 * 10
    block(x).sum().backward()
    assert len(restored) == 3  # other's copy, then same's and the norm's: one copy
    assert torch.equal(restored[1], restored[2]) and not torch.equal(restored[0], restored[1])


def test_a_reader_of_a_tensor_changed_in_place_makes_its_own_codes(restored):
    """The norm's codes are of y as it was; once y changes in place they are stale."""
    torch.manual_seed(5)
    norm, reader = QMSRMSNorm(64, bits=2), QLinear(64, 8, bits=2)
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = norm(x)
    y.add_(10)  # legal: the norm's backward reads its codes, not y
    reader(y).sum().backward(inputs=[reader.weight])
    (y_hat,) = restored  # the reader's own codes, of the changed y: within a 2-bit step
    step = (y.detach().amax() - y.detach().amin()) / 3  # (the norm's codes are 10 away)
    assert (y_hat - y.detach()).abs().max() <= step < 10


@pytest.mark.parametrize("amp, dtype", MODES)
def test_a_reader_of_a_whole_view_keeps_the_norms_codes(amp, dtype, saved):
    """transformers hands the head h[:, 0:], a view of every element in the same layout:
    the same data, so the same codes. A view of part of y is other data: codes of its own."""
    torch.manual_seed(7)
    norm = QMSRMSNorm(64, bits=2)
    whole, part = (QLinear(64, 8, bits=2).to(dtype) for _ in range(2))
    x = torch.randn(2, 5, 64, dtype=dtype, requires_grad=True)
    params = [*whole.parameters(), *part.parameters()]
    with autocast(amp):
        kept = saved(lambda inp: whole(norm(inp)[:, 0:]), x, params)
        assert sum(kept.values()) == code_bytes(2, 320) + 4 * 10
        kept = saved(lambda inp: part(norm(inp)[:, 1:]), x, params)
        assert sum(kept.values()) == code_bytes(2, 320) + code_bytes(2, 256) + 4 * 10


def test_without_grad_a_coded_norm_is_the_ms_norm():
    x = torch.randn(4, 33)
    with torch.no_grad():
        assert torch.equal(QMSLayerNorm(33)(x), MSLayerNorm(33)(x))
    y = QMSLayerNorm(33)(x)  # x needs no gradient: nothing is kept
    assert y.grad_fn is None and not hasattr(y, "_actdesign_codes")


def llama_mlp(dtype=torch.float32, d=64, hidden=160):
    torch.manual_seed(2)
    config = LlamaConfig(hidden_size=d, intermediate_size=hidden, num_attention_heads=4)
    return LlamaMLP(config).to(dtype)


@pytest.mark.parametrize("amp, dtype", MODES)
def test_msglu_keeps_codes_of_up_in_place_of_up(amp, dtype, saved):
    mlp = llama_mlp(dtype)
    exact, coded = MSGLU.from_module(mlp), MSGLU.from_module(mlp, codes=(2, 256))
    x = torch.randn(3, 7, 64, dtype=dtype, requires_grad=True)
    with autocast(amp):
        assert torch.equal(coded(x), exact(x))  # the forward is exact
        kept_exact = saved(exact, x, list(mlp.parameters()))
        kept_coded = saved(coded, x, list(mlp.parameters()))
    u_bytes = 3 * 7 * 160 * (amp or dtype).itemsize
    assert sum(kept_coded.values()) == sum(kept_exact.values()) - u_bytes \
        + code_bytes(3, 7 * 160)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_msglu_backward_is_the_exact_one_on_the_restored_up(dtype, restored):
    """dg = dh·û·act'(g) and down's weight gradient from h = act(g)·û; du = dh·act(g) does
    not read u at all."""
    torch.manual_seed(3)
    holder = MSGLU.from_module(llama_mlp(), codes=(2, 256))
    g0, u0 = (torch.randn(3, 7, 160, dtype=dtype) for _ in range(2))
    weight0 = torch.randn(64, 160)
    grad = torch.randn(3, 7, 64, dtype=dtype)

    def run(u, codes):
        g, u, weight = (t.clone().requires_grad_(True) for t in (g0, u, weight0))
        _GLUDown.apply(g, u, weight, None, "silu", dtype, codes).backward(grad)
        return g.grad, u.grad, weight.grad

    coded = run(u0, holder)
    (u_hat,) = restored
    assert not torch.equal(u_hat, u0)
    for got, want in zip(coded, run(u_hat, None), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(coded[1], run(u0, None)[1])  # du: exact


def test_msglu_codes_keep_the_gradients_unbiased():
    """E[grad] over the codes' random rounding is the exact gradient, for the input
    (dg = dh·û·act'(g): g exact, û unbiased) and the down weight (h = act(g)·û)."""
    mlp = llama_mlp(torch.float64, d=16, hidden=40)
    exact, coded = MSGLU.from_module(mlp), MSGLU.from_module(mlp, codes=(2, 8))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    grad = torch.randn(2, 5, 16, dtype=torch.float64)

    def grads(m):
        xi = x.clone().requires_grad_(True)
        mlp.zero_grad()
        m(xi).backward(grad)
        return torch.cat([xi.grad.flatten(), mlp.down_proj.weight.grad.flatten()])

    reference = grads(exact)
    draws = torch.stack([grads(coded) for _ in range(400)])
    mean_err = draws.mean(0) - reference
    # Σ (mean - exact)² / Σ var/K over 800 values: about 1 if unbiased (the spread is set by
    # the few largest variances, so the band is wide); a bias grows it with K.
    ratio = (mean_err**2).sum() / (draws.var(0).sum() / len(draws))
    assert 0.6 < ratio < 1.5


def test_msglu_codes_noise_in_the_input_gradient_falls_with_the_step():
    """Why compress gives MS-GLU's codes of up(x) two bits more than ActNN's: û enters dx
    elementwise (through dg), so the noise is about half of dx at 2 bits and shrinks with the
    step (3 levels apart -> 15: 5 times finer) to about a tenth at 4; a norm's 2-bit codes
    reach dx only through a row mean."""
    mlp = llama_mlp(d=128, hidden=341)
    torch.manual_seed(9)
    x, grad = torch.randn(4, 64, 128), torch.randn(4, 64, 128)

    def dx(m):
        xi = x.clone().requires_grad_(True)
        m(xi).backward(grad)
        return xi.grad

    exact = dx(MSGLU.from_module(mlp))
    error = {b: ((dx(MSGLU.from_module(mlp, codes=(b, 256))) - exact).norm() / exact.norm())
             .item() for b in (2, 4)}
    assert 0.4 < error[2] < 0.7 and 4 < error[2] / error[4] < 6
    exact = dx(MSRMSNorm(128))
    norm_error = ((dx(QMSRMSNorm(128, bits=2)) - exact).norm() / exact.norm()).item()
    assert 0.5 < norm_error / error[4] < 1.5  # at d = 128; it falls as 1/sqrt(d)


def test_msglu_gate_and_up_share_the_norm_codes(restored, saved):
    mlp = llama_mlp()
    norm = QMSRMSNorm(64, bits=2)
    glu = MSGLU.from_module(mlp, codes=(2, 256), input_codes=(2, 256))
    assert all(type(m) is QLinear for m in (glu.gate_proj, glu.up_proj))
    x = torch.randn(3, 7, 64, requires_grad=True)
    kept = saved(lambda inp: glu(norm(inp)), x, list(mlp.parameters()))
    # The norm's codes of its output (once) and rstd, g in float32, the codes of u.
    assert sum(kept.values()) == code_bytes(3, 7 * 64) + 4 * 21 + 4 * 21 * 160 \
        + code_bytes(3, 7 * 160)
    glu(norm(x)).sum().backward()
    # The GLU's û, then gate's and up's copy of the norm's output, then the norm's: one copy.
    assert len(restored) == 4
    assert torch.equal(restored[1], restored[2]) and torch.equal(restored[1], restored[3])


def test_torch_compile_runs_the_codes_eagerly_and_matches_eager():
    torch.manual_seed(4)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = QMSRMSNorm(64)
            self.q, self.k = QLinear(64, 32), QLinear(64, 32)

        def forward(self, x):
            y = self.norm(x)
            return self.q(y) + self.k(y)

    block = Block()
    eager = copy.deepcopy(block)
    x = torch.randn(2, 8, 64)
    grads = []
    for m in (torch.compile(block, backend="aot_eager"), eager):
        torch.manual_seed(5)  # the same draws, so the same codes
        xi = x.clone().requires_grad_(True)
        m(xi).sum().backward()
        grads.append((xi.grad, *(p.grad for p in m.parameters())))
    for compiled, reference in zip(*grads, strict=True):
        assert torch.equal(compiled, reference)


@pytest.mark.parametrize("amp, dtype", MODES)
def test_calibration_gives_a_norm_and_its_readers_one_bit_width(amp, dtype, tmp_path):
    """The readers of a coded norm keep one set of codes: one item of the allocation (C
    summed over the readers, the elements counted once), one bit width for all of them and
    the norm, so the codes stay shared and the memory is the budget's."""
    import json

    from actdesign.cli import main
    from actdesign.designer.allocate import load_bits
    from actdesign.runtime import account, calibrate, compress, models

    torch.manual_seed(8)
    model, _ = models.build("llama-tiny", seed=0)
    model.to(dtype)
    batches = [models.example_batch(model, 4, 64) for _ in range(2)]
    compress(model, "msnorm+actnn2", batches[0])

    def loss(m, batch):
        with autocast(amp):
            return models.loss_of(models.call(m, batch))

    uniform, _ = account(model, lambda: loss(model, batches[0]))
    bits = calibrate(model, batches, avg_bits=2, stats_path=tmp_path / "stats.json",
                     bits_path=tmp_path / "bits.json", loss=loss)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert {attn.q_proj.bits, attn.k_proj.bits, attn.v_proj.bits} == {layer.input_layernorm.bits}
    assert {mlp.gate_proj.bits, mlp.up_proj.bits} == {layer.post_attention_layernorm.bits}
    assert model.lm_head.bits == model.model.norm.bits  # through transformers' h[:, 0:]
    names = [it["name"] for it in json.loads((tmp_path / "stats.json").read_text())["items"]]
    prefix = "model.layers.0."
    assert names[:3] == [",".join(prefix + n for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                      "self_attn.v_proj")),
                         f"{prefix}mlp.gate_proj,{prefix}mlp.up_proj", f"{prefix}mlp.down_proj"]
    assert names[-1] == "lm_head" and len(names) == 7
    assert load_bits(tmp_path / "bits.json") == bits  # each layer by name
    # `actdesign allocate` on the stats names the items; a bits file expands the names
    with pytest.raises(SystemExit) as info:
        main(["allocate", str(tmp_path / "stats.json"), "--avg-bits", "2", "--out",
              str(tmp_path / "allocated.json")])
    assert info.value.code == 0
    assert load_bits(tmp_path / "allocated.json") == bits
    calibrated, _ = account(model, lambda: loss(model, batches[0]))
    # Every code is shared, and the budget Σ w·b holds the uniform bits' Σ w·2: the codes of
    # each sample are w·b/8 bytes (w a multiple of 8 here), the group statistics the same.
    assert calibrated.total <= uniform.total


def test_a_calibrated_policy_keeps_the_codes_shared():
    from actdesign.runtime import compress, models
    from actdesign.runtime.calibration.policy import calibrate_policy

    model, _ = models.build("llama-tiny", seed=0)
    batches = [models.example_batch(model, 4, 64) for _ in range(2)]
    result = calibrate_policy(model, batches, "msnorm+actnn2")
    report = compress(model, result.policy, batches[0])
    norms = [c.new for c in report.replaced if c.old == "LlamaRMSNorm"]
    assert len(norms) == 5 and all("codes of x̂, shared" in n for n in norms)
    assert not any(c.new.startswith("LeanLinear (its input is an MS norm's")
                   for c in report.replaced)
