"""xent's PyTorch operator in one process (group=None), on the CPU and, where there is one, CUDA,
under torch's tools:
  * torch.compile(fullgraph=True) of a training step (logits = x @ w.T, label smoothing 0.1,
    grad_scale) against eager and float64, one graph with no breaks (and CUDA graphs, mode
    "reduce-overhead", on CUDA);
  * torch.library.opcheck of the internal operators torch.ops.xent._forward and friends.
Bad input is test_torch_op_errors.py's, the loss and gradient test_torch_op_loss.py's; the shared
problem is op_problem.py.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \
        python3 -m pytest -q tests/python
"""

import pytest
import torch
import torch.nn.functional as F

import xent
from op_problem import (B, DEVICES, N, OP_ARGS, S, V, assert_close, grad_output_for,
                        random_logits, random_target)

H = 16  # hidden size of the compiled training step


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
