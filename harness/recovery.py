"""
recovery.py -- `python eval.py recovery` and `python eval.py samples`: how each conversion of a pretrained model
recovers with uptraining (Relaxed Recursive Transformers, section 3, Figures 4-5, on a real model), and the teacher
text one of its rows mixes in (sequence-level distillation, LLM-QAT, Liu et al., arXiv:2305.17888).

Rows, each from its conversion, uptrained with KD from the original at equal tokens (the same seed, the same
batches): (a) recursive B = 2 Stepwise, (b) the non-looped model of its N/2 layers (the paper's same-size baseline,
from the same pretrained layers), (c) relaxed B = 2 Stepwise + SVD LoRA, (d) Middle-Cycle sharing (Mixture-of-
Recursions, Bae et al., arXiv:2507.10524: first and last layer unique, the middle looped), (e) the original (the
anchor), and (a+samples) row (a) with text sampled from the teacher mixed in. Each row's loss on the fixed evaluation
set of `eval.py loss` at log-spaced token counts is its recovery curve: one table (with looped minus same-size
non-looped at every point, where they cross) and a plot beside it. Stage exits then post-trains the best looped row
for early exit (Appendix J) and serves its real exits against the original: loss, agreement and tok/s per gate
threshold, one table. Every run is a train.py (bench.py serve) process; results accumulate in OUT/recovery.jsonl, so
calls of a few minutes each (--rows) build the curves at one budget.

Run:
    python eval.py recovery --device cuda --minutes 1.5 --rows a,b,c          # a GPU call: the budget, three rows
    python eval.py recovery --device cuda --rows d,e,a+samples --stages curves,exits   # the rest, then real exits
    python eval.py recovery --stages table                                  # the table and plot again
    python eval.py samples --model smollm2-135m --tokens 5e6 --out out/recovery/samples
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import graphs
from harness.checkpoint import load_source_model, tokenizer_from_spec
from harness.cli import (DTYPES, MIN_TEMPERATURE, UsageError, append_line, check_output_file,
                         check_writable_dir, comma_list, fields_problem, number, one_of, path_arg, read_json,
                         run_child, save_png, seed_arg, user_input, write_atomic)
from harness.curve import read_curve
from harness.data import step_generator
from harness.device import pick_device, pick_dtype
from svd_lora import max_ranks

# ----------------------------------------------------------------------------------------------------------------
# Text sampled from a model (samples): sequence-level distillation data

SAMPLES_MAX_TOKENS = 10 ** 12  # --tokens: a thousand times what a recovery row mixes in
SAMPLES_MIN_BYTES = 2  # the least a token takes in a shard (its text in JSON): what --out must have free per token


@torch.no_grad()
def eval_samples(args):
    """Text sampled from a vanilla model, written as SlimPajama-style .jsonl shards that train.py reads (--data,
    --mix-data). Sequence-level distillation as in LLM-QAT (Liu et al., arXiv:2305.17888, section 2.1): the first token
    drawn uniformly from the vocabulary, the next --greedy-first tokens greedy, the rest sampled from the full softmax;
    a document ends at the first end-of-text. The model's own cached generate (compiled, a CUDA graph per step on a GPU:
    graphs.compile_decode). One shard per batch, written atomically and seeded by (--seed, its index), so a rerun with
    the same settings continues where the last one stopped and every shard is reproducible alone; manifest.json
    holds the settings and each shard's tokens."""
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    args.tokens = int(args.tokens)
    args.batch_size = args.batch_size or (256 if device.type == "cuda" else 8)
    with user_input():
        model, arch, spec = load_source_model(args.model)
    if arch != "vanilla":
        raise UsageError(f"--model {args.model} holds a {arch} model; samples come from a vanilla one (the teacher)")
    if args.length > model.config.max_seq_len:
        raise UsageError(f"--length {args.length} exceeds the model's context of {model.config.max_seq_len}")
    tok = tokenizer_from_spec(spec)
    out = Path(args.out)
    settings = dict(model=args.model, tokenizer=spec, seed=args.seed, length=args.length, batch_size=args.batch_size,
                    greedy_first=args.greedy_first, temperature=args.temperature, top_k=args.top_k)
    manifest = read_manifest(out / "manifest.json") if os.path.lexists(out / "manifest.json") else \
        {**settings, "shards": {}}
    differ = [k for k in settings if manifest.get(k) != settings[k]]
    if differ:
        raise UsageError(f"--out {out} holds samples of other settings ({differ[0]} {manifest.get(differ[0])!r}, "
                         f"here {settings[differ[0]]!r}): give another --out or remove it")
    check_writable_dir(out, "--out")
    have = sum(manifest["shards"].values())
    need, free = (args.tokens - have) * SAMPLES_MIN_BYTES, shutil.disk_usage(out).free
    if need > free:
        raise UsageError(f"--tokens {args.tokens:,}: the shards of the {args.tokens - have:,} tokens to sample take at "
                         f"least {need / 1e9:,.3g} GB ({SAMPLES_MIN_BYTES} bytes a token), but --out {out} has "
                         f"{free / 1e9:,.3g} GB free")
    model = model.to(device=device, dtype=dtype).eval()
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    if compiled:
        graphs.compile_decode(model, mode="reduce-overhead" if device.type == "cuda" else None)
    print(f"samples of {args.model} ({dtype}, {device}{', compiled decode' if compiled else ''}): {args.batch_size} x "
          f"{args.length} tokens per shard, first token uniform, {args.greedy_first} greedy, then sampled (temperature "
          f"{args.temperature:g}{f', top-k {args.top_k}' if args.top_k else ''}) -> {out}; {have:,} of {args.tokens:,} "
          f"tokens there", flush=True)
    while have < args.tokens:
        i = len(manifest["shards"])
        g = step_generator(args.seed, i)
        first = torch.randint(0, tok.n_vocab - 1, (args.batch_size, 1), generator=g)
        first += (first >= tok.eot).long()  # never the end-of-text id
        gen = torch.Generator(device=device).manual_seed(int(torch.randint(2 ** 62, (1,), generator=g)))
        t0 = time.perf_counter()
        ids = model.generate(first.to(device), args.length - 1, temperature=args.temperature, top_k=args.top_k,
                             generator=gen, greedy_first=args.greedy_first).cpu()
        dt = time.perf_counter() - t0
        lines, n = [], 0
        for row in ids.tolist():
            row = row[:row.index(tok.eot, 1)] if tok.eot in row[1:] else row  # a document ends at end-of-text
            n += len(row)
            lines.append(json.dumps({"text": tok.decode(row), "meta": {"redpajama_set_name": "TeacherSamples"}}))
        name = f"samples_{i:05d}.jsonl"
        write_atomic(out / name, "\n".join(lines) + "\n", "samples shard")
        manifest["shards"][name] = n
        write_atomic(out / "manifest.json", json.dumps(manifest, indent=1), "samples manifest")
        have += n
        print(f"shard {name}: {n:,} tokens, {args.batch_size * (args.length - 1) / dt:,.0f} generated tok/s | "
              f"{have:,} of {args.tokens:,}", flush=True)
    return out


def read_manifest(path: Path) -> dict:
    """OUT/manifest.json of eval_samples: its settings and {shard file name: tokens} (cli.read_json); a damaged one is
    one line naming it."""
    def problem(m):
        shards = m.get("shards")
        if not isinstance(shards, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in shards.items()):
            return "its 'shards' is not a map of shard file names to token counts"
        return None
    return read_json(path, "samples manifest", "a manifest of eval.py samples", problem, damaged=True,
                     fix=f"remove {path.parent} to sample again")


# ----------------------------------------------------------------------------------------------------------------
# The recovery curves of a converted pretrained model (recovery)
#
# Each row is one `python train.py` process, not a function call: eval.py reaches no train.py (tests/test_layout.py),
# every row trains through train.py's own loop (its KD, schedule, checks and checkpoint) and gets a clean GPU, and
# train.py measures the curve itself (--curve-at: the fixed evaluation set of `eval.py loss` at given token counts,
# into OUT_DIR/curve.jsonl), so a row is one process, not one per point. This command only plans the rows, runs them,
# and reads, tabulates and plots what they wrote.

RECOVERY_ROWS = ("a", "b", "c", "d", "e", "a+samples")
LOOPED_ROWS = ("a", "c", "a+samples")  # CYCLE-sharing looped rows: what the exits stage may post-train
STAGES = ("curves", "exits", "table")
ROOT = Path(__file__).resolve().parents[1]  # train.py, serve.py, bench.py


def recovery_rows(n_layer: int, top: dict, args, out: Path) -> dict[str, tuple[str, list[str]]]:
    """row -> (label, its conversion as train.py flags) for a vanilla source of n_layer layers (LoRA ranks capped at
    the source's full ranks `top`)."""
    K, mid = n_layer // 2, (n_layer - 2) // 2
    a = ["--arch", "recursive", "--loops", "2", "--init", "stepwise"]
    rank = [f for c, r in top.items() for f in (f"--lora-rank-{c}", str(min(args.lora_rank, r)))]
    return {
        "a": (f"recursive B=2, Stepwise ({K} shared layers)", a),
        "b": (f"non-looped, the same {K} layers", ["--arch", "vanilla", "--keep-layers", f"stepwise:{K}"]),
        "c": (f"relaxed B=2, Stepwise + SVD LoRA rank {args.lora_rank}",
              ["--arch", "relaxed", "--loops", "2", "--init", "stepwise", *rank]),
        "d": (f"Middle-Cycle B=2, Stepwise (1 + {mid} shared + 1 layers)", [*a, "--sharing", "middle_cycle"]),
        "e": (f"the original, {n_layer} layers (the anchor)", ["--arch", "vanilla"]),
        "a+samples": (f"(a) on {args.data} + teacher samples ({args.samples_share:.0%} of the windows)",
                      [*a, "--mix-data", str(out / "samples"), "--mix-weight", str(args.samples_share)]),
    }


def curve_points(tokens: int, points: str | None) -> list[int]:
    """--points, or 0 (the conversion), 1-3-10 steps from 10k tokens below the budget, and the budget."""
    if points:
        return sorted({int(float(p)) for p in points.split(",")})
    ladder = [m * 10 ** k for k in range(4, 13) for m in (1, 3) if m * 10 ** k < tokens]
    return [0, *ladder, tokens]


def run_script(script: str, argv: list[str], keep=lambda line: False) -> tuple[list[str], float]:
    """`python SCRIPT ARGV` in a child process, its output passed through -> (the lines `keep` selects, wall seconds).
    Its own `error: ...` line (exit code 2) ends this command with the same code; a stopped run (130) is Stopped;
    any other failure one error line naming the command."""
    cmd = [sys.executable, str(ROOT / script), *argv]
    print("$ python " + " ".join([script, *argv]), flush=True)
    t0 = time.perf_counter()
    kept = []

    def on_line(line):
        if keep(line):
            kept.append(line)
        else:
            print(line, end="", flush=True)

    run_child(cmd, on_line,
              f"python {script} was stopped; run the same command again to go on (finished rows are kept)",
              lambda code: f"python {' '.join([script, *argv])} failed (exit code {code})")
    return kept, time.perf_counter() - t0


# The fields each kind of OUT/recovery.jsonl record holds (what the table, the plot and the exits stage read back)
RECOVERY_RECORDS = {
    "settings": {"source": str, "data": str, "seq_len": int, "batch_size": int, "lr": float, "min_lr": float,
                 "eval_tokens": int, "seed": int, "tokens": int},
    "row": {"row": str, "label": str, "points": list, "params": int, "non_emb": int, "device": str},
    "exits": {"row": str, "label": str, "post_tokens": int, "post_curve": list, "device": str, "eval_tokens": int,
              "loop_loss": list, "original_loss": float, "gate": list, "served": dict},
}


def recovery_problem(r: dict) -> str | None:
    """What keeps a line of OUT/recovery.jsonl from being a record of its kind, or None."""
    fields = RECOVERY_RECORDS.get(r.get("kind"))
    if fields is None:
        return f"its kind {r.get('kind')!r} is not one of {', '.join(RECOVERY_RECORDS)}"
    curve = r.get("points", r.get("post_curve"))
    return fields_problem(r, fields) or (None if curve is None or all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p)
        for p in curve) else "its curve is not a list of [tokens, loss] pairs")


def read_recovery(path: Path) -> tuple[dict | None, dict, dict | None]:
    """OUT/recovery.jsonl -> (the settings, {row: its latest record}, the latest exits record). A file or a line that
    is not such a record is an error naming it (cli.read_json)."""
    settings, rows, exits = None, {}, None
    if not os.path.lexists(path):
        return settings, rows, exits
    for r in read_json(path, "results file", "a record of eval.py recovery", recovery_problem, lines=True,
                       damaged=True, fix="remove the line or the file"):
        kind = r["kind"]
        if kind == "settings":
            settings = r
        elif kind == "row":
            rows[r["row"]] = r
        elif kind == "exits":
            exits = r
    return settings, rows, exits


def append_record(path, record: dict):
    """One JSON line appended to a results file (eval.py loss --results, OUT_DIR/recovery.jsonl: cli.append_line)."""
    append_line(path, json.dumps(record))


def eval_recovery(args):
    """The recovery experiment: the rows (--rows) uptrained with KD from the original at equal tokens, each from its
    conversion, their curves on the fixed evaluation set (stage curves); the early-exit post-training of the best
    looped row and real exits served against the original (stage exits); the table and plot (every stage). Results
    accumulate in OUT/recovery.jsonl: a row already there is kept (--redo trains it again), so several calls of a
    few minutes build the curves."""
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    args.tokens = int(args.tokens) if args.tokens else None
    out = Path(args.out_dir)
    path = out / "recovery.jsonl"
    settings, done, exits = read_recovery(path)
    if set(stages) == {"table"}:  # what the results file holds, nothing run: no source, no settings to check
        if not done:
            raise UsageError(f"{path} holds no rows yet: run stage curves first")
        return report_recovery(settings, done, exits, out)
    device = pick_device(args.device)
    batch = args.batch_size or (64 if device.type == "cuda" else 4)
    tps = batch * args.seq_len
    if args.tokens and args.minutes:
        raise UsageError("--tokens and --minutes both size the rows: give one")
    if args.tokens and args.tokens < tps:
        raise UsageError(f"--tokens {args.tokens:,} is less than one step ({batch} x {args.seq_len} tokens)")
    with user_input():  # a source that is not there or not a model: one line, before any work
        src, arch, spec = load_source_model(args.source)
    if arch != "vanilla":
        raise UsageError(f"--source {args.source} holds a {arch} model; the rows convert a vanilla one")
    N = src.config.n_layer
    if N % 2 or N < 4:
        raise UsageError(f"--source {args.source} has {N} layers; the rows loop B = 2 over N/2 and (N-2)/2 layers: "
                         f"N must be even and >= 4")
    if args.seq_len > src.config.max_seq_len:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the source's context of {src.config.max_seq_len}")
    plan = recovery_rows(N, max_ranks(src.config), args, out)
    del src
    mine = dict(source=args.source, data=args.data, seq_len=args.seq_len, batch_size=batch, lr=args.lr,
                min_lr=args.lr / 10, eval_tokens=args.eval_tokens, seed=args.seed, lora_rank=args.lora_rank,
                samples_share=args.samples_share)
    if args.data == "stdlib":  # the corpus, and so the evaluation set, is this interpreter's standard library
        mine["python"] = platform.python_version()
    if settings is not None:
        other = [k for k in mine if settings.get(k) != mine[k]]
        if other:
            raise UsageError(f"{path} was made with {other[0]} {settings.get(other[0])!r}, here {mine[other[0]]!r}: "
                             f"equal tokens and settings are the experiment; give the same flags or another --out-dir")
        if args.tokens and args.tokens // tps * tps != settings["tokens"]:
            raise UsageError(f"{path} holds rows of {settings['tokens']:,} tokens, here --tokens {args.tokens:,}: the "
                             f"rows compare at equal tokens; give another --out-dir for another budget")
    todo = [r for r in rows if args.redo or r not in done] if "curves" in stages else []
    if "exits" in stages and not any(r in done or r in todo for r in LOOPED_ROWS):
        raise UsageError(f"the exits stage post-trains the best looped row ({', '.join(LOOPED_ROWS)}); none is in "
                         f"{path} yet: add one to --rows with --stages curves,exits")
    if (todo or "exits" in stages) and settings is None and not (args.tokens or args.minutes):
        raise UsageError("give the budget of every row: --tokens N or --minutes M (then kept in the results file)")
    budget = settings["tokens"] if settings is not None else args.tokens
    if args.points and budget and max(curve_points(0, args.points)) > budget:
        raise UsageError(f"--points {args.points}: a point is past the budget of {budget:,} tokens")
    check_writable_dir(out, "--out-dir")
    check_output_file(path, "--out-dir's results file")  # appended after every row: never a link or a FIFO
    common = ["--data", args.data, "--cache-dir", args.cache_dir, "--seq-len", str(args.seq_len), "--batch-size",
              str(batch), "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
              "--teacher", args.source, "--kd", "fkl", "--sample-tokens", "0", "--eval-iters", "4",
              "--curve-tokens", str(args.eval_tokens)]
    if settings is None and (todo or "exits" in stages):
        tokens = args.tokens // tps * tps if args.tokens else probe_budget(args, plan["a"][1], common, batch, out)
        settings = {"kind": "settings", **mine, "tokens": tokens}
        append_record(path, settings)
    if settings is not None:
        steps = settings["tokens"] // tps
        print(f"recovery of {args.source}: {settings['tokens']:,} tokens per row ({steps} steps x {batch} x "
              f"{args.seq_len}), KD (fkl) from the original, lr {args.lr:g} -> {args.lr / 10:g}; rows to train: "
              f"{', '.join(todo) or 'none'}; stages {', '.join(stages)} -> {path}", flush=True)
    for row in todo:
        label, flags = plan[row]
        if row == "a+samples":
            need = args.sample_tokens or math.ceil(args.samples_share * settings["tokens"])
            run_script("eval.py", ["samples", "--model", args.source, "--tokens", str(need), "--out",
                                   str(out / "samples"), "--length", str(args.seq_len), "--seed", str(args.seed),
                                   "--device", args.device, "--dtype", args.dtype]
                       + (["--batch-size", str(args.sample_batch)] if args.sample_batch else []))
        done[row] = train_row(row, label, flags, common, settings, args, out)
        append_record(path, done[row])
    if "exits" in stages:
        exits = exits_stage(args, settings, done, common, out)
        append_record(path, exits)
    return report_recovery(settings, done, exits, out)


def report_recovery(settings, done, exits, out: Path):
    """The curves' table (OUT/recovery.md) and plot (OUT/recovery.png), and the exits table (OUT/exits.md), printed."""
    if done:
        text = recovery_table(settings, done)
        print(text)
        write_atomic(out / "recovery.md", text + "\n", "table")
        plot = recovery_plot(settings, done, out / "recovery.png")
        print(f"table: {out / 'recovery.md'}" + (f", plot: {plot}" if plot else " (no plot: matplotlib does not "
                                                                               "import here)"))
    if exits is not None:
        text = exits_table(exits)
        print(text)
        write_atomic(out / "exits.md", text + "\n", "table")
    return settings, done, exits


def steps_flags(steps: int, lr: float, points: list[int]) -> list[str]:
    """The schedule of a run of `steps` steps: lr -> lr/10 cosine, the default warm-up, one evaluation and checkpoint
    at the end, about 20 log lines, the curve at `points` tokens."""
    return ["--max-iters", str(steps), "--eval-interval", str(steps), "--log-interval", str(max(1, steps // 20)),
            "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--curve-at", ",".join(map(str, points))]


def train_row(row, label, flags, common, settings, args, out) -> dict:
    """One row: python train.py from its conversion at the budget, its curve read back -> its record."""
    tps = settings["batch_size"] * settings["seq_len"]
    steps = settings["tokens"] // tps
    run_dir = out / "rows" / row.replace("+", "_")
    argv = [*flags, "--init-from", settings["source"], *common,
            *steps_flags(steps, settings["lr"], curve_points(settings["tokens"], args.points)),
            "--out-dir", str(run_dir)]
    rates = []
    _, wall = run_script("train.py", argv, keep=lambda line: step_rate(line, rates))
    curve = read_curve(run_dir / "curve.jsonl")
    return {"kind": "row", "row": row, "label": label, "points": [[c["tokens"], c["loss"]] for c in curve],
            "params": curve[-1]["params"], "non_emb": curve[-1]["non_emb"], "device": curve[-1]["device"],
            "tok_s": statistics.median(rates[1:] or rates) if rates else None, "wall_s": wall, "steps": steps,
            "command": "python train.py " + " ".join(argv)}


def step_rate(line: str, rates: list) -> bool:
    """train.py's step lines: their tok/s into `rates` (the line is still printed: returns False)."""
    m = re.search(r"^step \d+ .* tok/s (\d+)", line)
    if m:
        rates.append(float(m.group(1)))
    return False


def probe_budget(args, flags, common, batch, out) -> int:
    """--minutes: row (a)'s training step timed in a short train.py run (the first step excluded); the budget is the
    tokens it trains in --minutes at that rate, in whole steps."""
    n = 8 if pick_device(args.device).type == "cuda" else 3
    rates = []
    run_script("train.py", [*flags, "--init-from", args.source, *common, "--max-iters", str(n), "--eval-interval",
                            str(n), "--eval-iters", "1", "--log-interval", "1", "--lr", f"{args.lr:g}",
                            "--out-dir", str(out / "probe")], keep=lambda line: step_rate(line, rates))
    shutil.rmtree(out / "probe", ignore_errors=True)
    rate = statistics.median(rates[1:] or rates)
    steps = max(1, int(args.minutes * 60 * rate / (batch * args.seq_len)))
    print(f"budget: row (a) trains {rate:,.0f} tok/s here: {args.minutes:g} minutes = {steps} steps = "
          f"{steps * batch * args.seq_len:,} tokens per row", flush=True)
    return steps * batch * args.seq_len


def short(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else f"{n:.0f}"


def recovery_table(settings, done) -> str:
    """The curves as a markdown table (a column per token count), then what they say: looped against the same-size
    non-looped model at every point (the paper's claim), each row's distance to the anchor at the end, samples
    against stdlib only."""
    order = [r for r in RECOVERY_ROWS if r in done]
    ticks = sorted({t for r in order for t, _ in done[r]["points"]})
    lines = [f"Recovery: KD (fkl) from {settings['source']}, {settings['tokens']:,} tokens per row "
             f"({settings['batch_size']} x {settings['seq_len']} per step, lr {settings['lr']:g} -> "
             f"{settings['min_lr']:g}, seed {settings['seed']}); loss on the fixed evaluation set (the first "
             f"{settings['eval_tokens']:,} tokens of the {settings['data']} validation split"
             + (f" of Python {settings['python']}" if settings.get("python") else "") + ") after t tokens", "",
             "| row | parameters (non-emb) | " + " | ".join(short(t) for t in ticks) + " | tok/s | card |",
             "|---|---|" + "---|" * len(ticks) + "---|---|"]
    loss = {r: dict(map(tuple, done[r]["points"])) for r in order}
    for r in order:
        d = done[r]
        cells = [f"{loss[r][t]:.3f}" if t in loss[r] else "-" for t in ticks]
        rate = f"{d['tok_s']:,.0f}" if d.get("tok_s") else "-"
        lines.append(f"| ({r}) {d['label']} | {d['params'] / 1e6:.1f}M ({d['non_emb'] / 1e6:.1f}M) | "
                     + " | ".join(cells) + f" | {rate} | {d['device']} |")
    lines.append("")
    for r, base, what in (("a", "b", "looped (a) - same-size non-looped (b)"),
                          ("d", "b", "Middle-Cycle (d) - same-size non-looped (b)"),
                          ("a+samples", "a", f"(a) with teacher samples - (a) on {settings['data']} only")):
        if r in loss and base in loss:
            common = [t for t in ticks if t in loss[r] and t in loss[base]]
            diff = [loss[r][t] - loss[base][t] for t in common]
            lines.append(f"{what}: " + ", ".join(f"{short(t)} {v:+.3f}" for t, v in zip(common, diff))
                         + f" -> {crossing(common, diff)}")
    if "e" in loss:
        end = max(loss["e"])
        lines.append(f"at {short(end)} tokens, above the anchor (e) {loss['e'][end]:.3f}: " + ", ".join(
            f"({r}) {loss[r][end] - loss['e'][end]:+.3f}" for r in order if r != "e" and end in loss[r]))
    return "\n".join(lines)


def crossing(ticks, diff) -> str:
    """Whether a row ends below its baseline and since when (the last sign change), or the trend of the gap."""
    if all(v < 0 for v in diff):
        return "below at every point"
    if diff[-1] < 0:
        i = max(j for j, v in enumerate(diff) if v >= 0) + 1
        return f"crosses below between {short(ticks[i - 1])} and {short(ticks[i])} tokens and stays below"
    below = [short(t) for t, v in zip(ticks, diff) if v < 0]
    return (f"not below at the end: {diff[0]:+.3f} at {short(ticks[0])} -> {diff[-1]:+.3f} at {short(ticks[-1])}"
            + (f" (below at {', '.join(below)} only)" if below else ""))


def recovery_plot(settings, done, path: Path) -> Path | None:
    """Loss against tokens (log) per row, the points after the conversion (t > 0), beside the table (matplotlib is
    optional: without it, None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in [r for r in RECOVERY_ROWS if r in done]:
        pts = [(t, v) for t, v in done[r]["points"] if t > 0]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"({r}) {done[r]['label']}")
    ax.set_xscale("log")
    ax.set_xlabel("uptraining tokens (KD from the original)")
    ax.set_ylabel(f"loss, first {settings['eval_tokens']:,} tokens of {settings['data']} val")
    ax.set_title(f"Recovery of {settings['source']} conversions")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_png(fig, path)


def exits_stage(args, settings, done, common, out) -> dict:
    """Early-exit post-training of the best looped row (the lowest final loss among a, c, a+samples; Appendix J:
    aggressive CE on every loop, self-distillation, the learned exit gate, KD from the original kept), then the gate
    at --thresholds: the loss, the loop and the argmax agreement with no exit on validation windows (`eval.py exits`,
    teacher-forced real cached decoding) and the original's loss on the same windows, and the served tok/s and
    greedy-text agreement against the original (serve_command)."""
    cands = [r for r in LOOPED_ROWS if r in done and (out / "rows" / r.replace("+", "_") / "ckpt.pt").is_file()]
    if not cands:
        raise UsageError(f"the exits stage post-trains the best looped row ({', '.join(LOOPED_ROWS)}); none is "
                         f"trained in {out} yet: run --stages curves --rows a first")
    best = min(cands, key=lambda r: done[r]["points"][-1][1])
    src = out / "rows" / best.replace("+", "_") / "ckpt.pt"
    tps = settings["batch_size"] * settings["seq_len"]
    steps = max(1, (args.exit_tokens or settings["tokens"] // 4) // tps)
    run_dir = out / "exit"
    argv = ["--arch", "relaxed" if best == "c" else "recursive", "--init-from", str(src), *common, "--exit-loss",
            "aggressive", "--exit-coef", "0.1", "--self-distill", "--exit-gate",
            *steps_flags(steps, args.lr / 3, [0, steps * tps]), "--out-dir", str(run_dir)]
    run_script("train.py", argv)
    curve = read_curve(run_dir / "curve.jsonl")
    ckpt = str(run_dir / "ckpt.pt")
    seq = min(settings["seq_len"], 512)
    ex_argv = ["exits", "--ckpt", ckpt, "--rules", "gate", "--thresholds", args.thresholds, "--batches", "1",
               "--batch-size", str(16 if pick_device(args.device).type == "cuda" else 2), "--seq-len", str(seq),
               "--device", args.device, "--seed", str(args.seed), "--cache-dir", args.cache_dir]
    print("$ python eval.py " + " ".join(ex_argv), flush=True)
    ex = args.exits(ex_argv)  # eval.py's exits evaluation, in this process (the harness does not import eval.py)
    original = source_loss_on_windows(ex.pop("windows"), settings["source"], pick_device(args.device))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the serving run is another process
    script, serve_argv = serve_command(ckpt, settings, args)
    lines, _ = run_script(script, serve_argv, keep=lambda line: line.startswith("{"))
    served = serve_results(lines, args.thresholds)
    return {"kind": "exits", "row": best, "label": done[best]["label"], "post_tokens": steps * tps,
            "post_curve": [[c["tokens"], c["loss"]] for c in curve], "device": curve[-1]["device"],
            "eval_tokens": ex["tokens"], "loop_loss": ex["loop_loss"], "original_loss": original,
            "gate": ex["rules"].get("gate", []), "served": served, "command": "python train.py " + " ".join(argv)}


@torch.no_grad()
def source_loss_on_windows(windows, source, device) -> float:
    """The original's loss on the windows `eval.py exits` scored (eval_exits hands them over; positions 1..T-1)."""
    model = load_source_model(source)[0].to(device).eval()
    total, n = 0.0, 0
    for x, y in windows:
        logits = model(x)[0][:, 1:].float()
        total += F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten(), reduction="sum").item()
        n += y[:, 1:].numel()
    return total / n


def serve_command(ckpt: str, settings: dict, args) -> tuple[str, list[str]]:
    """The serving comparison of the exits stage as (script, argv), in one place: the depth-wise server with the
    learned gate at --thresholds against the original (continuous batching), the same greedy requests, one JSON line
    (--json). Prompts and lengths from the corpus at the rows' context; more requests on a GPU."""
    T = settings["seq_len"]
    cuda = pick_device(args.device).type == "cuda"
    return "bench.py", ["serve", "--ckpt", ckpt, "--vanilla-ckpt", settings["source"], "--prompts", "corpus", "--data",
                        settings["data"], "--cache-dir", args.cache_dir, "--prompt-len", f"{T // 8}:{T // 4}",
                        "--gen-len", str(T // 4), "--context", str(T), "--requests", "256" if cuda else "8", "--slots",
                        "64" if cuda else "4", "--warmup", "4" if cuda else "1", "--repeats", "1", "--rules", "gate",
                        "--exit-threshold", args.thresholds, "--device", args.device, "--dtype", args.dtype,
                        "--seed", str(args.seed), "--json", *args.serve_extra.split()]


def serve_results(lines: list[str], thresholds: str) -> dict:
    """serve_command's JSON line -> {"original": row, "no exit": row, "gate>=t": row ...} (its rows by system name)."""
    rows = {r["system"]: r for r in json.loads(lines[-1])["serve"]}
    keys = {"original": "vanilla CSB", "no exit": "depth-wise, no exit"}
    keys.update({f"gate>={float(t):.3g}": f"depth-wise + exit (gate>={float(t):g})" for t in thresholds.split(",")})
    return {k: rows.get(name) for k, name in keys.items()}


def exits_table(ex: dict) -> str:
    """One table: the original, no exit and each gate threshold, with quality (loss, agreement) and speed (tok/s)."""
    served, gate = ex["served"], {f"gate>={p['threshold']:.3g}": p for p in ex["gate"]}
    base = (served.get("original") or {}).get("loaded_tok_per_s")
    lines = [f"Real exits: ({ex['row']}) {ex['label']}, early-exit post-trained {ex['post_tokens']:,} more tokens "
             f"(fixed-set loss {ex['post_curve'][0][1]:.3f} -> {ex['post_curve'][-1][1]:.3f}), on {ex['device']}; "
             f"losses on {ex['eval_tokens']:,} validation tokens (teacher-forced cached decoding), serving: the same "
             f"greedy requests", "",
             "| system | mean exit loop | loss | argmax = no exit | loaded tok/s | x original | e2e tok/s | "
             "greedy = original | greedy = no exit |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for key in ["original", "no exit", *gate]:
        s = served.get(key) or {}
        if key == "original":
            quality = ["-", fmt(ex["original_loss"], ".3f"), "-"]
        elif key == "no exit":
            quality = [f"{len(ex['loop_loss'])}.00", fmt(ex["loop_loss"][-1], ".3f"), "100%"]
        else:
            p = gate[key]
            quality = [f"{p['mean_loop']:.2f}", f"{p['loss']:.3f}", f"{p['agree']:.1%}"]
        rate = s.get("loaded_tok_per_s")
        lines.append(f"| {key} | " + " | ".join(quality) + f" | {fmt(rate, ',.1f')} | "
                     f"{fmt(rate / base if rate and base else None, '.2f')} | {fmt(s.get('tok_per_s'), ',.1f')} | "
                     f"{fmt(s.get('agree_vanilla'), '.1%')} | {fmt(s.get('agree_full'), '.1%')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The command lines of eval.py recovery and eval.py samples


def add_parsers(sub, exits):
    """eval.py's `recovery` and `samples` subcommands into its subparsers; exits(argv) -> the dict eval.py's exits
    evaluation returns (the exits stage runs it in this process)."""
    pos, nonneg, two = number(int, min=1), number(int, min=0), number(int, min=2)  # two: >= 2 tokens

    p = sub.add_parser("recovery", help="converted models uptrained with KD at equal tokens: their recovery curves on "
                                        "the fixed evaluation set, then real exits served against the original")
    p.add_argument("--source", type=path_arg, default="smollm2-135m",
                   help="the original: smollm2-135m, gguf:PATH, hf:DIR or a vanilla train.py checkpoint")
    p.add_argument("--rows", type=comma_list(one_of(RECOVERY_ROWS)), default="a,b,c,d,e",
                   help="a: recursive B=2 Stepwise; b: the non-looped model of its N/2 layers; c: relaxed B=2 "
                        "Stepwise + SVD LoRA (--lora-rank); d: Middle-Cycle B=2 Stepwise; e: the original; a+samples: "
                        "(a) with teacher samples mixed in (python eval.py samples)")
    p.add_argument("--stages", type=comma_list(one_of(STAGES)), default="curves",
                   help="curves: train the rows not yet in the results file; exits: early-exit post-training of the "
                        "best looped row and real exits served against the original; table: print the table and "
                        "plot again")
    p.add_argument("--tokens", type=number(float, min=1), default=None,
                   help="KD tokens per row (whole steps); fixed in the results file by the first call")
    p.add_argument("--minutes", type=number(float, above=0), default=None,
                   help="instead of --tokens: what row (a) trains in this many minutes (a short timed run first)")
    p.add_argument("--points", type=comma_list(number(float, min=0)), default=None,
                   help="token counts of the curve (default 0, 10k, 30k, 100k, ... below the budget, and the budget)")
    p.add_argument("--out-dir", type=path_arg, default="out/recovery",
                   help="rows/ROW (train.py runs), samples/, exit/; recovery.jsonl, recovery.md, recovery.png, "
                        "exits.md")
    p.add_argument("--redo", action="store_true", help="train the selected rows again though the results have them")
    p.add_argument("--data", type=path_arg, default="stdlib", help="training corpus and its validation split")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help="token cache directory")
    p.add_argument("--eval-tokens", type=number(int, min=2), default=51200, help="size of the fixed evaluation set")
    p.add_argument("--seq-len", type=two, default=512, help="tokens per window")
    p.add_argument("--batch-size", type=pos, default=None, help="windows per step (default 64 on CUDA, else 4)")
    p.add_argument("--lr", type=number(float, above=0), default=3e-4,
                   help="peak learning rate of the rows (cosine to lr / 10); the exit post-training uses lr / 3")
    p.add_argument("--lora-rank", type=pos, default=32, help="row c's LoRA rank (capped at full rank per component)")
    p.add_argument("--samples-share", type=number(float, above=0, max=1), default=0.5,
                   help="row a+samples: share of its training windows from the teacher samples")
    p.add_argument("--sample-tokens", type=pos, default=None,
                   help="row a+samples: tokens of teacher samples (default: share x budget, each seen about once)")
    p.add_argument("--sample-batch", type=pos, default=None, help="row a+samples: sequences per generation batch")
    p.add_argument("--exit-tokens", type=pos, default=None,
                   help="stage exits: tokens of early-exit post-training (default a quarter of the budget)")
    p.add_argument("--thresholds", type=comma_list(number(float, above=0, max=1)), default="0.5,0.7,0.9",
                   help="stage exits: thresholds of the learned exit gate")
    p.add_argument("--serve-extra", default="", help="stage exits: flags appended to the serving command")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="of the training runs (auto: bf16 autocast on GPU)")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seeds every run (the same batches for every row)")
    p.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
    p.set_defaults(fn=eval_recovery, exits=exits)

    p = sub.add_parser("samples", help="text sampled from a vanilla model (greedy start, then sampled) as .jsonl "
                                       "shards train.py reads: sequence-level distillation data")
    p.add_argument("--model", type=path_arg, required=True,
                   help="train.py checkpoint, hf:DIR, gguf:PATH or smollm2-135m")
    p.add_argument("--tokens", type=number(float, min=1, max=SAMPLES_MAX_TOKENS), required=True,
                   help="tokens to have in --out (at least)")
    p.add_argument("--out", type=path_arg, required=True, help="directory of the shards and manifest.json")
    p.add_argument("--length", type=two, default=512, help="tokens per sequence, the first one included")
    p.add_argument("--batch-size", type=pos, default=None, help="sequences per shard (default 256 on CUDA, else 8)")
    p.add_argument("--greedy-first", type=nonneg, default=4, help="greedy tokens after the first (LLM-QAT: 3-5)")
    p.add_argument("--temperature", type=number(float, min=MIN_TEMPERATURE), default=1.0,  # logits / T: finite
                   help="of the sampled tokens")
    p.add_argument("--top-k", type=pos, default=None, help="of the sampled tokens (default: the full softmax)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA, a CUDA graph per step)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bf16 on GPU")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seeds the first tokens and the sampling, per shard")
    p.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
    p.set_defaults(fn=eval_samples)
