"""Runtime: loads generated op modules, caches them and applies them to PyTorch models.

    from actdesign import runtime
    ops = runtime.load("gelu3.json")     # render, cache and import the op module once
    act = ops.Module()                   # drop-in activation module
"""

from .cache import cache_dir, load, load_source
from .calibrate import calibrate
from .norms import MSLayerNorm, MSRMSNorm, fold_norm_affine, norm_ops
from .pooled import PooledConv2d
from .quantized import QConv2d, QLinear, actnn_ops, qconv2d, qlinear
from .sparse import SparseConv2d, SparseLinear

__all__ = ["MSLayerNorm", "MSRMSNorm", "PooledConv2d", "QConv2d", "QLinear", "SparseConv2d",
           "SparseLinear", "actnn_ops", "cache_dir", "calibrate", "fold_norm_affine", "load",
           "load_source", "norm_ops", "qconv2d", "qlinear"]
