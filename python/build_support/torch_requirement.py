"""The wheel's torch requirement, for `pip install .` (pyproject.toml names this provider).

libxent_torch.so is built against the C++ ABI of one PyTorch, the one importable where pip
builds (hence `pip install --no-build-isolation .`): the wheel requires exactly that version.
"""


def dynamic_metadata(field, settings=None, project=None):
    if field != "dependencies":
        raise RuntimeError(f"xent: torch_requirement provides 'dependencies', not {field!r}")
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            "xent: building the wheel needs the PyTorch it will run with, importable by the "
            "building Python: install torch first, then `pip install --no-build-isolation .` "
            f"({e})") from e
    return [f"torch=={torch.__version__.split('+')[0]}"]
