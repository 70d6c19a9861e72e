"""
serve_demo.py -- `python serve.py`: serve.py's servers on the same requests, side by side. Random weights, exits
simulated; the serving benchmark with checkpoints, request files, exit rules and --json is `python bench.py serve`.

A vanilla model of a model.py preset and its Average-tied Recursive Transformer (B = 2 loops; --lora-rank makes it a
relaxed one) serve --requests requests, all there at the start, in --slots slots each: static batching, continuous
sequence-wise batching (the baseline), continuous depth-wise batching without exits and with them (a max-softmax
threshold calibrated so that SIMULATED_EXIT_RATE of the prompt tokens leave at loop 1: random weights have no real
exits).
After a warm-up, which also says how long the rest will take, the servers run --rounds times, interleaved: a busy
moment of the machine falls on every server of a round alike, so each round's ratio to continuous batching holds on a
loaded machine too, and the table prints the median and the range over the rounds. --schedule then prints the
depth-wise schedule of the run with exits (Figure 3, as `python bench.py figures` draws it).
"""
from __future__ import annotations

import math
import time

import torch

from harness import cpu_tuning
from harness.bench_common import med, per_round, spread
from harness.bench_serve import SIMULATED_EXIT_RATE, exit_threshold_for
from harness.cli import (DTYPES, ArgumentParser, UsageError, available_memory, check_device, check_dtype, number,
                         seed_arg, user_input)
from harness.device import pick_device, pick_dtype
from harness.serve_hooks import SCHEDULE_LEGEND, Metrics, ScheduleTrace
from harness.serve_requests import MAX_REQUESTS, random_requests
from model import GPT, PRESETS, GPTConfig
from recursive import from_vanilla
from serve import ContinuousServer, DepthWiseServer

COLUMNS = """tokens        tokens generated in a round (the same requests for every server)
tok/s         generated tokens / the round's wall time (admission, prefill and decode), median (min..max) of the rounds
loaded tok/s  tokens / time of the decode steps with every slot busy: what a server with a queue sustains
step ms       mean time of one decode step (a depth-wise step runs one loop: half the layers at B = 2)
exit loop     mean loop (1-based) the generated tokens left at (depth-wise); B = 2 without exits
x continuous  tok/s / continuous batching's in the same round, median (min..max) of the rounds"""


def demo_parser():
    """The demo's flags (a cli.ArgumentParser: a bad value is one line `error: ...`)."""
    ap = ArgumentParser(description="serve.py's demo: the same requests through every server, random weights, exits "
                                    "simulated (the serving benchmark, with checkpoints: python bench.py serve)")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS),
                    help="model.py preset (default small: 8 layers of width 512, 33M parameters)")
    ap.add_argument("--lora-rank", type=number(int, min=0), default=0, help="relaxed LoRA rank (0: recursive, B=2)")
    ap.add_argument("--requests", type=number(int, min=1, max=MAX_REQUESTS), default=32, help="requests, all at once")
    ap.add_argument("--slots", type=number(int, min=1), default=16, help="batch slots of every server")
    ap.add_argument("--rounds", type=number(int, min=1, max=100), default=3,
                    help="timed rounds, every server once per round, interleaved")
    ap.add_argument("--device", default="auto", help="auto (cuda > mps > cpu) | cpu | cuda | mps")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto (bf16 on GPU, fp32 on CPU) | ...")
    ap.add_argument("--compile", nargs="?", const="on", default=None, choices=["on", "off", "auto"],
                    help="compiled steps: on, off, or auto (on a CPU: where measured faster, cpu_tuning.py); "
                         "default: on CUDA only")
    ap.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="eager steps")
    ap.add_argument("--schedule", type=number(int, min=1), nargs="?", const=40, default=None, metavar="PASSES",
                    help="after the table, the depth-wise schedule of the run with exits: which request each slot "
                         "held and the loop it ran, for its first PASSES forward passes (default 40; Figure 3)")
    ap.add_argument("--seed", type=seed_arg, default=1337)
    return ap


def round_row(srv, metrics: Metrics, out) -> dict:
    """One server's figures of one round."""
    exits = [e + 1 for r in out for e in r.exits[1:] if e is not None]
    tokens = sum(len(r.output) for r in out)
    return {"tokens": tokens, "tok/s": tokens / (metrics.t_end - metrics.t_start),
            "loaded": metrics.full_tokens / metrics.full_time if metrics.full_time else math.nan,
            "step": metrics.step_time / max(srv.n_steps, 1), "exit": sum(exits) / len(exits) if exits else math.nan}


@torch.no_grad()
def demo(argv=None):
    """Static, continuous and depth-wise batching without and with exits -> the serving table (and with --schedule
    the depth-wise schedule of the run with exits)."""
    args = demo_parser().parse_args(argv)
    check_device(args.device)
    check_dtype(args.device, args.dtype)
    device = pick_device(args.device)
    dtype, ranks = pick_dtype(device, args.dtype), {f"lora_rank_{c}": args.lora_rank for c in ("q", "kv", "o", "mlp")}
    torch.manual_seed(args.seed)
    van = GPT(GPTConfig.from_preset(args.preset))
    with user_input():  # a rank above full rank: one line
        rec = from_vanilla(van, 2, "average", log=lambda *_: None, **(ranks if args.lora_rank else {}))
    van, rec = van.to(device, dtype).eval(), rec.to(device, dtype).eval()
    need, (avail, where) = 4 * van.kv_cache_bytes(args.slots, van.config.max_seq_len, dtype.itemsize), \
        available_memory(device)
    if avail is not None and need > avail:
        raise UsageError(f"--slots {args.slots:,}: the servers' KV caches need {need / 1e9:.3g} GB, {device} has "
                         f"{avail / 1e9:.3g} GB available ({where}); lower it")
    reqs = random_requests(args.requests, van.config.vocab_size, (8, 48), (8, 32), [0.0] * args.requests,
                           torch.Generator().manual_seed(args.seed))
    thr = exit_threshold_for(rec, [r.prompt for r in reqs[:8]], SIMULATED_EXIT_RATE)
    flag = {"on": True, "off": False, "auto": None}.get(args.compile, device.type == "cuda")  # auto: measured
    kw = dict(slots=args.slots, compile=cpu_tuning.compiled_decode_faster(van, args.slots, flag, keep=False))
    servers = [ContinuousServer(van, **kw), ContinuousServer(van, static=True, **kw), DepthWiseServer(rec, **kw),
               DepthWiseServer(rec, exit_threshold=thr, exit_rule="softmax", **kw)]  # continuous first: the base
    print(f"device {device} dtype {dtype} | {args.preset}: vanilla {van.config.n_layer} layers, recursive B=2 "
          f"(Average tying, LoRA rank {args.lora_rank}) | {args.requests} requests of 8-48 + 8-32 tokens, {args.slots} "
          f"slots | exits SIMULATED (random weights): a max-softmax threshold makes {SIMULATED_EXIT_RATE:.0%} of "
          f"prompt tokens leave at loop 1 | steps {'compiled' if servers[0].compiled else 'eager'}")

    t0 = time.perf_counter()
    warm = reqs[:args.slots]
    for srv in servers:  # warm-up, one batch each: the allocator, first calls, compiling
        srv.run(warm, clock="step")
    warm_s, waves = time.perf_counter() - t0, math.ceil(len(reqs) / args.slots)  # a round serves `waves` batches
    print(f"warm-up {warm_s:.1f} s; {args.rounds} interleaved rounds of {len(reqs)} requests take about "
          f"{warm_s * waves * args.rounds:.0f} s\n", flush=True)
    rounds = {srv.name: [] for srv in servers}
    for _ in range(args.rounds):
        for srv in servers:
            srv.hook = m = Metrics()
            rounds[srv.name].append(round_row(srv, m, srv.run(reqs)))

    base = [r["tok/s"] for r in rounds[servers[0].name]]
    print(f"{'system':30s} {'tokens':>7s} {'tok/s':>22s} {'loaded tok/s':>12s} {'step ms':>8s} {'exit loop':>9s} "
          f"{'x continuous':>18s}")
    for srv in servers:
        rs = rounds[srv.name]
        col = lambda k: [r[k] for r in rs]  # noqa: E731
        exit_loop = f"{med(col('exit')):9.2f}" if isinstance(srv, DepthWiseServer) else f"{'-':>9s}"
        print(f"{srv.name:30s} {rs[0]['tokens']:7d} {spread(col('tok/s')):>22s} {med(col('loaded')):12.1f} "
              f"{1e3 * med(col('step')):8.2f} {exit_loop} "
              f"{spread(per_round(col('tok/s'), base), fmt='.2f'):>18s}")
    print("\n" + COLUMNS)
    if args.schedule:  # the schedule does not depend on the clock: every request is there at the start
        srv = servers[-1]
        srv.hook = trace = ScheduleTrace()
        srv.run(reqs, clock="step")
        print(f"\nFigure 3 (continuous depth-wise batching), traced from the run above:\n{SCHEDULE_LEGEND}\n"
              f"{trace.text(last=args.schedule)}")


def main(argv=None):
    """The command: a mistake (a flag) is one line `error: ...` and exit code 2 (cli.run_cli); on a CPU the linear,
    attention and LoRA forms measured fastest here (cpu_tuning.py)."""
    from harness.cli import run_cli

    def run(argv):
        with cpu_tuning.switched_on():
            demo(argv)
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
