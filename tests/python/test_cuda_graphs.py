"""xent.linear_cross_entropy captured into CUDA graphs, forward and backward, the way training
loops capture a step: warm-up on a side stream, then `torch.cuda.graph`, then replays with new
inputs copied into the captured tensors; and `torch.compile(mode="reduce-overhead")`. Each replay
is checked against float64 (linear_reference.reference), with a grad_output that changes between
replays: equal to grad_scale (where an uncaptured fused backward keeps forward's gradients), a
scalar, and one per token. Every schedule and grad mode; over two GPUs (NCCL), with and without
sequence parallelism, where there are two. Skipped where there is no GPU.

    python3 -m pytest -q tests/python/test_cuda_graphs.py
"""
import json
import sys
import traceback

import pytest
import torch

import ranks
from linear_reference import inputs, per_token, reference
from test_linear_cuda import excess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

ROWS, VOCAB = (12, 50), 3001  # 600 rows: more than one of the fast schedule's sub-chunks
WORLD = 2
DEADLINE_S = 300
TWO_RANK_CASES = ["tp2", "tp2_sp"]


def grad_outputs(reduction):
    """One per replay: 1 (the default grad_scale), then others."""
    if reduction == "none":
        return [torch.ones(ROWS), per_token(ROWS, seed=5), per_token(ROWS, seed=6)]
    return [torch.tensor(1.0), torch.tensor(2.5), torch.tensor(0.75)]


def check(loss, dh, dw, want, what):
    ranks.assert_close(loss, want[0], 1e-5, f"{what}: loss")
    assert excess(dh, want[1], want[3], torch.bfloat16) <= 0.5, f"{what}: d_hidden"
    assert excess(dw, want[2], want[4], torch.bfloat16) <= 0.5, f"{what}: d_weight"


class Captured:
    """One step, forward and backward, captured once on static tensors."""

    def __init__(self, device, call, hidden, weight, target, grad_output):
        self.h = hidden.to(device).requires_grad_()
        self.w = weight.to(device).requires_grad_()
        self.t = target.to(device)
        self.go = grad_output.to(device)
        self.call = call
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
                self.h.grad = self.w.grad = None
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self.step()

    def step(self):
        loss = self.call(self.h, self.w, self.t)
        loss.backward(self.go)
        return loss.detach()

    def replay(self, hidden, weight, target, grad_output):
        with torch.no_grad():
            for static, new in ((self.h, hidden), (self.w, weight), (self.t, target),
                                (self.go, grad_output)):
                static.copy_(new)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.loss, self.h.grad, self.w.grad


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
@pytest.mark.parametrize("schedule", ["lean", "fast"])
def test_graph_replays(schedule, grad_mode, reduction):
    import xent

    def call(h, w, t):
        return xent.linear_cross_entropy(h, w, t, reduction=reduction, grad_mode=grad_mode,
                                         schedule=schedule)

    gos = grad_outputs(reduction)
    g = Captured("cuda", call, *inputs(torch.bfloat16, seed=20, rows=ROWS, vocab=VOCAB), gos[0])
    for i, go in enumerate(gos):
        hidden, weight, target = inputs(torch.bfloat16, seed=21 + i, rows=ROWS, vocab=VOCAB)
        got = g.replay(hidden, weight, target, go)
        check(*got, reference(hidden, weight, target, go, reduction), f"replay {i}")


@pytest.mark.parametrize("grad_mode", ["fused", "deferred"])
def test_compile_reduce_overhead(grad_mode):
    """torch.compile's CUDA graphs (cudagraph trees): forward and backward graphs replayed, none
    skipped."""
    import xent
    from torch._dynamo.utils import counters

    @torch.compile(mode="reduce-overhead")
    def step(h, w, t):
        return xent.linear_cross_entropy(h, w, t, label_smoothing=0.1, grad_mode=grad_mode)

    torch._dynamo.reset()
    counters.clear()
    try:
        for i, scale in enumerate([1.0, 2.5, 1.0, 0.5]):
            hidden, weight, target = inputs(torch.bfloat16, seed=30 + i, rows=ROWS, vocab=VOCAB)
            h = hidden.cuda().requires_grad_()
            w = weight.cuda().requires_grad_()
            loss = step(h, w, target.cuda())
            (loss * scale).backward()
            want = reference(hidden, weight, target, torch.tensor(scale), "mean",
                             label_smoothing=0.1)
            check(loss.detach().clone(), h.grad, w.grad, want, f"step {i}")
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    finally:
        torch._dynamo.reset()


two_ranks = ranks.fixture(__file__, "cuda_graphs", WORLD, DEADLINE_S)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two GPUs")
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks(case, two_ranks):
    ranks.expect_case(*two_ranks("nccl"), case)


# ================================================================================ the ranks


def two_rank_case(rank, group, device, sequence_parallel):
    """Each rank's shard of the vocabulary (uneven), the whole step captured on every rank;
    with sequence parallelism each rank's half of the rows."""
    import xent
    cut = VOCAB // 2 + 1
    cols = slice(0, cut) if rank == 0 else slice(cut, VOCAB)
    half = ROWS[0] // WORLD
    rows = slice(rank * half, (rank + 1) * half) if sequence_parallel else slice(None)

    def mine(hidden, weight, target, go):
        return (hidden[rows], weight[cols], target[rows], go[rows] if go.dim() else go)

    def call(h, w, t):
        return xent.linear_cross_entropy(h, w, t, group, sequence_parallel=sequence_parallel,
                                         reduction="none")

    gos = grad_outputs("none")
    g = Captured(device, call, *mine(*inputs(torch.bfloat16, seed=40, rows=ROWS, vocab=VOCAB),
                                     gos[0]))
    for i, go in enumerate(gos):
        hidden, weight, target = inputs(torch.bfloat16, seed=41 + i, rows=ROWS, vocab=VOCAB)
        loss, dh, dw = g.replay(*mine(hidden, weight, target, go))
        want = reference(hidden, weight, target, go, "none")
        want = (want[0][rows], want[1][rows], want[2][cols], want[3][rows], want[4][cols])
        check(loss, dh, dw, want, f"rank {rank}, replay {i}")


def run_ranks(backend, rank, init, out_dir):
    device = ranks.join_group(backend, rank, init, WORLD)
    import torch.distributed as dist
    group = dist.group.WORLD
    results = {}
    for case in TWO_RANK_CASES:
        try:
            two_rank_case(rank, group, device, case == "tp2_sp")
            results[case] = {"ok": True, "error": ""}
        except Exception:
            results[case] = {"ok": False, "error": traceback.format_exc()}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    run_ranks(backend_, int(rank_), init_, out_dir_)
