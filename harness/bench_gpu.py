"""
bench_gpu.py -- `python bench.py gpu`: the four papers' efficiency claims on ONE GPU, in one command that finishes in
--minutes (default 8), each system against its baseline in the same run (interleaved rounds, median and min..max).

Papers (the figures beside each ratio): "Relaxed Recursive Transformers" (Bae et al., arXiv:2410.20672; section 2.4,
Appendix K: depth-wise batching + early exit), "Block Transformer" (Ho, Bae et al., arXiv:2406.02657; Table 2: 10-20x
the throughput of vanilla at the best batch), "Parallel Loop Transformer" (PLT; Table 3: PLT-2 / vanilla 1.02-1.06 per
token), the block-based double decoder (section 3.3: per-token cost ~ L_dec / L).

Sections (--only picks some; each is timed on its own, its result written to --json as soon as it ends):
  decode  vanilla decode at batch 1/16/64: our eager decode (GPT.generate), our graphed decode (graphs.compile_decode:
          static caches per batch bucket, on CUDA torch.compile mode="reduce-overhead": one CUDA graph per step) and
          transformers' eager LlamaForCausalLM.generate at our shape: ms per step, tok/s, % of the measured copy
          bandwidth (bytes a step reads: the weights and the KV positions it attends over).
  serve   serve.py's servers on the same requests at 16 and 64 slots: continuous batching of the vanilla model,
          depth-wise batching of its recursive conversion (B = 2, Average tying) without and with exits (SIMULATED at
          the oracle share serve.DEMO_EXIT_RATE: bench_serve.calibrate_threshold, as `bench.py serve --exit-rate`),
          a bare graphed decode step of the same batch, and transformers' continuous batching
          (LlamaForCausalLM.generate_batch, which captures CUDA graphs on a GPU) on the same prompts.
  plt     PLT-2 / vanilla / loop-2 per-token latency at batch 1/4/16 (bench.py plt's generation_times).
  block   Block Transformer vs vanilla at the best batch of a cache budget (bench.py block's block_pair and
          search_batch), decode-heavy setting.
  double  double decoder vs decoder-only per-token latency (bench.py double's models and timing).
  train   training tok/s and MFU of ours against nanoGPT's model.py at the same parameter count: nanoGPT-124M (12
          layers, d 768, 12 heads, GELU 4d MLP, LayerNorm, vocab 50304) and ours at the same d / layers / heads with
          MHA, SwiGLU 2048 = 8d/3 (the MLP's parameters match), tied embedding; eager and torch.compile'd.
          MFU = tok/s x model.flops_per_token (6N + 12 L H D T) / device.peak_flops.

Graphs (--graphs). auto: on CUDA the decode and serve sections compile their steps with inductor, mode
"reduce-overhead" (static caches, one CUDA graph per step); plt, block and double capture theirs with torch's
"cudagraphs" backend (a CUDA graph of the stock kernels, seconds to capture where inductor takes tens of seconds per
graph: they fit the budget), train compiles with inductor (torch.compile's default mode). On a CPU every graph-safe
step is traced by dynamo with fullgraph=True and run by backend "eager": the CPU run proves every step is one graph
and that nothing recompiles after warm-up (each section reports the graphs compiled during its timed rounds: it must
be 0), its timings of "graphed" steps mean nothing.

Time. Each section gets a share of what is left of --minutes (SHARES); it runs fewer rounds (and skips batches) when
it runs long, is stopped at 1.25 x its cap + 15 s if it overruns (`stopped at its cap`), and a section that raises
prints `section X failed: ...` while the others still run. --json is rewritten after each section with every result
so far: an outer timeout keeps what is done.

The GPU run (one H100 or H200, about 8 minutes; scripts/gpu_check.sh):
    timeout 560 python bench.py gpu --device cuda --dtype bfloat16 --minutes 8 --nanogpt nanogpt \\
        --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.txt
On a CPU, every section at toy sizes (about a minute):
    python bench.py gpu --device cpu --preset tiny --minutes 1 --json /tmp/g.json
"""
from __future__ import annotations

import gc
import json
import logging
import math
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

import double_decoder as dd
import graphs
import plt
import serve
from harness import bench_serve
from harness.bench_common import (check_bench_memory, device_name, hf_generate, hf_llama, json_safe, kv_of, med,
                                  per_round, rounds, spread)
from harness.bench_decode import (block_lengths, block_pair, block_pair_memory, block_ratios, block_systems,
                                  generation_bytes, generation_times, search_batch)
from harness.bench_train import (check_nanogpt, optimizer_for, param_counts, train_batch, train_memory, train_models,
                                 train_step)
from harness.cli import DTYPES, UsageError, comma_list, number, one_of, path_arg, threads_arg, write_atomic
from harness.device import peak_flops, pick_device, pick_dtype, sync
from harness.memory import forward_memory, memory_sum, model_memory, param_bytes
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
    decode_batches: tuple = (1, 16, 64)
    serve_slots: tuple = (16, 64)
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
                  block_scale=1 / 32, block_budget_mib=16, block_search=4, double=(16, 6), train=(2, 64),
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


class SectionTimeout(Exception):
    pass


class Clock:
    """The overall deadline (--minutes from the start) and the current section's cap."""

    def __init__(self, minutes: float):
        self.t0 = time.perf_counter()
        self.end = self.t0 + minutes * 60 * (1 - RESERVE)
        self.cap_end = self.end

    def start_section(self, share: float, shares_left: float) -> float:
        left = max(self.end - time.perf_counter(), 0.0)
        cap = left * share / shares_left
        self.cap_end = time.perf_counter() + cap
        return cap

    def left(self) -> float:
        return self.cap_end - time.perf_counter()

    def over(self) -> bool:
        return self.left() <= 0


def fit_repeats(cost: float, clock: Clock, want: int) -> int:
    """Rounds that fit what is left of the section's cap, each costing `cost` s: at most `want`, at least 1."""
    return max(1, min(want, int(clock.left() / max(cost, 1e-9))))


def capped_rounds(systems: dict, want: int, device, clock: Clock, warmup: int = 1) -> tuple[dict, dict]:
    """bench_common.rounds after `warmup` untimed calls of each system (graphed steps compile here), one interleaved
    round at a time, until `want` rounds or the section's cap (at least one round) -> (name -> list of seconds,
    {rounds: rounds run, warmup_s, recompiles: graphs compiled during the timed rounds})."""
    t0 = time.perf_counter()
    rounds(systems, 0, device, warmup=warmup)
    warm, before = time.perf_counter() - t0, graphs_compiled()
    out = {name: [] for name in systems}
    n = 0
    while n < want and (n == 0 or not clock.over()):
        for name, ts in rounds(systems, 1, device, warmup=0).items():
            out[name] += ts
        n += 1
    return out, dict(rounds=n, warmup_s=warm, recompiles=graphs_compiled() - before)


def graphs_compiled() -> int:
    """Frames dynamo has compiled so far (a recompile counts one more)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def timed_generation(ctx, models: dict, idx, new: int, want: int) -> tuple[dict, dict]:
    """bench_decode.generation_times (TTFT and per-token decode time of each model's generate, interleaved), its
    rounds fitted to the cap: a warm-up generate of each model first (a graphed model compiles here), then one timed
    pilot round (the rounds' warm-up) -> (times, {warmup_s, rounds, recompiles: graphs compiled during the timed
    rounds})."""
    clock = ctx.clock
    t0, g0 = time.perf_counter(), graphs_compiled()
    for m in models.values():
        m.generate(idx, new)
    sync(idx.device)
    warm, warm_graphs = time.perf_counter() - t0, graphs_compiled() - g0
    t0 = time.perf_counter()
    for m in models.values():
        m.generate(idx, 1)
        m.generate(idx, new)
    sync(idx.device)
    reps = fit_repeats(time.perf_counter() - t0, clock, want)
    before = graphs_compiled()
    t = generation_times(models, idx, new, reps, warmup=0)  # the pilot round warmed them up
    return t, dict(warmup_s=warm, warmup_graphs=warm_graphs, rounds=reps, recompiles=graphs_compiled() - before)


# ----------------------------------------------------------------------------------------------------------------
# Graphs: how each section compiles its steps


GRAPH_BACKENDS = ("auto", "inductor", "cudagraphs", "eager", "none")


def graph_backend(flag: str, device, section: str):
    """--graphs for one section -> (label, backend for graphs.compile_step / graphs.compile_decode / serve.Server) or
    (label, False) for no graphs. backend None is inductor (mode "reduce-overhead" on CUDA)."""
    if flag == "auto":
        if device.type != "cuda":
            flag = "eager"
        else:
            flag = "inductor" if section in ("decode", "serve", "train") else "cudagraphs"
    if flag == "none":
        return "none (eager steps)", False
    eager = ('torch.compile, backend "eager" (no kernels, no speed)' if section == "train" else  # the whole model
             'dynamo, fullgraph, backend "eager" (graph safety only: no kernels, no speed)')
    graphed = device.type == "cuda" and section != "train"  # train: torch.compile's default mode, no CUDA graphs
    label = {"inductor": "inductor" + (', mode "reduce-overhead" (CUDA graphs)' if graphed else ""),
             "cudagraphs": 'backend "cudagraphs" (CUDA graphs of the stock kernels)', "eager": eager}[flag]
    return label, None if flag == "inductor" else flag


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
    shared: dict = field(default_factory=dict)  # models one section builds and a later one reuses

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
        """A row of the section's table, kept for --json."""
        rows.append(kw)
        return kw

    def capped(self, rows: list, what: str, **kw) -> bool:
        """True (and a `skipped` row) once the section's time cap is reached: the loop over sizes goes on to the end."""
        if not self.clock.over():
            return False
        self.row(rows, name=what, skipped="section cap reached", **kw)
        print(f"   {what}: skipped (section cap reached)")
        return True

    def met(self, ok: bool):
        """A target's verdict: ok on CUDA at the base preset, None (not judged) elsewhere."""
        return bool(ok) if self.judged else None


def copy_bandwidth(device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a large device copy (y.copy_(x) over `nbytes`: read + written = 2 x nbytes), best of `repeats`: the
    memory-bound ceiling a decode step can approach."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    ts = rounds({"copy": lambda: y.copy_(x)}, repeats, device, warmup=2)["copy"]
    del x, y
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
    """The positions of a graphed generate's static cache (GPT.generation_cache)."""
    return graphs.static_cache_len(prompt + new, cfg.max_seq_len)


def graphed_vanilla(ctx: Ctx, weights: GPT | None = None) -> GPT:
    """The vanilla GPT of --preset with compile_decode (shared by decode and serve's bare step)."""
    if "graphed" not in ctx.shared:
        g = GPT(ctx.cfg).to(ctx.device, ctx.dtype).eval()
        if weights is not None:
            g.load_state_dict(weights.state_dict())
        ctx.shared["graphed"] = graphs.compile_decode(g, "auto", ctx.backend("decode")[1])
    return ctx.shared["graphed"]


@torch.no_grad()
def section_decode(ctx: Ctx, rows: list):
    cfg, dev, dt, (P, N) = ctx.cfg, ctx.device, ctx.dtype, ctx.sizes.decode
    label, backend = ctx.backend("decode")
    torch.manual_seed(0)
    eager = GPT(cfg).to(dev, dt).eval()
    models = {"ours eager": eager}
    if backend is not False:
        models["ours graphed"] = graphed_vanilla(ctx, eager)
    hf = hf_llama(cfg, dt)
    if hf is not None:
        hf.to(dev)
        models["transformers eager"] = SimpleNamespace(generate=lambda idx, n: hf_generate(hf, idx, n))
    wbytes, elem, S = param_bytes(eager), dt.itemsize, context_len(cfg, P, N)
    print(f"   prompt {P}, {N} new tokens, greedy | weights {wbytes / 1e6:.0f} MB | graphs: {label} | % bw = (weights "
          f"+ the KV a step attends over) / step time / copy bandwidth"
          + ("" if hf is not None else " | transformers not installed: no transformers row"))
    print(f"   {'system':22s} {'batch':>5s} {'ms/step':>22s} {'tok/s':>12s} {'% bw':>6s}  vs transformers")
    for B in ctx.sizes.decode_batches:
        if ctx.capped(rows, f"batch {B}", batch=B):
            continue
        idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=dev)
        t, info = timed_generation(ctx, models, idx, N, ctx.sizes.repeats)
        for name, ts in t.items():
            kv = kv_of(cfg, B, S if name == "ours graphed" else P + N // 2, elem)
            step = med(ts["token"])
            r = ctx.row(rows, name=name, batch=B, ms_per_step=step * 1e3, tok_per_s=B / step,
                        pct_copy_bw=100 * (wbytes + kv) / step / ctx.copy_bw, rounds=info["rounds"],
                        ms_spread=spread(ts["token"], 1e3, ".3f"), warmup_s=info["warmup_s"],
                        warmup_graphs=info["warmup_graphs"],
                        recompiles_after_warmup=info["recompiles"])
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
        print(f"   batch {B}: {info['rounds']} rounds, warm-up {info['warmup_s']:.1f} s ({info['warmup_graphs']} graphs "
              f"compiled), graphs compiled during the timed rounds: {info['recompiles']}")


# ----------------------------------------------------------------------------------------------------------------
# 2. serve


def bare_step(graphed: GPT, batch: int, prompt: int, new: int, steps: int):
    """A bare graphed decode step of `batch` rows on the static cache a graphed generate uses: fn() runs `steps`
    steps (the positions reset each call: the same keys read every time) -> (fn, its cache)."""
    cache = graphed.generation_cache(batch, prompt, new)
    tok = torch.zeros(cache.batch, dtype=torch.long, device=cache.k.device)

    @torch.no_grad()  # as generate: grad mode is part of the compiled step's guards (else a second graph)
    def fn():
        cache.lengths.fill_(prompt)
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            graphed.decode_step(tok, cache)
    return fn


def hf_generate_batch(hf, prompts, new: int, slots: int, device):
    """transformers' continuous batching on these prompts (greedy, `new` tokens each, `slots` requests per batch; the
    manager kept between calls: its CUDA graphs are captured once) -> fn() returning the tokens generated."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc_ = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = dict(max_requests_per_batch=slots)
    if device.type != "cuda":  # sized from GPU memory otherwise
        kw.update(num_blocks=2 * slots + 4, max_batch_tokens=max(256, 2 * slots))
    cb = ContinuousBatchingConfig(**kw)

    def fn():
        out = hf.generate_batch(prompts, generation_config=gc_, continuous_batching_config=cb, persistent_manager=True,
                                progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())
    return fn


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
    graphed = graphed_vanilla(ctx) if backend is not False else None
    print(f"   vanilla {cfg.n_layer} layers vs recursive B=2 (Average tying, no LoRA) | context {S_ctx} per slot | "
          f"requests: prompts {sz.serve_prompt}, {sz.serve_gen} new tokens, greedy, all at once, {sz.serve_waves:g} x "
          f"slots | exits SIMULATED: a max-softmax threshold makes {serve.DEMO_EXIT_RATE:.1%} of prompt tokens leave "
          f"at loop 1 (the oracle share) | steps: {label}")
    for S in sz.serve_slots:
        if ctx.capped(rows, f"slots {S}", slots=S):
            continue
        reqs = synthetic_requests(max(S + 1, round(sz.serve_waves * S)), cfg.vocab_size, sz.serve_prompt,
                                  sz.serve_gen, "all", seed=0)
        thr = bench_serve.calibrate_threshold(rec, reqs, serve.DEMO_EXIT_RATE, rule="softmax")
        servers = [serve.ContinuousServer(van, S, **compile_kw), serve.DepthWiseServer(rec, S, **compile_kw),
                   serve.DepthWiseServer(rec, S, exit_threshold=thr, exit_rule="softmax", **compile_kw)]
        for srv, name in zip(servers, ("continuous", "depth-wise, no exit", "depth-wise + exit")):
            srv.name = name
        bench_serve.check_cache_memory({s.name: s.model for s in servers}, {s.name: s.slots for s in servers},
                                       dt.itemsize, dev, f"bench.py gpu serve at {S} slots")
        t0 = time.perf_counter()
        for srv in servers:  # warm-up: compiles the steps
            srv.run(reqs[:S], clock="step")
        bare = bare_step(graphed, S, P, N, 8) if graphed is not None else None
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
        warm = time.perf_counter() - t0
        before = graphs_compiled()
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
        recompiles = graphs_compiled() - before
        base = summ["continuous"]
        print(f"   slots {S}: {len(reqs)} requests, {n} rounds, warm-up {warm:.1f} s (compiles included), graphs "
              f"compiled during the timed rounds: {recompiles}")
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
                  f"positions")
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
    if hf is not None and hasattr(hf, "destroy_cached_continuous_batching_manager"):
        hf.destroy_cached_continuous_batching_manager()


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
            graphs.compile_decode(m, "auto", backend)
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
        ctx.row(rows, name=f"PLT-{L} / vanilla", batch=B, ratio=med(pv), target=TARGETS["plt"], met=met,
                rounds=info["rounds"], recompiles_after_warmup=info["recompiles"],
                **{f"ms_{v}": med(t[v]["token"]) * 1e3 for v in t})
        ctx.row(rows, name=f"PLT-{L} / loop-{L}", batch=B, ratio=med(pl), target=TARGETS["plt_loop"], met=None,
                rounds=info["rounds"])
        print(f"   batch {B:3d}: ms/token " + ", ".join(f"{v} {spread(t[v]['token'], 1e3, '.3f')}" for v in t))
        verdict = fmt_met(met) if B in (4, 16) else ""
        print(f"              PLT-{L} / vanilla {spread(pv, fmt='.2f')}  target {TARGETS['plt']}{verdict}")
        print(f"              PLT-{L} / loop-{L} {spread(pl, fmt='.2f')}  ({TARGETS['plt_loop']}) | {info['rounds']} "
              f"rounds, warm-up {info['warmup_s']:.1f} s, graphs compiled during the timed rounds: "
              f"{info['recompiles']}")


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
    n_search = min(G - 2, sz.block_search)
    best = {}
    for k, m in models.items():  # the batch search runs the eager steps: one graph per batch would not fit the time
        best[k], found = search_batch(m, P, G, top[k], n_search, dev)
        print(f"   batch search, {k} (eager decode tok/s): " + ", ".join(f"{b}: {v:.0f}" for b, v in found.items())
              + f" -> batch {best[k]}")
    if backend is not False:
        for m in models.values():
            graphs.compile_decode(m, "auto", backend)
    print(f"   block {preset} vs its vanilla counterpart | decode-heavy x{sz.block_scale:g}: prompt {P}, {G} new "
          f"tokens | caches {sz.block_budget_mib} MiB: largest batch vanilla {top['vanilla']}, block {top['block']} | "
          f"timed: {label}")
    systems, batch = block_systems(models, {k: sorted({1, best[k]}) for k in models}, P, G, dev)
    res, info = capped_rounds(systems, sz.repeats, dev, ctx.clock)  # its warm-up compiles the graphed steps
    n, warm, recompiles = info["rounds"], info["warmup_s"], info["recompiles"]
    tput, r_best, r_one = block_ratios(res, batch, best, G)
    for s, ts in res.items():
        ctx.row(rows, name=s.split()[0], batch=batch[s], tok_per_s=med(tput[s]), ms_per_token_step=med(ts) / G * 1e3,
                rounds=n)
        print(f"   {s:14s} {spread(tput[s], fmt='.0f'):>24s} tok/s  {med(ts) / G * 1e3:.3f} ms per token step")
    ok = ctx.met(med(r_best) >= 10)
    ctx.row(rows, name="block / vanilla at the best batches", batch=best["block"], ratio=med(r_best),
            ratio_batch1=med(r_one), target=TARGETS["block"], met=ok, rounds=n, warmup_s=warm,
            recompiles_after_warmup=recompiles)
    print(f"   block / vanilla at the best batches ({best['block']} vs {best['vanilla']}) {spread(r_best, fmt='.2f')}x, "
          f"at batch 1 {spread(r_one, fmt='.2f')}x  target {TARGETS['block']}{fmt_met(ok)} | {n} rounds, warm-up "
          f"{warm:.1f} s, graphs compiled during the timed rounds: {recompiles}")


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
            graphs.compile_decode(m, "auto", backend)
    models = {"decoder-only": gm, "double": dm}
    paper = cfg.gen_layers / cfg.n_layer
    print(f"   double preset {preset}: {cfg.ctx_layers} + {cfg.gen_layers} layers vs {cfg.n_layer} | prompt {P}, {N} "
          f"new tokens | paper: per-token ~ L_dec / L = {paper:.3f} | steps: {label}")
    for B in ctx.sizes.double_batches:
        if ctx.capped(rows, f"batch {B}", batch=B):
            continue
        idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=dev)
        t, info = timed_generation(ctx, models, idx, N, ctx.sizes.repeats)
        per = per_round(t["double"]["token"], t["decoder-only"]["token"])
        ctx.row(rows, name="double / decoder-only per token", batch=B, ratio=med(per), paper=paper,
                target=TARGETS["double"], met=None, rounds=info["rounds"], recompiles_after_warmup=info["recompiles"],
                **{f"ms_{k.replace('-', '_')}": med(v["token"]) * 1e3 for k, v in t.items()})
        print(f"   batch {B:3d}: ms/token " + ", ".join(f"{k} {spread(v['token'], 1e3, '.3f')}" for k, v in t.items())
              + f" -> double / decoder-only {spread(per, fmt='.3f')} (paper ~{paper:.3f}) | {info['rounds']} rounds, "
              f"graphs compiled during the timed rounds: {info['recompiles']}")


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
    res, info = capped_rounds(steps, ctx.sizes.repeats, dev, ctx.clock, warmup=2)  # the warm-up compiles
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


def bench_gpu(args) -> dict:
    only = [s for s in SECTIONS if s in args.only.split(",")]
    check_nanogpt(args.nanogpt)
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    sizes = Sizes() if device.type == "cuda" else CPU_SIZES
    ctx = Ctx(args, device, dtype, replace(sizes, repeats=args.repeats or sizes.repeats), Clock(args.minutes))
    check_gpu_memory(ctx, only)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
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
    write_json(args.json, results)
    for i, name in enumerate(only):
        shares_left = sum(SHARES[s] for s in only[i:])
        cap = ctx.clock.start_section(SHARES[name], shares_left)
        rows, t0 = [], time.perf_counter()
        entry = results["sections"][name] = {"status": "running", "cap_s": cap, "rows": rows}
        print(f"\n== {TITLES[name]} | cap {cap:.0f} s")
        if cap <= 1:
            entry.update(status="skipped", error="no time left of --minutes")
            print(f"section {name} skipped: no time left of --minutes {args.minutes:g}")
            write_json(args.json, results)
            continue
        hard = min(cap * 1.25 + 15, max(ctx.clock.end + RESERVE * 30 * args.minutes - time.perf_counter(), 1))

        def stop(signum, frame, hard=hard):
            raise SectionTimeout(f"stopped at its cap ({hard:.0f} s)")

        old = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, hard)
        try:
            SECTION_FNS[name](ctx, rows)
            entry["status"] = "ok"
        except SectionTimeout as e:
            entry.update(status="stopped", error=str(e))
            print(f"section {name} {e}: the rows above are kept")
        except (KeyboardInterrupt, UsageError):
            raise
        except Exception as e:  # noqa: BLE001 - one section failing leaves the others to run
            entry.update(status="failed", error=one_line(e))
            print(f"section {name} failed: {one_line(e)}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        entry["seconds"] = time.perf_counter() - t0
        if name != "decode":
            ctx.shared.pop("graphed", None)
        free(device)
        write_json(args.json, results)
    summary = [(n, r) for n, e in results["sections"].items() for r in e["rows"] if r.get("met") is not None]
    if not ctx.judged:
        print(f"\n== targets: not judged on {device.type} at preset {args.preset} (they are for one GPU at preset "
              f"base) | {time.perf_counter() - ctx.clock.t0:.0f} s in all")
        return results
    print(f"\n== targets: {sum(r['met'] for _, r in summary)} of {len(summary)} met ("
          + ", ".join(f"{n}/{r['name']}{' b' + str(r['batch']) if 'batch' in r else ''}"
                      f"{' s' + str(r['slots']) if 'slots' in r else ''}: {'met' if r['met'] else 'MISSED'}"
                      for n, r in summary) + f") | {time.perf_counter() - ctx.clock.t0:.0f} s in all")
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
                   help="how graph-safe steps compile: auto (CUDA: inductor reduce-overhead for decode, serve and "
                        "train, cudagraphs for plt, block, double; CPU: dynamo + backend eager), or one for all")
    p.add_argument("--repeats", type=number(int, min=1), default=None,
                   help="interleaved rounds per comparison, at most (default 5 on CUDA, 3 on CPU; fewer when a "
                        "section runs long)")
    p.add_argument("--json", type=path_arg, default=None, help="write every result here after each section")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_gpu)
