"""
bench_serve.py -- the serving benchmark (`python bench.py serve`): serve.py's servers on the same requests, side by
side -- continuous sequence-wise batching (CSB) of the vanilla model, continuous depth-wise batching of the recursive /
relaxed model without and with early exit, and static batching with --static.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), section 2.4 and 3.8, Appendix K (Tables K.1-K.4: depth-wise batching + early exit 1.4-1.9x CSB,
simulated on an A100 from oracle exits). Here the schedule runs for real: per dtype and loop count B, every server
serves the same requests in --repeats interleaved rounds after a warm-up, and the table prints each system's median
round, the ratios to CSB per round (median and min..max) and the ceiling B / E[loops] of a depth-wise server at equal
slots (a step runs N/B layers; a token needs E[loops] steps).

  * Models: random weights (a vanilla preset and its Average-tied conversion with B = --loops, LoRA rank --lora-rank,
    a random exit gate whose cost is real and whose decisions are calibrated), or checkpoints: --ckpt (a recursive /
    relaxed one, with its real exits), --vanilla-ckpt (a vanilla one, or a pretrained model: hf:DIR, gguf:PATH,
    smollm2-135m; converted without training when there is no --ckpt).
  * Requests (serve_requests.py): synthetic, validation-corpus windows, those windows as chat questions in the model's
    chat template, or a JSONL file; all at once or Poisson arrivals. A bad request gets its own error; the errors are
    counted by reason under the table (and in --json).
  * Exits: the threshold of each exit rule (--rules) is calibrated so that --exit-rate of the prompt tokens leave at
    loop 1 (SIMULATED exits on random weights: the rate measured on a trained checkpoint by `python eval.py exits`),
    or given (--exit-threshold, a comma list: one server per rule and threshold).
  * Metrics (each server's hook is a serve_hooks.Metrics): generated tok/s (all tokens / wall time from the first
    arrival to the last token), loaded tok/s (tokens emitted in the decode steps with every slot busy / those steps'
    time: what a server with a queue sustains), TTFT, per-token latency p50/p99, mean exit loop (1-based), slot
    occupancy, step time, agreement of the greedy text with CSB's and with the no-exit server's, and on CUDA the bytes
    a decode step reads (parameters + KV) per second against the device's peak.
  * Memory: --batch-memory-mb gives each system the slots that fit that many MiB of weights + full-context KV (Table
    K.3/K.4's memory-limited setting: smaller shared weights buy slots); every server's cache is checked against the
    memory available before any is allocated.
  * --profile: after the rounds, one more run of each depth-wise server with the parts of its step timed.

Run:
    python bench.py serve --exit-rate 0.633 --profile       # base shape, B = 2 and 3, fp32 and bf16
    python bench.py serve --ckpt out/relaxed-exit/ckpt.pt --vanilla-ckpt out/vanilla/ckpt.pt --prompts corpus
    python bench.py serve --requests-file reqs.jsonl --ckpt out/relaxed/ckpt.pt --json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import serve
from harness import cpu_tuning
from harness.bench_common import header, json_safe, med, per_round, spread
from harness.checkpoint import load_checkpoint, load_source_model, model_from_checkpoint, tokenizer_from_spec
from harness.cli import (DTYPES, UsageError, available_memory, check_device, check_dtype, check_writable_dir,
                         comma_list, number, one_of, path_arg, seed_arg, temperature_arg, threads_arg, user_input)
from harness.data import Tokenizer
from harness.device import peak_bandwidth, pick_device, pick_dtype
from harness.memory import param_bytes
from harness.serve_hooks import Metrics
from harness.serve_requests import (MAX_REQUESTS, chat_requests, chat_template, corpus_requests, error_counts,
                                    jsonl_requests, parse_range, print_errors, synthetic_requests)
from model import GPT, PRESETS, GPTConfig, kv_bytes
from recursive import EXIT_RULES, RecursiveGPT, from_vanilla
from svd_lora import max_ranks

# ----------------------------------------------------------------------------------------------------------------
# The command


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_serve(args) -> dict:
    """Every (dtype, B) setting: build the models and the requests, set the exits, run the servers -> their rows."""
    check_args(args)
    device = pick_device(args.device)
    out = []
    for dname in args.dtype.split(","):
        dtype = pick_dtype(device, dname)
        for B in loop_counts(args):
            out += serve_setting(args, device, dtype, B)
    if args.json:
        print(json.dumps(json_safe({"serve": out})))
    return {"serve": out}


def loop_counts(args) -> list:
    """--loops of the random-weight models (those that split the preset's layers; none is a UsageError), or [None]:
    a checkpoint's own."""
    if args.ckpt:
        return [None]
    loops = [int(b) for b in str(args.loops).split(",")]
    n_layer = None if args.vanilla_ckpt else GPTConfig.from_preset(args.preset).n_layer
    if n_layer is not None and all(n_layer % B for B in loops):
        raise UsageError(f"--loops {args.loops}: the {n_layer} layers of --preset {args.preset} do not split into "
                         f"{' or '.join(map(str, loops))} loops")
    return loops


def serve_setting(args, device, dtype, B) -> list[dict]:
    built = build_setting(args, device, dtype, B)
    if built is None:
        return []
    van, rec, reqs, rules, thresholds, how = built
    servers, slots = make_servers(args, van, rec, rules, thresholds, dtype, device)
    setting_header(args, device, dtype, van, rec, reqs, slots, rules, thresholds, how, servers[0].compiled)
    for srv in servers:  # warm-up: allocator, first-call overheads, the linear product choice, compiling
        if args.warmup != 0:
            srv.run(reqs[:args.warmup or max(slots.values())], clock="step")
    rounds = {srv.name: [] for srv in servers}
    outputs = {}
    peak = args.peak_bw * 1e9 if args.peak_bw else peak_bandwidth(device)
    for _ in range(args.repeats):
        for srv in servers:
            done = srv.run(reqs)
            rounds[srv.name].append(summarize(srv, done, peak))
            outputs.setdefault(srv.name, {r.rid: r.output for r in done if r.error is None})
    rows = report(args, servers, rounds, outputs, rec.config.n_loops, slots, peak)
    for row in rows:
        row.update(dtype=str(dtype).removeprefix("torch."), loops=rec.config.n_loops)
    if args.profile:  # an eager step's parts (a compiled step is one graph)
        for srv in servers[1:]:
            if isinstance(srv, serve.DepthWiseServer) and not srv.compiled:
                shares = step_shares(srv, reqs)
                machinery = shares["exit score"] + shares["state propagation"]
                print(f"   profile of {srv.name}: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
                      + (f" | exit machinery (score + propagation) {machinery:.1%} of a step (target: <= 10%)"
                         if srv.threshold is not None else ""))
    return rows


def build_setting(args, device, dtype, B):
    """-> (vanilla, recursive, requests, exit rules, thresholds per rule, how they were set), or None (skipped)."""
    source = f"--vanilla-ckpt {args.vanilla_ckpt}" if args.vanilla_ckpt else f"--preset {args.preset}"
    # random weights: the preset's layers are known before anything is built; a source checkpoint's once loaded
    n_layer = GPTConfig.from_preset(args.preset).n_layer if B is not None and not args.vanilla_ckpt else None
    van = rec = None
    if n_layer is None or n_layer % B == 0:
        with user_input():  # a config the flags make impossible (a LoRA rank above full rank, ...): one line
            van, rec, spec = build_models(args, device, dtype, B)
    if rec is None:  # the layers do not split into B loops (build_models: those of --vanilla-ckpt)
        n_layer = van.config.n_layer if van is not None else n_layer
        print(f"\n== serving B={B}: skipped, the {n_layer} layers of {source} do not split into {B} loops")
        return None
    reqs = build_requests(args, van, rec, spec)
    rules = (args.rules.split(",") if args.rules else
             ["gate", "softmax"] if not args.ckpt else ["gate" if rec.exit_gate is not None else "softmax"])
    if "gate" in rules and rec.exit_gate is None:
        raise UsageError("--rules gate needs a checkpoint trained with --exit-gate (--ckpt); this model has no exit "
                         "gate")
    if args.exit_threshold != "auto":
        return van, rec, reqs, rules, {r: [float(t) for t in args.exit_threshold.split(",")] for r in rules}, "given"
    try:
        thr = {r: [calibrate_threshold(rec, reqs, args.exit_rate, rule=r)] for r in rules}
        return van, rec, reqs, rules, thr, f"calibrated: ~{args.exit_rate:.0%} of prompt tokens leave at loop 1"
    except NoValidRequest:  # every request is an error: they are reported below, nothing to calibrate on
        return van, rec, reqs, rules, {r: [] for r in rules}, "no valid request to calibrate on"


def make_servers(args, van, rec, rules, thresholds, dtype, device):
    elem = torch.empty((), dtype=dtype).element_size()
    slots = {"van": args.slots, "rec": args.slots}
    if args.batch_memory_mb:
        slots = {"van": slots_for_memory(van, args.batch_memory_mb, van.config.max_seq_len, elem),
                 "rec": slots_for_memory(rec, args.batch_memory_mb, rec.config.max_seq_len, elem)}
    flag = {"on": True, "off": False, "auto": None}.get(args.compile, device.type == "cuda")  # auto: measured
    compiled = cpu_tuning.compiled_decode_faster(van, slots["van"], flag, keep=False)
    kw = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed, prefill_chunk=args.prefill_chunk,
              compile=compiled)
    servers = [serve.ContinuousServer(van, slots["van"], hook=Metrics(), **kw)]
    servers[0].name = "vanilla CSB"
    if args.static:
        servers.append(serve.ContinuousServer(van, slots["van"], static=True, hook=Metrics(), **kw))
    servers.append(serve.DepthWiseServer(rec, slots["rec"], hook=Metrics(), **kw))
    servers[-1].name = "depth-wise, no exit"
    for rule in rules:
        for t in thresholds[rule]:
            servers.append(serve.DepthWiseServer(rec, slots["rec"], t, rule, hook=Metrics(), **kw))
            servers[-1].name = f"depth-wise + exit ({rule}{'' if args.exit_threshold == 'auto' else f'>={t:g}'})"
    check_cache_memory({s.name: s.model for s in servers}, {s.name: s.slots for s in servers}, elem, device,
                       f"--batch-memory-mb {args.batch_memory_mb:g} (slots {slots['van']:,} vanilla, "
                       f"{slots['rec']:,} depth-wise)" if args.batch_memory_mb else f"--slots {args.slots:,}")
    return servers, slots


def setting_header(args, device, dtype, van, rec, reqs, slots, rules, thresholds, how, compiled: bool):
    """bench_common.header of a (dtype, B) setting (compiled: the servers' steps are), then what its exits are."""
    rc = rec.config
    kind = f"relaxed ranks {rc.lora_ranks}" if rc.relaxed else "recursive"
    thr = "; ".join(f"{r} {','.join(format(t, '.4g') for t in thresholds[r]) or '-'}" for r in rules)
    budget = f" (memory budget {args.batch_memory_mb} MiB)" if args.batch_memory_mb else ""
    header(f"serving B={rc.n_loops}", device, dtype,
           f"vanilla {van.config.n_layer} layers, d {van.config.n_embd}, {param_bytes(van) / 1e6:.0f} MB | {kind} "
           f"B={rc.n_loops} K={rc.n_shared} {param_bytes(rec) / 1e6:.0f} MB | {len(reqs)} requests, arrivals "
           f"{args.arrival}{f' at {args.rate}/s' if args.arrival == 'poisson' else ''} | slots {slots['van']} vanilla, "
           f"{slots['rec']} depth-wise{budget} | steps {'compiled' if compiled else 'eager'} | median (min..max) of "
           f"{args.repeats} interleaved rounds after a warm-up")
    if args.ckpt:
        print(f"   EXITS REAL: --ckpt {args.ckpt}; thresholds {thr} ({how})")
        return
    what = (f"--vanilla-ckpt {args.vanilla_ckpt} converted without training (Average tying"
            + (", SVD LoRA)" if rc.relaxed else ")") if args.vanilla_ckpt else "random weights")
    print(f"   SIMULATED exits: no --ckpt, the depth-wise model is {what}; its exit scores mean nothing, so each "
          f"rule's threshold makes a chosen share of tokens leave: {thr} ({how}; {args.exit_source})")
    if van.num_params() < SMALL_MODEL_PARAMS:
        print(f"   SMALL MODEL ({van.num_params() / 1e6:.2f}M): a decode step here is per-operator overhead, not "
              f"weight reads, so half the layers per step save little and the exit path costs more; the depth-wise "
              f"bargain shows where weights dominate a step (the base preset)")


# Below this many non-embedding parameters the header says that its model is too small to show the bargain: per-operator
# overhead, not weight reads, sets the step of such a model (the tiny preset against the base one: RESULTS.md, Serving).
SMALL_MODEL_PARAMS = 10_000_000


def report(args, servers, rounds, outputs, B, slots, peak) -> list[dict]:
    """The table (each system's median round by tok/s), agreement, errors, and the ratios to CSB per round."""
    rows = []
    for srv in servers:
        rs = rounds[srv.name]
        row = sorted(rs, key=lambda r: r["tok_per_s"])[(len(rs) - 1) // 2]
        rows.append(dict(row, tok_per_s_rounds=[r["tok_per_s"] for r in rs]))
    if args.temperature == 0:  # greedy: what the exits change in the text
        ref_full = outputs.get("depth-wise, no exit", {})
        for row in rows:
            row["agree_vanilla"] = prefix_agreement(outputs[row["system"]], outputs["vanilla CSB"])
            row["agree_full"] = prefix_agreement(outputs[row["system"]], ref_full)
    print_table(rows, SERVE_COLS, "   serving: the same requests through every system (tok lat = per-token latency "
                                  "ms, exit loop 1-based)")
    if peak:
        print(f"   peak memory bandwidth {peak / 1e9:.0f} GB/s; GB/s = (parameter + KV bytes read) / decode step time")
    print_errors(rows)
    base = rounds["vanilla CSB"]
    if not all(b["tok_per_s"] > 0 for b in base):  # no token generated (every request an error): no ratio
        return rows
    for srv, row in zip(servers, rows):
        rs = rounds[srv.name]
        e2e = per_round([r["tok_per_s"] for r in rs], [b["tok_per_s"] for b in base])
        loaded = per_round([r["loaded_tok_per_s"] for r in rs], [b["loaded_tok_per_s"] for b in base])
        row.update(e2e_vs_csb=med(e2e), loaded_vs_csb=med(loaded))
        loops = row["mean_exit_loop"]
        ceiling = (f"ceiling {B / loops * slots['rec'] / slots['van']:.2f}x"
                   if isinstance(srv, serve.DepthWiseServer) and loops == loops else "")
        print(f"   {srv.name:30s} step {spread([r['step_ms'] for r in rs])} ms  E[loops] {loops:.2f}  end-to-end "
              f"{spread([r['tok_per_s'] for r in rs], fmt='.0f')} tok/s {spread(e2e, fmt='.2f')}x  loaded "
              f"{spread([r['loaded_tok_per_s'] for r in rs], fmt='.0f')} tok/s {spread(loaded, fmt='.2f')}x  {ceiling}")
    print("   paper (Table K.2/K.4, simulated on an A100 from oracle exits, blocks only): depth-wise + early exit "
          "1.4-1.9x continuous sequence-wise batching; measured batched early exit on GPUs (Miao et al. 2024): "
          "<= 1.25x")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Models and requests


def build_models(args, device, dtype, B):
    """-> (vanilla GPT, recursive/relaxed model, tokenizer spec or None). Checkpoints by path (the vanilla one may be a
    pretrained model: hf:DIR, gguf:PATH, smollm2-135m), or random weights: a vanilla preset and its Average + SVD
    conversion (B loops, --lora-rank, a random exit gate). The tokenizer is the checkpoints' own (they must agree)."""
    vanilla = rec = v_spec = r_spec = None
    if args.vanilla_ckpt:
        vanilla, _, v_spec = load_source_model(args.vanilla_ckpt)
        if type(vanilla) is not GPT:
            raise UsageError(f"--vanilla-ckpt {args.vanilla_ckpt} is not a vanilla checkpoint (it holds "
                             f"{type(vanilla).__name__})")
    if args.ckpt:
        ck = load_checkpoint(args.ckpt)
        rec, r_spec = model_from_checkpoint(ck), ck["tokenizer"]
        if not isinstance(rec, RecursiveGPT):
            raise UsageError(f"--ckpt {args.ckpt} is not a recursive/relaxed checkpoint (it holds "
                             f"{type(rec).__name__})")
        if rec.config.sharing != "cycle":
            raise UsageError(f"--ckpt {args.ckpt} shares its layers {rec.config.sharing}: depth-wise batching and "
                             f"its exits need sharing='cycle' (a loop's output is an exit only there)")
    if v_spec and r_spec and v_spec != r_spec:
        raise UsageError(f"--ckpt {args.ckpt} and --vanilla-ckpt {args.vanilla_ckpt} use different tokenizers "
                         f"({r_spec} vs {v_spec}): they must serve the same token ids")
    torch.manual_seed(args.seed)
    if vanilla is None:
        base = dict(PRESETS[args.preset], vocab_size=args.vocab_size)
        if rec is not None:  # a vanilla model of the recursive one's shape (random weights)
            base = {k: getattr(rec.config, k) for k in base}
        elif not args.requests_file and args.prompts == "synthetic":  # what the requests need, within the preset's
            need = sum(parse_range(x)[1] for x in (args.prompt_len, args.gen_len)) + 8
            base["max_seq_len"] = min(need, base["max_seq_len"])
        vanilla = GPT(GPTConfig(**base))
    if rec is None and vanilla.config.n_layer % B:  # a source whose layers do not split into B loops: skipped
        return vanilla, None, None
    if rec is None:
        rank, top = 64 if args.lora_rank is None else args.lora_rank, max_ranks(vanilla.config)
        # the default rank is capped at each component's full rank (a small source); a rank typed is taken as typed
        ranks = {f"lora_rank_{c}": rank if args.lora_rank is not None else min(rank, top[c]) for c in top} if rank \
            else {}
        rec = from_vanilla(vanilla, n_loops=B, init="average", lora_init="svd", log=lambda *_: None, exit_gate=True,
                           **ranks)
        with torch.no_grad():  # a random gate: its cost is real, its decisions are calibrated to the exit rate
            rec.exit_gate.weight.normal_(0, vanilla.config.n_embd ** -0.5)
    for m in (vanilla, rec):  # --context: the KV positions a slot holds (a pretrained model's 8k is far too many)
        m.config.max_seq_len = min(m.config.max_seq_len, args.context or m.config.max_seq_len)
    return (vanilla.to(device=device, dtype=dtype).eval(), rec.to(device=device, dtype=dtype).eval(),
            r_spec or v_spec)


def build_requests(args, vanilla, rec, spec):
    """The requests: a JSONL file, corpus windows, chat questions about them, or synthetic ones."""
    if vanilla.config.vocab_size != rec.config.vocab_size:
        raise UsageError(f"the vanilla model has {vanilla.config.vocab_size} vocabulary rows and the recursive one "
                         f"{rec.config.vocab_size}: they must serve the same token ids")
    if not args.requests_file:  # ours: every request must fit the context of both models
        ctx = min(vanilla.config.max_seq_len, rec.config.max_seq_len)
        P, G = parse_range(args.prompt_len)[1], parse_range(args.gen_len)[1]
        if P + G > ctx:
            raise UsageError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len}: a request of {P} prompt + "
                             f"{G} new tokens exceeds the context of {ctx} positions; lower them")
    tok = None
    if args.requests_file or args.prompts != "synthetic":
        with user_input():
            tok = tokenizer_from_spec(spec) if spec else Tokenizer.from_args(
                None if vanilla.config.vocab_size >= 100256 else 4096, None)
    if spec and spec.get("kind") == "task" and not args.requests_file and args.prompts == "corpus":
        raise UsageError(f"--prompts corpus: the model's tokenizer is that of the synthetic task {spec.get('name')!r}, "
                         f"which reads no text; serve --prompts synthetic, or a --requests-file of prompt_ids")
    common = (args.prompt_len, args.gen_len, args.arrival, args.rate, args.seed)
    if args.requests_file:
        reqs = jsonl_requests(args.requests_file, tok, parse_range(args.gen_len)[1], args.arrival, args.rate,
                              args.seed)
        if not reqs:
            raise UsageError(f"--requests-file {args.requests_file} holds no request (no non-empty line)")
        return reqs
    if args.prompts == "corpus":
        return corpus_requests(args.requests, tok, args.data, args.cache_dir, *common)
    if args.prompts == "chat":
        with user_input():
            template = chat_template(spec)
        return chat_requests(args.requests, tok, template, args.data, args.cache_dir, *common,
                             source=spec.get("path", "the model"))
    return synthetic_requests(args.requests, vanilla.config.vocab_size, *common)


class NoValidRequest(ValueError):
    pass


# The share of tokens serve.py's demo and bench.py gpu make leave at loop 1: the oracle share of a trained tiny relaxed
# checkpoint (RESULTS.md, Exit rules).
SIMULATED_EXIT_RATE = 0.633


@torch.no_grad()
def exit_threshold_for(model: RecursiveGPT, prompts, exit_rate: float = 0.5, rule: str | None = None) -> float:
    """A threshold at which about `exit_rate` of the tokens leave after the first loop under the exit rule (default
    config.exit_rule), measured on the tokens of `prompts` (lists of token ids): loop-0 states do not depend on the
    deeper loops, so this is what decoding sees at loop 0. Random weights give flat softmaxes where a fixed 0.9 would
    never exit: serve.py's demo, bench.py serve and the figures simulate exits at a chosen share with it."""
    scores = []
    for p in prompts:
        idx = torch.tensor([p], device=model.lm_head.weight.device)
        x, h = model.embed(idx)[0][:, None], model.loop_hidden(idx)[0][0][:, None]  # (T, 1, C): loop 0's in/out
        loops = torch.zeros(len(p), dtype=torch.long, device=idx.device)
        scores.append(model.exit_score(x, h, loops, rule or model.config.exit_rule)[0].cpu())
    return float(torch.quantile(torch.cat(scores), 1.0 - exit_rate))


def calibrate_threshold(model: RecursiveGPT, reqs, exit_rate=0.5, n=8, rule=None) -> float:
    """exit_threshold_for on the prompts of the first n valid requests."""
    cfg = model.config
    prompts = [r.prompt for r in reqs if r.problem(cfg.vocab_size, cfg.max_seq_len) is None][:n]
    if not prompts:
        raise NoValidRequest("no valid request to calibrate the exit threshold on")
    return exit_threshold_for(model, prompts, exit_rate, rule)


# ----------------------------------------------------------------------------------------------------------------
# Memory: slots per budget, and the caches against what the device has


def slots_for_memory(model, budget_mb, max_len, elem) -> int:
    """Slots that fit in budget_mb of parameters + KV cache (one full-context row per slot)."""
    per_slot = model.kv_cache_bytes(1, max_len, elem)
    left = budget_mb * 2 ** 20 - param_bytes(model)
    if left < per_slot:
        raise UsageError(f"--batch-memory-mb {budget_mb} does not hold the parameters and one slot of "
                         f"{type(model).__name__} ({(param_bytes(model) + per_slot) / 2 ** 20:.1f} MiB)")
    return int(left // per_slot)


def check_cache_memory(models: dict, slots: dict, elem: int, device, flag: str):
    """Before any cache is allocated: the KV caches of the servers (one full-context row per slot each, every server
    keeping its own) against the memory available; too much is one UsageError with both figures. models/slots:
    {server name: model / slots}."""
    caches = {name: m.kv_cache_bytes(slots[name], m.config.max_seq_len, elem) for name, m in models.items()}
    need = sum(caches.values())
    avail, source = available_memory(device)
    if avail is not None and need > avail:
        parts = ", ".join(f"{name} {b / 1e9:.3g} GB" for name, b in caches.items())
        raise UsageError(f"{flag}: the servers' KV caches need {need / 1e9:.3g} GB ({need:,} bytes: {parts}), but "
                         f"{device} has {avail / 1e9:.3g} GB ({avail:,} bytes) available ({source}); lower it")


# ----------------------------------------------------------------------------------------------------------------
# Metrics


def prefix_agreement(out: dict, ref: dict) -> float:
    """Mean over requests of the share of the generated tokens before the first one that differs from `ref`'s
    (request id -> token ids): 1.0 = the same greedy text. After a first difference the two continue from different
    contexts, so later positions are not compared."""
    shares = []
    for rid, toks in out.items():
        if rid in ref and toks:
            n = next((i for i, (a, b) in enumerate(zip(toks, ref[rid])) if a != b), min(len(toks), len(ref[rid])))
            shares.append(n / len(toks))
    return sum(shares) / len(shares) if shares else float("nan")


def _pct(xs, q):
    if not xs:
        return float("nan")
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q))


def step_bytes(server) -> int:
    """Bytes a server's decode steps read: the weights of a step (vanilla: all layers and the head; depth-wise: the
    shared block and the head) each step, and K/V of every key read (its Metrics' kv_read) in the layers a step
    runs."""
    m, c = server.model, server.cfg
    layers = c.n_shared if isinstance(m, RecursiveGPT) else c.n_layer
    kv = kv_bytes(layers, 1, server.hook.kv_read, c.n_kv_head, c.hd, server.cache.k.element_size())
    return server.n_steps * param_bytes(m.blocks, m.norm, m.lm_head) + kv


def summarize(server, reqs, peak_bw=None) -> dict:
    """The row of a server's run of `reqs` (the requests it returned), from the requests' records and the server's
    hook, a serve_hooks.Metrics."""
    m = server.hook
    ok = [r for r in reqs if r.error is None]
    n_tok = sum(len(r.output) for r in ok)
    wall = m.t_end - min((r.t_arrive for r in reqs if r.t_arrive), default=m.t_start)
    ttft = [r.t_first - r.t_arrive for r in ok if r.t_first is not None]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    exits = [e + 1 for r in ok for e in r.exits[1:] if e is not None]  # decode tokens (the first is the prefill's)
    d = dict(system=server.name, slots=server.slots, requests=len(reqs), errors=len(reqs) - len(ok),
             tokens=n_tok, wall_s=wall, tok_per_s=n_tok / wall if wall > 0 else float("nan"),
             ttft_ms_p50=1e3 * _pct(ttft, 0.5), ttft_ms_p99=1e3 * _pct(ttft, 0.99),
             tpot_ms_p50=1e3 * _pct(gaps, 0.5), tpot_ms_p99=1e3 * _pct(gaps, 0.99),
             mean_exit_loop=sum(exits) / len(exits) if exits else float("nan"),
             occupancy=m.occupancy / max(server.n_steps, 1), steps=server.n_steps,
             step_ms=1e3 * m.step_time / max(server.n_steps, 1),
             loaded_tok_per_s=m.full_tokens / m.full_time if m.full_time > 0 else float("nan"),
             errors_by_reason=error_counts(reqs), request_errors={r.rid: r.error for r in reqs if r.error})
    if server.device.type == "cuda" and m.step_time > 0:
        read = step_bytes(server) / m.step_time  # bytes/s
        d["bandwidth_GBs"] = read / 1e9
        if peak_bw:
            d["bandwidth_pct_peak"] = 100 * read / peak_bw
    return d


def print_table(rows: list[dict], cols: list[tuple[str, str, str]], title: str):
    """cols: (key, header, format)."""
    print(f"\n{title}")
    widths = [max(len(h), 10) for _, h, _ in cols]
    widths[0] = max(widths[0], max((len(str(r.get(cols[0][0], ""))) for r in rows), default=0))
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(cols, widths))))
    for r in rows:
        cells = []
        for i, ((k, _, f), w) in enumerate(zip(cols, widths)):
            v = r.get(k)
            s = "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)
            cells.append(s.rjust(w) if i else s.ljust(w))
        print("  ".join(cells))


SERVE_COLS = [("system", "system", ""), ("slots", "slots", "d"), ("errors", "errors", "d"), ("tokens", "tokens", "d"),
              ("tok_per_s", "tok/s", ".1f"), ("ttft_ms_p50", "TTFT p50 ms", ".1f"),
              ("ttft_ms_p99", "TTFT p99 ms", ".1f"),
              ("tpot_ms_p50", "tok lat p50", ".2f"), ("tpot_ms_p99", "tok lat p99", ".2f"),
              ("mean_exit_loop", "exit loop", ".2f"), ("agree_vanilla", "= vanilla", ".1%"),
              ("agree_full", "= no exit", ".1%"), ("occupancy", "occupancy", ".2f"), ("steps", "steps", "d"),
              ("step_ms", "step ms", ".2f"), ("loaded_tok_per_s", "loaded tok/s", ".1f"),
              ("bandwidth_GBs", "GB/s", ".0f"),
              ("bandwidth_pct_peak", "% peak", ".1f")]


# ----------------------------------------------------------------------------------------------------------------
# --profile: where a depth-wise step's time goes. The parts of RecursiveGPT.exit_pass (and the server's sampler) are
# timed from outside, on the instances, for one more run after the timed rounds; shares are of the decode steps' time.
STEP_PARTS = (("loop_step", "shared block"), ("exit_score", "exit score"), ("propagate", "state propagation"),
              ("exit_logits", "head on leaving rows"), ("sample", "sampling"))


def step_shares(srv, reqs) -> dict[str, float]:
    """Run srv (built with a serve_hooks.Metrics hook) once with its step's parts timed -> {part: share of the decode
    steps' time}. Only calls made inside srv.step count (admission also samples, outside the steps), and a part called
    by another part is not counted again; host-side wall time, the CPU runs every op synchronously (an eager step: a
    compiled one is one graph). The instances are left as they were."""
    spent = dict.fromkeys([label for _, label in STEP_PARTS], 0.0)
    depth = [0]  # 1 inside srv.step, 2 inside one of its parts

    def timed(fn, label):
        def run(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if depth[0] == 2 and label is not None:
                    spent[label] += time.perf_counter() - t
                depth[0] -= 1
        return run

    targets = [(srv, "step", None)] + [(srv if name == "sample" else srv.model, name, label)
                                       for name, label in STEP_PARTS]
    before = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in targets]
    for owner, name, label in targets:
        setattr(owner, name, timed(getattr(owner, name), label))
    try:
        srv.run(reqs, clock="step")
    finally:
        for owner, name, old in before:
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
    shares = {label: t / srv.hook.step_time for label, t in spent.items()}
    shares["the rest (state updates, bookkeeping)"] = 1 - sum(shares.values())
    return shares


# ----------------------------------------------------------------------------------------------------------------
# Command line (bench.py's `serve` subcommand)


def length_range(text: str) -> str:
    """--prompt-len / --gen-len: 'a:b' or 'a' with 1 <= a <= b (kept as text for parse_range)."""
    try:
        lo, hi = parse_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected 'a:b' or 'a' with integers 1 <= a <= b, got {text!r}"
                                         + (f" ({e})" if "range" in str(e) else "")) from None
    if lo < 1:
        raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {text!r}")
    return text


def threshold(text: str) -> str:
    """--exit-threshold: 'auto' or a comma list of probabilities in (0, 1] (one depth-wise server each)."""
    if text == "auto":
        return text
    if "auto" in text.split(","):
        raise argparse.ArgumentTypeError(f"'auto' calibrates one threshold: give it alone, not in a list ({text!r})")
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            v = math.nan
        if not 0.0 < v <= 1.0:
            raise argparse.ArgumentTypeError(f"expected 'auto' or probabilities in (0, 1], got {part!r}")
    return text


def request_count(text: str) -> int:
    """--requests: an integer in [1, MAX_REQUESTS]; '1e8' is read as the integer it writes (and refused by the bound)."""
    try:
        v = float(text)
        text = str(int(v)) if v.is_integer() else text
    except (ValueError, OverflowError):
        pass
    return number(int, min=1, max=MAX_REQUESTS)(text)


def add_args(p):
    """The flags of `python bench.py serve` (p: its subparser)."""
    pos, nonneg = number(int, min=1), number(int, min=0)
    g = p.add_argument_group("machine and models")
    g.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
    g.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    g.add_argument("--dtype", type=comma_list(one_of(DTYPES)), default="float32,bfloat16",
                   help="comma list of dtypes")
    g.add_argument("--preset", default="base", choices=sorted(PRESETS), help="preset of the random-weight models "
                   "(default base: 125M, where weight reads dominate a decode step)")
    g.add_argument("--loops", type=comma_list(number(int, min=2)), default="2,3",
                   help="comma list of B (loops of the random-weight depth-wise model)")
    g.add_argument("--lora-rank", type=nonneg, default=None,
                   help="relaxed model's LoRA rank (0 = recursive; default 64, capped at full rank)")
    g.add_argument("--vocab-size", type=number(int, min=2), default=4160,
                   help="vocabulary of the random-weight models (default: this repository's tokenizer)")
    g.add_argument("--ckpt", type=path_arg, default=None,
                   help="recursive/relaxed checkpoint (train.py) for the depth-wise servers: real exits")
    g.add_argument("--vanilla-ckpt", type=path_arg, default=None,
                   help="vanilla checkpoint for the vanilla servers, or a pretrained model: hf:DIR, gguf:PATH, "
                        "smollm2-135m")
    g.add_argument("--context", type=pos, default=None,
                   help="KV positions per slot (default: the model's context; cap a pretrained model's 8k with it)")
    g.add_argument("--compile", nargs="?", const="on", default=None, choices=["on", "off", "auto"],
                   help="compiled decode steps: on, off, or auto (on a CPU: where measured faster, "
                        "cpu_tuning.compiled_decode_faster); default: on CUDA only")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="eager decode steps")
    g = p.add_argument_group("requests")
    g.add_argument("--requests", type=request_count, default=48, help=f"requests (at most {MAX_REQUESTS:,})")
    g.add_argument("--prompts", default="synthetic", choices=["synthetic", "corpus", "chat"],
                   help="prompt token source: random ids, validation corpus windows, or those windows as a chat "
                        "question in the tokenizer's chat template (a GGUF file's)")
    g.add_argument("--requests-file", type=path_arg, default=None, help="JSONL requests (overrides --prompts)")
    g.add_argument("--data", type=path_arg, default="stdlib", help="--prompts corpus: train.py corpus")
    g.add_argument("--cache-dir", type=path_arg, default="data_cache", help="--prompts corpus: token cache directory")
    g.add_argument("--prompt-len", type=length_range, default="64", help="prompt tokens, 'a:b' uniform or 'a'")
    g.add_argument("--gen-len", type=length_range, default="64", help="max_new_tokens, 'a:b' uniform or 'a'")
    g.add_argument("--arrival", default="all", choices=["all", "poisson"], help="arrival process")
    g.add_argument("--rate", type=number(float, above=0), default=20.0, help="Poisson arrival rate (requests/s)")
    g = p.add_argument_group("serving")
    g.add_argument("--slots", type=pos, default=16, help="batch slots of every server")
    g.add_argument("--batch-memory-mb", type=number(float, above=0), default=None,
                   help="instead of --slots: each system gets the slots that fit this many MiB of weights + KV")
    g.add_argument("--static", action="store_true", help="also the vanilla static-batching server")
    g.add_argument("--prefill-chunk", type=pos, default=256, help="prompt tokens per row prefilled per iteration")
    g.add_argument("--rules", type=comma_list(one_of(list(EXIT_RULES))), default=None,
                   help="comma list of exit rules: gate, saturation, softmax (default: gate,softmax; with --ckpt its "
                        "gate if it has one, else softmax)")
    g.add_argument("--exit-threshold", type=threshold, default="auto",
                   help="'auto' (calibrated to --exit-rate) or a comma list of thresholds in (0, 1] (one server each)")
    g.add_argument("--exit-rate", type=number(float, above=0, max=1), default=0.5,
                   help="--exit-threshold auto: share of tokens exiting at loop 1, in (0, 1]")
    g.add_argument("--exit-source", default="--exit-rate as given", help="where the exit rate was measured")
    g.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=pos, default=None)
    g.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")
    g.add_argument("--warmup", type=nonneg, default=None, help="requests of the untimed warm-up run of each server "
                   "(default: as many as the slots; 0: none)")
    g.add_argument("--peak-bw", type=number(float, above=0), default=None,
                   help="device peak bandwidth in GB/s (default: known GPUs)")
    g.add_argument("--profile", action="store_true", help="after the timed rounds, one more run of each depth-wise "
                   "server with the parts of its step timed: the share of the shared block, the exit score, state "
                   "propagation, the head, sampling and the rest")
    g.add_argument("--json", action="store_true", help="print one JSON line with every result at the end")
    g.add_argument("--seed", type=seed_arg, default=0, help="random weights, requests and each request's sampler")
    p.set_defaults(fn=bench_serve)


def check_args(args):
    """Flag combinations that cannot work, found before any model is built (lengths against a context: later)."""
    check_device(args.device)
    check_dtype(args.device, args.dtype)
    if args.prompts in ("corpus", "chat") and not args.requests_file:  # the corpus is tokenized into it
        check_writable_dir(Path(args.cache_dir), "--cache-dir")
