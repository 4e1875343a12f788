"""xent.megatron.patch(fused_lm_head=True) in megatron-core's own GPTModel (its local layer spec,
no TransformerEngine), tensor parallel over 2 ranks (Gloo on the CPU; NCCL where there are 2
GPUs), with and without tied embeddings and sequence parallelism: the patched model never runs
its output layer, and its per-token loss and gradients (the lm head's weight shard, the
embedding, the first block) match the same model's unpatched step. The gradients are compared
with an fp32 tolerance: both are float32 computations of the same sums in another order. Under
sequence parallelism the model normalises with examples/megatron_gpt.py's sequence_parallel_norm
(megatron-core's local spec refuses torch's norm there).

test_example_trains runs examples/megatron_gpt.py itself under torchrun (CPU, tiny).

On the CPU, megatron-core's GPTModel allocates its attention scratch on the current CUDA device
and forks the CUDA RNG state around dropout; the workers replace both there (dropout off), which
leaves the model's arithmetic as it is.

    python3 -m pytest -q tests/python/test_megatron_gpt.py
"""
import json
import os
import pathlib
import subprocess
import sys
import traceback

import pytest
import torch

import ranks

WORLD = 2
LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 64, 4, 256, 16, 3
DEADLINE_S = 300
CASES = {"tp2": (False, False), "tp2_tied": (False, True), "tp2_sp": (True, False),
         "tp2_sp_tied": (True, True)}
OTHER_CASES = ["no_labels", "unpatch"]
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # the ranks import the example's model pieces
BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


needs_megatron = ranks.needs_megatron("GPTModel")

two_ranks = ranks.fixture(__file__, "megatron_gpt", WORLD, DEADLINE_S)


@needs_megatron
@pytest.mark.parametrize("case", list(CASES) + OTHER_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_model(backend, case, two_ranks):
    ranks.expect_case(*two_ranks(backend), case)


@needs_megatron
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_example_trains(sequence_parallel, tmp_path):
    """examples/megatron_gpt.py as a user runs it (torchrun, 2 ranks; on the CPU over Gloo, tiny):
    every run's loss falls; at the first step xent's loss and gradients (logits path and fused
    lm head) agree with float64 of the gathered logits as closely as Megatron's own, and the
    fused lm head never makes the logits."""
    out = tmp_path / "gpt.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), str(EXAMPLES / "megatron_gpt.py"), "--device", "cpu", "--tiny",
           "--out", str(out)] + (["--sequence-parallel"] if sequence_parallel else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["config"]["sequence_parallel"] == sequence_parallel
    for name, run in report["runs"].items():
        assert len(run["loss"]) == report["config"]["steps"], name
        assert run["loss"][-1] < run["loss"][0] - 1.0, (name, run["loss"][0], run["loss"][-1])
    curves = report["curves"]  # xent's follow Megatron's curve closer than another seed's does
    assert curves["xent"]["mean"] < curves["megatron_seed2"]["mean"], curves
    assert curves["xent_fused"]["mean"] < curves["megatron_seed2"]["mean"], curves
    first = report["first_step"]
    for name, c in first.items():
        assert c["loss_rel_error"] < 1e-5, (name, c)
        assert c["d_weight_rel_error"] < 1e-4 and c["d_hidden_rel_error"] < 1e-4, (name, c)
        assert c["last_block_vs_megatron"] < 1e-3, (name, c)
    assert first["megatron"]["logits_made"] and not first["xent_fused"]["logits_made"]


# ================================================================================ the ranks


class Rank:
    def __init__(self, backend, rank, init, out_dir):
        import warnings
        warnings.filterwarnings("ignore")
        from megatron.core import parallel_state
        self.parallel_state = parallel_state
        self.device = ranks.join_group(backend, rank, init, WORLD)
        if self.device.type == "cpu":
            from megatron_gpt import cpu_shims
            cpu_shims()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(1)
        self.rank = rank
        self.out = f"{out_dir}/rank{rank}.json"
        self.results = {}

    def record(self, case, fn):
        try:
            fn()
            self.results[case] = {"ok": True, "error": ""}
        except Exception:
            self.results[case] = {"ok": False, "error": traceback.format_exc()}
        with open(self.out, "w") as f:
            json.dump(self.results, f)

    def model(self, sequence_parallel, tied):
        """GPTModel of the local spec; under sequence parallelism with the norm of
        examples/megatron_gpt.py (torch's, which megatron-core's local spec refuses there)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig
        torch.manual_seed(7)
        cfg = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
            tensor_model_parallel_size=WORLD, sequence_parallel=sequence_parallel,
            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
            pipeline_dtype=torch.float32)
        spec = get_gpt_layer_local_spec()
        if sequence_parallel:
            from megatron_gpt import sequence_parallel_norm as norm
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
            spec = TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=norm)
        m = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=tied)
        return m.to(self.device)

    def inputs(self):
        g = torch.Generator().manual_seed(11)  # the same on every rank
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.rand(BATCH, SEQ, generator=g) > 0.2  # Megatron's loss mask
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
        return [t.to(self.device) for t in (tokens, pos, causal, labels, mask)]

    def step(self, m):
        """One training step's loss [b, s] and the gradients that matter, as a loop makes them."""
        tokens, pos, causal, labels, mask = self.inputs()
        m.zero_grad(set_to_none=True)
        loss = m(tokens, pos, causal, labels=labels)
        (loss.float() * mask).sum().div(mask.sum()).backward()
        grads = {name: p.grad.detach().clone() for name, p in m.named_parameters()
                 if p.grad is not None and ("output_layer" in name or "word_embeddings" in name
                                            or "layers.0." in name)}
        return loss.detach(), grads

    def compare(self, sequence_parallel, tied):
        import xent.megatron
        m = self.model(sequence_parallel, tied)
        want_loss, want = self.step(m)
        calls = []
        m.output_layer.register_forward_hook(lambda *a: calls.append(1))
        xent.megatron.patch(fused_lm_head=True)
        try:
            got_loss, got = self.step(m)
        finally:
            xent.megatron.unpatch()
        assert not calls, "the patched GPTModel ran its output layer (made the logits)"
        ranks.assert_close(got_loss, want_loss, 1e-5, "per-token loss")
        assert set(got) == set(want) and want, (sorted(got), sorted(want))
        for name in want:
            ranks.assert_close(got[name], want[name], 2e-4, f"grad of {name}")

    def no_labels(self):
        """Without labels the patched model returns Megatron's own logits."""
        import xent.megatron
        m = self.model(False, False)
        tokens, pos, causal, _, _ = self.inputs()
        with torch.no_grad():
            want = m(tokens, pos, causal)
            xent.megatron.patch(fused_lm_head=True)
            try:
                got = m(tokens, pos, causal)
            finally:
                xent.megatron.unpatch()
        assert torch.equal(got, want)

    def unpatch_restores(self):
        import xent.megatron
        from megatron.core.models.gpt.gpt_model import GPTModel
        own = GPTModel._postprocess
        xent.megatron.patch(fused_lm_head=True)
        assert GPTModel._postprocess is not own and GPTModel._postprocess.__wrapped__ is own
        xent.megatron.patch(fused_lm_head=True)  # again: nothing changes
        assert GPTModel._postprocess.__wrapped__ is own
        xent.megatron.unpatch()
        assert GPTModel._postprocess is own

    def run_all(self):
        for case, args in CASES.items():
            self.record(case, lambda: self.compare(*args))
        self.record("no_labels", self.no_labels)
        self.record("unpatch", self.unpatch_restores)
        import torch.distributed as dist
        dist.barrier()
        self.parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    Rank(backend_, int(rank_), init_, out_dir_).run_all()
