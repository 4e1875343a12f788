"""Host time of one call of the op: xent._C against torch.ops.xent.* and F.cross_entropy.

    XENT_TORCH_LIB=build/src/torch/libxent_torch.so PYTHONPATH=python python3 bench/host_call.py

Tiny tensors ([rows, cols] float32, no gradient by default), so that the kernels cost almost
nothing and the figure is the call itself: the Python wrapper, argument passing, checks, the
group and layout lookups and the output allocations. The three ways are interleaved in rounds
(each round times `--calls` calls of each), and the median round is printed, in microseconds per
call. --device cuda times the same on the GPU (launches included, no synchronisation per call).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import xent


def per_call_us(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--cols", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--grad", action="store_true", help="logits require grad (forward only)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if xent._direct is None:
        raise SystemExit("host_call.py: xent._C is not built or did not load: nothing to compare")

    x = torch.randn(args.rows, args.cols, device=args.device).requires_grad_(args.grad)
    t = torch.randint(0, args.cols, (args.rows,), device=args.device)
    direct = xent._direct

    def via_ops():
        xent._direct = None
        try:
            return xent.vocab_parallel_cross_entropy(x, t)
        finally:
            xent._direct = direct

    ways = {
        "xent (xent._C)": lambda: xent.vocab_parallel_cross_entropy(x, t),
        "xent (torch.ops)": via_ops,
        "F.cross_entropy": lambda: F.cross_entropy(x, t),
    }
    times = {name: [] for name in ways}
    for fn in ways.values():  # warm-up
        per_call_us(fn, args.calls // 10 + 1)
    for _ in range(args.rounds):
        for name, fn in ways.items():
            times[name].append(per_call_us(fn, args.calls))
    if args.device != "cpu":
        torch.cuda.synchronize()
    print(f"# host_call.py: [{args.rows}, {args.cols}] float32 on {args.device}, "
          f"requires_grad={args.grad}, torch {torch.__version__}, median of {args.rounds} rounds "
          f"of {args.calls} calls")
    for name, v in times.items():
        print(f"  {name:18s} {statistics.median(v):7.2f} us per call")


if __name__ == "__main__":
    main()
