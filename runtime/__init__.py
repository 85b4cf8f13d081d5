"""Runtime: loads generated op modules, caches them and applies them to PyTorch models.

    from actdesign import runtime
    ops = runtime.load("gelu3.json")     # render, cache and import the op module once
    act = ops.Module()                   # drop-in activation module
"""

from .cache import cache_dir, load

__all__ = ["cache_dir", "load"]
