"""
bench.py -- the speed claims of the four papers, measured on the machine you have, plus the peer comparisons.

Every benchmark here follows the same protocol, because the machines this repository is developed on are small and
shared: the systems being compared are built once, then timed in INTERLEAVED rounds in one process (round r times
system A, then B, then C...), warm-up excluded, and each figure is the median over the rounds with the spread
(min..max) beside it. A ratio is only ever computed between systems timed in the same run. Each benchmark prints
the device, the sizes, the dtype, the batch, the ratio and the paper's figure beside it.

Memory. Each benchmark adds up what it will allocate (its models, caches, RoPE tables and batches, with model.py's
pieces) and compares it with what the device has before it allocates anything (check_bench_memory): a size no
machine holds is one line, not an allocator traceback.

Sizes. On a CPU, a model whose weights fit in the caches is bound by per-operator overhead, not by memory, and none
of the papers' memory-bound arguments apply to it. The default sizes here are therefore the ~100-150M `base`
presets (hundreds of MB of weights, far more than the caches): decoding them one token at a time is memory-bound
on a CPU as on a GPU. (`--preset tiny` is for a quick check.)

CPU forms. The inference benchmarks (decode, plt, double, archs, serve, block) run with cpu_tuning.py switched on: the
linear products, attention and LoRA forms measured fastest on this CPU (decode --linear forces a product instead).
`train` and `kd` measure what train.py runs: plain PyTorch.

Run:
    python bench.py decode                       # vanilla decode: tok/s, bandwidth vs this machine's, vs transformers
    python bench.py decode --weights smollm2-135m --dtype bfloat16   # eager/compiled/int8 vs transformers, llama.cpp
    python bench.py decode --dtype bfloat16 --batch 1,8
    python bench.py train --nanogpt DIR          # training tok/s vs nanoGPT's model.py (a checkout you provide)
    python bench.py train --nanogpt DIR --profile   # ... and one step of each by operator group
    python bench.py kd --weights smollm2-135m    # KD uptraining step of SmolLM2-135M vs the same in transformers
    python bench.py archs                        # all six architectures side by side (tiny presets)
    python bench.py double --rollover 16         # double decoder vs decoder-only: TTFT, cached prefix, per token, KV
    python bench.py serve --exit-rate 0.633 --profile   # depth-wise + exit vs continuous batching; a step's parts
    python bench.py kernels                      # (CUDA) every Triton kernel vs its reference and stock PyTorch
    python bench.py roofline                     # this CPU's roofline; PLT-2 / vanilla from the matmuls alone
    python bench.py ckpt                         # what verifying a checkpoint's CRC-32s costs beside torch.load
    python bench.py presets --arch plt           # every preset's rows: parameters, KV bytes, FLOPs (no timing)
    python bench.py gpu --nanogpt DIR --json g.json   # (one GPU, 8 minutes) every section above against its baseline
    python bench.py figures                      # each paper's figure traced from the code: text, PNGs in docs/figures

What a trained checkpoint does on validation text (early exits, SVD residual energy, double-eval, block --eval) is
measured by eval.py, not here.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import argparse

import block_transformer as bt
import double_decoder as dd
import plt
from harness import bench_gpu, bench_serve, figures
from harness.bench_common import describe
from harness.bench_decode import (BLOCK_SETTINGS, DECODE_SYSTEMS, bench_archs, bench_block, bench_decode, bench_double,
                                  bench_plt, bench_roofline)
from harness.bench_kernels import bench_kernels
from harness.bench_train import bench_ckpt, bench_kd, bench_train
from harness.archs import arch_table
from harness.cli import (DTYPES, ArgumentParser, UsageError, comma_list, number, one_of, path_arg, run_cli,
                         run_subcommand, threads_arg, user_input)
from harness.cpu_tuning import LINEAR_PRODUCTS
from model import PRESETS

# ----------------------------------------------------------------------------------------------------------------
# The command line: each subcommand runs a benchmark of bench_decode.py, bench_train.py, bench_kernels.py or
# bench_serve.py; `presets` lists the architectures' presets (nothing timed)


def settings(text):
    """--settings of archs: a comma list of prompt/new with prompt >= 1 and new >= 2 (the decode time of a round is
    the difference of a 1-token and a new-token generate)."""
    for part in text.split(","):
        p, sep, g = part.partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected prompt/new pairs like 160/8, got {part!r}")
        number(int, min=1)(p)
        number(int, min=2)(g)
    return text


def bench_presets(args):
    """Every preset of the architectures asked for, through the architecture table: each ArchSpec's rows (the model
    and its baseline, built on the meta device) printed by bench_common.describe. Nothing is timed or allocated."""
    table = arch_table()
    names = args.arch.split(",") if args.arch else list(table)
    for name in names:
        spec = table[name]
        if args.preset is not None and args.preset not in spec.presets:
            raise UsageError(f"--preset {args.preset}: not a preset of {name}; choose one of {sorted(spec.presets)}")
        print(f"{name}:")
        for preset in [args.preset] if args.preset else spec.presets:
            with user_input():  # a config the flags make invalid (a --loops that does not divide the layers)
                rows = spec.table(preset, args)
            for label, m, baseline in rows:
                describe(label, m, baseline)


def build_parser():
    """Every subcommand and flag, each number with its bound (cli.number): a bad value is one line `error: ...`."""
    pos, nonneg, two = number(int, min=1), number(int, min=0), number(int, min=2)  # two: >= 2 tokens
    dtypes = comma_list(one_of(DTYPES))
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)

    def machine(p):
        p.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
        p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")

    def common(p, preset="base", presets=PRESETS):
        machine(p)
        p.add_argument("--preset", default=preset, choices=sorted(presets), help=f"preset (default {preset})")
        p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")

    def generation(p, dtype, batch, prompt_len, new_tokens):  # what a generate() timing runs
        p.add_argument("--dtype", type=dtypes, default=dtype, help="comma list of dtypes")
        p.add_argument("--batch", type=comma_list(pos), default=batch, help="comma list of batch sizes")
        p.add_argument("--prompt-len", type=pos, default=prompt_len, help="prompt tokens")
        p.add_argument("--new-tokens", type=two, default=new_tokens, help="generated tokens per run (>= 2)")

    p = sub.add_parser("decode", help="vanilla decode vs the machine's bandwidth and transformers' generate")
    common(p)
    generation(p, "float32,bfloat16", "1", 128, 64)
    p.add_argument("--weights", default="random", help="random (the --preset's shape) | smollm2-135m | gguf:PATH (a "
                   "GGUF file of the Llama family: its shape and weights; llama.cpp runs the same file)")
    p.add_argument("--systems", type=comma_list(one_of(list(DECODE_SYSTEMS))), default=",".join(DECODE_SYSTEMS),
                   help="comma list of: eager (ours, cpu_tuning's forms), compiled (graphs.compile_decode), int8 "
                        "(harness/quantize.py, compiled), transformers, llama.cpp (node-llama-cpp, a GGUF file)")
    p.add_argument("--linear", type=comma_list(one_of(["auto", *LINEAR_PRODUCTS])), default="auto",
                   help="comma list of cpu_tuning's linear products to time, each forced in turn: "
                   "auto (the measured choice), linear, mv, mm, xwt, dnn")
    p.set_defaults(fn=bench_decode)

    p = sub.add_parser("train", help="training tok/s vs nanoGPT's model.py at the same shape")
    common(p, "small")
    p.add_argument("--nanogpt", type=path_arg, default=None,
                   help="a nanoGPT checkout (its model.py is imported from there)")
    p.add_argument("--train-batch", type=pos, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=pos, default=256, help="tokens per sequence")
    p.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="ours with nanoGPT's AdamW (torch's per-tensor loop on CPU) instead of train.py's fused one")
    p.add_argument("--compile", action="store_true", help="torch.compile both models (the warm-up covers it)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="float32 | bfloat16 (autocast, both models)")
    p.add_argument("--profile", action="store_true", help="after the timed rounds, profile two steps of each model: "
                   "ms per step by operator group (matmuls, attention, loss, AdamW, norms, RoPE, MLP, casts, ...)")
    p.set_defaults(fn=bench_train)

    p = sub.add_parser("kd", help="one KD training step of SmolLM2-135M (recursive student, original teacher) vs "
                                  "the same step in transformers")
    machine(p)
    p.add_argument("--weights", default="random", help="random (SmolLM2-135M's shape) | smollm2-135m | gguf:PATH "
                   "(a GGUF file of the Llama family: its shape and weights)")
    p.add_argument("--loops", type=number(int, min=2), default=2, help="loops B of the recursive student")
    p.add_argument("--train-batch", type=pos, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=pos, default=512, help="tokens per sequence")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="float32 | bfloat16 (autocast, both)")
    p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")
    p.set_defaults(fn=bench_kd)

    p = sub.add_parser("plt", help="PLT-2 vs vanilla vs loop-2 per-token decode latency (Table 3)")
    common(p, presets=plt.PRESETS)
    generation(p, "float32,bfloat16", "1,4,16", 256, 32)
    p.add_argument("--variants", type=comma_list(one_of(list(plt.VARIANTS))), default="vanilla,loop,plt",
                   help="comma list of Table 2 rows: vanilla, loop, clp, kv_share, plt")
    p.set_defaults(fn=bench_plt)

    p = sub.add_parser("roofline", help="this CPU's read bandwidth and matmul speed; one layer's weight products "
                                        "at 1..32 rows; PLT-L / vanilla from the matmuls alone")
    p.add_argument("--preset", default="base", choices=sorted(plt.PRESETS), help="PLT preset (default base)")
    p.add_argument("--dtype", type=dtypes, default="float32,bfloat16", help="comma list of dtypes")
    p.add_argument("--rows", type=comma_list(pos), default="1,2,4,8,16,32", help="comma list of row counts")
    p.add_argument("--batch", type=comma_list(pos), default="1,4,16", help="comma list of decode batches")
    p.add_argument("--repeats", type=pos, default=5, help="timed passes per product (median)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_roofline, device="cpu")  # this CPU's: --dtype is checked there, whatever else is here

    p = sub.add_parser("ckpt", help="checkpoint load: the CRC-32 verification of every record vs torch.load")
    p.add_argument("--preset", default="base", choices=sorted(PRESETS), help="GPT preset (default base)")
    p.add_argument("--dir", type=path_arg, default=None, help="where the temporary checkpoint is written "
                   "(default: the system's temporary directory)")
    p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_ckpt)

    p = sub.add_parser("double", help="double decoder vs decoder-only: TTFT (also after a cached prefix), "
                                      "per-token latency, KV bytes")
    common(p, presets=dd.PRESETS)
    generation(p, "float32,bfloat16", "1,8", 256, 32)
    p.add_argument("--shared-prefix", type=pos, default=None, help="cached prefix tokens (default: prompt / 2)")
    p.add_argument("--rollover", type=pos, default=None, help="double: fold the block into the context every N "
                                                              "tokens")
    p.add_argument("--vocab-size", type=number(int, min=2), default=None,
                   help="override the preset's vocabulary (the head is read every step; 4160 = this repository's "
                        "tokenizer)")
    p.add_argument("--ctx-layers", type=pos, default=None, help="override the preset's context layers")
    p.add_argument("--gen-layers", type=pos, default=None, help="override the preset's generation layers")
    p.set_defaults(fn=bench_double)

    p = sub.add_parser("archs", help="all six architectures side by side: TTFT, per-token latency, KV bytes")
    common(p, "tiny")
    p.add_argument("--dtype", type=dtypes, default="float32", help="comma list of dtypes")
    p.add_argument("--rank", type=pos, default=8, help="LoRA rank of the relaxed model")
    p.add_argument("--settings", type=settings, default="160/8,16/48",
                   help="comma list of prompt/new (prefill-, decode-heavy)")
    p.add_argument("--batch", type=comma_list(pos), default="1,8", help="comma list of batch sizes")
    p.set_defaults(fn=bench_archs)

    p = sub.add_parser("serve", help="serve.py's servers on the same requests: depth-wise batching + early exit vs "
                                     "continuous sequence-wise batching (bench_serve.py)")
    bench_serve.add_args(p)

    p = sub.add_parser("gpu", help="every efficiency claim on one GPU in one command (--minutes): decode, serving, "
                                   "PLT, Block, double decoder, training, each against its baseline (bench_gpu.py)")
    bench_gpu.add_args(p)

    p = sub.add_parser("block", help="Block Transformer vs vanilla: throughput at the largest batch of a memory "
                                     "budget (decode-heavy, prefill-heavy)")
    p.add_argument("--preset", default="t3-19m", choices=sorted(bt.PRESETS),
                   help="block_transformer.py preset (default t3-19m: Table 3's 19M)")
    p.add_argument("--vanilla", default=None, choices=sorted(PRESETS), help="model.py preset of the vanilla model "
                   "(default: the block preset's counterpart at equal non-embedding parameters)")
    p.add_argument("--setting", default="both", choices=["both", *BLOCK_SETTINGS], help="run one setting alone")
    p.add_argument("--scale", type=number(float, above=0), default=0.25,
                   help="multiply the paper's prompt/generated lengths (128/2048, 2048/128); 1 = the paper's")
    p.add_argument("--budget-mib", type=pos, default=None, help="memory for generate()'s caches per model: the "
                   "batch search goes up to the largest batch that fits (default 2048 x scale: the same batches at "
                   "every scale)")
    p.add_argument("--search-tokens", type=nonneg, default=32, help="tokens per batch-search run (0: no search, time "
                                                                    "the largest batch)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in comma_list(pos)(s).split(",")] if s else [],
                   default=[], help="comma list of more batch sizes to time (besides 1 and the best)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="float32 | bfloat16 | auto")
    p.add_argument("--repeats", type=pos, default=3, help="interleaved timed rounds (median and min..max)")
    machine(p)
    p.add_argument("--profile", action="store_true", help="also profile 64 decode steps per model at its best batch "
                   "and the setting's mean context (where a step's time goes)")
    p.set_defaults(fn=bench_block)

    p = sub.add_parser("presets", help="every preset of an architecture: parameters, KV bytes, FLOPs per token, "
                                       "beside its baseline (nothing timed)")
    p.add_argument("--arch", type=comma_list(one_of(list(arch_table()))), default=None,
                   help="comma list of architectures (default: all)")
    p.add_argument("--preset", default=None, help="one preset (default: every preset of each architecture)")
    p.add_argument("--loops", type=number(int, min=1), default=None, help="recursive / relaxed: B (default 2)")
    p.add_argument("--ranks", type=comma_list(number(int, min=1)), default=None,
                   help="relaxed: comma list of LoRA ranks to list (default 8,16,32,64)")
    p.set_defaults(fn=bench_presets)

    p = sub.add_parser("figures", help="each paper's central figure traced from the code on a tiny model: a text "
                                       "grid, and a PNG with matplotlib (figures.py)")
    figures.add_args(p)

    p = sub.add_parser("kernels", help="(CUDA) Triton kernels vs their references and stock PyTorch")
    p.add_argument("--only", default="", help="comma list of: lora, gswa, gswa_decode, dual (default: all); with "
                                              "--aot: substrings of the case names, e.g. lora/tiny,bfloat16")
    p.add_argument("--aot", action="store_true",
                   help="compile every kernel ahead of time for GPU targets (no GPU needed): shared memory, registers")
    p.add_argument("--aot-targets", type=comma_list(pos), default="80,90",
                   help="comma list of CUDA compute capabilities for --aot")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="bfloat16 | float16 | float32 | auto (bf16 on CUDA)")
    p.add_argument("--warmup", type=nonneg, default=None, help="untimed calls first (default: 10 on CUDA, 1 on CPU)")
    p.add_argument("--iters", type=pos, default=None, help="timed calls (default: 50 on CUDA, 3 on CPU)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_kernels)
    return ap


def run(argv=None):
    return run_subcommand(build_parser(), argv)


def main(argv=None):
    """The command: a mistake (a flag, a file, a checkpoint) is one line `error: ...` and exit code 2 (cli.run_cli)."""
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
