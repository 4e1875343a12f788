"""The two tensor-parallel ranks of the Megatron tests, test_megatron_functions.py and
test_megatron_patch.py, against Megatron-core itself (the real package: megatron-core 0.16.1
under the default python3, 0.19.2 under Python 3.12 through launch/megatron_env.sh; what differs
between the two is checked version by version): Megatron's parallel state is initialised with
tensor_model_parallel_size=2, each rank holds half the vocabulary (64 columns: [0, 32) and
[32, 64), Megatron's partition) of the same full logits [S, B, V], and every case compares
xent's loss and gradient shard with what Megatron's own function gives on the same shard. Gloo
with CPU tensors always, and NCCL with cuda:<rank> where there are 2 GPUs.

How: as tests/python/test_torch_dist.py, through ranks.py: the two ranks are subprocesses running
this file (the worker at the bottom: the set-up here, the cases of both test files) and write one
JSON file each with every case's outcome. They run once per backend for both files (two_ranks).
"""

import importlib.metadata
import inspect
import pathlib
import sys

import pytest
import torch

import ranks
import test_torch_dist

WORLD = 2
S, B, V = 4, 3, 64
WIDTH = V // WORLD  # Megatron's partition: rank r owns [r * WIDTH, (r + 1) * WIDTH)
SMOOTHING = 0.1
DEADLINE_S = 420  # both ranks, all cases: importing Megatron and torch.compile of its fused path

UNFUSED_CASES = {f"unfused-{dtype}-{how}": (dtype, how)
                 for dtype in ("fp32", "bf16")
                 for how in ("tp_group", "tp_group_keyword", "default_group")}
FUSED_CASES = {f"fused-{dtype}": dtype for dtype in ("fp32", "bf16")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


needs_megatron = ranks.needs_megatron("function")

# every case of both test files, the ranks of each backend launched once (ranks.fixture keeps
# the runs with the fixture, which both files import)
two_ranks = ranks.fixture(__file__, "megatron", WORLD, DEADLINE_S)


def two_ranks_test(cases):
    """A test file's test_two_ranks: each of `cases` (its part of the worker's) on each backend."""
    @needs_megatron
    @pytest.mark.parametrize("case", cases)
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_two_ranks(backend, case, two_ranks):
        results, reports = two_ranks(backend)
        ranks.expect_case(results, reports, case)
    return test_two_ranks


class RankSetUp:
    """A rank's set-up and its problem; the cases are FunctionCases' (test_megatron_functions.py)
    and PatchCases' (test_megatron_patch.py)."""

    def __init__(self, backend, rank, init, out_dir):
        import warnings

        import torch.distributed as dist
        # Megatron warns, on import, that TransformerEngine and Apex are missing: noise here.
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core import parallel_state, tensor_parallel

        self.dist = dist
        self.parallel_state = parallel_state
        self.rank = rank
        self.lo, self.hi = rank * WIDTH, (rank + 1) * WIDTH
        self.device = ranks.join_group(backend, rank, init, WORLD)
        # Megatron's own set-up; its groups get the default backend (Gloo on CPU works).
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        assert parallel_state.get_tensor_model_parallel_rank() == rank
        # megatron-core 0.17 and later: vocab_parallel_cross_entropy(..., tp_group=None), whose
        # rank is the group's; 0.16.1: no tp_group, the rank is Megatron's (overridable)
        self.megatron_version = tuple(
            int(p) for p in importlib.metadata.version("megatron-core").split(".")[:2])
        self.takes_tp_group = "tp_group" in inspect.signature(
            tensor_parallel.vocab_parallel_cross_entropy).parameters
        assert self.takes_tp_group == (self.megatron_version >= (0, 17)), (
            self.megatron_version, self.takes_tp_group)
        # another group of the same ranks, made now (a collective) on every rank alike
        self.other_group = dist.new_group(list(range(WORLD)))
        self.path = pathlib.Path(out_dir) / f"rank{rank}.json"
        self.results = {}

        # The same full logits, targets and loss weights on every rank.
        g = torch.Generator().manual_seed(0)
        self.full = torch.randn((S, B, V), generator=g, dtype=torch.float64) * 2.0
        self.target = torch.randint(0, V, (S, B), generator=g)
        # grad_output as Megatron makes it: loss mask times 1 / tokens, never 1
        self.weight = (torch.rand((S, B), generator=g) + 0.5) / (S * B)

    record = test_torch_dist.Rank.record  # case -> self.results, written to self.path as it goes

    def shard(self, dtype):
        """This rank's logits shard, a leaf that requires grad."""
        x = self.full[..., self.lo:self.hi].to(dtype).contiguous()
        return x.to(self.device).requires_grad_()

    def run_loss(self, fn, dtype, *args):
        """(loss, gradient of this rank's shard for grad_output = weight) of fn(logits, ...).
        The logits given to fn are a copy (Megatron's function overwrites float32 logits)."""
        x = self.shard(dtype)
        loss = fn(x * 1, self.target.to(self.device), *args)
        loss.backward(self.weight.to(self.device))
        return loss.detach(), x.grad

    def run_all(self):
        """Every case of both test files, then the clean exit ("done")."""
        for case, args in UNFUSED_CASES.items():
            self.record(case, lambda: self.unfused_case(*args))
        for case, dtype_name in FUSED_CASES.items():
            self.record(case, lambda: self.fused_case(dtype_name))
        self.record("signature", self.signature_case)
        self.record("smoothing", self.smoothing_case)
        self.record("patch", self.patch_case)
        self.record("errors", self.errors_case)
        self.record("rank_override", self.rank_override_case)

        def finish():
            self.dist.barrier()
            self.parallel_state.destroy_model_parallel()
            self.dist.destroy_process_group()
        self.record("done", finish)


if __name__ == "__main__":
    from test_megatron_functions import FunctionCases
    from test_megatron_patch import PatchCases

    class Rank(FunctionCases, PatchCases, RankSetUp):
        pass
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    Rank(backend_, int(rank_), init_, out_dir_).run_all()
