"""xent.linear_cross_entropy, the fused lm head, through `import xent`, on two and three ranks
over Gloo (tests/python/ranks.py), and two over NCCL where there are 2 GPUs (cuda:<rank>),
uneven shards, with and without sequence parallelism, against the float64 reference on the full
vocabulary (linear_reference.py); on two ranks the DTensor weight of ColwiseParallel on an
nn.Linear, xent.megatron.linear_cross_entropy (Megatron-LM main's signature and layout, with
and without sequence parallelism), and bad input raised on every rank alike.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_linear_several_ranks.py
"""

import pathlib
import sys

import pytest
import torch

import ranks
import test_torch_dist
from linear_reference import (B, DTYPES, H, S, V, check_close_loss, check_exact, inputs,
                              per_token, reference)

WIDTHS = {2: [40, 37], 3: [30, 25, 22]}  # uneven shards of V, in rank order
DEADLINE_S = 300


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
