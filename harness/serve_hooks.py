"""
serve_hooks.py -- the two hooks that watch a run of serve.py's servers (serve.Hook): Metrics, the numbers of the
serving benchmark (`python bench.py serve`, harness/bench_serve.py) and of serve.py's demo; ScheduleTrace, the paper's
Figure 3 recorded from the run itself (`python serve.py --schedule`, drawn by `python bench.py figures`).

A server built without a hook records nothing: the engine passes each hook what it knows anyway (serve.Hook).
"""
from __future__ import annotations

import time

import serve

# ----------------------------------------------------------------------------------------------------------------
# The metrics of a run, and its schedule (Figure 3)


class Metrics(serve.Hook):
    """The numbers of `python bench.py serve` (harness/bench_serve.py: summarize) and of the demo's table: the run's
    wall time (t_start, t_end) and, per decode step, its time, live slots, keys read and tokens emitted; the steps
    with every slot busy are also summed apart (full_time, full_tokens: the throughput of a loaded server, free of
    the tail of the drain). server.n_steps counts the steps."""

    def start(self, server):
        self.t_start, self.t_end = time.perf_counter(), None
        self.step_time = self.occupancy = self.full_time = 0.0
        self.kv_read = self.full_tokens = 0

    def stepped(self, server, live, cols, emitted, kv_len, seconds):
        self.step_time += seconds
        self.occupancy += len(live) / server.slots
        self.kv_read += (server.slots if server.every_slot else len(live)) * kv_len
        if len(live) == server.slots:
            self.full_time += seconds
            self.full_tokens += len(emitted)

    def end(self, server):
        self.t_end = time.perf_counter()


class ScheduleTrace(serve.Hook):
    """Figure 3 of the paper, recorded from a run: every forward pass of the model in order, a prefill pass or a
    decode step, with a cell per slot: None for a free slot, else (request id, what the slot ran, whether a token
    left in this pass). What: None the slot holds a request but is not in this pass, 'p' a prompt chunk, an int the
    loop (0-based) of a depth-wise row, 'all' every layer (vanilla). passes: [(kind, [cell per slot])]; `text()`
    prints them as a grid."""

    def start(self, server):
        self.server_name, self.slots, self.passes = server.name, server.slots, []

    def record(self, server, kind, ran: dict, emitted):
        """One pass: ran {slot: what it ran}, emitted the slots whose token left."""
        self.passes.append((kind, [None if r is None else (r.rid, ran.get(s), s in emitted)
                                   for s, r in enumerate(server.req)]))

    def prefilled(self, server, slots, chunk, started):
        self.record(server, "prefill", dict.fromkeys(slots, "p"), started)

    def stepped(self, server, live, cols, emitted, kv_len, seconds):
        loops = cols[2] if len(cols) == 3 else None  # the depth-wise step's loop of each row
        self.record(server, "decode", {s: "all" if loops is None else loops[s] for s in live}, emitted)

    def text(self, first: int = 0, last: int | None = None) -> str:
        """The passes first..last as a grid (SCHEDULE_LEGEND), one line per slot."""
        cols = self.passes[first:last]
        head, step = "", sum(kind == "decode" for kind, _ in self.passes[:first])
        for kind, _ in cols:
            step += kind == "decode"
            head += " pf" if kind == "prefill" else f"{step % 100:3d}"
        lines = [f"{self.server_name}: forward passes {first + 1}..{first + len(cols)} of {len(self.passes)} "
                 f"(pf = a prefill pass, n = decode step n)", f"{'pass':7s}{head}"]
        for s in range(self.slots):
            row = ""
            for _, cells in cols:
                if cells[s] is None or cells[s][1] is None:
                    row += "  ." if cells[s] is None else "   "
                    continue
                rid, what, emitted = cells[s]
                letter = chr(ord("a") + rid % 26)
                row += " " + (letter.upper() if emitted else letter) + ("p" if what == "p" else "#" if what == "all"
                                                                         else str(what + 1))
            lines.append(f"slot {s:<2d}{row}")
        return "\n".join(lines)


SCHEDULE_LEGEND = ("a cell = the request's letter (a = request 0, b = 1, ...) + what its slot ran: the loop (1, 2, "
                   "...)\nof a depth-wise row, # all layers (vanilla), p a prompt chunk; UPPERCASE = a token left in "
                   "that pass;\n"
                   "blank = the slot holds a request that is not in this pass; . = a free slot")
