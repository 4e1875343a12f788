"""The fused lm head's test problem, shared by test_linear_*.py, test_linear_cuda.py and
test_cuda_graphs.py: its inputs (hidden [S, B, H], the whole weight [V, H], targets with ignored
rows), per-token grad_outputs, xent's call through `import xent`, the float64 reference
(F.cross_entropy of hidden.double() @ weight.double().T) and the checks against it."""

import torch

import ranks
from test_exact_grad import excess_ulps
from test_exact_grad import reference as logits_reference

S, B, H, V = 4, 6, 32, 77  # hidden [S, B, H], the whole vocabulary V
IGNORE = -100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "zloss_softcap": dict(z_loss=1e-3, softcap=5.0),
}


def inputs(dtype, seed=0, rows=(S, B), vocab=V):
    """hidden [*rows, H], the whole weight [vocab, H], target [*rows] with ignored rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((*rows, H), generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn((vocab, H), generator=g, dtype=torch.float64) * 2 * H ** -0.5).to(dtype)
    target = torch.randint(0, vocab, rows, generator=g)
    target.view(-1)[3::7] = IGNORE
    return hidden, weight, target


def per_token(rows=(S, B), seed=5):
    """A per-token grad_output: random, some exactly 1 (the default grad_scale), one 0."""
    go = torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 0.01
    go.view(-1)[::4] = 1.0
    go.view(-1)[6] = 0.0
    return go


def grad_output_for(reduction):
    return per_token() if reduction == "none" else torch.tensor(2.5)


def reference(hidden, weight, target, grad_output, reduction, **options):
    """float64 (loss, d_hidden, d_weight) and the magnitude of each gradient element's terms
    (the float32 noise allowance of excess_ulps): the logits' gradient and its terms come from
    test_exact_grad.reference, pushed through the two products."""
    h = hidden.detach().double().reshape(-1, H)
    w = weight.detach().double()
    logits = h @ w.T
    t = target.reshape(-1)
    z = options.get("softcap", 0.0)
    capped = z * torch.tanh(logits / z) if z > 0 else logits
    row = torch.nn.functional.cross_entropy(
        capped, t, ignore_index=IGNORE, reduction="none",
        label_smoothing=options.get("label_smoothing", 0.0))
    row = row + (t != IGNORE) * options.get("z_loss", 0.0) * torch.logsumexp(capped, -1) ** 2
    loss = {"none": row.reshape(target.shape), "sum": row.sum(),
            "mean": row.sum() / max(int((t != IGNORE).sum()), 1)}[reduction]
    g, terms = logits_reference(logits, t, grad_output, reduction, **options)
    d_hidden = (g @ w).reshape(hidden.shape)
    return (loss, d_hidden, g.T @ h, (terms @ w.abs()).reshape(hidden.shape),
            terms.T @ h.abs())


def xent_call(hidden, weight, target, grad_output, **options):
    """xent's (loss, d_hidden, d_weight) for loss.backward(grad_output)."""
    import xent
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = xent.linear_cross_entropy(h, w, target, **options)
    loss.backward(grad_output)
    return loss.detach(), h.grad, w.grad


def check_close_loss(got, want, what="loss"):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    ranks.assert_close(got, want, 1e-5, what)


def check_exact(got, want, terms, dtype, what):
    """Within half an ulp of dtype from float64, past the float32 noise: rounded once."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, got.dtype)
    worst, raw = excess_ulps(got, want, terms, dtype)
    assert worst <= 0.5, f"{what}: {raw:.3f} ulps from the float64 gradient"
