"""xent.linear_cross_entropy, the fused lm head (hidden @ weight.T and the loss, the logits never
whole), through `import xent`, on the CPU backend, on one rank, against float64 F.cross_entropy
of hidden.double() @ weight.double().T (linear_reference.py).

Covered:
  * loss, d_hidden and d_weight for float32 and bfloat16 inputs, the three reductions,
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
  * xent.megatron.linear_cross_entropy with tp_group None (Megatron-LM main's signature and
    layout), and xent.megatron.patch() with and without Megatron's module.
torch.compile, opcheck and bad input: test_linear_compile_and_errors.py; two and three ranks:
test_linear_several_ranks.py; CUDA tensors: test_linear_cuda.py.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_linear_one_rank.py
"""

import subprocess
import sys
import textwrap

import pytest
import torch

import ranks
from linear_reference import (B, DTYPES, H, S, V, VARIANTS, check_close_loss, check_exact,
                              grad_output_for, inputs, per_token, reference, xent_call)


def check_all(got, want, dtype):
    loss, dh, dw = got
    check_close_loss(loss, want[0])
    check_exact(dh, want[1], want[3], dtype, "d_hidden")
    check_exact(dw, want[2], want[4], dtype, "d_weight")


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
