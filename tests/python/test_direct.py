"""xent._C, the direct entry that `import xent` prefers in eager mode, against torch.ops.xent.*.

Covered:
  * the build's xent._C is the one loaded (where the test runner names it: XENT_TORCH_DIRECT);
  * the two paths give bitwise the same loss, gradient and statistics, and the same errors, over
    the options (reductions, label smoothing, z-loss, softcap, fused / deferred, in place,
    grad_scale), 3-D logits, float32 and bfloat16, CPU and CUDA;
  * which path runs: the direct one for plain tensors in eager mode; torch.ops under a
    __torch_function__ mode, for a tensor subclass and under torch.compile;
  * profiler traces name the call as torch.ops does.

Run: XENT_TORCH_LIB=... PYTHONPATH=python python3 -m pytest tests/python/test_direct.py
"""

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

import xent
from op_problem import DEVICES, IGNORE, V, random_logits, random_target
from test_torch_op_errors import BAD_INPUTS, bad_args

needs_direct = pytest.mark.skipif(xent._direct is None,
                                  reason="xent._C not built (no Python headers at build time)")


class Spy:
    """Stands in for xent._C and counts the calls that reach it."""

    def __init__(self, module):
        self.module = module
        self.calls = 0

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args):
            self.calls += 1
            return fn(*args)

        return counted


@pytest.fixture
def spy(monkeypatch):
    s = Spy(xent._direct)
    monkeypatch.setattr(xent, "_direct", s)
    return s


@pytest.fixture
def ops_only(monkeypatch):
    """Runs a call with xent._C switched off (torch.ops.xent.* alone)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(xent, "_direct", None)
            return fn()

    return run


def test_the_build_s_direct_module_is_loaded():
    want = os.environ.get("XENT_TORCH_DIRECT")
    if not want:
        pytest.skip("XENT_TORCH_DIRECT not set (ctest sets it where the build made xent._C)")
    assert xent._direct is not None, f"xent._C ({want}) was built but did not load"
    assert os.path.samefile(xent._direct.__file__, want)


# name -> keyword arguments of the call
OPTIONS = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 5.0},
    "deferred": {"grad_mode": "deferred"},
    "inplace": {"inplace_grad": True},
    "grad_scale": {"grad_scale": 0.25},
    "ignore_7": {"ignore_index": 7},
}


def _loss_and_grad(shape, dtype, device, kwargs):
    x = random_logits(shape, dtype=dtype, device=device).requires_grad_()
    # In place needs a non-leaf (autograd refuses to overwrite a leaf that requires grad).
    logits = x * 1 if kwargs.get("inplace_grad") else x
    y = random_target(shape[:-1], device=device, ignore_index=kwargs.get("ignore_index", IGNORE))
    loss = xent.vocab_parallel_cross_entropy(logits, y, **kwargs)
    g = torch.rand(loss.shape, generator=torch.Generator().manual_seed(3)).to(device) + 0.5
    loss.backward(g)
    return loss.detach(), x.grad


@needs_direct
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(24, V), (4, 6, V)], ids=["2d", "3d"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_direct_and_torch_ops_agree_bitwise(spy, ops_only, device, dtype, shape, name):
    kwargs = OPTIONS[name]
    loss, grad = _loss_and_grad(shape, dtype, device, kwargs)
    assert spy.calls == 1, "the eager call on plain tensors did not take xent._C"
    want_loss, want_grad = ops_only(lambda: _loss_and_grad(shape, dtype, device, kwargs))
    assert spy.calls == 1, "with xent._direct = None the call still reached xent._C"
    assert torch.equal(loss, want_loss), f"loss {loss} != {want_loss}"
    assert torch.equal(grad, want_grad), "gradients differ"


@needs_direct
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_accuracy", [False, True])
def test_stats_agree_bitwise(spy, ops_only, device, compute_accuracy):
    x = random_logits((4, 6, V), device=device)
    y = random_target((4, 6), device=device)

    def stats():
        return xent.vocab_parallel_cross_entropy_stats(x, y, z_loss=1e-3, reduction="none",
                                                       compute_accuracy=compute_accuracy)

    got = stats()
    want = ops_only(stats)
    assert spy.calls == 1
    assert len(got) == len(want) == 5
    for name, a, b in zip(("loss", "lse", "z_loss", "argmax", "accuracy"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {a.shape} vs {b}"
        assert torch.equal(a, b), f"{name} differs"


@needs_direct
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_INPUTS, ids=lambda b: b.name)
def test_direct_and_torch_ops_raise_the_same_error(spy, ops_only, device, bad):
    if device not in bad.devices:
        pytest.skip(f"{bad.name} is a {'/'.join(bad.devices)} case")
    with pytest.raises(RuntimeError) as direct:
        bad.call(*bad_args(device, True))
    assert spy.calls == 1
    with pytest.raises(RuntimeError) as boxed:
        ops_only(lambda: bad.call(*bad_args(device, True)))
    assert str(direct.value) == str(boxed.value)


class Subclass(torch.Tensor):
    pass


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@needs_direct
def test_function_mode_and_subclass_take_torch_ops(spy):
    x = random_logits((24, V))
    y = random_target((24,))
    want = xent.vocab_parallel_cross_entropy(x, y)
    assert spy.calls == 1
    with PassThrough():
        got = xent.vocab_parallel_cross_entropy(x, y)
    assert spy.calls == 1, "a __torch_function__ mode is active: the call must go to torch.ops"
    assert torch.equal(got, want)
    got = xent.vocab_parallel_cross_entropy(x.as_subclass(Subclass), y)
    assert spy.calls == 1, "a tensor subclass must go to torch.ops"
    assert torch.equal(torch.Tensor(got), want)


@needs_direct
def test_compiled_call_takes_torch_ops(spy):
    x = random_logits((24, V))
    y = random_target((24,))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: xent.vocab_parallel_cross_entropy(a, b), fullgraph=True,
                             backend="eager")
    got = compiled(x, y)
    assert spy.calls == 0, "torch.compile traced the direct entry instead of torch.ops"
    assert torch.equal(got, xent.vocab_parallel_cross_entropy(x, y))


@needs_direct
def test_profiler_names_the_operator():
    x = random_logits((24, V))
    y = random_target((24,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        xent.vocab_parallel_cross_entropy(x, y)
        xent.vocab_parallel_cross_entropy_stats(x, y)
    names = {e.name for e in prof.events()}
    for want in ("xent::vocab_parallel_cross_entropy", "xent::vocab_parallel_cross_entropy_stats"):
        assert want in names, f"{want} not in the profile: {sorted(names)[:20]}"
