"""xent.linear_cross_entropy is, on every rank, no less accurate than torch's unfused bf16 path
(issue 38, part 4): the configuration of the issue's anomaly (TP 4 with sequence parallelism,
bf16, 1024 rows per rank, hidden 1024, V 50257 in even shards of 12565, 10 % of rows ignored,
mean reduction), where rank 0's d_weight was measured 3.67e-3 from float64 against torch's
2.43e-3 while ranks 1 to 3 agreed. Each rank's d_weight (its shard) and d_hidden (its rows) are
compared with float64 and with torch's path on the same data, rank by rank:

  * err = max |x - ref| / max |ref| over the rank's block (the issue's measure) and
    ||x - ref|| / ||ref|| (Frobenius: steadier, a few top elements do not move it);
  * xent's must be within MARGIN_MAX (max) and MARGIN_FRO (Frobenius) of torch's on the same
    rank and block. Why these: in an emulation of the CUDA backend's former arithmetic at this
    configuration (bench/linear_accuracy.py's "folded" row, before the fix below; 16 problems, n
    from 3645 to 3721, 64 rank blocks), wherever xent and torch round the mean's 1 / n to the
    same bf16 number (most n) the largest d_weight elements, which the target terms -(1 - p) / n (p ~ 0) dominate, came
    out the same bits and xent's max error was 0.94x to 1.04x torch's; its Frobenius errors were
    below torch's in every block measured (d_weight 0.97x to 0.99x, d_hidden 0.95x: its gradient
    of the logits is the correctly rounded one, from fp32 logits). The margins leave room for
    that and for the GEMMs' other fp32 summation orders on a GPU; the issue's 1.51x is outside
    them. The CPU backend keeps the gradient in fp32 and is far inside them;
  * cases: "uniform" targets and targets skewed to the low ids that rank 0 holds ("zipf": P(id)
    ~ 1 / (id + 10)), 410 rows ignored (n = 3686 valid); and "swing" (uniform, seed 20, 391 rows
    ignored: n = 3705), where the CUDA backend's former arithmetic (the scale folded into the
    bf16 gradient) was 1.41x torch's on rank 1 and 0.94x to 0.99x on the other ranks: the
    issue's pattern. There bf16(1 / n) is 3.5e-3 above
    1 / n and torch's bf16(1 / bf16(n)) 3.6e-3 below it, each about half an ulp of the largest
    d_weight elements, so a rank's max error is decided by how its one or two largest elements
    round: rank 1's largest is just above a power of two, and xent's lands 0.78 ulp from
    float64, torch's 0.22. Its Frobenius errors are below torch's on every rank there. The
    CUDA backend now applies the mean's scale as the GEMMs' fp32 alpha instead of folding it
    into the bf16 gradient (xent_model(scale_in_gemm=True)): 1.8e-3 on rank 1, below torch's on
    every rank and case. The swing case would fail on CUDA with the folded scale (never on the
    CPU backend, whose gradient is fp32).

Backends: 4 ranks over Gloo (the CPU backend), and over NCCL where there are 2 or more GPUs
(cuda:<rank>, as many ranks as GPUs up to 4, V in that many shards); one process on one device
(CPU, and CUDA where there is one): one TP-1 call over every rank's rows and the whole weight, its
d_weight cut into the 4 shards and d_hidden into the 4 ranks' rows (the same problem: shard k's
d_weight is rows [k x 12565, ...) of it). test_arithmetic_no_worse_than_torch checks the
emulated arithmetic itself, the CUDA backend's and the former folded one (xfail on the swing
case: the test that would have caught the anomaly; no library needed).

float64 reference and torch's path are made once per case in the test process (on cuda:0 for
NCCL); the ranks write their gradients to the test's temporary folder. The issue's size takes
15 to 20 minutes on a 2-core CPU (with OpenBLAS; a build without a CBLAS is far slower), much
less on a GPU: XENT_ACCURACY_SIZE=issue runs it (with the swing case); the default, small, runs
256 rows a rank, hidden 256 and V 12007 instead (no swing case; under a minute).

Run (from the repository root, with the library built):
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q tests/python/test_linear_accuracy.py
"""

import functools
import json
import os
import pathlib
import sys

import pytest
import torch

import ranks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import linear_accuracy as acc  # noqa: E402  (the problem, float64, torch's path, the errors)

SIZES = {
    "issue": dict(rows=1024, hidden=1024, vocab=50257),
    "small": dict(rows=256, hidden=256, vocab=12007),
}
# CI runs the small size (under a minute); the (with the swing case) on request.
SIZE = SIZES[os.environ.get("XENT_ACCURACY_SIZE", "small")]
# name -> Problem's arguments (ignore=0.1: 410 of 4096 rows)
CASES = {"uniform": dict(targets="uniform", seed=0), "zipf": dict(targets="zipf", seed=1)}
if SIZE is SIZES["issue"]:  # the anomaly's pattern, at this size only
    CASES["swing"] = dict(targets="uniform", seed=20, ignored=391)
MARGIN_MAX = 1.25
MARGIN_FRO = 1.05
DEADLINE_S = 1200


def problem(case, tp=4):
    return acc.Problem(tp=tp, ignore=0.1, **CASES[case], **SIZE)


@functools.lru_cache(maxsize=None)
def expected(case, tp, device):
    """(problem, float64 (d_hidden, d_weight), torch's (d_hidden, d_weight)) on `device`."""
    p = problem(case, tp)
    return p, acc.reference(p, torch.device(device)), acc.torch_unfused(p, torch.device(device))


def compare(p, ref, peer, got, peer_name="torch"):
    """Per rank: the errors of xent's and the peer's (torch's) d_hidden and d_weight; failures as
    lines. got: rank -> (d_hidden of its rows, d_weight of its shard's real rows)."""
    lines, failures = [], []
    for k, (dh, dw) in sorted(got.items()):
        lo, hi = p.shard(k)
        own = p.own(k)
        for what, x, want, theirs in (("d_hidden", dh, ref[0][own], peer[0][own]),
                                      ("d_weight", dw, ref[1][lo:hi], peer[1][lo:hi])):
            e, t = acc.errors(x, want), acc.errors(theirs, want)
            line = (f"rank {k} {what}: xent max {e['max']:.3e} fro {e['fro']:.3e}, {peer_name} "
                    f"max {t['max']:.3e} fro {t['fro']:.3e}")
            if e["max"] > MARGIN_MAX * t["max"] or e["fro"] > MARGIN_FRO * t["fro"]:
                failures.append(line)
                line += "   <-- past the margin"
            lines.append(line)
    dx, dt = acc.scale_roundings(p.valid)
    head = (f"n = {p.valid} valid rows, delta(n) = {dx:+.2e} (xent), {dt:+.2e} (torch); "
            f"allowed: xent <= {MARGIN_MAX} x {peer_name} (max), {MARGIN_FRO} x {peer_name} "
            "(Frobenius)")
    return failures, "\n".join([head] + lines)


# ------------------------------------------------------------------------ several ranks


def _backends():
    gpus = torch.cuda.device_count()
    return ["gloo-4"] + ([f"nccl-{min(gpus, 4)}"] if gpus >= 2 else [])


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    runs = {}

    def get(backend):
        if backend not in runs:
            tmp = tmp_path_factory.mktemp(f"accuracy_{backend}")
            world = int(backend.split("-")[1])
            runs[backend] = (tmp, *ranks.launch(__file__, backend, tmp, world, DEADLINE_S))
        return runs[backend]
    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", _backends())
def test_ranks_no_worse_than_torch(backend, case, rank_runs):
    """Sequence parallelism over the group: every rank's d_weight and d_hidden against torch's."""
    tmp, results, reports = rank_runs(backend)
    ranks.expect_case(results, reports, case)
    world = int(backend.split("-")[1])
    device = "cuda:0" if backend.startswith("nccl") else "cpu"
    p, ref, peer = expected(case, world, device)
    got = {}
    for k in range(world):
        saved = torch.load(tmp / f"{case}-rank{k}.pt")
        got[k] = (saved["d_hidden"].to(device), saved["d_weight"].to(device))
    failures, table = compare(p, ref, peer, got)
    print(table)
    assert not failures, "xent less accurate than torch's unfused path:\n" + table


# ------------------------------------------------------------------- one process, one device


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
def test_one_device_shards_no_worse_than_torch(device, case):
    """One TP-1 call over the 4 ranks' rows and the whole weight, cut into the 4 shards (a
    column-range dependence, such as one for the columns near 0, shows here on one GPU)."""
    p, ref, peer = expected(case, 4, device)
    dh, dw = acc.xent_emulated(p, torch.device(device))
    got = {k: (dh[p.own(k)], dw[slice(*p.shard(k))]) for k in range(p.tp)}
    failures, table = compare(p, ref, peer, got)
    print(table)
    assert not failures, "xent less accurate than torch's unfused path:\n" + table


@pytest.mark.parametrize("in_gemm", [True, False], ids=["xent", "folded"])
@pytest.mark.parametrize("case", list(CASES))
def test_arithmetic_no_worse_than_torch(case, in_gemm, request):
    """The CUDA backend's arithmetic for bf16 inputs (fp32 logits, the gradient p - [target]
    rounded to bf16 once, fp32-accumulated GEMMs that apply the scale s as alpha), emulated in
    torch: per rank no worse than torch's path. Where this passes and test_ranks_* fails on
    GPUs, the implementation departs from its own arithmetic on that rank. "folded": s p - s
    [target] rounded instead (the arithmetic before issue 38), which fails the swing case."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if case == "swing" and not in_gemm:  # measured on the CPU: strict there
        request.applymarker(pytest.mark.xfail(
            strict=device == "cpu", reason="the folded scale: delta(3705) = +3.5e-3 in the bf16 "
            "gradient, rank 1's d_weight max error 1.41x torch's (issue 38)"))
    p, ref, peer = expected(case, 4, device)
    dh, dw = acc.xent_model(p, torch.device(device), scale_in_gemm=in_gemm)
    got = {k: (dh[p.own(k)], dw[slice(*p.shard(k))]) for k in range(p.tp)}
    failures, table = compare(p, ref, peer, got)
    print(table)
    assert not failures, "xent's arithmetic less accurate than torch's:\n" + table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: cuBLASLt's GEMMs")
@pytest.mark.parametrize("schedule", ["fast", "lean"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_shard_on_one_gpu_no_worse_than_torch(case, schedule):
    """One rank's GEMM shapes at TP 4 in a TP-1 call on one GPU: the four ranks' rows and a
    vocabulary as wide as one shard, so that d_weight is one GEMM of [shard x hidden], K = every
    row (3002 x 256 x 1024 at the small size). On four GPUs every rank's d_weight came out with a
    Frobenius error of 2.24e-3 to 2.29e-3, past the margin, where the whole problem in one call
    gave 1.67e-3 to 1.71e-3 (stop 51, test_ranks_no_worse_than_torch[nccl-4-zipf]): cuBLASLt can
    split K there and add the slices in bf16 (docs/linear.md, "Accuracy"). Torch's path is less
    accurate at this shape than the split made xent (its GEMMs here are fp32, rounded once), so
    xent is also held to its own arithmetic (acc.xent_model: the same roundings, fp32 GEMMs) within
    the same margins: on two H200, 1.72e-3 with the mask against 2.38e-3 without it (stop 52)."""
    size = dict(SIZE, rows=4 * SIZE["rows"], vocab=-(-SIZE["vocab"] // 4))
    p = acc.Problem(tp=1, ignore=0.1, **CASES[case], **size)
    device = torch.device("cuda:0")
    ref = acc.reference(p, device)
    got = {0: acc.xent_emulated(p, device, schedule=schedule)}
    failures, table = compare(p, ref, acc.torch_unfused(p, device), got)
    model_failures, model_table = compare(p, ref, acc.xent_model(p, device), got, "model")
    print(table + "\n" + model_table)
    assert not failures + model_failures, ("xent less accurate than torch's unfused path or its "
                                           "own arithmetic:\n" + table + "\n" + model_table)


# ------------------------------------------------------------------------------- the worker


def worker(backend, rank, init, out_dir):
    """One rank: each case's xent gradients written to out_dir/<case>-rank<k>.pt."""
    kind, world = backend.split("-")
    world = int(world)
    device = ranks.join_group(kind, rank, init, world)
    import torch.distributed as dist
    results = {}
    path = pathlib.Path(out_dir) / f"rank{rank}.json"
    for case in CASES:
        try:
            p = problem(case, world)
            dh, dw = acc.xent_rank(p, rank, dist.group.WORLD, device)
            torch.save({"d_hidden": dh.detach().cpu(), "d_weight": dw.detach().cpu()},
                       pathlib.Path(out_dir) / f"{case}-rank{rank}.pt")
            results[case] = {"ok": True}
        except BaseException:  # noqa: B902
            import traceback
            results[case] = {"ok": False, "error": traceback.format_exc()}
        path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    backend_, rank_, init_, out_dir_ = sys.argv[1:5]
    if backend_.startswith("gloo"):  # the CPU backend's BLAS: the cores shared by the ranks
        share = max(1, (os.cpu_count() or 1) // int(backend_.split("-")[1]))
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(share))
        torch.set_num_threads(share)
    worker(backend_, int(rank_), init_, out_dir_)
