"""`pip install .` as a user runs it, into a fresh virtual environment (which sees this Python's
packages through a .pth file, so PyTorch is not installed again): plain (pip's isolated build
against torch==2.11.0) and with --no-build-isolation (against this Python's PyTorch), each then
`import xent` from another directory with no XENT_TORCH_LIB or PYTHONPATH: the package must bring
its own library (and xent._C beside it), name its torch requirement, and compute the loss. Then
`pip install -e .` must import from the source tree. The two installs against this Python's
PyTorch share one build folder (a reinstall's rebuild); the isolated one builds afresh.

Run (from the repository root; needs scikit-build-core, torch and the CUDA toolkit):
    python3 -m pytest -q tests/package/test_pip_install.py
"""

import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent("""
    import importlib.metadata, json, sys
    import torch, torch.nn.functional as F
    import xent
    x = torch.randn(6, 40, dtype=torch.float64).float().requires_grad_()
    t = torch.tensor([0, 5, 39, -100, 7, 12])
    loss = xent.vocab_parallel_cross_entropy(x, t)
    loss.backward()
    want = F.cross_entropy(x.detach().double(), t)
    print(json.dumps(dict(
        file=xent.__file__, library=xent.library_path(), loss=float(loss), want=float(want),
        direct=None if xent._direct is None else xent._direct.__file__,
        grad_finite=bool(torch.isfinite(x.grad).all()),
        requires=importlib.metadata.requires("xent"))))
""")


# xent._C is built wherever this Python's headers are (as they are for the build's Python here).
HAS_PYTHON_HEADERS = pathlib.Path(sysconfig.get_paths()["include"], "Python.h").is_file()


def check_direct(got):
    """xent._C was installed beside the library and loaded (where it can be built)."""
    if HAS_PYTHON_HEADERS:
        assert got["direct"] is not None, f"xent._C missing or not loaded: {got}"
        assert pathlib.Path(got["direct"]).parent == pathlib.Path(got["library"]).parent, got


def clean_env():
    env = dict(os.environ)
    for k in ("PYTHONPATH", "XENT_TORCH_LIB"):
        env.pop(k, None)
    return env


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), **kw)
    assert r.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited with {r.returncode}\n"
        f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")
    return r.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    pytest.importorskip("scikit_build_core", reason="pip install scikit-build-core")
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(root)])
    python = root / "bin" / "python"
    # The new environment sees this Python's packages (PyTorch, scikit-build-core) after its own,
    # also where this Python is itself a virtual environment (whose packages
    # --system-site-packages would not show: it shows the base interpreter's).
    import site
    own = run([str(python), "-c", "import site; print(site.getsitepackages()[0])"]).strip()
    outer = site.getsitepackages() + [site.getusersitepackages()]
    pathlib.Path(own, "outer_packages.pth").write_text(
        "".join(p + "\n" for p in outer if os.path.isdir(p)))
    return python


@pytest.fixture(scope="module")
def shared_build(tmp_path_factory):
    """One CMake build folder for the installs against this Python's PyTorch (the
    --no-build-isolation one and the editable one): the second reuses the first's objects, as a
    developer's reinstall would, so the suite compiles the CUDA kernels twice, not three times."""
    return tmp_path_factory.mktemp("build")


def check_import(python, cwd):
    import json
    out = run([str(python), "-c", CHECK], cwd=cwd)
    return json.loads(out.strip().splitlines()[-1])


def pip_install(venv, *args):
    """pip install into the venv: with build isolation, pip fetches the build requirements
    (scikit-build-core, torch==2.11.0) from its index or cache; skipped where it cannot."""
    # XENT_PIP_CUDA_ARCH (the ctest sets it to its build's, comma-separated): one architecture
    # keeps the suite's builds short; unset, the package's default (the visible GPUs', else sm_80, sm_90 and
    # sm_100) is built, as a user's `pip install .` does.
    arch = os.environ.get("XENT_PIP_CUDA_ARCH")
    if arch:
        archs = arch.replace(",", ";")
        args = (f"-Ccmake.define.CMAKE_CUDA_ARCHITECTURES={archs}",) + args
    cmd = [str(venv), "-m", "pip", "install", "--no-deps", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
    if r.returncode != 0 and "--no-build-isolation" not in args and (
            "No matching distribution found" in r.stderr or "Could not find a version" in r.stderr):
        pytest.skip(f"pip cannot fetch the build requirements here:\n{r.stderr[-1500:]}")
    assert r.returncode == 0, (
        f"{' '.join(cmd)} exited with {r.returncode}\n"
        f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")


@pytest.mark.parametrize("isolation", ["isolated", "no-build-isolation"])
def test_pip_install_then_import_anywhere(venv, shared_build, tmp_path, isolation):
    if isolation == "isolated":  # plain `pip install <repo>`: builds against torch==2.11.0
        if torch.__version__.split("+")[0] != "2.11.0":
            pytest.skip(f"the isolated build makes a wheel for torch 2.11.0, this is "
                        f"{torch.__version__}")
        pip_install(venv, str(REPO))
    else:
        pip_install(venv, "--no-build-isolation", "--no-index", f"-Cbuild-dir={shared_build}",
                    str(REPO))
    got = check_import(venv, tmp_path)
    site = pathlib.Path(got["file"]).parent
    assert site.parent.name == "site-packages" and str(venv.parent.parent) in got["file"], got
    assert pathlib.Path(got["library"]).parent == site, got
    # Nothing is loaded from where the build ran (an isolated build's folder under /tmp).
    runpath = subprocess.run(["readelf", "-d", got["library"]], capture_output=True,
                             text=True).stdout
    assert "pip-build-env" not in runpath and "$ORIGIN" in runpath, runpath
    assert abs(got["loss"] - got["want"]) <= 1e-5 * abs(got["want"]), got
    assert got["grad_finite"], got
    check_direct(got)
    version = torch.__version__.split("+")[0]
    assert got["requires"] == [f"torch=={version}"], got


def test_editable_install_imports_the_source_tree(venv, shared_build, tmp_path):
    pip_install(venv, "--no-build-isolation", "--no-index", f"-Cbuild-dir={shared_build}", "-e",
                str(REPO))
    got = check_import(venv, tmp_path)
    assert pathlib.Path(got["file"]) == REPO / "python" / "xent" / "__init__.py", got
    assert abs(got["loss"] - got["want"]) <= 1e-5 * abs(got["want"]), got
    check_direct(got)
