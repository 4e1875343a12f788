"""xent.linear_cross_entropy on CUDA tensors (the CUDA backend's fused lm head: cuBLASLt GEMMs in
chunks), through `import xent`, against float64 F.cross_entropy of hidden @ weight.T (the
reference of linear_reference.py). Skipped where there is no GPU.

What it asserts:
  * the loss within float32 rounding of float64 (the logits are fp32 GEMM outputs);
  * float32 inputs: every gradient element rounded once (half an ulp past float32 noise);
  * bfloat16 inputs: the gradient of the logits is rounded to bfloat16 before the two GEMMs that
    consume it (tensor-core GEMMs, as the unfused path's), so each d_hidden and d_weight element
    may carry 2^-8 of the magnitude of its terms on top of half an ulp of its own rounding;
  * fused and deferred, a scalar and a per-token grad_output, several chunks, softcap and z-loss,
    a padded vocabulary; the same loss as the CPU backend.
"""

import pytest
import torch

from linear_reference import H, IGNORE, VARIANTS, grad_output_for, inputs, reference, xent_call
from test_exact_grad import NOISE_F32_ULPS, ulp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def excess(got, want, magnitude, dtype):
    """Worst |got - want| in ulps of dtype past the allowances: float32 noise, and for 16-bit
    inputs the 2^-8 of the magnitude that the gradient's rounding to bfloat16 may add."""
    g, w = got.detach().cpu().double(), want.double()
    allowance = NOISE_F32_ULPS * 2.0 ** -23 + (0.0 if dtype == torch.float32 else 2.0 ** -8)
    return (((g - w).abs() - allowance * magnitude) / ulp(w, dtype)).max().item()


@pytest.mark.parametrize("chunk_rows", [0, 7])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("variant", ["plain", "zloss_softcap"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_float64(dtype, reduction, variant, grad_mode, chunk_rows):
    hidden, weight, target = inputs(DTYPES[dtype])
    go = grad_output_for(reduction)
    options = VARIANTS[variant]
    want = reference(hidden, weight, target, go, reduction, **options)
    loss, dh, dw = xent_call(hidden.cuda(), weight.cuda(), target.cuda(), go.cuda(),
                             reduction=reduction, grad_mode=grad_mode, chunk_rows=chunk_rows,
                             **options)
    assert loss.is_cuda and dh.is_cuda and dw.is_cuda
    torch.testing.assert_close(loss.cpu().double(), want[0], rtol=1e-5, atol=1e-6)
    assert dh.dtype == DTYPES[dtype] and dw.dtype == DTYPES[dtype]
    assert excess(dh, want[1], want[3], DTYPES[dtype]) <= 0.5, "d_hidden"
    assert excess(dw, want[2], want[4], DTYPES[dtype]) <= 0.5, "d_weight"


@pytest.mark.parametrize("chunk_rows", [0, 600])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_rows_past_one_sub_chunk(grad_mode, chunk_rows):
    """1100 rows of bfloat16: chunks of several of the CUDA backend's sub-chunks of fp32 logits
    (src/linear/plan.h: the fast schedule's sub-chunks of 512 rows; one chunk of every row, or
    chunks of 600), a per-token grad_output across their seams."""
    rows = (1100,)
    hidden, weight, target = inputs(torch.bfloat16, seed=6, rows=rows)
    go = torch.rand(rows, generator=torch.Generator().manual_seed(7)) + 0.5
    want = reference(hidden, weight, target, go, "none")
    loss, dh, dw = xent_call(hidden.cuda(), weight.cuda(), target.cuda(), go.cuda(),
                             reduction="none", grad_mode=grad_mode, chunk_rows=chunk_rows,
                             schedule="fast")
    torch.testing.assert_close(loss.cpu().double(), want[0], rtol=1e-5, atol=1e-6)
    assert excess(dh, want[1], want[3], torch.bfloat16) <= 0.5, "d_hidden"
    assert excess(dw, want[2], want[4], torch.bfloat16) <= 0.5, "d_weight"


@pytest.mark.parametrize("vocab", [5001, 40000])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_wide_rows(dtype, grad_mode, vocab):
    """Rows wide enough for the one-rank single pass over each sub-chunk's fp32 logits (more than
    2048 columns: a block's registers at 5001, rows in every alignment, a cluster of blocks at
    40000 on sm_90), under the default arguments and grad_output 1 (forward's gradients final),
    with padding columns past vocab_size; deferred takes two passes."""
    hidden, weight, target = inputs(DTYPES[dtype], seed=8, vocab=vocab)
    target.view(-1)[target.view(-1) >= vocab - 9] = 0
    want = reference(hidden, weight[: vocab - 9], target, torch.tensor(1.0), "mean")
    # (Sub-chunks of 7 rows, a 16-bit gradient row at element 7 k x 5001 of its buffer where a
    # pack of 4 cannot always be one store: tests/test_linear.cpp's WideRowsSinglePass.)
    loss, dh, dw = xent_call(hidden.cuda(), weight.cuda(), target.cuda(), None,
                             vocab_size=vocab - 9, grad_mode=grad_mode)
    torch.testing.assert_close(loss.cpu().double(), want[0], rtol=1e-5, atol=1e-6)
    assert excess(dh, want[1], want[3], DTYPES[dtype]) <= 0.5, "d_hidden"
    assert excess(dw[: vocab - 9], want[2], want[4], DTYPES[dtype]) <= 0.5, "d_weight"
    assert (dw[vocab - 9:] == 0).all(), "padding rows of d_weight"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_grad_output_equal_to_one_keeps_forward(dtype):
    """grad_output 1 (the default grad_scale): forward's gradients are final, and exact."""
    hidden, weight, target = inputs(DTYPES[dtype], seed=3)
    want = reference(hidden, weight, target, torch.tensor(1.0), "mean")
    loss, dh, dw = xent_call(hidden.cuda(), weight.cuda(), target.cuda(), None)
    torch.testing.assert_close(loss.cpu().double(), want[0], rtol=1e-5, atol=1e-6)
    assert excess(dh, want[1], want[3], DTYPES[dtype]) <= 0.5
    assert excess(dw, want[2], want[4], DTYPES[dtype]) <= 0.5


def test_padded_vocabulary_and_cpu_agree():
    """A weight with padding rows past vocab_size (never read: NaN there), on CUDA and on the CPU
    backend: the same loss within float32 rounding, padding rows of d_weight 0."""
    import xent
    hidden, weight, target = inputs(torch.float32, seed=4, vocab=80)
    target = target.clamp(max=76).masked_fill(target == IGNORE, IGNORE)
    weight[77:] = float("nan")
    out = {}
    for device in ("cpu", "cuda"):
        h = hidden.detach().clone().to(device).requires_grad_()
        w = weight.detach().clone().to(device).requires_grad_()
        loss = xent.linear_cross_entropy(h, w, target.to(device), vocab_size=77, chunk_rows=5)
        loss.backward()
        out[device] = (loss.detach().cpu(), w.grad.cpu())
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], rtol=2e-6, atol=0)
    assert torch.equal(out["cuda"][1][77:], torch.zeros(3, H))
    torch.testing.assert_close(out["cuda"][1][:77], out["cpu"][1][:77], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule", ["fast", "lean"])
def test_scratch_from_the_caching_allocator(schedule):
    """The call's scratch comes from PyTorch's caching allocator (max_memory_allocated sees it,
    at least the plan's scratch_bytes beyond the outputs), stays within the budget, and nothing
    of it is held after the call (memory_allocated back to its level with the outputs alone)."""
    import xent
    hidden, weight, target = inputs(torch.bfloat16, seed=11, rows=(2048,), vocab=6000)
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    t = target.cuda()
    plan = xent.linear_cross_entropy_plan(h, w, t, schedule=schedule)
    assert plan["schedule"] == schedule and plan["scratch_bytes"] <= plan["budget"], plan
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = xent.linear_cross_entropy(h, w, t, schedule=schedule)
    torch.cuda.synchronize()
    outputs = h.numel() * 2 + w.numel() * 2 + 2 * h.shape[0] * 4 + 64 * 1024  # grads, lse, loss
    peak = torch.cuda.max_memory_allocated() - before
    assert peak >= plan["scratch_bytes"], (peak, plan)
    assert peak <= plan["budget"] + outputs + (1 << 20), (peak, plan)
    assert torch.cuda.memory_allocated() - before <= outputs, "scratch held after the call"
    loss.backward()
