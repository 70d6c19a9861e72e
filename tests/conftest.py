"""Shared test setup: CPU, fp32, deterministic, one thread; the Triton interpreter when no GPU is present."""
import os
import signal
import sys
from pathlib import Path

# One intra-op thread, in this process and the commands the tests start: the tests' tensors are tiny, and threads only
# add synchronisation there -- on a 2-core machine that other jobs keep busy, two threads per process made the suite
# several times slower. OMP_NUM_THREADS=N before pytest keeps N.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton reads TRITON_INTERPRET when a kernel is defined, so set it before any test imports kernels.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor keeps compiled kernels (and a precompiled header) in one cache directory; code built for another CPU
# capability (ATEN_CPU_CAPABILITY=default|avx2|avx512) is not valid for this one, so key the directory on it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"torchinductor-tests-{torch.backends.cpu.get_cpu_capability().lower()}"))

# The CPU forms measured fastest (harness/cpu_tuning.py) are kept in a file under ~/.cache; the tests keep theirs beside
# inductor's, so a test run never writes into the user's home (tests/test_cpu_tuning.py sets its own per test).
os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
os.environ.setdefault("LINEAR_CHOICE_CACHE", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "linear_choice.json"))

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


@pytest.fixture
def no_hang():
    """A read or wait that never ends (a FIFO without a writer, /dev/zero, a child that stopped answering) fails the
    test after 120 s instead of hanging it; a test that merely runs slowly on a busy machine stays far below that."""
    def alarm(signum, frame):
        raise AssertionError("hung: waited 120 s (a read or wait that never ends)")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def one_error_line(capsys, run, argv, match):
    """run(argv) exits with code 2 after ONE stderr line `error: ...` that contains match (no traceback, never torch's
    advice to load with weights_only=False) -> that line."""
    with pytest.raises(SystemExit) as e:
        run(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert match in err[0], err[0]
    assert "weights_only=False" not in err[0] and "Traceback" not in err[0]
    return err[0]


def fp16_missing(monkeypatch, op: str, kernel: str):
    """torch.nn.functional.<op> as on a CPU whose torch has no float16 form of it (raising what torch raises there)."""
    real = getattr(torch.nn.functional, op)

    def patched(x, *a, **k):
        if x.dtype == torch.float16:
            raise RuntimeError(f'"{kernel}" not implemented for \'Half\'')
        return real(x, *a, **k)
    monkeypatch.setattr(torch.nn.functional, op, patched)


def command(cmd: str) -> list[str]:
    """The interpreter line of a command: a root script by its file (train.py), a harness module by its name
    (harness.hf: `python -m harness.hf`, run with cwd=ROOT)."""
    return [sys.executable, str(ROOT / cmd)] if cmd.endswith(".py") else [sys.executable, "-m", cmd]


def write_jsonl(path: Path, texts, meta_set="RedPajamaCommonCrawl"):
    """A small SlimPajama-style shard: {"text": ..., "meta": {"redpajama_set_name": ...}} per line."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "meta": {"redpajama_set_name": meta_set}}) + "\n")
    return path
