"""One tensor-parallel training step's loss with xent, checked against PyTorch.

    torchrun --standalone --nproc-per-node 2 examples/train_step.py  # a GPU per rank: NCCL; else Gloo
    torchrun --standalone --nproc-per-node 2 examples/train_step.py --tokens 8192 --vocab 128256

Every rank of the tensor-parallel group holds a slice of the output projection (the vocabulary
split as evenly as it goes, so shards may differ by a column), computes its logits shard and
calls torch.ops.xent.vocab_parallel_cross_entropy with the group's name: the gradient is written
over the logits shard (inplace_grad=True), no rank sees the full vocabulary. The check does what
one would do without xent: all-gather the logits, F.cross_entropy on them, and compare the loss
and the gradients of the hidden states and of this rank's weight shard. Needs libxent_torch.so
(built with -DXENT_WITH_TORCH=ON; `import xent` from python/ finds it, or set XENT_TORCH_LIB).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402  (loads the operators)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32003)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--grad-mode", choices=["fused", "deferred"], default="fused")
    args = p.parse_args()

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks  # a GPU each
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = dist.new_group(list(range(world)))  # the tensor-parallel group: here, every rank
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if not cuda and dtype == torch.float16:
        dtype = torch.float32  # half matmuls on CPU are slow or missing: say so, and what ran
        if dist.get_rank() == 0:
            print("fp16 on CPU: running in fp32 instead", flush=True)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]

    # The same model and batch on every rank (same seed); rank r owns vocabulary rows [lo, hi).
    g = torch.Generator().manual_seed(1234)
    T, H, V = args.tokens, args.hidden, args.vocab
    hidden0 = torch.randn(T, H, generator=g) * 0.5
    weight0 = torch.randn(V, H, generator=g) * H ** -0.5
    target = torch.randint(0, V, (T,), generator=g)
    target[::17] = -100  # some padding tokens
    widths = [V // world + (1 if r < V % world else 0) for r in range(world)]
    lo = sum(widths[:rank])
    hi = lo + widths[rank]

    hidden = hidden0.to(device, dtype).requires_grad_()
    weight = weight0[lo:hi].to(device, dtype).requires_grad_()
    target = target.to(device)

    # --- the xent step: logits shard -> loss -> backward (gradient written over the shard)
    logits = hidden @ weight.t()  # [T, V / world]
    kept = logits.detach().clone()  # for the check only: the step itself never copies them
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = torch.ops.xent.vocab_parallel_cross_entropy(
        logits, target, tp.group_name, label_smoothing=args.label_smoothing,
        grad_mode=args.grad_mode, inplace_grad=True)
    loss.backward()
    dist.all_reduce(hidden.grad, group=tp)  # column-parallel projection: sum over the shards
    if cuda:
        torch.cuda.synchronize()
    t_xent = time.perf_counter() - t0

    # --- the check: what one would do without xent, in fp32 on the gathered logits
    width_max = max(widths)
    padded = torch.full((T, width_max), float("-inf"), device=device, dtype=kept.dtype)
    padded[:, : widths[rank]] = kept
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=tp)
    full = torch.cat([s[:, :w] for s, w in zip(shards, widths)], dim=1).float()
    ref_loss = F.cross_entropy(full, target, label_smoothing=args.label_smoothing)

    h_ref = hidden0.to(device, dtype).float().requires_grad_()
    w_ref = weight0.to(device, dtype).float().requires_grad_()
    F.cross_entropy(h_ref @ w_ref.t(), target, label_smoothing=args.label_smoothing).backward()

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()

    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
    dh = rel(hidden.grad, h_ref.grad)
    dw = rel(weight.grad, w_ref.grad[lo:hi])
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    ok = loss_err < 1e-4 and dh < tol and dw < tol
    line = (f"rank {rank}/{world} {device} {dtype_name} tokens={T} vocab={V} shard=[{lo},{hi}) "
            f"loss={loss.item():.6f} ref={ref_loss.item():.6f} (rel {loss_err:.1e}) "
            f"d_hidden rel {dh:.1e} d_weight rel {dw:.1e} step {t_xent * 1e3:.2f} ms "
            f"{'OK' if ok else 'MISMATCH'}")
    print(line, flush=True)
    okt = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(okt, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    sys.exit(0 if okt.item() == 1 else 1)


if __name__ == "__main__":
    main()
