"""DTensor logits: PyTorch's own tensor parallelism (ColwiseParallel on the output projection,
as in TorchTitan) gives logits that are a DTensor sharded on the vocabulary over a 1-D
DeviceMesh. xent takes them as they are: the local shard and the mesh's process group go to the
operator, and the loss (the same on every rank) comes back as a replicated DTensor, the same
result as `with loss_parallel(): F.cross_entropy(logits, target)`. The gradient flows back into
the DTensor through to_local(), sharded as the logits are.

The fused lm head takes the weight of that projection instead (a DTensor sharded on dim 0):
LinearInputs.
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


def _mesh_group(tensor, what, group):
    """The 1-D DeviceMesh of DTensor `tensor` and its process group (`group`, if given, must be
    that one)."""
    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        raise RuntimeError(
            f"xent: {what} is a DTensor on a {mesh.ndim}-D DeviceMesh: xent needs the 1-D mesh "
            f"of the tensor-parallel dimension (e.g. mesh['tp'])")
    mesh_group = mesh.get_group()
    if group is not None and group != mesh_group:
        raise RuntimeError(
            f"xent: group is given, and it is not the group of the DeviceMesh of the DTensor "
            f"{what}: leave group=None (the mesh says it)")
    return mesh, mesh_group


def _replicated_local(x, what):
    """A plain tensor as it is; a DTensor's local tensor, if it is replicated."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(x, DTensor):
        return x
    if not all(isinstance(p, Replicate) for p in x.placements):
        raise RuntimeError(
            f"xent: {what} is a DTensor placed {x.placements}: it must be replicated "
            f"(every rank holds all of it)")
    return x.to_local()


def unwrap(logits, target, group, inplace_grad):
    """(local logits, local target, the mesh's group, the mesh), after checking the layout."""
    from torch.distributed.tensor import Shard
    if inplace_grad:
        # to_local() gives a view made inside an autograd Function, which autograd forbids
        # writing in place; the gradient goes into a new tensor instead.
        raise RuntimeError(
            "xent: inplace_grad = true with DTensor logits: autograd forbids writing over the "
            "local shard of a DTensor (a view made by to_local()); use inplace_grad = false")
    mesh, mesh_group = _mesh_group(logits, "logits", group)
    (place,) = logits.placements
    if not (isinstance(place, Shard) and place.dim in (-1, logits.ndim - 1)):
        raise RuntimeError(
            f"xent: logits are a DTensor placed {place}: they must be sharded on the last "
            f"(vocabulary) dimension, Shard({logits.ndim - 1})")
    return logits.to_local(), _replicated_local(target, "target"), mesh_group, mesh


class LinearInputs:
    """The fused lm head's local inputs of a DTensor weight, and the layout its shard has."""

    def __init__(self, hidden, weight, target, group, sequence_parallel, vocab_start,
                 vocab_size):
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        if not isinstance(weight, DTensor):
            raise RuntimeError(
                "xent: hidden is a DTensor but weight is not: pass the lm head's weight as the "
                "DTensor ColwiseParallel makes (sharded on dim 0), or plain tensors and a group")
        self.mesh, self.group = _mesh_group(weight, "weight", group)
        (place,) = weight.placements
        if not (isinstance(place, Shard) and place.dim in (0, -2)):
            raise RuntimeError(
                f"xent: weight is a DTensor placed {place}: it must be sharded on dim 0 (the "
                f"vocabulary: Shard(0), as ColwiseParallel makes an nn.Linear's weight)")
        if sequence_parallel and isinstance(hidden, DTensor):
            raise RuntimeError(
                "xent: hidden is a DTensor with sequence_parallel = true: pass this rank's own "
                "rows as a plain tensor")
        _, offset = compute_local_shape_and_global_offset(weight.shape, self.mesh,
                                                          weight.placements)
        if vocab_start not in (-1, offset[0]):
            raise RuntimeError(
                f"xent: vocab_start = {vocab_start} with a DTensor weight whose shard starts at "
                f"row {offset[0]}: leave vocab_start = -1 (the shard layout says it)")
        self.vocab_start = offset[0]
        self.vocab_size = weight.shape[0] if vocab_size == -1 else vocab_size
        self.hidden = _replicated_local(hidden, "hidden")
        self.weight = weight.to_local()
        self.target = _replicated_local(target, "target")

    def wrap(self, loss, own_rows):
        """The loss as a DTensor: this rank's rows of it (sequence parallelism, reduction
        "none") sharded on dim 0, else replicated (the same on every rank)."""
        from torch.distributed.tensor import DTensor, Shard
        if own_rows:
            return DTensor.from_local(loss, self.mesh, [Shard(0)], run_check=False)
        return replicated(loss, self.mesh)


def replicated(t, mesh):
    """A per-rank result that every rank holds alike, as a replicated DTensor."""
    from torch.distributed.tensor import DTensor, Replicate
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
