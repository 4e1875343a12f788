"""xent's CPU backend against PyTorch's own CPU cross-entropy, one process, side by side.

    PYTHONPATH=python XENT_TORCH_LIB=build/src/torch/libxent_torch.so \\
        python3 bench/cpu_vs_torch.py                       # 2048 x 32000, fp32 and bf16
    python3 bench/cpu_vs_torch.py --shape 4096x128256 --reps 5 --threads 1
    python3 bench/cpu_vs_torch.py --torch-threads 2 --xent-threads 1 --dtype bf16

Builds nothing: `import xent` loads the library ($XENT_TORCH_LIB, else the repository's build/).
For each dtype, forward + backward (torch.autograd.grad of the mean loss for the logits, on CPU
tensors, no process group) is timed with time.perf_counter, `--reps` steps after `--warmup`:

  xent copy     xent.vocab_parallel_cross_entropy(x, t), x a leaf (inplace_grad=False: the
                gradient goes into a new tensor)
  xent inplace  the same with inplace_grad=True on a non-leaf (the gradient overwrites the logits;
                they are restored, untimed, before each step)
  torch         F.cross_entropy(x, t) on the same leaf and targets

Threads: torch.set_num_threads(--torch-threads) for PyTorch, XENT_CPU_THREADS=--xent-threads for
xent (both default to --threads, which defaults to os.cpu_count()). It prints the median and the
best time of each, and the ratio xent / torch of the medians per dtype (below 1: xent is faster).

Then, unless --no-check, a determinism check: subprocesses with XENT_CPU_THREADS=1 and =2 (and
--check-threads to change the list) compute loss, lse and gradient (fp32, bf16 and fp16; plain and
with label smoothing, z-loss and ignored rows, copy and in place) and the parent compares
their SHA-256 digests: every thread count must give the same bits.
"""

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_shape(s):
    rows, cols = s.lower().split("x")
    return int(rows), int(cols)


def load_torch_and_xent():
    # torch warns at import when NumPy is missing; nothing here needs NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))  # PYTHONPATH still wins if set
    import torch  # noqa: F401
    import xent
    return torch, xent


def make_inputs(torch, rows, cols, dtype, seed=1, ignore_every=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 2.0).to(dtype)
    t = torch.randint(0, cols, (rows,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return x, t


def timed(step, reps, warmup, before=None):
    out = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if i >= warmup:
            out.append((t1 - t0) * 1e3)
    return statistics.median(out), min(out)


def bench(args):
    os.environ["XENT_CPU_THREADS"] = str(args.xent_threads)  # read by the backend on every call
    torch, xent = load_torch_and_xent()
    import torch.nn.functional as F
    torch.set_num_threads(args.torch_threads)
    rows, cols = args.shape
    print(f"# {rows} x {cols}, forward + backward (mean loss), ms over {args.reps} reps "
          f"(+{args.warmup} warm-up); torch threads {torch.get_num_threads()}, "
          f"XENT_CPU_THREADS={os.environ['XENT_CPU_THREADS']}, cpu_count {os.cpu_count()}")
    print(f"# library: {xent.library_path()}")
    print(f"# {'dtype':5s} {'what':13s} {'median':>9s} {'best':>9s} {'/torch':>7s}")
    summary = {}
    for name in args.dtype:
        dtype = getattr(torch, DTYPES[name])
        base, t = make_inputs(torch, rows, cols, dtype)
        leaf = base.clone().requires_grad_()
        src = base.clone().requires_grad_()
        nonleaf = src * 1.0  # a layer's output: its storage takes the gradient in place

        def xent_copy():
            loss = xent.vocab_parallel_cross_entropy(leaf, t, None, inplace_grad=False)
            return torch.autograd.grad(loss, [leaf])

        def xent_inplace():
            loss = xent.vocab_parallel_cross_entropy(nonleaf, t, None, inplace_grad=True)
            return torch.autograd.grad(loss, [nonleaf])

        def restore():
            with torch.no_grad():
                nonleaf.copy_(base)

        def torch_ce():
            loss = F.cross_entropy(leaf, t)
            return torch.autograd.grad(loss, [leaf])

        res = {
            "xent copy": timed(xent_copy, args.reps, args.warmup),
            "xent inplace": timed(xent_inplace, args.reps, args.warmup, before=restore),
            "torch": timed(torch_ce, args.reps, args.warmup),
        }
        ref = res["torch"][0]
        for what, (med, best) in res.items():
            print(f"  {name:5s} {what:13s} {med:9.1f} {best:9.1f} {med / ref:7.3f}")
        summary[name] = {k: v[0] for k, v in res.items()}
        del leaf, src, nonleaf, base
    print("# xent / torch (medians): " + ", ".join(
        f"{n}: copy {s['xent copy'] / s['torch']:.3f}, inplace {s['xent inplace'] / s['torch']:.3f}"
        for n, s in summary.items()))
    return summary


def digests(args):
    """Child of the determinism check: SHA-256 of every output, as JSON on stdout."""
    torch, xent = load_torch_and_xent()
    rows, cols = args.shape
    out = {}
    cases = {
        "plain": dict(),
        "options": dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=-100),
    }
    for name in args.dtype:
        dtype = getattr(torch, DTYPES[name])
        for case, kw in cases.items():
            base, t = make_inputs(torch, rows, cols, dtype, seed=3,
                                  ignore_every=7 if case == "options" else 0)
            for inplace in (False, True):
                src = base.clone().requires_grad_()
                x = src * 1.0 if inplace else src
                loss, lse, zl, _, _ = xent.vocab_parallel_cross_entropy_stats(
                    x, t, None, inplace_grad=inplace, **kw)
                (g,) = torch.autograd.grad(loss, [x])
                h = hashlib.sha256()
                for a in (loss, lse, zl, g):
                    a = a.detach().contiguous()  # the raw bytes (no numpy needed)
                    h.update(ctypes.string_at(a.data_ptr(), a.numel() * a.element_size()))
                out[f"{name} {case} {'inplace' if inplace else 'copy'}"] = h.hexdigest()
    print(json.dumps(out))


def check(args):
    rows, cols = args.shape
    print(f"# determinism: {rows} x {cols}, XENT_CPU_THREADS in {args.check_threads}")
    got = {}
    for n in args.check_threads:
        env = dict(os.environ, XENT_CPU_THREADS=str(n))
        cmd = [sys.executable, os.path.abspath(__file__), "--child-digests",
               "--shape", f"{rows}x{cols}", "--dtype", ",".join(args.check_dtype)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"determinism child (threads {n}) failed:\n{r.stderr}")
        got[n] = json.loads(r.stdout.strip().splitlines()[-1])
    first = args.check_threads[0]
    bad = 0
    for key in got[first]:
        same = all(got[n][key] == got[first][key] for n in args.check_threads)
        bad += not same
        print(f"  {key:24s} {'identical' if same else 'DIFFERENT'}  {got[first][key][:16]}"
              + ("" if same else "  " + " ".join(got[n][key][:16] for n in args.check_threads)))
    print(f"# determinism: {'OK, bitwise identical' if bad == 0 else f'{bad} cases DIFFER'} "
          f"across XENT_CPU_THREADS={','.join(map(str, args.check_threads))}")
    return bad == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=parse_shape, default=(2048, 32000), help="rows x cols")
    ap.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--torch-threads", type=int, default=None, help="default: --threads")
    ap.add_argument("--xent-threads", type=int, default=None, help="default: --threads")
    ap.add_argument("--no-check", action="store_true", help="skip the determinism check")
    ap.add_argument("--check-only", action="store_true", help="only the determinism check")
    ap.add_argument("--check-threads", default="1,2", help="XENT_CPU_THREADS values to compare")
    ap.add_argument("--check-shape", type=parse_shape, default=None,
                    help="shape of the determinism check (default: --shape)")
    ap.add_argument("--check-dtype", default="fp32,bf16,fp16")
    ap.add_argument("--child-digests", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = [d for d in args.dtype.split(",") if d]
    args.check_dtype = [d for d in args.check_dtype.split(",") if d]
    for d in args.dtype + args.check_dtype:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r} (fp32, bf16, fp16)")
    if args.child_digests:
        return digests(args)
    args.torch_threads = args.torch_threads or args.threads
    args.xent_threads = args.xent_threads or args.threads
    args.check_threads = [int(n) for n in args.check_threads.split(",") if n]
    ok = True
    if not args.check_only:
        bench(args)
    if not args.no_check:
        args.shape = args.check_shape or args.shape
        ok = check(args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
