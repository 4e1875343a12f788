"""xent's PyTorch operator in one process (group=None), on the CPU and, where there is one, CUDA:
bad input and refused calls.

Covered:
  * bad input raises RuntimeError naming the argument and the value, in this process and (the
    guard against the crash once seen on the GPU image) in a fresh subprocess that must exit 0;
    BAD_INPUTS and bad_args are test_direct.py's too;
  * on CUDA, a target out of range gives a NaN loss and is reported once by check_errors;
  * on CUDA, the internal operators refuse tensors off the logits' device;
  * one rank's layout with a gap in the vocabulary (vocab_start, vocab_size) is refused.
The loss and gradient are test_torch_op_loss.py's, torch.compile and opcheck
test_torch_op_compile.py's; the shared problem is op_problem.py.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \
        python3 -m pytest -q tests/python
"""

import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Callable, NamedTuple, Tuple

import pytest
import torch

import xent
from op_problem import DEVICES, N, OP_ARGS, V, random_logits, random_target


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
        import test_torch_op_errors as t
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


# --------------------------------------------------------------------------- refused layouts


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
