"""xent's PyTorch operator on two ranks: each holds an uneven shard of the vocabulary (67 columns:
34 and 33) of the same full logits, calls xent with group=dist.group.WORLD, and checks its loss and
gradient shard against float64 F.cross_entropy on the full logits.

Covered, on Gloo with CPU tensors always, and on NCCL with cuda:<rank> where there are 2 GPUs:
  * 3-D logits [S, B, V/2], reduction none and mean, label smoothing 0.1 (exact across shards),
    ignored rows, grad_mode fused and deferred, the gradient in place or into a new tensor;
    float32, and bfloat16 for some;
  * torch.compile(fullgraph=True) of a training step (logits = x @ w_shard.T) against eager;
  * a bad input (label_smoothing=1.0) raises RuntimeError on every rank, and the group still
    works afterwards (no rank hangs).

How: a module-scoped fixture starts the two ranks as subprocesses running this file (the worker at
the bottom), which meet through a file:// store in a temporary directory and write one JSON file
per rank with every case's outcome (a traceback on failure) as they go; the ranks get a deadline
and are killed past it. Each test asserts on one case's outcome on both ranks, with the child's
message (and its stderr, if it died or hung) in the failure.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \
        python3 -m pytest -q tests/python/test_torch_dist.py
"""

import json
import pathlib
import sys
import traceback

import pytest
import torch

import ranks

WORLD = 2
S, B, V, H = 4, 6, 67, 16  # logits [S, B, V], hidden size H of the compiled step
WIDTHS = [34, 33]  # every rank's vocabulary columns, in rank order
IGNORE = -100
SMOOTHING = 0.1
DEADLINE_S = 240  # both ranks, all cases (the first torch.compile is the slow part)

# name -> (reduction, grad_mode, inplace_grad, dtype)
LOSS_CASES = {
    f"loss-{reduction}-{grad_mode}-{'inplace' if inplace else 'new_grad'}-{dtype}":
        (reduction, grad_mode, inplace, dtype)
    for dtype in ("fp32",)
    for reduction in ("none", "mean")
    for grad_mode in ("fused", "deferred")
    for inplace in (False, True)
}
LOSS_CASES.update({
    f"loss-{reduction}-fused-inplace-bf16": (reduction, "fused", True, "bf16")
    for reduction in ("none", "mean")
})
# name -> (grad_mode, inplace_grad, backward_in_graph)
COMPILE_CASES = {
    f"compile-{grad_mode}-{'inplace' if inplace else 'new_grad'}-"
    f"{'backward_in_graph' if in_graph else 'backward_outside'}": (grad_mode, inplace, in_graph)
    for grad_mode in ("fused", "deferred")
    for inplace in (False, True)
    for in_graph in (True, False)
}
BAD_CASES = ["bad-label_smoothing_1"]
CASES = list(LOSS_CASES) + list(COMPILE_CASES) + BAD_CASES

BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


def shard_bounds(rank):
    lo = sum(WIDTHS[:rank])
    return lo, lo + WIDTHS[rank]


# =============================================================================== the parent


two_ranks = ranks.fixture(__file__, "xent", WORLD, DEADLINE_S)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks(backend, case, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_exit_cleanly(backend, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, "done")


# =============================================================================== the ranks


def _grad_rtol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


def _random(shape, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _target(shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[3::5] = IGNORE
    return t


class Rank:
    def __init__(self, backend, rank, init, out_dir):
        import torch.distributed as dist
        self.dist = dist
        self.rank = rank
        self.lo, self.hi = shard_bounds(rank)
        self.device = ranks.join_group(backend, rank, init, WORLD)
        self.group = dist.group.WORLD
        self.path = pathlib.Path(out_dir) / f"rank{rank}.json"
        self.results = {}

    def record(self, case, fn):
        try:
            fn()
            self.results[case] = {"ok": True}
        except BaseException:  # noqa: B902  (an assertion, a RuntimeError, anything)
            self.results[case] = {"ok": False, "error": traceback.format_exc()}
        self.path.write_text(json.dumps(self.results))  # as we go: a hang keeps what ran

    def loss_case(self, reduction, grad_mode, inplace, dtype_name):
        import xent
        import torch.nn.functional as F
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        full = _random((S, B, V), seed=0).to(dtype)  # the same on every rank
        target = _target((S, B), seed=1)
        weight = (torch.rand((S, B), generator=torch.Generator().manual_seed(2)) + 0.5
                  if reduction == "none" else torch.tensor(1.0))

        x = full.double().requires_grad_()
        want = F.cross_entropy(x.view(-1, V), target.view(-1), ignore_index=IGNORE,
                               label_smoothing=SMOOTHING, reduction=reduction)
        want = want.view(S, B) if reduction == "none" else want
        want.backward(weight.double())
        want_grad = x.grad[..., self.lo:self.hi]

        shard = full[..., self.lo:self.hi].contiguous().to(self.device).requires_grad_()
        before, version = shard.detach().clone(), shard._version
        logits = shard * 1.0 if inplace else shard  # in place: not a leaf
        loss = xent.vocab_parallel_cross_entropy(
            logits, target.to(self.device), self.group, reduction=reduction,
            label_smoothing=SMOOTHING, grad_mode=grad_mode, inplace_grad=inplace)
        assert loss.shape == want.shape, (tuple(loss.shape), tuple(want.shape))
        ranks.assert_close(loss, want.detach(), 1e-5, "loss")
        loss.backward(weight.to(self.device))
        ranks.assert_close(shard.grad, want_grad, _grad_rtol(dtype), "gradient shard")
        assert shard._version == version and torch.equal(shard.detach(), before), (
            "the leaf logits shard was written")

    def compile_case(self, grad_mode, inplace, backward_in_graph):
        import xent
        import torch.nn.functional as F
        from torch._dynamo.utils import counters
        group = self.group

        def step(x, w, t):
            logits = x @ w.t()  # [S * B, this rank's columns]
            loss = xent.vocab_parallel_cross_entropy(
                logits.view(S, B, -1), t.view(S, B), group, label_smoothing=SMOOTHING,
                grad_mode=grad_mode, inplace_grad=inplace)
            if backward_in_graph:
                loss.backward()
                return loss.detach()
            return loss

        x0 = _random((S * B, H), seed=3, scale=1.0).float()
        w_full = _random((V, H), seed=4, scale=H ** -0.5).float()
        target = _target((S * B,), seed=5)

        def run(fn):
            x = x0.clone().to(self.device).requires_grad_()
            w = w_full[self.lo:self.hi].clone().to(self.device).requires_grad_()
            loss = fn(x, w, target.to(self.device))
            if not backward_in_graph:
                loss.backward()
            return loss.detach().clone(), x.grad, w.grad

        eager = run(step)
        # eager against float64 on the full vocabulary (x's gradient is a partial sum here)
        xd, wd = x0.double(), w_full.double().requires_grad_()
        want = F.cross_entropy(xd @ wd.t(), target, ignore_index=IGNORE,
                               label_smoothing=SMOOTHING)
        want.backward()
        ranks.assert_close(eager[0], want.detach(), 1e-5, "eager loss vs float64")
        ranks.assert_close(eager[2], wd.grad[self.lo:self.hi], 1e-5, "eager dw vs float64")

        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            got = run(torch.compile(step, fullgraph=True))
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        torch._dynamo.reset()
        for g, e, what in zip(got, eager, ("loss", "dx", "dw")):
            ranks.assert_close(g, e, 1e-5, f"compiled {what} vs eager")

    def bad_case(self):
        import xent
        x = _random((S, B, V), seed=0).float()[..., self.lo:self.hi].contiguous()
        x = x.to(self.device).requires_grad_()
        t = _target((S, B), seed=1).to(self.device)
        try:
            xent.vocab_parallel_cross_entropy(x, t, self.group, label_smoothing=1.0)
        except RuntimeError as e:
            assert "label_smoothing = 1" in str(e) and "[0, 1)" in str(e), str(e)
        else:
            raise AssertionError("label_smoothing = 1.0 raised no error")
        # the group still works: a valid call (a collective) on every rank
        loss = xent.vocab_parallel_cross_entropy(x, t, self.group, label_smoothing=SMOOTHING)
        assert torch.isfinite(loss).item(), loss

    def run_all(self):
        for case, args in LOSS_CASES.items():
            self.record(case, lambda: self.loss_case(*args))
        for case in BAD_CASES:
            self.record(case, self.bad_case)
        for case, args in COMPILE_CASES.items():
            self.record(case, lambda: self.compile_case(*args))
        self.record("done", lambda: (self.dist.barrier(), self.dist.destroy_process_group()))


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    Rank(backend_, int(rank_), init_, out_dir_).run_all()
