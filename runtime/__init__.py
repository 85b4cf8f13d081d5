"""Runtime: loads generated op modules, caches them and applies them to PyTorch models.

    from actdesign.runtime import compress
    report = compress(model, "fewbit3+msnorm")   # replace modules in place, per a policy
    print(report)

    from actdesign import runtime
    ops = runtime.load("gelu3.json")     # render, cache and import the op module once
    act = ops.Module()                   # drop-in activation module
"""

from . import models
from .apply.accounting import SavedBytes, account
from .apply.compress import Report, compress
from .apply.policy import Policy
from .apply.policy import load as load_policy
from .calibration.bits import calibrate
from .calibration.policy import calibrate_policy
from .memory.estimate import estimate
from .memory.results import Estimate
from .ops.cache import cache_dir, load, load_source
from .ops.compressed import LeanLinear
from .ops.lm_loss import fused_linear_cross_entropy
from .ops.norms import MSLayerNorm, MSRMSNorm, QMSLayerNorm, QMSRMSNorm, ms_norm, norm_ops
from .ops.pooled_conv import PooledConv2d
from .ops.quantized import QConv2d, QLinear, actnn_ops, qconv2d, qlinear
from .ops.sparse import SparseConv2d, SparseLinear

__all__ = ["Estimate", "LeanLinear", "MSLayerNorm", "MSRMSNorm", "Policy", "PooledConv2d",
           "QConv2d", "QLinear", "QMSLayerNorm", "QMSRMSNorm", "Report", "SavedBytes",
           "SparseConv2d", "SparseLinear", "account", "actnn_ops", "cache_dir", "calibrate",
           "calibrate_policy", "compress", "estimate", "fused_linear_cross_entropy", "load",
           "load_policy", "load_source", "models", "ms_norm", "norm_ops", "plan", "qconv2d",
           "qlinear"]


def plan(model, batches, budget, **options):
    """The policy with the least gradient error whose training step fits `budget`: see
    runtime.memory.planner.plan (imported here on first use: it brings the solver's scipy)."""
    from .memory.planner import plan as run

    return run(model, batches, budget, **options)
