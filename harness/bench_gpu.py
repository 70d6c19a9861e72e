"""
bench_gpu.py -- `python bench.py gpu`: the four papers' efficiency claims on ONE GPU, each system against its baseline
in the same run (interleaved rounds, median and min..max), with this project's targets beside them.

Papers (the figures beside each ratio): "Relaxed Recursive Transformers" (Bae et al., arXiv:2410.20672; section 2.4,
Appendix K: depth-wise batching + early exit), "Block Transformer" (Ho, Bae et al., arXiv:2406.02657; Table 2: 10-20x
the throughput of vanilla at the best batch), "Parallel Loop Transformer" (PLT; Table 3: PLT-2 / vanilla 1.02-1.06 per
token), the block-based double decoder (section 3.3: per-token cost ~ L_dec / L).

Sections, in the order a run brings them (the targets first; --only picks some):
  decode  vanilla decode at batch 1, 64, 16: our eager decode (GPT.generate), our graphed step (serve.py's continuous
          step: the decode step, the greedy argmax and the next token in one graph; the continuous server of `serve`
          compiles the same step at 64 and 16 slots) and transformers' eager LlamaForCausalLM.generate at our shape:
          ms per step, tok/s, % of the measured copy bandwidth (bytes a step reads: the weights and the KV positions it
          attends over). --profile: the kernel table of one eager and one graphed step at batch 1 (torch.profiler).
  serve   serve.py's servers on the same requests at 64 and 16 slots: continuous batching of the vanilla model,
          depth-wise batching of its recursive conversion (B = 2, Average tying) without and with exits (SIMULATED at
          the oracle share bench_serve.SIMULATED_EXIT_RATE: bench_serve.calibrate_threshold, as `bench.py serve
          --exit-rate`),
          the continuous server's graphed step alone (bare), and transformers' continuous batching
          (LlamaForCausalLM.generate_batch, one manager per slot count, destroyed after it, its memory capped).
  plt     PLT-2 / vanilla / loop-2 per-token latency at batch 1/4/16 (bench.py plt's generation_times).
  block   Block Transformer vs vanilla at the best batch of a cache budget (bench.py block's block_pair, batches
          searched among the batch buckets: a graphed model runs them unpadded), decode-heavy setting.
  double  double decoder vs decoder-only per-token latency (bench.py double's models and timing).
  train   training tok/s and MFU of ours against nanoGPT's model.py at the same parameter count: nanoGPT-124M (12
          layers, d 768, 12 heads, GELU 4d MLP, LayerNorm, vocab 50304) and ours at the same d / layers / heads with
          MHA, SwiGLU 2048 = 8d/3 (the MLP's parameters match), tied embedding; eager and torch.compile'd.
          MFU = tok/s x model.flops_per_token (6N + 12 L H D T) / device.peak_flops.

Graphs (--graphs). auto: on CUDA, decode and serve compile their steps with inductor, mode "reduce-overhead" (static
caches, one CUDA graph per step kind and batch); plt, block and double record theirs with graphs.CapturedStep (a
torch.cuda.CUDAGraph of the eager step per step kind and batch bucket, on its static cache: the weights and caches
read in place, only the token ids copied in; seconds to record where inductor takes tens); train compiles with
inductor (torch.compile's default mode). On a CPU, decode and serve trace their steps with dynamo (fullgraph, backend
"eager") and plt, block and double run CapturedStep's CPU path (the same signatures and copies, no graph): the CPU run
proves every step is one graph, nothing recompiles or re-records after warm-up (each section reports it: 0), and only
the token ids are copied per replay; its timings of "graphed" steps mean nothing. Each section prints its warm-up
(compile) seconds and, on CUDA, inductor's CUDA-graph counters (skips, recordings, re-records, non-static inputs;
TORCH_LOGS=perf_hints says why a graph was skipped).

Time. Each section gets a share of what is left of --minutes (SHARES) and runs fewer rounds (and skips batches, each
`skipped` in its rows) when it runs long, down to one round of its first size; the clock is read between rounds only,
never inside a compile or a capture, so a run can outlast --minutes by what its compiles take.
A section that raises (a UsageError included) prints `section X failed: ...` and the others still run; the command then
exits with status 1. --json is rewritten after each row with every result so far: an outer timeout keeps what is
done. scripts/gpu_check.sh runs each section in a process of its own, each under its own timeout.

The GPU run (one H100 or H200): `bash scripts/gpu_check.sh` (its table and JSON under $OUT). One section by hand:
    python3 bench.py gpu --device cuda --dtype bfloat16 --only decode --minutes 1.5 --profile --json $OUT/decode.json
On a CPU, every section at toy sizes (about two minutes):
    python bench.py gpu --device cpu --preset tiny --minutes 2 --json /tmp/g.json
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

import double_decoder as dd
import graphs
import plt
import serve
from harness import bench_serve
from harness.bench_common import (check_bench_memory, device_name, hf_generate, hf_llama, json_safe, kv_of, med,
                                  per_round, rounds, spread)
from harness.bench_decode import (block_lengths, block_pair, block_pair_memory, block_ratios, block_systems,
                                  generation_bytes, generation_times, search_batch, search_window)
from harness.bench_train import (check_nanogpt, optimizer_for, param_counts, train_batch, train_memory, train_models,
                                 train_step)
from harness.cli import (DTYPES, check_output_file, check_writable_dir, comma_list, number, one_of, path_arg,
                         threads_arg, write_atomic)
from harness.device import peak_flops, pick_device, pick_dtype, sync
from harness.memory import forward_memory, memory_sum, model_memory, param_bytes
from harness.serve_hooks import Metrics
from harness.serve_requests import parse_range, synthetic_requests
from model import GPT, PRESETS, GPTConfig
from recursive import from_vanilla

SECTIONS = ("decode", "serve", "plt", "block", "double", "train")
SHARES = {"decode": 0.20, "serve": 0.28, "plt": 0.13, "block": 0.14, "double": 0.08, "train": 0.17}
RESERVE = 0.04  # of --minutes, kept for the startup and the last write


# ----------------------------------------------------------------------------------------------------------------
# Sizes: what a section runs on a GPU and, smaller, on a CPU (the same code paths)


@dataclass
class Sizes:
    decode: tuple = (128, 64)  # prompt, new tokens
    decode_batches: tuple = (1, 64, 16)  # the targets' batches first
    serve_slots: tuple = (64, 16)
    serve_waves: float = 3.0  # requests = waves x slots: the slots refill twice after the first wave
    serve_prompt: str = "16:112"
    serve_gen: str = "64"
    plt: tuple = (256, 32)
    plt_batches: tuple = (1, 4, 16)
    block_scale: float = 0.25  # of the paper's decode-heavy 128 / 2048
    block_budget_mib: int = 512
    block_search: int = 32
    double: tuple = (256, 32)
    double_batches: tuple = (1, 16)
    train: tuple = (8, 1024)  # batch, sequence length
    bandwidth_bytes: int = 2 ** 30
    repeats: int = 5


CPU_SIZES = Sizes(decode=(16, 8), serve_waves=1.5, serve_prompt="4:12", serve_gen="8", plt=(16, 6),
                  block_scale=1 / 32, block_budget_mib=4, block_search=4, double=(16, 6), train=(2, 64),
                  bandwidth_bytes=2 ** 26, repeats=3)

# The vanilla model's preset -> the other architectures' presets at that scale
BLOCK_PRESET = {"tiny": "tiny", "small": "t3-5m", "base": "t3-19m"}

TARGETS = {  # this project's targets on one GPU and the papers' figures, printed beside each row
    "decode_b1_ms": "<= 0.5 ms/token", "decode_b1_vs_hf": ">= 10x transformers eager",
    "decode_b64": ">= 40k tok/s", "serve64": ">= 30k tok/s", "serve_vs_hf": ">= 1.5x generate_batch",
    "serve_step": "<= 1.5x bare graphed step", "serve_exit": ">= 1.25x continuous, loaded (paper K.2/K.4: 1.4-1.9x)",
    "plt": "<= 1.10 at batch 4 and 16 (paper 1.02 at 4, 1.04-1.06 at 32-64)",
    "plt_loop": "paper 0.63 at batch 4, 0.53 at 32-64", "block": ">= 10x at the best batch (paper 10-20x)",
    "double": "paper ~ L_dec / L", "train": ">= 1.0x nanoGPT, compiled",
}


# ----------------------------------------------------------------------------------------------------------------
# Time: the section caps


class Clock:
    """The overall deadline (--minutes from the start) and the current section's cap. Clock(math.inf): no caps (every
    size, every round of --repeats; what the tests run, so that a slow machine only makes them slower)."""

    def __init__(self, minutes: float):
        self.t0 = time.perf_counter()
        self.end = self.t0 + minutes * 60 * (1 - RESERVE)
        self.cap_end, self.cap = self.end, minutes * 60

    def start_section(self, share: float, shares_left: float) -> float:
        left = max(self.end - time.perf_counter(), 0.0)
        self.cap = left * share / shares_left
        self.cap_end = time.perf_counter() + self.cap
        return self.cap

    def left(self) -> float:
        return self.cap_end - time.perf_counter()

    def over(self) -> bool:
        return self.left() <= 0


def fit_repeats(cost: float, clock: Clock, want: int) -> int:
    """Rounds that fit what is left of the section's cap, each costing `cost` s: at most `want`, at least 1."""
    return max(1, min(want, int(min(clock.left() / max(cost, 1e-9), want))))  # left() is inf without caps


def capped_rounds(ctx, systems: dict, want: int, warmup: int = 1) -> tuple[dict, dict]:
    """bench_common.rounds after `warmup` untimed calls of each system (graphed steps compile or record here), one
    interleaved round at a time, until `want` rounds or the section's cap (at least one round) -> (name -> list of
    seconds, {rounds: rounds run, warmup_s, recompiles: graphs compiled or recorded during the timed rounds})."""
    t0 = time.perf_counter()
    rounds(systems, 0, ctx.device, warmup=warmup)
    warm, before = ctx.warmed(time.perf_counter() - t0), graphs_made()
    out = {name: [] for name in systems}
    n = 0
    while n < want and (n == 0 or not ctx.clock.over()):
        for name, ts in rounds(systems, 1, ctx.device, warmup=0).items():
            out[name] += ts
        n += 1
    return out, dict(rounds=n, warmup_s=warm, recompiles=graphs_made() - before)


def graphs_made() -> int:
    """Graphs made so far: frames dynamo has compiled (a recompile counts one more) and graphs CapturedStep has
    recorded."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"] + graphs.CapturedStep.recorded


def timed_generation(ctx, models: dict, idx, new: int, want: int) -> tuple[dict, dict]:
    """bench_decode.generation_times (TTFT and per-token decode time of each model's generate, interleaved), its
    rounds fitted to the cap: a warm-up generate of each model first (a graphed model compiles or records here), then
    one timed pilot round (the rounds' warm-up) -> (times, {warmup_s, rounds, recompiles: graphs made during the
    timed rounds})."""
    t0, g0 = time.perf_counter(), graphs_made()
    for m in models.values():
        m.generate(idx, new)
    sync(idx.device)
    warm, warm_graphs = ctx.warmed(time.perf_counter() - t0), graphs_made() - g0
    t0 = time.perf_counter()
    for m in models.values():
        for n in (1, (1 + new) // 2, new):
            m.generate(idx, n)
    sync(idx.device)
    reps = fit_repeats(time.perf_counter() - t0, ctx.clock, want)
    before = graphs_made()
    t = generation_times(models, idx, new, reps, warmup=0)  # the pilot round warmed them up
    return t, dict(warmup_s=warm, warmup_graphs=warm_graphs, rounds=reps, recompiles=graphs_made() - before)


# ----------------------------------------------------------------------------------------------------------------
# Graphs: how each section compiles its steps


GRAPH_BACKENDS = ("auto", "inductor", "capture", "eager", "none")
CAPTURED = ("plt", "block", "double")  # the sections whose decode steps CapturedStep records (--graphs auto, capture)


def graph_backend(flag: str, device, section: str):
    """--graphs for one section -> (label, backend): "capture" (graphs.CapturedStep, for graphs.compile_decode), None
    (inductor: graphs.compile_step, mode "reduce-overhead" on CUDA), "eager" (dynamo, backend "eager") or False (no
    graphs). auto and capture: CapturedStep for plt, block and double, inductor (CUDA) or eager (CPU) for the rest."""
    if flag in ("auto", "capture"):
        flag = "capture" if section in CAPTURED else "inductor" if device.type == "cuda" else "eager"
    if flag == "none":
        return "none (eager steps)", False
    if flag == "capture":
        return ("graphs.CapturedStep: " + ("a CUDA graph of the eager step per kind and batch" if device.type == "cuda"
                                           else "its CPU path (the same records and copies, no graph, no speed)"),
                "capture")
    eager = ('torch.compile, backend "eager" (no kernels, no speed)' if section == "train" else  # the whole model
             'dynamo, fullgraph, backend "eager" (graph safety only: no kernels, no speed)')
    graphed = device.type == "cuda" and section != "train"  # train: torch.compile's default mode, no CUDA graphs
    label = {"inductor": "inductor" + (', mode "reduce-overhead" (CUDA graphs)' if graphed else ""), "eager": eager}
    return label[flag], None if flag == "inductor" else flag


def compile_decode(m, backend):
    """graphs.compile_decode of a model with a section's backend (graph_backend)."""
    return graphs.compile_decode(m, "capture" if backend == "capture" else "auto", None if backend == "capture"
                                 else backend)


def replay_copies(models) -> list[int]:
    """The bytes each replay of the models' CapturedSteps copied in since the last call (only the token ids: 8 x the
    batch bucket), each distinct figure once; the count starts again."""
    steps = [s for m in models for s in (getattr(m, name) for name in m.graph_steps)
             if isinstance(s, graphs.CapturedStep)]
    copies = sorted({b for s in steps for b in s.copied})
    for s in steps:
        s.copied.clear()
    return copies


def cudagraph_counters(device) -> dict:
    """Inductor's CUDA-graph counters so far: skips (a step run without its graph: TORCH_LOGS=perf_hints says why),
    non-static inputs recorded (each copied in at every replay), and from its graph trees the recordings and the
    re-records (a graph recorded again: its static inputs moved). The trees are torch internals: where this torch
    lacks them, those two are None."""
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    out = {"skips": c["cudagraph_skips"], "non_static_inputs": c["cudagraph_recorded_non_static_inputs"],
           "recordings": None, "rerecords": None}
    if device.type == "cuda":
        try:
            from torch._inductor import cudagraph_trees
            m = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            nodes = [n for ns in m.roots.values() for n in ns] if m is not None else []
            count = 0
            while nodes:
                count += 1
                nodes += [child for children in nodes.pop().children.values() for child in children]
            out.update(recordings=count, rerecords=sum(sum(d.values()) for d in m.num_rerecord.values()) if m else 0)
        except (ImportError, AttributeError, TypeError):
            pass
    return out


# ----------------------------------------------------------------------------------------------------------------
# Context shared by the sections


@dataclass
class Ctx:
    args: object
    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    clock: Clock
    copy_bw: float = math.nan
    warm_s: float = 0.0  # the current section's warm-up seconds: its compiles and recordings
    save: Callable = lambda: None  # rewrites --json with every result so far

    @property
    def cfg(self) -> GPTConfig:
        return GPTConfig.from_preset(self.args.preset)

    def backend(self, section):
        return graph_backend(self.args.graphs, self.device, section)

    @property
    def judged(self) -> bool:
        """The targets are set for one GPU at the base preset: judged there only (elsewhere: printed)."""
        return self.device.type == "cuda" and self.args.preset == "base"

    def row(self, rows: list, **kw):
        """A row of the section's table, kept for --json (rewritten now: a section stopped from outside keeps it)."""
        rows.append(kw)
        self.save()
        return kw

    def capped(self, rows: list, what: str, **kw) -> bool:
        """True (and a `skipped` row) once the section's time cap is reached and it has measured its first size: the
        loop over sizes goes on to the end."""
        if not self.clock.over() or all("skipped" in r for r in rows):
            return False
        self.row(rows, name=what, skipped="section cap reached", **kw)
        print(f"   {what}: skipped (section cap reached)")
        return True

    def warmed(self, seconds: float) -> float:
        """Count a warm-up (compiles and recordings included) towards the section's compile seconds."""
        self.warm_s += seconds
        return seconds

    def met(self, ok: bool):
        """A target's verdict: ok on CUDA at the base preset, None (not judged) elsewhere."""
        return bool(ok) if self.judged else None


def copy_bandwidth(device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a large device copy (y.copy_(x) over `nbytes`: read + written = 2 x nbytes), best of `repeats`: the
    memory-bound ceiling a decode step can approach."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    ts = rounds({"copy": lambda: y.copy_(x)}, repeats, device, warmup=2)["copy"]
    return 2 * nbytes / min(ts)


def fmt_met(ok) -> str:
    return " (not judged here)" if ok is None else (" MET" if ok else " MISSED")


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# 1. decode


def context_len(cfg, prompt: int, new: int) -> int:
    """The positions of the decode and serve sections' static caches: a graphed generate's (graphs.static_cache_len),
    which the servers' caches get too (max_seq_len), so that the continuous step has one shape in both sections."""
    return graphs.static_cache_len(prompt + new, cfg.max_seq_len)


def continuous(ctx: Ctx, model: GPT, slots: int, backend) -> serve.ContinuousServer:
    """serve.py's continuous server of `model` with `slots` slots, its step compiled with the section's backend."""
    return serve.ContinuousServer(model, slots, compile=backend is not False, backend=backend or None)


def bare_step(srv: serve.ContinuousServer, prompt: int, steps: int):
    """The continuous server's (graphed) step alone: fn() runs `steps` steps of every slot, live, from position
    `prompt` (reset at each call: the same keys read every time) -> fn."""
    srv.reset()  # the static cache and slot state, allocated once

    @torch.no_grad()  # as the server's run: grad mode is part of the compiled step's guards (else a second graph)
    def fn():
        srv.cache.lengths.fill_(prompt)
        srv.live_mask.fill_(True)
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()  # each step a new iteration: its outputs are not kept
            srv.step()
    return fn


@torch.no_grad()
def section_decode(ctx: Ctx, rows: list):
    dev, dt, (P, N) = ctx.device, ctx.dtype, ctx.sizes.decode
    label, backend = ctx.backend("decode")
    S = context_len(ctx.cfg, P, N)
    cfg = GPTConfig.from_preset(ctx.args.preset, max_seq_len=S)
    torch.manual_seed(0)
    eager = GPT(cfg).to(dev, dt).eval()
    models = {"ours eager": eager}
    hf = hf_llama(cfg, dt)
    if hf is not None:
        hf.to(dev)
        models["transformers eager"] = SimpleNamespace(generate=lambda idx, n: hf_generate(hf, idx, n))
    wbytes, elem = param_bytes(eager), dt.itemsize
    print(f"   prompt {P}, {N} new tokens, greedy | weights {wbytes / 1e6:.0f} MB | ours graphed: serve.py's "
          f"continuous step ({label}) over a static cache of {S} positions | % bw = (weights + the KV a step attends "
          f"over) / step time / copy bandwidth" + ("" if hf is not None else " | transformers not installed: no "
                                                  "transformers row"))
    print(f"   {'system':22s} {'batch':>5s} {'ms/step':>22s} {'tok/s':>12s} {'% bw':>6s}  vs transformers")
    servers = {}  # batch -> the continuous server whose graphed step is timed
    for B in ctx.sizes.decode_batches:
        if ctx.capped(rows, f"batch {B}", batch=B):
            continue
        idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=dev)
        step = None
        if backend is not False:
            step = bare_step(servers.setdefault(B, continuous(ctx, eager, B, backend)), P, N)
        t, info = timed_generation(ctx, models, idx, N, ctx.sizes.repeats)
        if step is not None:  # the graphed step: its warm-up compiles it, then as many rounds as the others
            g0 = graphs_made()
            res, winfo = capped_rounds(ctx, {"ours graphed": step}, info["rounds"])
            t["ours graphed"] = {"token": [x / N for x in res["ours graphed"]]}
            info.update(warmup_s=info["warmup_s"] + winfo["warmup_s"], recompiles=info["recompiles"] +
                        winfo["recompiles"], warmup_graphs=info["warmup_graphs"] + graphs_made() - g0 -
                        winfo["recompiles"])
        for name, ts in t.items():
            kv = kv_of(cfg, B, S if name == "ours graphed" else P + N // 2, elem)
            step_s = med(ts["token"])
            r = ctx.row(rows, name=name, batch=B, ms_per_step=step_s * 1e3, tok_per_s=B / step_s,
                        pct_copy_bw=100 * (wbytes + kv) / step_s / ctx.copy_bw, rounds=info["rounds"],
                        ms_spread=spread(ts["token"], 1e3, ".3f"), warmup_s=info["warmup_s"],
                        warmup_graphs=info["warmup_graphs"], recompiles_after_warmup=info["recompiles"])
            vs = ""
            if "transformers eager" in t and name != "transformers eager":
                per = per_round(t["transformers eager"]["token"], ts["token"])
                r["x_transformers"] = med(per)
                vs = f"{spread(per, fmt='.2f')}x"
            target = met = None
            if name == "ours graphed" and B == 1:
                target, met = (f"{TARGETS['decode_b1_ms']}, {TARGETS['decode_b1_vs_hf']}",
                               ctx.met(r["ms_per_step"] <= 0.5 and r.get("x_transformers", 0) >= 10))
            elif name == "ours graphed" and B == 64:
                target, met = TARGETS["decode_b64"], ctx.met(r["tok_per_s"] >= 40e3)
            r.update(target=target, met=met)
            print(f"   {name:22s} {B:5d} {r['ms_spread']:>22s} {r['tok_per_s']:12.0f} {r['pct_copy_bw']:5.1f}%  "
                  f"{vs}" + (f"  target {target}{fmt_met(met)}" if target else ""))
        print(f"   batch {B}: {info['rounds']} rounds, warm-up {info['warmup_s']:.1f} s ({info['warmup_graphs']} "
              f"graphs made), graphs made during the timed rounds: {info['recompiles']}")
    if ctx.args.profile:
        profile_steps(ctx, rows, eager, servers.get(1), P)


def profile_steps(ctx: Ctx, rows: list, model: GPT, srv, P: int):
    """torch.profiler's kernel table of one eager decode step and one graphed continuous step (srv's, if given) at
    batch 1 (where the 0.5 ms target is): which kernels, how long each, what a fusion would remove. Printed and kept
    in --json."""
    from torch.profiler import ProfilerActivity, profile

    dev = ctx.device
    cache = model.new_cache(1, static=True)
    model.prefill(torch.zeros(1, P, dtype=torch.long, device=dev), cache)
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    systems = {"eager decode step": lambda: model.decode_step(tok, cache)}
    if srv is not None:
        systems["graphed continuous step"] = bare_step(srv, P, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    for name, fn in systems.items():
        for _ in range(3):  # warm: compiled, recorded
            fn()
            cache.lengths.fill_(P)
        sync(dev)
        with profile(activities=activities) as prof:
            fn()
            sync(dev)
        events = prof.key_averages()
        table = events.table(sort_by=key, row_limit=25)
        self_us = sum(getattr(e, "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total", 0)
                      for e in events)
        ctx.row(rows, name=f"profile: {name}", batch=1, self_time_ms=self_us / 1e3, kernels=table)
        print(f"   profile, {name} at batch 1 (sorted by {key}):\n{table}")


# ----------------------------------------------------------------------------------------------------------------
# 2. serve


def hf_generate_batch(hf, prompts, new: int, slots: int, device):
    """transformers' continuous batching on these prompts (greedy, `new` tokens each, `slots` requests per batch; the
    manager kept between calls, its CUDA graphs captured once: the caller destroys it after the last call, before a
    manager of another size is made -- persistent_manager returns the cached one whatever it was sized for; on CUDA
    its cache takes at most HF_MEMORY of the free memory, not the default 80-90%) -> fn() returning the tokens
    generated."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc_ = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = dict(max_requests_per_batch=slots)
    if device.type == "cuda":
        kw.update(max_memory_percent=HF_MEMORY)
    else:  # sized from GPU memory otherwise
        kw.update(num_blocks=2 * slots + 4, max_batch_tokens=max(256, 2 * slots))
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    cb = ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in known})

    def fn():
        out = hf.generate_batch(prompts, generation_config=gc_, continuous_batching_config=cb, persistent_manager=True,
                                progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())
    return fn


HF_MEMORY = 0.3  # of the free GPU memory, for transformers' continuous-batching cache


@torch.no_grad()
def section_serve(ctx: Ctx, rows: list):
    sz, dev, dt = ctx.sizes, ctx.device, ctx.dtype
    label, backend = ctx.backend("serve")
    P, N = sz.decode
    S_ctx = context_len(ctx.cfg, P, N)
    if parse_range(sz.serve_prompt)[1] + parse_range(sz.serve_gen)[1] > S_ctx:
        raise ValueError(f"serving requests of {sz.serve_prompt} + {sz.serve_gen} tokens exceed {S_ctx} positions")
    cfg = GPTConfig.from_preset(ctx.args.preset, max_seq_len=S_ctx)
    torch.manual_seed(0)
    van = GPT(cfg)
    rec = from_vanilla(van, 2, "average", log=lambda *_: None)
    van, rec = van.to(dev, dt).eval(), rec.to(dev, dt).eval()
    compile_kw = dict(compile=backend is not False, backend=backend or None)
    gen = parse_range(sz.serve_gen)[1]
    hf, hf_why = None, None
    try:
        hf = hf_llama(cfg, dt)
        hf_why = None if hf is not None else "transformers is not installed"
    except Exception as e:  # noqa: BLE001 - the peer's row says why
        hf_why = one_line(e)
    if hf is not None:
        hf.to(dev)
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "persistent_manager=True" notes
    print(f"   vanilla {cfg.n_layer} layers vs recursive B=2 (Average tying, no LoRA) | context {S_ctx} per slot | "
          f"requests: prompts {sz.serve_prompt}, {sz.serve_gen} new tokens, greedy, all at once, {sz.serve_waves:g} x "
          f"slots | exits SIMULATED: a max-softmax threshold makes {bench_serve.SIMULATED_EXIT_RATE:.1%} of prompt "
          f"tokens leave "
          f"at loop 1 (the oracle share) | steps: {label} | bare step: the continuous server's graphed step alone")
    for S in sz.serve_slots:
        if ctx.capped(rows, f"slots {S}", slots=S):
            continue
        reqs = synthetic_requests(max(S + 1, round(sz.serve_waves * S)), cfg.vocab_size, sz.serve_prompt,
                                  sz.serve_gen, "all", seed=0)
        thr = bench_serve.calibrate_threshold(rec, reqs, bench_serve.SIMULATED_EXIT_RATE, rule="softmax")
        servers = [continuous(ctx, van, S, backend), serve.DepthWiseServer(rec, S, **compile_kw),
                   serve.DepthWiseServer(rec, S, exit_threshold=thr, exit_rule="softmax", **compile_kw)]
        for srv, name in zip(servers, ("continuous", "depth-wise, no exit", "depth-wise + exit")):
            srv.name, srv.hook = name, Metrics()  # what bench_serve.summarize reads
        bench_serve.check_cache_memory({s.name: s.model for s in servers}, {s.name: s.slots for s in servers},
                                       dt.itemsize, dev, f"bench.py gpu serve at {S} slots")
        t0 = time.perf_counter()
        for srv in servers:  # warm-up: compiles the steps
            srv.run(reqs[:S], clock="step")
        bare = bare_step(servers[0], P, 8) if backend is not False else None
        if bare is not None:
            bare()
        hf_fn, hf_err = None, hf_why
        if hf is not None:
            try:
                hf_fn = hf_generate_batch(hf, [r.prompt for r in reqs], gen, S, dev)
                hf_fn()  # warm-up: the manager, its graphs
            except Exception as e:  # noqa: BLE001 - transformers' own limits: its row says why
                hf_fn, hf_err = None, one_line(e)
        sync(dev)
        warm = ctx.warmed(time.perf_counter() - t0)
        before = graphs_made()
        summ = {s.name: [] for s in servers}
        hf_tps, bare_ms, n = [], [], 0
        while n < sz.repeats and (n == 0 or not ctx.clock.over()):  # interleaved rounds, capped
            for srv in servers:
                summ[srv.name].append(bench_serve.summarize(srv, srv.run(reqs)))
            if hf_fn is not None:
                sync(dev)
                t1 = time.perf_counter()
                toks = hf_fn()
                sync(dev)
                hf_tps.append(toks / (time.perf_counter() - t1))
            if bare is not None:
                sync(dev)
                t1 = time.perf_counter()
                bare()
                sync(dev)
                bare_ms.append((time.perf_counter() - t1) / 8 * 1e3)
            n += 1
        recompiles = graphs_made() - before
        if hf is not None:  # the next slot count gets a manager of its own (and this one's memory back)
            hf.destroy_cached_continuous_batching_manager()
        base = summ["continuous"]
        print(f"   slots {S}: {len(reqs)} requests, {n} rounds, warm-up {warm:.1f} s (compiles included), graphs "
              f"made during the timed rounds: {recompiles}")
        print(f"   {'system':24s} {'tok/s':>22s} {'loaded tok/s':>22s} {'step ms':>8s} {'x continuous loaded':>20s}")
        for srv in servers:
            rs = summ[srv.name]
            loaded = per_round([x["loaded_tok_per_s"] for x in rs], [b["loaded_tok_per_s"] for b in base])
            r = ctx.row(rows, name=srv.name, slots=S, tok_per_s=med([x["tok_per_s"] for x in rs]),
                        loaded_tok_per_s=med([x["loaded_tok_per_s"] for x in rs]),
                        step_ms=med([x["step_ms"] for x in rs]), x_continuous_loaded=med(loaded),
                        mean_exit_loop=med([x["mean_exit_loop"] for x in rs]), rounds=n, warmup_s=warm,
                        recompiles_after_warmup=recompiles)
            target = met = None
            if srv.name == "continuous" and bare_ms:
                r["x_bare_step"] = r["step_ms"] / med(bare_ms)
                target, met = TARGETS["serve_step"], r["x_bare_step"] <= 1.5
            if srv.name == "continuous" and S == 64:
                target = f"{target + '; ' if target else ''}{TARGETS['serve64']}"
                met = (met is not False) and r["tok_per_s"] >= 30e3
            if srv.name == "depth-wise + exit":
                target, met = TARGETS["serve_exit"], r["x_continuous_loaded"] >= 1.25
            met = ctx.met(met) if target else None
            r.update(target=target, met=met)
            print(f"   {srv.name:24s} {spread([x['tok_per_s'] for x in rs], fmt='.0f'):>22s} "
                  f"{spread([x['loaded_tok_per_s'] for x in rs], fmt='.0f'):>22s} {r['step_ms']:8.2f} "
                  f"{spread(loaded, fmt='.2f'):>20s}" + (f"  (step {r['x_bare_step']:.2f}x the bare step)"
                                                          if "x_bare_step" in r else "")
                  + (f"  target {target}{fmt_met(met)}" if target else ""))
        if bare_ms:
            ctx.row(rows, name="bare graphed decode step", slots=S, step_ms=med(bare_ms),
                    tok_per_s=S / med(bare_ms) * 1e3, rounds=n)
            print(f"   {'bare graphed decode step':24s} {spread(bare_ms, fmt='.3f')} ms/step at batch {S}, {S_ctx} "
                  f"positions (the continuous server's step alone)")
        if hf_fn is not None:
            per = per_round([c["tok_per_s"] for c in base], hf_tps)
            ok = ctx.met(med(per) >= 1.5)
            ctx.row(rows, name="transformers generate_batch", slots=S, tok_per_s=med(hf_tps), continuous_x=med(per),
                    rounds=n, target=TARGETS["serve_vs_hf"], met=ok)
            print(f"   {'transformers generate_batch':24s} {spread(hf_tps, fmt='.0f'):>22s} -> continuous / "
                  f"generate_batch {spread(per, fmt='.2f')}x  target {TARGETS['serve_vs_hf']}{fmt_met(ok)}")
        else:
            ctx.row(rows, name="transformers generate_batch", slots=S, skipped=hf_err)
            print(f"   transformers generate_batch: skipped on {dev.type}: {hf_err}")
        del servers
        free(dev)


# ----------------------------------------------------------------------------------------------------------------
# 3. PLT


@torch.no_grad()
def section_plt(ctx: Ctx, rows: list):
    dev, dt, (P, N) = ctx.device, ctx.dtype, ctx.sizes.plt
    label, backend = ctx.backend("plt")
    preset = ctx.args.preset if ctx.args.preset in plt.PRESETS else "base"
    base = dict(plt.PRESETS[preset], max_seq_len=P + N + 8)
    torch.manual_seed(0)
    models = {v: plt.PLT(plt.PLTConfig(**{**base, **plt.variant_fields(v)})).to(dev, dt).eval()
              for v in ("vanilla", "loop", "plt")}
    if backend is not False:
        for m in models.values():
            compile_decode(m, backend)
    L = base["n_loops"]
    print(f"   plt preset {preset}: {base['n_layer']} layers x L={L}, d {base['n_embd']}, window {base['window']} | "
          f"prompt {P}, {N} new tokens | steps: {label}")
    for B in ctx.sizes.plt_batches:
        if ctx.capped(rows, f"batch {B}", batch=B):
            continue
        idx = torch.randint(0, base["vocab_size"] - 1, (B, P), device=dev)
        t, info = timed_generation(ctx, models, idx, N, ctx.sizes.repeats)
        pv = per_round(t["plt"]["token"], t["vanilla"]["token"])
        pl = per_round(t["plt"]["token"], t["loop"]["token"])
        met = ctx.met(med(pv) <= 1.10) if B in (4, 16) else None
        copies = replay_copies(models.values())
        ctx.row(rows, name=f"PLT-{L} / vanilla", batch=B, ratio=med(pv), target=TARGETS["plt"], met=met,
                rounds=info["rounds"], recompiles_after_warmup=info["recompiles"], bytes_copied_per_replay=copies,
                **{f"ms_{v}": med(t[v]["token"]) * 1e3 for v in t})
        ctx.row(rows, name=f"PLT-{L} / loop-{L}", batch=B, ratio=med(pl), target=TARGETS["plt_loop"], met=None,
                rounds=info["rounds"])
        print(f"   batch {B:3d}: ms/token " + ", ".join(f"{v} {spread(t[v]['token'], 1e3, '.3f')}" for v in t))
        verdict = fmt_met(met) if B in (4, 16) else ""
        print(f"              PLT-{L} / vanilla {spread(pv, fmt='.2f')}  target {TARGETS['plt']}{verdict}")
        print(f"              PLT-{L} / loop-{L} {spread(pl, fmt='.2f')}  ({TARGETS['plt_loop']}) | {info['rounds']} "
              f"rounds, warm-up {info['warmup_s']:.1f} s, graphs made during the timed rounds: "
              f"{info['recompiles']}" + (f", bytes copied in per replay {copies}" if copies else ""))


# ----------------------------------------------------------------------------------------------------------------
# 4. Block


@torch.no_grad()
def section_block(ctx: Ctx, rows: list):
    sz, dev, dt = ctx.sizes, ctx.device, ctx.dtype
    label, backend = ctx.backend("block")
    preset = BLOCK_PRESET.get(ctx.args.preset, "t3-19m")
    P, G = block_lengths("decode-heavy", sz.block_scale)
    budget = sz.block_budget_mib * 2 ** 20
    check_bench_memory(dev, f"bench.py gpu block ({preset}, {P + G} positions, {sz.block_budget_mib} MiB of caches)",
                       *block_pair_memory(preset, None, P + G, dt.itemsize),
                       {"generation caches (one model at a time)": budget})
    block, vanilla = block_pair(preset, None, dev, dt, P + G)
    models = {"vanilla": vanilla, "block": block}
    top = {k: budget // generation_bytes(m, P, G) for k, m in models.items()}
    if min(top.values()) < 1:
        raise ValueError(f"a model does not fit {sz.block_budget_mib} MiB of caches at batch 1")
    n_search = search_window(P, G, sz.block_search)[0]
    best = {}
    for k, m in models.items():  # the batch search runs the eager steps: one graph per batch would not fit the time
        t0, cut = time.perf_counter(), []  # each model's search takes at most a quarter of the section's cap

        def stop():
            cut.append(time.perf_counter() - t0 > ctx.clock.cap / 4)
            return cut[-1]
        best[k], found = search_batch(m, P, G, top[k], n_search, dev, buckets_only=backend is not False, stop=stop)
        print(f"   batch search, {k} (eager decode tok/s): " + ", ".join(f"{b}: {v:.0f}" for b, v in found.items())
              + f" -> batch {best[k]}" + (" (cut at a quarter of the section's cap)" if any(cut) else ""))
    if backend is not False:
        for m in models.values():
            compile_decode(m, backend)
    print(f"   block {preset} vs its vanilla counterpart | decode-heavy x{sz.block_scale:g}: prompt {P}, {G} new "
          f"tokens | caches {sz.block_budget_mib} MiB: largest batch vanilla {top['vanilla']}, block {top['block']} | "
          f"timed: {label}" + ("" if backend is False else f" | batches searched among the buckets, both static caches "
                               f"of {graphs.static_cache_len(P + G, vanilla.config.max_seq_len)} positions"))
    systems, batch = block_systems(models, {k: sorted({1, best[k]}) for k in models}, P, G, dev)
    res, info = capped_rounds(ctx, systems, sz.repeats)  # its warm-up records the graphed steps
    n, warm, recompiles = info["rounds"], info["warmup_s"], info["recompiles"]
    tput, r_best, r_one = block_ratios(res, batch, best, G)
    for s, ts in res.items():
        ctx.row(rows, name=s.split()[0], batch=batch[s], tok_per_s=med(tput[s]), ms_per_token_step=med(ts) / G * 1e3,
                rounds=n)
        print(f"   {s:14s} {spread(tput[s], fmt='.0f'):>24s} tok/s  {med(ts) / G * 1e3:.3f} ms per token step")
    ok, copies = ctx.met(med(r_best) >= 10), replay_copies(models.values())
    ctx.row(rows, name="block / vanilla at the best batches", batch=best["block"], ratio=med(r_best),
            ratio_batch1=med(r_one), target=TARGETS["block"], met=ok, rounds=n, warmup_s=warm,
            recompiles_after_warmup=recompiles, bytes_copied_per_replay=copies)
    print(f"   block / vanilla at the best batches ({best['block']} vs {best['vanilla']}) "
          f"{spread(r_best, fmt='.2f')}x, at batch 1 {spread(r_one, fmt='.2f')}x  target {TARGETS['block']}"
          f"{fmt_met(ok)} | {n} rounds, warm-up {warm:.1f} s, graphs made during the timed rounds: {recompiles}"
          + (f", bytes copied in per replay {copies}" if copies else ""))


# ----------------------------------------------------------------------------------------------------------------
# 5. double decoder


@torch.no_grad()
def section_double(ctx: Ctx, rows: list):
    dev, dt, (P, N) = ctx.device, ctx.dtype, ctx.sizes.double
    label, backend = ctx.backend("double")
    preset = ctx.args.preset if ctx.args.preset in dd.PRESETS else "base"
    cfg = dd.DoubleConfig(**{**dd.PRESETS[preset], "max_seq_len": P + N + 8})
    torch.manual_seed(0)
    gm, dm = GPT(dd.baseline_config(cfg)).to(dev, dt).eval(), dd.DoubleDecoder(cfg).to(dev, dt).eval()
    if backend is not False:
        for m in (gm, dm):
            compile_decode(m, backend)
    models = {"decoder-only": gm, "double": dm}
    paper = cfg.gen_layers / cfg.n_layer
    print(f"   double preset {preset}: {cfg.ctx_layers} + {cfg.gen_layers} layers vs {cfg.n_layer} | prompt {P}, {N} "
          f"new tokens | paper: per-token ~ L_dec / L = {paper:.3f} | steps: {label}")
    for B in ctx.sizes.double_batches:
        if ctx.capped(rows, f"batch {B}", batch=B):
            continue
        idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=dev)
        t, info = timed_generation(ctx, models, idx, N, ctx.sizes.repeats)
        per, copies = per_round(t["double"]["token"], t["decoder-only"]["token"]), replay_copies(models.values())
        ctx.row(rows, name="double / decoder-only per token", batch=B, ratio=med(per), paper=paper,
                target=TARGETS["double"], met=None, rounds=info["rounds"], recompiles_after_warmup=info["recompiles"],
                bytes_copied_per_replay=copies, **{f"ms_{k.replace('-', '_')}": med(v["token"]) * 1e3
                                                   for k, v in t.items()})
        print(f"   batch {B:3d}: ms/token " + ", ".join(f"{k} {spread(v['token'], 1e3, '.3f')}" for k, v in t.items())
              + f" -> double / decoder-only {spread(per, fmt='.3f')} (paper ~{paper:.3f}) | {info['rounds']} rounds, "
              f"graphs made during the timed rounds: {info['recompiles']}"
              + (f", bytes copied in per replay {copies}" if copies else ""))


# ----------------------------------------------------------------------------------------------------------------
# 6. train


def train_shapes(preset: str, seq_len: int) -> tuple[GPTConfig, str]:
    """Ours at nanoGPT's shape: `base` -> nanoGPT-124M (12 layers, d 768, 12 heads, vocab 50304); another preset ->
    its layers, width and heads. MHA, SwiGLU of 8d/3 (nanoGPT's 4d GELU MLP has 8 d^2 parameters, so has a SwiGLU
    of 8d/3: 3 x d x 8d/3), tied embedding."""
    if preset == "base":
        shape = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304)
        what = "nanoGPT-124M's shape"
    else:
        p = PRESETS[preset]
        shape = dict(n_layer=p["n_layer"], n_embd=p["n_embd"], n_head=p["n_head"], vocab_size=p["vocab_size"])
        what = f"preset {preset}'s layers, width and heads"
    d = shape["n_embd"]
    return GPTConfig(**shape, n_kv_head=shape["n_head"], mlp_hidden=round(8 * d / 3), max_seq_len=seq_len,
                     tie_embeddings=True), what


def section_train(ctx: Ctx, rows: list):
    dev, dt, (B, T) = ctx.device, ctx.dtype, ctx.sizes.train
    label, backend = ctx.backend("train")
    cfg, what = train_shapes(ctx.args.preset, T)
    models = train_models(cfg, ctx.args.nanogpt, T, dev)
    x, y, autocast = train_batch(cfg, B, T, dev, dt)
    steps = {}
    for name, m in models.items():  # as bench.py train: ours train.py's AdamW, nanoGPT torch's (fused on CUDA)
        opt = optimizer_for(name, m, dev)
        steps[f"{name} eager"] = train_step(m, opt, x, y, autocast)
        if backend is not False:
            fwd = torch.compile(m) if backend is None else torch.compile(m, backend=backend)
            steps[f"{name} compiled"] = train_step(fwd, opt, x, y, autocast)
    n_params = param_counts(models)
    flops, peak = models["ours"].flops_per_token(T), peak_flops(dev)
    print(f"   {what}: layers {cfg.n_layer}, d {cfg.n_embd}, heads {cfg.n_head} (MHA), ours SwiGLU {cfg.mlp_hidden} + "
          f"RMSNorm vs nanoGPT GELU {4 * cfg.n_embd} + LayerNorm | params " + ", ".join(
              f"{k} {v / 1e6:.2f}M" for k, v in n_params.items()) + f" | batch {B} x {T}, autocast {dt} | compiled: "
          f"{label} | MFU = tok/s x {flops / 1e6:.0f} MFLOP/token (6N + 12LHDT) / "
          + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "no known peak on this device (MFU -)")
          + ("" if ctx.args.nanogpt else " | no --nanogpt: ours alone (nanoGPT's model.py comes from a checkout)"))
    res, info = capped_rounds(ctx, steps, ctx.sizes.repeats, warmup=2)  # the warm-up compiles
    n, warm = info["rounds"], info["warmup_s"]
    for name, ts in res.items():
        tps = [B * T / t for t in ts]
        mfu = 100 * med(tps) * flops / peak if peak else None
        r = ctx.row(rows, name=name, tok_per_s=med(tps), mfu_pct=mfu, params=n_params[name.split()[0]], rounds=n,
                    warmup_s=warm)
        vs, target, met = "", None, None
        if name.startswith("ours") and name.replace("ours", "nanoGPT") in res:
            per = per_round(res[name.replace("ours", "nanoGPT")], ts)
            r["x_nanogpt"] = med(per)
            vs = f"  ours / nanoGPT {spread(per, fmt='.2f')}x"
            if name.endswith("compiled"):
                target, met = TARGETS["train"], ctx.met(r["x_nanogpt"] >= 1.0)
        r.update(target=target, met=met)
        print(f"   {name:18s} {spread(tps, fmt='.0f'):>26s} tok/s  MFU "
              + (f"{mfu:.1f}%" if mfu is not None else "-") + vs + (f"  target {target}{fmt_met(met)}" if target
                                                                     else ""))
    print(f"   {n} rounds, warm-up {warm:.1f} s (2 steps of each, compiles included)")


SECTION_FNS = {"decode": section_decode, "serve": section_serve, "plt": section_plt, "block": section_block,
               "double": section_double, "train": section_train}
TITLES = {"decode": "1. vanilla decode: eager, graphed, transformers", "serve": "2. serving: serve.py vs "
          "generate_batch", "plt": "3. PLT-2 / vanilla / loop-2", "block": "4. Block Transformer vs vanilla",
          "double": "5. double decoder vs decoder-only", "train": "6. training vs nanoGPT at the same parameters"}


# ----------------------------------------------------------------------------------------------------------------
# Memory, before anything is allocated


def check_gpu_memory(ctx: Ctx, only):
    """The largest section's models, caches and batches (sections run one at a time) against the device."""
    cfg, dt, sz, e = ctx.cfg, ctx.dtype, ctx.sizes, ctx.dtype.itemsize
    P, N = sz.decode
    top = max(sz.decode_batches + sz.serve_slots)
    need = {"decode": memory_sum(*[model_memory(cfg, e)] * 3, {"KV caches": 3 * kv_of(cfg, top, P + N + 128, e)},
                                 forward_memory(cfg, top, P, e, logits_rows=top)),
            "serve": memory_sum(*[model_memory(cfg, e)] * 4, {"server caches": 6 * kv_of(cfg, top, P + N + 128, e)},
                                forward_memory(cfg, top, P, e, logits_rows=top))}
    tcfg, _ = train_shapes(ctx.args.preset, sz.train[1])
    need["train"] = train_memory(tcfg, *sz.train, dt, 2 if ctx.args.nanogpt else 1)
    worst = max((need[s] for s in only if s in need), key=lambda d: d["total"], default=None)
    check_bench_memory(ctx.device, f"bench.py gpu (preset {ctx.args.preset}, the largest section)",
                       {"copy bandwidth probe": 2 * sz.bandwidth_bytes}, *([worst] if worst else []),
                       fix="take a smaller --preset")


# ----------------------------------------------------------------------------------------------------------------
# The command


def write_json(path, results):
    """Every result so far, atomically (an outer timeout finds the last complete file)."""
    if not path:
        return
    write_atomic(Path(path), json.dumps(json_safe(results), indent=1))


def one_line(e: BaseException) -> str:
    """An exception as one line for a row and the log: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_json(path):
    """--json: a regular file (or none yet) in a writable directory, checked before any work: a directory, a special
    file, a missing directory or a read-only place is one `error:` line, and nothing is left behind."""
    check_output_file(path, "--json")
    check_writable_dir(Path(path).parent, "--json's directory")


def bench_gpu(args) -> dict:
    only = [s for s in SECTIONS if s in args.only.split(",")]
    check_nanogpt(args.nanogpt)
    if args.json:
        check_json(args.json)
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    sizes = Sizes() if device.type == "cuda" else CPU_SIZES
    ctx = Ctx(args, device, dtype, replace(sizes, repeats=args.repeats or sizes.repeats), Clock(args.minutes))
    check_gpu_memory(ctx, only)
    cfg = ctx.cfg
    ctx.copy_bw = copy_bandwidth(device, ctx.sizes.bandwidth_bytes)
    with torch.device("meta"):
        n_params = GPT(cfg).num_params(False)
    head = dict(device=device_name(device), device_type=device.type, dtype=str(dtype).removeprefix("torch."),
                torch=torch.__version__, preset=args.preset, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, mlp_hidden=cfg.mlp_hidden, vocab_size=cfg.vocab_size,
                params=n_params, copy_bandwidth_GBs=ctx.copy_bw / 1e9, minutes=args.minutes, sections=only,
                graphs={s: ctx.backend(s)[0] for s in only})
    print(f"== bench.py gpu | device {head['device']} | dtype {head['dtype']} | torch {torch.__version__} | preset "
          f"{args.preset}: {cfg.n_layer} layers, d {cfg.n_embd}, heads {cfg.n_head}/{cfg.n_kv_head}, MLP "
          f"{cfg.mlp_hidden}, vocab {cfg.vocab_size}, {n_params / 1e6:.1f}M params | random weights | copy bandwidth "
          f"{ctx.copy_bw / 1e9:.1f} GB/s (read + written by a {ctx.sizes.bandwidth_bytes >> 20} MiB copy_) | "
          f"--minutes {args.minutes:g} | median (min..max) of interleaved rounds after a warm-up")
    results = {"header": head, "sections": {}}
    ctx.save = lambda: write_json(args.json, results)
    ctx.save()
    for i, name in enumerate(only):
        cap = ctx.clock.start_section(SHARES[name], sum(SHARES[s] for s in only[i:]))
        rows, t0, ctx.warm_s, counted = [], time.perf_counter(), 0.0, cudagraph_counters(device)
        entry = results["sections"][name] = {"status": "running", "cap_s": cap, "rows": rows}
        print(f"\n== {TITLES[name]} | cap {cap:.0f} s" + (" (--minutes spent: its first size, one round)"
                                                           if cap <= 0 else ""))
        try:
            SECTION_FNS[name](ctx, rows)
            entry["status"] = "ok"
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - a UsageError too: one section failing leaves the others to run
            entry.update(status="failed", error=one_line(e))
            print(f"section {name} failed: {one_line(e)}")
        now = cudagraph_counters(device)
        entry.update(seconds=time.perf_counter() - t0, warmup_s=ctx.warm_s, cudagraphs={
            k: None if v is None else v - (counted[k] or 0) for k, v in now.items()})
        print(f"   section {name}: {entry['seconds']:.0f} s, of which warm-up (compiles, recordings) "
              f"{ctx.warm_s:.0f} s | inductor CUDA graphs: " + ", ".join(
                  f"{k.replace('_', ' ')} {'-' if v is None else v}" for k, v in entry["cudagraphs"].items()))
        free(device)
        write_json(args.json, results)
    failed = {n: e["error"] for n, e in results["sections"].items() if e["status"] == "failed"}
    summary = [(n, r) for n, e in results["sections"].items() for r in e["rows"] if r.get("met") is not None]
    took = f"{time.perf_counter() - ctx.clock.t0:.0f} s in all"
    if not ctx.judged:
        print(f"\n== targets: not judged on {device.type} at preset {args.preset} (they are for one GPU at preset "
              f"base) | {took}")
    else:
        print(f"\n== targets: {sum(r['met'] for _, r in summary)} of {len(summary)} met ("
              + ", ".join(f"{n}/{r['name']}{' b' + str(r['batch']) if 'batch' in r else ''}"
                          f"{' s' + str(r['slots']) if 'slots' in r else ''}: {'met' if r['met'] else 'MISSED'}"
                          for n, r in summary) + f") | {took}")
    if failed:  # the results are written; the command still fails
        print("failed: " + "; ".join(f"section {n}: {e}" for n, e in failed.items()), file=sys.stderr)
        raise SystemExit(1)
    return results


def add_args(p):
    """The flags of `python bench.py gpu` (p: its subparser)."""
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto (bf16 on CUDA, fp32 on CPU) | ...")
    p.add_argument("--preset", default="base", choices=sorted(PRESETS), help="model.py preset (default base)")
    p.add_argument("--minutes", type=number(float, above=0), default=8.0,
                   help="time for every section together (each gets a share)")
    p.add_argument("--only", type=comma_list(one_of(list(SECTIONS))), default=",".join(SECTIONS),
                   help="comma list of sections: " + ", ".join(SECTIONS))
    p.add_argument("--nanogpt", type=path_arg, default=None, help="a nanoGPT checkout (its model.py) for train")
    p.add_argument("--graphs", default="auto", choices=GRAPH_BACKENDS,
                   help="how graph-safe steps are recorded: auto and capture (graphs.CapturedStep for plt, block, "
                        "double; decode, serve, train: inductor on CUDA, dynamo + backend eager on a CPU), or "
                        "inductor, eager, none for all")
    p.add_argument("--repeats", type=number(int, min=1), default=None,
                   help="interleaved rounds per comparison, at most (default 5 on CUDA, 3 on CPU; fewer when a "
                        "section runs long)")
    p.add_argument("--json", type=path_arg, default=None, help="write every result here after each section")
    p.add_argument("--profile", action="store_true",
                   help="decode: also the kernel table of one eager and one graphed step at batch 1 (torch.profiler)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_gpu)
