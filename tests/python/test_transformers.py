"""xent.transformers.patch(): a Hugging Face Transformers causal LM (transformers 5.17.0) computes
its loss with xent.linear_cross_entropy, and what it returns is Transformers' own.

Each supported family is a tiny random-weight model (2 layers, hidden 64, vocabulary 256,
intermediate 128, 4 heads, 2 KV heads, initializer_range 0.1 so that the logits spread over a
few units; Gemma's final-logit softcap 2, small enough to bend them) built by
AutoModelForCausalLM.from_config: nothing is downloaded. Against the same model unpatched, on a
batch [2, 12] with ignored (-100) labels:
  * float32 (on CPU, and on CUDA where there is a GPU): the loss within 1e-6 (relative) and every parameter's gradient within 1e-5 of its
    largest element (ranks.assert_close, as the other float32 tests here). Both paths compute
    the logits in float32 and differ only in summation order (xent's chunked GEMMs against one
    GEMM, V = 256 softmax terms): measured (3 seeds, every family) at most 1 ulp on the loss and
    1.0e-6 on the gradients, a tenth of the tolerance;
  * bfloat16 (CPU, and CUDA): the loss within 2^-8 (bf16's unit roundoff; measured <= 8e-5) and each gradient
    within 2^-5 in norm (measured <= 2.2e-2: the network's own bf16 backward dominates); and,
    against the float32 model of the same weights, all gradients together are no less accurate
    than Transformers' own bf16 path (within 25%; measured 0.91x to 1.05x of its error).
    Transformers rounds the logits to bf16 before its float32 loss; xent never rounds them;
  * num_items_in_batch (a tensor and an int: sum / n, as gradient accumulation uses it),
    shift_labels, ignore_index, all labels ignored (NaN loss, zero gradients, as F.cross_entropy),
    return_dict=False, logits None with labels, unchanged without, keep_logits=True,
    max_scratch_bytes passed through and honoured;
  * 3 SGD steps: the losses and the final weights match; and Transformers' Trainer with
    gradient accumulation (it passes num_items_in_batch), where accelerate is installed;
  * unpatch() restores the original forward objects; patch() is idempotent;
  * refused, naming the class: patch(model) of an unsupported model, of a subclass with its own
    forward, of a model whose instance forward holds the unpatched one (accelerate's hooks), and
    at the call a biased lm head or another loss_function; patch() refuses a forward
    whose logits differ from the supported ones (checked in the source), changing nothing;
  * two ranks over Gloo on the CPU, and over NCCL where there are two GPUs
    (tests/python/ranks.py), with Transformers' tensor parallelism
    (from_pretrained(tp_plan="auto"): the lm head's weight a DTensor sharded on the vocabulary;
    it needs accelerate), every family but GPT-2 (which has no tp_plan): xent's vocab-parallel
    path, the same loss and gradients (each rank's shards) as unpatched, and with keep_logits
    the gathered logits of tp_plan's own lm head.

Without transformers the module is skipped (install: pip install transformers==5.17.0; the
two-rank test also needs accelerate).

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_transformers.py
"""

import copy
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import traceback

if __name__ == "__main__" and sys.argv[1:2] == ["gloo"]:
    # A Gloo rank runs on the CPU: Transformers' tp_plan would otherwise take cuda:<LOCAL_RANK>
    # where a GPU is visible (rank 1 found no cuda:1 on a one-GPU machine). Before torch's import.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ranks  # noqa: E402
import xent.transformers as xt  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

# initializer_range 0.3 (not 0.02): logits of a few units, so that the softmax is not flat and
# Gemma's softcap of 3 bends them as a trained model's
SIZES = dict(num_hidden_layers=2, hidden_size=64, vocab_size=256, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
# model_type -> (the class AutoModelForCausalLM makes, its config)
FAMILIES = {
    "llama": ("LlamaForCausalLM", SIZES),
    "mistral": ("MistralForCausalLM", SIZES),
    "qwen2": ("Qwen2ForCausalLM", SIZES),
    "qwen3": ("Qwen3ForCausalLM", dict(SIZES, head_dim=16)),
    "gemma2": ("Gemma2ForCausalLM", dict(SIZES, head_dim=16, final_logit_softcapping=2.0)),
    "gemma3_text": ("Gemma3ForCausalLM", dict(SIZES, head_dim=16, final_logit_softcapping=2.0)),
    # GPT-2's own names; no dropout (the two runs must see the same network)
    "gpt2": ("GPT2LMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, n_inner=128,
                                     vocab_size=256, n_positions=64, initializer_range=0.1,
                                     bos_token_id=1, eos_token_id=1, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)),
}
B, T = 2, 12
BF16_LOSS = 2.0 ** -8
BF16_GRAD = 2.0 ** -5
# GPT-2 has no tp_plan in transformers 5.17.0: from_pretrained(tp_plan="auto") leaves it whole
TP_FAMILIES = [f for f in FAMILIES if f != "gpt2"]
# The float32 and bfloat16 comparisons run on the GPU too where there is one (the fused lm head's
# CUDA backend under Transformers)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEADLINE_S = 240


def _has_accelerate():  # Trainer and tp_plan need it
    return importlib.util.find_spec("accelerate") is not None


def build(family, dtype=torch.float32, seed=0, **overrides):
    name, sizes = FAMILIES[family]
    config = AutoConfig.for_model(family, **dict(sizes, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    assert type(model).__name__ == name
    return model


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, 7] = -100
    return ids, labels


def step(model, ids, labels, **kwargs):
    """(the output, its loss, every parameter's gradient) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def patched_step(model, ids, labels, **kwargs):
    xt.patch()
    try:
        return step(model, ids, labels, **kwargs)
    finally:
        xt.unpatch()


def assert_same(got, want, what):
    """float32: loss within 1e-6 relative, each gradient within 1e-5 of its largest element."""
    (_, loss, grads), (_, want_loss, want_grads) = got, want
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item()), (
        f"{what}: loss {loss.item()!r}, want {want_loss.item()!r}")
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        ranks.assert_close(grads[name], want_grads[name], 1e-5, f"{what}: {name}.grad")


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    xt.unpatch()


@pytest.fixture
def calls(monkeypatch):
    """The calls xent.transformers makes to xent.linear_cross_entropy."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return linear(*args, **kwargs)
    linear = xt._xent_linear
    monkeypatch.setattr(xt, "_xent_linear", spy)
    return seen


# ================================================================================ one process


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


def test_shift_labels_and_ignore_index():
    model = build("llama")
    ids, labels = batch()
    shift = torch.roll(labels, -1, 1)
    shift[:, -1] = 7  # not a shifted copy of labels: the model must use shift_labels itself
    want = step(model, ids, labels, shift_labels=shift)
    assert_same(patched_step(model, ids, labels, shift_labels=shift), want, "shift_labels")
    labels = torch.where(labels == -100, 5, labels)  # ignore_index 5 (labels 5 ignored too)
    want = step(model, ids, labels, ignore_index=5)
    assert_same(patched_step(model, ids, labels, ignore_index=5), want, "ignore_index")


def test_all_ignored():
    """F.cross_entropy's mean of no tokens is NaN with zero gradients; so is the patched one."""
    model = build("qwen2")
    ids, labels = batch()
    labels[:] = -100
    for run in (step, patched_step):
        _, loss, grads = run(model, ids, labels)
        assert loss.isnan()
        assert all(g.abs().max() == 0 for g in grads.values())


def test_outputs(calls):
    """No labels: the original forward, bit for bit; return_dict=False: the tuple, loss first;
    keep_logits=True: the logits as before, the loss still xent's."""
    model = build("gemma3_text")
    ids, labels = batch()
    before = model(input_ids=ids)
    want = model(input_ids=ids, labels=labels, return_dict=False)
    xt.patch()
    after = model(input_ids=ids)
    assert after.loss is None and torch.equal(after.logits, before.logits)
    got = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # no logits
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-6)
    assert len(calls) == 1
    xt.patch(keep_logits=True)
    out = model(input_ids=ids, labels=labels)
    assert len(calls) == 2 and torch.equal(out.logits, want[1])
    assert out.loss.item() == pytest.approx(want[0].item(), rel=1e-6)
    xt.patch()  # keep_logits=False again
    assert model(input_ids=ids, labels=labels).logits is None


def test_max_scratch_bytes(calls):
    """patch(max_scratch_bytes=n) bounds every call's scratch: passed as is (0, the default:
    xent's default budget), honoured (a budget too small for any schedule is refused by xent,
    naming it), the same loss within it; a bad value refused by patch, naming it; unpatch()
    resets it."""
    model = build("llama")
    ids, labels = batch()
    xt.patch()
    want = model(input_ids=ids, labels=labels).loss
    xt.patch(max_scratch_bytes=1 << 20)
    got = model(input_ids=ids, labels=labels).loss
    assert [c["max_scratch_bytes"] for c in calls] == [0, 1 << 20]
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    xt.patch(max_scratch_bytes=64)
    with pytest.raises(RuntimeError, match="max_scratch_bytes = 64: too small"):
        model(input_ids=ids, labels=labels)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"patch\(max_scratch_bytes="):
            xt.patch(max_scratch_bytes=bad)
    xt.unpatch()
    xt.patch()
    model(input_ids=ids, labels=labels)
    assert calls[-1]["max_scratch_bytes"] == 0


def test_unpatch_restores():
    classes = {name: getattr(importlib.import_module(f"transformers.models.{module}"), name)
               for name, (module, _) in xt.SUPPORTED.items()}
    originals = {name: vars(cls)["forward"] for name, cls in classes.items()}
    model = build("gpt2")
    xt.patch()
    xt.patch()  # idempotent
    for name, cls in classes.items():
        assert vars(cls)["forward"] is not originals[name]
        assert vars(cls)["forward"].__wrapped__ is originals[name]
    assert xt.patch(model) is model
    xt.unpatch()
    xt.unpatch()
    for name, cls in classes.items():
        assert vars(cls)["forward"] is originals[name], name
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels).logits is not None


def test_refused():
    """Never a silent fallback: each refusal names the class, and patch(model) changes nothing."""
    llama = build("llama")
    original = vars(type(llama))["forward"]
    other = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_neox", num_hidden_layers=2, hidden_size=64, vocab_size=256, intermediate_size=128,
        num_attention_heads=4))
    with pytest.raises(RuntimeError, match="GPTNeoXForCausalLM is not supported"):
        xt.patch(other)
    assert vars(type(llama))["forward"] is original

    class MyLlama(type(llama)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    mine = MyLlama(llama.config)
    with pytest.raises(RuntimeError, match="MyLlama is not supported"):
        xt.patch(mine)

    hooked = build("llama")  # as accelerate's hooks (device_map) leave it, loaded before patch()
    hooked._old_forward = hooked.forward
    hooked.forward = lambda *args, **kwargs: hooked._old_forward(*args, **kwargs)
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM has its own forward on the "
                       r"instance.*patch\(\) before loading"):
        xt.patch(hooked)
    assert vars(type(llama))["forward"] is original

    xt.patch(llama)
    ids, labels = batch()
    llama.loss_function = lambda *args, **kwargs: torch.zeros(())
    with pytest.raises(RuntimeError, match="LlamaForCausalLM.loss_function is <lambda>"):
        llama(input_ids=ids, labels=labels)
    del llama._loss_function
    llama.lm_head = torch.nn.Linear(64, 256)
    with pytest.raises(RuntimeError, match="LlamaForCausalLM.lm_head is Linear with a bias"):
        llama(input_ids=ids, labels=labels)


class ScaledLogits:
    """A forward as Cohere's or Granite's: the logits scaled after the lm head."""

    def forward(self, hidden_states, labels, slice_indices, **kwargs):
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        logits = logits * self.logit_scale
        return self.loss_function(logits, labels, 256, **kwargs)


def test_source_check():
    with pytest.raises(RuntimeError, match=r"ScaledLogits.forward .*logits \* self.logit_scale"):
        xt._check_source(ScaledLogits, softcap=False)


# ================================================================== two ranks, tensor parallel


two_ranks = ranks.fixture(__file__, "transformers_tp", 2, DEADLINE_S)
# Gloo on the CPU everywhere; NCCL where two GPUs are visible (each rank's model on its own GPU,
# as from_pretrained(tp_plan="auto") places it from LOCAL_RANK)
TP_BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.skipif(not _has_accelerate(), reason="Transformers' tp_plan needs accelerate "
                    "(pip install accelerate)")
@pytest.mark.parametrize("case", [f"tp-{f}" for f in TP_FAMILIES] + ["done"])
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_tensor_parallel(backend, case, two_ranks):
    ranks.expect_case(*two_ranks(backend), case)


def tp_case(family, rank, tmp, device):
    """A tiny model saved by rank 0, loaded with tp_plan="auto" on both ranks: patched and not,
    the same loss and gradients (each rank's shard of the DTensor ones)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    path = pathlib.Path(tmp) / family
    if rank == 0:
        build(family).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), weight
    assert weight.device == device, (weight.device, device)
    ids, labels = (t.to(device) for t in batch())
    want = step(model, ids, labels)
    got = patched_step(model, ids, labels)
    assert got[0].logits is None and type(got[1]) is torch.Tensor
    xt.patch(keep_logits=True)  # the stand-in calls tp_plan's own lm head forward
    try:
        assert torch.equal(model(input_ids=ids, labels=labels).logits, want[0].logits)
    finally:
        xt.unpatch()

    def local(grads):
        return {n: g.to_local() if isinstance(g, DTensor) else g for n, g in grads.items()}
    assert_same((got[0], got[1], local(got[2])), (want[0], want[1], local(want[2])), family)


def _worker(backend, rank, init, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    results, path = {}, pathlib.Path(out_dir) / f"rank{rank}.json"

    def record(case, fn):
        try:
            fn()
            results[case] = {"ok": True}
        except BaseException:  # noqa: B902  (an assertion, a RuntimeError, anything)
            results[case] = {"ok": False, "error": traceback.format_exc()}
        path.write_text(json.dumps(results))  # as we go: a hang keeps what ran

    import torch.distributed as dist
    device = ranks.join_group(backend, rank, init, 2)
    for family in TP_FAMILIES:
        record(f"tp-{family}", lambda: tp_case(family, rank, out_dir, device))
    record("done", lambda: (dist.barrier(), dist.destroy_process_group()))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
