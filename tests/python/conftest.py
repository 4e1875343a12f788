"""Shared set-up of the Python tests: `import xent` works from a checkout, here and in the child
processes the tests start (they inherit os.environ, so python/ goes onto PYTHONPATH as well)."""

import os
import pathlib
import sys

PYTHON_DIR = str(pathlib.Path(__file__).resolve().parents[2] / "python")

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if PYTHON_DIR not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + _paths)
