"""xent.linear_cross_entropy, the fused lm head (hidden @ weight.T and the loss, the logits never
whole), through `import xent`, on the CPU backend, against float64 F.cross_entropy of
hidden.double() @ weight.double().T.

Covered:
  * one rank: loss, d_hidden and d_weight for float32 and bfloat16 inputs, the three reductions,
    label smoothing, z-loss and softcap, ignored rows, fused and deferred, a scalar and a
    per-token grad_output: every gradient element within half an ulp of its dtype from float64
    (plus float32 noise: test_exact_grad's excess_ulps), i.e. rounded once;
  * fused: grad_output equal to grad_scale returns forward's gradients as they are (hidden and
    weight made NaN after forward cannot reach them), any other grad_output recomputes; fused
    and deferred give the same bits; a second backward (retain_graph) recomputes; the gradients
    are differentiable once only;
  * both schedules (fast, lean) in every case of the float64 comparison; chunks (chunk_rows, a
    budget that splits lean's vocabulary): the same loss bits, exact gradients; the plan
    (linear_cross_entropy_plan) within its budget, the schedule asked for; frozen inputs,
    no_grad, grad_mode "none"; leading dimensions, strided and transposed hidden, a row-strided
    weight, int32 targets; a padded vocabulary (vocab_size);
  * torch.compile(fullgraph=True) of a training step against eager (no graph break), and
    torch.library.opcheck of the three internal operators; bad input, each a RuntimeError naming
    the argument, the value and the rule;
  * two and three ranks over Gloo (tests/python/ranks.py), and two over NCCL where there are
    2 GPUs (cuda:<rank>), uneven shards, with and without
    sequence parallelism, against the float64 reference on the full vocabulary; on two ranks
    the DTensor weight of ColwiseParallel on an nn.Linear, xent.megatron.linear_cross_entropy
    (Megatron-LM main's signature and layout, with and without sequence parallelism), and bad
    input raised on every rank alike; xent.megatron.patch() with and without Megatron's module.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_linear.py
"""

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import ranks
import test_torch_dist
from test_exact_grad import excess_ulps
from test_exact_grad import reference as logits_reference

S, B, H, V = 4, 6, 32, 77  # hidden [S, B, H], the whole vocabulary V
IGNORE = -100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "zloss_softcap": dict(z_loss=1e-3, softcap=5.0),
}
WIDTHS = {2: [40, 37], 3: [30, 25, 22]}  # uneven shards of V, in rank order
DEADLINE_S = 300


# ---------------------------------------------------------------------------------- helpers


def inputs(dtype, seed=0, rows=(S, B), vocab=V):
    """hidden [*rows, H], the whole weight [vocab, H], target [*rows] with ignored rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((*rows, H), generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn((vocab, H), generator=g, dtype=torch.float64) * 2 * H ** -0.5).to(dtype)
    target = torch.randint(0, vocab, rows, generator=g)
    target.view(-1)[3::7] = IGNORE
    return hidden, weight, target


def per_token(rows=(S, B), seed=5):
    """A per-token grad_output: random, some exactly 1 (the default grad_scale), one 0."""
    go = torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 0.01
    go.view(-1)[::4] = 1.0
    go.view(-1)[6] = 0.0
    return go


def grad_output_for(reduction):
    return per_token() if reduction == "none" else torch.tensor(2.5)


def reference(hidden, weight, target, grad_output, reduction, **options):
    """float64 (loss, d_hidden, d_weight) and the magnitude of each gradient element's terms
    (the float32 noise allowance of excess_ulps): the logits' gradient and its terms come from
    test_exact_grad.reference, pushed through the two products."""
    h = hidden.detach().double().reshape(-1, H)
    w = weight.detach().double()
    logits = h @ w.T
    t = target.reshape(-1)
    z = options.get("softcap", 0.0)
    capped = z * torch.tanh(logits / z) if z > 0 else logits
    row = torch.nn.functional.cross_entropy(
        capped, t, ignore_index=IGNORE, reduction="none",
        label_smoothing=options.get("label_smoothing", 0.0))
    row = row + (t != IGNORE) * options.get("z_loss", 0.0) * torch.logsumexp(capped, -1) ** 2
    loss = {"none": row.reshape(target.shape), "sum": row.sum(),
            "mean": row.sum() / max(int((t != IGNORE).sum()), 1)}[reduction]
    g, terms = logits_reference(logits, t, grad_output, reduction, **options)
    d_hidden = (g @ w).reshape(hidden.shape)
    return (loss, d_hidden, g.T @ h, (terms @ w.abs()).reshape(hidden.shape),
            terms.T @ h.abs())


def xent_call(hidden, weight, target, grad_output, **options):
    """xent's (loss, d_hidden, d_weight) for loss.backward(grad_output)."""
    import xent
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = xent.linear_cross_entropy(h, w, target, **options)
    loss.backward(grad_output)
    return loss.detach(), h.grad, w.grad


def check_close_loss(got, want, what="loss"):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    ranks.assert_close(got, want, 1e-5, what)


def check_exact(got, want, terms, dtype, what):
    """Within half an ulp of dtype from float64, past the float32 noise: rounded once."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, got.dtype)
    worst, raw = excess_ulps(got, want, terms, dtype)
    assert worst <= 0.5, f"{what}: {raw:.3f} ulps from the float64 gradient"


def check_all(got, want, dtype):
    loss, dh, dw = got
    check_close_loss(loss, want[0])
    check_exact(dh, want[1], want[3], dtype, "d_hidden")
    check_exact(dw, want[2], want[4], dtype, "d_weight")


# ------------------------------------------------------------------------------ one rank


@pytest.mark.parametrize("schedule", ["fast", "lean"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_float64(dtype, reduction, variant, grad_mode, schedule):
    """A grad_output that is not 1 (2.5, or per token): fused recomputes, deferred computes."""
    dt, options = DTYPES[dtype], VARIANTS[variant]
    hidden, weight, target = inputs(dt, seed=1)
    go = grad_output_for(reduction)
    got = xent_call(hidden, weight, target, go, reduction=reduction, grad_mode=grad_mode,
                    schedule=schedule, **options)
    check_all(got, reference(hidden, weight, target, go, reduction, **options), dt)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad_output_equal_to_grad_scale_keeps_forward_gradients(dtype, reduction):
    """grad_scale = 0.25 and grad_output 0.25 (every token's, for "none"): backward returns
    forward's gradients untouched (hidden and weight made NaN after forward cannot reach them),
    exact; one other grad_output anywhere recomputes (and so reads the NaN)."""
    import xent
    dt = DTYPES[dtype]
    hidden, weight, target = inputs(dt, seed=2)
    go = torch.full(target.shape if reduction == "none" else (), 0.25)
    want = reference(hidden, weight, target, go, reduction, label_smoothing=0.1)

    def run(grad_output):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = xent.linear_cross_entropy(h, w, target, reduction=reduction, grad_scale=0.25,
                                         label_smoothing=0.1)
        h.data.fill_(float("nan"))  # .data: the saved tensors' version is unchanged
        w.data.fill_(float("nan"))
        loss.backward(grad_output)
        return loss.detach(), h.grad, w.grad

    got = run(go)
    check_all(got, want, dt)
    other = go.clone()
    other.view(-1)[0] = 0.5
    _, dh, dw = run(other)
    assert dh.isnan().any() and dw.isnan().any(), "a grad_output other than grad_scale was kept"


@pytest.mark.parametrize("grad_output", ["one", "scaled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_equals_deferred(dtype, reduction, grad_output):
    """Forward's gradients (grad_output 1) and the recomputed ones are the same bits."""
    hidden, weight, target = inputs(DTYPES[dtype], seed=3)
    go = (torch.ones(target.shape if reduction == "none" else ()) if grad_output == "one"
          else grad_output_for(reduction))
    fused = xent_call(hidden, weight, target, go, reduction=reduction)
    deferred = xent_call(hidden, weight, target, go, reduction=reduction, grad_mode="deferred")
    for a, b in zip(fused, deferred):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunks", [dict(chunk_rows=1), dict(chunk_rows=5),
                                    dict(max_chunk_bytes=1 << 26)])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_chunks(grad_mode, chunks):
    """Chunks of 1 and 5 rows, and of a budget by its former name: the loss is the same bits, the
    gradients exact."""
    dt = torch.bfloat16
    hidden, weight, target = inputs(dt, seed=4)
    go = torch.tensor(2.5)
    whole = xent_call(hidden, weight, target, go, label_smoothing=0.1, grad_mode=grad_mode)
    got = xent_call(hidden, weight, target, go, label_smoothing=0.1, grad_mode=grad_mode,
                    **chunks)
    assert torch.equal(got[0], whole[0])
    check_all(got, reference(hidden, weight, target, go, "mean", label_smoothing=0.1), dt)


@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_lean_in_chunks_of_the_vocabulary(grad_mode):
    """A budget of three quarters of what lean takes in one chunk of the vocabulary: several
    chunks, within the budget, the plan saying so; the loss and gradients against float64."""
    import xent
    dt = torch.bfloat16
    hidden, weight, target = inputs(dt, seed=9)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    whole = xent.linear_cross_entropy_plan(h, w, target, schedule="lean", grad_mode=grad_mode)
    assert whole["schedule"] == "lean" and whole["chunks"] == 1, whole
    budget = whole["scratch_bytes"] * 3 // 4
    plan = xent.linear_cross_entropy_plan(h, w, target, schedule="lean", grad_mode=grad_mode,
                                          max_scratch_bytes=budget)
    assert plan["chunks"] > 1 and plan["chunk_cols"] < V, plan
    assert plan["budget"] == budget and plan["scratch_bytes"] <= budget, plan
    go = torch.tensor(2.5)
    got = xent_call(hidden, weight, target, go, label_smoothing=0.1, grad_mode=grad_mode,
                    schedule="lean", max_scratch_bytes=budget)
    check_all(got, reference(hidden, weight, target, go, "mean", label_smoothing=0.1), dt)


def test_plan_default_and_asked():
    """The default budget (at least 64 MiB) holds fast's one chunk at these sizes; asked-for
    schedules are taken; every plan stays within its budget."""
    import xent
    hidden, weight, target = inputs(torch.float32, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    default = xent.linear_cross_entropy_plan(h, w, target)
    assert default["schedule"] == "fast" and default["budget"] >= 64 << 20, default
    for schedule in ("fast", "lean"):
        p = xent.linear_cross_entropy_plan(h, w, target, schedule=schedule)
        assert p["schedule"] == schedule and p["scratch_bytes"] <= p["budget"], p
    assert set(default) == {"schedule", "budget", "scratch_bytes", "chunk_rows", "chunk_cols",
                            "chunks", "gemm"}
    # The CPU backend and f32 inputs: cuBLASLt's name, never the sm_90a engine.
    assert default["gemm"] == "cublaslt" and p["gemm"] == "cublaslt", (default, p)


@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_frozen_inputs_and_no_grad(grad_mode):
    import xent
    hidden, weight, target = inputs(torch.float32, seed=5)
    go = torch.tensor(2.5)
    want = reference(hidden, weight, target, go, "mean")
    h = hidden.clone().requires_grad_()
    (xent.linear_cross_entropy(h, weight, target, grad_mode=grad_mode) * 2.5).backward()
    check_exact(h.grad, want[1], want[3], torch.float32, "d_hidden, weight frozen")
    w = weight.clone().requires_grad_()
    (xent.linear_cross_entropy(hidden, w, target, grad_mode=grad_mode) * 2.5).backward()
    check_exact(w.grad, want[2], want[4], torch.float32, "d_weight, hidden frozen")
    with torch.no_grad():
        loss = xent.linear_cross_entropy(h, w, target, grad_mode=grad_mode)
    assert loss.grad_fn is None
    check_close_loss(loss, want[0])
    loss = xent.linear_cross_entropy(h, w, target, grad_mode="none")
    assert loss.grad_fn is None and not loss.requires_grad


def test_layouts():
    """Hidden transposed (copied once), hidden and weight with row strides (views of wider
    leaves, whose other columns get no gradient), 2-D hidden, int32 targets: the same bits as
    contiguous inputs."""
    import xent
    hidden, weight, target = inputs(torch.bfloat16, seed=6)
    go = per_token()
    want = xent_call(hidden, weight, target, go, reduction="none")

    h = hidden.transpose(0, 1).contiguous().transpose(0, 1)  # B-major rows (clone keeps them)
    loss, dh, dw = xent_call(h, weight, target, go, reduction="none")
    assert torch.equal(loss, want[0]) and torch.equal(dh, want[1]) and torch.equal(dw, want[2])

    wide_h = torch.cat([hidden, hidden], -1).requires_grad_()  # row stride 2H
    wide_w = torch.cat([weight, weight], -1).requires_grad_()
    loss = xent.linear_cross_entropy(wide_h[..., :H], wide_w[:, :H], target.int(),
                                     reduction="none")
    loss.backward(go)
    assert torch.equal(loss.detach(), want[0])
    for wide, part in ((wide_h, want[1]), (wide_w, want[2])):
        assert torch.equal(wide.grad[..., :H], part)
        assert not wide.grad[..., H:].any()

    loss, dh, dw = xent_call(hidden.reshape(-1, H), weight, target.reshape(-1), go.reshape(-1),
                             reduction="none")
    assert torch.equal(loss, want[0].reshape(-1)) and torch.equal(dh, want[1].reshape(-1, H))
    assert torch.equal(dw, want[2])


def test_padded_vocabulary():
    """vocab_size = 70 of the weight's 77 rows: rows past it are padding (logits -inf,
    d_weight 0), the loss that of the first 70."""
    hidden, weight, target = inputs(torch.float32, seed=7, vocab=70)
    padded = torch.cat([weight, torch.randn(7, H)])
    go = torch.tensor(2.5)
    loss, dh, dw = xent_call(hidden, padded, target, go, vocab_size=70, label_smoothing=0.1)
    want = reference(hidden, weight, target, go, "mean", label_smoothing=0.1)
    check_all((loss, dh, dw[:70]), want, torch.float32)
    assert torch.equal(dw[70:], torch.zeros(7, H))


def test_retain_graph_and_second_derivative():
    """A second backward recomputes (fused gave its forward gradients to the first); asking
    for the gradients' own gradient fails clearly."""
    import xent
    hidden, weight, target = inputs(torch.float32, seed=8)
    for mode in ("fused", "deferred"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = xent.linear_cross_entropy(h, w, target, grad_mode=mode)
        loss.backward(retain_graph=True)
        first = (h.grad.clone(), w.grad.clone())
        h.grad, w.grad = None, None
        loss.backward(torch.tensor(2.5))
        want = reference(hidden, weight, target, torch.tensor(2.5), "mean")
        check_exact(h.grad, want[1], want[3], torch.float32, f"{mode}: second d_hidden")
        check_exact(w.grad, want[2], want[4], torch.float32, f"{mode}: second d_weight")
        assert torch.equal(first[0], xent_call(hidden, weight, target, None)[1])
    h = hidden.clone().requires_grad_()
    loss = xent.linear_cross_entropy(h, weight, target)
    (dh,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once only"):
        dh.sum().backward()


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


def test_megatron_one_rank():
    """tp_group None: one rank, Megatron's [s, b, h] hidden and [s, b] labels."""
    import xent.megatron
    hidden, weight, target = inputs(torch.float32, seed=12)
    for reduction in ("mean", "none"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = xent.megatron.linear_cross_entropy(h, w, target, reduction=reduction)
        want = reference(hidden, weight, target, grad_output_for(reduction), reduction)
        assert loss.shape == (() if reduction == "mean" else (S * B,)), loss.shape
        loss.backward(grad_output_for(reduction).reshape(loss.shape))
        check_close_loss(loss.detach().reshape(want[0].shape), want[0])
        check_exact(h.grad, want[1], want[3], torch.float32, "d_hidden")
        check_exact(w.grad, want[2], want[4], torch.float32, "d_weight")


@pytest.mark.skipif(not ranks.has_megatron(), reason="megatron-core is not installed")
def test_megatron_patch_covers_the_linear_path_where_it_exists(tmp_path):
    """In fresh processes: megatron-core 0.16.1 has no fused_linear_cross_entropy, and patch()
    leaves that path alone (imports nothing of it); a megatron-core with it (a stand-in module)
    has it replaced by xent.megatron.linear_cross_entropy, and unpatch() puts Megatron's back."""
    script = textwrap.dedent("""
        import importlib.util, sys, types
        import xent.megatron as xm
        name = "megatron.core.fusions.fused_linear_cross_entropy"
        if sys.argv[1] == "with":
            module = types.ModuleType(name)
            def linear_cross_entropy(*args, **kwargs):
                raise AssertionError("Megatron's own")
            module.linear_cross_entropy = linear_cross_entropy
            sys.modules[name] = module
        else:
            assert importlib.util.find_spec(name) is None, "this megatron-core has it"
        xm.patch()
        if sys.argv[1] == "with":
            assert module.linear_cross_entropy.__wrapped__ is xm.linear_cross_entropy
            xm.unpatch()
            assert module.linear_cross_entropy is linear_cross_entropy
        else:
            assert name not in sys.modules
            import megatron.core.tensor_parallel as tp
            assert tp.vocab_parallel_cross_entropy.__wrapped__ is xm.vocab_parallel_cross_entropy
            xm.unpatch()
        print("ok")
    """)
    for how in ("without", "with"):
        r = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (how, r.stderr[-4000:])


# ----------------------------------------------------------------------------- several ranks


def _cases(world):
    cases = [f"loss-{'sp' if sp else 'tp'}-{reduction}-{mode}-{dtype}"
             for sp in (False, True) for reduction in ("mean", "none")
             for mode in ("fused", "deferred") for dtype in ("fp32", "bf16")]
    cases += ["bad-rows", "bad-label_smoothing"]
    if world == 2:
        cases += ["dtensor-plain_hidden", "dtensor-replicated_hidden", "dtensor-bad_placement"]
        cases += [f"megatron-{'sp' if sp else 'tp'}-{reduction}" for sp in (False, True)
                  for reduction in ("mean", "none")]
    return cases + ["done"]


two_ranks = ranks.fixture(__file__, "linear2", 2, DEADLINE_S)
three_ranks = ranks.fixture(__file__, "linear3", 3, DEADLINE_S)
# Two ranks also over NCCL, cuda:<rank> each, where there are 2 GPUs.
TWO_RANK_BACKENDS = ["gloo-2"] + (["nccl-2"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("backend", TWO_RANK_BACKENDS)
@pytest.mark.parametrize("case", _cases(2))
def test_two_ranks(case, backend, two_ranks):
    ranks.expect_case(*two_ranks(backend), case)


@pytest.mark.parametrize("case", _cases(3))
def test_three_ranks(case, three_ranks):
    ranks.expect_case(*three_ranks("gloo-3"), case)


class Rank(test_torch_dist.Rank):
    """One rank of the worker: every case against the float64 reference of the whole problem
    (every rank's rows with sequence parallelism, the whole vocabulary), made on the CPU; the
    inputs go to the rank's device (cuda:<rank> over NCCL). record() is test_torch_dist's."""

    def __init__(self, backend, rank, init, out_dir):  # not super().__init__: two ranks only
        import torch.distributed as dist
        kind, world = backend.split("-")  # "gloo-3", "nccl-2"
        self.dist, self.world, self.rank = dist, int(world), rank
        self.device = ranks.join_group(kind, rank, init, self.world)
        self.group = dist.group.WORLD
        self.lo = sum(WIDTHS[self.world][:rank])
        self.hi = self.lo + WIDTHS[self.world][rank]
        self.path = pathlib.Path(out_dir) / f"rank{rank}.json"
        self.results = {}

    def check_grad(self, got, want, terms, dtype, what):
        """check_exact; on CUDA with 16-bit inputs test_linear_cuda's bound, whose allowance
        adds 2^-8 of the terms' magnitude (the logits' gradient is rounded to 16 bits before the
        two GEMMs there, as the unfused path's)."""
        if self.device.type == "cuda" and dtype != torch.float32:
            from test_linear_cuda import excess
            worst = excess(got, want, terms, dtype)
            assert worst <= 0.5, f"{what}: {worst:.3f} ulps past test_linear_cuda's allowances"
        else:
            check_exact(got, want, terms, dtype, what)

    def problem(self, dtype, sp, reduction, seed, vocab=V):
        """The whole problem (every rank's rows with sp), this rank's rows of it, and a
        grad_output of the whole loss (the same on every rank)."""
        rows = (S * self.world if sp else S, B)
        hidden, weight, target = inputs(dtype, seed, rows, vocab)
        go = per_token(rows) if reduction == "none" else torch.tensor(2.5)
        own = slice(S * self.rank, S * (self.rank + 1)) if sp else slice(None)
        return hidden, weight, target, go, own

    def loss_case(self, name):
        import xent
        _, how, reduction, mode, dtype = name.split("-")
        sp, dt = how == "sp", DTYPES[dtype]
        hidden, weight, target, go, own = self.problem(dt, sp, reduction, seed=20)
        want = reference(hidden, weight, target, go, reduction, label_smoothing=0.1)
        h = hidden[own].to(self.device, copy=True).requires_grad_()
        w = weight[self.lo:self.hi].to(self.device, copy=True).requires_grad_()
        loss = xent.linear_cross_entropy(h, w, target[own].to(self.device), self.group,
                                         sequence_parallel=sp, reduction=reduction,
                                         grad_mode=mode, label_smoothing=0.1, chunk_rows=3)
        loss.backward((go[own] if reduction == "none" else go).to(self.device))
        check_close_loss(loss.detach(), want[0][own] if reduction == "none" else want[0])
        self.check_grad(h.grad, want[1][own], want[3][own], dt, "d_hidden")
        self.check_grad(w.grad, want[2][self.lo:self.hi], want[4][self.lo:self.hi], dt,
                        "d_weight")

    def bad_case(self, name):
        import xent
        hidden, weight, target, _, _ = self.problem(torch.float32, False, "mean", seed=21)
        hidden, target = hidden.to(self.device), target.to(self.device)
        w = weight[self.lo:self.hi].to(self.device)
        if name == "bad-rows":  # rank 1 has a row fewer: every rank raises
            rows = S - 1 if self.rank == 1 else S
            want = f"hidden.rows = {(S - 1) * B} on rank 1 but {S * B} on rank 0"
            call = lambda: xent.linear_cross_entropy(  # noqa: E731
                hidden[:rows], w, target[:rows], self.group)
        else:
            want = "label_smoothing = 1: must be in [0, 1)"
            call = lambda: xent.linear_cross_entropy(  # noqa: E731
                hidden, w, target, self.group, label_smoothing=1.0)
        try:
            call()
        except RuntimeError as e:
            assert want in str(e), str(e)
        else:
            raise AssertionError(f"no error; want {want!r}")
        # the group still works: a valid call (a collective) on every rank
        loss = xent.linear_cross_entropy(hidden, w, target, self.group)
        assert torch.isfinite(loss).item(), loss

    def dtensor_case(self, name):
        """An nn.Linear lm head made ColwiseParallel (its weight a DTensor sharded on dim 0,
        uneven: 39 and 38 rows): its weight goes straight in."""
        import xent
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        mesh = init_device_mesh(self.device.type, (self.world,))
        hidden, weight, target, go, _ = self.problem(torch.float32, False, "mean", seed=22)
        head = torch.nn.Linear(H, V, bias=False, device=self.device)
        with torch.no_grad():
            head.weight.copy_(weight)
        head = parallelize_module(head, mesh, ColwiseParallel())
        if name == "dtensor-bad_placement":
            w = distribute_tensor(weight.to(self.device), mesh, [Replicate()])
            with pytest.raises(RuntimeError, match=r"must be sharded on dim 0"):
                xent.linear_cross_entropy(hidden.to(self.device), w, target.to(self.device))
            return
        h = hidden.to(self.device, copy=True).requires_grad_()
        x = (DTensor.from_local(h, mesh, [Replicate()], run_check=False)
             if name == "dtensor-replicated_hidden" else h)
        loss = xent.linear_cross_entropy(x, head.weight, target.to(self.device),
                                         label_smoothing=0.1)
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), loss
        (loss * 2.5).backward()
        want = reference(hidden, weight, target, go, "mean", label_smoothing=0.1)
        check_close_loss(loss.full_tensor(), want[0])
        check_exact(h.grad, want[1], want[3], torch.float32, "d_hidden")
        check_exact(head.weight.grad.full_tensor(), want[2], want[4], torch.float32, "d_weight")

    def megatron_case(self, name):
        """Megatron's layout: equal shards, hidden [s, b, h] (this rank's s / tp with sequence
        parallelism), labels [s, b] every token's, the loss every token's on every rank."""
        import xent.megatron
        _, how, reduction = name.split("-")
        sp = how == "sp"
        vocab = 78  # equal shards of 39
        hidden, weight, target, go, own = self.problem(torch.bfloat16, sp, reduction, 23, vocab)
        width = vocab // self.world
        want = reference(hidden, weight, target, go, reduction)
        h = hidden[own].to(self.device, copy=True).requires_grad_()
        rows = slice(self.rank * width, (self.rank + 1) * width)
        w = weight[rows].to(self.device, copy=True).requires_grad_()
        loss = xent.megatron.linear_cross_entropy(h, w, target.to(self.device), self.group,
                                                  reduction, sequence_parallel=sp)
        assert loss.shape == (() if reduction == "mean" else (target.numel(),)), loss.shape
        loss.backward(go.reshape(loss.shape).to(self.device))
        check_close_loss(loss.detach().reshape(want[0].shape), want[0])
        self.check_grad(h.grad, want[1][own], want[3][own], torch.bfloat16, "d_hidden")
        self.check_grad(w.grad, want[2][rows], want[4][rows], torch.bfloat16, "d_weight")

    def run_all(self):
        for case in _cases(self.world):
            if case == "done":
                self.record(case, lambda: (self.dist.barrier(),
                                           self.dist.destroy_process_group()))
            else:
                run = getattr(self, case.split("-")[0] + "_case")
                self.record(case, lambda: run(case))


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    Rank(backend_, int(rank_), init_, out_dir_).run_all()
