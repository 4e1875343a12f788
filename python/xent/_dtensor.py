"""DTensor logits: PyTorch's own tensor parallelism (ColwiseParallel on the output projection,
as in TorchTitan) gives logits that are a DTensor sharded on the vocabulary over a 1-D
DeviceMesh. xent takes them as they are: the local shard and the mesh's process group go to the
operator, and the loss (the same on every rank) comes back as a replicated DTensor, the same
result as `with loss_parallel(): F.cross_entropy(logits, target)`. The gradient flows back into
the DTensor through to_local(), sharded as the logits are.
"""


import torch


def is_dtensor(x):
    if type(x) is torch.Tensor:  # the common case, decided without an import on every call
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return False
    return isinstance(x, DTensor)


def unwrap(logits, target, group, inplace_grad):
    """(local logits, local target, the mesh's group, the mesh), after checking the layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if inplace_grad:
        # to_local() gives a view made inside an autograd Function, which autograd forbids
        # writing in place; the gradient goes into a new tensor instead.
        raise RuntimeError(
            "xent: inplace_grad = true with DTensor logits: autograd forbids writing over the "
            "local shard of a DTensor (a view made by to_local()); use inplace_grad = false")
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise RuntimeError(
            f"xent: logits are a DTensor on a {mesh.ndim}-D DeviceMesh: xent needs the 1-D mesh "
            f"of the tensor-parallel dimension (e.g. mesh['tp'])")
    (place,) = logits.placements
    if not (isinstance(place, Shard) and place.dim in (-1, logits.ndim - 1)):
        raise RuntimeError(
            f"xent: logits are a DTensor placed {place}: they must be sharded on the last "
            f"(vocabulary) dimension, Shard({logits.ndim - 1})")
    mesh_group = mesh.get_group()
    if group is not None and group != mesh_group:
        raise RuntimeError(
            "xent: group is given with DTensor logits, and it is not their DeviceMesh's group: "
            "leave group=None (the mesh says it)")
    if isinstance(target, DTensor):
        if not all(isinstance(p, Replicate) for p in target.placements):
            raise RuntimeError(
                f"xent: target is a DTensor placed {target.placements}: it must be replicated "
                f"(every rank holds every target)")
        target = target.to_local()
    return logits.to_local(), target, mesh_group, mesh


def replicated(t, mesh):
    """A per-rank result that every rank holds alike, as a replicated DTensor."""
    from torch.distributed.tensor import DTensor, Replicate
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
