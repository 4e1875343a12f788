"""The loss curves of examples/megatron_gpt.py's runs, one panel per JSON it wrote:

    python3 bench/plot_training.py docs/results/megatron-gpt-tp2.json \\
        docs/results/megatron-gpt-tp2-sp.json --out docs/megatron_gpt.png

Needs matplotlib (the GPU machines have it; `pip install matplotlib` elsewhere).
"""
import argparse
import json

STYLE = {"megatron": ("Megatron's loss", "C0", "-"),
         "megatron_seed2": ("Megatron's loss, other initial weights", "C0", ":"),
         "xent": ("xent.megatron.patch() (logits path)", "C1", "--"),
         "xent_fused": ("xent fused lm head", "C3", "-")}


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
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], line, color=color, lw=1.2,
                    label=f"{label}: {run['median_ms']:.0f} ms/step, {run['peak_mib'] / 1024:.1f}"
                          " GiB peak")
        ax.axhline(c["loss_floor"], color="gray", lw=0.8, ls="--", label="ln 4 (the floor)")
        sp = ", sequence parallel" if c["sequence_parallel"] else ""
        ax.set_title(f"GPTModel {c['layers']} x {c['hidden']}, V {c['vocab']}, TP {c['tp']}{sp}\n"
                     f"{c['device']}, megatron-core {c['megatron_core']}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
