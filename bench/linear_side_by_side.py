"""The lm head and its loss on one rank, side by side (issues 30 and 38: schedules and peers).

    python3 bench/linear_side_by_side.py --json out.json
    # the peers from wheels (quack-kernels 0.6.5, nvidia-cutlass-dsl 4.7.1 with its cu13 libraries,
    # liger-kernel 0.8.5, cut-cross-entropy 25.1.1): pip first, then the libraries' files over it
    python3 -m pip install -q --no-index --no-deps --target /tmp/site/site-packages WHEELS... \\
        && tar -xJf nvidia_cutlass_dsl_libs_cu13-4.7.1-*.tar.xz -C /tmp/site/site-packages
    PYTHONPATH=/tmp/site/site-packages python3 bench/linear_side_by_side.py --vocab 128256
    python3 bench/linear_side_by_side.py --device cpu --tokens 64 --hidden 32 --vocab 100 \\
        --iters 2 --warmup 1                                   # smoke test, no GPU

Inputs per vocabulary width V: hidden h [T, H] ~ N(0, 1) and weight W [V, H] ~ N(0, s^2 / H),
s = --logit-std (default 2), both leaves that require grad, in --dtype; targets y [T] uniform in
[0, V). The logits h @ W.T are then ~N(0, s^2), independent across the vocabulary, in every row,
and the target is an ordinary column (not favoured): the printout states s, the logits' measured
std and the share of softmax probabilities at or above CCE's gradient filter (its "high"
filter_eps, the dtype's eps / 32: 2^-12 in bf16), since CCE's time depends on it.
A step is forward + backward of the mean loss, producing d_hidden (dH) and d_weight (dW):
  gemm3          the three matmuls alone, no autograd: logits = h @ W.T, dH = G @ W,
                 dW = G.T @ h, with G a preallocated random [T, V] tensor of --dtype: the
                 compute floor
  torch          F.cross_entropy((h @ W.T).float(), y)
  torch + xent (inplace_grad)
                 logits = h @ W.T, then xent.vocab_parallel_cross_entropy(logits, y,
                 inplace_grad=True) (the gradient of the logits is written over them)
  xent default   xent.linear_cross_entropy(h, W, y, max_scratch_bytes=0, grad_mode=--grad-mode):
                 the default budget, the largest of an eighth of the bf16 logits, what the lean
                 schedule needs and 64 MiB (at 8192 tokens and hidden 4096: the lean schedule)
  xent fast (4 GiB budget)
                 the same with max_scratch_bytes = --fast-budget-mib (default 4 GiB): the plan
                 takes the fast schedule (three GEMMs, an fp32 d_weight accumulator) where it fits
                 (docs/linear.md, "Schedules and the budget")
  quack (chunk 8192)
                 quack-kernels' quack.linear_cross_entropy.chunked_linear_cross_entropy(h, W, y,
                 chunk_size=--quack-chunk): CuTe DSL (nvidia-cutlass-dsl); chunk 8192 by default,
                 since at hidden 4096 chunk 4096 fails ("m == n ambiguous"). It must be installed
                 in a folder whose path holds "site-packages" (it fingerprints the code of any
                 module outside one): pip install --target <dir>/site-packages
  liger          Liger-Kernel's liger_kernel.transformers.functional.
                 liger_fused_linear_cross_entropy(h, W, y), its defaults (Triton)
  liger cutedsl sm90
                 Liger-Kernel's CuTe DSL Hopper kernel, liger_kernel.ops.cutedsl.ops.
                 fused_linear_cross_entropy_sm90.liger_fused_linear_cross_entropy_sm90(h, W, y):
                 compute capability 9.0, bf16, T % 128 == 0 and V % 256 == 0 only (elsewhere it
                 raises and the row prints why); it writes the bf16 logits [T, V] in full
  cce (logits ~N(0, s^2))
                 Apple's cut_cross_entropy.linear_cross_entropy(h, W, y), its defaults (impl "cce",
                 filter_eps "high": gradient blocks whose entries are all below the threshold are
                 skipped, so its time depends on the logits' distribution, stated in its name)
quack, liger, liger cutedsl sm90 and cce are skipped on CPU; a row whose package does not import
prints "n/a (why)", and the script goes on. pip install --target leaves the .pth files of that
folder unprocessed when it is only on PYTHONPATH (CuTe DSL puts its `cutlass` package on sys.path
through one): this script processes the .pth files of the PYTHONPATH folders as a site folder's.

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
  extra     one definition for every row: torch.cuda.max_memory_allocated() during one step
            (after reset_peak_memory_stats), minus torch.cuda.memory_allocated() just before it
            (the inputs h, W, y allocated, and gemm3's G; h.grad = W.grad = None), minus the bytes
            of dH and dW, which every row must produce and keep ("dH+dW MiB" in the notes). So
            it is the scratch a step takes beyond its inputs and its two gradients (for gemm3,
            the logits). xent's scratch comes from PyTorch's caching allocator, so it is in it
            like every peer's. The JSON keeps the peak with dH and dW in it ("peak_mib").
            "n/a" on CPU.
  outside   device memory in use outside PyTorch's caching allocator ((total - free) of
            torch.cuda.mem_get_info() less torch.cuda.memory_reserved()) after the measured
            step, minus the same before the row's first call: module loads, a library's own
            cudaMalloc. Shown for every row, added to none ("n/a" on CPU).
  ms back to back  the same --iters steps run back to back with one synchronisation after the
            last, wall time a step: as bench/linear_profile.py and xent_dist_bench time a step
            (the host runs ahead of the device), where "ms" starts each step from an idle device
  xent plan for the xent rows, what xent.linear_cross_entropy_plan says of the same call: the
            schedule (fast or lean), the scratch it takes of its budget, its chunks ("n/a (why)"
            where the installed xent lacks the function); also in the JSON ("plan")
  errors    against float64 on the same device (rows of the logits in chunks of about 1 GiB,
            so it fits beside the float64 copies of W and dW, 3 x V x H x 8 bytes in all):
            the loss's absolute error, and ||x - ref||_F / ||ref||_F for dH and dW, from the
            step whose memory was measured. --no-reference skips it. None for gemm3.
A row that raises (out of memory, a shape a kernel refuses) prints "error: " and the exception.
--only takes row names, or their part before " (": --only "xent default,xent fast,quack".
--json OUT writes the environment and every row.
"""

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import xent  # noqa: E402
from linear_side_by_side_measure import (  # noqa: E402
    MIB, copy_bandwidth, logits_distribution, measure, reference)
from linear_side_by_side_peers import optional, why  # noqa: E402
from linear_side_by_side_steps import gemm3, rows, xent_plan  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
PACKAGES = ("quack-kernels", "nvidia-cutlass-dsl", "liger-kernel", "cut-cross-entropy", "triton")


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def selected(row, only):
    return only is None or row == "gemm3" or row in only or row.split(" (")[0] in only


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
        "\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, action="append",
                    help="vocabulary width per rank (repeatable; 16032, 64128, 128256)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--logit-std", type=float, default=2.0,
                    help="s: W ~ N(0, s^2 / H), so the logits are ~N(0, s^2) (default 2)")
    ap.add_argument("--grad-mode", choices=("fused", "deferred"), default="fused",
                    help="the xent rows' grad_mode")
    ap.add_argument("--fast-budget-mib", type=float, default=4096,
                    help="max_scratch_bytes of the 'xent fast' row in MiB (default 4096)")
    ap.add_argument("--quack-chunk", type=int, default=8192,
                    help="quack's chunk_size (default 8192; at hidden 4096, 4096 fails)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-reference", action="store_true", help="skip the float64 errors")
    ap.add_argument("--only", default="", help="comma-separated row names, or their part "
                    "before ' (' (gemm3 always runs)")
    ap.add_argument("--json", default="", metavar="OUT")
    args = ap.parse_args()
    vocabs = args.vocab or [16032, 64128, 128256]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device).index or 0)
        torch.cuda.init()
    dtype = DTYPES[args.dtype]
    extra = optional(cuda, args)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    env = dict(device=name, dtype=args.dtype, tokens=args.tokens, hidden=args.hidden,
               iters=args.iters, warmup=args.warmup, logit_std=args.logit_std,
               grad_mode=args.grad_mode, fast_budget_mib=args.fast_budget_mib,
               quack_chunk=args.quack_chunk, torch=torch.__version__,
               xent_library=xent.library_path(),
               peers={k: (v if isinstance(v, str) else "ok") for k, v in extra.items()})
    for pkg in PACKAGES:
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    print(f"# linear_side_by_side.py: {name}, {args.dtype}, mean, {args.tokens} tokens, hidden "
          f"{args.hidden}, one rank, torch {torch.__version__}, "
          + ", ".join(f"{pkg} {env[pkg]}" for pkg in PACKAGES[:-1])
          + f"; xent grad_mode {args.grad_mode}; median of {args.iters} steps after "
          f"{args.warmup}", flush=True)
    bandwidth = copy_bandwidth(device, cuda)
    if cuda:
        torch.cuda.empty_cache()  # the copy's 2 GiB, out of every row's memory
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    print(f"# copy bandwidth {bandwidth / 1e9:.1f} GB/s (x floor: over gemm3 + 8 bytes a logit "
          "at it)")
    print("# extra MiB: the step's peak of torch.cuda.max_memory_allocated() over the inputs, "
          "less dH and dW (every row alike); outside MiB: device memory outside PyTorch's "
          "allocator, after the step vs before the row's first call (added to none)")
    print("\n| V | row | ms | x gemm3 | x floor | extra MiB | loss abs err | dH rel err | "
          "dW rel err | outside MiB | xent plan | ms back to back |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    only = {r.strip() for r in args.only.split(",") if r.strip()} if args.only else None
    results, notes = [], []
    for vocab in vocabs:
        gen = torch.Generator(device=device).manual_seed(vocab)
        h = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(dtype)
        w = (torch.randn(vocab, args.hidden, device=device, generator=gen)
             * (args.logit_std * args.hidden ** -0.5)).to(dtype)
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
        grads_bytes = (args.tokens + vocab) * args.hidden * item
        grads_mib = grads_bytes / MIB
        logits_mib = args.tokens * vocab * item / MIB
        std, share, eps = logits_distribution(h, w, dtype)
        notes.append(f"V {vocab}: dH+dW {grads_mib:.1f} MiB (taken off every row's extra), "
                     f"logits in {args.dtype} {logits_mib:.1f} MiB; logits ~N(0, "
                     f"{args.logit_std:g}^2) (measured std {std:.3f}), softmax probabilities "
                     f">= {eps:.3g} (CCE's filter_eps 'high'): {share:.2e} of them")
        table, budgets = rows(h, w, y, args, extra)
        # gemm3's step, with its G, lives through every row: each row's steps alternate with it.
        floor_step = gemm3(h, w, torch.randn(args.tokens, vocab, device=device,
                                             generator=gen).to(dtype))
        for row, step in table.items():
            if not selected(row, only):
                continue
            res = dict(vocab=vocab, row=row, ms=None, ratio=None, extra_mib=None, peak_mib=None,
                       outside_mib=None, loss_err=None, dh_err=None, dw_err=None,
                       dhdw_mib=grads_mib, logits_mib=logits_mib, logits_std=std,
                       paired_ms=None, x_floor=None, error=None, plan=None, b2b_ms=None)
            try:
                if isinstance(step, str):  # a peer that did not import: "n/a (why)"
                    res["error"] = step
                    step = None
                elif row == "gemm3":
                    step = floor_step
                if step is not None and row in budgets:
                    res["plan"] = xent_plan(h, w, y, args, budgets[row])
                if step is not None:
                    res.update(measure(step, h, w, args, cuda, ref, grads_bytes,
                                       paired=None if row == "gemm3" else floor_step))
                if res["ms"] is not None:
                    res["ratio"] = res["ms"] / (res["paired_ms"] or res["ms"])
                if res["paired_ms"] is not None:
                    floor_ms = res["paired_ms"] + 8 * args.tokens * vocab / bandwidth * 1e3
                    res["x_floor"] = res["ms"] / floor_ms
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, not fatal
                res["error"] = "error: " + why(e)
            step = None
            h.grad = w.grad = None
            if cuda:
                torch.cuda.empty_cache()
            results.append(res)
            if res["error"]:
                print(f"| {vocab} | {row} | {res['error']} | | | | | | | | | |", flush=True)
                continue
            print(f"| {vocab} | {row} | {res['ms']:.3f} | {fmt(res['ratio'], '.2f')} | "
                  f"{fmt(res['x_floor'], '.2f')} | {fmt(res['extra_mib'], '.1f')} | "
                  f"{fmt(res['loss_err'], '.1e')} | {fmt(res['dh_err'], '.1e')} | "
                  f"{fmt(res['dw_err'], '.1e')} | {fmt(res['outside_mib'], '.1f')} | "
                  f"{res['plan'] or ''} | {fmt(res['b2b_ms'], '.3f')} |", flush=True)
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
