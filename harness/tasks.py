"""Synthetic tasks that need depth: where looping a model's layers should buy what extra layers buy.

On language modelling at CPU scale a loop adds nothing measurable (RESULTS.md, Table 2: loop-2 = the 2-layer
vanilla), so the claim the looped papers sell (Relaxed Recursive Transformers section 1; PLT section 1: "loops add
quality at almost no latency") cannot show there. Tasks that need many sequential steps can (Saunshi et al. 2025,
"Reasoning with Latent Thoughts": on p-hop induction one layer looped k times matches k layers). This file generates
one such task offline, seeded, as train.py's data:

    python train.py --arch plt --data task:phop --task-p 1-4 --preset tiny --batch-size 32 --max-iters 800
    python -m harness.tasks show --task-p 3              # one sequence with its labels, readable
    python -m harness.tasks depth --seeds 0,1,2          # RESULTS.md's Depth table: every architecture on the task
    python -m harness.tasks table                        # the table again, from out/depth/results.jsonl

Its command line keeps the contract of every command here (cli.py): a mistake is one line `error: ...` and exit code 2,
found before the first run starts.

Dense p-hop induction (Saunshi et al., section 2, made dense: every position is a question):
  a marker token names p, then `length` symbols from an alphabet of `alphabet`. For symbol position j (0-based among
  the symbols) hop(j) = 1 + k where k is the last symbol position before j holding the same symbol (undefined if the
  symbol has not occurred before). The label at j is the symbol at hop^p(j), where all p hops are defined, and no
  label (IGNORE) otherwise. One hop is an induction head (two attention layers); p hops compose p of them, so a model
  needs depth that grows with p.

Pause tokens (`pause` = q, a remedy measured in RESULTS.md's Depth section): every symbol is followed by q filler
tokens and the label sits on the last of them, so a model has q more positions of computation per answer. With
cross-loop parallelism (plt.py) loop l at position i reads loop l-1 at position i-1: q >= L-1 fillers give the
diagonal of L loops room to start at the symbol itself.

Token ids: symbols 0..alphabet-1, markers alphabet..alphabet+MAX_P-1 (p = 1..MAX_P), one filler. Labels are read at
the position itself: targets[:, t] is the answer at token t (not the next token), so the task runs through every
model's forward(idx, targets) unchanged.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import argparse
import functools
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.cli import (ArgumentParser, UsageError, append_line, check_output_file, check_writable_dir, comma_list,
                         fields_problem, number, path_arg, read_json, run_child, run_cli, run_subcommand, seed_arg)
from model import IGNORE

MAX_P = 8  # markers in the vocabulary: a checkpoint trained on p <= 4 can be evaluated at p up to 8
# Symbols of the alphabet: a sequence's hops need repeated symbols, so an alphabet far beyond the sequence length only
# makes labels rare; and each batch keeps the last position of every symbol (batch x alphabet), so 10^12 would be an
# allocation no machine makes. 2^16 is far more than any length this task is run with.
MAX_ALPHABET = 2 ** 16


def parse_hops(text: str) -> tuple[int, ...]:
    """'1-4' -> (1, 2, 3, 4); '2,4' -> (2, 4)."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            lo, hi = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--task-p {text!r}: expected numbers and ranges such as 1-4 or 2,4") from None
        if not 1 <= lo <= hi <= MAX_P:  # checked before a range is expanded
            raise ValueError(f"--task-p {text!r}: hops must lie in 1..{MAX_P}, ranges going up")
        out += range(lo, hi + 1)
    return tuple(sorted(set(out)))


def hops_arg(text: str) -> str:
    """argparse type of --task-p: parse_hops must read it (the text is kept)."""
    try:
        parse_hops(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--task-p ")) from None
    return text


def previous_occurrence(sym: torch.Tensor) -> torch.Tensor:
    """sym (B, n) -> (B, n): the last k < j with sym[k] == sym[j], or -1."""
    B, n = sym.shape
    last = torch.full((B, int(sym.max()) + 1), -1, dtype=torch.long)  # last position of each symbol so far
    prev = torch.empty_like(sym)
    rows = torch.arange(B)
    for j in range(n):
        prev[:, j] = last[rows, sym[:, j]]
        last[rows, sym[:, j]] = j
    return prev


def hop_targets(sym: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sym (B, n) symbols, p (B,) hops -> (B, n) the symbol at hop^p(j), or IGNORE where a hop is undefined."""
    B, n = sym.shape
    hop = previous_occurrence(sym) + 1  # (B, n); 0 where undefined (k = -1)
    cur = torch.arange(n).expand(B, n).clone()
    ok = torch.ones(B, n, dtype=torch.bool)
    for step in range(int(p.max())):
        active = (step < p)[:, None]  # (B, 1): rows that still hop
        nxt = hop.gather(1, cur)
        ok &= ~active | (nxt > 0)
        cur = torch.where(active & ok, nxt, cur)
    return torch.where(ok, sym.gather(1, cur), IGNORE)


@dataclass
class PHopTask:
    """Dense p-hop induction; see the module docstring. `hops` are the p values a batch mixes uniformly."""

    hops: tuple[int, ...] = (1, 2, 3, 4)
    alphabet: int = 4
    length: int = 48
    pause: int = 0

    def __post_init__(self):
        if not 2 <= self.alphabet <= MAX_ALPHABET or self.length < 2 or self.pause < 0:
            raise ValueError(f"p-hop needs an alphabet in 2..{MAX_ALPHABET}, a length >= 2 and pause >= 0 (got "
                             f"{self.alphabet}, {self.length}, {self.pause})")
        if not self.hops or not all(isinstance(p, int) and 1 <= p <= MAX_P for p in self.hops):
            raise ValueError(f"p-hop needs hops in 1..{MAX_P} (the vocabulary's markers), got {list(self.hops)}")

    @property
    def filler(self) -> int:
        return self.alphabet + MAX_P

    @property
    def n_vocab(self) -> int:
        return self.alphabet + MAX_P + 1

    @property
    def seq_len(self) -> int:  # marker + length groups of (symbol, pause fillers)
        return 1 + self.length * (self.pause + 1)

    def batch(self, n: int, gen: torch.Generator, seq_len: int | None = None):
        """-> x, y (n, seq_len) int64: tokens and labels (IGNORE where none). seq_len >= self.seq_len right-pads
        with fillers that carry no label (block models need a multiple of their block length)."""
        T = self.seq_len if seq_len is None else seq_len
        self.check_seq_len(T)
        hops = torch.tensor(self.hops)
        p = hops[torch.randint(len(hops), (n,), generator=gen)]  # (n,)
        sym = torch.randint(self.alphabet, (n, self.length), generator=gen)  # (n, length)
        label = hop_targets(sym, p)
        g = self.pause + 1
        x = torch.full((n, T), self.filler, dtype=torch.long)
        y = torch.full((n, T), IGNORE, dtype=torch.long)
        x[:, 0] = self.alphabet + p - 1
        x[:, 1:self.seq_len:g] = sym
        y[:, g:self.seq_len:g] = label  # the last token of each group: the symbol itself when pause = 0
        return x, y

    def check_seq_len(self, T: int):
        if T < self.seq_len:
            raise ValueError(f"--seq-len {T} is shorter than the task's {self.seq_len} tokens "
                             f"(1 + length {self.length} x (1 + pause {self.pause}))")

    def hops_of(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] - self.alphabet + 1  # (B,)

    def score(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[int, tuple[int, int]]:
        """-> {p: (correct labels, labels)} of a batch: the argmax of the logits at each labelled position."""
        pred = logits[..., :self.alphabet].argmax(-1)  # answers are symbols
        hit, has = (pred == y) & (y != IGNORE), y != IGNORE
        p = self.hops_of(x)
        return {int(q): (int(hit[p == q].sum()), int(has[p == q].sum())) for q in p.unique()}

    def spec(self) -> dict:
        return {"kind": "task", "name": "phop", "hops": list(self.hops), "alphabet": self.alphabet,
                "length": self.length, "pause": self.pause}

    # -- readable tokens --
    def token_names(self) -> list[str]:
        letters = [chr(ord("a") + i) if i < 26 else f"s{i}" for i in range(self.alphabet)]
        return letters + [f"p{q}" for q in range(1, MAX_P + 1)] + ["_"]

    def show(self, x, y, pred=None) -> str:
        """One sequence: tokens on one line, labels under the labelled positions (and predictions, if given)."""
        names = self.token_names()
        lines = [" ".join(f"{names[t]:>2}" for t in x.tolist()),
                 " ".join(f"{names[t]:>2}" if t != IGNORE else " ." for t in y.tolist())]
        if pred is not None:
            lines.append(" ".join((f"{names[t]:>2}" if u != IGNORE else " .") for t, u in zip(pred.tolist(),
                                                                                          y.tolist())))
        return "\n".join(lines)


@torch.no_grad()
def answers_text(model, task: PHopTask, x, y, device) -> str:
    """train.py's sample at the end of a run on a task: the first sequence of x with its labels y and the model's
    greedy answers, readable."""
    model.eval()
    pred = model(x.to(device), y.to(device))[0].argmax(-1).cpu()
    return f"sample (p = {int(task.hops_of(x)[0])}; tokens, labels, answers):\n{task.show(x[0], y[0], pred[0])}"


def add_counts(total: dict, counts: dict):
    for q, (c, n) in counts.items():
        a, b = total.get(q, (0, 0))
        total[q] = (a + c, b + n)


def accuracies(counts: dict) -> dict[int, float]:
    """{p: (correct, n)} -> {p: accuracy}, in order of p."""
    return {q: c / max(n, 1) for q, (c, n) in sorted(counts.items())}


def accuracy_text(counts: dict) -> str:
    """{p: (correct, n)} -> 'acc p1 0.998 p2 0.951 ...' (greppable, in every step and val line)."""
    return "acc " + " ".join(f"p{q} {a:.3f}" for q, a in accuracies(counts).items())


# ----------------------------------------------------------------------------------------------------------------
# train.py's view: a tokenizer and a data source


def is_task_source(data: str) -> bool:
    return data.startswith("task:")


def task_from_spec(spec: dict) -> PHopTask:
    if spec.get("name") != "phop":
        raise ValueError(f"unknown task {spec.get('name')!r}; known: phop")
    return PHopTask(tuple(spec["hops"]), spec["alphabet"], spec["length"], spec["pause"])


def task_from_args(args) -> PHopTask:
    name = args.data.removeprefix("task:")
    if name != "phop":
        raise ValueError(f"--data {args.data}: unknown task {name!r}; known: task:phop")
    return PHopTask(parse_hops(args.task_p), args.task_alphabet, args.task_length, args.task_pause)


TASK_FLAGS = ("task_p", "task_alphabet", "task_length", "task_pause")  # read only with --data task:...


def add_args(ap):
    g = ap.add_argument_group("synthetic task (--data task:phop)")
    g.add_argument("--task-p", type=hops_arg, default="1-4",
                   help="hops p of dense p-hop induction: a range 1-4 or a list 2,4")
    g.add_argument("--task-alphabet", type=number(int, min=2, max=MAX_ALPHABET), default=4,
                   help="symbols in the alphabet")
    g.add_argument("--task-length", type=number(int, min=2), default=48, help="symbols per sequence")
    g.add_argument("--task-pause", type=number(int, min=0), default=0,
                   help="filler tokens after every symbol; the label sits on the last (0: on the symbol)")


class TaskTokenizer:
    """The task's vocabulary behind train.py's Tokenizer interface (spec, n_vocab, eot, encode, decode)."""

    def __init__(self, spec: dict):
        self.spec = dict(spec)
        self.task = task_from_spec(spec)
        self.n_vocab = self.task.n_vocab
        self.eot = None  # no documents: nothing to separate

    @functools.cached_property
    def names(self) -> list[str]:  # built when first read: a huge alphabet is refused (train.py) before
        return self.task.token_names()

    def encode(self, text: str) -> list[int]:
        ids = {s: i for i, s in enumerate(self.names)}
        try:
            return [ids[t] for t in text.split()]
        except KeyError as e:
            raise ValueError(f"{e.args[0]!r} is not a token of the task; tokens: {' '.join(self.names)}") from None

    def decode(self, ids) -> str:
        return " ".join(self.names[i] for i in ids)


class TaskData:
    """Fresh task sequences from the step's generator: train.py's TokenData interface (get_batch)."""

    def __init__(self, task: PHopTask, split: str):
        self.task, self.split = task, split

    def get_batch(self, batch: int, seq_len: int, gen: torch.Generator):
        return self.task.batch(batch, gen, seq_len)


# ----------------------------------------------------------------------------------------------------------------
# The Depth experiment (RESULTS.md): every architecture on p-hop, several seeds; rows share one recipe

DEPTH_RECIPE = ["--data", "task:phop", "--task-p", "1-4", "--preset", "tiny", "--batch-size", "32", "--max-iters",
                "800", "--lr", "2e-3", "--eval-iters", "60", "--eval-interval", "800", "--sample-tokens", "0"]
# name -> (flags, init-from row or None). plt's tiny preset is 2 layers of d 128, the 4-layer vanilla tiny has the same
# width: vanilla-2 / loop / clp / kv_share / PLT share every weight shape, vanilla-4 has twice the layers.
DEPTH_ROWS = {
    "vanilla-2": (["--arch", "plt", "--plt-variant", "vanilla"], None),
    "loop-2": (["--arch", "plt", "--plt-variant", "loop"], None),
    "clp-2": (["--arch", "plt", "--plt-variant", "clp"], None),
    "kv_share-2": (["--arch", "plt", "--plt-variant", "kv_share"], None),
    "plt-2": (["--arch", "plt", "--plt-variant", "plt"], None),
    "plt-3": (["--arch", "plt", "--plt-variant", "plt", "--loops", "3"], None),
    "vanilla-4": (["--arch", "vanilla"], None),
    "recursive-2 (from vanilla-4)": (["--arch", "recursive"], "vanilla-4"),
    "relaxed-2 (from vanilla-4)": (["--arch", "relaxed"], "vanilla-4"),
    "loop-2 pause 1": (["--arch", "plt", "--plt-variant", "loop", "--task-pause", "1"], None),
    "clp-2 pause 1": (["--arch", "plt", "--plt-variant", "clp", "--task-pause", "1"], None),
    "plt-2 pause 1": (["--arch", "plt", "--plt-variant", "plt", "--task-pause", "1"], None),
    "vanilla-2 pause 1": (["--arch", "plt", "--plt-variant", "vanilla", "--task-pause", "1"], None),
    "plt-2 pause 2": (["--arch", "plt", "--plt-variant", "plt", "--task-pause", "2"], None),
    "kv_share-2 pause 1": (["--arch", "plt", "--plt-variant", "kv_share", "--task-pause", "1"], None),
    "plt-2 pause 1 w104": (["--arch", "plt", "--plt-variant", "plt", "--task-pause", "1", "--plt-window", "104"], None),
    "kv_share-2 w56": (["--arch", "plt", "--plt-variant", "kv_share", "--plt-window", "56"], None),
    "plt-2 w56": (["--arch", "plt", "--plt-variant", "plt", "--plt-window", "56"], None),
}


def depth(args):
    """Every row of --rows for every seed of --seeds, one train.py run each, appended to OUT/results.jsonl. The rows,
    the seeds, --out and every row's --init-from source are checked before the first run starts; a run that refuses
    its flags (--extra) says so itself, in one line, before it trains."""
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not rows:
        raise UsageError(f"--rows {args.rows!r} names no row; known: {', '.join(DEPTH_ROWS)}")
    unknown = [r for r in rows if r not in DEPTH_ROWS]
    if unknown:
        raise UsageError(f"--rows: unknown rows {unknown}; known: {', '.join(DEPTH_ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for i, row in enumerate(rows):
        flags, parent = DEPTH_ROWS[row]
        for seed in seeds:
            out = f"{args.out}/{slug(row)}-s{seed}"
            argv_row = flags + DEPTH_RECIPE + ["--seed", str(seed), "--out-dir", out] + args.extra.split()
            if parent is not None:
                src = f"{args.out}/{slug(parent)}-s{seed}/ckpt.pt"
                if parent not in rows[:i] and not Path(src).is_file():
                    raise UsageError(f"row {row!r} starts from {parent!r}, and {src} does not exist: put {parent} "
                                     f"before it in --rows, or run it first")
                argv_row += ["--init-from", src]
            runs.append((row, seed, argv_row))
    check_writable_dir(Path(args.out), "--out")
    check_output_file(f"{args.out}/results.jsonl", "--out's results file")  # appended after every run: never a FIFO
    results = {}
    for row, seed, argv_row in runs:
        acc = run_train(argv_row)
        results.setdefault(row, []).append(acc)
        append_line(f"{args.out}/results.jsonl", json.dumps({"row": row, "seed": seed, "argv": argv_row, "acc": acc}))
    print(depth_table(results))


def run_train(argv: list[str]) -> dict[int, float]:
    """`python train.py ARGV` in a child process (train.py imports this file), its log passed through; -> the
    accuracy per p of its last `val` line."""
    print("python train.py " + " ".join(argv), flush=True)
    acc = None

    def on_line(line):
        nonlocal acc
        print(line, end="", flush=True)
        if line.startswith("val step") and " acc " in line:
            acc = {int(q): float(v) for q, v in re.findall(r"p(\d+) ([\d.]+)", line.split(" acc ", 1)[1])}

    def failed(code):
        return f"the run failed (exit code {code}): python train.py {' '.join(argv)}"

    run_child([sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), *argv], on_line,
              f"the run was stopped: python train.py {' '.join(argv)}; continue it with --resume", failed)
    if acc is None:
        raise UsageError(failed(0))
    return acc


def table(args):
    results = read_results(args.results)
    order = [r for r in DEPTH_ROWS if r in results] + [r for r in results if r not in DEPTH_ROWS]
    print(depth_table({r: list(results[r].values()) for r in order}))
    print("seeds: " + "; ".join(f"{r}: {sorted(results[r])}" for r in order))


def read_results(path) -> dict[str, dict[int, dict]]:
    """The lines `depth` appended to a results file -> {row: {seed: {p: accuracy}}} (a rerun of a seed replaces it).
    A file that cannot be read, a line that is not such a record, or no record at all is a UsageError naming it
    (cli.read_json)."""
    if os.path.isdir(path):
        raise UsageError(f"--results {path} is a directory, not a results file")
    results = {}
    for r in read_json(path, "--results", 'a result of tasks.py depth ({"row": ..., "seed": ..., "acc": {p: accuracy '
                       'in [0, 1]}})', result_problem, lines=True,
                       missing="does not exist (python -m harness.tasks depth writes it)"):
        results.setdefault(r["row"], {})[r["seed"]] = r["acc"]
    if not results:
        raise UsageError(f"--results {path} holds no results")
    return results


P_KEY = re.compile(r"0|[1-9][0-9]{0,5}")  # an accuracy's key: p written in ASCII digits as depth writes it ("12")


def result_problem(r: dict) -> str | None:
    """What keeps a line of a results file from being one of depth's records, or None. Its accuracies' keys are p in
    ASCII digits (str.isdigit would take "²" or an Arabic-Indic "١", which int() refuses or reads as another p)."""
    acc = r.get("acc")
    return fields_problem(r, {"row": str, "seed": int, "acc": dict}) or (
        None if acc and all(P_KEY.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
                            and 0 <= v <= 1 for k, v in acc.items())
        else "its 'acc' is not {p: an accuracy in [0, 1]} (p in ASCII digits)")


def slug(row: str) -> str:
    return row.split(" (")[0].replace(" ", "-")


def depth_table(results: dict) -> str:
    """{row: [{p: acc} per seed]} -> a markdown table: mean ± half the range per p, the seeds' values listed."""
    ps = sorted({int(q) for runs in results.values() for acc in runs for q in acc})
    lines = ["| model | " + " | ".join(f"p={q}" for q in ps) + " |", "|---|" + "---|" * len(ps)]
    for row, runs in results.items():
        cells = []
        for q in ps:
            v = [acc[str(q)] if str(q) in acc else acc[q] for acc in runs if str(q) in acc or q in acc]
            cells.append(f"{statistics.mean(v):.3f} ± {(max(v) - min(v)) / 2:.3f}" if v else "-")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SHOW_MAX_TOKENS = 1_000_000  # `show` prints its sequences: more is a mistake, not a request


def show(args):
    args.data = "task:phop"
    task = task_from_args(args)
    if args.n * task.seq_len > SHOW_MAX_TOKENS:
        raise UsageError(f"--n {args.n} sequences of {task.seq_len} tokens is more than the {SHOW_MAX_TOKENS:,} "
                         f"tokens show prints; ask for fewer or shorter sequences")
    x, y = task.batch(args.n, torch.Generator().manual_seed(args.seed))
    for i in range(args.n):
        print(f"p = {int(task.hops_of(x)[i])}:\n{task.show(x[i], y[i])}\n")


def build_parser():
    ap = ArgumentParser(prog="python -m harness.tasks", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("show", help="print task sequences with their labels")
    add_args(p)
    p.add_argument("--n", type=number(int, min=1), default=2, help="sequences")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.set_defaults(fn=show)

    p = sub.add_parser("depth", help="RESULTS.md's Depth table: each row trained on p-hop for each seed")
    p.add_argument("--seeds", type=comma_list(seed_arg), default="0,1,2", help="comma-separated seeds")
    p.add_argument("--rows", default=",".join(DEPTH_ROWS), help="comma-separated rows of the table"
                   ).empty_checked = True  # '' is refused by depth() with the list of known rows
    p.add_argument("--out", type=path_arg, default="out/depth",
                   help="checkpoints go to OUT/ROW-sSEED; results to OUT/results.jsonl")
    p.add_argument("--extra", default="", help="flags appended to every run (e.g. '--max-iters 200')")
    p.set_defaults(fn=depth)

    p = sub.add_parser("table", help="the Depth table from the results a `depth` run appended")
    p.add_argument("--results", type=path_arg, default="out/depth/results.jsonl")
    p.set_defaults(fn=table)
    return ap


def run(argv=None):
    return run_subcommand(build_parser(), argv)


def main(argv=None):
    """The command: a mistake (a flag, a file) is one line `error: ...` and exit code 2 (cli.run_cli)."""
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
