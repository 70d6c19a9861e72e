"""
chat_template.py -- a model's chat template (a Jinja template from its GGUF file) rendered with bounds on its work,
its memory and its output, in a child process of its own.

A chat template is code that comes with a model file. Jinja's sandbox (ImmutableSandboxedEnvironment) keeps it from
side effects and bounds each range() to 100,000 items, but not the total work (two nested loops: 10^10 iterations),
the memory of what it builds (two 100 MB strings), or the length of the prompt it renders, which the tokenizer then
reads in one long call that no signal interrupts. So bench.py serve --prompts chat renders in a child process
(`python harness/chat_template.py`: jinja2 and the standard library, no torch), fed one conversation at a time
(ChatTemplate.render), where:
  * CPU time: each rendering may use RENDER_CPU_S seconds of the child's CPU (RLIMIT_CPU: the kernel's SIGXCPU ends
    the rendering). CPU time, not wall time: a busy machine does not fail a good template.
  * memory: the child's address space is RENDER_MEMORY bytes (RLIMIT_AS): a larger allocation is a MemoryError.
  * output: at most MAX_RENDERED_CHARS characters, counted as the template produces them; integer powers (`**`) are
    bounded too (a huge one is a single C call that allocates little and never ends).
A rendering that fails any of them, or fails as a template (a syntax error, raise_exception, an undefined value, the
sandbox), is a RenderError naming the reason, in one line: the caller makes it one request's error. The child goes
on with the next conversation; one that ended (killed) is started again. The parent only waits in plain Python calls
(poll, a second at a time), so Ctrl-C and SIGTERM stop it at once, and the child is killed on its way out (close). It
never waits unboundedly: a child that takes no CPU time for STALL_S seconds without answering (stopped, or blocked)
is killed and the rendering is a RenderError; a killed child is reaped within CLOSE_WAIT_S or left to the system.

    python -m pytest -q tests/test_inputs.py -k template     # a syntax error, a loop of 10^10 steps, 200 MB strings
"""
from __future__ import annotations

import contextlib
import json
import operator
import os
import select
import signal
import subprocess
import sys

RENDER_CPU_S = 5  # CPU seconds of one rendering: a real chat template renders a conversation in milliseconds
RENDER_MEMORY = 512 << 20  # bytes of the child's address space (Python and jinja2 take ~30 MB of it)
MAX_RENDERED_CHARS = 1_000_000  # characters of a rendered prompt: far more than any model's context holds
MAX_POWER_BITS = 1 << 16  # bits of an integer a template may compute with **
STALL_S = 10  # seconds the child may take no CPU time at all without answering before it is taken for hung
CLOSE_WAIT_S = 10  # seconds to wait for a killed child to be reaped


class RenderError(ValueError):
    """A chat template that did not render one conversation: the reason in one line ("TemplateSyntaxError: ...",
    "used more than 5 s of CPU time", ...)."""


class ChatTemplate:
    """The template in its child process: render(messages) -> the prompt text with the assistant turn opened, or
    RenderError. A context manager: the child ends with it (close)."""

    def __init__(self, template: str):
        self.template = template
        self.proc = None
        self._buffer = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Kill the child and reap it, waiting at most CLOSE_WAIT_S (a process that SIGKILL does not end at once is
        left to the system: it can hold nothing of ours)."""
        if self.proc is not None:
            proc, self.proc, self._buffer = self.proc, None, b""
            proc.kill()
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=CLOSE_WAIT_S)

    def render(self, messages: list[dict]) -> str:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                                         start_new_session=True)  # a Ctrl-C at the terminal reaches the parent alone
            self._send({"template": self.template, "cpu_s": RENDER_CPU_S, "memory": RENDER_MEMORY,
                        "chars": MAX_RENDERED_CHARS})
        self._send(messages)
        line, why = self._read_line()
        if line is None:  # the child ended (SIGXCPU past its CPU time, or killed) or stalled: the next starts another
            self.close()
            raise RenderError(why)
        try:
            reply = json.loads(line)
            text, error = reply.get("text"), reply.get("error")
        except (ValueError, AttributeError):
            text = error = None
        if error is not None:
            raise RenderError(str(error))
        if not isinstance(text, str):
            raise RenderError("its renderer process answered something else than a rendering")
        return text

    # The parent waits for the child in poll(): a plain Python call, so Ctrl-C and SIGTERM stop it at once; and a
    # child that stops taking CPU time (stopped, or blocked on something) without answering is killed after STALL_S
    # seconds of that. A child that is merely slow (a busy machine) keeps taking CPU time, and its RLIMIT_CPU bounds it.

    def _stalled(self, ticks: list) -> bool:
        """After one more second of waiting: has the child taken no CPU time for STALL_S seconds? (ticks: [the
        child's CPU ticks when last seen to change, the seconds since].) Where /proc cannot say, a rendering may take
        STALL_S x 10 seconds of waiting."""
        now = _cpu_ticks(self.proc.pid)
        if now is not None and now != ticks[0]:
            ticks[:] = [now, 0]
            return False
        ticks[1] += 1
        return ticks[1] >= (STALL_S if now is not None else STALL_S * 10)

    def _send(self, obj):
        data, fd, ticks = (json.dumps(obj) + "\n").encode(), self.proc.stdin.fileno(), [None, 0]
        while data:
            if not _ready(fd, select.POLLOUT):
                if self._stalled(ticks):
                    return  # _read_line finds it stalled too, and says so
                continue
            try:
                data = data[os.write(fd, data):]
            except BrokenPipeError:  # ended before it read the line: _read_line finds it gone and says why
                return

    def _read_line(self) -> tuple[bytes | None, str | None]:
        """(the child's next line, None), or (None, why there is none: it ended, or it stalled)."""
        fd, ticks = self.proc.stdout.fileno(), [None, 0]
        while b"\n" not in self._buffer:
            if not _ready(fd, select.POLLIN):
                if self._stalled(ticks):
                    return None, f"its renderer process stopped answering (it took no CPU time for {STALL_S} s)"
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: the child has ended
                try:
                    code = self.proc.wait(timeout=CLOSE_WAIT_S)
                except subprocess.TimeoutExpired:
                    return None, "its renderer process closed its output"
                return None, f"used more than {RENDER_CPU_S} s of CPU time" if code == -signal.SIGXCPU else \
                    f"its renderer process ended ({signal.Signals(-code).name if code < 0 else f'exit code {code}'})"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line, None


def _ready(fd: int, event: int) -> bool:
    """Is fd ready for event (POLLIN: something to read or its end; POLLOUT: room to write or a closed reader) within
    one second?"""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(1000))


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time process pid has used (user + system, in clock ticks: fields 14 and 15 of /proc/PID/stat), or None
    where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# The child: jinja2's sandbox under the limits above


def raise_exception(message):
    """What a chat template calls to refuse a conversation (Hugging Face's convention): the message is the reason."""
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def bounded_environment():
    """jinja2's ImmutableSandboxedEnvironment (Hugging Face's settings: trim_blocks, lstrip_blocks; raise_exception)
    with `**` bounded to MAX_POWER_BITS bits."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["**"])

        def call_binop(self, context, operator_name, left, right):
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    right * max(1, abs(left).bit_length() - 1) > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} is an integer of more than {MAX_POWER_BITS:,} bits")
            return operator.pow(left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def render_bounded(compiled, messages, max_chars: int) -> str:
    """The template's output for `messages`, piece by piece, stopped once it passes max_chars."""
    out, n = [], 0
    for piece in compiled.generate(messages=messages, add_generation_prompt=True):
        n += len(piece)
        if n > max_chars:
            raise RenderError(f"it renders more than {max_chars:,} characters")
        out.append(piece)
    return "".join(out)


def serve():
    """Read the template and the limits (the first line: ChatTemplate.render's), then one conversation per line;
    answer each with one line: {"text": ...} or {"error": "Type: reason"}. Compiling the template (jinja2 folds its
    constant expressions then) and each rendering run under the limits."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    first = json.loads(sys.stdin.readline())
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a rendering ended by SIGXCPU leaves no core file
    resource.setrlimit(resource.RLIMIT_AS, (first["memory"], first["memory"]))
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def bounded(work):
        """work() with first["cpu_s"] more seconds of this process's CPU time -> (its result, None) or (None, the
        error in one line)."""
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime) + 1 + first["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            return work(), None
        except MemoryError:
            return None, f"MemoryError: it needs more than the {first['memory'] >> 20} MiB a rendering has"
        except Exception as e:  # TemplateSyntaxError, UndefinedError, SecurityError, TemplateError, RenderError, ...
            return None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"

    compiled, failure = bounded(lambda: bounded_environment().from_string(first["template"]))
    for line in sys.stdin:
        text, error = (None, failure) if compiled is None else \
            bounded(lambda: render_bounded(compiled, json.loads(line), first["chars"]))
        sys.stdout.write(json.dumps({"text": text} if error is None else {"error": error}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    del sys.path[0]  # this file's directory: the harness's modules must not shadow what jinja2 imports
    serve()
