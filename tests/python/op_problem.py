"""The problem the test_torch_op_*.py files (and test_direct.py) share: the sizes, random logits
and targets (every fifth row ignored), grad_output for each reduction, the internal operators'
common arguments and the float64 tolerance check."""

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N, V = 24, 67  # rows, vocabulary
S, B = 4, 6  # [seq, batch] with S * B == N
IGNORE = -100
OP_ARGS = ("", IGNORE, 0.1, 1e-3, 0.0)  # group_name, ignore_index, smoothing, z_loss, softcap


def assert_close(got, want, rtol, what):
    """max |got - want| <= rtol * max |want|, in float64; a NaN fails."""
    assert got is not None, f"{what}: None"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    if w.numel() == 0:
        return
    scale = max(w.abs().max().item(), 1e-30)
    err = (g - w).abs().max().item()
    assert err <= rtol * scale, (
        f"{what}: max |error| {err:.3e} > {rtol:g} * {scale:.3e} (got {g.flatten()[:6].tolist()}, "
        f"want {w.flatten()[:6].tolist()} ...)")


def random_logits(shape, dtype=torch.float32, device="cpu", seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def random_target(shape, device="cpu", seed=1, ignore_index=IGNORE):
    """Class ids in [0, V), every fifth row (from the fourth) ignore_index."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[3::5] = ignore_index
    return t.to(device)


def grad_output_for(reduction, shape, device):
    """d total / d loss: 1 for mean (the fused path's no-rescale case), 0.75 for sum, random
    per-row weights for none."""
    if reduction == "none":
        g = torch.Generator().manual_seed(7)
        return (torch.rand(shape, generator=g) + 0.5).to(device)
    return torch.tensor(1.0 if reduction == "mean" else 0.75, device=device)
