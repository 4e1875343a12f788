"""One training step of a Hugging Face causal LM, unpatched and patched (issue 31, part 4).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site/site-packages \\
        .whl/quack2/*.whl && export PYTHONPATH=/tmp/site/site-packages:$PYTHONPATH  # Liger-Kernel
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python:$PYTHONPATH \\
        python3 bench/transformers_step.py --json step.json            # on one GPU
    XENT_TORCH_LIB=$PWD/build/src/torch/libxent_torch.so PYTHONPATH=$PWD/python \\
        python3 bench/transformers_step.py --model tiny --device cpu --iters 2 --warmup 1  # smoke

Models (AutoModelForCausalLM.from_config, nothing downloaded; built on the device in --dtype,
attn_implementation "sdpa", use_cache False, tied embeddings as the real ones):
  llama3.2-1b    hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256
  qwen2.5-1.5b   hidden 1536, 28 layers, 12 heads, 2 kv heads, intermediate 8960, vocab 151936
  tiny           Llama, hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, vocab 1000
Random weights, each parameter drawn from a seed made of its name (matrices N(0, 0.02), norms 1,
biases 0): every row has the same model, whatever modules its patch swaps in. Input: --batch x
--seq token ids uniform in the vocabulary (4 x 2048 = 8192 tokens; tiny 2 x 64), labels = ids.

A step is model(input_ids=ids, labels=ids).loss.backward(), every .grad None before it (as after
optimizer.zero_grad()); no optimizer step. Each row runs in a fresh process (this script runs
itself with --row NAME and reads a JSON line from its stdout), so no patch leaks into another:
  transformers   Transformers as installed: its lm head, then ForCausalLMLoss on the logits
  xent           xent.transformers.patch(model): the loss through xent.linear_cross_entropy
  liger          apply_liger_kernel_to_<family>(fused_linear_cross_entropy=True, rope=False,
                 rms_norm=False, swiglu=False, cross_entropy=False): the loss only
  liger-full     apply_liger_kernel_to_<family>(), its defaults: the fused linear cross-entropy
                 and its RoPE, RMSNorm and SwiGLU kernels (not a loss-only comparison)
The liger rows are skipped on CPU, and say "not installed" without liger_kernel.

  step ms       median of --iters steps after --warmup, each alone between CUDA events
                (synchronized before; time.perf_counter on CPU)
  x transformers  step ms / the transformers row's, wherever --rows puts it (the rows run in
                the order given, the table printed once a model's rows have all run)
  peak extra    one definition for every row: torch.cuda.max_memory_allocated() during one
                step after warmup (after reset_peak_memory_stats) minus
                torch.cuda.memory_allocated() just before it, the model and inputs present: the
                parameters' gradients, which every row makes, are in it. xent's scratch comes
                from PyTorch's caching allocator (docs/linear.md, "Schedules and the budget"),
                so it is in it like every other row's buffers. n/a on CPU.
  outside MiB   the device memory in use outside PyTorch's allocator, (total - free) of
                torch.cuda.mem_get_info() - torch.cuda.memory_reserved(), after that step minus
                the same before the first step (module loads, a library's own cudaMalloc): shown
                for every row, added to none; xent's should be about 0 (issue 38: nothing of
                xent's outside PyTorch's allocator). n/a on CPU.
  loss          of the first step; rows more than 1e-2 relative from transformers' are warned
                about (in bf16, Transformers rounds the logits to bf16 before its loss)
--json OUT writes the environment and every row.
"""

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

MIB = float(1 << 20)
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def sizes(hidden, layers, heads, kv_heads, intermediate, vocab, eps=1e-5):
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                rms_norm_eps=eps, tie_word_embeddings=True, use_cache=False)


MODELS = {"llama3.2-1b": ("llama", sizes(2048, 16, 32, 8, 8192, 128256)),
          "qwen2.5-1.5b": ("qwen2", sizes(1536, 28, 12, 2, 8960, 151936, eps=1e-6)),
          "tiny": ("llama", sizes(64, 2, 4, 2, 128, 1000))}
ROWS = ["transformers", "xent", "liger", "liger-full"]
MARK = "TRANSFORMERS_STEP_ROW "


def outside_torch():
    """Device memory in use outside torch's caching allocator (xent's own buffers among it)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def build(args, family, config, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(family, **config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype],
                                                 attn_implementation="sdpa")
    with torch.no_grad():  # the same weights in every row, whatever modules a patch swapped in
        for name, p in model.named_parameters():
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return model.train()


def run_row(args):
    """Child process: one row of one model; returns its result dict."""
    family, config = MODELS[args.model]
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # mem_get_info() and the peak stats are the current device's
    if args.row.startswith("liger"):  # patches classes: before the model is built
        import liger_kernel.transformers as liger
        apply = getattr(liger, f"apply_liger_kernel_to_{family}")
        if args.row == "liger":
            apply(fused_linear_cross_entropy=True, cross_entropy=False, rope=False,
                  rms_norm=False, swiglu=False)
        else:
            apply()
    model = build(args, family, config, device)
    if args.row == "xent":
        import xent.transformers
        # raises unless the model's forward is supported
        xent.transformers.patch(model, max_scratch_bytes=args.xent_scratch_mib << 20)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (args.batch, args.seq), generator=gen).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    res = dict(outside_mib=None, extra_mib=None, params=sum(p.numel() for p in model.parameters()),
               device=torch.cuda.get_device_name(device) if cuda else "cpu")
    outside0 = outside_torch() if cuda else None
    first_loss = None
    for _ in range(args.warmup):
        loss = step()
        first_loss = loss.item() if first_loss is None else first_loss
    model.zero_grad(set_to_none=True)
    sync()
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = step()
    sync()
    if cuda:
        res["outside_mib"] = (outside_torch() - outside0) / MIB
        res["extra_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
    res["loss"] = loss.item() if first_loss is None else first_loss
    times = []
    for _ in range(args.iters):
        model.zero_grad(set_to_none=True)
        sync()
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    res["ms"] = statistics.median(times)
    return res


def spawn(args, model, row):
    """Runs one row in a fresh interpreter; its stderr goes straight through."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--model", model,
           "--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch),
           "--seq", str(args.seq), "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--xent-scratch-mib", str(args.xent_scratch_mib)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return dict(error=f"the row's process exited with {proc.returncode} (see its stderr above)")


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all",
                    help="all: llama3.2-1b and qwen2.5-1.5b")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated, of " + ", ".join(ROWS))
    ap.add_argument("--batch", type=int, default=None, help="default 4 (tiny: 2)")
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 64)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--xent-scratch-mib", type=int, default=0, metavar="MIB",
                    help="the xent row's max_scratch_bytes in MiB (0, the default: xent's "
                    "default budget)")
    ap.add_argument("--json", default="", metavar="OUT")
    ap.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # internal: the child
    args = ap.parse_args()
    tiny = args.model == "tiny"
    args.batch = args.batch or (2 if tiny else 4)
    args.seq = args.seq or (64 if tiny else 2048)
    if args.row:  # the child: one row, as one JSON line
        try:
            res = run_row(args)
        except Exception as e:  # noqa: BLE001 - reported as the row's error
            res = dict(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        return print(MARK + json.dumps(res), flush=True)

    cuda = torch.device(args.device).type == "cuda"
    models = ["llama3.2-1b", "qwen2.5-1.5b"] if args.model == "all" else [args.model]
    rows = [r for r in args.rows.split(",") if r]
    env = dict(dtype=args.dtype, batch=args.batch, seq=args.seq, iters=args.iters,
               warmup=args.warmup, xent_scratch_mib=args.xent_scratch_mib,
               torch=torch.__version__, transformers=version("transformers"),
               liger_kernel=version("liger-kernel"), triton=version("triton"))
    print(f"# transformers_step.py: {args.device}, {args.dtype}, {args.batch} x {args.seq} "
          f"tokens, torch {env['torch']}, transformers {env['transformers']}, liger "
          f"{env['liger_kernel']}; forward + backward, median of {args.iters} steps after "
          f"{args.warmup}", flush=True)
    print("\n| model | row | step ms | x transformers | peak extra MiB | outside MiB | loss |")
    print("|---|---|---|---|---|---|---|", flush=True)
    results, notes = [], []
    for model in models:
        done = []
        for row in rows:
            if row.startswith("liger") and not cuda:
                res = dict(error="skipped on CPU")
            elif row.startswith("liger") and env["liger_kernel"] is None:
                res = dict(error="not installed")
            else:
                res = spawn(args, model, row)
            done.append(dict(model=model, row=row, **res))
        results += done
        # The transformers row, where it ran, is the reference for x and loss, wherever --rows
        # puts it (a row's time depends on the card's state, so the order is the caller's).
        ran = [res for res in done if not res.get("error")]
        base = next((res for res in ran if res["row"] == "transformers"), ran[0] if ran else None)
        for res in done:
            if res.get("error"):
                print(f"| {model} | {res['row']} | {res['error']} | | | | |", flush=True)
                continue
            ratio = res["ms"] / base["ms"] if base["row"] == "transformers" else None
            res["ratio"] = ratio
            print(f"| {model} | {res['row']} | {res['ms']:.1f} | {fmt(ratio, '.2f')} | "
                  f"{fmt(res['extra_mib'], '.0f')} | {fmt(res['outside_mib'], '.0f')} | "
                  f"{res['loss']:.4f} |", flush=True)
            rel = abs(res["loss"] - base["loss"]) / abs(base["loss"])
            if rel > 1e-2:
                notes.append(f"WARNING: {model} {res['row']}: loss {res['loss']:.5f} differs from "
                             f"{base['row']}'s {base['loss']:.5f} by {rel:.1e} relative (> 1e-2)")
        if base is not None:
            env["device"] = base["device"]  # the parent never touches the GPU
            item, tokens = DTYPES[args.dtype].itemsize, args.batch * args.seq
            notes.append(f"{model}: {base['params'] / 1e6:.1f}M parameters, gradients "
                         f"{base['params'] * item / MIB:.0f} MiB (in every peak); logits "
                         f"{tokens * MODELS[model][1]['vocab_size'] * item / MIB:.0f} MiB")
    print(f"\n# device: {env.get('device')}")
    for note in notes:
        print(f"# {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, results=results, notes=notes), f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
