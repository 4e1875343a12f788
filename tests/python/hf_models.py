"""The tiny Hugging Face Transformers models (transformers 5.17.0) of test_transformers_*.py: each
supported family a random-weight model (2 layers, hidden 64, vocabulary 256, intermediate 128, 4
heads, 2 KV heads, initializer_range 0.1 so that the logits spread over a few units; Gemma's
final-logit softcap 2, small enough to bend them) built by AutoModelForCausalLM.from_config
(nothing is downloaded), a batch [2, 12] with ignored (-100) labels, one forward and backward
patched or not, the float32 comparison, and the fixtures: unpatch() after each test, and the
calls xent.transformers makes to xent.linear_cross_entropy. The importer skips its module
without transformers first (pytest.importorskip)."""

import importlib.util

import pytest
import torch

import ranks
import xent.transformers as xt
from transformers import AutoConfig, AutoModelForCausalLM

# initializer_range 0.1 (not 0.02): logits of a few units, so that the softmax is not flat and
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
