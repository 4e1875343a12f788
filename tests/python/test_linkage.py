"""libxent_torch.so (and xent._C, where it is built) links the shared libstdc++ and carries no
copy of it.

A copy of libstdc++ linked into the library (a toolchain with only libstdc++.a, as /opt/gcc on
the GPU machines) made every error message holding a number crash the Python process: the copy's
stream code ran against locale state that the process's own libstdc++.so.6 had set up. See
src/torch/CMakeLists.txt. Run: XENT_TORCH_LIB=... PYTHONPATH=python python3 -m pytest tests/python
"""

import shutil
import subprocess

import pytest

import xent

# Symbols that only libstdc++'s own objects define (explicit instantiations and non-template
# code): a library that defines any of them carries (part of) libstdc++.a.
SENTINELS = [
    "_ZNSo9_M_insertIlEERSoT_",  # std::ostream::_M_insert<long>
    "_ZNSt6locale7classicEv",  # std::locale::classic()
    "_ZNSt8ios_base4InitC1Ev",  # std::ios_base::Init::Init()
]


def _lines(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()


def _libstdcxx_of_this_process():
    with open("/proc/self/maps") as f:
        for line in f:
            if "libstdc++.so" in line:
                return line.split()[-1]
    pytest.fail("no libstdc++.so is mapped into this Python process")


def _defined(path):
    out = set()
    for line in _lines(["nm", "-D", "--defined-only", path]):
        parts = line.split()
        if len(parts) >= 3:
            out.add(parts[2].split("@")[0])
    return out


needs_binutils = pytest.mark.skipif(not shutil.which("nm") or not shutil.which("readelf"),
                                    reason="needs nm and readelf (binutils)")


def _libraries():
    """The shared objects `import xent` loaded: the library, and xent._C where there is one."""
    paths = [xent.library_path()]
    if xent._direct is not None:
        paths.append(xent._direct.__file__)
    return paths


@needs_binutils
@pytest.mark.parametrize("path", _libraries(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_library_needs_the_shared_libstdcxx(path):
    needed = [l for l in _lines(["readelf", "-d", path]) if "(NEEDED)" in l]
    assert any("libstdc++.so" in l for l in needed), "NEEDED has no libstdc++.so: " + str(needed)


@needs_binutils
@pytest.mark.parametrize("path", _libraries(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_library_defines_no_libstdcxx_internals(path):
    ours = _defined(path)
    assert not [s for s in SENTINELS if s in ours], "libstdc++'s own code is inside " + path
    # A good build shares only a few inline members (e.g. basic_stringbuf's destructors) with
    # libstdc++'s exports; a static copy shares thousands.
    shared = ours & _defined(_libstdcxx_of_this_process())
    assert len(shared) < 50, f"{len(shared)} symbols of libstdc++ defined in {path}"
