"""xent.transformers.patch(): a Hugging Face Transformers causal LM (transformers 5.17.0) computes
its loss with xent.linear_cross_entropy, and what it returns is Transformers' own: the numbers.

Each supported family is a tiny random-weight model (hf_models.py). Against the same model
unpatched, on a batch [2, 12] with ignored (-100) labels:
  * float32 (on CPU, and on CUDA where there is a GPU): the loss within 1e-6 (relative) and every
    parameter's gradient within 1e-5 of its largest element (ranks.assert_close, as the other
    float32 tests here). Both paths compute the logits in float32 and differ only in summation
    order (xent's chunked GEMMs against one GEMM, V = 256 softmax terms): measured (3 seeds,
    every family) at most 1 ulp on the loss and 1.0e-6 on the gradients, a tenth of the
    tolerance;
  * bfloat16 (CPU, and CUDA): the loss within 2^-8 (bf16's unit roundoff; measured <= 8e-5) and
    each gradient within 2^-5 in norm (measured <= 2.2e-2: the network's own bf16 backward
    dominates); and,
    against the float32 model of the same weights, all gradients together are no less accurate
    than Transformers' own bf16 path (within 25%; measured 0.91x to 1.05x of its error).
    Transformers rounds the logits to bf16 before its float32 loss; xent never rounds them;
  * num_items_in_batch (a tensor and an int: sum / n, as gradient accumulation uses it);
  * 3 SGD steps: the losses and the final weights match; and Transformers' Trainer with
    gradient accumulation (it passes num_items_in_batch), where accelerate is installed;
  * Gemma's final-logit softcap changes the loss, and xent's softcap follows it.
The options, outputs and refusals are test_transformers_patch.py's, tensor parallelism
test_transformers_tp.py's.

Without transformers the module is skipped (install: pip install transformers==5.17.0; the
Trainer test also needs accelerate).

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_transformers_numerics.py
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ranks  # noqa: E402
import xent.transformers as xt  # noqa: E402
from hf_models import (B, FAMILIES, T, _has_accelerate, _unpatched,  # noqa: E402,F401 (fixtures)
                       assert_same, batch, build, calls, patched_step, step)

BF16_LOSS = 2.0 ** -8
BF16_GRAD = 2.0 ** -5
# The float32 and bfloat16 comparisons run on the GPU too where there is one (the fused lm head's
# CUDA backend under Transformers)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", DEVICES)
def test_float32(family, device, calls):
    model = build(family).to(device)
    ids, labels = (t.to(device) for t in batch())
    want = step(model, ids, labels)
    got = patched_step(model, ids, labels)
    assert len(calls) == 1 and calls[0]["reduction"] == "mean"
    assert calls[0]["softcap"] == (2.0 if family.startswith("gemma") else 0.0)
    assert want[0].logits.shape == (B, T, 256) and got[0].logits is None
    assert_same(got, want, family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16(family, device):
    model = build(family, torch.bfloat16).to(device)
    reference = copy.deepcopy(model).float()  # the same weights, in float32
    ids, labels = (t.to(device) for t in batch())
    _, want_loss, want = step(model, ids, labels)
    _, loss, got = patched_step(model, ids, labels)
    _, _, exact = step(reference, ids, labels)
    assert abs(loss.item() - want_loss.item()) <= BF16_LOSS * abs(want_loss.item())
    for name in want:
        diff = (got[name].float() - want[name].float()).norm() / want[name].float().norm()
        assert diff <= BF16_GRAD, f"{family}: {name}.grad differs by {diff:.3e} in norm"

    def error(grads):  # of all gradients together, against the float32 model's
        return torch.cat([(grads[n].double() - exact[n].double()).flatten() for n in exact]).norm()
    assert error(got) <= 1.25 * error(want), (
        f"{family}: xent's bf16 gradients are off the float32 ones by {error(got):.3e}, "
        f"Transformers' own by {error(want):.3e}")


@pytest.mark.parametrize("family", FAMILIES)
def test_num_items_in_batch(family, calls):
    """Gradient accumulation: sum / num_items_in_batch (here twice this batch's tokens)."""
    model = build(family)
    ids, labels = batch()
    count = int((labels[:, 1:] != -100).sum()) * 2
    for num in (torch.tensor(count), count):
        want = step(model, ids, labels, num_items_in_batch=num)
        got = patched_step(model, ids, labels, num_items_in_batch=num)
        assert_same(got, want, f"{family}, num_items_in_batch={num!r}")
    assert [c["reduction"] for c in calls] == ["sum", "sum"]
    # the gradient for (sum / n).backward() is made in forward: no recompute
    assert calls[0]["grad_scale"] == (torch.ones(()) / count).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps(family):
    """3 SGD steps from the same weights: the same losses and the same weights after."""
    def train(patched):
        model = build(family)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for seed in range(3):
            ids, labels = batch(seed)
            _, loss, _ = (patched_step if patched else step)(model, ids, labels)
            optimizer.step()
            losses.append(loss.item())
        return losses, dict(model.named_parameters())
    want_losses, want = train(False)
    losses, got = train(True)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert want_losses[2] != want_losses[0]
    for name in want:
        ranks.assert_close(got[name], want[name], 1e-5, f"{family}: {name} after 3 steps")


@pytest.mark.skipif(not _has_accelerate(), reason="Trainer needs accelerate")
def test_trainer_gradient_accumulation(calls, tmp_path):
    """Transformers' Trainer, 2 optimizer steps of 2 micro-batches each with different token
    counts: it passes num_items_in_batch (the tokens of the whole step) and the weights end the
    same. SGD: Adam's first steps are about sign(grad), which rounding can flip."""
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids, labels = batch(i)
            labels[0, :i] = -100
            return {"input_ids": ids[0], "labels": labels[0]}

    def train(patched):
        model = build("llama")
        if patched:
            xt.patch(model)
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
            gradient_accumulation_steps=2, learning_rate=0.1, optim="sgd", use_cpu=True,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
        result = Trainer(model=model, args=args, train_dataset=Data()).train()
        xt.unpatch()
        return result.training_loss, dict(model.named_parameters())
    want_loss, want = train(False)
    loss, got = train(True)
    assert len(calls) == 4 and all(c["reduction"] == "sum" for c in calls)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        ranks.assert_close(got[name], want[name], 1e-5, f"Trainer: {name}")


def test_softcap_applies():
    """Gemma's final_logit_softcapping changes the loss here, and xent's softcap follows it."""
    model = build("gemma2")
    ids, labels = batch()
    capped = patched_step(model, ids, labels)
    model.config.final_logit_softcapping = None
    uncapped = patched_step(model, ids, labels)
    assert_same(uncapped, step(model, ids, labels), "gemma2 without softcap")
    assert abs(capped[1].item() - uncapped[1].item()) > 1e-3

