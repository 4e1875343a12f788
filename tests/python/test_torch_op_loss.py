"""xent's PyTorch operator in one process (group=None), on the CPU and, where there is one, CUDA:
what a call computes.

Covered:
  * loss and gradient against float64 F.cross_entropy on the full logits: logits [V], [N, V],
    [S, B, V], a transposed view (rows not one stride apart), a column slice of a wider tensor
    (row stride > V); reductions mean / sum / none; ignored rows; label smoothing; grad_mode fused
    and deferred; the gradient into a new tensor or over the logits (inplace_grad); grad_scale;
    float32 and bfloat16; autograd's rules (logits untouched without inplace_grad, second
    backward); int32 targets and another ignore_index;
  * rows wide enough for the CUDA single-pass path (5000 and 40000 columns);
  * the stats operator (lse, z-loss, argmax, accuracy) against float64 torch;
  * on CUDA, the per-row scratch comes from PyTorch's caching allocator.
Bad input is test_torch_op_errors.py's, torch.compile and opcheck test_torch_op_compile.py's;
the shared problem is op_problem.py.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \
        python3 -m pytest -q tests/python
"""

import math
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F

import xent
from op_problem import (B, DEVICES, IGNORE, N, S, V, assert_close, grad_output_for,
                        random_logits, random_target)

LOSS_RTOL = 1e-5  # the loss is float32 whatever the logits' dtype


def grad_rtol(dtype, rounded_twice=False):
    """Gradient tolerance, relative to the reference's largest magnitude: rounded once to the
    dtype (half an ulp, at most 2^-8 relative for bfloat16), or, where rounded_twice says, twice
    (up to 1.75 ulps)."""
    return (1.6e-2 if rounded_twice else 8e-3) if dtype == torch.bfloat16 else 1e-5


def rounded_twice(grad_mode, inplace_grad, reduction, grad_output, grad_scale=1.0):
    """Whether the gradient is rounded twice (docs/torch.md): fused in place with a mean or sum
    loss whose grad_output / grad_scale is not a power of two (a rescale that is not exact)."""
    if grad_mode != "fused" or not inplace_grad or reduction == "none":
        return False
    return math.frexp(abs(float(grad_output) / grad_scale))[0] != 0.5


def reference(source, view, target, grad_output, *, reduction="mean", label_smoothing=0.0,
              ignore_index=IGNORE):
    """float64 F.cross_entropy on the full logits view(source) and its gradient w.r.t. source
    for loss.backward(grad_output); the loss has the target's shape for reduction "none"."""
    x = source.detach().cpu().double().requires_grad_()
    logits = view(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.cpu().reshape(-1).long(),
                           ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    loss.backward(grad_output.detach().cpu().double())
    return loss.detach(), x.grad


# ----------------------------------------------------------------------- loss and gradient


class Layout(NamedTuple):
    source_shape: tuple  # the leaf that requires grad
    logits: Callable  # source -> the logits passed to xent
    target_shape: tuple  # the target made for it
    target: Callable  # target -> the target passed to xent


def _same(t):
    return t


LAYOUTS = {
    "1d": Layout((V,), _same, (), _same),
    "2d": Layout((N, V), _same, (N,), _same),
    "3d": Layout((S, B, V), _same, (S, B), _same),
    # [B, S, V] view of [S, B, V]: rows are not one stride apart (the op copies once)
    "transposed": Layout((S, B, V), lambda s: s.transpose(0, 1), (S, B),
                         lambda t: t.transpose(0, 1)),
    # columns [5, 5 + V) of [N, V + 13]: row stride V + 13
    "column_slice": Layout((N, V + 13), lambda s: s[:, 5:5 + V], (N,), _same),
}


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["ls0", "ls0.1"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_loss_and_gradient_match_torch(device, dtype, layout, reduction, label_smoothing,
                                       grad_mode, inplace_grad):
    lay = LAYOUTS[layout]
    source = random_logits(lay.source_shape, dtype, device).requires_grad_()
    target = lay.target(random_target(lay.target_shape, device))
    grad_output = grad_output_for(reduction, target.shape, device)
    want_loss, want_grad = reference(source, lay.logits, target, grad_output,
                                     reduction=reduction, label_smoothing=label_smoothing)
    before = source.detach().clone()

    # In place the logits must not be a leaf (nor a view of one): the output of some layer.
    logits = lay.logits(source * 1.0 if inplace_grad else source)
    version = logits._version
    loss = xent.vocab_parallel_cross_entropy(
        logits, target, reduction=reduction, label_smoothing=label_smoothing,
        grad_mode=grad_mode, inplace_grad=inplace_grad)

    assert loss.dtype == torch.float32 and loss.device == source.device
    assert loss.shape == (target.shape if reduction == "none" else ())
    assert_close(loss, want_loss, LOSS_RTOL, "loss")
    loss.backward(grad_output)
    twice = rounded_twice(grad_mode, inplace_grad, reduction, grad_output)
    assert_close(source.grad, want_grad, grad_rtol(dtype, twice), "gradient")
    if not inplace_grad:
        assert logits._version == version, "the logits' version changed without inplace_grad"
        assert torch.equal(source.detach(), before), "the logits changed without inplace_grad"


@pytest.mark.parametrize("backward_scale", [0.125, 1.0, 0.3], ids=["same", "one", "other"])
@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_any_grad_output_matches_torch(device, dtype, reduction, inplace_grad,
                                                  backward_scale):
    """grad_scale=0.125 (e.g. 8 accumulation steps): the loss is unchanged, and the gradient is
    exact for whatever grad_output reaches it: the same 0.125 (nothing left to do in backward),
    1, or another value."""
    source = random_logits((S, B, V), dtype, device).requires_grad_()
    target = random_target((S, B), device)
    grad_output = grad_output_for(reduction, target.shape, device) * backward_scale
    want_loss, want_grad = reference(source, _same, target, grad_output, reduction=reduction)
    logits = source * 1.0 if inplace_grad else source
    loss = xent.vocab_parallel_cross_entropy(logits, target, reduction=reduction,
                                             inplace_grad=inplace_grad, grad_scale=0.125)
    assert_close(loss, want_loss, LOSS_RTOL, "loss")
    loss.backward(grad_output)
    twice = rounded_twice("fused", inplace_grad, reduction, grad_output, 0.125)
    assert_close(source.grad, want_grad, grad_rtol(dtype, twice), "gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_is_folded_into_forward(device):
    """With grad_scale=0.25 the gradient that forward writes is a quarter of the plain one, bit
    for bit (a power of two), and a backward of grad_output 0.25 leaves it as it is."""
    x = random_logits((N, V), torch.bfloat16, device)
    target = random_target((N,), device)
    grads = []
    for grad_scale in (1.0, 0.25):
        source = x.clone().requires_grad_()
        logits = source * 1.0
        loss = xent.vocab_parallel_cross_entropy(logits, target, inplace_grad=True,
                                                 grad_scale=grad_scale)
        grads.append(logits.detach().clone())  # forward's gradient, over the logits
        (loss * grad_scale).backward()
        assert torch.equal(source.grad, grads[-1]), "backward changed the gradient"
    assert torch.equal(grads[1], grads[0] * 0.25)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_column_slice_leaves_other_columns_alone(device, grad_mode):
    source = random_logits((N, V + 13), device=device).requires_grad_()
    target = random_target((N,), device)
    wide = source * 1.0
    loss = xent.vocab_parallel_cross_entropy(wide[:, 5:5 + V], target, grad_mode=grad_mode,
                                             inplace_grad=True)
    loss.backward()
    outside = torch.ones(V + 13, dtype=torch.bool)
    outside[5:5 + V] = False
    assert torch.equal(wide.detach()[:, outside.to(device)], source.detach()[:, outside.to(device)])
    _, want_grad = reference(source, lambda s: s[:, 5:5 + V], target, torch.tensor(1.0))
    assert_close(source.grad, want_grad, grad_rtol(torch.float32), "gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_int32_target_and_other_ignore_index(device):
    source = random_logits((N, V), device=device).requires_grad_()
    target = random_target((N,), device, ignore_index=5).int()
    loss = xent.vocab_parallel_cross_entropy(source, target, ignore_index=5)
    want_loss, want_grad = reference(source, _same, target, torch.tensor(1.0), ignore_index=5)
    assert_close(loss, want_loss, LOSS_RTOL, "loss")
    loss.backward()
    assert_close(source.grad, want_grad, grad_rtol(torch.float32), "gradient")


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("device", DEVICES)
def test_second_backward_only_deferred_out_of_place(device, grad_mode, inplace_grad):
    source = random_logits((N, V), device=device).requires_grad_()
    target = random_target((N,), device)
    loss = xent.vocab_parallel_cross_entropy(source * 1.0, target, grad_mode=grad_mode,
                                             inplace_grad=inplace_grad)
    loss.backward(retain_graph=True)
    first = source.grad.clone()
    if grad_mode == "deferred" and not inplace_grad:
        loss.backward()
        assert_close(source.grad, 2 * first, 1e-6, "gradient after two backwards")
    else:
        with pytest.raises(RuntimeError, match="a second time"):
            loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_without_autograd_the_logits_are_only_read(device):
    logits = random_logits((N, V), device=device).requires_grad_()
    target = random_target((N,), device)
    before, version = logits.detach().clone(), logits._version
    with torch.no_grad():
        loss = xent.vocab_parallel_cross_entropy(logits * 1.0, target, inplace_grad=True)
    want_loss, _ = reference(logits, _same, target, torch.tensor(1.0))
    assert_close(loss, want_loss, LOSS_RTOL, "loss")
    assert loss.grad_fn is None
    assert logits._version == version and torch.equal(logits.detach(), before)


# -------------------------------------------------------------------------------- stats op


@pytest.mark.parametrize("compute_accuracy", [False, True], ids=["no_accuracy", "accuracy"])
@pytest.mark.parametrize("device", DEVICES)
def test_stats_match_torch(device, compute_accuracy):
    z_weight = 1e-3
    logits = random_logits((S, B, V), device=device)
    x = logits.cpu().double()
    best = x.argmax(-1)
    target = random_target((S, B)).view(-1)
    target[::2] = torch.where(target[::2] == IGNORE, IGNORE, best.view(-1)[::2])  # some right
    target = target.view(S, B).to(device)

    loss, lse, zl, argmax, accuracy = xent.vocab_parallel_cross_entropy_stats(
        logits, target, z_loss=z_weight, reduction="none", compute_accuracy=compute_accuracy)

    t = target.cpu()
    valid = t != IGNORE
    want_lse = torch.logsumexp(x, -1)
    want_z = torch.where(valid, z_weight * want_lse ** 2, torch.zeros_like(want_lse))
    want_loss = F.cross_entropy(x.reshape(-1, V), t.reshape(-1), reduction="none").view(S, B)
    for got in (loss, lse, zl):
        assert got.shape == target.shape and got.dtype == torch.float32
    assert_close(lse, want_lse, 1e-5, "lse")
    assert_close(zl, want_z, 1e-5, "z_loss")
    assert_close(loss, want_loss + want_z, LOSS_RTOL, "loss")
    if compute_accuracy:
        assert argmax.shape == target.shape and argmax.dtype == torch.int64
        assert torch.equal(argmax.cpu(), best)
        want_accuracy = ((best == t) & valid).sum().double() / valid.sum()
        assert 0 < want_accuracy.item() < 1
        assert accuracy.shape == ()
        assert_close(accuracy, want_accuracy, 1e-6, "accuracy")
    else:
        assert argmax.numel() == 0 and accuracy.numel() == 0


# ------------------------------------------------------------------------------ wide rows


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("cols", [5000, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_wide_rows_match_torch(device, dtype, cols, reduction, inplace_grad):
    """Rows wide enough for the CUDA single-pass path (one block; a cluster of blocks at 40000
    columns), [seq, batch, cols] logits, against float64 F.cross_entropy."""
    g = torch.Generator().manual_seed(cols)
    source = random_logits((S, B, cols), dtype, device, seed=cols).requires_grad_()
    target = torch.randint(0, cols, (S, B), generator=g)
    target.view(-1)[2::7] = IGNORE
    target = target.to(device)
    grad_output = grad_output_for(reduction, target.shape, device)
    want_loss, want_grad = reference(source, lambda x: x, target, grad_output,
                                     reduction=reduction)
    logits = source * 1.0 if inplace_grad else source
    loss = xent.vocab_parallel_cross_entropy(logits, target, reduction=reduction,
                                             inplace_grad=inplace_grad)
    assert_close(loss, want_loss, LOSS_RTOL, "loss")
    loss.backward(grad_output)
    assert_close(source.grad, want_grad, grad_rtol(dtype), "gradient")


# --------------------------------------------------------------------------------- memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_mode", ["fused", "none"])
def test_cuda_per_row_scratch_from_the_caching_allocator(grad_mode):
    """The per-row scratch (records, lse) of a call on CUDA tensors comes from PyTorch's caching
    allocator: max_memory_allocated sees it, and no device memory outside that allocator grows
    with the rows (the group's workspace keeps its fixed part; it used to grow to 12 bytes a
    row, 24 MiB here, and keep them)."""
    def outside():
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()
    rows, cols = 1 << 21, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    small = torch.randn(64, cols, device="cuda", generator=g)
    xent.vocab_parallel_cross_entropy(small, torch.zeros(64, dtype=torch.long, device="cuda"))
    x = torch.randn(rows, cols, device="cuda", generator=g).requires_grad_(grad_mode != "none")
    t = torch.randint(0, cols, (rows,), device="cuda", generator=g)
    torch.cuda.synchronize()
    outside0, before = outside(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = xent.vocab_parallel_cross_entropy(x, t, grad_mode=grad_mode)
    torch.cuda.synchronize()
    assert torch.isfinite(loss).item()
    assert torch.cuda.max_memory_allocated() - before >= 8 * rows  # two floats of record a row
    grown = outside() - outside0
    assert grown < (2 << 20), f"{grown} bytes outside PyTorch's allocator after {rows} rows"
