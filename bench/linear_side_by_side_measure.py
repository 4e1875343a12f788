"""bench/linear_side_by_side.py's measurements of a row: its float64 reference and errors, its
times, its memory, and the copy bandwidth that its floor takes."""

import statistics
import time

import torch

MIB = float(1 << 20)


def reference(h, w, y):
    """float64 (loss, dH, dW) of the mean loss, the logits made ~1 GiB of rows at a time."""
    hd, wd = h.detach().double(), w.detach().double()
    tokens, vocab = y.numel(), wd.shape[0]
    step = max(1, (1 << 30) // (vocab * 8))
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    d_hidden = torch.empty_like(hd)
    d_weight = torch.zeros_like(wd)
    for r in range(0, tokens, step):
        logits = hd[r:r + step] @ wd.T
        t = y[r:r + step]
        lse = torch.logsumexp(logits, -1)
        loss += (lse - logits.gather(1, t[:, None])[:, 0]).sum()
        grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
        grad[torch.arange(t.numel(), device=t.device), t] -= 1.0
        grad /= tokens
        d_hidden[r:r + step] = grad @ wd
        d_weight.addmm_(grad.T, hd[r:r + step])
        del logits, grad
    return loss / tokens, d_hidden, d_weight


def logits_distribution(h, w, dtype):
    """The logits' measured std and the share of softmax probabilities >= CCE's gradient filter
    (filter_eps "high": the dtype's eps / 32), over up to 256 rows."""
    with torch.no_grad():
        logits = h[:256].float() @ w.float().T
        probs = torch.softmax(logits, -1)
        eps = torch.finfo(dtype).eps / 32
        return logits.std().item(), (probs >= eps).double().mean().item(), eps


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def outside_torch():
    """Device memory in use outside PyTorch's caching allocator."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def measure(step, h, w, args, cuda, ref, grads_bytes, paired=None):
    """{"ms", "extra_mib", "peak_mib", "outside_mib", "loss_err", "dh_err", "dw_err",
    "paired_ms"} of one row; grads_bytes: the bytes of dH and dW, taken off the peak; paired: a
    step timed after each of the row's (gemm3's), its median in "paired_ms"."""
    def clear():
        h.grad = None
        w.grad = None

    def timed(fn):
        clear()
        sync(cuda)
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            out = fn()
            ms = (time.perf_counter() - t0) * 1e3
        del out
        return ms

    res = {"extra_mib": None, "peak_mib": None, "outside_mib": None, "loss_err": None,
           "dh_err": None, "dw_err": None}
    clear()
    sync(cuda)
    outside0 = outside_torch() if cuda else None
    for _ in range(args.warmup):
        clear()
        out = step()
        del out
    clear()
    sync(cuda)
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss, d_hidden, d_weight = step()
    sync(cuda)
    if cuda:
        res["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
        res["extra_mib"] = res["peak_mib"] - grads_bytes / MIB
        res["outside_mib"] = (outside_torch() - outside0) / MIB
    if ref is not None and loss is not None:
        res["loss_err"] = abs(loss.double().item() - ref[0].item())
        res["dh_err"] = rel_err(d_hidden, ref[1])
        res["dw_err"] = rel_err(d_weight, ref[2])
    del loss, d_hidden, d_weight
    times, paired_times = [], []
    for _ in range(args.iters):
        times.append(timed(step))
        if paired is not None:
            paired_times.append(timed(paired))
    clear()
    res["ms"] = statistics.median(times)
    res["paired_ms"] = statistics.median(paired_times) if paired_times else None
    # The same steps back to back, one synchronisation after the last: a step's wall time once
    # the host runs ahead of the device, as bench/linear_profile.py and xent_dist_bench time it
    # (the event-timed single step above starts from an idle device).
    clear()
    sync(cuda)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        clear()
        out = step()
        del out
    sync(cuda)
    res["b2b_ms"] = (time.perf_counter() - t0) * 1e3 / args.iters
    clear()
    return res


def copy_bandwidth(device, cuda):
    """Bytes read and written a second by a device-to-device copy, the best of 10."""
    src = torch.empty((1 << 30) if cuda else (64 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(cuda)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(cuda)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best
