"""bench/linear_accuracy.py's table: each rank's rows of errors and their printout."""

from linear_accuracy_problem import errors, scale_roundings


def rank_rows(p, k, ref, peers, xents):
    """The table's rows for rank k: [(schedule or "", impl, dH errors, dW errors)]."""
    lo, hi = p.shard(k)
    own = p.own(k)
    rows = []
    for name, (dh, dw) in peers.items():
        rows.append(("", name, errors(dh[own], ref[0][own]), errors(dw[lo:hi], ref[1][lo:hi])))
    for sched, got in xents.items():
        if isinstance(got, str):
            rows.append((sched, "xent", got, got))
            continue
        dh, dw = got
        rows.append((sched, "xent", errors(dh, ref[0][own]), errors(dw, ref[1][lo:hi])))
    return rows


def print_table(p, all_rows, device_name):
    dx, dt = scale_roundings(p.valid)
    print(f"# linear_accuracy.py: {device_name}, tp {p.tp}, {p.rows} rows a rank, hidden {p.H}, "
          f"V {p.vocab} in shards of {p.width}, n = {p.valid} valid rows; delta(n) = "
          f"{dx:+.2e} (xent), {dt:+.2e} (torch bf16)")
    print("\n| rank | schedule | row | dH max | dH fro | dW max | dW fro | xent/torch dH max | "
          "dH fro | dW max | dW fro |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, rows in enumerate(all_rows):
        torch_row = next((r for r in rows if r[1] == "torch"), None)
        for sched, impl, eh, ew in rows:
            if isinstance(eh, str):
                print(f"| {k} | {sched} | {impl} | {eh} | | | | | | | |")
                continue
            cells = [f"{eh['max']:.3e}", f"{eh['fro']:.3e}", f"{ew['max']:.3e}",
                     f"{ew['fro']:.3e}"]
            ratios = [""] * 4
            if impl == "xent" and torch_row is not None:
                th, tw = torch_row[2], torch_row[3]
                ratios = [f"{eh['max'] / th['max']:.2f}", f"{eh['fro'] / th['fro']:.2f}",
                          f"{ew['max'] / tw['max']:.2f}", f"{ew['fro'] / tw['fro']:.2f}"]
            print(f"| {k} | {sched} | {impl} | " + " | ".join(cells + ratios) + " |")
    print(flush=True)
