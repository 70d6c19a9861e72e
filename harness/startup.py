"""
startup.py -- the first thing each command does (`python train.py`, eval.py, bench.py, hf.py, tasks.py, serve.py),
before its heavy imports: torch takes a second or more to import, and Ctrl-C or SIGTERM in that time should end the
command as it does later (cli.run_cli: one `stopped: ...` line on stderr, exit code 130), not with a traceback from
inside an import. Standard library only, so that it is in place before anything slow is imported.
"""
import signal
import sys


def _stopped_while_starting(signum, frame):
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"
    print(f"stopped: {how} while starting", file=sys.stderr)
    raise SystemExit(130)


def stop_while_starting():
    """Ctrl-C and SIGTERM -> `stopped: ... while starting`, exit code 130, until cli.run_cli installs its own."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _stopped_while_starting)
