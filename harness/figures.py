"""
figures.py -- each paper's central figure, drawn from a trace of the code (`python bench.py figures [--out DIR]`).

Each figure runs its mechanism on a tiny model and records what the code did, on the path that serves or decodes (a
hook or a recording cache; nothing re-derived beside it), prints the record as a text grid and, where matplotlib is
installed, draws it as a PNG (OUT/<name>.png; docs/figures/ holds the ones this command made):

  depthwise  Relaxed Recursive Transformers (Bae et al., arXiv:2410.20672), Figure 3: continuous depth-wise batching
             with early exit. serve.py's DepthWiseServer and ContinuousServer serve the same requests (Poisson arrivals
             counted in decode steps, prompts prefilled in chunks), each with a serve.ScheduleTrace as its hook: for
             every forward pass, the request each slot held, the loop it ran, where a token left, the prompt chunks.
  plt        Parallel Loop Transformer (Wu et al., arXiv:2510.24824), Algorithm 1 and Figure 2 (right): cross-loop
             parallel decoding. A PLTCache with a trace records, in every layer of every decode forward, the keys its
             L rows read: the shared first-loop cache (K_share, V_share) and each later loop's own window of w keys.
  block      Block Transformer (Ho et al., arXiv:2406.02657), Figure 1: the receptive field of a generated token. The
             block decoder's and the token decoder's KV caches are recording caches (RecordingCache): for every
             generated token, the blocks the block decoder read for its block's context, and the entries the token
             decoder read to predict it (the block's prefix vectors and the block's earlier tokens).
  double     Block-Based Double Decoders (Alexander et al., arXiv:2605.18807), Figure 2: the doubly-causal block mask
             of generation. A DoubleCache with a trace records the masks every generation step attends under
             (kernels.dual_masks, what kernels.dual_attention builds): the context latents of the earlier blocks and
             the own block causally, for a few prompt lengths and rollover block sizes.

Random weights: none of these schedules or masks depends on what a model learned, except where a depth-wise token
leaves its loops; those exits are SIMULATED by a max-softmax threshold at which about half of the prompt tokens leave
after the first loop (serve.exit_threshold_for, as in serve.py's demo). tests/test_figures.py checks every record
against the paper's rule, written out independently, and that a record changes when its mechanism is broken.

Run:
    python bench.py figures                  # the four as text; PNGs into docs/figures/ (with matplotlib)
    python bench.py figures --out /tmp/figs
"""
from __future__ import annotations

import copy
import io
import time
from pathlib import Path

import torch

import serve
from block_transformer import BlockConfig, BlockTransformer
from double_decoder import DoubleConfig, DoubleDecoder
from harness.cli import check_output_file, check_writable_dir, write_atomic
from harness.serve_requests import synthetic_requests
from model import GPT, GPTConfig, KVCache, LayerCache
from plt import PLT, PLTConfig
from recursive import from_vanilla

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "figures"
TINY = dict(n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=64, vocab_size=96, max_seq_len=64)  # every figure's width


# ----------------------------------------------------------------------------------------------------------------
# Relaxed Recursive Transformers, Figure 3: continuous depth-wise batching


def depthwise(n_requests=9, slots=3, loops=3, chunk=4, seed=0) -> dict:
    """The same requests (Poisson arrivals, 2-9 prompt tokens prefilled `chunk` at a time, 2-5 new tokens) through a
    depth-wise server with early exit (a recursive model of `loops` loops of one shared layer, converted from a
    `loops`-layer vanilla model) and a continuous one (that vanilla model), both with a ScheduleTrace. -> {"threshold",
    "loops", "chunk", "models": (vanilla, recursive), "requests", name: (trace, served requests)}."""
    torch.manual_seed(seed)
    van = GPT(GPTConfig(n_layer=loops, **TINY)).eval()
    rec = from_vanilla(van, loops, "average", log=lambda *_: None).eval()
    reqs = synthetic_requests(n_requests, TINY["vocab_size"], "2:9", "2:5", "poisson", rate=0.4, seed=seed)
    thr = serve.exit_threshold_for(rec, [r.prompt for r in reqs], 0.5, "softmax")
    out = dict(threshold=thr, loops=loops, chunk=chunk, models=(van, rec), requests=reqs)
    for srv in (serve.DepthWiseServer(rec, slots, thr, "softmax", prefill_chunk=chunk, hook=serve.ScheduleTrace()),
                serve.ContinuousServer(van, slots, prefill_chunk=chunk, hook=serve.ScheduleTrace())):
        out[srv.name] = (srv.hook, srv.run(reqs, clock="step"))
    return out


def depthwise_text(d) -> str:
    names = [k for k in d if k.startswith(("depth-wise", "vanilla"))]
    head = (f"Relaxed Recursive Transformers, Figure 3: continuous depth-wise batching with early exit, traced from "
            f"serve.py:\n{len(d['requests'])} requests arriving over the run (Poisson), prompts prefilled {d['chunk']} "
            f"tokens at a time; depth-wise: {d['loops']} loops of one shared layer,\nexits SIMULATED on random "
            f"weights by a max-softmax threshold {d['threshold']:.3g}; continuous: the {d['loops']}-layer vanilla "
            f"model")
    return "\n\n".join([head, serve.SCHEDULE_LEGEND] + [d[n][0].text() for n in names])


# ----------------------------------------------------------------------------------------------------------------
# Parallel Loop Transformer, Algorithm 1: which rows a decode forward runs and which keys they read


def plt_forwards(prompt_len=4, new_tokens=7, loops=3, window=3, n_layer=2, seed=0) -> dict:
    """A PLT (CLP, first-loop KV sharing, G-SWA) generates from a random prompt on a PLTCache whose trace is on.
    -> {"prompt_len", "loops", "window", "n_layer", "model", "tokens" (prompt + generated), "forwards": [{"pos": i,
    "rows": L, "layers": [(shared key positions, own-window key positions or None) per layer]}]}, one entry per
    decode forward."""
    torch.manual_seed(seed)
    m = PLT(PLTConfig(n_layer=n_layer, n_loops=loops, window=window, **TINY)).eval()
    idx = torch.randint(0, TINY["vocab_size"] - 1, (1, prompt_len))
    cache = m.new_cache(1, prompt_len + new_tokens)
    cache.trace = []
    tokens = m.generate(idx, new_tokens, cache=cache)
    forwards = []
    for r in cache.trace:
        if r["layer"] == 0:
            forwards.append(dict(pos=int(r["q_pos"][0]), rows=r["rows"], layers=[]))
        own = None if r["own"] is None else sorted(r["ring_pos"][0][r["own"][0]].tolist())
        forwards[-1]["layers"].append((r["shared"][0].nonzero().flatten().tolist(), own))
    return dict(prompt_len=prompt_len, loops=loops, window=window, n_layer=n_layer, forwards=forwards, model=m,
                tokens=tokens)


def plt_text(d) -> str:
    last = d["forwards"][-1]["pos"]
    keys = "".join(str(j % 10) for j in range(last + 1))
    w = max(last + 1, 20) + 2  # a key panel's width
    lines = [f"Parallel Loop Transformer, Algorithm 1 (L = {d['loops']} loops, window w = {d['window']}), traced from "
             f"plt.py: the prompt is positions 0..{d['prompt_len'] - 1}.\nEach decode forward runs its L rows at ONE "
             f"position i: row l = loop l+1 at i from e_i + h^(l)_(i-1), token i-l's chain (Algorithm 1's B_l).\n"
             f"# = a key the row read, recorded from the caches (layer 0 of {d['n_layer']}; every layer read the "
             f"same):",
             f"{'forward':8s}{'pos':>4s}  {'row':4s}{'loop':5s}{'chain':7s}{'shared loop-1 cache':{w}s}"
             f"own window (w = {d['window']})", f"{'':30s}{keys:{w}s}{keys}"]
    for f, fw in enumerate(d["forwards"], 1):
        shared, own = fw["layers"][0]
        for row in range(fw["rows"]):
            read_own = set(own or ()) if row else set()
            lead = f"{f:<8d}{fw['pos']:>4d}  " if row == 0 else " " * 14
            lines.append(f"{lead}{row:<4d}{row + 1:<5d}{'t' + str(fw['pos'] - row):7s}"
                         f"{''.join('#' if j in shared else '.' for j in range(last + 1)):{w}s}"
                         f"{''.join('#' if j in read_own else '.' for j in range(last + 1))}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Block Transformer, Figure 1: the receptive field of a generated token


class RecordingCache(KVCache):
    """A KVCache whose layer views log what a decoder's cached step did in its first layer, for batch row 0: (name,
    'write', positions written) and (name, 'read', keys read back). recording() turns a cache into one."""

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


def recording(cache: KVCache, name: str, log: list) -> RecordingCache:
    """The same cache (its tensors shared, not copied), logging into `log` under `name`."""
    rec = copy.copy(cache)
    rec.__class__, rec.name, rec.log = RecordingCache, name, log
    return rec


def block_fields(prompt_blocks=2, new_tokens=11, seed=0) -> dict:
    """A Block Transformer (L_B = 4, P = 2 prefix vectors) generates after a prompt of whole blocks, on a BlockCache
    whose two KV caches record (recording) and with every decode step marked in the log. Each pass -- the prefill,
    then each decode step -- predicts one token g; the token decoder's entries are labelled by what wrote them: the
    j-th written after the block decoder ran (a block's start) ('prefix', block of g, j), else ('token', p) by the
    step that fed token p. A fresh pass (the prefill, a block's start: causal over what it writes, nothing read back)
    reads what it wrote.
    -> {"prompt_len", "block_len", "prefix_len", "model", "tokens" (prompt + generated), "fields": [{"token": g,
    "block_keys": [blocks], "token_keys": [labels]}]}: the block decoder's keys are those of the last block-decoder
    pass before g."""
    torch.manual_seed(seed)
    m = BlockTransformer(BlockConfig(n_layer=1, block_len=4, prefix_len=2, **TINY)).eval()
    L, P, T0 = m.config.block_len, m.config.prefix_len, prompt_blocks * m.config.block_len
    idx = torch.randint(0, TINY["vocab_size"] - 1, (1, T0))
    cache, log = m.new_cache(1, T0 + new_tokens), []
    cache.blocks, cache.local = recording(cache.blocks, "block", log), recording(cache.local, "token", log)
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
    lines = [f"Block Transformer, Figure 1 (L_B = {L}, P = {P} prefix vectors), traced from block_transformer.py's "
             f"KV caches: the prompt is blocks 0..{d['prompt_len'] // L - 1}.\nPer generated token, what was read to "
             f"predict it: = a block the block decoder read (for the context embedding of the token's block),\no a "
             f"token the token decoder read, P its block's prefix vectors, ^ the predicted token",
             f"{'token':>5s}  {'prefix':8s}" + " ".join("".join(str(p % 10) for p in range(b, min(b + L, n)))
                                                       for b in range(0, n, L))]
    for f in d["fields"]:
        toks = {lab[1] for lab in f["token_keys"] if lab[0] == "token"}
        prefix = "".join("P" if lab[0] == "prefix" else "" for lab in f["token_keys"])
        cells = ["^" if p == f["token"] else "o" if p in toks else "=" if p // L in f["block_keys"] else "."
                 for p in range(n)]
        lines.append(f"{f['token']:>5d}  {prefix:8s}" + " ".join("".join(cells[b:b + L]) for b in range(0, n, L)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Block-Based Double Decoders, Figure 2: the doubly-causal mask of generation


def double_masks(settings=((1, 4, 11), (6, 3, 11)), seed=0) -> list[dict]:
    """A double decoder (1 context + 1 generation layer) generates from random prompts, one run per (prompt length,
    rollover N, new tokens), on a DoubleCache whose trace is on: the mask of every generation step. -> per setting
    {"prompt_len", "rollover", "new_tokens", "model", "tokens" (prompt + generated), "rows": [{"pos": query position,
    "cross": latent positions visible, "self": own-block positions visible}]}."""
    torch.manual_seed(seed)
    m = DoubleDecoder(DoubleConfig(ctx_layers=1, gen_layers=1, **TINY)).eval()
    out = []
    for prompt_len, rollover, new in settings:
        idx = torch.randint(0, TINY["vocab_size"] - 1, (1, prompt_len))
        cache = m.generation_cache(1, prompt_len, new, rollover=rollover)
        cache.trace = []
        tokens = m.generate(idx, new, cache=cache, rollover=rollover)
        rows = [dict(pos=int(r["q_pos"][0, 0]), cross=r["cross_pos"][r["cross"][0, 0]].tolist(),
                     self=r["self_pos"][0][r["self"][0, 0]].tolist()) for r in cache.trace]
        out.append(dict(prompt_len=prompt_len, rollover=rollover, new_tokens=new, rows=rows, model=m, tokens=tokens))
    return out


def double_text(settings) -> str:
    lines = ["Block-Based Double Decoders, Figure 2: the mask of every generation step, traced from double_decoder.py "
             "(kernels.dual_masks of the step's ids).\nOne row per query position (the prompt's last token opens the "
             "first block): x = a context latent it attends (cross key: an earlier block),\ns = a key of its own "
             "block (self, causal), . = hidden"]
    for s in settings:
        n = s["rows"][-1]["pos"] + 1
        lines += [f"\nprompt of {s['prompt_len']} token{'s' * (s['prompt_len'] > 1)}, a new block every "
                  f"{s['rollover']} tokens:",
                  f"{'query':>5s}  " + "".join(str(p % 10) for p in range(n))]
        for r in s["rows"]:
            lines.append(f"{r['pos']:>5d}  " + "".join("x" if p in r["cross"] else "s" if p in r["self"] else "."
                                                       for p in range(n)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Drawings (matplotlib, when installed): one PNG per figure


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def _cell(ax, x, y, color, text="", edge=None, bold=False):
    """One cell of a grid: the unit square at (x, y), its text centred, an outlined cell above its neighbours."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge or "white", lw=1.8 if edge else 0.6,
                           zorder=3 if edge else 2))
    if text:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7, weight="bold" if bold else "normal",
                zorder=4)


def _grid(ax, cols, rows, xlabel, title, fontsize=7):
    """The axes of a grid of cells: cols / rows the labels of its columns (x = 0, 1, ...) and rows (y, top down)."""
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([x + 0.5 for x in range(len(cols))], cols, fontsize=fontsize)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], rows, fontsize=fontsize)
    ax.tick_params(length=0)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")


def _finish(pyplot, fig, path: Path, title: str, legend: list[tuple[str, str, str]]):
    """The figure's title (paper, figure, what was traced), its legend (label, face colour, edge colour) below, and
    the PNG, written atomically."""
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor=face, edgecolor=edge, label=label) for label, face, edge in legend],
               loc="lower center", ncol=len(legend), fontsize=7)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    pyplot.close(fig)
    write_atomic(path, buf.getvalue())


LOOP_COLORS = ["#c6dbef", "#6baed6", "#2171b5", "#08306b"]
ALL_LAYERS, PROMPT_CHUNK, HELD = "#fdae6b", "#bdbdbd", "#f0f0f0"
CROSS = PREFIX = "#9e9ac8"  # what comes from the other level: a context latent, a prefix vector
SELF, READ, BLOCK_READ, PREDICTED = "#41ab5d", "#238b45", "#c7e9c0", "#fec44f"


def draw_depthwise(pyplot, d, path):
    names = [k for k in d if k.startswith(("depth-wise", "vanilla"))]
    width = max(len(d[n][0].passes) for n in names)
    fig, axes = pyplot.subplots(len(names), 1, figsize=(13, 5.6))
    for ax, name in zip(axes, names):
        trace = d[name][0]
        held = [None] * trace.slots  # the request each slot held last
        labels, step = [], 0
        for x, (kind, cells) in enumerate(trace.passes):
            step += kind == "decode"
            labels.append("p" if kind == "prefill" else str(step))
            for s, cell in enumerate(cells):
                if cell is None:
                    continue
                rid, what, emitted = cell
                if held[s] is not None and held[s] != rid:  # a refill: the slot's next request
                    ax.plot([x, x], [s, s + 1], color="red", lw=2.5, zorder=5)
                held[s] = rid
                color = (HELD if what is None else PROMPT_CHUNK if what == "p" else ALL_LAYERS if what == "all"
                         else LOOP_COLORS[what])
                letter = chr(ord("a") + rid % 26)
                _cell(ax, x, s, color, "" if what is None else letter.upper() if emitted else letter,
                      "black" if emitted else None, emitted)
        _grid(ax, labels + [""] * (width - len(labels)), [f"slot {s}" for s in range(trace.slots)],
              "forward pass of the model, in order (p = a prefill pass, n = decode step n); a letter = a request, "
              "UPPERCASE = a token leaves" if ax is axes[-1] else "", f"{name}: {step} decode steps")
    _finish(pyplot, fig, path, "Relaxed Recursive Transformers, Figure 3: continuous depth-wise batching with early "
            f"exit\ntraced from serve.py: {len(d['requests'])} requests, Poisson arrivals, prompts prefilled in "
            f"chunks of {d['chunk']}, exits simulated (random weights)",
            [(f"loop {i + 1}", LOOP_COLORS[i], LOOP_COLORS[i]) for i in range(d["loops"])]
            + [("all layers (vanilla)", ALL_LAYERS, ALL_LAYERS), ("prompt chunk", PROMPT_CHUNK, PROMPT_CHUNK),
               ("a token leaves", "white", "black"), ("held, not run", HELD, HELD), ("refill", "red", "red")])


def draw_plt(pyplot, d, path):
    fws, L, n0 = d["forwards"], d["loops"], d["prompt_len"]
    last = fws[-1]["pos"]
    fig, (ax, ax_s, ax_w) = pyplot.subplots(1, 3, figsize=(13, 5), gridspec_kw=dict(width_ratios=[1.1, 1, 1]))
    for f, fw in enumerate(fws):  # the schedule: forward x row; row l continues token i-l's chain
        for row in range(fw["rows"]):
            _cell(ax, f, row, LOOP_COLORS[row], f"t{fw['pos'] - row}")
            if f and row:  # h^(l)_(i-1), the state row l-1 wrote in the forward before, feeds row l
                ax.annotate("", (f + 0.2, row + 0.4), (f - 0.2, row - 0.4),
                            arrowprops=dict(arrowstyle="->", color="black", lw=0.8))
    _grid(ax, [f"pos {fw['pos']}" for fw in fws], [f"row {r}: loop {r + 1}" for r in range(L)],
          f"decode forward at position i (row {L - 1}'s logits give token i+1)",
          "rows of each forward: t_k = the chain of token k\n(arrow: h^(l) of the forward before feeds loop l+1)")
    rows = [(f, row) for f, fw in enumerate(fws) for row in range(fw["rows"])]
    for axis, title, color in ((ax_s, "shared loop-1 cache (K_share, V_share)", LOOP_COLORS[1]),
                               (ax_w, f"own sliding window (w = {d['window']})", ALL_LAYERS)):
        for y, (f, row) in enumerate(rows):
            shared, own = fws[f]["layers"][0]
            keys = shared if axis is ax_s else (own or []) if row else []
            for j in range(last + 1):
                _cell(axis, j, y, color if j in keys else "white" if j <= fws[f]["pos"] else HELD,
                      edge="black" if j == fws[f]["pos"] and j in keys else None)
        _grid(axis, [str(j) for j in range(last + 1)], [f"pos {fws[f]['pos']} loop {row + 1}" for f, row in rows],
              "key position (outlined: the row's own position)", f"keys read: {title}", fontsize=6)
        axis.axvline(n0, color="gray", lw=0.8, ls="--", zorder=5)
    _finish(pyplot, fig, path, f"Parallel Loop Transformer, Algorithm 1 / Figure 2 (right): cross-loop parallel "
            f"decoding, L = {L}, first-loop KV sharing, gated window\ntraced from plt.py's decode forwards (prompt: "
            f"positions 0..{n0 - 1}, left of the dashed line; random weights)",
            [("shared key read", LOOP_COLORS[1], LOOP_COLORS[1]), ("own-window key read", ALL_LAYERS, ALL_LAYERS),
             ("not read", "white", "gray"), ("not yet written", HELD, HELD)])


def draw_block(pyplot, d, path):
    L, P, fields = d["block_len"], d["prefix_len"], d["fields"]
    n = fields[-1]["token"] + 1
    fig, ax = pyplot.subplots(figsize=(12, 5.4))
    for y, f in enumerate(fields):  # columns: the P prefix vectors, a gap, the token positions
        toks = {lab[1] for lab in f["token_keys"] if lab[0] == "token"}
        for j in range(P):
            _cell(ax, j, y, PREFIX if ("prefix", f["token"] // L, j) in f["token_keys"] else "white", f"P{j + 1}")
        for p in range(n):
            color = (READ if p in toks else BLOCK_READ if p // L in f["block_keys"] else
                     PREDICTED if p == f["token"] else "white")
            _cell(ax, P + 1 + p, y, color, "?" if p == f["token"] else "", "black" if p == f["token"] else None)
    for b in range(0, n + 1, L):
        ax.axvline(P + 1 + b, color="gray", lw=0.8, zorder=5)
    one = len(fields) - 2  # one token's receptive field, as the paper draws its last token's
    ax.add_patch(pyplot.Rectangle((0, one), P + 1 + n, 1, fill=False, edgecolor="#d62728", lw=2, clip_on=False,
                                  zorder=6))
    _grid(ax, [""] * (P + 1) + [str(p) for p in range(n)], [f"token {f['token']}" for f in fields],
          f"prefix vectors of the token's block | token position (blocks of L_B = {L}; the prompt: "
          f"0..{d['prompt_len'] - 1})", "")
    _finish(pyplot, fig, path, "Block Transformer, Figure 1: the receptive field of each generated token, global "
            "(block decoder) and local (token decoder)\ntraced from block_transformer.py's KV caches (L_B = 4, P = 2, "
            f"random weights); red: token {fields[one]['token']}'s. The token decoder never reads outside its block.",
            [("block read by the block decoder (its embedding)", BLOCK_READ, BLOCK_READ),
             ("prefix vector read by the token decoder", PREFIX, PREFIX),
             ("token read by the token decoder", READ, READ), ("the predicted token", PREDICTED, "black")])


def draw_double(pyplot, settings, path):
    fig, axes = pyplot.subplots(1, len(settings), figsize=(12, 5))
    for ax, s in zip(axes, settings):
        n = s["rows"][-1]["pos"] + 1
        for y, r in enumerate(s["rows"]):
            for p in range(n):
                _cell(ax, p, y, CROSS if p in r["cross"] else SELF if p in r["self"] else "white")
        for b in sorted({min(r["self"]) for r in s["rows"]}):  # where each block begins
            ax.axvline(b, color="black", lw=0.8, zorder=5)
        context = f"context 0..{s['prompt_len'] - 2}" if s["prompt_len"] > 1 else "no context"
        _grid(ax, [str(p) for p in range(n)], [f"query {r['pos']}" for r in s["rows"]],
              "key position (lines: where a block starts)", f"prompt of {s['prompt_len']} "
              f"token{'s' * (s['prompt_len'] > 1)} ({context}), a new block every {s['rollover']} tokens")
    _finish(pyplot, fig, path, "Block-Based Double Decoders, Figure 2: the doubly-causal block mask of generation\n"
            "traced from double_decoder.py's generation steps (kernels.dual_masks; random weights)",
            [("context latent of an earlier block (cross key)", CROSS, CROSS),
             ("own block, causal (self key)", SELF, SELF), ("hidden", "white", "gray")])


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
        for name in FIGURES:  # a directory or a special file at a PNG's name: found now, not when it is drawn
            check_output_file(out / f"{name}.png", "--out's figure")
    t0, records = time.perf_counter(), {}
    for name, (record, text, draw) in FIGURES.items():
        records[name] = record()
        print(f"\n== {name}\n{text(records[name])}")
        if pyplot is not None:
            draw(pyplot, records[name], out / f"{name}.png")
    print(f"\n{len(FIGURES)} figures in {time.perf_counter() - t0:.1f} s: " +
          (f"PNGs in {out}" if pyplot is not None else "text only (matplotlib is not installed: pip install "
                                                       "matplotlib for the PNGs)"))
    return records


def add_args(p):
    """The flags of `python bench.py figures` (p: its subparser)."""
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the PNGs (default: docs/figures of this "
                                                          "repository, the committed ones)")
    p.set_defaults(fn=bench_figures)
