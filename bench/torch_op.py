"""The torch op against the raw C++ API and F.cross_entropy: time on the GPU and on the host.

    torchrun --standalone --nproc-per-node 2 bench/torch_op.py --shape 8192x128256 --shape 8192x64128
    torchrun ... bench/torch_op.py --raw-json results/llama3-tp2.json   # ratios to xent_dist_bench

One process per GPU, the vocabulary split evenly over the ranks (a shape is tokens x global
vocab). For each shape and each way of calling the op (`copy`: inplace_grad=False, the default;
`inplace`: inplace_grad=True, fused; with --kinds also `scaled`: in place, the loss divided by 8
before backward, `scaled_hint`: the same with grad_scale=1/8, and `copy_ops` / `inplace_ops`:
through torch.ops.xent.* instead of xent._C), forward + backward
(torch.autograd.grad of the loss for the logits) is timed three ways, each the slowest rank's
median:

  idle    one step alone from an idle GPU, CUDA events around it, the ranks starting together
          (as xent_dist_bench --idle): how a training step reaches its loss, host latency
          included wherever it leaves the GPU waiting.
  b2b     20 steps back to back between two events, divided by 20.
  host    time.perf_counter around the forward call and around the backward call, steps in a
          row while the GPU is kept busy with queued work (no launch waits for the GPU): the host
          cost of a call. Measured the same way for F.cross_entropy on this rank's shard (same
          tensors).

With --raw-json (the JSON of `xent_dist_bench --json` for the same shapes and ranks, measured on
the same machine; repeatable), each GPU time is also shown as a ratio to the raw API's forward +
backward timed the same way: `idle` to a run with `--idle`, `b2b` to a run without (back to
back). With only a back-to-back file, idle is shown against it too (the ratio then also counts
the launch latency that the raw figure hides).
The cost of starting from idle, idle minus b2b, is printed for the op, the raw API and
F.cross_entropy on this rank's shard (fwd + bwd, same harness): the host latency that a step
from an idle GPU exposes, which no call from Python avoids.
--profile prints torch.profiler's table of the CPU time per call (the largest totals first).
--json FILE writes every number (rank 0).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402


# The ways of calling the op (--kinds): (inplace_grad, the factor the loop scales the loss by,
# grad_scale, through torch.ops). `scaled`: (loss / 8) backward with xent not told, so backward
# rescales the gradient (two more passes); `scaled_hint`: the same loop with grad_scale = 1/8 (no
# such pass). `copy_ops` and `inplace_ops`: as `copy` and `inplace`, with `xent._direct = None`,
# so that `import xent` calls torch.ops.xent.* rather than xent._C (docs/torch.md).
CALLS = {
    "copy": (False, 1.0, 1.0, False),
    "inplace": (True, 1.0, 1.0, False),
    "scaled": (True, 0.125, 1.0, False),
    "scaled_hint": (True, 0.125, 0.125, False),
    "copy_ops": (False, 1.0, 1.0, True),
    "inplace_ops": (True, 1.0, 1.0, True),
}


def parse_shape(s):
    t, v = s.lower().split("x")
    return int(t), int(v)


def slowest(x, device):
    t = torch.tensor([float(x)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def busy(device, ms=30.0):
    """Queues a kernel that keeps the GPU busy for about `ms` (host calls then never wait)."""
    torch.cuda._sleep(int(ms * 1e-3 * torch.cuda.clock_rate(device) * 1e6))


class Case:
    """One shape on this rank: its logits shard and targets, and the steps to time."""

    def __init__(self, tokens, vocab, dtype, device, group):
        world, rank = dist.get_world_size(), dist.get_rank()
        width = vocab // world + (1 if rank < vocab % world else 0)
        g = torch.Generator(device=device).manual_seed(1 + rank)
        self.tokens, self.vocab, self.width = tokens, vocab, width
        self.group, self.device = group, device
        self.target = torch.randint(0, vocab, (tokens,), device=device,
                                    generator=torch.Generator(device=device).manual_seed(7))
        self.local_target = self.target.remainder(width)
        base = torch.randn(tokens, width, device=device, dtype=dtype, generator=g)
        # Not in place: a leaf that requires grad (read only; the gradient is a new tensor).
        self.leaf = base.clone().requires_grad_()
        # In place: a non-leaf (a layer's output), whose storage takes the gradient. Each step
        # runs on the previous step's gradient: the same work, finite values.
        self.src = base.clone().requires_grad_()
        self.nonleaf = self.src * 1.0
        del base

    def loss_fn(self, kind):
        """(the logits, a function that returns the step's loss) for this way of calling."""
        inplace, loss_scale, grad_scale, via_ops = CALLS[kind]
        x = self.nonleaf if inplace else self.leaf

        def loss():
            direct = xent._direct
            if via_ops:
                xent._direct = None
            try:
                out = xent.vocab_parallel_cross_entropy(x, self.target, self.group,
                                                        inplace_grad=inplace, grad_scale=grad_scale)
            finally:
                xent._direct = direct
            return out * loss_scale if loss_scale != 1.0 else out
        return x, loss

    def op_step(self, kind):
        x, loss = self.loss_fn(kind)
        return lambda: torch.autograd.grad(loss(), [x])

    def torch_step(self):
        x = self.leaf

        def step():
            return torch.autograd.grad(F.cross_entropy(x, self.local_target), [x])
        return step

    def host_times(self, fn_loss, reps):
        """Median host microseconds of the forward call and of the backward call, `reps` steps
        in a row behind one long queued kernel (the GPU stays busy, no call waits for it)."""
        fwd, bwd = [], []
        torch.cuda.synchronize()
        busy(self.device, ms=400.0)
        for _ in range(reps):
            t0 = time.perf_counter()
            loss = fn_loss()
            t1 = time.perf_counter()
            torch.autograd.grad(loss, [self._x])
            t2 = time.perf_counter()
            fwd.append((t1 - t0) * 1e6)
            bwd.append((t2 - t1) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(fwd), statistics.median(bwd)

    def host_op(self, kind, reps):
        self._x, loss = self.loss_fn(kind)
        return self.host_times(loss, reps)

    def host_torch(self, reps):
        self._x = self.leaf
        return self.host_times(lambda: F.cross_entropy(self._x, self.local_target), reps)


def start_together(device):
    """Returns at the same instant on every rank of one host, as xent_dist_bench --idle does:
    the ranks agree on a start a little after the latest of their clocks and spin until it (a
    barrier alone releases them tens of microseconds apart). The wait is capped at 10 ms."""
    now = time.time() * 1e6
    latest = slowest(now, device)
    start = min(latest + 1000.0, now + 10000.0)
    while time.time() * 1e6 < start:
        pass


def time_idle(step, reps, device):
    out = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize()
        start_together(device)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        out.append(start.elapsed_time(stop))
    return statistics.median(out)


def time_b2b(step, reps, iters=20):
    out = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            step()
        stop.record()
        stop.synchronize()
        out.append(start.elapsed_time(stop) / iters)
    return statistics.median(out)


def raw_times(paths, world):
    """{"idle": {...}, "b2b": {...}}: (tokens, width) -> fastest forward + backward of the raw API
    in xent_dist_bench's JSON files, by how each was timed (--idle or not)."""
    out = {"idle": {}, "b2b": {}}
    for path in paths or []:
        with open(path) as f:
            doc = json.load(f)
        if doc["env"]["ranks"] != world:
            sys.exit(f"torch_op.py: --raw-json {path} was measured on {doc['env']['ranks']} "
                     f"ranks, this run has {world}")
        best = out["idle" if doc["config"].get("idle") else "b2b"]
        for r in doc["results"]:
            key = (r["tokens"], r["vocab_per_rank"])
            best[key] = min(best.get(key, float("inf")), r["total_ms"])
    return out


def profile(case, kind, rank, trace):
    from torch.profiler import ProfilerActivity, profile as prof
    step = case.op_step(kind)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    if rank == 0 and trace:
        p.export_chrome_trace(f"{trace}-{kind}-{case.tokens}x{case.vocab}.json")
    if rank == 0:
        print(f"# torch.profiler, {kind}, 5 steps, {case.tokens} x {case.vocab}: CPU time per "
              f"call (us) of the xent operators and what they call", flush=True)
        rows = []
        for e in p.key_averages():
            if e.count == 0:
                continue
            rows.append((e.key, e.count, e.self_cpu_time_total / e.count,
                         e.cpu_time_total / e.count))
        rows.sort(key=lambda r: -r[3] * r[1])
        print(f"#   {'name':60s} {'calls':>6s} {'self us':>9s} {'total us':>9s}")
        for name, n, self_us, tot_us in rows[:25]:
            print(f"#   {name[:60]:60s} {n:6d} {self_us:9.1f} {tot_us:9.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=parse_shape,
                    help="tokens x global vocab, e.g. 8192x128256 (repeatable)")
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kinds", default="copy,inplace",
                    help="ways of calling the op, of " + ", ".join(CALLS) + " (copy,inplace)")
    ap.add_argument("--raw-json", action="append",
                    help="xent_dist_bench --json output, with --idle or not (repeatable)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", default="", help="with --profile: rank 0's Chrome trace, this prefix")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    shapes = args.shape or [(8192, 128256)]

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        sys.exit("torch_op.py: needs a GPU per rank")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    raw = raw_times(args.raw_json, world)
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in CALLS:
            sys.exit(f"torch_op.py: --kinds: {kind!r} is not one of {', '.join(CALLS)}")

    if rank == 0:
        print(f"# torch_op.py: {world} rank(s), {torch.cuda.get_device_name(device)}, "
              f"{args.dtype}, mean, torch {torch.__version__}, slowest rank, median of "
              f"{args.reps}", flush=True)
        print(f"# {'tokens':>7s} {'vocab':>7s} {'width':>7s} {'call':>11s} {'raw idle':>8s} "
              f"{'idle ms':>8s} {'ratio':>6s} {'raw b2b':>8s} {'b2b ms':>8s} {'ratio':>6s} "
              f"{'fwd us':>7s} {'bwd us':>7s} {'F.ce fwd':>8s} {'F.ce bwd':>8s}", flush=True)
    results = []
    for tokens, vocab in shapes:
        case = Case(tokens, vocab, dtype, device, group)
        ce_step = case.torch_step()
        for _ in range(5):
            ce_step()
        ce_idle = slowest(time_idle(ce_step, args.reps, device), device)
        ce_b2b = slowest(time_b2b(ce_step, args.reps), device)
        for kind in kinds:
            step = case.op_step(kind)
            for _ in range(5):
                step()
            idle = slowest(time_idle(step, args.reps, device), device)
            b2b = slowest(time_b2b(step, args.reps), device)
            hf, hb = case.host_op(kind, args.reps)
            tf, tb = case.host_torch(args.reps)
            hf, hb, tf, tb = (slowest(v, device) for v in (hf, hb, tf, tb))
            key = (tokens, vocab // world + (1 if vocab % world else 0))
            rb = raw["b2b"].get(key)
            ri = raw["idle"].get(key, rb)
            res = dict(tokens=tokens, vocab=vocab, width=case.width, call=kind,
                       raw_idle_ms=raw["idle"].get(key), raw_b2b_ms=rb, idle_ms=idle,
                       b2b_ms=b2b, host_fwd_us=hf, host_bwd_us=hb, torch_host_fwd_us=tf,
                       torch_host_bwd_us=tb, torch_idle_ms=ce_idle, torch_b2b_ms=ce_b2b)
            results.append(res)
            if rank == 0:
                def cols(raw_ms, ms):
                    if not raw_ms:
                        return f"{'-':>8s} {ms:8.3f} {'-':>6s}"
                    return f"{raw_ms:8.3f} {ms:8.3f} {ms / raw_ms:6.3f}"
                print(f"  {tokens:7d} {vocab:7d} {case.width:7d} {kind:>11s} {cols(ri, idle)} "
                      f"{cols(rb, b2b)} {hf:7.1f} {hb:7.1f} {tf:8.1f} {tb:8.1f}", flush=True)
        if rank == 0:
            key = (tokens, vocab // world + (1 if vocab % world else 0))
            ri, rb = raw["idle"].get(key), raw["b2b"].get(key)
            rs = f"{(ri - rb) * 1e3:.1f}" if ri and rb else "-"
            ops = ", ".join(f"{r['call']} {(r['idle_ms'] - r['b2b_ms']) * 1e3:.1f}"
                            for r in results if r["tokens"] == tokens and r["vocab"] == vocab)
            print(f"#   from idle, us over b2b: op {ops}; raw API {rs}; F.cross_entropy on the "
                  f"shard {(ce_idle - ce_b2b) * 1e3:.1f} ({ce_idle:.3f} / {ce_b2b:.3f} ms)",
                  flush=True)
        if args.profile:
            for kind in kinds:
                profile(case, kind, rank, args.trace)
        del case
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ranks=world, device=torch.cuda.get_device_name(device),
                           dtype=args.dtype, torch=torch.__version__, results=results), f,
                      indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
