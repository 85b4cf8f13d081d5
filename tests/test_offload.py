"""`checkpoint` with `offload`: each recomputed block's inputs wait in host memory for its
backward. The step is plain checkpointing's bit for bit (a copy is exact; the generators are
replayed as checkpoint replays them), in float32, under bf16 autocast and with bf16 weights;
a tensor every block takes is copied once; `estimate` counts the host bytes apart and the
device's saved bytes without the inputs."""

import copy
import os
import pickle
import sys

import pytest
import torch

from actdesign.errors import ActdesignError
from actdesign.runtime import compress, estimate, models
from actdesign.runtime.apply import policy as P
from actdesign.runtime.memory.steps import step
from actdesign.runtime.ops import offload

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import gpt2, llama, train_step  # noqa: E402

pytest.importorskip("transformers")

CHECKPOINT = {"target": "block", "apply": "checkpoint"}
OFFLOAD = {"target": "block", "apply": "checkpoint", "offload": True}


def pair(build, policy, bf16_weights=False):
    """(the model compressed by `policy` with plain checkpointing, a copy with offloaded
    checkpointing, the inputs)."""
    model, inputs = build()
    if bf16_weights:
        model.to(torch.bfloat16)
    offloaded = copy.deepcopy(model)
    rules = P.load(policy).to_dict()["rules"]
    compress(model, {"rules": [*rules, CHECKPOINT]})
    compress(offloaded, {"rules": [*rules, OFFLOAD]})
    return model, offloaded, inputs


@pytest.mark.parametrize("build, policy", [(llama, "llm"), (llama, "llm+actnn2"),
                                           (gpt2, "fewbit3+msnorm")],
                         ids=["llama-llm", "llama-llm+actnn2", "gpt2-fewbit3+msnorm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights-autocast"])
def test_the_step_is_plain_checkpointings_bit_for_bit(build, policy, precision):
    plain, offloaded, inputs = pair(build, policy, precision == "bf16-weights-autocast")
    autocast = precision != "fp32"
    for seed in (1, 2):  # dropout and ActNN's rounding draw anew each step, replayed each
        loss, grads = train_step(plain, inputs, seed, autocast)
        with offload.host_bytes() as host:
            loss_o, grads_o = train_step(offloaded, inputs, seed, autocast)
        assert torch.equal(loss, loss_o)
        assert grads.keys() == grads_o.keys()
        assert all(torch.equal(grads[n], grads_o[n]) for n in grads), policy
        assert host[0] > 0


def test_the_host_holds_each_block_input_once_and_shared_inputs_once():
    model, inputs = llama()
    compress(model, "llm+offload")
    with offload.host_bytes() as host:
        models.loss_of(models.call(model, inputs)).backward()
    config, (batch, seq) = model.config, inputs["input_ids"].shape
    hidden = batch * seq * config.hidden_size * 4  # float32 residual stream
    head = config.hidden_size // config.num_attention_heads
    rotary = 2 * seq * head * 4  # cos and sin: taken by every layer, copied once
    assert host[0] == config.num_hidden_layers * hidden + rotary


def test_a_shared_tensor_changed_in_place_is_copied_again():
    t = torch.randn(4, 8)
    with offload.offloaded():
        first = offload._pack(t)
        assert offload._pack(t) is first
        t.add_(1)
        second = offload._pack(t)
        w = torch.nn.Parameter(torch.randn(3))
        assert offload._pack(w) is w  # weights stay where they are
    assert second is not first and torch.equal(offload._unpack(second), t)
    assert not torch.equal(offload._unpack(first), t)


def test_each_input_comes_back_once_and_the_block_before_it_ahead():
    """Two blocks' backward: each hidden state is copied back once, the first block's while
    the second's backward runs; cos and sin, which every block takes, once for both."""
    model, inputs = llama()
    compress(model, "llm+offload")
    events = []
    real_back, real_fetch = offload._Held._copy_back, offload._Held.fetch

    def copy_back(held):
        events.append(("back", tuple(held.shape)))
        return real_back(held)

    def fetch(held):
        events.append(("fetch", tuple(held.shape)))
        return real_fetch(held)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload._Held, "_copy_back", copy_back)
        patch.setattr(offload._Held, "fetch", fetch)
        models.loss_of(models.call(model, inputs)).backward()
    hidden = tuple(inputs["input_ids"].shape) + (model.config.hidden_size,)
    backs = [shape for kind, shape in events if kind == "back"]
    assert backs.count(hidden) == model.config.num_hidden_layers == 2
    assert len(backs) == 2 + 2  # and cos and sin, once
    second_back = [i for i, e in enumerate(events) if e == ("back", hidden)][1]
    second_fetch = [i for i, e in enumerate(events) if e == ("fetch", hidden)][1]
    assert second_back < second_fetch  # the first block's input, fetched ahead


def test_the_estimate_counts_the_host_bytes_apart():
    rows = estimate("llama-tiny", 2, 32, "fp32", ["llm", "llm+offload"], kernels="cpu").rows
    lean, off = rows
    model, _ = models.build("llama-tiny")
    compress(model, "llm+offload")
    inputs = models.example_batch(model, 2, 32)
    with offload.host_bytes() as host:
        saved, _ = step(model, inputs, "fp32")
    assert off.host_bytes == host[0] > 0 and lean.host_bytes == 0
    assert off.saved_bytes == saved.total < lean.saved_bytes
    assert "host memory (not on the card)" in estimate(
        "llama-tiny", 2, 32, "fp32", ["llm+offload"], kernels="cpu").table()


def test_copies_and_pickles_keep_the_offload():
    model, inputs = llama()
    compress(model, "llm+offload")
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with offload.host_bytes() as host:
            models.loss_of(models.call(other, inputs)).backward()
        assert host[0] > 0


def test_the_option_is_checked_and_reported():
    report = compress(llama()[0], "offload")
    assert "recomputed in backward (checkpoint, its input kept in host memory)" in str(report)
    with pytest.raises(ActdesignError, match="must be true or false") as info:
        P.load({"rules": [{**OFFLOAD, "offload": "yes"}]})
    assert "\n" not in str(info.value)


def test_fsdp2_cpu_offload_moves_the_state_to_the_host_and_keeps_units_in_flight():
    plain, off = (estimate("llama-tiny", 2, 32, "fp32", ["llm"], kernels="cpu",
                           cpu_offload=flag).rows[0] for flag in (False, True))
    model, _ = models.build("llama-tiny")
    units = [*model.model.layers, model.lm_head]
    sizes = [sum(p.numel() * 4 for p in u.parameters()) for u in units]
    sizes.append(sum(p.numel() * 4 for p in model.parameters()) - sum(sizes))  # the root
    in_flight = sum(sorted(sizes)[-2:]) + max(sizes)  # two units' weights, one's gradients
    assert off.in_flight_bytes == in_flight
    assert off.peak_bytes == plain.peak_bytes
    assert off.total_bytes == off.peak_bytes + in_flight
    assert off.host_bytes == plain.weights_bytes + plain.gradients_bytes + plain.optimizer_bytes
    assert off.total_bytes < plain.total_bytes
