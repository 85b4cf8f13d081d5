"""The LLM buckets: the fused linear cross-entropy, MS-GLU, LeanLinear and the `llm` preset,
against eager computations, in float64, float32 and bf16."""

import copy
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from actdesign.errors import ActdesignError
from actdesign.runtime import LeanLinear, MSRMSNorm, account, compress, models
from actdesign.runtime.methods.fused_ce import attach_fused_loss
from actdesign.runtime.ops.glu import MSGLU, glu_ops
from actdesign.runtime.ops.lm_loss import FusedLossHead, fused_linear_cross_entropy, loss_ops

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from conftest import module_step  # noqa: E402
from lms import NAMES, architecture  # noqa: E402


def eager_loss(hidden, weight, labels, num_items_in_batch=None, wide=torch.float32):
    """transformers' causal-LM loss of hidden @ weight.T (float64 kept for float64 inputs)."""
    logits = (hidden @ weight.T).to(wide)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.flatten(0, -2), shifted.reshape(-1), ignore_index=-100,
                           reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def loss_and_grads(fn, hidden, weight, autocast=False):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w)
    loss.backward()
    return loss.detach().double(), h.grad, w.grad


def problem(dtype=torch.float64, seed=0, tokens=37, d=24, vocab=301):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens, d, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (2, tokens), generator=g)
    labels[0, :5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("items", [None, 50])
def test_fused_loss_equals_the_eager_loss_in_float64(chunk, items):
    hidden, weight, labels = problem()
    expected = loss_and_grads(lambda h, w: eager_loss(h, w, labels, items, torch.float64),
                              hidden, weight)
    got = loss_and_grads(lambda h, w: fused_linear_cross_entropy(
        h, w, labels, num_items_in_batch=items, chunk_size=chunk), hidden, weight)
    for a, b in zip(got, expected, strict=True):  # float64 round-off only
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert got[1].dtype == got[2].dtype == torch.float64


def test_shift_labels_and_every_label_ignored():
    hidden, weight, labels = problem()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    a = fused_linear_cross_entropy(hidden, weight, labels)
    b = fused_linear_cross_entropy(hidden, weight, shift_labels=shifted)
    assert torch.equal(a, b)
    nothing = torch.full_like(labels, -100)  # eager: the mean over no tokens is NaN
    assert fused_linear_cross_entropy(hidden, weight, nothing).isnan()
    assert eager_loss(hidden, weight, nothing).isnan()
    with pytest.raises(ActdesignError, match="labels or shift_labels"):
        fused_linear_cross_entropy(hidden, weight)
    with pytest.raises(ActdesignError, match="do not match"):
        fused_linear_cross_entropy(hidden, weight, labels[:, :5])
    with pytest.raises(ActdesignError, match="cannot read"):
        fused_linear_cross_entropy(hidden, weight[:, :5], labels)


@pytest.mark.parametrize("autocast", [False, True])
def test_shift_false_is_the_cross_entropy_of_the_labels_as_given(autocast):
    """shift=False reads labels aligned with the hidden states (a model that is not causal,
    or labels shifted already): the unfused cross-entropy of the same labels, unshifted.
    float32: both compute the same float32 numbers in another order of sums, so torch's
    float32 tolerances hold. Under bf16 autocast both round the logits to bf16 (eps 2^-8)
    before a float32 cross-entropy; the chunked product may round some logits the other
    way, so the loss and gradients agree to within that rounding, relative to their norm."""
    hidden, weight, labels = problem(torch.float32, tokens=45, d=32, vocab=257)

    def unfused(h, w):
        logits = F.linear(h, w).float()
        return F.cross_entropy(logits.flatten(0, -2), labels.reshape(-1), ignore_index=-100)

    expected = loss_and_grads(unfused, hidden, weight, autocast)
    got = loss_and_grads(lambda h, w: fused_linear_cross_entropy(h, w, labels, shift=False,
                                                                 chunk_size=16),
                         hidden, weight, autocast)
    shifted = loss_and_grads(lambda h, w: fused_linear_cross_entropy(h, w, labels), hidden,
                             weight, autocast)
    assert (shifted[0] - expected[0]).abs() > 0.01  # the default shift reads other labels
    for g, e in zip(got, expected, strict=True):
        if autocast:
            assert (g.double() - e.double()).norm() <= 2 ** -8 * e.double().norm()
        else:
            torch.testing.assert_close(g, e)
    same = fused_linear_cross_entropy(hidden, weight, shift_labels=labels)
    assert torch.equal(fused_linear_cross_entropy(hidden, weight, labels, shift=False), same)


@pytest.mark.parametrize("mode", ["float32", "autocast", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fused_loss_is_as_accurate_as_eager(mode, seed, backend, monkeypatch):
    """Against the float64 loss of the same (rounded) inputs: the fused loss and gradients are
    at most twice as far from it as eager's in the same precision (two computations with the
    same roundings: the bf16 product, a float32 cross-entropy; only the order of sums and,
    for the weight gradient, per-chunk rounding differ)."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", backend)  # triton: the CUDA kernels, interpreted
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    hidden, weight, labels = problem(dtype, seed, tokens=137, d=64, vocab=1001)
    autocast = mode == "autocast"
    if autocast:  # what the product consumes
        exact_h, exact_w = hidden.bfloat16().double(), weight.bfloat16().double()
    else:
        exact_h, exact_w = hidden.double(), weight.double()
    exact = loss_and_grads(lambda h, w: eager_loss(h, w, labels, wide=torch.float64),
                           exact_h, exact_w)
    eager = loss_and_grads(lambda h, w: eager_loss(h, w, labels), hidden, weight, autocast)
    fused = loss_and_grads(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=32),
                           hidden, weight, autocast)
    for e, f, x in zip(eager, fused, exact, strict=True):
        assert f.dtype == e.dtype
        assert (f.double() - x).norm() <= 2 * (e.double() - x).norm() + 1e-7 * x.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [301, 2 * loss_ops().BLOCK + 77])  # one block; a loop, a tail
def test_loss_kernels_are_as_accurate_as_the_torch_path(dtype, vocab, monkeypatch):
    """Both compute the same float32 quantities from the same logits, in another order: each
    output is at most twice as far from float64 as the torch path's, plus one float32
    rounding (u = 2^-24) of its size."""
    ops, rows = loss_ops(), 9
    g = torch.Generator().manual_seed(vocab)
    z = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[2, 5]] = -100
    targets[0] = vocab - 1  # the last column, in the tail block
    grad = torch.tensor(0.37)

    def run(backend, z=z, wide=torch.float32):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        lse, nll = torch.empty(rows, dtype=wide), torch.empty(rows, dtype=wide)
        ops.row_losses(z, targets, -100, lse, nll)
        return lse, nll, ops.logits_grad_(z.clone(), targets, -100, lse, grad.to(wide))

    exact = run("torch", z.double(), torch.float64)
    torch_path, kernels = run("torch"), run("triton")
    assert kernels[2].dtype == dtype
    assert torch.equal(kernels[1][[2, 5]], torch.zeros(2))  # ignored rows: no loss,
    assert not kernels[2][[2, 5]].any()  # no gradient
    for k, t, x in zip(kernels, torch_path, exact, strict=True):
        x = x.to(dtype).double() if x.dim() == 2 else x  # the rounding to dtype is part of it
        slack = 2**-24 * x.norm()
        assert (k.double() - x).norm() <= 2 * (t.double() - x).norm() + slack


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates while it is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_nothing_of_size_tokens_times_vocabulary_is_kept_or_made(saved):
    hidden, weight, labels = problem(torch.float32, tokens=300, d=16, vocab=2000)
    h = hidden.clone().requires_grad_(True)
    kept = saved(lambda x: fused_linear_cross_entropy(x, weight, labels, chunk_size=64), h,
                 [weight])
    # the hidden states themselves, the shifted labels (int64), one float32 per token, and the
    # count of counted tokens (an int64 scalar the mean divides by)
    assert sorted(kept.values()) == sorted([h.numel() * 4, 600 * 8, 600 * 4, 8])
    w = weight.clone().requires_grad_(True)
    with LargestTensor() as mode:
        fused_linear_cross_entropy(h, w, labels, chunk_size=64).backward()
    chunk = 64 * 2000 * 4  # one chunk's float32 logits
    assert chunk <= mode.largest <= chunk + 64 * 8  # (the gather of targets is smaller)
    with LargestTensor() as mode:
        eager_loss(h, w, labels).backward()
    assert mode.largest >= 600 * 2000 * 4


@pytest.mark.parametrize("compiling", [False, True])
def test_the_kernels_make_no_float32_copy_of_a_chunk(compiling, monkeypatch):
    """Under autocast the kernels read and overwrite the bf16 logits of a chunk; the torch
    path (and what torch.compile traces, fusing it itself) copies them to float32."""
    monkeypatch.setenv("ACTDESIGN_BACKEND", "triton")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    hidden, weight, labels = problem(torch.float32, tokens=300, d=16, vocab=2000)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with LargestTensor() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(h, w, labels, chunk_size=64)
        loss.backward()
    chunk = 64 * 2000  # logits per chunk
    if compiling:
        assert mode.largest >= chunk * 4
    else:
        assert mode.largest == chunk * 2


def test_under_autocast_only_the_consumed_hidden_states_are_kept(saved):
    """The bf16 copy the product consumes, never the head weight's bf16 copy (eager keeps
    both, and the logits)."""
    hidden, weight, labels = problem(torch.float32, tokens=300, d=16, vocab=2000)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused_linear_cross_entropy(x, w, labels, chunk_size=64)

    kept = saved(loss, h, [w])
    assert sorted(kept.values()) == sorted([h.numel() * 2, 600 * 8, 600 * 4, 8])


# --- transformers causal LMs --------------------------------------------------------------

def causal_lm(name="llama-tiny", dtype=torch.float32):
    """A built-in causal LM in training mode (where the fused loss runs), dropout off."""
    model, _ = models.build(name)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.to(dtype).train()


def run_model(model, inputs, autocast=False, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_attached_loss_matches_the_models_own(name):
    model = causal_lm(name)
    ref = copy.deepcopy(model)
    inputs = models.example_batch(model, 2, 12)
    inputs["labels"][0, :3] = -100
    assert attach_fused_loss(model, chunk_size=5, probe=models.example_batch(model, 2, 8)) \
        == "lm_head"
    assert isinstance(model.lm_head, FusedLossHead)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(17)}):
        out0, grads0 = run_model(ref, inputs, **kwargs)
        out1, grads1 = run_model(model, inputs, **kwargs)
        assert out1.logits is None  # never materialised
        torch.testing.assert_close(out1.loss, out0.loss, rtol=2e-6, atol=0)
        assert grads1.keys() == grads0.keys()  # tied embeddings (GPT-2) included
        for n in grads0:
            torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)
    plain = {"input_ids": inputs["input_ids"]}  # no labels: exactly the model as it was
    with torch.no_grad():
        assert torch.equal(model(**plain).logits, ref(**plain).logits)
    loss, *rest = model(**inputs, return_dict=False)
    torch.testing.assert_close(loss, ref(**inputs).loss, rtol=2e-6, atol=0)
    clone = copy.deepcopy(model)  # the copy runs its own modules and weights
    with torch.no_grad():
        clone.lm_head.weight.mul_(2)
        assert clone(**inputs).loss != model(**inputs).loss
        assert clone(**plain).logits.abs().sum() > 0
    with pytest.raises(ActdesignError, match="logits_to_keep"):
        model(**inputs, logits_to_keep=1)


def test_attached_loss_under_autocast_is_as_accurate_as_eager():
    model = causal_lm()
    ref = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    inputs = models.example_batch(model, 2, 12)
    attach_fused_loss(model)
    out64, grads64 = run_model(exact, inputs)
    out0, grads0 = run_model(ref, inputs, autocast=True)
    out1, grads1 = run_model(model, inputs, autocast=True)
    for n in grads0:
        assert grads1[n].dtype == torch.float32
        x = grads64[n]
        assert (grads1[n].double() - x).norm() <= 2 * (grads0[n].double() - x).norm(), n


def scaled(model, labels=None, **kwargs):
    """A forward scaling the logits after the head (Cohere's logit_scale, say), its loss
    computed by loss_function, as transformers' forwards do."""
    out = type(model).forward(model, **kwargs)
    out.logits = 0.5 * (out.logits / 2.0)
    if labels is not None:
        out.loss = model.loss_function(out.logits, labels, model.config.vocab_size)
    return out


def test_heads_the_fused_loss_cannot_reproduce_are_refused_unchanged():
    model = causal_lm()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ActdesignError, match="final_logit_softcapping"):
        attach_fused_loss(model)
    model = causal_lm()
    model.lm_head.bias = nn.Parameter(torch.zeros(model.lm_head.out_features))
    with pytest.raises(ActdesignError, match="bias"):
        attach_fused_loss(model)
    model = causal_lm()
    own = model.forward

    def capped(self, **kwargs):  # soft-capping the logits: not something the hidden states allow
        out = own(**kwargs)
        out.logits = 3 * torch.tanh(out.logits / 3)
        if out.loss is not None:
            out.loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                       kwargs["labels"][:, 1:].flatten())
        return out

    model.forward = types.MethodType(capped, model)
    with pytest.raises(ActdesignError, match="cannot follow this forward: it applies tanh to "
                                             "the logits"):
        attach_fused_loss(model, probe=models.example_batch(model, 2, 8))
    assert type(model.lm_head) is nn.Linear and model.forward.__func__ is capped  # unchanged
    # a scale commutes with the head
    model.forward = types.MethodType(scaled, model)
    ref = copy.deepcopy(model)
    attach_fused_loss(model, probe=models.example_batch(model, 2, 8))
    inputs = models.example_batch(model, 2, 12)
    out0, grads0 = run_model(ref, inputs)
    out1, grads1 = run_model(model, inputs)
    assert out1.logits is None and len(grads0) == len(list(model.parameters()))
    torch.testing.assert_close(out1.loss, out0.loss, rtol=2e-6, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)
    other = causal_lm()
    other.forward = lambda **kwargs: own(**kwargs)  # not a method of the model: refused
    with pytest.raises(ActdesignError, match="already replaced"):
        attach_fused_loss(other)
    with pytest.raises(ActdesignError, match="causal LM"):
        attach_fused_loss(causal_lm("bert-tiny"))


# --- MS-GLU ---------------------------------------------------------------------------------

def llama_mlp(dtype=torch.float32, act="silu"):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act=act)
    torch.manual_seed(0)
    return transformers.models.llama.modeling_llama.LlamaMLP(config).to(dtype)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("mode", ["float32", "autocast", "bf16"])
def test_ms_glu_is_the_eager_mlp_bit_for_bit(act, mode):
    """The torch path uses eager's own ops with eager's roundings: identical results."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    eager = llama_mlp(dtype, act)
    ours = MSGLU.from_module(copy.deepcopy(eager))
    x = torch.randn(3, 5, 32, dtype=dtype)
    g = torch.randn(3, 5, 32)
    (y0, dx0, grads0), (y1, dx1, grads1) = (module_step(m, x, g, mode == "autocast")
                                            for m in (eager, ours))
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert all(torch.equal(a, b) and a.dtype == p.dtype
               for a, b, p in zip(grads1, grads0, ours.parameters(), strict=True))


def test_ms_glu_keeps_gate_and_up_only(saved):
    eager = llama_mlp()
    ours = MSGLU.from_module(copy.deepcopy(eager))
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)  # a norm's bf16 output

    kept = saved(ours, x, list(ours.parameters()), autocast=True)
    assert sorted(kept.values()) == [4 * 32 * 2, 4 * 80 * 2, 4 * 80 * 2]  # x, g, u
    theirs = saved(eager, x, list(eager.parameters()), autocast=True)
    # eager: x, g, act(g), u, h, and the three bf16 weight copies
    assert sum(theirs.values()) == 4 * 32 * 2 + 4 * 4 * 80 * 2 + 3 * 32 * 80 * 2


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_glu_triton_kernels_match_the_torch_path(kind, dtype, monkeypatch):
    """Both compute each step in float32 and round where eager does. Their float32 formulas
    for the activation and its slope differ in the last bits (torch's CPU tanh-GELU backward
    is off by up to about 4 float32 ulps; the kernel's tanh keeps its tails exact): 16 float32
    ulps of the output's scale. A 16-bit rounding that this moves across a boundary changes a
    value by one step of its dtype: 2 eps relative."""
    ops = glu_ops()
    g = (torch.randn(3000, dtype=torch.float64) * 3).to(dtype)
    u, dh = torch.randn_like(g), torch.randn_like(g)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ACTDESIGN_BACKEND", backend)
        results[backend] = (ops.forward(g, u, kind), *ops.backward(g, u, dh, kind))
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    for a, b in zip(results["triton"], results["torch"], strict=True):
        assert a.dtype == dtype
        a, b = a.double(), b.double()
        bound = 2 * eps * b.abs() + 16 * eps32 * b.abs().max()
        assert ((a - b).abs() <= bound).all()


def test_glu_ops_opcheck_and_compile():
    ops = glu_ops()
    g, u, dh = (torch.randn(6, 10) for _ in range(3))
    torch.library.opcheck(ops.forward, (g, u, "silu"))
    torch.library.opcheck(ops.backward, (g, u, dh, "gelu_tanh"))
    eager = llama_mlp()
    ours = MSGLU.from_module(copy.deepcopy(eager))
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 32, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, eager(x), rtol=1e-6, atol=1e-6)


def test_eager_ms_glu_skips_the_custom_op_dispatch(monkeypatch):
    ops, mlp = glu_ops(), llama_mlp()
    ours = MSGLU.from_module(copy.deepcopy(mlp))
    x = torch.randn(2, 32, requires_grad=True)
    y_ref = ours(x)
    y_ref.sum().backward()
    grads_ref = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()

    def refuse(*args):
        raise AssertionError("custom op called in eager mode")

    monkeypatch.setattr(ops, "forward", refuse)
    monkeypatch.setattr(ops, "backward", refuse)
    y = ours(x)
    y.sum().backward()
    assert torch.equal(y, y_ref)
    assert all(torch.equal(p.grad, r) for p, r in zip(ours.parameters(), grads_ref, strict=True))


def test_a_down_projection_with_hooks_is_called_as_a_module():
    """A hook that may act on down_proj (a wrapper's) runs: MS-GLU calls it as a module on h,
    offered as a recipe from g and u, with the same results and nothing more kept. A hook that
    only observes (accounting's) leaves the fused path, so that gradient checkpointing sees the
    same saved tensors when it runs the forward again without it."""
    eager = llama_mlp()
    ours = MSGLU.from_module(copy.deepcopy(eager))
    x = torch.randn(3, 32, requires_grad=True)
    y0 = ours(x)
    y0.square().sum().backward()
    grads0 = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    seen = []
    ours.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y1 = ours(x)
    y1.square().sum().backward()
    assert seen == [(3, 80)]
    assert torch.equal(y1, y0)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads0, strict=True))
    storages = {t.untyped_storage().data_ptr() for t in kept if t.shape == (3, 80)}
    assert len(storages) == 2  # g and u: no h

    model = models.build("llama-tiny")[0].train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compress(model, "llm")
    inputs = models.example_batch(model, 1, 16)
    saved, out = account(model, lambda: model(**inputs).loss)
    out.backward()  # no CheckpointError: the same path in the forward and its recompute
    assert saved.total > 0


def test_modules_that_are_not_gated_mlps_are_refused():
    mlp = llama_mlp()
    mlp.act_fn = nn.ReLU()
    with pytest.raises(ActdesignError, match="not SiLU or tanh-GELU"):
        MSGLU.from_module(mlp)
    mlp = llama_mlp()
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x))
    with pytest.raises(ActdesignError, match="is not down_proj"):
        MSGLU.from_module(mlp)
    mlp = llama_mlp()
    mlp.up_proj = nn.Linear(32, 81, bias=False)
    with pytest.raises(ActdesignError, match="shapes"):
        MSGLU.from_module(mlp)


# --- the llm preset -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("policy", ["llm", "llm+actnn2", "llm+fewbit3"])
def test_llm_presets_compose_and_train(name, policy):
    model = causal_lm(name)
    ref = copy.deepcopy(model)
    report = compress(model, policy)
    kinds = {c.new.split(" ")[0].rstrip(",") for c in report.replaced}
    assert "FusedLossHead" in kinds and kinds & {"MSLayerNorm", "MSRMSNorm", "QMSLayerNorm",
                                                 "QMSRMSNorm"}
    assert ("MSGLU" in kinds) == (name == "llama-tiny")
    if policy == "llm+actnn2":  # the norms keep codes, which the layers reading them share
        assert "QLinear" in kinds and kinds & {"QMSLayerNorm", "QMSRMSNorm"}
    assert compress(model, policy).replaced == []  # idempotent
    inputs = models.example_batch(model, 2, 12)
    out0, grads0 = run_model(ref, inputs)
    out1, grads1 = run_model(model, inputs)
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-5, atol=0)  # the forward is exact
    assert all(g.isfinite().all() for g in grads1.values())
    if policy == "llm":  # lossless: gradients too
        for n, g in grads1.items():
            torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)


# Causal LMs beyond the built-ins, by their parts: what `llm` must find in each (MS norms,
# MS-GLU, the rotation, the fused loss) and the loss it must refuse (a head with a bias,
# soft-capping).
ARCHITECTURES = {
    "Mistral": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},
    "Qwen3": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},  # q/k norms: exact, as they are
    "Gemma": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},  # x̂·(1 + w), tanh-GELU
    "Gemma2": {"msnorm", "MSGLU", "rotary", "softcapping"},
    "Qwen3Next": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},  # x̂·(1 + w), MoE
    "Phi3": {"msnorm", "rotary", "FusedLossHead"},  # gate and up in one Linear: no MS-GLU
    "Olmo2": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},
    "Granite": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},  # scales the logits
    "Cohere": {"msnorm", "MSGLU", "FusedLossHead"},  # its own LayerNorm; an interleaved rotation
    "StableLm": {"msnorm", "MSGLU", "rotary", "FusedLossHead"},
    "GPTNeoX": {"msnorm", "rotary", "FusedLossHead"},  # rotates a quarter of each head
    "Mixtral": {"msnorm", "rotary", "FusedLossHead"},
    "Falcon": {"msnorm", "rotary", "FusedLossHead"},
    "OPT": {"msnorm", "FusedLossHead"},
}
def test_every_architecture_is_listed():
    assert set(ARCHITECTURES) == set(NAMES)


def parts(report):
    """What `llm` did to a model, in the words of ARCHITECTURES."""
    new = [c.new for c in report.replaced]
    found = {part for part in ("MSGLU", "FusedLossHead") if any(n.startswith(part)
                                                               for n in new)}
    found |= {"msnorm"} if any(n.startswith(("MSRMSNorm", "MSLayerNorm")) for n in new) \
        else set()
    found |= {"rotary"} if any("rotary" in n for n in new) else set()
    refused = " ".join(why for _, _, why in report.skipped)
    return found | {word for word in ("bias", "softcapping") if word in refused}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_llm_is_exact_on_other_causal_lms(name):
    model = architecture(name)
    ours = copy.deepcopy(model)
    report = compress(ours, "llm")
    assert parts(report) == ARCHITECTURES[name], str(report)
    inputs = models.example_batch(model, 2, 16)
    inputs["labels"][0, :3] = -100
    # The forward is exact: in float32, under autocast and with bf16 weights the losses
    # differ by float32's summation order at most (32 tokens, a few 2^-24 each).
    model16 = copy.deepcopy(model).bfloat16()
    ours16 = copy.deepcopy(model16)
    assert parts(compress(ours16, "llm")) == ARCHITECTURES[name]
    for a, b, autocast in ((model, ours, False), (model, ours, True), (model16, ours16, False)):
        out0, _ = run_model(a, inputs, autocast)
        out1, _ = run_model(b, inputs, autocast)
        torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-5, atol=0)
    out0, grads0 = run_model(model, inputs)
    out1, grads1 = run_model(ours, inputs)
    # Lossless in float32, every parameter's gradient, the norms' own too; the absolute term
    # covers gradients that are zero in exact arithmetic (a key bias: softmax ignores a shift
    # shared by a row).
    assert grads1.keys() == grads0.keys()
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("base", ["llm", "msnorm"])
def test_actnn_layers_reading_an_ms_norm_share_its_codes(name, base):
    """When ActNN quantizes every layer reading an MS norm, the norm keeps codes of its x̂
    in place of x̂ and those layers keep the same codes. A layer reading what
    attention keeps stays exact (lean): codes would add bytes. The bytes go down."""
    model = causal_lm(name)
    inputs = models.example_batch(model, 4, 64)  # codes pay once a group is full (256 values)
    plain = compress(copy.deepcopy(model), base, inputs)
    report = compress(model, f"{base}+actnn2", inputs)
    new = {c.name.rsplit(".", 2)[-2] + "." + c.name.rsplit(".", 1)[-1]: c.new
           for c in report.replaced if "layers.0." in c.name or ".h.0." in c.name}
    # The output projection reads what attention keeps for its backward (its output, whose
    # layout makes the merged heads a view of it).
    if name == "gpt2-tiny":
        readers, quantized, kept = ["attn.c_attn", "mlp.c_fc"], ["mlp.c_proj"], "attn.c_proj"
        norms = ["0.ln_1", "0.ln_2"]
    else:
        readers, quantized = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], []
        kept, norms = "self_attn.o_proj", ["0.input_layernorm", "0.post_attention_layernorm"]
        if base == "msnorm":
            readers, quantized = readers + ["mlp.gate_proj", "mlp.up_proj"], \
                quantized + ["mlp.down_proj"]
        else:  # MS-GLU holds the MLP's layers: gate and up share the codes, u is coded
            assert new["0.mlp"] == ("MSGLU (silu; keeps gate(x) and 4-bit codes of up(x) "
                                           "only; gate and up keep the MS norm's 2-bit codes "
                                           "of x)")
    for layer in readers:
        assert new[layer] == "QLinear (2-bit saved input: the MS norm's codes, shared)", layer
    for layer in quantized:
        assert new[layer] == "QLinear (2-bit saved input)", layer
    for norm in norms:
        assert "2-bit codes of x̂, shared with" in new[norm]
    assert new[kept] == "LeanLinear (its input is kept by another op, kept anyway: no codes)"
    assert report.after.total < plain.after.total


def test_an_ms_norm_keeps_its_output_when_a_reader_is_exact():
    """ActNN on q_proj only: k and v read the norm's output exactly, so the norm keeps x̂,
    and q_proj, whose input is then kept anyway (as x̂), stays exact too."""
    model = causal_lm("llama-tiny")
    policy = {"format": "actdesign.policy/1",
              "rules": [{"target": "norm", "apply": "msnorm"},
                        {"target": "linear", "apply": "actnn", "name": "*.q_proj"}]}
    report = compress(model, policy, models.example_batch(model, 2, 16))
    layer = model.model.layers[0]
    assert type(layer.input_layernorm) is MSRMSNorm
    assert type(layer.self_attn.q_proj) is LeanLinear
    what = {c.name: c.new for c in report.replaced}
    assert what["model.layers.0.self_attn.q_proj"] == \
        "LeanLinear (its input is an MS norm's x̂, kept anyway: no codes)"


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the method's newer name varies
def test_llm_with_gradient_checkpointing():
    model = causal_lm().train()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    compress(model, "llm")
    inputs = models.example_batch(model, 2, 12)
    out0, grads0 = run_model(ref, inputs)
    out1, grads1 = run_model(model, inputs)
    torch.testing.assert_close(out1.loss, out0.loss, rtol=1e-5, atol=0)
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("autocast", [False, True])
def test_shared_codes_under_gradient_checkpointing_are_the_recomputed_ones(autocast):
    """With checkpointing, each layer's forward runs twice; the recompute replays torch's
    generator, so it draws the codes the step without checkpointing drew. The gradients must be
    exactly those of that step. The norms' codes must reach their readers in the recomputation
    too, or their draws would differ."""
    model = causal_lm().train()
    compress(model, "llm+actnn2")
    inputs = models.example_batch(model, 2, 12)
    torch.manual_seed(5)
    out0, grads0 = run_model(model, inputs, autocast)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(5)
    out1, grads1 = run_model(model, inputs, autocast)
    assert torch.equal(out1.loss, out0.loss)
    assert grads1.keys() == grads0.keys()
    for n, g in grads1.items():
        assert torch.equal(g, grads0[n]), n
