"""
serve_requests.py -- where the requests of the serving benchmark come from, and the tables of their errors.

  * Requests: serve.py's Request (what the engine serves and refuses), read as a ReadRequest here: it also remembers
    where it came from (a file:line) and why reading it failed, and is refused for it by the engine like a request
    it cannot serve. At most MAX_REQUESTS per run.
  * Sources: synthetic (all at once, or Poisson at a rate, seeded; lengths uniform in "a:b" ranges), windows of the
    validation corpus (data.prepare_corpus / TokenData), those windows asked about in the model's chat template
    (chat_requests), or a JSONL file of
    {"prompt": str | "prompt_ids": [...], "max_new_tokens": n[, "arrival": s]}, read line by line.
  * Validation: a bad JSONL line (not UTF-8, not JSON, a "prompt" that is not a string, an arrival that is not a
    number of seconds in [0, MAX_ARRIVAL_S]) becomes a request marked invalid, which the server refuses with its own
    error naming the file:line, as it refuses an empty prompt, ids outside the vocabulary or a request longer than the
    context (ReadRequest.problem); the others are served. A file that is not a regular file (a FIFO, a device),
    cannot be read, or holds more than MAX_REQUESTS requests, is one UsageError; a line with both "prompt" and
    "prompt_ids" is that request's error (which one was meant is not known). A chat template runs bounded in a child
    process (chat_template.py): one that does not render a first question is one UsageError, one that fails on a
    request makes that request's error ("chat template").
  * The error tables: the requests' errors counted by reason (error_counts, in every system's summary and --json)
    and printed under the serving table with a few examples (print_errors).
"""
from __future__ import annotations

import json
import os

import torch

from dataclasses import dataclass

from harness.chat_template import ChatTemplate, RenderError
from harness.cli import UsageError, one_line, regular_file
from harness.data import TokenData, prepare_corpus, step_generator
from serve import Request

# ----------------------------------------------------------------------------------------------------------------
# A request as read, and what it can get wrong

# The most requests one run takes: each keeps its prompt, outputs and token times in Python lists (a few KB).
MAX_REQUESTS = 100_000


@dataclass
class ReadRequest(Request):
    """A request read from a file, a corpus or a chat template: where it came from, named in its error, and why
    reading it failed (then the engine refuses it with that error, as it refuses a request it cannot serve)."""
    invalid: str | None = None  # a reason found while reading the request (bad JSONL line, a failed chat template)
    invalid_kind: str = "bad request line"  # the short reason of `invalid`
    source: str | None = None  # where the request came from ("reqs.jsonl:3"), named in its error

    def problem(self, vocab_size: int, max_seq_len: int) -> tuple[str, str] | None:
        """The reading error first, then what a file can give that the engine never makes itself (values of the wrong
        type), then the engine's own reasons (serve.Request.problem)."""
        if self.invalid:
            return self.invalid_kind, self.invalid
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            return "bad max_new_tokens", f"max_new_tokens={self.max_new_tokens!r} must be a positive integer"
        if not isinstance(self.prompt, list):
            return "prompt ids not a list", "prompt_ids must be a list of token ids"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt):
            return "prompt ids not integers", "prompt ids must be integers"
        return super().problem(vocab_size, max_seq_len)

    def refuse(self, kind: str, message: str):
        """The error names where the request came from (unless the message names its file already)."""
        named = self.source and self.source.rsplit(":", 1)[0] in message
        super().refuse(kind, f"{self.source}: {message}" if self.source and not named else message)


# ----------------------------------------------------------------------------------------------------------------
# Reading requests: arrivals, synthetic, corpus and JSONL requests

# A request arriving later than MAX_ARRIVAL_S seconds after the start (a file's arrival, or Poisson arrivals at a tiny
# --rate) would keep every server idle that long: an error, not a wait.
MAX_ARRIVAL_S = 3600.0


def parse_range(spec: str) -> tuple[int, int]:
    """'a:b' -> (a, b) (uniform integers, both included); 'a' -> (a, a)."""
    lo, _, hi = str(spec).partition(":")
    lo, hi = int(lo), int(hi or lo)
    if lo > hi:
        raise ValueError(f"bad range {spec!r}: {lo} > {hi}")
    return lo, hi


def arrival_times(n: int, process: str, rate: float, gen: torch.Generator) -> list[float]:
    """'all': everything at 0; 'poisson': exponential gaps of mean 1/rate."""
    if process == "all":
        return [0.0] * n
    if process == "poisson":
        if rate <= 0:
            raise ValueError(f"--rate must be > 0 for Poisson arrivals, got {rate}")
        gaps = -torch.log1p(-torch.rand(n, generator=gen, dtype=torch.float64)) / rate
        times = torch.cumsum(gaps, 0).tolist()
        if times and times[-1] > MAX_ARRIVAL_S:
            raise UsageError(f"--rate {rate:g}: the {n} Poisson arrivals span {times[-1]:.3g} s, beyond the "
                             f"{MAX_ARRIVAL_S:g} s a run may wait for its requests; raise --rate")
        return times
    raise ValueError(f"unknown arrival process {process!r}; choose all or poisson")


def random_requests(n: int, vocab_size: int, prompt_len: tuple[int, int], gen_len: tuple[int, int], arrivals,
                    gen: torch.Generator) -> list[ReadRequest]:
    """n requests of random token ids (never the last vocabulary row, which some architectures use as a pad), prompt
    and output lengths uniform in the (lo, hi) ranges (both included), arriving at `arrivals` (n times), drawn from
    `gen`: serve.py's demo's requests, and bench.py serve's synthetic ones."""
    out = []
    for i in range(n):
        T = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        G = int(torch.randint(gen_len[0], gen_len[1] + 1, (1,), generator=gen))
        out.append(ReadRequest(i, torch.randint(0, vocab_size - 1, (T,), generator=gen).tolist(), G, arrivals[i]))
    return out


def synthetic_requests(n, vocab_size, prompt_len="8:48", gen_len="8:64", arrival="all", rate=10.0, seed=0):
    """n requests with random token ids (random_requests), lengths uniform in the "a:b" ranges, arriving all at once
    or Poisson at `rate`."""
    g = torch.Generator().manual_seed(seed)
    times = arrival_times(n, arrival, rate, g)
    return random_requests(n, vocab_size, parse_range(prompt_len), parse_range(gen_len), times, g)


def corpus_requests(n, tok, data="stdlib", cache_dir="data_cache", prompt_len="8:48", gen_len="8:64", arrival="all",
                    rate=10.0, seed=0):
    """Prompts are windows of the validation split of train.py's corpus (tokenized once, cached)."""
    cache = prepare_corpus(data, tok, cache_dir)
    val = TokenData(cache, "val")
    reqs = synthetic_requests(n, 2, prompt_len, gen_len, arrival, rate, seed)  # lengths and arrivals
    x, _ = val.get_batch(n, parse_range(prompt_len)[1], step_generator(seed, -7))
    for r in reqs:
        r.prompt = x[r.rid, :len(r.prompt)].tolist()
    return reqs


CHAT_QUESTION = "What does this Python code do? Explain briefly.\n\n```python\n{code}\n```"


def chat_template(spec) -> str:
    """The chat template of a tokenizer spec: a GGUF file's tokenizer.chat_template (Hugging Face directories keep
    theirs in tokenizer_config.json, not read here). ValueError when there is none."""
    if not spec or spec.get("kind") != "gguf":
        raise ValueError("--prompts chat needs a model whose tokenizer has a chat template (a GGUF file's: "
                         "--vanilla-ckpt smollm2-135m, or a --ckpt converted from one)")
    from harness.hf import gguf_chat_template

    return gguf_chat_template(spec["path"])


def chat_requests(n, tok, template, data="stdlib", cache_dir="data_cache", prompt_len="8:48", gen_len="8:64",
                  arrival="all", rate=10.0, seed=0, source="the model"):
    """Chat prompts: each corpus window (corpus_requests) becomes a user question about that code, rendered with the
    model's chat template (its default system prompt included) and the assistant turn opened, as a chat front end
    sends it. The template runs sandboxed, bounded in CPU time, memory and output (chat_template.ChatTemplate). It is
    tried first on a question about `pass`, before the corpus is read: a template that fails there (a syntax error,
    raise_exception, a loop that does not end, strings beyond its memory) is one UsageError naming `source`; one that
    fails only on some window makes that request's error (ReadRequest.problem: "chat template"). The prompt is longer
    than the window by the template's tokens."""
    with ChatTemplate(template) as chat:
        try:
            chat.render([{"role": "user", "content": CHAT_QUESTION.format(code="pass")}])
        except RenderError as e:
            raise UsageError(f"the chat template of {source} does not render ({e}); serve --prompts synthetic or "
                             f"corpus, or a requests file") from None
        reqs = corpus_requests(n, tok, data, cache_dir, prompt_len, gen_len, arrival, rate, seed)
        for r in reqs:
            question = CHAT_QUESTION.format(code=tok.decode(r.prompt).strip())
            try:
                r.prompt = tok.encode(chat.render([{"role": "user", "content": question}]))
            except RenderError as e:
                r.invalid = f"the chat template of {source} does not render this request's question ({e})"
                r.invalid_kind = "chat template"
    return reqs


def read_lines(path) -> list[tuple[int, bytes]]:
    """The non-empty lines of a requests file as (line number, bytes), read line by line (each decoded on its own, so
    one bad line is one bad request). A file that cannot be opened, or holds more than MAX_REQUESTS lines, is one
    UsageError naming it."""
    if os.path.exists(path) and not os.path.isdir(path):  # a FIFO would block the read, /dev/zero never end it
        regular_file(path, "--requests-file")
    try:
        with open(path, "rb") as f:
            lines = []
            for n, ln in enumerate(f, 1):
                if ln.strip():
                    lines.append((n, ln))
                    if len(lines) > MAX_REQUESTS:
                        raise UsageError(f"--requests-file {path} holds more than {MAX_REQUESTS:,} requests (line {n})")
    except IsADirectoryError:
        raise UsageError(f"--requests-file {path} is a directory, not a JSONL file") from None
    except OSError as e:
        raise UsageError(f"--requests-file {path}: cannot read it ({e.strerror or e})") from None
    return lines


def jsonl_requests(path, tok=None, default_gen=32, arrival="all", rate=10.0, seed=0):
    """{"prompt": str | "prompt_ids": [...], "max_new_tokens": n, "arrival": s (optional)} per line. A line that
    cannot be read (not UTF-8, not JSON, an arrival that is not a time in [0, MAX_ARRIVAL_S] seconds) becomes a request
    with an error (served as an error, never silently dropped). Request ids count the non-empty lines from 0; each
    request remembers its file:line (`source`) for its error message."""
    lines = read_lines(path)
    times = arrival_times(len(lines), arrival, rate, torch.Generator().manual_seed(seed))
    reqs = []
    for i, (lineno, raw) in enumerate(lines):
        r = ReadRequest(i, [], default_gen, times[i], source=f"{path}:{lineno}")
        try:
            try:
                ln = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
            d = json.loads(ln)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if "prompt_ids" in d and "prompt" in d:  # which one the client meant is not known
                raise ValueError("both 'prompt' and 'prompt_ids': give one (text, or the token ids of a prompt)")
            if "prompt_ids" in d:
                r.prompt = d["prompt_ids"]
            elif "prompt" in d:
                if not isinstance(d["prompt"], str):  # null, a number, a list, an object: never str() of it
                    raise ValueError(f"'prompt' is {_json_kind(d['prompt'])}, not text (give a string, or "
                                     f"'prompt_ids': a list of token ids)")
                if tok is None:
                    raise ValueError("a text prompt needs a tokenizer")
                r.prompt = tok.encode(d["prompt"])
            else:
                raise ValueError("no 'prompt' or 'prompt_ids'")
            r.max_new_tokens = d.get("max_new_tokens", default_gen)
            t = d.get("arrival", r.arrival)
            if not isinstance(t, (int, float)) or isinstance(t, bool):  # "0.5", true: not a time
                raise ValueError(f"'arrival' is {_json_kind(t)}, not a number of seconds")
            if not 0 <= t <= MAX_ARRIVAL_S:  # NaN too: it would never arrive
                raise ValueError(f"arrival {d['arrival']!r} must be a time in [0, {MAX_ARRIVAL_S:g}] seconds")
            r.arrival = float(t)
        except Exception as e:  # anything one line raises (a RecursionError from JSON nested too deep) is its own
            why = e if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {one_line(e)}"
            r.invalid = f"bad request line {lineno} of {path}: {why}"
        reqs.append(r)
    return reqs


def _json_kind(v) -> str:
    """What a JSON value is, in a request's error: null, true, a number, a string, an array, an object."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    kind = {int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(type(v), "?")
    return f"{kind} ({json.dumps(v)[:20]})" if kind in ("a number", "a string") else kind


# ----------------------------------------------------------------------------------------------------------------
# The error tables


def error_counts(reqs) -> dict:
    """{short reason: number of requests} of the requests that got an error, most frequent first."""
    counts = {}
    for r in reqs:
        if r.error is not None:
            counts[r.error_kind or "error"] = counts.get(r.error_kind or "error", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def print_errors(rows: list[dict], show=3):
    """Under the serving table: the request errors by reason (once if every system saw the same), and a few of them."""
    groups = {}
    for r in rows:
        if r.get("request_errors"):
            groups.setdefault(json.dumps(r["request_errors"], sort_keys=True), []).append(r)
    for same in groups.values():
        d = same[0]
        who = "every system" if len(same) == len(rows) else ", ".join(r["system"] for r in same)
        print(f"request errors ({who}): " + ", ".join(f"{n} {k}" for k, n in d["errors_by_reason"].items()))
        for rid, msg in list(d["request_errors"].items())[:show]:
            print(f"  request {rid}: {msg}")
        if len(d["request_errors"]) > show:
            print(f"  ... {len(d['request_errors']) - show} more (--json lists every request id -> reason)")
