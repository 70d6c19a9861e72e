"""
bench.py -- the speed claims of the four papers, measured on the machine you have, plus the peer comparisons.

Every benchmark here follows the same protocol, because the machines this repository is developed on are small and
shared: the systems being compared are built once, then timed in INTERLEAVED rounds in one process (round r times
system A, then B, then C...), warm-up excluded, and each figure is the median over the rounds with the spread
(min..max) beside it. A ratio is only ever computed between systems timed in the same run. Each benchmark prints
the device, the sizes, the dtype, the batch, the ratio and the paper's figure beside it.

Memory. Each benchmark adds up what it will allocate (its models, caches, RoPE tables and batches, with model.py's
pieces) and compares it with what the device has before it allocates anything (check_bench_memory): a size no
machine holds is one line, not an allocator traceback.

Sizes. On a CPU, a model whose weights fit in the caches is bound by per-operator overhead, not by memory, and none
of the papers' memory-bound arguments apply to it. The default sizes here are therefore the ~100-150M `base`
presets (hundreds of MB of weights, far more than the caches): decoding them one token at a time is memory-bound
on a CPU as on a GPU. (`--preset tiny` is for a quick check.)

CPU forms. The inference benchmarks (decode, plt, double, archs, serve, block) run with cpu_tuning.py switched on: the
linear products, attention and LoRA forms measured fastest on this CPU (decode --linear forces a product instead).
`train` and `kd` measure what train.py runs: plain PyTorch.

Run:
    python bench.py decode                       # vanilla decode: tok/s, bandwidth vs this machine's, vs transformers
    python bench.py decode --dtype bfloat16 --batch 1,8
    python bench.py train --nanogpt DIR          # training tok/s vs nanoGPT's model.py (a checkout you provide)
    python bench.py train --nanogpt DIR --profile   # ... and one step of each by operator group
    python bench.py kd --weights smollm2-135m    # KD uptraining step of SmolLM2-135M vs the same in transformers
    python bench.py archs                        # all six architectures side by side (tiny presets)
    python bench.py double --rollover 16         # double decoder vs decoder-only: TTFT, cached prefix, per token, KV
    python bench.py serve --exit-rate 0.633 --profile   # depth-wise + exit vs continuous batching; a step's parts
    python bench.py kernels                      # (CUDA) every Triton kernel vs its reference and stock PyTorch
    python bench.py roofline                     # this CPU's roofline; PLT-2 / vanilla from the matmuls alone
    python bench.py ckpt                         # what verifying a checkpoint's CRC-32s costs beside torch.load
    python bench.py presets --arch plt           # every preset's rows: parameters, KV bytes, FLOPs (no timing)
    python bench.py gpu --nanogpt DIR --json g.json   # (one GPU, 8 minutes) every section above against its baseline

What a trained checkpoint does on validation text (early exits, SVD residual energy, double-eval, block --eval) is
measured by eval.py, not here.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    import startup
    startup.stop_while_starting()

import argparse
import math
import os
import statistics
import time
from dataclasses import asdict, fields
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import bench_gpu
import bench_serve
import cpu_tuning
import kernels as K
from cli import (DTYPES, ArgumentParser, UsageError, check_memory, check_writable_dir, comma_list, number, one_of,
                 path_arg, run_cli, run_subcommand, threads_arg, user_input)
from cpu_tuning import LINEAR_PROBE_BYTES, LINEAR_PRODUCTS, cpu_key, force_linear, linear_report
from model import (GPT, PRESETS, GPTConfig, describe, forward_memory, kv_bytes, least_step_memory, make_optimizer,
                   memory_sum, model_memory, module_bytes, param_bytes, pick_device, pick_dtype, sync, timeit)

# ----------------------------------------------------------------------------------------------------------------
# Protocol: interleaved rounds, median and spread


def rounds(systems: dict, repeats: int, device, warmup: int = 1) -> dict[str, list[float]]:
    """systems: name -> fn() (one timed unit of work on `device`). Each fn is warmed up, then the systems are timed in
    turn, `repeats` rounds, the device synchronised around each call as model.timeit does -> name -> list of seconds
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


def med(xs) -> float:
    return statistics.median(xs)


def spread(xs, scale=1.0, fmt=".1f") -> str:
    """'median (min..max)' of a list, each multiplied by scale."""
    return f"{med(xs) * scale:{fmt}} ({min(xs) * scale:{fmt}}..{max(xs) * scale:{fmt}})"


def header(title: str, device, dtype, extra: str = ""):
    cpu = f"cpu, {torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"\n== {title} | device {cpu} | dtype {dtype} | torch {torch.__version__}" + (f" | {extra}" if extra else ""))


# The memory a benchmark allocates (model.py's pieces: its models, caches and batches), checked before it allocates
# it (cli.check_memory): a size no machine holds (--batch 100000000) is one line, not an allocator traceback.
BANDWIDTH_PROBE = 2 ** 30  # read_bandwidth's buffer


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


# ----------------------------------------------------------------------------------------------------------------
# Vanilla decode: this repository vs transformers' LlamaForCausalLM.generate, and vs the machine's bandwidth


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


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_decode(args):
    device = pick_device(args.device)
    cfg = GPTConfig.from_preset(args.preset)
    P, N = args.prompt_len, args.new_tokens
    products = args.linear.split(",")  # "auto" = cpu_tuning's measured choice, else a forced product
    check_context(P + N, cfg.max_seq_len, f"--prompt-len {P} + --new-tokens {N}")
    top, twins = max(int(b) for b in args.batch.split(",")), 2 if args.hf else 1  # ours and transformers' model
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        elem = dtype.itemsize
        check_bench_memory(device, f"bench.py decode in {dtype} at --batch {top}", {"bandwidth probe": BANDWIDTH_PROBE},
                           *[model_memory(cfg, elem)] * twins, {"prompts": top * P * 8},
                           {"KV caches of generate": twins * kv_of(cfg, top, P + N, elem)},
                           forward_memory(cfg, top, P, elem, logits_rows=top), fix="lower --batch or --prompt-len")
    bw = read_bandwidth(device)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        ours = GPT(cfg).to(device=device, dtype=dtype).eval()
        if args.compile:
            ours.compile_decode()
        hf = hf_llama(cfg, dtype) if args.hf else None
        if hf is not None:
            hf.to(device)
        wbytes = param_bytes(ours)
        header("vanilla decode", device, dtype, f"compiled decode step {args.compile} | preset {args.preset}: {cfg.n_layer} layers, d {cfg.n_embd}, "
               f"{wbytes / 1e6:.0f} MB of weights | prompt {P}, {N} new tokens, greedy | median (min..max) of "
               f"{args.repeats} interleaved rounds after 1 warm-up")
        print(f"   read bandwidth of this machine (1 GiB streaming sum): {bw / 1e9:.1f} GB/s -> a batch-1 decode "
              f"step cannot take less than {wbytes / bw * 1e3:.1f} ms ({bw / wbytes:.1f} tok/s)")
        for B in [int(b) for b in args.batch.split(",")]:
            idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=device)
            systems = {decode_name(p): partial(forced_generate, ours, p, idx, N) for p in products}
            if hf is not None:
                systems["transformers: LlamaForCausalLM.generate"] = lambda: hf.generate(
                    idx, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
            pre = rounds({"prefill": lambda: ours.generate(idx, 1)}, args.repeats, device)["prefill"]
            res = rounds(systems, args.repeats, device)
            for p in products:
                name = decode_name(p)
                t_dec = [t - med(pre) for t in res[name]]  # the decode steps alone
                print(f"   batch {B}, {name}: {spread([B * N / t for t in res[name]])} tok/s end to end; "
                      f"decode alone {med(t_dec) / (N - 1) * 1e3:.2f} ms/step = "
                      f"{B * (N - 1) / med(t_dec):.1f} tok/s, {wbytes / (med(t_dec) / (N - 1)) / 1e9:.1f} GB/s of "
                      f"weights = {wbytes / (med(t_dec) / (N - 1)) / bw:.0%} of the measured bandwidth")
                if hf is not None:
                    hname = "transformers: LlamaForCausalLM.generate"
                    ratio = [a / b for a, b in zip(res[hname], res[name])]
                    print(f"            transformers {spread([B * N / t for t in res[hname]])} tok/s end to end -> "
                          f"ours / transformers = {spread(ratio, fmt='.2f')}x (per-round ratios)")
        if device.type == "cpu":
            print_linear_choices(dtype)
    force_linear(None)


def decode_name(product: str) -> str:
    return "ours: GPT.generate" + ("" if product == "auto" else f" [linear: {product}]")


def forced_generate(model, product: str, idx, new_tokens: int):
    """model.generate with `product` forced in cpu_tuning.linear ("auto": the measured choice)."""
    force_linear(None if product == "auto" else product)
    return model.generate(idx, new_tokens)


def print_linear_choices(dtype):
    """cpu_tuning's linear measurements in this dtype: per (rows, weight shape) the GB/s of weights each candidate
    read and the pick, and the bytes of the weight copies alive (what "xwt" and "dnn" cost in memory)."""
    rows, copies = linear_report()
    print(f"   cpu_tuning's linear product per (rows, out x in) in {dtype} (GB/s of weights read, timed once over "
          f">= {LINEAR_PROBE_BYTES >> 20} MiB of copies; * = picked; cpu {cpu_key()}):")
    for r in rows:
        if r["dtype"] == str(dtype).removeprefix("torch."):
            cands = "  ".join(f"{k} {v:5.1f}{'*' if k == r['pick'] else ' '}" for k, v in r["gbps"].items())
            print(f"      rows {r['rows']:3d}  {r['shape'][0]:6d} x {r['shape'][1]:<6d} {cands}")
    print(f"   weight copies alive (transposed / oneDNN layout): {copies / 1e6:.1f} MB")


# ----------------------------------------------------------------------------------------------------------------
# Training speed: this repository's GPT vs nanoGPT's model.py at the same shape, batch and sequence length


def nanogpt_model(path: str, cfg: GPTConfig, seq_len: int):
    """nanoGPT's GPT (from the model.py of a nanoGPT checkout at `path`; nothing of it is copied here) at the shape of
    cfg: same layers, width, heads, vocabulary and context; its own MLP (4d GELU) and LayerNorm."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nanogpt_model", f"{path}/model.py")  # not our `model` module
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    conf = mod.GPTConfig(block_size=seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd, dropout=0.0, bias=False)
    return mod.GPT(conf)


# --profile of `train`: where one training step's time goes, by operator group. Forward operators are grouped by the
# module they run in (hooks open a profiler range per norm, attention and MLP module); a backward operator belongs to
# the module of the forward operator that made its autograd node (the profiler gives both the same sequence number).
TRAIN_GROUPS = (  # (group, test on (operator name, names of its enclosing ranges, module scope)), first match wins
    ("matmul (every linear, fwd + bwd)", lambda op, up, scope: op in ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention kernel (SDPA fwd + bwd)", lambda op, up, scope: any("scaled_dot_product" in n for n in (op, *up))),
    ("loss over the vocabulary", lambda op, up, scope: any("log_softmax" in n or "nll_loss" in n for n in (op, *up))),
    ("AdamW step", lambda op, up, scope: any(n.startswith("Optimizer.step") for n in up)),
    ("zero_grad", lambda op, up, scope: any(n.startswith("Optimizer.zero_grad") for n in up)),
    ("dtype casts", lambda op, up, scope: any(n in ("aten::_to_copy", "aten::to") for n in (op, *up))),
    ("norms", lambda op, up, scope: scope == "norm"),
    ("attention: RoPE, head reshapes", lambda op, up, scope: scope == "attention"),
    ("MLP activation and product", lambda op, up, scope: scope == "mlp"),
    ("embedding", lambda op, up, scope: any("embedding" in n for n in (op, *up))),
    ("other (residual adds, grad accumulation)", lambda op, up, scope: True),
)


def module_scope(module) -> str | None:
    """The profile scope of a module of either model: norm, attention or mlp (by class name), else None."""
    name = type(module).__name__
    return "norm" if "Norm" in name else "attention" if "Attention" in name else "mlp" if name == "MLP" else None


def profile_train_step(model, step, n_steps: int = 2) -> dict[str, float]:
    """Run step() n_steps times under torch.profiler -> {operator group (TRAIN_GROUPS): ms per step}, plus "total"."""
    from torch.profiler import ProfilerActivity, profile, record_function

    open_ranges, hooks = [], []
    for m in model.modules():
        scope = module_scope(m)
        if scope is not None:
            hooks.append(m.register_forward_pre_hook(
                lambda mod, a, scope=scope: open_ranges.append(record_function(f"scope:{scope}").__enter__())))
            hooks.append(m.register_forward_hook(lambda mod, a, out: open_ranges.pop().__exit__(None, None, None)))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                step()
    finally:
        for h in hooks:
            h.remove()
    events = prof.events()
    scope_of_seq = {}  # forward sequence number -> scope of the forward operator that made the autograd node
    for e in events:
        up = ancestors(e)
        scope = next((n.removeprefix("scope:") for n in up if n.startswith("scope:")), None)
        if scope is not None and e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            scope_of_seq.setdefault(e.sequence_nr, scope)
    out = dict.fromkeys([g for g, _ in TRAIN_GROUPS], 0.0)
    for e in events:
        up = ancestors(e)
        scope = next((n.removeprefix("scope:") for n in up if n.startswith("scope:")), None)
        if scope is None:  # backward: the scope of the forward operator of the nearest autograd node above
            node = next((a for a in [e, *ancestor_events(e)] if a.name.startswith("autograd::engine::")), None)
            scope = scope_of_seq.get(node.sequence_nr) if node is not None else None
        group = next(g for g, test in TRAIN_GROUPS if test(e.name, up, scope))
        out[group] += e.self_cpu_time_total / 1e3 / n_steps
    out["total"] = sum(out.values())
    return out


def ancestor_events(e) -> list:
    out, p = [], e.cpu_parent
    while p is not None:
        out.append(p)
        p = p.cpu_parent
    return out


def ancestors(e) -> list[str]:
    return [a.name for a in ancestor_events(e)]


def bench_train(args):
    if args.nanogpt and not (Path(args.nanogpt) / "model.py").is_file():
        raise UsageError(f"--nanogpt {args.nanogpt} is not a nanoGPT checkout (a directory with its model.py)")
    device = pick_device(args.device)
    cfg = GPTConfig.from_preset(args.preset, max_seq_len=args.seq_len)
    B, T = args.train_batch, args.seq_len
    dtype = pick_dtype(device, args.dtype)
    n, m = 2 if args.nanogpt else 1, model_memory(cfg, 4)  # fp32 weights, gradients, AdamW's two moments per model
    check_memory(memory_sum({"weights, gradients and AdamW moments": 4 * n * m["weights"]},
                            {"RoPE tables": n * m["RoPE tables"], "batch": 2 * B * T * 8},
                            least_step_memory(B, T, cfg.vocab_size, dtype)), device,
                 f"bench.py train --train-batch {B} x --seq-len {T}", "lower --train-batch or --seq-len",
                 per="per training step", at_least=True)
    torch.manual_seed(0)
    models = {"ours": GPT(cfg).to(device)}
    if args.nanogpt:
        models["nanoGPT"] = nanogpt_model(args.nanogpt, cfg, T).to(device)
    x = torch.randint(0, cfg.vocab_size - 1, (B, T), device=device)
    y = torch.randint(0, cfg.vocab_size - 1, (B, T), device=device)  # bf16: autocast, fp32 weights and optimizer
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    steps = {}
    for name, m in models.items():  # ours: train.py's AdamW (fused on CPU and CUDA); nanoGPT: its own choice, fused
        # on CUDA only (its configure_optimizers), torch's per-tensor loop on CPU
        if name == "ours" and args.fused_adamw:
            opt = make_optimizer(m, 1e-4, 0.1, device)
        else:
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda")
        fwd = torch.compile(m) if args.compile else m  # both models alike

        def step(fwd=fwd, opt=opt):
            with autocast:
                _, loss = fwd(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
        steps[name] = step
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    header("training step", device, dtype, f"compile {args.compile} | preset {args.preset} shape (layers {cfg.n_layer}, d "
           f"{cfg.n_embd}, heads {cfg.n_head}) batch {B} x {T} | params " + ", ".join(
               f"{k} {v / 1e6:.2f}M" for k, v in n_params.items()))
    res = rounds(steps, args.repeats, device, warmup=2)
    if args.profile:  # after the timed rounds: one profiled pair of steps per model, ms per step by operator group
        prof = {name: profile_train_step(models[name], fn) for name, fn in steps.items()}
        print("   profile, ms per step (self time of the operators, 2 steps each): " + ", ".join(prof))
        for group in prof["ours"]:
            print(f"      {group:42s} " + "  ".join(f"{p[group]:8.1f}" for p in prof.values()))
    for name, ts in res.items():
        print(f"   {name:8s} {spread([B * T / t for t in ts], fmt='.0f')} tok/s")
    if "nanoGPT" in res:
        ratio = [b / a for a, b in zip(res["ours"], res["nanoGPT"])]
        print(f"   ours / nanoGPT = {spread(ratio, fmt='.2f')}x tokens/s (per-round ratios)")


# ----------------------------------------------------------------------------------------------------------------
# One knowledge-distillation step of a real model: a recursive student converted from SmolLM2-135M, the original as
# teacher; this repository's models against the same step written with transformers' LlamaForCausalLM

# SmolLM2-135M's shape (hf.gguf_config of its GGUF file gives the same), for a run without the file
SMOLLM2_135M = dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536, vocab_size=49152,
                    max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True)


def hf_twin(gpt: GPT, loops: int = 1):
    """transformers' LlamaForCausalLM computing what `gpt` computes, with its weights copied (hf.hf_tensor_plan's
    names, read backwards): a vanilla GPT, or (loops > 1) a RecursiveGPT's K shared layers run `loops` times, the
    same layer modules listed once per loop. Its attention runs SDPA, as ours does."""
    from transformers import LlamaForCausalLM

    from hf import hf_tensor_plan

    cfg = GPTConfig(**{f.name: getattr(gpt.config, f.name) for f in fields(GPTConfig)} | {"n_layer": len(gpt.blocks)})
    ours = gpt.state_dict()
    sd = {theirs: ours[name] for theirs, (_, fn) in hf_tensor_plan("llama", cfg).items() for name in fn(None)}
    hf = hf_llama(cfg, torch.float32, attn_implementation="sdpa")
    hf.load_state_dict(sd, strict=False)  # a tied head is the embedding
    if loops > 1:
        hf.model.layers = torch.nn.ModuleList(list(hf.model.layers) * loops)
        hf.config.num_hidden_layers = len(hf.model.layers)
    return hf.to(gpt.lm_head.weight.device).train()


def kd_models(teacher: GPT, loops: int, device):
    """The teacher (a vanilla GPT) and its recursive conversion (Stepwise, B = loops) as the student, ours and their
    transformers twins (hf_twin: the same weights) -> {"ours": (teacher, student), "transformers": (...)}."""
    import recursive

    student = recursive.from_vanilla(teacher, n_loops=loops, init="stepwise", log=lambda *a: None)
    teacher, student = teacher.to(device).eval().requires_grad_(False), student.to(device).train()
    return {"ours": (teacher, student),
            "transformers": (hf_twin(teacher).eval().requires_grad_(False), hf_twin(student, loops))}


def kd_step(teacher, student, logits_of, x, y, autocast, device):
    """One step of train.py's uptraining with --teacher and --kd fkl: the teacher's logits without gradients, the
    student's, loss = cross-entropy + KD(fkl) (model.lm_loss, model.distill_loss), backward, AdamW
    (model.make_optimizer), zero_grad -> step() returning the loss. logits_of(model) -> logits (B, T, V) of x."""
    from model import distill_loss, lm_loss
    opt = make_optimizer(student, 3e-4, 0.1, device)
    mask = (y != -100).float()

    def step():
        with autocast:
            with torch.no_grad():
                t_logits = logits_of(teacher)
            logits = logits_of(student)
            loss = lm_loss(logits, y) + distill_loss(logits, t_logits, "fkl", mask=mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


LOGITS_OF = {"ours": lambda x: lambda m: m(x)[0],  # GPT.forward -> (logits, loss)
             "transformers": lambda x: lambda m: m(input_ids=x, use_cache=False).logits}


def bench_kd(args):
    """Tokens per second of one uptraining step as train.py runs it with --teacher and --kd fkl: the teacher's logits
    without gradients, the student's forward, loss = cross-entropy + KD(fkl), backward, AdamW (model.make_optimizer),
    zero_grad; the same step with transformers' LlamaForCausalLM for teacher and student (their logits, the same loss
    functions, the same optimizer). Interleaved rounds; the ratio per round."""
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    if args.weights == "random":
        cfg = GPTConfig(**SMOLLM2_135M)
    else:
        from hf import gguf_config, gguf_file, read_gguf
        with user_input():
            cfg = gguf_config(read_gguf(gguf_file(args.weights) or Path(args.weights)))
    B, T, V = args.train_batch, args.seq_len, cfg.vocab_size
    student = GPTConfig(**{**asdict(cfg), "n_layer": max(1, cfg.n_layer // args.loops)})  # its shared layers
    t, s = model_memory(cfg, 4), model_memory(student, 4)
    check_memory(memory_sum({"teachers (ours and transformers')": 2 * t["total"], "students": 2 * s["total"],
                             "students' gradients and AdamW moments": 2 * 3 * s["weights"], "batch": 2 * B * T * 8,
                             "teacher logits and the divergence's float32 softmaxes": 3 * B * T * V * 4},
                            least_step_memory(B, T, V, dtype)), device,
                 f"bench.py kd --train-batch {B} x --seq-len {T}", "lower --train-batch or --seq-len",
                 per="per training step", at_least=True)
    if args.weights == "random":
        torch.manual_seed(0)
        teacher = GPT(GPTConfig(**SMOLLM2_135M))
    else:
        from hf import from_gguf
        with user_input():
            teacher = from_gguf(args.weights)
    models = kd_models(teacher, args.loops, device)
    c = teacher.config
    B, T = args.train_batch, args.seq_len
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, c.vocab_size, (B, T), generator=gen).to(device)
    y = torch.randint(0, c.vocab_size, (B, T), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    steps = {name: kd_step(*pair, LOGITS_OF[name](x), x, y, autocast, device) for name, pair in models.items()}
    first = {name: step().item() for name, step in steps.items()}  # the warm-up: the same step on the same weights
    student = models["ours"][1]
    s = student.config
    header("KD training step, SmolLM2-135M", device, dtype,
           f"weights {args.weights} | teacher {c.n_layer} layers, d {c.n_embd}, heads {c.n_head}/{c.n_kv_head}, MLP "
           f"{c.mlp_hidden}, vocab {c.vocab_size} ({teacher.num_params(False) / 1e6:.1f}M params) | student recursive "
           f"B={s.n_loops}, {s.n_shared} shared layers, Stepwise ({student.num_params(False) / 1e6:.1f}M)"
           f" | batch {B} x {T} | loss CE + KD fkl | AdamW (model.make_optimizer) | median (min..max) of "
           f"{args.repeats} interleaved rounds after 1 warm-up")
    res = rounds(steps, args.repeats, device, warmup=0)
    print(f"   loss of the first (warm-up) step: ours {first['ours']:.5f}, transformers {first['transformers']:.5f} "
          f"(the same step on the same weights)")
    for name, ts in res.items():
        print(f"   {name:13s} {spread([B * T / t for t in ts], fmt='.0f')} tok/s  ({spread(ts, fmt='.2f')} s/step)")
    print(f"   ours / transformers = {ratio(res['transformers'], res['ours'])}x tokens/s (per-round ratios)")


# ----------------------------------------------------------------------------------------------------------------
# The architectures against vanilla: per-token decode latency and time to first token, each model's own generate()


@torch.no_grad()
def generation_times(models: dict, idx, new_tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """models: name -> model. Each round times, for every model in turn, generate(idx, 1) (the prefill and the first
    token: TTFT) and generate(idx, new_tokens) -> name -> {"ttft": [s], "token": [s per decode step]}, one entry per
    round. The decode time of a round is the difference of its two runs."""
    systems = {}
    for name, m in models.items():
        systems[name + "/1"] = lambda m=m: m.generate(idx, 1)
        systems[name + "/n"] = lambda m=m: m.generate(idx, new_tokens)
    res = rounds(systems, repeats, idx.device)
    return {name: {"ttft": res[name + "/1"],
                   "token": [(tn - t1) / (new_tokens - 1) for t1, tn in zip(res[name + "/1"], res[name + "/n"])]}
            for name in models}


def ratio(a, b, fmt=".2f") -> str:
    """Per-round ratios of two lists of times, as 'median (min..max)'."""
    return spread([x / y for x, y in zip(a, b)], fmt=fmt)


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_plt(args):
    """Table 3 of the PLT paper on this machine: per-token decode latency of PLT-2 against the vanilla model of the
    same parameters (the N-layer stack run once) and against the sequential loop-2 baseline, at several batches."""
    import plt

    device = pick_device(args.device)
    n = args.prompt_len + args.new_tokens
    base = dict(plt.PRESETS[args.preset], max_seq_len=n + 8)
    variants = args.variants.split(",")
    top = max(int(b) for b in args.batch.split(","))
    with torch.device("meta"):  # the models' sizes and caches, nothing allocated
        shapes = [plt.PLT(plt.PLTConfig(**{**base, **plt.variant_fields(v)})) for v in variants]
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        check_bench_memory(device, f"bench.py plt in {dtype} at --batch {top}, {n} positions",
                           {"weights": sum(module_bytes(m) for m in shapes) * dtype.itemsize // 4,
                            "KV caches of generate": max(m.kv_cache_bytes(top, n, dtype.itemsize) for m in shapes)},
                           forward_memory(shapes[0].config, top, args.prompt_len, dtype.itemsize, logits_rows=top),
                           fix="lower --batch, --prompt-len or --new-tokens")
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        models = {v: plt.PLT(plt.PLTConfig(**{**base, **plt.variant_fields(v)})).to(device, dtype).eval()
                  for v in variants}
        p = next(iter(models.values()))
        L = base["n_loops"]
        header("PLT decode latency", device, dtype, f"preset {args.preset}: {base['n_layer']} layers x L={L}, d "
               f"{base['n_embd']}, {param_bytes(p) / 1e6:.0f} MB of weights, window {base['window']} | prompt "
               f"{args.prompt_len}, {args.new_tokens} new tokens | median (min..max) of {args.repeats} rounds")
        kv = {v: m.kv_cache_bytes(1, n, torch.finfo(dtype).bits // 8) for v, m in models.items()}
        print("   KV bytes per sequence at the end (Table 1): " + ", ".join(
            f"{v} {b / 1024:.1f} KiB" + (f" ({b / kv['vanilla'] - 1:+.1%} vs vanilla)" if "vanilla" in kv else "")
            for v, b in kv.items()))
        for B in [int(b) for b in args.batch.split(",")]:
            idx = torch.randint(0, base["vocab_size"] - 1, (B, args.prompt_len), device=device)
            t = generation_times(models, idx, args.new_tokens, args.repeats)
            print(f"   batch {B:3d}: ms/token " + ", ".join(f"{v} {spread(t[v]['token'], 1e3, '.2f')}" for v in t))
            if "plt" in t and "vanilla" in t:
                print(f"              PLT-{L} / vanilla {ratio(t['plt']['token'], t['vanilla']['token'])} (paper: "
                      "1.02 at batch 4, 1.04-1.06 at 32-64)")
            if "plt" in t and "loop" in t:
                print(f"              PLT-{L} / loop-{L} {ratio(t['plt']['token'], t['loop']['token'])} (paper: "
                      "0.63 at batch 4, 0.53 at 32-64)")


def linear_shapes(model) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of every linear layer of one block of `model` (q, k, v, o, gate, up, down, or their fused forms) and
    of its head."""
    layer = [tuple(m.weight.shape) for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    return layer, tuple(model.lm_head.weight.shape)


def fastest_ms(dtype, rows: int, shape, repeats: int) -> float:
    """ms of the fastest of cpu_tuning's products (F.linear, mv, mm, x @ W^T, oneDNN) for x (rows, in) @ W^T, W
    (out, in) = shape, weights streamed from memory (cpu_tuning.time_linear_products)."""
    names = cpu_tuning.linear_candidates(dtype, rows)
    return min(cpu_tuning.time_linear_products(dtype, rows, *shape, names, repeats).values()) * 1e3


def matmul_ratios(layer_ms: dict[int, float], head_ms: dict[int, float], n_layer: int, loops: int, batch: int):
    """The matmuls alone of one decode step at `batch` sequences -> (PLT-L / vanilla, loop-L / vanilla). Vanilla runs
    n_layer layers at B rows; PLT-L the same layers once at L*B rows (its loops side by side); loop-L the layers L
    times at B rows. Each runs the head once at B rows."""
    B = batch
    vanilla = n_layer * layer_ms[B] + head_ms[B]
    return ((n_layer * layer_ms[loops * B] + head_ms[B]) / vanilla,
            (loops * n_layer * layer_ms[B] + head_ms[B]) / vanilla)


@torch.no_grad()
def bench_roofline(args):
    """This CPU's roofline and where PLT's decode sits on it: streaming read bandwidth, the speed of a large matmul
    (the compute roof), the ridge between them in rows, the weight products of one layer and of the head at 1..32
    rows, and the PLT-L / vanilla ratio the matmuls alone would give at each batch (what the PLT paper's Table 3
    latency rests on: L loops side by side read each weight once for L times the rows)."""
    import plt

    device = pick_device("cpu")
    with torch.device("meta"):
        m = plt.PLT(plt.PLTConfig(**plt.PRESETS[args.preset]))
    layer, head = linear_shapes(m)
    N, L = m.config.n_layer, m.config.n_loops
    batches = sorted({int(b) for b in args.batch.split(",")})
    rows = sorted({int(r) for r in args.rows.split(",")} | set(batches) | {L * b for b in batches})
    widest = max(o + i for o, i in [*layer, head])
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        check_bench_memory(device, f"bench.py roofline in {dtype} at {rows[-1]:,} rows",
                           {"bandwidth probe": BANDWIDTH_PROBE, "weight copies of a timing": 3 * LINEAR_PROBE_BYTES,
                            "inputs and outputs of the widest product": rows[-1] * widest * dtype.itemsize},
                           fix="lower --rows or --batch")
    bw = read_bandwidth(device, repeats=args.repeats)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        big = (torch.randn(2048, 768, dtype=dtype), torch.randn(3072, 768, dtype=dtype))
        t = timeit(lambda: F.linear(*big), device, warmup=2, repeats=args.repeats)
        big_flops = 2 * 2048 * 768 * 3072
        peak = big_flops / med(t)
        header("CPU roofline and PLT decode matmuls", device, dtype, f"preset {args.preset}: {N} layers x L={L}, "
               f"layer products {layer}, head {head} | median of {args.repeats} passes per product")
        print(f"   streaming read {bw / 1e9:.1f} GB/s (1 GiB sum); F.linear 2048x768 by 768x3072 {peak / 1e9:.0f} "
              f"GFLOP/s ({spread([big_flops / x / 1e9 for x in t], fmt='.0f')}) -> ridge at "
              f"{peak * dtype.itemsize / (2 * bw):.1f} rows (a weight read once for M rows: 2M FLOP per "
              f"{dtype.itemsize} bytes)")
        layer_ms = {r: sum(fastest_ms(dtype, r, s, args.repeats) for s in layer) for r in rows}
        head_ms = {r: fastest_ms(dtype, r, head, args.repeats) for r in rows}
        lbytes = sum(o * i for o, i in layer) * dtype.itemsize
        print("   rows   layer ms  (GB/s of weights, GFLOP/s)   head ms  (GB/s, GFLOP/s)")
        for r in rows:
            print(f"   {r:4d}  {layer_ms[r]:8.3f}  ({lbytes / layer_ms[r] / 1e6:6.1f}, {2 * r * lbytes / dtype.itemsize / layer_ms[r] / 1e6:6.1f})"
                  f"  {head_ms[r]:8.3f}  ({head[0] * head[1] * dtype.itemsize / head_ms[r] / 1e6:6.1f}, "
                  f"{2 * r * head[0] * head[1] / head_ms[r] / 1e6:6.1f})")
        for B in batches:
            p, lp = matmul_ratios(layer_ms, head_ms, N, L, B)
            print(f"   batch {B:3d}: matmuls alone PLT-{L} / vanilla {p:.2f}, loop-{L} / vanilla {lp:.2f} (paper, "
                  f"whole step: PLT-2 / vanilla 1.02 at batch 4)")


def prefix_prefills(gpt, dm, idx, prefix: int) -> dict:
    """TTFT after a cached shared prefix (section 3.3 item 3), the systems for `rounds`: idx[:, :prefix] is computed
    once, outside the timers (decoder-only: its K/V; double: the context decoder's K/V and the cross K/V); each timed
    call copies that prefix into a pre-allocated cache and runs the rest of the prompt against it, up to the first
    token's logits."""
    B, T = idx.shape
    rows = torch.arange(B, device=idx.device)
    g_prefix, g_work = gpt.new_cache(B, prefix), gpt.new_cache(B, T)
    gpt.prefill(idx[:, :prefix], g_prefix)
    d_prefix, d_work = dm.new_cache(B, prefix, 1, keep_context=True), dm.new_cache(B, T - 1, 1, keep_context=True)
    dm.extend_context(idx[:, :prefix], d_prefix)

    def decoder_only():
        g_work.copy_rows(g_prefix, rows, rows)
        gpt.head(gpt.forward_cached(idx[:, prefix:], g_work)[:, -1:])
        sync(idx.device)

    def double():
        d_work.copy_from(d_prefix)
        dm.prefill(idx[:, prefix:], d_work)
        sync(idx.device)

    return {"decoder-only": decoder_only, "double": double}


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_double(args):
    """The double decoder's serving claims (section 3.3, Appendix A.1) against the decoder-only model of the same
    parameters (ctx + gen layers): time to first token, TTFT after a cached shared prefix, per-token latency (each
    model's own generate(); the double decoder's with --rollover N folds its block into the context every N tokens)
    and KV bytes."""
    import double_decoder as dd

    device = pick_device(args.device)
    P, N, R = args.prompt_len, args.new_tokens, args.rollover
    prefix = args.shared_prefix if args.shared_prefix is not None else P // 2
    if not 1 <= prefix < P:
        raise UsageError(f"--shared-prefix must be in [1, {P - 1}] (below --prompt-len), got {prefix}" if P > 1 else
                         "--prompt-len 1: the cached-prefix timing needs a prompt of at least 2 tokens")
    over = {"max_seq_len": P + N + 8, **({"vocab_size": args.vocab_size} if args.vocab_size else {})}
    for name in ("ctx_layers", "gen_layers"):
        if getattr(args, name) is not None:
            over.update({name: getattr(args, name), "n_layer": None})
    with user_input():  # layer counts the flags make impossible: one line
        cfg = dd.DoubleConfig(**{**dd.PRESETS[args.preset], **over})
    L = cfg.n_layer
    top = max(int(b) for b in args.batch.split(","))
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:  # from the configs: nothing built yet
        e = dtype.itemsize
        check_bench_memory(device, f"bench.py double in {dtype} at --batch {top}, {P + N} positions",
                           model_memory(cfg, e), model_memory(dd.baseline_config(cfg), e),
                           {"KV caches of generate and of the cached prefix": 2 * (kv_of(cfg, top, P + N, e)
                                                                                   + 2 * kv_of(cfg, top, P, e))},
                           forward_memory(cfg, top, P, e, logits_rows=top),
                           fix="lower --batch, --prompt-len, --new-tokens, --vocab-size or the layers")
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        models = {"decoder-only": GPT(dd.baseline_config(cfg)).to(device, dtype).eval(),
                  "double": dd.DoubleDecoder(cfg).to(device, dtype).eval()}
        gm, dm = models["decoder-only"], models["double"]
        header("double decoder latency", device, dtype, f"preset {args.preset}: {cfg.ctx_layers} + "
               f"{cfg.gen_layers} layers vs {L}, d {cfg.n_embd}, vocab {cfg.vocab_size}, {param_bytes(dm) / 1e6:.0f} "
               f"MB of weights (head {param_bytes(dm.lm_head) / 1e6:.0f} MB) | prompt "
               f"{P}, {N} new tokens, shared prefix {prefix}, rollover {R} | random weights | median (min..max) of "
               f"{args.repeats} rounds")
        floor = param_bytes(dm.gen_blocks, dm.norm, dm.lm_head) / param_bytes(gm)
        print(f"   paper (section 3.3, Appendix A.1), at a 2/3 : 1/3 split: per-token cost and KV memory ~L_dec/L = "
              f"{cfg.gen_layers / L:.3f} of the decoder-only model's (the weight bytes a step reads give "
              f"{floor:.2f}), time to first token ~L_ctx/L = {cfg.ctx_layers / L:.3f}")
        dbytes = torch.finfo(dtype).bits // 8
        for B in [int(b) for b in args.batch.split(",")]:
            idx = torch.randint(0, cfg.vocab_size - 1, (B, P), device=device)
            timed = {"decoder-only": gm, "double": SimpleNamespace(generate=partial(dm.generate, rollover=R))}
            t = generation_times(timed, idx, N, args.repeats)
            pre = rounds(prefix_prefills(gm, dm, idx, prefix), args.repeats, device)
            kv = {name: m.kv_cache_bytes(B, P + N, dbytes) for name, m in models.items()}  # Appendix A.1
            dc = dm.generation_cache(B, P, N, rollover=R)  # what generate() allocates
            alloc = {"decoder-only": gm.generation_cache(B, P, N).nbytes(), "double": dc.nbytes() + dc.context_nbytes()}
            print(f"   batch {B:3d}:")
            for name in models:
                print(f"      {name:12s} TTFT {spread(t[name]['ttft'], 1e3, '.2f')} ms | after the cached prefix "
                      f"{spread(pre[name], 1e3, '.2f')} ms | per-token {spread(t[name]['token'], 1e3, '.3f')} ms | "
                      f"KV (A.1) {kv[name] / 2 ** 20:.2f} MiB | allocated caches {alloc[name] / 2 ** 20:.2f} MiB")
            d, v = t["double"], t["decoder-only"]
            print(f"      double / decoder-only: TTFT {ratio(d['ttft'], v['ttft'])} | TTFT after the prefix "
                  f"{ratio(pre['double'], pre['decoder-only'])} | per-token {ratio(d['token'], v['token'])} | "
                  f"KV bytes {kv['double'] / kv['decoder-only']:.3f}")


# ----------------------------------------------------------------------------------------------------------------
# All six architectures side by side at matched non-embedding parameters


def arch_models(preset: str, loops=2, rank=8, max_seq_len=None) -> dict:
    """One model.py preset -> {name: model} at matched non-embedding parameters (random weights): vanilla N layers;
    recursive K = N shared layers looped `loops` times (loops*N effective); relaxed the same + LoRA rank `rank` (a few %
    more); block: N/2 block-decoder + N/2 token-decoder layers (L_B = 4, P = 2); plt: the N-layer stack looped twice
    (CLP + KV sharing + G-SWA); double: round(2N/3) context + the rest generation layers."""
    import block_transformer as bt
    import double_decoder as dd
    import plt
    from recursive import RecursiveConfig, RecursiveGPT

    base = dict(PRESETS[preset], **({"max_seq_len": max_seq_len} if max_seq_len else {}))
    N = base["n_layer"]
    out = {"vanilla": GPT(GPTConfig(**base))}
    out["recursive"] = RecursiveGPT(RecursiveConfig(**{**base, "n_layer": loops * N}, n_loops=loops))
    ranks = {f"lora_rank_{c}": rank for c in ("q", "kv", "o", "mlp")}
    out["relaxed"] = RecursiveGPT(RecursiveConfig(**{**base, "n_layer": loops * N}, n_loops=loops, **ranks))
    shape = bt.halves(**{k: base[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden")},
                        max_seq_len=base["max_seq_len"] - base["max_seq_len"] % 4, vocab_size=base["vocab_size"])
    out["block"] = bt.BlockTransformer(bt.BlockConfig(**shape))
    out["plt"] = plt.PLT(plt.PLTConfig(**base, n_loops=2, window=min(64, base["max_seq_len"])))
    ctx = min(max(round(2 * N / 3), 1), N - 1) if N > 1 else 1
    out["double"] = dd.DoubleDecoder(dd.DoubleConfig(**{k: v for k, v in base.items() if k != "n_layer"},
                                                     ctx_layers=ctx, gen_layers=max(N - ctx, 1)))
    return out


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_archs(args):
    """Every architecture's own generate() at matched non-embedding parameters: time to first token, per-token decode
    latency and KV bytes per sequence, in a prefill-heavy and a decode-heavy setting."""
    device = pick_device(args.device)
    for dtype in [pick_dtype(device, d) for d in args.dtype.split(",")]:
        torch.manual_seed(0)
        with user_input():  # a --rank above full rank: one line
            models = {k: m.to(device, dtype).eval() for k, m in arch_models(args.preset, rank=args.rank).items()}
        settings_ = [tuple(int(v) for v in s.split("/")) for s in args.settings.split(",")]
        top = max(int(b) for b in args.batch.split(","))
        for P, G in settings_:  # one model generates at a time
            check_context(P + G, min(m.config.max_seq_len for m in models.values()), f"--settings {P}/{G}")
            check_bench_memory(device, f"bench.py archs in {dtype} at --batch {top}, prompt {P} / new {G}",
                               max((memory_sum({"KV caches of generate": m.kv_cache_bytes(top, P + G, dtype.itemsize)},
                                               forward_memory(m.config, top, P, dtype.itemsize, logits_rows=top))
                                    for m in models.values()), key=lambda est: est["total"]),
                               fix="lower --batch or --settings")
        header("architectures side by side", device, dtype, f"preset {args.preset}, random weights | non-embedding "
               "params " + ", ".join(f"{k} {m.num_params() / 1e6:.2f}M" for k, m in models.items())
               + f" | median (min..max) of {args.repeats} interleaved rounds")
        for setting in args.settings.split(","):
            P, G = (int(v) for v in setting.split("/"))
            for B in [int(b) for b in args.batch.split(",")]:
                idx = torch.randint(0, PRESETS[args.preset]["vocab_size"] - 1, (B, P), device=device)
                t = generation_times(models, idx, G, args.repeats)
                print(f"   prompt {P} / new {G}, batch {B}:  (TTFT ms | ms per token | KV KiB per sequence)")
                for name, m in models.items():
                    kv = m.kv_cache_bytes(1, P + G, torch.finfo(dtype).bits // 8) / 1024
                    print(f"      {name:10s} {spread(t[name]['ttft'], 1e3, '.2f'):>22s} | "
                          f"{spread(t[name]['token'], 1e3, '.3f'):>24s} | {kv:8.1f}")


# ----------------------------------------------------------------------------------------------------------------
# Block Transformer vs vanilla: throughput at the largest batch a memory budget allows (Block Transformer, section
# 3.2)

# The paper's two settings (prompt tokens, generated tokens) and its figures for the pair at equal non-embedding
# parameters (Table 2, H100, maximum batch; 1K tokens/s): {preset: {setting: (vanilla, block)}}.
BLOCK_SETTINGS = {"decode-heavy": (128, 2048), "prefill-heavy": (2048, 128)}
PAPER_BLOCK = {"t3-5m": {"decode-heavy": (41.6, 809.5), "prefill-heavy": (10.8, 272.3)},
               "t3-19m": {"decode-heavy": (19.1, 421.4), "prefill-heavy": (6.9, 175.3)},
               "t3-85m": {"decode-heavy": (6.2, 134.7), "prefill-heavy": (2.3, 59.0)},
               "t3-302m": {"decode-heavy": (2.1, 44.1), "prefill-heavy": (0.8, 21.0)}}


def block_pair(args, device, dtype, max_len):
    """(Block Transformer of --preset, its vanilla counterpart): the vanilla model with the same non-embedding
    parameters (BlockConfig.vanilla_config, the paper's pairing), or the model.py preset --vanilla. Random weights."""
    import block_transformer as bt

    cfg = bt.BlockConfig.from_preset(args.preset)
    max_len = -(-max_len // cfg.block_len) * cfg.block_len
    cfg = bt.BlockConfig.from_preset(args.preset, max_seq_len=max(max_len, cfg.max_seq_len))
    vcfg = cfg.vanilla_config() if args.vanilla is None else GPTConfig.from_preset(args.vanilla)
    vcfg.max_seq_len = max(max_len, vcfg.max_seq_len)
    torch.manual_seed(0)
    return (bt.BlockTransformer(cfg).to(device=device, dtype=dtype).eval(),
            GPT(vcfg).to(device=device, dtype=dtype).eval())


def generation_bytes(model, prompt, new) -> int:
    """Bytes of the caches generate() allocates for ONE sequence (KV caches; linear in the batch)."""
    return model.generation_cache(1, prompt, new).nbytes()


def search_batch(model, P, G, top, n_tokens, device) -> tuple[int, dict]:
    """The batch search: at batch 1, 2, 4, ... and `top` (the largest batch the memory budget allows), the decode
    throughput at the setting's mean context: a prefill of P + G // 2 random tokens and one decode step (untimed), then
    n_tokens timed decode steps (greedy) -> (the batch with the most decode tokens/s, {batch: tokens/s}). It only
    selects the batch (a short run at the start of a long generation would hide what a long context costs); the
    reported throughput is then timed on the full setting."""
    from model import sample_next

    n = min(n_tokens, G - 2)
    ctx = min(P + G // 2, P + G - 2 - n)
    found = {}
    for B in sorted({2 ** i for i in range(top.bit_length())} | {top}):
        cache = model.generation_cache(B, ctx, n + 2)
        tok = sample_next(model.prefill(torch.randint(0, model.config.vocab_size - 1, (B, ctx), device=device), cache))
        tok = sample_next(model.decode_step(tok, cache))
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = sample_next(model.decode_step(tok, cache))
        sync(device)
        found[B] = B * n / (time.perf_counter() - t0)
    return max(found, key=found.get), found


# operator groups of a decode profile: (name, operators, inclusive time?) -- attention counts with its children (its
# math fallback copies K/V and runs bmm), the others by their own time
PROFILE_GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::mv", "aten::addmv_"), False),
                  ("attention", ("aten::scaled_dot_product_attention",), True),
                  ("argmax (sampling)", ("aten::argmax",), False))


def profile_generate(model, idx, n_tokens) -> str:
    """One generate(idx, n_tokens) under torch.profiler -> where its time goes: matmuls (with their achieved
    GFLOP/s), attention, the argmax of greedy sampling and everything else, per token step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        model.generate(idx, n_tokens)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    group = {g: [e for e in events if e.key in names] for g, names, _ in PROFILE_GROUPS}
    times = {g: sum(e.cpu_time_total if incl else e.self_cpu_time_total for e in group[g])
             for g, _, incl in PROFILE_GROUPS}
    gflops = sum(e.flops for e in group["matmul"]) / max(times["matmul"], 1) / 1e3  # flops per us -> GFLOP/s
    parts = [f"{g} {t / total:.0%}" + (f" ({gflops:.0f} GFLOP/s)" if g == "matmul" else "") for g, t in times.items()]
    return (f"{total / n_tokens / 1e3:.1f} ms of operators per token step: " + ", ".join(parts)
            + f", other {1 - sum(times.values()) / total:.0%}")


@torch.no_grad()
@cpu_tuning.switched_on()
def bench_block(args):
    """Tokens generated per second, prefill included (the paper's throughput), of the Block Transformer and vanilla
    in the paper's decode-heavy and prefill-heavy settings. Per model: the largest batch whose generation caches fit
    --budget-mib (the paper's "maximum batch allowed by memory"), a batch search up to it, then interleaved rounds at
    batch 1 and the best batch; the ratio of the best batches, per round, with the paper's figure beside it."""
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    names = list(BLOCK_SETTINGS) if args.setting == "both" else [args.setting]
    lengths = {n: tuple(max(1, round(x * args.scale)) for x in BLOCK_SETTINGS[n]) for n in names}
    if args.budget_mib is None:
        args.budget_mib = round(2048 * args.scale)
    budget = args.budget_mib * 2 ** 20
    import block_transformer as bt

    longest = max(p + g for p, g in lengths.values())
    cfg = bt.BlockConfig.from_preset(args.preset)
    span = max(-(-longest // cfg.block_len) * cfg.block_len, cfg.max_seq_len)  # what block_pair builds
    vcfg = cfg.vanilla_config() if args.vanilla is None else GPTConfig.from_preset(args.vanilla)
    check_bench_memory(device, f"bench.py block in {dtype} at --scale {args.scale:g} ({longest:,} positions) and "
                               f"--budget-mib {args.budget_mib:,}",
                       model_memory(bt.BlockConfig.from_preset(args.preset, max_seq_len=span), dtype.itemsize),
                       model_memory(GPTConfig(**{**asdict(vcfg), "max_seq_len": max(longest, vcfg.max_seq_len)}),
                                    dtype.itemsize),
                       {"generation caches (--budget-mib, one model at a time)": budget},
                       fix="lower --scale or --budget-mib")
    block, vanilla = block_pair(args, device, dtype, longest)
    models = {"vanilla": vanilla, "block": block}
    b, v = block.config, vanilla.config
    header("Block Transformer vs vanilla: generation throughput", device, dtype,
           f"block {args.preset} ({b.block_n_layer}+{b.n_layer} layers, d {b.n_embd}, L_B {b.block_len}, "
           f"P {b.prefix_len}, {block.num_params(False) / 1e6:.1f}M params, {param_bytes(block) / 1e6:.0f} MB) vs "
           f"vanilla {args.vanilla or 'counterpart'} ({v.n_layer} layers, d {v.n_embd}, "
           f"{vanilla.num_params(False) / 1e6:.1f}M params, {param_bytes(vanilla) / 1e6:.0f} MB) | non-embedding "
           f"{block.num_params() / 1e6:.1f}M vs {vanilla.num_params() / 1e6:.1f}M | random weights and prompts, "
           f"greedy, no EOS | cache budget {args.budget_mib} MiB | median (min..max) of {args.repeats} interleaved "
           f"rounds")
    for name in names:
        P, G = lengths[name]
        per_seq = {k: generation_bytes(m, P, G) for k, m in models.items()}
        top = {k: budget // n for k, n in per_seq.items()}
        print(f"\n-- {name}: prompt {P}, {G} new tokens | generation caches per sequence: vanilla "
              f"{per_seq['vanilla'] / 2 ** 20:.2f} MiB, block {per_seq['block'] / 2 ** 20:.2f} MiB -> largest batch in "
              f"{args.budget_mib} MiB: vanilla {top['vanilla']}, block {top['block']}")
        if min(top.values()) < 1:
            print("   a model does not fit the budget at batch 1: raise --budget-mib")
            continue
        check_bench_memory(device, f"bench.py block, {name}: the prefill of the largest batch in the budget",
                           max((forward_memory(m.config, top[k], P, dtype.itemsize, logits_rows=top[k])
                                for k, m in models.items()), key=lambda est: est["total"]),
                           {"generation caches (--budget-mib)": budget}, fix="lower --budget-mib")
        n_search = min(G - 2, args.search_tokens)  # no search below 3 generated tokens
        systems, batch, best = {}, {}, {}
        for k, m in models.items():
            best[k], found = (search_batch(m, P, G, top[k], n_search, device) if n_search > 0 else (top[k], {}))
            if found:
                print(f"   batch search, {k} (decode tok/s at context {min(P + G // 2, P + G - 2 - n_search)}): "
                      + ", ".join(f"{B}: {t:.0f}" for B, t in found.items()) + f" -> batch {best[k]}")
            for B in sorted({1, best[k], *[x for x in args.batches if x <= top[k]]}):
                idx = torch.randint(0, m.config.vocab_size - 1, (B, P), device=device)
                m.generate(idx, min(G, 2))  # warm-up: allocations, kernels
                systems[f"{k} {B}"], batch[f"{k} {B}"] = (lambda m=m, idx=idx: m.generate(idx, G)), B
        res = rounds(systems, args.repeats, device, warmup=0)
        tput = {s: [batch[s] * G / t for t in ts] for s, ts in res.items()}
        print(f"   {'model':8s} {'batch':>5s} {'caches MiB':>10s} {'ms/token step':>14s} {'tok/s':>26s}")
        for s, ts in res.items():
            k, B = s.split()
            print(f"   {k:8s} {B:>5s} {per_seq[k] * int(B) / 2 ** 20:10.1f} {med(ts) / G * 1e3:14.2f} "
                  f"{spread(tput[s], fmt='.0f'):>26s}")
        ratio = [a / c for a, c in zip(tput[f"block {best['block']}"], tput[f"vanilla {best['vanilla']}"])]
        one = [a / c for a, c in zip(tput["block 1"], tput["vanilla 1"])]
        paper = PAPER_BLOCK.get(args.preset, {}).get(name) if args.vanilla is None else None
        ref = (f"paper (Table 2, {args.preset} pair, H100, max batch): {paper[1] / paper[0]:.1f}x" if paper else
               "paper: 10-20x at equal perplexity (abstract); no Table 2 pair for this preset")
        print(f"   best batch: vanilla {best['vanilla']}, block {best['block']} -> block / vanilla = "
              f"{spread(ratio, fmt='.2f')}x (per round) | {ref} | at batch 1: {spread(one, fmt='.2f')}x")
        if args.profile:
            for k, m in models.items():
                idx = torch.randint(0, m.config.vocab_size - 1, (best[k], P), device=device)
                print(f"   profile, {k} batch {best[k]}, {min(G, 64)} new tokens: "
                      f"{profile_generate(m, idx, min(G, 64))}")


# ----------------------------------------------------------------------------------------------------------------
# Kernels: python bench.py kernels (CUDA; each Triton kernel of kernels.py vs its reference and stock PyTorch)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint integrity: what verifying the CRC-32 of every record costs against the load itself


def bench_ckpt(args):
    """checkpoint.load_checkpoint verifies the CRC-32 of every record before torch.load: time the two apart on a
    train.py-shaped checkpoint (the preset's GPT, its AdamW state after one step), interleaved rounds."""
    import tempfile

    import checkpoint

    if args.dir is not None:  # a file, a missing or a read-only directory: one line before the checkpoint is built
        if not Path(args.dir).is_dir():
            raise UsageError(f"--dir {args.dir} is not a directory")
        check_writable_dir(Path(args.dir), "--dir")
    device = pick_device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset(args.preset)
    w = model_memory(cfg, 4)
    check_bench_memory(device, f"bench.py ckpt --preset {args.preset}", w,
                       {"gradients and AdamW moments": 3 * w["weights"], "a loaded checkpoint": 3 * w["weights"]},
                       fix="take a smaller --preset")
    model = GPT(cfg)
    opt = make_optimizer(model, lr=1e-4, weight_decay=0.1, device=device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's two moments exist after a step
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "ckpt.pt"
        checkpoint.save_checkpoint(path, {"format": checkpoint.CKPT_FORMAT, "model": model.state_dict(),
                                          "optimizer": opt.state_dict(), "config": asdict(cfg), "arch": "vanilla"})
        del model, opt
        if not checkpoint.verify_records(path):
            raise RuntimeError(f"{path} was written without CRC-32s: nothing to time")
        size = path.stat().st_size
        header("checkpoint load: CRC-32 verification vs torch.load", device, "float32",
               f"preset {args.preset}, {size / 2 ** 20:,.0f} MiB with AdamW state | median (min..max) of "
               f"{args.repeats} interleaved rounds after 1 warm-up")
        t = rounds({"torch.load": lambda: torch.load(path, map_location="cpu", weights_only=True),
                    "verify": lambda: checkpoint.verify_records(path)}, args.repeats, device)
    print(f"   torch.load(weights_only=True) {spread(t['torch.load'], fmt='.2f')} s, checkpoint.verify_records "
          f"{spread(t['verify'], fmt='.2f')} s -> a verified load takes "
          f"{(med(t['torch.load']) + med(t['verify'])) / med(t['torch.load']):.2f}x the time of a plain one")


def kernel_us(fn, device, warmup=10, iters=50) -> float:
    """Median time of one fn() call in microseconds, warm-up excluded (the warm-up also covers torch.compile and the
    Triton JIT).

    CUDA: a CUDA event pair around each call, with L2 flushed before each call (in a real forward pass the weights and
    caches of this layer are not in L2), and torch.cuda.synchronize() before the events are read. Other devices:
    model.timeit's wall clock.
    """
    if device.type != "cuda":
        return med(timeit(fn, device, warmup, iters)) * 1e6
    for _ in range(warmup):
        fn()
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for i in range(iters):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2] * 1e3


def _report(impl, us, nbytes=None, flops=None, base_us=None):
    bw = f"{nbytes / us / 1e3:9.1f} GB/s" if nbytes else " " * 14
    fl = f"{flops / us / 1e6:8.1f} TFLOP/s" if flops else " " * 16
    rel = f"   kernel is {us / base_us:5.2f}x faster" if base_us and us != base_us else ""
    print(f"    {impl:44s} {us:11.1f} us  {bw} {fl}{rel}")


def _maxerr(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _flex_lse():
    """(q, k, v, block_mask, scale=None, lse=True) -> (out, lse or None) through kernels.flex_attention_lse, or None
    when this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None

    def attn(q, k, v, block_mask, scale=None, lse=True):
        if lse:
            return K.flex_attention_lse(q, k, v, block_mask, scale)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1)), None
    return attn


def _random_blocks(T, n_blocks, gen, device):
    """Block ids (T,) of a random partition into n_blocks blocks (split points drawn as the double decoder does)."""
    splits = torch.randperm(T - 3, generator=gen)[: n_blocks - 1].sort().values + 2
    return torch.bucketize(torch.arange(T), splits, right=True).to(device)


def bench_aot(args):
    """`bench.py kernels --aot`: every Triton kernel compiled ahead of time for real GPU targets on this machine (no
    GPU needed): per kernel, launch case and target the shared memory against the target's limit, registers and
    spills (kernels_aot.aot_report; ~3 minutes for every case of every preset on 2 cores)."""
    import kernels_aot

    if os.environ.get("TRITON_INTERPRET"):
        raise UsageError("--aot compiles for a GPU: run it without TRITON_INTERPRET in the environment")
    targets = tuple(int(t) for t in args.aot_targets.split(","))
    cases = [c for c in kernels_aot.aot_cases() if not args.only or any(k in c.name for k in args.only.split(","))]
    if not cases:
        raise UsageError(f"--only {args.only}: no launch case name contains it (python bench.py kernels --aot runs "
                         f"them all)")
    print(f"triton {K.triton.__version__} | ahead-of-time compilation for {', '.join(f'sm_{t}' for t in targets)} | "
          f"{len(cases)} launch cases (the presets' shapes, decode and prefill, fp32/bf16/fp16)")
    print(f"{'kernel':28s} {'case':34s} {'target':6s} {'dtype':8s} {'shared':>14s} {'regs':>5s} {'spills':>7s}  error")
    rows = kernels_aot.aot_report(targets, cases)
    for r in rows:
        shared = f"{r['shared']}/{r['shared_limit']}" if r["shared"] is not None else "-"
        print(f"{r['kernel']:28s} {r['case'][:34]:34s} {r['target']:6s} {r['dtype']:8s} {shared:>14s} "
              f"{str(r['regs']):>5s} {str(r['spills']):>7s}  {r['error'] or ''}")
    bad = [r for r in rows if r["error"] or (r["shared"] or 0) > r["shared_limit"]]
    print(f"{len(rows)} compiles, {len(bad)} failed or over the shared-memory limit, "
          f"{sum(1 for r in rows if r['spills'])} with register spills")


KERNELS = ("lora", "gswa", "gswa_decode", "dual")  # bench.py kernels --only


def bench_kernels(args):
    if args.aot:
        return bench_aot(args)
    unknown = [k for k in args.only.split(",") if args.only and k not in KERNELS]
    if unknown:
        raise UsageError(f"--only {args.only}: {', '.join(unknown)} is not one of {', '.join(KERNELS)}")
    dev = pick_device(args.device)
    dtype = pick_dtype(dev, args.dtype)
    cuda = dev.type == "cuda"
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"device {gpu}  dtype {dtype}  torch {torch.__version__}  triton {K.triton.__version__ if K.triton else None}")
    if not cuda:
        print("Triton kernels need CUDA: timing the references and stock alternatives only, at small shapes. "
              "CPU figures say nothing about the GPU targets; do not record them.")
    gen = torch.Generator().manual_seed(0)
    esz = torch.finfo(dtype).bits // 8
    run_triton = cuda and K.triton is not None
    flex = _flex_lse() if cuda else None
    want = set(args.only.split(",")) if args.only else set(KERNELS)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    iters = args.iters if args.iters is not None else (50 if cuda else 3)
    print(f"warm-up {warmup} calls, then the median (CUDA events) / mean (CPU clock) of {iters} timed calls")

    def ktime(fn, heavy=False):  # heavy: the dense references (T x T scores), fewer calls
        return kernel_us(fn, dev, min(warmup, 3) if heavy else warmup, min(iters, 10) if heavy else iters)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=dev, dtype=dtype)

    with torch.no_grad():
        if "lora" in want:
            # decode: batch 64 rows at 4 different loops (adapters), r = 64, d = 2048 (the issue's target shape)
            N, d, r, n = (64, 2048, 64, 4) if cuda else (16, 256, 16, 4)
            x, W = rnd(N, d), rnd(d, d, s=d ** -0.5)
            A, Bm = rnd(n, r, d, s=d ** -0.5), rnd(n, d, r, s=r ** -0.5)
            idx = torch.randint(0, n, (N,), generator=gen).to(dev)

            def loop_over_adapters():
                y = torch.zeros(N, d, device=dev, dtype=dtype)
                for a in range(n):
                    rows = (idx == a).nonzero().squeeze(1)
                    y.index_copy_(0, rows, (x[rows] @ A[a].T) @ Bm[a].T)
                return y

            print(f"\nmulti_lora (BGMV, decode)  rows {N}  in = out = {d}  r {r}  adapters {n}  {dtype}")
            nbytes = esz * (2 * N * d + n * r * 2 * d)
            flops = 2 * N * r * 2 * d
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.multi_lora_triton(x, A, Bm, idx))
                err = _maxerr(K.multi_lora_triton(x, A, Bm, idx), K.multi_lora_ref(x, A, Bm, idx))
                print(f"    max |kernel - reference| = {err:.2e}")
                _report("triton shrink+expand", t_k, nbytes, flops)
            _report("reference: gather + bmm", ktime(lambda: K.multi_lora_ref(x, A, Bm, idx)), nbytes, flops, t_k)
            _report("stacked adapters, masked (the CPU path)", ktime(lambda: K.multi_lora_stacked(x, A, Bm, idx)),
                    nbytes, flops, t_k)
            _report("python loop over adapters", ktime(loop_over_adapters), nbytes, flops, t_k)
            t_base = ktime(lambda: F.linear(x, W))
            _report(f"base GEMM ({N} x {d} x {d}) it rides on", t_base, esz * (d * d + 2 * N * d), 2 * N * d * d)
            if t_k:
                print(f"    LoRA costs {100 * t_k / t_base:.0f}% of the base GEMM")

        Bt, H, Hkv, T, D = (4, 16, 4, 2048, 128) if cuda else (1, 4, 2, 128, 32)
        scale = 1.0 / math.sqrt(D)
        pos_b = torch.arange(T, device=dev)[None].expand(Bt, T).contiguous()

        if "gswa" in want:
            window = 64
            q, k, v, ks, vs = (rnd(Bt, H, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D),
                               rnd(Bt, Hkv, T, D))
            gw, gb = rnd(H, D, s=D ** -0.5), rnd(H)
            pairs = Bt * H * (T * (T + 1) // 2 + int(K.swa_mask(T, window, dev).sum()))
            flops, nbytes = 4 * D * pairs, esz * (2 * Bt * H * T * D + 4 * Bt * Hkv * T * D)
            print(f"\ngated_swa (prefill)  B {Bt}  H {H}/{Hkv}  T {T}  D {D}  window {window}  {dtype}")
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.gated_swa_triton(q, k, v, ks, vs, gw, gb, window))
                err = _maxerr(K.gated_swa_triton(q, k, v, ks, vs, gw, gb, window),
                              K.gated_swa_ref(q, k, v, ks, vs, gw, gb, window))
                print(f"    max |kernel - reference| = {err:.2e}")
                _report("triton (one kernel)", t_k, nbytes, flops)
            _report("reference (dense scores)", ktime(lambda: K.gated_swa_ref(q, k, v, ks, vs, gw, gb, window),
                                                       heavy=True), nbytes, flops, t_k)

            def gate_mix(q, y_loc, y_glob):
                g = K.plt_gate(q, gw, gb)[..., None]
                return (g * y_loc.float() + (1 - g) * y_glob.float()).to(q.dtype)

            if flex is not None:
                from torch.nn.attention.flex_attention import create_block_mask
                wm = create_block_mask(lambda b, h, i, j: (j <= i) & (j > i - window), None, None, T, T, device=dev)

                def stock():  # flex for the window, flash SDPA for the causal shared branch, gate and mix
                    y_loc, _ = flex(q, k, v, wm, lse=False)
                    y_glob = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=True)
                    return gate_mix(q, y_loc, y_glob)
                name = "flex(window) + SDPA(causal) + gate, compiled"
            else:
                wmask = K.swa_mask(T, window, dev)

                def stock():
                    y_loc = F.scaled_dot_product_attention(q, k, v, attn_mask=wmask, enable_gqa=True)
                    y_glob = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=True)
                    return gate_mix(q, y_loc, y_glob)
                name = "SDPA(window mask) + SDPA(causal) + gate"
            f = torch.compile(stock) if cuda else stock
            _report(name, ktime(f), nbytes, flops, t_k)

        if "gswa_decode" in want:
            Bd, L1, W, S = (64, 2, 64, 2048) if cuda else (4, 2, 16, 128)
            q = rnd(Bd, L1, H, D)
            kr, vr = rnd(Bd, L1, Hkv, W, D), rnd(Bd, L1, Hkv, W, D)
            ks, vs = rnd(Bd, Hkv, S, D), rnd(Bd, Hkv, S, D)
            q_pos = torch.full((Bd,), S - 1, device=dev)
            ring_pos = (torch.arange(S - W, S, device=dev)[None] + torch.zeros(Bd, 1, dtype=torch.long, device=dev))
            gw, gb = rnd(H, D, s=D ** -0.5), rnd(H)
            nbytes = esz * (2 * Bd * Hkv * S * D + 2 * Bd * L1 * Hkv * W * D + 2 * Bd * L1 * H * D)
            args_ = (q, kr, vr, ring_pos, ks, vs, q_pos, gw, gb, W)
            print(f"\ngated_swa_decode  batch {Bd}  loops {L1}+1  H {H}/{Hkv}  D {D}  window {W}  shared cache {S}  "
                  f"{dtype}")
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.gated_swa_decode_triton(*args_))
                print(f"    max |kernel - reference| = "
                      f"{_maxerr(K.gated_swa_decode_triton(*args_), K.gated_swa_decode_ref(*args_)):.2e}")
                _report("triton (split shared keys + combine)", t_k, nbytes)
            _report("reference", ktime(lambda: K.gated_swa_decode_ref(*args_)), nbytes, None, t_k)

            def stock_decode():  # two SDPA calls with masks, then the gate
                qq = q.reshape(Bd * L1, H, 1, D)
                ok = (ring_pos <= q_pos[:, None]) & (ring_pos > q_pos[:, None] - W) & (ring_pos >= 0)
                y_loc = F.scaled_dot_product_attention(qq, kr.flatten(0, 1), vr.flatten(0, 1), enable_gqa=True,
                                                       attn_mask=ok.repeat_interleave(L1, 0)[:, None, None])
                glob = (torch.arange(S, device=dev)[None] <= q_pos[:, None])[:, None, None]
                y_glob = F.scaled_dot_product_attention(q.transpose(1, 2), ks, vs, attn_mask=glob, enable_gqa=True)
                y_glob = y_glob.transpose(1, 2).reshape(Bd * L1, H, 1, D)
                g = K.plt_gate(qq, gw, gb)[..., None]
                return (g * y_loc.float() + (1 - g) * y_glob.float()).to(q.dtype).reshape(Bd, L1, H, D)
            f = torch.compile(stock_decode) if cuda else stock_decode
            _report("2 x SDPA + gate" + (", compiled" if cuda else ""), ktime(f), nbytes, None, t_k)

        if "dual" in want:  # the double decoder's setting: 4-8 blocks (a random partition, as in training)
            q = rnd(Bt, H, T, D)
            k_s, v_s, k_c, v_c = rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D)
            for n_blocks in ((4, 8) if cuda else (4,)):
                blk_d = _random_blocks(T, n_blocks, gen, dev)[None].expand(Bt, T).contiguous()
                dargs = (q, pos_b, blk_d, k_s, v_s, pos_b, blk_d, k_c, v_c, blk_d, scale)
                m_self, m_cross = K.dual_masks(pos_b, blk_d, pos_b, blk_d, blk_d)
                pairs = int(m_self.sum() + m_cross.sum()) * H
                flops, nbytes = 4 * D * pairs, esz * (2 * Bt * H * T * D + 4 * Bt * Hkv * T * D)
                print(f"\ndual_attention  B {Bt}  H {H}/{Hkv}  T {T}  D {D}  {n_blocks} blocks (self keys {T}, cross "
                      f"keys {T})  {dtype}")
                t_k = None
                if run_triton:
                    t_k = ktime(lambda: K.dual_attention_triton(*dargs))
                    o1, l1 = K.dual_attention_triton(*dargs)
                    o2, l2 = K.dual_attention_ref(*dargs)
                    print(f"    max |kernel - reference| = {_maxerr(o1, o2):.2e} (out)  {_maxerr(l1, l2):.2e} (lse)")
                    _report("triton (one pass, one softmax)", t_k, nbytes, flops)
                _report("reference: 2 dense attentions + LSE merge",
                        ktime(lambda: K.dual_attention_ref(*dargs), heavy=True), nbytes, flops, t_k)
                if flex is not None:
                    from torch.nn.attention.flex_attention import create_block_mask
                    sm = create_block_mask(
                        lambda b, h, i, j: (blk_d[b, j] == blk_d[b, i]) & (pos_b[b, j] <= pos_b[b, i]), Bt, None, T, T,
                        device=dev)
                    cm = create_block_mask(lambda b, h, i, j: blk_d[b, j] < blk_d[b, i], Bt, None, T, T, device=dev)

                    def two_flex():
                        o1, l1 = flex(q, k_s, v_s, sm, scale)
                        o2, l2 = flex(q, k_c, v_c, cm, scale)
                        return K.merge_lse(o1, l1.float(), o2, l2.float())
                    _report("2 x FlexAttention + LSE merge, compiled", ktime(torch.compile(two_flex)), nbytes,
                            flops, t_k)


# ----------------------------------------------------------------------------------------------------------------


def settings(text):
    """--settings of archs: a comma list of prompt/new with prompt >= 1 and new >= 2 (the decode time of a round is
    the difference of a 1-token and a new-token generate)."""
    for part in text.split(","):
        p, sep, g = part.partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected prompt/new pairs like 160/8, got {part!r}")
        number(int, min=1)(p)
        number(int, min=2)(g)
    return text


def bench_presets(args):
    """Every preset of the architectures asked for, through the architecture table: each ArchSpec's rows (the model
    and its baseline, built on the meta device) printed by model.describe. Nothing is timed or allocated."""
    from checkpoint import arch_table

    table = arch_table()
    names = args.arch.split(",") if args.arch else list(table)
    for name in names:
        spec = table[name]
        if args.preset is not None and args.preset not in spec.presets:
            raise UsageError(f"--preset {args.preset}: not a preset of {name}; choose one of {sorted(spec.presets)}")
        print(f"{name}:")
        for preset in [args.preset] if args.preset else spec.presets:
            with user_input():  # a config the flags make invalid (a --loops that does not divide the layers)
                rows = spec.table(preset, args)
            for label, m, baseline in rows:
                describe(label, m, baseline)


def build_parser():
    """Every subcommand and flag, each number with its bound (cli.number): a bad value is one line `error: ...`."""
    import block_transformer as bt
    import double_decoder as dd
    import plt

    pos, nonneg, two = number(int, min=1), number(int, min=0), number(int, min=2)  # two: >= 2 tokens
    dtypes = comma_list(one_of(DTYPES))
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)

    def machine(p):
        p.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
        p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")

    def common(p, preset="base", presets=PRESETS):
        machine(p)
        p.add_argument("--preset", default=preset, choices=sorted(presets), help=f"preset (default {preset})")
        p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")

    def generation(p, dtype, batch, prompt_len, new_tokens):  # what a generate() timing runs
        p.add_argument("--dtype", type=dtypes, default=dtype, help="comma list of dtypes")
        p.add_argument("--batch", type=comma_list(pos), default=batch, help="comma list of batch sizes")
        p.add_argument("--prompt-len", type=pos, default=prompt_len, help="prompt tokens")
        p.add_argument("--new-tokens", type=two, default=new_tokens, help="generated tokens per run (>= 2)")

    p = sub.add_parser("decode", help="vanilla decode vs the machine's bandwidth and transformers' generate")
    common(p)
    generation(p, "float32,bfloat16", "1", 128, 64)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers comparison")
    p.add_argument("--compile", action="store_true", help="ours: GPT.compile_decode() (static cache, compiled step)")
    p.add_argument("--linear", type=comma_list(one_of(["auto", *LINEAR_PRODUCTS])), default="auto",
                   help="comma list of cpu_tuning's linear products to time, each forced in turn: "
                   "auto (the measured choice), linear, mv, mm, xwt, dnn")
    p.set_defaults(fn=bench_decode)

    p = sub.add_parser("train", help="training tok/s vs nanoGPT's model.py at the same shape")
    common(p, "small")
    p.add_argument("--nanogpt", type=path_arg, default=None,
                   help="a nanoGPT checkout (its model.py is imported from there)")
    p.add_argument("--train-batch", type=pos, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=pos, default=256, help="tokens per sequence")
    p.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="ours with nanoGPT's AdamW (torch's per-tensor loop on CPU) instead of train.py's fused one")
    p.add_argument("--compile", action="store_true", help="torch.compile both models (the warm-up covers it)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="float32 | bfloat16 (autocast, both models)")
    p.add_argument("--profile", action="store_true", help="after the timed rounds, profile two steps of each model: "
                   "ms per step by operator group (matmuls, attention, loss, AdamW, norms, RoPE, MLP, casts, ...)")
    p.set_defaults(fn=bench_train)

    p = sub.add_parser("kd", help="one KD training step of SmolLM2-135M (recursive student, original teacher) vs "
                                  "the same step in transformers")
    machine(p)
    p.add_argument("--weights", default="random", help="random (SmolLM2-135M's shape) | smollm2-135m | gguf:PATH "
                   "(a GGUF file of the Llama family: its shape and weights)")
    p.add_argument("--loops", type=number(int, min=2), default=2, help="loops B of the recursive student")
    p.add_argument("--train-batch", type=pos, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=pos, default=512, help="tokens per sequence")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="float32 | bfloat16 (autocast, both)")
    p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")
    p.set_defaults(fn=bench_kd)

    p = sub.add_parser("plt", help="PLT-2 vs vanilla vs loop-2 per-token decode latency (Table 3)")
    common(p, presets=plt.PRESETS)
    generation(p, "float32,bfloat16", "1,4,16", 256, 32)
    p.add_argument("--variants", type=comma_list(one_of(list(plt.VARIANTS))), default="vanilla,loop,plt",
                   help="comma list of Table 2 rows: vanilla, loop, clp, kv_share, plt")
    p.set_defaults(fn=bench_plt)

    p = sub.add_parser("roofline", help="this CPU's read bandwidth and matmul speed; one layer's weight products "
                                        "at 1..32 rows; PLT-L / vanilla from the matmuls alone")
    p.add_argument("--preset", default="base", choices=sorted(plt.PRESETS), help="PLT preset (default base)")
    p.add_argument("--dtype", type=dtypes, default="float32,bfloat16", help="comma list of dtypes")
    p.add_argument("--rows", type=comma_list(pos), default="1,2,4,8,16,32", help="comma list of row counts")
    p.add_argument("--batch", type=comma_list(pos), default="1,4,16", help="comma list of decode batches")
    p.add_argument("--repeats", type=pos, default=5, help="timed passes per product (median)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_roofline)

    p = sub.add_parser("ckpt", help="checkpoint load: the CRC-32 verification of every record vs torch.load")
    p.add_argument("--preset", default="base", choices=sorted(PRESETS), help="GPT preset (default base)")
    p.add_argument("--dir", type=path_arg, default=None, help="where the temporary checkpoint is written "
                   "(default: the system's temporary directory)")
    p.add_argument("--repeats", type=pos, default=5, help="interleaved timed rounds (median and min..max)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_ckpt)

    p = sub.add_parser("double", help="double decoder vs decoder-only: TTFT (also after a cached prefix), "
                                      "per-token latency, KV bytes")
    common(p, presets=dd.PRESETS)
    generation(p, "float32,bfloat16", "1,8", 256, 32)
    p.add_argument("--shared-prefix", type=pos, default=None, help="cached prefix tokens (default: prompt / 2)")
    p.add_argument("--rollover", type=pos, default=None, help="double: fold the block into the context every N "
                                                              "tokens")
    p.add_argument("--vocab-size", type=number(int, min=2), default=None,
                   help="override the preset's vocabulary (the head is read every step; 4160 = this repository's "
                        "tokenizer)")
    p.add_argument("--ctx-layers", type=pos, default=None, help="override the preset's context layers")
    p.add_argument("--gen-layers", type=pos, default=None, help="override the preset's generation layers")
    p.set_defaults(fn=bench_double)

    p = sub.add_parser("archs", help="all six architectures side by side: TTFT, per-token latency, KV bytes")
    common(p, "tiny")
    p.add_argument("--dtype", type=dtypes, default="float32", help="comma list of dtypes")
    p.add_argument("--rank", type=pos, default=8, help="LoRA rank of the relaxed model")
    p.add_argument("--settings", type=settings, default="160/8,16/48",
                   help="comma list of prompt/new (prefill-, decode-heavy)")
    p.add_argument("--batch", type=comma_list(pos), default="1,8", help="comma list of batch sizes")
    p.set_defaults(fn=bench_archs)

    p = sub.add_parser("serve", help="serve.py's servers on the same requests: depth-wise batching + early exit vs "
                                     "continuous sequence-wise batching (bench_serve.py)")
    bench_serve.add_args(p)

    p = sub.add_parser("gpu", help="every efficiency claim on one GPU in one command (--minutes): decode, serving, "
                                   "PLT, Block, double decoder, training, each against its baseline (bench_gpu.py)")
    bench_gpu.add_args(p, SimpleNamespace(generation_times=generation_times, block_pair=block_pair,
                                          search_batch=search_batch, generation_bytes=generation_bytes,
                                          BLOCK_SETTINGS=BLOCK_SETTINGS, nanogpt_model=nanogpt_model))

    p = sub.add_parser("block", help="Block Transformer vs vanilla: throughput at the largest batch of a memory "
                                     "budget (decode-heavy, prefill-heavy)")
    p.add_argument("--preset", default="t3-19m", choices=sorted(bt.PRESETS),
                   help="block_transformer.py preset (default t3-19m: Table 3's 19M)")
    p.add_argument("--vanilla", default=None, choices=sorted(PRESETS), help="model.py preset of the vanilla model "
                   "(default: the block preset's counterpart at equal non-embedding parameters)")
    p.add_argument("--setting", default="both", choices=["both", *BLOCK_SETTINGS], help="run one setting alone")
    p.add_argument("--scale", type=number(float, above=0), default=0.25,
                   help="multiply the paper's prompt/generated lengths (128/2048, 2048/128); 1 = the paper's")
    p.add_argument("--budget-mib", type=pos, default=None, help="memory for generate()'s caches per model: the "
                   "batch search goes up to the largest batch that fits (default 2048 x scale: the same batches at "
                   "every scale)")
    p.add_argument("--search-tokens", type=nonneg, default=32, help="tokens per batch-search run (0: no search, time "
                                                                    "the largest batch)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in comma_list(pos)(s).split(",")] if s else [],
                   default=[], help="comma list of more batch sizes to time (besides 1 and the best)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="float32 | bfloat16 | auto")
    p.add_argument("--repeats", type=pos, default=3, help="interleaved timed rounds (median and min..max)")
    machine(p)
    p.add_argument("--profile", action="store_true", help="also profile one generate per model at its best batch")
    p.set_defaults(fn=bench_block)

    p = sub.add_parser("presets", help="every preset of an architecture: parameters, KV bytes, FLOPs per token, "
                                       "beside its baseline (nothing timed)")
    from checkpoint import arch_table
    p.add_argument("--arch", type=comma_list(one_of(list(arch_table()))), default=None,
                   help="comma list of architectures (default: all)")
    p.add_argument("--preset", default=None, help="one preset (default: every preset of each architecture)")
    p.add_argument("--loops", type=number(int, min=1), default=None, help="recursive / relaxed: B (default 2)")
    p.add_argument("--ranks", type=comma_list(number(int, min=1)), default=None,
                   help="relaxed: comma list of LoRA ranks to list (default 8,16,32,64)")
    p.set_defaults(fn=bench_presets)

    p = sub.add_parser("kernels", help="(CUDA) Triton kernels vs their references and stock PyTorch")
    p.add_argument("--only", default="", help="comma list of: lora, gswa, gswa_decode, dual (default: all); with --aot: "
                                              "substrings of the case names, e.g. lora/tiny,bfloat16")
    p.add_argument("--aot", action="store_true",
                   help="compile every kernel ahead of time for GPU targets (no GPU needed): shared memory, registers")
    p.add_argument("--aot-targets", type=comma_list(pos), default="80,90",
                   help="comma list of CUDA compute capabilities for --aot")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="bfloat16 | float16 | float32 | auto (bf16 on CUDA)")
    p.add_argument("--warmup", type=nonneg, default=None, help="untimed calls first (default: 10 on CUDA, 1 on CPU)")
    p.add_argument("--iters", type=pos, default=None, help="timed calls (default: 50 on CUDA, 3 on CPU)")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=bench_kernels)
    return ap


def run(argv=None):
    return run_subcommand(build_parser(), argv)


def main(argv=None):
    """The command: a mistake (a flag, a file, a checkpoint) is one line `error: ...` and exit code 2 (cli.run_cli)."""
    return run_cli(run, argv)


if __name__ == "__main__":
    main()
