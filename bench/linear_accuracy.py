"""Accuracy of the fused lm head at TP > 1, rank by rank: d_hidden and d_weight of
xent.linear_cross_entropy against float64, beside torch's unfused bf16 path on the same data
(issue 38, "The anomaly to explain": TP 4 with sequence parallelism, bf16, 1024 rows per rank,
hidden 1024, V 50257 in even shards, 10 % of rows ignored, mean reduction).

    # ranks as processes, one GPU each (NCCL), sequence parallelism:
    torchrun --standalone --nproc-per-node 4 bench/linear_accuracy.py
    # the same problem emulated on one device (no process group):
    python3 bench/linear_accuracy.py --emulate
    # CPU ranks over Gloo (the CPU backend), or --device cpu with --emulate:
    torchrun --standalone --nproc-per-node 4 bench/linear_accuracy.py --device cpu

(XENT_TORCH_LIB=build/src/torch/libxent_torch.so where xent is not installed; the script puts
python/ on the path.)

The problem (the same on every rank, generated on the CPU from --seed): hidden [tp x rows, H]
~ N(0, 1), the weight [V, H] ~ N(0, 4 / H) (logits' std about 2) with padding rows of 0 up to tp
equal shards of ceil(V / tp) rows, targets uniform over [0, V) (--targets zipf: P(id) ~ 1 /
(id + 10), skewed to the low ids that rank 0 holds), exactly round(--ignore x rows) rows (or
--ignored rows) ignored (-100) at random places. Rank k holds rows [k x rows, (k + 1) x rows)
(sequence parallelism) and the weight's rows [k x width, (k + 1) x width).

Per rank and per schedule, the errors of d_hidden (this rank's rows) and d_weight (this rank's
shard, real rows) against float64, two ways: "max" = max |x - ref| / max |ref| over the
rank's block (the issue's measure) and "fro" = ||x - ref|| / ||ref|| (steadier: the max of a
few top elements' roundings moves by tens of percent from seed to seed). Rows:
  xent      xent.linear_cross_entropy on the rank's rows and shard (sequence_parallel=True,
            vocab_start, vocab_size), one row per schedule (below). --emulate: one call of
            tp 1 over every rank's rows and the whole weight, its d_weight cut into the ranks'
            shards and its d_hidden into their rows: the same problem, exactly (rows [k x width,
            ...) of a TP-1 d_weight are shard k's d_weight; TP-1 takes the one-rank kernels).
  model     xent's CUDA arithmetic for 16-bit inputs, in torch: fp32 logits (fp32 GEMM), the
            gradient p - [target] in fp32 rounded to bf16 once, unscaled (-1 exactly where p is
            small), then the d_hidden and d_weight GEMMs with fp32 accumulation that apply
            s = fp32(1 / n) (n the valid rows) as their alpha, each output rounded once: no bf16
            rounding of s anywhere. Where xent's own row differs from this one by more than the
            GEMMs' fp32 summation order can, the implementation does something the arithmetic
            does not. (On the CPU backend xent keeps the gradient in fp32: it should beat both.)
  folded    the CUDA arithmetic before issue 38's fix: the gradient s p - s [target] rounded to
            bf16 once, the GEMMs with alpha 1: the anomaly below.
  torch     the unfused bf16 path: logits = bf16(h @ W^T) (fp32 accumulation), F.cross_entropy
            on the bf16 logits (bf16 log-softmax; its backward folds bf16(1 / bf16(n)) into the
            bf16 gradient), then dH = G W and dW = G^T h, fp32 accumulation, rounded to bf16.
  torch32   as torch with F.cross_entropy(logits.float()): the gradient in fp32, rounded to bf16
            by the cast's backward (Megatron's and linear_side_by_side.py's "torch" row).
  xent / torch in the last columns: xent's error over torch's, per measure (> 1: xent worse).

Schedules: "default" (the call's defaults), "chunks" (max_chunk_bytes = --chunk-mib MiB: several
chunks of rows, d_weight accumulated in fp32 scratch over them, rounded once), and where
xent.linear_cross_entropy takes a `schedule` argument (issue 38's fast and lean), "fast" and
"lean" too. --schedule NAME:key=value,... adds one (values parsed as Python literals).

Also printed: n, and the relative error of the mean's scale rounded to bf16, delta(n) =
bf16(1/n) n - 1 (torch: bf16(1 / bf16(n)) n - 1). Where the gradient of most target columns is
-(1 - p) / n with p near 0, that gradient is the same bf16 number in every such row, so
d_weight's elements that the target terms dominate (the largest, at random logits) all carry
delta(n) on top of their own rounding: it sets most of the "max" error (2.2e-3 at delta ~ 0,
3.4e-3 to 3.8e-3 at n = 3686, delta = -1.7e-3; up to 5.6e-3). For most n, delta is the same for
xent's arithmetic and torch's, and their largest elements come out the same bits. For some n
(3654-3656, 3672-3679 and 3704-3705 near 3686) the two round 1/n to neighbouring bf16 numbers,
deltas of opposite signs and each about half an ulp of the top elements, and the rounding of a
rank's one or two largest elements then decides that rank's "max": --seed 20 --ignored 391
(n = 3705) gives the folded arithmetic 1.41x torch's on rank 1 and 0.94x to 0.99x on ranks 0, 2
and 3 (the issue's pattern), its Frobenius errors below torch's on every rank. The "model" row
(today's xent) has no delta: d_weight 1.8e-3 to 2.6e-3 (max), d_hidden 2.7e-3 to 3.4e-3, Frobenius 1.66e-3 for
both, on every rank of the 3 problems tried at this size, below torch's everywhere.

--json OUT writes every number (rank 0).
"""

import argparse
import ast
import inspect
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))

IGNORE = -100
MIB = 1 << 20


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
    """(d_hidden, d_weight) of xent's CUDA arithmetic for 16-bit inputs (see the module's
    docstring), in torch: the gradient p - [target] rounded to bf16 unscaled and s applied in
    fp32 by the two GEMMs (their alpha, before their one rounding), so that no bf16 rounding of
    s enters the gradient. scale_in_gemm=False: the former, folded arithmetic (s p - s [target]
    rounded), the "folded" row."""
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


# ------------------------------------------------------------------------------------ xent


def schedules(extra=(), chunk_mib=64):
    """name -> keyword arguments of xent.linear_cross_entropy ({} where xent does not import:
    the reference and the peers alone)."""
    try:
        import xent
    except ImportError as e:
        print(f"# xent does not import ({str(e)[:160]}): its rows are left out", flush=True)
        return {}
    out = {"default": {}, "chunks": {"max_chunk_bytes": int(chunk_mib * MIB)}}
    if "schedule" in inspect.signature(xent.linear_cross_entropy).parameters:
        out["fast"] = {"schedule": "fast"}
        out["lean"] = {"schedule": "lean"}
    for spec in extra:
        name, _, kv = spec.partition(":")
        kwargs = {}
        for item in filter(None, kv.split(",")):
            k, _, v = item.partition("=")
            try:
                kwargs[k] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                kwargs[k] = v
        out[name] = kwargs
    return out


def xent_rank(p, k, group, device, **kwargs):
    """Rank k's (d_hidden of its rows, d_weight of its shard's real rows) from
    xent.linear_cross_entropy with sequence parallelism over `group`."""
    import xent
    lo, hi = p.shard(k)
    own = p.own(k)
    h = p.hidden[own].to(device, copy=True).requires_grad_()
    w = p.weight[k * p.width:(k + 1) * p.width].to(device, copy=True).requires_grad_()
    loss = xent.linear_cross_entropy(h, w, p.target[own].to(device), group,
                                     sequence_parallel=True, vocab_start=k * p.width,
                                     vocab_size=p.vocab, **kwargs)
    loss.backward()
    return h.grad, w.grad[:hi - lo]


def xent_emulated(p, device, **kwargs):
    """(d_hidden [tp x rows, H], d_weight [vocab, H]) of one TP-1 call over every rank's rows
    and the whole padded weight: rank k's results are its rows and shard of these."""
    import xent
    h = p.hidden.to(device, copy=True).requires_grad_()
    w = p.weight.to(device, copy=True).requires_grad_()
    loss = xent.linear_cross_entropy(h, w, p.target.to(device), vocab_size=p.vocab, **kwargs)
    loss.backward()
    return h.grad, w.grad[:p.vocab]


# ------------------------------------------------------------------------------------ main


def rank_rows(p, k, ref, peers, xents):
    """The table's rows for rank k: [(schedule or "", impl, dH errors, dW errors)]."""
    lo, hi = p.shard(k)
    own = p.own(k)
    rows = []
    for name, (dh, dw) in peers.items():
        rows.append(("", name, errors(dh[own], ref[0][own]), errors(dw[lo:hi], ref[1][lo:hi])))
    for sched, got in xents.items():
        if isinstance(got, str):
            rows.append((sched, "xent", got, got))
            continue
        dh, dw = got
        rows.append((sched, "xent", errors(dh, ref[0][own]), errors(dw, ref[1][lo:hi])))
    return rows


def print_table(p, all_rows, device_name):
    dx, dt = scale_roundings(p.valid)
    print(f"# linear_accuracy.py: {device_name}, tp {p.tp}, {p.rows} rows a rank, hidden {p.H}, "
          f"V {p.vocab} in shards of {p.width}, n = {p.valid} valid rows; delta(n) = "
          f"{dx:+.2e} (xent), {dt:+.2e} (torch bf16)")
    print("\n| rank | schedule | row | dH max | dH fro | dW max | dW fro | xent/torch dH max | "
          "dH fro | dW max | dW fro |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, rows in enumerate(all_rows):
        torch_row = next((r for r in rows if r[1] == "torch"), None)
        for sched, impl, eh, ew in rows:
            if isinstance(eh, str):
                print(f"| {k} | {sched} | {impl} | {eh} | | | | | | | |")
                continue
            cells = [f"{eh['max']:.3e}", f"{eh['fro']:.3e}", f"{ew['max']:.3e}",
                     f"{ew['fro']:.3e}"]
            ratios = [""] * 4
            if impl == "xent" and torch_row is not None:
                th, tw = torch_row[2], torch_row[3]
                ratios = [f"{eh['max'] / th['max']:.2f}", f"{eh['fro'] / th['fro']:.2f}",
                          f"{ew['max'] / tw['max']:.2f}", f"{ew['fro'] / tw['fro']:.2f}"]
            print(f"| {k} | {sched} | {impl} | " + " | ".join(cells + ratios) + " |")
    print(flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=None,
                    help="ranks (default: the process group's size, or 4 with --emulate)")
    ap.add_argument("--rows", type=int, default=1024, help="rows of hidden per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ignore", type=float, default=0.1, help="share of rows ignored")
    ap.add_argument("--ignored", type=int, default=None,
                    help="rows ignored, a count (instead of --ignore)")
    ap.add_argument("--targets", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulate", action="store_true",
                    help="one process: xent at tp 1 over the gathered rows, cut into shards")
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    ap.add_argument("--chunk-mib", type=float, default=64.0,
                    help="max_chunk_bytes of the 'chunks' schedule, in MiB")
    ap.add_argument("--schedule", action="append", default=[], metavar="NAME:k=v,...",
                    help="another set of xent.linear_cross_entropy arguments (repeatable)")
    ap.add_argument("--only", default="", help="comma-separated schedules to run")
    ap.add_argument("--json", default="", metavar="OUT")
    args = ap.parse_args()

    import torch.distributed as dist
    distributed = not args.emulate and "RANK" in os.environ
    if not args.emulate and not distributed:
        sys.exit("run under torchrun (one process a rank), or pass --emulate")
    want_cuda = args.device != "cpu" and torch.cuda.is_available()
    if distributed:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if want_cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        group = dist.group.WORLD
        tp = world
        if args.tp not in (None, world):
            sys.exit(f"--tp {args.tp} but {world} processes")
    else:
        rank, tp, group = 0, args.tp or 4, None
        device = torch.device("cuda" if want_cuda else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    p = Problem(tp, args.rows, args.hidden, args.vocab, args.ignore, args.targets, args.seed,
                ignored=args.ignored)
    t0 = time.perf_counter()
    scheds = schedules(args.schedule, args.chunk_mib)
    if args.only:
        keep = set(args.only.split(","))
        scheds = {k: v for k, v in scheds.items() if k in keep}

    ref = reference(p, device)
    peers = {"model": xent_model(p, device), "folded": xent_model(p, device, scale_in_gemm=False),
             "torch": torch_unfused(p, device),
             "torch32": torch_unfused(p, device, fp32_loss=True)}
    if distributed:
        xents = {}
        for name, kwargs in scheds.items():
            try:
                xents[name] = xent_rank(p, rank, group, device, **kwargs)
            except Exception as e:  # noqa: BLE001  (a schedule this build refuses)
                xents[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        mine = rank_rows(p, rank, ref, peers, xents)
        gathered = [None] * tp
        dist.all_gather_object(gathered, mine)
        all_rows = gathered
    else:
        whole = {}
        for name, kwargs in scheds.items():
            try:
                whole[name] = xent_emulated(p, device, **kwargs)
            except Exception as e:  # noqa: BLE001
                whole[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        all_rows = []
        for k in range(tp):
            lo, hi = p.shard(k)
            xk = {n: (v if isinstance(v, str) else (v[0][p.own(k)], v[1][lo:hi]))
                  for n, v in whole.items()}
            all_rows.append(rank_rows(p, k, ref, peers, xk))
    if rank == 0:
        print_table(p, all_rows, device_name + (" (emulated: tp 1, cut)" if args.emulate else ""))
        print(f"# {time.perf_counter() - t0:.1f} s")
        if args.json:
            dx, dt = scale_roundings(p.valid)
            out = dict(device=device_name, emulated=args.emulate, tp=tp, rows=args.rows,
                       hidden=args.hidden, vocab=args.vocab, width=p.width, valid=p.valid,
                       targets=args.targets, seed=args.seed, delta_xent=dx, delta_torch=dt,
                       schedules={k: {kk: repr(vv) for kk, vv in v.items()}
                                  for k, v in scheds.items()},
                       ranks=[[dict(schedule=s, row=i, d_hidden=eh, d_weight=ew)
                               for s, i, eh, ew in rows] for rows in all_rows])
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
