"""
cli.py -- the one error contract of every command of this repository (train.py, serve.py, bench.py, eval.py, hf.py,
tasks.py).

A mistake the user can fix (a flag, a file, a checkpoint, a batch that cannot fit, a non-finite loss) is one line
`error: ...` on stderr naming the flag, value or file, and exit code 2; a run stopped by Ctrl-C or SIGTERM is one line
`stopped: ...` and exit code 130; warnings are one line `warning: ...` each. Anything else is a bug and keeps its
traceback. The pieces live here, not in train.py, so that the architecture files (which never import train.py) can
route their own command lines through them. The checks made before a run's first step live here too: a directory
that must be writable (check_writable_dir), one that another live run writes (take_dir_lock: a lock file, held for a
run by hold_dir_lock and releasing_dir_locks), the disk space a checkpoint needs (check_disk_space) and the memory an
estimate says a command needs (check_memory, check_step_memory), a file a command will write (check_output_file). The
files themselves: every file a command writes goes through atomic_file / write_atomic (a fresh temporary name, fsync,
rename) or append_line (a results file: no link followed, no special file), every JSON file it reads back through
read_json (a regular file, a size bound, UTF-8, a depth bound, the caller's schema: fields_problem). log writes a
run's lines, and run_child runs a command of this repository as a child process under the same contract (tasks.py
depth, eval.py recovery: its error ends this command with code 2, a Ctrl-C or SIGTERM is passed on to it).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm


class UsageError(ValueError):
    """A flag value or combination that cannot work. run_cli prints it as one line and exits with code 2."""


class DataError(RuntimeError):
    """A corpus problem the user must fix: a shard that does not decompress or is truncated, an empty split, a corrupt
    token shard or token cache. The message names the file."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, written or used; the message names the file."""


class Stopped(Exception):
    """A run stopped on request (Ctrl-C, SIGTERM) after saving what it had: `stopped: ...` and exit code 130 (the
    shell's code for a process ended by SIGINT). The message says where the work is and how to continue it."""


# Expected errors: the user can fix them. run_cli prints one line; anything else keeps its traceback.
EXPECTED_ERRORS = (UsageError, DataError, CheckpointError, FloatingPointError, FileNotFoundError, ModuleNotFoundError,
                   torch.OutOfMemoryError)


# --dtype of every command (device.pick_dtype's names)
DTYPES = ["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the error contract: a bad flag raises UsageError (one line), and an empty value typed for a flag
    that takes one (`--keep-layers ''`, an unset shell variable) is an error, never "not given". A flag whose command
    judges an empty value itself (with a message of its own) sets `empty_checked = True` on its action."""

    def error(self, message):  # argparse prints usage + message and exits; raise instead (one line, testable)
        raise UsageError(message)

    def _get_values(self, action, arg_strings):
        value = super()._get_values(action, arg_strings)  # the flag's own type and choices speak first
        if action.nargs not in (argparse.PARSER, argparse.REMAINDER) and "" in arg_strings \
                and not getattr(action, "empty_checked", False):
            raise argparse.ArgumentError(action, "expected a value, got '' (an unset variable?); leave the flag out "
                                                 "for its default")
        return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default said once: argparse's "(default: X)" is added only where the help text does
    not speak of the default itself ("default: the arch's", "default 10%% of max-iters") and the default says
    something (not None: "not given", not an empty string, not a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default is argparse.SUPPRESS \
            or (isinstance(action.default, str) and not action.default)
        if quiet or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def number(kind=int, min=None, above=None, max=None):  # noqa: A002 - argparse-style names
    """An argparse type: a finite int/float, >= min or > above, <= max; else 'argument --x: must be >= 1, got 0'."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if min is not None and v < min:
            raise argparse.ArgumentTypeError(f"must be >= {min}, got {text}")
        if above is not None and v <= above:
            raise argparse.ArgumentTypeError(f"must be > {above}, got {text}")
        if max is not None and v > max:
            raise argparse.ArgumentTypeError(f"must be <= {max}, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


def path_arg(text):
    """argparse type of a path flag (a file, a directory, a checkpoint, hf:DIR, a tokenizer name): an empty string is
    an error, never "not given" (an unset shell variable would silently change the run)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (an unset variable?)")
    return text


# --temperature of the commands that sample: 0 is greedy; below MIN_TEMPERATURE, logits / T overflow float32 for
# large logits (inf - inf: NaN probabilities) while the sampling is greedy in effect anyway
MIN_TEMPERATURE = 1e-6


def temperature_arg(text):
    """argparse type of --temperature: 0 (greedy) or a finite number >= MIN_TEMPERATURE."""
    t = number(float, min=0)(text)
    if 0 < t < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"{text} is below {MIN_TEMPERATURE:g}, where logits / temperature overflow "
                                         f"float32 (NaN sampling) and sampling is greedy in effect: give 0 for greedy "
                                         f"decoding")
    return t


# --seed of every command: what torch.manual_seed accepts without wrapping (an unsigned 64-bit integer)
SEED_MAX = 2 ** 64 - 1
seed_arg = number(int, min=0, max=SEED_MAX)
# --threads: at most one per CPU of the machine (torch takes more, and starts them all: 1e5 crash the interpreter)
threads_arg = number(int, min=1, max=os.cpu_count() or 1)


def comma_list(item):
    """argparse type of a comma list each of whose items passes `item` (a cli.number(...) or one_of(...) type); the
    text is kept (each command splits it itself)."""
    def parse(text):
        for part in text.split(","):
            item(part.strip())
        return text

    parse.__name__ = "list"
    return parse


def one_of(choices):
    """argparse type of one name of `choices` (used alone or in a comma_list)."""
    def parse(text):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    parse.__name__ = "name"
    return parse


DEVICE_TYPES = ("cpu", "cuda", "mps")  # what the commands run on; torch parses more (xla, xpu, meta, ...)


def check_device(flag):
    """--device: auto, or a device of DEVICE_TYPES that this build of torch and this machine have."""
    if flag == "auto":
        return
    try:
        device = torch.device(flag)
    except RuntimeError as e:
        raise UsageError(f"--device {flag!r} is not a device ({one_line(e)})") from None
    if device.type not in DEVICE_TYPES:
        raise UsageError(f"--device {flag}: the commands run on {', '.join(DEVICE_TYPES)} (or auto), not "
                         f"{device.type}")
    if device.type == "cpu" and device.index not in (None, 0):
        raise UsageError(f"--device {flag}: there is one CPU device (cpu)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {flag}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {flag}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not (
            getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise UsageError(f"--device {flag}: MPS is not available on this machine")


def check_dtype(device_flag: str, dtypes, flag: str = "--dtype"):
    """--dtype (one name or a comma list of device.pick_dtype's names) on --device: a few operations of a forward
    pass (a linear layer with a bias, an RMS norm, a softmax, attention) run once on a tiny tensor, so that a dtype
    this machine's torch cannot compute (float16 on a CPU without it, bfloat16 on an old MPS) is one line before any
    work, not a traceback in the middle of it."""
    from harness.device import pick_device, pick_dtype  # the command-line module stays importable without the model

    if dtypes is None:
        return
    device = pick_device(device_flag)
    for name in [d.strip() for d in str(dtypes).split(",")]:
        if name == "auto":
            continue
        dtype = pick_dtype(device, name)
        try:
            x = torch.ones(2, 8, device=device, dtype=dtype)
            y = torch.nn.functional.rms_norm(torch.nn.functional.linear(x, x, x[:, 0]), (2,), eps=1e-5).softmax(-1)
            torch.nn.functional.scaled_dot_product_attention(y[None, None], y[None, None], y[None, None])
        except (RuntimeError, NotImplementedError, TypeError) as e:
            raise UsageError(f"{flag} {name}: this machine's torch cannot compute {dtype} on {device} "
                             f"({type(e).__name__}: {one_line(e)[:160]}); choose another --dtype") from None


def run_subcommand(parser, argv=None):
    """The body of a command of subcommands (bench.py, eval.py): parse argv, check --device and --dtype, apply
    --threads, then run the subcommand's function (set_defaults(fn=...)) on the arguments."""
    args = parser.parse_args(argv)
    check_device(getattr(args, "device", "auto"))
    check_dtype(getattr(args, "device", "auto"), getattr(args, "dtype", None))
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args.fn(args)


@contextlib.contextmanager
def user_input():
    """ValueErrors raised while building things from flags (tokenizer, config, conversion, teacher, an imported
    checkpoint) are the user's to fix: UsageError (one line, exit code 2). The same error elsewhere (inside a training
    loop) is a bug and keeps its traceback."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e


@contextlib.contextmanager
def _signal_handlers(handlers: dict):
    """{signal: handler} installed for the block, the previous handlers restored after it, however it ends. Only the
    main thread gets signals (and may install handlers): elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s, handler in handlers.items()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def stop_signals(at_once=lambda name: f"{name} again: stopped at once"):
    """Ctrl-C (SIGINT) and SIGTERM during the training loop: the first asks the loop to stop at its next check (after
    the step, or between micro-batches: it writes the checkpoint and exits with code 130, Stopped); a second one stops
    at once, wherever the loop is: KeyboardInterrupt (Terminated for SIGTERM) with the message at_once(signal name)
    says (where the work is), `stopped: ...` and exit code 130 through run_cli. A BaseException, so that no `except
    Exception` on its way swallows it; a checkpoint being written is abandoned (its temporary file removed), the last
    good one stays. Yields the list the handler appends the signal's name to. Outside the main thread, where Python
    delivers no signal, the list stays empty."""
    asked = []

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if asked:
            raise (Terminated if signum == signal.SIGTERM else KeyboardInterrupt)(at_once(name))
        asked.append(name)

    with _signal_handlers({signal.SIGINT: on_signal, signal.SIGTERM: on_signal}):
        yield asked


def available_memory(device) -> tuple[int | None, str]:
    """(bytes the device can still allocate, where the figure comes from), or (None, "") where it is not known: CUDA
    free memory, MemAvailable of /proc/meminfo on a CPU. The one figure every memory check compares against
    (check_memory below, serve.py's KV-cache check): a batch that cannot fit is refused before it is allocated."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "MemAvailable"
        except OSError:
            pass
    return None, ""


def gb(nbytes) -> str:
    """Bytes as GB for a message: 0.34, 12.3, 2.01e+04 (beyond 10,000 GB the figure is a mistake, not a machine)."""
    v = nbytes / 1e9
    return "<0.01" if 0 < v < 0.005 else f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 1e4 else f"{v:.3g}"


def check_memory(need: dict, device, what: str, fix: str, per: str = "", at_least: bool = False,
                 error=UsageError) -> int | None:
    """The one comparison of every command's memory check: an estimate of what `what` is about to allocate (model.py's
    pieces, {part: bytes, ..., "total": bytes}) against available_memory(device), before it is allocated. On a CPU
    every process of this machine under torchrun (LOCAL_WORLD_SIZE) allocates as much. One that cannot fit is an
    `error` (UsageError unless the caller's class), one line: `WHAT needs about (at least) X GB (N bytes) PER (the
    parts), but DEVICE has Y GB available (source): FIX`. -> the bytes available, None where unknown (then nothing is
    checked)."""
    avail, source = available_memory(torch.device(device))
    procs = local_world_size() if torch.device(device).type == "cpu" else 1
    if avail is None or need["total"] * procs <= avail:
        return avail
    parts = ", ".join(f"{k} {gb(v)} GB" for k, v in need.items() if k != "total")
    raise error(f"{what} needs {'at least' if at_least else 'about'} {gb(need['total'])} GB "
                     f"({need['total']:,.0f} bytes){f' {per}' if per else ''}"
                     f"{f' in each of {procs} processes' if procs > 1 else ''} ({parts}), but {device} has "
                     f"{gb(avail)} GB available ({source}): {fix}")


def check_step_memory(need: dict, device, args, at_least=False):
    """A memory estimate of one training step (memory.step_memory or least_step_memory) against the memory available
    (check_memory): a batch that cannot fit is refused, one line, before the first step allocates it."""
    return check_memory(need, device, f"--batch-size {args.batch_size} x --seq-len {args.seq_len}",
                        "lower --batch-size (--grad-accum keeps the tokens per step) or --seq-len, or take a smaller "
                        "model (--preset, --loops)", per="per training step", at_least=at_least)


def check_model_fits(cfg, where: str, elem: int = 4, device="cpu", error=UsageError):
    """A model description (a GGUF file's metadata, a config.json, a checkpoint's config) whose model cannot fit in
    the memory `device` has (a block_count or context_length far beyond any model: RoPE tables of 2^32 positions) is
    refused before anything is allocated: memory.model_memory against check_memory, one `error` (the caller's class,
    as regular_file's) naming the source, the shape and both figures."""
    from harness.memory import model_memory  # the command-line module stays importable without the model

    check_memory(model_memory(cfg, elem), device, f"{where}: a model of this config ({cfg.n_layer:,} layers, d "
                 f"{cfg.n_embd:,}, vocab {cfg.vocab_size:,}, RoPE tables of {cfg.max_seq_len:,} positions)",
                 "it cannot be loaded here", error=error)


# What os.stat says a path is, when it is not a regular file
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path, what: str, error=UsageError, missing: str | None = None) -> Path:
    """The one gate of every file opened as a model, checkpoint, corpus, token shard, request or results file: the
    path (a link to a regular file included) must be a regular file. A FIFO would block the read until a writer
    comes (a hang), a device like /dev/zero never ends (memory runs out), a directory is not a file: each is
    `error` (the caller's class: CheckpointError, DataError, UsageError, ...) naming `what` and the path, before
    anything opens it. A missing path is `error` too, with `missing` as the reason when given, else FileNotFoundError
    (the caller's own message decides); a link to a missing file is `error` saying so. -> Path(path)"""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):  # a dangling link: said as such, whatever the caller says of a missing file
            raise error(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist") from None
        if missing is None:
            raise
        raise error(f"{what} {path} {missing}") from None
    except OSError as e:
        raise error(f"{what} {path} cannot be read ({e.strerror or e})") from None
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), None if stat.S_ISREG(mode) else "not a file")
    if kind is not None:
        raise error(f"{what} {path} is {kind}, not a regular file")
    return path


def flag_name(ap, dest) -> str:
    return next((a.option_strings[0] for a in ap._actions if a.dest == dest and a.option_strings),
                "--" + dest.replace("_", "-"))


# Path lengths. A name (a path component) has at most NAME_MAX bytes, a path at most PATH_MAX (255 and 4096 on Linux's
# file systems: os.pathconf says); a path a command writes must leave room for what it writes there: a directory for
# the names of its files (DIR_ROOM: ".ckpt.pt.XXXXXXXX.tmp", "samples-00001.txt", ...), a file for its temporary name
# beside it (TMP_EXTRA bytes more, or NAME_MAX: atomic_file shortens the temporary name of a long one to fit).
TMP_EXTRA = len(".") + len(".XXXXXXXX.tmp")  # atomic_file's ".NAME.XXXXXXXX.tmp" beside NAME
DIR_ROOM = 64


def fs_limits(path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system path is on, or would be created on (its nearest existing ancestor's);
    (255, 4096) where os.pathconf cannot say."""
    p = os.path.abspath(path)
    while True:
        try:
            return os.pathconf(p, "PC_NAME_MAX"), os.pathconf(p, "PC_PATH_MAX")
        except (OSError, ValueError):
            if os.path.dirname(p) == p:
                return 255, 4096
            p = os.path.dirname(p)


def shown(path) -> str:
    """A path for a message: a long one cut in its middle."""
    text = str(path)
    return text if len(text) <= 160 else f"{text[:80]}...{text[-60:]}"


def path_length_problem(path, room: int) -> str | None:
    """Why path cannot be written with `room` more bytes written under it (DIR_ROOM for a directory, TMP_EXTRA for a
    file): a name of more bytes than NAME_MAX, or an absolute path that with room passes PATH_MAX; None if it fits."""
    room_for = "the names of the files written in it" if room == DIR_ROOM else "its temporary name beside it"
    name_max, path_max = fs_limits(path)
    raw = os.fsencode(os.path.abspath(path))
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > name_max:
        return f"has a name of {len(longest):,} bytes, more than the {name_max} bytes a name may have on its file " \
               f"system"
    if len(raw) + room >= path_max:
        return f"is a path of {len(raw):,} bytes: with {room_for} ({room} bytes), past the {path_max:,} bytes a " \
               f"path may have (PATH_MAX)"
    return None


def check_writable_dir(path: Path, flag: str):
    """--out-dir / --cache-dir: create the directory now and write a probe file in it, so that a file in the way, a
    read-only file system or too long a path is one line before any work, not a traceback after the training steps."""
    problem = path_length_problem(path, DIR_ROOM)
    if problem is not None:
        raise UsageError(f"{flag} {shown(path)} {problem}")
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path} is a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path} is not a writable directory ({e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------------------------
# Files a command writes and reads back. Every write goes through atomic_file (a whole file: token shards and their
# meta.json, checkpoints, eval.py samples' shards and manifest, tables, --json, the CPU-tuning cache) or append_line
# (a results file: eval.py --results, OUT/recovery.jsonl, tasks.py's results, a run's curve.jsonl); neither follows a
# link or opens a special file. Every JSON file read back (a run's curve.jsonl, recovery.jsonl, samples' manifest,
# the CPU-tuning cache, a token cache's meta.json, a results file, a model's config.json) goes through read_json.

_UMASK = os.umask(0o22)  # read once at import (os.umask can only be read by setting it)
os.umask(_UMASK)


def check_output_file(path, flag: str):
    """A file a command writes once its work is done (eval.py --results, tasks.py's results, bench.py gpu --json),
    checked before the work: if it exists it must be a regular file (never a directory, a FIFO, a device, or a link:
    writes never follow one), its directory must exist, and a file must be creatable there (not a read-only file
    system, /proc, a directory without permission: check_writable_dir's probe). One line, nothing left behind."""
    path = Path(path)
    problem = path_length_problem(path, TMP_EXTRA)
    if problem is not None:
        raise UsageError(f"{flag} {shown(path)} {problem}")
    if os.path.islink(path):
        raise UsageError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}): results are never written "
                         f"through one; give the file itself")
    if os.path.lexists(path):
        regular_file(path, flag)
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: its directory {path.parent} does not exist")
    try:
        check_writable_dir(path.parent, flag)
    except UsageError as e:
        raise UsageError(f"{flag} {path}: {str(e).removeprefix(f'{flag} ')}") from None


def _write_failed(e: BaseException, doing: str, path, tmp=None) -> str:
    """'writing checkpoint PATH failed (OSError: [Errno 28] No space left on device; a full disk?)'"""
    full = "; a full disk?" if isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ENOSPC else ""
    gone = f"; its temporary file {Path(tmp).name} was removed" if tmp is not None else ""
    return f"{doing} {path} failed ({type(e).__name__}: {one_line(e)}{full}){gone}"


def temp_prefix(path: Path) -> str:
    """The start of atomic_file's temporary names for path: ".NAME." (then mkstemp's 8 random characters and ".tmp"),
    cut so that the whole fits NAME_MAX (a legal long NAME stays writable)."""
    return os.fsdecode(os.fsencode(f".{path.name}.")[:max(1, fs_limits(path.parent)[0] - TMP_EXTRA + 2)])


@contextlib.contextmanager
def atomic_file(path, what: str, error=UsageError):
    """The one way a command writes a whole file: yields a binary file at a fresh temporary name in path's directory
    (created if missing), then flushes, fsyncs and renames it over path. The temporary name is mkstemp's (created
    exclusively: a link or file planted at any name is never followed or overwritten) and the file gets the mode
    open() would give; a link at path itself is replaced, never written through; the temporary name of a name near
    NAME_MAX is cut to fit. A crash or a failure leaves path as
    it was and no temporary file: an OSError (or torch's RuntimeError of a full disk) is `error` ("writing WHAT PATH
    failed (...)"), anything else (Ctrl-C, a bug) propagates after the cleanup."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
        with open(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() would give the file
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            raise error(_write_failed(e, f"writing {what}", path, tmp)) from e
        raise


def write_atomic(path, data: str | bytes, what: str = "file", error=UsageError):
    """path's new contents (text as UTF-8) through atomic_file: an interrupted write never leaves half a file."""
    with atomic_file(path, what, error) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def save_png(fig, path, what: str = "plot", dpi: int = 120):
    """A matplotlib figure laid out (tight_layout), written as a PNG through atomic_file, then closed -> path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    with atomic_file(path, what) as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)
    return path


def append_line(path, line: str, what: str = "results file", error=UsageError):
    """One line appended to a results file, created if missing: opened without following a link (O_NOFOLLOW) and
    without waiting for a reader (O_NONBLOCK: a FIFO is refused, never a hang), it must be a regular file; the line
    goes in one write and is fsynced (appends of other processes interleave by whole lines). A failure is `error`."""
    data = (line.rstrip("\n") + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666)
    except OSError as e:
        why = "it is a symbolic link, never written through" if e.errno == errno.ELOOP else \
            "it is a FIFO without a reader" if e.errno == errno.ENXIO else f"{type(e).__name__}: {one_line(e)}"
        raise error(f"appending to {what} {path} failed ({why})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"appending to {what} {path} failed (not a regular file)")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as e:
        raise error(_write_failed(e, f"appending to {what}", path)) from None
    finally:
        os.close(fd)


MAX_READ_BYTES = 64 << 20  # a JSON file a command reads back: far more than any of them holds
MAX_JSON_DEPTH = 32  # nesting of such a file (a few levels each); Python's parser itself stops near 1,000


def _json_depth(obj, limit: int) -> int:
    """Levels of nesting of a parsed JSON value (a number 0, [] 1, [[]] 2, ...), counted up to limit + 1."""
    depth, level = 0, [obj] if isinstance(obj, (dict, list)) else []
    while level and depth <= limit:
        depth += 1
        level = [v for o in level for v in (o.values() if isinstance(o, dict) else o) if isinstance(v, (dict, list))]
    return depth


def _parse_json(text: str):
    """json.loads -> (the object, None), or (None, why it is not JSON of this kind: '(JSONDecodeError): ...'), whatever
    json.loads raises for the text (a syntax error, nesting past the parser, an integer of more digits than Python
    converts)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"(JSONDecodeError): {e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:  # nested deeper than the parser goes
        return None, "(RecursionError): nested deeper than the JSON parser goes"
    except ValueError as e:  # what else json.loads raises: an integer past Python's digit limit (5,000 digits)
        return None, f"({type(e).__name__}): {one_line(e)[:160]}"
    if _json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return None, f"(nested more than {MAX_JSON_DEPTH} levels deep)"
    return obj, None


def read_json(path, what: str, record: str, check=None, error=UsageError, lines=False, missing=None, fix="",
              damaged=False, max_bytes=MAX_READ_BYTES):
    """The one reader of a JSON file a command reads back: a regular file (regular_file; opened without waiting, so a
    FIFO swapped in meanwhile is refused too), at most max_bytes, UTF-8, JSON at most MAX_JSON_DEPTH deep, a JSON
    object (`record` says what it should be: "a point of the curve") that check(obj) finds no problem with (-> the
    problem, or None). lines=True: a JSON Lines file, each non-empty line such an object. Anything else is `error`
    (the caller's class) in one line naming `what`, the file, the line and the reason ("is damaged (...)" for a file
    this repository wrote itself: damaged=True), then `fix` (how to mend it). A missing file: as regular_file
    (`missing` the reason, else FileNotFoundError). -> the object, or the list of the lines' objects."""
    path = Path(path)

    def fail(where: str, reason: str):  # reason: "is not valid JSON (...)", "holds a JSON list, not ..."
        if damaged:
            reason = f"is damaged ({reason.removeprefix('is ')})"
        return error(f"{what} {path}{where} {reason}{f'; {fix}' if fix else ''}")

    regular_file(path, what, error, missing)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise fail("", "is not a regular file")
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise fail("", f"cannot be read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise fail("", f"holds more than {max_bytes:,} bytes, not {record}")
    out = []
    for n, chunk in enumerate(raw.split(b"\n") if lines else [raw], 1):
        where = f" line {n}" if lines else ""
        if lines and not chunk.strip():
            continue
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            raise fail(where, f"is not UTF-8 text (an undecodable byte at byte {e.start})") from None
        obj, why = _parse_json(text)
        if why is not None:
            raise fail(where, f"is not {'a JSON line' if lines else 'valid JSON'} {why}")
        if not isinstance(obj, dict):
            kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(obj), "number")
            raise fail(where, f"holds a JSON {kind}, not {record}")
        problem = check(obj) if check is not None else None
        if problem:
            raise fail(where, f"is not {record}: {problem}")
        out.append(obj)
    return out if lines else out[0]


def _is_kind(v, kind) -> bool:
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, kind)


_KIND_NAMES = {int: "an integer", float: "a number", str: "text", bool: "true or false", list: "a list",
               dict: "an object"}


def fields_problem(obj: dict, fields: dict) -> str | None:
    """What keeps a JSON object from holding `fields` ({name: int | float | str | bool | list | dict}; a float field
    takes an integer, an integer field never a boolean): "it lacks 'loss'", "'step' is '3', not an integer", or
    None."""
    for name, kind in fields.items():
        if name not in obj:
            return f"it lacks {name!r}"
        if not _is_kind(obj[name], kind):
            v = obj[name]
            shown = repr(v) if isinstance(v, (int, float, bool, type(None))) or (isinstance(v, str) and len(v) < 30) \
                else f"a {type(v).__name__}"
            return f"{name!r} is {shown}, not {_KIND_NAMES[kind]}"
    return None


# The lock of a directory a run writes (train.py's --out-dir): OUT_DIR/train.lock, created exclusively (O_EXCL), holding
# "PID START HOST" (the owner's process id, its start time in clock ticks since boot from /proc/PID/stat, so that a
# reused pid is not taken for the owner, and the machine). It is removed when the run ends, however it ends (an error,
# Ctrl-C, SIGTERM); after kill -9 it stays, and the next run takes it over, saying so, once no process owns it: on a
# machine that has /proc, the owner is a live process of that pid started at that time ("-", a start the writer could
# not read, names no process here). A lock file that is a link or a special file is not ours: refused, never followed.
LOCK_NAME = "train.lock"
LOCK_BEING_WRITTEN_S = 30  # a lock file without its owner line younger than this: a run taking it right now


def _process_start(pid: int) -> str | None:
    """The start time of process pid (field 22 of /proc/PID/stat), or None where that is not known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _lock_owner(lock: Path) -> tuple[int, str, str] | None:
    """(pid, start, host) of a lock file, or None when it holds no owner line (being written, or garbage). Read
    without following a link or waiting on a FIFO (take_dir_lock refuses those), at most one line's worth."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            pid, start, host = f.read(4096).decode().split()
        return (int(pid), start, host) if int(pid) > 0 else None  # 0 and -N would name process groups
    except (OSError, ValueError):
        return None


def _owner_alive(pid: int, start: str, host: str) -> bool:
    if host != socket.gethostname():
        return True  # another machine's process (a shared file system): it cannot be asked
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass  # alive, another user's
    now = _process_start(pid)
    return now is None or now == start  # no /proc here: the pid alone says it


def _lock_kind(lock: Path) -> str | None:
    """What a lock file that is not a regular file is ("a symbolic link (to X)", "a FIFO (named pipe)", ...), or None
    for a regular file (or none at all)."""
    try:
        mode = os.lstat(lock).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(lock)})"
    return None if stat.S_ISREG(mode) else next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")


def take_dir_lock(path: Path, flag: str, leftovers=()) -> Path:
    """Refuse a directory another live run writes: create path/LOCK_NAME exclusively with this process's owner line,
    or, when it exists, read its owner. A live owner is a UsageError naming the flag, the directory, the pid and the
    lock file (two runs in one directory would overwrite each other's checkpoints); a dead one's lock (kill -9, a
    crash) is taken over with one warning, and the temporary files atomic_file left there for the names `leftovers`
    (a checkpoint being written when the owner was killed: ".ckpt.pt.XXXXXXXX.tmp", regular files only) are removed,
    said in the same warning; a link or special file at the lock is a UsageError saying what it is. Takeovers are
    serialised by a flock of the directory, so that two runs finding one stale lock never both take it. -> the lock
    file, for release_dir_lock."""
    lock = path / LOCK_NAME
    me = f"{os.getpid()} {_process_start(os.getpid()) or '-'} {socket.gethostname()}\n"
    taken = None  # the stale lock's owner this run took over, if it did
    for _ in range(5):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            kind = _lock_kind(lock)
            if kind is not None:
                raise UsageError(f"{flag} {path}: its lock file {lock} is {kind}, not a lock file train.py writes: "
                                 f"remove it, or give another {flag}") from None
            owner = _lock_owner(lock)
            if owner is None:
                try:
                    young = time.time() - lock.stat().st_mtime < LOCK_BEING_WRITTEN_S
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                if young:
                    raise UsageError(f"{flag} {path} is being taken by another train.py run right now (lock file "
                                     f"{lock}): give another {flag}") from None
            elif _owner_alive(*owner):
                pid, _, host = owner
                where = "" if host == socket.gethostname() else f" on {host}"
                raise UsageError(f"{flag} {path} is in use by another train.py run (pid {pid}{where}; lock file "
                                 f"{lock}): two runs would overwrite each other's checkpoints; wait for it to end, or "
                                 f"give another {flag}") from None
            dir_fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
                if _lock_owner(lock) == owner:  # still the stale one: nobody took it over meanwhile
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(lock)
                    taken = [owner]
            finally:
                os.close(dir_fd)  # releases the flock
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        if taken is not None:
            owner = taken[0]
            removed = _remove_temporaries(path, leftovers)
            warnings.warn(f"{flag} {path}: its lock file {lock} was left by {f'pid {owner[0]}' if owner else 'a run'}, "
                          f"which is no longer running (killed, crashed, or its directory was read-only when it "
                          f"ended): taken over by this run"
                          + (f"; the temporary file{'s' * (len(removed) > 1)} it left ({', '.join(removed)}) removed"
                             if removed else ""), stacklevel=2)
        return lock
    raise UsageError(f"{flag} {path}: its lock file {lock} keeps changing (other runs starting there?): give another "
                     f"{flag}")


def _remove_temporaries(path: Path, names) -> list[str]:
    """atomic_file's temporary files of the files `names` in directory path (a run killed while it wrote one): the
    regular files named temp_prefix(NAME) + 8 of mkstemp's characters + ".tmp" -> the names removed. Nothing else is
    touched (a link or a special file of that name is not a file this repository wrote)."""
    removed = []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return removed
    for name in names:
        prefix = temp_prefix(path / name)
        for entry in entries:
            middle = entry.name[len(prefix):-len(".tmp")]
            if entry.name.startswith(prefix) and entry.name.endswith(".tmp") and re.fullmatch(r"[a-z0-9_]{8}", middle) \
                    and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def release_dir_lock(lock: Path):
    """Remove a lock take_dir_lock took, if it is still this process's. A file system that refuses (remounted
    read-only meanwhile) raises OSError: the lock stays, naming this process, and the next run takes it over once
    this process has ended."""
    owner = _lock_owner(lock)
    if owner is not None and owner[0] == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


_held_locks: list[Path] = []  # the locks hold_dir_lock took, innermost last


def hold_dir_lock(path: Path, flag: str, leftovers=()):
    """take_dir_lock, held until the releasing_dir_locks() around this call ends."""
    _held_locks.append(take_dir_lock(path, flag, leftovers))


def _release_held(held: int, ending: BaseException | None):
    """Release the locks taken since there were `held`; one that cannot be removed is said once: as a note on the
    error the command ends with (run_cli prints it on the same line), or as a warning after a run that went well."""
    while len(_held_locks) > held:
        lock = _held_locks.pop()
        try:
            release_dir_lock(lock)
        except OSError as e:
            note = (f"its lock file {lock} could not be removed ({e.strerror or e}); it names this process, so the "
                    f"next run in {lock.parent} takes it over")
            if ending is not None:
                ending.add_note(note)
            else:
                warnings.warn(note, stacklevel=3)


@contextlib.contextmanager
def releasing_dir_locks():
    """The locks hold_dir_lock takes inside it are released when it ends, however it ends (an error, Ctrl-C, SIGTERM,
    Stopped). Also a decorator: train.py's train() is wrapped in it, so its --out-dir lock lives as long as the run."""
    held = len(_held_locks)
    try:
        yield
    except BaseException as e:
        _release_held(held, e)
        raise
    _release_held(held, None)


def check_disk_space(model, path: Path):
    """A checkpoint holds the weights (and buffers) of the state dict plus AdamW's two moments per trainable
    parameter; it is written next to the last good one (then renamed), so that many bytes must be free in path before
    the first step, not found missing at the first evaluation."""
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
        2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    free = shutil.disk_usage(path).free
    if free < need:
        raise UsageError(f"--out-dir {path} has {free / 1e6:,.1f} MB free, but a checkpoint of this model needs about "
                         f"{need / 1e6:,.1f} MB (weights + AdamW moments): free space or give another --out-dir")


def one_line(msg) -> str:
    return "; ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def log(msg, master=True):
    """A run's log line on stdout (above any progress bar); under DDP only rank 0 (master) writes."""
    if master:
        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (as Ctrl-C raises KeyboardInterrupt) by run_cli's handler."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """While a command runs (run_cli): SIGTERM raises Terminated, so that `kill PID` stops every command like Ctrl-C
    (`stopped: ...`, exit code 130) instead of ending the process with no word, and Ctrl-C raises KeyboardInterrupt
    again (startup.py's handler covered the imports). train.py's loop installs its own handlers over these
    (stop_signals: finish the step, write the checkpoint). Only the main thread gets signals."""

    def on_sigterm(signum, frame):
        raise Terminated

    # over startup.py's handlers (Ctrl-C: KeyboardInterrupt again)
    with _signal_handlers({signal.SIGTERM: on_sigterm, signal.SIGINT: signal.default_int_handler}):
        yield


def run_child(cmd: list[str], on_line, stopped: str, failed) -> None:
    """A command of this repository (`python train.py ...`) in a child process, each line of its stdout handed to
    on_line. Its own `error: ...` line (exit code 2) ends this command with the same code; a stopped child (130) is
    Stopped(stopped); any other failure a UsageError(failed(exit code)). The child runs in a session of its own, so
    that a Ctrl-C at the terminal reaches this process alone; each Ctrl-C or SIGTERM this process gets, however it is
    sent (the terminal, kill, kill -INT), is passed on to the child once, as the same signal: the child stops as it
    would (a run finishes its step and writes its checkpoint; a second signal stops it at once) while this process
    keeps passing its output on and waits for it, then ends as it was asked to (the first KeyboardInterrupt or
    Terminated, raised again: `stopped: ...` through run_cli)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    interrupted = None
    while True:
        try:
            for line in proc.stdout:
                on_line(line)
            code = proc.wait()
            break
        except KeyboardInterrupt as e:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
    if code == 2:  # the child refused a flag or an input: its one `error: ...` line (just above) is the error
        raise SystemExit(2)
    if code == 130:
        raise Stopped(stopped)
    if code != 0:
        raise UsageError(failed(code))


# Environment variables the commands read, checked like flags before the work (run_cli): each module that reads one
# appends a function -> the problem in one line ("NAME=value ..."), or None; cli's own is LOCAL_WORLD_SIZE
ENVIRONMENT_CHECKS: list = []
LOCAL_WORLD_MAX = 4096  # processes of one machine under torchrun: far more than any machine runs


def env_int(name: str, default: int, low: int = 0, high: int | None = None, what: str = "") -> int:
    """An integer environment variable (torchrun's RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ...): its default when unset,
    else an integer in [low, high]; anything else a UsageError naming the variable (what: what it is)."""
    text = os.environ.get(name)
    if text is None:
        return default
    value = int(text) if re.fullmatch(r"-?[0-9]{1,18}", text) else None  # ASCII digits: int() takes "٣" and "1_0"
    if value is None or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise UsageError(f"{name}={text!r}: expected an integer {bound}{f' ({what})' if what else ''}")
    return value


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE: the processes torchrun runs on this machine (1 without torchrun)."""
    return env_int("LOCAL_WORLD_SIZE", 1, 1, LOCAL_WORLD_MAX, "the processes torchrun runs on this machine, each "
                   "allocating as much: every memory check counts them")


def kernels_fallback_problem() -> str | None:
    """KERNELS_FALLBACK (kernels.py's use_triton): 1 forces the PyTorch references, 0 or unset lets the Triton kernels
    run; another value would silently mean 0."""
    text = os.environ.get("KERNELS_FALLBACK")
    if text in (None, "", "0", "1"):
        return None
    return (f"KERNELS_FALLBACK={text!r}: expected 1 (kernels.py runs its PyTorch references, never a Triton kernel) "
            f"or 0 (unset: the kernels where they apply)")


def check_environment():
    """Every ENVIRONMENT_CHECKS function: the first problem found is a UsageError (one line, exit code 2)."""
    local_world_size()
    problem = kernels_fallback_problem()
    if problem:
        raise UsageError(problem)
    for check in ENVIRONMENT_CHECKS:
        problem = check()
        if problem:
            raise UsageError(problem)


def _said(e: BaseException, text: str) -> str:
    """The one line of an error or a stop: its text and the notes added to it on its way out (add_note)."""
    return one_line("; ".join([text, *getattr(e, "__notes__", ())]))


def run_cli(fn, argv=None, expected=EXPECTED_ERRORS):
    """fn(argv) as a command: warnings one line each (`warning: ...`), an expected error `error: ...` on stderr and
    exit code 2, a Stopped run (or a Ctrl-C or SIGTERM that nothing handled) `stopped: ...` and exit code 130; output
    cut short by its reader (a closed pipe) ends quietly with exit code 1. The environment variables the loaded modules
    read are checked first (check_environment)."""
    with warnings.catch_warnings(), _sigterm_interrupts():
        warnings.showwarning = lambda message, *a, **k: print(f"warning: {one_line(message)}", file=sys.stderr)
        try:
            check_environment()
            return fn(argv)
        except expected as e:
            print(f"error: {_said(e, str(e))}", file=sys.stderr)
            sys.exit(2)
        except Stopped as e:
            print(f"stopped: {_said(e, str(e))}", file=sys.stderr)
            sys.exit(130)
        except KeyboardInterrupt as e:  # its message, when it has one (stop_signals), says where the work is
            how = str(e) or ("terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)")
            print(f"stopped: {_said(e, how)}", file=sys.stderr)
            sys.exit(130)
        except BrokenPipeError:  # the reader went away (`python bench.py presets | head`): nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the recipe of Python's signal docs
            sys.exit(1)
