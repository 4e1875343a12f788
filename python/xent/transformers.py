"""Hugging Face Transformers drop-in: a causal LM's loss through xent's fused lm head.

    import xent.transformers
    xent.transformers.patch()           # every supported *ForCausalLM class, from now on
    model = AutoModelForCausalLM.from_pretrained(...)
    out = model(input_ids, labels=labels)   # out.loss: xent.linear_cross_entropy, out.logits None
    xent.transformers.unpatch()         # Transformers' own forward again

    xent.transformers.patch(model)      # the same, and raises unless `model` is supported

With labels, the hidden states that the model hands its lm head and the lm head's weight go to
xent.linear_cross_entropy: the logits [tokens, V] are never made. The loss is Transformers'
ForCausalLMLoss (labels shifted, ignore_index -100, mean, or sum / num_items_in_batch), with
Gemma's final_logit_softcapping as xent's softcap. Without labels nothing changes. A weight that
is a DTensor sharded on the vocabulary (tp_plan) takes xent's vocab-parallel path. See
docs/transformers.md. Written for transformers 5.17.0.
"""

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import textwrap

import torch
import torch.nn.functional as F

from . import _dtensor
from . import linear_cross_entropy as _xent_linear

__all__ = ["SUPPORTED", "patch", "unpatch"]

# class -> (its module in transformers.models, whether its forward applies
# config.final_logit_softcapping). Each forward is, between the decoder and the loss:
#     logits = self.lm_head(hidden_states[:, slice_indices, :])
#     [Gemma: logits = tanh(logits / c) * c]
#     loss = self.loss_function(logits, labels, vocab_size, **kwargs)
# which is what patch() checks in the installed source before it touches anything.
SUPPORTED = {
    "LlamaForCausalLM": ("llama.modeling_llama", False),
    "MistralForCausalLM": ("mistral.modeling_mistral", False),
    "Qwen2ForCausalLM": ("qwen2.modeling_qwen2", False),   # Qwen 2 and 2.5
    "Qwen3ForCausalLM": ("qwen3.modeling_qwen3", False),
    "Gemma2ForCausalLM": ("gemma2.modeling_gemma2", True),
    "Gemma3ForCausalLM": ("gemma3.modeling_gemma3", True),  # text-only Gemma 3 (Gemma3TextConfig)
    "GPT2LMHeadModel": ("gpt2.modeling_gpt2", False),       # tied embeddings: one weight, two uses
}

_HEAD = "logits = self.lm_head(hidden_states[:, slice_indices, :])"
_SOFTCAP = ("logits = logits / self.config.final_logit_softcapping",
            "logits = torch.tanh(logits)",
            "logits = logits * self.config.final_logit_softcapping")

# While patched: class -> the forward it had. And the options of the last patch().
_replaced = {}
_DEFAULT_OPTIONS = {"keep_logits": False, "max_scratch_bytes": 0}
_options = dict(_DEFAULT_OPTIONS)
_causal_lm_loss = None  # transformers.loss.loss_utils.ForCausalLMLoss, once imported


def _supported_classes():
    """name -> class, importing each model module (transformers must be installed)."""
    try:
        loss_utils = importlib.import_module("transformers.loss.loss_utils")
    except ImportError as e:
        raise ImportError(f"xent.transformers: needs transformers (pip install "
                          f"transformers==5.17.0); importing it failed ({e})") from e
    global _causal_lm_loss
    _causal_lm_loss = loss_utils.ForCausalLMLoss
    return {name: getattr(importlib.import_module(f"transformers.models.{module}"), name)
            for name, (module, _) in SUPPORTED.items()}


def _check_source(cls, softcap):
    """Refuses a forward whose logits are not exactly what xent computes: another Transformers
    may scale, bias or cap them differently, and a silently different loss is the worst outcome.
    Compares the statements that assign `logits` (parsed, so layout does not matter)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError) as e:
        raise RuntimeError(f"xent.transformers: cannot read the source of {cls.__name__}.forward "
                           f"({e}) to check it computes logits as xent does") from e
    assigns = [ast.unparse(node) for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AugAssign))
               and any(isinstance(t, ast.Name) and t.id == "logits"
                       for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    calls = sorted(ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and ast.unparse(node.func) in ("self.loss_function", "self.lm_head"))
    want = [_HEAD, *(_SOFTCAP if softcap else ())]
    if assigns != want or calls != ["self.lm_head", "self.loss_function"]:
        raise RuntimeError(
            f"xent.transformers: {cls.__name__}.forward in this transformers does not compute its "
            f"logits and loss as xent.transformers was written for (transformers 5.17.0): it "
            f"assigns logits as {assigns}, expected {want}, calling self.lm_head and "
            f"self.loss_function once each")


def _model_class_error(model):
    cls = type(model)
    return RuntimeError(
        f"xent.transformers: {cls.__module__}.{cls.__qualname__} is not supported (supported: "
        f"{', '.join(SUPPORTED)}, and subclasses that keep their forward); xent never falls "
        f"back silently: call unpatch(), or compute the loss with xent.linear_cross_entropy")


@contextlib.contextmanager
def _capture_lm_head(head, seen, keep_logits):
    """Runs the model with `head` standing in for the lm head: it records its input, the hidden
    states, and returns [..., 0] "logits" (nothing computed) or, with keep_logits, the real ones.
    The stand-in goes on the instance, so it replaces whatever forward is there for this call only
    (Transformers' tp_plan installs its own there too; keep_logits calls it)."""
    had_own = "forward" in vars(head)
    own = vars(head).get("forward")
    call = head.forward

    def stand_in(hidden, *args, **kwargs):
        seen.append(hidden)
        if keep_logits:
            return call(hidden, *args, **kwargs)
        return hidden.new_empty((*hidden.shape[:-1], 0))

    head.forward = stand_in
    try:
        yield
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def _grad_scale(num_items):
    """The grad_output that `(loss_sum / num_items).backward()` gives the sum (float32 1/n), so
    that the gradient xent computes in forward is the final one (no recompute in backward);
    None where it is not known without a device sync, or not finite."""
    if torch.is_tensor(num_items) and num_items.device.type != "cpu":
        return None
    scale = (torch.ones((), dtype=torch.float32) / num_items).item()
    return scale if math.isfinite(scale) else None


def _loss(model, hidden, labels, softcap, loss_kwargs):
    """Transformers' ForCausalLMLoss of lm_head(hidden), through xent (the same arithmetic)."""
    ignore_index = loss_kwargs.get("ignore_index", -100)
    num_items = loss_kwargs.get("num_items_in_batch")
    target = loss_kwargs.get("shift_labels")
    if target is None:  # ForCausalLMLoss: tokens < n predict n; the last predicts nothing
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    cap = model.config.final_logit_softcapping if softcap else None
    options = dict(ignore_index=ignore_index, softcap=float(cap or 0.0),
                   max_scratch_bytes=_options["max_scratch_bytes"])
    if num_items is None:
        options.update(reduction="mean")
    else:
        scale = _grad_scale(num_items)
        options.update(reduction="sum", **(dict(grad_mode="deferred") if scale is None
                                           else dict(grad_scale=scale)))
    target = target.reshape(-1).to(hidden.device)
    loss = _xent_linear(hidden.flatten(0, -2), model.lm_head.weight, target, **options)
    if _dtensor.is_dtensor(loss):  # tp_plan: Transformers' own loss is a plain tensor there
        loss = loss.to_local()
    if num_items is None:
        # F.cross_entropy's mean of no tokens is 0 / 0 = NaN (gradient 0); xent's is 0.
        return torch.where((target != ignore_index).any(), loss, float("nan"))
    if torch.is_tensor(num_items):  # as fixed_cross_entropy divides
        num_items = num_items.to(loss.device)
    return loss / num_items


def _fused_forward(original, softcap):
    """The forward patch() installs: `original` itself without labels; with labels, `original`
    without them (the decoder, and no loss) and xent's loss from the lm head's input."""
    signature = inspect.signature(original)  # the model's own (through can_return_tuple)
    var_kw = next(name for name, p in signature.parameters.items()
                  if p.kind is inspect.Parameter.VAR_KEYWORD)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None:
            return original(self, *args, **kwargs)
        head = self.lm_head
        if type(head) is not torch.nn.Linear or head.bias is not None:
            raise RuntimeError(
                f"xent.transformers: {type(self).__name__}.lm_head is {type(head).__name__}"
                f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}: xent "
                f"computes the loss of a bias-free torch.nn.Linear lm head only")
        if self.loss_function is not _causal_lm_loss:
            raise RuntimeError(
                f"xent.transformers: {type(self).__name__}.loss_function is "
                f"{getattr(self.loss_function, '__name__', self.loss_function)}, not "
                f"Transformers' ForCausalLMLoss, the only loss xent computes in its place")
        loss_kwargs = dict(bound.arguments.get(var_kw, {}))
        return_dict = loss_kwargs.pop("return_dict", None)  # can_return_tuple's, not the loss's
        if return_dict is None:
            return_dict = self.config.return_dict
        bound.arguments["labels"] = None
        bound.arguments[var_kw] = dict(loss_kwargs, return_dict=True)
        keep_logits, seen = _options["keep_logits"], []
        with _capture_lm_head(head, seen, keep_logits):
            out = original(*bound.args, **bound.kwargs)
        if len(seen) != 1:
            raise RuntimeError(f"xent.transformers: {type(self).__name__}.forward called its "
                               f"lm head {len(seen)} times; xent expects once")
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        fields.update(loss=_loss(self, seen[0], labels, softcap, loss_kwargs),
                      logits=out.logits if keep_logits else None)
        out = type(out)(**fields)
        return out if return_dict else out.to_tuple()

    forward.__xent_transformers__ = True
    return forward


def _check_model(model, classes):
    """Raises unless the forward that `model` runs is a supported class's (patched by patch())."""
    owner = next((c for c in type(model).__mro__ if "forward" in vars(c)), None)
    if owner not in classes.values():
        raise _model_class_error(model)
    own = vars(model).get("forward")  # an instance forward (accelerate's hooks) runs instead
    inner = getattr(getattr(model, "_old_forward", None), "__func__", None)
    if own is not None and not getattr(inner, "__xent_transformers__", False):
        raise RuntimeError(
            f"xent.transformers: this {owner.__name__} has its own forward on the instance "
            f"(accelerate's hooks, from device_map?) that calls Transformers' unpatched one: "
            f"call xent.transformers.patch() before loading the model")


def patch(model=None, *, keep_logits=False, max_scratch_bytes=0):
    """Makes every supported class (SUPPORTED) compute its loss with xent.linear_cross_entropy
    when labels are given: its `forward` is replaced by a wrapper (whose __wrapped__ is the
    original). With labels, the returned logits are None unless keep_logits=True (then they are
    computed as before, for the caller; the loss still comes from xent). max_scratch_bytes:
    xent.linear_cross_entropy's bound on the scratch of each call (0: its default, an eighth of
    the bf16 logits or what its lean schedule needs). Calling it again only updates keep_logits
    and max_scratch_bytes. Raises, changing nothing, where this transformers' forward of a
    supported class is not the one xent was written for.

    model: also checks that this model runs a patched forward, and raises naming its class
    otherwise (an unsupported model is never silently left on Transformers' loss). Returns it.
    Undo with unpatch()."""
    if (isinstance(max_scratch_bytes, bool) or not isinstance(max_scratch_bytes, int)
            or max_scratch_bytes < 0):
        raise ValueError(f"xent.transformers.patch(max_scratch_bytes={max_scratch_bytes!r}): must "
                         "be an int >= 0 (0: xent.linear_cross_entropy's default budget)")
    classes = _supported_classes()
    if model is not None:
        _check_model(model, classes)
    todo = [cls for cls in classes.values() if cls not in _replaced]
    for cls in todo:  # every check before any change
        _check_source(cls, SUPPORTED[cls.__name__][1])
    for cls in todo:
        original = vars(cls)["forward"]
        cls.forward = _fused_forward(original, SUPPORTED[cls.__name__][1])
        _replaced[cls] = original
    _options["keep_logits"] = bool(keep_logits)
    _options["max_scratch_bytes"] = max_scratch_bytes
    return model


def unpatch():
    """Undoes patch(): every class gets its original forward object back. Does nothing if not
    patched."""
    for cls, original in _replaced.items():
        cls.forward = original
    _replaced.clear()
    _options.update(_DEFAULT_OPTIONS)
