"""The lm head and its loss on one rank, side by side (issue 30's table, xent's fused row added).

    python3 bench/linear_side_by_side.py --json out.json
    python3 bench/linear_side_by_side.py --device cpu --tokens 64 --hidden 32 --vocab 100 \\
        --iters 2 --warmup 1                                   # smoke test, no GPU

Inputs per vocabulary width V: hidden h [T, H] ~ N(0, 1) and weight W [V, H] ~ N(0, 4 / H) (the
logits' std is about 2), both leaves that require grad, in --dtype; targets y [T] uniform in
[0, V). A step is forward + backward of the mean loss, producing d_hidden (dH) and d_weight (dW):
  gemm3          the three matmuls alone, no autograd: logits = h @ W.T, dH = G @ W,
                 dW = G.T @ h, with G a preallocated random [T, V] tensor of --dtype: the
                 compute floor
  torch          F.cross_entropy((h @ W.T).float(), y)
  torch + xent   logits = h @ W.T, then xent.vocab_parallel_cross_entropy(logits, y,
                 inplace_grad=True) (the gradient of the logits is written over them)
  xent fused     xent.linear_cross_entropy(h, W, y, max_chunk_bytes=--max-chunk-mib)
  xent deferred  the same with grad_mode="deferred" (the gradients recomputed in backward)
  liger          liger_kernel's liger_fused_linear_cross_entropy(h, W, y), its defaults
  cce            cut_cross_entropy.linear_cross_entropy(h, W, y), its defaults (impl "cce",
                 filter_eps "high": gradient entries below the threshold are skipped)
liger and cce are skipped on CPU, and say "not installed" where their package is missing.

Metrics per row:
  ms        the median over --iters steps (after --warmup) of each step alone, timed by CUDA
            events with torch.cuda.synchronize() before and after (time.perf_counter on CPU)
  x gemm3   the row's median over the median of gemm3 steps timed alternately with it (a gemm3
            step after each of the row's), so that both see the same clocks and temperature:
            the GPU's speed drifts over a run by more than the gaps measured (an H100 run gave
            gemm3 40.6 ms where others give 35.0 to 35.7)
  x floor   the row's median over the floor of an exact step: the paired gemm3 plus 8 bytes a
            logit at the copy bandwidth (a device-to-device copy of 1 GiB, 64 MiB on CPU, best
            of 10, bytes read and written): fp32 logits written, read once and their 16-bit
            gradient written (docs/linear.md, "The floor of an exact step")
  extra     torch.cuda.max_memory_allocated() during one step (after reset_peak_memory_stats)
            minus torch.cuda.memory_allocated() just before it, measured with the inputs (and
            for gemm3, G) allocated and h.grad = W.grad = None. So dH and dW, which every row
            must produce, count in every row alike: "dH+dW MiB" is their size, to subtract.
            For gemm3 it is the logits plus dH and dW. "n/a" on CPU. xent's own buffers
            (chunks, the fp32 d_weight accumulator, cuBLASLt's workspace: cudaMalloc'd and
            kept by its group between calls) are outside torch's allocator: for the xent rows
            the device memory in use outside it after the step, over what it was at the start
            of the run (cudaMemGetInfo less torch's reserved memory), is added.
  errors    against float64 on the same device (rows of the logits in chunks of about 1 GiB,
            so it fits beside the float64 copies of W and dW, 3 x V x H x 8 bytes in all):
            the loss's absolute error, and ||x - ref||_F / ||ref||_F for dH and dW, from the
            step whose memory was measured. --no-reference skips it. None for gemm3.
A row that raises (out of memory, a backend that lacks the op) prints the error instead.
--json OUT writes the environment and every row.
"""

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import xent  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
MIB = float(1 << 20)


def optional(cuda):
    """name -> fused linear cross-entropy fn(h, W, y) or the reason it is missing."""
    out = {}
    if not cuda:
        return {"liger": "skipped on CPU", "cce": "skipped on CPU"}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        out["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
    except ImportError:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            module = LigerFusedLinearCrossEntropyLoss()
            out["liger"] = lambda h, w, y: module(w, h, y)  # its order: (weight, input, target)
        except ImportError:
            out["liger"] = "not installed"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cce"] = lambda h, w, y: cce(h, w, y)
    except ImportError:
        out["cce"] = "not installed"
    return out


def gemm3(h, w, g):
    """The floor: the step's three matmuls, g standing for the logits' gradient."""
    def step():
        hd, wd = h.detach(), w.detach()
        logits = hd @ wd.T  # noqa: F841 - live with the other two until the end, as in a step
        return None, g @ wd, g.T @ hd
    return step


def rows(h, w, y, args, extra):
    """name -> step() returning (loss or None, dH, dW), or a string: why the row is absent
    (gemm3's entry is None: main() makes its G and step)."""
    def autograd(loss_fn):
        def step():
            loss = loss_fn()
            loss.backward()
            return loss.detach(), h.grad, w.grad
        return step

    chunk = {} if args.max_chunk_mib is None else {"max_chunk_bytes": int(args.max_chunk_mib * MIB)}
    out = {
        "gemm3": None,
        "torch": autograd(lambda: F.cross_entropy((h @ w.T).float(), y)),
        "torch + xent": autograd(
            lambda: xent.vocab_parallel_cross_entropy(h @ w.T, y, inplace_grad=True)),
        "xent fused": autograd(lambda: xent.linear_cross_entropy(h, w, y, **chunk)),
        "xent deferred": autograd(
            lambda: xent.linear_cross_entropy(h, w, y, grad_mode="deferred", **chunk)),
    }
    for name, fn in extra.items():
        out[name] = fn if isinstance(fn, str) else autograd(lambda fn=fn: fn(h, w, y))
    return out


def reference(h, w, y):
    """float64 (loss, dH, dW) of the mean loss, the logits made ~1 GiB of rows at a time."""
    hd, wd = h.detach().double(), w.detach().double()
    tokens, vocab = y.numel(), wd.shape[0]
    step = max(1, (1 << 30) // (vocab * 8))
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    d_hidden = torch.empty_like(hd)
    d_weight = torch.zeros_like(wd)
    for r in range(0, tokens, step):
        logits = hd[r:r + step] @ wd.T
        t = y[r:r + step]
        lse = torch.logsumexp(logits, -1)
        loss += (lse - logits.gather(1, t[:, None])[:, 0]).sum()
        grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
        grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
        grad /= tokens
        d_hidden[r:r + step] = grad @ wd
        d_weight.addmm_(grad.T, hd[r:r + step])
        del logits, grad
    return loss / tokens, d_hidden, d_weight


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def outside_torch():
    """Device memory in use outside torch's caching allocator (xent's own buffers among it)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


OUTSIDE_AT_START = None


def measure(step, h, w, args, cuda, ref, own_buffers=False, paired=None):
    """{"ms", "extra_mib", "loss_err", "dh_err", "dw_err", "paired_ms"} of one row; own_buffers:
    the row's library allocates outside torch (xent), counted in extra; paired: a step timed
    after each of the row's (gemm3's), its median in "paired_ms"."""
    def clear():
        h.grad = None
        w.grad = None

    def timed(fn):
        clear()
        sync(cuda)
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            out = fn()
            ms = (time.perf_counter() - t0) * 1e3
        del out
        return ms

    for _ in range(args.warmup):
        clear()
        out = step()
        del out
    clear()
    sync(cuda)
    res = {"extra_mib": None, "loss_err": None, "dh_err": None, "dw_err": None}
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss, d_hidden, d_weight = step()
    sync(cuda)
    if cuda:
        res["extra_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
        if own_buffers:
            res["extra_mib"] += (outside_torch() - OUTSIDE_AT_START) / MIB
    if ref is not None and loss is not None:
        res["loss_err"] = abs(loss.double().item() - ref[0].item())
        res["dh_err"] = rel_err(d_hidden, ref[1])
        res["dw_err"] = rel_err(d_weight, ref[2])
    del loss, d_hidden, d_weight
    times, paired_times = [], []
    for _ in range(args.iters):
        times.append(timed(step))
        if paired is not None:
            paired_times.append(timed(paired))
    clear()
    res["ms"] = statistics.median(times)
    res["paired_ms"] = statistics.median(paired_times) if paired_times else None
    return res


def copy_bandwidth(device, cuda):
    """Bytes read and written a second by a device-to-device copy, the best of 10."""
    src = torch.empty((1 << 30) if cuda else (64 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(cuda)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(cuda)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, action="append",
                    help="vocabulary width per rank (repeatable; 16032, 64128, 128256)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-chunk-mib", type=float, default=None,
                    help="xent.linear_cross_entropy's max_chunk_bytes in MiB (its default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-reference", action="store_true", help="skip the float64 errors")
    ap.add_argument("--only", default="", help="comma-separated row names (gemm3 always runs)")
    ap.add_argument("--json", default="", metavar="OUT")
    args = ap.parse_args()
    vocabs = args.vocab or [16032, 64128, 128256]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device).index or 0)
        torch.cuda.init()
        global OUTSIDE_AT_START
        OUTSIDE_AT_START = outside_torch()
    dtype = DTYPES[args.dtype]
    extra = optional(cuda)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    env = dict(device=name, dtype=args.dtype, tokens=args.tokens, hidden=args.hidden,
               iters=args.iters, warmup=args.warmup, max_chunk_mib=args.max_chunk_mib,
               torch=torch.__version__, xent_library=xent.library_path())
    for pkg in ("liger_kernel", "cut_cross_entropy", "triton"):
        try:
            env[pkg] = importlib.metadata.version(pkg.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    print(f"# linear_side_by_side.py: {name}, {args.dtype}, mean, {args.tokens} tokens, hidden "
          f"{args.hidden}, one rank, torch {torch.__version__}, liger {env['liger_kernel']}, "
          f"cce {env['cut_cross_entropy']}; median of {args.iters} steps after {args.warmup}",
          flush=True)
    bandwidth = copy_bandwidth(device, cuda)
    if cuda:
        torch.cuda.empty_cache()  # the copy's 2 GiB, out of every row's memory
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    print(f"# copy bandwidth {bandwidth / 1e9:.1f} GB/s (x floor: over gemm3 + 8 bytes a logit "
          "at it)")
    print("\n| V | row | ms | x gemm3 | x floor | extra MiB | loss abs err | dH rel err | "
          "dW rel err |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    results, notes = [], []
    for vocab in vocabs:
        gen = torch.Generator(device=device).manual_seed(vocab)
        h = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(dtype)
        w = (torch.randn(vocab, args.hidden, device=device, generator=gen)
             * (2 * args.hidden ** -0.5)).to(dtype)
        y = torch.randint(0, vocab, (args.tokens,), device=device, generator=gen)
        h.requires_grad_()
        w.requires_grad_()
        ref = None
        if not args.no_reference:
            try:
                ref = reference(h, w, y)
            except torch.OutOfMemoryError:
                notes.append(f"V {vocab}: no float64 reference (out of memory)")
        item = torch.empty((), dtype=dtype).element_size()
        grads_mib = (args.tokens + vocab) * args.hidden * item / MIB
        logits_mib = args.tokens * vocab * item / MIB
        notes.append(f"V {vocab}: dH+dW {grads_mib:.1f} MiB (counted in every row's extra), "
                     f"logits in {args.dtype} {logits_mib:.1f} MiB")
        table = rows(h, w, y, args, extra)
        only = set(args.only.split(",")) if args.only else None
        # gemm3's step, with its G, lives through every row: each row's steps alternate with it.
        floor_step = gemm3(h, w, torch.randn(args.tokens, vocab, device=device,
                                             generator=gen).to(dtype))
        for row, step in table.items():
            if only is not None and row != "gemm3" and row not in only:
                continue
            res = dict(vocab=vocab, row=row, ms=None, ratio=None, extra_mib=None, loss_err=None,
                       dh_err=None, dw_err=None, dhdw_mib=grads_mib, logits_mib=logits_mib,
                       paired_ms=None, x_floor=None, error=None)
            try:
                if isinstance(step, str):  # liger or cce: why it is absent
                    res["error"] = step
                    step = None
                elif row == "gemm3":
                    step = floor_step
                if step is not None:
                    res.update(measure(step, h, w, args, cuda, ref,
                                       own_buffers=row.startswith("xent"),
                                       paired=None if row == "gemm3" else floor_step))
                if res["ms"] is not None:
                    res["ratio"] = res["ms"] / (res["paired_ms"] or res["ms"])
                if res["paired_ms"] is not None:
                    floor_ms = res["paired_ms"] + 8 * args.tokens * vocab / bandwidth * 1e3
                    res["x_floor"] = res["ms"] / floor_ms
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            step = None
            h.grad = w.grad = None
            if cuda:
                torch.cuda.empty_cache()
            results.append(res)
            if res["error"]:
                print(f"| {vocab} | {row} | {res['error']} | | | | | | |", flush=True)
                continue
            print(f"| {vocab} | {row} | {res['ms']:.3f} | {fmt(res['ratio'], '.2f')} | "
                  f"{fmt(res['x_floor'], '.2f')} | {fmt(res['extra_mib'], '.1f')} | "
                  f"{fmt(res['loss_err'], '.1e')} | {fmt(res['dh_err'], '.1e')} | "
                  f"{fmt(res['dw_err'], '.1e')} |", flush=True)
        del h, w, y, ref, table, floor_step  # gemm3's closure holds G
        if cuda:
            torch.cuda.empty_cache()
    print()
    for note in notes:
        print(f"# {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, results=results, notes=notes), f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
