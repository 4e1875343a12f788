"""bench/linear_side_by_side.py's peers: their fused linear cross-entropy functions, each
imported where it can be, or why it cannot."""

import os
import site

PEERS = ("quack", "liger", "liger cutedsl sm90", "cce")


def why(e):
    """An exception in one line: what a row prints instead of its numbers."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def process_pythonpath_pth():
    """pip install --target DIR puts no DIR on sys.path as a site folder: where DIR is only on
    PYTHONPATH, its .pth files are not read. CuTe DSL's wheel puts its `cutlass` package on
    sys.path through one (nvidia_cutlass_dsl_packages.pth): read them as a site folder's."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        try:
            if entry and any(n.endswith(".pth") for n in os.listdir(entry)):
                site.addsitedir(entry)
        except OSError:
            continue


def in_site_packages(module):
    name = os.path.abspath(getattr(module, "__file__", None) or "")
    return any(f"{os.sep}{d}{os.sep}" in name for d in ("site-packages", "dist-packages"))


def optional(cuda, args):
    """name -> the peers' fused linear cross-entropy fn(h, W, y), or "n/a (why)"."""
    if not cuda:
        return {name: "n/a (skipped on CPU)" for name in PEERS}
    process_pythonpath_pth()
    out = {}
    try:
        import cutlass
        if not in_site_packages(cutlass):
            raise ImportError(f"cutlass in {os.path.dirname(cutlass.__file__)}: quack needs it "
                              "in a site-packages folder (pip install --target DIR/site-packages)")
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
        chunk = args.quack_chunk
        out["quack"] = lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_size=chunk)
    except Exception as e:  # noqa: BLE001 - not only ImportError: CuTe DSL checks the driver
        out["quack"] = f"n/a ({why(e)})"
    try:
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            out["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
        except ImportError:  # an older Liger-Kernel: the module, whose order is (W, h, y)
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            module = LigerFusedLinearCrossEntropyLoss()
            out["liger"] = lambda h, w, y: module(w, h, y)
    except Exception as e:  # noqa: BLE001
        out["liger"] = f"n/a ({why(e)})"
    try:
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
            liger_fused_linear_cross_entropy_sm90)
        out["liger cutedsl sm90"] = liger_fused_linear_cross_entropy_sm90
    except Exception as e:  # noqa: BLE001
        out["liger cutedsl sm90"] = f"n/a ({why(e)})"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cce"] = lambda h, w, y: cce(h, w, y)
    except Exception as e:  # noqa: BLE001
        out["cce"] = f"n/a ({why(e)})"
    return out
