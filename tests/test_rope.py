"""The rotary embedding: kernels against eager's ops and float64, and the attention modules it
attaches to (by behaviour, with nothing patched outside the module)."""

import copy
import importlib
import inspect

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, models
from actdesign.runtime.methods.rope import attach_rotary
from actdesign.runtime.methods.targets import target_of
from actdesign.runtime.ops.rope import reference, rotary

rope_mod = importlib.import_module("actdesign.runtime.ops.rope")

pytest.importorskip("transformers")


def qk_cos_sin(heads=3, kv_heads=2, dim=12, batch=2, seq=5, cos_batch=2, dtype=torch.bfloat16,
               seed=0):
    """q and k as attention makes them (transposed views of (B, T, H, D)), float32 cos/sin."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen).transpose(1, 2).to(dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen).transpose(1, 2).to(dtype)
    cos, sin = (torch.randn(cos_batch, seq, dim, generator=gen) for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [dict(), dict(dim=8, heads=4, kv_heads=4, cos_batch=1),
                                   dict(dim=64, heads=1, kv_heads=1, seq=3)])
def test_kernels_give_eagers_values_and_the_adjoint(dtype, shape, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    q, k, cos, sin = qk_cos_sin(dtype=dtype, **shape)
    with torch.autocast("cpu", dtype=dtype):
        qe, ke = rotary(q, k, cos, sin)
    assert type(qe.grad_fn).__name__ == "_RotaryBackward"
    # Forward: eager's float32 values, rounded once to what attention casts them to.
    want_q, want_k = reference(q.detach(), k.detach(), cos, sin)
    assert qe.dtype == dtype and torch.equal(qe, want_q.to(dtype))
    assert torch.equal(ke, want_k.to(dtype))
    assert qe.stride() == q.stride()  # the layout of q: no copy for attention to undo
    # Kept for the backward: cos and sin themselves, nothing of q or k (as eager).
    assert [t.data_ptr() for t in qe.grad_fn.saved_tensors] == [cos.data_ptr(), sin.data_ptr()]
    # Backward against float64: half an ulp of the dtype, plus float32's rounding of the two
    # products and their sum, 3 * 2^-24 * (|g1·c| + |g2·s|) at most.
    gq, gk = torch.randn_like(qe), torch.randn_like(ke)
    torch.autograd.backward((qe, ke), (gq, gk))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    ref = reference(q64, k64, cos.double(), sin.double())
    torch.autograd.backward(ref, (gq.double(), gk.double()))
    half_ulp = torch.finfo(dtype).eps / 2
    for got, want, g in ((q.grad, q64.grad, gq), (k.grad, k64.grad, gk)):
        bound = half_ulp * want.abs() + 3 * 2.0**-24 * magnitude(g, cos, sin)
        assert got.dtype == dtype
        assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("autocast", [False, True])
def test_with_cos_and_sin_in_qs_dtype_the_kernel_is_eager_bit_for_bit(dtype, autocast,
                                                                     monkeypatch):
    """16-bit weights make cos and sin 16-bit (float32 without autocast): eager's rotation
    then rounds each product and each sum to that dtype, forward and backward (autograd sums
    the two paths' gradients in it). The kernel rounds where it does: eager's values and
    gradients bit for bit, in one launch each way."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    q, k, cos, sin = qk_cos_sin(dtype=dtype, heads=4, kv_heads=2, dim=16)
    cos, sin = (t.to(dtype) for t in (cos, sin))
    gq, gk = (torch.randn(t.shape, dtype=torch.float64).to(dtype) for t in (q, k))
    results = []
    for fn in (rotary, reference):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
        half = dtype if dtype != torch.float32 else torch.bfloat16
        with torch.autocast("cpu", dtype=half, enabled=autocast):
            out = fn(*leaves, cos, sin)
        torch.autograd.backward(out, (gq, gk))
        results.append((*out, *(t.grad for t in leaves)))
        if fn is rotary:
            assert type(out[0].grad_fn).__name__ == "_RotaryBackward"
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def magnitude(g, cos, sin):
    """|g1·c1| + |g2·s2| and |g2·c2| + |g1·s1|: the size of the backward's two terms."""
    g, c, s = (t.double().abs() for t in (g, cos.unsqueeze(1), sin.unsqueeze(1)))
    h = g.shape[-1] // 2
    return torch.cat((g[..., :h] * c[..., :h] + g[..., h:] * s[..., h:],
                      g[..., h:] * c[..., h:] + g[..., :h] * s[..., :h]), dim=-1)


def test_eagers_ops_run_where_the_kernel_does_not_pay(monkeypatch):
    # Without autocast (or on the CPU backends) the eager ops run: exactly eager's results.
    q, k, cos, sin = qk_cos_sin(dtype=torch.float32)
    qe, ke = rotary(q, k, cos, sin)
    assert type(qe.grad_fn).__name__ != "_RotaryBackward"
    for a, b in zip((qe, ke), reference(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another layout: eager's ops
        qe, _ = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert type(qe.grad_fn).__name__ != "_RotaryBackward"


def built(name):
    model, _ = models.build(name)
    inputs = models.example_batch(model, batch=2, seq=16)
    return model, {"labels": inputs["input_ids"], **inputs}


def step(model, inputs, autocast, saved=None):
    """One step: (loss, gradients); `saved`, a dict, gets each storage autograd keeps and its
    size."""
    def pack(t):
        if saved is not None:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_attached_attention_trains_as_eager(name, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    model, inputs = built(name)
    ours = attached_copy(model)
    # float32: eager's ops, bit for bit.
    (l0, g0), (l1, g1) = step(model, inputs, False), step(ours, inputs, False)
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    # bf16 autocast: the kernels; the forward is eager's bit for bit, so the loss is; the
    # gradients differ by the backward's roundings only (one bf16 rounding where eager has
    # two), far below the gradients' own bf16 noise.
    kept, kept_ours = {}, {}
    calls = []
    monkeypatch.setattr(rope_mod, "_kernels", lambda *a, real=rope_mod._kernels: (
        calls.append(1), real(*a))[1])
    (l0, g0), (l1, g1) = step(model, inputs, True, kept), step(ours, inputs, True, kept_ours)
    assert len(calls) == model.config.num_hidden_layers  # the kernels ran, in every layer
    assert torch.equal(l0, l1)
    assert sum(kept_ours.values()) == sum(kept.values())  # the same bytes kept: no more
    assert_bf16_close(g1, g0)


def attached_copy(model):
    """A copy of the model whose every attention module rotates with `rotary`."""
    ours = copy.deepcopy(model)
    attentions = [m for m in ours.modules() if target_of(m) == "attention"]
    assert len(attentions) == ours.config.num_hidden_layers
    for m in attentions:
        attach_rotary(m)
        assert target_of(m) is None  # done: not a target again
    return ours


def assert_bf16_close(got, want):
    """Gradients apart by a few bf16 roundings of the largest, per parameter."""
    for n in want:
        scale = want[n].abs().max().clamp_min(1e-30)
        assert (got[n] - want[n]).abs().max() <= 4 * 2.0**-8 * scale, n


class BreakingLinear(torch.nn.Linear):
    """A Linear that torch.compile cannot trace through: a graph break inside attention, as
    ActNN's eager quantization makes."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


def test_attached_attention_compiles_across_a_graph_break():
    torch._dynamo.reset()
    model, inputs = built("llama-tiny")
    for layer in model.model.layers:
        q = layer.self_attn.q_proj
        layer.self_attn.q_proj = BreakingLinear(q.in_features, q.out_features, bias=False)
        layer.self_attn.q_proj.weight = q.weight
    ours = attached_copy(model)
    forwards = {m.forward.__func__ for m in ours.modules() if "forward" in vars(m)}
    assert len(forwards) == 1  # one copy of the forward serves every layer
    want, grads = step(ours, inputs, False)
    # The resume function compiled at the break lives in the copy's globals: every layer
    # must find it there (a copy per layer left the second one without it).
    got, compiled_grads = step(torch.compile(ours, backend="eager"), inputs, False)
    assert torch.equal(got, want)
    assert all(torch.equal(compiled_grads["_orig_mod." + n], grads[n]) for n in grads)


def test_the_modeling_file_and_other_instances_are_untouched():
    model, inputs = built("llama-tiny")
    other, _ = built("llama-tiny")
    attention = model.model.layers[0].self_attn
    module_globals = inspect.unwrap(type(attention).forward).__globals__
    before = module_globals["apply_rotary_pos_emb"]
    attach_rotary(attention)
    assert module_globals["apply_rotary_pos_emb"] is before
    assert "forward" not in other.model.layers[0].self_attn.__dict__
    copied = copy.deepcopy(model)  # a copy runs its own module
    assert copied.model.layers[0].self_attn.forward.__self__ is copied.model.layers[0].self_attn
    # the attached forward has the class forward's signature and docstring
    assert inspect.signature(attention.forward) == \
        inspect.signature(other.model.layers[0].self_attn.forward)
    assert attention.forward.__doc__ == type(attention).forward.__doc__
    with pytest.raises(ActdesignError, match="already replaced"):
        attach_rotary(attention)


def test_a_rotation_that_is_not_the_standard_one_is_refused(monkeypatch):
    model, _ = built("llama-tiny")
    attention = model.model.layers[0].self_attn
    module_globals = inspect.unwrap(type(attention).forward).__globals__
    standard = module_globals["apply_rotary_pos_emb"]

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J style pairs: another rotation
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    monkeypatch.setitem(module_globals, "apply_rotary_pos_emb", interleaved)
    with pytest.raises(ActdesignError, match="not the standard rotation"):
        attach_rotary(attention)
    assert "forward" not in attention.__dict__
    monkeypatch.setitem(module_globals, "apply_rotary_pos_emb", standard)


def test_llm_preset_attaches_it_and_reports_it():
    model, _ = built("llama-tiny")
    report = compress(model, "llm")
    rotary_rows = [c for c in report.replaced if "rotary" in c.new]
    assert len(rotary_rows) == model.config.num_hidden_layers
    assert compress(model, "llm").replaced == []  # idempotent


def partial_rotary_model(kind):
    """A tiny model rotating a quarter of each head: GPT-NeoX splits the head inside
    apply_rotary_pos_emb (cos narrower than q), Phi before calling it (q as wide as cos)."""
    transformers = pytest.importorskip("transformers")
    config, model = {"gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
                     "phi": ("PhiConfig", "PhiForCausalLM")}[kind]
    config = getattr(transformers, config)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=128, max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0,
        hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    config.rope_parameters["partial_rotary_factor"] = 0.25
    torch.manual_seed(0)
    model = getattr(transformers, model)(config)
    inputs = models.example_batch(model, batch=2, seq=16)
    return model, {"labels": inputs["input_ids"], **inputs}


@pytest.mark.parametrize("kind", ["gpt_neox", "phi"])
def test_partial_rotary_trains_as_eager(kind, monkeypatch):
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    model, inputs = partial_rotary_model(kind)
    ours = attached_copy(model)
    for autocast in (False, True):
        (l0, g0), (l1, g1) = step(model, inputs, autocast), step(ours, inputs, autocast)
        assert torch.equal(l0, l1)  # the forward is eager's, bit for bit
        assert_bf16_close(g1, g0)  # bf16: one rounding of the backward where eager has two
