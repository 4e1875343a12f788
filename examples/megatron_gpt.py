"""Megatron-core's own GPTModel trained with tensor parallelism, three ways from the same weights
and data, step for step:

  megatron        Megatron's own loss (the output layer's logits, vocab_parallel_cross_entropy);
  megatron_seed2  the same from other initial weights (the spread of Megatron's own curve);
  xent            xent.megatron.patch(): Megatron's logits, xent's vocab-parallel loss;
  xent_fused      xent.megatron.patch(fused_lm_head=True): no logits, xent.linear_cross_entropy
                  on the output layer's weight shard and the final hidden states.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --out tp2.json
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --sequence-parallel --out tp2_sp.json
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --device cpu --tiny   # Gloo, seconds

The model is megatron-core's local layer spec (no TransformerEngine, no Apex), bf16 with
Megatron's mixed-precision Adam (fp32 main weights, get_megatron_optimizer) behind Megatron's
DistributedDataParallel, tensor parallel over every rank. By default 8 layers, hidden 2048 and
Llama 3's vocabulary of 128256, 4 x 2048 = 8192 tokens a step: the lm head is a third of the
model's FLOPs. The data is a fixed random bigram process over 2048 tokens spread over the whole
vocabulary (each has 4 equally likely successors: the loss can fall to ln 4 = 1.39), with
Megatron's loss mask hiding a tenth of the positions; the same batches in every run.

Before training, one step of the `megatron` weights checks agreement (--check, on by default):
each way's loss and gradients against float64 from the gathered logits (those of the output
layer, in bf16, for Megatron and xent; hidden @ weight.T in float64 for the fused head), written
to the JSON with each run's losses, step times and peak memory. On the CPU (--device cpu, Gloo)
the model stays float32 and a torch Adam stands in for Megatron's optimizer, whose buffers live
on the GPU; that mode is for the test (tests/python/test_megatron_gpt.py), not for measuring.

Megatron's model and optimizer, and the shims that run them on the CPU, are in
megatron_gpt_model.py beside this file.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

# tests/python/test_megatron_gpt.py imports cpu_shims and sequence_parallel_norm from here
from megatron_gpt_model import cpu_shims, gpt_model, sequence_parallel_norm, trainer  # noqa: F401

RUNS = ["megatron", "megatron_seed2", "xent", "xent_fused"]
WAYS = {"megatron": None, "megatron_seed2": None, "xent": "logits", "xent_fused": "fused"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, hidden 64, vocab 512, 4 x 64 tokens, 30 steps (for tests)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences a step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10,
                   help="steps left out of the step time's median")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=50, help="steps of the lr's linear warm-up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tied", action="store_true", help="share the embedding and output weights")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the first step's agreement check")
    p.add_argument("--out", default="", help="JSON of the results (rank 0 writes it)")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.hidden, a.heads, a.vocab, a.seq, a.batch = 2, 64, 4, 512, 64, 4
        a.steps, a.warmup, a.lr, a.lr_warmup = min(a.steps, 30), 2, 1e-2, 2
    a.runs = a.runs.split(",")
    bad = [r for r in a.runs if r not in RUNS]
    if bad:
        p.error(f"--runs {','.join(bad)}: not among {','.join(RUNS)}")
    return a


# ============================================================================ the data


def bigram_batches(args):
    """[steps + 1, batch, seq + 1] token ids of a fixed random bigram process (the same on every
    rank and in every run), and Megatron's loss mask [steps + 1, batch, seq]."""
    g = torch.Generator().manual_seed(1234)
    active = torch.randperm(args.vocab, generator=g)[:min(2048, args.vocab // 8)]
    successors = torch.randint(0, len(active), (len(active), 4), generator=g)
    n = (args.steps + 1) * args.batch
    state = torch.randint(0, len(active), (n,), generator=g)
    seqs = torch.empty(n, args.seq + 1, dtype=torch.long)
    for i in range(args.seq + 1):
        seqs[:, i] = state
        state = successors[state, torch.randint(0, 4, (n,), generator=g)]
    mask = torch.rand(n, args.seq, generator=g) > 0.1
    shape = (args.steps + 1, args.batch)
    return active[seqs].view(*shape, -1), mask.view(*shape, -1)


# ============================================================================ the model


@contextlib.contextmanager
def way_of(name):
    import xent.megatron
    way = WAYS[name]
    if way is not None:
        xent.megatron.patch(fused_lm_head=way == "fused")
    try:
        yield
    finally:
        xent.megatron.unpatch()


def positions(args, device):
    """The position ids and the causal attention mask, the same for every batch."""
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    causal = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device=device).triu(1)
    return pos, causal


def inputs(tokens, mask, step, device):
    """Step `step`'s tokens, labels and loss mask."""
    seqs = tokens[step].to(device)
    return seqs[:, :-1], seqs[:, 1:], mask[step].to(device)


def masked_mean(per_token, mask):
    return (per_token.float() * mask).sum() / mask.sum()


# ============================================================================ training


def train(args, name, tokens, mask, tp, device):
    """One run: its loss at every step, step times (ms) and peak memory (MiB)."""
    free_memory(device.type == "cuda")
    model, cfg = gpt_model(args, tp, device, args.seed + (1 if name == "megatron_seed2" else 0))
    loop, opt, finalize = trainer(args, model, cfg, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() / 2 ** 20
    losses, times = [], []
    pos, causal = positions(args, device)
    with way_of(name):
        for step in range(args.steps):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / args.lr_warmup)
            if cuda:
                loop.zero_grad_buffer()
            opt.zero_grad()
            tok, labels, m = inputs(tokens, mask, step, device)
            loss = masked_mean(loop(tok, pos, causal, labels=labels), m)
            loss.backward()
            finalize()
            opt.step()
            losses.append(loss.item())  # a synchronisation, as a loop's logging makes
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else 0.0
    del loop, opt, model, finalize
    timed = times[args.warmup:] or times
    return {"loss": losses, "step_ms": times, "median_ms": statistics.median(timed),
            "peak_mib": peak, "weights_and_optimizer_mib": start if cuda else 0.0}


def free_memory(cuda):
    """What a finished run held (megatron-core's modules hold reference cycles), so that the next
    run's peak is its own."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ============================================================================ the first step


def gather_columns(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def first_step(args, tokens, mask, tp, device):
    """Each way's first step on the same weights: its loss, the lm head shard's gradient and the
    gradient of the final hidden states against float64, and the last block's gradients against
    Megatron's own. Errors are max |got - want| / max |want|."""
    from megatron.core import parallel_state
    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    model, cfg = gpt_model(args, tp, device, args.seed)
    gpt = model.module if hasattr(model, "module") else model
    tok, labels, m = inputs(tokens, mask, 0, device)
    pos, causal = positions(args, device)
    seen = {}

    def keep_hidden(module, inp, out):
        out.retain_grad()
        seen["normed"] = out

    def keep_logits(module, inp, out):
        # a copy: Megatron's loss works on its logits in place
        seen["head_input"], seen["logits"] = inp[0].detach(), out[0].detach().clone()
    hooks = [gpt.decoder.final_layernorm.register_forward_hook(keep_hidden),
             gpt.output_layer.register_forward_hook(keep_logits)]
    weight = gpt.shared_embedding_or_output_weight() if args.tied else gpt.output_layer.weight
    block = gpt.decoder.layers[-1]
    got = {}
    for name in ["megatron", "xent", "xent_fused"]:
        model.zero_grad(set_to_none=True)
        seen.clear()
        with way_of(name):
            loss = masked_mean(model(tok, pos, causal, labels=labels), m)
        loss.backward()
        got[name] = {"loss": loss.item(), "d_weight": weight.grad.detach().double(),
                     "d_normed": seen["normed"].grad.double(),
                     "block": {k: p.grad.detach().double()
                               for k, p in block.named_parameters() if p.grad is not None},
                     "logits_made": "logits" in seen}
        if name == "megatron":
            head_input, logits = seen["head_input"], seen["logits"]
    for h in hooks:
        h.remove()

    # float64 from the gathered logits: Megatron's (bf16 on CUDA) and hidden @ weight.T's
    full_w = gather_columns(weight.detach().T.contiguous(), group).T.double()
    if cfg.sequence_parallel:  # the output layer gathers its input's rows itself
        parts = [torch.empty_like(head_input) for _ in range(tp)]
        dist.all_gather(parts, head_input.contiguous(), group=group)
        head_input = torch.cat(parts)
    h64 = head_input.double()  # [s, b, h], every row
    s = h64.shape[0]
    rows = slice(rank * s // tp, (rank + 1) * s // tp) if cfg.sequence_parallel else slice(None)
    width = weight.shape[0]
    out = {}
    for ref, logits64 in {"made": gather_columns(logits, group).double(),
                          "exact": h64 @ full_w.T}.items():
        lab, mk = labels.T.reshape(-1), m.T.reshape(-1).double()
        z = logits64.reshape(-1, logits64.shape[-1])
        per = torch.nn.functional.cross_entropy(z, lab, reduction="none")
        want_loss = (per * mk).sum() / mk.sum()
        dz = torch.softmax(z, -1)
        dz[torch.arange(len(lab), device=dz.device), lab] -= 1.0
        dz *= (mk / mk.sum())[:, None]
        want_dw = dz[:, rank * width:(rank + 1) * width].T @ h64.reshape(-1, h64.shape[-1])
        want_dh = (dz @ full_w).view(h64.shape)[rows]
        out[ref] = (want_loss.item(), want_dw, want_dh)

    def err(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    result = {}
    for name, g in got.items():
        want_loss, want_dw, want_dh = out["exact" if name == "xent_fused" else "made"]
        result[name] = {
            "reference": "hidden @ weight.T in float64" if name == "xent_fused"
            else "the output layer's logits, gathered, in float64",
            "loss": g["loss"], "loss_float64": want_loss,
            "loss_rel_error": abs(g["loss"] - want_loss) / abs(want_loss),
            "d_weight_rel_error": err(g["d_weight"], want_dw),
            "d_hidden_rel_error": err(g["d_normed"], want_dh),
            "last_block_vs_megatron": max(err(g["block"][k], got["megatron"]["block"][k])
                                         for k in got["megatron"]["block"]),
            "logits_made": g["logits_made"]}
    return result


# ============================================================================ main


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        cpu_shims()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tokens, mask = bigram_batches(args)
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"} | {
        "tp": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "megatron_core": version("megatron-core"), "torch": torch.__version__,
        "tokens_per_step": args.batch * args.seq, "loss_floor": math.log(4)}}
    if args.check:
        report["first_step"] = first_step(args, tokens, mask, world, device)
    report["runs"] = {}
    for name in args.runs:
        report["runs"][name] = r = train(args, name, tokens, mask, world, device)
        if rank == 0:
            print(f"{name:15s} loss {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}, step "
                  f"{r['median_ms']:.1f} ms (median), peak {r['peak_mib']:.0f} MiB (weights and "
                  f"optimizer {r['weights_and_optimizer_mib']:.0f})", flush=True)
    report["curves"] = curve_distances(report["runs"], args.lr_warmup)
    for name, d in report["curves"].items():
        if rank == 0:
            print(f"curve {name:15s} vs megatron after the lr warm-up: mean |loss difference| "
                  f"{d['mean']:.4f}, max {d['max']:.4f}")
    if rank == 0 and args.check:
        for name, c in report["first_step"].items():
            print(f"first step {name:10s} loss {c['loss']:.6f} (float64 {c['loss_float64']:.6f},"
                  f" rel {c['loss_rel_error']:.1e}), d_weight {c['d_weight_rel_error']:.1e}, "
                  f"d_hidden {c['d_hidden_rel_error']:.1e}, last block vs Megatron "
                  f"{c['last_block_vs_megatron']:.1e}, logits made: {c['logits_made']}")
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return report


def curve_distances(runs, start):
    """Each run's distance from Megatron's own loss curve, step for step after `start`: the mean
    and max |loss difference|. megatron_seed2's is the spread of Megatron's own (other weights):
    the scale for the others', which start from the same weights as megatron."""
    if "megatron" not in runs:
        return {}
    own = runs["megatron"]["loss"]
    out = {}
    for name, run in runs.items():
        diffs = [abs(a - b) for a, b in zip(run["loss"][start:], own[start:])]
        if name != "megatron" and diffs:
            out[name] = {"mean": statistics.mean(diffs), "max": max(diffs)}
    return out


def version(package):
    from importlib.metadata import version as v
    return v(package)



if __name__ == "__main__":
    main()
