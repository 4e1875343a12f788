"""Runs a test file's worker on several ranks, as subprocesses that meet through a file:// store:
`python3 <worker_file> <backend> <rank> <init_method> <tmp>`. Each rank writes <tmp>/rank<k>.json
(case -> {"ok": bool, "error": str}) as it goes; the ranks get a deadline and are killed past it,
so that no test hangs, and a rank that died or hung is reported with the end of its output."""

import json
import os
import subprocess
import sys
import time


def has_megatron():
    """Whether megatron-core is installed (the reference of the Megatron tests)."""
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all
        return False


def needs_megatron(reference):
    """The skip mark of a Megatron test whose reference is `reference` (Megatron's own ...)."""
    import pytest
    return pytest.mark.skipif(
        not has_megatron(),
        reason="megatron-core is not installed (pip install megatron-core==0.16.1, or 0.19.2 "
               f"under Python 3.12); the reference for these tests is Megatron's own {reference}")


def launch(worker_file, backend, tmp, world=2, deadline_s=240):
    """Runs `world` ranks to completion or the deadline; returns (per-rank results, reports)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if backend.startswith("nccl"):  # "nccl", "nccl-2": no NVLink multicast (NVLS) here
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   NVSHMEM_DISABLE_NVLS="1")
    init = f"file://{tmp / 'store'}"
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(worker_file), backend, str(rank), init, str(tmp)],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + deadline_s
    status = []
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
            status.append(f"exit status {p.returncode}")
        except subprocess.TimeoutExpired:
            status.append(f"killed after the {deadline_s} s deadline (hung?)")
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    results, reports = [], []
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
        tail = (tmp / f"rank{rank}.log").read_text()[-3000:]
        reports.append(f"rank {rank} ({backend}): {status[rank]}; its output ends:\n{tail}")
    return results, reports


def expect_case(results, reports, case):
    """Fails the calling test unless every rank finished `case` and it went well there."""
    import pytest
    for rank, per_rank in enumerate(results):
        outcome = per_rank.get(case)
        if outcome is None:
            pytest.fail(f"rank {rank} never finished case {case}\n" + "\n".join(reports))
        assert outcome["ok"], f"rank {rank}, case {case}:\n{outcome['error']}"


def fixture(worker_file, name, world, deadline_s):
    """A module-scoped pytest fixture giving backend -> (per-rank results, reports), the ranks of
    each backend run once: `two_ranks = ranks.fixture(__file__, "name", 2, 240)` in a test file.
    The runs are kept with the fixture, so that test files that import one fixture (each gets a
    module-scoped copy from pytest) share its ranks' run instead of launching them again."""
    import pytest

    runs = {}

    @pytest.fixture(scope="module")
    def two_ranks(tmp_path_factory):
        def get(backend):
            if backend not in runs:
                runs[backend] = launch(worker_file, backend,
                                       tmp_path_factory.mktemp(f"{name}_{backend}"), world,
                                       deadline_s)
            return runs[backend]
        return get
    return two_ranks


def assert_close(got, want, rtol, what):
    """max |got - want| <= rtol * max |want|, in float64; a NaN fails (workers' checks)."""
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    g = got.detach().cpu().double()
    w = want.detach().cpu().double()
    scale = max(w.abs().max().item(), 1e-30)
    err = (g - w).abs().max().item()
    assert err <= rtol * scale, f"{what}: max |error| {err:.3e} > {rtol:g} * {scale:.3e}"


def join_group(backend, rank, init, world):
    """A worker's torch.distributed set-up: NCCL with this rank's GPU current, or Gloo on the
    CPU. Returns the device its tensors live on."""
    import torch
    import torch.distributed as dist
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return device
