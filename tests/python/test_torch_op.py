"""xent's PyTorch operator in one process (group=None), on the CPU and, where there is one, CUDA.

Covered:
  * bad input raises RuntimeError naming the argument and the value, in this process and (the
    guard against the crash once seen on the GPU image) in a fresh subprocess that must exit 0;
  * loss and gradient against float64 F.cross_entropy on the full logits: logits [V], [N, V],
    [S, B, V], a transposed view (rows not one stride apart), a column slice of a wider tensor
    (row stride > V); reductions mean / sum / none; ignored rows; label smoothing; grad_mode fused
    and deferred; the gradient into a new tensor or over the logits (inplace_grad); float32 and
    bfloat16; autograd's rules (logits untouched without inplace_grad, second backward);
  * the stats operator (lse, z-loss, argmax, accuracy) against float64 torch;
  * torch.compile(fullgraph=True) of a training step against eager (and CUDA graphs on CUDA);
  * torch.library.opcheck of the internal operators torch.ops.xent._forward and friends.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \
        python3 -m pytest -q tests/python
"""

import math
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Callable, NamedTuple, Tuple

import pytest
import torch
import torch.nn.functional as F

import xent

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N, V = 24, 67  # rows, vocabulary
S, B = 4, 6  # [seq, batch] with S * B == N
H = 16  # hidden size of the compiled training step
IGNORE = -100

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


# --------------------------------------------------------------------------------- helpers


def assert_close(got, want, rtol, what):
    """max |got - want| <= rtol * max |want|, in float64; a NaN fails."""
    assert got is not None, f"{what}: None"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    if w.numel() == 0:
        return
    scale = max(w.abs().max().item(), 1e-30)
    err = (g - w).abs().max().item()
    assert err <= rtol * scale, (
        f"{what}: max |error| {err:.3e} > {rtol:g} * {scale:.3e} (got {g.flatten()[:6].tolist()}, "
        f"want {w.flatten()[:6].tolist()} ...)")


def random_logits(shape, dtype=torch.float32, device="cpu", seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def random_target(shape, device="cpu", seed=1, ignore_index=IGNORE):
    """Class ids in [0, V), every fifth row (from the fourth) ignore_index."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[3::5] = ignore_index
    return t.to(device)


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


def grad_output_for(reduction, shape, device):
    """d total / d loss: 1 for mean (the fused path's no-rescale case), 0.75 for sum, random
    per-row weights for none."""
    if reduction == "none":
        g = torch.Generator().manual_seed(7)
        return (torch.rand(shape, generator=g) + 0.5).to(device)
    return torch.tensor(1.0 if reduction == "mean" else 0.75, device=device)


# ------------------------------------------------------------------------------- bad input


class BadInput(NamedTuple):
    name: str
    call: Callable  # (logits [4, 10], target [4]) -> the failing call
    parts: Tuple[str, ...]  # the message contains each
    devices: Tuple[str, ...] = ("cpu", "cuda")


def _loss(*args, **kwargs):
    return xent.vocab_parallel_cross_entropy(*args, **kwargs)


def _with_target(y, row, value):
    y = y.clone()
    y[row] = value
    return y


BAD_INPUTS = [
    BadInput("rows_mismatch", lambda x, y: _loss(x, y.new_zeros(5)),
             ("target has shape [5]", "[4, 10]")),
    BadInput("label_smoothing_1", lambda x, y: _loss(x, y, label_smoothing=1.0),
             ("label_smoothing = 1", "[0, 1)")),
    BadInput("3d_logits_flat_target",
             lambda x, y: _loss(x.new_zeros(2, 4, 10), y.new_zeros(8)),
             ("target has shape [8]", "[2, 4, 10]", "[2, 4]")),
    BadInput("float_target", lambda x, y: _loss(x, y.float()), ("int64 or int32", "Float")),
    BadInput("reduction_avg", lambda x, y: _loss(x, y, reduction="avg"), ('reduction = "avg"',)),
    BadInput("grad_mode_eager", lambda x, y: _loss(x, y, grad_mode="eager"),
             ('grad_mode = "eager"',)),
    BadInput("vocab_start_-2", lambda x, y: _loss(x, y, vocab_start=-2), ("vocab_start = -2",)),
    BadInput("vocab_size_11", lambda x, y: _loss(x, y, vocab_size=11), ("vocab_size = 11",)),
    BadInput("grad_scale_0", lambda x, y: _loss(x, y, grad_scale=0.0),
             ("grad_scale = 0", "finite and > 0")),
    BadInput("grad_scale_nan", lambda x, y: _loss(x, y, grad_scale=float("nan")),
             ("grad_scale = nan", "finite and > 0")),
    BadInput("grad_scale_deferred", lambda x, y: _loss(x, y, grad_mode="deferred", grad_scale=0.5),
             ("grad_scale = 0.5", "grad_mode = deferred", "fused only")),
    BadInput("int_logits", lambda x, y: _loss(x.detach().int(), y),
             ("float32, bfloat16 or float16", "Int")),
    BadInput("0d_logits", lambda x, y: _loss(x[0, 0], y), ("0-D",)),
    BadInput("target_out_of_range", lambda x, y: _loss(x, _with_target(y, 2, 10)),
             ("targets[2]", "= 10"), devices=("cpu",)),
    BadInput("target_on_cpu", lambda x, y: _loss(x, y.cpu()),
             ("target is on cpu", "logits are on cuda"), devices=("cuda",)),
    BadInput("logits_on_cpu", lambda x, y: _loss(x.detach().cpu(), y),
             ("target is on cuda", "logits are on cpu"), devices=("cuda",)),
]


def bad_cases():
    """(id, device, requires_grad, BadInput) for every bad input on every device here."""
    return [(f"{device}-{'grad' if rg else 'nograd'}-{b.name}", device, rg, b)
            for device in DEVICES for rg in (False, True) for b in BAD_INPUTS
            if device in b.devices]


def bad_args(device, requires_grad):
    """Otherwise valid logits [4, 10] (requiring grad or not) and target [4]."""
    x = random_logits((4, 10), device=device).requires_grad_(requires_grad)
    y = torch.tensor([1, 9, 2, 0], device=device)
    return x, y


def one_line(e):
    return " | ".join(str(e).splitlines())


@pytest.mark.parametrize("case", bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_naming_argument_and_value(case):
    _, device, requires_grad, bad = case
    with pytest.raises(RuntimeError) as info:
        bad.call(*bad_args(device, requires_grad))
    message = one_line(info.value)
    assert message.startswith("xent: "), f"message lacks the 'xent: ' prefix: {message}"
    for part in bad.parts:
        assert part in message, f"message lacks {part!r}: {message}"


def test_bad_input_in_fresh_process_raises_and_never_crashes():
    """Every bad input in a fresh interpreter: a crash (e.g. a C++ exception escaping as abort or
    a segfault) gives a non-zero (negative: a signal) exit status instead of RuntimeErrors."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parent)!r})
        import test_torch_op as t
        for case_id, device, requires_grad, bad in t.bad_cases():
            try:
                bad.call(*t.bad_args(device, requires_grad))
            except RuntimeError as e:
                print(case_id + ": RuntimeError: " + t.one_line(e), flush=True)
            else:
                print(case_id + ": no error", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], env=os.environ, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (
        f"subprocess exited with {r.returncode} (negative: killed by signal {-r.returncode})\n"
        f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}")
    lines = {line.split(": ", 1)[0]: line for line in r.stdout.splitlines() if ": " in line}
    for case_id, _, _, bad in bad_cases():
        line = lines.get(case_id, "")
        assert line.startswith(case_id + ": RuntimeError: xent: "), (
            f"{case_id}: no RuntimeError printed ({line!r})\nstdout:\n{r.stdout}")
        for part in bad.parts:
            assert part in line, f"{case_id}: message lacks {part!r}: {line}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_target_out_of_range_is_nan_and_reported_by_check_errors():
    x = random_logits((4, 10), device="cuda")
    y = torch.tensor([1, 9, 10, 0], device="cuda")
    loss = xent.vocab_parallel_cross_entropy(x, y, reduction="none")
    with pytest.raises(RuntimeError) as info:
        xent.check_errors(None, x.device)
    message = one_line(info.value)
    assert "targets[2]" in message and "= 10" in message, message
    assert torch.isnan(loss[2]).item(), loss
    ok = torch.tensor([True, True, False, True])
    assert torch.isfinite(loss.cpu()[ok]).all(), loss
    xent.check_errors(None, x.device)  # reported once: the next check passes


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_internal_operators_refuse_tensors_off_the_logits_device():
    """The internal operators skip the driver's pointer queries: they must check devices."""
    ops = torch.ops.xent
    args = OP_ARGS + ("mean", -1, -1, 1.0)
    x = random_logits((N, V), device="cuda")
    t = random_target((N,), "cuda")
    _, lse, _, _, _, grad = ops._forward.default(x, t, *args, False, True, True)
    one = torch.ones((), device="cuda")
    calls = {
        "target": lambda: ops._forward.default(x, t.cpu(), *args, False, True, False),
        "lse": lambda: ops._backward.default(x, t, lse.cpu(), one, *args),
        "grad_output": lambda: ops._scale_inplace.default(grad, t, one.cpu(), *args),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError) as info:
            call()
        message = one_line(info.value)
        assert "is on cpu but the logits are on cuda:0" in message, (what, message)


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


# ---------------------------------------------------------------------------- torch.compile


def make_step(grad_mode, inplace_grad, backward_in_graph, grad_scale=1.0):
    """A training step's loss: logits = x @ w.T viewed as [S, B, V]. backward_in_graph: the step
    runs loss.backward() itself (one compiled graph, forward and backward); else the caller does.
    grad_scale != 1: the step's loss is the loss times grad_scale (one micro-batch of several),
    and xent is told so."""
    def step(x, w, t):
        logits = x @ w.t()
        loss = xent.vocab_parallel_cross_entropy(
            logits.view(S, B, -1), t.view(S, B), label_smoothing=0.1, grad_mode=grad_mode,
            inplace_grad=inplace_grad, grad_scale=grad_scale)
        if grad_scale != 1.0:
            loss = loss * grad_scale
        if backward_in_graph:
            loss.backward()
            return loss.detach()
        return loss
    return step


def run_step(step, x0, w0, target, backward_in_graph):
    """(loss, x.grad, w.grad) of one step from fresh leaves x0 and w0."""
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    loss = step(x, w, target)
    if not backward_in_graph:
        loss.backward()
    return loss.detach().clone(), x.grad, w.grad


def step_inputs(device, seed=0):
    x0 = random_logits((N, H), device=device, seed=seed, scale=1.0)
    w0 = random_logits((V, H), device=device, seed=seed + 1, scale=H ** -0.5)
    target = random_target((N,), device, seed=seed + 2)
    return x0, w0, target


def step_reference(x0, w0, target, grad_scale=1.0):
    """float64 loss and gradients of x and w (F.cross_entropy, label smoothing 0.1)."""
    x = x0.cpu().double().requires_grad_()
    w = w0.cpu().double().requires_grad_()
    loss = F.cross_entropy(x @ w.t(), target.cpu(), label_smoothing=0.1) * grad_scale
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.fixture
def dynamo():
    """A fresh dynamo (caches and counters) for one test; backward may be traced in the graph."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield counters
    torch._dynamo.reset()


def assert_one_graph(counters):
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("backward_in_graph", [True, False],
                         ids=["backward_in_graph", "backward_outside"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device, inplace_grad, grad_mode, backward_in_graph,
                                         dynamo):
    x0, w0, target = step_inputs(device)
    step = make_step(grad_mode, inplace_grad, backward_in_graph)
    eager = run_step(step, x0, w0, target, backward_in_graph)
    for got, want, what in zip(eager, step_reference(x0, w0, target), ("loss", "dx", "dw")):
        assert_close(got, want, 1e-5, f"eager {what} vs float64")

    compiled = torch.compile(step, fullgraph=True)
    got = run_step(compiled, x0, w0, target, backward_in_graph)
    assert_one_graph(dynamo)
    for g, want, what in zip(got, eager, ("loss", "dx", "dw")):
        assert_close(g, want, 1e-5, f"compiled {what} vs eager")


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_grad_scale_matches_eager(device, inplace_grad, dynamo):
    x0, w0, target = step_inputs(device)
    step = make_step("fused", inplace_grad, True, grad_scale=0.25)
    eager = run_step(step, x0, w0, target, True)
    for got, want, what in zip(eager, step_reference(x0, w0, target, 0.25), ("loss", "dx", "dw")):
        assert_close(got, want, 1e-5, f"eager {what} vs float64")
    got = run_step(torch.compile(step, fullgraph=True), x0, w0, target, True)
    assert_one_graph(dynamo)
    for g, want, what in zip(got, eager, ("loss", "dx", "dw")):
        assert_close(g, want, 1e-5, f"compiled {what} vs eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backward_in_graph", [True, False],
                         ids=["backward_in_graph", "backward_outside"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_compile_cuda_graphs_match_eager(grad_mode, backward_in_graph, dynamo):
    step = make_step(grad_mode, False, backward_in_graph)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for call in range(3):  # warm-up, recording, replay
        x0, w0, target = step_inputs("cuda", seed=10 * call)
        want = run_step(step, x0, w0, target, backward_in_graph)
        got = run_step(compiled, x0, w0, target, backward_in_graph)
        for g, w, what in zip(got, want, ("loss", "dx", "dw")):
            assert_close(g, w, 1e-5, f"call {call}: compiled {what} vs eager")
    assert_one_graph(dynamo)


# -------------------------------------------------------------------------------- opcheck


OP_ARGS = ("", IGNORE, 0.1, 1e-3, 0.0)  # group_name, ignore_index, smoothing, z_loss, softcap


def opcheck_cases(device, reduction):
    """name -> (operator, arguments): valid calls of every internal operator."""
    ops = torch.ops.xent
    args = OP_ARGS + (reduction, -1, -1, 0.5)
    x = random_logits((N, V), device=device)
    t = random_target((N,), device)
    _, lse, _, _, _, grad = ops._forward.default(x, t, *args, False, True, True)
    go = grad_output_for(reduction, (N,), device).float()
    return {
        "forward_with_grad": (ops._forward.default, (x, t, *args, False, True, False)),
        "forward_no_grad": (ops._forward.default, (x, t, *args, True, False, True)),
        "backward": (ops._backward.default, (x, t, lse, go, *args)),
        "forward_inplace": (ops._forward_inplace.default, (x.clone(), t, *args, False, True)),
        "backward_inplace": (ops._backward_inplace.default, (x.clone(), t, lse, go, *args)),
        "scale_inplace": (ops._scale_inplace.default, (grad.clone(), t, go, *args)),
    }


OPCHECK_NAMES = ["forward_with_grad", "forward_no_grad", "backward", "forward_inplace",
                 "backward_inplace", "scale_inplace"]


@pytest.mark.parametrize("name", OPCHECK_NAMES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_internal_operators(device, reduction, name):
    op, args = opcheck_cases(device, reduction)[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [dict(vocab_start=3), dict(vocab_start=100),
                                    dict(vocab_start=0, vocab_size=20)],
                         ids=["start3", "start100", "size20"])
def test_one_rank_layout_with_a_gap_is_refused(device, layout):
    """One rank's shard is the whole vocabulary: a gap used to give inf losses, silently."""
    x = torch.randn(4, 10, device=device, requires_grad=True)
    t = torch.tensor([0, 2, 5, 9], device=device)
    with pytest.raises(RuntimeError, match="vocab_start = |vocab_size = 20"):
        xent.vocab_parallel_cross_entropy(x, t, reduction="none", **layout)


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
