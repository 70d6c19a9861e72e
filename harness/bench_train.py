"""
bench_train.py -- training speed: one training step of this repository's GPT against nanoGPT's model.py at the same
shape (`python bench.py train`, with --profile: the step by operator group), one knowledge-distillation step of a
recursive student converted from SmolLM2-135M against the same step written with transformers (`kd`), and what
verifying a train.py checkpoint's CRC-32s costs beside torch.load (`ckpt`). Plain PyTorch, as train.py runs it.
"""
from __future__ import annotations

import importlib.util
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import recursive
from harness import checkpoint
from harness.bench_common import check_bench_memory, header, hf_twin, med, ratio, rounds, spread
from harness.cli import UsageError, check_memory, check_writable_dir, user_input
from harness.device import pick_device, pick_dtype, sync
from harness.hf import from_gguf, gguf_config, gguf_file, read_gguf
from harness.memory import least_step_memory, memory_sum, model_memory
from model import GPT, GPTConfig, distill_loss, lm_loss, make_optimizer

# ----------------------------------------------------------------------------------------------------------------
# Training speed: this repository's GPT vs nanoGPT's model.py at the same shape, batch and sequence length


def nanogpt_model(path: str, cfg: GPTConfig, seq_len: int):
    """nanoGPT's GPT (from the model.py of a nanoGPT checkout at `path`; nothing of it is copied here) at the shape of
    cfg: same layers, width, heads, vocabulary and context; its own MLP (4d GELU) and LayerNorm."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", f"{path}/model.py")  # not our `model` module
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    conf = mod.GPTConfig(block_size=seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd, dropout=0.0, bias=False)
    return mod.GPT(conf)


def check_nanogpt(path):
    """--nanogpt, when given, must be a nanoGPT checkout: one line before any work."""
    if path and not (Path(path) / "model.py").is_file():
        raise UsageError(f"--nanogpt {path} is not a nanoGPT checkout (a directory with its model.py)")


def train_memory(cfg: GPTConfig, batch: int, seq_len: int, dtype, n_models: int) -> dict:
    """What training `n_models` models of cfg's shape allocates at least: fp32 weights, gradients and AdamW's two
    moments per model, their RoPE tables, the batch and one step's activations (memory.least_step_memory)."""
    m = model_memory(cfg, 4)
    return memory_sum({"weights, gradients and AdamW moments": 4 * n_models * m["weights"]},
                      {"RoPE tables": n_models * m["RoPE tables"], "batch": 2 * batch * seq_len * 8},
                      least_step_memory(batch, seq_len, cfg.vocab_size, dtype))


def train_models(cfg: GPTConfig, nanogpt, seq_len: int, device) -> dict:
    """{"ours": GPT of cfg} and, with a nanoGPT checkout, {"nanoGPT": its model at cfg's shape}: fp32, seed 0."""
    torch.manual_seed(0)
    models = {"ours": GPT(cfg).to(device)}
    if nanogpt:
        models["nanoGPT"] = nanogpt_model(nanogpt, cfg, seq_len).to(device)
    return models


def train_batch(cfg: GPTConfig, batch: int, seq_len: int, device, dtype):
    """Random inputs and targets (batch, seq_len) and the autocast the steps run under (bf16: autocast, fp32 weights
    and optimizer) -> (x, y, autocast)."""
    x = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), device=device)
    return x, y, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def optimizer_for(name: str, model, device, fused_ours: bool = True):
    """ours: train.py's AdamW (model.make_optimizer, fused on CPU and CUDA); nanoGPT (and ours without fused_ours):
    nanoGPT's own choice, torch's AdamW fused on CUDA only (its configure_optimizers), the per-tensor loop on CPU."""
    if name == "ours" and fused_ours:
        return make_optimizer(model, 1e-4, 0.1, device)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def train_step(model, opt, x, y, autocast, sync_device=None):
    """One training step as step(): forward under autocast, backward, AdamW, zero_grad (then a device sync when
    sync_device is given: a profiled step ends with its kernels)."""
    def step():
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync_device is not None:
            sync(sync_device)
    return step


def param_counts(models: dict) -> dict[str, int]:
    """name -> every parameter of the model (embeddings included)."""
    return {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}


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
    check_nanogpt(args.nanogpt)
    device = pick_device(args.device)
    cfg = GPTConfig.from_preset(args.preset, max_seq_len=args.seq_len)
    B, T = args.train_batch, args.seq_len
    dtype = pick_dtype(device, args.dtype)
    check_memory(train_memory(cfg, B, T, dtype, 2 if args.nanogpt else 1), device,
                 f"bench.py train --train-batch {B} x --seq-len {T}", "lower --train-batch or --seq-len",
                 per="per training step", at_least=True)
    models = train_models(cfg, args.nanogpt, T, device)
    x, y, autocast = train_batch(cfg, B, T, device, dtype)
    steps = {}
    for name, m in models.items():
        opt = optimizer_for(name, m, device, fused_ours=args.fused_adamw)
        fwd = torch.compile(m) if args.compile else m  # both models alike
        steps[name] = train_step(fwd, opt, x, y, autocast, sync_device=device)
    n_params = param_counts(models)
    header("training step", device, dtype, f"compile {args.compile} | preset {args.preset} shape "
           f"(layers {cfg.n_layer}, d "
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
        print(f"   ours / nanoGPT = {ratio(res['nanoGPT'], res['ours'])}x tokens/s (per-round ratios)")


# ----------------------------------------------------------------------------------------------------------------
# One knowledge-distillation step of a real model: a recursive student converted from SmolLM2-135M, the original as
# teacher; this repository's models against the same step written with transformers' LlamaForCausalLM

# SmolLM2-135M's shape (hf.gguf_config of its GGUF file gives the same), for a run without the file
SMOLLM2_135M = dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536, vocab_size=49152,
                    max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True)


def kd_models(teacher: GPT, loops: int, device):
    """The teacher (a vanilla GPT) and its recursive conversion (Stepwise, B = loops) as the student, ours and their
    transformers twins (hf_twin: the same weights) -> {"ours": (teacher, student), "transformers": (...)}."""
    student = recursive.from_vanilla(teacher, n_loops=loops, init="stepwise", log=lambda *a: None)
    teacher, student = teacher.to(device).eval().requires_grad_(False), student.to(device).train()
    return {"ours": (teacher, student),
            "transformers": (hf_twin(teacher).eval().requires_grad_(False), hf_twin(student, loops))}


def kd_step(teacher, student, logits_of, x, y, autocast, device):
    """One step of train.py's uptraining with --teacher and --kd fkl: the teacher's logits without gradients, the
    student's, loss = cross-entropy + KD(fkl) (model.lm_loss, model.distill_loss), backward, AdamW
    (model.make_optimizer), zero_grad -> step() returning the loss. logits_of(model) -> logits (B, T, V) of x."""
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
        with user_input():
            cfg = gguf_config(read_gguf(gguf_file(args.weights) or Path(args.weights)))
    if cfg.n_layer % args.loops:  # the student shares n_layer / loops layers (recursive.from_vanilla, Stepwise)
        fits = [b for b in range(2, cfg.n_layer + 1) if cfg.n_layer % b == 0]
        raise UsageError(f"--loops {args.loops}: the {cfg.n_layer} layers of --weights {args.weights} do not split "
                         f"into {args.loops} loops of shared layers; give one of {', '.join(map(str, fits))}")
    if args.seq_len > cfg.max_seq_len:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the context of --weights {args.weights} "
                         f"({cfg.max_seq_len:,} positions)")
    B, T, V = args.train_batch, args.seq_len, cfg.vocab_size
    student = GPTConfig(**{**asdict(cfg), "n_layer": cfg.n_layer // args.loops})  # its shared layers
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
# Checkpoint integrity: what verifying the CRC-32 of every record costs against the load itself


def bench_ckpt(args):
    """checkpoint.load_checkpoint verifies the CRC-32 of every record before torch.load: time the two apart on a
    train.py-shaped checkpoint (the preset's GPT, its AdamW state after one step), interleaved rounds."""
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
