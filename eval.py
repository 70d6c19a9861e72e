"""
eval.py -- what a trained checkpoint does on validation text: the measurements of quality, not of speed (bench.py).

Each evaluation reads train.py checkpoints and the validation split of the corpus they were trained on (their run
arguments; the token cache goes to this command's --cache-dir), draws its windows from seeded generators so that every
checkpoint of the same corpus and tokenizer sees the same ones, checks the memory it will allocate (the models on the
device, the windows, a batch's logits, the caches of decoding: check_eval_memory) and prints one table:

  * loss: one model's loss on a fixed evaluation set (the first --tokens of a validation split, consecutive
    windows), a checkpoint or a pretrained model as loaded or converted without training: the rows of the conversion
    table of the Relaxed Recursive Transformers paper (section 3, Figures 4-5) on a real model.
  * exits (Relaxed Recursive Transformers, sections 2.4 and 3.7, Table 3): a recursive/relaxed checkpoint's loss
    and accuracy when every token leaves after loop l (static exit), the oracle exit (the earliest loop whose argmax
    equals the last loop's), and per exit rule (max softmax, the learned gate, saturation) the trade-off curve over
    thresholds: the share of tokens leaving at each loop, the mean loop, the loss against the last loop's and the
    agreement with it, in real cached decoding with state propagation (recursive.exit_analysis).
  * energy (Relaxed Recursive Transformers, section 2.3, eq. 4, and section 3.5): the share of ||W_l - W'||_F^2 that a
    rank-r truncated SVD captures when a vanilla checkpoint is relaxed into B loops under a tying strategy
    (svd_lora.residual_energy): how much of the full model the LoRA initialisation can recover at each rank.
  * double-eval (Block-Based Double Decoders, section 4): validation losses of double-decoder and decoder-only
    checkpoints on identical windows, each under its own objective and under the prefix-LM split that equalises them
    (loss on the suffix only), with paired differences to the first checkpoint; --sample: generations.
  * block (Block Transformer, Table 2 and Appendix H): the validation loss of Block Transformer and vanilla
    checkpoints on the same targets (the block model's layout, random-length padding included).

Run:
    python eval.py loss --model smollm2-135m                                    # the pretrained model as loaded
    python eval.py loss --model smollm2-135m --arch relaxed --loops 2 --lora-rank 32   # converted, no training
    python eval.py loss --model out/smol-relaxed/ckpt.pt                        # after uptraining
    python eval.py exits --ckpt out/relaxed/ckpt.pt             # per loop, oracle, threshold curve of each rule
    python eval.py exits --ckpt out/relaxed/ckpt.pt --rules gate,softmax --thresholds 0.5,0.9
    python eval.py energy --ckpt out/vanilla/ckpt.pt --loops 2 --init average
    python eval.py double-eval out/double/ckpt.pt out/vanilla/ckpt.pt --batches 50
    python eval.py double-eval out/double/ckpt.pt --sample "def " --rollover 16
    python eval.py block --eval out/block/ckpt.pt out/vanilla/ckpt.pt
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below (a second or more): `stopped:`, exit code 130
    import signal
    import sys

    def _stopped_while_starting(signum, frame):  # what cli.run_cli says later, before it can be imported
        print(f"stopped: {'terminated (SIGTERM)' if signum == signal.SIGTERM else 'interrupted (Ctrl-C)'} while "
              f"starting", file=sys.stderr)
        raise SystemExit(130)

    for _signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signal, _stopped_while_starting)

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import block_transformer as bt
import double_decoder as dd
import recursive
from checkpoint import check_vocab, load_checkpoint, load_source_model, model_from_checkpoint, tokenizer_from_spec
from cli import (ArgumentParser, UsageError, check_memory, check_output_file, check_writable_dir, comma_list, number,
                 one_of, path_arg, run_cli, run_subcommand, seed_arg, temperature_arg, threads_arg, user_input)
from data import TokenData, is_gguf_source, is_hf_source, prepare_corpus, step_generator
from model import IGNORE, forward_memory, memory_sum, module_bytes, pick_device
from svd_lora import max_ranks, residual_energy


# ----------------------------------------------------------------------------------------------------------------
# A run's checkpoint and its validation windows


def load_run(path, device):
    """A train.py checkpoint -> (checkpoint dict, model in eval mode on device, tokenizer)."""
    ck = load_checkpoint(path)
    model = model_from_checkpoint(ck)
    tok = text_tokenizer(ck["tokenizer"], f"checkpoint {path}")
    check_vocab(model.config, tok, f"checkpoint {path}")
    check_eval_memory(weights_on(device, model), device, f"the model of {path}")
    return ck, model.to(device).eval(), tok


# The memory an evaluation allocates (model.py's pieces), checked before it allocates it (cli.check_memory): the
# models as they move to the device (on a CPU they are in memory already), the evaluation windows and one batch's
# forward (its logits and their float32 copies for the loss), the KV caches of decoding.

def weights_on(device, *models) -> dict:
    """The models' weights and buffers as they are copied to `device`; nothing on a CPU (they are there already)."""
    return {f"models on {device}": module_bytes(*models)} if torch.device(device).type != "cpu" else {}


def elem_of(model) -> int:
    return next(model.parameters()).element_size()


def check_eval_memory(parts: dict, device, what: str, fix: str = "evaluate it on a device with more memory"):
    check_memory(memory_sum(parts), device, what, fix)


def text_tokenizer(spec, where):
    """The tokenizer of a spec, for text: a synthetic task's vocabulary reads no text (tasks.py evaluates those
    models), and a tokenizer that cannot be built here (a tiktoken name that needs the network, a missing file) is
    one line naming the model's source."""
    if spec.get("kind") == "task":
        raise UsageError(f"{where} was trained on the synthetic task {spec.get('name')!r}: its tokenizer reads no "
                         f"text, so eval.py has no corpus to evaluate it on (train.py's evaluation reports the task)")
    try:
        return tokenizer_from_spec(spec)
    except ValueError as e:  # a tiktoken name says nothing of the file it came from; hf/gguf messages name theirs
        raise UsageError(f"{where}: {e}" if spec.get("kind") == "tiktoken" else str(e)) from None


def val_windows(ck, tok, n_batches, batch, seq_len, seed, device, cache_dir):
    """The validation windows of the checkpoint's corpus (its run arguments), drawn from seeded generators: every
    checkpoint of the same corpus and tokenizer sees the same windows. The token cache goes to this command's
    --cache-dir (cache_dir), never to a directory the checkpoint names."""
    a = ck.get("args", {})
    cache = prepare_corpus(a.get("data", "stdlib"), tok, cache_dir,
                           [s for s in a.get("exclude_sets", "").split(",") if s], a.get("val_data"), verbose=False)
    val = TokenData(cache, "val")
    for i in range(n_batches):
        x, y = val.get_batch(batch, seq_len, step_generator(seed, -1, i, 0))
        yield x.to(device), y.to(device)

# ----------------------------------------------------------------------------------------------------------------
# The loss of one model on a fixed evaluation set (loss): the conversion table of a pretrained model


def loss_model(args):
    """--model (a train.py checkpoint, hf:DIR, gguf:PATH or a packaged short name) and, for a pretrained source, the
    conversion flags (--arch, --loops, --init, --lora-rank, --keep-layers) -> (model, label, tokenizer spec). The
    conversion is recursive.from_vanilla, the one train.py --init-from runs, without a training step."""
    conversion = [f for f in ("arch", "loops", "init", "lora_rank", "keep_layers") if getattr(args, f) is not None]
    if not (is_gguf_source(args.model) or is_hf_source(args.model)):
        if conversion:
            raise UsageError(f"--{conversion[0].replace('_', '-')} converts a pretrained source (hf:DIR, gguf:PATH); "
                             f"{args.model} is a train.py checkpoint: evaluate it as it is")
        ck = load_checkpoint(args.model)
        return model_from_checkpoint(ck), f"{ck['arch']} step {ck.get('step')}", ck["tokenizer"]
    src, _, spec = load_source_model(args.model)
    label = "pretrained"
    if args.keep_layers:
        src = recursive.keep_layers(src, args.keep_layers)
        label = f"layers {args.keep_layers}"
    arch = args.arch or "vanilla"
    if arch == "vanilla":
        if args.loops or args.init or args.lora_rank:
            raise UsageError("--loops, --init and --lora-rank convert to --arch recursive or relaxed")
        return src, label, spec
    if arch == "recursive" and args.lora_rank:
        raise UsageError("--lora-rank is a flag of --arch relaxed")
    ranks = {}
    if arch == "relaxed":
        if not args.lora_rank:
            raise UsageError("--arch relaxed needs --lora-rank (a rank, or full)")
        top = max_ranks(src.config)
        ranks = {f"lora_rank_{c}": top[c] if args.lora_rank == "full" else min(int(args.lora_rank), top[c])
                 for c in top}
    init = args.init or ("average" if arch == "relaxed" else "stepwise")
    model = recursive.from_vanilla(src, n_loops=args.loops or 2, init=init, **ranks, log=lambda s: None)
    return model, f"{arch} B={args.loops or 2} init {init}" + (f" rank {args.lora_rank}" if ranks else ""), spec


def first_tokens_windows(tok, args):
    """The evaluation set: the first --tokens tokens of the validation split of --data under the model's own tokenizer,
    cut into consecutive windows of --seq-len (+1 target). No sampling: every model of one tokenizer sees the same
    tokens. -> (x, y) LongTensors (n_windows, seq_len)."""
    cache = prepare_corpus(args.data, tok, args.cache_dir, verbose=False)
    val = TokenData(cache, "val")
    flat = torch.cat([torch.from_numpy(s[:].astype("int64")) for s in val.shards])
    n = args.tokens // args.seq_len
    if flat.numel() < n * args.seq_len + 1:
        raise UsageError(f"--tokens {args.tokens}: the validation split of {args.data} has only {flat.numel():,} "
                         f"tokens under this tokenizer")
    w = flat[:n * args.seq_len + 1]
    return w[:-1].view(n, args.seq_len), w[1:].view(n, args.seq_len)


@torch.no_grad()
def eval_loss(args):
    """Mean next-token cross-entropy of one model on the evaluation set (first_tokens_windows), with its parameter
    counts; --results appends the row as one JSON line."""
    device = pick_device(args.device)
    if args.tokens < args.seq_len:  # before any work: not one window to evaluate
        raise UsageError(f"--tokens {args.tokens} is fewer than one window of --seq-len {args.seq_len}: give "
                         f"--tokens >= --seq-len")
    if args.results:
        check_output_file(args.results, "--results")
    check_writable_dir(Path(args.cache_dir), "--cache-dir")
    with user_input():  # a bad source, conversion or layer list: one line
        model, label, spec = loss_model(args)
    if args.seq_len > model.config.max_seq_len:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's context of {model.config.max_seq_len}")
    tok = text_tokenizer(spec, args.model)
    check_vocab(model.config, tok, args.model)
    n, rows = args.tokens // args.seq_len, min(args.batch_size, args.tokens // args.seq_len)
    check_eval_memory(memory_sum(weights_on(device, model), {"evaluation windows": 2 * 8 * n * args.seq_len},
                                 forward_memory(model.config, rows, args.seq_len, elem_of(model), fp32_copies=2)),
                      device, f"the evaluation of --tokens {args.tokens} in batches of --batch-size {rows} x "
                              f"--seq-len {args.seq_len}", "lower --batch-size, --seq-len or --tokens")
    model = model.to(device).eval()
    x, y = first_tokens_windows(tok, args)
    total = 0.0
    for i in tqdm(range(0, len(x), args.batch_size), desc="eval", leave=False):
        xb, yb = x[i:i + args.batch_size].to(device), y[i:i + args.batch_size].to(device)
        logits = model(xb)[0].float()
        total += F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="sum").item()
    n = y.numel()
    row = dict(model=args.model, label=label, params=model.num_params(False), non_emb=model.num_params(True),
               tokens=n, loss=total / n, data=args.data, seq_len=args.seq_len)
    print(f"{args.model} [{label}]: {row['params'] / 1e6:.1f}M parameters ({row['non_emb'] / 1e6:.1f}M non-embedding)"
          f" | {n:,} tokens of the {args.data} validation split ({len(x)} windows of {args.seq_len}) | "
          f"loss {row['loss']:.4f} ppl {math.exp(row['loss']):.2f}")
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


# ----------------------------------------------------------------------------------------------------------------
# Early exit of a recursive/relaxed checkpoint (exits)


@torch.no_grad()
def eval_exits(args):
    """Early exit of a recursive/relaxed checkpoint on validation text: static exit per loop, the oracle, and the
    confidence-exit trade-off curve with state propagation (recursive.exit_analysis), summed over the windows."""
    device = pick_device(args.device)
    check_writable_dir(Path(args.cache_dir), "--cache-dir")
    ck, model, tok = load_run(args.ckpt, device)
    if not isinstance(model, recursive.RecursiveGPT):
        raise UsageError(f"{args.ckpt} holds a {ck['arch']} model, not a recursive/relaxed one")
    L = model.config.n_loops
    seq = min(args.seq_len, model.config.max_seq_len)
    if args.rules is None:  # every rule this checkpoint can apply
        rules = [r for r in EXIT_RULE_TEXT if r != "gate" or model.exit_gate is not None]
    else:  # a rule asked for must apply
        rules = args.rules.split(",")
        if "gate" in rules and model.exit_gate is None:
            raise UsageError(f"--rules gate: {args.ckpt} has no learned exit gate (train it with --exit-gate); the "
                             f"rules it can apply are softmax and saturation")
    B, V, elem = args.batch_size, model.config.vocab_size, elem_of(model)
    check_eval_memory({"validation windows": 2 * 8 * args.batches * B * seq,
                       "logits of every loop (static exit)": 3 * L * B * seq * V * 4,
                       "KV caches of the cached decoding": model.kv_cache_bytes(B, seq, elem),
                       "emitted logits of the decoding": 2 * B * seq * V * 4}, device,
                      f"the exit analysis of --batches {args.batches} x --batch-size {B} x --seq-len {seq}",
                      "lower --batch-size, --seq-len or --batches")
    windows = list(val_windows(ck, tok, args.batches, args.batch_size, seq, args.seed, device, args.cache_dir))
    n = sum(y[:, 1:].numel() for _, y in windows)
    print(f"{args.ckpt}: {ck['arch']} B={L} K={model.config.n_shared} step {ck['step']} | {n:,} validation tokens "
          f"({args.batches} x {args.batch_size} windows of {seq}, seed {args.seed}) | exit rules {rules}"
          + ("" if model.exit_gate is not None else " (no learned gate in this checkpoint: train with --exit-gate)"))
    for k, rule in enumerate(rules):
        thresholds = [float(t) for t in (args.saturation_thresholds if rule == "saturation" else
                                         args.thresholds).split(",")]
        parts = [recursive.exit_analysis(model, x, y, thresholds, rule) for x, y in windows]
        avg = lambda get: sum(get(p) * p["tokens"] for p in parts) / n  # noqa: E731  token-weighted mean
        if k == 0:
            print("static exit (every token leaves after loop l):")
            for l in range(L):
                print(f"  loop {l + 1}: loss {avg(lambda p: p['loop_loss'][l]):.4f}  "
                      f"acc {avg(lambda p: p['loop_acc'][l]):.2%}")
            oracle = sum(p["oracle"] for p in parts).double() / n
            print("oracle exit (earliest loop whose argmax equals the final loop's): "
                  + "  ".join(f"loop {l + 1} {oracle[l]:.1%}" for l in range(L))
                  + f"  -> mean loop {float((oracle * torch.arange(1, L + 1)).sum()):.3f}")
        print(f"exit rule {rule} ({EXIT_RULE_TEXT[rule]}; real cached decoding with state propagation, "
              f"teacher-forced):")
        print(f"  {'t':>6s}  " + "  ".join(f"{'exit@' + str(l + 1):>8s}" for l in range(L))
              + f"  {'mean loop':>9s}  {'loss':>7s}  {'vs final':>8s}  {'agree':>7s}")
        final = avg(lambda p: p["loop_loss"][-1])
        for i, t in enumerate(thresholds):
            share = [avg(lambda p: p["curve"][i]["share"][l]) for l in range(L)]
            loss = avg(lambda p: p["curve"][i]["loss"])
            print(f"  {t:6.3f}  " + "  ".join(f"{s:8.1%}" for s in share)
                  + f"  {avg(lambda p: p['curve'][i]['mean_loop']):9.3f}  {loss:7.4f}  {loss - final:+8.4f}  "
                  f"{avg(lambda p: p['curve'][i]['agree']):7.1%}")


EXIT_RULE_TEXT = {"softmax": "max softmax >= t, the head on every row", "gate": "learned gate probability >= t, O(d)",
                  "saturation": "cos(loop input, loop output) >= t, O(d)"}

# ----------------------------------------------------------------------------------------------------------------
# Residual energy of a rank-r SVD (energy)


def eval_energy(args):
    """Share of the residual energy ||W_l - W'||^2 a rank-r truncated SVD captures (svd_lora.residual_energy)."""
    ck, model, _ = load_run(args.ckpt, "cpu")
    if ck["arch"] != "vanilla":
        raise UsageError(f"{args.ckpt} holds a {ck['arch']} model, not a vanilla one")
    N = model.config.n_layer
    if N % args.loops:
        raise UsageError(f"{args.ckpt}: its n_layer={N} is not divisible by --loops {args.loops}")
    ranks = [int(r) for r in args.ranks.split(",")]
    res = residual_energy(list(model.blocks), recursive.tying_sources(N, N // args.loops, args.init), ranks)
    print(f"{args.ckpt}: N={N}, B={args.loops}, init={args.init}; share of ||W_l - W'||_F^2 in the top-r singular "
          f"values (mean over loops and layers; exactly-zero residuals skipped)")
    print("component " + "".join(f"{'r=' + str(r):>9s}" for r in ranks))
    for comp, fr in res.items():
        print(f"{comp:9s} " + "".join(f"{fr[r]:9.3f}" for r in ranks))

# ----------------------------------------------------------------------------------------------------------------
# Double decoder vs decoder-only (double-eval)


@torch.no_grad()
def eval_double(args):
    """Validation losses of train.py checkpoints (double or decoder-only) on identical windows:
    native: each model's own objective (double: random block partitions; decoder-only: causal LM);
    prefix-LM: one split per batch, loss on the suffix tokens only -- the comparison of section 4 (the double decoder
    reads the prefix through its context decoder, the decoder-only model reads it causally).
    --sample PROMPT: instead, print a generation of each checkpoint (the double decoder's with --rollover)."""
    device = pick_device(args.device)
    paths, batches = args.ckpt, args.batches
    if args.sample is None:
        check_writable_dir(Path(args.cache_dir), "--cache-dir")
    cks = [load_checkpoint(p) for p in paths]
    a = cks[0].get("args") or {}
    for p, ck in zip(paths, cks):
        if ck["tokenizer"] != cks[0]["tokenizer"] or (ck.get("args") or {}).get("data") != a.get("data"):
            raise UsageError(f"{p} was trained with another tokenizer or corpus than {paths[0]}")
    tok = text_tokenizer(cks[0]["tokenizer"], f"checkpoint {paths[0]}")
    models = [model_from_checkpoint(ck) for ck in cks]
    for p, m in zip(paths, models):
        check_vocab(m.config, tok, f"checkpoint {p}")
    if args.sample is not None:
        ids = tok.encode(args.sample)
        if not ids or len(ids) >= min(m.config.max_seq_len for m in models):
            raise UsageError(f"--sample is {len(ids)} tokens: a prompt needs at least one token and room for a new "
                             f"one in the context ({min(m.config.max_seq_len for m in models)} positions)")
        n = max(min(args.new_tokens, m.config.max_seq_len - len(ids)) for m in models)
        work = {"KV caches of generate": max(m.kv_cache_bytes(1, len(ids) + n, elem_of(m)) for m in models)}
        what = f"generating --new-tokens {args.new_tokens} from each checkpoint"
    else:
        T = min(m.config.max_seq_len for m in models)
        work = max((forward_memory(m.config, args.batch_size, T, elem_of(m), fp32_copies=3) for m in models),
                   key=lambda est: est["total"])  # one model at a time; the double decoder's prefix-LM pass too
        what = f"the evaluation of --batch-size {args.batch_size} windows of {T} tokens"
    check_eval_memory(memory_sum(weights_on(device, *models), work), device, what,
                      "lower --batch-size" if args.sample is None else "lower --new-tokens")
    models = [m.to(device).eval() for m in models]
    if args.sample is not None:
        for p, ck, m in zip(paths, cks, models):
            idx = torch.tensor([ids], device=device)
            gen = torch.Generator(device=device).manual_seed(args.seed)
            n = min(args.new_tokens, m.config.max_seq_len - idx.size(1))
            kw = {"rollover": args.rollover} if isinstance(m, dd.DoubleDecoder) else {}
            out = m.generate(idx, n, temperature=args.temperature, top_k=args.top_k, generator=gen, **kw)
            print(f"== {ck['arch']} | {p}\n{tok.decode(out[0].tolist())}")
        return None
    exclude = [s for s in a.get("exclude_sets", "").split(",") if s]
    val = TokenData(prepare_corpus(a.get("data", "stdlib"), tok, args.cache_dir, exclude, a.get("val_data"),
                                   verbose=False), "val")
    T = min(min(m.config.max_seq_len, (ck.get("args") or {}).get("seq_len") or 10 ** 9)
            for ck, m in zip(cks, models))  # trained length
    sums = torch.zeros(len(models), 2, batches, dtype=torch.float64)  # [model, native | prefix-LM, batch] CE sums
    counts = torch.zeros(2, batches, dtype=torch.float64)  # targets per batch (the same for every model)
    for i in range(batches):
        gen = step_generator(args.seed, -2, i)
        x, y = val.get_batch(args.batch_size, T, gen)
        s = int(torch.randint(1, T, (1,), generator=gen))
        y_pl = y.clone()
        y_pl[:, :s] = IGNORE
        blk_pl = (torch.arange(T) >= s).long()
        blk_native = dd.sample_blocks(T, gen, 3, 8)
        x, y, y_pl = x.to(device), y.to(device), y_pl.to(device)
        counts[:, i] = torch.tensor([y.numel(), int((y_pl != IGNORE).sum())])
        for j, m in enumerate(models):
            double = isinstance(m, dd.DoubleDecoder)
            logits = m(x, blk=blk_native)[0] if double else m(x)[0]
            sums[j, 0, i] = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
            logits = m(x, blk=blk_pl)[0] if double else logits
            sums[j, 1, i] = F.cross_entropy(logits.float().flatten(0, 1), y_pl.flatten(), ignore_index=IGNORE,
                                            reduction="sum").item()
    mean = sums.sum(-1) / counts.sum(-1)  # (models, 2): the token means
    print(f"val split of {a['data']} | {batches} batches x {args.batch_size} x {T} tokens | prefix-LM split uniform "
          f"in [1, {T - 1}] | device {device}")
    for j, (p, ck, m) in enumerate(zip(paths, cks, models)):
        line = (f"{ck['arch']:8s} {m.num_params() / 1e6:6.2f}M non-emb | native loss {mean[j, 0]:.4f} | "
                f"prefix-LM suffix loss {mean[j, 1]:.4f}")
        if j:  # paired over the same batches: the difference to the first model and its standard error
            d = (sums[j] - sums[0]) / counts  # (2, batches) per-batch mean differences
            se = [f" +- {v:.4f}" if batches > 1 else "" for v in (d.std(-1) / math.sqrt(batches)).tolist()]
            line += (f" | minus the first: native {mean[j, 0] - mean[0, 0]:+.4f}{se[0]}, prefix-LM "
                     f"{mean[j, 1] - mean[0, 1]:+.4f}{se[1]} (s.e. over paired batches)")
        print(f"{line} | {p}")
    return mean

# ----------------------------------------------------------------------------------------------------------------
# Block Transformer vs vanilla on the same targets (block --eval)


@torch.no_grad()
def eval_block_targets(args):
    """Validation loss of Block Transformer and vanilla checkpoints on the SAME targets: the block model's (the
    windows as its training lays them out, random-length padding included; the first L_B - 1 targets of a window and
    pad targets left out). Vanilla reads the raw window and is scored at the raw positions of those targets
    (random_pad_documents' `src`), so both models predict the same tokens from the same preceding real tokens."""
    device = pick_device(args.device)
    check_writable_dir(Path(args.cache_dir), "--cache-dir")
    runs = [load_run(p, device) for p in args.eval]
    blocks = [r for r in runs if isinstance(r[1], bt.BlockTransformer)]
    if not blocks:
        raise UsageError("--eval needs at least one Block Transformer checkpoint (its targets define the evaluation)")
    cfg = blocks[0][1].config
    if args.seq_len % cfg.block_len:
        fit = args.seq_len // cfg.block_len * cfg.block_len or cfg.block_len
        raise UsageError(f"--seq-len {args.seq_len} is not a multiple of the Block Transformer's block length "
                         f"L_B = {cfg.block_len}: give a multiple (e.g. {fit})")
    context = min(r[1].config.max_seq_len for r in runs)  # tokens, for both kinds of model
    if args.seq_len > context:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the checkpoints' context of {context} tokens")
    # one model at a time: its logits, their float32 copies and, for vanilla, the gathered rows on the CPU
    check_eval_memory(max((forward_memory(m.config, args.eval_batch_size, args.seq_len, elem_of(m), fp32_copies=3)
                           for _, m, _ in runs), key=lambda est: est["total"]), device,
                      f"the evaluation of --eval-batch-size {args.eval_batch_size} x --seq-len {args.seq_len}",
                      "lower --eval-batch-size or --seq-len")
    key = lambda c: (c.block_len, c.pad, c.eot_id, c.random_pad)  # noqa: E731  what decides the layout
    if any(key(r[1].config) != key(cfg) for r in blocks):
        raise UsageError("the Block Transformer checkpoints lay windows out differently (block_len, pad, eot_id)")
    ck0, _, tok0 = runs[0]
    sums = {p: [0.0, 0.0] for p in args.eval}  # loss on the shared targets, loss on all of its own targets
    n_shared, n_all = 0, 0
    for i, (x, y) in enumerate(val_windows(ck0, tok0, args.eval_batches, args.eval_batch_size, args.seq_len,
                                           args.seed, "cpu", args.cache_dir)):
        gen = torch.Generator().manual_seed((args.seed + i) % 2 ** 64)  # what torch takes
        if cfg.random_pad and cfg.eot_id is not None:
            x2, y2, src = bt.random_pad_documents(x, y, gen, cfg.block_len, cfg.pad, cfg.eot_id, return_source=True)
        else:
            x2, y2, src = x, y, torch.arange(1, x.size(1) + 1).expand_as(x)
        y2 = y2.clone()
        y2[:, :cfg.block_len - 1] = IGNORE  # the block model never predicts these
        keep = y2 != IGNORE
        assert torch.equal(y.gather(1, (src - 1).clamp(min=0))[keep], y2[keep])  # the same tokens
        n_shared += int(keep.sum())
        n_all += y.numel()
        for p, (_, m, _) in zip(args.eval, runs):
            if isinstance(m, bt.BlockTransformer):  # its own loss counts exactly the shared targets
                logits = m(x2.to(device))[0].float().cpu()
                sel = logits[keep]
            else:
                logits = m(x.to(device))[0].float().cpu()  # (B, T, V): row t predicts raw token t + 1
                rows = (src - 1).clamp(min=0)
                sel = logits.gather(1, rows[..., None].expand(*rows.shape, logits.size(-1)))[keep]
                sums[p][1] += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            sums[p][0] += float(F.cross_entropy(sel, y2[keep], reduction="sum"))
    print(f"validation: {args.eval_batches} x {args.eval_batch_size} windows of {args.seq_len} (seed {args.seed}); "
          f"{n_shared:,} shared targets (the block layout's, of {n_all:,} raw targets)")
    print(f"   {'checkpoint':60s} {'arch':8s} {'shared targets':>14s} {'all raw targets':>15s}")
    for p, (ck, m, _) in zip(args.eval, runs):
        raw = "" if isinstance(m, bt.BlockTransformer) else f"{sums[p][1] / n_all:15.4f}"
        print(f"   {p:60s} {ck['arch']:8s} {sums[p][0] / n_shared:14.4f} {raw:>15s}")

# ----------------------------------------------------------------------------------------------------------------
# The command line


def rank_or_full(text):
    if text == "full":
        return text
    return str(number(int, min=1)(text))


RUN_CACHE_HELP = "token cache directory: the checkpoint's corpus is tokenized there (never where the checkpoint says)"


def build_parser():
    """Every subcommand and flag, each number with its bound (cli.number): a bad value is one line `error: ...`."""
    pos, nonneg, two = number(int, min=1), number(int, min=0), number(int, min=2)  # two: >= 2 tokens
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)

    def machine(p):
        p.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
        p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")

    p = sub.add_parser("exits", help="early exit of a recursive/relaxed checkpoint: per loop, oracle, threshold curve")
    p.add_argument("--ckpt", type=path_arg, required=True, help="a recursive/relaxed checkpoint written by train.py")
    p.add_argument("--thresholds", type=comma_list(number(float, min=0, max=1)), default="0.3,0.5,0.7,0.8,0.9,0.95",
                   help="comma list of thresholds of the softmax and gate rules (probabilities, in [0, 1])")
    p.add_argument("--saturation-thresholds", type=comma_list(number(float, min=-1, max=1)),
                   default="0.5,0.7,0.8,0.9,0.95,0.98",
                   help="comma list of cosine thresholds of the saturation rule, in [-1, 1]")
    p.add_argument("--rules", type=comma_list(one_of(list(EXIT_RULE_TEXT))), default=None,
                   help="comma list of exit rules, side by side (default: softmax, gate and saturation, the gate "
                        "when the checkpoint has one); a rule asked for must apply to the checkpoint")
    p.add_argument("--batches", type=pos, default=4, help="validation batches")
    p.add_argument("--batch-size", type=pos, default=8, help="windows per batch")
    p.add_argument("--seq-len", type=two, default=256, help="tokens per window (>= 2)")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seeds the windows")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help=RUN_CACHE_HELP)
    machine(p)
    p.set_defaults(fn=eval_exits)

    p = sub.add_parser("loss", help="loss of one model (a checkpoint, or a pretrained one as loaded or converted) on "
                                    "the first --tokens of a validation split")
    p.add_argument("--model", type=path_arg, required=True, help="train.py checkpoint, hf:DIR, gguf:PATH or smollm2-135m")
    p.add_argument("--arch", default=None, choices=["vanilla", "recursive", "relaxed"],
                   help="pretrained source: convert to this architecture first (no training)")
    p.add_argument("--loops", type=number(int, min=2), default=None, help="B of the conversion (default 2)")
    p.add_argument("--init", default=None, choices=recursive.INITS, help="tying of the conversion")
    p.add_argument("--lora-rank", default=None, type=rank_or_full, help="relaxed: LoRA rank of every component, or "
                                                                        "'full' (the relaxed model is the source)")
    p.add_argument("--keep-layers", default=None, metavar="SPEC", help="pretrained source: keep only these layers "
                                                                       "(stepwise:K, lower:K, a comma list)")
    p.add_argument("--data", type=path_arg, default="stdlib",
                   help="corpus whose validation split is evaluated (train.py's --data)")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help="token cache directory")
    p.add_argument("--tokens", type=number(int, min=2), default=51200, help="evaluated tokens (the first of the split)")
    p.add_argument("--seq-len", type=two, default=512, help="tokens per window")
    p.add_argument("--batch-size", type=pos, default=4, help="windows per forward pass")
    p.add_argument("--results", type=path_arg, default=None, help="append the row as one JSON line to this file")
    machine(p)
    p.set_defaults(fn=eval_loss)

    p = sub.add_parser("energy", help="residual energy a rank-r SVD captures when relaxing a vanilla checkpoint")
    p.add_argument("--ckpt", type=path_arg, required=True, help="a vanilla checkpoint written by train.py")
    p.add_argument("--loops", type=number(int, min=2), default=2, help="number of loops B (>= 2: one loop has no "
                                                                         "residual)")
    p.add_argument("--init", default="average", choices=["stepwise", "average", "lower"], help="tying strategy")
    p.add_argument("--ranks", type=comma_list(pos), default="4,8,16,32,64,128", help="comma-separated ranks")
    p.add_argument("--threads", type=threads_arg, default=None, help="CPU threads (default: torch's)")
    p.set_defaults(fn=eval_energy)

    p = sub.add_parser("double-eval", help="validation losses of double and decoder-only checkpoints on the same "
                                           "windows (native and prefix-LM suffix); --sample: generations")
    p.add_argument("ckpt", type=path_arg, nargs="+", metavar="CKPT",
                   help="train.py checkpoints (double, vanilla); the first is the reference of the paired differences")
    p.add_argument("--batches", type=pos, default=50, help="validation batches")
    p.add_argument("--batch-size", type=pos, default=16, help="sequences per batch")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seeds the windows, the splits and the samples")
    p.add_argument("--sample", default=None, metavar="PROMPT", help="instead: generate from each checkpoint")
    p.add_argument("--new-tokens", type=pos, default=128, help="--sample: generated tokens")
    p.add_argument("--rollover", type=pos, default=None, help="--sample: the double decoder folds its block into the "
                                                              "context every N tokens")
    p.add_argument("--temperature", type=temperature_arg, default=0.8, help="--sample: temperature (0 = greedy)")
    p.add_argument("--top-k", type=pos, default=50, help="--sample: top-k")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help=RUN_CACHE_HELP)
    machine(p)
    p.set_defaults(fn=eval_double)

    p = sub.add_parser("block", help="validation loss of Block Transformer and vanilla checkpoints on the block "
                                     "model's targets")
    p.add_argument("--eval", type=path_arg, nargs="+", required=True, metavar="CKPT",
                   help="block and vanilla checkpoints (at least one Block Transformer: its targets are evaluated)")
    p.add_argument("--eval-batches", type=pos, default=20, help="validation batches")
    p.add_argument("--eval-batch-size", type=pos, default=16, help="windows per batch")
    p.add_argument("--seq-len", type=pos, default=256, help="tokens per window (a multiple of L_B)")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seeds the windows and the padding layout")
    p.add_argument("--cache-dir", type=path_arg, default="data_cache", help=RUN_CACHE_HELP)
    machine(p)
    p.set_defaults(fn=eval_block_targets)
    return ap


def run(argv=None):
    return run_subcommand(build_parser(), argv)


def main(argv=None):
    """The command: a mistake (a flag, a file, a checkpoint) is one line `error: ...` and exit code 2 (cli.run_cli)."""
    return run_cli(run, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt again (run_cli's)
    main()
