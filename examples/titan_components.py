"""The pieces examples/titan_train.py plugs into TorchTitan 0.3.0's own Trainer, each through
one of TorchTitan's extension points (a Trainer.Config slot, model_registry's converters, a
subclass): the two losses of xent (XentLoss, XentFusedLMHead), the causal SDPA converter, the
tokenizer and data of token ids, the recording metrics and trainer. Importing this module first
readies torch 2.11 and a machine without CUDA for TorchTitan (_torch_compat, _cpu_device; why:
titan_train.py's docstring), before TorchTitan's modules are imported, here and in the example.
"""
import dataclasses
import itertools
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import xent  # noqa: E402

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

# After the two above: these imports (and titan_train.py's) need the first, and copy what
# the second sets.
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention, ScaledDotProductAttention)
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402
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
