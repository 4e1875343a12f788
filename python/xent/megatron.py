"""Megatron-core drop-in: xent's vocab-parallel cross-entropy behind Megatron-core's own names.

    import xent.megatron
    loss = xent.megatron.vocab_parallel_cross_entropy(logits, labels)  # [s, b, V/tp] -> [s, b]

    xent.megatron.patch()    # Megatron's own entry points now call xent (see patch())
    xent.megatron.unpatch()  # and now Megatron's own functions again

    # the fused lm head, as Megatron-LM main's fused_linear_cross_entropy.linear_cross_entropy
    loss = xent.megatron.linear_cross_entropy(hidden, weight_shard, labels, tp_group)

With label_smoothing = 0 the loss and gradient are Megatron's, to rounding. With
label_smoothing > 0 they are NOT Megatron's: xent computes PyTorch's definition
(F.cross_entropy(label_smoothing=...) on the full vocabulary), see vocab_parallel_cross_entropy
and docs/megatron.md.

Supported and tested: megatron-core 0.16.1 (Python 3.10 and later) and 0.19.2 (0.17 and later
need Python 3.12). Where the two behave differently (the rank that Megatron's own function uses),
docs/megatron.md says so, version by version.

megatron-core is imported only by patch(), unpatch() and a call with tp_group=None (which asks
megatron.core.parallel_state for the group); with tp_group given, it need not be installed (where
it is loaded, a group that is Megatron's tensor-parallel group is checked against Megatron's rank
and size, see vocab_parallel_cross_entropy).
"""

import functools
import importlib
import inspect
import sys
import types
import warnings

import torch

from . import linear_cross_entropy as _xent_linear
from . import vocab_parallel_cross_entropy as _xent_loss

__all__ = ["fused_vocab_parallel_cross_entropy", "linear_cross_entropy", "patch", "unpatch",
           "vocab_parallel_cross_entropy"]

# Megatron has no ignore_index: a target outside the vocabulary gets a meaningless loss there,
# which its callers mask out (LLaVA's labels use -100 for that). xent gives -100 a loss and a
# gradient of exactly 0 instead; any other out-of-range target is an error (CPU: raised at once;
# CUDA: NaN loss, reported by xent.check_errors()), where Megatron silently computes garbage.
_IGNORE_INDEX = -100

# Megatron always scales the per-token loss before backward (loss mask, division by the number
# of tokens and micro-batches, fp16 loss scaling), so grad_output is never 1. "deferred" applies
# grad_output before its single rounding, as Megatron does (it scales in float32, then casts):
# 3 passes over the logits and no fp16 underflow of small probabilities ahead of the loss scale.
# "fused" (out of place) would write a gradient for grad_output = 1 in forward only to recompute
# nearly every row in backward: the same single rounding, in 5 passes.
_GRAD_MODE = "deferred"


def _import_megatron(module_name, needed_by):
    """The module megatron-core's `module_name`, or an ImportError saying who needs it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"xent.megatron: {needed_by} needs megatron-core, and importing {module_name} "
            f"failed ({e}); install it (pip install megatron-core), or pass tp_group "
            f"explicitly to use vocab_parallel_cross_entropy without it") from e


def _check_megatron_rank(parallel_state, group, how):
    """Refuses a rank or size set by set_tensor_model_parallel_rank/_world_size that is not the
    rank and size of `group`, Megatron's tensor-parallel group (passed as `how` says)."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if (rank, world) != (group.rank(), group.size()):
        raise RuntimeError(
            f"xent.megatron: {how}: Megatron's tensor-parallel rank and size are {rank} of "
            f"{world} (set_tensor_model_parallel_rank/_world_size) but this process is rank "
            f"{group.rank()} of {group.size()} in the tensor-parallel group: they must agree, "
            f"since xent needs the vocabulary shards in the group's rank order (unset the "
            f"override with set_tensor_model_parallel_rank(None) and "
            f"set_tensor_model_parallel_world_size(None))")


def _tensor_parallel_layout(tp_group):
    """(group, this rank's index in it, its size): Megatron's tensor-parallel group if None.
    Megatron's rank and size (set_tensor_model_parallel_rank/_world_size can override them) must
    be the group's where the group is Megatron's: with tp_group=None, and with tp_group given
    where it is the group of megatron.core.parallel_state (already imported: never imported
    here), as LanguageModule passes it in megatron-core 0.19."""
    if tp_group is not None:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and tp_group is (
                parallel_state.get_tensor_model_parallel_group(check_initialized=False)):
            _check_megatron_rank(parallel_state, tp_group,
                                 "tp_group is Megatron's tensor-parallel group")
        return tp_group, tp_group.rank(), tp_group.size()
    parallel_state = _import_megatron("megatron.core.parallel_state",
                                      "vocab_parallel_cross_entropy with tp_group=None")
    group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    if group is None:
        raise RuntimeError(
            "xent.megatron: tp_group is None and Megatron's tensor-parallel group is not "
            "initialized: call megatron.core.parallel_state.initialize_model_parallel(...) "
            "first, or pass tp_group")
    # megatron-core 0.16.1's own function takes its rank and size from these (0.19's from the
    # group); xent needs the shards in the group's rank order, so they must agree.
    _check_megatron_rank(parallel_state, group,
                         "tp_group is None (Megatron's tensor-parallel group)")
    return group, group.rank(), group.size()


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                 tp_group=None):
    """Per-token cross-entropy of vocabulary-parallel logits, as Megatron-core's function of the
    same name: logits [s, b, V/tp] (any leading dimensions), this rank's equal share of the
    vocabulary, columns [rank * V/tp, (rank + 1) * V/tp) as Megatron partitions it; target
    [s, b] global class ids, the same on every rank. Returns the float32 loss [s, b], one value
    per token (no reduction), the same on every rank; differentiable for the logits, whose
    gradient shard flows back to this rank's logits. The logits are never written.

    loss = logsumexp(x) - x[target], x the full row of V logits (every column a class:
    Megatron's padded vocabulary columns included, as Megatron counts them).

    tp_group: the tensor-parallel ProcessGroup (positional or keyword, as in megatron-core 0.19's
    function, which has the same four parameters; 0.16.1's has no tp_group); this rank's index
    in it places the shard. None asks Megatron's
    megatron.core.parallel_state.get_tensor_model_parallel_group().
    Where the group is Megatron's (None, or the group of an already imported parallel_state, as
    0.19's LanguageModule passes it), a rank or size set by set_tensor_model_parallel_rank/
    _world_size that is not the group's raises a RuntimeError naming both: megatron-core 0.16.1's
    own function would use that rank with tp_group=None, 0.19's uses the group's.

    label_smoothing (alpha) > 0 computes PyTorch's definition, NOT Megatron's:
        xent:     (1 - alpha) * loss + alpha * (logsumexp(x) - mean over all V columns of x),
                  = F.cross_entropy(x, target, label_smoothing=alpha), the same on every rank;
        Megatron: (1 - s) * loss - s * mean over this rank's V/tp columns of log softmax(x),
                  s = alpha * (V/tp) / (V/tp - 1): a different value on every rank when tp > 1.
    A UserWarning says so on use; docs/megatron.md has the details.

    A target of -100 gets loss 0 and gradient 0 (Megatron has no ignore index and returns a
    meaningless value there); any other target outside [0, V) raises (CPU) or gives a NaN loss
    that xent.check_errors(tp_group) reports (CUDA), where Megatron returns a meaningless value.
    """
    if label_smoothing > 0:
        warnings.warn(
            f"xent.megatron.vocab_parallel_cross_entropy: label_smoothing = {label_smoothing} "
            f"computes PyTorch's label smoothing (F.cross_entropy on the full vocabulary), not "
            f"Megatron-core's (which rescales it by V_local / (V_local - 1) and averages over each "
            f"rank's own shard); see docs/megatron.md", UserWarning, stacklevel=2)
    group, rank, world = _tensor_parallel_layout(tp_group)
    width = vocab_parallel_logits.size(-1)
    # Megatron's partition, given explicitly: no collective to plan the layout.
    return _xent_loss(vocab_parallel_logits, target, group, ignore_index=_IGNORE_INDEX,
                      label_smoothing=label_smoothing, reduction="none",
                      vocab_start=rank * width, vocab_size=world * width,
                      grad_mode=_GRAD_MODE)


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """Megatron-core's fused_vocab_parallel_cross_entropy (no label smoothing): the same loss as
    vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group), the same checks
    of tp_group included. tp_group=None asks Megatron's parallel state (Megatron's own function
    needs a group).

    Megatron's fused version always rounds the gradient to bfloat16; xent's has the logits'
    dtype (float32 logits get a float32 gradient)."""
    return vocab_parallel_cross_entropy(vocab_parallel_logits, target, 0.0, tp_group)


class _GatherRows(torch.autograd.Function):
    """Every rank's equal share of a per-token vector, concatenated in rank order; backward
    hands each rank its own slice of the gradient (which Megatron's contract makes the same on
    every rank: no sum)."""

    @staticmethod
    def forward(ctx, mine, group):
        import torch.distributed as dist
        ctx.rank, ctx.rows = group.rank(), mine.numel()
        parts = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(parts, mine.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def linear_cross_entropy(hidden, weight, labels, tp_group=None, reduction="mean",
                         ignore_index=-100, sequence_parallel=False):
    """The fused lm head with the signature and layout of Megatron-LM main's
    megatron.core.fusions.fused_linear_cross_entropy.linear_cross_entropy (in no megatron-core
    release from 0.16.1 to 0.19.2), on xent's CPU or CUDA backend (xent.linear_cross_entropy).

    hidden: [s, b, h] or [tokens, h], this rank's tokens with sequence_parallel (then s / tp of
    them, rank-major); weight: [V/tp, h], this rank's equal share of the vocabulary (rank r holds
    rows [r V/tp, (r + 1) V/tp), Megatron's partition); labels: [s, b] (Megatron's
    LinearCrossEntropyModule transposes its [b, s] labels first) or [tokens], every token's, the
    same on every rank, also with sequence_parallel. tp_group None: one rank. Returns the
    float32 loss, the same on every rank: [] for "mean" and "sum", [s * b] for "none" (every
    token's, also with sequence_parallel, as Megatron's). Differentiable for hidden (summed over
    the ranks; with sequence_parallel this rank's rows) and weight; grad_output must be the
    same on every rank, as Megatron requires.

    grad_mode "deferred": Megatron scales the per-token loss before backward (loss mask, token
    count), so a gradient made in forward for grad_output = 1 would be recomputed anyway.
    """
    rank, world = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    sp = sequence_parallel and world > 1
    rows = hidden.reshape(-1, hidden.shape[-1]).shape[0]
    labels = labels.reshape(-1)
    want = rows * world if sp else rows
    if labels.numel() != want:
        raise RuntimeError(
            f"xent.megatron.linear_cross_entropy: labels has {labels.numel()} elements: must "
            f"have {want}, one per row of hidden" + (
                f" on each of the {world} ranks (with sequence_parallel, labels hold every "
                f"rank's tokens)" if sp else ""))
    if sp:  # xent takes this rank's own labels
        labels = labels[rank * rows:(rank + 1) * rows]
    width = weight.shape[0]
    loss = _xent_linear(hidden.reshape(rows, -1), weight, labels, tp_group,
                        sequence_parallel=sp, ignore_index=ignore_index, reduction=reduction,
                        vocab_start=rank * width, vocab_size=world * width,
                        grad_mode=_GRAD_MODE)
    if sp and reduction == "none":  # Megatron returns every token's loss on every rank
        loss = _GatherRows.apply(loss, tp_group)
    return loss


def _entry_point(function):
    """A new function object that calls `function`: what patch() installs. Being a distinct
    object, unpatch() finds exactly the places that hold it, and never touches a user's own
    reference to xent.megatron's functions. Its __wrapped__ is `function`."""
    @functools.wraps(function)
    def entry_point(*args, **kwargs):
        return function(*args, **kwargs)
    return entry_point


# (Megatron module defining it, its name, what patch() installs in its place, whether every
# megatron-core has the module: fused_linear_cross_entropy is only on Megatron-LM's development
# branch, in no release from 0.16.1 to 0.19.2)
_TARGETS = (
    ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy",
     _entry_point(vocab_parallel_cross_entropy), True),
    ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy",
     _entry_point(fused_vocab_parallel_cross_entropy), True),
    ("megatron.core.fusions.fused_linear_cross_entropy", "linear_cross_entropy",
     _entry_point(linear_cross_entropy), False),
)
def _target_module(module_name, always):
    """Megatron's module, or None where it is one that this megatron-core does not have."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not always and e.name == module_name:
            return None
    return _import_megatron(module_name, "xent.megatron.patch()")


# While patched: installed entry point -> the object it replaced.
_replaced = {}


def _rebind(old, new):
    """Every attribute of every loaded module that is `old` (by identity) becomes `new`: the
    defining module, the packages that re-export it (megatron.core.tensor_parallel) and the
    modules that imported it by name (megatron.core.models.common.language_module)."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        for name, value in list(vars(module).items()):
            if value is old:
                setattr(module, name, new)


def patch(fused_lm_head=False):
    """Makes Megatron-core call xent: megatron.core.tensor_parallel.vocab_parallel_cross_entropy
    (the unfused path, config.cross_entropy_loss_fusion = False) and
    megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy (the fused
    path, cross_entropy_fusion_impl = "native") are replaced by xent's, in their defining
    modules and in every loaded module that holds them under any name (the
    megatron.core.tensor_parallel package, LanguageModule's module, a training script's own
    `from ... import`); modules imported later get xent's through the defining modules.
    References held elsewhere (a local variable, a closure, a dict) keep Megatron's.

    The installed functions are wrappers whose __wrapped__ is xent.megatron's function of the
    same name. Does nothing if already patched. Undo with unpatch(). Not patched: the
    TransformerEngine path (cross_entropy_fusion_impl = "te").

    Where the installed megatron-core has megatron.core.fusions.fused_linear_cross_entropy
    (Megatron-LM's development branch; no release from 0.16.1 to 0.19.2 has it), its
    linear_cross_entropy is replaced too, by a wrapper of xent.megatron.linear_cross_entropy;
    where it does not, that module is neither imported nor required.

    fused_lm_head=True also gives GPTModel a fused lm head: where it computes the loss of its
    labels in training (post_process, no multi-token prediction, no inference context, an output
    layer without bias; in 0.19 no MuP scaling of the logits and no output_processor),
    GPTModel._postprocess hands the output layer's weight shard (the embedding's where they are
    tied) and the hidden states to xent.megatron.linear_cross_entropy (sequence parallelism as
    the model's config says) and never makes the logits; it returns the per-token loss [b, s]
    that Megatron's own returns, which the training loop masks and scales as before. Elsewhere
    (no labels, inference, MTP, MuP) Megatron's own _postprocess runs.

    The same names and modules in megatron-core 0.16.1 and 0.19.2; in 0.19 LanguageModule passes
    tp_group=self.tp_group to the unfused function, which xent's takes as 0.19's does."""
    if fused_lm_head and not _lm_head:
        gpt = _target_module("megatron.core.models.gpt.gpt_model", True)
        original = vars(gpt.GPTModel).get("_postprocess")
        if original is None:
            raise RuntimeError(
                "xent.megatron.patch(fused_lm_head=True): megatron.core's GPTModel has no "
                "_postprocess: this megatron-core is not one xent.megatron knows (tested with "
                "0.16.1 and 0.19.2)")
        gpt.GPTModel._postprocess = _fused_postprocess(original)
        _lm_head[gpt.GPTModel] = original
    if _replaced:
        return
    found = []
    for module_name, name, entry_point, always in _TARGETS:
        module = _target_module(module_name, always)
        if module is None:
            continue
        if not hasattr(module, name):
            raise RuntimeError(
                f"xent.megatron.patch(): {module_name} has no {name}: this megatron-core is "
                f"not one xent.megatron knows (tested with 0.16.1 and 0.19.2)")
        found.append((getattr(module, name), entry_point))
    for original, entry_point in found:
        _rebind(original, entry_point)
        _replaced[entry_point] = original


# While patch(fused_lm_head=True) holds: GPTModel -> its own _postprocess.
_lm_head = {}


def _fused_postprocess(original):
    """GPTModel._postprocess with the fused lm head where it applies, else `original`."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def postprocess(self, *args, **kwargs):
        a = signature.bind(self, *args, **kwargs).arguments
        labels = a.get("labels")
        inference = (a.get("inference_context") is not None
                     or a.get("inference_params") is not None) and not self.training
        # Megatron's own where it does more than the loss of the output layer's logits: MTP,
        # 0.19's MuP scaling of the logits and its output_processor hook.
        if (labels is None or not self.post_process or inference or a.get("mtp_in_postprocess")
                or getattr(self.config, "mtp_num_layers", None)
                or getattr(self.config, "use_mup", False)
                or a.get("output_processor") is not None
                or getattr(self.output_layer, "bias", None) is not None):
            return original(self, *args, **kwargs)
        return _lm_head_loss(self, a["hidden_states"], labels)
    return postprocess


def _lm_head_loss(model, hidden, labels):
    """The per-token loss [b, s] of GPTModel `model` from its final hidden states [s, b, h]
    (with sequence parallelism this rank's s / tp of them) and labels [b, s]."""
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights else model.output_layer.weight)
    pgs = getattr(model, "pg_collection", None)
    tp = getattr(pgs, "tp", None)
    if tp is None:
        tp = _import_megatron("megatron.core.parallel_state",
                              "xent.megatron.patch(fused_lm_head=True)"
                              ).get_tensor_model_parallel_group()
    world = tp.size()
    b, s = labels.shape
    sp = bool(model.config.sequence_parallel) and world > 1
    loss = linear_cross_entropy(hidden, weight, labels.transpose(0, 1).contiguous(),
                                tp if world > 1 else None, reduction="none", sequence_parallel=sp)
    return loss.view(s, b).transpose(0, 1).contiguous()


def unpatch():
    """Undoes patch(): every module attribute that holds an entry point patch() installed (the
    places patch() changed, and modules that imported one by name since) holds Megatron's
    original function object again, and GPTModel its own _postprocess. Does nothing if not
    patched."""
    for entry_point, original in _replaced.items():
        _rebind(entry_point, original)
    _replaced.clear()
    for cls, original in _lm_head.items():
        cls._postprocess = original
    _lm_head.clear()
