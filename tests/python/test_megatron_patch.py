"""xent.megatron.patch() and the set-ups xent refuses, against Megatron-core itself on two
tensor-parallel ranks (megatron_ranks.py: the problem, the set-up and the worker; Gloo with CPU
tensors always, and NCCL with cuda:<rank> where there are 2 GPUs).

Covered:
  * errors: tp_group=None with Megatron's rank overridden or its parallel state not
    initialised, and label_smoothing = 1, raise on every rank naming what is wrong;
  * a rank or size set by set_tensor_model_parallel_rank/_world_size that is not the group's:
    Megatron's own unfused function uses it (0.16.1) or ignores it (0.19: the group's rank),
    its fused one ignores it (both);
    xent refuses it with tp_group=None, with Megatron's group given (positionally, by keyword,
    to the fused entry point, and through the patched LanguageModule), naming tp_group, both
    values and the rule, and takes another group as given;
  * patch(): Megatron's names (defining modules, the tensor_parallel package, LanguageModule's
    module, a module imported while patched) hold xent's functions, and Megatron's own
    LanguageModule.compute_language_model_loss then runs xent, on both its paths (0.19 passes
    tp_group=self.tp_group to the unfused one, which the stand-in module has); unpatch()
    restores the original objects everywhere; both are idempotent;
  * the ranks exit cleanly (Megatron's parallel state and the process group destroyed).
The patch case uses -100 (xent's ignore index: loss 0, where Megatron's loss is positive) to
tell which function ran. The two functions against Megatron's are test_megatron_functions.py's.
Without megatron-core these tests are skipped (install: pip install megatron-core==0.16.1, or
0.19.2 under Python 3.12).

Run (from the repository root, with the library built):
    PYTHONPATH=$PWD/python python3 -m pytest -q tests/python/test_megatron_patch.py
    bash launch/megatron_env.sh 3.12 0.19.2 build/megatron-envs/py3.12-megatron-core-0.19.2
"""

import pytest
import torch

import ranks
from megatron_ranks import (B, BACKENDS, S, V, WORLD, needs_megatron, two_ranks,  # noqa: F401
                            two_ranks_test)

CASES = ["patch", "errors", "rank_override"]
test_two_ranks = two_ranks_test(CASES)


@needs_megatron
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_exit_cleanly(backend, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, "done")


# =============================================================================== the ranks


class PatchCases:
    """The cases of this file, run by megatron_ranks.py's worker on each rank."""

    def language_model_loss(self, fusion):
        """Megatron's own LanguageModule.compute_language_model_loss (unfused path, or the
        native fused one), on a stand-in module: (loss [b, s], gradient of this rank's shard)
        for labels whose token (0, 1) is -100."""
        from types import SimpleNamespace

        from megatron.core.models.common.language_module.language_module import LanguageModule
        # what LanguageModule.__init__ sets and compute_language_model_loss reads: 0.19 passes
        # self.tp_group to the unfused function, both pass pg_collection.tp to the fused one
        module = SimpleNamespace(
            config=SimpleNamespace(cross_entropy_loss_fusion=fusion,
                                   cross_entropy_fusion_impl="native"),
            pg_collection=SimpleNamespace(tp=self.tp_group), tp_group=self.tp_group)
        labels = self.target.clone()
        labels[0, 1] = -100
        x = self.shard(torch.float32)
        loss = LanguageModule.compute_language_model_loss(
            module, labels.t().contiguous().to(self.device), x * 1)  # labels are [b, s]
        loss.backward(self.weight.t().to(self.device))
        return loss.detach().t(), x.grad  # back to [s, b]

    def patch_case(self):
        import sys
        import types

        import torch.nn.functional as F
        from megatron.core import tensor_parallel
        from megatron.core.fusions import fused_cross_entropy
        from megatron.core.models.common.language_module import language_module
        from megatron.core.tensor_parallel import cross_entropy

        import xent.megatron as xm
        places = {  # (module, name) -> Megatron's object there now
            (m, name): getattr(m, name) for m, name in (
                (tensor_parallel, "vocab_parallel_cross_entropy"),
                (cross_entropy, "vocab_parallel_cross_entropy"),
                (fused_cross_entropy, "fused_vocab_parallel_cross_entropy"),
                (language_module, "fused_vocab_parallel_cross_entropy"))}
        xent_of = {"vocab_parallel_cross_entropy": xm.vocab_parallel_cross_entropy,
                   "fused_vocab_parallel_cross_entropy": xm.fused_vocab_parallel_cross_entropy}

        # the reference: float64 F.cross_entropy, token (0, 1) ignored (loss 0, gradient 0)
        target = self.target.clone()
        target[0, 1] = -100
        full = self.full.clone().requires_grad_()
        want = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none").view(S, B)
        want.backward(self.weight.double())
        valid = target != -100

        # Megatron's own functions first: a positive loss for the -100 token
        for fusion in (False, True):
            meg, _ = self.language_model_loss(fusion)
            ranks.assert_close(meg[valid], want.detach()[valid], 1e-6,
                               f"Megatron (fusion={fusion})")
            assert meg[0, 1].item() > 0, f"Megatron (fusion={fusion}) gave {meg[0, 1].item()}"

        xm.patch()
        xm.patch()  # a no-op: patched once
        for (m, name), original in places.items():
            got = getattr(m, name)
            assert got is not original and got.__wrapped__ is xent_of[name], (
                f"{m.__name__}.{name} is {got!r} after patch()")
        # a module that imports Megatron's names while patched gets xent's
        late = types.ModuleType("xent_test_late_import")
        sys.modules[late.__name__] = late
        exec("from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as u\n"
             "from megatron.core.fusions.fused_cross_entropy import "
             "fused_vocab_parallel_cross_entropy as f\n"
             "import xent.megatron\n"
             "mine = xent.megatron.vocab_parallel_cross_entropy\n", vars(late))
        assert late.u.__wrapped__ is xm.vocab_parallel_cross_entropy, late.u
        assert late.f.__wrapped__ is xm.fused_vocab_parallel_cross_entropy, late.f
        # Megatron's LanguageModule now runs xent on both paths: -100 is ignored
        for fusion in (False, True):
            loss, grad = self.language_model_loss(fusion)
            ranks.assert_close(loss, want.detach(), 1e-6, f"patched loss (fusion={fusion})")
            assert loss[0, 1].item() == 0.0, loss[0, 1].item()
            ranks.assert_close(grad, full.grad[..., self.lo:self.hi], 1e-6,
                               f"patched gradient (fusion={fusion})")

        xm.unpatch()
        xm.unpatch()  # a no-op: not patched
        for (m, name), original in places.items():
            assert getattr(m, name) is original, f"{m.__name__}.{name} not restored"
        assert late.u is places[(tensor_parallel, "vocab_parallel_cross_entropy")], late.u
        assert late.f is places[(fused_cross_entropy, "fused_vocab_parallel_cross_entropy")]
        assert late.mine is xm.vocab_parallel_cross_entropy, "unpatch() changed a user's name"
        del sys.modules[late.__name__]
        meg, _ = self.language_model_loss(False)
        assert meg[0, 1].item() > 0, "Megatron's function did not come back"

    def errors_case(self):
        """Bad set-ups and inputs raise on every rank, naming what is wrong; nothing hangs."""
        import xent.megatron as xm
        ps = self.parallel_state
        x = self.shard(torch.float32)
        target = self.target.to(self.device)

        def expect(error, words, call):
            try:
                call()
            except error as e:
                assert all(w in str(e) for w in words), str(e)
            else:
                raise AssertionError(f"no {error.__name__} ({words})")

        # Megatron's rank overridden to another than the group's (tp_group=None; the case
        # rank_override has the rest)
        ps.set_tensor_model_parallel_rank(WORLD - 1 - self.rank)
        try:
            expect(RuntimeError, ["tp_group is None",
                                  f"rank and size are {WORLD - 1 - self.rank} of {WORLD}",
                                  f"rank {self.rank} of {WORLD}", "rank order"],
                   lambda: xm.vocab_parallel_cross_entropy(x, target))
        finally:
            ps.set_tensor_model_parallel_rank(None)
        # Megatron's parallel state not initialised (tp_group=None)
        saved, ps._TENSOR_MODEL_PARALLEL_GROUP = ps._TENSOR_MODEL_PARALLEL_GROUP, None
        try:
            expect(RuntimeError, ["tp_group is None", "not initialized",
                                  "initialize_model_parallel"],
                   lambda: xm.vocab_parallel_cross_entropy(x, target))
        finally:
            ps._TENSOR_MODEL_PARALLEL_GROUP = saved
        # xent's own check of label_smoothing, on every rank
        expect(RuntimeError, ["label_smoothing = 1", "[0, 1)"],
               lambda: xm.vocab_parallel_cross_entropy(x, target, 1.0))
        # the group still works: a valid call (a collective) on every rank
        loss = xm.vocab_parallel_cross_entropy(x, target)
        assert torch.isfinite(loss).all().item(), loss

    def rank_override_case(self):
        """A rank or size set by set_tensor_model_parallel_rank/_world_size that is not the
        tensor-parallel group's: Megatron's own unfused function uses that rank in 0.16.1 and
        the group's in 0.19, its fused one the group's in both (docs/megatron.md, version by
        version); xent refuses the call on
        every rank wherever the group is Megatron's (tp_group None or given, positionally or by
        keyword, the fused entry point, Megatron's LanguageModule while patched), naming
        tp_group, both values and the rule, and computes with another group as given."""
        from megatron.core import tensor_parallel
        from megatron.core.fusions import fused_cross_entropy

        import xent.megatron as xm
        ps = self.parallel_state
        x = self.shard(torch.float32)
        target = self.target.to(self.device)
        want, _ = self.run_loss(tensor_parallel.vocab_parallel_cross_entropy, torch.float32)
        want_fused, _ = self.run_loss(fused_cross_entropy.fused_vocab_parallel_cross_entropy,
                                      torch.float32, self.tp_group)

        def expect_refused(words, call, how):
            try:
                call()
            except RuntimeError as e:
                message = str(e)
                assert all(w in message for w in words), (how, message)
            else:
                raise AssertionError(f"{how}: no RuntimeError with Megatron's rank overridden")

        other = WORLD - 1 - self.rank
        ps.set_tensor_model_parallel_rank(other)
        try:
            meg, _ = self.run_loss(tensor_parallel.vocab_parallel_cross_entropy, torch.float32)
            apart = (meg.double() - want.double()).abs().max().item()
            if self.takes_tp_group:  # 0.19: the group's rank, the override ignored
                assert apart == 0.0, f"Megatron {self.megatron_version} used the override"
            else:  # 0.16.1: the override's rank, another shard's columns
                assert apart > 1e-3, f"Megatron {self.megatron_version} ignored the override"
            # Megatron's fused function takes the rank from its group in both versions
            meg, _ = self.run_loss(fused_cross_entropy.fused_vocab_parallel_cross_entropy,
                                   torch.float32, self.tp_group)
            assert torch.equal(meg, want_fused), "Megatron's fused function used the override"
            words = ["tp_group", f"rank and size are {other} of {WORLD}",
                     f"rank {self.rank} of {WORLD}", "must agree", "rank order",
                     "set_tensor_model_parallel_rank"]
            calls = {
                "tp_group=None": lambda: xm.vocab_parallel_cross_entropy(x, target),
                "tp_group positional":
                    lambda: xm.vocab_parallel_cross_entropy(x, target, 0.0, self.tp_group),
                "tp_group keyword":
                    lambda: xm.vocab_parallel_cross_entropy(x, target, tp_group=self.tp_group),
                "fused": lambda: xm.fused_vocab_parallel_cross_entropy(x, target, self.tp_group)}
            for how, call in calls.items():
                extra = ["tp_group is None"] if how == "tp_group=None" else [
                    "tp_group is Megatron's tensor-parallel group"]
                expect_refused(words + extra, call, how)
            xm.patch()
            try:  # 0.19's LanguageModule passes tp_group=self.tp_group, 0.16.1's none
                for fusion in (False, True):
                    expect_refused(words, lambda: self.language_model_loss(fusion),
                                   f"patched LanguageModule (fusion={fusion})")
            finally:
                xm.unpatch()
            # a group other than Megatron's: the override is not about it
            loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=self.other_group)
            ranks.assert_close(loss, want, 1e-6, "loss on another group of the same ranks")
        finally:
            ps.set_tensor_model_parallel_rank(None)
        ps.set_tensor_model_parallel_world_size(WORLD + 2)
        try:
            expect_refused(["tp_group", f"rank and size are {self.rank} of {WORLD + 2}",
                            f"rank {self.rank} of {WORLD}", "must agree"],
                           lambda: xm.vocab_parallel_cross_entropy(x, target,
                                                                   tp_group=self.tp_group),
                           "world size overridden")
        finally:
            ps.set_tensor_model_parallel_world_size(None)
        # nothing was left half done: a valid call (collectives) on every rank
        loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=self.tp_group)
        ranks.assert_close(loss, want, 1e-6, "loss after the refused calls")
