"""
checkpoint.py -- the architecture table and the checkpoint files of train.py, shared by serve.py and bench.py, the
run flags that --resume and --init-from reconcile with a checkpoint, train.py's run from its flags (their defaults,
the checks made before anything is built, the models it starts from) and its recovery curve (--curve-at,
OUT_DIR/curve.jsonl).

The table: each architecture module (ARCH_MODULES, imported here) exposes ARCH_SPECS, a list of model.ArchSpec (config
class, model class, presets, and optional hooks: extra flags, config overrides from flags, conversion from a vanilla
model, batch preparation); arch_table() maps every spec's name to it. Architectures register here as they land.

A checkpoint is one torch.save'd dict, read back with weights_only=True (no code runs on load):
    format          CKPT_FORMAT (anything else is not ours)
    arch, config    the table's name and the config as a dict (config_cls.from_dict rebuilds it)
    model           the state dict
    optimizer       AdamW's state (what --resume needs to continue exactly), step, best_val_loss, val_loss
    tokenizer       data.Tokenizer's spec
    args            the run's flags (--resume restores them)
It is written to a fresh temporary file in the same directory (created exclusively: never a link already there) and
renamed, so a crash or a full disk never leaves half a checkpoint and the last good one stays. Every problem with a
file is a cli.CheckpointError naming it. --init-from and --teacher also take hf:DIR, a local Hugging Face checkpoint
(hf.py), or gguf:PATH, through load_source_model.

Integrity: torch.save writes the dict as a zip archive of records (the pickle, then one record per tensor storage) and
stores the CRC-32 of every record in the archive's directory: per-tensor checksums, which torch.load never reads.
load_checkpoint verifies every record against its CRC-32 before torch.load runs (a byte changed anywhere in the
weights, the optimizer state or the metadata is an error naming the file and the record), then the type of every
field (check_fields: a missing or mistyped field is an error naming it, never a KeyError later). Checkpoints written
before this check existed carry the checksums too (torch.save writes them by default), so they are verified alike; a
file without any (torch's legacy format, or saved with torch.serialization.set_crc32_options(False)) still loads,
with one warning that its contents were not verified.

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
import functools
import json
import math
import mmap
import os
import struct
import warnings
import zipfile
import zlib
from dataclasses import asdict, replace
from pathlib import Path

import torch

import block_transformer
import double_decoder
import model
import plt
import recursive
from harness import tasks
from harness.cli import (CheckpointError, UsageError, append_line, atomic_file, check_device, check_model_fits,
                         check_output_file, check_step_memory, check_writable_dir, fields_problem, flag_name, log,
                         number, one_line, read_json, regular_file)
from harness.data import (DEFAULT_BASE, Tokenizer, first_tokens_windows, hf_tokenizer_spec, is_gguf_source,
                          is_hf_source, padded_vocab)
from harness.hf import from_gguf, from_pretrained, gguf_tokenizer_spec
from harness.memory import least_step_memory
from model import ArchSpec, windows_loss

# ----------------------------------------------------------------------------------------------------------------
# The architecture table

ARCH_MODULES = [model, recursive, block_transformer, plt, double_decoder]


def arch_table() -> dict[str, ArchSpec]:
    table = {}
    for module in ARCH_MODULES:
        for spec in module.ARCH_SPECS:
            table[spec.name] = spec
    return table


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints

CKPT_FORMAT = "nano-efficient-inference/ckpt"


def run_checkpoint(model, optimizer, step, best_val, val_loss, tokenizer_spec, args) -> dict:
    """train.py's checkpoint of its run at `step` (val_loss None: written between evaluations; best_val: the best
    validation loss before this one): the fields above, the run's flags as JSON-able values."""
    return {"format": CKPT_FORMAT, "arch": args.arch, "config": asdict(model.config), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "step": step,
            "best_val_loss": best_val if val_loss is None else min(best_val, val_loss), "val_loss": val_loss,
            "tokenizer": tokenizer_spec,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}


def save_checkpoint(path: Path, obj: dict):
    """torch.save (with the CRC-32 of every record, which load_checkpoint verifies) through cli.atomic_file: a fresh
    temporary file in the same directory (created exclusively: a link or file already there is never followed or
    overwritten), fsynced, then renamed, so a crash never leaves half a checkpoint and the previous checkpoint stays
    until the new one is whole. A write that fails (a full disk: torch reports it as a RuntimeError "unexpected pos";
    a directory that cannot be written) removes the temporary file and is a CheckpointError."""
    crc = torch.serialization.get_crc32_options()
    try:
        with atomic_file(path, "checkpoint", CheckpointError) as f:
            torch.serialization.set_crc32_options(True)
            torch.save(obj, f)
    finally:
        torch.serialization.set_crc32_options(crc)


def load_checkpoint(path) -> dict:
    """torch.load(weights_only=True) of a train.py checkpoint, after the CRC-32 of every record is verified
    (verify_records) and before its fields are used (check_fields). Anything else is a CheckpointError naming the
    file; the reason is one line (never torch's advice to retry with weights_only=False: that runs arbitrary code).
    The dict gains "loaded_from" (the path), so that later errors about its contents can name the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        inside = f"give {path / 'ckpt.pt'} (the checkpoint in it), or " if (path / "ckpt.pt").is_file() else "give "
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file: {inside}hf:{path} if it is a "
                              f"Hugging Face checkpoint directory")
    regular_file(path, "checkpoint", CheckpointError)  # a FIFO would hang the read, /dev/zero never end it
    try:
        verified = verify_records(path)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    try:
        with warnings.catch_warnings():  # e.g. torch's "Detected pickle protocol 4" on files that are not ours
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch checkpoint "
                              f"({type(e).__name__}: {_torch_load_reason(e)})") from e
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{path} is a PyTorch file but not a checkpoint written by train.py")
    if not verified:
        warnings.warn(f"checkpoint {path} carries no checksums (torch's legacy format, or saved with CRC-32 switched "
                      f"off): loaded without verifying its contents", stacklevel=2)
    check_fields(ck, path)
    ck["loaded_from"] = str(path)
    return ck


def verify_records(path) -> bool:
    """Every record of torch.save's zip archive against the CRC-32 stored with it (read through a memory map, no
    copy). -> True when verified, False when the file carries no checksums (not a zip archive: torch's legacy format
    or not a PyTorch file, which torch.load then judges; or every CRC-32 zero: saved with CRC-32 switched off). A
    record that does not match, or an archive whose records cannot be located, is a CheckpointError naming the file."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return False
    with archive:
        records = archive.infolist()
    names = [r.filename for r in records]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # zipfile and torch.load would read one of them (the last): which one the file means is not known
        raise CheckpointError(f"checkpoint {path} holds {len(names) - len(set(names))} duplicate record(s) "
                              f"({', '.join(n.split('/', 1)[-1] for n in twice[:3])} twice): not an archive torch.save "
                              f"writes; it was altered after it was written")
    if not any(r.CRC for r in records if r.file_size):
        return False

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        problem = next(filter(None, (_record_problem(mm, r) for r in records)), None)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; it changed after it was written (a disk or "
                              f"copy error?): restore it from a copy, or train again")
    return True


def _record_problem(mm, r: zipfile.ZipInfo) -> str | None:
    """Why record r of the archive mapped at mm fails its CRC-32 (or cannot be located), or None."""
    name = r.filename.split("/", 1)[-1]
    what = "the pickled dict" if name == "data.pkl" else "a tensor's data" if name.startswith("data/") else "metadata"
    head = mm[r.header_offset:r.header_offset + 30]
    if len(head) < 30 or head[:4] != b"PK\x03\x04" or r.compress_type != zipfile.ZIP_STORED:
        return f"record {name} ({what}) is not where the archive's directory says"
    start = r.header_offset + 30 + sum(struct.unpack("<HH", head[26:30]))  # after the file name and extra field
    if start + r.file_size > len(mm):
        return f"record {name} ({what}) ends past the end of the file"
    with memoryview(mm) as view, view[start:start + r.file_size] as data:  # no copy; released before the map closes
        if zlib.crc32(data) != r.CRC:
            return f"record {name} ({what}) does not match its CRC-32"
    return None


def _shown(v) -> str:
    """A field's value in an error message: short values as they are, containers by their type."""
    if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 40):
        return repr(v)
    return f"a {type(v).__name__}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def tokenizer_spec_problem(spec) -> str | None:
    """What is wrong with a checkpoint's tokenizer spec (data.Tokenizer's), or None."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        return f"tokenizer spec {_shown(spec)} is not a dict with a 'kind'"
    need = {"tiktoken": {"name": str}, "hf": {"path": str}, "gguf": {"path": str},
            "task": {"name": str, "hops": list, "alphabet": int, "length": int, "pause": int}}.get(spec["kind"])
    if need is None:
        return f"tokenizer kind {_shown(spec['kind'])} is not one of tiktoken, hf, gguf, task"
    for key, kind in need.items():
        v = spec.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) or v in ("", []):
            return f"{spec['kind']} tokenizer spec has {key} {_shown(v)}, not a {'non-empty ' * (kind is not int)}" \
                   f"{kind.__name__}"
    if spec["kind"] == "tiktoken" and spec.get("n") is not None and not (_is_int(spec["n"]) and spec["n"] >= 256):
        return f"tiktoken tokenizer spec has n {_shown(spec['n'])}, not None or an int >= 256"
    if spec["kind"] == "task" and not all(_is_int(p) for p in spec["hops"]):
        return f"task tokenizer spec has hops {_shown(spec['hops'])}, not a list of ints"
    return None


def check_fields(ck: dict, path):
    """Every field a loader reads has the type train.py writes: arch, config, model (a state dict) and tokenizer
    must be there; args, optimizer, step and the losses may be absent (or None: optimizer, val_loss), and are checked
    when present. A missing or mistyped field is a CheckpointError naming the file and the field."""
    missing = [k for k in ("arch", "config", "model", "tokenizer") if k not in ck]
    if missing:
        raise CheckpointError(f"checkpoint {path} holds no {', '.join(missing)}: not a whole train.py checkpoint")

    def bad(field, want):
        return CheckpointError(f"checkpoint {path} holds {field} {_shown(ck[field])}: not {want}")

    str_keys = lambda d: isinstance(d, dict) and all(isinstance(k, str) for k in d)  # noqa: E731
    if not isinstance(ck["arch"], str):
        raise bad("arch", "an architecture name")
    if not str_keys(ck["config"]):
        raise bad("config", "a dict of config fields")
    if not str_keys(ck["model"]) or not all(isinstance(v, torch.Tensor) for v in ck["model"].values()):
        raise bad("model", "a state dict (parameter name -> tensor)")
    for name, t in ck["model"].items():  # every architecture's state dict is floating point; NaN makes NaN logits
        if not t.is_floating_point():
            raise CheckpointError(f"checkpoint {path} holds tensor {name} of dtype {t.dtype}: weights must be "
                                  f"floating point")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"checkpoint {path}: tensor {name} holds NaN or infinite values (a diverged run?): "
                                  f"not usable weights")
    problem = tokenizer_spec_problem(ck["tokenizer"])
    if problem:
        raise CheckpointError(f"checkpoint {path}: its {problem}")
    if "args" in ck and not str_keys(ck["args"]):
        raise bad("args", "a dict of the run's flags")
    if "step" in ck and ck["step"] is not None and not (_is_int(ck["step"]) and ck["step"] >= 0):
        raise bad("step", "a step count (an int >= 0)")
    for k in ("best_val_loss", "val_loss"):  # val_loss None: a checkpoint written between evaluations
        if k in ck and not (_is_number(ck[k]) or (k == "val_loss" and ck[k] is None)):
            raise bad(k, "a number")
    opt = ck.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("state"), dict)
                                and isinstance(opt.get("param_groups"), list)
                                and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                        for g in opt["param_groups"])):
        raise bad("optimizer", "an optimizer state (state and param_groups)")


def load_optimizer_state(optimizer: torch.optim.Optimizer, ck: dict, path):
    """--resume: the checkpoint's AdamW state into `optimizer` (built for the checkpoint's model), after checking that
    it fits: the same parameter groups, of the same sizes, the same kinds of settings, and moments of the
    parameters' shapes. A state that does not fit is a CheckpointError naming the file and the group or parameter."""
    saved, groups = ck["optimizer"], optimizer.param_groups
    where = f"checkpoint {path}: its optimizer state"
    if len(saved["param_groups"]) != len(groups):
        raise CheckpointError(f"{where} has {len(saved['param_groups'])} parameter groups, the model's optimizer "
                              f"{len(groups)}")
    for i, (old, new) in enumerate(zip(saved["param_groups"], groups)):
        if len(old["params"]) != len(new["params"]):
            raise CheckpointError(f"{where}: group {i} holds {len(old['params'])} parameters, the model's "
                                  f"{len(new['params'])}")
        odd = [k for k, v in new.items() if k in old and (  # the numeric settings: lr, betas, eps, weight decay
            (_is_number(v) and not _is_number(old[k])) or (isinstance(v, tuple) and not (
                isinstance(old[k], (tuple, list)) and len(old[k]) == len(v) and all(map(_is_number, old[k])))))]
        if odd:
            raise CheckpointError(f"{where}: group {i} has {odd[0]} {_shown(old[odd[0]])}, not "
                                  f"{'a number' if _is_number(new[odd[0]]) else f'{len(new[odd[0]])} numbers'}")
        for pid, p in zip(old["params"], new["params"]):
            state = saved["state"].get(pid, {})
            if not isinstance(state, dict):
                raise CheckpointError(f"{where}: parameter {pid} has state {_shown(state)}, not a dict")
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                    raise CheckpointError(f"{where}: {k} of parameter {pid} has shape {tuple(v.shape)}, the "
                                          f"parameter {tuple(p.shape)}")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{where} does not fit the model ({type(e).__name__}: {one_line(e)})") from e


def check_resumable(ck: dict, path) -> dict:
    """--resume needs what train.py writes at every evaluation: a step >= 0, the optimizer state, the weights, the
    config, the tokenizer and the run's flags. A checkpoint without them is a CheckpointError naming the part."""
    missing = [k for k in ("arch", "config", "model", "optimizer", "tokenizer", "step") if ck.get(k) is None]
    if missing:
        what = "optimizer state" if missing == ["optimizer"] else "field(s) " + ", ".join(missing)
        raise CheckpointError(f"checkpoint {path} has no {what}: it cannot be resumed exactly; start a new run from "
                              f"its weights with --init-from {path} (and another --out-dir)")
    return ck


def _torch_load_reason(e: Exception) -> str:
    """The informative part of torch.load's error: the unpickler's own reason, else the first sentence."""
    msg = str(e)
    if "WeightsUnpickler error:" in msg:
        msg = msg.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
    msg = " ".join(msg.split())
    return msg.split(". ")[0].rstrip(".") or "unreadable"


def model_from_checkpoint(ck: dict, table=None):
    """Rebuild the model of a checkpoint (config and weights); the optimizer state is left to the caller."""
    table = table or arch_table()
    name = f"checkpoint {ck.get('loaded_from', '')}".rstrip()
    missing = [k for k in ("arch", "config", "model") if k not in ck]
    if missing:
        raise CheckpointError(f"{name} holds no model (no {', '.join(missing)})")
    if ck["arch"] not in table:
        raise CheckpointError(f"{name}: architecture {ck['arch']!r} is unknown here; known: {sorted(table)}")
    spec = table[ck["arch"]]
    try:
        cfg = spec.config_cls.from_dict(ck["config"])
    except (ValueError, TypeError) as e:
        field = getattr(e, "field", None)
        if field is not None:  # a value out of range (a NaN rope_theta, a float layer count): name the field
            raise CheckpointError(f"{name}: its config field {field}: {e}") from e
        raise CheckpointError(f"{name}: its {ck['arch']} config does not fit this code ({e}); was it written by "
                              f"another version of the repository?") from e
    check_model_fits(cfg, name, error=CheckpointError)  # a layer count or context far beyond memory: refused first
    model = spec.model_cls(cfg)
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{name}: weights do not fit its {ck['arch']} config: {e}") from e
    return model


def load_source_model(src: str, table=None, load=load_checkpoint):
    """--init-from / --teacher: a train.py checkpoint (read by `load`), hf:DIR (a local Hugging Face checkpoint) or
    gguf:PATH (a GGUF file, or the short name of a packaged one).

    -> (model, arch name, tokenizer spec)
    """
    if is_gguf_source(src):  # dequantized to fp32
        model = from_gguf(src)
        return model, "vanilla", model.tokenizer_spec
    if is_hf_source(src):  # a plain model.GPT (fp32, CPU); conversions start from it like from a vanilla checkpoint
        model = from_pretrained(src[3:] if src.startswith("hf:") else src)
        return model, "vanilla", model.tokenizer_spec
    ck = load(src)
    return model_from_checkpoint(ck, table), ck["arch"], ck["tokenizer"]


def check_vocab(config, tok, where: str):
    """A model and the tokenizer it is used with (a checkpoint's spec, a pretrained source's file): every id the
    tokenizer produces, the end-of-text id included, must have a row in the model's embedding; else one
    CheckpointError naming the source (never an IndexError on the first batch)."""
    if tok.n_vocab > config.vocab_size or not 0 <= tok.eot < config.vocab_size:
        raise CheckpointError(f"{where}: its tokenizer has {tok.n_vocab:,} ids (end of text {tok.eot}), but the "
                              f"model's embedding has {config.vocab_size:,} rows: the model and tokenizer do not "
                              f"belong together")


def load_source_tokenizer(src, load=load_checkpoint):
    """The tokenizer spec of --init-from: a Hugging Face checkpoint's tokenizer.json, a GGUF file's vocabulary, or a
    checkpoint's own spec (read by `load`)."""
    if is_gguf_source(src):
        return gguf_tokenizer_spec(src)
    if is_hf_source(src):
        return hf_tokenizer_spec(src)
    return load(src)["tokenizer"]


def tokenizer_from_spec(spec: dict):
    """The tokenizer of a spec stored in a checkpoint: a synthetic task's vocabulary (tasks.TaskTokenizer) for a spec
    of kind "task" (--data task:...), else data.Tokenizer (tiktoken, or a Hugging Face tokenizer.json)."""
    return tasks.TaskTokenizer(spec) if spec.get("kind") == "task" else Tokenizer(spec)


def run_tokenizer(args, resume_ck=None, task=None, load=load_checkpoint):
    """train.py's tokenizer: the resumed checkpoint's, the task's, --init-from's when no tokenizer flag is typed, else
    the flags' (--vocab-size, --tokenizer)."""
    if resume_ck is not None:
        return tokenizer_from_spec(resume_ck["tokenizer"])
    if task is not None:
        return tasks.TaskTokenizer(task.spec())
    if args.init_from and not args.tokenizer and not args.vocab_size:
        return tokenizer_from_spec(load_source_tokenizer(args.init_from, load))
    return Tokenizer.from_args(args.vocab_size, args.tokenizer)


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
# Which flags a run typed, and which architectures read them


def add_arch_args(ap, table, shared: dict):
    """Every architecture's flags (spec.add_args, plain argparse) into train.py's parser, and `ap.arch_flags`: the
    dest of every flag that only some architectures read -> their names (the flags each add_args adds, plus `shared`:
    the command's own flags that only some read, {dest: names}). A flag with `bounds` ({min, above, max}, set by its
    add_args) gets them checked as it is parsed: its type becomes cli.number(type, **bounds), the one-line error."""
    ap.arch_flags = {dest: set(names) for dest, names in shared.items()}
    added = {}  # add_args function -> dests it added (recursive and relaxed share one function, called once)
    for spec in table.values():
        if spec.add_args is not None and spec.add_args not in added:
            before = set(map(id, ap._actions))
            spec.add_args(ap)
            new = [a for a in ap._actions if id(a) not in before]
            for a in new:
                if getattr(a, "bounds", None):
                    a.type = number(a.type, **a.bounds)
            added[spec.add_args] = [a.dest for a in new]
    for spec in table.values():
        for dest in added.get(spec.add_args, []):
            ap.arch_flags.setdefault(dest, set()).add(spec.name)


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


def keep_layers(src: model.GPT, spec: str) -> model.GPT:
    """--keep-layers: the reduced-size baseline of the Relaxed Recursive Transformers paper (section 3.2) built from
    pretrained layers: a vanilla GPT made of some of src's layers, in their order, with its embedding, final norm and
    head. spec: 'stepwise:K' (the K layers Stepwise ties, i.e. the unique layers of the recursive model), 'lower:K'
    (the first K), or a comma list of layer indices. The paper pretrains its reduced-size models from scratch;
    starting them from the same pretrained layers as the recursive model isolates what looping adds."""
    N = src.config.n_layer
    kind, _, k = spec.partition(":")
    if kind in ("stepwise", "lower"):
        if not k.isdigit() or not 1 <= int(k) <= N:
            raise ValueError(f"--keep-layers {spec}: give {kind}:K with 1 <= K <= {N} (the source's layers)")
        layers = recursive.stepwise_layers(N, int(k)) if kind == "stepwise" else list(range(int(k)))
    else:
        try:
            layers = [int(i) for i in spec.split(",")]
        except ValueError:
            raise ValueError(f"--keep-layers {spec!r}: give stepwise:K, lower:K or a comma list of layer indices")
        if not layers or any(not 0 <= i < N for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"--keep-layers {spec}: layer indices must be distinct and in [0, {N})")
    cfg = replace(src.config, n_layer=len(layers))
    p = src.tok_emb.weight
    with torch.device("meta"):
        kept = model.GPT(cfg)
    sd = {k: v for k, v in src.state_dict().items() if not k.startswith("blocks.")}
    for new, old in enumerate(layers):
        sd.update({f"blocks.{new}.{k}": v for k, v in src.blocks[old].state_dict().items()})
    kept.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    if cfg.tie_embeddings:
        kept.lm_head.weight = kept.tok_emb.weight
    kept.rope = model.RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta).to(p.device)  # fp32 tables
    return kept


def init_from(args, spec: ArchSpec, tok, table, ap, given, note=print, load=load_checkpoint) -> torch.nn.Module:
    """--init-from SOURCE: a model of this architecture keeps its shapes and takes the recipe flags typed
    (init_same_arch); a vanilla one (after --keep-layers picks its layers) is converted by spec.convert. `note` gets
    the lines train.py logs about it."""
    src, src_arch, _ = load_source_model(args.init_from, table, load)
    if args.keep_layers:
        if src_arch != "vanilla":
            raise UsageError(f"--keep-layers takes layers of a vanilla model; {args.init_from} holds a {src_arch} one")
        src = keep_layers(src, args.keep_layers)
        note(f"init from {args.init_from}: keeping layers {args.keep_layers} ({src.config.n_layer} layers)")
    if src_arch == spec.name:
        model, line = init_same_arch(src, spec, recipe_overrides(args, spec, ap, given), args.seq_len, args.init_from)
        note(line)
        return model
    if src_arch != "vanilla" or spec.convert is None:
        raise UsageError(f"cannot initialise a {spec.name} model from a {src_arch} checkpoint "
                         f"({'conversion starts from a vanilla model' if spec.convert else 'no conversion exists'})")
    note(f"init from {args.init_from}: converting vanilla -> {spec.name}")
    return spec.convert(args, src, tok=tok)


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
# train.py's run from its flags: their defaults, the checks made before anything is built, the models


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


def check_run_args(args, spec: ArchSpec, resume_ck, given) -> tuple[int, float, list[str]]:
    """The architecture's defaults, then the checks made before anything is built: --device, --out-dir and --cache-dir
    writable, a resumed run not past --max-iters -> (the first step, the best validation loss so far, notes about the
    resumed run's length)."""
    try:
        resolve_defaults(args, spec)
        check_step_tokens(args)
    except UsageError as e:  # on --resume the flags are the checkpoint's: say so
        raise (UsageError(f"checkpoint {resume_ck['loaded_from']}: its saved flags: {e}") if resume_ck else e) from None
    args.out_dir = Path(args.out_dir or f"out/{args.arch}")
    check_device(args.device)
    check_writable_dir(args.out_dir, "--out-dir")
    if not tasks.is_task_source(args.data):
        check_writable_dir(Path(args.cache_dir), "--cache-dir")
    if resume_ck is None:
        return 0, math.inf, []
    return resume_ck["step"], resume_ck.get("best_val_loss", math.inf), resume_length(args, given, resume_ck)


def build_models(args, spec: ArchSpec, table, ap, given, resume_ck, dtype, device, master):
    """The tokenizer (the checkpoint's, a task's, --init-from's or the flags'), the model (resumed, converted or new;
    the step's memory checked before it is built) and the teacher -> (tok, task or None, model, teacher or None)."""
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
    if resume_ck is not None:
        model = model_from_checkpoint(resume_ck, table)
    else:
        model = build_model(args, spec, tok, table, ap, given, master, load)
    if args.teacher != args.init_from:
        load.cache_clear()  # kept only for a teacher that is the same file
    if task is not None:
        task = tok.task  # on resume: the checkpoint's task
        task.check_seq_len(args.seq_len)
    if model.config.vocab_size < tok.n_vocab:
        raise UsageError(f"model vocabulary {model.config.vocab_size} is smaller than the tokenizer's {tok.n_vocab}")
    teacher = load_teacher(args, spec, tok, table, load) if args.teacher else None
    return tok, task, model, teacher


def build_model(args, spec: ArchSpec, tok: Tokenizer, table, ap, given, master, load):
    """Fresh model from the preset, or --init-from (init_from: same arch, the weights and the recipe flags
    typed; vanilla, the conversion). The flags' config fields are checked either way."""
    overrides = dict(vocab_size=padded_vocab(tok.n_vocab), max_seq_len=args.seq_len)
    if spec.config_overrides is not None:
        overrides.update(spec.config_overrides(args, tok=tok))
    if args.init_from:
        return init_from(args, spec, tok, table, ap, given, note=lambda line: log(line, master), load=load)
    return spec.model_cls(spec.make_config(args.preset, **overrides))


# ----------------------------------------------------------------------------------------------------------------
# The recovery curve (--curve-at): the run's losses at token counts, OUT_DIR/curve.jsonl beside its checkpoint


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
