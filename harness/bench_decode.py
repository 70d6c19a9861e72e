"""
bench_decode.py -- inference speed of the architectures, each model's own generate() on this machine: vanilla decode
against the machine's read bandwidth and transformers' generate (`python bench.py decode`), PLT-2 against vanilla and
loop-2 (`plt`, the PLT paper's Table 3) and where its matmuls sit on this CPU's roofline (`roofline`), the double
decoder against decoder-only (`double`), all six architectures side by side (`archs`) and the Block Transformer's
throughput at the largest batch of a memory budget (`block`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import block_transformer as bt
import double_decoder as dd
import graphs
import plt
from harness import cpu_tuning
from harness.bench_common import (BANDWIDTH_PROBE, check_bench_memory, check_context, header, hf_generate, hf_twin,
                                  kv_of, med, per_round, ratio, read_bandwidth, rounds, spread)
from harness.cli import UsageError, user_input
from harness.cpu_tuning import LINEAR_PROBE_BYTES, cpu_key, force_linear, linear_report
from harness.device import pick_device, pick_dtype, sync, timeit
from harness.hf import from_gguf, gguf_config, gguf_file, read_gguf
from harness.memory import forward_memory, memory_sum, model_memory, module_bytes, param_bytes
from harness.quantize import int8_weights
from model import GPT, PRESETS, GPTConfig, RotaryEmbedding, sample_next
from recursive import RecursiveConfig, RecursiveGPT

# ----------------------------------------------------------------------------------------------------------------
# Vanilla decode: this repository vs transformers' LlamaForCausalLM.generate, and vs the machine's bandwidth


DECODE_SYSTEMS = ("eager", "compiled", "int8", "transformers", "llama.cpp")  # bench.py decode --systems


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_decode(args):
    """Vanilla decode on this machine, every system in the same interleaved rounds (a warm-up first: the compiles):
    ours eager (cpu_tuning's forms; --linear forces products), ours compiled (graphs.compile_decode: inductor's C++
    backend, frozen weights), ours int8 (harness/quantize.py, compiled), transformers' LlamaForCausalLM.generate with
    the same weights, and llama.cpp on the same GGUF file (--weights smollm2-135m or gguf:PATH; batch 1). Each system
    generates 1 and --new-tokens tokens per round: the decode time per token is the difference over the tokens
    between (the prefill is in both). Beside each: the weight bytes a decode step reads and the share of the
    machine's probed read bandwidth they take at that speed."""
    device = pick_device(args.device)
    P, N = args.prompt_len, args.new_tokens
    systems = args.systems.split(",")
    products = args.linear.split(",")  # "auto" = cpu_tuning's measured choice, else a forced product
    path = None if args.weights == "random" else (gguf_file(args.weights) or Path(args.weights))
    with user_input():
        cfg = GPTConfig.from_preset(args.preset) if path is None else gguf_config(read_gguf(path))
    check_context(P + N, cfg.max_seq_len, f"--prompt-len {P} + --new-tokens {N}")
    top = max(int(b) for b in args.batch.split(","))
    # ours, its weight copies, a compiled copy and its frozen weights, transformers', int8 ones (a quarter or half)
    copies = 2 + 2 * ("compiled" in systems) + ("transformers" in systems) + ("int8" in systems)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        elem = dtype.itemsize
        check_bench_memory(device, f"bench.py decode in {dtype} at --batch {top}", {"bandwidth probe": BANDWIDTH_PROBE},
                           {"models and their weight copies": copies * model_memory(cfg, elem)["total"]},
                           {"prompts": top * P * 8}, {"KV caches of generate": 4 * kv_of(cfg, top, P + N, elem)},
                           forward_memory(cfg, top, P, elem, logits_rows=top), fix="lower --batch or --prompt-len")
    bw = read_bandwidth(device)
    llama = LlamaCpp.start(path, P + N) if "llama.cpp" in systems else None
    try:
        for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
            decode_rows(args, device, dtype, cfg, path, systems, products, bw, llama)
    finally:
        if isinstance(llama, LlamaCpp):
            llama.close()
    force_linear(None)


def decode_rows(args, device, dtype, cfg, path, systems, products, bw, llama):
    """One dtype of bench_decode: the models, the rounds at each batch, the table."""
    P, N = args.prompt_len, args.new_tokens
    torch.manual_seed(0)
    with user_input():
        ours = (GPT(cfg) if path is None else from_gguf(path, dtype=dtype)).to(device=device, dtype=dtype).eval()
    models = {}  # row name -> (fn(idx, n) -> tokens, weight bytes a decode step reads)
    for p in products if "eager" in systems else []:
        models[decode_name(p)] = (partial(forced_generate, ours, p), read_bytes(ours))
    if "compiled" in systems:
        models["ours compiled"] = (graphs.compile_decode(copy.deepcopy(ours)).generate, read_bytes(ours))
    if "int8" in systems:
        q = graphs.compile_decode(int8_weights(copy.deepcopy(ours)))
        models["ours int8 compiled"] = (q.generate, read_bytes(q))
    skipped = []
    if "transformers" in systems:
        try:
            hf = hf_twin(ours).to(dtype).eval()
            models["transformers"] = (partial(hf_generate, hf), read_bytes(ours))
        except ImportError:
            skipped.append("transformers: not installed (pip install transformers)")
    wbytes = read_bytes(ours)
    what = f"preset {args.preset}" if path is None else f"weights {path.name}"
    header("vanilla decode", device, dtype, f"{what}: {cfg.n_layer} layers, d {cfg.n_embd}, {wbytes / 1e6:.0f} MB of "
           f"weights read per token | prompt {P}, {N} new tokens, greedy | median (min..max) of {args.repeats} "
           f"interleaved rounds after 1 warm-up; decode = (generate {N} - generate 1) / {N - 1}")
    print(f"   read bandwidth of this machine (1 GiB streaming sum): {bw / 1e9:.1f} GB/s -> a batch-1 decode step "
          f"cannot take less than {wbytes / bw * 1e3:.1f} ms ({bw / wbytes:.1f} tok/s) in {dtype}")
    for B in [int(b) for b in args.batch.split(",")]:
        idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=device)
        rows = dict(models)
        if isinstance(llama, LlamaCpp) and B == 1:
            rows[f"llama.cpp ({llama.quant})"] = (llama.generate, llama.nbytes)
        elif llama is not None:
            skipped.append(f"llama.cpp: {llama if isinstance(llama, str) else 'batch 1 only'}")
        timed = {f"{name}/{n}": partial(fn, idx, n) for name, (fn, _) in rows.items() for n in (1, N)}
        res = rounds(timed, args.repeats, device)
        step = {name: [positive((a - b) / (N - 1)) for a, b in zip(res[f"{name}/{N}"], res[f"{name}/1"])]
                for name in rows}
        print(f"   batch {B}:")
        for name, (_, nbytes) in rows.items():
            t = med(step[name])
            print(f"      {name:34s} decode {spread(step[name], 1e3, '.2f')} ms/token = {B / t:6.1f} tok/s | "
                  f"{nbytes / 1e6:5.0f} MB/token = {nbytes / t / 1e9:5.1f} GB/s = {nbytes / t / bw:4.0%} of the "
                  f"probe | end to end {spread([B * N / x for x in res[f'{name}/{N}']])} tok/s")
        for name in [r for r in rows if r.startswith("ours")]:
            for peer in [r for r in rows if not r.startswith("ours")]:
                print(f"      {name} / {peer}: decode speed {ratio(step[peer], step[name])}x (per-round ratios)")
        for line in dict.fromkeys(skipped):
            print(f"      skipped {line}")
    if device.type == "cpu" and "eager" in systems:
        print_linear_choices(dtype)


def read_bytes(model) -> int:
    """Bytes a batch-1 decode step of `model` reads from its weights: every product's weight (the int8 weights and
    scales of a converted model) and the norms; the embedding table only as a head tied to it (a lookup reads one
    row); no RoPE table."""
    seen, n = set(), 0
    for mod in model.modules():
        if mod is getattr(model, "tok_emb", None) or isinstance(mod, RotaryEmbedding):
            continue
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                n += t.numel() * t.element_size()
    return n


class LlamaCpp:
    """llama.cpp decoding a GGUF file (node-llama-cpp's prebuilt CPU binary, harness/llama_cpp/decode.mjs) in a node
    process that stays up for the whole benchmark: generate(idx, n) sends the prompt's token ids, it evaluates them
    from an empty context and decodes n tokens greedily, on as many threads as torch uses. start() returns the
    running process, or a one-line reason why there is none (no GGUF file, node or the package not installed, the
    binary failing to load): the benchmark prints it and skips the row."""

    SCRIPT = Path(__file__).parent / "llama_cpp" / "decode.mjs"
    INSTALL = "npm install --prefix harness/llama_cpp --omit=optional @node-llama-cpp/linux-x64@3.22.1"

    @classmethod
    def start(cls, path, positions: int):
        if path is None:
            return "random weights have no GGUF file (--weights smollm2-135m or gguf:PATH)"
        node = shutil.which("node")
        if node is None:
            return "node is not installed (Node.js >= 20, then: " + cls.INSTALL + ")"
        if not (cls.SCRIPT.parent / "node_modules" / "node-llama-cpp").is_dir():
            return "node-llama-cpp is not installed: " + cls.INSTALL
        self = cls()
        self.log = tempfile.TemporaryFile(mode="w+")  # node's stderr: read when it fails to start (never a full pipe)
        self.proc = subprocess.Popen([node, str(cls.SCRIPT), str(path), str(torch.get_num_threads()),
                                      str(-(-positions // 64) * 64)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=cls.SCRIPT.parent)
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.close()
            self.log.seek(0)
            err = self.log.read().strip().splitlines()
            return f"node-llama-cpp did not start: {err[-1] if err else 'no output'}"
        reader = read_gguf(path)
        types = sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) == 2})
        self.quant, self.nbytes = "/".join(types), sum(int(t.n_bytes) for t in reader.tensors)
        return self

    def generate(self, idx, n: int):
        self.proc.stdin.write(json.dumps({"prompt": idx[0].tolist(), "n": n}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if len(out["tokens"]) != n:  # an end-of-generation token stops llama.cpp's evaluation: a shorter run
            raise RuntimeError(f"llama.cpp generated {len(out['tokens'])} of {n} tokens")
        return out

    def close(self):
        with contextlib.suppress(Exception):
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()


def decode_name(product: str) -> str:
    return "ours eager" + ("" if product == "auto" else f" [linear: {product}]")


def forced_generate(model, product: str, idx, new_tokens: int):
    """model.generate with `product` forced in cpu_tuning.linear ("auto": the measured choice)."""
    force_linear(None if product == "auto" else product)
    return model.generate(idx, new_tokens)


def print_linear_choices(dtype):
    """cpu_tuning's linear measurements in this dtype: per (rows, weight shape) the GB/s of weights each candidate
    read and the pick, and the bytes of the weight copies alive (what "xwt" and "dnn" cost in memory)."""
    rows, copies = linear_report()
    print(f"   cpu_tuning's linear product per (rows, out x in) in {dtype} (GB/s of weights read, timed once over "
          f">= {LINEAR_PROBE_BYTES >> 20} MiB of copies; * = picked; cpu {cpu_key()}):")
    for r in rows:
        if r["dtype"] == str(dtype).removeprefix("torch."):
            cands = "  ".join(f"{k} {v:5.1f}{'*' if k == r['pick'] else ' '}" for k, v in r["gbps"].items())
            print(f"      rows {r['rows']:3d}  {r['shape'][0]:6d} x {r['shape'][1]:<6d} {cands}")
    print(f"   weight copies alive (transposed / oneDNN layout): {copies / 1e6:.1f} MB")


# ----------------------------------------------------------------------------------------------------------------
# The architectures against vanilla: per-token decode latency and time to first token, each model's own generate()


@torch.no_grad()
def generation_times(models: dict, idx, new_tokens: int, repeats: int,
                     warmup: int = 1) -> dict[str, dict[str, list[float]]]:
    """models: name -> model. After `warmup` untimed rounds, each round times, for every model in turn, generate(idx,
    n) at n = 1 (the prefill and the first token: TTFT), the midpoint and new_tokens -> name -> {"ttft": [s], "token":
    [s per decode step]}, one entry per round. The decode time of a round is the slope of its times over n (least
    squares over the three); a round whose slope is not positive -- on a loaded machine the noise of a run can exceed
    the decode time it measures -- is NaN, which med and spread leave out: never a negative time."""
    ns = sorted({1, (1 + new_tokens) // 2, new_tokens})
    systems = {f"{name}/{n}": (lambda m=m, n=n: m.generate(idx, n)) for name, m in models.items() for n in ns}
    res = rounds(systems, repeats, idx.device, warmup=warmup)
    return {name: {"ttft": res[f"{name}/1"], "token": [positive(slope(ns, ts)) for ts in
                                                       zip(*(res[f"{name}/{n}"] for n in ns))]}
            for name in models}


def slope(xs, ys) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def positive(t: float) -> float:
    """A time, or NaN where the measurement gave none above zero."""
    return t if t > 0 else math.nan


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_plt(args):
    """Table 3 of the PLT paper on this machine: per-token decode latency of PLT-2 against the vanilla model of the
    same parameters (the N-layer stack run once) and against the sequential loop-2 baseline, at several batches."""
    device = pick_device(args.device)
    n = args.prompt_len + args.new_tokens
    base = dict(plt.PRESETS[args.preset], max_seq_len=n + 8)
    variants = args.variants.split(",")
    top = max(int(b) for b in args.batch.split(","))
    with torch.device("meta"):  # the models' sizes and caches, nothing allocated
        shapes = [plt.PLT(plt.PLTConfig(**{**base, **plt.variant_fields(v)})) for v in variants]
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        check_bench_memory(device, f"bench.py plt in {dtype} at --batch {top}, {n} positions",
                           {"weights": sum(module_bytes(m) for m in shapes) * dtype.itemsize // 4,
                            "KV caches of generate": max(m.kv_cache_bytes(top, n, dtype.itemsize) for m in shapes)},
                           forward_memory(shapes[0].config, top, args.prompt_len, dtype.itemsize, logits_rows=top),
                           fix="lower --batch, --prompt-len or --new-tokens")
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        models = {v: plt.PLT(plt.PLTConfig(**{**base, **plt.variant_fields(v)})).to(device, dtype).eval()
                  for v in variants}
        p = next(iter(models.values()))
        L = base["n_loops"]
        header("PLT decode latency", device, dtype, f"preset {args.preset}: {base['n_layer']} layers x L={L}, d "
               f"{base['n_embd']}, {param_bytes(p) / 1e6:.0f} MB of weights, window {base['window']} | prompt "
               f"{args.prompt_len}, {args.new_tokens} new tokens | median (min..max) of {args.repeats} rounds")
        kv = {v: m.kv_cache_bytes(1, n, torch.finfo(dtype).bits // 8) for v, m in models.items()}
        print("   KV bytes per sequence at the end (Table 1): " + ", ".join(
            f"{v} {b / 1024:.1f} KiB" + (f" ({b / kv['vanilla'] - 1:+.1%} vs vanilla)" if "vanilla" in kv else "")
            for v, b in kv.items()))
        for B in [int(b) for b in args.batch.split(",")]:
            idx = torch.randint(0, base["vocab_size"] - 1, (B, args.prompt_len), device=device)
            t = generation_times(models, idx, args.new_tokens, args.repeats)
            print(f"   batch {B:3d}: ms/token " + ", ".join(f"{v} {spread(t[v]['token'], 1e3, '.2f')}" for v in t))
            if "plt" in t and "vanilla" in t:
                print(f"              PLT-{L} / vanilla {ratio(t['plt']['token'], t['vanilla']['token'])} (paper: "
                      "1.02 at batch 4, 1.04-1.06 at 32-64)")
            if "plt" in t and "loop" in t:
                print(f"              PLT-{L} / loop-{L} {ratio(t['plt']['token'], t['loop']['token'])} (paper: "
                      "0.63 at batch 4, 0.53 at 32-64)")


def linear_shapes(model) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of every linear layer of one block of `model` (q, k, v, o, gate, up, down, or their fused forms) and
    of its head."""
    layer = [tuple(m.weight.shape) for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    return layer, tuple(model.lm_head.weight.shape)


def fastest_ms(dtype, rows: int, shape, repeats: int) -> float:
    """ms of the fastest of cpu_tuning's products (F.linear, mv, mm, x @ W^T, oneDNN) for x (rows, in) @ W^T, W
    (out, in) = shape, weights streamed from memory (cpu_tuning.time_linear_products)."""
    names = cpu_tuning.linear_candidates(dtype, rows)
    return min(cpu_tuning.time_linear_products(dtype, rows, *shape, names, repeats).values()) * 1e3


def matmul_ratios(layer_ms: dict[int, float], head_ms: dict[int, float], n_layer: int, loops: int, batch: int):
    """The matmuls alone of one decode step at `batch` sequences -> (PLT-L / vanilla, loop-L / vanilla). Vanilla runs
    n_layer layers at B rows; PLT-L the same layers once at L*B rows (its loops side by side); loop-L the layers L
    times at B rows. Each runs the head once at B rows."""
    B = batch
    vanilla = n_layer * layer_ms[B] + head_ms[B]
    return ((n_layer * layer_ms[loops * B] + head_ms[B]) / vanilla,
            (loops * n_layer * layer_ms[B] + head_ms[B]) / vanilla)


@torch.no_grad()
def bench_roofline(args):
    """This CPU's roofline and where PLT's decode sits on it: streaming read bandwidth, the speed of a large matmul
    (the compute roof), the ridge between them in rows, the weight products of one layer and of the head at 1..32
    rows, and the PLT-L / vanilla ratio the matmuls alone would give at each batch (what the PLT paper's Table 3
    latency rests on: L loops side by side read each weight once for L times the rows)."""
    device = pick_device("cpu")
    with torch.device("meta"):
        m = plt.PLT(plt.PLTConfig(**plt.PRESETS[args.preset]))
    layer, head = linear_shapes(m)
    N, L = m.config.n_layer, m.config.n_loops
    batches = sorted({int(b) for b in args.batch.split(",")})
    rows = sorted({int(r) for r in args.rows.split(",")} | set(batches) | {L * b for b in batches})
    widest = max(o + i for o, i in [*layer, head])
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        check_bench_memory(device, f"bench.py roofline in {dtype} at {rows[-1]:,} rows",
                           {"bandwidth probe": BANDWIDTH_PROBE, "weight copies of a timing": 3 * LINEAR_PROBE_BYTES,
                            "inputs and outputs of the widest product": rows[-1] * widest * dtype.itemsize},
                           fix="lower --rows or --batch")
    bw = read_bandwidth(device, repeats=args.repeats)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        big = (torch.randn(2048, 768, dtype=dtype), torch.randn(3072, 768, dtype=dtype))
        t = timeit(lambda: F.linear(*big), device, warmup=2, repeats=args.repeats)
        big_flops = 2 * 2048 * 768 * 3072
        peak = big_flops / med(t)
        header("CPU roofline and PLT decode matmuls", device, dtype, f"preset {args.preset}: {N} layers x L={L}, "
               f"layer products {layer}, head {head} | median of {args.repeats} passes per product")
        print(f"   streaming read {bw / 1e9:.1f} GB/s (1 GiB sum); F.linear 2048x768 by 768x3072 {peak / 1e9:.0f} "
              f"GFLOP/s ({spread([big_flops / x / 1e9 for x in t], fmt='.0f')}) -> ridge at "
              f"{peak * dtype.itemsize / (2 * bw):.1f} rows (a weight read once for M rows: 2M FLOP per "
              f"{dtype.itemsize} bytes)")
        layer_ms = {r: sum(fastest_ms(dtype, r, s, args.repeats) for s in layer) for r in rows}
        head_ms = {r: fastest_ms(dtype, r, head, args.repeats) for r in rows}
        lbytes = sum(o * i for o, i in layer) * dtype.itemsize
        print("   rows   layer ms  (GB/s of weights, GFLOP/s)   head ms  (GB/s, GFLOP/s)")
        for r in rows:
            print(f"   {r:4d}  {layer_ms[r]:8.3f}  ({lbytes / layer_ms[r] / 1e6:6.1f}, "
                  f"{2 * r * lbytes / dtype.itemsize / layer_ms[r] / 1e6:6.1f})"
                  f"  {head_ms[r]:8.3f}  ({head[0] * head[1] * dtype.itemsize / head_ms[r] / 1e6:6.1f}, "
                  f"{2 * r * head[0] * head[1] / head_ms[r] / 1e6:6.1f})")
        for B in batches:
            p, lp = matmul_ratios(layer_ms, head_ms, N, L, B)
            print(f"   batch {B:3d}: matmuls alone PLT-{L} / vanilla {p:.2f}, loop-{L} / vanilla {lp:.2f} (paper, "
                  f"whole step: PLT-2 / vanilla 1.02 at batch 4)")


def prefix_prefills(gpt, dm, idx, prefix: int) -> dict:
    """TTFT after a cached shared prefix (section 3.3 item 3), the systems for `rounds`: idx[:, :prefix] is computed
    once, outside the timers (decoder-only: its K/V; double: the context decoder's K/V and the cross K/V); each timed
    call copies that prefix into a pre-allocated cache and runs the rest of the prompt against it, up to the first
    token's logits."""
    B, T = idx.shape
    rows = torch.arange(B, device=idx.device)
    g_prefix, g_work = gpt.new_cache(B, prefix), gpt.new_cache(B, T)
    gpt.prefill(idx[:, :prefix], g_prefix)
    d_prefix, d_work = dm.new_cache(B, prefix, 1, keep_context=True), dm.new_cache(B, T - 1, 1, keep_context=True)
    dm.extend_context(idx[:, :prefix], d_prefix)

    def decoder_only():
        g_work.copy_rows(g_prefix, rows, rows)
        gpt.head(gpt.forward_cached(idx[:, prefix:], g_work)[:, -1:])
        sync(idx.device)

    def double():
        d_work.copy_from(d_prefix)
        dm.prefill(idx[:, prefix:], d_work)
        sync(idx.device)

    return {"decoder-only": decoder_only, "double": double}


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_double(args):
    """The double decoder's serving claims (section 3.3, Appendix A.1) against the decoder-only model of the same
    parameters (ctx + gen layers): time to first token, TTFT after a cached shared prefix, per-token latency (each
    model's own generate(); the double decoder's with --rollover N folds its block into the context every N tokens)
    and KV bytes."""
    device = pick_device(args.device)
    P, N, R = args.prompt_len, args.new_tokens, args.rollover
    prefix = args.shared_prefix if args.shared_prefix is not None else P // 2
    if not 1 <= prefix < P:
        raise UsageError(f"--shared-prefix must be in [1, {P - 1}] (below --prompt-len), got {prefix}" if P > 1 else
                         "--prompt-len 1: the cached-prefix timing needs a prompt of at least 2 tokens")
    over = {"max_seq_len": P + N + 8, **({"vocab_size": args.vocab_size} if args.vocab_size else {})}
    for name in ("ctx_layers", "gen_layers"):
        if getattr(args, name) is not None:
            over.update({name: getattr(args, name), "n_layer": None})
    with user_input():  # layer counts the flags make impossible: one line
        cfg = dd.DoubleConfig(**{**dd.PRESETS[args.preset], **over})
    L = cfg.n_layer
    top = max(int(b) for b in args.batch.split(","))
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:  # from the configs: nothing built yet
        e = dtype.itemsize
        check_bench_memory(device, f"bench.py double in {dtype} at --batch {top}, {P + N} positions",
                           model_memory(cfg, e), model_memory(dd.baseline_config(cfg), e),
                           {"KV caches of generate and of the cached prefix": 2 * (kv_of(cfg, top, P + N, e)
                                                                                   + 2 * kv_of(cfg, top, P, e))},
                           forward_memory(cfg, top, P, e, logits_rows=top),
                           fix="lower --batch, --prompt-len, --new-tokens, --vocab-size or the layers")
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        models = {"decoder-only": GPT(dd.baseline_config(cfg)).to(device, dtype).eval(),
                  "double": dd.DoubleDecoder(cfg).to(device, dtype).eval()}
        gm, dm = models["decoder-only"], models["double"]
        header("double decoder latency", device, dtype, f"preset {args.preset}: {cfg.ctx_layers} + "
               f"{cfg.gen_layers} layers vs {L}, d {cfg.n_embd}, vocab {cfg.vocab_size}, {param_bytes(dm) / 1e6:.0f} "
               f"MB of weights (head {param_bytes(dm.lm_head) / 1e6:.0f} MB) | prompt "
               f"{P}, {N} new tokens, shared prefix {prefix}, rollover {R} | random weights | median (min..max) of "
               f"{args.repeats} rounds")
        floor = param_bytes(dm.gen_blocks, dm.norm, dm.lm_head) / param_bytes(gm)
        print(f"   paper (section 3.3, Appendix A.1), at a 2/3 : 1/3 split: per-token cost and KV memory ~L_dec/L = "
              f"{cfg.gen_layers / L:.3f} of the decoder-only model's (the weight bytes a step reads give "
              f"{floor:.2f}), time to first token ~L_ctx/L = {cfg.ctx_layers / L:.3f}")
        dbytes = torch.finfo(dtype).bits // 8
        for B in [int(b) for b in args.batch.split(",")]:
            idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=device)
            timed = {"decoder-only": gm, "double": SimpleNamespace(generate=partial(dm.generate, rollover=R))}
            t = generation_times(timed, idx, N, args.repeats)
            pre = rounds(prefix_prefills(gm, dm, idx, prefix), args.repeats, device)
            kv = {name: m.kv_cache_bytes(B, P + N, dbytes) for name, m in models.items()}  # Appendix A.1
            dc = dm.generation_cache(B, P, N, rollover=R)  # what generate() allocates
            alloc = {"decoder-only": gm.generation_cache(B, P, N).nbytes(), "double": dc.nbytes() + dc.context_nbytes()}
            print(f"   batch {B:3d}:")
            for name in models:
                print(f"      {name:12s} TTFT {spread(t[name]['ttft'], 1e3, '.2f')} ms | after the cached prefix "
                      f"{spread(pre[name], 1e3, '.2f')} ms | per-token {spread(t[name]['token'], 1e3, '.3f')} ms | "
                      f"KV (A.1) {kv[name] / 2 ** 20:.2f} MiB | allocated caches {alloc[name] / 2 ** 20:.2f} MiB")
            d, v = t["double"], t["decoder-only"]
            print(f"      double / decoder-only: TTFT {ratio(d['ttft'], v['ttft'])} | TTFT after the prefix "
                  f"{ratio(pre['double'], pre['decoder-only'])} | per-token {ratio(d['token'], v['token'])} | "
                  f"KV bytes {kv['double'] / kv['decoder-only']:.3f}")


# ----------------------------------------------------------------------------------------------------------------
# All six architectures side by side at matched non-embedding parameters


def arch_models(preset: str, loops=2, rank=8, max_seq_len=None) -> dict:
    """One model.py preset -> {name: model} at matched non-embedding parameters (random weights): vanilla N layers;
    recursive K = N shared layers looped `loops` times (loops*N effective); relaxed the same + LoRA rank `rank` (a few %
    more); block: N/2 block-decoder + N/2 token-decoder layers (L_B = 4, P = 2); plt: the N-layer stack looped twice
    (CLP + KV sharing + G-SWA); double: round(2N/3) context + the rest generation layers."""
    base = dict(PRESETS[preset], **({"max_seq_len": max_seq_len} if max_seq_len else {}))
    N = base["n_layer"]
    out = {"vanilla": GPT(GPTConfig(**base))}
    out["recursive"] = RecursiveGPT(RecursiveConfig(**{**base, "n_layer": loops * N}, n_loops=loops))
    ranks = {f"lora_rank_{c}": rank for c in ("q", "kv", "o", "mlp")}
    out["relaxed"] = RecursiveGPT(RecursiveConfig(**{**base, "n_layer": loops * N}, n_loops=loops, **ranks))
    shape = bt.halves(**{k: base[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden")},
                        max_seq_len=base["max_seq_len"] - base["max_seq_len"] % 4, vocab_size=base["vocab_size"])
    out["block"] = bt.BlockTransformer(bt.BlockConfig(**shape))
    out["plt"] = plt.PLT(plt.PLTConfig(**base, n_loops=2, window=min(64, base["max_seq_len"])))
    ctx = min(max(round(2 * N / 3), 1), N - 1) if N > 1 else 1
    out["double"] = dd.DoubleDecoder(dd.DoubleConfig(**{k: v for k, v in base.items() if k != "n_layer"},
                                                     ctx_layers=ctx, gen_layers=max(N - ctx, 1)))
    return out


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_archs(args):
    """Every architecture's own generate() at matched non-embedding parameters: time to first token, per-token decode
    latency and KV bytes per sequence, in a prefill-heavy and a decode-heavy setting."""
    device = pick_device(args.device)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        with user_input():  # a --rank above full rank: one line
            models = {k: m.to(device, dtype).eval() for k, m in arch_models(args.preset, rank=args.rank).items()}
        settings_ = [tuple(int(v) for v in s.split("/")) for s in args.settings.split(",")]
        top = max(int(b) for b in args.batch.split(","))
        for P, G in settings_:  # one model generates at a time
            check_context(P + G, min(m.config.max_seq_len for m in models.values()), f"--settings {P}/{G}")
            check_bench_memory(device, f"bench.py archs in {dtype} at --batch {top}, prompt {P} / new {G}",
                               max((memory_sum({"KV caches of generate": m.kv_cache_bytes(top, P + G, dtype.itemsize)},
                                               forward_memory(m.config, top, P, dtype.itemsize, logits_rows=top))
                                    for m in models.values()), key=lambda est: est["total"]),
                               fix="lower --batch or --settings")
        header("architectures side by side", device, dtype, f"preset {args.preset}, random weights | non-embedding "
               "params " + ", ".join(f"{k} {m.num_params() / 1e6:.2f}M" for k, m in models.items())
               + f" | median (min..max) of {args.repeats} interleaved rounds")
        for setting in args.settings.split(","):
            P, G = (int(v) for v in setting.split("/"))
            for B in [int(b) for b in args.batch.split(",")]:
                idx = torch.randint(0, PRESETS[args.preset]["vocab_size"] - 1, (B, P), device=device)
                t = generation_times(models, idx, G, args.repeats)
                print(f"   prompt {P} / new {G}, batch {B}:  (TTFT ms | ms per token | KV KiB per sequence)")
                for name, m in models.items():
                    kv = m.kv_cache_bytes(1, P + G, torch.finfo(dtype).bits // 8) / 1024
                    print(f"      {name:10s} {spread(t[name]['ttft'], 1e3, '.2f'):>22s} | "
                          f"{spread(t[name]['token'], 1e3, '.3f'):>24s} | {kv:8.1f}")


# ----------------------------------------------------------------------------------------------------------------
# Block Transformer vs vanilla: throughput at the largest batch a memory budget allows (Block Transformer, section
# 3.2)

# The paper's two settings (prompt tokens, generated tokens) and its figures for the pair at equal non-embedding
# parameters (Table 2, H100, maximum batch; 1K tokens/s): {preset: {setting: (vanilla, block)}}.
BLOCK_SETTINGS = {"decode-heavy": (128, 2048), "prefill-heavy": (2048, 128)}
PAPER_BLOCK = {"t3-5m": {"decode-heavy": (41.6, 809.5), "prefill-heavy": (10.8, 272.3)},
               "t3-19m": {"decode-heavy": (19.1, 421.4), "prefill-heavy": (6.9, 175.3)},
               "t3-85m": {"decode-heavy": (6.2, 134.7), "prefill-heavy": (2.3, 59.0)},
               "t3-302m": {"decode-heavy": (2.1, 44.1), "prefill-heavy": (0.8, 21.0)}}


def block_lengths(setting: str, scale: float) -> tuple[int, int]:
    """(prompt, generated tokens) of one of the paper's settings (BLOCK_SETTINGS) times `scale`, at least 1 each."""
    return tuple(max(1, round(x * scale)) for x in BLOCK_SETTINGS[setting])


def block_configs(preset: str, vanilla: str | None, max_len: int) -> tuple[bt.BlockConfig, GPTConfig]:
    """The configs of block_pair, their contexts raised to max_len positions (whole blocks) where shorter."""
    cfg = bt.BlockConfig.from_preset(preset)
    max_len = -(-max_len // cfg.block_len) * cfg.block_len
    cfg = bt.BlockConfig.from_preset(preset, max_seq_len=max(max_len, cfg.max_seq_len))
    vcfg = cfg.vanilla_config() if vanilla is None else GPTConfig.from_preset(vanilla)
    vcfg.max_seq_len = max(max_len, vcfg.max_seq_len)
    return cfg, vcfg


def block_pair_memory(preset: str, vanilla: str | None, max_len: int, elem: int) -> list[dict]:
    """What building block_pair's two models allocates (memory.model_memory of each), before they exist."""
    return [model_memory(c, elem) for c in block_configs(preset, vanilla, max_len)]


def block_pair(preset: str, vanilla: str | None, device, dtype, max_len: int):
    """(Block Transformer of `preset`, its vanilla counterpart): the vanilla model with the same non-embedding
    parameters (BlockConfig.vanilla_config, the paper's pairing), or the model.py preset `vanilla`. Random weights."""
    cfg, vcfg = block_configs(preset, vanilla, max_len)
    torch.manual_seed(0)
    return (bt.BlockTransformer(cfg).to(device=device, dtype=dtype).eval(),
            GPT(vcfg).to(device=device, dtype=dtype).eval())


def block_systems(models: dict, batches: dict, P: int, G: int, device, warmup_tokens: int = 0) -> tuple[dict, dict]:
    """The timed systems of the pair: per model and batch B in batches[model], generate(G) of random prompts (B, P)
    -> ({"model B": fn}, {"model B": B}). warmup_tokens > 0: each first generates that many tokens (allocations,
    kernels)."""
    systems, batch = {}, {}
    for k, m in models.items():
        for B in batches[k]:
            idx = torch.randint(0, m.config.vocab_size - 1, (B, P), device=device)
            if warmup_tokens:
                m.generate(idx, warmup_tokens)
            systems[f"{k} {B}"], batch[f"{k} {B}"] = (lambda m=m, idx=idx: m.generate(idx, G)), B
    return systems, batch


def block_ratios(res: dict, batch: dict, best: dict, G: int) -> tuple[dict, list, list]:
    """Rounds of block_systems -> (tokens/s of each system per round, block / vanilla per round at the best batches,
    at batch 1)."""
    tput = {s: [batch[s] * G / t for t in ts] for s, ts in res.items()}
    return (tput, per_round(tput[f"block {best['block']}"], tput[f"vanilla {best['vanilla']}"]),
            per_round(tput["block 1"], tput["vanilla 1"]))


def generation_bytes(model, prompt, new) -> int:
    """Bytes of the caches generate() allocates for ONE sequence (KV caches; linear in the batch)."""
    return model.generation_cache(1, prompt, new).nbytes()


def search_window(P: int, G: int, n_tokens: int) -> tuple[int, int]:
    """(timed decode steps per batch, context they start at) of search_batch: at most n_tokens steps, at the setting's
    mean context P + G // 2 where n untimed and n timed steps still fit the setting's P + G positions."""
    n = min(n_tokens, (G - 1) // 2)
    return n, min(P + G // 2, P + G - 1 - 2 * n)


def warm_window(model, B: int, P: int, G: int, n_tokens: int, device):
    """The start of a decode window of B rows at the setting's mean context (search_window): a prefill of random
    tokens and n decode steps, untimed (every step kind runs once -- a Block Transformer's steps differ within a
    block -- and cpu_tuning measures each new shape's CPU form) -> (cache, the last token, n): room for n more steps."""
    n, ctx = search_window(P, G, n_tokens)
    cache = model.generation_cache(B, ctx, 2 * n + 1)
    tok = sample_next(model.prefill(torch.randint(0, model.config.vocab_size - 1, (B, ctx), device=device), cache))
    for _ in range(n):
        tok = sample_next(model.decode_step(tok, cache))
    return cache, tok, n


def search_batch(model, P, G, top, n_tokens, device, buckets_only: bool = False, stop=None) -> tuple[int, dict]:
    """The batch search: at batch 1, 2, 4, ... and `top` (the largest batch the memory budget allows; buckets_only:
    only the batches a graphed model runs unpadded, graphs.batch_bucket(B) == B), the decode throughput at the
    setting's mean context: warm_window's prefill and n untimed decode steps (cpu_tuning's measurements of new shapes,
    seconds at a large batch, happen before the clock starts), then n timed decode steps (greedy) -> (the batch with
    the most decode tokens/s, {batch: tokens/s}). It only selects the batch (a short run at the start of a long
    generation would hide what a long context costs); the reported throughput is then timed on the full setting.
    stop() (optional), asked before each batch after the first: True ends the search there (a capped run), with the
    batches measured so far."""
    found = {}
    batches = {2 ** i for i in range(top.bit_length())} | {top}
    for B in sorted(b for b in batches if not buckets_only or graphs.batch_bucket(b) == b):
        if found and stop is not None and stop():
            break
        cache, tok, n = warm_window(model, B, P, G, n_tokens, device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = sample_next(model.decode_step(tok, cache))
        sync(device)
        found[B] = B * n / (time.perf_counter() - t0)
    return max(found, key=found.get), found


# operator groups of a decode profile: (name, operators, inclusive time?) -- attention counts with its children (SDPA's
# math fallback copies K/V and runs bmm; cpu_tuning's grouped form is two bmm), the others by their own time. The
# matmuls are the kernels of every CPU product cpu_tuning picks (F.linear, mm, the transposed copy: aten::mm or addmm;
# torch.mv: aten::addmv_; oneDNN's layout: mkldnn::_linear_pointwise), one event per product.
PROFILE_GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::addmv_", "mkldnn::_linear_pointwise"), False),
                  ("attention", ("aten::scaled_dot_product_attention", cpu_tuning.GROUPED_EVENT), True),
                  ("argmax (sampling)", ("aten::argmax",), False))


def profile_groups(events) -> dict[str, dict]:
    """A profile's key_averages -> {group of PROFILE_GROUPS: {"calls", "us" (its time), "flops"}} and "total" (the
    operators' own time, us)."""
    out = {}
    for g, names, incl in PROFILE_GROUPS:
        es = [e for e in events if e.key in names]
        out[g] = {"calls": sum(e.count for e in es), "flops": sum(e.flops for e in es),
                  "us": sum(e.cpu_time_total if incl else e.self_cpu_time_total for e in es)}
    out["total"] = sum(e.self_cpu_time_total for e in events)
    return out


PROFILE_STEPS = 64  # decode steps bench.py block --profile records (16 blocks of the t3-19m pair's L_B 4)


def profile_decode(model, P: int, G: int, batch: int, n_tokens: int, device) -> str:
    """n_tokens decode steps (greedy) of `batch` rows at the setting's mean context under torch.profiler, after the
    same prefill and untimed steps as search_batch (warm_window) -> where a decode step's time goes: matmuls (with
    the GFLOP/s of those the profiler counts flops for: aten::mm and addmm), attention, the argmax of greedy sampling
    and everything else, per token step. A window at the mean context, not the whole generation: the profiler keeps
    every event, and a 2,048-token generation at batch 158 outgrew a 23 GB machine's memory."""
    ctx = search_window(P, G, n_tokens)[1]
    cache, tok, n = warm_window(model, batch, P, G, n_tokens, device)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(n):
            tok = sample_next(model.decode_step(tok, cache))
    events = prof.key_averages()
    groups = profile_groups(events)
    total = groups.pop("total")
    counted = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
    gflops = groups["matmul"]["flops"] / max(counted, 1) / 1e3  # flops per us -> GFLOP/s
    parts = [f"{g} {d['us'] / total:.0%}" + (f" ({gflops:.0f} GFLOP/s)" if g == "matmul" and counted else "")
             for g, d in groups.items()]
    return (f"{n} decode steps at context {ctx}: {total / n / 1e3:.1f} ms of operators per token step: "
            + ", ".join(parts) + f", other {1 - sum(d['us'] for d in groups.values()) / total:.0%}")


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_block(args):
    """Tokens generated per second, prefill included (the paper's throughput), of the Block Transformer and vanilla
    in the paper's decode-heavy and prefill-heavy settings. Per model: the largest batch whose generation caches fit
    --budget-mib (the paper's "maximum batch allowed by memory"), a batch search up to it, then interleaved rounds at
    batch 1 and the best batch; the ratio of the best batches, per round, with the paper's figure beside it."""
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    names = list(BLOCK_SETTINGS) if args.setting == "both" else [args.setting]
    lengths = {n: block_lengths(n, args.scale) for n in names}
    if args.budget_mib is None:
        args.budget_mib = round(2048 * args.scale)
    budget = args.budget_mib * 2 ** 20
    longest = max(p + g for p, g in lengths.values())
    check_bench_memory(device, f"bench.py block in {dtype} at --scale {args.scale:g} ({longest:,} positions) and "
                               f"--budget-mib {args.budget_mib:,}",
                       *block_pair_memory(args.preset, args.vanilla, longest, dtype.itemsize),
                       {"generation caches (--budget-mib, one model at a time)": budget},
                       fix="lower --scale or --budget-mib")
    block, vanilla = block_pair(args.preset, args.vanilla, device, dtype, longest)
    models = {"vanilla": vanilla, "block": block}
    b, v = block.config, vanilla.config
    header("Block Transformer vs vanilla: generation throughput", device, dtype,
           f"block {args.preset} ({b.block_n_layer}+{b.n_layer} layers, d {b.n_embd}, L_B {b.block_len}, "
           f"P {b.prefix_len}, {block.num_params(False) / 1e6:.1f}M params, {param_bytes(block) / 1e6:.0f} MB) vs "
           f"vanilla {args.vanilla or 'counterpart'} ({v.n_layer} layers, d {v.n_embd}, "
           f"{vanilla.num_params(False) / 1e6:.1f}M params, {param_bytes(vanilla) / 1e6:.0f} MB) | non-embedding "
           f"{block.num_params() / 1e6:.1f}M vs {vanilla.num_params() / 1e6:.1f}M | random weights and prompts, "
           f"greedy, no EOS | cache budget {args.budget_mib} MiB | median (min..max) of {args.repeats} interleaved "
           f"rounds")
    for name in names:
        P, G = lengths[name]
        per_seq = {k: generation_bytes(m, P, G) for k, m in models.items()}
        top = {k: budget // n for k, n in per_seq.items()}
        print(f"\n-- {name}: prompt {P}, {G} new tokens | generation caches per sequence: vanilla "
              f"{per_seq['vanilla'] / 2 ** 20:.2f} MiB, block {per_seq['block'] / 2 ** 20:.2f} MiB -> largest batch in "
              f"{args.budget_mib} MiB: vanilla {top['vanilla']}, block {top['block']}")
        if min(top.values()) < 1:
            print("   a model does not fit the budget at batch 1: raise --budget-mib")
            continue
        check_bench_memory(device, f"bench.py block, {name}: the prefill of the largest batch in the budget",
                           max((forward_memory(m.config, top[k], P, dtype.itemsize, logits_rows=top[k])
                                for k, m in models.items()), key=lambda est: est["total"]),
                           {"generation caches (--budget-mib)": budget}, fix="lower --budget-mib")
        n_search = search_window(P, G, args.search_tokens)[0]  # no search below 3 generated tokens
        best = {}
        for k, m in models.items():
            best[k], found = (search_batch(m, P, G, top[k], n_search, device) if n_search > 0 else (top[k], {}))
            if found:
                print(f"   batch search, {k} (decode tok/s at context {search_window(P, G, n_search)[1]}): "
                      + ", ".join(f"{B}: {t:.0f}" for B, t in found.items()) + f" -> batch {best[k]}")
        # each system warmed up by the whole setting, untimed: cpu_tuning measures a new shape's CPU form on its first
        # use (the decode attention's once per key-count bucket), and none of that may fall in a timed round
        systems, batch = block_systems(models, {k: sorted({1, best[k], *[x for x in args.batches if x <= top[k]]})
                                                for k in models}, P, G, device, warmup_tokens=G)
        res = rounds(systems, args.repeats, device, warmup=0)
        tput, at_best, at_one = block_ratios(res, batch, best, G)
        print(f"   {'model':8s} {'batch':>5s} {'caches MiB':>10s} {'ms/token step':>14s} {'tok/s':>26s}")
        for s, ts in res.items():
            k, B = s.split()
            print(f"   {k:8s} {B:>5s} {per_seq[k] * int(B) / 2 ** 20:10.1f} {med(ts) / G * 1e3:14.2f} "
                  f"{spread(tput[s], fmt='.0f'):>26s}")
        paper = PAPER_BLOCK.get(args.preset, {}).get(name) if args.vanilla is None else None
        ref = (f"paper (Table 2, {args.preset} pair, H100, max batch): {paper[1] / paper[0]:.1f}x" if paper else
               "paper: 10-20x at equal perplexity (abstract); no Table 2 pair for this preset")
        print(f"   best batch: vanilla {best['vanilla']}, block {best['block']} -> block / vanilla = "
              f"{spread(at_best, fmt='.2f')}x (per round) | {ref} | at batch 1: {spread(at_one, fmt='.2f')}x")
        if args.profile and G >= 3:
            for k, m in models.items():
                print(f"   profile, {k} batch {best[k]}, {profile_decode(m, P, G, best[k], PROFILE_STEPS, device)}")
