"""
run_flags.py -- train.py's flags against a checkpoint: what --resume restores and refuses, what --init-from a
checkpoint of the same architecture applies and refuses, which typed flags do not apply, and the checks made before
anything is built (the step's size, --device, --out-dir and --cache-dir, a resumed run's length).

A run's flags and its checkpoint (train.py's contract; the flags are reconciled here):
  * `--resume` continues OUT_DIR/ckpt.pt with the flags stored in it (teacher and KD included): `python train.py
    --resume --out-dir out/relaxed` is enough (resume_run, restore_run_args). A flag typed again with another value is
    an error naming it, except the environment (--device, --dtype, --compile, --cache-dir, --eval-iters,
    --log-interval, --sample-tokens) and the run length (--max-iters, --eval-interval, --lr-decay-iters), which are
    taken with a printed note (resume_length). Every saved flag is parsed as if typed (saved_flag: its type, bounds,
    choices, no empty value) and must fit the model the checkpoint holds (check_saved_run: the saved --arch is the
    checkpoint's, the architecture's flags give its config, --seq-len fits its context); one that does not is one
    line naming the file and the flag. The checkpoint's saved --cache-dir is never restored: the token cache goes to
    this command's --cache-dir, or its default data_cache, never to a directory a file names (`../` included).
  * `--init-from` a checkpoint of the same architecture applies the training-recipe flags typed (exit loss,
    self-distillation, ...: the early-exit post-training of the Relaxed Recursive Transformers paper, Appendix J) and
    refuses, naming them, flags that would change a parameter (a LoRA rank, the loops) (recipe_overrides,
    init_same_arch). Which architecture reads which flag is recorded as the parser is built (add_arch_args); flags of
    another architecture are named in one warning (warn_inapplicable).
  * A mistake the user can fix (a flag, a data file, a checkpoint, a batch that cannot fit in memory) is one line
    `error: ...` on stderr and exit code 2 (cli.py: the contract of every command). What can be checked is checked
    before the first step: --out-dir and --cache-dir writable, disk space for a checkpoint, a lower bound of the
    step's memory before tables and the memory probe are built, the tokenizer (an encoding that needs the network is
    named), a resumable checkpoint.
  * One run per --out-dir: a run holds OUT_DIR/train.lock (cli.take_dir_lock: created exclusively, with its pid)
    from its setup to its end, however it ends; another run there is refused in one line, and the lock of a run that
    was killed (-9) is taken over with a warning.
  * Ctrl-C or SIGTERM: the run stops at its next check (after the step, or between two micro-batches or evaluation
    batches, where nothing of the unfinished step has reached the weights yet), writes the checkpoint of the last
    whole step (atomically, as always), and stops with one line `stopped: ... continue with: python train.py
    --resume --out-dir OUT_DIR` and exit code 130; a second one stops at once (a checkpoint being written is
    abandoned, the last good one stays), `stopped: SIGTERM again: ...`; before the first step (setup, tokenizing) it
    stops at once, `stopped: terminated (SIGTERM)`, exit code 130. A checkpoint write that fails (a full disk)
    removes its temporary file and keeps the last good checkpoint. A step is at most MAX_STEP_TOKENS tokens, typed or
    restored (a saved --grad-accum of 10^9 would be a step that never ends).
  * Divergence: a non-finite loss or weight stops the run without writing its checkpoint (exit code 2). A finite
    validation loss more than a nat above the best of the run so far (of the run it resumes too), or a first one above
    ln(V) + 1 (a nat above a uniform guess over the V tokens) for a run from random weights, is one warning (once per
    run) naming the loss, the step and --lr, and the run goes on. A run from weights (--init-from, --resume) starts
    where its model is: a converted model above ln(V) + 1 is one note, and later evaluations are compared with it
    (train.check_val_loss).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from harness import tasks
from harness.checkpoint import CheckpointError, _shown, check_resumable, load_checkpoint
from harness.cli import UsageError, check_device, check_writable_dir, flag_name
from harness.data import DEFAULT_BASE, Tokenizer
from model import ArchSpec


def given_flags(ap, argv) -> dict:
    """The flags typed on the command line: argv parsed again with every default suppressed -> {dest: value}."""
    defaults = [(a, a.default) for a in ap._actions]
    try:
        for a, _ in defaults:
            a.default = argparse.SUPPRESS
        return vars(ap.parse_args(argv))
    finally:
        for a, default in defaults:
            a.default = default


def warn_inapplicable(ap, args, given):
    """Flags that the chosen architecture never reads, or that need another flag: one warning line naming them (they
    are ignored)."""
    odd = sorted(d for d in given if d in ap.arch_flags and args.arch not in ap.arch_flags[d])
    needs = {}  # flags read only with another flag -> what they need
    if args.teacher is None:
        needs.update(dict.fromkeys(("kd_weight", "kd_temperature"), "needs --teacher"))
    if not tasks.is_task_source(args.data):
        needs.update(dict.fromkeys(tasks.TASK_FLAGS, "needs --data task:phop"))
    else:
        needs.update(dict.fromkeys(("tokenizer", "vocab_size"), f"--data {args.data} has its own vocabulary"))
    if args.tokenizer and args.tokenizer != DEFAULT_BASE and "vocab_size" not in needs:
        needs["vocab_size"] = f"cuts only {DEFAULT_BASE}; --tokenizer {args.tokenizer} has its own vocabulary"
    odd += [d for d in needs if d in given]
    if odd:
        owner = lambda d: "/".join(sorted(ap.arch_flags[d])) if d in ap.arch_flags else needs[d]  # noqa: E731
        what = ", ".join(f"{flag_name(ap, d)} ({owner(d)})" for d in odd)
        warnings.warn(f"flags that do not apply to --arch {args.arch} are ignored: {what}", stacklevel=2)


# ----------------------------------------------------------------------------------------------------------------
# --init-from a checkpoint of the same architecture


def recipe_overrides(args, spec: ArchSpec, ap, given) -> dict:
    """The config fields set by the architecture flags typed on the command line, and only those.

    An arch's config_overrides may also return fields it sets without any flag (plt: its Table 2 row); those are the
    fields of the all-defaults namespace. A typed flag owns the fields that change when it is added to that namespace
    or, when it restates the default (e.g. --plt-variant plt), all of that namespace's fields."""
    if spec.config_overrides is None:
        return {}
    none = argparse.Namespace(**{**vars(args), **{d: ap.get_default(d) for d in ap.arch_flags}})
    typed = [d for d in ap.arch_flags if d in given and spec.name in ap.arch_flags[d]]
    default = spec.config_overrides(none)
    owned = set()
    for d in typed:
        one = spec.config_overrides(argparse.Namespace(**{**vars(none), d: given[d]}))
        diff = {k for k, v in one.items() if default.get(k, object()) != v}
        owned |= diff or set(one)
    every = spec.config_overrides(argparse.Namespace(**{**vars(none), **{d: given[d] for d in typed}}))
    return {k: v for k, v in every.items() if k in owned}


ADDED_MODULES = ("exit_gate.",)  # parameters a recipe flag may add to a checkpoint of the same architecture


def init_same_arch(src, spec: ArchSpec, overrides: dict, seq_len: int, path) -> tuple[torch.nn.Module, str]:
    """--init-from a checkpoint of this architecture: its config and weights, plus `overrides`, the config fields set by
    the flags typed now (recipe_overrides; the checkpoint's own settings stay otherwise). A field that leaves
    every parameter shape as it is takes effect: an exit loss, self-distillation, an exit threshold, a longer
    max_seq_len (RoPE tables are rebuilt), so the early-exit post-training of Appendix J runs from a trained relaxed
    checkpoint. One that would change a parameter (a LoRA rank, the loops, the width) is refused with the fields that
    cause it: new shapes come from a conversion. -> (the model, the line train.py logs about it)"""
    base = asdict(src.config)
    target = {**base, **overrides, "max_seq_len": max(base["max_seq_len"], seq_len)}
    changed = {k: (base.get(k), v) for k, v in target.items() if base.get(k) != v}
    config = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
    if not changed:
        return src, f"init from {path}: {spec.name} weights"

    def shapes(fields):
        with torch.device("meta"):  # no memory, no RNG draws
            m = spec.model_cls(spec.config_cls.from_dict(fields))
        return {k: tuple(v.shape) for k, v in m.state_dict().items()}

    have = {k: tuple(v.shape) for k, v in src.state_dict().items()}
    want = shapes(target)
    added = set(want) - set(have)
    if added and all(k.startswith(ADDED_MODULES) for k in added) and all(want.get(k) == v for k, v in have.items()):
        # a field that only adds a fresh module (an exit gate to train in the post-training phase): the checkpoint's
        # weights load, the new module keeps its init
        model = spec.model_cls(spec.config_cls.from_dict(target))
        missing = model.load_state_dict(src.state_dict(), strict=False).missing_keys
        return model, f"init from {path}: {spec.name} weights; new {', '.join(sorted(missing))}; config {config}"
    if want != have:
        culprits = []
        for k in changed:
            try:
                if shapes({**base, k: target[k]}) != have:
                    culprits.append(k)
            except ValueError:
                culprits.append(k)
        what = ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in culprits or changed)
        raise UsageError(f"--init-from {path} holds a {spec.name} model, and {what} would change its "
                         f"parameters: a checkpoint of the same architecture keeps its shape, only training-recipe "
                         f"flags (exit loss, self-distillation, KD, ...) apply; drop the flag, or convert a vanilla "
                         f"checkpoint to get the new shape")
    model = spec.model_cls(spec.config_cls.from_dict(target))
    model.load_state_dict(src.state_dict())
    return model, f"init from {path}: {spec.name} weights; config {config}"


# ----------------------------------------------------------------------------------------------------------------
# --resume: the run's flags from its checkpoint


# --resume restores every flag of the run from the checkpoint. A flag typed again with the same value is fine; with
# another value it is an error, except these: the environment (taken as given) and the run length (extended, with a
# printed note). Two are never restored: --out-dir (the checkpoint's own directory is where it is now) and --cache-dir
# (the token cache goes where this command says, or to its default: a path read from a file never decides where the
# command writes).
RESUME_ENVIRONMENT = {"resume", "out_dir", "device", "dtype", "compile", "cache_dir", "sample_tokens",
                      "log_interval", "eval_iters"}
RESUME_LENGTH = {"max_iters", "eval_interval", "lr_decay_iters"}
NOT_RESTORED = {"resume", "out_dir", "cache_dir"}


def _same_value(new, old) -> bool:
    if new == old:
        return True
    if isinstance(new, str) and isinstance(old, str) and os.path.exists(new):  # a path written another way
        return Path(new).resolve() == Path(old).resolve()
    return False


def resume_run(ap, args, given, table) -> tuple[dict, list[str]]:
    """--resume: the checkpoint of the run in --out-dir (default out/ARCH), whole and resumable, and args <- its flags
    (restore_run_args) -> (the checkpoint, notes about flags taken from the command line)."""
    args.out_dir = args.out_dir or f"out/{args.arch}"
    path = Path(args.out_dir) / "ckpt.pt"
    ck = check_resumable(load_checkpoint(path), path)
    if ck["arch"] not in table:
        raise CheckpointError(f"{path} holds a {ck['arch']!r} model, unknown here; known: {sorted(table)}")
    notes = restore_run_args(ap, args, given, ck, path, table)
    check_saved_run(ap, args, given, ck, path, table)
    return ck, notes


def resume_length(args, given, ck) -> list[str]:
    """--resume and the run length, once the defaults are resolved: a --max-iters below the checkpoint's step is a
    UsageError; -> notes: the run is complete, or its cosine schedule ends before --max-iters."""
    start = ck["step"]
    if args.max_iters < start:
        raise UsageError(f"--max-iters {args.max_iters} is below the step {start} of {ck['loaded_from']}: nothing to "
                         f"resume; give --max-iters above {start} to continue the run")
    if args.max_iters == start:
        return [f"the run in {args.out_dir} is complete (step {start} = --max-iters); nothing to train (give a larger "
                f"--max-iters to continue)"]
    if args.max_iters > args.lr_decay_iters and "lr_decay_iters" not in given:
        return [f"the cosine schedule still ends at step {args.lr_decay_iters} (--lr-decay-iters); later steps use "
                f"--min-lr {args.min_lr:g}"]
    return []


def restore_run_args(ap, args, given, ck, path, table):
    """--resume: args <- the checkpoint's run arguments, each parsed as if typed (saved_flag), except the flags typed
    now (checked against them) and NOT_RESTORED."""
    saved = ck.get("args") or {}
    notes, clash = [], []
    for dest, old in saved.items():
        if not hasattr(args, dest) or dest in NOT_RESTORED:
            continue
        if dest not in given:
            setattr(args, dest, saved_flag(ap, dest, old, path))
        elif not _same_value(given[dest], old):
            if dest in RESUME_ENVIRONMENT or dest in RESUME_LENGTH:
                notes.append(f"{flag_name(ap, dest)} {given[dest]} (the run had {old})")
            else:
                clash.append(dest)
    clash = [d for d in clash if not _consistent_with_checkpoint(ap, d, args, saved, ck, table)]
    if clash:
        what = ", ".join(f"{flag_name(ap, d)} {given[d]} (the run had {saved[d]})" for d in clash)
        raise UsageError(f"--resume continues the run in {path} with its own flags; these contradict it: {what}. "
                         f"Drop them, or start a new run in another --out-dir (--init-from {path} keeps the weights)")
    return notes


def saved_flag(ap, dest, value, path):
    """One flag of a checkpoint's saved run arguments, parsed as if it were typed now: the type the flag's parser
    produces (a switch a bool, a count an int, a number an int or float, any other flag text), then the flag's own
    argparse type with its bounds, its choices and the empty-value rule (cli.ArgumentParser). The flag's default is
    always taken. A value that fails is a CheckpointError naming the file and the flag -> the parsed value."""
    action = next(a for a in ap._actions if a.dest == dest)
    flag = flag_name(ap, dest)

    def bad(why):
        return CheckpointError(f"checkpoint {path}: its saved flag {flag} = {_shown(value)} {why}; --resume takes "
                               f"every flag of the run from its checkpoint, which was edited or damaged: start a new "
                               f"run from its weights with --init-from {path} (and another --out-dir)")

    if value is action.default or (type(value) is type(action.default) and value == action.default):
        return value
    if action.nargs == 0:  # a switch (store_true)
        if isinstance(value, bool):
            return value
        raise bad("is not true or false")
    if value is None:
        raise bad(f"is missing, but {flag} takes a value (default {action.default!r})")
    kind = getattr(action.type, "__name__", "str")
    want, what = {"int": (int, "an integer"), "float": ((int, float), "a number")}.get(kind, (str, "text"))
    if isinstance(value, bool) or not isinstance(value, want):
        raise bad(f"is not {what}")
    try:
        return ap._get_values(action, [repr(value) if isinstance(value, float) else str(value)])
    except argparse.ArgumentError as e:
        raise bad(f"is refused as if typed ({e.message})") from None


def check_saved_run(ap, args, given, ck, path, table):
    """--resume, after restore_run_args: what the run's flags say must fit the model the checkpoint holds, as the
    architecture's checks would have made them fit when the run began. The saved --arch is the checkpoint's (a
    checkpoint written under another name could never be loaded again); the architecture's flags give its config
    (spec.config_overrides, as _consistent_with_checkpoint compares a typed one); --seq-len fits the model's context
    (and the Block Transformer's block length). A saved flag that does not fit is a CheckpointError naming the file
    and the flag."""
    saved, spec = ck.get("args") or {}, table[ck["arch"]]
    where = f"checkpoint {path}: its saved flag"
    if "arch" not in given and "arch" not in saved:  # run arguments without it: the checkpoint's architecture
        args.arch = ck["arch"]
    if "arch" not in given and args.arch != ck["arch"]:
        raise CheckpointError(f"{where} --arch {args.arch!r} contradicts its model, a {ck['arch']} one; a run of it "
                              f"would write a checkpoint nothing can load: restore the file, or start a new run from "
                              f"its weights with --init-from {path}")
    for dest in ap.arch_flags:
        if dest in given or saved.get(dest) is None or saved[dest] is False or ck["arch"] not in ap.arch_flags[dest] \
                or spec.config_overrides is None:
            continue
        if not _consistent_with_checkpoint(ap, dest, args, {**saved, dest: None}, ck, table):
            raise CheckpointError(f"{where} {flag_name(ap, dest)} = {_shown(saved[dest])} contradicts its "
                                  f"{ck['arch']} config (or the architecture refuses it): the file was edited or "
                                  f"damaged; start a new run from its weights with --init-from {path}")
    if "device" not in given:  # a run on a machine with CUDA resumed on one without
        try:
            check_device(args.device)
        except UsageError as e:
            raise CheckpointError(f"{where} {e}; type --device to run it here") from None
    max_len = ck["config"].get("max_seq_len")
    block = ck["config"].get("block_len")
    if "seq_len" not in given and isinstance(max_len, int) and args.seq_len > max_len:
        raise CheckpointError(f"{where} --seq-len {args.seq_len} exceeds the context of its model ({max_len} "
                              f"positions): the file was edited or damaged")
    if "seq_len" not in given and isinstance(block, int) and block > 0 and args.seq_len % block:
        raise CheckpointError(f"{where} --seq-len {args.seq_len} is not a multiple of its model's block length L_B = "
                              f"{block}: the file was edited or damaged")


def _consistent_with_checkpoint(ap, dest, args, saved, ck, table) -> bool:
    """A flag the run left at its default (None) may be typed with the value the checkpoint has anyway: the same
    tokenizer, or config fields (through the arch's config_overrides) equal to the checkpoint's config."""
    if saved.get(dest) is not None:
        return False
    if dest in ("vocab_size", "tokenizer"):
        return Tokenizer.spec_from_args(args.vocab_size, args.tokenizer) == ck["tokenizer"]
    if dest not in ap.arch_flags:  # --teacher, --init-from, ...: the run had none
        return False
    spec = table.get(ck["arch"])
    if spec is None or ck["arch"] not in ap.arch_flags[dest] or spec.config_overrides is None:
        return True  # a flag this architecture never reads: warned about and ignored
    try:
        before = spec.config_overrides(argparse.Namespace(**{**vars(args), **saved, "resume": True}))
        after = spec.config_overrides(argparse.Namespace(**{**vars(args), "resume": True}))
    except ValueError:
        return False
    return all(ck["config"].get(k) == v for k, v in after.items() if before.get(k, object()) != v)


# ----------------------------------------------------------------------------------------------------------------
# The checks made before anything is built


# The tokens of one optimizer step of one process (--batch-size x --seq-len x --grad-accum): 2^30 is 64 times the
# 16M-token batches of the largest published pretraining runs. More is a typo or an edited checkpoint (a saved
# --grad-accum of 10^9), and one step would never end: its micro-batches run one after another, each allocating only
# --batch-size x --seq-len, so no memory estimate sees it.
MAX_STEP_TOKENS = 2 ** 30


def check_step_tokens(args):
    """One optimizer step of at most MAX_STEP_TOKENS tokens per process, typed or restored by --resume."""
    n = args.batch_size * args.seq_len * args.grad_accum
    if n > MAX_STEP_TOKENS:
        raise UsageError(f"--grad-accum {args.grad_accum} x --batch-size {args.batch_size} x --seq-len {args.seq_len} "
                         f"= {n:,} tokens per optimizer step, more than {MAX_STEP_TOKENS:,} (64 times the largest "
                         f"published pretraining batches): one step would not end; lower --grad-accum")


@contextlib.contextmanager
def saved_flags(resume_ck):
    """On --resume the flags are the checkpoint's: a UsageError about them names the checkpoint."""
    try:
        yield
    except UsageError as e:
        if resume_ck is None:
            raise
        raise UsageError(f"checkpoint {resume_ck['loaded_from']}: its saved flags: {e}") from None


def check_run_args(args, resume_ck, given) -> tuple[int, float, list[str]]:
    """The checks made before anything is built, once the defaults are resolved (train.resolve_defaults): the step's
    size, --device, --out-dir and --cache-dir writable, a resumed run not past --max-iters -> (the first step, the
    best validation loss so far, notes about the resumed run's length)."""
    with saved_flags(resume_ck):
        check_step_tokens(args)
    args.out_dir = Path(args.out_dir or f"out/{args.arch}")
    check_device(args.device)
    check_writable_dir(args.out_dir, "--out-dir")
    if not tasks.is_task_source(args.data):
        check_writable_dir(Path(args.cache_dir), "--cache-dir")
    if resume_ck is None:
        return 0, math.inf, []
    return resume_ck["step"], resume_ck.get("best_val_loss", math.inf), resume_length(args, given, resume_ck)
