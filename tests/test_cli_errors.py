"""The command lines of train.py and serve.py: a mistake the user can fix (a flag, a file, a checkpoint) is ONE line
`error: ...` on stderr and exit code 2, never a traceback; flags another architecture owns are named in a warning."""
import os
import subprocess
import sys

import pytest

import serve
import train
from conftest import ROOT, write_jsonl


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import zstandard

    d = tmp_path_factory.mktemp("cli")
    _, stdlib = train.stdlib_files()
    texts = [f.read_text(encoding="utf-8") for f in stdlib[:80] if f.stat().st_size > 2000][:12]
    write_jsonl(d / "corpus" / "a.jsonl", texts[:6])
    write_jsonl(d / "corpus" / "b.jsonl", texts[6:])
    (d / "random.pt").write_bytes(os.urandom(512))
    raw = b"".join(b'{"text": "%d"}\n' % i for i in range(3000))
    (d / "broken" / "x.jsonl.zst").parent.mkdir()
    (d / "broken" / "x.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw)[:-20])
    return d


def _train_args(d, *extra):
    return ["--data", str(d / "corpus"), "--cache-dir", str(d / "cache"), "--out-dir", str(d / "out"),
            "--vocab-size", "512", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1", "--max-iters", "1",
            "--sample-tokens", "0", *extra]


def _one_error_line(capsys, run, argv, match):
    with pytest.raises(SystemExit) as e:
        run(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert match in err[0], err[0]
    assert "weights_only=False" not in err[0] and "Traceback" not in err[0]


TRAIN_MISTAKES = [
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
    (["--grad-accum", "0"], "argument --grad-accum: must be >= 1"),
    (["--log-interval", "0"], "argument --log-interval: must be >= 1"),
    (["--eval-iters", "0"], "argument --eval-iters: must be >= 1"),
    (["--max-iters", "0"], "argument --max-iters: must be >= 1"),
    (["--lr", "nan"], "argument --lr: must be a finite number"),
    (["--kd-temperature", "0"], "argument --kd-temperature: must be > 0"),
    (["--kd", "fkl"], "--kd needs --teacher"),
    (["--seed", "x"], "argument --seed: expected an integer, got 'x'"),
    (["--nonsense"], "unrecognized arguments: --nonsense"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--device", "nope"], "--device 'nope' is not a device"),
    (["--arch", "relaxed", "--lora-rank", "-1"], "lora_rank_q=-1 must be an int >= 0"),
    (["--arch", "plt", "--plt-window", "0"], "window=0 must be an int >= 1"),
    (["--arch", "block", "--block-len", "3"], "not a multiple of block_len"),
    (["--seq-len", "100000", "--batch-size", "4096"], "--batch-size 4096 x --seq-len 100000 needs about"),
]


@pytest.mark.parametrize("argv,match", TRAIN_MISTAKES, ids=[" ".join(a) for a, _ in TRAIN_MISTAKES])
def test_train_mistakes_are_one_line_and_exit_code_2(files, capsys, argv, match):
    _one_error_line(capsys, train.main, _train_args(files, *argv), match)


def test_train_file_mistakes_name_the_file(files, capsys):
    rnd = str(files / "random.pt")
    _one_error_line(capsys, train.main, _train_args(files, "--init-from", rnd), f"checkpoint {rnd} is corrupt")
    _one_error_line(capsys, train.main, _train_args(files, "--teacher", rnd), f"checkpoint {rnd} is corrupt")
    _one_error_line(capsys, train.main, _train_args(files, "--resume", "--out-dir", str(files / "none")),
                    "ckpt.pt does not exist")
    _one_error_line(capsys, train.main, _train_args(files, "--data", str(files / "broken")), "x.jsonl.zst is truncated")


def test_flags_of_another_architecture_are_named_in_one_warning(files, capsys):
    train.main(_train_args(files, "--lora-rank", "8", "--plt-window", "3", "--loops", "2", "--kd-weight", "2"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["warning: flags that do not apply to --arch vanilla are ignored: --loops (plt/recursive/relaxed), "
                   "--lora-rank (recursive/relaxed), --plt-window (plt), --kd-weight (needs --teacher)"]


SERVE_MISTAKES = [
    (["--prompt-len", "300"], "exceeds the context of 256 positions"),
    (["--gen-len", "0"], "argument --gen-len: lengths must be >= 1"),
    (["--requests", "0"], "argument --requests: must be >= 1"),
    (["--slots", "0"], "argument --slots: must be >= 1"),
    (["--prompt-len", "10:5"], "argument --prompt-len: expected 'a:b'"),
    (["--exit-threshold", "1.5"], "probability in (0, 1]"),
    (["--exit-rate", "2"], "--exit-rate 2.0 is a share of tokens"),
    (["--rate", "0", "--arrival", "poisson"], "argument --rate: must be > 0"),
    (["--batch-memory-mb", "0.001"], "does not hold the parameters and one slot"),
    (["--lora-rank", "1000"], "lora_rank_q=1000 exceeds"),
    (["--loops", "3"], "n_layer=4 is not divisible by n_loops=3"),
]


@pytest.mark.parametrize("argv,match", SERVE_MISTAKES, ids=[" ".join(a) for a, _ in SERVE_MISTAKES])
def test_serve_mistakes_are_one_line_and_exit_code_2(capsys, argv, match):
    _one_error_line(capsys, serve.main, ["--warmup", "0", "--requests", "2", *argv], match)


def test_serve_checkpoint_mistakes(files, capsys):
    rnd = str(files / "random.pt")
    _one_error_line(capsys, serve.main, ["--ckpt", rnd], f"checkpoint {rnd} is corrupt")
    empty = files / "empty.jsonl"
    empty.write_text("\n")
    _one_error_line(capsys, serve.main, ["--requests-file", str(empty)], "holds no request")


def test_the_commands_themselves(files):
    """Through the interpreter: exit code 2, one stderr line, no traceback (and quickly: before any training)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for cmd in (["train.py", *_train_args(files, "--seq-len", "100000", "--batch-size", "4096")],
                ["train.py", "--batch-size", "0"],
                ["serve.py", "--slots", "0"]):
        r = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        err = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), r.stderr
        assert "Traceback" not in r.stderr
