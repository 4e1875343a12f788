"""TorchTitan's way: a tensor-parallel lm head (ColwiseParallel) whose loss is xent's fused lm head.
The minimal form, without the torchtitan package; examples/titan_train.py is the real integration
(torchtitan 0.3.0's own Trainer and Llama 3 debug model, xent in its loss slot and its lm-head
hook; docs/transformers.md).

    torchrun --nproc-per-node 2 examples/titan_lm_head.py                  # CPU, Gloo
    torchrun --nproc-per-node 2 examples/titan_lm_head.py --device cuda    # a GPU per rank, NCCL

A toy model (embedding, two residual MLP blocks, RMSNorm, a bias-free nn.Linear lm head) whose lm
head is parallelized as TorchTitan does it: ColwiseParallel over a 1-D DeviceMesh, so its weight
is a DTensor sharded on the vocabulary. The loss is xent.linear_cross_entropy(hidden,
model.lm_head.weight, labels): the DTensor weight goes straight in (the mesh gives the group and
the shard's place) and the logits are never made, not even a rank's shard of them whole (a chunk
of rows at a time); the loss comes back as a replicated DTensor and the weight's gradient flows
into the DTensor, sharded. A few AdamW steps on one batch print the loss on rank 0; the first is
checked against F.cross_entropy of the gathered logits (the loss, the gradients of the lm head's
shard and of a block). Run on CPU (Gloo, 2 and 3 ranks), and with --device cuda on one H100 (one
rank, NCCL); not yet on several GPUs. Needs libxent_torch.so (built with -DXENT_WITH_TORCH=ON; `import xent` from python/ finds
it, or set XENT_TORCH_LIB). See docs/transformers.md ("TorchTitan's way") and docs/torch.md.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self, vocab, dim, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.Sequential(*[Block(dim) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def hidden(self, tokens):  # the final norm's output: what the lm head would get
        return self.norm(self.layers(self.tok_embeddings(tokens)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--vocab", type=int, default=1001)  # odd: the two shards differ by a row
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(args.device, (world,))  # Gloo on CPU, NCCL on CUDA
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same model and batches on every rank
    model = ToyLM(args.vocab, args.dim).to(args.device)
    # TorchTitan's lm head plan; use_local_output=False: the logits of the check stay a DTensor.
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)})
    # foreach=False: the parameters are plain tensors and one DTensor, which foreach cannot mix
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # one batch, learnt by heart: the loss falls
    for step in range(args.steps):
        h = model.hidden(inputs)  # [batch, seq, dim], the same on every rank
        loss = xent.linear_cross_entropy(h, model.lm_head.weight, labels)  # no logits

        if step == 0:  # without xent: gather the logits, F.cross_entropy on them
            checked = {"lm_head.weight": model.lm_head.weight,
                       "layers.0.w1.weight": model.layers[0].w1.weight}
            logits = model.lm_head(h).full_tensor()  # [batch, seq, vocab] on every rank
            want = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            want_grads = torch.autograd.grad(want, list(checked.values()), retain_graph=True)
            torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=1e-6)

        opt.zero_grad()
        loss.backward()  # lm_head.weight.grad: this rank's rows; the rest: the same everywhere

        if step == 0:
            for (name, param), w in zip(checked.items(), want_grads):
                got = param.grad
                if isinstance(got, DTensor):  # the lm head's: compare this rank's shard
                    got, w = got.to_local(), w.to_local()
                torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, name=name: f"{name}: {m}")
            if rank == 0:
                print(f"step 0 checked on every rank: xent {loss.full_tensor().item():.6f}, "
                      f"F.cross_entropy of the gathered logits {want.item():.6f}; the gradients of "
                      f"each rank's lm head shard ({model.lm_head.weight.to_local().shape[0]} of "
                      f"{args.vocab} rows on rank 0) and of layers.0.w1 match", flush=True)
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.full_tensor().item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
