"""
checkpoint.py -- the architecture table and the checkpoint files of train.py, shared by serve.py and bench.py.

The table: each architecture module (ARCH_MODULES) exposes ARCH_SPECS, a list of model.ArchSpec (config class, model
class, presets, and optional hooks: extra flags, config overrides from flags, conversion from a vanilla model, batch
preparation); arch_table() maps every spec's name to it. Architectures register here as they land.

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
(hf.py), through load_source_model; --init-from a checkpoint of the same architecture keeps its shapes and takes the
config fields of the recipe flags typed (init_same_arch). --resume takes the run's flags back from the checkpoint and
refuses, naming them, flags typed now that contradict it (restore_run_args).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import math
import os
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from cli import CheckpointError, UsageError, flag_name, one_line
from data import Tokenizer, hf_tokenizer_spec, is_hf_source
from hf import from_pretrained
from model import ArchSpec

# ----------------------------------------------------------------------------------------------------------------
# The architecture table

ARCH_MODULES = ["model", "recursive", "block_transformer", "plt", "double_decoder"]


def arch_table() -> dict[str, ArchSpec]:
    table = {}
    for name in ARCH_MODULES:
        for spec in importlib.import_module(name).ARCH_SPECS:
            table[spec.name] = spec
    return table


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints

CKPT_FORMAT = "nano-efficient-inference/ckpt"


def save_checkpoint(path: Path, obj: dict):
    """torch.save (with the CRC-32 of every record switched on, whatever torch's global setting) to a fresh temporary
    file in the same directory, then rename: a crash never leaves half a checkpoint, and the previous checkpoint stays
    until the new one is whole. The temporary file is created exclusively (mkstemp: a link or file already there is
    never followed or overwritten). A write that fails (a full disk: torch reports it as a RuntimeError "unexpected
    pos"; a directory that cannot be written) removes the temporary file and is a CheckpointError."""
    tmp = None
    crc = torch.serialization.get_crc32_options()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with open(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() would give the checkpoint
            torch.serialization.set_crc32_options(True)
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            full = "; a full disk?" if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ENOSPC else ""
            gone = f"; its temporary file {Path(tmp).name} was removed" if tmp is not None else ""
            raise CheckpointError(f"writing checkpoint {path} failed ({type(e).__name__}: {one_line(e)}{full}){gone}") \
                from e
        raise
    finally:
        torch.serialization.set_crc32_options(crc)


_UMASK = os.umask(0o22)  # read once at import (os.umask can only be read by setting it)
os.umask(_UMASK)


def load_checkpoint(path) -> dict:
    """torch.load(weights_only=True) of a train.py checkpoint. Anything else is a CheckpointError naming the file; the
    reason is one line (never torch's advice to retry with weights_only=False: that runs arbitrary code). The dict
    gains "loaded_from" (the path), so that later errors about its contents can name the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        inside = f"give {path / 'ckpt.pt'} (the checkpoint in it), or " if (path / "ckpt.pt").is_file() else "give "
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file: {inside}hf:{path} if it is a "
                              f"Hugging Face checkpoint directory")
    try:
        with warnings.catch_warnings():  # e.g. torch's "Detected pickle protocol 4" on files that are not ours
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch checkpoint "
                              f"({type(e).__name__}: {_torch_load_reason(e)})") from e
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{path} is a PyTorch file but not a checkpoint written by train.py")
    ck["loaded_from"] = str(path)
    return ck


def check_resumable(ck: dict, path) -> dict:
    """--resume needs what train.py writes at every evaluation: a step >= 0, the optimizer state, the weights, the
    config, the tokenizer and the run's flags. A checkpoint without them is a CheckpointError naming the part."""
    missing = [k for k in ("arch", "config", "model", "optimizer", "tokenizer", "step") if ck.get(k) is None]
    if missing:
        what = "optimizer state" if missing == ["optimizer"] else "field(s) " + ", ".join(missing)
        raise CheckpointError(f"checkpoint {path} has no {what}: it cannot be resumed exactly; start a new run from "
                              f"its weights with --init-from {path} (and another --out-dir)")
    step, best = ck["step"], ck.get("best_val_loss", math.inf)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path} holds step {step!r}: not a step count (an int >= 0)")
    if not isinstance(best, (int, float)):
        raise CheckpointError(f"checkpoint {path} holds best_val_loss {best!r}: not a number")
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
        raise CheckpointError(f"{name}: its {ck['arch']} config does not fit this code ({e}); was it written by "
                              f"another version of the repository?") from e
    model = spec.model_cls(cfg)
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{name}: weights do not fit its {ck['arch']} config: {e}") from e
    return model


def load_source_model(src: str, table=None):
    """--init-from / --teacher: a train.py checkpoint, or hf:DIR (a local Hugging Face checkpoint).

    -> (model, arch name, tokenizer spec)
    """
    if is_hf_source(src):  # a plain model.GPT (fp32, CPU); conversions start from it like from a vanilla checkpoint
        model = from_pretrained(src[3:] if src.startswith("hf:") else src)
        return model, "vanilla", model.tokenizer_spec
    ck = load_checkpoint(src)
    return model_from_checkpoint(ck, table), ck["arch"], ck["tokenizer"]


def load_source_tokenizer(src):
    """The tokenizer spec of --init-from: a Hugging Face checkpoint's tokenizer.json, or a checkpoint's own spec."""
    if is_hf_source(src):
        return hf_tokenizer_spec(src)
    return load_checkpoint(src)["tokenizer"]


# ----------------------------------------------------------------------------------------------------------------
# --init-from a checkpoint of the same architecture

ADDED_MODULES = ("exit_gate.",)  # parameters a recipe flag may add to a checkpoint of the same architecture


def init_same_arch(src, spec: ArchSpec, overrides: dict, seq_len: int, path) -> tuple[torch.nn.Module, str]:
    """--init-from a checkpoint of this architecture: its config and weights, plus `overrides`, the config fields set by
    the flags typed now (train.recipe_overrides; the checkpoint's own settings stay otherwise). A field that leaves
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
# printed note). The checkpoint's own directory is where it is now (--out-dir is never restored).
RESUME_ENVIRONMENT = {"resume", "out_dir", "device", "dtype", "compile", "cache_dir", "sample_tokens",
                      "log_interval", "eval_iters"}
RESUME_LENGTH = {"max_iters", "eval_interval", "lr_decay_iters"}


def _same_value(new, old) -> bool:
    if new == old:
        return True
    if isinstance(new, str) and isinstance(old, str) and os.path.exists(new):  # a path written another way
        return Path(new).resolve() == Path(old).resolve()
    return False


def restore_run_args(ap, args, given, ck, path, table):
    """--resume: args <- the checkpoint's run arguments, except the flags typed now (checked against them)."""
    saved = ck.get("args") or {}
    notes, clash = [], []
    for dest, old in saved.items():
        if not hasattr(args, dest) or dest in ("resume", "out_dir"):
            continue
        if dest not in given:
            setattr(args, dest, old)
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
