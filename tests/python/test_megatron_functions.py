"""xent.megatron's two functions against Megatron-core's own, on two tensor-parallel ranks
(megatron_ranks.py: the problem, the set-up and the worker; Gloo with CPU tensors always, and
NCCL with cuda:<rank> where there are 2 GPUs).

Covered:
  * the unfused entry point, float32 and bfloat16 logits, tp_group given (positionally, and as
    the keyword that megatron-core 0.19's function also takes) and tp_group=None (Megatron's
    parallel state): loss and gradient equal Megatron's to rounding, with a non-unit grad_output
    (as Megatron's loss mask and token count make it); xent's parameters are Megatron's (0.19:
    all four; 0.16.1: the first three, it has no tp_group);
  * the fused entry point (Megatron's runs on CPU too, through torch.compile): the loss equals
    Megatron's, the gradient to bfloat16 rounding (Megatron's fused gradient is always bf16);
  * label smoothing 0.1: xent's loss and gradient equal float64 F.cross_entropy on the full
    logits, Megatron's equal the formula docs/megatron.md gives for them, and the two differ
    (as do Megatron's two ranks), and xent warns.
Only valid targets are compared: Megatron has no ignore index and returns a meaningless loss for
a target outside the vocabulary. patch(), the errors and the rank override are
test_megatron_patch.py's.

Without megatron-core the two-rank tests are skipped (install: pip install megatron-core==0.16.1,
or 0.19.2 under Python 3.12);
test_without_megatron runs anyway: xent.megatron imports and works with an explicit tp_group
without it, and patch() and tp_group=None fail with an ImportError that says what is missing.

Run (from the repository root, with the library built):
    PYTHONPATH=$PWD/python python3 -m pytest -q tests/python/test_megatron_functions.py
    bash launch/megatron_env.sh 3.12 0.19.2 build/megatron-envs/py3.12-megatron-core-0.19.2
"""

import functools
import inspect
import subprocess
import sys
import textwrap

import torch

import ranks
from megatron_ranks import (B, DTYPES, FUSED_CASES, S, SMOOTHING, UNFUSED_CASES, V, WIDTH, WORLD,
                            two_ranks, two_ranks_test)  # noqa: F401 (a fixture)

CASES = list(UNFUSED_CASES) + list(FUSED_CASES) + ["signature", "smoothing"]
test_two_ranks = two_ranks_test(CASES)


def test_without_megatron(tmp_path):
    """In a fresh process where `import megatron` fails: xent.megatron imports, works with an
    explicit tp_group (a one-rank Gloo group), and patch() and tp_group=None raise an
    ImportError naming megatron-core and the module."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["megatron"] = None  # makes every `import megatron...` raise ImportError
        import torch, torch.distributed as dist, torch.nn.functional as F
        import xent.megatron as xm

        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
        g = torch.Generator().manual_seed(0)
        full = torch.randn(3, 2, 10, generator=g, dtype=torch.float64)
        target = torch.randint(0, 10, (3, 2), generator=g)
        x = full.float().requires_grad_()
        loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=dist.group.WORLD)
        want = F.cross_entropy(full.view(-1, 10), target.view(-1), reduction="none").view(3, 2)
        assert loss.shape == (3, 2) and loss.dtype == torch.float32, (loss.shape, loss.dtype)
        assert torch.allclose(loss.double(), want, rtol=1e-6, atol=0), (loss, want)

        for call, what in ((xm.patch, "xent.megatron.patch()"),
                           (lambda: xm.vocab_parallel_cross_entropy(x, target),
                            "vocab_parallel_cross_entropy with tp_group=None")):
            try:
                call()
            except ImportError as e:
                message = str(e)
                assert what in message and "megatron-core" in message, message
                assert "pip install megatron-core" in message, message
            else:
                raise AssertionError(what + " raised nothing without megatron-core")
        assert "megatron.core" not in sys.modules or sys.modules["megatron.core"] is None
        dist.destroy_process_group()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")


# =============================================================================== the ranks


def _assert_bf16_close(got, want, what):
    """Every element within one bfloat16 rounding (2^-7 relative) of the other."""
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    bound = 2.0 ** -7 * torch.maximum(g.abs(), w.abs())
    bad = ((g - w).abs() > bound) | g.isnan() | w.isnan()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements differ by more than a bfloat16 rounding; "
        f"max |error| {(g - w).abs().max().item():.3e}")


class FunctionCases:
    """The cases of this file, run by megatron_ranks.py's worker on each rank."""

    def unfused_case(self, dtype_name, how):
        from megatron.core import tensor_parallel

        import xent.megatron as xm
        dtype = DTYPES[dtype_name]
        megatron = tensor_parallel.vocab_parallel_cross_entropy
        if how == "tp_group_keyword" and self.takes_tp_group:  # Megatron's own call, as 0.19's
            megatron = functools.partial(megatron, tp_group=self.tp_group)  # LanguageModule's
        want_loss, want_grad = self.run_loss(megatron, dtype)

        x = self.shard(dtype)
        before = x.detach().clone()
        target = self.target.to(self.device)
        if how == "tp_group":
            loss = xm.vocab_parallel_cross_entropy(x, target, 0.0, self.tp_group)
        elif how == "tp_group_keyword":
            loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=self.tp_group)
        else:
            loss = xm.vocab_parallel_cross_entropy(x, target)
        assert loss.dtype == torch.float32 == want_loss.dtype, (loss.dtype, want_loss.dtype)
        ranks.assert_close(loss, want_loss, 1e-6, "loss vs Megatron's")
        loss.backward(self.weight.to(self.device))
        assert x.grad.dtype == dtype, x.grad.dtype
        if dtype == torch.float32:
            ranks.assert_close(x.grad, want_grad, 1e-6, "gradient vs Megatron's")
        else:  # both round a float32 gradient once
            _assert_bf16_close(x.grad, want_grad, "gradient vs Megatron's")
        assert torch.equal(x.detach(), before), "xent wrote the logits"

    def fused_case(self, dtype_name):
        from megatron.core.fusions import fused_cross_entropy

        import xent.megatron as xm
        dtype = DTYPES[dtype_name]
        want_loss, want_grad = self.run_loss(
            fused_cross_entropy.fused_vocab_parallel_cross_entropy, dtype, self.tp_group)
        loss, grad = self.run_loss(xm.fused_vocab_parallel_cross_entropy, dtype, self.tp_group)
        ranks.assert_close(loss, want_loss, 1e-6, "fused loss vs Megatron's")
        assert grad.dtype == dtype, grad.dtype  # Megatron's is rounded to bf16 in any case
        _assert_bf16_close(grad, want_grad, "fused gradient vs Megatron's")

    def signature_case(self):
        """xent's entry points take Megatron's parameters (names, defaults, kinds): all of them
        (megatron-core 0.19: vocab_parallel_cross_entropy's four, tp_group last), and xent's
        tp_group after 0.16.1's three; the patched entry points show the same signatures."""
        from megatron.core import tensor_parallel
        from megatron.core.fusions import fused_cross_entropy

        import xent.megatron as xm

        def params(fn):
            return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]

        for megatron, mine in (
                (tensor_parallel.vocab_parallel_cross_entropy, xm.vocab_parallel_cross_entropy),
                (fused_cross_entropy.fused_vocab_parallel_cross_entropy,
                 xm.fused_vocab_parallel_cross_entropy)):
            theirs, ours = params(megatron), params(mine)
            assert ours[:len(theirs)] == theirs, (megatron.__name__, theirs, ours)
            assert len(ours) == len(theirs) or (
                not self.takes_tp_group and megatron.__name__ == "vocab_parallel_cross_entropy"
                and [p[0] for p in ours[len(theirs):]] == ["tp_group"]), (theirs, ours)
        tp_group = inspect.signature(xm.vocab_parallel_cross_entropy).parameters["tp_group"]
        assert tp_group.default is None, tp_group
        if self.takes_tp_group:
            assert len(params(tensor_parallel.vocab_parallel_cross_entropy)) == 4
        xm.patch()
        try:
            for fn in (tensor_parallel.vocab_parallel_cross_entropy,
                       fused_cross_entropy.fused_vocab_parallel_cross_entropy):
                assert params(fn) == params(fn.__wrapped__), (fn, params(fn))
        finally:
            xm.unpatch()

    def smoothing_case(self):
        import warnings

        import torch.nn.functional as F
        from megatron.core import tensor_parallel

        import xent.megatron as xm
        # xent: PyTorch's definition, on the full logits, in float64
        full = self.full.clone().requires_grad_()
        want = F.cross_entropy(full.view(-1, V), self.target.view(-1), reduction="none",
                               label_smoothing=SMOOTHING).view(S, B)
        want.backward(self.weight.double())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grad = self.run_loss(xm.vocab_parallel_cross_entropy, torch.float32,
                                       SMOOTHING)
        assert any(issubclass(w.category, UserWarning) and "label_smoothing" in str(w.message)
                   and "not Megatron-core's" in str(w.message) for w in caught), (
            [str(w.message) for w in caught])
        ranks.assert_close(loss, want.detach(), 1e-6, "smoothed loss vs float64 F.cross_entropy")
        ranks.assert_close(grad, full.grad[..., self.lo:self.hi], 1e-6,
                           "smoothed gradient vs float64 F.cross_entropy")

        # Megatron: (1 - s) * CE - s * mean over this rank's columns of log softmax,
        # s = alpha * WIDTH / (WIDTH - 1), as docs/megatron.md states
        meg, _ = self.run_loss(tensor_parallel.vocab_parallel_cross_entropy, torch.float32,
                               SMOOTHING)
        log_p = torch.log_softmax(self.full, dim=-1)
        ce = -log_p.gather(-1, self.target.unsqueeze(-1)).squeeze(-1)
        s = SMOOTHING * WIDTH / (WIDTH - 1)
        meg_formula = (1 - s) * ce - s * log_p[..., self.lo:self.hi].mean(-1)
        ranks.assert_close(meg, meg_formula, 1e-5,
                           "Megatron's smoothed loss vs the documented formula")

        differ = (meg.cpu().double() - loss.cpu().double()).abs().max().item()
        assert differ > 1e-3, f"Megatron's smoothed loss equals xent's (max |diff| {differ:.2e})"
        both = [torch.empty_like(meg) for _ in range(WORLD)]
        self.dist.all_gather(both, meg)
        apart = (both[0] - both[1]).abs().max().item()
        assert apart > 1e-3, f"Megatron's ranks agree on the smoothed loss ({apart:.2e})"
