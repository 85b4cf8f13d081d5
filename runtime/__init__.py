"""Runtime: loads generated op modules, caches them and applies them to PyTorch models.

    from actdesign.runtime import compress
    report = compress(model, "fewbit3+msnorm")   # replace modules in place, per a policy
    print(report)

    from actdesign import runtime
    ops = runtime.load("gelu3.json")     # render, cache and import the op module once
    act = ops.Module()                   # drop-in activation module
"""

from .accounting import SavedBytes, account
from .cache import cache_dir, load, load_source
from .calibrate import calibrate
from .compress import Report, compress
from .compressed import LeanLinear
from .estimate import Estimate, estimate
from .norms import MSLayerNorm, MSRMSNorm, QMSLayerNorm, QMSRMSNorm, ms_norm, norm_ops
from .policy import Policy
from .policy import load as load_policy
from .pooled import PooledConv2d
from .quantized import QConv2d, QLinear, actnn_ops, qconv2d, qlinear
from .sparse import SparseConv2d, SparseLinear

__all__ = ["Estimate", "LeanLinear", "MSLayerNorm", "MSRMSNorm", "Policy", "PooledConv2d",
           "QConv2d", "QLinear", "QMSLayerNorm", "QMSRMSNorm", "Report", "SavedBytes",
           "SparseConv2d", "SparseLinear", "account", "actnn_ops", "cache_dir", "calibrate",
           "compress", "estimate", "load", "load_policy", "load_source", "ms_norm", "norm_ops",
           "plan",
           "qconv2d", "qlinear"]


def plan(model, batches, budget, **options):
    """The policy with the least gradient error whose training step fits `budget`: see
    runtime.planner.plan (imported here on first use: it brings the solver's scipy)."""
    from .planner import plan as run

    return run(model, batches, budget, **options)
