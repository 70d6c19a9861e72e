"""
sweep.py -- fair quality comparisons: both sides of each quality claim of RESULTS.md tuned with the same budget
(`python eval.py sweep COMPARISON`).

A comparison (COMPARISONS) is two or three sides, each a train.py recipe, one protocol they share (steps, batch,
schedule, evaluation) and one grid per side: learning rates, and for the double decoder learning rate x weight decay.
Order of a sweep: the shared sources (a vanilla checkpoint that uptraining starts from) are trained once; every grid
point of every side runs at the first seed; a side whose best learning rate lies at an edge of its grid gets the
next one beyond that edge (x2 or /2, at every weight decay; Comparison.extend times at most), since a best at the
edge says the side's optimum may lie outside the grid; then each side's best grid setting runs again at the other
seeds (three in all). A run is `python train.py ...` in a child process, then its score (`python eval.py ...` on
its checkpoint, or its own `val` line on a task), both under the CPU lock (flock(2) on --lock, what `flock
~/.cpu.lock CMD` takes), released after the run and re-taken after --pause seconds so that other jobs on the machine
get their turn.

Results: one JSON line per run appended to OUT/results.jsonl as it ends (cli.append_line; read back through
cli.read_json: a damaged line is one `error: ...` line). A run whose result is there is skipped when the sweep is
called again, so a stopped sweep resumes where it was; a run stopped half-way continues from its checkpoint
(`train.py --resume`), or starts again where it has none. A run that train.py refuses or that diverges is recorded as
failed (its error line kept) and ranks last. Output: OUT/runs/NAME (each run's checkpoint), OUT/logs/NAME.log (its
output), OUT/table.md (each side's grid, each side's best with mean and spread over seeds, the differences, the
budget), OUT/plot.txt (always) and OUT/plot.png (with matplotlib), rewritten after every run.

    python eval.py sweep double-tiny                    # run or resume it; the table at the end
    python eval.py sweep double-tiny --dry-run          # the plan: every command, nothing run
    python eval.py sweep double-tiny --table --plot     # the table and the plot from the results so far
    python eval.py sweep plt --reuse out/sweeps/looped-corpus   # runs identical to another sweep's are copied
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import tasks
from harness.cli import (Stopped, Terminated, UsageError, append_line, check_output_file,
                         check_writable_dir, comma_list, fields_problem, number, path_arg, read_json, save_png,
                         write_atomic)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# The comparisons: one per quality claim of RESULTS.md, each with the protocol of its section


@dataclass(frozen=True)
class Side:
    """One side of a comparison: its train.py flags, its grid, and the shared source it starts from (or None)."""
    name: str
    flags: tuple[str, ...]
    lrs: tuple[float, ...]
    wds: tuple[float, ...] = (0.1,)  # train.py's default weight decay
    source: str | None = None  # the name of a Comparison.sources entry: --init-from its checkpoint


@dataclass(frozen=True)
class Comparison:
    name: str
    title: str
    section: str  # the RESULTS.md section whose claim this sweep tests
    steps: int  # optimizer steps of every run of a side (sources have their own)
    recipe: tuple[str, ...]  # train.py flags every run shares beside --max-iters: batch, schedule, evaluation
    sides: tuple[Side, ...]
    score: str  # loss (eval.py loss, a fixed set) | double (eval.py double-eval) | block (eval.py block) | acc
    contrasts: tuple[tuple[str, str], ...]  # (a, b): the table reports a - b
    seeds: tuple[int, ...] = (1337, 2, 3)  # the grid at seeds[0]; each side's best again at the others
    sources: dict = field(default_factory=dict)  # name -> train.py flags (their own --max-iters), trained once
    extend: int = 1  # times a side's lr grid grows by one step (x2 or /2) beyond the edge its best lies on

    def recipe_flags(self, steps: int) -> list[str]:
        return ["--max-iters", str(steps), "--eval-interval", str(steps), "--sample-tokens", "0", *self.recipe]


LOSS_TOKENS = 307_200  # the fixed evaluation set of `loss`: 1,200 windows of 256, nearly the whole validation split
SCORES = {  # what each score is, for the table
    "loss": f"`eval.py loss` on the first {LOSS_TOKENS:,} tokens of the validation split (1,200 windows of 256, the "
            f"same for every run and seed), nats; lower is better",
    "double": "`eval.py double-eval` native loss (each model's own objective) on 50 x 16 x 256 validation windows "
              "(seed 1337: the same windows, partitions and splits for every run), nats; lower is better; the "
              "prefix-LM suffix loss beside it",
    "block": "`eval.py block` loss on the Block Transformer's targets (20 x 16 windows of 256, seed 1337, the same "
             "for every run), nats; lower is better",
    "acc": "accuracy on fresh p-hop sequences (train.py's last `val` line, 60 x 32 sequences), mean over p = 1..4; "
           "higher is better; each p beside it",
}
TEXT = ("--batch-size", "16", "--seq-len", "256", "--eval-iters", "10")  # the corpus runs' shape (RESULTS' protocol)
VANILLA_SOURCE = {"vanilla": ("--arch", "vanilla", "--max-iters", "300", "--seed", "1337", "--sample-tokens", "0")}
PHOP = tuple(a for i, a in enumerate(tasks.DEPTH_RECIPE)  # the Depth recipe without its steps and lr (set per run)
             if a not in ("--max-iters", "--lr", "--eval-interval", "--sample-tokens")
             and tasks.DEPTH_RECIPE[i - 1] not in ("--max-iters", "--lr", "--eval-interval", "--sample-tokens"))
PLT_ROWS = {"vanilla-2": ("--arch", "plt", "--plt-variant", "vanilla"), "loop-2": ("--arch", "plt", "--plt-variant",
            "loop"), "plt-2": ("--arch", "plt", "--plt-variant", "plt"), "vanilla-4": ("--arch", "vanilla")}
LR_PLT, LR_2E3 = (2e-3, 4e-3, 8e-3), (1e-3, 2e-3, 4e-3)  # Table 2's lr 4e-3 and train.py's 2e-3 in the middle


def _double(size: str, steps: int) -> Comparison:
    vanilla = "tiny6" if size == "tiny" else "mini"
    return Comparison(
        f"double-{size}", f"double decoder vs decoder-only at `{size}` (double `{size}` vs vanilla `{vanilla}`, the "
                          f"same non-embedding parameters)",
        "Block-based double decoder: the gap to decoder-only", steps, TEXT,
        (Side("decoder-only", ("--arch", "vanilla", "--preset", vanilla), LR_2E3, (0.0, 0.1, 0.5)),
         Side("double", ("--arch", "double", "--preset", size), LR_2E3, (0.0, 0.1, 0.5))),
        "double", (("double", "decoder-only"),))


COMPARISONS: dict[str, Comparison] = {c.name: c for c in [
    _double("tiny", 300),  # RESULTS' 300 steps
    _double("mini", 150),  # half of RESULTS' 300 steps: 22 runs of ~2 s a step fit in about two hours
    Comparison("looped-corpus", "looped vs its same-size non-looped twin vs the full-depth model, toy corpus "
                                "(Table 2's protocol: plt.py's `tiny` 2 layers, looped twice or run once; 4-layer "
                                "vanilla `tiny`)",
               "Parallel Loop Transformer: Table 2 at CPU scale", 800, TEXT,
               tuple(Side(n, PLT_ROWS[n], LR_PLT) for n in ("loop-2", "vanilla-2", "vanilla-4")),
               "loss", (("loop-2", "vanilla-2"), ("loop-2", "vanilla-4"))),
    Comparison("looped-phop", "looped vs its same-size non-looped twin vs the full-depth model on p-hop (the Depth "
                              "recipe: 800 steps x 32 sequences)",
               "Parallel Loop Transformer: Depth", 800, PHOP,
               tuple(Side(n, PLT_ROWS[n], LR_2E3) for n in ("loop-2", "vanilla-2", "vanilla-4")),
               "acc", (("loop-2", "vanilla-2"), ("loop-2", "vanilla-4")), seeds=(0, 1, 2)),
    Comparison("relaxed", "relaxed (Average + SVD LoRA rank 16) vs recursive (Stepwise), B = 2, both uptrained from "
                          "one vanilla `tiny` source",
               "Recursive and Relaxed Recursive Transformers: conversion and rank", 300, TEXT,
               (Side("recursive", ("--arch", "recursive", "--loops", "2", "--init", "stepwise"), LR_2E3,
                     source="vanilla"),
                Side("relaxed", ("--arch", "relaxed", "--loops", "2", "--init", "average", "--lora-rank", "16",
                                 "--lora-init", "svd"), LR_2E3, source="vanilla")),
               "loss", (("relaxed", "recursive"),), sources=VANILLA_SOURCE),
    Comparison("block", "Block Transformer uptrained from a vanilla `tiny` checkpoint (Appendix N) vs that vanilla "
                        "model trained on for the same tokens",
               "Block Transformer at matched parameters and at matched inference cost", 300, TEXT,
               (Side("block-up", ("--arch", "block"), LR_2E3, source="vanilla"),
                Side("vanilla", ("--arch", "vanilla"), LR_2E3, source="vanilla")),
               "block", (("block-up", "vanilla"),),
               # the layout reference of the vanilla runs' targets: a Block Transformer converted from the source
               sources={**VANILLA_SOURCE, "layout": ("--arch", "block", "--init-from", "@vanilla", "--max-iters", "1",
                                                     "--eval-iters", "1", "--sample-tokens", "0")}),
    Comparison("plt", "PLT-2 vs vanilla and the sequential loop-2 (Table 2's protocol)",
               "Parallel Loop Transformer: Table 2 at CPU scale", 800, TEXT,
               tuple(Side(n, PLT_ROWS[n], LR_PLT) for n in ("plt-2", "vanilla-2", "loop-2")),
               "loss", (("plt-2", "vanilla-2"), ("plt-2", "loop-2"))),
]}


# ----------------------------------------------------------------------------------------------------------------
# The plan: every run of a sweep, each with its commands and the key its result is recorded under


@dataclass
class Run:
    kind: str  # source | grid | seed
    name: str  # the run's directory and log name
    side: str | None
    lr: float | None
    wd: float | None
    seed: int
    argv: list[str]  # train.py's flags, without --out-dir and --cache-dir
    key: str  # sha1 of what decides the result: train.py's flags, the source's key, the score
    out: Path  # train.py's --out-dir
    tag: str = ""  # "[i/N]" in the progress lines

    @property
    def ckpt(self) -> Path:
        return self.out / "ckpt.pt"


def _g(v: float) -> str:
    return f"{v:g}"


def run_key(argv: list[str], extra: str) -> str:
    return hashlib.sha1(json.dumps([argv, extra]).encode()).hexdigest()[:12]


def source_runs(comp: Comparison, out: Path, results: dict[str, dict] | None = None) -> dict[str, Run]:
    """The comparison's sources in order (one may start from an earlier one: '@name' stands for its checkpoint). A
    source copied from another sweep (--reuse) is used where that sweep wrote it."""
    runs = {}
    for name, flags in comp.sources.items():
        argv, deps = [], []
        for a in flags:
            if a.startswith("@"):
                deps.append(runs[a[1:]].key)
                a = str(runs[a[1:]].ckpt)
            argv.append(a)
        paths = {str(r.ckpt) for r in runs.values()}
        key = run_key([x for x in argv if x not in paths], "source " + " ".join(deps))
        seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 1337
        run = Run("source", f"source-{name}-{key[:6]}", None, None, None, seed, argv, key,
                  out / "sources" / f"{name}-{key[:6]}")
        rec = (results or {}).get(key)
        if rec is not None and "reused_from" in rec:
            run.out = Path(rec["ckpt"]).parent
        runs[name] = run
    return runs


def side_run(comp: Comparison, side: Side, lr: float, wd: float, seed: int, kind: str, out: Path, steps: int,
             sources: dict[str, Run]) -> Run:
    argv = [*side.flags, *comp.recipe_flags(steps), "--lr", _g(lr), "--weight-decay", _g(wd), "--seed", str(seed)]
    src = sources.get(side.source) if side.source else None
    key = run_key(argv, f"{comp.score} {src.key if src else ''}")
    if src is not None:
        argv += ["--init-from", str(src.ckpt)]
    name = f"{side.name}-lr{_g(lr)}-wd{_g(wd)}-s{seed}-{key[:6]}"
    return Run(kind, name, side.name, lr, wd, seed, argv, key, out / "runs" / name)


def grid_runs(comp: Comparison, out: Path, steps: int, sources: dict[str, Run],
              results: dict[str, dict] | None = None) -> list[Run]:
    """Every side's grid at the first seed: its learning rates (side_lrs: extended as far as the results decide) x
    its weight decays."""
    return [run for side in comp.sides for run in side_grid(comp, side, side_lrs(comp, side, out, steps, sources,
                                                                                 results), out, steps, sources)]


def side_grid(comp, side, lrs, out, steps, sources) -> list[Run]:
    return [side_run(comp, side, lr, wd, comp.seeds[0], "grid", out, steps, sources) for lr in lrs for wd in side.wds]


def side_lrs(comp: Comparison, side: Side, out: Path, steps: int, sources: dict[str, Run],
             results: dict[str, dict] | None) -> list[float]:
    """The side's learning rates: its grid's, and once all of them have a result and the best lies at the lowest or
    highest, the next one beyond that edge (/2 or x2), up to comp.extend times."""
    lrs = sorted(side.lrs)
    for _ in range(comp.extend if results is not None and len(lrs) > 1 else 0):
        runs = side_grid(comp, side, lrs, out, steps, sources)
        best = best_of(comp, runs, results)
        if best is None or lrs[0] < best.lr < lrs[-1]:
            break
        lrs = [lrs[0] / 2, *lrs] if best.lr == lrs[0] else [*lrs, lrs[-1] * 2]
    return lrs


def seed_runs(comp: Comparison, best: dict[str, Run], out: Path, steps: int, sources: dict[str, Run]) -> list[Run]:
    """Each side's best grid setting (best: side -> its grid run) at the other seeds."""
    return [side_run(comp, side, best[side.name].lr, best[side.name].wd, seed, "seed", out, steps, sources)
            for side in comp.sides if side.name in best for seed in comp.seeds[1:]]


def total_runs(comp: Comparison, grid: list[Run] | None = None) -> int:
    """Sources + grid + seeds: the grid as planned so far (grid; default: no learning rate beyond the edges yet)."""
    n_grid = len(grid) if grid is not None else sum(len(s.lrs) * len(s.wds) for s in comp.sides)
    return len(comp.sources) + n_grid + len(comp.sides) * (len(comp.seeds) - 1)


# ----------------------------------------------------------------------------------------------------------------
# Commands and their output


def train_cmd(run: Run, cache_dir: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *run.argv, "--out-dir", str(run.out), "--cache-dir", cache_dir]


def resume_cmd(run: Run, cache_dir: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--resume", "--out-dir", str(run.out), "--cache-dir", cache_dir]


def score_cmd(comp: Comparison, run: Run, cache_dir: str, layout: Run | None) -> list[str] | None:
    """The evaluation of a run's checkpoint, or None where its own val line is the score (acc) or it is a source."""
    ev = [sys.executable, str(ROOT / "eval.py")]
    if run.kind == "source" or comp.score == "acc":
        return None
    if comp.score == "loss":
        return [*ev, "loss", "--model", str(run.ckpt), "--seq-len", "256", "--tokens", str(LOSS_TOKENS),
                "--batch-size", "16", "--cache-dir", cache_dir]
    if comp.score == "double":
        return [*ev, "double-eval", str(run.ckpt), "--batches", "50", "--cache-dir", cache_dir]
    if comp.score == "block":
        ref = [] if run.argv[run.argv.index("--arch") + 1] == "block" else [str(layout.ckpt)]
        return [*ev, "block", "--eval", *ref, str(run.ckpt), "--cache-dir", cache_dir]
    raise ValueError(comp.score)


VAL = re.compile(r"^val step (\d+) loss ([-\d.naif]+)")


def parse_val(lines: list[str]) -> tuple[float | None, dict | None]:
    """train.py's last `val step N loss X [acc p1 A ...]` line -> (X, {p: accuracy} or None)."""
    val, acc = None, None
    for line in lines:
        m = VAL.match(line)
        if m:
            val = float(m.group(2))
            acc = ({q: float(v) for q, v in re.findall(r"p(\d+) ([\d.]+)", line.split(" acc ", 1)[1])}
                   if " acc " in line else None)
    return val, acc


def parse_score(comp: Comparison, run: Run, lines: list[str], val: float | None, acc: dict | None
                ) -> tuple[float | None, dict]:
    """-> (the score, extra figures) from the score command's output (or the run's own val line)."""
    text = "".join(lines)
    if comp.score == "acc":
        return (statistics.mean(acc.values()) if acc else None), {f"p{q}": v for q, v in sorted((acc or {}).items())}
    if comp.score == "loss":
        m = re.search(r"\| loss ([\d.]+) ppl", text)
        return (float(m.group(1)) if m else None), {}
    if comp.score == "double":
        m = re.search(r"native loss ([\d.]+) \| prefix-LM suffix loss ([\d.]+)", text)
        return (float(m.group(1)), {"prefix_lm": float(m.group(2))}) if m else (None, {})
    if comp.score == "block":
        for line in lines:
            parts = line.split()
            if parts and parts[0] == str(run.ckpt) and len(parts) >= 3:
                return float(parts[2]), {}
        return None, {}
    raise ValueError(comp.score)


def shown(cmd: list[str] | None, lock: str | None) -> str:
    """A command as a user would type it (python for the interpreter, paths relative to the repository)."""
    if cmd is None:
        return ""
    words = ["python" if c == sys.executable else os.path.relpath(c, ROOT) if c.startswith(str(ROOT) + "/") else c
             for c in cmd]
    return (f"flock {lock} " if lock else "") + shlex.join(words)


# ----------------------------------------------------------------------------------------------------------------
# Running: the real runner holds the CPU lock around a run; tests hand in a fake one with the same two methods


class ChildRunner:
    """Runs commands as child processes, each line of their output (stdout and stderr) into a log file, under the
    CPU lock (held(): flock(2) on `lock`, the lock `flock LOCK CMD` takes; released after the run, then --pause
    seconds before the next run takes it). A Ctrl-C or SIGTERM is passed on to the child once (train.py finishes its
    step and writes its checkpoint), then raised again here when the child has ended."""

    def __init__(self, lock: str | None, pause: float, echo=print, threads: int | None = None):
        self.lock, self.pause, self.echo, self.threads = lock, pause, echo, threads
        self.live = set()  # the children running now (several with --parallel)
        self.env = {**os.environ, "TQDM_DISABLE": "1"}  # no progress bars in the logs
        if threads:
            self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))

    def interrupt(self, e: BaseException):
        """A Ctrl-C or SIGTERM that reached this process while other threads wait on children: passed on to each."""
        for proc in list(self.live):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)

    @contextlib.contextmanager
    def held(self):
        if not self.lock:
            yield
            return
        fd = os.open(os.path.expanduser(self.lock), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.echo(f"    waiting for the CPU lock {self.lock} (another job holds it)")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock
        time.sleep(self.pause)

    def run(self, cmd: list[str], log: Path) -> tuple[int, list[str]]:
        lines, interrupted = [], None
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, errors="replace", env=self.env)
            self.live.add(proc)
            while True:
                try:
                    for line in proc.stdout:
                        f.write(line)
                        f.flush()
                        lines.append(line)
                    code = proc.wait()
                    break
                except KeyboardInterrupt as e:
                    if proc.poll() is None and interrupted is None:
                        proc.send_signal(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
                    interrupted = interrupted or e
        self.live.discard(proc)
        if interrupted is not None:
            raise interrupted
        return code, lines


# ----------------------------------------------------------------------------------------------------------------
# Results: OUT/results.jsonl, one line per run as it ends

STATUSES = ("trained", "done", "failed")


def record_problem(r: dict) -> str | None:
    problem = fields_problem(r, {"key": str, "status": str, "kind": str, "name": str})
    if problem:
        return problem
    if r["status"] not in STATUSES:
        return f"'status' is {r['status']!r}, not one of {', '.join(STATUSES)}"
    if r["kind"] != "source":
        problem = fields_problem(r, {"side": str, "lr": float, "wd": float, "seed": int})
    if not problem and r["status"] == "done" and r["kind"] != "source":
        score = r.get("score")
        if not (isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score)):
            return "a finished run's 'score' is not a finite number"
    return problem


def read_results(path: Path, missing_ok=True) -> dict[str, dict]:
    """OUT/results.jsonl -> {key: its last record}. A line that is not one of this module's records is one
    UsageError naming the file and the line (cli.read_json)."""
    if missing_ok and not os.path.lexists(path):
        return {}
    recs = read_json(path, "results file", "a record of a sweep run", record_problem, lines=True, damaged=True,
                     missing="does not exist (python eval.py sweep COMPARISON writes it)",
                     fix="delete or mend that line; the sweep runs again what has no record")
    return {r["key"]: r for r in recs}


def results_of(comp: Comparison, out: Path, steps: int, results: dict[str, dict]
               ) -> tuple[dict[str, Run], list[Run], dict[str, Run], list[Run]]:
    """The plan as far as the results decide it -> (sources, grid runs, each side's best grid run, seed runs)."""
    sources = source_runs(comp, out, results)
    grid = grid_runs(comp, out, steps, sources, results)
    best = best_per_side(comp, grid, results)
    return sources, grid, best, seed_runs(comp, best, out, steps, sources)


def best_per_side(comp: Comparison, grid: list[Run], results: dict[str, dict]) -> dict[str, Run]:
    """side -> its best grid run, once every grid run of the side has a result (finished or failed); failed runs rank
    last. Higher is better for acc, lower for the losses."""
    best = {}
    for side in comp.sides:
        run = best_of(comp, [r for r in grid if r.side == side.name], results)
        if run is not None:
            best[side.name] = run
    return best


def best_of(comp: Comparison, runs: list[Run], results: dict[str, dict]) -> Run | None:
    """The best of runs once all have a result (finished or failed; failed rank last), else None."""
    recs = [results.get(r.key) for r in runs]
    if not runs or any(rec is None or rec["status"] not in ("done", "failed") for rec in recs):
        return None
    scored = [(rank_value(comp, rec), i) for i, rec in enumerate(recs) if rec["status"] == "done"]
    return runs[min(scored)[1]] if scored else None


def rank_value(comp: Comparison, rec: dict) -> float:
    return -rec["score"] if comp.score == "acc" else rec["score"]


def cpu_line(threads: int | None = None) -> str:
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    import torch
    threads = threads or torch.get_num_threads()
    per_run = f"{threads} thread{'s' if threads != 1 else ''} a run"
    return f"{name}, {os.cpu_count()} cores, {per_run}, torch {torch.__version__}"


# ----------------------------------------------------------------------------------------------------------------
# The sweep


def sweep(comp: Comparison, out: Path, runner, cache_dir: str = "data_cache", steps: int | None = None,
          reuse: list[Path] = (), lock: str | None = None, echo=print, parallel: int = 1) -> dict[str, dict]:
    """Every run of the comparison that has no result in OUT/results.jsonl, in order (sources, the grid, each side's
    best at the other seeds), each result appended as the run ends; the table and plot rewritten after each group.
    parallel > 1: that many runs at once under one hold of the CPU lock (the grid's runs, then the seeds'; the
    sources one by one). -> the results {key: record}."""
    steps = steps or comp.steps
    results_file = out / "results.jsonl"
    results = read_results(results_file)
    reused = {}
    for d in reuse:
        reused.update({k: r for k, r in read_results(Path(d) / "results.jsonl", missing_ok=False).items()
                       if r["status"] in ("done", "failed")})
    n_total, t_start, timings = total_runs(comp), time.time(), []
    i, queued = 0, set()  # runs numbered so far; keys of those numbered to run and not yet finished

    def todo(run: Run) -> bool:
        """Numbers the run; False where its result is recorded here or copied from a --reuse sweep."""
        nonlocal i
        i += 1
        rec = results.get(run.key)
        if rec is not None and rec["status"] in ("done", "failed"):
            echo(f"[{i}/{n_total}] {describe(run)}: recorded -> {score_text(comp, rec)}")
            return False
        if run.key in reused and (run.kind != "source" or Path(reused[run.key]["ckpt"]).is_file()):
            rec = {**reused[run.key], "reused_from": str(reuse_dir_of(run.key, reuse))}
            append_line(results_file, json.dumps(rec))
            results[run.key] = rec
            echo(f"[{i}/{n_total}] {describe(run)}: reused from {rec['reused_from']} -> {score_text(comp, rec)}")
            return False
        run.tag = f"[{i}/{n_total}]"
        queued.add(run.key)
        return True

    def work(run: Run, layout: Run | None, t0: float):
        rec = execute(comp, run, results.get(run.key), runner, cache_dir, layout, results_file, lock, echo, run.tag,
                      t0)
        results[run.key] = rec
        if rec.get("wall_s"):
            timings.append(rec["wall_s"])
        queued.discard(run.key)
        # the phase's runs still to run (a later phase's are not known yet: the seeds wait for the grid)
        left = len(queued)
        eta = (f"; ~{fmt_minutes(statistics.mean(timings) * left / parallel)} for the {left} runs queued"
               if timings and left else "")
        echo(f"{run.tag} -> {score_text(comp, rec)} | {fmt_minutes(rec.get('wall_s', 0))}; sweep "
             f"{fmt_minutes(time.time() - t_start)} in{eta}")

    def phase(runs: list[Run], layout: Run | None, size: int):
        """The runs without a result, `size` at a time, each group under one hold of the CPU lock."""
        runs = [r for r in runs if todo(r)]
        for k in range(0, len(runs), size):
            group, t0 = runs[k:k + size], time.time()
            with runner.held():
                if len(group) == 1:
                    work(group[0], layout, t0)
                else:
                    together(runner, [lambda r=r, t0=t0: work(r, layout, t0) for r in group])
            write_report(comp, out, steps, results, png=False)  # the PNG once at the end: matplotlib takes a while

    check_writable_dir(out, "--out")
    check_output_file(results_file, "--out's results file")
    (out / "logs").mkdir(exist_ok=True)
    for name in comp.sources:  # in order: a source's flags name the checkpoints of the ones before it
        phase([source_runs(comp, out, results)[name]], None, 1)
        run = source_runs(comp, out, results)[name]
        if results[run.key]["status"] != "done" or not run.ckpt.is_file():
            raise UsageError(f"the source {run.name} did not train: {results[run.key].get('error', '')} (log "
                             f"{out / 'logs' / (run.name + '.log')})")
    sources = source_runs(comp, out, results)
    layout = sources.get("layout")
    planned: set[str] = set()
    while True:  # the grid, then each learning rate beyond an edge that a side's best lies on (side_lrs)
        grid = grid_runs(comp, out, steps, sources, results)
        new = [r for r in grid if r.key not in planned]
        if not new:
            break
        if planned:
            echo(f"    a best learning rate at the edge of its side's grid: {len(new)} more grid runs")
        planned |= {r.key for r in new}
        n_total = total_runs(comp, grid)
        phase(new, layout, parallel)
    best = best_per_side(comp, grid, results)
    phase(seed_runs(comp, best, out, steps, sources), layout, parallel)
    write_report(comp, out, steps, results)
    return results


def together(runner, jobs: list):
    """jobs (each a function: one run) in threads at once; the first error of any is raised after all have ended. A
    Ctrl-C or SIGTERM (this thread's) is passed on to every child, then raised when all have ended."""
    errors = []

    def guard(job):
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt as e:
        runner_interrupt = getattr(runner, "interrupt", None)
        if runner_interrupt is not None:
            runner_interrupt(e)
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]


def reuse_dir_of(key: str, reuse) -> Path | None:
    for d in reuse:
        if key in read_results(Path(d) / "results.jsonl"):
            return Path(d)
    return None


def describe(run: Run) -> str:
    if run.kind == "source":
        return f"source {run.name}"
    return f"{run.side} lr {_g(run.lr)} wd {_g(run.wd)} seed {run.seed}"


def score_text(comp: Comparison, rec: dict) -> str:
    if rec["status"] == "failed":
        return f"failed: {rec.get('error', '')}"
    val = f"val {rec['val']:.4f}" if isinstance(rec.get("val"), (int, float)) else "val -"
    if rec["kind"] == "source":
        return val
    extras = "".join(f" {k} {v:.4f}" for k, v in (rec.get("extras") or {}).items())
    return f"{val} | score {rec['score']:.4f}{extras}"


def rel(path: Path) -> str:
    r = os.path.relpath(path)
    return str(path) if r.startswith("..") else r


def fmt_minutes(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"


def was_stopped(code: int) -> bool:
    """A child's exit code that says it was stopped (cli's `stopped: ...`, 130, or killed by SIGINT), not that it
    failed: the sweep stops too, and the run's checkpoint stays for the resume."""
    return code == 130 or code == -signal.SIGINT


def execute(comp, run: Run, rec, runner, cache_dir, layout, results_file, lock, echo, tag, t0) -> dict:
    """One run: train (or resume, or only score where its training is recorded), score, record; t0: when its group
    asked for the CPU lock. -> its record."""
    log = results_file.parent / "logs" / f"{run.name}.log"
    base = {"comparison": comp.name, "key": run.key, "kind": run.kind, "name": run.name, "side": run.side,
            "lr": run.lr, "wd": run.wd, "seed": run.seed, "argv": run.argv, "ckpt": str(run.ckpt)}
    if run.kind == "source":
        base = {k: v for k, v in base.items() if k not in ("side", "lr", "wd")}
    scmd = score_cmd(comp, run, cache_dir, layout)
    echo(f"{tag} {describe(run)}: {shown(train_cmd(run, cache_dir), lock)}"
         + (f" && {shown(scmd, lock)}" if scmd else "") + f"  (log {rel(log)})")
    t1 = time.time()
    # the caller holds the CPU lock (sweep: one hold per group of --parallel runs)
    if rec is not None and rec["status"] == "trained" and run.ckpt.is_file():
        val, acc, train_s = rec.get("val"), rec.get("acc"), rec.get("train_s", 0.0)
    else:
        resume = run.ckpt.is_file()
        code, lines = runner.run(resume_cmd(run, cache_dir) if resume else train_cmd(run, cache_dir), log)
        val, acc = parse_val(lines)
        if resume and not was_stopped(code) and (code != 0 or val is None):  # a checkpoint it cannot continue
            echo(f"    {run.name}: its checkpoint did not resume (exit code {code}); training it again")
            run.ckpt.unlink()
            code, lines = runner.run(train_cmd(run, cache_dir), log)
            val, acc = parse_val(lines)
        if was_stopped(code):
            raise Stopped(f"run {run.name} was stopped; its checkpoint is in {run.out}: the same command "
                          f"resumes the sweep there")
        if code == 2 or (code == 0 and val is None) or (val is not None and not math.isfinite(val)):
            error = next((ln.strip() for ln in reversed(lines) if ln.startswith("error:")),
                         f"exit code {code}, no val line")
            failed = {**base, "status": "failed", "error": error[:300], "wall_s": time.time() - t1}
            append_line(results_file, json.dumps(failed))
            return failed
        if code != 0:
            raise UsageError(f"run {run.name} failed with exit code {code} (log {log}); the same command "
                             f"tries it again")
        train_s = time.time() - t1
        if scmd is not None:  # its training is kept if the evaluation is stopped
            append_line(results_file, json.dumps({**base, "status": "trained", "val": val, "acc": acc,
                                                  "train_s": train_s}))
    if scmd is None:
        score, extras = (None, {}) if run.kind == "source" else parse_score(comp, run, [], val, acc)
    else:
        code, lines = runner.run(scmd, log)
        if was_stopped(code):
            raise Stopped(f"the evaluation of {run.name} was stopped: the same command resumes the sweep there")
        score, extras = parse_score(comp, run, lines, val, acc)
        if code != 0 or score is None:
            raise UsageError(f"the evaluation of {run.name} failed (exit code {code}; log {log}): "
                             + next((ln.strip() for ln in reversed(lines) if ln.startswith("error:")), ""))
    if score is None and run.kind != "source":
        failed = {**base, "status": "failed", "error": "no score in its output", "wall_s": time.time() - t1}
        append_line(results_file, json.dumps(failed))
        return failed
    done = {**base, "status": "done", "val": val, "acc": acc, "score": score, "extras": extras,
            "train_s": train_s, "wall_s": time.time() - t1, "waited_s": t1 - t0, "cpu": runner_cpu(runner),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    append_line(results_file, json.dumps(done))
    return done


def runner_cpu(runner) -> str:
    return getattr(runner, "cpu", None) or cpu_line(getattr(runner, "threads", None))


# ----------------------------------------------------------------------------------------------------------------
# The table and the plot


def side_results(comp: Comparison, steps: int, out: Path, results: dict[str, dict]):
    """-> (grid runs, best per side, {side: [records of the best setting, one per seed]})."""
    _, grid, best, seeds = results_of(comp, out, steps, results)
    per_seed = {}
    for side, run in best.items():
        recs = [results[run.key]] + [results[r.key] for r in seeds if r.side == side and r.key in results
                                     and results[r.key]["status"] == "done"]
        per_seed[side] = recs
    return grid, best, per_seed


def ran_lrs(grid: list[Run], side: Side) -> list[float]:
    """The side's learning rates in the grid as planned (its own and any beyond an edge), lowest first."""
    return sorted({r.lr for r in grid if r.side == side.name})


def mean_spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def edge_note(side: Side, run: Run, lrs: list[float]) -> str:
    """Where the best lies on an edge of what the side ran (lrs: its learning rates, extended or not)."""
    notes = []
    for what, grid, v in (("lr", lrs, run.lr), ("weight decay", side.wds, run.wd)):
        if len(grid) > 1 and v in (min(grid), max(grid)):
            notes.append(f"{what} {_g(v)} is at the {'lower' if v == min(grid) else 'upper'} edge of the grid")
    return "; ".join(notes)


def extend_rule(comp: Comparison) -> str:
    """The grid's extension (side_lrs) in words, for the table and the plan."""
    return ("a side whose best learning rate lies at an edge of its grid runs the next one beyond it, x2 or /2, at "
            "every weight decay" + (f", up to {comp.extend} times" if comp.extend > 1 else ""))


def budget_line(comp: Comparison, steps: int, results: dict[str, dict], keys: set[str], n_total: int) -> str:
    argv = comp.recipe_flags(steps)
    if comp.score == "acc":
        per_step, what = f"{argv[argv.index('--batch-size') + 1]} sequences", "p-hop"
    else:
        b, t = int(argv[argv.index("--batch-size") + 1]), int(argv[argv.index("--seq-len") + 1])
        per_step, what = f"{b} x {t} tokens", f"{steps * b * t / 1e6:.2f}M tokens"
    recs = [results[k] for k in keys if k in results and results[k]["status"] in ("done", "failed")]
    spent = sum(r.get("wall_s") or 0 for r in recs if "reused_from" not in r)
    cpus = sorted({r["cpu"] for r in recs if r.get("cpu")})
    extend = f" ({extend_rule(comp)})" if comp.extend else ""
    return (f"Budget per run: {steps} steps x {per_step} ({what}), warmup {min(200, steps // 10)} steps then cosine "
            f"to lr / 10, the same for every side and seed; grid at seed {comp.seeds[0]}{extend}, each side's best "
            f"again at seeds {', '.join(map(str, comp.seeds[1:]))}. {len(recs)} of {n_total} runs "
            f"recorded"
            + (f" ({sum('reused_from' in r for r in recs)} copied from an identical run of another sweep)"
               if any("reused_from" in r for r in recs) else "")
            + f", {fmt_minutes(spent)} of training and evaluation" + (f" on {'; '.join(cpus)}" if cpus else "")
            + " (lock waits excluded).")


def table(comp: Comparison, out: Path, steps: int, results: dict[str, dict]) -> str:
    sources, grid, best, seeds = results_of(comp, out, steps, results)
    _, _, per_seed = side_results(comp, steps, out, results)
    keys = {r.key for r in [*sources.values(), *grid, *seeds]}
    lines = [f"## {comp.name}: {comp.title}", "", f"RESULTS.md: {comp.section}. Score: {SCORES[comp.score]}.", "",
             budget_line(comp, steps, results, keys, total_runs(comp, grid)), "",
             f"Rerun: `python eval.py sweep {comp.name}" + (f" --steps {steps}" if steps != comp.steps else "")
             + " --out DIR` (resumes where DIR's results.jsonl stops); the table: the same with `--table`.", ""]
    if comp.sources:
        lines.append("Sources (trained once, every uptraining run starts from them): " + "; ".join(
            f"{name}: `python train.py {shlex.join(r.argv)}`" + (
                f" val {results[r.key]['val']:.4f}" if r.key in results and
                isinstance(results[r.key].get("val"), (int, float)) else "") for name, r in sources.items()))
        lines.append("")
    # each side's grid: lr rows x weight-decay columns at the grid seed
    lines.append(f"Grid, seed {comp.seeds[0]} (score; **best** of the side):")
    lines.append("")
    wds = sorted({wd for s in comp.sides for wd in s.wds})
    lines.append("| side | lr | " + " | ".join(f"wd {_g(w)}" for w in wds) + " |")
    lines.append("|---|---|" + "---|" * len(wds))
    by_setting = {(r.side, r.lr, r.wd): r for r in grid}
    for side in comp.sides:
        for lr in ran_lrs(grid, side):
            cells = []
            for wd in wds:
                run = by_setting.get((side.name, lr, wd))
                rec = results.get(run.key) if run else None
                if run is None:
                    cells.append("")
                elif rec is None or rec["status"] == "trained":
                    cells.append("…")
                elif rec["status"] == "failed":
                    cells.append("failed")
                else:
                    v = f"{rec['score']:.3f}"
                    cells.append(f"**{v}**" if best.get(side.name) is run else v)
            lines.append(f"| {side.name} | {_g(lr)} | " + " | ".join(cells) + " |")
    lines.append("")
    extra_names = sorted({k for recs in per_seed.values() for r in recs for k in (r.get("extras") or {})})
    lines.append("Each side at its own best setting, every seed (mean ± half the range):")
    lines.append("")
    lines.append("| side | lr | wd | " + " | ".join(f"seed {s}" for s in comp.seeds) + " | mean ± spread | "
                 + "".join(f"{k} | " for k in extra_names) + "note |")
    lines.append("|---|---|---|" + "---|" * (len(comp.seeds) + 2 + len(extra_names)))
    for side in comp.sides:
        run = best.get(side.name)
        if run is None:
            lines.append(f"| {side.name} | (grid not finished) |" + " |" * (len(comp.seeds) + 3 + len(extra_names)))
            continue
        recs = {r["seed"]: r for r in per_seed[side.name]}
        cells = [f"{recs[s]['score']:.3f}" if s in recs else "…" for s in comp.seeds]
        scores = [recs[s]["score"] for s in comp.seeds if s in recs]
        ex = [mean_spread([recs[s]["extras"][k] for s in comp.seeds if s in recs and k in recs[s]["extras"]])
              for k in extra_names]
        lines.append(f"| {side.name} | {_g(run.lr)} | {_g(run.wd)} | " + " | ".join(cells) +
                     f" | **{mean_spread(scores)}** | " + "".join(f"{e} | " for e in ex)
                     + f"{edge_note(side, run, ran_lrs(grid, side))} |")
    lines.append("")
    for a, b in comp.contrasts:
        ra, rb = {r["seed"]: r["score"] for r in per_seed.get(a, [])}, {r["seed"]: r["score"] for r in
                                                                         per_seed.get(b, [])}
        common = [s for s in comp.seeds if s in ra and s in rb]
        if not common:
            lines.append(f"- {a} − {b}: not yet measured")
            continue
        diffs = [ra[s] - rb[s] for s in common]
        full = len(common) == len(comp.seeds)
        gap = statistics.mean(ra.values()) - statistics.mean(rb.values())
        lines.append(f"- {a} − {b}, each at its best setting: **{gap:+.3f}**"
                     f" (mean over seeds; per seed {', '.join(f'{d:+.3f}' for d in diffs)}"
                     + ("" if full else f"; {len(common)} of {len(comp.seeds)} seeds so far") + ")"
                     + (" -- higher is better" if comp.score == "acc" else " -- negative: a is better"))
    return "\n".join(lines) + "\n"


def text_plot(comp: Comparison, out: Path, steps: int, results: dict[str, dict], width: int = 40) -> str:
    """Score against lr per side (and weight decay), as bars between the sweep's lowest and highest score; the best
    setting's seeds below."""
    grid, best, per_seed = side_results(comp, steps, out, results)
    done = [(r, results[r.key]) for r in grid if r.key in results and results[r.key]["status"] == "done"]
    lines = [f"{comp.name}: score against lr ({'higher' if comp.score == 'acc' else 'lower'} is better); "
             f"# = the score between the lowest and highest of the sweep"]
    if not done:
        return "\n".join(lines + ["(no result yet)"]) + "\n"
    allv = [rec["score"] for _, rec in done] + [r["score"] for recs in per_seed.values() for r in recs]
    lo, hi = min(allv), max(allv)

    def bar(v):
        n = 1 + round((v - lo) / (hi - lo) * (width - 1)) if hi > lo else width
        return "#" * n + " " * (width - n)

    for side in comp.sides:
        lines.append(f"{side.name}")
        for wd in side.wds:
            for lr in ran_lrs(grid, side):
                run = next(r for r in grid if r.side == side.name and r.lr == lr and r.wd == wd)
                rec = results.get(run.key)
                cell = (f"|{bar(rec['score'])}| {rec['score']:.4f}" if rec and rec["status"] == "done"
                        else "| failed" if rec and rec["status"] == "failed" else "| …")
                mark = " <- best" if best.get(side.name) is run else ""
                lines.append(f"  lr {_g(lr):>6s} wd {_g(wd):>4s} {cell}{mark}")
        for r in per_seed.get(side.name, []):
            lines.append(f"  best, seed {r['seed']:<6d}  |{bar(r['score'])}| {r['score']:.4f}")
    return "\n".join(lines) + "\n"


def png_plot(comp: Comparison, out: Path, steps: int, results: dict[str, dict], path: Path) -> Path | None:
    """Score against lr (log) per side and weight decay, the best setting's seeds as points; None without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grid, best, per_seed = side_results(comp, steps, out, results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, side in enumerate(comp.sides):
        color = f"C{k}"
        for j, wd in enumerate(side.wds):
            pts = [(r.lr, results[r.key]["score"]) for r in grid if r.side == side.name and r.wd == wd
                   and r.key in results and results[r.key]["status"] == "done"]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", color=color, linestyle=["-", "--", ":"][j % 3],
                        label=side.name + (f" wd {_g(wd)}" if len(side.wds) > 1 else ""))
        recs = per_seed.get(side.name, [])
        if recs:
            ax.scatter([best[side.name].lr * (1 + 0.03 * (i - 1)) for i in range(len(recs))],
                       [r["score"] for r in recs], color=color, marker="x", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("score (" + ("accuracy, mean over p" if comp.score == "acc" else "loss, nats") + ")")
    ax.set_title(f"{comp.name}: grid at seed {comp.seeds[0]}; x = each side's best at every seed", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return save_png(fig, path)


def write_report(comp: Comparison, out: Path, steps: int, results: dict[str, dict], png: bool = True
                 ) -> tuple[str, str, Path | None]:
    """OUT/table.md, OUT/plot.txt and (png, with matplotlib) OUT/plot.png from the results."""
    t, p = table(comp, out, steps, results), text_plot(comp, out, steps, results)
    write_atomic(out / "table.md", t, "table")
    write_atomic(out / "plot.txt", p, "plot")
    return t, p, png_plot(comp, out, steps, results, out / "plot.png") if png else None


# ----------------------------------------------------------------------------------------------------------------
# The command (eval.py sweep)


def add_args(p):
    pos = number(int, min=1)
    p.add_argument("comparison", choices=sorted(COMPARISONS), metavar="COMPARISON",
                   help="one of: " + "; ".join(f"{c.name} ({c.title})" for c in COMPARISONS.values()))
    p.add_argument("--out", type=path_arg, default=None,
                   help="results, checkpoints, logs, table, plot (default out/sweeps/COMPARISON)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (every command) and run nothing")
    p.add_argument("--table", action="store_true", help="print the table from the results so far; run nothing")
    p.add_argument("--plot", action="store_true", help="write the plot (OUT/plot.txt; plot.png with matplotlib) from "
                                                      "the results so far and print it; run nothing")
    p.add_argument("--steps", type=pos, default=None, help="steps per run (default: the comparison's protocol); "
                                                          "another value is another sweep (new runs)")
    p.add_argument("--reuse", type=comma_list(path_arg), default=None, metavar="DIRS",
                   help="comma-separated sweep folders: a run identical to one recorded there (the same flags and "
                        "score) is copied, not run")
    p.add_argument("--lock", type=path_arg, default="~/.cpu.lock", help="the CPU lock each run holds (flock)")
    p.add_argument("--no-lock", action="store_true", help="run without the CPU lock")
    p.add_argument("--pause", type=number(float, min=0), default=3.0,
                   help="seconds between releasing the lock and taking it again")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help="token cache of the runs")
    p.add_argument("--parallel", type=pos, default=1,
                   help="runs at once under one hold of the lock, one thread each (2 on two cores: small models "
                        "gain little from a second thread, and the sweep waits for the lock half as often)")


def main(args) -> dict | None:
    comp = COMPARISONS[args.comparison]
    out = Path(args.out or f"out/sweeps/{comp.name}")
    steps = args.steps or comp.steps
    if args.dry_run:
        print(plan_text(comp, out, steps, read_results(out / "results.jsonl"), args,
                        None if args.no_lock else args.lock))
        return None
    if args.table or args.plot:
        results = read_results(out / "results.jsonl", missing_ok=False)
        if args.table:
            print(table(comp, out, steps, results))
        if args.plot:
            check_writable_dir(out, "--out")
            _, p, png = write_report(comp, out, steps, results)
            print(p + f"plot: {out / 'plot.txt'}" + (f", {png}" if png else " (no PNG: matplotlib is not installed)"))
        return None
    reuse = [Path(d.strip()) for d in (args.reuse or "").split(",") if d.strip()]
    lock = None if args.no_lock else args.lock
    threads = 1 if args.parallel > 1 else None  # several runs at once: one thread each
    results = sweep(comp, out, ChildRunner(lock, args.pause, threads=threads), args.cache_dir, steps, reuse, lock,
                    parallel=args.parallel)
    print(table(comp, out, steps, results))
    print(f"table: {out / 'table.md'}, plot: {out / 'plot.txt'}" + (f", {out / 'plot.png'}" if (out / "plot.png")
                                                                  .is_file() else ""))
    return results


def plan_text(comp: Comparison, out: Path, steps: int, results: dict[str, dict], args, lock) -> str:
    sources, grid, best, seeds = results_of(comp, out, steps, results)
    layout = sources.get("layout")
    lines = [f"{comp.name}: {comp.title}", f"{total_runs(comp, grid)} runs; score: {SCORES[comp.score]}"]
    n = 0
    for run in [*sources.values(), *grid, *seeds]:
        n += 1
        state = results.get(run.key, {}).get("status", "to run")
        scmd = score_cmd(comp, run, args.cache_dir, layout)
        lines.append(f"[{n}] ({state}) {describe(run)}: {shown(train_cmd(run, args.cache_dir), lock)}"
                     + (f" && {shown(scmd, lock)}" if scmd else ""))
    if comp.extend:
        lines.append(f"then: {extend_rule(comp)}")
    for side in comp.sides:
        if side.name not in best:
            lines.append(f"then: {side.name}'s best grid setting again at seeds "
                         f"{', '.join(map(str, comp.seeds[1:]))} ({len(comp.seeds) - 1} runs)")
    return "\n".join(lines)
