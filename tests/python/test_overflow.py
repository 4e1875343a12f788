"""Reductions near the float maximum, through `import xent` with default arguments: row losses of
3e38 (logits of +-1.5e38) have a representable mean, which must come out finite and within
float32 rounding of float64 F.cross_entropy; their sum is not representable and is inf.

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_overflow.py
"""

import pytest
import torch
import torch.nn.functional as F

import xent

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def huge_rows(dtype, device):
    n, v = 8, 16
    x = torch.full((n, v), -1.5e38, dtype=torch.float64)
    target = torch.arange(n) % v
    x[torch.arange(n), (target + 1) % v] = 1.5e38  # the target's logit stays at -1.5e38
    return x.to(dtype).to(device), target.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_of_huge_row_losses_is_finite(device, dtype):
    x, target = huge_rows(dtype, device)
    want = F.cross_entropy(x.double().cpu(), target.cpu())
    assert 2e38 < want < 3.4e38
    loss = xent.vocab_parallel_cross_entropy(x.clone().requires_grad_(), target)
    assert torch.isfinite(loss), f"mean of row losses near 3e38 overflowed: {loss}"
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()


@pytest.mark.parametrize("device", DEVICES)
def test_sum_past_the_float_maximum_is_inf(device):
    x, target = huge_rows(torch.float32, device)
    loss = xent.vocab_parallel_cross_entropy(x, target, reduction="sum")
    assert torch.isinf(loss) and loss > 0
