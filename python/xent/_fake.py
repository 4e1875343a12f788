"""Fake (meta) kernels of the operators in torch.ops.xent, for torch.compile and FakeTensor.

They compute only what the real kernels would return (shapes, dtypes, devices, strides); the
library names this module (TORCH_LIBRARY's set_python_module), and `import xent` imports it.
The public operators need none: they are CompositeImplicitAutograd, traced through into the
internal ones below (docs/torch.md). check_errors synchronises: call it outside compiled code.
"""

import torch


def _forward_outputs(logits, reduction, compute_accuracy, grad, with_stats):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    # lse also comes with a new gradient tensor: the fused backward recomputes rows from it.
    lse = logits.new_empty((n if with_stats or grad else 0,), dtype=torch.float32)
    z_loss = logits.new_empty((n if with_stats else 0,), dtype=torch.float32)
    argmax = logits.new_empty((n if compute_accuracy else 0,), dtype=torch.int64)
    accuracy = logits.new_empty(() if compute_accuracy else (0,), dtype=torch.float32)
    if grad:
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    else:
        grad = logits.new_empty((0,))
    return loss, lse, z_loss, argmax, accuracy, grad


@torch.library.register_fake("xent::_forward")
def _forward(logits, target, group_name, ignore_index, label_smoothing, z_loss, softcap,
             reduction, vocab_start, vocab_size, grad_scale, compute_accuracy, with_grad, with_stats):
    return _forward_outputs(logits, reduction, compute_accuracy, with_grad, with_stats)


@torch.library.register_fake("xent::_forward_inplace")
def _forward_inplace(logits, target, group_name, ignore_index, label_smoothing, z_loss, softcap,
                     reduction, vocab_start, vocab_size, grad_scale, compute_accuracy, with_stats):
    return _forward_outputs(logits, reduction, compute_accuracy, False, with_stats)


@torch.library.register_fake("xent::_backward")
def _backward(logits, target, lse, grad_output, group_name, ignore_index, label_smoothing,
              z_loss, softcap, reduction, vocab_start, vocab_size, grad_scale):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("xent::_backward_inplace")
def _backward_inplace(logits, target, lse, grad_output, group_name, ignore_index,
                      label_smoothing, z_loss, softcap, reduction, vocab_start, vocab_size, grad_scale):
    return None


@torch.library.register_fake("xent::_backward_fused")
def _backward_fused(grad, logits, target, lse, grad_output, group_name, ignore_index,
                    label_smoothing, z_loss, softcap, reduction, vocab_start, vocab_size,
                    grad_scale):
    return None


@torch.library.register_fake("xent::_scale_inplace")
def _scale_inplace(grad, target, grad_output, group_name, ignore_index, label_smoothing, z_loss,
                   softcap, reduction, vocab_start, vocab_size, grad_scale):
    return None


# The fused lm head: hidden [rows, H], weight [V_local, H], target [rows].
def _linear_grads(hidden, weight, d_hidden, d_weight):
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if d_hidden \
        else hidden.new_empty((0,))
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if d_weight \
        else weight.new_empty((0,))
    return dh, dw


@torch.library.register_fake("xent::_linear_forward")
def _linear_forward(hidden, weight, target, group_name, ignore_index, label_smoothing, z_loss,
                    softcap, reduction, vocab_start, vocab_size, grad_scale, sequence_parallel,
                    chunk_rows, max_scratch_bytes, schedule, d_hidden, d_weight):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    return (loss, lse) + _linear_grads(hidden, weight, d_hidden, d_weight)


@torch.library.register_fake("xent::_linear_backward")
def _linear_backward(hidden, weight, target, lse, grad_output, group_name, ignore_index,
                     label_smoothing, z_loss, softcap, reduction, vocab_start, vocab_size,
                     grad_scale, sequence_parallel, chunk_rows, max_scratch_bytes, schedule,
                     d_hidden, d_weight):
    return _linear_grads(hidden, weight, d_hidden, d_weight)


@torch.library.register_fake("xent::_linear_backward_fused")
def _linear_backward_fused(d_hidden, d_weight, hidden, weight, target, lse, grad_output,
                           group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale, sequence_parallel, chunk_rows,
                           max_scratch_bytes, schedule):
    return None
