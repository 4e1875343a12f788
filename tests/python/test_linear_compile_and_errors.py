"""xent.linear_cross_entropy, the fused lm head, through `import xent`, on the CPU backend, as
torch's machinery sees it: torch.compile(fullgraph=True) of a training step against eager (no
graph break), torch.library.opcheck of the three internal operators, and bad input, each a
RuntimeError naming the argument, the value and the rule. The problem is linear_reference.py's.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_linear_compile_and_errors.py
"""

import re

import pytest
import torch

from linear_reference import H, IGNORE, V, inputs, per_token


@pytest.mark.parametrize("backward_in_graph", [False, True], ids=["outside", "in_graph"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_compile_fullgraph(grad_mode, backward_in_graph):
    """A training step compiled whole: the same loss and gradients as eager. Outside the graph
    the loss is scaled by 2.5 (fused: the compiled backward recomputes); in it, loss.backward()
    (fused: forward's gradients)."""
    import xent
    from torch._dynamo.utils import counters
    hidden, weight, target = inputs(torch.bfloat16, seed=9)

    def step(h, w, t):
        loss = xent.linear_cross_entropy(h, w, t, label_smoothing=0.1, grad_mode=grad_mode)
        if backward_in_graph:
            loss.backward()
            return loss.detach()
        return loss

    def run(f):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = f(h, w, target)
        if not backward_in_graph:
            (loss * 2.5).backward()
        return loss.detach(), h.grad, w.grad

    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            got = run(torch.compile(step, fullgraph=True))
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    eager = run(step)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def _op_args(reduction, grad_scale, chunk_rows=0):
    return ("", IGNORE, 0.1, 1e-3, 0.0, reduction, -1, -1, grad_scale, False, chunk_rows,
            1 << 26, "auto")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(reduction):
    hidden, weight, target = inputs(torch.float32, seed=10)
    h, t = hidden.reshape(-1, H), target.reshape(-1)
    go = per_token().reshape(-1) if reduction == "none" else torch.tensor(3.0)
    ops = torch.ops.xent
    for dh, dw in ((True, True), (True, False), (False, True)):
        args = _op_args(reduction, 0.5, chunk_rows=5)
        torch.library.opcheck(ops._linear_forward.default, (h, weight, t, *args, dh, dw))
    args = _op_args(reduction, 1.0)
    _, lse, _, _ = ops._linear_forward.default(h, weight, t, *args, False, False)
    torch.library.opcheck(ops._linear_backward.default, (h, weight, t, lse, go, *args, True, True))
    args = _op_args(reduction, 0.5)
    _, lse, dh, dw = ops._linear_forward.default(h, weight, t, *args, True, True)
    torch.library.opcheck(ops._linear_backward_fused.default,
                          (dh.clone(), dw.clone(), h, weight, t, lse, go, *args))


BAD = {  # name -> (changes to the call, what the error says)
    "hidden_size": (dict(weight=lambda w: w[:, :H - 1]),
                    f"hidden.shape[-1] = {H} but weight.shape[1] = {H - 1}"),
    "weight_1d": (dict(weight=lambda w: w[0]), "weight has shape [32]: must be 2-D"),
    "weight_dtype": (dict(weight=lambda w: w.bfloat16()),
                     "weight is BFloat16 but hidden is Float: both must have the same dtype"),
    "hidden_dtype": (dict(hidden=lambda h: h.double()),
                     "hidden must be float32, bfloat16 or float16, got Double"),
    "hidden_0d": (dict(hidden=lambda h: h[0, 0, 0]), "hidden must have a last"),
    "target_shape": (dict(target=lambda t: t[:, :2]), "target has shape [4, 2] but hidden"),
    "target_dtype": (dict(target=lambda t: t.float()), "target must hold int64 or int32"),
    "target_range": (dict(target=lambda t: t.clone().fill_(V)),
                     f"targets[0] = {V}: must be in [0, vocab_size = {V})"),
    "not_cpu": (dict(hidden=lambda h: h.to("meta"), weight=lambda w: w.to("meta"),
                     target=lambda t: t.to("meta")),
                "hidden is on meta: the fused lm head takes CPU or CUDA tensors"),
    "devices": (dict(weight=lambda w: w.to("meta")),
                "weight is on meta and target on cpu but hidden is on cpu"),
    "reduction": (dict(reduction="avg"), 'reduction = "avg"'),
    "grad_mode": (dict(grad_mode="eager"), 'grad_mode = "eager"'),
    "grad_scale": (dict(grad_scale=-1.0), "grad_scale = -1: must be finite and > 0"),
    "grad_scale_deferred": (dict(grad_mode="deferred", grad_scale=0.5),
                            "grad_scale = 0.5 with grad_mode = deferred"),
    "label_smoothing": (dict(label_smoothing=1.0), "label_smoothing = 1: must be in [0, 1)"),
    "chunk_rows": (dict(chunk_rows=-1), "chunk_rows = -1: must be >= 1, or 0"),
    "max_scratch_bytes": (dict(max_scratch_bytes=-1), "max_scratch_bytes = -1: must be >= 0"),
    "max_scratch_bytes_small": (dict(max_scratch_bytes=8),
                                "max_scratch_bytes = 8: too small for either schedule"),
    "schedule": (dict(schedule="slow"), 'schedule = "slow": must be "auto", "fast" or "lean"'),
    "vocab_size": (dict(vocab_size=V + 1), f"vocab_size = {V + 1}: must be in [1, {V}]"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(name):
    import xent
    hidden, weight, target = inputs(torch.float32, seed=11)
    changes, message = BAD[name]
    args = dict(hidden=hidden.requires_grad_(), weight=weight.requires_grad_(), target=target)
    options = {}
    for key, change in changes.items():
        if key in args:
            args[key] = change(args[key])
        else:
            options[key] = change
    with pytest.raises(RuntimeError, match=re.escape(message)):
        xent.linear_cross_entropy(args["hidden"], args["weight"], args["target"], **options)
