"""The model of examples/megatron_gpt.py: megatron-core's own GPTModel from its local layer spec
(no TransformerEngine, no Apex), bf16 on CUDA (float32 on the CPU), Megatron's
DistributedDataParallel and mixed-precision Adam around it (torch's Adam on the CPU), and the
shims that run it in a process with no GPU.

Megatron's local spec normalises with torch's LayerNorm, which megatron-core refuses under
sequence parallelism (TransformerEngine's or Apex's is expected). `sequence_parallel_norm` is the
same torch norm with its weights marked `sequence_parallel`, so that finalize_model_grads sums
their gradients over the tensor-parallel ranks, as it does for TransformerEngine's.
"""
import contextlib

import torch


class sequence_parallel_norm:
    """megatron-core's WrappedTorchNorm, allowed under sequence parallelism (see the module's
    docstring)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def gpt_model(args, tp, device, seed):
    """Megatron's GPTModel from its local spec, its weights from `seed`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        tensor_model_parallel_size=tp, sequence_parallel=args.sequence_parallel and tp > 1,
        bf16=cuda, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=not cuda,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)
    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = sequence_parallel_norm
    layer.submodules.pre_mlp_layernorm = sequence_parallel_norm
    block = TransformerBlockSubmodules(layer_specs=[layer] * args.layers,
                                       layer_norm=sequence_parallel_norm)
    model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=args.vocab,
                     max_sequence_length=args.seq,
                     share_embeddings_and_output_weights=args.tied)
    model = model.to(device)
    if cuda:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model)
    return model, cfg


def trainer(args, model, cfg, device):
    """(model as the loop calls it, optimizer, the step's grad finalisation): Megatron's DDP and
    mixed-precision Adam on CUDA; torch's Adam on the CPU."""
    if device.type != "cuda":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
        return model, opt, lambda: None
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp = DistributedDataParallel(
        config=cfg, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, bf16=True,
                        adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0), [ddp])
    return ddp, opt, lambda: finalize_model_grads([ddp])


def cpu_shims():
    """GPTModel on the CPU (a process with no GPU): its attention scratch and its sequence-
    parallel collectives' buffers (on torch.cuda.current_device()) in host memory, no CUDA RNG
    fork (dropout 0). The model's arithmetic stays as it is."""
    import megatron.core.utils as utils
    from megatron.core.tensor_parallel import random

    def host_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        return torch.empty(tensor_shape, dtype=dtype)
    utils.GlobalMemoryBuffer.get_tensor = host_tensor
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
