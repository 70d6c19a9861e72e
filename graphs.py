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

Two ways to record one:
  * compile_step: torch.compile(fullgraph=True), mode "reduce-overhead" on CUDA: inductor fuses the step's kernels,
    then records them (tens of seconds per graph). On a CPU there is no graph to replay, but the same cost is there:
    a batch-1 step of a small model is ~20 small operators per layer, each a dispatch and a thread fork-join, and its
    products multiply one row by weights in their stored layout. Inductor's C++ backend fuses the pointwise operators
    into a few loops and, with the weights frozen into the graph as constants (CPU_OPTIONS: inductor's freezing),
    runs every product on a copy of its weight prepacked in oneDNN's blocked layout. Whether that beats the eager
    step depends on the CPU, the model and the batch: the commands decide by measurement (harness/cpu_tuning.py,
    compiled_decode_faster), never by a rule;
  * CapturedStep: torch.cuda.CUDAGraph of the eager step as it is (about a second): the stock kernels, replayed with
    one launch; only the token ids are copied in, the weights and the caches are read where they are.
compile_decode(model, mode) records every step kind of a model and gives its generate() the static caches.

Run:
    python bench.py decode                      # eager vs compiled (and int8) decode on this machine
    python bench.py gpu --only decode           # (one GPU) the graphed decode vs eager and transformers
"""
from __future__ import annotations

import contextlib

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


# inductor's options for a CPU decode step (torch.compile(options=...)): freezing folds the weights into the graph as
# constants, so that each product runs on a prepacked oneDNN copy of its weight (the eager weights stay for the
# prefill: the weight bytes are held twice, as cpu_tuning's "dnn" copies are). A frozen graph does not see later
# changes of the weights: compile after loading or converting a model.
CPU_OPTIONS = {"freezing": True}


def compile_step(fn, mode: str | None = None, backend=None, device=None):
    """torch.compile for a graph-safe step: the whole step is one graph (fullgraph: a graph break is an error) with
    static shapes (one graph per input shape, e.g. per batch bucket); on CUDA mode='reduce-overhead' records it as a
    CUDA graph; on a CPU (`device`) inductor's C++ backend with CPU_OPTIONS. `backend` (default inductor) is for
    tests: tests/graph_check.py's GraphCheck traces and counts graphs.

    Dynamo keeps its graphs per code object, with a recompile limit for each. A step decorated in torch (no_grad) would
    share one code object with every other such step, so each compiled step gets a code object of its own, and the
    limit is raised to hold a graph for every batch bucket."""
    def step(*args, **kwargs):
        return fn(*args, **kwargs)

    step.__code__ = step.__code__.replace()  # a copy: a cache of this step's graphs alone
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(BATCH_BUCKETS))
    cpu = backend is None and mode is None and device is not None and torch.device(device).type == "cpu"
    return torch.compile(step, mode=mode, backend=backend or "inductor", fullgraph=True, dynamic=False,
                         options=dict(CPU_OPTIONS) if cpu else None)


class CapturedStep:
    """A graph-safe step recorded as one CUDA graph per signature from its eager kernels (torch.cuda.CUDAGraph), the
    other way to record it: no compiler (a second to record where inductor takes tens), the stock kernels.

    The first call with a new signature runs the step eagerly (its result is that call's: on CUDA on a side stream,
    the warm-up a capture needs), then records it into a graph (recording runs nothing). A later call copies its
    tensor arguments into the recorded ones and replays the graph, which reads the weights and the caches where they
    are and leaves its result in the recorded outputs: valid until the next replay (generate samples it first).
    A signature: the shapes of the tensor arguments, the other arguments themselves (a step kind's ints) and, for an
    object (a cache), which one and the address of every tensor it holds -- a cache whose tensors moved is recorded
    anew, never replayed on stale addresses. A tensor marked static (a server's slot state) is read in place.
    A step that changes a number or a flag of a cache (host state, which a replay would not change) is refused.

    On a CPU there is no CUDA graph: a replay runs the step on the recorded arguments, through the same copies and
    signatures. `graphs` holds one entry per recorded signature, `copied` the bytes copied in at each replay, and
    CapturedStep.recorded counts the records of every step."""

    recorded = 0

    def __init__(self, fn):
        self.fn, self.graphs, self.copied = fn, {}, []

    def __call__(self, *args):
        key = tuple(signature(a) for a in args)
        if key not in self.graphs:
            return self.record(key, args)
        graph, inputs, out = self.graphs[key]
        self.copied.append(sum(copy_in(x, a) for x, a in zip(inputs, args)))
        if graph is None:  # a CPU: the eager step on the recorded arguments
            return self.fn(*inputs)
        graph.replay()
        return out

    def record(self, key, args):
        inputs = [a.clone() if torch.is_tensor(a) and not is_static(a) else a for a in args]
        before = host_state(args)
        cuda = inputs[0].device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            result = self.fn(*args)  # the warm-up: cuBLAS handles and workspaces exist before the capture
        changed = [k for k, v in host_state(args).items() if before.get(k) != v]
        if changed:
            raise ValueError(f"{getattr(self.fn, '__name__', 'a step')} changed {', '.join(changed)} on the host: a "
                             f"recorded graph would not change it again")
        graph, out = None, None
        if cuda:
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = self.fn(*inputs)
        self.graphs[key] = (graph, inputs, out)
        CapturedStep.recorded += 1
        return result


def is_static(t: torch.Tensor) -> bool:
    return getattr(t, "_dynamo_static_input_type", None) is not None


def leaves(obj, path: str = "", depth: int = 3):
    """(path, value) of an object's attributes that are tensors, numbers, strings or None, `depth` objects deep."""
    for k, v in vars(obj).items():
        if torch.is_tensor(v) or isinstance(v, (int, float, str, type(None))):
            yield path + k, v
        elif depth > 1 and hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)):
            yield from leaves(v, f"{path}{k}.", depth - 1)


def signature(a):
    """What a recorded graph is specific to (CapturedStep): see there."""
    if torch.is_tensor(a):
        return ("static", a.data_ptr()) if is_static(a) else (tuple(a.shape), a.dtype, a.device)
    if isinstance(a, (int, float, str, type(None))):
        return a
    return id(a), tuple(v.data_ptr() for _, v in leaves(a) if torch.is_tensor(v))


def host_state(args) -> dict:
    """The numbers and flags the object arguments of a step hold (their tensors are the graph's business)."""
    return {f"{type(a).__name__}.{k}": v for a in args if hasattr(a, "__dict__") and not torch.is_tensor(a)
            for k, v in leaves(a) if not torch.is_tensor(v)}


def copy_in(recorded, a) -> int:
    """A tensor argument into its recorded copy -> the bytes copied (0 for a static tensor or another argument)."""
    if not torch.is_tensor(a) or recorded is a:
        return 0
    recorded.copy_(a)
    return a.numel() * a.element_size()


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
    its generate() static caches, one per batch bucket (model.graph_caches, StaticCaches). mode 'capture': each step
    a CapturedStep (CUDA graphs of the eager kernels); otherwise compile_step with that mode ('auto': 'reduce-overhead'
    on CUDA, inductor's C++ backend with CPU_OPTIONS on a CPU) and `backend`.
    The prefill stays eager (its shapes change with every prompt). -> model"""
    model.static_cache = True
    model.graph_caches = StaticCaches(model)
    device = model.lm_head.weight.device
    for name in model.graph_steps:
        fn = getattr(model, name)
        setattr(model, name, CapturedStep(fn) if mode == "capture" else
                compile_step(fn, graph_mode(mode, device, backend), backend, device))
    model.decode_step = getattr(model, model.graph_decode)
    return model


def uncompile_decode(model):
    """compile_decode undone: the model's own (eager) steps and dynamic caches again. -> model"""
    for k in (*model.graph_steps, "decode_step", "static_cache", "graph_caches"):
        model.__dict__.pop(k, None)
    return model


@contextlib.contextmanager
def eager_decode(model):
    """compile_decode undone for a with block: the model's own (eager) steps and dynamic caches; its compiled steps
    and static caches come back after it (what measures one against the other: cpu_tuning.compiled_decode_faster)."""
    names = (*model.graph_steps, "decode_step", "static_cache", "graph_caches")
    saved = {k: model.__dict__.pop(k) for k in names if k in model.__dict__}
    try:
        yield model
    finally:
        model.__dict__.update(saved)
