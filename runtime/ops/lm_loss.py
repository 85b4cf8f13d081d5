"""A causal-LM loss that never materialises the logits: the output projection and the
cross-entropy, chunk by chunk over the tokens.

    loss = fused_linear_cross_entropy(hidden, lm_head.weight, labels)

The forward computes each chunk's logits, keeps one float32 per token and drops the chunk:
the log-sum-exp of the token's logits less their maximum (between 0 and log V, so that it
rounds relative to the loss, not to the logits' size). The backward computes each chunk's
logits again, finds each token's maximum anew and turns them at once into that chunk's share
of the gradients: softmax(z) - onehot(y), times the upstream scale, the target's entry as
expm1 of its log-probability (the digits of p - 1 survive a confident prediction). So
nothing of size (tokens x vocabulary) outlives one chunk, forward or backward, and what is
kept for the backward is the hidden states (often the very tensor a norm already keeps), the
labels and 4 bytes per token. The price is a second logits product in the backward.

A chunk's cross-entropy is one pass over its logits each way where Triton runs (CUDA): the
kernels read the logits in the product's dtype, keep float32 in registers and write the
gradient over the logits. Elsewhere torch's ops compute it from a float32 copy.

The semantics are transformers' causal-LM loss: labels shifted by one here (or
`shift_labels` given, or `shift=False` for labels that need no shift), `ignore_index`
skipped, the mean over counted tokens or the sum over `num_items_in_batch`. Under autocast
the product runs in the autocast dtype and the cross-entropy in float32, as eager
transformers does; the weight is cast per call, not kept.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator

import torch
import torch.nn.functional as F

from actdesign.codegen.render import render_lm_loss
from actdesign.errors import ActdesignError

from .cache import generated
from .compressed import LeanLinear, autocast_casts, autocast_off
from .draws import same_draws
from .fake import spans_to_run
from .sharing import kept_for, rebuild

# A chunk's logits hold at least this many values: its four products then take far longer on
# a GPU than launching its seven kernels does.
MIN_CHUNK_LOGITS = 2**26


def fused_linear_cross_entropy(hidden, weight, labels=None, *, shift_labels=None,
                               ignore_index: int = -100, num_items_in_batch=None,
                               chunk_size: int | None = None, shift: bool = True):
    """The causal-LM loss of logits = hidden @ weight.T, without the logits.

    hidden: (..., T, d); weight: (V, d); labels: (..., T), shifted here by one, as
    transformers' causal-LM loss does, so that token t predicts label t + 1 (the last token
    predicts nothing); pass the same ids as the inputs. With `shift=False` the labels are used
    as they are, aligned with hidden (a model that is not causal, or labels shifted already);
    `shift_labels` (..., T) is such labels too. Returns the mean over tokens whose label is
    not `ignore_index`, or their sum divided by `num_items_in_batch` when given. `chunk_size`
    tokens per chunk (default: about as many logits per chunk as the hidden states have
    values, and at least 2^26 logits: a chunk launches seven kernels, so a short step is cut
    into few chunks)."""
    if (labels is None) == (shift_labels is None):
        raise ActdesignError("give labels or shift_labels, not both or neither")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift else labels
    if hidden.shape[:-1] != shift_labels.shape:
        raise ActdesignError(f"hidden states {tuple(hidden.shape)} and labels "
                             f"{tuple(shift_labels.shape)} do not match")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ActdesignError(f"a head weight of shape {tuple(weight.shape)} cannot read hidden "
                             f"states of width {hidden.shape[-1]}")
    targets = shift_labels.reshape(-1).to(hidden.device)
    dtype, (hidden,) = autocast_casts(weight, hidden)
    dtype = dtype or hidden.dtype
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens, vocab = flat.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = -(-max(tokens * flat.shape[1], MIN_CHUNK_LOGITS) // vocab)
    with autocast_off(hidden.device.type):
        total = _FusedLinearCrossEntropy.apply(flat, weight, targets, ignore_index,
                                               int(chunk_size), dtype)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def loss_ops():
    """The generated cross-entropy module (Triton kernels and torch path), imported once."""
    return generated(render_lm_loss)


def _chunks(tokens: int, size: int):
    for start in range(0, tokens, size):
        yield start, min(start + size, tokens)


def _wide(dtype):
    """The cross-entropy's dtype: float32, or float64 for float64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Σ over counted tokens of logsumexp(z) - z[target], z = hidden @ weight.T per chunk,
    computed as (max z - z[target]) + logsumexp(z - max z); the second term is what is kept."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, dtype):
        ops, w, wide = loss_ops(), weight.to(dtype), _wide(dtype)
        r = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        nll = torch.empty_like(r)
        for a, b in spans_to_run(_chunks(hidden.shape[0], chunk_size), hidden):
            ops.row_losses(hidden[a:b] @ w.T, targets[a:b], ignore_index, r[a:b], nll[a:b])
        kept, extras, ctx.make = kept_for(hidden)  # a final MS norm's x̂, where it offers it
        if kept is None:  # a recipe with nothing to slice per chunk: keep the hidden states
            kept, extras, ctx.make = hidden, (), None
        ctx.save_for_backward(kept, weight, targets, r, *extras)
        ctx.ignore_index, ctx.chunk_size, ctx.dtype = ignore_index, chunk_size, dtype
        ctx.hidden_dtype = hidden.dtype
        return nll.sum()

    @staticmethod
    def backward(ctx, grad_total):
        kept, weight, targets, r, *extras = ctx.saved_tensors
        ops, w, wide = loss_ops(), weight.to(ctx.dtype), _wide(ctx.dtype)
        grad_hidden = torch.empty(kept.shape, dtype=ctx.hidden_dtype, device=kept.device) \
            if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(w.shape, dtype=wide, device=w.device) \
            if ctx.needs_input_grad[1] else None
        with autocast_off(kept.device.type):
            for a, b in spans_to_run(_chunks(kept.shape[0], ctx.chunk_size), kept):
                hidden = rebuild(kept[a:b], extras, ctx.make, (b - a, kept.shape[1]),
                                 ctx.hidden_dtype)  # a chunk at a time
                dz = ops.logits_grad_(hidden @ w.T, targets[a:b], ctx.ignore_index,
                                      r[a:b], grad_total)
                if grad_hidden is not None:
                    torch.mm(dz, w, out=grad_hidden[a:b])
                if grad_weight is not None and dz.dtype == grad_weight.dtype:
                    grad_weight.addmm_(dz.T, hidden)  # in place: no weight-sized product
                elif grad_weight is not None:  # a 16-bit product summed in float32: it is
                    # the size of the 16-bit weight copy eager's autocast keeps all step
                    grad_weight.add_(dz.T @ hidden)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


# --- transformers causal LMs --------------------------------------------------------------

class FusedLossHead(LeanLinear):
    """A causal LM's output projection, holding the same weight. Called normally it returns
    the logits, as the Linear it replaces did (exact, and lean: it reads a final MS norm's x̂);
    while the model's fused-loss forward runs it returns the hidden states in their place (a
    _DeferredLogits), from which the loss is computed without logits."""

    def __init__(self, in_features, out_features, bias=True, *, chunk_size=None, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.chunk_size = chunk_size
        self.deferred = False

    def forward(self, hidden, loss_inputs=None):
        """The logits; the hidden states while deferred; with `loss_inputs` (the keywords
        of fused_linear_cross_entropy but the chunk size), the fused loss of the hidden
        states. The loss is computed in this module's own call, so that a wrapper (FSDP2
        sharding the head as its own unit) has the weight in place, forward and backward;
        there the loss is the unit's one tensor output, a fresh one (FSDP2 warns of a view),
        and the deferred call returns no tensor."""
        if loss_inputs is not None:
            return fused_linear_cross_entropy(hidden, self.weight, chunk_size=self.chunk_size,
                                              **loss_inputs)
        return _DeferredLogits(hidden) if self.deferred else super().forward(hidden)

    @contextlib.contextmanager
    def deferring(self):
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False

    def extra_repr(self):
        return super().extra_repr() + ", fused loss"


@contextlib.contextmanager
def _returning_input(head):
    """The head returns its input as deferred logits while open, through a hook removed
    after."""
    handle = head.register_forward_hook(lambda module, args, output: _DeferredLogits(args[0]))
    try:
        yield
    finally:
        handle.remove()


def probe_losses(model, head, chunk_size, probe):
    """(the model's own loss, the fused one) on the probe, with the same dropout masks."""
    def loss_of(hidden, **loss_inputs):
        return fused_linear_cross_entropy(hidden, head.weight, chunk_size=chunk_size,
                                          **loss_inputs)

    with torch.no_grad():
        expected, got = same_draws(model, lambda: model(**probe), lambda: _fused_call(
            model, model.forward, lambda: _returning_input(head), loss_of, (), probe))
    return expected.loss, got.loss


_FORWARDS = {}  # a class's forward -> its fused twin: one function for torch.compile to see


def fused_forward(forward):
    """A causal LM's forward whose loss, given labels in training, is fused with its head;
    with the signature, name and docstring of `forward` (clients read the signature:
    `Trainer` keeps the dataset columns it names)."""
    if forward not in _FORWARDS:
        @functools.wraps(forward)
        def fused(self, *args, **kwargs):
            head = self.get_output_embeddings()
            if not (self.training and torch.is_grad_enabled()):  # logits wanted: eval, no grad
                return self.unfused_forward(*args, **kwargs)
            if not isinstance(head, FusedLossHead):  # the loss would skip what wraps it
                raise ActdesignError(f"the output head is a {type(head).__name__}: it was "
                                     "wrapped after compress (a PEFT adapter on it), and the "
                                     "fused loss reads the head's weight; wrap the model first "
                                     "(get_peft_model), then compress")
            return _fused_call(self, self.unfused_forward, head.deferring, _head_loss(head),
                               args, kwargs)

        _FORWARDS[forward] = fused
    return _FORWARDS[forward]


def _head_loss(head):
    def loss_of(hidden, **loss_inputs):
        return head(hidden, loss_inputs=loss_inputs)  # a module call: its hooks run
    return loss_of


def _fused_call(model, original, deferring, loss_of, args, kwargs):
    """`original(*args, **kwargs)`, the forward of `model`, with its loss fused, given labels:
    while `deferring()` is open the head returns _DeferredLogits, and the model's
    `loss_function` is one that gives `loss_of(hidden, labels=..., ...)` for them. Whatever the
    forward adds to that loss (router auxiliary losses) it adds as it always does. The output
    is the model's own with no logits."""
    signature = inspect.signature(original)
    bound = signature.bind(*args, **kwargs)
    extra = bound.arguments.get(_var_keyword(signature), {})
    labels = bound.arguments.get("labels", extra.get("labels"))
    if labels is None:  # no loss, so the logits are what is wanted: the model as it was
        return original(*args, **kwargs)
    keep = bound.arguments.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ActdesignError("the fused loss covers every position: logits_to_keep must "
                             "be 0 when labels are given")
    with deferring(), _loss_function(model, _causal_lm_loss(loss_of)):
        out = original(*args, **kwargs)
    if isinstance(out, tuple):  # as transformers orders it: the loss first, then the rest
        return tuple(None if isinstance(v, _DeferredLogits) else v for v in out)
    return type(out)(**{k: v for k, v in out.items() if not isinstance(v, _DeferredLogits)})


def _var_keyword(signature) -> str | None:
    return next((p.name for p in signature.parameters.values()
                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)


_KEEP_THE_HEAD = ('; compress without fusing the loss (a policy rule {"target": "head", '
                  '"apply": "keep"} before llm\'s)')


def _refuse(why):
    raise ActdesignError(f"the fused loss cannot follow this forward: {why}, and the fused "
                         f"loss never computes the logits{_KEEP_THE_HEAD}")


class _DeferredLogits:
    """What the head returns while the loss is fused: its input, the hidden states, in place
    of the logits, for the model's forward to pass to its loss_function. A scale of the
    logits by a number (Granite, Cohere), `.float()` and `.contiguous()` are followed on the
    hidden states (the same loss); any other use of the logits is refused by name. Not a
    tensor: FSDP2 finds no view to warn of in what the head returns."""

    __slots__ = ("hidden",)

    def __init__(self, hidden):
        self.hidden = hidden

    def _scaled(self, op, other):
        if not (isinstance(other, (int, float)) or (torch.is_tensor(other) and other.dim() == 0)):
            _refuse(f"it applies {op.__name__} with a {type(other).__name__} to the logits")
        return _DeferredLogits(op(self.hidden, other))

    def __mul__(self, other):
        return self._scaled(operator.mul, other)

    def __rmul__(self, other):
        return self._scaled(operator.mul, other)

    def __truediv__(self, other):
        return self._scaled(operator.truediv, other)

    def float(self):  # the cross-entropy is float32 (float64 for float64 models) anyway
        return self

    def contiguous(self):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):  # Python's protocols (copy, pickle) look for these
            raise AttributeError(name)
        _refuse(f"it uses logits.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _refuse(f"it applies {getattr(func, '__name__', func)} to the logits")


def _refused_operator(name):
    def refused(self, *args):
        _refuse(f"it applies {name} to the logits")
    return refused


for _name in ("add", "radd", "sub", "rsub", "neg", "pow", "rtruediv", "matmul", "rmatmul",
              "getitem", "setitem", "iter", "len", "lt", "le", "gt", "ge", "bool", "float"):
    setattr(_DeferredLogits, f"__{_name}__", _refused_operator(f"__{_name}__"))


def _causal_lm_loss(loss_of):
    """In place of transformers' ForCausalLMLoss, with its signature: the fused loss of the
    deferred logits."""
    def loss_function(logits, labels=None, vocab_size=None, num_items_in_batch=None,
                      ignore_index=-100, shift_labels=None, **kwargs):
        if not isinstance(logits, _DeferredLogits):
            _refuse("it passes loss_function a tensor other than the head's logits")
        return loss_of(logits.hidden, labels=labels if shift_labels is None else None,
                       shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                       ignore_index=ignore_index)
    return loss_function


@contextlib.contextmanager
def _loss_function(model, loss_function):
    """`model.loss_function` is `loss_function` while open, where the model's own is
    transformers' causal-LM loss (the one the fused loss computes)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    own = model.loss_function
    if own is not ForCausalLMLoss:
        raise ActdesignError(f"its loss_function is {getattr(own, '__name__', own)}, not "
                             "transformers' ForCausalLMLoss, the one loss the fused loss "
                             f"computes{_KEEP_THE_HEAD}")
    missing = object()
    before = model.__dict__.get("_loss_function", missing)
    model.__dict__["_loss_function"] = loss_function  # what transformers' property returns
    try:
        yield
    finally:
        if before is missing:
            del model.__dict__["_loss_function"]
        else:
            model.__dict__["_loss_function"] = before
