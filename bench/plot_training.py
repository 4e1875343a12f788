"""The loss curves of examples/megatron_gpt.py's and examples/titan_train.py's runs, one panel
per JSON they wrote:

    python3 bench/plot_training.py docs/results/megatron-gpt-tp2.json \\
        docs/results/megatron-gpt-tp2-sp.json --out docs/megatron_gpt_tp2.png
    python3 bench/plot_training.py docs/results/titan-1b-tp2.json \\
        docs/results/titan-1b-tp2-nosp.json --out docs/titan_tp2.png

Needs matplotlib (the GPU machines have it; `pip install matplotlib` elsewhere).
"""
import argparse
import json

STYLE = {"megatron": ("Megatron's loss", "C0", "-"),
         "megatron_seed2": ("Megatron's loss, other initial weights", "C0", ":"),
         "titan": ("TorchTitan's loss", "C0", "-"),
         "titan_seed2": ("TorchTitan's loss, other initial weights", "C0", ":"),
         "xent": ("xent's op (logits path)", "C1", "--"),
         "xent_fused": ("xent fused lm head", "C3", "-")}


def summary(run):
    """(median step ms, peak GiB) of a run: megatron_gpt.py's JSON has them; titan_train.py's
    has every step's, of which the first quarter is warm-up."""
    if "median_ms" in run:
        return run["median_ms"], run["peak_mib"] / 1024
    steps = sorted(run["step_time_s"][len(run["step_time_s"]) // 4:])
    return steps[len(steps) // 2] * 1e3, max(run["peak_memory_bytes"]) / 2**30


def title(c):
    sp = ", sequence parallel" if c["sequence_parallel"] else ""
    if "megatron_core" in c:
        return (f"GPTModel {c['layers']} x {c['hidden']}, V {c['vocab']}, TP {c['tp']}{sp}\n"
                f"{c['device']}, megatron-core {c['megatron_core']}")
    model = "Llama 3 debug model" if c.get("flavor", "debugmodel") == "debugmodel" else \
        f"Llama 3.2 {c['flavor']}" if c["flavor"] == "1B" else f"Llama 3 {c['flavor']}"
    vocab = f", V {c['vocab']}" if c.get("vocab") else ""
    dp = c.get("dp_shard", 1)
    mesh = f"FSDP {dp} x TP {c['world'] // dp}" if dp > 1 else f"TP {c['world']}"
    compiled = ", blocks compiled" if c.get("compile") else ""
    return (f"TorchTitan {model}{vocab}, {c['batch']} x {c['seq']} tokens, {mesh}{sp}\n"
            f"{c['device']}, torch {c['torch']}{compiled}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", required=True, help="the PNG to write")
    a = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(a.json), figsize=(6 * len(a.json), 4.2), squeeze=False)
    for ax, path in zip(axes[0], a.json):
        with open(path) as f:
            report = json.load(f)
        c = report["config"]
        for name, run in report["runs"].items():
            label, color, line = STYLE[name]
            ms, gib = summary(run)
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], line, color=color, lw=1.2,
                    label=f"{label}: {ms:.0f} ms/step, {gib:.1f} GiB peak")
        if "loss_floor" in c:
            ax.axhline(c["loss_floor"], color="gray", lw=0.8, ls="--", label="ln 4 (the floor)")
        ax.set_title(title(c), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
