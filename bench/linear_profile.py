"""Where the fused lm head's step spends its time: xent.linear_cross_entropy forward + backward
under torch.profiler, the device time of each kernel family (cuBLASLt GEMMs by shape, xent's
kernels, copies and memsets) summed over --iters steps and shown per step, beside the step's
wall time. What the issue's "limit explained with profiler figures" asks for. On CUDA also the
device's busy time (the union of the spans: where programmatic launch makes a kernel's span
start inside its predecessor's, the overlap counts once), its idle time between the first and
the last kernel, and the longest idle gaps with the kernels around them.

    XENT_TORCH_LIB=build/src/torch/libxent_torch.so PYTHONPATH=python \\
        python3 bench/linear_profile.py --vocab 128256 [--max-scratch-mib 256] [--grad-mode fused]
    # TP > 1: one process per GPU over NCCL, each with its V / tp rows of the weight (V a
    # multiple of tp); the table is rank 0's, its NCCL kernels included, and every rank's wall time
    torchrun --standalone --nproc-per-node 2 bench/linear_profile.py --vocab 128256

Beside it, unless --no-unfused, the unfused step that the fused lm head must beat, timed the same
way: logits = hidden @ W^T in the inputs' dtype, xent.vocab_parallel_cross_entropy(inplace_grad=
True) over the group, backward, and at TP > 1 d_hidden all-reduced in its dtype (as Megatron's
column-parallel lm head does): "matmul + xent op", and the fused step's ratio to it (the slowest
rank's of each).

On CPU (--device cpu, small shapes) it runs and prints the CPU operators instead: a smoke test.
"""

import argparse
import collections
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
import xent  # noqa: E402


def family(name):
    """A kernel's family: GEMMs together (cuBLASLt's names carry tile shapes), xent's by name."""
    low = name.lower()
    if "gemm" in low or "cutlass" in low or "sm90_xmma" in low or "nvjet" in low:
        return "GEMM " + name[:70]  # the kernel's name tells its tile shape: one row per GEMM kind
    if "xent" in low:  # "void xent::cuda::(anonymous namespace)::stats_kernel<...>(...)"
        name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
        return name.split("(")[0].split("<")[0].strip()
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return name.split("(")[0].split("<")[0].strip()[:60]


def busy_and_gaps(spans):
    """spans: (start_ns, end_ns, name) of device events. The nanoseconds covered by their union,
    and the gaps between its intervals, longest first: (gap_ns, the name that ends before it,
    the name that starts after it)."""
    busy, gaps = 0, []
    lo = hi = last = None
    for start, end, name in sorted(spans):
        if hi is None or start > hi:
            if hi is not None:
                busy += hi - lo
                gaps.append((start - hi, last, name))
            lo, hi, last = start, end, name
        elif end > hi:
            hi, last = end, name
    if hi is not None:
        busy += hi - lo
    return busy, sorted(gaps, key=lambda g: -g[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--grad-mode", choices=["fused", "deferred"], default="fused")
    p.add_argument("--max-scratch-mib", "--max-chunk-mib", type=int, default=0,
                   help="max_scratch_bytes in MiB (0: the default budget)")
    p.add_argument("--schedule", choices=["auto", "fast", "lean"], default="auto")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-unfused", action="store_true",
                   help="skip the unfused step (matmul + xent op) timed beside the fused one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    group, rank, tp = None, 0, 1
    if "RANK" in os.environ:  # torchrun: one rank per GPU, the vocabulary split over them
        import torch.distributed as dist
        rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if a.device == "cpu":  # Gloo: a smoke test
            dist.init_process_group("gloo")
        else:
            a.device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
            torch.cuda.set_device(a.device)
            dist.init_process_group("nccl", device_id=torch.device(a.device))
        group = dist.group.WORLD
        if a.vocab % tp:
            sys.exit(f"--vocab {a.vocab} is not a multiple of the {tp} ranks")
    width = a.vocab // tp
    gen = torch.Generator(device=a.device).manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, device=a.device, generator=gen).to(dt).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device=a.device, generator=gen) * 2 * a.hidden ** -0.5
         )[rank * width:(rank + 1) * width].to(dt).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), device=a.device, generator=gen)
    cuda = a.device.startswith("cuda")

    def step():
        h.grad = w.grad = None
        loss = xent.linear_cross_entropy(h, w, y, group, vocab_start=rank * width,
                                         vocab_size=a.vocab, grad_mode=a.grad_mode,
                                         max_scratch_bytes=a.max_scratch_mib << 20,
                                         schedule=a.schedule)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return loss.detach()

    def unfused_step():
        h.grad = w.grad = None
        loss = xent.vocab_parallel_cross_entropy(h @ w.T, y, group, vocab_start=rank * width,
                                                 vocab_size=a.vocab, inplace_grad=True)
        loss.backward()
        if group is not None:  # d_hidden summed over the ranks in its dtype, as Megatron's
            torch.distributed.all_reduce(h.grad, group=group)
        if cuda:
            torch.cuda.synchronize()
        return loss.detach()

    def wall(fn):
        """(ms a step over --iters steps, the first step's loss)."""
        loss = fn().item()  # buffers grown, algorithms chosen
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / a.iters, loss

    wall_ms, fused_loss = wall(step)
    unfused_ms, unfused_loss = (None, None) if a.no_unfused else wall(unfused_step)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    # One step traced and dropped first: the ranks enter the profiler at different times, and that
    # step's collectives would count the wait for the last rank as device time.
    sched = torch.profiler.schedule(wait=0, warmup=1, active=a.iters)
    with torch.profiler.profile(activities=acts, schedule=sched) as prof:
        for i in range(a.iters + 1):
            step()
            if i < a.iters:  # a step after the last would end the cycle and start another
                prof.step()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        t = e.device_time_total if cuda else e.self_cpu_time_total
        if t <= 0 or (cuda and e.device_type != torch.autograd.DeviceType.CUDA):
            continue
        f = per[family(e.key)]
        f[0] += t / 1e3 / a.iters
        f[1] += e.count // a.iters
    plan = xent.linear_cross_entropy_plan(h, w, y, group, vocab_start=rank * width,
                                          vocab_size=a.vocab, grad_mode=a.grad_mode,
                                          max_scratch_bytes=a.max_scratch_mib << 20,
                                          schedule=a.schedule)
    walls, unfused = [wall_ms], [unfused_ms]
    if group is not None:
        import torch.distributed as dist
        walls, unfused = [None] * tp, [None] * tp
        dist.all_gather_object(walls, wall_ms, group=group)
        dist.all_gather_object(unfused, unfused_ms, group=group)
        dist.destroy_process_group()
        if rank != 0:
            return
    print(f"# {a.device}, {a.dtype}, {a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab} "
          f"({width} a rank, tp {tp}), {a.grad_mode}, plan {plan['schedule']} "
          f"({plan['scratch_bytes'] / 2**20:.0f} MiB of a {plan['budget'] / 2**20:.0f} MiB budget, "
          f"chunks of {plan['chunk_rows']} rows x {plan['chunk_cols']} columns): "
          + ", ".join(f"{ms:.2f}" for ms in walls) + " ms a step (each rank's wall time)")
    if unfused_ms is not None:
        print("# matmul + xent op (inplace_grad" + (", d_hidden all-reduced" if tp > 1 else "")
              + "): " + ", ".join(f"{ms:.2f}" for ms in unfused) + " ms a step (each rank's); "
              f"fused / unfused {max(walls) / max(unfused):.3f} (the slowest ranks'); loss "
              f"{fused_loss:.6f} fused, {unfused_loss:.6f} unfused (logits rounded to "
              f"{a.dtype} there)")
    print("| kernels | ms a step | launches a step |\n|---|---|---|")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {name} | {ms:.3f} | {n} |")
    gemm = sum(ms for name, (ms, _) in per.items() if name.startswith("GEMM "))
    print(f"| all GEMMs | {gemm:.3f} | |\n| all kernels | {sum(v[0] for v in per.values()):.3f} | |")
    if not cuda:
        return
    spans = [(e.start_ns(), e.end_ns(), family(e.name()))
             for e in prof.profiler.kineto_results.events()
             if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    if not spans:
        return
    busy, gaps = busy_and_gaps(spans)
    window = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    print(f"\n# device busy {busy / 1e6 / a.iters:.3f} ms a step, idle "
          f"{(window - busy) / 1e6 / a.iters:.3f} ms a step between the first kernel and the last "
          f"(steps end in a host synchronisation: their gaps between steps count)")
    print("| idle gap | ms | after | before |\n|---|---|---|---|")
    for i, (gap, before, after) in enumerate(gaps[:8]):
        print(f"| {i + 1} | {gap / 1e6:.3f} | {before} | {after} |")


if __name__ == "__main__":
    main()
