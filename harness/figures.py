"""
figures.py -- each paper's central figure, drawn from a record of the code as it runs (`python bench.py figures
[--out DIR]`).

Each figure runs its mechanism on a tiny model and records what the code did, on the path that serves, decodes or
trains, through a hook the harness attaches from outside (the paper files hold no line for it: a model nobody records
records nothing and pays nothing). It prints the record as a text grid and, where matplotlib is installed, draws it as
a PNG (OUT/<name>.png; docs/figures/ holds the ones this command made):

  depthwise  Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672), Figure 3: the same requests through
             static batching, continuous sequence-wise batching (both the vanilla model), continuous depth-wise
             batching without and with early exit (its recursive conversion), on one time axis in loop-steps: a
             vanilla pass runs every layer (as wide as the loops), a depth-wise pass one loop. Each server runs with a
             serve_hooks.ScheduleTrace as its hook (serve.Hook): every forward pass, the request each slot held, the loop it
             ran, where a token left.
  plt        Parallel Loop Transformer (Wu et al., arXiv:2510.24824), Algorithm 1 and Algorithm 3: the L rows of
             every decode forward, the keys each row read (the shared loop-1 cache; the loop's own window of w keys)
             and the gate that mixes the two attentions. A forward pre-hook on every layer's attention (on_calls)
             reads the step the layer receives: its mask, the ring's positions, the rows' queries.
  block      Block Transformer (Ho et al., arXiv:2406.02657), Figure 1: the two levels. The block decoder's and the
             token decoder's KV caches are recording caches (RecordingCache): for every generated token, the blocks
             the block decoder read for its block's context, and the entries the token decoder read to predict it
             (its own block's prefix vectors and the block's earlier tokens).
  double     Block-Based Double Decoders (Alexander et al., arXiv:2605.18807), Figure 2: the doubly-causal mask of
             training (one forward, one partition: every context-response pair at once) beside the mask of
             generation. A forward pre-hook on every generation layer's attention records the masks it attends under
             (kernels.dual_masks of the ids it receives, what kernels.dual_attention builds).

Random weights: none of these schedules or masks depends on what a model learned, except where a depth-wise token
leaves its loops; those exits are SIMULATED by a max-softmax threshold at which about half of the prompt tokens leave
after the first loop (bench_serve.exit_threshold_for, as in serve.py's demo). tests/test_figures.py checks every record
against the paper's rule, written out independently, and that a record changes when its mechanism is broken.

Run:
    python bench.py figures                  # the four as text; PNGs into docs/figures/ (with matplotlib)
    python bench.py figures --out /tmp/figs
"""
from __future__ import annotations

import copy
import io
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

import kernels
import serve
from block_transformer import BlockConfig, BlockTransformer
from double_decoder import DoubleConfig, DoubleDecoder, splits_to_blk
from harness.bench_serve import exit_threshold_for
from harness.cli import check_writable_dir, write_atomic
from harness.serve_hooks import SCHEDULE_LEGEND, ScheduleTrace
from harness.serve_requests import synthetic_requests
from model import GPT, GPTConfig, KVCache, LayerCache
from plt import PLT, PLTConfig
from recursive import from_vanilla

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "figures"
TINY = dict(n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=64, vocab_size=96, max_seq_len=64)  # every figure's width


@contextmanager
def on_calls(modules, record):
    """While open: record(i, module, args, kwargs) at every call of the i-th of `modules`, before it runs (torch's
    forward pre-hooks, with the keyword arguments). The hooks are removed on exit."""
    def hook(i, module, args, kwargs):  # returns None: the module runs on its inputs unchanged
        record(i, module, args, kwargs)

    handles = [m.register_forward_pre_hook(partial(hook, i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------------------
# Relaxed Recursive Transformers, Figure 3: static, continuous and depth-wise batching on one time axis

PANELS = (  # (label, what it does); (a), (c), (d) are the paper's (a), (b), (c)
    ("(a) static batching", "vanilla model, a new batch once every slot is free"),
    ("(b) continuous batching", "vanilla model, a freed slot refilled at the next pass"),
    ("(c) depth-wise batching", "recursive model, one loop a pass, no exit: slots free as in (b)"),
    ("(d) depth-wise batching + early exit", "a token may leave after loop 1"),
)


def pass_width(kind: str, cells, loops: int) -> int:
    """A pass's length on the time axis, in loop-steps (one loop-step: one pass of one loop's layers): a depth-wise
    decode step runs ONE loop; a prefill chunk and a vanilla decode step run every layer, i.e. `loops` loop-steps."""
    depthwise_step = kind == "decode" and any(c is not None and isinstance(c[1], int) for c in cells)
    return 1 if depthwise_step else loops


def depthwise(n_requests=7, slots=3, loops=3, chunk=4, seed=3) -> dict:
    """The same requests (all waiting at time 0, prompts of 2-4 tokens prefilled in one chunk, 2-8 new tokens) through
    four servers: the `loops`-layer vanilla model with static and with continuous batching, its recursive conversion
    (`loops` loops of one shared layer) depth-wise without and with (simulated) early exit; each with a ScheduleTrace.
    -> {"threshold", "loops", "chunk", "slots", "models": (vanilla, recursive), "requests", "panels": [{"label",
    "about", "name", "trace", "served", "widths" (per pass, loop-steps), "loop_steps", "tokens"}]}."""
    torch.manual_seed(seed)
    van = GPT(GPTConfig(n_layer=loops, **TINY)).eval()
    rec = from_vanilla(van, loops, "average", log=lambda *_: None).eval()
    reqs = synthetic_requests(n_requests, TINY["vocab_size"], "2:4", "2:8", "all", seed=seed)
    thr = exit_threshold_for(rec, [r.prompt for r in reqs], 0.5, "softmax")
    servers = (serve.ContinuousServer(van, slots, static=True, prefill_chunk=chunk),
               serve.ContinuousServer(van, slots, prefill_chunk=chunk),
               serve.DepthWiseServer(rec, slots, None, prefill_chunk=chunk),
               serve.DepthWiseServer(rec, slots, thr, "softmax", prefill_chunk=chunk))
    panels = []
    for (label, about), srv in zip(PANELS, servers):
        srv.hook = trace = ScheduleTrace()
        served = srv.run(reqs, clock="step")
        trace.server_name = label  # the grid's title (the server's name holds the raw threshold)
        widths = [pass_width(kind, cells, loops) for kind, cells in trace.passes]
        panels.append(dict(label=label, about=about, name=srv.name, trace=trace, served=served, widths=widths,
                           loop_steps=sum(widths), tokens=sum(len(r.output) for r in served)))
    return dict(threshold=thr, loops=loops, chunk=chunk, slots=slots, models=(van, rec), requests=reqs, panels=panels)


def early_exits(d) -> tuple[int, int]:
    """(decoded tokens that left after loop 1, decoded tokens) of the run with exits (a prefill's token runs every
    loop)."""
    exits = [e for r in d["panels"][-1]["served"] for e in r.exits[1:]]
    return sum(e == 0 for e in exits), len(exits)


def depthwise_text(d) -> str:
    left, decoded = early_exits(d)
    head = (f"Relaxed Recursive Transformers, Figure 3, traced from serve.py: {len(d['requests'])} requests waiting at "
            f"time 0, {d['slots']} slots; the vanilla model has {d['loops']} layers,\nthe recursive one {d['loops']} "
            f"loops of one shared layer (converted from it). Time in loop-steps: a depth-wise decode step is one loop "
            f"(1 loop-step),\na vanilla step or a prefill chunk every layer ({d['loops']} loop-steps). Exits simulated "
            f"(random weights): {left} of {decoded} decoded tokens leave after loop 1.")
    parts = [head, SCHEDULE_LEGEND]
    for p in d["panels"]:
        parts.append(f"{p['label']} -- {p['about']}: {p['loop_steps']} loop-steps, {p['tokens']} tokens\n"
                     f"{p['trace'].text()}")
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Parallel Loop Transformer, Algorithms 1 and 3: the rows of a decode forward, the keys they read, the gate


def plt_forwards(prompt_len=4, new_tokens=5, loops=3, window=3, n_layer=2, seed=0) -> dict:
    """A PLT (CLP, first-loop KV sharing, G-SWA) generates from a random prompt while a pre-hook on every layer's
    attention records each CLP decode step: the position i, the L rows, the keys of the shared cache under the step's
    mask, the ring positions under the window rule (kernels.ring_window_mask), and each later row's gate g per head
    (kernels.plt_gate of the row's query, as G-SWA computes it). The gates are drawn at random like every other
    weight (a new model's gate is g = 0.5 everywhere), so that the mix shows.
    -> {"prompt_len", "loops", "window", "n_layer", "model", "tokens" (prompt + generated), "forwards": [{"pos": i,
    "rows": L, "layers": [(shared key positions, own-window key positions) per layer], "gates": [[g per head] per
    row 1..L-1] of layer 0}]}, one entry per decode forward."""
    torch.manual_seed(seed)
    m = PLT(PLTConfig(n_layer=n_layer, n_loops=loops, window=window, **TINY)).eval()
    for block in m.blocks:
        torch.nn.init.normal_(block.attn.gate_w, std=1.0)
        torch.nn.init.normal_(block.attn.gate_b, std=1.0)
    idx = torch.randint(0, TINY["vocab_size"] - 1, (1, prompt_len))
    log = []

    def record(_, attn, args, kw):
        if kw.get("mode") != "clp_step":
            return
        step, (x, rope) = kw["step"], args
        ring = step.cache.ring
        own = ring.pos[0][kernels.ring_window_mask(ring.pos, step.q_pos, attn.window)[0]]
        q = attn.project_q(x, rope, kw.get("lora_idx"))  # (B, H, L, D): row l = loop l+1
        log.append(dict(layer=kw["layer"], pos=int(step.q_pos[0]), rows=x.size(1),
                        shared=step.mask[0, 0, 0].nonzero().flatten().tolist(), own=sorted(own.tolist()),
                        gates=kernels.plt_gate(q[:, :, 1:], attn.gate_w, attn.gate_b)[0].T.tolist()))

    with on_calls([b.attn for b in m.blocks], record):
        tokens = m.generate(idx, new_tokens)
    forwards = []
    for r in log:
        if r["layer"] == 0:
            forwards.append(dict(pos=r["pos"], rows=r["rows"], layers=[], gates=r["gates"]))
        forwards[-1]["layers"].append((r["shared"], r["own"]))
    return dict(prompt_len=prompt_len, loops=loops, window=window, n_layer=n_layer, forwards=forwards, model=m,
                tokens=tokens)


def plt_text(d) -> str:
    last = d["forwards"][-1]["pos"]
    keys = "".join(str(j % 10) for j in range(last + 1))
    w = max(last + 1, 20) + 2  # a key panel's width
    own = f"own window (w = {d['window']})"
    lines = [f"Parallel Loop Transformer, Algorithms 1 and 3 (L = {d['loops']} loops, window w = {d['window']}), "
             f"traced from plt.py: the prompt is positions 0..{d['prompt_len'] - 1}.\nEach decode forward runs L rows "
             f"at ONE position i: loop l at i from e_i + h^(l-1)_(i-1) (Algorithm 1's B_(l-1), which the paper names "
             f"by token i-l+1's chain).\n# = a key the row read, recorded from the step each attention received "
             f"(layer 0 of {d['n_layer']}; every layer read the same);\ng = the gate of loops >= 2 per head: y = g * "
             f"y_local(own window) + (1 - g) * y_global(shared cache)",
             f"{'forward':8s}{'pos':>4s}  {'loop':5s}{'shared loop-1 cache':{w}s}{own:{w}s}g per head",
             f"{'':19s}{keys:{w}s}{keys:{w}s}"]
    for f, fw in enumerate(d["forwards"], 1):
        shared, own = fw["layers"][0]
        for row in range(fw["rows"]):
            read_own = set(own) if row else set()
            lead = f"{f:<8d}{fw['pos']:>4d}  " if row == 0 else " " * 14
            gate = " ".join(f"{g:.2f}" for g in fw["gates"][row - 1]) if row else "-"
            lines.append(f"{lead}{row + 1:<5d}{''.join('#' if j in shared else '.' for j in range(last + 1)):{w}s}"
                         f"{''.join('#' if j in read_own else '.' for j in range(last + 1)):{w}s}{gate}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Block Transformer, Figure 1: the two levels, and what each generated token was predicted from


class RecordingCache(KVCache):
    """A KVCache whose layer views log what a decoder's cached step did in its first layer, for batch row 0: (name,
    'write', positions written) and (name, 'read', keys read back). recording_cache() turns a cache into one."""

    def layer(self, layer, rows=None):
        return RecordingLayer(self, layer, self.all_rows if rows is None else rows)


class RecordingLayer(LayerCache):
    """A LayerCache that logs its writes and reads (RecordingCache), then does them."""

    def write(self, pos, k, v, where=None):
        if self.layer == 0:
            self.cache.log.append((self.cache.name, "write", pos[0].tolist()))
        super().write(pos, k, v, where)

    def read(self, kv_len):
        if self.layer == 0:
            self.cache.log.append((self.cache.name, "read", kv_len))
        return super().read(kv_len)


def recording_cache(cache: KVCache, name: str, log: list) -> RecordingCache:
    """The same cache (its tensors shared, not copied), logging into `log` under `name`."""
    rec = copy.copy(cache)
    rec.__class__, rec.name, rec.log = RecordingCache, name, log
    return rec


def block_fields(prompt_blocks=2, new_tokens=11, seed=0) -> dict:
    """A Block Transformer (L_B = 4, P = 2 prefix vectors) generates after a prompt of whole blocks, on a BlockCache
    whose two KV caches record (recording_cache) and with every decode step marked in the log. Each pass -- the
    prefill, then each decode step -- predicts one token g; the token decoder's entries are labelled by what wrote
    them: the j-th written after the block decoder ran (a block's start) ('prefix', block of g, j), else ('token', p)
    by the step that fed token p. A fresh pass (the prefill, a block's start: causal over what it writes, nothing read
    back) reads what it wrote.
    -> {"prompt_len", "block_len", "prefix_len", "model", "tokens" (prompt + generated), "fields": [{"token": g,
    "block_keys": [blocks], "token_keys": [labels]}]}: the block decoder's keys are those of the last block-decoder
    pass before g."""
    torch.manual_seed(seed)
    m = BlockTransformer(BlockConfig(n_layer=1, block_len=4, prefix_len=2, **TINY)).eval()
    L, P, T0 = m.config.block_len, m.config.prefix_len, prompt_blocks * m.config.block_len
    idx = torch.randint(0, TINY["vocab_size"] - 1, (1, T0))
    cache, log = m.new_cache(1, T0 + new_tokens), []
    cache.blocks, cache.local = recording_cache(cache.blocks, "block", log), recording_cache(cache.local, "token", log)
    step = m.decode_step
    m.decode_step = lambda tok, cache, **kw: (log.append(("step",)), step(tok, cache, **kw))[1]
    try:
        tokens = m.generate(idx, new_tokens, cache=cache)
    finally:
        del m.decode_step
    passes = [[]]  # the log cut at the step marks: the prefill, then one list per decode step
    for e in log:
        if e == ("step",):
            passes.append([])
        else:
            passes[-1].append(e)
    local, fields, block_keys = {}, [], []
    for k, events in enumerate(passes):
        g = T0 + k  # the token this pass predicts (pass k > 0 fed token g - 1)
        wrote = {"token": [], "block": []}
        token_keys = None
        for name, kind, x in events:
            if kind == "write":
                wrote[name] += x
                for j, i in enumerate(x if name == "token" else ()):  # after the block decoder: a block's start
                    local[i] = ("prefix", g // L, j) if wrote["block"] else ("token", g - 1)
            elif name == "token":
                token_keys = [local[i] for i in range(x)]
            else:
                block_keys = list(range(x))
        if wrote["block"] and not any(name == "block" and kind == "read" for name, kind, _ in events):
            block_keys = sorted(wrote["block"])  # the prefill: the block decoder causally over the prompt's blocks
        fields.append(dict(token=g, block_keys=block_keys,
                           token_keys=token_keys if token_keys is not None else [local[i] for i in wrote["token"]]))
    return dict(prompt_len=T0, block_len=L, prefix_len=P, fields=fields, model=m, tokens=tokens)


def block_text(d) -> str:
    L, P, n = d["block_len"], d["prefix_len"], d["fields"][-1]["token"] + 1
    blocks = range(0, -(-n // L))
    lines = [f"Block Transformer, Figure 1 (L_B = {L}, P = {P} prefix vectors), traced from block_transformer.py's "
             f"KV caches: the prompt is blocks 0..{d['prompt_len'] // L - 1}.\nPer generated token, what was read to "
             f"predict it. Block decoder (global): = a block whose embedding it read (for the context of the token's "
             f"block).\nToken decoder (local), per block its own P prefix vectors then its tokens: P a prefix vector "
             f"read, o a token read, ^ the predicted token;\n- the prompt's blocks, which the token decoder never runs "
             f"on",
             f"{'token':>5s}  {'block decoder':14s}" + " ".join(f"{'b' + str(b):{P + L}s}" for b in blocks),
             f"{'':5s}  {''.join(str(b) for b in blocks):14s}" + " ".join(
                 "p" * P + "".join(str(p % 10) for p in range(b * L, min(b * L + L, n))) for b in blocks)]
    for f in d["fields"]:
        g = f["token"]
        toks = {lab[1] for lab in f["token_keys"] if lab[0] == "token"}
        cells = []
        for b in blocks:
            if b * L < d["prompt_len"]:
                cells.append("-" * (P + L))
                continue
            prefix = "".join("P" if ("prefix", b, j) in f["token_keys"] else "." for j in range(P))
            cells.append(prefix + "".join("^" if p == g else "o" if p in toks else "."
                                          for p in range(b * L, min(b * L + L, n))))
        lines.append(f"{g:>5d}  {''.join('=' if b in f['block_keys'] else '.' for b in blocks):14s}" + " ".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Block-Based Double Decoders, Figure 2: the doubly-causal mask of training, and of generation

PAPER_TOKENS = ("BOS", "A", "B", "C", "D", "E", "F")  # Figure 2's sentence, and its partition (0, 2, 5, 7):
PAPER_SPLITS = (2, 5)  # blocks [BOS, A], [B, C, D], [E, F]: three context-response pairs in one forward


@contextmanager
def dual_masks_of(model: DoubleDecoder, log: list):
    """While open: every call of a generation layer's attention appends {"layer", "rows": [{"pos": query position,
    "self": self-key positions visible, "cross": positions of the context latents visible}]} for batch row 0, the
    masks kernels.dual_masks makes of the ids the layer receives (kernels.dual_attention's). Cross key j is the
    latent of position j, in training (all T latents) and in a cached step (the context's) alike."""
    def record(i, attn, args, kw):
        ids = kw["ids"]
        m_self, m_cross = kernels.dual_masks(ids.q_pos, ids.q_blk, ids.s_pos, ids.s_blk, ids.c_blk)
        s_pos = ids.s_pos[0]
        log.append(dict(layer=i, rows=[dict(pos=int(p), self=s_pos[m_self[0, 0, t]].tolist(),
                                            cross=m_cross[0, 0, t].nonzero().flatten().tolist())
                                       for t, p in enumerate(ids.q_pos[0])]))

    with on_calls([b.attn for b in model.gen_blocks], record):
        yield


def by_layer(log: list) -> list[list[dict]]:
    """The rows of every record, gathered per generation layer, in order."""
    layers = {}
    for r in log:
        layers.setdefault(r["layer"], []).extend(r["rows"])
    return [layers[i] for i in sorted(layers)]


def double_masks(generation=((3, 3, 5), (1, 4, 11)), seed=0) -> dict:
    """A double decoder (1 context + 2 generation layers) runs the training forward over 7 random tokens with the
    partition of the paper's Figure 2, then generates from random prompts, one run per (prompt length, rollover N,
    new tokens), each with dual_masks_of on. The first generation setting is the paper's partition again: the prompt
    [BOS, A, B] makes [BOS, A] the context and B the first token of a block of N = 3.
    -> {"model", "training": {"tokens", "splits", "layers": [rows per layer]}, "generation": [{"prompt_len",
    "rollover", "new_tokens", "tokens" (prompt + generated), "layers": [rows per layer]}]}; rows as dual_masks_of."""
    torch.manual_seed(seed)
    m = DoubleDecoder(DoubleConfig(ctx_layers=1, gen_layers=2, **TINY)).eval()
    T = len(PAPER_TOKENS)
    idx = torch.randint(0, TINY["vocab_size"] - 1, (1, T))
    log = []
    with dual_masks_of(m, log):
        m(idx, blk=splits_to_blk(PAPER_SPLITS, T))
    out = dict(model=m, training=dict(tokens=idx, splits=PAPER_SPLITS, layers=by_layer(log)), generation=[])
    for prompt_len, rollover, new in generation:
        idx = torch.randint(0, TINY["vocab_size"] - 1, (1, prompt_len))
        log = []
        with dual_masks_of(m, log):
            tokens = m.generate(idx, new, rollover=rollover)
        out["generation"].append(dict(prompt_len=prompt_len, rollover=rollover, new_tokens=new, tokens=tokens,
                                      layers=by_layer(log)))
    return out


def mask_lines(rows, n, names=None) -> list[str]:
    """One text line per query row over key positions 0..n-1: x a context latent (cross), s a self key, . hidden."""
    name = (lambda p: names[p]) if names else str
    lines = [f"{'query':>6s}  " + "".join(str(p % 10) for p in range(n))]
    for r in rows:
        lines.append(f"{name(r['pos']):>6s}  " + "".join("x" if p in r["cross"] else "s" if p in r["self"] else "."
                                                        for p in range(n)))
    return lines


def double_text(d) -> str:
    tr = d["training"]
    lines = ["Block-Based Double Decoders, Figure 2, traced from double_decoder.py's attention (kernels.dual_masks of "
             "the ids each generation layer receives; every layer the same).\nOne row per query position: x = a "
             "context latent it attends (cross key: an earlier block), s = a key of its own block (self, causal), "
             ". = hidden",
             f"\ntraining: ONE forward over {' '.join(PAPER_TOKENS)} with the partition (0, "
             f"{', '.join(map(str, tr['splits']))}, {len(PAPER_TOKENS)}): every context-response pair at once"]
    lines += mask_lines(tr["layers"][0], len(PAPER_TOKENS), PAPER_TOKENS)
    for s in d["generation"]:
        rows = s["layers"][0]
        n = rows[-1]["pos"] + 1
        names = PAPER_TOKENS if n <= len(PAPER_TOKENS) else None
        lines += [f"\ngeneration: a prompt of {s['prompt_len']} token{'s' * (s['prompt_len'] > 1)} (its last one opens "
                  f"the first block), a new block every {s['rollover']} tokens:"] + mask_lines(rows, n, names)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Drawings (matplotlib, when installed): one PNG per figure, 10 inches wide at FONT points, so that the text stays
# legible when a repository page shows the PNG about 900 pixels wide (a point then is ~1.25 pixels).

FONT, SMALL, WIDTH, DPI = 11, 10, 10.0, 120


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def _cell(ax, x, y, color, text="", edge=None, bold=False, w=1.0, h=1.0, size=SMALL, hatch=None, text_color="black"):
    """One cell: the w x h box at (x, y), its text centred; an outlined cell sits above its neighbours."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge or "white", lw=2.0 if edge else 0.8,
                           zorder=3 if edge else 2, hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=text_color,
                weight="bold" if bold else "normal", zorder=4)


def _grid(ax, cols, rows, xlabel="", title="", size=SMALL):
    """The axes of a grid of cells: cols / rows the labels of its columns (x = 0, 1, ...) and rows (y, top down)."""
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([x + 0.5 for x in range(len(cols))], cols, fontsize=size)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], rows, fontsize=size)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel(xlabel, fontsize=size)
    ax.set_title(title, fontsize=FONT, loc="left")


def _legend(fig, entries, y=0.0, ncol=None):
    """A legend (label, face colour, edge colour) along the bottom of the figure."""
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor=face, edgecolor=edge, label=label) for label, face, edge in entries],
               loc="lower center", ncol=ncol or len(entries), fontsize=SMALL, frameon=False, bbox_to_anchor=(0.5, y),
               handlelength=1.4, columnspacing=1.2)


def _save(pyplot, fig, path: Path):
    """The PNG, written atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    pyplot.close(fig)
    write_atomic(path, buf.getvalue())


STAGE = ["#c6dbef", "#6baed6", "#2171b5", "#08306b"]  # loop l of a recursive model = layer l of the vanilla one
STAGE_TEXT = ["black", "black", "white", "white"]
PROMPT, HELD, LEFT = "#bdbdbd", "#f0f0f0", "black"
CROSS = PREFIX = "#9e9ac8"  # what comes from the other level: a context latent, a prefix vector
SELF, READ, BLOCK_READ, PREDICTED, LOCAL = "#41ab5d", "#238b45", "#c7e9c0", "#fec44f", "#fd8d3c"


def draw_depthwise(pyplot, d, path):
    L, S, panels = d["loops"], d["slots"], d["panels"]
    end = max(p["loop_steps"] for p in panels)
    fig, axes = pyplot.subplots(len(panels), 1, figsize=(WIDTH, 1.45 * len(panels) + 1.9), sharex=True)
    for ax, p in zip(axes, panels):
        t, held = 0, [None] * S  # the time (loop-steps) where the pass starts; the request each slot held last
        for (kind, cells), w in zip(p["trace"].passes, p["widths"]):
            for s, cell in enumerate(cells):
                if cell is None:
                    continue
                rid, what, left = cell
                if held[s] is not None and held[s] != rid:  # a refill: the slot's next request
                    ax.plot([t, t], [s + 0.02, s + 0.98], color="red", lw=2.5, zorder=5)
                held[s] = rid
                letter = chr(ord("a") + rid % 26)
                letter = letter.upper() if left else letter
                if what is None:
                    _cell(ax, t, s, HELD, w=w)
                elif what == "p":
                    _cell(ax, t, s, PROMPT, letter, LEFT if left else None, left, w=w)
                elif what == "all":  # one vanilla pass: the L layers one after another
                    for k in range(w):
                        _cell(ax, t + k, s, STAGE[k])
                    _cell(ax, t, s, "none", letter, LEFT if left else None, left, w=w)
                else:  # one depth-wise row: the loop it ran
                    _cell(ax, t, s, STAGE[what], letter, LEFT if left else None, left, text_color=STAGE_TEXT[what])
            t += w
        ax.set_ylim(S, 0)
        ax.set_yticks([s + 0.5 for s in range(S)], [f"slot {s}" for s in range(S)], fontsize=SMALL)
        ax.tick_params(length=0, labelsize=SMALL)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        about = p["about"] if p is not panels[-1] else "{} of {} decoded tokens leave after loop 1 (simulated)".format(
            *early_exits(d))
        ax.set_title(f"{p['label']}: {about}", fontsize=FONT, loc="left")
        ax.text(1.015, 0.5, f"{p['loop_steps']} loop-steps\n{p['tokens']} tokens", transform=ax.transAxes,
                va="center", ha="left", fontsize=FONT, weight="bold")
    axes[-1].set_xlim(0, end)
    axes[-1].set_xticks(range(0, end + 1, 2 * L))
    axes[-1].set_xlabel(f"time in loop-steps: a depth-wise step runs one loop (1 loop-step),\na vanilla step or a "
                        f"prefill chunk all {L} layers ({L} loop-steps)", fontsize=SMALL)
    fig.suptitle(f"Relaxed Recursive Transformers, Figure 3: the same {len(d['requests'])} requests through four "
                 f"servers, traced from serve.py\n{S} slots, all requests queued at time 0; a letter is a request, "
                 f"UPPERCASE where its token leaves\n(a), (c) and (d) are the paper's panels (a), (b) and (c); (b) is "
                 f"the continuous batching its text compares with", fontsize=FONT, x=0.01, ha="left")
    _legend(fig, [(f"loop / layer {i + 1}", STAGE[i], STAGE[i]) for i in range(L)]
            + [("prompt chunk", PROMPT, PROMPT), ("a token leaves", "white", LEFT),
               ("held, not in the pass", HELD, HELD), ("refill", "red", "red")], ncol=4)
    fig.subplots_adjust(left=0.08, right=0.85, top=0.855, bottom=0.15, hspace=0.55)
    _save(pyplot, fig, path)


def draw_plt(pyplot, d, path):
    fws, L, n0, w = d["forwards"], d["loops"], d["prompt_len"], d["window"]
    last = fws[-1]["pos"]
    fig = pyplot.figure(figsize=(WIDTH, 7.2))
    gs = fig.add_gridspec(2, 3, width_ratios=[1, 1, 0.42], height_ratios=[1, 2.6], wspace=0.08, hspace=0.5)
    ax = fig.add_subplot(gs[0, :2])
    for f, fw in enumerate(fws):  # the schedule: one column per decode forward, one row per loop
        for row in range(fw["rows"]):
            _cell(ax, f, row, STAGE[row], f"$h^{{({row + 1})}}_{{{fw['pos']}}}$", size=FONT,
                  text_color=STAGE_TEXT[row])
            if f and row:  # h^(l-1)_(i-1), loop l-1's state in the forward before, feeds loop l at i
                ax.annotate("", (f + 0.3, row + 0.3), (f - 0.3, row - 0.3),
                            arrowprops=dict(arrowstyle="->", color="black", lw=1.2), zorder=6)
    _grid(ax, [f"forward at pos {fw['pos']}" for fw in fws], [f"loop {r + 1}" for r in range(L)],
          title=f"Algorithm 1: ONE forward per position i runs all {L} loops as rows; loop l reads "
                f"e$_i$ + h$^{{(l-1)}}_{{i-1}}$ (arrows)")
    rows = [(f, row) for f, fw in enumerate(fws) for row in range(fw["rows"])]
    labels = [f"pos {fws[f]['pos']}, loop {row + 1}" for f, row in rows]
    ax_g, ax_l, ax_m = (fig.add_subplot(gs[1, k]) for k in range(3))
    for y, (f, row) in enumerate(rows):
        shared, own = fws[f]["layers"][0]
        pos = fws[f]["pos"]
        for j in range(last + 1):
            future = HELD if j > pos else "white"
            _cell(ax_g, j, y, STAGE[1] if j in shared else future)
            if row:
                _cell(ax_l, j, y, LOCAL if j in own else future)
        if not row:
            _cell(ax_l, 0, y, "white", "loop 1: no window", w=last + 1, size=SMALL - 1)
        if row:
            gates = fws[f]["gates"][row - 1]
            for h, g in enumerate(gates):
                _cell(ax_m, h, y, pyplot.get_cmap("Oranges")(0.15 + 0.7 * g), f"{g:.2f}", size=SMALL)
        else:
            _cell(ax_m, 0, y, "white", "loop 1: no gate", w=len(fws[f]["gates"][0]), size=SMALL - 1)
        for axis in (ax_g, ax_l):
            if y and row == 0:
                axis.axhline(y, color="black", lw=1.2, zorder=6)
    keys = [str(j) for j in range(last + 1)]
    _grid(ax_g, keys, labels, "key position", "y$_{global}$ = Attn(q, K$_{share}$, V$_{share}$)")
    _grid(ax_l, keys, [""] * len(rows), "key position", f"y$_{{local}}$ = SWA(q, own K, V), w = {w}")
    _grid(ax_m, [f"head {h}" for h in range(len(fws[0]["gates"][0]))], [""] * len(rows), "",
          "g = $\\sigma$(f$_{gate}$(q))")
    fig.text(0.13, 0.615, "Algorithm 3, each row's attention: y = g $\\cdot$ y$_{local}$ + (1 - g) $\\cdot$ "
             "y$_{global}$ (loop 1: y$_{global}$ alone)", fontsize=FONT, weight="bold")
    for axis in (ax_g, ax_l):
        axis.axvline(n0, color="gray", lw=1.2, ls="--", zorder=6)
    fig.suptitle(f"Parallel Loop Transformer, Algorithms 1 and 3 (L = {L} loops, window w = {w}), traced from plt.py's "
                 f"decode forwards\nlayer 0; the prompt is positions 0..{n0 - 1} (left of the dashed line); random "
                 f"weights, the gates too", fontsize=FONT, x=0.01, ha="left")
    _legend(fig, [("shared loop-1 key read", STAGE[1], STAGE[1]), ("own-window key read", LOCAL, LOCAL),
                  ("not read", "white", "gray"), ("not yet written", HELD, HELD)])
    fig.subplots_adjust(left=0.13, right=0.99, top=0.86, bottom=0.11)
    _save(pyplot, fig, path)


def _box(ax, x0, x1, y, h, face, text="", edge="gray", lw=1.0, size=SMALL, hatch=None, z=2, text_color="black"):
    """A rounded box over x0..x1 (data units) at height y, its text centred."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x0 + 0.06, y), x1 - x0 - 0.12, h, boxstyle="round,pad=0,rounding_size=0.15",
                                facecolor=face, edgecolor=edge, lw=lw, hatch=hatch, zorder=z))
    if text:
        ax.text((x0 + x1) / 2, y + h / 2, text, ha="center", va="center", fontsize=size, zorder=z + 1,
                color=text_color)


def _arrow(ax, a, b, color="gray", lw=1.0, rad=0.0, z=1):
    ax.annotate("", b, a, arrowprops=dict(arrowstyle="-|>", color=color, lw=lw, shrinkA=0, shrinkB=0,
                                          connectionstyle=f"arc3,rad={rad}"), zorder=z)


def draw_block(pyplot, d, path):
    L, P, fields, T0 = d["block_len"], d["prefix_len"], d["fields"], d["prompt_len"]
    n = fields[-1]["token"] + 1
    nb, b0 = -(-n // L), T0 // L  # blocks; the first generated block
    one = fields[-1]  # the receptive field of the last token, as the paper draws it
    g, bg = one["token"], one["token"] // L
    R = P + L + 1  # a block's width in the diagram: its P prefix entries, its L tokens, a gap

    def x_tok(p):
        return (p // L) * R + P + p % L

    fig = pyplot.figure(figsize=(WIDTH, 9.4))
    gs = fig.add_gridspec(2, 2, height_ratios=[1.25, 1], width_ratios=[nb + 1, (nb - b0) * (P + L)],
                          wspace=0.12, hspace=0.3)
    ax = fig.add_subplot(gs[0, :])
    ax.set_xlim(-3.4, nb * R)
    ax.set_ylim(-0.3, 8.2)
    ax.axis("off")
    field = "#2ca02c"  # the receptive field's outline (the paper's green line)
    rows = dict(tok=0.0, emb=1.7, blk=3.4, loc=5.3, out=7.0)
    for name, y in (("tokens", rows["tok"]), ("embedder", rows["emb"]), ("block\ndecoder", rows["blk"]),
                    ("token\ndecoder", rows["loc"]), ("predicted", rows["out"])):
        ax.text(-3.3, y + 0.4, name, ha="left", va="center", fontsize=SMALL, weight="bold")
    for p in range(n - 1):  # the inputs: every token before the last
        read = ("token", p) in one["token_keys"]
        _cell(ax, x_tok(p), rows["tok"], PROMPT if p < T0 else "white", str(p), field if read else "gray",
              h=0.8, size=SMALL)
    for b in range(nb):
        if (b + 1) * L <= n - 1:  # a finished block: the embedder makes its embedding, the block decoder reads it
            lo, hi = b * R + P, b * R + P + L
            read = b in one["block_keys"]
            _box(ax, lo, hi, rows["emb"], 0.8, BLOCK_READ if read else "white", f"embedding {b}",
                 field if read else "gray", 2.2 if read else 1.0, size=SMALL - 1)
            _arrow(ax, ((lo + hi) / 2, rows["tok"] + 0.85), ((lo + hi) / 2, rows["emb"] - 0.02))
            _box(ax, lo, hi, rows["blk"], 0.8, BLOCK_READ if read else "white", f"context {b}",
                 field if b == bg - 1 else "gray", 2.2 if b == bg - 1 else 1.0, size=SMALL - 1)
            _arrow(ax, ((lo + hi) / 2, rows["emb"] + 0.85), ((lo + hi) / 2, rows["blk"] - 0.02))
            if b:  # causal over blocks: context b reads the embeddings of blocks 0..b
                _arrow(ax, (lo - R + L / 2 + 0.3, rows["blk"] + 0.4), (lo - 0.05, rows["blk"] + 0.4), rad=0.0)
        if b < b0:
            _box(ax, b * R, b * R + P + L, rows["loc"], 0.8, HELD, "prompt: not run", "gray", hatch="//",
                 size=SMALL - 1)
            continue
        for j in range(P):  # block b's own prefix vectors, from the context of block b - 1
            read = ("prefix", b, j) in one["token_keys"]
            _cell(ax, b * R + j, rows["loc"], PREFIX, f"$P^{{{b}}}_{{{j + 1}}}$", field if read else "gray",
                  h=0.8, size=SMALL)
        _arrow(ax, ((b - 1) * R + P + L / 2, rows["blk"] + 0.85), (b * R + P / 2, rows["loc"] - 0.02), rad=-0.25,
               color=PREFIX, lw=1.6)
        for p in range(b * L, min(b * L + L, n)):
            if p < n - 1 and p % L < L - 1:  # the token decoder's entries: the block's tokens before its last
                read = ("token", p) in one["token_keys"]
                _cell(ax, x_tok(p) + 1, rows["loc"], READ if read else "white", str(p), field if read else "gray",
                      h=0.8, size=SMALL, text_color="white" if read else "black")
            _cell(ax, x_tok(p), rows["out"], PREDICTED if p == g else "white", str(p), "black" if p == g else "gray",
                  h=0.8, size=SMALL)
        ax.plot([b * R - 0.02, b * R + P + L + 0.02], [rows["loc"] + 0.95] * 2, color="gray", lw=0.8)
        _arrow(ax, (b * R + P + L / 2, rows["loc"] + 0.95), (b * R + P + L / 2, rows["out"] - 0.02))
    ax.set_title(f"The receptive field of token {g} (green): the block decoder read the embeddings of blocks "
                 f"{one['block_keys'][0]}..{one['block_keys'][-1]},\nthe token decoder only block {bg}'s own prefix "
                 f"vectors and its tokens before {g}", fontsize=FONT, loc="left")

    # every generated token: what each level read to predict it
    ax_b, ax_t = fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])
    for y, f in enumerate(fields):
        for b in range(nb):
            _cell(ax_b, b, y, BLOCK_READ if b in f["block_keys"] else "white", "")
        toks = {lab[1] for lab in f["token_keys"] if lab[0] == "token"}
        for k, b in enumerate(range(b0, nb)):
            x0 = k * (P + L)
            for j in range(P):
                _cell(ax_t, x0 + j, y, PREFIX if ("prefix", b, j) in f["token_keys"] else "white")
            for i, p in enumerate(range(b * L, min(b * L + L, n))):
                color = READ if p in toks else PREDICTED if p == f["token"] else "white"
                _cell(ax_t, x0 + P + i, y, color, "?" if p == f["token"] else "", "black" if p == f["token"] else None)
            ax_t.axvline(x0, color="black", lw=1.2, zorder=6)
    _grid(ax_b, [str(b) for b in range(nb)], [f"token {f['token']}" for f in fields], "block",
          "block decoder:\nembeddings read")
    cols = [lab for b in range(b0, nb) for lab in [f"$P^{{{b}}}_{{{j + 1}}}$" for j in range(P)]
            + [str(p) for p in range(b * L, min(b * L + L, n))]]
    _grid(ax_t, cols, [""] * len(fields), "its block's prefix vectors, then its tokens",
          f"token decoder: entries read (blocks {b0}..{nb - 1}; the prompt's blocks never enter it)")
    fig.suptitle(f"Block Transformer, Figure 1: global-to-local decoding, traced from block_transformer.py's KV "
                 f"caches\nL_B = {L} tokens a block, P = {P} prefix vectors; the prompt (shaded) is blocks "
                 f"0..{b0 - 1}; random weights", fontsize=FONT, x=0.01, ha="left")
    _legend(fig, [("block embedding read", BLOCK_READ, BLOCK_READ), ("prefix vector read", PREFIX, PREFIX),
                  ("token read", READ, READ), ("predicted", PREDICTED, "black"), ("prompt", PROMPT, PROMPT)])
    fig.subplots_adjust(left=0.08, right=0.99, top=0.87, bottom=0.08)
    _save(pyplot, fig, path)


def _mask_panel(ax, rows, n, names, title, context=None):
    """A doubly-causal mask: one row per query position (y = its position), x = key positions; `context`, the
    positions with no generation step (a prompt's context), hatched; lines where blocks begin."""
    by_pos = {r["pos"]: r for r in rows}
    if context:
        _cell(ax, 0, context[0], HELD, w=n, h=len(context), hatch="//")
        ax.text(n / 2, context[0] + len(context) / 2, f"the context {' '.join(names[p] for p in context)}: no step,\n"
                "the context decoder runs once over it", ha="center", va="center", fontsize=SMALL, zorder=7,
                bbox=dict(facecolor="white", edgecolor="gray", boxstyle="round"))
    for y in range(n):
        r = by_pos.get(y)
        if r is None:
            continue
        for p in range(n):
            _cell(ax, p, y, CROSS if p in r["cross"] else SELF if p in r["self"] else "white")
    starts = sorted({min(r["self"]) for r in rows})
    for b in starts:
        ax.axvline(b, color="black", lw=1.2, zorder=6)
        ax.axhline(b, color="black", lw=1.2, zorder=6)
    _grid(ax, list(names[:n]), list(names[:n]), "key (self: a token's own state; cross: its context latent)", title)
    ax.set_ylabel("query", fontsize=SMALL)


def draw_double(pyplot, d, path):
    tr, gen = d["training"], d["generation"][0]
    T = len(PAPER_TOKENS)
    fig, (a1, a2) = pyplot.subplots(1, 2, figsize=(WIDTH, 5.9))
    splits = ", ".join(map(str, tr["splits"]))
    _mask_panel(a1, tr["layers"][0], T, PAPER_TOKENS, f"training: ONE forward, partition (0, {splits}, {T}):\n"
                f"three context-response pairs at once")
    prompt = " ".join(PAPER_TOKENS[:gen["prompt_len"]])
    _mask_panel(a2, gen["layers"][0], T, PAPER_TOKENS, f"generation from the prompt {prompt},\n"
                f"a new block every {gen['rollover']} tokens: the same rows",
                context=list(range(gen["prompt_len"] - 1)))
    fig.suptitle("Block-Based Double Decoders, Figure 2: the doubly-causal block mask, traced from double_decoder.py's "
                 "attention\n(kernels.dual_masks of the ids each generation layer receives; positions named as in the "
                 "paper; random weights)", fontsize=FONT, x=0.01, ha="left")
    _legend(fig, [("cross key: a context latent of an earlier block", CROSS, CROSS),
                  ("self key: own block, causal", SELF, SELF), ("hidden", "white", "gray")])
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _save(pyplot, fig, path)


# ----------------------------------------------------------------------------------------------------------------
# The command: python bench.py figures [--out DIR]

FIGURES = {  # name -> (record, text, drawing)
    "depthwise": (depthwise, depthwise_text, draw_depthwise),
    "plt": (plt_forwards, plt_text, draw_plt),
    "block": (block_fields, block_text, draw_block),
    "double": (double_masks, double_text, draw_double),
}


@torch.no_grad()
def bench_figures(args) -> dict:
    """Every figure: record it, print it, draw it (OUT/<name>.png) when matplotlib is installed. -> {name: record}."""
    pyplot = _pyplot()
    out = Path(args.out)
    if pyplot is not None:
        check_writable_dir(out, "--out")
    t0, records = time.perf_counter(), {}
    for name, (record, text, draw) in FIGURES.items():
        records[name] = record()
        print(f"\n== {name}\n{text(records[name])}")
        if pyplot is not None:
            draw(pyplot, records[name], out / f"{name}.png")
    took = f"{len(FIGURES)} figures in {time.perf_counter() - t0:.1f} s"
    print(f"\n{took}: PNGs in {out}" if pyplot is not None else
          f"\n{took}, as text only: the PNGs need matplotlib (pip install matplotlib)")
    return records


def add_args(p):
    """The flags of `python bench.py figures` (p: its subparser)."""
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the PNGs (default: docs/figures of this "
                                                          "repository, the committed ones)")
    p.set_defaults(fn=bench_figures)
