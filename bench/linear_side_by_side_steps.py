"""bench/linear_side_by_side.py's rows: the step each row times (gemm3, torch's, xent's, the
peers') and what xent's plan says of its call."""

import torch.nn.functional as F
import xent  # from python/, which linear_side_by_side.py puts on the path

from linear_side_by_side_measure import MIB
from linear_side_by_side_peers import PEERS, why


def budget_name(mib):
    return f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib:g} MiB"


def peer_name(peer, args):
    if peer == "quack":
        return f"quack (chunk {args.quack_chunk})"
    if peer == "cce":
        return f"cce (logits ~N(0, {args.logit_std:g}^2))"
    return peer


def gemm3(h, w, g):
    """The floor: the step's three matmuls, g standing for the logits' gradient."""
    def step():
        hd, wd = h.detach(), w.detach()
        logits = hd @ wd.T  # noqa: F841 - live with the other two until the end, as in a step
        return None, g @ wd, g.T @ hd
    return step


def rows(h, w, y, args, extra):
    """(name -> step() returning (loss or None, dH, dW), or a string: why the row is absent
    (gemm3's entry is None: main() makes its G and step); xent's row name -> its
    max_scratch_bytes)."""
    def autograd(loss_fn):
        def step():
            loss = loss_fn()
            loss.backward()
            return loss.detach(), h.grad, w.grad
        return step

    mode = args.grad_mode
    fast = int(args.fast_budget_mib * MIB)
    fast_row = f"xent fast ({budget_name(args.fast_budget_mib)} budget)"
    out = {
        "gemm3": None,
        "torch": autograd(lambda: F.cross_entropy((h @ w.T).float(), y)),
        "torch + xent (inplace_grad)": autograd(
            lambda: xent.vocab_parallel_cross_entropy(h @ w.T, y, inplace_grad=True)),
        "xent default": autograd(
            lambda: xent.linear_cross_entropy(h, w, y, grad_mode=mode, max_scratch_bytes=0)),
        fast_row: autograd(
            lambda: xent.linear_cross_entropy(h, w, y, grad_mode=mode, max_scratch_bytes=fast)),
    }
    for peer in PEERS:
        fn = extra[peer]
        out[peer_name(peer, args)] = fn if isinstance(fn, str) else autograd(
            lambda fn=fn: fn(h, w, y))
    return out, {"xent default": 0, fast_row: fast}


def xent_plan(h, w, y, args, budget):
    """The schedule, scratch and chunks xent.linear_cross_entropy_plan reports for the row's
    call, or "n/a (why)" (a build without the function)."""
    plan_fn = getattr(xent, "linear_cross_entropy_plan", None)
    if plan_fn is None:
        return "n/a (no xent.linear_cross_entropy_plan)"
    try:
        p = plan_fn(h, w, y, grad_mode=args.grad_mode, max_scratch_bytes=budget)
    except Exception as e:  # noqa: BLE001 - a library older than the Python package
        return f"n/a ({why(e)})"
    return (f"{p['schedule']}, scratch {p['scratch_bytes'] / MIB:.1f} of "
            f"{p['budget'] / MIB:.1f} MiB, {p['chunks']} chunks of {p['chunk_rows']} rows x "
            f"{p['chunk_cols']} cols")
