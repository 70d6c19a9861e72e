"""
plt_forms.py -- PLT's loop-input and G-SWA forms trained side by side (RESULTS.md, "The loop input").

plt.py keeps the paper's CLP loop input E + shift_right(H) one flag away from this repository's remedy (learned norms,
`--plt-loop-norm shared`) and from IQuest's LoopCoder-V2 forms (a*E + b*shift_right(H), the shared final norm between
loops, the gate from the normed residual, the w + 1 window). `run` trains each row of ROWS for each seed with one
recipe (train.py in a child process; the checkpoint to OUT/ROW-sSEED), then reads the checkpoint: its validation loss
(train.py's last `val` line), what loop 2's input at position i is made of on validation windows (the rms of the
embedding part a * n_E(e_i) over the rms of the state part b * n_H(S(h_(i-1))): how much of token i reaches loop 2),
how far the logits at i move when token i is replaced against when token i - 1 is, and learned a, b where learned. A
line per run is appended to OUT/results.jsonl as it ends, so a stopped run resumes where it stopped (rows and seeds
already there are skipped).

    python -m harness.plt_forms run --rows paper,shared --seeds 0,1,2   # one flock'd command per row in RESULTS
    python -m harness.plt_forms table                                   # the table from OUT/results.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch

from harness.cli import (ArgumentParser, UsageError, append_line, check_output_file, check_writable_dir, comma_list,
                         number, path_arg, read_json, run_child, run_cli, run_subcommand, seed_arg)

# The recipe of "The loop input" (RESULTS.md): plt.py's tiny preset, PLT-2 (Table 2's row 5), 16 x 128 tokens a step.
RECIPE = ["--arch", "plt", "--plt-variant", "plt", "--preset", "tiny", "--batch-size", "16", "--seq-len", "128",
          "--lr", "2e-3", "--eval-iters", "20", "--sample-tokens", "0"]
LOOPCODER_INPUT = ["--plt-loop-norm", "none", "--plt-emb-scale", "0.707", "--plt-hidden-scale", "0.053",
                   "--plt-loop-final-norm"]
# row -> flags. The loop-input forms sit on the paper's raw sum (loop norm none); the gate and the window, which leave
# the loop input alone, on the default (shared) too, where the loop input learns.
ROWS = {
    "paper": ["--plt-loop-norm", "none"],
    "shared": ["--plt-loop-norm", "shared"],
    "scales 0.707/0.053": ["--plt-loop-norm", "none", "--plt-emb-scale", "0.707", "--plt-hidden-scale", "0.053"],
    "scales learned": ["--plt-loop-norm", "none", "--plt-learn-scales"],
    "final norm": ["--plt-loop-norm", "none", "--plt-loop-final-norm"],
    "final norm + scales": LOOPCODER_INPUT,
    "final norm + scales learned": LOOPCODER_INPUT + ["--plt-learn-scales"],
    "residual gate": ["--plt-loop-norm", "none", "--plt-gate", "residual"],
    "w+1": ["--plt-loop-norm", "none", "--plt-window-keys", "w+1"],
    "shared + residual gate": ["--plt-loop-norm", "shared", "--plt-gate", "residual"],
    "shared + w+1": ["--plt-loop-norm", "shared", "--plt-window-keys", "w+1"],
    "loopcoder": LOOPCODER_INPUT + ["--plt-gate", "residual", "--plt-window-keys", "w+1"],
}
N_WINDOWS = 4  # validation windows of the probe (the run's batch x seq_len each); it probes position seq_len // 2


def slug(row: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", row)


@torch.no_grad()
def probe(path, cache_dir) -> dict:
    """A trained checkpoint -> {e_share, own, prev, scales}: loop 2's input at every position, rms of the embedding
    part over rms of the state part (positions >= 1); the mean L2 change of the logits at i = seq_len // 2 when token
    i is replaced by the next token id (own) and when token i - 1 is (prev); the learned (a, b) or None."""
    import eval as ev
    from plt import shift_right

    ck, model, tok = ev.load_run(path, "cpu")
    a = ck["args"]
    share, own, prev = [], [], []
    i = a["seq_len"] // 2
    for x, _ in ev.val_windows(ck, tok, N_WINDOWS, a["batch_size"], a["seq_len"], 0, "cpu", cache_dir):
        hs, _ = model.hidden_states(x)
        e_part, h_part = model.clp_summands(model.embed(x), shift_right(model.loop_state(hs[0])), 1)
        share.append(float(e_part[:, 1:].pow(2).mean().sqrt() / h_part[:, 1:].pow(2).mean().sqrt()))  # i >= 1
        base = model(x)[0][:, i]
        for j, out in ((i, own), (i - 1, prev)):
            x2 = x.clone()
            x2[:, j] = (x2[:, j] + 1) % model.config.vocab_size
            out.append(float((model(x2)[0][:, i] - base).norm(dim=-1).mean()))
    scales = model.loop_scales.tolist() if model.loop_scales is not None else None
    return dict(e_share=statistics.mean(share), own=statistics.mean(own), prev=statistics.mean(prev), scales=scales)


def run(args):
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if not rows or unknown:
        raise UsageError(f"--rows: unknown rows {unknown or [args.rows]}; known: {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    check_writable_dir(Path(args.out), "--out")
    results_path = os.path.join(args.out, "results.jsonl")
    check_output_file(results_path, "--out's results file")
    done = {(r["row"], r["seed"], r["steps"]) for r in read_results(results_path, missing_ok=True)}
    for row in rows:
        for seed in seeds:
            if (row, seed, args.steps) in done:
                print(f"{row} seed {seed} ({args.steps} steps): in {results_path} already")
                continue
            out = os.path.join(args.out, f"{slug(row)}-{args.steps}-s{seed}")
            argv = RECIPE + ROWS[row] + ["--max-iters", str(args.steps), "--eval-interval", str(args.steps),
                                         "--seed", str(seed), "--out-dir", out, "--cache-dir", args.cache_dir]
            val = train(argv)
            rec = dict(row=row, seed=seed, steps=args.steps, val=val, argv=argv,
                       **probe(os.path.join(out, "ckpt.pt"), args.cache_dir))
            append_line(results_path, json.dumps(rec))
            print(json.dumps({k: v for k, v in rec.items() if k != "argv"}), flush=True)


def train(argv) -> float:
    """`python train.py ARGV` in a child process -> the loss of its last `val` line."""
    print("python train.py " + " ".join(argv), flush=True)
    val = None

    def on_line(line):
        nonlocal val
        print(line, end="", flush=True)
        m = re.match(r"val step \d+ loss ([\d.]+)", line)
        if m:
            val = float(m.group(1))

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_child([sys.executable, os.path.join(here, "train.py"), *argv], on_line,
              f"the run was stopped: python train.py {' '.join(argv)}",
              lambda code: f"the run failed (exit code {code}): python train.py {' '.join(argv)}")
    if val is None:
        raise UsageError(f"python train.py {' '.join(argv)} printed no val line")
    return val


def read_results(path, missing_ok=False) -> list[dict]:
    if missing_ok and not os.path.lexists(path):
        return []
    return list(read_json(path, "--results", "a record of plt_forms run", record_problem, lines=True,
                          missing="does not exist (python -m harness.plt_forms run writes it)"))


def record_problem(r: dict) -> str | None:
    for k, kind in (("row", str), ("seed", int), ("steps", int), ("val", float), ("e_share", float), ("own", float),
                    ("prev", float)):
        if not isinstance(r.get(k), kind) or isinstance(r.get(k), bool):
            return f"its {k!r} is not a {kind.__name__}"
    return None


def table(args):
    """Per (steps, row): mean ± half the range over seeds of the val loss, the embedding share of loop 2's input,
    own / prev (the logit moves), and learned a, b."""
    recs = read_results(args.results)
    groups = {}
    for r in recs:  # a rerun of a seed replaces it
        groups.setdefault((r["steps"], r["row"]), {})[r["seed"]] = r

    def pm(v, fmt):
        return f"{statistics.mean(v):{fmt}} ± {(max(v) - min(v)) / 2:{fmt}}"

    order = {row: i for i, row in enumerate(ROWS)}
    print("| steps | row | val loss | rms(a E) / rms(b S(H)) at loop 2 | logits at i move: token i / token i-1 | "
          "learned a, b | seeds |")
    print("|---|---|---|---|---|---|---|")
    for (steps, row), by_seed in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))):
        rs = list(by_seed.values())
        learned = [r["scales"] for r in rs if r.get("scales")]
        ab = (", ".join(f"{statistics.mean(s[i] for s in learned):.3f}" for i in range(2)) if learned else "-")
        print(f"| {steps} | {row} | {pm([r['val'] for r in rs], '.3f')} | {pm([r['e_share'] for r in rs], '.3f')} | "
              f"{pm([r['own'] for r in rs], '.2f')} / {pm([r['prev'] for r in rs], '.2f')} | {ab} | "
              f"{','.join(map(str, sorted(by_seed)))} |")


def build_parser():
    ap = ArgumentParser(prog="python -m harness.plt_forms", description=__doc__.split("\n\n")[1].strip(),
                        formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("run", help="train each row for each seed, probe its checkpoint, append to OUT/results.jsonl")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    p.add_argument("--seeds", type=comma_list(seed_arg), default="0,1,2", help="comma-separated seeds")
    p.add_argument("--steps", type=number(int, min=1), default=150, help="training steps of 16 x 128 tokens")
    p.add_argument("--out", type=path_arg, default="out/plt_forms", help="checkpoints and results.jsonl")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help="train.py's token cache")
    p.set_defaults(fn=run)
    p = sub.add_parser("table", help="the markdown table from a results file")
    p.add_argument("--results", type=path_arg, default="out/plt_forms/results.jsonl")
    p.set_defaults(fn=table)
    return ap


def main(argv=None):
    """The command: a mistake is one line `error: ...` and exit code 2 (cli.run_cli)."""
    return run_cli(lambda a: run_subcommand(build_parser(), a), argv)


if __name__ == "__main__":
    main()
