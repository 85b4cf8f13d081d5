"""ActNN-style quantized saved inputs: QLinear and QConv2d keep their input, for the weight
gradient only, as b-bit per-sample group codes with stochastic rounding (unbiased). The
forward and the input gradient are exact.

Bits are one number for every sample, or one per sample (set `layer.bits` to a tensor of
length N before the forward). Each call draws its seed from torch's default generator of the
input's device, as dropout draws its mask: after `torch.manual_seed` a run draws the same codes
in any process, and checkpointing's recompute, which replays the generator, draws them again.
"""

from __future__ import annotations

import functools
import math

import torch

from actdesign.codegen.render import render_actnn
from actdesign.errors import ActdesignError

from .cache import generated
from .chains import leaf_recipe, offer_recipe, shares_recipes
from .compressed import CompressedConv2d, CompressedLinear, compressed_call
from .fake import on_host
from .sharing import whole


def eager(fn):
    """`torch.compiler.disable(fn)`, applied at the first call rather than at import: the
    decorator imports torch._dynamo, seconds that only a program which calls `fn` should pay.
    Under torch.compile the result is the same: the call graph-breaks and `fn` runs eagerly."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


def actnn_ops():
    """The generated quantization module (Triton kernels and torch path), imported once."""
    return generated(render_actnn)


def draw_seed(device: torch.device) -> int:
    """A 32-bit seed from torch's default generator of `device`. On CUDA the generator's
    offset is advanced on the host, as its random ops do: no device sync."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # Philox advances in steps of 4
        return hash((generator.initial_seed(), offset)) & 0xFFFFFFFF  # ints hash the same
    return int(torch.randint(0, 2**32, (1,), dtype=torch.int64))  # everywhere


_SHARED = "_actdesign_codes"  # the attribute carrying a tensor's codes to its readers


class _QuantizedInput:
    """What QLinear and QConv2d share: bits, group size, seeds, the codes."""

    def _setup(self, bits, group_size):
        if not (isinstance(group_size, int) and group_size >= 8
                and group_size & (group_size - 1) == 0):
            raise ActdesignError(f"group_size must be a power of two >= 8, got {group_size!r}")
        self.group_size = group_size
        self.bits = bits

    def _sample_bits(self, x):
        # On the host: the codes' layout is worked out there, without waiting for the device.
        bits = self.bits
        if isinstance(bits, int):
            if not 1 <= bits <= 8:
                raise ActdesignError(f"bits must be in 1..8, got {bits}")
            return torch.full((x.shape[0],), bits, dtype=torch.int8)
        bits = torch.as_tensor(bits).cpu()
        if bits.shape != (x.shape[0],) or bits.min() < 1 or bits.max() > 8:
            raise ActdesignError(f"per-sample bits must be {x.shape[0]} values in 1..8")
        return bits.to(torch.int8)

    # torch.compile runs these eagerly: the codes' layout comes from host-side bits, and the
    # numba kernels cannot be traced.
    @eager
    def compress(self, x):
        with on_host():  # bits and seeds are the host's, on fake tensors too
            bits = self._sample_bits(x)
            shared = getattr(whole(x), _SHARED, None)
            if shared is not None and shared[:2] == (self.group_size, x._version) \
                    and torch.equal(shared[2][3], bits):
                return shared[2]  # the producer's codes of this very tensor: kept once
            seed = draw_seed(x.device)
        packed, lo, width = actnn_ops().quantize(x.detach().reshape(x.shape[0], -1), bits,
                                                 seed, self.group_size)
        codes = packed, lo, width, bits
        if x.grad_fn is not None and shares_recipes(in_function=True):
            # made in this forward (`keep` hands x itself over only where x offers nothing
            # this layer takes): its other readers (a block's shortcut conv, a residual add's
            # recipe) keep these codes. Not a tensor the caller feeds again: each forward
            # draws its codes anew.
            offer_recipe(whole(x), leaf_recipe(_dequantized, (
                *codes, self.group_size, tuple(x.shape), x.dtype), bits=self.bits_taken))
        return codes

    @property
    def bits_taken(self):
        """The fewest bits of codes it keeps of what x's producer offers made from codes (a
        batch norm's output rebuilt from its codes of x̂): its own; none with bits per sample."""
        return self.bits if isinstance(self.bits, int) else None

    def share(self, x, codes):
        """Offer `codes` of x (from `compress`) to the layers that read x: a QLinear with the
        same bits and group size keeps these, instead of making its own, unless x was
        changed in place since."""
        setattr(x, _SHARED, (self.group_size, x._version, codes))

    def restore(self, saved, shape, dtype):
        return _dequantized(*saved, self.group_size, shape, dtype)

    def extra_repr(self):
        bits = self.bits if isinstance(self.bits, int) else "per sample"
        return super().extra_repr() + f", bits={bits}, group_size={self.group_size}"


@eager
def _dequantized(packed, lo, width, bits, group_size, shape, dtype):
    """x^ of `shape` and `dtype` from its codes."""
    x = actnn_ops().dequantize(packed, lo, width, bits, math.prod(shape[1:]), group_size, dtype)
    return x.view(shape)


class InputCodes(_QuantizedInput):
    """The codes of a layer's input, on their own: what a LoRA adapter path keeps of x for
    A's gradient under an ActNN rule (its frozen base layer keeps nothing)."""

    def __init__(self, bits=2, group_size=256):
        self._setup(bits, group_size)


class QLinear(_QuantizedInput, CompressedLinear):
    """nn.Linear keeping its input as b-bit group codes for the weight gradient."""

    def __init__(self, in_features, out_features, bias=True, *, bits=2, group_size=256,
                 device=None, dtype=None):
        CompressedLinear.__init__(self, in_features, out_features, bias, device, dtype)
        self._setup(bits, group_size)


class QConv2d(_QuantizedInput, CompressedConv2d):
    """nn.Conv2d keeping its input as b-bit group codes for the weight gradient."""

    def __init__(self, *args, bits=2, group_size=256, **kwargs):
        CompressedConv2d.__init__(self, *args, **kwargs)
        self._setup(bits, group_size)


def qlinear(x, weight, bias=None, *, bits=2, group_size=256):
    """F.linear whose input is kept for the weight gradient as b-bit group codes."""
    layer = QLinear(weight.shape[1], weight.shape[0], bias is not None, bits=bits,
                    group_size=group_size, device="meta")
    return compressed_call(layer, x, weight, bias)


def qconv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, bits=2,
            group_size=256):
    """F.conv2d whose input is kept for the weight gradient as b-bit group codes."""
    layer = QConv2d(weight.shape[1] * groups, weight.shape[0], weight.shape[2:], stride,
                    padding, dilation, groups, bias is not None, bits=bits,
                    group_size=group_size, device="meta")
    return compressed_call(layer, x, weight, bias)
