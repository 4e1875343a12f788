"""bench/linear_accuracy.py's xent rows: the schedules it runs and the calls of
xent.linear_cross_entropy, one rank of a group or one device emulating them all. xent is imported
in the calls, so that the reference and the peers run where it does not import."""

import ast
import inspect

MIB = 1 << 20


def schedules(extra=(), chunk_mib=64):
    """name -> keyword arguments of xent.linear_cross_entropy ({} where xent does not import:
    the reference and the peers alone)."""
    try:
        import xent
    except ImportError as e:
        print(f"# xent does not import ({str(e)[:160]}): its rows are left out", flush=True)
        return {}
    out = {"default": {}, "chunks": {"max_chunk_bytes": int(chunk_mib * MIB)}}
    if "schedule" in inspect.signature(xent.linear_cross_entropy).parameters:
        out["fast"] = {"schedule": "fast"}
        out["lean"] = {"schedule": "lean"}
    for spec in extra:
        name, _, kv = spec.partition(":")
        kwargs = {}
        for item in filter(None, kv.split(",")):
            k, _, v = item.partition("=")
            try:
                kwargs[k] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                kwargs[k] = v
        out[name] = kwargs
    return out


def xent_rank(p, k, group, device, **kwargs):
    """Rank k's (d_hidden of its rows, d_weight of its shard's real rows) from
    xent.linear_cross_entropy with sequence parallelism over `group`."""
    import xent
    lo, hi = p.shard(k)
    own = p.own(k)
    h = p.hidden[own].to(device, copy=True).requires_grad_()
    w = p.weight[k * p.width:(k + 1) * p.width].to(device, copy=True).requires_grad_()
    loss = xent.linear_cross_entropy(h, w, p.target[own].to(device), group,
                                     sequence_parallel=True, vocab_start=k * p.width,
                                     vocab_size=p.vocab, **kwargs)
    loss.backward()
    return h.grad, w.grad[:hi - lo]


def xent_emulated(p, device, **kwargs):
    """(d_hidden [tp x rows, H], d_weight [vocab, H]) of one TP-1 call over every rank's rows
    and the whole padded weight: rank k's results are its rows and shard of these."""
    import xent
    h = p.hidden.to(device, copy=True).requires_grad_()
    w = p.weight.to(device, copy=True).requires_grad_()
    loss = xent.linear_cross_entropy(h, w, p.target.to(device), vocab_size=p.vocab, **kwargs)
    loss.backward()
    return h.grad, w.grad[:p.vocab]
