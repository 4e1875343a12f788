"""bench/linear_accuracy.py's problem and the arithmetic it is measured against: the ranks'
data, the float64 reference, torch's unfused path, the model of xent's CUDA arithmetic and the
errors (tests/python/test_linear_accuracy.py uses them too)."""

import math

import torch
import torch.nn.functional as F

IGNORE = -100


# ------------------------------------------------------------------------------ the problem


class Problem:
    """hidden [tp x rows, H], weight [tp x width, H] (padding rows 0), target [tp x rows]; all on
    the CPU, in `dtype` (target int64)."""

    def __init__(self, tp=4, rows=1024, hidden=1024, vocab=50257, ignore=0.1, targets="uniform",
                 seed=0, dtype=torch.bfloat16, logit_std=2.0, ignored=None):
        self.tp, self.rows, self.H, self.vocab = tp, rows, hidden, vocab
        self.width = -(-vocab // tp)
        n = tp * rows
        g = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(n, hidden, generator=g).to(dtype)
        w = torch.zeros(self.width * tp, hidden)
        w[:vocab] = torch.randn(vocab, hidden, generator=g) * (logit_std / math.sqrt(hidden))
        self.weight = w.to(dtype)
        if targets == "uniform":
            t = torch.randint(0, vocab, (n,), generator=g)
        elif targets == "zipf":
            p = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10.0)
            t = torch.multinomial(p / p.sum(), n, replacement=True, generator=g)
        else:
            raise ValueError(f"targets = {targets!r}: uniform or zipf")
        count = round(ignore * n) if ignored is None else ignored
        t[torch.randperm(n, generator=g)[:count]] = IGNORE
        self.target = t
        self.valid = int((t != IGNORE).sum())

    def shard(self, k):
        """Rank k's real weight rows, as global vocabulary ids [lo, hi)."""
        lo = k * self.width
        return lo, min(lo + self.width, self.vocab)

    def own(self, k):
        """Rank k's rows (sequence parallelism)."""
        return slice(k * self.rows, (k + 1) * self.rows)


def scale_roundings(n):
    """delta(n) of xent's arithmetic (bf16(1/n) n - 1) and of torch's bf16 cross-entropy
    (bf16(1 / bf16(n)) n - 1)."""
    bf = torch.bfloat16
    x = torch.tensor(1.0 / n).to(bf).double().item() * n - 1.0
    nb = torch.tensor(float(n)).to(bf).double().item()
    t = torch.tensor(1.0 / nb).to(bf).double().item() * n - 1.0
    return x, t


# ------------------------------------------------------------------- reference and peers


def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def reference(p, device, block=512):
    """float64 (d_hidden [tp x rows, H], d_weight [vocab, H]) of the mean loss, the logits made
    `block` rows at a time."""
    h = p.hidden.to(device).double()
    w = p.weight[:p.vocab].to(device).double()
    t = p.target.to(device)
    d_hidden = torch.empty_like(h)
    d_weight = torch.zeros_like(w)
    for r0 in range(0, h.shape[0], block):
        z = h[r0:r0 + block] @ w.T
        tt = t[r0:r0 + block]
        g = torch.softmax(z, -1)
        del z
        ok = tt != IGNORE
        g[torch.arange(tt.numel(), device=device)[ok], tt[ok]] -= 1.0
        g[~ok] = 0.0
        g /= p.valid
        d_hidden[r0:r0 + block] = g @ w
        d_weight.addmm_(g.T, h[r0:r0 + block])
        del g
    return d_hidden, d_weight


def _gemms(grad16, h32, w32, alpha=None):
    """dH = alpha G W and dW = alpha G^T h with fp32 accumulation, each rounded once to G's
    dtype: what a 16-bit GEMM with fp32 compute writes (up to the order of its sums)."""
    g = grad16.float()
    dh, dw = g @ w32, g.T @ h32
    if alpha is not None:
        dh, dw = dh * alpha, dw * alpha
    return dh.to(grad16.dtype), dw.to(grad16.dtype)


def torch_unfused(p, device, fp32_loss=False):
    """(d_hidden, d_weight) of torch's unfused path: bf16 logits, F.cross_entropy on them (or on
    their float32 copy), the two GEMMs. The GEMMs are made in fp32 from the bf16 values and
    rounded (on the CPU a bf16 GEMM is slow; on CUDA the same numbers as cuBLAS's bf16 GEMMs,
    which accumulate in fp32)."""
    no_tf32()
    h32 = p.hidden.to(device).float()
    w32 = p.weight[:p.vocab].to(device).float()
    logits = (h32 @ w32.T).to(p.hidden.dtype)
    x = (logits.float() if fp32_loss else logits).requires_grad_()
    F.cross_entropy(x, p.target.to(device), ignore_index=IGNORE).backward()
    grad = x.grad.to(p.hidden.dtype)
    del x, logits
    return _gemms(grad, h32, w32)


def xent_model(p, device, scale_in_gemm=True):
    """(d_hidden, d_weight) of xent's CUDA arithmetic for 16-bit inputs (see the "model" row in
    bench/linear_accuracy.py's docstring), in torch: the gradient p - [target] rounded to bf16
    unscaled and s applied in fp32 by the two GEMMs (their alpha, before their one rounding), so
    that no bf16 rounding of s enters the gradient. scale_in_gemm=False: the former, folded
    arithmetic (s p - s [target] rounded), the "folded" row."""
    no_tf32()
    h32 = p.hidden.to(device).float()
    w32 = p.weight[:p.vocab].to(device).float()
    t = p.target.to(device)
    z = h32 @ w32.T
    s = torch.tensor(1.0 / p.valid, dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    c = one if scale_in_gemm else s
    g = torch.exp(z - torch.logsumexp(z, -1, keepdim=True)) * c
    del z
    ok = t != IGNORE
    g[torch.arange(t.numel(), device=device)[ok], t[ok]] -= c
    g[~ok] = 0.0
    grad = g.to(p.hidden.dtype)
    del g
    return _gemms(grad, h32, w32, s if scale_in_gemm else None)


def errors(x, ref):
    """{"max": max|x - ref| / max|ref|, "fro": ||x - ref|| / ||ref||}, in float64."""
    d = x.detach().to(ref.device).double() - ref
    return {"max": (d.abs().max() / ref.abs().max()).item(),
            "fro": (d.norm() / ref.norm()).item()}

