"""
checkpoint.py -- train.py's checkpoint files (written atomically, read back verified), the other sources a model
comes from (hf:DIR, gguf:PATH), and a run's model and validation windows as eval.py reads them; shared by train.py,
eval.py, serve.py's benchmark and bench.py.

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
"""
from __future__ import annotations

import mmap
import struct
import warnings
import zipfile
import zlib
from dataclasses import asdict, replace
from pathlib import Path

import torch

import model
import recursive
from harness import tasks
from harness.archs import arch_table
from harness.cli import CheckpointError, UsageError, atomic_file, check_memory, check_model_fits, one_line, regular_file
from harness.data import (TokenData, Tokenizer, hf_tokenizer_spec, is_gguf_source, is_hf_source, prepare_corpus,
                          step_generator)
from harness.hf import from_gguf, from_pretrained, gguf_tokenizer_spec
from harness.memory import memory_sum, module_bytes

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


# ----------------------------------------------------------------------------------------------------------------
# A run's checkpoint, its model and its validation windows (eval.py's evaluations)


def load_run(path, device):
    """A train.py checkpoint -> (checkpoint dict, model in eval mode on device, tokenizer)."""
    ck = load_checkpoint(path)
    model = model_from_checkpoint(ck)
    tok = text_tokenizer(ck["tokenizer"], f"checkpoint {path}")
    check_vocab(model.config, tok, f"checkpoint {path}")
    check_eval_memory(weights_on(device, model), device, f"the model of {path}")
    return ck, model.to(device).eval(), tok


# The memory an evaluation allocates (model.py's pieces), checked before it allocates it (cli.check_memory): the
# models as they move to the device (on a CPU they are in memory already), the evaluation windows and one batch's
# forward (its logits and their float32 copies for the loss), the KV caches of decoding.

def weights_on(device, *models) -> dict:
    """The models' weights and buffers as they are copied to `device`; nothing on a CPU (they are there already)."""
    return {f"models on {device}": module_bytes(*models)} if torch.device(device).type != "cpu" else {}


def elem_of(model) -> int:
    return next(model.parameters()).element_size()


def check_eval_memory(parts: dict, device, what: str, fix: str = "evaluate it on a device with more memory"):
    check_memory(memory_sum(parts), device, what, fix)


def text_tokenizer(spec, where):
    """The tokenizer of a spec, for text: a synthetic task's vocabulary reads no text (tasks.py evaluates those
    models), and a tokenizer that cannot be built here (a tiktoken name that needs the network, a missing file) is
    one line naming the model's source."""
    if spec.get("kind") == "task":
        raise UsageError(f"{where} was trained on the synthetic task {spec.get('name')!r}: its tokenizer reads no "
                         f"text, so eval.py has no corpus to evaluate it on (train.py's evaluation reports the task)")
    try:
        return tokenizer_from_spec(spec)
    except ValueError as e:  # a tiktoken name says nothing of the file it came from; hf/gguf messages name theirs
        raise UsageError(f"{where}: {e}" if spec.get("kind") == "tiktoken" else str(e)) from None


def checkpoint_val_data(ck, tok, cache_dir) -> TokenData:
    """The validation split of the checkpoint's corpus (its run arguments: --data, --exclude-sets, --val-data). The
    token cache goes to this command's --cache-dir (cache_dir), never to a directory the checkpoint names."""
    a = ck.get("args") or {}
    return TokenData(prepare_corpus(a.get("data", "stdlib"), tok, cache_dir,
                                    [s for s in a.get("exclude_sets", "").split(",") if s], a.get("val_data"),
                                    verbose=False), "val")


def val_windows(ck, tok, n_batches, batch, seq_len, seed, device, cache_dir):
    """The validation windows of the checkpoint's corpus (checkpoint_val_data), drawn from seeded generators: every
    checkpoint of the same corpus and tokenizer sees the same windows."""
    val = checkpoint_val_data(ck, tok, cache_dir)
    for i in range(n_batches):
        x, y = val.get_batch(batch, seq_len, step_generator(seed, -1, i, 0))
        yield x.to(device), y.to(device)
