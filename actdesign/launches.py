"""Kernel launches of generated ops, heard while a listener is set: how a training step's
launches are counted (benchmarks/step_profile.py), the same way on a GPU and in a shape-only
run on fake tensors, where the launch a kernel would make is noted and nothing runs.

Generated modules call `note()` once per launch site taken. With no listener set (always,
outside counting) it costs one global lookup.
"""

from __future__ import annotations

import contextlib

_listener = None


def note() -> None:
    """One kernel launched (or, on fake tensors, one that a GPU step would launch)."""
    if _listener is not None:
        _listener()


@contextlib.contextmanager
def listening(listener):
    """`listener()` is called for every launch while the block runs; blocks do not nest."""
    global _listener
    if _listener is not None:
        raise RuntimeError("launches are already being listened to")
    _listener = listener
    try:
        yield
    finally:
        _listener = None
