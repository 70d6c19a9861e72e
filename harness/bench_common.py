"""
bench_common.py -- what every benchmark of bench.py shares: the protocol (interleaved rounds, median and spread, the
header line, `describe`'s preset rows), the memory check before anything is allocated, the device's measured
bandwidth, and the peer model (transformers' LlamaForCausalLM at our shape, with our weights).

The protocol. The systems being compared are built once, then timed in INTERLEAVED rounds in one process (round r
times system A, then B, then C...), warm-up excluded, and each figure is the median over the rounds with the spread
(min..max) beside it. A ratio is only ever computed between systems timed in the same run (`ratio`: per round).
Every benchmark prints a header line (`header`): the device (the card's name on CUDA), the dtype, torch's version.

The topic files (bench_decode.py, bench_train.py, bench_kernels.py, bench_serve.py, bench_gpu.py) import this file;
it imports none of them, and bench.py (the command line) imports them all.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import fields

import torch

from harness.cli import UsageError, check_memory
from harness.device import sync, timeit
from harness.hf import hf_tensor_plan
from harness.memory import memory_sum
from model import GPT, GPTConfig, kv_bytes

# ----------------------------------------------------------------------------------------------------------------
# Protocol: interleaved rounds, median and spread


def rounds(systems: dict, repeats: int, device, warmup: int = 1) -> dict[str, list[float]]:
    """systems: name -> fn() (one timed unit of work on `device`). Each fn is warmed up, then the systems are timed in
    turn, `repeats` rounds, the device synchronised around each call as device.timeit does -> name -> list of seconds
    (one per round)."""
    for fn in systems.values():
        for _ in range(warmup):
            fn()
    out = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out[name].append(time.perf_counter() - t0)
    return out


def measured(xs) -> list:
    """The samples of a list that were measured: NaN marks a round whose figure could not be (generation_times)."""
    return [x for x in xs if not math.isnan(x)]


def med(xs) -> float:
    """The median of the measured samples; NaN for none (a metric nothing measured)."""
    xs = measured(xs)
    return statistics.median(xs) if xs else math.nan


def spread(xs, scale=1.0, fmt=".1f") -> str:
    """'median (min..max)' of the measured samples, each multiplied by scale; '-' for none."""
    xs = measured(xs)
    if not xs:
        return "-"
    return f"{med(xs) * scale:{fmt}} ({min(xs) * scale:{fmt}}..{max(xs) * scale:{fmt}})"


def device_name(device) -> str:
    """The card's name on CUDA (torch.cuda.get_device_name), else the device type and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}, {torch.get_num_threads()} threads"


def header(title: str, device, dtype, extra: str = ""):
    print(f"\n== {title} | device {device_name(device)} | dtype {dtype} | torch {torch.__version__}"
          + (f" | {extra}" if extra else ""))


# The memory a benchmark allocates (model.py's pieces: its models, caches and batches), checked before it allocates
# it (cli.check_memory): a size no machine holds (--batch 100000000) is one line, not an allocator traceback.
BANDWIDTH_PROBE = 2 ** 30  # read_bandwidth's buffer


def describe(name: str, model: torch.nn.Module, baseline: torch.nn.Module | None = None, seq_len: int | None = None):
    """One line per preset row (`python bench.py presets` prints every architecture's with it): non-embedding
    parameters, KV cache bytes of one sequence of seq_len tokens in bf16, training GFLOP per token -- and the same
    for a baseline model (e.g. the vanilla model of the same parameters) in brackets. Build the models on the meta
    device: nothing is allocated."""
    T = seq_len or model.config.max_seq_len

    def fmt(m):
        return (m.num_params() / 1e6, m.kv_cache_bytes(1, T) / 2 ** 20, m.flops_per_token(T) / 1e9)

    p, kv, fl = fmt(model)
    line = f"{name:22s} non-emb params {p:8.2f}M  KV @T={T} {kv:8.2f} MiB  train GFLOP/token {fl:7.3f}"
    if baseline is not None:
        bp, bkv, bfl = fmt(baseline)
        line += f"   (baseline {bp:.2f}M, {bkv:.2f} MiB, {bfl:.3f})"
    print(line)


def check_bench_memory(device, what: str, *parts: dict, fix: str = "lower it, or take a smaller --preset"):
    check_memory(memory_sum(*parts), device, what, fix)


def kv_of(cfg, batch: int, positions: int, elem: int) -> int:
    """KV bytes of a decoder of cfg's layers over `positions` (model.kv_bytes)."""
    return kv_bytes(cfg.n_layer, batch, positions, cfg.n_kv_head, cfg.hd, elem)


def check_context(positions: int, context: int, flags: str):
    """A prompt and its new tokens must fit the models' context (else a ValueError deep in generate)."""
    if positions > context:
        raise UsageError(f"{flags} = {positions:,} positions exceed the models' context of {context:,}: lower them")


def read_bandwidth(device, nbytes=BANDWIDTH_PROBE, repeats=5) -> float:
    """Bytes/s of a large streaming read on this device (a sum over `nbytes` of fp32, far larger than any cache):
    the memory-bound ceiling a decode step can approach."""
    x = torch.ones(nbytes // 4, device=device)
    ts = timeit(lambda: x.sum(), device, warmup=2, repeats=repeats)
    return nbytes / min(ts)


def per_round(a, b) -> list[float]:
    """The ratio of each round: a[r] / b[r] (two lists of one figure per round, timed in the same rounds)."""
    return [x / y for x, y in zip(a, b)]


def ratio(a, b, fmt=".2f") -> str:
    """Per-round ratios of two lists of times, as 'median (min..max)'."""
    return spread(per_round(a, b), fmt=fmt)


def json_safe(obj):
    """NaN/inf (a metric with no sample, e.g. no token generated) -> null: the --json line stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------------------------
# The peer: transformers' LlamaForCausalLM at the shape of a vanilla GPTConfig (decode, KD)


def hf_llama(cfg: GPTConfig, dtype, **kwargs):
    """transformers' LlamaForCausalLM with the same dims as a vanilla GPTConfig (random weights; kwargs: more
    LlamaConfig fields), or None when transformers is not installed (it is a dev dependency)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_hidden,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                     head_dim=cfg.hd, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                     tie_word_embeddings=cfg.tie_embeddings, rope_theta=cfg.rope_theta, **kwargs)
    return LlamaForCausalLM(hc).to(dtype).eval()


def hf_generate(hf, idx, n: int):
    """transformers' generate of exactly n new tokens, greedy (the peer's row of a decode benchmark)."""
    return hf.generate(idx, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def hf_twin(gpt: GPT, loops: int = 1):
    """transformers' LlamaForCausalLM computing what `gpt` computes, with its weights copied (hf.hf_tensor_plan's
    names, read backwards): a vanilla GPT, or (loops > 1) a RecursiveGPT's K shared layers run `loops` times, the
    same layer modules listed once per loop. Its attention runs SDPA, as ours does."""
    from transformers import LlamaForCausalLM  # noqa: F401 (a dev dependency: ImportError without it)

    cfg = GPTConfig(**{f.name: getattr(gpt.config, f.name) for f in fields(GPTConfig)} | {"n_layer": len(gpt.blocks)})
    ours = gpt.state_dict()
    sd = {theirs: ours[name] for theirs, (_, fn) in hf_tensor_plan("llama", cfg).items() for name in fn(None)}
    hf = hf_llama(cfg, torch.float32, attn_implementation="sdpa")
    hf.load_state_dict(sd, strict=False)  # a tied head is the embedding
    if loops > 1:
        hf.model.layers = torch.nn.ModuleList(list(hf.model.layers) * loops)
        hf.config.num_hidden_layers = len(hf.model.layers)
    return hf.to(gpt.lm_head.weight.device).train()
