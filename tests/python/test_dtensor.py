"""DTensor logits, as PyTorch's own tensor parallelism makes them (ColwiseParallel on the output
projection: a DTensor sharded on the vocabulary over a 1-D DeviceMesh), against PyTorch's
`with loss_parallel(): F.cross_entropy(...)` on the same DTensor, on two ranks with uneven shards
(11 columns: 6 and 5): the loss (a replicated DTensor) and the gradient shard that flows back into
the DTensor, and a column-parallel output projection whose weight gradient stays sharded. Gloo
on CPU always; NCCL on cuda:<rank> where there are 2 GPUs. Also the layouts xent
refuses (sharded on another dimension, a sharded target).

Run: XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
         python3 -m pytest -q tests/python/test_dtensor.py
"""

import json
import sys
import traceback

import pytest
import torch

import ranks

WORLD = 2
N, V = 12, 11
CASES = {  # name -> (leading shape, reduction, inplace_grad, label_smoothing, grad_scale)
    "2d-mean": ((N,), "mean", False, 0.0, 1.0),
    "2d-mean-smoothing": ((N,), "mean", False, 0.1, 1.0),
    "2d-sum": ((N,), "sum", False, 0.0, 1.0),
    "2d-none": ((N,), "none", False, 0.0, 1.0),
    "3d-mean": ((3, 4), "mean", False, 0.0, 1.0),
    "3d-none-smoothing": ((3, 4), "none", False, 0.1, 1.0),
    # the loss halved before backward, as xent is told: the gradient is halved, exactly
    "2d-mean-grad-scale": ((N,), "mean", False, 0.0, 0.5),
}
LAYER = ["colwise-projection"]
BAD = ["bad-shard-dim", "bad-target-sharded", "bad-inplace", "bad-grad-scale"]
BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


two_ranks = ranks.fixture(__file__, "dtensor", WORLD, 180)


@pytest.mark.parametrize("case", list(CASES) + LAYER + BAD)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtensor_matches_loss_parallel(backend, case, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, case)


# ================================================================================ the worker


def run_case(name, mesh, device):
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import xent

    lead, reduction, inplace, smoothing, grad_scale = CASES[name]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(*lead, V, generator=g, dtype=torch.float64).float().to(device)
    target = torch.randint(0, V, lead, generator=g).to(device)
    target.view(-1)[::5] = -100

    # The reference: PyTorch's loss_parallel (classes in dimension 1, so [rows, V]), where it
    # works: with label smoothing and ignored rows it fails (a Tensor/DTensor mix in its
    # masked_fill), so there float64 F.cross_entropy on the full logits.
    if smoothing == 0.0:
        ref_leaf = distribute_tensor(full.reshape(-1, V), mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            ref = F.cross_entropy(ref_leaf, target.reshape(-1), reduction=reduction)
            ref.backward(torch.ones_like(ref) if reduction == "none" else None)
        ref_loss, ref_grad = ref.full_tensor(), ref_leaf.grad.full_tensor()
    else:
        x = full.reshape(-1, V).double().requires_grad_()
        ref = F.cross_entropy(x, target.reshape(-1), reduction=reduction,
                              label_smoothing=smoothing)
        ref.backward(torch.ones_like(ref) if reduction == "none" else None)
        ref_loss, ref_grad = ref.detach().float(), x.grad.float()
    if reduction == "none":
        ref_loss = ref_loss.reshape(lead)

    leaf = distribute_tensor(full, mesh, [Shard(full.ndim - 1)]).requires_grad_()
    logits = leaf * 1.0 if inplace else leaf  # in place needs a non-leaf (a layer's output)
    loss = xent.vocab_parallel_cross_entropy(logits, target, reduction=reduction,
                                             label_smoothing=smoothing, inplace_grad=inplace,
                                             grad_scale=grad_scale)
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), loss
    torch.testing.assert_close(loss.full_tensor(), ref_loss, rtol=1e-5, atol=1e-6)
    (loss * grad_scale).backward(torch.ones_like(loss) if reduction == "none" else None)
    ref_grad = ref_grad * grad_scale
    # (With uneven shards PyTorch hands a leaf DTensor's gradient back replicated, whatever made
    # it: compare the values.)
    assert isinstance(leaf.grad, DTensor)
    torch.testing.assert_close(leaf.grad.full_tensor().reshape(-1, V), ref_grad,
                               rtol=1e-5, atol=1e-6)


def run_layer(name, mesh, device):
    """A column-parallel output projection (weight sharded on the vocabulary, as ColwiseParallel
    makes it): the weight's gradient stays sharded and equals loss_parallel's."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import xent

    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, 8, generator=g).to(device)
    w_full = torch.randn(V, 8, generator=g).to(device)
    target = torch.randint(0, V, (N,), generator=g).to(device)
    grads, losses = [], []
    for use_xent in (False, True):
        w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
        logits = F.linear(DTensor.from_local(h, mesh, [Replicate()], run_check=False), w)
        assert logits.placements == (Shard(1),), logits.placements
        if use_xent:
            loss = xent.vocab_parallel_cross_entropy(logits, target)
            loss.backward()
        else:  # (loss_parallel fails with label smoothing: a Tensor/DTensor mix)
            with loss_parallel():  # backward too must run inside it
                loss = F.cross_entropy(logits, target)
                loss.backward()
        assert w.grad.placements == (Shard(0),), w.grad.placements
        grads.append(w.grad.to_local())
        losses.append(loss.full_tensor())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def run_bad(name, mesh, device):
    from torch.distributed.tensor import Shard, distribute_tensor

    import xent

    full = torch.randn(4, V, device=device)
    target = torch.zeros(4, dtype=torch.long, device=device)
    inplace, grad_scale = False, 1.0
    if name == "bad-shard-dim":
        logits, want = distribute_tensor(full, mesh, [Shard(0)]), "sharded on the last"
    elif name == "bad-inplace":
        logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_() * 1.0
        want, inplace = "inplace_grad = true with DTensor logits", True
    elif name == "bad-grad-scale":  # the option reaches the operator through the DTensor path
        logits, want = distribute_tensor(full, mesh, [Shard(1)]), "grad_scale = -1"
        grad_scale = -1.0
    else:
        logits, want = distribute_tensor(full, mesh, [Shard(1)]), "must be replicated"
        target = distribute_tensor(target, mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match=want):
        xent.vocab_parallel_cross_entropy(logits, target, inplace_grad=inplace,
                                          grad_scale=grad_scale)


def worker(backend, rank, init, tmp):
    import pathlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=WORLD)
    mesh = init_device_mesh(device.type, (WORLD,))
    out = pathlib.Path(tmp) / f"rank{rank}.json"
    results = {}
    for name in list(CASES) + LAYER + BAD:
        try:
            run = run_case if name in CASES else run_layer if name in LAYER else run_bad
            run(name, mesh, device)
            results[name] = {"ok": True, "error": ""}
        except Exception:  # noqa: BLE001  (reported to the parent)
            results[name] = {"ok": False, "error": traceback.format_exc()}
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
