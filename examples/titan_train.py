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
extension points: the Trainer.Config slots, model_registry(converters=[...]), subclasses. What
is not, and why:

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
import dataclasses
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402

RUNS = ["titan", "titan_seed2", "xent", "xent_fused"]
PROFILE = {"dir": "", "run": "", "step": 5}  # --profile: the sixth step of each run, profiled


def _torch_compat():
    """The two torch 2.12 names TorchTitan 0.3.0 needs on this path, where torch lacks them."""
    import torch.distributed.fsdp as fsdp
    if not hasattr(fsdp, "DataParallelMeshDims"):  # imported by torchtitan.distributed.full_dtensor
        @dataclasses.dataclass
        class DataParallelMeshDims:  # made by the spmd_types and full_dtensor backends only
            shard: object = None
            replicate: object = None
        fsdp.DataParallelMeshDims = DataParallelMeshDims
    if not hasattr(dist, "set_timeout"):  # Trainer.train(): set_pg_timeouts after step 1
        dist.set_timeout = lambda timeout, group=None: None


def _cpu_device():
    """Without CUDA: TorchTitan's device_type "cpu" (Gloo), and a device_module with no memory."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils
    cpu = types.SimpleNamespace(
        set_device=lambda *a: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=lambda *a: None, empty_cache=lambda: None, memory_stats=lambda *a: {},
        reset_peak_memory_stats=lambda *a: None, get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 40))
    for module in (utils, metrics, dist_utils):
        module.device_type, module.device_module = "cpu", cpu
    parallel_dims.device_type = "cpu"


_torch_compat()
if not torch.cuda.is_available():
    _cpu_device()

# After the two above: these imports need the first, and copy what the second sets.
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import (  # noqa: E402
    CommConfig, CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig)
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention, ScaledDotProductAttention)
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


def _as_titan_loss(loss, global_valid_tokens):
    """xent's loss of DTensors is a replicated DTensor: the Trainer wants a plain tensor
    (to_local() keeps the gradient's path), divided by its global token count as its own are."""
    loss = loss.to_local() if isinstance(loss, DTensor) else loss
    return (loss if global_valid_tokens is None else loss / global_valid_tokens), {}


class XentLoss(BaseLoss):
    """(xent) The logits DTensor (Shard(-1) on the TP mesh) into xent's vocab-parallel loss."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config, *, compile_config=None):
        self.fn = None

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss = xent.vocab_parallel_cross_entropy(pred, labels, reduction="sum")
        return _as_titan_loss(loss, global_valid_tokens)


class XentFusedLMHead(ChunkedLossWrapper):
    """(xent_fused) pred is the final norm's output (a replicated DTensor), lm_head.weight this
    rank's rows of the vocabulary (Shard(0)). xent chunks by itself: num_chunks and loss_fn of
    the Config are unused."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        pass

    def __init__(self, config, *, compile_config=None):
        self.lm_head = None  # Trainer.__init__ calls set_lm_head(model.lm_head)
        self.plan = None  # the first call's: what ran, in the JSON

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        weight = self.lm_head.weight
        if self.plan is None:
            self.plan = self._plan(pred, weight, labels)
        # The Trainer divides the sum by global_valid_tokens, a device tensor (no host sync): the
        # gradient's grad_output is not known in forward. "deferred" makes the gradient once, in
        # backward, for it; the default "fused" would make it in forward for grad_output 1, then
        # again in backward.
        loss = xent.linear_cross_entropy(pred, weight, labels, reduction="sum",
                                         grad_mode="deferred")
        return _as_titan_loss(loss, global_valid_tokens)

    @staticmethod
    def _plan(pred, weight, labels):
        local = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        h, group = local(pred), weight.device_mesh.get_group()
        plan = xent.linear_cross_entropy_plan(h.reshape(-1, h.shape[-1]), weight.to_local(),
                                              local(labels).reshape(-1), group, reduction="sum",
                                              grad_mode="deferred")
        return dict(plan, hidden=str(pred.dtype), weight=str(weight.dtype),
                    hidden_shape=list(h.shape), weight_shape=list(weight.to_local().shape))


class CausalSdpa(ModelConfigConverter):
    """Every FlexAttention of the model config becomes TorchTitan's causal SDPA (see above)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config):
        pass

    def convert(self, model_config):
        for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
        return model_config


class NoTokenizer(BaseTokenizer):
    """The Trainer always builds a tokenizer; token ids need none."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config, tokenizer_path=None):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs):
        raise NotImplementedError("token ids only")

    decode = encode

    def get_vocab_size(self):
        return self.vocab_size


class FixedBatches(BaseDataLoader):
    """A few fixed random batches, cycled: the same in every run and on every TP rank (which must
    see the same tokens), learnt by heart, so the loss falls; each data-parallel rank (FSDP's,
    --dp-shard) its own. No positions: causal SDPA."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        batches: int = 4
        seed: int = 0

    def __init__(self, config, *, seq_len, local_batch_size, dp_rank=0, **_):
        g = torch.Generator().manual_seed(config.seed + 1000 * dp_rank)
        self.pool = torch.randint(0, config.vocab_size,
                                  (config.batches, local_batch_size, seq_len + 1), generator=g)

    def __iter__(self):
        for i in itertools.count():
            tokens = self.pool[i % len(self.pool)]
            yield {"input": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


class RecordingMetrics(MetricsProcessor):
    """TorchTitan's metrics, keeping the loss and gradient norm the Trainer logs every step."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.kept = {"loss": [], "grad_norm": [], "peak_memory_bytes": []}

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.kept["loss"].append(global_avg_loss)
        self.kept["grad_norm"].append(grad_norm)  # before clipping
        # The step's peak, read before super().log() resets it (it does, at its end: a peak read
        # after train_step() sees only what was allocated since)
        cuda = torch.cuda.is_available()
        self.kept["peak_memory_bytes"].append(torch.cuda.max_memory_allocated() if cuda else None)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


class RecordingTrainer(Trainer):
    """TorchTitan's Trainer, timing each step (Config.build() constructs the class that owns the
    Config, so a subclass needs just its own Config). Each step's peak is RecordingMetrics'."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config):
        super().__init__(config)
        if self.device.type == "cpu":  # Gloo has no PREMUL_SUM: FSDP's sums, then its division
            for module in self.model_parts[0].modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        self.record = {"step_time_s": [], "lm_head_calls": 0,
                       "loss_fn": type(self.loss_fn).__name__}
        self.model_parts[0].lm_head.register_forward_hook(self._count_lm_head)

    def _count_lm_head(self, *_):  # the fused head's run never makes the logits
        self.record["lm_head_calls"] += 1

    def train_step(self, data_iterator):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if PROFILE["dir"] and len(self.record["step_time_s"]) == PROFILE["step"]:
            with torch.profiler.profile() as prof:
                super().train_step(data_iterator)
                if cuda:
                    torch.cuda.synchronize()
            if dist.get_rank() == 0:  # the device's time, then the host's (both on the CPU)
                sorts = ["self_device_time_total"] * cuda + ["cpu_time_total"]
                with open(os.path.join(PROFILE["dir"], f"{PROFILE['run']}.txt"), "w") as f:
                    for key in sorts:
                        f.write(prof.key_averages().table(sort_by=key, row_limit=25) + "\n")
        else:
            super().train_step(data_iterator)
        if cuda:
            torch.cuda.synchronize()
        self.record["step_time_s"].append(time.perf_counter() - start)


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
