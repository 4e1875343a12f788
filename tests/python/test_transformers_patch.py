"""xent.transformers.patch() in one process (transformers 5.17.0): its options, outputs and
refusals, on the tiny random-weight models of hf_models.py, against the same model unpatched:
  * shift_labels, ignore_index, all labels ignored (NaN loss, zero gradients, as
    F.cross_entropy), return_dict=False, logits None with labels, unchanged without,
    keep_logits=True, max_scratch_bytes passed through and honoured;
  * unpatch() restores the original forward objects; patch() is idempotent;
  * refused, naming the class: patch(model) of an unsupported model, of a subclass with its own
    forward, of a model whose instance forward holds the unpatched one (accelerate's hooks), and
    at the call a biased lm head or another loss_function; patch() refuses a forward
    whose logits differ from the supported ones (checked in the source), changing nothing.
The loss and gradients are test_transformers_numerics.py's, tensor parallelism
test_transformers_tp.py's. Without transformers the module is skipped (install: pip install
transformers==5.17.0).

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_transformers_patch.py
"""

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import xent.transformers as xt  # noqa: E402
from hf_models import (_unpatched, assert_same, batch, build,  # noqa: E402,F401 (fixtures)
                       calls, patched_step, step)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


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
