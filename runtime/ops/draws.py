"""Random draws replayed: the same generator state for calls that must draw the same dropout
masks, and the generators, and the buffers a forward updates, put back as they were after a
probe."""

from __future__ import annotations

import contextlib

import torch


def same_draws(model, *calls) -> list:
    """The results of `calls`, each run from the same random generator state, so that dropout
    draws the same masks in each; the generators as they were after. The model keeps its mode:
    eval mode is not a neutral probe (bitsandbytes repacks its 4-bit weights for CPU inference
    on an eval forward, which changes its later results)."""
    results = []
    with forked_rng(model):
        for call in calls:
            torch.manual_seed(0)
            results.append(call())
    return results


def forked_rng(model):
    """torch.random.fork_rng over the CPU's generator and those of the CUDA devices holding
    the model's parameters: they are as they were when it closes."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    return torch.random.fork_rng(devices=devices)


@contextlib.contextmanager
def probing(model):
    """A probe of `model` while open: the random generators (`forked_rng`) and the buffers a
    forward updates in place (a BatchNorm's running statistics and count) are as they were
    when it closes. A probe is not a training step."""
    kept = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with forked_rng(model):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def rng_state(device):
    """The state of `device`'s default generator."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def replayed_rng(device, state):
    """The default generator of `device` at `state` while open; the generators as they were
    after (as torch.utils.checkpoint replays dropout)."""
    cpu = device.type == "cpu"
    with torch.random.fork_rng(devices=[] if cpu else [device], device_type=device.type):
        if cpu:
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield
