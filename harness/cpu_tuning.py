"""
cpu_tuning.py -- the CPU forms chosen by measurement on this machine, kept off the teaching path.

model.linear, model.attend and kernels.multi_lora are plain PyTorch (F.linear; SDPA with GQA; the stacked LoRA).
Decoding on a CPU multiplies a few rows by every weight matrix without gradients: the step is bound by reading the
weights, and which form of the same math reads them fastest depends on the CPU, its vector extensions, the dtype,
the row count and the shapes (RESULTS.md, "CPU forms chosen by measurement"). This module times the
candidate forms once per shape on random tensors and keeps the fastest; enable() installs them:

  * linear (model.linear, model.tuned_ops): F.linear, torch.mv (one row), mm(W, x^T), x times a transposed copy of W,
    oneDNN on a copy of W in its blocked layout (what inductor runs), per (dtype, row bucket, shape); a product that
    reads a weight copy needs a > 10% lead; the times are kept on disk per machine (LINEAR_CACHE: under cpu_key, with
    the time they were taken). A later process times the recorded pick once and measures every candidate again when
    that is far off the record (times taken under load, a machine that changed) or the record is older than
    LINEAR_CACHE_DAYS.
  * decode attention (model.attend with few queries per row, no gradients, and the two attentions of PLT's G-SWA
    decode through kernels.cpu_decode_attend): SDPA or attend_grouped, the same math as two fp32-accumulated batched
    matmuls per KV head group (decode_attention).
  * attention precision under CPU bf16 autocast training: the attention itself in fp32 or bf16, whichever forward +
    backward is faster at the shape (bf16 only with a > 10% lead; attention_precision). train.py does not enable this
    module, so its CPU bf16-autocast runs take SDPA in bf16; the choice stays here for a training loop that wants it.
  * kernels.multi_lora's CPU inference form (kernels.cpu_lora_form): all adapters stacked into one masked LoRA, or one
    adapter's rows at a time, per (dtype, row bucket, shapes) (lora_form).
  * the decode step itself: eager (with the forms above) or compiled by graphs.compile_decode (inductor's C++ backend,
    frozen weights), per model shape, dtype and batch bucket (compiled_decode_faster): a measurement, kept on disk
    beside the linear products' (the same file, key and re-timing rule), never a rule written down for one CPU.
    `bench.py decode`, `serve.py` and `bench.py serve` ask it for their CPU runs unless a flag says on or off.

Every candidate computes the same math in another summation order: results agree to rounding, and
tests/test_cpu_tuning.py checks each one against its plain counterpart. Timing goes through one rule, `fastest`
(interleaved rounds after a warm-up, median; the plain form is the default and keeps a tie).

Who switches it on: bench.py's inference benchmarks and serve.py's command, each for its own run (switched_on, which
restores the state before it); train.py never does, and the tests run plain PyTorch unless a test switches it on.

Run:
    python bench.py decode --linear auto,linear --repeats 5   # each product's GB/s, the choice, vs transformers
    python -m pytest -q tests/test_cpu_tuning.py
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import json
import os
import platform
import time
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

import kernels
import model
from harness.cli import ENVIRONMENT_CHECKS, read_json, write_atomic
from model import check

# ----------------------------------------------------------------------------------------------------------------
# The switch


def enable():
    """From now on model.linear, model.attend, kernels.gated_swa_decode's CPU attention and kernels.multi_lora run the
    forms measured fastest on this CPU (where they apply: CPU tensors, no gradients for the products and decode
    attention, bf16 autocast training for the attention precision); elsewhere they stay plain PyTorch."""
    model.tuned_ops = TUNED
    kernels.cpu_decode_attend = attend
    kernels.cpu_lora_form = lora_form


def enabled() -> bool:
    return model.tuned_ops is TUNED


@contextlib.contextmanager
def switched_on():
    """enable() for a with block, or a function when used as a decorator; the state before it is restored after (so
    a benchmark run inside a test leaves the next test on plain PyTorch)."""
    before = model.tuned_ops, kernels.cpu_decode_attend, kernels.cpu_lora_form
    enable()
    try:
        yield
    finally:
        model.tuned_ops, kernels.cpu_decode_attend, kernels.cpu_lora_form = before


# ----------------------------------------------------------------------------------------------------------------
# The tuned model.linear and model.attend


def linear(x, weight, bias=None):
    """model.linear's math at CPU inference in the product this machine runs fastest at x's shape: on CPU without
    gradients, with x and W of one dtype (fp32 or bf16) and 1 to 64 rows, the product `linear_product` picked for
    (dtype, row bucket, shape); F.linear otherwise (training, more rows, other devices, a compiled graph: torch.compile
    picks its own kernel)."""
    if (x.device.type == "cpu" and not torch.is_grad_enabled() and x.dtype in LINEAR_DTYPES
            and weight.dtype == x.dtype and not torch.compiler.is_compiling()):
        rows = x.numel() // x.size(-1)
        name = linear_product(x.dtype, rows, *weight.shape) if 0 < rows <= LINEAR_ROW_BUCKETS[-1] else "linear"
        if name != "linear":
            copy = weight_copy(weight, name) if name in LINEAR_COPIES else None
            y = LINEAR_PRODUCTS[name](x.reshape(rows, -1), weight, copy)  # (rows, out)
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)


def attend(q, k, v, mask=None, is_causal=False, scale=None):
    """model.attend's math in the form measured fastest on this CPU. CPU training under bf16 autocast runs the
    attention itself in fp32 or bf16 (attention_precision); the projections around it stay in bf16. No-grad CPU
    attention with few queries per row (decoding) runs SDPA or attend_grouped (decode_attention). Elsewhere SDPA."""
    gqa = q.size(1) != k.size(1)
    causal = is_causal and mask is None
    if q.device.type == "cpu" and q.requires_grad and torch.is_autocast_enabled("cpu"):
        if attention_precision(q, k, mask, causal, scale, gqa) == "fp32":
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                   is_causal=causal, scale=scale, enable_gqa=gqa)
            return y.to(q.dtype)
    if (q.device.type == "cpu" and not torch.is_grad_enabled() and not causal and q.size(2) <= DECODE_QUERIES
            and not torch.compiler.is_compiling() and decode_attention(q, k, mask) == "grouped"):
        if torch.autograd._profiler_enabled():  # one named event in a profile (bench.py block --profile)
            with torch.profiler.record_function(GROUPED_EVENT):
                return attend_grouped(q, k, v, mask, scale)
        return attend_grouped(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


TUNED = SimpleNamespace(linear=linear, attend=attend)  # what enable() puts into model.tuned_ops


# ----------------------------------------------------------------------------------------------------------------
# Attention: the decode form and the training precision


DECODE_QUERIES = 16  # attend measures SDPA against attend_grouped for at most this many queries per row
GROUPED_EVENT = "cpu_tuning::attend_grouped"  # the profiler event of attend's grouped form (its matmuls are bmm)
_decode_choice: dict[tuple, str] = {}  # (shapes with keys rounded up to a power of two, dtype, mask) -> the form


def attend_grouped(q, k, v, mask=None, scale=None):
    """attend's math for a few queries (decode) as two batched matmuls per KV head group, accumulated in fp32 like
    SDPA's flash kernel: the G = H / H_kv query heads of a KV head are stacked as G*T rows against its keys (no K/V
    copy per query head). A query that sees no key gets 0, as SDPA on CPU gives. q (B, H, T, D) -> (B, H, T, D)."""
    B, H, T, D = q.shape
    Hkv, S = k.size(1), k.size(2)
    G = H // Hkv
    scale = scale if scale is not None else D ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 (fp64 inputs: fp64)
    s = q.reshape(B, Hkv, G * T, D).to(acc) @ k.to(acc).transpose(-1, -2) * scale  # (B, H_kv, G T, S)
    if mask is not None:
        m = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B or 1, H or 1, T or 1, S)
        m = m[:, :, None] if m.size(1) == 1 else m.view(m.size(0), Hkv, G, m.size(2), S)  # (., H_kv or 1, G or 1, ., S)
        s = s.view(B, Hkv, G, T, S).masked_fill(~m, float("-inf")).view(B, Hkv, G * T, S)
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row with every key masked: all -inf -> NaN -> 0
    return (p @ v.to(acc)).to(q.dtype).view(B, H, T, D)


def decode_attention(q, k, mask, timer=None) -> str:
    """Which form runs no-grad CPU attention with few queries at these shapes: "sdpa" or "grouped" (attend_grouped),
    whichever this machine runs faster, timed once per (q's shape, k's shape with the key count rounded up to a power
    of two, dtype, mask shape) on random tensors: which form wins depends on the CPU, the torch build and the dtype
    (RESULTS.md, "CPU forms chosen by measurement"), hence the measurement. `timer(form) -> seconds` replaces it
    (tests)."""
    S = 1 << max(0, k.size(2) - 1).bit_length()
    mshape = None if mask is None else tuple(mask.shape[:-1])
    key = (tuple(q.shape), tuple(k.shape[:2]), S, k.size(3), q.dtype, mshape)
    if key not in _decode_choice:
        def run(form):
            qq = torch.randn(q.shape, dtype=q.dtype)
            kk, vv = (torch.randn(*k.shape[:2], S, k.size(3), dtype=q.dtype) for _ in range(2))
            m = None if mask is None else torch.ones(*mask.shape[:-1], S, dtype=torch.bool)
            t0 = time.perf_counter()
            for _ in range(5):
                if form == "sdpa":
                    F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, enable_gqa=qq.size(1) != kk.size(1))
                else:
                    attend_grouped(qq, kk, vv, m)
            return time.perf_counter() - t0

        _decode_choice[key] = fastest(timer or run, ("sdpa", "grouped"))
    return _decode_choice[key]


_attention_choice: dict[tuple, str] = {}  # (shapes, dtype, mask, causal) -> "fp32" | "bf16", for this process


def attention_precision(q, k, mask, causal, scale, gqa, timer=None) -> str:
    """The precision of CPU autocast-training attention at q's and k's shapes: forward + backward of SDPA timed once
    in fp32 and in q's dtype on random tensors of those shapes (warm-up, 3 interleaved runs, median); "bf16" only
    when it beats fp32 by more than 10%. A compiled graph takes fp32 (no timing while tracing). `timer(kind) ->
    seconds` replaces the measurement (tests)."""
    if torch.compiler.is_compiling():
        return "fp32"
    key = (tuple(q.shape), tuple(k.shape), q.dtype, None if mask is None else tuple(mask.shape), causal)
    if key not in _attention_choice:
        def run(kind):
            dt = torch.float32 if kind == "fp32" else q.dtype
            qq, kk, vv = (torch.randn(t.shape, dtype=dt).requires_grad_() for t in (q, k, k))
            m = None if mask is None else torch.ones(mask.shape, dtype=torch.bool)
            t0 = time.perf_counter()
            with torch.autocast("cpu", enabled=False):
                F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, is_causal=causal, scale=scale,
                                               enable_gqa=gqa).sum().backward()
            return time.perf_counter() - t0

        _attention_choice[key] = fastest(timer or run, ("fp32", "bf16"), gain=1.10)
    return _attention_choice[key]


# ----------------------------------------------------------------------------------------------------------------
# Linear products (what `linear` above runs)
#
# The candidates compute x W^T for x (rows, in) and W (out, in). Each (dtype, row bucket, shape) is timed once per
# process, on the first call that needs it, and the fastest product is kept. The timing streams through enough copies
# of a random matrix to exceed the caches, as a decode step streams through a model's weights.

LINEAR_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_ROW_BUCKETS = (1, 2, 4, 16, 64)  # rows are timed at the smallest bucket >= them; more than 64 rows: F.linear
LINEAR_PROBE_BYTES = 64 << 20  # bytes of weight copies one timed pass reads: more than the caches
LINEAR_MAX_COPIES = 128  # at most this many: a small matrix's product is bound by per-call overhead (>= 512 KB: 64 MiB)
# measured times on disk, per machine; the environment variable LINEAR_CHOICE_CACHE names another file ("": none)
LINEAR_CACHE = os.path.expanduser("~/.cache/nano-efficient-inference/linear_choice.json")
LINEAR_CACHE_BYTES = 16 << 20  # far more than the records of every shape of every preset on a few machines
LINEAR_CACHE_DAYS = 30  # a record older than this is measured again (a new kernel library, firmware, settings)
LINEAR_FAR_OFF = 2.0  # the recorded pick timed now this many times slower or faster than its record: measure again
LINEAR_COPY_GAIN = 1.10  # a weight copy costs the weight's bytes again: kept only when > 10% faster than the rest
LINEAR_COPIES = {  # product -> the copy of W it reads, made once per weight (weight_copy)
    "xwt": lambda w: w.t().contiguous(),  # W^T (in, out)
    "dnn": lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 64),  # oneDNN's blocked layout (hint: 64 rows)
}
LINEAR_PRODUCTS = {  # name -> f(x (rows, in), W (out, in), the product's copy of W or None) -> (rows, out)
    "linear": lambda x, w, c: F.linear(x, w),
    "mv": lambda x, w, c: torch.mv(w, x[0])[None],  # one row only
    # (rows, out) made contiguous (a few KB): a transposed view would push later ops (SDPA's CPU flash kernel needs
    # unit stride in the last dim) onto slow strided paths
    "mm": lambda x, w, c: torch.mm(w, x.t().contiguous()).t().contiguous(),
    "xwt": lambda x, w, c: torch.mm(x, c),
    "dnn": lambda x, w, c: torch.ops.mkldnn._linear_pointwise(x, c, None, "none", [], ""),  # what inductor runs
}
_linear_choice: dict[tuple, str] = {}  # (dtype, rows, out, in) -> product name, for this process
_linear_times: dict[tuple, dict[str, float]] = {}  # (dtype, bucket, out, in) -> product -> seconds, as measured
_linear_forced: list[str | None] = [os.environ.get("LINEAR_PRODUCT") or None]  # force_linear() sets it


def _linear_product_env() -> str | None:
    """LINEAR_PRODUCT, checked like a flag before a command's work (cli.ENVIRONMENT_CHECKS): empty or unset, or a
    product's name."""
    name = os.environ.get("LINEAR_PRODUCT")
    if name and name not in LINEAR_PRODUCTS:
        return (f"LINEAR_PRODUCT={name!r} is not one of {', '.join(LINEAR_PRODUCTS)} (the product every linear layer "
                f"runs where it applies); unset it for the measured choice")
    return None


ENVIRONMENT_CHECKS.append(_linear_product_env)
_weight_copies = WeakIdKeyDictionary()  # weight -> product -> ((version, data_ptr), copy of the weight)


def force_linear(name: str | None):
    """Run product `name` wherever it applies (where it is a candidate: "mv" for one row, "dnn" where oneDNN computes
    the dtype) instead of the measured choice; None: the measured choice again. The environment variable
    LINEAR_PRODUCT=name does the same for a whole process."""
    check(name is None or name in LINEAR_PRODUCTS, f"{name!r} is not one of {sorted(LINEAR_PRODUCTS)}",
          "linear product")
    _linear_forced[0] = name


def linear_candidates(dtype, rows: int) -> list[str]:
    """The products timed for `rows` rows of dtype, F.linear first (a tie keeps it); "dnn" where torch has oneDNN
    and oneDNN computes the dtype on this CPU (bf16; fp16 needs avx_ne_convert or avx512_fp16)."""
    return ["linear"] + ["mv"] * (rows == 1) + ["mm", "xwt"] + ["dnn"] * _dnn_computes(dtype)


@functools.cache
def _dnn_computes(dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def pick_linear(times: dict[str, float]) -> str:
    """The fastest product of `times` (name -> seconds, "linear" among them); one that reads a weight copy (memory)
    only when it beats the fastest product without one by LINEAR_COPY_GAIN. Never slower than F.linear as measured."""
    plain = min((k for k in times if k not in LINEAR_COPIES), key=times.__getitem__)
    copy = min((k for k in times if k in LINEAR_COPIES), key=times.__getitem__, default=None)
    return copy if copy is not None and times[copy] * LINEAR_COPY_GAIN < times[plain] else plain


def time_linear_products(dtype, rows: int, out_f: int, in_f: int, names, repeats: int = 3) -> dict[str, float]:
    """Seconds per product of each named product for x (rows, in_f) and W (out_f, in_f): after one warm-up call
    each, `repeats` interleaved passes over n copies of W (LINEAR_PROBE_BYTES, at most LINEAR_MAX_COPIES), median."""
    n = max(1, min(LINEAR_MAX_COPIES, -(-LINEAR_PROBE_BYTES // (out_f * in_f * dtype.itemsize))))
    w = torch.randn(out_f, in_f, dtype=dtype).expand(n, out_f, in_f).contiguous().unbind(0)  # n x (out, in)
    copies = {k: [LINEAR_COPIES[k](wi) for wi in w] if k in LINEAR_COPIES else [None] * n for k in names}
    x = torch.randn(rows, in_f, dtype=dtype)
    times = {k: [] for k in names}
    for k in names:
        LINEAR_PRODUCTS[k](x, w[0], copies[k][0])
    for _ in range(repeats):
        for k in names:
            f, c = LINEAR_PRODUCTS[k], copies[k]
            t0 = time.perf_counter()
            for i in range(n):
                f(x, w[i], c[i])
            times[k].append((time.perf_counter() - t0) / n)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def linear_product(dtype, rows: int, out_f: int, in_f: int) -> str:
    """The product `linear` runs for rows x (out_f, in_f) in dtype: the forced one, else the measured choice of the
    row bucket (timed on first use by time_linear_products, picked by pick_linear)."""
    forced = _linear_forced[0]
    if forced is not None and forced in linear_candidates(dtype, rows):
        return forced
    key = (dtype, rows, out_f, in_f)
    name = _linear_choice.get(key)
    if name is None:
        bucket = LINEAR_ROW_BUCKETS[bisect.bisect_left(LINEAR_ROW_BUCKETS, rows)]
        name = _linear_choice[key] = pick_linear(linear_times(dtype, bucket, out_f, in_f))
    return name


def linear_times(dtype, bucket: int, out_f: int, in_f: int) -> dict[str, float]:
    """Seconds per product of the candidates at (dtype, bucket, shape): this process's, else the disk cache's for this
    machine (cpu_key) while it still holds (recorded_times), else measured now (time_linear_products) and recorded in
    the disk cache with the time of the measurement. A cold choice streams every candidate over LINEAR_PROBE_BYTES of
    weights per shape, a pause at a command's start, hence the disk cache."""
    key = (dtype, bucket, out_f, in_f)
    if key not in _linear_times:
        path, names = os.environ.get("LINEAR_CHOICE_CACHE", LINEAR_CACHE), linear_candidates(dtype, bucket)
        mkey, skey = cpu_key(), f"{str(dtype).removeprefix('torch.')} {bucket} {out_f}x{in_f}"
        entry = _read_cache(path).get(mkey, {}).get(skey) if path else None
        times = recorded_times(entry, names, dtype, bucket, out_f, in_f)
        if times is None:
            times = time_linear_products(dtype, bucket, out_f, in_f, names)
            if path:
                disk = _read_cache(path)
                disk.setdefault(mkey, {})[skey] = {"times": times, "measured": time.time()}
                _write_cache(path, disk)
        _linear_times[key] = times
    return _linear_times[key]


def recorded_times(entry, names, dtype, bucket: int, out_f: int, in_f: int) -> dict[str, float] | None:
    """The disk cache's record of one shape ({"times": {product: seconds}, "measured": unix time}) if it still holds
    here: times of the same candidates, taken less than LINEAR_CACHE_DAYS ago, and the recorded pick, timed once now
    (one pass, time_linear_products), within LINEAR_FAR_OFF of its record either way. Else None: measure every
    candidate again (a record taken under load, or before the machine changed, is far off; one without its time is
    from before records had one)."""
    times = young_record(entry, names)
    if times is None:
        return None
    pick = pick_linear(times)
    now = time_linear_products(dtype, bucket, out_f, in_f, [pick], repeats=1)[pick]
    return times if times[pick] / LINEAR_FAR_OFF <= now <= times[pick] * LINEAR_FAR_OFF else None


def young_record(entry, names) -> dict[str, float] | None:
    """The times of a disk-cache record ({"times": {candidate: seconds}, "measured": unix time}) when it holds times
    of exactly these candidates, each > 0, taken less than LINEAR_CACHE_DAYS ago; else None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("times"), dict):
        return None
    times, measured = entry["times"], entry.get("measured")
    if sorted(times) != sorted(names) or not all(isinstance(t, (int, float)) and t > 0 for t in times.values()):
        return None
    if not isinstance(measured, (int, float)) or not 0 <= time.time() - measured < LINEAR_CACHE_DAYS * 86400:
        return None
    return times


def weight_copy(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The copy of `weight` product `name` reads (LINEAR_COPIES), made once per weight and again whenever the weight
    changed: in place (its version counter moved: an optimizer step, load_state_dict) or replaced (its storage
    moved: .to()). Writes through `weight.data` bypass the version counter and are not seen."""
    stamp = (weight._version, weight.data_ptr())
    copies = _weight_copies.get(weight)
    if copies is None:
        copies = _weight_copies[weight] = {}
    hit = copies.get(name)
    if hit is None or hit[0] != stamp:
        hit = copies[name] = (stamp, LINEAR_COPIES[name](weight))
    return hit[1]


def linear_report() -> tuple[list[dict], int]:
    """What the chooser measured: one dict per (dtype, row bucket, shape) -- the pick and the GB/s of weights each
    candidate read -- and the bytes of the weight copies alive now (elements x size: oneDNN's layout may pad)."""
    rows = [dict(dtype=str(d).removeprefix("torch."), rows=b, shape=(o, i), pick=pick_linear(t),
                 gbps={k: o * i * d.itemsize / s / 1e9 for k, s in t.items()})
            for (d, b, o, i), t in _linear_times.items()]
    return rows, sum(c.numel() * c.element_size() for cs in _weight_copies.values() for _, c in cs.values())


# ----------------------------------------------------------------------------------------------------------------
# The LoRA form of kernels.multi_lora at CPU inference

_lora_form: dict[tuple, str] = {}  # (dtype, row bucket, T, n, r, in, out) -> the faster form, for this process


def lora_form(x, A, B, timer=None) -> str:
    """Which CPU form multi_lora runs at these shapes: 'stacked' (n x the LoRA FLOPs, no gathers) or 'grouped' (the
    FLOPs once, a gather and scatter per adapter), whichever this machine runs faster. Timed once per (dtype, row
    count rounded up to a power of two, shapes) on random inputs whose rows are spread evenly over the adapters (the
    mix of a depth-wise step): a warm-up, then 5 interleaved rounds of 20 calls each, median. `timer(form) -> seconds`
    replaces the measurement (tests)."""
    N = x.size(0)
    bucket = 1 << max(0, N - 1).bit_length()
    key = (x.dtype, bucket, x[0].numel() // x.size(-1), *A.shape, B.size(1))
    if key not in _lora_form:
        def run(form):
            xs = torch.randn(bucket, *x.shape[1:], dtype=x.dtype)
            As, Bs = torch.randn_like(A), torch.randn_like(B)
            ids = torch.arange(bucket) % A.size(0)
            t0 = time.perf_counter()
            for _ in range(20):
                kernels.LORA_FORMS[form](xs, As, Bs, ids)
            return time.perf_counter() - t0

        _lora_form[key] = fastest(timer or run, tuple(kernels.LORA_FORMS), rounds=5)
    return _lora_form[key]


# ----------------------------------------------------------------------------------------------------------------
# The decode step: eager or compiled

DECODE_PROMPT, DECODE_TOKENS = 16, 17  # the generation compiled_decode_faster times: prompt tokens, new tokens
DECODE_GAIN = 1.10  # the compiled step (tens of seconds of compiling, a second copy of the weights) must win by 10%


def decode_key(model, batch: int) -> str:
    """What a decode choice holds for besides the machine (cpu_key): the model's class, its config (hashed), whether
    its products are int8 (harness/quantize.py), its dtype and the batch bucket (graphs.batch_bucket)."""
    import hashlib

    import graphs

    cfg = hashlib.sha1(repr(sorted(vars(model.config).items())).encode()).hexdigest()[:12]
    int8 = any(type(m).__name__ == "Int8Linear" for m in model.modules())
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    return f"decode {type(model).__name__} {cfg}{' int8' if int8 else ''} {dtype} {graphs.batch_bucket(batch)} rows"


def decode_step_time(model, batch: int, compiled: bool, rounds: int = 1) -> float:
    """Seconds per new token of model.generate at `batch` rows (DECODE_PROMPT prompt tokens, DECODE_TOKENS new ones,
    greedy), with its compiled step (graphs.compile_decode applied) or its eager one (graphs.eager_decode), the
    median of `rounds` timed runs. The prefill is the same eager code in both and the difference is the decode."""
    import graphs

    torch.manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (batch, DECODE_PROMPT), device=model.lm_head.weight.device)
    times = []
    with contextlib.nullcontext() if compiled else graphs.eager_decode(model):
        for _ in range(rounds):
            t0 = time.perf_counter()
            model.generate(idx, DECODE_TOKENS)
            times.append((time.perf_counter() - t0) / DECODE_TOKENS)
    return sorted(times)[len(times) // 2]


def compiled_decode_faster(model, batch: int, flag: bool | None = None, timer=None, keep: bool = True) -> bool:
    """Whether `model` decodes `batch` rows with graphs.compile_decode's compiled step on this machine; the model is
    left compiled when it does (the graphs compiled for the measurement are the ones used), eager otherwise.
    keep=False: the model is left eager either way, and a record on disk is taken as it is, not timed again (a
    server compiles steps of its own: serve.py, bench.py serve).

    flag True / False: as told (a command's --compile / --no-compile). None (`auto`): compiled on CUDA; on a CPU
    by measurement, never by a rule: generate() timed with the eager step (this module's forms) and with the
    compiled one, a warm-up each (the compile), then 3 interleaved rounds, median (decode_step_time); compiled when
    it wins by DECODE_GAIN. The times are kept on disk beside the linear products' (LINEAR_CACHE, under cpu_key and
    decode_key: the model's shape and dtype and the batch bucket); a later process times the recorded pick once and
    measures both again when that is far off the record or the record is old (LINEAR_FAR_OFF, LINEAR_CACHE_DAYS).
    `timer(model, batch, compiled) -> seconds per token` replaces decode_step_time (tests)."""
    import graphs

    device = model.lm_head.weight.device
    if flag is None and device.type != "cpu":
        flag = device.type == "cuda"
    if flag is not None:
        if flag and keep and model.graph_caches is None:
            graphs.compile_decode(model)
        return flag
    timer = timer or (lambda m, b, c, rounds=1: decode_step_time(m, b, c, rounds))
    names = ("eager", "compiled")
    path, mkey, skey = os.environ.get("LINEAR_CHOICE_CACHE", LINEAR_CACHE), cpu_key(), decode_key(model, batch)
    entry = _read_cache(path).get(mkey, {}).get(skey) if path else None
    times = young_record(entry, names)
    if times is not None and keep:
        pick = "compiled" if times["compiled"] * DECODE_GAIN < times["eager"] else "eager"
        if pick == "compiled":
            graphs.compile_decode(model)
            timer(model, batch, True)  # the compile
        now = timer(model, batch, pick == "compiled")
        if not times[pick] / LINEAR_FAR_OFF <= now <= times[pick] * LINEAR_FAR_OFF:
            times = None
    if times is None:
        if model.graph_caches is None:
            graphs.compile_decode(model)
        for compiled in (False, True):
            timer(model, batch, compiled)  # the warm-up: the compile, the eager forms' measurements
        runs = {k: [] for k in names}
        for _ in range(3):
            for k in names:
                runs[k].append(timer(model, batch, k == "compiled"))
        times = {k: sorted(v)[1] for k, v in runs.items()}
        if path:
            disk = _read_cache(path)
            disk.setdefault(mkey, {})[skey] = {"times": times, "measured": time.time()}
            _write_cache(path, disk)
    faster = times["compiled"] * DECODE_GAIN < times["eager"]
    if not (faster and keep):
        graphs.uncompile_decode(model)
    return faster


# ----------------------------------------------------------------------------------------------------------------
# One timing rule, and what a measurement holds for


def fastest(timer, kinds, rounds: int = 3, gain: float = 1.0) -> str:
    """The kind with the least median time over `rounds` interleaved calls of timer(kind) -> seconds after one
    warm-up call each; a kind other than the first must beat the first by `gain` (the first is the default)."""
    times = {kind: [] for kind in kinds}
    for kind in kinds:
        timer(kind)
    for _ in range(rounds):
        for kind in kinds:
            times[kind].append(timer(kind))
    med = {kind: sorted(ts)[len(ts) // 2] for kind, ts in times.items()}
    best = min(kinds, key=med.__getitem__)
    return best if med[best] * gain < med[kinds[0]] else kinds[0]


def cpu_key() -> str:
    """What a measured choice holds for: the CPU model, torch's version and CPU capability, the thread count."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return (f"{cpu} | torch {torch.__version__} | {torch.backends.cpu.get_cpu_capability()} | "
            f"{torch.get_num_threads()} threads")


def _read_cache(path: str) -> dict:
    """The disk cache {cpu_key: {shape: record}} through cli.read_json; none yet is empty, and a damaged one (not a
    regular file, too large, not UTF-8 or JSON, nested too deep, not of this form) is one warning per process: its
    shapes are measured again and the file is written anew (_write_cache)."""
    def problem(cache):
        return None if all(isinstance(v, dict) for v in cache.values()) else "a machine's entry is not an object"
    try:
        return read_json(path, "CPU-tuning cache", "a cache of measured linear products", problem, error=ValueError,
                         damaged=True, max_bytes=LINEAR_CACHE_BYTES)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        if path not in _damaged_caches:  # once per process: every shape reads it
            _damaged_caches.add(path)
            warnings.warn(f"{e}: its shapes are measured again and the file written anew", stacklevel=2)
        return {}


_damaged_caches: set[str] = set()


def _write_cache(path: str, obj: dict):
    """Atomically (cli.write_atomic: another process may read it meanwhile, a link there is never followed); a cache
    that cannot be written is skipped."""
    try:
        write_atomic(path, json.dumps(obj, indent=1), "CPU-tuning cache", error=OSError)
    except OSError:
        pass
