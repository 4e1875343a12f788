"""TorchTitan 0.3.0's own Trainer and Llama 3 model (the debug model, or --flavor 1B), tensor
parallel over every rank (or, with --dp-shard N, FSDP over N ranks and TP over the rest), four
runs on the same data:

  titan       TorchTitan's own loss, CrossEntropyLoss (as its llama3_debugmodel_ce_loss config):
              the lm head's logits DTensor into its _LossParallelCrossEntropy;
  titan_seed2 the same from other initial weights (seed + 1), on the same data: the spread of
              TorchTitan's own curve, which xent's should stay within;
  xent        XentLoss in the Trainer.Config.loss slot: that DTensor into
              xent.vocab_parallel_cross_entropy;
  xent_fused  XentFusedLMHead, a ChunkedLossWrapper, in that slot: for one the Trainer itself sets
              the model's _skip_lm_head (forward returns the final norm's output) and calls
              set_lm_head(model.lm_head); the loss calls xent.linear_cross_entropy(hidden,
              lm_head.weight, labels, grad_mode="deferred") on the weight's DTensor shard. No
              logits are made.

    torchrun --nproc-per-node 2 examples/titan_train.py --vocab 128256 --out tp2.json  # NCCL
    torchrun --nproc-per-node 2 examples/titan_train.py --flavor 1B --batch 4 --lr 3e-4 --out b.json
    torchrun --nproc-per-node 2 examples/titan_train.py --tiny --out tp2.json   # CPU: Gloo

The JSON (--out, rank 0) has each run's losses and gradient norms as TorchTitan logs them
(RecordingMetrics, the metrics slot, which also reads each step's peak memory before TorchTitan's
log() resets it; none on the CPU), its step times (RecordingTrainer, a Trainer subclass) and the
fused head's plan; what it measured on H200s (TP 2 and 4, FSDP 2 x TP 2) is in
docs/transformers.md. --compile has TorchTitan torch.compile each block and its own loss.
--profile DIR writes torch.profiler's tables of each run's sixth step. All through TorchTitan's
extension points: the Trainer.Config slots, model_registry(converters=[...]), subclasses (in
titan_components.py, beside this file). What is not, and why:

- torch 2.11, which xent is built against, is older than TorchTitan 0.3.0 expects (2.12):
  `import torchtitan.trainer` fails on torch.distributed.fsdp.DataParallelMeshDims, and
  Trainer.train() calls torch.distributed.set_timeout after step 1. _torch_compat() adds both
  where missing (a placeholder class never instantiated here; a no-op). The default
  spmd_backend "spmd_types" calls fully_shard(dp_mesh_dims=...), which torch 2.11 lacks: these
  runs take "partial_dtensor" (DTensors on the TP mesh).
- FlexAttention's masks call create_block_mask(separate_full_blocks=...) (torch 2.12): a
  ModelConfigConverter, CausalSdpa, puts TorchTitan's own causal ScaledDotProductAttention in
  its place, and the data has no document positions (so the Trainer makes no masks). The debug
  model's default loss, ChunkedLossWrapper, failed in backward here (its lm_head.reshard() also
  frees the final norm, of the same FSDP unit): hence CrossEntropyLoss for `titan`.
- Without CUDA, TorchTitan still takes "cuda" (the fallback of tools/utils.get_device_info):
  _cpu_device() sets device_type "cpu" and a device_module stand-in in the four modules that
  copy them at import. Then init_process_group takes Gloo and the Trainer runs unchanged.
A model converter alone cannot fuse the lm head (the model never sees the labels): the Trainer's
ChunkedLossWrapper hook is the way in. Needs libxent_torch.so (XENT_TORCH_LIB, or python/'s xent).
"""
import argparse
import gc
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

# First: importing it readies torch and TorchTitan for the imports after it (_torch_compat,
# _cpu_device), and puts python/'s xent on the path
from titan_components import (PROFILE, CausalSdpa, FixedBatches, NoTokenizer, RecordingMetrics,
                              RecordingTrainer, XentFusedLMHead, XentLoss)
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import (
    CommConfig, CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig)
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.tools.logging import init_logger

RUNS = ["titan", "titan_seed2", "xent", "xent_fused"]


def trainer_config(run, a, world):
    """TorchTitan's Llama 3 `a.flavor` with this run's loss, FSDP over a.dp_shard ranks and TP over
    the rest of the world; the rest that differs is said above. No CUDA graphs: the runs alike,
    each step timed as it runs."""
    spec = model_registry(a.flavor, converters=[CausalSdpa.Config()])
    if a.layers:
        spec.model.layers = spec.model.layers[:a.layers]
    if a.vocab:  # a larger vocabulary shows what the fused head saves
        spec.model.vocab_size = spec.model.tok_embeddings.num_embeddings = a.vocab
        spec.model.lm_head.out_features = a.vocab
    vocab = decoder_vocab_size(spec)
    titan = CrossEntropyLoss.Config(global_vocab_size=vocab)
    loss = {"titan": titan, "titan_seed2": titan, "xent": XentLoss.Config(),
            "xent_fused": XentFusedLMHead.Config()}[run]
    return RecordingTrainer.Config(
        model_spec=spec, loss=loss, tokenizer=NoTokenizer.Config(vocab_size=vocab),
        dataloader=FixedBatches.Config(vocab_size=vocab, batches=a.batches, seed=a.seed),
        optimizer=default_adamw(lr=a.lr),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=a.lr_warmup, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=a.batch, seq_len=a.seq, steps=a.steps,
                                disable_cuda_graphs=True, mixed_precision_param=a.precision),
        metrics=RecordingMetrics.Config(log_freq=1),
        # --compile: TorchTitan's torch.compile of each block and of its own loss (xent's losses
        # are custom ops, never compiled); the lm head and the final norm stay eager in every run
        compile=CompileConfig(enable=a.compile, components=["model", "loss"]),
        parallelism=ParallelismConfig(
            tensor_parallel_degree=world // a.dp_shard, data_parallel_shard_degree=a.dp_shard,
            enable_sequence_parallel=a.sequence_parallel, spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False), validator=Validator.Config(enable=False),
        comm=CommConfig(trace_buf_size=0),
        debug=DebugConfig(seed=a.seed + (run == "titan_seed2")),  # other weights, the same data
        dump_folder=os.path.join(tempfile.gettempdir(), "xent_titan_train"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, 2 batches of 2 x 64 tokens, 8 steps, lr 3e-3 (CPU tests)")
    p.add_argument("--flavor", default="debugmodel", choices=["debugmodel", "1B", "3B", "8B"],
                   help="TorchTitan's Llama 3 model (1B: Llama 3.2 1B, dim 2048, 16 layers, "
                        "V 128256, tied embeddings)")
    p.add_argument("--layers", type=int, default=0, help="the first N layers (0: all)")
    p.add_argument("--vocab", type=int, default=0, help="0: the flavor's (the debug model's 2048)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--batches", type=int, default=4, help="fixed batches, cycled")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--lr-warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["float32", "bfloat16"],
                   default="bfloat16" if torch.cuda.is_available() else "float32",
                   help="FSDP's parameter dtype in compute (default: bfloat16 on CUDA)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block and TorchTitan's own loss (GPU "
                        "steps: eager ones are bound by the host)")
    p.add_argument("--dp-shard", type=int, default=1,
                   help="FSDP's sharding degree; TP is the rest of the ranks (2D where > 1)")
    p.add_argument("--out", default="", help="JSON of the results (rank 0 writes it)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    p.add_argument("--profile", default="",
                   help="a folder: torch.profiler's table of each run's sixth step, RUN.txt")
    a = p.parse_args(argv)
    a.runs = a.runs.split(",")
    if any(r not in RUNS for r in a.runs):
        p.error(f"--runs {','.join(a.runs)}: not a subset of {','.join(RUNS)}")
    if a.tiny:
        a.flavor = "debugmodel"
        a.layers, a.seq, a.batch, a.batches, a.steps, a.lr, a.lr_warmup = 2, 64, 2, 2, 8, 3e-3, 1
    return a


def compare(runs):
    """Each run's first step, and its loss curve, against TorchTitan's own loss."""
    want = runs["titan"]
    return {r: {"loss": v["loss"][0], "grad_norm": v["grad_norm"][0],
                "loss_rel_error": abs(v["loss"][0] - want["loss"][0]) / want["loss"][0],
                "grad_norm_rel_error":
                    abs(v["grad_norm"][0] - want["grad_norm"][0]) / want["grad_norm"][0],
                "max_loss_diff_all_steps": max(abs(x - y) for x, y in zip(v["loss"], want["loss"]))}
            for r, v in runs.items()}


def main():
    a = parse_args()
    world = int(os.environ["WORLD_SIZE"])
    if a.dp_shard < 1 or world % a.dp_shard:
        raise SystemExit(f"--dp-shard {a.dp_shard}: must be >= 1 and divide the {world} ranks")
    init_logger()  # TorchTitan's step lines
    runs = {}
    for run in a.runs:
        PROFILE.update(dir=a.profile, run=run)
        # The trainer before this one is garbage in reference cycles (modules and their hooks):
        # collected here, or its model and optimizer states would count in this run's peak.
        gc.collect()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if cuda else None
        trainer = trainer_config(run, a, world).build()  # the first starts torch.distributed
        try:
            trainer.train()
        finally:
            trainer.close()
        runs[run] = dict(trainer.metrics_processor.kept, **trainer.record,
                         plan=getattr(trainer.loss_fn, "plan", None), memory_before_bytes=before)
        del trainer
    first = compare(runs) if "titan" in runs else {}
    if dist.get_rank() == 0:
        for r, v in runs.items():
            mem = max(v["peak_memory_bytes"], key=lambda m: m or 0)
            before = v["memory_before_bytes"]
            steps = v["step_time_s"][len(v["step_time_s"]) // 4:]  # after a quarter as warm-up
            print(f"{r:>10}: loss {v['loss'][0]:.6f} -> {v['loss'][-1]:.6f}, median step "
                  f"{statistics.median(steps) * 1e3:.1f} ms, peak memory "
                  f"{'-' if mem is None else f'{mem / 2**30:.3f} GiB'} (before the run: "
                  f"{'-' if before is None else f'{before / 2**30:.3f} GiB'}), "
                  f"lm head calls {v['lm_head_calls']}", flush=True)
        if a.out:
            config = dict(vars(a), world=world, torch=torch.__version__,
                          device="cuda" if torch.cuda.is_available() else "cpu",
                          spmd_backend="partial_dtensor")
            with open(a.out, "w") as f:
                json.dump({"config": config, "runs": runs, "first_step": first}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
