"""xent.transformers.patch() under Transformers' tensor parallelism (transformers 5.17.0,
from_pretrained(tp_plan="auto"): the lm head's weight a DTensor sharded on the vocabulary; it
needs accelerate), on two ranks over Gloo on the CPU, and over NCCL where there are two GPUs
(tests/python/ranks.py), every family of hf_models.py but GPT-2 (which has no tp_plan): xent's
vocab-parallel path, the same loss and gradients (each rank's shards) as unpatched, and with
keep_logits the gathered logits of tp_plan's own lm head. The one-process tests are
test_transformers_numerics.py's and test_transformers_patch.py's.

Without transformers the module is skipped (install: pip install transformers==5.17.0 and
accelerate).

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_transformers_tp.py
"""

import json
import os
import pathlib
import sys
import traceback

if __name__ == "__main__" and sys.argv[1:2] == ["gloo"]:
    # A Gloo rank runs on the CPU: Transformers' tp_plan would otherwise take cuda:<LOCAL_RANK>
    # where a GPU is visible (rank 1 found no cuda:1 on a one-GPU machine). Before torch's import.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ranks  # noqa: E402
import xent.transformers as xt  # noqa: E402
from hf_models import (FAMILIES, _has_accelerate, _unpatched,  # noqa: E402,F401 (a fixture)
                       assert_same, batch, build, patched_step, step)
from transformers import AutoModelForCausalLM  # noqa: E402

# GPT-2 has no tp_plan in transformers 5.17.0: from_pretrained(tp_plan="auto") leaves it whole
TP_FAMILIES = [f for f in FAMILIES if f != "gpt2"]
DEADLINE_S = 240


two_ranks = ranks.fixture(__file__, "transformers_tp", 2, DEADLINE_S)
# Gloo on the CPU everywhere; NCCL where two GPUs are visible (each rank's model on its own GPU,
# as from_pretrained(tp_plan="auto") places it from LOCAL_RANK)
TP_BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.skipif(not _has_accelerate(), reason="Transformers' tp_plan needs accelerate "
                    "(pip install accelerate)")
@pytest.mark.parametrize("case", [f"tp-{f}" for f in TP_FAMILIES] + ["done"])
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_tensor_parallel(backend, case, two_ranks):
    ranks.expect_case(*two_ranks(backend), case)


def tp_case(family, rank, tmp, device):
    """A tiny model saved by rank 0, loaded with tp_plan="auto" on both ranks: patched and not,
    the same loss and gradients (each rank's shard of the DTensor ones)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    path = pathlib.Path(tmp) / family
    if rank == 0:
        build(family).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), weight
    assert weight.device == device, (weight.device, device)
    ids, labels = (t.to(device) for t in batch())
    want = step(model, ids, labels)
    got = patched_step(model, ids, labels)
    assert got[0].logits is None and type(got[1]) is torch.Tensor
    xt.patch(keep_logits=True)  # the stand-in calls tp_plan's own lm head forward
    try:
        assert torch.equal(model(input_ids=ids, labels=labels).logits, want[0].logits)
    finally:
        xt.unpatch()

    def local(grads):
        return {n: g.to_local() if isinstance(g, DTensor) else g for n, g in grads.items()}
    assert_same((got[0], got[1], local(got[2])), (want[0], want[1], local(want[2])), family)


def _worker(backend, rank, init, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    results, path = {}, pathlib.Path(out_dir) / f"rank{rank}.json"

    def record(case, fn):
        try:
            fn()
            results[case] = {"ok": True}
        except BaseException:  # noqa: B902  (an assertion, a RuntimeError, anything)
            results[case] = {"ok": False, "error": traceback.format_exc()}
        path.write_text(json.dumps(results))  # as we go: a hang keeps what ran

    import torch.distributed as dist
    device = ranks.join_group(backend, rank, init, 2)
    for family in TP_FAMILIES:
        record(f"tp-{family}", lambda: tp_case(family, rank, out_dir, device))
    record("done", lambda: (dist.barrier(), dist.destroy_process_group()))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
