"""
serve.py -- a lean serving engine on one device: continuous batching for the vanilla model, continuous depth-wise
batching with early exit for Recursive Transformers.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), section 2.4 (Continuous Depth-wise Batching and Early-Exiting, Figure 3), section 3.8, Appendix K.
The paper simulates depth-wise batching from measured per-token times and oracle exits; here the schedule runs for
real, with confidence-based exits and state propagation.

The engine (nanochat's engine.py and gpt-fast's generate.py are its models):
  * Requests: prompt token ids + max_new_tokens + an arrival time, and what serving records (tokens, the loop each
    left at, times, an error). One the model cannot serve (Request.problem: an empty prompt, an id outside the
    vocabulary, more tokens than the context) gets an error of its own; the others are served.
  * Slots: a server has `slots` rows of one pre-allocated KV cache and of its state tensors, allocated once. A request
    is admitted into a free slot, prefilled and decoded there, and frees it when done; the queue refills it at once.
  * Prefill, batched and chunked: each iteration runs ONE chunk (`prefill_chunk` tokens) of every prompt still being
    prefilled, in one batch, into the slots' cache rows (model.prefill_chunk): a long prompt delays the others' decode
    steps by a chunk per iteration, not by its whole length. A prompt's last chunk samples its first token.
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
    exit flags and loops, in one tensor; the host records them and frees finished slots.
  * Sampling: greedy (argmax), or with ONE seeded torch.Generator per request (request_generator(seed, rid)): a
    request's output does not depend on the schedule, it equals model.generate on it alone with that generator
    (sequential_generate, the reference of every test). The compiled depth-wise step draws for every live row and
    keeps a draw only where the row leaves (the generator's state is put back elsewhere): still one transfer.
  * One hook watches a run (Hook; none by default, and then nothing is recorded): it hears each prefill pass and each
    decode step with what the engine knows of it anyway (harness/serve_hooks.py: Metrics, and ScheduleTrace, Figure 3).
The harness measures and feeds the engine: the demo (serve_demo.py), `python bench.py serve` (bench_serve.py) and the
requests it reads (serve_requests.py: synthetic, corpus, chat, JSONL files).

Run:
    python serve.py                    # the demo: small preset, random weights, simulated exits: the serving table
    python serve.py --preset tiny --schedule   # 0.8M parameters, and the depth-wise schedule of the run (Figure 3)
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import math
import time
from dataclasses import dataclass, field, replace

import torch

from graphs import compile_step, graph_mode, mark_static
from model import GPT, sample_next
from recursive import RecursiveGPT

# ----------------------------------------------------------------------------------------------------------------
# Requests: what a server is asked, what it records on them, what it refuses


@dataclass
class Request:
    rid: int
    prompt: list  # token ids
    max_new_tokens: int
    arrival: float = 0.0  # seconds after the start (clock='wall') or decode steps (clock='step')
    error: str | None = None
    error_kind: str | None = None  # the short reason of `error` (the summaries count requests by it)
    finished: bool = False
    output: list = field(default_factory=list)  # generated ids
    exits: list = field(default_factory=list)  # 0-based loop that produced each generated token (None: vanilla)
    t_arrive: float | None = None  # wall times (perf_counter)
    t_first: float | None = None
    t_done: float | None = None
    token_times: list = field(default_factory=list)
    gen: torch.Generator | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or self.finished

    def fresh(self) -> "Request":
        """The same request, not yet served (its prompt, length and arrival, and any field a subclass adds)."""
        return replace(self, prompt=list(self.prompt) if isinstance(self.prompt, list) else self.prompt, error=None,
                       error_kind=None, finished=False, output=[], exits=[], t_arrive=None, t_first=None,
                       t_done=None, token_times=[], gen=None)

    def problem(self, vocab_size: int, max_seq_len: int) -> tuple[str, str] | None:
        """(short reason, clear message) why a model of this vocabulary and context cannot serve this request, or
        None. (A request read from a file can be wrong in more ways: harness/serve_requests.py's ReadRequest.)"""
        if self.max_new_tokens < 1:
            return "bad max_new_tokens", f"max_new_tokens={self.max_new_tokens!r} must be a positive integer"
        if not self.prompt:
            return "empty prompt", "empty prompt: a request needs at least one prompt token"
        bad = [t for t in self.prompt if not 0 <= t < vocab_size]
        if bad:
            return "token id outside vocabulary", (f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                                   f"{vocab_size})")
        if len(self.prompt) >= max_seq_len:
            return "prompt longer than context", (f"prompt of {len(self.prompt)} tokens is longer than the context "
                                                  f"({max_seq_len} positions, one kept for a new token)")
        if len(self.prompt) + self.max_new_tokens > max_seq_len:
            return "prompt + output longer than context", (
                f"prompt of {len(self.prompt)} tokens + max_new_tokens={self.max_new_tokens} exceeds the context of "
                f"{max_seq_len} positions")
        return None

    def refuse(self, kind: str, message: str):
        """This request is not served: its error."""
        self.error_kind, self.error, self.t_done = kind, message, time.perf_counter()


def request_generator(seed: int, rid: int, device="cpu") -> torch.Generator:
    """The sampling generator of request rid: outputs do not depend on the schedule."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + rid) % 2 ** 64)  # what torch takes


# ----------------------------------------------------------------------------------------------------------------
# The hook: what a run tells whoever watches it


class Hook:
    """One object that hears a run: its start, every prefill pass, every decode step and its end. The engine passes
    what it knows anyway and keeps nothing for the hook; this base class does nothing (a server built without a hook
    gets it). Metrics and ScheduleTrace below are the two hooks of this repository."""

    def start(self, server):
        """A run begins: the slots are empty."""

    def prefilled(self, server, slots: list, chunk: list, started: list):
        """One prefill pass: slot slots[i] ran chunk[i] prompt tokens; the slots in `started` finished their prompt and
        emitted their first token."""

    def stepped(self, server, live: list, cols: list, emitted: list, kv_len: int, seconds: float):
        """One decode step over the slots `live`: cols are its results per slot on the host (ContinuousServer: [token];
        DepthWiseServer: [leave, token, loop]), `emitted` the slots whose token was recorded, kv_len the keys a row
        read, seconds the step with its bookkeeping."""

    def end(self, server):
        """The run is done: every request finished or refused."""


# ----------------------------------------------------------------------------------------------------------------
# Servers


class Server:
    """The loop every server shares: arrivals -> admission into free slots -> one prefill chunk -> one decode step ->
    one transfer -> emit. A subclass gives make_state() (its slot tensors, position and live_mask among them),
    start() (slots begin decoding on their first tokens), step() (one decode step over the slots -> per-slot results
    on the device) and finish_step() (the host's bookkeeping of those results). clock='wall' reads arrivals as
    seconds (sleeping while nothing has arrived), clock='step' as iterations (deterministic schedules for tests).
    compile: None = on CUDA only (a command decides for a CPU: cpu_tuning.compiled_decode_faster); backend:
    compile_step's (tests: GraphCheck). hook: a Hook that watches every run
    (default: none)."""

    name, prefill_exit = "server", None  # prefill_exit: the exit loop recorded for the token a prefill produces
    static = False  # static batching (ContinuousServer(static=True))
    every_slot = True  # a step reads every slot's cache row (else the live ones only: the eager depth-wise step)

    def __init__(self, model, slots: int, temperature=0.0, top_k=None, seed=0, eos_id=None, prefill_chunk=256,
                 compile=None, backend=None, hook: Hook | None = None):
        if slots < 1 or prefill_chunk < 1:
            raise ValueError(f"slots and prefill_chunk must be >= 1, got {slots} and {prefill_chunk}")
        self.model, self.slots, self.chunk, self.cfg = model, slots, prefill_chunk, model.config
        self.temperature, self.top_k, self.seed, self.eos_id = temperature, top_k, seed, eos_id
        self.hook = hook if hook is not None else Hook()
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.mode, self.backend, self.graphs = graph_mode("auto", self.device, backend), backend, {}

    def graph(self, fn):
        """fn compiled once per server (compile_step: one graph per step kind and slot count)."""
        if fn.__name__ not in self.graphs:
            self.graphs[fn.__name__] = compile_step(fn, self.mode, self.backend, self.device)
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
        their next prompt position. -> (the slots prefilled, their chunk lengths, the slots started, their first
        tokens on the device)."""
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
            return slots, n, [], None
        started = [slots[i] for i in done]
        last = h[torch.tensor(done, device=self.device), torch.tensor([n[i] - 1 for i in done], device=self.device)]
        toks = self.sample(self.model.head(last[:, None])[:, 0], [self.req[s] for s in started])
        lengths = torch.tensor([self.filled[s] for s in started], device=self.device)
        decoding = [s for s in started if self.req[s].max_new_tokens > 1]  # a one-token request ends here
        self.start(started, toks, lengths)
        self.live += decoding
        self.live_mask[torch.tensor(decoding, device=self.device, dtype=torch.long)] = True
        return slots, n, started, toks

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

    def emit_rows(self, rows, tok, loop, finished) -> list:
        """A step's token tok[s] (exit loop loop[s], None: not recorded) for each of `rows`, the finished ones added
        to `finished`. A row whose request is already done -- its prefill, in this iteration, sampled eos as its first
        token; live all the same for the step -- emits nothing. -> the slots that emitted."""
        rows = [s for s in rows if not self.req[s].finished]
        finished += [s for s in rows if self.emit(self.req[s], tok[s], None if loop is None else loop[s])]
        return rows

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
        self.n_steps = 0
        self.reset()
        self.hook.start(self)
        head = seen = 0  # next request to admit / to stamp with its arrival time
        tick, t0 = 0, time.perf_counter()
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
                problem = r.problem(self.cfg.vocab_size, self.cfg.max_seq_len)
                if problem is None:
                    self.place(r)
                    room -= 1
                else:
                    r.refuse(*problem)
            if self.busy():
                self.iterate()
                tick += 1
            elif head < len(reqs) and head == seen:  # idle until the next arrival
                if clock == "wall":
                    time.sleep(max(0.0, min(reqs[head].arrival - now(), 0.05)))
                else:
                    tick = max(tick, reqs[head].arrival)
        self.hook.end(self)  # (the last iteration ended in its transfer: nothing is left queued on the device)
        return sorted(reqs, key=lambda r: r.rid)

    def iterate(self):
        """One iteration: a prefill chunk, a decode step over the live slots, ONE transfer, the host's bookkeeping."""
        prefilled, started, first = None, [], None
        if any(self.todo):
            *prefilled, started, first = self.prefill()  # prefilled: the slots and their chunk lengths
        live, t0 = list(self.live), time.perf_counter()
        out = self.step() if live else None  # (k, slots) on the device
        parts = [t for t in (first, None if out is None else out.flatten()) if t is not None]
        values = torch.cat(parts).tolist() if parts else []  # the one device-to-host transfer
        finished = [s for s, tok in zip(started, values) if self.emit(self.req[s], tok, self.prefill_exit)]
        if prefilled:
            self.hook.prefilled(self, *prefilled, started)
        if out is not None:  # the keys a row read: all max_len of a static cache, else up to the longest live row
            kv_len = self.cache.max_len if self.compiled else max(len(self.req[s].prompt) + len(self.req[s].output)
                                                                  for s in live)
            cols = [values[len(started) + i * self.slots:len(started) + (i + 1) * self.slots] for i in range(len(out))]
            emitted = self.finish_step(live, cols, finished)
            self.n_steps += 1
            self.hook.stepped(self, live, cols, emitted, kv_len, time.perf_counter() - t0)
        if finished:
            self.free(finished)


class ContinuousServer(Server):
    """Vanilla GPT, continuous sequence-wise batching: one GPT.decode_step over all slots per step. static=True:
    static batching (a new batch is admitted only when the whole previous one is done). The eager and the compiled
    step are the same graph-safe code (decode, greedy_step), compiled or not."""

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

    def step(self):
        """Greedy: greedy_step (compiled: one graph, the argmax inside it); sampled: decode, then each live row draws
        with its request's generator."""
        if self.temperature <= 0:
            return (self.graph(self.greedy_step) if self.compiled else self.greedy_step)()
        logits = (self.graph(self.decode) if self.compiled else self.decode)()
        live = torch.tensor(self.live, device=self.device)
        self.tok[live] = self.sample(logits[live], [self.req[s] for s in self.live])
        return self.tok[None]

    def decode(self):
        """Graph-safe: every slot decodes its token; the rows that are not live keep their position."""
        logits = self.model.decode_step(self.tok, self.cache)  # (slots, V); lengths += 1
        self.cache.lengths.sub_((~self.live_mask).long())
        return logits

    def greedy_step(self):
        tok = torch.where(self.live_mask, self.decode().argmax(-1), self.tok)
        self.tok.copy_(tok)
        return tok[None]

    def finish_step(self, live, cols, finished) -> list:
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

    def step(self):
        """-> (3, slots): leave, token, the loop each row ran. Eager (eager_step) or compiled (graphed_step)."""
        return self.graphed_step() if self.compiled else self.eager_step()

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

    def finish_step(self, live, cols, finished) -> list:
        leave, tok, loop = cols
        for s, state in getattr(self, "kept", ()):  # the compiled sampled step's draws of the rows that stay
            if not leave[s]:
                self.req[s].gen.set_state(state)
        self.kept = []
        return self.emit_rows([s for s in live if leave[s]], tok, loop, finished)

    # -- the compiled step: graph-safe forms over every slot (masks, no row subsets, no host reads) --------------

    def graphed_step(self):
        """Greedy: greedy_step, one graph (the argmax and the next state inside it). Sampled: the pass is the graph
        (its outputs copied out: the next replay reuses its memory); each live row draws with its own generator, the
        draw kept only where the row leaves (finish_step puts the generator back elsewhere); the next state in eager
        ops."""
        if self.temperature <= 0:
            return self.graph(self.greedy_step)()
        out, leave, logits = (t.clone() for t in self.graph(self.masked_pass)())
        live = torch.tensor(self.live, device=self.device)
        self.kept = [(s, self.req[s].gen.get_state()) for s in self.live]
        tok = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        tok[live] = self.sample(logits[live], [self.req[s] for s in self.live])
        return self.advance(out, leave, tok)

    def masked_pass(self):
        return self.model.depthwise_step(self.h, self.loop, self.position, self.live_mask, self.cache,
                                         self.threshold, self.rule)

    def greedy_step(self):
        out, leave, logits = self.masked_pass()
        return self.advance(out, leave, logits.argmax(-1))

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
# python serve.py: the demo (harness/serve_demo.py) serves the same requests through every server above. It runs as
# `python -m harness.serve_demo` would: the engine takes no name from the harness, which imports it.

if __name__ == "__main__":
    import runpy

    runpy.run_module("harness.serve_demo", run_name="__main__")
