"""
graphs.py -- a decode step as one CUDA graph, static caches per batch bucket (gpt-fast's lesson).

A decode step of a small model at a small batch is bound by kernel launches, not by memory: each of its ~15 kernels
per layer costs microseconds of CPU to launch, while the weights it reads take well under a millisecond. A CUDA graph
records the step's kernels once and replays them all with one launch. What a step must be to be recorded ("graph-safe",
model.py's decode steps and every architecture's `graph_steps`):
  * fixed shapes: a static cache (model.KVCache(static=True)) attends over all its positions, the unfilled ones masked,
    and a batch is padded up to one of a few sizes (BATCH_BUCKETS, vLLM's recipe): one graph per bucket;
  * fixed addresses: what the step writes (K/V, lengths) is written in place into tensors allocated once -- one static
    cache per batch bucket, reused by every generation (StaticCaches, gpt-fast's setup_caches) -- and marked static
    (mark_static), so that torch.compile may let a graph write into them;
  * no host round trip: the step reads no tensor back (no .item(), no int(t)) and branches on no tensor value; the
    host picks the step kind (Block Transformer: inside a block or its last token) from counts it keeps itself.

compile_step records one: torch.compile(fullgraph=True), mode "reduce-overhead" on CUDA: inductor fuses the step's
kernels, then records them. compile_decode(model, mode) records every step kind of a model and gives its generate()
the static caches.

Run:
    python bench.py decode --compile            # eager vs graphed decode on this machine
    python bench.py gpu --only decode           # (one GPU) the graphed decode vs eager and transformers
"""
from __future__ import annotations

import torch

# The batch sizes a graph is specialised to (vLLM's recipe): a batch is padded up to its bucket, so a server whose
# occupancy changes replays a few graphs instead of recording one per batch size.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_bucket(n: int) -> int:
    """The smallest bucket >= n; past the largest bucket, n rounded up to a multiple of it."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    top = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= n), -(-n // top) * top)


def static_cache_len(need: int, max_seq_len: int) -> int:
    """The positions of a static cache for `need` tokens: rounded up to a multiple of 128, so that generations of
    nearby lengths share one cache and its graphs, at most max_seq_len."""
    return min(-(-need // 128) * 128, max_seq_len)


def mark_static(*tensors):
    """Promise torch.compile that these tensors keep their address from one call to the next (the state of a static
    cache), so a recorded CUDA graph may write into them in place. Without it torch skips CUDA graphs for a step that
    mutates its inputs. No guard: a new cache is re-recorded into a graph, not recompiled."""
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=False)


def graph_mode(mode: str | None, device, backend=None) -> str | None:
    """compile_step's mode for 'auto': 'reduce-overhead' (CUDA graphs) on CUDA with the default backend, else None."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if torch.device(device).type == "cuda" and backend is None else None


def compile_step(fn, mode: str | None = None, backend=None):
    """torch.compile for a graph-safe step: the whole step is one graph (fullgraph: a graph break is an error) with
    static shapes (one graph per input shape, e.g. per batch bucket); on CUDA mode='reduce-overhead' records it as a
    CUDA graph. `backend` (default inductor) is for tests: tests/graph_check.py's GraphCheck traces and counts graphs.

    Dynamo keeps its graphs per code object, with a recompile limit for each. A step decorated in torch (no_grad) would
    share one code object with every other such step, so each compiled step gets a code object of its own, and the
    limit is raised to hold a graph for every batch bucket."""
    def step(*args, **kwargs):
        return fn(*args, **kwargs)

    step.__code__ = step.__code__.replace()  # a copy: a cache of this step's graphs alone
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(BATCH_BUCKETS))
    return torch.compile(step, mode=mode, backend=backend or "inductor", fullgraph=True, dynamic=False)


# ----------------------------------------------------------------------------------------------------------------
# A model's decode, recorded


class StaticCaches(dict):
    """The generation caches of a recorded model (model.graph_caches): batch bucket -> one static cache, allocated on
    first use and reused, emptied, by every later generation of that bucket (gpt-fast's setup_caches), so that a
    recorded graph replays on the same addresses. Its rows are the bucket (generate pads the batch: the padding rows
    decode along, unread), its positions the need rounded up to 128 (static_cache_len); it is rebuilt (one graph
    more) only when a generation needs more positions or other cache arguments (model.cache_covers)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.sizes = model, {}  # bucket -> (positions, new_cache's other arguments, dtype, device)

    def get_cache(self, batch: int, need: int, kwargs: dict):
        m, rows = self.model, batch_bucket(batch)
        p = m.lm_head.weight
        max_len, have, dtype, device = self.sizes.get(rows, (0, {}, None, None))
        if rows in self and max_len >= need and m.cache_covers(have, kwargs) and (dtype, device) == (p.dtype, p.device):
            self[rows].reset()
            return self[rows]
        max_len = static_cache_len(need, m.config.max_seq_len)
        self[rows] = m.new_cache(rows, max_len, **kwargs)
        self.sizes[rows] = (max_len, kwargs, p.dtype, p.device)
        return self[rows]


def compile_decode(model, mode: str | None = "auto", backend=None):
    """Record every step kind of `model` (model.graph_steps: GPT's decode_step, or an architecture's kinds) and give
    its generate() static caches, one per batch bucket (model.graph_caches, StaticCaches): compile_step with `mode`
    ('auto': 'reduce-overhead' on CUDA, torch.compile's default elsewhere) and `backend`.
    The prefill stays eager (its shapes change with every prompt). -> model"""
    model.static_cache = True
    model.graph_caches = StaticCaches(model)
    mode = graph_mode(mode, model.lm_head.weight.device, backend)
    for name in model.graph_steps:
        setattr(model, name, compile_step(getattr(model, name), mode, backend))
    model.decode_step = getattr(model, model.graph_decode)
    return model
