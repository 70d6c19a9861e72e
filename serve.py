"""
serve.py -- a small serving loop: continuous depth-wise batching with early exit for Recursive Transformers, and the
vanilla baselines (static and continuous sequence-wise batching) on the same requests.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), section 2.4 (Continuous Depth-wise Batching and Early-Exiting, Figure 3), section 3.8 and
Appendix K (Tables K.1-K.4). The paper only *simulates* the throughput of depth-wise batching from measured per-token
times and oracle exit trajectories; here the schedule runs for real, with confidence-based exits and state
propagation.

The servers come first, then what runs them:
  * Servers, all with a fixed number of batch slots and a pre-allocated KV cache with one row per slot:
      - StaticServer (vanilla, static batching): waits until the batch is empty, takes up to `slots` arrived
        requests, prefills them together and decodes (GPT.decode_step) until the longest is done.
      - ContinuousServer (vanilla, continuous sequence-wise batching, Orca/vLLM): every step is ONE GPT.decode_step
        over all slots (per-row KVCache lengths = positions); a finished request frees its slot at once and the next
        arrived request is prefilled into it. Idle slots run along with a dummy token (static batch shape).
      - DepthWiseServer (recursive / relaxed, continuous depth-wise batching, Figure 3): each slot holds a request's
        position, current loop and hidden state; its per-loop KV caches are the slot's row of one KVCache with
        B*K layers (cache layer loop*K + k). A step runs the shared block ONCE over all active slots, each at its own
        loop (RecursiveGPT.loop_step: per-row LoRA index through kernels.multi_lora, per-row cache writes at
        (loop, slot, position), per-row attention lengths from the positional mask). Afterwards a row exits when it
        is at the last loop or, with a threshold, when its exit score reaches it (RecursiveGPT.exit_pass, the one
        exit rule of generate too: max softmax, the learned exit gate or saturation); an early exit fills the deeper
        loops' caches of that token by state propagation (RecursiveGPT.propagate). An exited row emits its token and
        starts the next token at loop 0 in the same slot; a finished request frees the slot, refilled at once by the
        queue. Other rows just move to the next loop. With threshold None it is "depth-wise batching without early
        exit". The slots' state (position, loop, hidden state) lives in tensors and every step updates all rows at
        once: no per-row tensor work, one host transfer.
    Prefill of newly admitted requests is a SEPARATE batched pass (the model's own prefill on a temporary cache of
    the admitted group, right-padded, copied into the slots' rows); it is not chunked, so a long prompt stalls the
    decode steps of that iteration (its time shows up in the other requests' per-token latency).
  * Requests (serve_requests.py): synthetic, corpus windows or a JSONL file; a bad request gets an error of its own
    and the others are served; the summary counts the errors by reason under the table, and --json gives every
    system's `request_errors` {request id: reason, naming the file:line} and `errors_by_reason`.
  * Sampling: greedy, or sampled with ONE seeded torch.Generator per request (`request_generator(seed, rid)`), so the
    output of a request does not depend on the schedule, and equals model.generate(prompt, n, generator=that one).
  * Metrics: generated tok/s (all generated tokens / wall time from the first arrival to the last token), loaded
    tok/s (tokens emitted in the decode steps that had every slot busy / those steps' time: what a server with a
    queue sustains; end to end, the drain at the end weighs in: a slot whose requests happen to exit less finishes
    last, and the others idle meanwhile), time to first token (from arrival), per-token latency p50/p99 (gaps
    between a request's tokens), mean exit loop (1-based), slot occupancy (active slots / slots per decode step)
    and, on CUDA, achieved memory bandwidth (parameter bytes + KV bytes read per decode step) / step time against
    the device's peak.
  * The command: build the models and the requests, calibrate the exits, run every server (serve_compare). Flags
    are checked before anything runs: an impossible value or combination (e.g. --slots 0, --prompt-len 10:5, prompt
    + gen lengths beyond the context, more than MAX_REQUESTS requests, Poisson arrivals spread beyond MAX_ARRIVAL_S),
    a corrupt --ckpt, a missing file or a directory, and KV caches the memory cannot hold (checked before any is
    allocated) are one line `error: ...` on stderr and exit code 2. On a CPU the command runs with cpu_tuning's
    measured forms switched on.
The speed claims of the four papers, measured on this machine at memory-bound sizes, are in bench.py (`python
bench.py serve` runs these servers at the `base` shape; `python bench.py archs` is the six architectures side by side).

Costs to know when reading the numbers: a step whose rows sit at different loops gathers each row's cache layer
(LayerCache.read), a copy a paged/ragged attention kernel would avoid; state propagation costs one norm and the k/v
projections per skipped layer; under the 'softmax' exit rule the head runs on every active row each step (its score
is the head's output), under 'gate' and 'saturation' only on the rows that leave.

Run:
    python serve.py                                   # CPU demo, tiny random models: the serving table
    python serve.py --json                            # the same, one JSON line at the end
    python serve.py --arrival poisson --rate 50 --requests 200
    python serve.py --ckpt out/relaxed/ckpt.pt --vanilla-ckpt out/vanilla/ckpt.pt --prompts corpus --exit-threshold 0.9
    python serve.py --requests-file reqs.jsonl --ckpt out/relaxed/ckpt.pt
    python serve.py --preset base --dtype bfloat16 --requests 64 --slots 16 --prompt-len 64 --gen-len 128 \\
        --batch-memory-mb 2048                                    # depth-wise vs continuous at equal batch memory
    python -m pytest -q tests/test_serve.py
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import cpu_tuning
from checkpoint import load_checkpoint, load_source_model, model_from_checkpoint, tokenizer_from_spec
from cli import (DTYPES, ArgumentParser, UsageError, available_memory, check_device, check_dtype, check_writable_dir,
                 number, path_arg, run_cli, seed_arg, temperature_arg, user_input)
from data import Tokenizer
from model import GPT, PRESETS, GPTConfig, param_bytes, peak_bandwidth, pick_device, pick_dtype, sample_next, sync
from recursive import RecursiveGPT, from_vanilla
from serve_requests import (MAX_REQUESTS, Request, chat_requests, chat_template, check_request, corpus_requests,
                            error_counts, jsonl_requests, parse_range, print_errors, request_generator,
                            request_problem, synthetic_requests)

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in requirements.txt
    tqdm = None


# ----------------------------------------------------------------------------------------------------------------
# Servers


class Server:
    """The loop shared by every server: arrivals -> admission (validation, batched prefill) -> decode steps.

    Subclasses give free_slots(), admit(requests) and step(); emit() records a token. clock='wall' reads arrivals as
    seconds (sleeping while nothing has arrived); clock='step' reads them as decode steps (deterministic schedules
    for tests).
    """

    name = "server"

    def __init__(self, model, slots: int, temperature=0.0, top_k=None, seed=0, eos_id=None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots = model, slots
        self.temperature, self.top_k, self.seed, self.eos_id = temperature, top_k, seed, eos_id
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.cfg = model.config

    # -- bookkeeping ---------------------------------------------------------------------------------------------

    def sample(self, logits, reqs) -> torch.Tensor:
        """logits (b, V) -> one token per request (b,) on the device: greedy in one argmax, sampled with each
        request's own generator (so a request's tokens do not depend on the schedule). THE sampler of every server."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return torch.cat([sample_next(logits[i:i + 1], self.temperature, self.top_k, r.gen) for i, r in
                          enumerate(reqs)])

    def emit(self, r: Request, tok: int, exit_loop: int) -> bool:
        """Record a generated token; True when the request is finished."""
        now = time.perf_counter()
        r.output.append(tok)
        r.exits.append(exit_loop)
        r.token_times.append(now)
        if r.t_first is None:
            r.t_first = now
        if len(r.output) >= r.max_new_tokens or (self.eos_id is not None and tok == self.eos_id):
            r.finished, r.t_done = True, now
            self.n_done += 1
            return True
        return False

    def batched_prefill(self, reqs, max_len=None):
        """Right-pad the prompts -> (logits (b, V), temporary cache, lengths (b,)) from the model's own prefill."""
        T = max(len(r.prompt) for r in reqs)
        idx = torch.zeros(len(reqs), T, dtype=torch.long)
        for i, r in enumerate(reqs):
            idx[i, :len(r.prompt)] = torch.tensor(r.prompt)
        lengths = torch.tensor([len(r.prompt) for r in reqs], device=self.device)
        tmp = self.model.new_cache(len(reqs), max_len or T)
        logits = self.model.prefill(idx.to(self.device), tmp, lengths)
        return logits, tmp, lengths

    def record_step(self, seconds, active, nbytes, emitted):
        """One decode step: its time, active slots, bytes read and tokens emitted. Steps with every slot busy are
        also summed apart: the loaded server's throughput, free of the tail where the last requests drain."""
        self.n_steps += 1
        self.step_time += seconds
        self.occupancy += active / self.slots
        self.bytes += nbytes
        if active == self.slots:
            self.full_time += seconds
            self.full_tokens += emitted

    # -- the loop ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, requests, clock="wall", progress=False) -> list[Request]:
        """Serve fresh copies of `requests`; returns them with outputs, exits, times and errors."""
        bad = next((r for r in requests if not 0 <= r.arrival < math.inf), None)  # NaN, inf, < 0: it never arrives
        if bad is not None:
            raise ValueError(f"request {bad.rid}: arrival {bad.arrival} is not a time >= 0")
        reqs = sorted((r.fresh() for r in requests), key=lambda r: (r.arrival, r.rid))
        for r in reqs:
            r.gen = request_generator(self.seed, r.rid, self.device) if self.temperature > 0 else None
        self.n_done, self.n_steps, self.step_time, self.occupancy, self.bytes = 0, 0, 0.0, 0.0, 0
        self.full_time, self.full_tokens = 0.0, 0
        self.reset()
        bar = tqdm(total=len(reqs), desc=self.name, leave=False, file=sys.stderr) if progress and tqdm else None
        head = seen = 0  # next request to admit / to stamp with its arrival time
        tick, t0 = 0.0, time.perf_counter()
        self.t_start = t0
        now = (lambda: time.perf_counter() - t0) if clock == "wall" else (lambda: tick)
        while head < len(reqs) or self.busy():
            t = now()
            while seen < len(reqs) and reqs[seen].arrival <= t:
                reqs[seen].t_arrive = t0 + reqs[seen].arrival if clock == "wall" else time.perf_counter()
                seen += 1
            admit = []
            while head < seen and len(admit) < self.free_slots():
                r = reqs[head]
                head += 1
                problem = request_problem(r, self.cfg.vocab_size, self.cfg.max_seq_len)
                if problem:
                    r.error_kind, r.error = problem
                    if r.source and r.source.rsplit(":", 1)[0] not in r.error:
                        r.error = f"{r.source}: {r.error}"
                    r.t_done = time.perf_counter()
                    self.n_done += 1
                else:
                    admit.append(r)
            if admit:
                self.admit(admit)
            if self.busy():
                self.step()
                tick += 1
            elif head < len(reqs) and head == seen:  # idle until the next arrival
                if clock == "wall":
                    time.sleep(max(0.0, min(reqs[head].arrival - now(), 0.05)))
                else:
                    tick = max(tick, reqs[head].arrival)
            if bar is not None and bar.n != self.n_done:
                bar.update(self.n_done - bar.n)
        sync(self.device)
        self.t_end = time.perf_counter()
        if bar is not None:
            bar.close()
        return sorted(reqs, key=lambda r: r.rid)


class SlotServer(Server):
    """The slot bookkeeping of the continuous servers, written once: a cache with one row per slot, `req[s]` the
    request in slot s (None = free), admission = one batched prefill of the arrived requests, their first tokens
    emitted, the unfinished ones placed in free slots (their prompt K/V copied into the slots' cache rows). A
    subclass gives reset_state() (its per-slot tensors), start(slots, toks, lengths) (what a placed request needs to
    decode on) and step()."""

    prefill_exit = None  # the exit loop recorded for the token the prefill produces

    def reset(self):
        self.cache = self.model.new_cache(self.slots)
        self.req = [None] * self.slots
        self.reset_state()

    def free_slots(self):
        return sum(r is None for r in self.req)

    def busy(self):
        return any(r is not None for r in self.req)

    def admit(self, reqs):
        logits, tmp, lengths = self.batched_prefill(reqs)
        toks = self.sample(logits, reqs)
        free = [s for s, r in enumerate(self.req) if r is None]
        keep, slots = [], []
        for i, (r, t) in enumerate(zip(reqs, toks.tolist())):
            if not self.emit(r, t, self.prefill_exit):  # a request of one token is done after its prefill
                keep.append(i)
                slots.append(free.pop(0))
                self.req[slots[-1]] = r
        if keep:
            self.cache.copy_rows(tmp, keep, slots)  # K/V and lengths of the prompts, all layers, one copy
            self.start(slots, toks[keep], lengths[keep])


class ContinuousServer(SlotServer):
    """Vanilla GPT, continuous sequence-wise batching: one GPT.decode_step over all slots per step."""

    name = "vanilla continuous"

    def reset_state(self):
        self.tok = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # the token each slot feeds next
        self.step_params = param_bytes(self.model.blocks, self.model.norm, self.model.lm_head)
        self.kv_tok = kv_token_bytes(self.cfg, self.cache.k.element_size()) * self.cfg.n_layer

    def start(self, slots, toks, lengths):
        self.tok[slots] = toks

    def step(self):
        t0 = time.perf_counter()
        slots = [s for s, r in enumerate(self.req) if r is not None]
        idle = torch.tensor([s for s, r in enumerate(self.req) if r is None], dtype=torch.long, device=self.device)
        self.cache.lengths[idle] = 0  # idle rows decode a dummy token at position 0 of their own row
        self.tok[idle] = 0
        kv_len = int(self.cache.lengths.max()) + 1
        logits = self.model.decode_step(self.tok, self.cache)  # (slots, V): one step over every slot
        toks = self.sample(logits[slots], [self.req[s] for s in slots])
        self.tok[slots] = toks
        for s, t in zip(slots, toks.tolist()):
            if self.emit(self.req[s], t, None):
                self.req[s] = None
        sync(self.device)
        self.record_step(time.perf_counter() - t0, len(slots), self.step_params + self.slots * kv_len * self.kv_tok,
                         len(slots))


class StaticServer(ContinuousServer):  # its own admission: a batch cache sized to the batch
    """Vanilla GPT, static batching: a new batch starts only when the whole previous batch is done."""

    name = "vanilla static"

    def free_slots(self):
        return 0 if self.busy() else self.slots

    def admit(self, reqs):  # the batch's own cache, sized to its longest request (the model's prefill path)
        need = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        logits, self.cache, _ = self.batched_prefill(reqs, need)
        self.req = list(reqs)
        self.tok = self.sample(logits, reqs)
        for r, t in zip(reqs, self.tok.tolist()):
            self.emit(r, t, None)

    def busy(self):
        return any(r is not None and not r.done for r in self.req)

    def step(self):  # every row of the batch decodes, finished ones included (the waste of static batching)
        t0 = time.perf_counter()
        kv_len = int(self.cache.lengths.max()) + 1
        logits = self.model.decode_step(self.tok, self.cache)
        live = [i for i, r in enumerate(self.req) if not r.done]
        new = self.sample(logits[live], [self.req[i] for i in live])
        for i, t in zip(live, new.tolist()):
            self.emit(self.req[i], t, None)
        done = [i for i, r in enumerate(self.req) if r.done]
        self.cache.lengths[done] -= 1  # finished rows hold their position (and rewrite it): no cache overflow
        self.tok[live] = new  # done rows: any token
        sync(self.device)
        self.record_step(time.perf_counter() - t0, len(live),
                         self.step_params + len(self.req) * kv_len * self.kv_tok, len(live))

    def reset(self):
        super().reset()
        self.req = []


class DepthWiseServer(SlotServer):
    """Recursive / relaxed model, continuous depth-wise batching (Figure 3) with optional confidence early exit.

    The state of every slot lives in tensors -- position, loop and hidden state of the token in flight -- and a step
    updates all of them at once: one pass of the shared block over the active slots (each at its own loop), one
    head over them, one exit decision, one state propagation for the early exits (a few projections per skipped
    loop, all exiting rows together), one embedding of the next tokens, three masked writes. The only per-row Python
    is the bookkeeping of emitted tokens (list appends), after ONE transfer of (exit, token, loop) to the host.
    """

    def __init__(self, model: RecursiveGPT, slots, exit_threshold=None, exit_rule=None, **kw):
        super().__init__(model, slots, **kw)
        self.threshold, self.rule = exit_threshold, exit_rule or model.config.exit_rule
        self.name = "depth-wise" + (f" {self.rule}>={exit_threshold:.3g}" if exit_threshold is not None else
                                    " no exit")

    @property
    def prefill_exit(self):  # prompt tokens never exit early: the prefill runs all loops
        return self.cfg.n_loops - 1

    def reset_state(self):
        cfg = self.cfg
        self.all_slots = torch.arange(self.slots, device=self.device)
        self.pos = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # position of the token in flight
        self.loop = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # its current loop
        self.h = torch.zeros(self.slots, 1, cfg.n_embd, dtype=self.dtype, device=self.device)  # its hidden state
        self.block_bytes = param_bytes(self.model.blocks)
        self.head_bytes = param_bytes(self.model.norm, self.model.lm_head)
        self.kv_tok = kv_token_bytes(cfg, self.cache.k.element_size()) * cfg.n_shared

    def start(self, slots, toks, lengths):
        """Slots (list) begin token toks (b,) at positions lengths (b,): loop 0, hidden state = its embedding."""
        idx = torch.tensor(slots, device=self.device)
        self.pos[idx] = lengths
        self.loop[idx] = 0
        self.h[idx] = self.model.embed(toks[:, None]).to(self.dtype)

    def step(self):
        t0 = time.perf_counter()
        m = self.model
        slots = [s for s, r in enumerate(self.req) if r is not None]
        full = len(slots) == self.slots
        active = self.all_slots if full else torch.tensor(slots, device=self.device)
        loops, pos = self.loop[active], self.pos[active]  # (b,), (b,)
        kv_len = int(pos.max()) + 1
        # ONE pass of the shared block over every active slot, each at its own loop (per-row LoRA through
        # kernels.multi_lora, per-row cache layers loop * K + k; all rows at one loop: plain matmuls), then the exit
        # rule of RecursiveGPT.exit_pass: who leaves, their state propagation, the head on the leaving rows only.
        uniform = bool((loops == loops[0]).all())
        h, leave, logits = m.exit_pass(self.h[active], int(loops[0]) if uniform else loops, pos[:, None],
                                       self.cache, rows=None if full else active, kv_len=kv_len,
                                       threshold=self.threshold, rule=self.rule)
        out = leave.nonzero().squeeze(1)  # (n,) rows that emit a token
        toks = torch.zeros(len(slots), dtype=torch.long, device=self.device)
        if out.numel():
            toks[out] = self.sample(logits, [self.req[slots[i]] for i in out.tolist()])
        # every slot's next state at once: leaving rows start their next token at loop 0, the others go deeper
        self.h[active] = torch.where(leave[:, None, None], m.embed(toks[:, None]).to(self.dtype), h)
        self.loop[active] = torch.where(leave, torch.zeros_like(loops), loops + 1)
        self.pos[active] = pos + leave.long()
        for i, (gone, tok, loop) in enumerate(torch.stack([leave.long(), toks, loops]).t().tolist()):
            if gone and self.emit(self.req[slots[i]], tok, loop):
                self.req[slots[i]] = None  # free: the queue refills it before the next step
        sync(self.device)
        self.record_step(time.perf_counter() - t0, len(slots),
                         self.block_bytes + self.head_bytes + len(slots) * kv_len * self.kv_tok, int(out.numel()))


# ----------------------------------------------------------------------------------------------------------------
# Bytes moved per decode step (the memory roofline; the peaks of known cards are model.PEAK)


def kv_token_bytes(cfg, elem: int) -> int:
    """K and V of one token in one layer."""
    return 2 * cfg.n_kv_head * cfg.hd * elem


# ----------------------------------------------------------------------------------------------------------------
# Sequential reference (one request at a time, the model's own generate) and the early-exit calibration


@torch.no_grad()
def sequential_generate(model, r: Request, temperature=0.0, top_k=None, seed=0, exit_threshold=None, exit_rule=None):
    """What a request should produce: model.generate on it alone (recursive: with the same exit rule)."""
    p = model.lm_head.weight
    idx = torch.tensor([r.prompt], device=p.device)
    gen = request_generator(seed, r.rid, p.device) if temperature > 0 else None
    if isinstance(model, RecursiveGPT):
        out, exits = model.generate(idx, r.max_new_tokens, temperature, top_k, gen, exit_threshold=exit_threshold,
                                    return_exits=True, exit_rule=exit_rule)
        return out[0, len(r.prompt):].tolist(), exits[0].tolist()
    return model.generate(idx, r.max_new_tokens, temperature, top_k, gen)[0, len(r.prompt):].tolist(), None


class NoValidRequest(ValueError):
    pass


@torch.no_grad()
def calibrate_threshold(model: RecursiveGPT, reqs, exit_rate=0.5, n=8, rule=None) -> float:
    """A threshold at which about `exit_rate` of the tokens leave after the first loop under the exit rule (default
    the model's), measured on the prompts of the first n valid requests (loop-0 states do not depend on deeper loops,
    so this is what decoding sees at loop 0). Random weights give flat softmaxes: a fixed 0.9 would never exit."""
    cfg = model.config
    rule = rule or cfg.exit_rule
    confs = []
    for r in reqs:
        if check_request(r, cfg.vocab_size, cfg.max_seq_len) is None:
            idx = torch.tensor([r.prompt], device=model.lm_head.weight.device)
            x, h = model.embed(idx)[0][:, None], model.loop_hidden(idx)[0][0][:, None]  # (T, 1, C): loop 0's in/out
            score, _ = model.exit_score(x, h, torch.zeros(len(r.prompt), dtype=torch.long, device=idx.device), rule)
            confs.append(score.cpu())
            if len(confs) == n:
                break
    if not confs:
        raise NoValidRequest("no valid request to calibrate the exit threshold on")
    return float(torch.quantile(torch.cat(confs), 1.0 - exit_rate))


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
    t = torch.tensor(xs, dtype=torch.float64)
    return float(torch.quantile(t, q))


def summarize(server: Server, reqs, peak_bw=None) -> dict:
    ok = [r for r in reqs if r.error is None]
    n_tok = sum(len(r.output) for r in ok)
    wall = server.t_end - min((r.t_arrive for r in reqs if r.t_arrive), default=server.t_start)
    ttft = [r.t_first - r.t_arrive for r in ok if r.t_first is not None]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    exits = [e + 1 for r in ok for e in r.exits[1:] if e is not None]  # decode tokens (the first comes from the prefill)
    d = dict(system=server.name, slots=server.slots, requests=len(reqs), errors=len(reqs) - len(ok),
             tokens=n_tok, wall_s=wall, tok_per_s=n_tok / wall if wall > 0 else float("nan"),
             ttft_ms_p50=1e3 * _pct(ttft, 0.5), ttft_ms_p99=1e3 * _pct(ttft, 0.99),
             tpot_ms_p50=1e3 * _pct(gaps, 0.5), tpot_ms_p99=1e3 * _pct(gaps, 0.99),
             mean_exit_loop=sum(exits) / len(exits) if exits else float("nan"),
             occupancy=server.occupancy / max(server.n_steps, 1), steps=server.n_steps,
             step_ms=1e3 * server.step_time / max(server.n_steps, 1),
             loaded_tok_per_s=server.full_tokens / server.full_time if server.full_time > 0 else float("nan"),
             errors_by_reason=error_counts(reqs), request_errors={r.rid: r.error for r in reqs if r.error})
    if server.device.type == "cuda" and server.step_time > 0:
        d["bandwidth_GBs"] = server.bytes / server.step_time / 1e9
        if peak_bw:
            d["bandwidth_pct_peak"] = 100 * server.bytes / server.step_time / peak_bw
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
              ("tok_per_s", "tok/s", ".1f"), ("ttft_ms_p50", "TTFT p50 ms", ".1f"), ("ttft_ms_p99", "TTFT p99 ms", ".1f"),
              ("tpot_ms_p50", "tok lat p50", ".2f"), ("tpot_ms_p99", "tok lat p99", ".2f"),
              ("mean_exit_loop", "exit loop", ".2f"), ("agree_vanilla", "= vanilla", ".1%"),
              ("agree_full", "= no exit", ".1%"), ("occupancy", "occupancy", ".2f"), ("steps", "steps", "d"),
              ("step_ms", "step ms", ".2f"), ("loaded_tok_per_s", "loaded tok/s", ".1f"), ("bandwidth_GBs", "GB/s", ".0f"),
              ("bandwidth_pct_peak", "% peak", ".1f")]


# ----------------------------------------------------------------------------------------------------------------
# Models of the serving comparison


def build_serving_models(args, device, dtype):
    """-> (vanilla GPT, recursive/relaxed model, tokenizer spec or None). Checkpoints by path (the vanilla one may be
    a pretrained model: hf:DIR, gguf:PATH, smollm2-135m), or random weights: a vanilla preset and its Average + SVD
    relaxed conversion (B = --loops, ranks of the relaxed preset unless --lora-rank). The tokenizer is the
    checkpoints' own (they must agree); random weights have none."""
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
    if v_spec and r_spec and v_spec != r_spec:
        raise UsageError(f"--ckpt {args.ckpt} and --vanilla-ckpt {args.vanilla_ckpt} use different tokenizers "
                         f"({r_spec} vs {v_spec}): they must serve the same token ids")
    if vanilla is None:
        base = dict(PRESETS[args.preset])
        if rec is not None:  # a vanilla model of the recursive one's shape (random weights)
            base = {k: getattr(rec.config, k) for k in base}
        torch.manual_seed(args.seed)
        vanilla = GPT(GPTConfig(**base))
    if rec is None:
        rank = args.lora_rank
        ranks = {f"lora_rank_{c}": rank for c in ("q", "kv", "o", "mlp")} if rank > 0 else {}
        rec = from_vanilla(vanilla, n_loops=args.loops, init="average", lora_init="svd", log=lambda *_: None,
                           **ranks)
    for m in (vanilla, rec):  # --context: the KV positions a slot holds (a pretrained model's 8k is far too many)
        m.config.max_seq_len = min(m.config.max_seq_len, args.context or m.config.max_seq_len)
    return (vanilla.to(device=device, dtype=dtype).eval(), rec.to(device=device, dtype=dtype).eval(),
            r_spec or v_spec)


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
    keeping its own: the vanilla static and continuous servers, one or two depth-wise ones) plus one prefill's
    temporary cache of an admitted group (at most as large as the largest) against the memory available; too much is
    one UsageError with both figures. models/slots: {server name: model / slots}."""
    caches = {name: m.kv_cache_bytes(slots[name], m.config.max_seq_len, elem) for name, m in models.items()}
    need = sum(caches.values()) + max(caches.values())
    avail, source = available_memory(device)
    if avail is not None and need > avail:
        parts = ", ".join(f"{name} {b / 1e9:.3g} GB" for name, b in caches.items())
        raise UsageError(f"{flag}: the servers' KV caches need {need / 1e9:.3g} GB ({need:,} bytes: {parts}, and one "
                         f"prefill's temporary cache), but {device} has {avail / 1e9:.3g} GB ({avail:,} bytes) "
                         f"available ({source}); lower it")


def enable_compile(model, device):
    """--compile: torch.compile each block (dynamic shapes: the batch and kv_len change every step). Off on CPU."""
    if device.type == "cpu":
        print("--compile ignored on CPU")
        return
    for block in model.blocks:
        block.compile(dynamic=True)


def serve_compare(args, device, dtype, requests=None) -> list[dict]:
    """serve.py's comparison: build the models and the requests, calibrate the exits, run every server -> its rows."""
    vanilla, rec, requests = build_comparison(args, device, dtype, requests)
    rule, thr, how = calibrate_exits(args, rec, requests)
    return run_comparison(args, device, dtype, vanilla, rec, requests, rule, thr, how)


def build_comparison(args, device, dtype, requests=None):
    """The two models (checkpoints or random weights; torch.compile'd with --compile) and the requests (`requests`
    when given, else a JSONL file, corpus windows or synthetic ones) -> (vanilla, rec, requests)."""
    with user_input():  # a config the flags make impossible (a LoRA rank above full rank, ...): one line
        vanilla, rec, spec = build_serving_models(args, device, dtype)
    if args.compile:
        enable_compile(vanilla, device)
        enable_compile(rec, device)
    if requests is not None:
        return vanilla, rec, requests
    check_lengths_fit(args, vanilla, rec)
    tok = None
    if args.requests_file or args.prompts != "synthetic":
        with user_input():
            tok = tokenizer_from_spec(spec) if spec else Tokenizer.from_args(
                None if vanilla.config.vocab_size >= 100256 else 4096, None)
    if spec and spec.get("kind") == "task" and not args.requests_file and args.prompts == "corpus":
        raise UsageError(f"--prompts corpus: the model's tokenizer is that of the synthetic task {spec.get('name')!r}, "
                         f"which reads no text; serve --prompts synthetic, or a --requests-file of prompt_ids")
    if args.requests_file:
        requests = jsonl_requests(args.requests_file, tok, parse_range(args.gen_len)[1], args.arrival, args.rate,
                                  args.seed)
        if not requests:
            raise UsageError(f"--requests-file {args.requests_file} holds no request (no non-empty line)")
    elif args.prompts == "corpus":
        requests = corpus_requests(args.requests, tok, args.data, args.cache_dir, args.prompt_len, args.gen_len,
                                   args.arrival, args.rate, args.seed)
    elif args.prompts == "chat":
        with user_input():
            template = chat_template(spec)
        requests = chat_requests(args.requests, tok, template, args.data, args.cache_dir, args.prompt_len,
                                 args.gen_len, args.arrival, args.rate, args.seed,
                                 source=spec.get("path", "the model"))
    else:
        requests = synthetic_requests(args.requests, vanilla.config.vocab_size, args.prompt_len, args.gen_len,
                                      args.arrival, args.rate, args.seed)
    return vanilla, rec, requests


def calibrate_exits(args, rec, requests) -> tuple[str, list[float], str]:
    """The exit rule (--exit-rule, else the learned gate when the model has one, else softmax) and the thresholds
    (given, or 'auto': calibrated so that --exit-rate of the prompt tokens leave after loop 1) -> (rule, thresholds,
    empty when no request is valid to calibrate on, how they were set)."""
    rule = args.exit_rule or ("gate" if rec.exit_gate is not None else "softmax")
    if rule == "gate" and rec.exit_gate is None:
        raise UsageError("--exit-rule gate needs a checkpoint trained with --exit-gate (--ckpt); this model has "
                         "no exit gate")
    given = args.exit_threshold.split(",")
    if "auto" not in given:
        return rule, [float(t) for t in given], "given"
    try:
        thr = calibrate_threshold(rec, requests, args.exit_rate, rule=rule)
        return rule, [thr], f"auto: ~{args.exit_rate:.0%} of prompt tokens leave after loop 1"
    except NoValidRequest:  # every request is an error: they are reported below, nothing to calibrate on
        return rule, [], "auto: no valid request to calibrate on"


def run_comparison(args, device, dtype, vanilla, rec, requests, rule, thr, how) -> list[dict]:
    """The servers (vanilla static and continuous, depth-wise without and with early exit) on `--slots` each or the
    slots of --batch-memory-mb, their caches checked against the memory first; every server serves the same requests
    after an untimed warm-up -> one summary row per server, printed as the serving table."""
    elem = torch.empty((), dtype=dtype).element_size()
    slots = {"vanilla": args.slots, "rec": args.slots}
    if args.batch_memory_mb:
        slots = {"vanilla": slots_for_memory(vanilla, args.batch_memory_mb, vanilla.config.max_seq_len, elem),
                 "rec": slots_for_memory(rec, args.batch_memory_mb, rec.config.max_seq_len, elem)}
    kw = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    servers = [StaticServer(vanilla, slots["vanilla"], **kw), ContinuousServer(vanilla, slots["vanilla"], **kw),
               DepthWiseServer(rec, slots["rec"], None, **kw)]
    servers += [DepthWiseServer(rec, slots["rec"], t, rule, **kw) for t in thr]
    check_cache_memory({s.name: s.model for s in servers}, {s.name: s.slots for s in servers}, elem, device,
                       f"--batch-memory-mb {args.batch_memory_mb:g} (slots {slots['vanilla']:,} vanilla, "
                       f"{slots['rec']:,} depth-wise)" if args.batch_memory_mb else f"--slots {args.slots:,}")
    rc = rec.config
    print(f"device {device} dtype {dtype} | vanilla {vanilla.config.n_layer} layers, {vanilla.num_params() / 1e6:.2f}M "
          f"non-emb params | {'relaxed' if rc.relaxed else 'recursive'} B={rc.n_loops} K={rc.n_shared} "
          f"ranks {rc.lora_ranks}, {rec.num_params() / 1e6:.2f}M | {len(requests)} requests, arrivals "
          f"{args.arrival}{f' at {args.rate}/s' if args.arrival == 'poisson' else ''} | exit rule {rule}, threshold "
          f"{','.join(format(t, '.4g') for t in thr) or '-'} "
          f"({how})" + (f" | batch memory {args.batch_memory_mb} MiB -> slots {slots}" if args.batch_memory_mb else ""))
    if not args.ckpt:
        what = (f"--vanilla-ckpt {args.vanilla_ckpt} converted without training (Average tying" +
                (", SVD LoRA)" if rc.relaxed else ")") if args.vanilla_ckpt else "RANDOM WEIGHTS, outputs are noise")
        print(f"EXITS SIMULATED: no --ckpt, the depth-wise model is {what}; its exit scores mean nothing, so a "
              f"threshold is set to make a chosen share of tokens leave (--exit-rate); give --ckpt (trained with "
              f"--exit-gate) to serve real exits")
        if vanilla.num_params() < SMALL_MODEL_PARAMS:
            print(f"SMALL MODEL ({vanilla.num_params() / 1e6:.2f}M): a decode step here is per-operator overhead, not "
                  f"weight reads, so half the layers per step save little and the exit path costs more; the depth-wise "
                  f"bargain shows where weights dominate a step: python serve.py (the base preset)")
    else:
        print(f"EXITS REAL: --ckpt {args.ckpt}, rule {rule}")
    peak = args.peak_bw * 1e9 if args.peak_bw else peak_bandwidth(device)
    rows, outputs = [], []
    for srv in servers:
        if args.warmup:  # untimed: allocator, cuBLAS, compile
            srv.run(requests[:args.warmup], clock="step")
        reqs = srv.run(requests, clock="wall", progress=not args.json)
        rows.append(summarize(srv, reqs, peak))
        outputs.append({r.rid: r.output for r in reqs if r.error is None})
    if args.temperature == 0:  # greedy: what the exits change in the text
        for row, out in zip(rows, outputs):
            row["agree_vanilla"] = prefix_agreement(out, outputs[1])
            row["agree_full"] = prefix_agreement(out, outputs[2])
    print_table(rows, SERVE_COLS, "serving: the same requests through every system (tok lat = per-token latency ms, "
                                  "exit loop 1-based)")
    if peak:
        print(f"peak memory bandwidth {peak / 1e9:.0f} GB/s; GB/s = (parameter + KV bytes read) / decode step time")
    print_errors(rows)
    base = rows[1]["tok_per_s"]
    if base > 0:  # no token generated (every request an error): no ratio
        print("throughput vs vanilla continuous: " + ", ".join(f"{r['system']} x{r['tok_per_s'] / base:.2f}"
                                                               for r in rows))
    return rows


# Below this many non-embedding parameters the demo says that its model is too small to show the bargain: per-operator
# overhead, not weight reads, sets the step of such a model (the tiny preset against the base one: RESULTS.md, Serving).
SMALL_MODEL_PARAMS = 10_000_000


# ----------------------------------------------------------------------------------------------------------------
# Command line


def length_range(text: str) -> str:
    """argparse type of --prompt-len / --gen-len: 'a:b' or 'a' with 1 <= a <= b (kept as text for parse_range)."""
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


def build_parser():
    num, pos, nonneg = number, number(int, min=1), number(int, min=0)
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_argument_group("models")
    g.add_argument("--preset", default="base", choices=sorted(PRESETS),
                   help="model.py preset of the random-weight models (default base: 125M, where weight reads dominate "
                        "a decode step and depth-wise batching pays; tiny is per-operator overhead)")
    g.add_argument("--ckpt", type=path_arg, default=None,
                   help="recursive/relaxed checkpoint (train.py) for the depth-wise server")
    g.add_argument("--vanilla-ckpt", type=path_arg, default=None,
                   help="vanilla checkpoint for the vanilla baselines, or a pretrained model: hf:DIR, gguf:PATH, "
                        "smollm2-135m")
    g.add_argument("--context", type=pos, default=None,
                   help="KV positions per slot (default: the model's context; cap a pretrained model's 8k with it)")
    g.add_argument("--loops", type=pos, default=2, help="B of the random-weight recursive models")
    g.add_argument("--lora-rank", type=nonneg, default=0,
                   help="LoRA rank of the random-weight relaxed model (default 0: recursive)")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu) | cpu | cuda | mps")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="auto (bf16 on GPU, fp32 on CPU) | ...")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (ignored on CPU)")
    g = ap.add_argument_group("requests")
    g.add_argument("--requests", type=request_count, default=32,
                   help=f"synthetic / corpus requests (at most {MAX_REQUESTS:,})")
    g.add_argument("--prompts", default="synthetic", choices=["synthetic", "corpus", "chat"],
                   help="prompt token source: random ids, validation corpus windows, or those windows as a chat "
                        "question in the tokenizer's chat template (a GGUF file's)")
    g.add_argument("--requests-file", type=path_arg, default=None, help="JSONL requests (overrides --prompts)")
    g.add_argument("--data", type=path_arg, default="stdlib", help="--prompts corpus: train.py corpus")
    g.add_argument("--cache-dir", type=path_arg, default="data_cache", help="--prompts corpus: token cache directory")
    g.add_argument("--prompt-len", type=length_range, default="8:48", help="prompt lengths, 'a:b' uniform or 'a'")
    g.add_argument("--gen-len", type=length_range, default="8:32", help="max_new_tokens, 'a:b' uniform or 'a'")
    g.add_argument("--arrival", default="all", choices=["all", "poisson"], help="arrival process")
    g.add_argument("--rate", type=num(float, above=0), default=20.0, help="Poisson arrival rate (requests/s)")
    g = ap.add_argument_group("serving")
    g.add_argument("--slots", type=pos, default=16, help="batch slots of every server")
    g.add_argument("--batch-memory-mb", type=num(float, above=0), default=None,
                   help="instead of --slots: slots that fit this many MiB of parameters + full-context KV")
    g.add_argument("--exit-threshold", type=threshold, default="auto",
                   help="confidence threshold in (0, 1], a comma list of them (one server each), or 'auto' "
                        "(calibrated)")
    g.add_argument("--exit-rule", default=None, choices=["softmax", "gate", "saturation"],
                   help="exit score: softmax (max probability), gate (learned; default when --ckpt has one), "
                        "saturation (cos of a loop's input and output)")
    g.add_argument("--exit-rate", type=num(float, above=0), default=0.633,
                   help="--exit-threshold auto: target share exiting at loop 1, in (0, 1] (default: the oracle share "
                        "of a trained tiny recursive model, RESULTS.md)")
    g.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=pos, default=None)
    g.add_argument("--warmup", type=nonneg, default=4, help="untimed warm-up requests per system")
    g.add_argument("--peak-bw", type=num(float, above=0), default=None,
                   help="device peak bandwidth in GB/s (default: known GPUs)")
    g = ap.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON line with every result at the end")
    g.add_argument("--seed", type=seed_arg, default=1337)
    return ap


def check_args(args):
    """Flag combinations that cannot work, found before any model is built (lengths against a context: below)."""
    if args.exit_rate > 1:
        raise UsageError(f"--exit-rate {args.exit_rate} is a share of tokens: it must be in (0, 1]")
    check_device(args.device)
    check_dtype(args.device, args.dtype)
    if args.prompts in ("corpus", "chat") and not args.requests_file:  # the corpus is tokenized into it
        check_writable_dir(Path(args.cache_dir), "--cache-dir")


def check_lengths_fit(args, vanilla, rec):
    """Synthetic and corpus requests are ours: every one must fit the context of both models (a requests file may
    hold requests that do not; those get their own error)."""
    if vanilla.config.vocab_size != rec.config.vocab_size:
        raise UsageError(f"the vanilla model has {vanilla.config.vocab_size} vocabulary rows and the recursive "
                               f"one {rec.config.vocab_size}: they must serve the same token ids")
    if args.requests_file:
        return
    ctx = min(vanilla.config.max_seq_len, rec.config.max_seq_len)
    P, G = parse_range(args.prompt_len)[1], parse_range(args.gen_len)[1]
    if P + G > ctx:
        raise UsageError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len}: a request of {P} prompt "
                               f"+ {G} new tokens exceeds the context of {ctx} positions; lower them")


def run(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    with cpu_tuning.switched_on():  # on a CPU: the linear, attention and LoRA forms measured fastest here
        out = {"serve": serve_compare(args, device, dtype)}
    if args.json:
        print(json.dumps(json_safe(out)))
    return out


def json_safe(obj):
    """NaN/inf (a metric with no sample, e.g. no token generated) -> null: the --json line stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def main(argv=None):
    """The command: an expected error (a flag, a file, a checkpoint) is one line `error: ...` and exit code 2."""
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
