#!/usr/bin/env python3
"""Plots % of the 3-pass roofline against tokens from xent_dist_bench --json files.

    python3 launch/plot.py results/*.json -o docs/roofline.png

One line per dtype and gradient mode (and per model / vocabulary shard / device when the files
mix several). Needs matplotlib (pip install matplotlib, or apt-get install python3-matplotlib).
"""
import argparse
import json
import sys
from collections import defaultdict


def load(paths):
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"plot.py: {path}: cannot read it as JSON ({e})")
        if data.get("tool") != "xent_dist_bench" or "results" not in data:
            sys.exit(f"plot.py: {path}: not an xent_dist_bench --json file")
        runs.append((path, data))
    return runs


def device_of(data):
    env = data.get("env", {})
    detail = env.get("ranks_detail") or []
    name = ""
    if detail and "device" in detail[0]:
        # "#  Rank   0 Pid ... device  0 [bus] NVIDIA H100 80GB HBM3, 80 GiB"
        name = detail[0].split("] ", 1)[-1].split(",")[0].strip()
    return name or env.get("backend", "?")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="JSON files written by xent_dist_bench --json")
    ap.add_argument("-o", "--output", default="roofline.png", help="image to write (default roofline.png)")
    ap.add_argument("--title", default=None, help="plot title")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        sys.exit("plot.py: needs matplotlib: pip install matplotlib (or apt-get install python3-matplotlib)")

    runs = load(args.files)
    # A line per (setup, dtype, mode); the setup goes into the label only when the files differ.
    lines = defaultdict(dict)
    setups = set()
    devices = set()
    for _, data in runs:
        cfg = data.get("config", {})
        dev = device_of(data)
        devices.add(dev)
        for r in data["results"]:
            setup = (cfg.get("model", "?"), cfg.get("tp", data.get("env", {}).get("ranks", "?")), r["vocab_per_rank"], dev)
            setups.add(setup)
            key = (setup, r.get("dtype", cfg.get("dtype", "?")), r["mode"])
            lines[key][r["tokens"]] = r["roofline_pct"]  # a later file wins for the same point
    if not lines:
        sys.exit("plot.py: the files hold no results")

    fig, ax = plt.subplots(figsize=(8, 5))
    for (setup, dtype, mode), pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        xs = sorted(pts)
        label = f"{dtype} {mode}"
        if len(setups) > 1:
            model, tp, width, dev = setup
            label = f"{model} TP{tp} ({width}/rank" + (f", {dev}" if len(devices) > 1 else "") + f"): {label}"
        ax.plot(xs, [pts[x] for x in xs], marker="o", linestyle="-" if mode == "fused" else "--", label=label)
    ax.axhline(100.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ticks = sorted({x for pts in lines.values() for x in pts})
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{int(round(x))}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tokens (rows of the logits)")
    ax.set_ylabel("% of the 3-pass roofline (forward + backward)")
    top = max(max(pts.values()) for pts in lines.values())
    ax.set_ylim(0, max(105.0, top * 1.05))
    ax.grid(True, which="both", alpha=0.3)
    if args.title:
        title = args.title
    else:
        models = sorted({s[0] for s in setups})
        title = "xent: " + ", ".join(models) + " on " + ", ".join(sorted(devices))
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.output, dpi=150)
    print(f"plot.py: wrote {args.output} ({len(lines)} line(s) from {len(runs)} file(s))")


if __name__ == "__main__":
    main()
