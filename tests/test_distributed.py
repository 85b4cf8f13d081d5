"""Compressed models under DistributedDataParallel and FSDP2 (fully_shard): two CPU processes
on the gloo backend, each with half of the global batch, against one process on the whole batch.

The two processes run this file as a script, once for all cases, and save their losses and
gradients; the tests compare them with single-process runs made here first. The processes
inherit the environment (TRITON_INTERPRET, the session's ACTDESIGN_CACHE_DIR), so they import
the op modules, fitted tables and numba kernels those runs rendered, fitted and compiled.

Models are float64, which every method supports (ActNN quantizes in float32 internally), so
deterministic methods must agree to float64 round-off. Split over two processes, every sum runs
in another order; the longest (the loss averages 384 elements, a weight gradient sums 24 rows)
have error bounds n·u·Σ|terms| with u = 1.1e-16, under 5e-14 of the summed magnitudes (seen:
3e-16 of each tensor's largest entry). A tolerance of 1e-12 of the largest entry is far above
that and far below any real difference, which is of the size of the gradients themselves.
"""

import importlib.util
import os
import subprocess
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from actdesign.runtime import compress

WORLD = 2
BATCH, TOKENS, WIDTH, HIDDEN = 8, 3, 16, 32
ROUNDOFF = 1e-12
DDP_CASES = ("fewbit3", "regelu2", "msnorm", "backrazor90", "actnn2")
FSDP_CASE = "fewbit3+msnorm+backrazor90"  # every deterministic kind of module
# The lossless conv chains on a small conv net, with batch norms and with group norms.
CONV_CASES = [("ddp-conv-batch", "cnn"), ("ddp-conv-group", "cnn")]
LM_CASES = [("fsdp-head", "llm"), ("wrapped", "llm"), ("fsdp-lora", "llm"), ("fsdp-moe", "llm"),
            ("fsdp-cpu-offload", "llm+offload"), ("fsdp-lora-tiled", "llm")]
# What each policy must replace, so that a no-op compress cannot pass.
REPLACED = {"fewbit3": {"act"}, "regelu2": {"act"}, "msnorm": {"norm", "fc1"},
            "backrazor90": {"fc1", "fc2"}, "actnn2": {"fc1", "fc2"},
            FSDP_CASE: {"norm", "act", "fc1", "fc2"}}


class Block(nn.Module):
    """A pre-norm MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, TOKENS, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def make_model(policy):
    """(model, compress report): the same float64 model in every process, compressed unless
    policy is None. The norm gets a non-trivial affine, so that a γ or β handled wrong shows."""
    torch.manual_seed(0)  # also fixes the seeds ActNN layers draw when they are made
    model = Block().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    report = None if policy is None else compress(model, policy, example_inputs=(batch()[0],))
    return model, report


class ConvNet(nn.Module):
    """conv, norm, ReLU, max pool; a residual conv and norm; a mean-pooled head: the parts
    of a ResNet a chain joins."""

    def __init__(self, norm):
        super().__init__()
        def make(channels):
            return nn.BatchNorm2d(channels) if norm == "batch" else nn.GroupNorm(2, channels)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.norm1 = make(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.norm2 = make(8)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.pool(self.relu(self.norm1(self.conv1(x))))
        y = self.relu(y + self.norm2(self.conv2(y)))
        return self.head(y.mean((2, 3)))


def images():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 3, 12, 12, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 4, generator=g, dtype=torch.float64)


def make_conv(norm, policy):
    """(the float64 conv net with trained-like norms, compress report or None)."""
    torch.manual_seed(0)
    model = ConvNet(norm).double()
    with torch.no_grad():
        for m in (model.norm1, model.norm2):
            m.weight.uniform_(0.8, 1.2)
            m.bias.uniform_(-0.1, 0.1)
    report = None if policy is None else compress(model, policy,
                                                  example_inputs=(images()[0][:2],))
    return model, report


def make_lm(lora=False, policy="llm", tile=None):
    """(llama-tiny compressed with `llm`, float64, dropout off, its token batch): the fused
    loss reads the head's weight through the head's own call. With `lora`, PEFT LoRA on all
    seven projections first (B drawn, so that A's gradients are not zero; no dropout, whose
    masks depend on how the batch is split), the lean LoRA path on each. With `tile`, the
    gated MLPs run in tiles of that many tokens."""
    from actdesign.runtime import models

    model, _ = models.build("llama-tiny")
    model = model.double().train()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    ids = torch.randint(1, 512, (BATCH, 6), generator=torch.Generator().manual_seed(3))
    if tile is not None:
        from actdesign.runtime.apply import policy as policy_mod

        policy = {"rules": [{"target": "glu", "apply": "msglu", "tile": tile},
                            *policy_mod.load(policy).to_dict()["rules"]]}
    report = compress(model, policy, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    return model, report, ids


def make_moe(compressed=True):
    """(a tiny Mixtral, float64, its router's load-balancing loss at coefficient 0.5,
    compressed with `llm` unless not `compressed`; its token batch)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from lms import architecture

    model = architecture("Mixtral", router_aux_loss_coef=0.5)
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    model = model.double().train()
    ids = torch.randint(1, 128, (BATCH, 6), generator=torch.Generator().manual_seed(3))
    if compressed:
        compress(model, "llm", example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    return model, ids


def lm_step(model, ids, **kwargs):
    loss = model(input_ids=ids, labels=ids, **kwargs).loss  # every rank counts the same tokens
    loss.backward()
    return loss.detach()


def step(model, x, target):
    """Forward and backward of a loss averaged over the local batch: DDP and FSDP average the
    ranks' gradients, which is then the gradient of the global mean."""
    loss = (model(x) - target).square().mean()
    loss.backward()
    return loss.detach()


# --- the two processes ---------------------------------------------------------------------------

def run_lm_case(rank, mode, policy):
    """llm on a transformers model: FSDP2 with the head sharded as its own unit (the loss must
    read the unsharded weight), and compress refusing a model wrapped already."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from actdesign.errors import ActdesignError

    local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    if mode == "fsdp-moe":
        model, ids = make_moe()
    else:
        model, _, ids = make_lm(lora=mode.startswith("fsdp-lora"), policy=policy,
                                tile=5 if mode == "fsdp-lora-tiled" else None)
    if mode == "wrapped":
        refused = []
        for wrap in (DistributedDataParallel, fully_shard):
            plain, _ = __import__("actdesign.runtime.models", fromlist=["build"]).build(
                "llama-tiny")
            wrapped = wrap(plain)
            try:
                compress(wrapped, "llm")
            except ActdesignError as exc:
                refused.append(str(exc))
        return {"refused": refused}
    mesh = init_device_mesh("cpu", (WORLD,))
    lm = model.get_base_model() if mode.startswith("fsdp-lora") else model
    # FSDP2's own engine keeps the weights, gradients and optimizer state on the host
    # (pinning needs CUDA: on the CPU the host memory is plain)
    shard = {"mesh": mesh, **({"offload_policy": CPUOffloadPolicy(pin_memory=False)}
                              if mode == "fsdp-cpu-offload" else {})}
    for layer in lm.model.layers:
        fully_shard(layer, **shard)
    fully_shard(lm.lm_head, **shard)  # the head its own unit, as some frameworks wrap it
    fully_shard(model, **shard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = lm_step(model, ids[local], **({"output_router_logits": True}
                                             if mode == "fsdp-moe" else {}))
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()
             if p.grad is not None}
    dist.all_reduce(loss)
    tiles = {m.tile for m in model.modules() if type(m).__name__ == "MSGLU"}
    return {"loss": loss / WORLD, "grads": grads, "warnings": [str(w.message) for w in caught],
            "tiles": sorted(tiles, key=str)}


def run_conv_case(rank, mode, policy):
    """The conv net under DDP, eager and compressed, each rank on its half: loss, averaged
    gradients and the running statistics (each rank's own: CPU has no SyncBatchNorm)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    x, target = images()
    local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    out = {}
    for name, applied in (("eager", None), ("compressed", policy)):
        model, _ = make_conv(mode.removeprefix("ddp-conv-"), applied)
        loss = step(DistributedDataParallel(model), x[local], target[local])
        dist.all_reduce(loss)
        out[name] = {"loss": loss / WORLD,
                     "grads": {n: p.grad for n, p in model.named_parameters()},
                     "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    return out["compressed"] | {"eager": out["eager"]}


def run_case(rank, mode, policy):
    import torch.distributed as dist

    if policy.startswith("llm"):
        return run_lm_case(rank, mode, policy)
    if mode.startswith("ddp-conv"):
        return run_conv_case(rank, mode, policy)
    x, target = batch()
    local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    model, _ = make_model(policy)  # compressed before wrapping, as compress requires
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        loss = step(DistributedDataParallel(model), x[local], target[local])
        grads = {name: p.grad for name, p in model.named_parameters()}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for module in (model.fc1, model.fc2, model):  # per layer, then the rest, as usual
            fully_shard(module, mesh=mesh)
        loss = step(model, x[local], target[local])
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    dist.all_reduce(loss)  # gloo has no AVG
    return {"loss": loss / WORLD, "grads": grads}


def worker(rank, out: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    results = {}
    for mode, policy in [("ddp", p) for p in DDP_CASES] + [("fsdp", FSDP_CASE)] + CONV_CASES + \
            LM_CASES:
        try:
            results[mode, policy] = run_case(rank, mode, policy)
        except Exception:  # reported by the test of this case; the others still run
            results[mode, policy] = {"error": traceback.format_exc()}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))


# --- the tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """{policy: (loss, gradients)} of one process on the whole batch. Runs before the two
    processes start, so the renders, fits and compiles are theirs to reuse from the cache."""
    out = {}
    for policy in (*DDP_CASES, FSDP_CASE):
        model, report = make_model(policy)
        assert {c.name for c in report.replaced} == REPLACED[policy], str(report)
        loss = step(model, *batch())
        out[policy] = loss, {name: p.grad for name, p in model.named_parameters()}
    model, report = make_conv("group", "cnn")
    assert {"norm1", "norm2", "pool", "relu"} <= {c.name for c in report.replaced}, str(report)
    loss = step(model, *images())
    out["cnn group"] = loss, {name: p.grad for name, p in model.named_parameters()}
    for lora in (False, True) if importlib.util.find_spec("peft") else (False,):
        model, report, ids = make_lm(lora)
        assert any(c.new.startswith("FusedLossHead") for c in report.replaced), str(report)
        assert sum(c.new.startswith("lean LoRA") for c in report.replaced) == 14 * lora
        loss = lm_step(model, ids)
        out["llm+lora" if lora else "llm"] = loss, {
            name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    # The MoE model, compressed and untouched, on each rank's half: the load-balancing loss is
    # not a mean over the tokens, so each rank adds its own half's; the gradients average.
    for compressed in (True, False):
        model, ids = make_moe(compressed)
        halves = [lm_step(model, ids[r * BATCH // WORLD:(r + 1) * BATCH // WORLD],
                          output_router_logits=True).double() for r in range(WORLD)]
        out["moe" if compressed else "moe untouched"] = sum(halves) / WORLD, {
            name: p.grad / WORLD for name, p in model.named_parameters() if p.grad is not None}
    return out


@pytest.fixture(scope="module")
def ranks(reference, tmp_path_factory):
    """{(mode, policy): [rank 0's result, rank 1's result]} from two processes."""
    out = tmp_path_factory.mktemp("distributed")
    logs = [out / f"rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as f:  # the child writes to its own copy of the descriptor
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(out)],
                                          env=os.environ, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)  # a hung collective times out after 60 s on its own
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log.read_text()}"
    results = [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]
    return {key: [r[key] for r in results] for key in results[0]}


def results_of(ranks, key):
    for rank, r in enumerate(ranks[key]):
        if "error" in r:
            pytest.fail(f"{key} on rank {rank}:\n{r['error']}")
    return ranks[key]


def assert_roundoff_close(actual, expected, name):
    torch.testing.assert_close(actual, expected, rtol=ROUNDOFF,
                               atol=ROUNDOFF * expected.abs().max().item(), msg=name)


def assert_matches(runs, loss, grads):
    for run in runs:
        torch.testing.assert_close(run["loss"], loss, rtol=ROUNDOFF, atol=0)
        assert run["grads"].keys() == grads.keys()
        for name, g in grads.items():
            assert_roundoff_close(run["grads"][name], g, name)


@pytest.mark.parametrize("policy", [p for p in DDP_CASES if p != "actnn2"])
def test_ddp_matches_one_process(policy, reference, ranks):
    assert_matches(results_of(ranks, ("ddp", policy)), *reference[policy])


def test_ddp_on_a_conv_net_with_batch_norms_is_eagers_bit_for_bit(ranks):
    """Each rank normalises its own half, as eager does under DDP without SyncBatchNorm
    (which torch runs on GPUs only): per rank, the compressed net's loss, averaged
    gradients and running statistics are the eager net's under DDP, bit for bit."""
    for run in results_of(ranks, ("ddp-conv-batch", "cnn")):
        eager = run["eager"]
        assert torch.equal(run["loss"], eager["loss"])
        for key in ("grads", "buffers"):
            assert run[key].keys() == eager[key].keys()
            assert [n for n, t in eager[key].items() if not torch.equal(run[key][n], t)] == []
        assert not torch.equal(eager["buffers"]["norm1.running_mean"],
                               torch.zeros(8, dtype=torch.float64))  # the statistics moved


def test_ddp_on_a_conv_net_with_group_norms_matches_one_process(reference, ranks):
    assert_matches(results_of(ranks, ("ddp-conv-group", "cnn")), *reference["cnn group"])


def test_fsdp2_matches_one_process(reference, ranks):
    assert_matches(results_of(ranks, ("fsdp", FSDP_CASE)), *reference[FSDP_CASE])


def test_fsdp2_with_the_head_its_own_unit_matches_one_process(reference, ranks):
    assert_matches(results_of(ranks, ("fsdp-head", "llm")), *reference["llm"])


def test_fsdp2_cpu_offload_of_a_model_with_offloaded_checkpoints_matches_one_process(
        reference, ranks):
    """FSDP2's CPUOffloadPolicy (weights, gradients and optimizer state on the host) over
    `llm+offload` (block inputs on the host): the one-process `llm` step, whose gradients the
    recompute keeps bit for bit, to round-off."""
    assert_matches(results_of(ranks, ("fsdp-cpu-offload", "llm+offload")), *reference["llm"])


def test_fsdp2_head_unit_returns_no_view(ranks):
    """The head as its own FSDP2 unit returns no view (FSDP2 warns that an in-place op on one
    drops its pre-backward hook): a MoE forward adds its router loss in place to the loss."""
    for mode in ("fsdp-head", "fsdp-moe"):
        for run in results_of(ranks, (mode, "llm")):
            assert not [w for w in run["warnings"] if "view tensor" in w], (mode, run["warnings"])


def test_fsdp2_on_a_moe_model_adds_each_ranks_router_loss(reference, ranks):
    """Compressed, under FSDP2, the loss and gradients of the untouched model on each rank's
    half, the router's load-balancing loss included: to round-off of the compressed model in one
    process, which is the untouched one but for its cross-entropy, float32 even in a float64
    model (logits rounded to 2^-24 and a float32 softmax: seen 4 such roundings of the
    largest gradient, 2^-18 allows 64)."""
    loss, grads = reference["moe"]
    assert_matches(results_of(ranks, ("fsdp-moe", "llm")), loss, grads)
    untouched, expected = reference["moe untouched"]
    assert any(".gate." in n for n in expected)  # the router learns
    torch.testing.assert_close(loss, untouched, rtol=2.0**-18, atol=0)
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=2.0**-18 * g.abs().max().item(),
                                   msg=name)


def test_fsdp2_on_a_compressed_peft_lora_model_matches_one_process(reference, ranks):
    pytest.importorskip("peft")  # PEFT first, then compress, then fully_shard
    assert len(reference["llm+lora"][1]) == 28  # A and B of 14 layers; the rest is frozen
    assert_matches(results_of(ranks, ("fsdp-lora", "llm")), *reference["llm+lora"])


def test_fsdp2_on_peft_lora_with_tiled_mlps_matches_one_process(reference, ranks):
    """MS-GLU in tiles of 5 tokens (24 per rank: 5 tiles) under FSDP2 with PEFT LoRA: the
    gradients of the tiles' parameters reach FSDP2 once, summed; the one-process untiled step
    to round-off (the tiles sum the tokens in another order)."""
    pytest.importorskip("peft")
    runs = results_of(ranks, ("fsdp-lora-tiled", "llm"))
    assert all(run["tiles"] == [5] for run in runs)
    assert_matches(runs, *reference["llm+lora"])


def test_compress_refuses_a_model_wrapped_already(ranks):
    for run in results_of(ranks, ("wrapped", "llm")):
        assert len(run["refused"]) == 2  # DDP and fully_shard
        assert all("compress the plain model first" in why for why in run["refused"])


def test_ddp_actnn_within_one_step_per_element(ranks):
    """Stochastic rounding draws other numbers in each process, so DDP cannot match one process
    exactly. The ranks still agree exactly (they all-reduce), and only the weight gradients of
    the quantized layers differ from the exact gradient: the forward and the input gradients are
    exact. A restored input element is off by less than one quantization step of its group,
    at most s_n = (max - min) / (2^bits - 1) over its sample n (a group lies in one sample), so
    |dW - dW_exact| <= |G|^T s, with G the exact gradient of the layer's output. Seen: at
    most half of that bound."""
    runs = results_of(ranks, ("ddp", "actnn2"))
    for name, g in runs[0]["grads"].items():
        assert torch.equal(runs[1]["grads"][name], g), name

    model, _ = make_model(None)
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen[module] = args[0], out

    for layer in (model.fc1, model.fc2):
        layer.register_forward_hook(keep)
    loss = step(model, *batch())
    torch.testing.assert_close(runs[0]["loss"], loss, rtol=ROUNDOFF, atol=0)
    bits = 2  # actnn2
    for name, p in model.named_parameters():
        got = runs[0]["grads"][name]
        if name not in ("fc1.weight", "fc2.weight"):
            assert_roundoff_close(got, p.grad, name)
            continue
        x, out = seen[model.get_submodule(name.removesuffix(".weight"))]
        flat = x.reshape(BATCH, -1)
        step_size = (flat.amax(1) - flat.amin(1)) / (2**bits - 1)
        # ActNN computes in float32: allow a few float32 roundings (2^-24 each) of the largest
        # input of the sample on top of the step.
        slack = 2.0**-18 * flat.abs().amax(1)
        # The bound of row o of dW; every input element of a sample has the same error bound.
        bound = torch.einsum("nto,n->o", out.grad.abs(), step_size + slack)[:, None]
        error = (got - p.grad).abs()
        assert (error <= bound + ROUNDOFF * p.grad.abs().max()).all(), (error / bound).max()
        assert error.max() > 0, "the quantized copy was exact: ActNN did not run"
