"""The gradient is rounded once to the logits' dtype, whatever grad_output reaches the loss
(issue 29): the fused default computes forward's gradient for grad_output = grad_scale, and
backward recomputes from the logits the rows whose grad_output differs (torch.ops.xent.
_backward_fused) instead of rescaling them, which rounded them twice.

Covered, on the CPU and on CUDA where there is one, through `import xent`:
  * TransformerEngine's test_bfloat16_unreduced_external_grad: bitwise the float32 gradient of
    F.cross_entropy rounded once to bfloat16;
  * a random per-token grad_output (reduction "none"), bfloat16, float16 and float32,
    inplace_grad False and True (which then takes the deferred path), the default grad_mode:
    every element within half an ulp of the float64 gradient (plus float32 noise, see
    excess_ulps); label smoothing, z-loss, softcap and ignored rows;
  * a mean (and a sum) loss times 2.5 without inplace_grad: the same;
  * grad_output equal to grad_scale: forward's gradient is kept as it is (backward reads no
    logits: made NaN, they cannot reach it), and exact;
  * the documented limit: inplace_grad with a scalar reduction and a grad_output other than
    grad_scale rescales forward's rounded gradient, bit for bit, and is off by more than half an
    ulp; with that grad_output as grad_scale it is exact;
  * _backward_fused under torch.library.opcheck and torch.compile(fullgraph=True);
  * xent.megatron (deferred, per-token grad_output) in a fresh process on a one-rank Gloo group.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import xent

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
S, B, V = 8, 8, 257  # 64 rows; an odd vocabulary (a partial vector group at the row's end)
IGNORE = -100
VARIANTS = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "zloss_softcap": dict(z_loss=1e-3, softcap=15.0),
}

_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_EMIN = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}  # smallest normal 2^emin
# The float32 arithmetic before the one rounding (the exponential, z - lse, the lse itself, terms
# that cancel) is off by a few dozen float32 ulps of the magnitude of the gradient's terms
# (reference's `terms`); 64 of them is 0.002 bfloat16 ulps and 0.016 float16 ulps of |g|, and the
# whole tolerance for float32 gradients.
NOISE_F32_ULPS = 64


# ---------------------------------------------------------------------------------- helpers


def ulp(want, dtype):
    """The spacing of dtype's values at |want| (a float64 tensor), subnormals included."""
    _, e = torch.frexp(want.abs())  # |want| = m 2^e, m in [0.5, 1)
    e = torch.where(want == 0, torch.full_like(e, _EMIN[dtype] + 1), e)
    exponent = torch.clamp(e - 1, min=_EMIN[dtype]) - _MANTISSA[dtype]
    return torch.ldexp(torch.ones_like(want), exponent)


def excess_ulps(got, want, terms, dtype):
    """(worst, raw): the largest |got - want| in ulps of dtype at the float64 reference, after
    taking off the float32 noise allowance (worst; <= 0.5 for a gradient rounded once from
    float32, up to about 1.5 for one rounded twice), and as measured (raw). NaN stays NaN."""
    g, w = got.detach().cpu().double(), want.double()
    u = ulp(w, dtype)
    err = (g - w).abs()
    worst = ((err - NOISE_F32_ULPS * 2.0 ** -23 * terms) / u).max().item()
    return worst, (err / u).max().item()


def reference(logits, target, grad_output, reduction, label_smoothing=0.0, z_loss=0.0,
              softcap=0.0):
    """The float64 gradient w.r.t. the logits for loss.backward(grad_output), from torch ops
    (F.cross_entropy of the capped logits, plus z_loss * lse^2 on the non-ignored rows; a mean
    over no row is 0, as xent defines it), and the magnitude of the terms it is made of, |g| +
    2 |row scale| (e / V + (1 - e) at the target), for the noise allowance."""
    x = logits.detach().cpu().double().reshape(-1, logits.shape[-1]).requires_grad_()
    t = target.cpu().reshape(-1).long()
    z = softcap * torch.tanh(x / softcap) if softcap > 0 else x
    valid = t != IGNORE
    row = F.cross_entropy(z, t, ignore_index=IGNORE, label_smoothing=label_smoothing,
                          reduction="none")
    row = row + torch.where(valid, z_loss * torch.logsumexp(z, -1) ** 2, torch.zeros_like(row))
    n_valid = max(int(valid.sum()), 1)
    loss = {"none": row, "sum": row.sum(), "mean": row.sum() / n_valid}[reduction]
    go = grad_output.detach().cpu().double()
    loss.backward(go.reshape(loss.shape))
    scale = go.reshape(-1).expand(t.numel()) / (n_valid if reduction == "mean" else 1)
    scale = torch.where(valid, scale, torch.zeros_like(scale)).abs()[:, None]
    cols = x.shape[-1]
    target_term = F.one_hot(t.clamp(min=0), cols) * valid[:, None] * (1 - label_smoothing)
    terms = x.grad.abs() + 2 * scale * (label_smoothing / cols + target_term)
    return x.grad.reshape(logits.shape), terms.reshape(logits.shape)


def inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((S, B, V), generator=g, dtype=torch.float64) * 2).to(dtype).to(device)
    t = torch.randint(0, V, (S, B), generator=g)
    t.view(-1)[3::7] = IGNORE
    return x, t.to(device)


def per_token_grad_output(device, grad_scale=1.0, seed=5):
    """Random per-token weights, some exactly grad_scale (left as forward wrote them), one 0."""
    g = torch.Generator().manual_seed(seed)
    go = torch.rand((S, B), generator=g) + 0.01
    go.view(-1)[::4] = grad_scale
    go.view(-1)[6] = 0.0
    return go.to(device)


def gradient(x, t, grad_output, inplace_grad=False, **options):
    """xent's gradient of the loss w.r.t. logits x, for loss.backward(grad_output)."""
    source = x.clone().requires_grad_()
    logits = source * 1.0 if inplace_grad else source  # in place: a layer's output, not a leaf
    loss = xent.vocab_parallel_cross_entropy(logits, t, inplace_grad=inplace_grad, **options)
    loss.backward(grad_output)
    return source.grad


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("device", DEVICES)
def test_te_bfloat16_unreduced_external_grad(device, inplace_grad):
    """TransformerEngine's test: bitwise the float32 gradient rounded once to bfloat16."""
    x = torch.zeros((2, 2, 3), dtype=torch.bfloat16, device=device)
    t = torch.tensor([[0, 1], [2, IGNORE]], device=device)
    go = torch.tensor([[0.01, 0.03], [0.1, 0.7]], device=device)
    x32 = x.float().cpu().requires_grad_()
    F.cross_entropy(x32.view(-1, 3), t.cpu().view(-1), reduction="none").view(2, 2).backward(
        go.cpu())
    got = gradient(x, t, go, inplace_grad, reduction="none")
    assert torch.equal(got.cpu(), x32.grad.to(torch.bfloat16)), (got, x32.grad)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("device", DEVICES)
def test_per_token_grad_output_is_rounded_once(device, dtype, inplace_grad, variant):
    dt, options = DTYPES[dtype], VARIANTS[variant]
    x, t = inputs(dt, device)
    go = per_token_grad_output(device)
    want, terms = reference(x, t, go, "none", **options)
    source = x.clone().requires_grad_()
    logits = source * 1.0 if inplace_grad else source
    version = logits._version
    loss = xent.vocab_parallel_cross_entropy(logits, t, reduction="none",
                                             inplace_grad=inplace_grad, **options)
    # In place, reduction "none" takes the deferred path: forward leaves the logits alone.
    assert logits._version == version and torch.equal(logits.detach(), x)
    loss.backward(go)
    worst, raw = excess_ulps(source.grad, want, terms, dt)
    assert worst <= 0.5, f"{raw:.3f} ulps from the float64 gradient"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("device", DEVICES)
def test_scalar_grad_output_is_rounded_once(device, dtype, reduction, variant):
    """(loss * 2.5).backward() without inplace_grad: the rows are recomputed, not rescaled."""
    dt, options = DTYPES[dtype], VARIANTS[variant]
    x, t = inputs(dt, device, seed=1)
    go = torch.tensor(2.5, device=device)
    want, terms = reference(x, t, go, reduction, **options)
    worst, raw = excess_ulps(gradient(x, t, go, reduction=reduction, **options), want, terms, dt)
    assert worst <= 0.5, f"{raw:.3f} ulps from the float64 gradient"


@pytest.mark.parametrize("inplace_grad", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_equal_to_grad_scale_is_exact(device, dtype, inplace_grad):
    """grad_scale=0.25 and (loss * 0.25).backward(): forward's gradient is final, exact, and bit
    for bit the deferred one."""
    dt = DTYPES[dtype]
    x, t = inputs(dt, device, seed=2)
    go = torch.tensor(0.25, device=device)
    want, terms = reference(x, t, go, "mean", label_smoothing=0.1)
    got = gradient(x, t, go, inplace_grad, grad_scale=0.25, label_smoothing=0.1)
    worst, raw = excess_ulps(got, want, terms, dt)
    assert worst <= 0.5, f"{raw:.3f} ulps from the float64 gradient"
    deferred = gradient(x, t, go, grad_mode="deferred", label_smoothing=0.1)
    assert torch.equal(got, deferred)


def forward_op(device, reduction, grad_scale, dtype, seed):
    """2-D logits, 1-D targets, the internal operators' option arguments, and _forward's lse and
    gradient (for grad_output = grad_scale; smoothing 0.1, z-loss 1e-3)."""
    args = ("", IGNORE, 0.1, 1e-3, 0.0, reduction, -1, -1, grad_scale)
    x, t = inputs(dtype, device, seed)
    x, t = x.view(-1, V), t.view(-1)
    _, lse, _, _, _, grad = torch.ops.xent._forward.default(x, t, *args, False, True, False)
    return x, t, args, lse, grad


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_fused_keeps_rows_whose_grad_output_is_grad_scale(device, reduction):
    """The internal operator leaves every row whose grad_output is grad_scale as _forward wrote
    it: the logits of those rows made NaN cannot reach it. The other rows are recomputed."""
    x, t, args, lse, grad = forward_op(device, reduction, 0.25, torch.bfloat16, seed=3)
    assert lse.shape == (S * B,)  # returned with the gradient, for this backward
    before = grad.clone()
    if reduction == "none":
        go = per_token_grad_output(device, grad_scale=0.25).view(-1)
    else:
        go = torch.full((), 0.25, device=device)
    kept = (go == 0.25).expand(S * B)
    x = torch.where(kept[:, None], torch.full_like(x, float("nan")), x)
    torch.ops.xent._backward_fused.default(grad, x, t, lse, go, *args)
    assert torch.equal(grad[kept], before[kept])
    recomputed = ~kept & (t != IGNORE)
    assert (grad[recomputed] != before[recomputed]).any(dim=-1).all()
    assert not grad.isnan().any()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_scalar_grad_output_is_a_rescale_as_documented(device, dtype):
    """inplace_grad, a mean loss, (loss * 2.5).backward(): the logits are gone, so forward's
    rounded gradient is rescaled (rounded again), bit for bit, and off by more than half an ulp
    somewhere; told grad_scale=2.5, the gradient is rounded once."""
    dt = DTYPES[dtype]
    x, t = inputs(dt, device, seed=4)
    go = torch.tensor(2.5, device=device)
    want, terms = reference(x, t, go, "mean")
    unscaled = gradient(x, t, torch.tensor(1.0, device=device), True)  # forward's, as it is
    twice = gradient(x, t, go, True)
    assert torch.equal(twice, (unscaled.float() * 2.5).to(dt)), "not the documented rescale"
    worst, raw = excess_ulps(twice, want, terms, dt)
    assert worst > 0.5, f"the rescale is within {raw:.3f} ulps: the documented limit is gone"
    worst, raw = excess_ulps(gradient(x, t, go, True, grad_scale=2.5), want, terms, dt)
    assert worst <= 0.5, f"{raw:.3f} ulps from the float64 gradient"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward_fused(device, reduction):
    x, t, args, lse, grad = forward_op(device, reduction, 0.5, torch.float32, seed=6)
    go = (per_token_grad_output(device).view(-1) if reduction == "none"
          else torch.full((), 3.0, device=device))
    torch.library.opcheck(torch.ops.xent._backward_fused.default,
                          (grad.clone(), x, t, lse, go, *args))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_recomputes_like_eager(device):
    """A compiled step whose loss is scaled by 2.5 in the graph (backward in the graph, one
    graph): the same gradients as eager, which are rounded once."""
    from torch._dynamo.utils import counters
    x0, t = inputs(torch.bfloat16, device, seed=7)

    def step(x, t):
        loss = xent.vocab_parallel_cross_entropy(x * 1.0, t, label_smoothing=0.1)
        (loss * 2.5).backward()
        return loss.detach()

    def run(f):
        x = x0.clone().requires_grad_()
        return f(x, t), x.grad

    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            loss, grad = run(torch.compile(step, fullgraph=True))
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    eager_loss, eager_grad = run(step)
    assert torch.equal(loss, eager_loss) and torch.equal(grad, eager_grad)
    want, terms = reference(x0, t, torch.tensor(2.5), "mean", label_smoothing=0.1)
    worst, raw = excess_ulps(grad, want, terms, torch.bfloat16)
    assert worst <= 0.5, f"{raw:.3f} ulps from the float64 gradient"


def test_megatron_drop_in_is_rounded_once(tmp_path):
    """xent.megatron (reduction none, grad_mode deferred, Megatron's partition) with a per-token
    grad_output, on a one-rank Gloo group in a fresh process: within half an ulp."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).resolve().parent)!r})
        import torch, torch.distributed as dist
        import xent.megatron as xm
        import test_exact_grad as t
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
        out = {{}}
        for name in ("bf16", "fp16"):
            x, target = t.inputs(t.DTYPES[name], "cpu", seed=8)
            target = target.clamp(min=0)  # Megatron's targets are classes
            go = t.per_token_grad_output("cpu")
            source = x.clone().requires_grad_()
            xm.vocab_parallel_cross_entropy(source, target, tp_group=dist.group.WORLD).backward(go)
            want, terms = t.reference(x, target, go, "none")
            out[name] = t.excess_ulps(source.grad, want, terms, t.DTYPES[name])
        dist.destroy_process_group()
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for name, (worst, raw) in json.loads(r.stdout.splitlines()[-1]).items():
        assert worst <= 0.5, f"{name}: {raw:.3f} ulps from the float64 gradient"
