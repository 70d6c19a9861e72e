"""
curve.py -- train.py's recovery curve (--curve-at): the loss on a fixed evaluation set at chosen token counts, logged
and appended to OUT_DIR/curve.jsonl beside the checkpoint, read back by --resume and by `python eval.py recovery`.

The fixed evaluation set is the first --curve-tokens of the validation split (data.first_tokens_windows), scored by
model.windows_loss with fp32 weights and no autocast: the number `python eval.py loss` gives the checkpoint. Each
count is reached after the first step at or past it; a resumed run keeps the points it has and measures no earlier
point again.
"""
from __future__ import annotations

import json
import os

import torch

from harness.cli import UsageError, append_line, check_output_file, fields_problem, log, read_json
from harness.data import first_tokens_windows
from model import windows_loss

def tokens_per_step(args, world) -> int:
    """The tokens one optimizer step trains on: --batch-size x --seq-len x --grad-accum x the processes."""
    return args.batch_size * args.seq_len * args.grad_accum * world


def check_curve(args, world) -> set[int] | None:
    """--curve-at's token counts -> the steps after which they are reached (the first step at or past each), refused
    before any work when the run ends earlier."""
    if not args.curve_at:
        return None
    per_step = tokens_per_step(args, world)
    counts = [int(float(c)) for c in args.curve_at.split(",")]
    steps = {c: -(-c // per_step) for c in counts}  # each count -> the first step at or past it
    late = [c for c, step in steps.items() if step > args.max_iters]
    if late:
        raise UsageError(f"--curve-at {late[0]:,} tokens is past the run's end: {args.max_iters} steps x {per_step:,} "
                         f"tokens = {args.max_iters * per_step:,}")
    return set(steps.values())


def setup_curve(args, steps, val_data, world, device, resume_ck, master) -> dict | None:
    """The recovery curve's pieces: the fixed evaluation set (the first --curve-tokens of the validation split),
    its steps and OUT_DIR/curve.jsonl (a fresh run starts it empty; a resumed one keeps the points it has)."""
    if steps is None:
        return None
    x, y = first_tokens_windows(val_data, args.curve_tokens, args.seq_len, f"the validation split of {args.data}")
    path = args.out_dir / "curve.jsonl"
    done = set()
    if resume_ck is not None and os.path.lexists(path):
        done = {point["step"] for point in read_curve(path)}
    elif master:
        path.unlink(missing_ok=True)
    if master:  # appended after each point: never through a link, never into a FIFO
        check_output_file(path, "--curve-at's file")
    card = f"{world} x " if world > 1 else ""
    card += f"{device.type} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    return {"steps": steps, "done": done, "x": x, "y": y, "file": path, "device": card}


def curve_point(run, step):
    """--curve-at: the loss on the fixed evaluation set (data.first_tokens_windows; model.windows_loss, the number
    `python eval.py loss` gives the checkpoint: fp32 weights, no autocast) after `step` optimizer steps, logged and
    appended to OUT_DIR/curve.jsonl with the tokens trained so far. A resumed run skips the steps already there."""
    c = run.curve
    if run.master:
        run.raw_model.eval()
        loss = windows_loss(run.raw_model, c["x"], c["y"], CURVE_BATCH, run.device)
        run.raw_model.train()
        tokens = step * run.tokens_per_step
        log(f"curve step {step} tokens {tokens} loss {loss:.4f}")
        append_line(c["file"], json.dumps({"step": step, "tokens": tokens, "loss": loss, "eval_tokens": c["y"].numel(),
                                           "seq_len": c["y"].size(1), "data": run.args.data, "device": c["device"],
                                           "params": run.raw_model.num_params(False),
                                           "non_emb": run.raw_model.num_params()}), "curve file")
    c["done"].add(step)


CURVE_POINT = {"step": int, "tokens": int, "loss": float, "eval_tokens": int, "params": int, "non_emb": int,
               "device": str}  # the fields of a curve.jsonl line that train.py --resume and eval.py recovery read


def read_curve(path) -> list[dict]:
    """OUT_DIR/curve.jsonl (curve_point's lines) -> its points, in the order they were written; a file or a line that
    is not such a point is one line naming it (cli.read_json)."""
    return read_json(path, "curve file", "a point of train.py's recovery curve",
                     lambda point: fields_problem(point, CURVE_POINT), lines=True, missing="does not exist",
                     damaged=True, fix="remove that line or the file (a resumed run measures no point before its "
                                       "step again)")


CURVE_BATCH = 8  # windows per forward pass of the fixed evaluation set (the loss does not depend on it)
