"""xent for PyTorch: loads libxent_torch.so, which registers torch.ops.xent.*, the fake kernels
that torch.compile needs (xent._fake), and xent._C, the same operators called without torch.ops'
boxing (a few microseconds less host time per call; used in eager mode where it is built).

    import xent                                       # finds and loads the library
    loss = xent.vocab_parallel_cross_entropy(logits_shard, target, group=tp_group)
    # the same:  torch.ops.xent.vocab_parallel_cross_entropy(logits_shard, target, tp_group.group_name)
    loss = xent.linear_cross_entropy(hidden, weight_shard, target, group=tp_group)  # lm head fused

logits_shard is [..., this rank's vocabulary columns] and target [...] (any leading dimensions,
e.g. Megatron's [seq, batch]); reduction="none" gives a loss of the target's shape.

The library is the first of: $XENT_TORCH_LIB (a path), libxent_torch.so in this package (where
`pip install --no-build-isolation .` puts it; any folder of the package's path, so that
`pip install -e .` finds it too), then build/ and build-torch/ of the repository this file lives
in (src/torch/libxent_torch.so there, from the CMake build with -DXENT_WITH_TORCH=ON). See
docs/torch.md for the options.
"""

import importlib.machinery
import importlib.util
import os
import pathlib
import warnings

import torch

__all__ = ["check_errors", "library_path", "linear_cross_entropy", "linear_cross_entropy_plan",
           "vocab_parallel_cross_entropy",
           "vocab_parallel_cross_entropy_stats"]

_NAME = "libxent_torch.so"


def _candidates():
    env = os.environ.get("XENT_TORCH_LIB")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    for folder in [here] + [pathlib.Path(p) for p in __path__]:
        yield folder / _NAME
    repo = here.parent.parent
    for build in ("build", "build-torch"):
        yield repo / build / "src" / "torch" / _NAME


def library_path():
    """The libxent_torch.so that `import xent` loads (raises if there is none)."""
    tried = []
    for path in _candidates():
        if path.is_file():
            return str(path)
        tried.append(str(path))
    raise ImportError(
        "xent: libxent_torch.so not found (looked at: " + ", ".join(tried) + "); build it with "
        "-DXENT_WITH_TORCH=ON (see docs/torch.md) or set XENT_TORCH_LIB to its path"
    )


def _check_built_torch():
    """A wheel's library works with the PyTorch it was built against only (its C++ ABI)."""
    try:
        from . import _build  # written by the wheel build; absent in the repository
    except ImportError:
        return
    if torch.__version__ != _build.TORCH_VERSION:
        raise ImportError(
            f"xent: this installation was built against PyTorch {_build.TORCH_VERSION}, but "
            f"PyTorch {torch.__version__} is imported: reinstall xent with this PyTorch "
            f"(pip install --no-build-isolation <xent source>)")


def _load_direct(library):
    """xent._C (src/torch/python.cpp) from the library's folder, or None where the build left it
    out (no Python headers) or made it for another Python."""
    folder = pathlib.Path(library).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / ("_C" + suffix)
        if not path.is_file():
            continue
        try:
            spec = importlib.util.spec_from_file_location(__name__ + "._C", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except ImportError as e:
            warnings.warn(f"xent: {path} did not load ({e}); calling torch.ops.xent.* instead")
            return None
    return None


_check_built_torch()
torch.ops.load_library(library_path())
# After the library: xent._C links it, and binds to the copy already loaded (its soname).
_direct = _load_direct(library_path())
from . import _dtensor  # noqa: E402
from . import _fake  # noqa: E402,F401  (registers the fake kernels)


# The overloads themselves: no attribute lookups or overload resolution on every call.
_LOSS = torch.ops.xent.vocab_parallel_cross_entropy.default
_STATS = torch.ops.xent.vocab_parallel_cross_entropy_stats.default
_LINEAR = torch.ops.xent.linear_cross_entropy.default


def _name(group):
    return "" if group is None else group.group_name


def _takes_direct(logits, target):
    """Whether xent._C may run the call: where torch.ops would do nothing but call the same C++
    (plain tensors, not traced by torch.compile, no __torch_function__ mode)."""
    return (_direct is not None and not torch.compiler.is_compiling()
            and type(logits) is torch.Tensor and type(target) is torch.Tensor
            and not torch._C._is_torch_function_mode_enabled())


def vocab_parallel_cross_entropy(logits, target, group=None, *, ignore_index=-100,
                                 label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean",
                                 vocab_start=-1, vocab_size=-1, grad_mode="fused",
                                 inplace_grad=False, grad_scale=1.0):
    """The loss of this rank's logits shard [..., columns] against global targets [...].

    group: the tensor-parallel ProcessGroup (None: one rank, no communication). Options as in
    docs/torch.md; differentiable for the logits (torch.compile traces it with no graph break).
    grad_scale (fused): the gradient is computed for grad_output = grad_scale, so that
    `(loss * grad_scale).backward()` (e.g. 1 / gradient-accumulation steps) costs no extra pass.
    Any other grad_output is still applied: without inplace_grad the rows are recomputed from the
    logits, rounded once; with inplace_grad and reduction "mean" or "sum" the logits are gone and
    the gradient is rescaled, rounded twice (more than half an ulp of the dtype: a mean loss
    times 2.5 measured 1.12 ulps in bfloat16, 1.75 in float16): pass the grad_output you will
    use as grad_scale, or grad_mode="deferred", for a gradient rounded once. inplace_grad with
    reduction "none" (a per-token grad_output) takes the deferred path by itself.
    logits may be a DTensor sharded on the last dimension over a 1-D DeviceMesh (group=None,
    target replicated): the loss is then a replicated DTensor, as under loss_parallel().
    """
    if _dtensor.is_dtensor(logits):
        local, target, group, mesh = _dtensor.unwrap(logits, target, group, inplace_grad)
        loss = vocab_parallel_cross_entropy(
            local, target, group, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, reduction=reduction, vocab_start=vocab_start,
            vocab_size=vocab_size, grad_mode=grad_mode, inplace_grad=inplace_grad,
            grad_scale=grad_scale)
        return _dtensor.replicated(loss, mesh)
    call = _direct.vocab_parallel_cross_entropy if _takes_direct(logits, target) else _LOSS
    return call(
        logits, target, _name(group), ignore_index, label_smoothing, z_loss, softcap, reduction,
        vocab_start, vocab_size, grad_mode, inplace_grad, grad_scale)


def vocab_parallel_cross_entropy_stats(logits, target, group=None, *, ignore_index=-100,
                                       label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                                       reduction="mean", vocab_start=-1, vocab_size=-1,
                                       grad_mode="fused", inplace_grad=False,
                                       compute_accuracy=False, grad_scale=1.0):
    """(loss, lse, z_loss, argmax, accuracy); argmax and accuracy are empty unless asked.
    DTensor logits as in vocab_parallel_cross_entropy: every output a replicated DTensor."""
    if _dtensor.is_dtensor(logits):
        local, target, group, mesh = _dtensor.unwrap(logits, target, group, inplace_grad)
        out = vocab_parallel_cross_entropy_stats(
            local, target, group, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, reduction=reduction, vocab_start=vocab_start,
            vocab_size=vocab_size, grad_mode=grad_mode, inplace_grad=inplace_grad,
            compute_accuracy=compute_accuracy, grad_scale=grad_scale)
        return tuple(_dtensor.replicated(t, mesh) for t in out)
    call = _direct.vocab_parallel_cross_entropy_stats if _takes_direct(logits, target) else _STATS
    return call(
        logits, target, _name(group), ignore_index, label_smoothing, z_loss, softcap, reduction,
        vocab_start, vocab_size, grad_mode, inplace_grad, compute_accuracy, grad_scale)


def linear_cross_entropy(hidden, weight, target, group=None, *, sequence_parallel=False,
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                         reduction="mean", vocab_start=-1, vocab_size=-1, grad_mode="fused",
                         grad_scale=1.0, chunk_rows=0, max_scratch_bytes=0, schedule="auto",
                         max_chunk_bytes=None):
    """The fused lm head: the loss of hidden @ weight.T against global targets, without the
    logits [rows, V] ever existing in full (docs/linear.md). CPU and CUDA tensors.

    hidden [..., H] and target [...] (the same on every rank; with sequence_parallel=True this
    rank's own rows, as many on every rank), weight [V_local, H] this rank's shard of the
    vocabulary (its rows are the columns vocab_start.. of the logits; planned from every rank's
    rows when -1). Returns the float32 loss ([] or target's shape for reduction "none"),
    differentiable for hidden (summed over the ranks, or this rank's rows with
    sequence_parallel) and weight. Options as in vocab_parallel_cross_entropy.

    max_scratch_bytes bounds every byte of scratch the call takes (on CUDA from PyTorch's caching
    allocator, given back when the call ends); 0, the default, is the larger of an eighth of the
    bf16 logits the call replaces and what the lean schedule needs (of which lean spends no more
    than chunks of 6144 columns take: wider ones gained nothing more). Within it the plan takes the
    fast schedule (three GEMMs; a 16-bit d_weight over several chunks of rows needs an fp32
    accumulator of the whole shard) where it fits with chunks of at least 1024 rows, else the
    lean one (four GEMMs, no accumulator of d_weight); both are exact. schedule="fast" or "lean"
    asks for one (refused where the budget cannot hold it); linear_cross_entropy_plan says which
    a call takes. max_chunk_bytes is the former name of max_scratch_bytes.

    Every gradient element is rounded once to its dtype for any grad_output: grad_mode "fused"
    computes them in forward for grad_output = grad_scale, and backward recomputes them where
    grad_output is anything else (grad_output applied before the rounding); "deferred" always
    recomputes in backward. weight may be a DTensor sharded on dim 0 over a 1-D DeviceMesh
    (ColwiseParallel on an nn.Linear lm head): group, vocab_start and vocab_size then come from
    it, hidden and target plain or replicated, and the loss is a DTensor. See docs/torch.md.
    """
    budget = _budget(max_scratch_bytes, max_chunk_bytes)
    if _dtensor.is_dtensor(weight) or _dtensor.is_dtensor(hidden):
        d = _dtensor.LinearInputs(hidden, weight, target, group, sequence_parallel, vocab_start,
                                  vocab_size)
        loss = linear_cross_entropy(
            d.hidden, d.weight, d.target, d.group, sequence_parallel=sequence_parallel,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, reduction=reduction, vocab_start=d.vocab_start,
            vocab_size=d.vocab_size, grad_mode=grad_mode, grad_scale=grad_scale,
            chunk_rows=chunk_rows, max_scratch_bytes=budget, schedule=schedule)
        return d.wrap(loss, own_rows=sequence_parallel and reduction == "none")
    return _LINEAR(hidden, weight, target, _name(group), sequence_parallel, ignore_index,
                   label_smoothing, z_loss, softcap, reduction, vocab_start, vocab_size,
                   grad_mode, grad_scale, chunk_rows, budget, schedule)


def linear_cross_entropy_plan(hidden, weight, target, group=None, *, sequence_parallel=False,
                              ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                              reduction="mean", vocab_start=-1, vocab_size=-1, grad_mode="fused",
                              grad_scale=1.0, chunk_rows=0, max_scratch_bytes=0,
                              schedule="auto", max_chunk_bytes=None):
    """The plan linear_cross_entropy takes for the same arguments (plain tensors, hidden [rows, H]
    and target [rows]), computing nothing: a dict of schedule ("fast" or "lean"), budget (bytes),
    scratch_bytes (what the call allocates beyond its inputs and outputs, at most the budget),
    chunk_rows, chunk_cols, chunks and gemm, the engine of the logits GEMMs ("cublaslt", or
    "epilogue": the forward's statistics and the lean sweep's gradient from the accumulators of
    xent's own sm_90a GEMMs)
    (docs/linear.md, "Schedules and the budget", "GEMM engines"). A collective
    as the call is: every rank of `group` calls it alike. The plan of grad_mode "fused" is the
    forward's that computes the gradients; "none" the statistics' alone."""
    need = weight.requires_grad or hidden.requires_grad
    grads = grad_mode != "none" and need
    h = hidden.reshape(-1, hidden.shape[-1])
    out = torch.ops.xent._linear_plan(
        h, weight, target.reshape(-1), _name(group), ignore_index, label_smoothing, z_loss,
        softcap, reduction, vocab_start, vocab_size, grad_scale, sequence_parallel, chunk_rows,
        _budget(max_scratch_bytes, max_chunk_bytes), schedule, grads and hidden.requires_grad,
        grads and weight.requires_grad)
    names = ["schedule", "budget", "scratch_bytes", "chunk_rows", "chunk_cols", "chunks", "gemm"]
    plan = dict(zip(names, out))
    plan["schedule"] = "lean" if plan["schedule"] == 1 else "fast"
    plan["gemm"] = "epilogue" if plan["gemm"] == 1 else "cublaslt"
    return plan


def _budget(max_scratch_bytes, max_chunk_bytes):
    """max_scratch_bytes, or its former name where only that is given."""
    if max_chunk_bytes is not None and max_scratch_bytes == 0:
        return int(max_chunk_bytes)
    return int(max_scratch_bytes)


def check_errors(group=None, device=None):
    """Waits for the current stream, then raises if a target was out of range in a call on
    `group` and `device` (default: the current CUDA device) since the last check. The CUDA
    backend gives such rows a NaN loss instead of stopping; the CPU backend raises at once."""
    if device is None:  # the CPU backend raises at once: nothing to check without a GPU
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    torch.ops.xent.check_errors(_name(group), torch.device(device))
