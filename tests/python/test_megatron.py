"""xent.megatron against Megatron-core itself (the real package: megatron-core 0.16.1 under the
default python3, 0.19.2 under Python 3.12 through launch/megatron_env.sh; what differs between
the two is checked version by version) on two tensor-parallel ranks: Megatron's parallel state
is initialised with tensor_model_parallel_size=2, each rank holds half the vocabulary (64
columns: [0, 32) and [32, 64), Megatron's partition) of the same full logits [S, B, V], and every
case compares xent's loss and gradient shard with what Megatron's own function gives on the same
shard.

Covered, on Gloo with CPU tensors always, and on NCCL with cuda:<rank> where there are 2 GPUs:
  * the unfused entry point, float32 and bfloat16 logits, tp_group given (positionally, and as
    the keyword that megatron-core 0.19's function also takes) and tp_group=None (Megatron's
    parallel state): loss and gradient equal Megatron's to rounding, with a non-unit grad_output
    (as Megatron's loss mask and token count make it); xent's parameters are Megatron's (0.19:
    all four; 0.16.1: the first three, it has no tp_group);
  * the fused entry point (Megatron's runs on CPU too, through torch.compile): the loss equals
    Megatron's, the gradient to bfloat16 rounding (Megatron's fused gradient is always bf16);
  * label smoothing 0.1: xent's loss and gradient equal float64 F.cross_entropy on the full
    logits, Megatron's equal the formula docs/megatron.md gives for them, and the two differ
    (as do Megatron's two ranks), and xent warns;
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
    restores the original objects everywhere; both are idempotent.
Only valid targets are compared: Megatron has no ignore index and returns a meaningless loss for
a target outside the vocabulary. The patch case uses -100 (xent's ignore index: loss 0, where
Megatron's loss is positive) to tell which function ran.

Without megatron-core the two-rank tests are skipped (install: pip install megatron-core==0.16.1,
or 0.19.2 under Python 3.12);
test_without_megatron runs anyway: xent.megatron imports and works with an explicit tp_group
without it, and patch() and tp_group=None fail with an ImportError that says what is missing.

How: as tests/python/test_torch_dist.py, through ranks.py: the two ranks are subprocesses running
this file (the worker at the bottom) and write one JSON file each with every case's outcome.

Run (from the repository root, with the library built):
    PYTHONPATH=$PWD/python python3 -m pytest -q tests/python/test_megatron.py
    bash launch/megatron_env.sh 3.12 0.19.2 build/megatron-envs/py3.12-megatron-core-0.19.2
"""

import functools
import importlib.metadata
import inspect
import json
import pathlib
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import ranks

WORLD = 2
S, B, V = 4, 3, 64
WIDTH = V // WORLD  # Megatron's partition: rank r owns [r * WIDTH, (r + 1) * WIDTH)
SMOOTHING = 0.1
DEADLINE_S = 420  # both ranks, all cases: importing Megatron and torch.compile of its fused path

UNFUSED_CASES = {f"unfused-{dtype}-{how}": (dtype, how)
                 for dtype in ("fp32", "bf16")
                 for how in ("tp_group", "tp_group_keyword", "default_group")}
FUSED_CASES = {f"fused-{dtype}": dtype for dtype in ("fp32", "bf16")}
OTHER_CASES = ["signature", "smoothing", "patch", "errors", "rank_override"]
CASES = list(UNFUSED_CASES) + list(FUSED_CASES) + OTHER_CASES

BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


needs_megatron = ranks.needs_megatron("function")


# =============================================================================== the parent


two_ranks = ranks.fixture(__file__, "megatron", WORLD, DEADLINE_S)


@needs_megatron
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks(backend, case, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, case)


@needs_megatron
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_exit_cleanly(backend, two_ranks):
    results, reports = two_ranks(backend)
    ranks.expect_case(results, reports, "done")


def test_without_megatron(tmp_path):
    """In a fresh process where `import megatron` fails: xent.megatron imports, works with an
    explicit tp_group (a one-rank Gloo group), and patch() and tp_group=None raise an
    ImportError naming megatron-core and the module."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["megatron"] = None  # makes every `import megatron...` raise ImportError
        import torch, torch.distributed as dist, torch.nn.functional as F
        import xent.megatron as xm

        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
        g = torch.Generator().manual_seed(0)
        full = torch.randn(3, 2, 10, generator=g, dtype=torch.float64)
        target = torch.randint(0, 10, (3, 2), generator=g)
        x = full.float().requires_grad_()
        loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=dist.group.WORLD)
        want = F.cross_entropy(full.view(-1, 10), target.view(-1), reduction="none").view(3, 2)
        assert loss.shape == (3, 2) and loss.dtype == torch.float32, (loss.shape, loss.dtype)
        assert torch.allclose(loss.double(), want, rtol=1e-6, atol=0), (loss, want)

        for call, what in ((xm.patch, "xent.megatron.patch()"),
                           (lambda: xm.vocab_parallel_cross_entropy(x, target),
                            "vocab_parallel_cross_entropy with tp_group=None")):
            try:
                call()
            except ImportError as e:
                message = str(e)
                assert what in message and "megatron-core" in message, message
                assert "pip install megatron-core" in message, message
            else:
                raise AssertionError(what + " raised nothing without megatron-core")
        assert "megatron.core" not in sys.modules or sys.modules["megatron.core"] is None
        dist.destroy_process_group()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")


# =============================================================================== the ranks


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _assert_bf16_close(got, want, what):
    """Every element within one bfloat16 rounding (2^-7 relative) of the other."""
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    bound = 2.0 ** -7 * torch.maximum(g.abs(), w.abs())
    bad = ((g - w).abs() > bound) | g.isnan() | w.isnan()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements differ by more than a bfloat16 rounding; "
        f"max |error| {(g - w).abs().max().item():.3e}")


class Rank:
    def __init__(self, backend, rank, init, out_dir):
        import warnings

        import torch.distributed as dist
        # Megatron warns, on import, that TransformerEngine and Apex are missing: noise here.
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core import parallel_state, tensor_parallel

        self.dist = dist
        self.parallel_state = parallel_state
        self.rank = rank
        self.lo, self.hi = rank * WIDTH, (rank + 1) * WIDTH
        self.device = ranks.join_group(backend, rank, init, WORLD)
        # Megatron's own set-up; its groups get the default backend (Gloo on CPU works).
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        assert parallel_state.get_tensor_model_parallel_rank() == rank
        # megatron-core 0.17 and later: vocab_parallel_cross_entropy(..., tp_group=None), whose
        # rank is the group's; 0.16.1: no tp_group, the rank is Megatron's (overridable)
        self.megatron_version = tuple(
            int(p) for p in importlib.metadata.version("megatron-core").split(".")[:2])
        self.takes_tp_group = "tp_group" in inspect.signature(
            tensor_parallel.vocab_parallel_cross_entropy).parameters
        assert self.takes_tp_group == (self.megatron_version >= (0, 17)), (
            self.megatron_version, self.takes_tp_group)
        # another group of the same ranks, made now (a collective) on every rank alike
        self.other_group = dist.new_group(list(range(WORLD)))
        self.path = pathlib.Path(out_dir) / f"rank{rank}.json"
        self.results = {}

        # The same full logits, targets and loss weights on every rank.
        g = torch.Generator().manual_seed(0)
        self.full = torch.randn((S, B, V), generator=g, dtype=torch.float64) * 2.0
        self.target = torch.randint(0, V, (S, B), generator=g)
        # grad_output as Megatron makes it: loss mask times 1 / tokens, never 1
        self.weight = (torch.rand((S, B), generator=g) + 0.5) / (S * B)

    def record(self, case, fn):
        try:
            fn()
            self.results[case] = {"ok": True}
        except BaseException:  # noqa: B902  (an assertion, a RuntimeError, anything)
            self.results[case] = {"ok": False, "error": traceback.format_exc()}
        self.path.write_text(json.dumps(self.results))  # as we go: a hang keeps what ran

    def shard(self, dtype):
        """This rank's logits shard, a leaf that requires grad."""
        x = self.full[..., self.lo:self.hi].to(dtype).contiguous()
        return x.to(self.device).requires_grad_()

    def run_loss(self, fn, dtype, *args):
        """(loss, gradient of this rank's shard for grad_output = weight) of fn(logits, ...).
        The logits given to fn are a copy (Megatron's function overwrites float32 logits)."""
        x = self.shard(dtype)
        loss = fn(x * 1, self.target.to(self.device), *args)
        loss.backward(self.weight.to(self.device))
        return loss.detach(), x.grad

    def unfused_case(self, dtype_name, how):
        from megatron.core import tensor_parallel

        import xent.megatron as xm
        dtype = DTYPES[dtype_name]
        megatron = tensor_parallel.vocab_parallel_cross_entropy
        if how == "tp_group_keyword" and self.takes_tp_group:  # Megatron's own call, as 0.19's
            megatron = functools.partial(megatron, tp_group=self.tp_group)  # LanguageModule's
        want_loss, want_grad = self.run_loss(megatron, dtype)

        x = self.shard(dtype)
        before = x.detach().clone()
        target = self.target.to(self.device)
        if how == "tp_group":
            loss = xm.vocab_parallel_cross_entropy(x, target, 0.0, self.tp_group)
        elif how == "tp_group_keyword":
            loss = xm.vocab_parallel_cross_entropy(x, target, tp_group=self.tp_group)
        else:
            loss = xm.vocab_parallel_cross_entropy(x, target)
        assert loss.dtype == torch.float32 == want_loss.dtype, (loss.dtype, want_loss.dtype)
        ranks.assert_close(loss, want_loss, 1e-6, "loss vs Megatron's")
        loss.backward(self.weight.to(self.device))
        assert x.grad.dtype == dtype, x.grad.dtype
        if dtype == torch.float32:
            ranks.assert_close(x.grad, want_grad, 1e-6, "gradient vs Megatron's")
        else:  # both round a float32 gradient once
            _assert_bf16_close(x.grad, want_grad, "gradient vs Megatron's")
        assert torch.equal(x.detach(), before), "xent wrote the logits"

    def fused_case(self, dtype_name):
        from megatron.core.fusions import fused_cross_entropy

        import xent.megatron as xm
        dtype = DTYPES[dtype_name]
        want_loss, want_grad = self.run_loss(
            fused_cross_entropy.fused_vocab_parallel_cross_entropy, dtype, self.tp_group)
        loss, grad = self.run_loss(xm.fused_vocab_parallel_cross_entropy, dtype, self.tp_group)
        ranks.assert_close(loss, want_loss, 1e-6, "fused loss vs Megatron's")
        assert grad.dtype == dtype, grad.dtype  # Megatron's is rounded to bf16 in any case
        _assert_bf16_close(grad, want_grad, "fused gradient vs Megatron's")

    def signature_case(self):
        """xent's entry points take Megatron's parameters (names, defaults, kinds): all of them
        (megatron-core 0.19: vocab_parallel_cross_entropy's four, tp_group last), and xent's
        tp_group after 0.16.1's three; the patched entry points show the same signatures."""
        from megatron.core import tensor_parallel
        from megatron.core.fusions import fused_cross_entropy

        import xent.megatron as xm

        def params(fn):
            return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]

        for megatron, mine in (
                (tensor_parallel.vocab_parallel_cross_entropy, xm.vocab_parallel_cross_entropy),
                (fused_cross_entropy.fused_vocab_parallel_cross_entropy,
                 xm.fused_vocab_parallel_cross_entropy)):
            theirs, ours = params(megatron), params(mine)
            assert ours[:len(theirs)] == theirs, (megatron.__name__, theirs, ours)
            assert len(ours) == len(theirs) or (
                not self.takes_tp_group and megatron.__name__ == "vocab_parallel_cross_entropy"
                and [p[0] for p in ours[len(theirs):]] == ["tp_group"]), (theirs, ours)
        tp_group = inspect.signature(xm.vocab_parallel_cross_entropy).parameters["tp_group"]
        assert tp_group.default is None, tp_group
        if self.takes_tp_group:
            assert len(params(tensor_parallel.vocab_parallel_cross_entropy)) == 4
        xm.patch()
        try:
            for fn in (tensor_parallel.vocab_parallel_cross_entropy,
                       fused_cross_entropy.fused_vocab_parallel_cross_entropy):
                assert params(fn) == params(fn.__wrapped__), (fn, params(fn))
        finally:
            xm.unpatch()

    def smoothing_case(self):
        import warnings

        import torch.nn.functional as F
        from megatron.core import tensor_parallel

        import xent.megatron as xm
        # xent: PyTorch's definition, on the full logits, in float64
        full = self.full.clone().requires_grad_()
        want = F.cross_entropy(full.view(-1, V), self.target.view(-1), reduction="none",
                               label_smoothing=SMOOTHING).view(S, B)
        want.backward(self.weight.double())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grad = self.run_loss(xm.vocab_parallel_cross_entropy, torch.float32,
                                       SMOOTHING)
        assert any(issubclass(w.category, UserWarning) and "label_smoothing" in str(w.message)
                   and "not Megatron-core's" in str(w.message) for w in caught), (
            [str(w.message) for w in caught])
        ranks.assert_close(loss, want.detach(), 1e-6, "smoothed loss vs float64 F.cross_entropy")
        ranks.assert_close(grad, full.grad[..., self.lo:self.hi], 1e-6,
                           "smoothed gradient vs float64 F.cross_entropy")

        # Megatron: (1 - s) * CE - s * mean over this rank's columns of log softmax,
        # s = alpha * WIDTH / (WIDTH - 1), as docs/megatron.md states
        meg, _ = self.run_loss(tensor_parallel.vocab_parallel_cross_entropy, torch.float32,
                               SMOOTHING)
        log_p = torch.log_softmax(self.full, dim=-1)
        ce = -log_p.gather(-1, self.target.unsqueeze(-1)).squeeze(-1)
        s = SMOOTHING * WIDTH / (WIDTH - 1)
        meg_formula = (1 - s) * ce - s * log_p[..., self.lo:self.hi].mean(-1)
        ranks.assert_close(meg, meg_formula, 1e-5,
                           "Megatron's smoothed loss vs the documented formula")

        differ = (meg.cpu().double() - loss.cpu().double()).abs().max().item()
        assert differ > 1e-3, f"Megatron's smoothed loss equals xent's (max |diff| {differ:.2e})"
        both = [torch.empty_like(meg) for _ in range(WORLD)]
        self.dist.all_gather(both, meg)
        apart = (both[0] - both[1]).abs().max().item()
        assert apart > 1e-3, f"Megatron's ranks agree on the smoothed loss ({apart:.2e})"

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

    def run_all(self):
        for case, args in UNFUSED_CASES.items():
            self.record(case, lambda: self.unfused_case(*args))
        for case, dtype_name in FUSED_CASES.items():
            self.record(case, lambda: self.fused_case(dtype_name))
        self.record("signature", self.signature_case)
        self.record("smoothing", self.smoothing_case)
        self.record("patch", self.patch_case)
        self.record("errors", self.errors_case)
        self.record("rank_override", self.rank_override_case)

        def finish():
            self.dist.barrier()
            self.parallel_state.destroy_model_parallel()
            self.dist.destroy_process_group()
        self.record("done", finish)


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    Rank(backend_, int(rank_), init_, out_dir_).run_all()
