"""
ddp.py -- train.py under torchrun: its environment checked like flags, and the rendezvous of its processes bounded.

torchrun (python -m torch.distributed.run) starts one process per rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. Read as they come, a mistake in them is a traceback (RANK=abc: int() of it), or worse a wait
that never ends: WORLD_SIZE=2 with one process started waits for the other forever, and the wait is a C++ call that no
Ctrl-C or SIGTERM interrupts. Here:
  * torchrun_env: WORLD_SIZE unset or 1 is one process; WORLD_SIZE > 1 needs the other four, each an integer in its
    range (RANK < WORLD_SIZE, a port in 1..65535) or a non-empty MASTER_ADDR; a mistake is one UsageError naming the
    variable, before the run's work.
  * rendezvous: the processes meet at MASTER_ADDR:MASTER_PORT (torch's env:// rendezvous, torchrun's agent store
    included) within RENDEZVOUS_S seconds, else a UsageError saying who did not come; the wait runs in a thread of its
    own while this one waits in plain Python calls, so Ctrl-C and SIGTERM stop it at once (`stopped: ...`, exit code
    130); c10d's own log lines of a failed attempt are kept off stderr (the command's error is its one line).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from harness.cli import UsageError, env_int, log, one_line

MAX_WORLD = 1 << 16  # processes of one run: far more than any job starts
RENDEZVOUS_S = 300  # seconds every process has to reach the rendezvous (torchrun starts them together: seconds)
TORCHRUN = "start the processes with torchrun (python -m torch.distributed.run), which sets them"


def torchrun_env() -> tuple[int, int, int] | None:
    """torchrun's variables, checked like flags -> None for one process (WORLD_SIZE unset or 1), else (rank,
    local_rank, world). A variable that is not what torchrun sets is a UsageError naming it."""
    world = env_int("WORLD_SIZE", 1, 1, MAX_WORLD, "the processes of the run, set by torchrun")
    rank = env_int("RANK", 0, 0, MAX_WORLD - 1, f"this process's rank; {TORCHRUN}")
    if rank >= world:
        raise UsageError(f"RANK={rank} is not below WORLD_SIZE={world}{' (unset)' * ('WORLD_SIZE' not in os.environ)}"
                         f": {TORCHRUN}")
    if world == 1:
        return None
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise UsageError(f"WORLD_SIZE={world} without {', '.join(missing)}: {TORCHRUN}, or unset WORLD_SIZE for one "
                         f"process")
    local = env_int("LOCAL_RANK", 0, 0, world - 1, f"this process's rank on its machine; {TORCHRUN}")
    env_int("MASTER_PORT", 0, 1, 65535, "the port of the rendezvous")
    return rank, local, world


def rendezvous(rank: int, world: int, seconds: float | None = None):
    """The processes of the run meet (torch's env:// rendezvous at MASTER_ADDR:MASTER_PORT) within `seconds`
    (default RENDEZVOUS_S) -> the store for dist.init_process_group, its timeout then torch's default. Waited for in a
    thread while this one waits in plain calls: a Ctrl-C or SIGTERM (KeyboardInterrupt, cli.Terminated) stops the wait
    at once. A rendezvous that does not complete is a UsageError naming the address, the time and the processes."""
    seconds = RENDEZVOUS_S if seconds is None else seconds
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    log(f"ddp: rank {rank} of {world} waits for the others at {where} (at most {seconds:g} s)", rank == 0)
    out = {}

    def meet():
        try:
            store, _, _ = next(dist.rendezvous("env://", rank, world,
                                               timeout=datetime.timedelta(seconds=seconds)))
            store.set_timeout(default_pg_timeout)  # the run's own waits: torch's default again
            out["store"] = dist.PrefixStore("default_pg", store)  # as init_process_group(init_method) makes it
        except Exception as e:  # noqa: BLE001 - DistStoreError, DistNetworkError, RuntimeError: said below
            out["error"] = e

    thread = threading.Thread(target=meet, name="ddp-rendezvous", daemon=True)
    with _quiet_stderr():
        with _signals_held():  # a signal handled inside start() breaks threading's own lock: after it, not during
            thread.start()
        while thread.is_alive():
            thread.join(0.25)
    if "error" in out:
        e = out["error"]
        raise UsageError(f"the DDP rendezvous at {where} (rank {rank} of WORLD_SIZE={world}) did not complete in "
                         f"{seconds:g} s ({type(e).__name__}: {one_line(e)[:200]}): did every process start, with the "
                         f"same MASTER_ADDR and MASTER_PORT?") from None
    return out["store"]


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held back for the block, then handled as they would have been. Thread.start() waits on a
    Condition, and the exception a handler raises inside that wait leaves its lock released twice (RuntimeError:
    release unlocked lock, a traceback where `stopped: ...` belongs). The new thread inherits the mask, so the signals
    go to this thread; where pthread_sigmask is missing (Windows) nothing is held."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (c10d logs each failed attempt from C++, several lines each)."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
