"""
serve.py -- a lean serving engine on one device: continuous batching for the vanilla model, continuous depth-wise
batching with early exit for Recursive Transformers, and a demo that serves the same requests through both.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), section 2.4 (Continuous Depth-wise Batching and Early-Exiting, Figure 3), section 3.8, Appendix K.
The paper simulates depth-wise batching from measured per-token times and oracle exits; here the schedule runs for
real, with confidence-based exits and state propagation.

The engine (nanochat's engine.py and gpt-fast's generate.py are its models):
  * Slots: a server has `slots` rows of one pre-allocated KV cache and of its state tensors, allocated once. A request
    is admitted into a free slot (validated alone: a bad one gets its own error), prefilled and decoded there, and
    frees it when done; the queue refills it at once.
  * Prefill, batched and chunked: each iteration runs ONE chunk (`prefill_chunk` tokens) of every prompt still being
    prefilled, in one batch, straight into the slots' cache rows (model.prefill_chunk): a long prompt delays the
    others' decode steps by a chunk per iteration, not by its whole length. A prompt's last chunk samples its first
    token.
  * ContinuousServer (vanilla; continuous sequence-wise batching, Orca/vLLM): a step is ONE GPT.decode_step over all
    slots, each at its own position. Rows with no token in flight run along (static shapes) and keep their position:
    0 when free, the next prompt position (which the next chunk overwrites) while prefilling. static=True: static
    batching, a new batch only once every slot is free.
  * DepthWiseServer (recursive / relaxed; Figure 3): a slot holds its token in flight -- position, loop, hidden
    state -- and a step runs the shared block ONCE over the slots, each at its own loop (per-row LoRA, cache layer
    loop*K + k). A row leaves at its last loop or, with a threshold, when its exit score reaches it (max softmax, the
    learned gate, saturation); an early leaver's deeper cache layers get its propagated K/V (CALM). A leaving row
    emits its token and starts the next at loop 0; the others go one loop deeper. No threshold: no early exit.
  * Eager or compiled steps. Eager (the CPU default) is the readable reference: the depth-wise step runs the live rows
    only (RecursiveGPT.exit_pass: row subsets, the head on the leaving rows). Compiled (the CUDA default) runs the
    graph-safe forms over every slot -- GPT.decode_step on a static cache, RecursiveGPT.depthwise_step -- through
    graphs.compile_step: one graph per step kind, a CUDA graph on CUDA, greedy sampling and the next state inside it.
    A graph cannot skip work per row: rows with nothing to do run along, their writes masked. Same tokens either way.
  * One device-to-host transfer per iteration: the first tokens of the prompts finished in it and the step's tokens,
    exit flags and loops, in one tensor; then the host records them and frees finished slots.
  * Sampling: greedy (argmax), or with ONE seeded torch.Generator per request (request_generator(seed, rid)): a
    request's output does not depend on the schedule, it equals model.generate on it alone with that generator
    (sequential_generate, the reference of every test). The compiled depth-wise step draws for every live row and
    keeps a draw only where the row leaves (the generator's state is put back elsewhere): still one transfer.
The comparison harness (checkpoints, request sources and files, exit calibration, metric tables, memory sizing,
--json) is bench_serve.py: `python bench.py serve`.

Run:
    python serve.py                    # demo: base preset, random weights, simulated exits: the serving table
    python serve.py --preset tiny      # the same at 0.8M parameters, where per-operator overhead eats the bargain
    python bench.py serve --help       # the serving benchmark: checkpoints, request files, exit rules, --json
    python -m pytest -q tests/test_serve.py
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import argparse
import math
import time

import torch

from graphs import compile_step, graph_mode, mark_static
from harness import cpu_tuning
from harness.cli import (DTYPES, ArgumentParser, UsageError, available_memory, check_device, check_dtype, number,
                         run_cli, seed_arg, user_input)
from harness.device import pick_device, pick_dtype, sync
from harness.serve_requests import MAX_REQUESTS, Request, request_generator, request_problem, synthetic_requests
from model import GPT, PRESETS, GPTConfig, sample_next
from recursive import RecursiveGPT, exit_threshold_for, from_vanilla


# ----------------------------------------------------------------------------------------------------------------
# Servers


class Server:
    """The loop every server shares: arrivals -> admission into free slots -> one prefill chunk -> one decode step ->
    one transfer -> emit. A subclass gives make_state() (its slot tensors, position and live_mask among them),
    start() (slots begin decoding on their first tokens), step() (one decode step over the slots -> per-slot results
    on the device) and finish_step() (the host's bookkeeping of those results). clock='wall' reads arrivals as
    seconds (sleeping while nothing has arrived), clock='step' as iterations (deterministic schedules for tests).
    compile: None = on CUDA only; backend: compile_step's (tests: GraphCheck)."""

    name, prefill_exit = "server", None  # prefill_exit: the exit loop recorded for the token a prefill produces
    static = False  # static batching (ContinuousServer(static=True))
    every_slot = True  # a step reads every slot's cache row (else the live ones only: the eager depth-wise step)

    def __init__(self, model, slots: int, temperature=0.0, top_k=None, seed=0, eos_id=None, prefill_chunk=256,
                 compile=None, backend=None):
        if slots < 1 or prefill_chunk < 1:
            raise ValueError(f"slots and prefill_chunk must be >= 1, got {slots} and {prefill_chunk}")
        self.model, self.slots, self.chunk, self.cfg = model, slots, prefill_chunk, model.config
        self.temperature, self.top_k, self.seed, self.eos_id = temperature, top_k, seed, eos_id
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.mode, self.backend, self.graphs = graph_mode("auto", self.device, backend), backend, {}

    def graph(self, fn):
        """fn compiled once per server (compile_step: one graph per step kind and slot count)."""
        if fn.__name__ not in self.graphs:
            self.graphs[fn.__name__] = compile_step(fn, self.mode, self.backend)
        return self.graphs[fn.__name__]

    def sample(self, logits, reqs) -> torch.Tensor:
        """logits (b, V) -> one token per request (b,) on the device: greedy in one argmax, or sampled with each
        request's own generator. THE sampler of every server."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return torch.cat([sample_next(logits[i:i + 1], self.temperature, self.top_k, r.gen)
                          for i, r in enumerate(reqs)])

    # -- slots ---------------------------------------------------------------------------------------------------

    def reset(self):
        """Empty slots. The cache and the slot tensors are allocated once and reused by every run (gpt-fast's
        setup_caches): what a compiled step writes in place keeps its address, so a CUDA graph replays on it."""
        if getattr(self, "cache", None) is None:
            self.cache = self.model.new_cache(self.slots, static=self.compiled)
            self.make_state()
            if self.compiled:
                mark_static(*self.state)
        self.cache.reset()
        for t in self.state:
            t.zero_()
        self.req, self.todo, self.filled, self.live = [None] * self.slots, [[]] * self.slots, [0] * self.slots, []

    def free_slots(self) -> int:
        """Slots a request may be admitted into now (static batching: all of them once the batch is done, else 0)."""
        free = sum(r is None for r in self.req)
        return 0 if self.static and free < self.slots else free

    def busy(self) -> bool:
        return any(r is not None for r in self.req)

    def place(self, r: Request):
        s = self.req.index(None)
        self.req[s], self.todo[s], self.filled[s] = r, list(r.prompt), 0

    def prefill(self):
        """One chunk of every prompt still being prefilled, in one batch (right-padded; a pad position past the cache
        is its last one, which no token of a request ever fills) into its slot's cache row. A prompt whose last
        chunk this is samples its first token and its slot starts decoding; the slots still prefilling park at
        their next prompt position. -> (the slots started, their first tokens on the device)."""
        slots = [s for s in range(self.slots) if self.todo[s]]
        n = [min(len(self.todo[s]), self.chunk) for s in slots]
        idx = torch.zeros(len(slots), max(n), dtype=torch.long)
        for i, s in enumerate(slots):
            idx[i, :n[i]] = torch.tensor(self.todo[s][:n[i]])
        start = torch.tensor([self.filled[s] for s in slots])
        q_pos = (start[:, None] + torch.arange(max(n))).clamp(max=self.cache.max_len - 1)
        rows = torch.tensor(slots, device=self.device)
        h = self.model.prefill_chunk(idx.to(self.device), q_pos.to(self.device), self.cache, rows,
                                     first=not any(self.filled[s] for s in slots))  # (b, T, C)
        for i, s in enumerate(slots):
            self.filled[s] += n[i]
            self.todo[s] = self.todo[s][n[i]:]
        done = [i for i, s in enumerate(slots) if not self.todo[s]]
        if len(done) < len(slots):
            parked = [s for s in slots if self.todo[s]]
            self.position[parked] = torch.tensor([self.filled[s] for s in parked], device=self.device)
        if not done:
            return [], None
        started = [slots[i] for i in done]
        last = h[torch.tensor(done, device=self.device), torch.tensor([n[i] - 1 for i in done], device=self.device)]
        toks = self.sample(self.model.head(last[:, None])[:, 0], [self.req[s] for s in started])
        lengths = torch.tensor([self.filled[s] for s in started], device=self.device)
        decoding = [s for s in started if self.req[s].max_new_tokens > 1]  # a one-token request ends here
        self.start(started, toks, lengths)
        self.live += decoding
        self.live_mask[torch.tensor(decoding, device=self.device, dtype=torch.long)] = True
        return started, toks

    def free(self, slots):
        """Finished requests leave their slots: free, parked at position 0, not live."""
        for s in slots:
            self.req[s] = None
        self.live = [s for s in self.live if s not in slots]
        idx = torch.tensor(slots, device=self.device)
        self.position[idx] = 0
        self.live_mask[idx] = False

    def emit(self, r: Request, tok: int, exit_loop) -> bool:
        """Record a generated token; True when the request is finished."""
        now = time.perf_counter()
        r.output.append(tok)
        r.exits.append(exit_loop)
        r.token_times.append(now)
        if r.t_first is None:
            r.t_first = now
        if len(r.output) >= r.max_new_tokens or (self.eos_id is not None and tok == self.eos_id):
            r.finished, r.t_done = True, now
            return True
        return False

    def emit_rows(self, rows, tok, loop, finished) -> int:
        """A step's token tok[s] (exit loop loop[s], None: not recorded) for each of `rows`, the finished ones added
        to `finished`. A row whose request is already done -- its prefill, in this iteration, sampled eos as its first
        token; live all the same for the step -- emits nothing. -> the tokens emitted."""
        rows = [s for s in rows if not self.req[s].finished]
        finished += [s for s in rows if self.emit(self.req[s], tok[s], None if loop is None else loop[s])]
        return len(rows)

    def record_step(self, seconds, rows, kv_len, emitted):
        """One decode step: its time, live slots, keys read (kv_len per row it reads) and tokens emitted. Steps with
        every slot busy are also summed apart: the loaded server's throughput, free of the tail of the drain."""
        self.n_steps += 1
        self.step_time += seconds
        self.occupancy += rows / self.slots
        self.kv_read += (self.slots if self.every_slot else rows) * kv_len
        if rows == self.slots:
            self.full_time += seconds
            self.full_tokens += emitted

    # -- the loop ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, requests, clock="wall") -> list[Request]:
        """Serve fresh copies of `requests`; returns them with outputs, exits, times and errors."""
        bad = next((r for r in requests if not 0 <= r.arrival < math.inf), None)  # NaN, inf, < 0: it never arrives
        if bad is not None:
            raise ValueError(f"request {bad.rid}: arrival {bad.arrival} is not a time >= 0")
        reqs = sorted((r.fresh() for r in requests), key=lambda r: (r.arrival, r.rid))
        for r in reqs:
            r.gen = request_generator(self.seed, r.rid, self.device) if self.temperature > 0 else None
        self.n_steps = self.kv_read = self.full_tokens = 0
        self.step_time = self.occupancy = self.full_time = 0.0
        self.reset()
        head = seen = 0  # next request to admit / to stamp with its arrival time
        tick, t0 = 0, time.perf_counter()
        self.t_start = t0
        now = (lambda: time.perf_counter() - t0) if clock == "wall" else (lambda: tick)
        while head < len(reqs) or self.busy():
            t = now()
            while seen < len(reqs) and reqs[seen].arrival <= t:
                reqs[seen].t_arrive = t0 + reqs[seen].arrival if clock == "wall" else time.perf_counter()
                seen += 1
            room = self.free_slots()
            while head < seen and room:
                r = reqs[head]
                head += 1
                problem = request_problem(r, self.cfg.vocab_size, self.cfg.max_seq_len)
                if problem is None:
                    self.place(r)
                    room -= 1
                    continue
                r.error_kind, r.error = problem
                if r.source and r.source.rsplit(":", 1)[0] not in r.error:
                    r.error = f"{r.source}: {r.error}"
                r.t_done = time.perf_counter()
            if self.busy():
                self.iterate()
                tick += 1
            elif head < len(reqs) and head == seen:  # idle until the next arrival
                if clock == "wall":
                    time.sleep(max(0.0, min(reqs[head].arrival - now(), 0.05)))
                else:
                    tick = max(tick, reqs[head].arrival)
        sync(self.device)
        self.t_end = time.perf_counter()
        return sorted(reqs, key=lambda r: r.rid)

    def iterate(self):
        """One iteration: a prefill chunk, a decode step over the live slots, ONE transfer, the host's bookkeeping."""
        started, first = self.prefill() if any(self.todo) else ([], None)
        live, t0 = list(self.live), time.perf_counter()
        out = self.step() if live else None  # (k, slots) on the device
        parts = [t for t in (first, None if out is None else out.flatten()) if t is not None]
        if not parts:  # every busy slot is still prefilling
            return
        values = torch.cat(parts).tolist()  # the one device-to-host transfer
        finished = [s for s, tok in zip(started, values) if self.emit(self.req[s], tok, self.prefill_exit)]
        if out is not None:  # the keys a row read: all max_len of a static cache, else up to the longest live row
            kv_len = self.cache.max_len if self.compiled else max(len(self.req[s].prompt) + len(self.req[s].output)
                                                                  for s in live)
            cols = [values[len(started) + i * self.slots:len(started) + (i + 1) * self.slots] for i in range(len(out))]
            emitted = self.finish_step(live, cols, finished)
            self.record_step(time.perf_counter() - t0, len(live), kv_len, emitted)
        if finished:
            self.free(finished)


class ContinuousServer(Server):
    """Vanilla GPT, continuous sequence-wise batching: one GPT.decode_step over all slots per step. static=True:
    static batching (a new batch is admitted only when the whole previous one is done)."""

    def __init__(self, model: GPT, slots, static=False, **kw):
        super().__init__(model, slots, **kw)
        self.static = static
        self.name = "vanilla static" if static else "vanilla continuous"

    def make_state(self):
        self.tok = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # the token each slot feeds next
        self.live_mask = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        self.position = self.cache.lengths
        self.state = (self.tok, self.live_mask)  # (the static cache marks its own k, v and lengths)

    def start(self, slots, toks, lengths):
        idx = torch.tensor(slots, device=self.device)
        self.tok[idx], self.cache.lengths[idx] = toks, lengths

    def decode(self):
        """Graph-safe: every slot decodes its token; the rows that are not live keep their position."""
        logits = self.model.decode_step(self.tok, self.cache)  # (slots, V); lengths += 1
        self.cache.lengths.sub_((~self.live_mask).long())
        return logits

    def greedy_step(self):
        tok = torch.where(self.live_mask, self.decode().argmax(-1), self.tok)
        self.tok.copy_(tok)
        return tok[None]

    def step(self):
        if self.temperature <= 0:
            return (self.graph(self.greedy_step) if self.compiled else self.greedy_step)()
        logits = (self.graph(self.decode) if self.compiled else self.decode)()
        live = torch.tensor(self.live, device=self.device)
        self.tok[live] = self.sample(logits[live], [self.req[s] for s in self.live])
        return self.tok[None]

    def finish_step(self, live, cols, finished) -> int:
        return self.emit_rows(live, cols[0], None, finished)


class DepthWiseServer(Server):
    """Recursive / relaxed model, continuous depth-wise batching (Figure 3), with confidence early exit when given a
    threshold. The state of every slot -- position, loop and hidden state of its token in flight -- lives in tensors
    and a step updates all of it at once; the host keeps only which slots are live."""

    def __init__(self, model: RecursiveGPT, slots, exit_threshold=None, exit_rule=None, **kw):
        super().__init__(model, slots, **kw)
        self.every_slot = self.compiled
        self.threshold, self.rule = exit_threshold, exit_rule or model.config.exit_rule
        self.name = "depth-wise" + (f" {self.rule}>={exit_threshold:.3g}" if exit_threshold is not None else
                                    " no exit")
        self.prefill_exit = model.config.n_loops - 1  # prompt tokens never exit early: the prefill runs all loops

    def make_state(self):
        S, dev = self.slots, self.device
        self.position = torch.zeros(S, dtype=torch.long, device=dev)  # position of the token in flight
        self.loop = torch.zeros(S, dtype=torch.long, device=dev)  # its current loop
        self.h = torch.zeros(S, 1, self.cfg.n_embd, dtype=self.dtype, device=dev)  # its state before that loop
        self.live_mask = torch.zeros(S, dtype=torch.bool, device=dev)
        self.state = (self.position, self.loop, self.h, self.live_mask)

    def start(self, slots, toks, lengths):
        """Slots begin token toks (b,) at positions lengths (b,): loop 0, state = its embedding."""
        idx = torch.tensor(slots, device=self.device)
        self.position[idx], self.loop[idx] = lengths, 0
        self.h[idx] = self.model.embed(toks[:, None]).to(self.dtype)

    def advance(self, out, leave, tok):
        """The next state of every slot: a leaving row starts token tok at loop 0 (its embedding) one position on,
        another live row goes one loop deeper with its new state; the rest stay as they are. -> the step's result
        (3, slots): leave, token, the loop each row ran."""
        live, loop = self.live_mask, self.loop.clone()
        self.h.copy_(torch.where(leave[:, None, None], self.model.embed(tok[:, None]).to(self.dtype),
                                 torch.where(live[:, None, None], out, self.h)))
        self.loop.copy_(torch.where(leave, 0, self.loop + live.long()))
        self.position.add_(leave.long())
        return torch.stack([leave.long(), tok, loop])

    def masked_pass(self):  # the graph-safe step: every slot, masks
        return self.model.depthwise_step(self.h, self.loop, self.position, self.live_mask, self.cache,
                                         self.threshold, self.rule)

    def greedy_step(self):
        out, leave, logits = self.masked_pass()
        return self.advance(out, leave, logits.argmax(-1))

    def step(self):
        if self.compiled:
            if self.temperature <= 0:
                return self.graph(self.greedy_step)()
            # sampled: the pass is the graph (its outputs copied out: the next replay reuses its memory); each live
            # row draws with its own generator, the draw kept only where the row leaves (finish_step puts the
            # generator back elsewhere); the next state in eager ops
            out, leave, logits = (t.clone() for t in self.graph(self.masked_pass)())
            live = torch.tensor(self.live, device=self.device)
            self.kept = [(s, self.req[s].gen.get_state()) for s in self.live]
            tok = torch.zeros(self.slots, dtype=torch.long, device=self.device)
            tok[live] = self.sample(logits[live], [self.req[s] for s in self.live])
            return self.advance(out, leave, tok)
        return self.eager_step()

    def eager_step(self):
        """The readable reference: ONE pass of the shared block over the live slots only, each at its own loop (all
        at one loop: plain matmuls), then RecursiveGPT.exit_pass's exit rule: who leaves, their state propagation,
        the head on the leaving rows only; the next state by index writes."""
        m, S, slots = self.model, self.slots, sorted(self.live)
        full = len(slots) == S
        active = torch.arange(S, device=self.device) if full else torch.tensor(slots, device=self.device)
        loops, pos = self.loop[active], self.position[active]
        uniform = bool((loops == loops[0]).all())
        h, leave, logits = m.exit_pass(self.h[active], int(loops[0]) if uniform else loops, pos[:, None],
                                       self.cache, rows=None if full else active, kv_len=int(pos.max()) + 1,
                                       threshold=self.threshold, rule=self.rule)
        out = leave.nonzero().squeeze(1)  # (n,) rows that emit a token
        toks = torch.zeros(len(active), dtype=torch.long, device=self.device)
        if out.numel():
            toks[out] = self.sample(logits, [self.req[slots[i]] for i in out.tolist()])
        self.h[active] = torch.where(leave[:, None, None], m.embed(toks[:, None]).to(self.dtype), h)
        self.loop[active] = torch.where(leave, torch.zeros_like(loops), loops + 1)
        self.position[active] = pos + leave.long()
        res = torch.zeros(3, S, dtype=torch.long, device=self.device)
        res[:, active] = torch.stack([leave.long(), toks, loops])
        return res

    def finish_step(self, live, cols, finished) -> int:
        leave, tok, loop = cols
        for s, state in getattr(self, "kept", ()):  # the compiled sampled step's draws of the rows that stay
            if not leave[s]:
                self.req[s].gen.set_state(state)
        self.kept = []
        return self.emit_rows([s for s in live if leave[s]], tok, loop, finished)


# ----------------------------------------------------------------------------------------------------------------
# The sequential reference: what each request must produce


@torch.no_grad()
def sequential_generate(model, r: Request, temperature=0.0, top_k=None, seed=0, exit_threshold=None, exit_rule=None):
    """model.generate on the request alone (recursive: with the same exit rule) -> (tokens, exit loops or None)."""
    p = model.lm_head.weight
    idx = torch.tensor([r.prompt], device=p.device)
    gen = request_generator(seed, r.rid, p.device) if temperature > 0 else None
    if isinstance(model, RecursiveGPT):
        out, exits = model.generate(idx, r.max_new_tokens, temperature, top_k, gen, exit_threshold=exit_threshold,
                                    return_exits=True, exit_rule=exit_rule)
        return out[0, len(r.prompt):].tolist(), exits[0].tolist()
    return model.generate(idx, r.max_new_tokens, temperature, top_k, gen)[0, len(r.prompt):].tolist(), None


# ----------------------------------------------------------------------------------------------------------------
# The demo: python serve.py


DEMO_EXIT_RATE = 0.633  # the share of tokens the demo makes exit at loop 1: a trained tiny model's oracle share


def demo_parser() -> ArgumentParser:
    ap = ArgumentParser(description="serve.py's demo: the same requests through every server, random weights, exits "
                                    "simulated (the serving benchmark, with checkpoints: python bench.py serve)")
    ap.add_argument("--preset", default="base", choices=sorted(PRESETS), help="model.py preset (default base: 125M)")
    ap.add_argument("--lora-rank", type=number(int, min=0), default=0, help="relaxed LoRA rank (0: recursive, B=2)")
    ap.add_argument("--requests", type=number(int, min=1, max=MAX_REQUESTS), default=32, help="requests, all at once")
    ap.add_argument("--slots", type=number(int, min=1), default=16, help="batch slots of every server")
    ap.add_argument("--device", default="auto", help="auto (cuda > mps > cpu) | cpu | cuda | mps")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto (bf16 on GPU, fp32 on CPU) | ...")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, help="compiled steps (default: on CUDA)")
    ap.add_argument("--seed", type=seed_arg, default=1337)
    return ap


def demo(argv=None):
    """Vanilla static and continuous batching, depth-wise batching without and with exits -> the serving table."""
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
    reqs = synthetic_requests(args.requests, van.config.vocab_size, "8:48", "8:32", seed=args.seed)
    thr = exit_threshold_for(rec, [r.prompt for r in reqs[:8]], DEMO_EXIT_RATE)
    kw = dict(slots=args.slots, compile=args.compile)
    servers = [ContinuousServer(van, **kw), ContinuousServer(van, static=True, **kw), DepthWiseServer(rec, **kw),
               DepthWiseServer(rec, exit_threshold=thr, exit_rule="softmax", **kw)]  # continuous first: the base
    print(f"device {device} dtype {dtype} | {args.preset}: vanilla {van.config.n_layer} layers, recursive B=2 "
          f"(Average tying, LoRA rank {args.lora_rank}) | {args.requests} requests of 8-48 + 8-32 tokens, {args.slots} "
          f"slots | exits SIMULATED (random weights): a max-softmax threshold {thr:.3g} makes {DEMO_EXIT_RATE:.0%} of "
          f"prompt tokens leave at loop 1 | steps {'compiled' if servers[0].compiled else 'eager'}\n")
    print(f"{'system':30s} {'tokens':>7s} {'tok/s':>8s} {'loaded tok/s':>12s} {'step ms':>8s} {'exit loop':>9s} "
          f"{'x continuous':>12s}")
    base = None
    for srv in servers:
        srv.run(reqs[:4], clock="step")  # warm-up: allocator, compile
        out = srv.run(reqs)
        tokens, exits = sum(len(r.output) for r in out), [e + 1 for r in out for e in r.exits[1:] if e is not None]
        tps = tokens / (srv.t_end - srv.t_start)
        base, loaded = base or tps, srv.full_tokens / srv.full_time if srv.full_time else math.nan
        print(f"{srv.name:30s} {tokens:7d} {tps:8.1f} {loaded:12.1f} {1e3 * srv.step_time / max(srv.n_steps, 1):8.2f} "
              f"{sum(exits) / max(len(exits), 1) or math.nan:9.2f} {tps / base:12.2f}")


def main(argv=None):
    """The command: a mistake (a flag) is one line `error: ...` and exit code 2 (cli.run_cli)."""
    def run(argv):
        with cpu_tuning.switched_on():  # on a CPU: the linear, attention and LoRA forms measured fastest here
            demo(argv)
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
