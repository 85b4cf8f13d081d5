"""What runs inside a training step.

The ops that keep less for the backward pass (few-bit and piecewise-linear activations,
ActNN, sparse and pooled saved inputs, MS norms, MS-GLU, the fused loss, the rotation, LoRA's
lean path, recomputation), the sharing of what they keep, the cache of generated modules they
take their kernels from, and what they need to recognise, replace and probe modules. Nothing
here imports the floors above (`apply`, `memory`).
"""
