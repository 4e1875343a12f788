"""Vocab-parallel cross-entropy at TP > 1, side by side: xent through each of its three entry
points against Megatron-core's own functions, PyTorch's loss_parallel() and Liger-Kernel's.

    torchrun --standalone --nproc-per-node 2 bench/tp_side_by_side.py --vocab 128256 --vocab 151936

One process per GPU, each holding its equal share of the vocabulary of logits [S, B, V/tp]
(Megatron's layout, S x B tokens, B = 1) in bf16, as a leaf that requires grad. Each
implementation's step is the mean loss over tokens (per-token losses reduced with .mean() where
an implementation returns those) and torch.autograd.grad for the logits:
  xent            xent.vocab_parallel_cross_entropy(logits, target, group): the defaults, the
                  mean over tokens inside
  xent.megatron   xent.megatron.vocab_parallel_cross_entropy(logits, target, 0.0, group)
  xent.dtensor    the same on a DTensor sharded on the vocabulary
  megatron        megatron.core.tensor_parallel.vocab_parallel_cross_entropy (unfused)
  megatron.fused  megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy
  loss_parallel   with torch.distributed.tensor.parallel.loss_parallel(): F.cross_entropy on the
                  DTensor, backward inside the context
  liger           liger_kernel's LigerVocabParallelCEFunction (PyTorch's smoothing formula)
Those whose package is missing are skipped with the reason. Printed per implementation: the time
of a step (20 steps back to back between CUDA events, the median of --reps, slowest rank), its
extra device memory (peak during a step minus what was allocated before it: the gradient of the
logits included, V/tp x tokens in bf16, which every implementation must produce), and its loss
against xent's (relative difference). --json FILE writes it all (rank 0).
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402
import xent.megatron  # noqa: E402


def slowest(x, device):
    t = torch.tensor([float(x)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def implementations(group, mesh):
    """name -> (make_loss(logits, target) -> per-token loss, None), (None, why it is missing), or
    (step(logits, target) -> mean loss, "step") where the gradient must be taken inside."""
    from torch.distributed.tensor import DTensor, Shard
    impls = {}
    # The plain entry points as their users call them: the mean over tokens inside (grad_output
    # is then the scalar 1, which the fused gradient needs no pass for). Megatron's entry point
    # returns per-token losses, which the caller reduces (xent.megatron then runs deferred).
    impls["xent"] = (lambda x, t: xent.vocab_parallel_cross_entropy(x, t, group), None)
    impls["xent.megatron"] = (
        lambda x, t: xent.megatron.vocab_parallel_cross_entropy(x, t, 0.0, group), None)
    impls["xent.dtensor"] = (
        lambda x, t: xent.vocab_parallel_cross_entropy(
            DTensor.from_local(x, mesh, [Shard(2)], run_check=False), t).to_local(), None)
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        tp = parallel_state.get_tensor_model_parallel_group()
        impls["megatron"] = (lambda x, t: mcore_ce(x, t), None)
        impls["megatron.fused"] = (lambda x, t: fused_vocab_parallel_cross_entropy(x, t, tp), None)
    except ImportError as e:
        impls["megatron"] = impls["megatron.fused"] = (None, f"megatron-core: {e}")

    def loss_parallel_step(x, t):
        # Its backward must run inside the context too: the whole step is here.
        from torch.distributed.tensor.parallel import loss_parallel
        d = DTensor.from_local(x.flatten(0, 1), mesh, [Shard(1)], run_check=False)
        with loss_parallel():
            loss = F.cross_entropy(d, t.flatten())
            torch.autograd.grad(loss, [x])
        return loss.to_local()
    impls["loss_parallel"] = (loss_parallel_step, "step")
    try:
        from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction
        impls["liger"] = (lambda x, t: LigerVocabParallelCEFunction.apply(
            x, t, group, -100, 0.0, "pytorch", "global"), None)
    except ImportError as e:
        impls["liger"] = (None, f"liger-kernel: {e}")
    return impls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, action="append", help="global vocabulary (repeatable)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated implementation names")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    vocabs = args.vocab or [128256, 151936]

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (world,))
    impls = implementations(group, mesh)
    if args.only:
        impls = {k: v for k, v in impls.items() if k in args.only.split(",")}
    if rank == 0:
        print(f"# tp_side_by_side.py: TP {world}, {torch.cuda.get_device_name(device)}, bf16, "
              f"mean, forward + backward, {args.tokens} tokens, torch {torch.__version__}, "
              f"slowest rank, median of {args.reps} x {args.iters} steps", flush=True)
        print(f"# {'vocab':>7s} {'implementation':>15s} {'ms':>8s} {'x xent':>7s} "
              f"{'extra MiB':>10s} {'loss rel diff':>14s}", flush=True)
    results = []
    for vocab in vocabs:
        width = vocab // world
        if width * world != vocab:
            sys.exit(f"tp_side_by_side.py: vocab {vocab} does not split evenly over {world} ranks "
                     f"(Megatron's layout needs equal shards)")
        g = torch.Generator(device=device).manual_seed(1 + rank)
        x = torch.randn(args.tokens, 1, width, device=device, dtype=torch.bfloat16,
                        generator=g).requires_grad_()
        t = torch.randint(0, vocab, (args.tokens, 1), device=device,
                          generator=torch.Generator(device=device).manual_seed(7))
        reference = None
        for name, (make_loss, why) in impls.items():
            if make_loss is None:
                if rank == 0:
                    print(f"  {vocab:7d} {name:>15s}  skipped: {why}", flush=True)
                continue

            def step():
                if why == "step":  # the function is the whole step
                    return make_loss(x, t)
                loss = make_loss(x, t).float().mean()
                torch.autograd.grad(loss, [x])
                return loss
            loss = step()  # warm-up (and compiles, where an implementation compiles)
            for _ in range(2):
                step()
            value = loss.detach().double()
            if reference is None:
                reference = value
            diff = slowest(abs((value - reference) / reference).item(), device)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize()
            extra = slowest((torch.cuda.max_memory_allocated(device) - before) / 2**20, device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(args.reps):
                dist.barrier()
                torch.cuda.synchronize()
                start.record()
                for _ in range(args.iters):
                    step()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / args.iters)
            ms = slowest(statistics.median(times), device)
            base = next((r["ms"] for r in results
                         if r["vocab"] == vocab and r["implementation"] == "xent"), ms)
            results.append(dict(vocab=vocab, tokens=args.tokens, implementation=name, ms=ms,
                                extra_mib=extra, loss_rel_diff=diff))
            if rank == 0:
                print(f"  {vocab:7d} {name:>15s} {ms:8.3f} {ms / base:7.2f} {extra:10.0f} "
                      f"{diff:14.2e}", flush=True)
        x = t = None  # free them before the next vocabulary
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tp=world, device=torch.cuda.get_device_name(device),
                           torch=torch.__version__, results=results), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
