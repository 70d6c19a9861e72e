"""
train.py -- pretraining and uptraining for every architecture of this repository.

The training loop first (AdamW with warmup + cosine, knowledge distillation, an evaluation and a checkpoint every
--eval-interval steps, single process or DDP under torchrun), then the run's setup and how its model comes to be
(build_models: resumed, converted from a vanilla model by its paper's own conversion, or new from a preset), the
schedule, the flags and their defaults. What a reader can skip is in harness/: data.py (the tokenizer, the corpus:
`--data stdlib` is the offline default, the batches), tasks.py (`--data task:phop`), checkpoint.py (the checkpoint
files, read back verified; hf:DIR and gguf:PATH sources), run_flags.py (how --resume and --init-from treat the flags,
the checks made before the first step), archs.py (the architecture table), curve.py (--curve-at's file), memory.py (a
step's memory estimate), cli.py (the error contract, the log, the --out-dir lock).

Runs (their wall times on 2 CPU cores: RESULTS.md, Timings):
    python train.py --arch vanilla                                  # the baseline, on the offline default corpus
    python train.py --arch plt                                      # any arch of archs.arch_table()
    python train.py --arch relaxed --init-from out/vanilla/ckpt.pt --loops 2 --init average \\
        --teacher out/vanilla/ckpt.pt --kd fkl                      # uptraining: convert, then distill
    python train.py --resume --out-dir out/relaxed                  # continue a run with its own flags
    python train.py --arch recursive --init-from smollm2-135m --teacher smollm2-135m --curve-at 0,3e5,1e6 \\
        --mix-data out/recovery/samples                             # a recovery curve, half the windows teacher text
    python train.py --data /data/SlimPajama-627B/train --exclude-sets RedPajamaGithub --preset small
    torchrun --nproc_per_node=8 train.py --preset base --data ...   # DDP (nccl on GPU, gloo on CPU)

Log lines are greppable: `step N loss X lr Y ms Z tok/s W mfu M`, `val step N loss X ppl Y` and, with --curve-at,
`curve step N tokens T loss X` (the fixed evaluation set of `python eval.py loss`, also in OUT_DIR/curve.jsonl).
`loss` is always the LM cross-entropy (the quantity val measures). When the objective has more terms, the header says
so ("objective: LM cross-entropy + KD fkl x1.0 (temperature 1.0) from T" / "+ exit loss aggressive coef 0.1 +
self-distill") and the step line adds them after `loss`: `kd` (the distillation term before its weight), `total` (the
objective that is optimised), and the model's own metrics (the per-loop exit terms `loss_l1 ... kd_l1 ...`) at the
end. On a task both lines add its accuracy per p after the loss terms: `acc p1 0.998 p2 0.951 ...`.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import block_transformer
import plt
import recursive
from harness import tasks
from harness.archs import add_arch_args, arch_table
from harness.checkpoint import (keep_layers, load_checkpoint, load_optimizer_state, load_source_model,
                                model_from_checkpoint, run_checkpoint, run_tokenizer, save_checkpoint)
from harness.cli import (DTYPES, ArgumentParser, CheckpointError, DefaultsHelpFormatter, Stopped, UsageError,
                         check_disk_space, check_step_memory, comma_list, hold_dir_lock, log, number, path_arg,
                         releasing_dir_locks, run_cli, seed_arg, stop_signals, user_input)
from harness.curve import check_curve, curve_point, setup_curve, tokens_per_step
from harness.data import Tokenizer, load_data, padded_vocab, step_generator
from harness.device import peak_flops, pick_device, pick_dtype
from harness.memory import least_step_memory, step_memory
from harness.run_flags import (check_run_args, given_flags, init_same_arch, recipe_overrides, resume_run, saved_flags,
                               warn_inapplicable)
from model import GPT, ArchSpec, distill_loss, lm_loss, make_optimizer
from plt import PLT
from svd_lora import COMPONENTS, max_ranks

# ----------------------------------------------------------------------------------------------------------------
# The training loop


@releasing_dir_locks()
def train(argv=None):
    """One run: setup_run builds everything from the flags (and refuses what cannot work before the first step), then
    the loop. -> the last logged losses, the best validation loss and, on a task, the last validation accuracies."""
    run = setup_run(argv)
    args, model, optimizer, master = run.args, run.model, run.optimizer, run.master
    flops_per_step, peak = run.raw_model.flops_per_token(args.seq_len) * run.tokens_per_step, peak_flops(run.device)
    bar = tqdm(total=args.max_iters, initial=run.start_step, desc=f"train {args.arch}",
               disable=None if master else True, file=sys.stderr, leave=False)
    last_loss, last_total, last_acc, t0 = None, None, None, time.perf_counter()
    model.train()
    with stop_signals(lambda name: f"{name} again: stopped at once; {kept(run)}{resume_hint(run)}") as run.asked:
        for step in range(run.start_step, args.max_iters + 1):  # `step` optimizer steps are done
            # -- evaluate and checkpoint: every --eval-interval steps and after the last one
            if step > run.start_step and (step % args.eval_interval == 0 or step == args.max_iters):
                val, val_counts = evaluate(run, step)
                log(f"val step {step} loss {val:.4f} ppl {math.exp(min(val, 30)):.2f}{scores_text(val_counts)}", master)
                check_val_loss(run, val, step)
                write_checkpoint(run, step, val)
                run.best_val, last_acc = min(run.best_val, val), tasks.accuracies(val_counts) or None
                t0 = time.perf_counter()
            if run.curve is not None and step in run.curve["steps"] and step not in run.curve["done"]:
                curve_point(run, step)
            if step == args.max_iters:
                break
            if step > run.start_step:
                stop_if_asked(run, step)

            # -- forward, backward, update: --grad-accum micro-batches, each drawn by its own step_generator (a resumed
            # run draws the batches an uninterrupted one would), then one AdamW step at the schedule's lr
            lr = lr_at(step, args.lr, args.warmup_iters, args.lr_decay_iters, args.min_lr)
            set_lr(optimizer, lr)
            total, lm_total, kd_total, counts = 0.0, 0.0, 0.0, {}
            for micro in range(args.grad_accum):
                if micro:
                    stop_within_step(run, step)
                x, y, kw = batch_on_device(run, run.train_data, step_generator(args.seed, step, micro, run.rank))
                sync = contextlib.nullcontext() if (not run.ddp or micro == args.grad_accum - 1) else model.no_sync()
                with sync:
                    loss, lm, kd, logits = loss_of(run, x, y, kw)
                    (loss / args.grad_accum).backward()
                tasks.add_counts(counts, scores(run, logits.detach(), x, y))
                total += loss.detach() / args.grad_accum
                lm_total += lm.detach() / args.grad_accum
                if kd is not None:
                    kd_total += kd.detach() / args.grad_accum
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            if not torch.isfinite(total):
                raise FloatingPointError(stopped(run, f"non-finite loss {total.item()}", step + 1))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update(1)

            # -- timing and logging: every --log-interval steps, the first and the last
            done = step + 1
            if done % args.log_interval == 0 or done == args.max_iters or step == run.start_step:
                if run.device.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                n = done - run.start_step if step == run.start_step else min(args.log_interval, done - run.start_step)
                dt, t0 = (t1 - t0) / max(1, n), t1
                last_loss, last_total = lm_total.item(), total.item()
                terms = (f" kd {kd_total.item():.4f}" if run.teacher is not None else "") + \
                    (f" total {last_total:.4f}" if run.extra_terms else "")
                mfu = f"{flops_per_step / dt / (peak * run.world) * 100:.1f}%" if peak else "n/a"
                metrics = "".join(f" {k} {v:.4f}" for k, v in getattr(run.raw_model, "metrics", {}).items())
                log(f"step {done} loss {last_loss:.4f}{terms}{scores_text(counts)} lr {lr:.2e} ms {dt * 1000:.1f} "
                    f"tok/s {run.tokens_per_step / dt:.0f} mfu {mfu}{metrics}", master)
    bar.close()
    if master and run.task is not None:
        x, y = run.val_data.get_batch(1, args.seq_len, step_generator(args.seed, -1, 0, 0))
        log(tasks.answers_text(run.raw_model, run.task, x, y, run.device))
    elif master and args.sample_tokens > 0:
        sample(run.raw_model, run.tok, run.device, args)
    if run.ddp:
        dist.barrier()
        dist.destroy_process_group()
    return {"loss": last_loss, "total": last_total, "best_val_loss": run.best_val, "acc": last_acc}


def batch_on_device(run, data, gen):
    """-> x, y on the run's device and the arch's extra model inputs (spec.prepare_batch re-lays some out)."""
    x, y = data.get_batch(run.args.batch_size, run.args.seq_len, gen)
    kwargs = {}
    if run.spec.prepare_batch is not None:
        x, y, kwargs = run.spec.prepare_batch(x, y, gen, run.raw_model.config)
    return x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True), kwargs


def loss_of(run, x, y, kwargs):
    """-> (the objective, the LM cross-entropy, the unweighted KD term or None, the logits)."""
    args = run.args
    with run.autocast:
        logits, loss = run.model(x, y, **kwargs)
        lm, kd = loss, None
        if run.exit_on:  # the model's loss holds the exit terms: the final loop's CE alone is what val measures
            with torch.no_grad():
                lm = lm_loss(logits, y)
        if run.teacher is not None:
            with torch.no_grad():
                t_logits, _ = run.teacher(x)
            v = run.tok.n_vocab
            kd = distill_loss(logits[..., :v], t_logits[..., :v], args.kd, args.kd_temperature,
                              mask=(y != -100).float())
            loss = loss + args.kd_weight * kd
    return loss, lm, kd, logits


@torch.no_grad()
def evaluate(run, step):
    """The evaluation after `step` steps -> the mean validation loss and the batches' scores summed (on a task
    {p: (correct, labels)}, else {})."""
    model = run.model
    model.eval()
    losses, counts = [], {}
    for i in tqdm(range(run.args.eval_iters), desc="eval", leave=False, disable=None if run.master else True,
                  file=sys.stderr):
        if i:
            stop_within_step(run, step)
        x, y, kw = batch_on_device(run, run.val_data, step_generator(run.args.seed, -1, i, run.rank))
        with run.autocast:
            logits, loss = model(x, y, **kw)
        losses.append(loss.float())
        tasks.add_counts(counts, scores(run, logits, x, y))
    loss = torch.stack(losses).mean()
    if run.ddp:
        dist.all_reduce(loss)
        loss /= run.world
    model.train()
    return loss.item(), counts


def scores(run, logits, x, y) -> dict:
    """What the step and val lines report of a batch beyond its loss: on a task (tasks.py) its {p: (correct, labels)},
    summed over batches with tasks.add_counts; else nothing ({})."""
    return run.task.score(logits, x, y) if run.task is not None else {}


def scores_text(counts) -> str:
    return f" {tasks.accuracy_text(counts)}" if counts else ""


def check_val_loss(run, val, step):
    """A non-finite validation loss stops the run without writing its checkpoint. A finite one is compared with where
    the run started, and one that says the run has diverged is one warning per run (the run goes on):
      * after an earlier evaluation (of this run, or of the run it resumes): a nat above the best validation loss so
        far;
      * the first evaluation of a run from random weights: a nat above ln V, the loss of a uniform guess over the V
        tokens, which is where an untrained model's small random logits start;
      * the first evaluation of a run from weights (--init-from, --resume): that start is the model's own, and a
        converted or imported model may well start above ln V + 1 (its layers were re-tied or dropped); that is
        said once as a note, not as a divergence, and later evaluations are compared with it."""
    if not math.isfinite(val):  # the NaN guard covers the evaluation: a diverged model is never saved
        raise FloatingPointError(stopped(run, f"non-finite validation loss {val}", step))
    if run.warned_divergence:
        return
    uniform = math.log(run.tok.n_vocab)
    lr = f"lower --lr, now {run.args.lr:g}"
    if math.isfinite(run.best_val):
        if val > run.best_val + 1:
            run.warned_divergence = True
            warnings.warn(f"validation loss {val:.4f} at step {step} is more than a nat above the best of this run so "
                          f"far ({run.best_val:.4f}): the run has diverged ({lr})", stacklevel=2)
    elif val > uniform + 1:
        start = f"--init-from {run.args.init_from}" if run.args.init_from else \
            f"the checkpoint in {run.args.out_dir}" if run.start_step > 0 else None
        if start is None:
            run.warned_divergence = True
            warnings.warn(f"validation loss {val:.4f} at step {step}, the first evaluation, is above ln("
                          f"{run.tok.n_vocab}) + 1 = {uniform + 1:.4f}, a nat worse than a uniform guess, where a "
                          f"model from random weights starts: the run has diverged ({lr})", stacklevel=2)
        else:
            log(f"note: validation loss {val:.4f} at step {step}, the first evaluation, is above ln({run.tok.n_vocab}) "
                f"+ 1 = {uniform + 1:.4f} (a uniform guess): the run starts from the weights of {start}, and a "
                f"converted or imported model can start worse than guessing until training recovers it; later "
                f"evaluations are compared with this one", run.master)


def stop_if_asked(run, step):
    """Ctrl-C or SIGTERM reached this process (cli.stop_signals) or, under DDP, any rank (every rank stops after the
    same step): the checkpoint of `step` unless it is on disk already, then cli.Stopped saying how to continue."""
    asked = run.asked
    stop = bool(asked)
    if run.ddp:
        flag = torch.tensor([float(stop)], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = flag.item() > 0
    if not stop:
        return
    if run.last_good != step:
        write_checkpoint(run, step, None)
    raise Stopped(f"{asked[0] if asked else 'another rank was signalled'} after step {step}: checkpoint {run.ck_file} "
                  f"(step {step}) written{resume_hint(run)}")


def stop_within_step(run, step):
    """Between two micro-batches of a step, or two batches of an evaluation: a stop asked for ends the run here, so a
    long step (a large --grad-accum, --eval-iters) never delays it. Nothing of the unfinished step has touched the
    weights or the optimizer yet (optimizer.step comes after the last micro-batch), so the checkpoint written is that
    of the `step` whole steps done (stop_if_asked). Under DDP the ranks agree on a stop between steps only (a rank
    leaving mid-step would hang the others' gradient all-reduce); a second signal stops at once there too."""
    if run.asked and not run.ddp:
        stop_if_asked(run, step)


def resume_hint(run) -> str:
    return f"; continue with: python train.py --resume --out-dir {run.args.out_dir}" if run.last_good is not None \
        else ""


def kept(run) -> str:
    """What is on disk when the run stops without writing its checkpoint."""
    return (f"the last good checkpoint stays at {run.ck_file} (step {run.last_good})" if run.last_good is not None
            else "no checkpoint was written")


def stopped(run, what, step) -> str:  # the error of a run that stops without writing its checkpoint
    return f"{what} at step {step}; stopping without writing a checkpoint: {kept(run)}"


def write_checkpoint(run, step, val_loss):
    """The run at `step` to run.ck_file (val_loss None: a stop between evaluations), unless a weight is not finite: a
    diverged model is never saved. A failed write keeps the last good checkpoint."""
    args, raw_model = run.args, run.raw_model
    bad = [n for n, p in raw_model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(stopped(run, f"non-finite weights in {bad[0]}"
                                         + (f" and {len(bad) - 1} more tensors" if len(bad) > 1 else ""), step))
    if run.master:
        try:
            save_checkpoint(run.ck_file, run_checkpoint(raw_model, run.optimizer, step, run.best_val, val_loss,
                                                        run.tok.spec, args))
        except CheckpointError as e:
            raise CheckpointError(f"{e} at step {step}; {kept(run)}") from e
    run.last_good = step


@dataclass
class Run:
    """What the loop and its helpers share, built by setup_run. `model` runs the steps (compiled and/or DDP-wrapped);
    `raw_model` is the module itself (its config, weights and state dict)."""
    args: argparse.Namespace
    spec: ArchSpec
    tok: Tokenizer
    task: object  # tasks.PHopTask of --data task:..., else None
    device: torch.device
    autocast: object  # torch.autocast, or a null context in fp32
    ddp: bool
    rank: int
    world: int
    tokens_per_step: int  # curve.tokens_per_step, after build_models (a task sets --seq-len there)
    raw_model: torch.nn.Module
    model: torch.nn.Module
    teacher: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    train_data: object  # TokenData or tasks.TaskData
    val_data: object
    exit_on: bool  # the model's loss holds per-loop exit terms (objective_line)
    extra_terms: bool  # the objective has terms beyond the LM loss: the step line logs `total`
    start_step: int
    best_val: float
    last_good: int | None  # the step of the checkpoint on disk, None before the first is written
    warned_divergence: bool = False  # check_val_loss warns once per run
    asked: list = field(default_factory=list)  # the stops asked for (cli.stop_signals: the signals' names)
    curve: dict | None = None  # --curve-at: steps, the fixed evaluation set, OUT_DIR/curve.jsonl (setup_curve)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def ck_file(self) -> Path:
        return self.args.out_dir / "ckpt.pt"


def setup_run(argv) -> Run:
    """Flags (and --resume's), device, tokenizer, model, teacher, optimizer and data, in that order: every check that
    can fail comes before the corpus is tokenized and before the first step."""
    table = arch_table()
    ap, args, given, resume_ck, notes = parse_run_args(argv, table)
    spec = table[args.arch]
    with saved_flags(resume_ck):  # on --resume the flags are the checkpoint's: an error says so
        resolve_defaults(args, spec)
    start_step, best_val, length_notes = check_run_args(args, resume_ck, given)
    if int(os.environ.get("RANK", "0")) == 0:  # one run per --out-dir (under torchrun rank 0 holds it)
        hold_dir_lock(args.out_dir, "--out-dir")
    ddp, rank, local_rank, world, device = setup_distributed(args.device)
    master = rank == 0
    curve_steps = check_curve(args, world)
    if master:
        for n in notes + length_notes:
            log(f"resume: {n}")
    torch.manual_seed(args.seed)
    dtype = pick_dtype(device, args.dtype)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    with user_input():  # every flag is checked here, before the corpus is tokenized
        tok, task, model, teacher = build_models(args, spec, table, ap, given, resume_ck, dtype, device, master)
    if master:  # after the checks: a run refused is its one error line
        warn_inapplicable(ap, args, given)
    model.to(device)
    if teacher is not None:
        teacher.to(device).eval().requires_grad_(False)
    check_step_memory(least_step_memory(args.batch_size, args.seq_len, model.config.vocab_size, dtype, model), device,
                      args, at_least=True)
    need = step_memory(model, spec, args.batch_size, args.seq_len, tok.n_vocab, device, autocast, teacher is not None)
    avail = check_step_memory(need, device, args)
    if master:
        check_disk_space(model, args.out_dir)
    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    if resume_ck is not None:
        load_optimizer_state(optimizer, resume_ck, resume_ck["loaded_from"])
    train_data, val_data = load_data(args, task, tok, master, ddp)
    curve = setup_curve(args, curve_steps, val_data, world, device, resume_ck, master)
    per_step = tokens_per_step(args, world)

    objective, exit_on, extra_terms = objective_line(args, model.config, teacher)
    if master:
        data_line = (f"task {json.dumps(task.spec())} seq_len {args.seq_len}" if task is not None else
                     f"tokens train {sum(len(s) for s in train_data.shards):,} val "
                     f"{sum(len(s) for s in val_data.shards):,}"
                     + (f" (train: {1 - args.mix_weight:.0%} of the windows from {args.data} "
                        f"{sum(len(s) for s in train_data.parts[0].shards):,}, {args.mix_weight:.0%} from "
                        f"{args.mix_data} {sum(len(s) for s in train_data.parts[1].shards):,})"
                        if args.mix_data else ""))
        log(f"config {json.dumps(asdict(model.config))}")
        log(f"arch {args.arch} | params {model.num_params(False) / 1e6:.2f}M total, "
            f"{model.num_params() / 1e6:.2f}M non-embedding | device {device} {dtype} | world {world} | "
            f"{data_line} | step memory ~{need['total'] / 1e9:.2f} GB (estimate)"
            + (f" of {avail / 1e9:.1f} GB available" if avail else ""))
        if objective:
            log(objective)
        if curve is not None:
            log(f"curve: the first {curve['y'].numel():,} tokens of the validation split of {args.data} "
                f"({len(curve['y'])} windows of {args.seq_len}) after steps {sorted(curve['steps'])} (x "
                f"{per_step:,} tokens) -> {curve['file']}")
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                                          else None)
    return Run(args=args, spec=spec, tok=tok, task=task, device=device, autocast=autocast, ddp=ddp, rank=rank,
               world=world, tokens_per_step=per_step, raw_model=raw_model, model=model, teacher=teacher,
               optimizer=optimizer, train_data=train_data, val_data=val_data, exit_on=exit_on, extra_terms=extra_terms,
               start_step=start_step, best_val=best_val, last_good=start_step if resume_ck is not None else None,
               curve=curve)


def parse_run_args(argv, table):
    """The flags; with --resume, the run's own flags restored from its checkpoint (run_flags.resume_run) -> (parser,
    args, the flags typed, the checkpoint to resume or None, notes about flags taken from the command line)."""
    ap = build_parser(table)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    given = given_flags(ap, argv)
    resume_ck, notes = resume_run(ap, args, given, table) if args.resume else (None, [])
    return ap, args, given, resume_ck, notes


# ----------------------------------------------------------------------------------------------------------------
# The model of a run: resumed, started from another model's weights, or new


def build_models(args, spec: ArchSpec, table, ap, given, resume_ck, dtype, device, master):
    """The run's tokenizer, model and teacher -> (tok, task or None, model, teacher or None).

    A run's model comes to be in one of three ways:
      1. --resume: the model of the run's checkpoint, its config and weights (setup_run then loads the optimizer's
         state into a new AdamW);
      2. --init-from SOURCE, a train.py checkpoint, hf:DIR (a local Hugging Face checkpoint) or gguf:PATH: a model of
         this architecture keeps its weights and takes the training-recipe flags typed now (run_flags.init_same_arch:
         the early-exit post-training of the Relaxed Recursive Transformers paper, Appendix J); a vanilla model, after
         --keep-layers picks its layers, goes through its paper's own conversion (convert, below);
      3. otherwise a new model of the preset, shaped by the flags, with random weights.
    What can fail is checked before anything is built: the tokenizer against the data, the step's memory, and the
    flags' config fields (spec.config_overrides) whichever way the model is made."""
    task = tasks.task_from_args(args) if tasks.is_task_source(args.data) else None
    if task is not None and "seq_len" not in given and resume_ck is None:
        args.seq_len = -(-task.seq_len // 8) * 8  # a multiple of 8: block models need whole blocks
    load = functools.cache(load_checkpoint)  # a checkpoint in several roles (--init-from's tokenizer and weights,
    # --teacher the same file) is read and verified once; each model is built from it (load_state_dict copies)
    tok = run_tokenizer(args, resume_ck, task, load)
    if task is None and isinstance(tok, tasks.TaskTokenizer):  # --init-from a task's checkpoint, on text
        raise UsageError(f"--init-from {args.init_from} was trained on the synthetic task {tok.spec['name']!r}: its "
                         f"tokenizer reads no text, and --data {args.data} is a text corpus; give --data "
                         f"task:{tok.spec['name']}, or start from a model trained on text")
    check_step_memory(least_step_memory(args.batch_size, args.seq_len, padded_vocab(tok.n_vocab), dtype), device, args,
                      at_least=True)

    if resume_ck is not None:  # 1. --resume
        model = model_from_checkpoint(resume_ck, table)
    else:
        fields = dict(vocab_size=padded_vocab(tok.n_vocab), max_seq_len=args.seq_len)
        if spec.config_overrides is not None:  # the flags' config fields, checked however the model is made
            fields.update(spec.config_overrides(args, tok=tok))
        if args.init_from:  # 2. --init-from
            src, src_arch, _ = load_source_model(args.init_from, table, load)
            if args.keep_layers:
                if src_arch != "vanilla":
                    raise UsageError(f"--keep-layers takes layers of a vanilla model; {args.init_from} holds a "
                                     f"{src_arch} one")
                src = keep_layers(src, args.keep_layers)
                log(f"init from {args.init_from}: keeping layers {args.keep_layers} ({src.config.n_layer} layers)",
                    master)
            if src_arch == args.arch:
                model, line = init_same_arch(src, spec, recipe_overrides(args, spec, ap, given), args.seq_len,
                                             args.init_from)
                log(line, master)
            elif src_arch != "vanilla" or args.arch not in CONVERSIONS:
                why = "conversion starts from a vanilla model" if args.arch in CONVERSIONS else "no conversion exists"
                raise UsageError(f"cannot initialise a {args.arch} model from a {src_arch} checkpoint ({why})")
            else:
                log(f"init from {args.init_from}: converting vanilla -> {args.arch}", master)
                model = convert(args, src, tok)
        else:  # 3. new, from the preset
            model = spec.model_cls(spec.make_config(args.preset, **fields))
    if args.teacher != args.init_from:
        load.cache_clear()  # kept only for a teacher that is the same file
    if task is not None:
        task = tok.task  # on resume: the checkpoint's task
        task.check_seq_len(args.seq_len)
    if model.config.vocab_size < tok.n_vocab:
        raise UsageError(f"model vocabulary {model.config.vocab_size} is smaller than the tokenizer's {tok.n_vocab}")
    teacher = load_teacher(args, spec, tok, table, load) if args.teacher else None
    return tok, task, model, teacher


CONVERSIONS = ("recursive", "relaxed", "block", "plt")  # the architectures a vanilla model converts into


def convert(args, src: GPT, tok) -> torch.nn.Module:
    """--init-from a vanilla model: the paper's own conversion, its arguments from the flags."""
    if args.arch in ("recursive", "relaxed"):
        # Relaxed Recursive Transformers, section 2.2 / 3.1: the N layers tied into N / B shared ones looped B times
        # (--loops; --init stepwise, average or lower); relaxed: one LoRA per loop, initialised by the truncated SVD
        # of what tying took from each layer (--lora-rank, --lora-init)
        relaxed = args.arch == "relaxed"
        fields = recursive.config_overrides(args, relaxed)
        presets = recursive.RELAXED_PRESETS if relaxed else recursive.RECURSIVE_PRESETS
        preset = presets.get(args.preset, recursive.RECURSIVE_PRESETS["tiny"])
        n_loops = fields.pop("n_loops", preset["n_loops"])
        if relaxed:  # ranks not given: the preset's rank, capped at this source's full rank
            top = max_ranks(src.config)
            for c in COMPONENTS:
                fields.setdefault(f"lora_rank_{c}", min(preset.get(f"lora_rank_{c}", 0), top[c]))
        fields["max_seq_len"] = max(args.seq_len, src.config.max_seq_len)
        return recursive.from_vanilla(src, n_loops=n_loops, init=args.init or ("average" if relaxed else "stepwise"),
                                      lora_init=args.lora_init or "svd", **fields)
    if args.arch == "block":
        # Block Transformer, Appendix N: the lower half of the layers becomes the block decoder, the upper half the
        # token decoder; the embedder a mean of the block's token embeddings, the prefix projection P identities
        if src.config.vocab_size <= tok.n_vocab:
            raise ValueError(f"the vanilla vocabulary ({src.config.vocab_size} rows) has no spare row above the "
                             f"tokenizer's {tok.n_vocab} ids for the pad token")
        if args.block_embedder == "lookup" or args.block_context == "summation":
            raise ValueError("uptraining from a vanilla model (--init-from) uses the lookup_proj embedder and prefix "
                             "decoding (Appendix N); drop --block-embedder lookup / --block-context summation")
        return block_transformer.from_vanilla(src, block_len=args.block_len or 4, prefix_len=args.block_prefix_len or 2,
                                              max_seq_len=args.seq_len, eot_id=tok.eot,
                                              random_pad=not args.block_no_random_pad)
    # Parallel Loop Transformer: the same weights looped (the paper's models are trained from scratch)
    return PLT.from_vanilla(src, **plt.config_overrides(args))


def load_teacher(args, spec: ArchSpec, tok, table, load=load_checkpoint):
    """--teacher: the model (a checkpoint, hf:DIR, gguf:PATH), refused for an architecture whose batches are re-laid out
    or when its tokenizer is not the run's."""
    if not spec.kd_ok:
        raise UsageError(f"--teacher is not supported for --arch {args.arch}: its training inputs are re-laid "
                         f"out, so teacher and student logits would not align")
    teacher, _, t_tok = load_source_model(args.teacher, table, load)
    if t_tok != tok.spec:
        raise UsageError(f"teacher {args.teacher} uses tokenizer {t_tok}, this run uses {tok.spec}: they must be the "
                         f"same")
    return teacher


# ----------------------------------------------------------------------------------------------------------------
# Optimizer and schedule


def set_lr(optimizer, lr):
    """The schedule's lr for this step into every group, times the group's lr_scale (make_optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def lr_at(step, lr, warmup, decay_iters, min_lr):
    """Linear warmup for `warmup` steps, then cosine decay to min_lr at decay_iters."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ----------------------------------------------------------------------------------------------------------------
# Arguments. Every numeric flag is checked while parsing (argparse `type=`), so a bad value is one line before any
# work; argparse's own errors are raised as UsageError (main prints "error: ..." and exits with code 2).


def build_parser(table) -> ArgumentParser:
    """train.py's flags, then each architecture's (spec.add_args). `ap.arch_flags` maps the dest of every flag that
    only some architectures read to their names (the groups each add_args creates; --loops is train.py's own)."""
    ap = ArgumentParser(description="Pretrain or uptrain one architecture of this repository.",
                        formatter_class=DefaultsHelpFormatter)
    pos, nonneg = number(int, min=1), number(int, min=0)
    ap.add_argument("--arch", default="vanilla", choices=sorted(table), help="architecture to train")
    ap.add_argument("--preset", default="tiny", help="config preset of the architecture (tiny, small, base, ...)")
    ap.add_argument("--data", type=path_arg, default="stdlib",
                    help="'stdlib' (offline default corpus), a directory / glob / file of .jsonl(.zst) shards, or "
                         "task:phop (a synthetic task that needs depth, tasks.py)")
    ap.add_argument("--val-data", type=path_arg, default=None,
                    help="validation shards (default: a split of --data by file)")
    ap.add_argument("--exclude-sets", default="", help="comma-separated redpajama_set_name values to skip")
    ap.add_argument("--cache-dir", type=path_arg, default="data_cache", help="where tokenized shards are kept")
    ap.add_argument("--vocab-size", type=number(int, min=256), default=None,
                    help="cut cl100k to this many merge ranks (+1 end-of-text id); default 4096")
    ap.add_argument("--tokenizer", type=path_arg, default=None,
                    help="a full tiktoken encoding name, hf:DIR or gguf:PATH (a GGUF file's vocabulary; "
                         "gguf:smollm2-135m is the packaged SmolLM2-135M)")
    ap.add_argument("--max-iters", type=pos, default=None, help="optimizer steps (default: the arch's)")
    ap.add_argument("--batch-size", type=pos, default=16, help="sequences per micro-batch per process")
    ap.add_argument("--seq-len", type=pos, default=256, help="tokens per sequence")
    ap.add_argument("--grad-accum", type=pos, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=number(float, min=0), default=None,
                    help="peak learning rate (0: weights stay; default: the arch's, else 2e-3)")
    ap.add_argument("--min-lr", type=number(float, min=0), default=None, help="final learning rate (default lr / 10)")
    ap.add_argument("--warmup-iters", type=nonneg, default=None,
                    help="warmup steps (default 10%% of max-iters, <= 200)")
    ap.add_argument("--lr-decay-iters", type=pos, default=None, help="cosine ends here (default max-iters)")
    ap.add_argument("--weight-decay", type=number(float, min=0), default=0.1, help="AdamW weight decay on matrices")
    ap.add_argument("--grad-clip", type=number(float, min=0), default=1.0, help="clip the gradient norm (0 = off)")
    ap.add_argument("--eval-interval", type=pos, default=None, help="steps between evaluations and checkpoints")
    ap.add_argument("--eval-iters", type=pos, default=10, help="validation batches per evaluation")
    ap.add_argument("--log-interval", type=pos, default=10, help="steps between log lines")
    ap.add_argument("--out-dir", type=path_arg, default=None, help="checkpoint directory (default out/ARCH)")
    ap.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | mps | auto")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto (bf16 autocast where supported) | ...")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off on CPU by default)")
    ap.add_argument("--seed", type=seed_arg, default=1337, help="seeds init, data order and sampling")
    ap.add_argument("--resume", action="store_true",
                    help="continue OUT_DIR/ckpt.pt exactly, with the flags of its run (restored from the checkpoint)")
    ap.add_argument("--init-from", type=path_arg, default=None,
                    help="start from weights: a checkpoint of the same arch (its shape, this run's training-recipe "
                         "flags), a vanilla checkpoint to convert, hf:DIR (a local Hugging Face checkpoint) or "
                         "gguf:PATH (a GGUF file; gguf:smollm2-135m is the packaged SmolLM2-135M)")
    ap.add_argument("--keep-layers", default=None, metavar="SPEC",
                    help="with --init-from a vanilla model: keep only these of its layers (stepwise:K, lower:K or a "
                         "comma list): the reduced-size baseline of the recursive paper from pretrained layers")
    ap.add_argument("--teacher", type=path_arg, default=None,
                    help="checkpoint (or hf:DIR, gguf:PATH) of a teacher for knowledge distillation")
    ap.add_argument("--kd", default="none", choices=["none", "fkl", "rkl", "jsd", "tvd"],
                    help="divergence between teacher and student")
    ap.add_argument("--kd-weight", type=number(float, min=0), default=1.0, help="weight of the distillation term")
    ap.add_argument("--kd-temperature", type=number(float, above=0), default=1.0,
                    help="softmax temperature of both distributions")
    ap.add_argument("--loops", type=pos, default=None,
                    help="number of loops of a looped architecture (recursive/relaxed: B, plt: L); default: preset")
    ap.add_argument("--sample-tokens", type=nonneg, default=64, help="tokens of the sample printed at the end")
    ap.add_argument("--mix-data", type=path_arg, default=None,
                    help="a second training corpus (as --data), mixed in at --mix-weight (e.g. text sampled from the "
                         "teacher: python eval.py samples); validation stays --data's")
    ap.add_argument("--mix-weight", type=number(float, above=0, max=1), default=None,
                    help="share of the training windows drawn from --mix-data (default 0.5)")
    ap.add_argument("--curve-at", type=comma_list(number(float, min=0)), default=None, metavar="TOKENS",
                    help="comma list of token counts (e.g. 0,3e5,1e6): after the first step at or past each, the loss "
                         "on the fixed evaluation set (the first --curve-tokens of the validation split, as `python "
                         "eval.py loss`) goes to the log and OUT_DIR/curve.jsonl")
    ap.add_argument("--curve-tokens", type=number(int, min=2), default=51200,
                    help="size of --curve-at's fixed evaluation set in tokens")
    tasks.add_args(ap)
    add_arch_args(ap, table, shared={"loops": {"recursive", "relaxed", "plt"}})
    return ap


def resolve_defaults(args, spec):
    """The flags left unset (None) <- the architecture's train_defaults, then train.py's; the combinations that
    cannot work are UsageErrors."""
    for k, v in spec.train_defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.max_iters = args.max_iters if args.max_iters is not None else 300
    args.lr = args.lr if args.lr is not None else 2e-3
    args.eval_interval = args.eval_interval or max(1, args.max_iters // 4)
    args.warmup_iters = args.warmup_iters if args.warmup_iters is not None else min(200, args.max_iters // 10)
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    args.min_lr = args.min_lr if args.min_lr is not None else args.lr / 10
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.kd != "none" and not args.teacher:
        raise UsageError("--kd needs --teacher")
    if args.keep_layers and not args.init_from:
        raise UsageError("--keep-layers needs --init-from (the model whose layers are kept)")
    if args.teacher and args.kd == "none":
        args.kd = "fkl"
    if args.mix_weight is not None and not args.mix_data:
        raise UsageError("--mix-weight needs --mix-data (the corpus it mixes in)")
    if args.mix_data and args.mix_weight is None:
        args.mix_weight = 0.5
    if tasks.is_task_source(args.data) and (args.mix_data or args.curve_at):
        raise UsageError(f"--{'mix-data' if args.mix_data else 'curve-at'} reads a text corpus; --data {args.data} is "
                         f"a synthetic task")


# ----------------------------------------------------------------------------------------------------------------
# Processes and what the run prints: DDP, the objective's header line, the closing sample


def setup_distributed(device_flag):
    """torchrun sets RANK/WORLD_SIZE: DDP with nccl on GPU, gloo on CPU. -> (ddp, rank, local_rank, world, device)"""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        device = pick_device(device_flag)
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return True, rank, local, world, device
    return False, 0, 0, 1, pick_device(device_flag)


def objective_line(args, cfg, teacher) -> tuple[str, bool, bool]:
    """The header line naming every term of the training loss -> (line, exit loss active, any extra term)."""
    exit_on = getattr(cfg, "exit_loss", "none") != "none" and getattr(cfg, "n_loops", 1) > 1
    terms = []
    if exit_on:
        terms.append(f"exit loss {cfg.exit_loss}" + (f" coef {cfg.exit_coef}" if cfg.exit_loss == "aggressive" else "")
                     + (" + self-distill" if cfg.self_distill else ""))
    if teacher is not None:
        terms.append(f"KD {args.kd} x{args.kd_weight} (temperature {args.kd_temperature}) from {args.teacher}")
    line = "objective: LM cross-entropy" + "".join(f" + {t}" for t in terms) if terms else ""
    if terms:
        line += " | logged: loss = LM cross-entropy (comparable to val)" + (
            ", kd = the distillation term before its weight" if teacher is not None else "") + \
            ", total = the objective" + (", loss_lN/kd_lN = per-loop exit terms" if exit_on else "")
    if getattr(cfg, "self_distill", False) and not exit_on:
        warnings.warn("self_distill has no effect without an exit loss (--exit-loss weighted|aggressive)", stacklevel=2)
    return line, exit_on, bool(terms)


@torch.no_grad()
def sample(model, tok, device, args):
    model.eval()
    prompt = "def "
    idx = torch.tensor([tok.encode(prompt)], device=device)
    n = min(args.sample_tokens, model.config.max_seq_len - idx.size(1))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, n, temperature=0.8, top_k=50, generator=gen)
    log(f"sample ({n} tokens, temperature 0.8, top-k 50):\n{tok.decode(out[0].tolist())}")


def main(argv=None):
    run_cli(train, argv)


if __name__ == "__main__":
    main()
