"""
recursive.py -- Recursive and Relaxed Recursive Transformers: looped layer tying, conversion from a vanilla model,
per-loop LoRA, early-exit training and confidence-based early exit with per-loop KV caches.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), sections 2.2-2.4, 3.4-3.7, Appendices B, C, E, F, J, K. The LoRA layer and its SVD init live in
svd_lora.py.

The model, top to bottom:
  * Looped layer tying, CYCLE (eq. 2, Appendix B): one block of K = N / B unique layers, looped B times. Loop l runs
    shared layer k at effective depth l*K + k. Every parameter is tied across loops, the norms included. The config
    keeps n_layer = N, the effective depth of the vanilla model it stands for; n_loops = B.
  * Middle-Cycle sharing (`sharing='middle_cycle'`; "Mixture-of-Recursions", Bae et al., arXiv:2507.10524, section
    2.2 and its sharing-strategy comparison, where it is the best scheme): the first and the last layer stay unique
    (`unique_first`, `unique_last`, run before and after the loops) and the middle N - 2 layers are K = (N - 2) / B
    shared layers looped B times. Conversion copies the first and last vanilla layers and ties the middle with the
    chosen init over the middle layers 1..N-2 (Stepwise: round(linspace(1, N-2, K)), as that paper's public code).
    Cache layers: 0 for the first layer, 1 + l*K + k for loop l, N - 1 for the last. A loop's output is not an exit
    here (the last layer still follows), so early exit, exit losses, the exit gate and depth-wise serving are
    refused for it (config validation, exit_pass, `python eval.py exits`).
  * Conversion from a vanilla N-layer model (section 2.2, Figure 2, Appendix F): Stepwise keeps the first and the
    last layer and picks the rest at even intervals ("fixed-ends", Appendix F.1: source layers
    round(linspace(0, N-1, K)) with Python's round, half to even, as the authors' public MoR code; N=6, B=2 -> layers
    0, 2, 5); Average averages the tied layers, norm weights included; Lower takes layers 0..K-1; Random is a fresh
    init that uses no pretrained weight at all (the paper's baseline). Embeddings, final norm and head are copied.
  * Relaxed (eq. 3): every shared projection carries one LoRA per loop (svd_lora.LoRALinear), ranks per component
    (q, kv, o, mlp; Table G.1), SVD-initialised from the residuals (eq. 4). All parameters train.
  * Early-exit training (section 3.7, Appendix J): the shared final norm + head read the hidden state after every
    loop. `exit_loss='weighted'`: sum_i alpha_i L_i with alpha_i = i / sum_j j; 'aggressive': `exit_coef` on every
    intermediate loop and 1 on the last; `self_distill`: plus a forward KL from the detached final-loop logits into
    every intermediate output, with the same coefficient. All of it is returned as the single loss of forward() in
    training mode; train.py adds its teacher KD on the final logits. `self.metrics` holds the per-loop CE (and KD)
    terms. In eval mode forward() returns the final loop's cross-entropy (train.py's val loss compares across
    settings); `python eval.py exits` gives the validation loss of every loop (`loop_logits`).
  * Inference (section 2.4): a KV cache with one "layer" per (loop, layer) pair, cache layer l*K + k. `path` is the
    depth order (unique first -> the loops -> unique last: blocks, cache layers, LoRA indices), and every cached step
    runs it through model.run_cached, the cached layer stack of every decoder here (mask, RoPE, cache views).
      - `prefill(idx, cache, lengths)` runs all loops over prompts;
      - `loop_step(x, loops, q_pos, cache, rows)` runs ONE pass of the shared block over rows that may sit at
        different loops (per-row LoRA index, per-row cache layer, per-row positions): the primitive of continuous
        depth-wise batching, which serve.py schedules;
      - `exit_logits(h)` = final norm + head; `exit_score` = the rule's score (max softmax probability, learned gate,
        saturation); `leaving` = THE exit decision (last loop, or score >= threshold) of every decoding path;
      - `propagate(h, from_loop, q_pos, cache, rows)`: state propagation for tokens that exit early (CALM,
        Schuster et al. 2022). Later tokens attend to this token in the deeper loops, so every skipped (l', k) cache
        layer gets K/V projected from the exit hidden state through layer k's attn_norm and k/v projections (with
        loop l''s LoRA). Cost per skipped layer: one norm and two projections (k, v) of one token, i.e. about
        2 * d * H_kv * D_head MACs, no attention and no MLP; for GQA models well under a fifth of a layer.
      - `exit_pass` (one loop, then leaving, propagation and the leavers' logits), `decode_step` and `generate`
        (model.GPT's loop) use exactly these methods. A token exits at the first loop whose exit score reaches
        `exit_threshold` (None = never; any value > 1 also never exits). Prompt tokens never exit early.
      - Graph-safe forms, in one section after the readable ones (torch.compile fullgraph, CUDA graphs: no host
        sync, no data-dependent shape): `masked_decode_step` is decode_step with every row running every loop (a row
        that left runs along, its deeper K/V replaced by `propagate`'s masked writes), what `graphs.compile_decode`
        records; `depthwise_step` is serve.py's compiled depth-wise step over every slot. Each equals its subset
        form (tests).
  * Early exit on text (section 3.8, Appendix K): `python eval.py exits` measures the static loss of every loop, the
    oracle exit loop (the earliest loop whose argmax equals the final one), and the confidence-exit trade-off a
    serving user picks a threshold from (threshold -> share of tokens exiting at each loop -> loss of the emitted
    tokens), with the real cached decoding and state propagation.

Run:
    python train.py --arch recursive --init-from out/vanilla/ckpt.pt --loops 2 --init stepwise
    python train.py --arch recursive --init-from out/vanilla/ckpt.pt --loops 2 --sharing middle_cycle  # Middle-Cycle
    python train.py --arch relaxed --init-from out/vanilla/ckpt.pt --loops 2 --init average --lora-rank 16
    python train.py --arch relaxed --init-from out/relaxed/ckpt.pt --exit-loss aggressive --exit-coef 0.1 \
        --self-distill --out-dir out/relaxed-exit                   # early-exit post-training (Appendix J)
    python eval.py exits --ckpt out/relaxed-exit/ckpt.pt           # per-loop losses, oracle, threshold curve
    python bench.py presets --arch recursive,relaxed --preset tiny  # parameter counts: vanilla, recursive, relaxed
    python bench.py serve --ckpt out/relaxed-exit/ckpt.pt           # depth-wise batching with early exit
    python -m pytest -q tests/test_recursive.py tests/test_svd_lora.py
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import (GPT, IGNORE, PRESETS, ArchSpec, Block, GPTConfig, KVCache, count_params, distill_loss, lm_loss,
                   run_cached, start_prefill)
from svd_lora import COMPONENTS, LoRALinear, add_lora, init_lora, max_ranks


# ----------------------------------------------------------------------------------------------------------------
# The model


class RecursiveCache(KVCache):
    """model.KVCache with one layer per (loop, shared layer), cache layer l*K + k, and the exit loop of every decoded
    token of each row (`exit_log`, one (B,) tensor per decode step), which generate(return_exits=True) reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_log: list[torch.Tensor] = []

    def reset(self, rows=None):
        super().reset(rows)
        if rows is None:  # a reused cache (a compiled model's) starts a new generation: a new log
            self.exit_log = []


class RecursiveGPT(GPT):
    """K shared blocks looped n_loops times (CYCLE); with LoRA ranks > 0, the Relaxed Recursive Transformer.

    model.GPT with other layers: its embedding, final norm + head (shared by every loop's exit) and generate loop are
    the vanilla model's. forward(idx, targets) -> (final logits, loss incl. the early-exit terms). Inference:
    new_cache -> prefill -> decode_step (or loop_step / exit_logits / propagate for a scheduler) -> generate.
    """

    # GPT.new_cache builds it: one cache layer per (loop, shared layer) and unique layer, N in all, so GPT's
    # kv_cache_bytes holds (sharing saves weights, not cache); GPT's num_params counts the shared layers once
    cache_cls = RecursiveCache

    def __init__(self, cfg: RecursiveConfig):
        # the stacks in depth order: unique first layers (Middle-Cycle; empty under CYCLE), the shared block, unique
        # last layers; init_weights scales the residual projections by the effective depth N
        super().__init__(cfg, stacks={"unique_first": nn.ModuleList(Block(cfg) for _ in range(cfg.n_first)),
                                      "blocks": self.make_blocks(cfg),
                                      "unique_last": nn.ModuleList(Block(cfg) for _ in range(cfg.n_last))})
        for m in self.modules():
            if isinstance(m, LoRALinear):
                m.reset_lora()
        # exit gate: logit of "loop l's argmax is final" for l < B-1, column l; zero init = probability 0.5
        self.exit_gate = nn.Linear(cfg.n_embd, cfg.n_loops - 1) if cfg.exit_gate and cfg.n_loops > 1 else None
        if self.exit_gate is not None:
            nn.init.zeros_(self.exit_gate.weight)
            nn.init.zeros_(self.exit_gate.bias)
        self.metrics = {}

    def make_blocks(self, cfg: RecursiveConfig) -> nn.ModuleList:
        blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_shared))
        if cfg.relaxed:
            for block in blocks:
                add_lora(block, cfg.n_loops, cfg.lora_ranks, cfg.lora_bias)
        return blocks

    def cache_layer(self, loop, k):
        """The cache layer (the effective depth) of shared layer k at loop `loop` (an int or a LongTensor):
        n_first + loop*K + k, after Middle-Cycle's unique first layer."""
        return self.config.n_first + loop * self.config.n_shared + k

    def path(self, loops, unique: bool = False) -> tuple[tuple, tuple, tuple]:
        """THE depth order of the model: the layers a token runs through at `loops`, as three tuples -- the blocks,
        their cache layers and their LoRA indices. Each loop l of `loops` (an int, or a LongTensor (b,) with one loop
        per row) runs the K shared layers with loop l's LoRA and cache layers cache_layer(l, k). unique=True adds
        Middle-Cycle's unique first layer before the loops and its unique last layer after them (cache layers 0 and
        N - 1, no LoRA); under CYCLE there are none."""
        c = self.config
        first = [(b, i, None) for i, b in enumerate(self.unique_first)] if unique else []
        last = [(b, c.n_layer - c.n_last + i, None) for i, b in enumerate(self.unique_last)] if unique else []
        shared = [(b, self.cache_layer(l, k), l) for l in loops for k, b in enumerate(self.blocks)]
        return tuple(zip(*(first + shared + last)))

    def run_path(self, x, loops, cache: KVCache, unique: bool = False, **kwargs):
        """x (b, T, C) through path(loops, unique) with its KV cache layers: model.run_cached, the cached layer stack
        of every decoder here (kwargs: its fresh, rows, q_pos, kv_len) -> h (b, T, C)."""
        blocks, layers, lora = self.path(loops, unique)
        return run_cached(blocks, self.rope, x, cache, layers=layers, lora_idx=lora, **kwargs)

    def check_cycle(self, what: str):
        """Early exit reads the final norm and head after a loop: only CYCLE sharing ends every loop there."""
        if self.config.sharing != "cycle":
            raise ValueError(f"{what} assumes sharing='cycle'; under sharing={self.config.sharing!r} the unique last "
                             f"layer follows the loops, so a loop's output is no exit")

    # -- training forward ----------------------------------------------------------------------------------------

    def loop_hidden(self, idx, all_loops=True) -> list[torch.Tensor]:
        """idx (B, T) -> hidden states (B, T, C) after every loop (or only the last), before the final norm; the
        last one after Middle-Cycle's unique last layer."""
        B, T = idx.shape
        self.check_length(T)
        c = self.config
        rope = self.rope(torch.arange(T, device=idx.device))
        ends = {c.n_first + (l + 1) * c.n_shared for l in range(c.n_loops - 1)} if all_loops else set()
        blocks, _, lora = self.path(range(c.n_loops), unique=True)  # no cache: every layer attends over idx itself
        x, out = self.embed(idx), []
        for i, (block, l) in enumerate(zip(blocks, lora), 1):
            x = block(x, rope, lora_idx=l)
            if i in ends:  # the end of a loop before the last
                out.append(x)
        return out + [x]

    def loop_logits(self, idx) -> list[torch.Tensor]:
        """idx (B, T) -> logits (B, T, V) of every loop (static exiting at each depth; eval.py's exit_analysis)."""
        self.check_cycle("static exit after every loop")
        return [self.head(h) for h in self.loop_hidden(idx)]

    def forward(self, idx, targets=None):
        """idx (B, T) -> final-loop logits (B, T, V) and, with targets, the loss (section 3.7 terms included)."""
        cfg = self.config
        # the early-exit objective is a training loss; in eval mode the loss is the final loop's cross-entropy, so
        # that validation losses compare across exit-loss settings (per-loop losses: `loop_logits`, eval.py exits)
        early = targets is not None and cfg.exit_loss != "none" and cfg.n_loops > 1 and self.training
        gate = targets is not None and self.exit_gate is not None and self.training
        hs = self.loop_hidden(idx, all_loops=early or gate)
        logits = self.head(hs[-1])
        if targets is None:
            return logits, None
        if not early:
            loss = lm_loss(logits, targets)
            all_logits = [None] * (len(hs) - 1) + [logits]
        else:
            all_logits = [self.head(h) for h in hs[:-1]] + [logits]
            loss = self.exit_objective(all_logits, targets)
        if gate:
            loss = loss + self.gate_objective(hs, all_logits, targets)
        return logits, loss

    def gate_objective(self, hs, all_logits, targets):
        """Binary cross-entropy of the exit gate at every non-final loop against the oracle target (this loop's
        argmax == the final loop's), on labelled positions. Inputs are detached: only the gate learns from it."""
        with torch.no_grad():
            final = all_logits[-1].argmax(-1)  # (B, T)
            mask = targets != IGNORE
        loss, hits = 0.0, []
        for l, h in enumerate(hs[:-1]):
            with torch.no_grad():
                lg = all_logits[l] if all_logits[l] is not None else self.head(h)
                target = (lg.argmax(-1) == final).float()
                z = self.norm(h)
            score = self.exit_gate(z)[..., l].float()  # (B, T) logits
            loss = loss + F.binary_cross_entropy_with_logits(score[mask], target[mask])
            hits.append(((score[mask] > 0).float() == target[mask]).float().mean().detach())
        if self.training:
            self.metrics.update({"gate_loss": loss.detach(), "gate_acc": torch.stack(hits).mean()})
        return loss

    def exit_objective(self, all_logits, targets):
        """sum_i c_i (CE_i [+ KD(final.detach() -> i) for i < B]) with the coefficients of exit_coefficients()."""
        cfg = self.config
        coefs = exit_coefficients(cfg.exit_loss, cfg.n_loops, cfg.exit_coef)
        mask = (targets != IGNORE).float() if cfg.self_distill else None
        loss, metrics = 0.0, {}
        for i, (c, lg) in enumerate(zip(coefs, all_logits)):
            ce = lm_loss(lg, targets)
            term = ce
            metrics[f"loss_l{i + 1}"] = ce.detach()
            if cfg.self_distill and i < len(all_logits) - 1:
                kd = distill_loss(lg, all_logits[-1], "fkl", mask=mask)  # the teacher is detached inside
                metrics[f"kd_l{i + 1}"] = kd.detach()
                term = term + kd
            loss = loss + c * term
        if self.training:  # 0-d tensors: formatted like floats by train.py, no device sync per step
            self.metrics = metrics
        return loss

    # -- inference -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, idx, cache: KVCache, lengths=None):
        """Prompts idx (B, T), right-padded, true lengths (B,) (default T) -> logits (B, V) of each row's last prompt
        token. Every prompt token runs all loops (no early exit) and fills every cache layer. The cache must be
        empty; afterwards cache.lengths == lengths."""
        B = idx.size(0)
        lengths = start_prefill(idx, cache, lengths)
        x = self.run_path(self.embed(idx), range(self.config.n_loops), cache, unique=True, fresh=True)
        cache.lengths.copy_(lengths)
        last = x[torch.arange(B, device=idx.device), lengths - 1]  # (B, C)
        return self.head(last[:, None])[:, 0]

    @torch.no_grad()
    def prefill_chunk(self, idx, q_pos, cache: KVCache, rows, first: bool = False):
        """model.GPT.prefill_chunk through every layer (prompt tokens never exit): tokens idx (b, T) at positions
        q_pos (b, T) of cache rows `rows` -> hidden states (b, T, C) after the last layer; every cache layer of those
        rows written at q_pos, cache.lengths untouched. first=True: causal over the chunk itself (as prefill)."""
        return self.run_path(self.embed(idx), range(self.config.n_loops), cache, unique=True, fresh=first, rows=rows,
                             q_pos=q_pos)

    def loop_step(self, x, loops, q_pos, cache: KVCache, rows=None, kv_len: int | None = None):
        """ONE pass of the shared block over tokens that may sit at different loops: x (b, T, C) hidden states
        (embeddings for loop 0); loops an int, or a LongTensor (b,) with one loop per row; q_pos (b, T) absolute
        positions; rows (b,) the cache rows of x (default all); kv_len the keys to read (default: model.run_cached's).
        Writes K/V of cache layers loops*K + k at q_pos, attends causally over each row's cache prefix -> h (b, T, C).
        cache.lengths is not touched."""
        return self.run_path(x, [loops], cache, rows=rows, q_pos=q_pos, kv_len=kv_len)

    def exit_logits(self, h):
        """h (b, T, C) after any loop -> logits (b, T, V) through the shared final norm and head."""
        return self.head(h)

    @staticmethod
    def exit_confidence(logits):
        """Max softmax probability (..., V) -> (...), in fp32: the early-exit score of rule 'softmax'."""
        return F.softmax(logits.float(), dim=-1).amax(-1)

    def exit_score(self, x, h, loops, rule):
        """Exit scores (b,) fp32 of rows with loop input x and output h (b, 1, C) at loops (b,), and the logits
        (b, V) the score computed (None if it needed none): 'softmax' = the max softmax probability (the head on
        every row), 'gate' = the exit gate's probability at each row's loop (O(d)), 'saturation' = cos(x, h) (O(d))."""
        if rule == "softmax":
            logits = self.exit_logits(h)[:, 0]  # (b, V)
            return self.exit_confidence(logits), logits
        if rule == "gate":
            if self.exit_gate is None:
                raise ValueError("exit rule 'gate' needs a model trained with an exit gate (--exit-gate)")
            z = self.exit_gate(self.norm(h[:, 0]))  # (b, B-1)
            return torch.sigmoid(z.float().gather(1, loops.clamp(max=z.size(1) - 1)[:, None])[:, 0]), None
        if rule == "saturation":
            return F.cosine_similarity(x[:, 0].float(), h[:, 0].float(), dim=-1), None
        raise ValueError(f"unknown exit rule {rule!r}; choose one of {EXIT_RULES}")

    def leaving(self, x, h, loops, threshold=None, rule=None):
        """THE exit decision, of every decoding path (decode_step, serve.py's depth-wise steps, their graph-safe
        forms): which rows leave after this loop. x, h (b, 1, C) the rows' states before and after it; loops an int
        or a LongTensor (b,). A row at its last loop leaves; with a threshold, so does a row whose exit score (rule:
        default config.exit_rule) reaches it. -> leave (b,) bool, and the logits (b, V) the score computed (None if
        none). No host sync; an int loop that is the last computes no score."""
        L = self.config.n_loops
        if not isinstance(loops, torch.Tensor):
            threshold = None if loops == L - 1 else threshold
            loops = torch.full((x.size(0),), loops, device=x.device)
        last = loops == L - 1
        if threshold is None:
            return last, None
        score, logits = self.exit_score(x, h, loops, rule or self.config.exit_rule)
        return last | (score >= threshold), logits

    def exit_pass(self, x, loops, q_pos, cache: KVCache, rows=None, kv_len=None, threshold=None, rule=None):
        """One loop over rows that may sit at different loops, then the exit rule (leaving), the state propagation of
        the rows that leave early and their logits: the step of decode_step and of serve.py's depth-wise server.

        x (b, 1, C) the rows' states before this loop; loops an int or (b,); q_pos (b, 1); rows (b,) cache rows
        (None = all). -> h (b, 1, C), leave (b,) bool, logits (n, V) of the n leaving rows in row order (None if none
        leaves). The head runs only on the leaving rows, except under rule 'softmax', whose score is the head's output
        on every row.
        """
        self.check_cycle("a loop's exit (exit_pass: early exit, depth-wise serving)")
        h = self.loop_step(x, loops, q_pos, cache, rows=rows, kv_len=kv_len)
        leave, logits = self.leaving(x, h, loops, threshold, rule)
        if threshold is not None:  # the tokens that leave before their last loop: K/V for the loops they skip
            loops = loops if isinstance(loops, torch.Tensor) else torch.full_like(q_pos[:, 0], loops)
            early = (leave & (loops < self.config.n_loops - 1)).nonzero().squeeze(1)
            if early.numel():
                self.propagate(h[early], loops[early], q_pos[early], cache,
                               rows=(cache.all_rows if rows is None else rows)[early])
        if bool(leave.all()):
            return h, leave, (logits if logits is not None else self.exit_logits(h)[:, 0])
        if not bool(leave.any()):
            return h, leave, None
        out = leave.nonzero().squeeze(1)
        return h, leave, (logits[out] if logits is not None else self.exit_logits(h[out])[:, 0])

    def propagate(self, h, from_loop, q_pos, cache: KVCache, rows=None, masked=False):
        """State propagation for exited tokens (CALM): fill every deeper cache layer (l' > from_loop, k) with K/V
        projected from the exit hidden state h (b, T, C) through layer k's attn_norm and k/v projections, with loop
        l''s LoRA. from_loop: an int or a LongTensor (b,); q_pos (b, T); rows (b,) cache rows (default all).

        Where layer k's K/V projections carry no LoRA (the recursive model; a relaxed one without K/V ranks) the K/V
        of h are the same at every loop: they are projected once for all the rows and written to each layer a row
        skips (with B = 3 loops half the projections of projecting per loop; the result is the same).

        masked=True, the graph-safe form (masked_step, depthwise_step): every row at every deeper loop l', the rows
        with from_loop >= l' writing back what their entry at q_pos held (LayerCache.write's `where`); from_loop =
        n_loops - 1 propagates nothing. The projections run for every row, the rows that do not exit included: a
        graph cannot skip work per row."""
        cfg = self.config
        rows = cache.all_rows if rows is None else rows
        if not isinstance(from_loop, torch.Tensor):
            from_loop = torch.full((h.size(0),), from_loop, device=h.device)
        if masked:  # every deeper loop, every row
            deeper = dict.fromkeys(range(1, cfg.n_loops))
        else:
            deeper = {}  # loop l' -> the rows that skipped it (None = all rows)
            for lp in range(1, cfg.n_loops):
                sel = (from_loop < lp).nonzero().squeeze(1)
                if sel.numel():
                    deeper[lp] = None if sel.numel() == h.size(0) else sel
        if not deeper:
            return
        rope = self.rope(q_pos)  # cos, sin (b, 1, T, rot)
        pick = lambda t, sel: t if sel is None else t[sel]  # noqa: E731
        for k, block in enumerate(self.blocks):
            xn = block.attn_norm(h)
            same_kv_every_loop = not any(isinstance(p, LoRALinear) for p in (block.attn.k_proj, block.attn.v_proj))
            if same_kv_every_loop:
                kk, vv = block.attn.project_kv(xn, rope)
            for lp, sel in deeper.items():
                if same_kv_every_loop:
                    ks, vs = pick(kk, sel), pick(vv, sel)
                else:
                    ks, vs = block.attn.project_kv(pick(xn, sel), tuple(pick(t, sel) for t in rope), lora_idx=lp)
                where = (from_loop < lp) if masked else None  # masked: the others write back what they hold
                cache.layer(self.cache_layer(lp, k), pick(rows, sel)).write(pick(q_pos, sel), ks, vs, where=where)

    @torch.no_grad()
    def decode_step(self, tok, cache: RecursiveCache, exit_threshold: float | None = None, return_exits=False,
                    exit_rule: str | None = None):
        """One new token per row tok (B,) at position cache.lengths -> logits (B, V) [, exit loop (B,)].

        Each loop is one `exit_pass`: without a threshold every row runs all loops; with one, the rows whose exit
        score (exit_rule, default config.exit_rule) reaches it leave with that loop's logits, their deeper cache
        layers filled by state propagation, and the others go on (a subset of rows, one loop index for all: plain
        matmuls). The exit loops are also appended to cache.exit_log.
        """
        cfg = self.config
        if cfg.sharing != "cycle":  # Middle-Cycle: every layer, no early exit (masked_step, graph-safe as it is)
            return self.masked_decode_step(tok, cache, exit_threshold, return_exits)
        B, L = tok.size(0), cfg.n_loops
        q_pos = cache.lengths[:, None]  # (B, 1)
        kv_len = cache.kv_len(1)
        x = self.embed(tok[:, None])
        logits = torch.empty(B, cfg.vocab_size, dtype=self.lm_head.weight.dtype, device=tok.device)
        exits = torch.full((B,), L - 1, dtype=torch.long, device=tok.device)
        active, rows = cache.all_rows, None  # None = all rows of the cache (views, no gathers); else the active rows
        for l in range(L):
            x, leave, lg = self.exit_pass(x, l, q_pos if rows is None else q_pos[active], cache, rows=rows,
                                          kv_len=kv_len, threshold=exit_threshold, rule=exit_rule)
            if not bool(leave.any()):
                continue
            gone = active[leave]
            logits[gone] = lg.to(logits.dtype)
            exits[gone] = l
            if bool(leave.all()):
                break
            active, x = active[~leave], x[~leave]
            rows = active
        cache.lengths += 1
        if isinstance(cache, RecursiveCache):
            cache.exit_log.append(exits)
        return (logits, exits) if return_exits else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0, top_k=None, generator=None,
                 exit_threshold: float | None = None, return_exits=False, exit_rule: str | None = None):
        """model.GPT.generate with early exit: idx (B, T) -> (B, T + max_new_tokens) [, exits (B, max_new_tokens)].

        exit_threshold (default: config.exit_threshold; None = never exit) turns on confidence-based early exit.
        exits[:, i] is the loop whose logits produced new token i (the first comes from the prefill: the last loop);
        it is also the exit loop of the token fed at position T - 1 + i.
        """
        thr = self.config.exit_threshold if exit_threshold is None else exit_threshold
        B, T = idx.shape
        self.check_length(T + max_new_tokens)
        cache = self.generation_cache(B, T, max(max_new_tokens, 0))
        tokens = super().generate(idx, max_new_tokens, temperature, top_k, generator, cache=cache,
                                  exit_threshold=thr, exit_rule=exit_rule)
        if not return_exits:
            return tokens
        first = torch.full((B,), self.config.n_loops - 1, dtype=torch.long, device=idx.device)
        return tokens, torch.stack(([first] + [e[:B] for e in cache.exit_log])[:max_new_tokens], 1)

    # -- graph-safe forms ----------------------------------------------------------------------------------------
    # The same steps for torch.compile(fullgraph) and CUDA graphs (graphs.compile_step): no host sync, no
    # data-dependent shape. Every row runs every loop; who leaves is kept by masked selects (`leaving`'s decision),
    # and the K/V a row that left writes into deeper cache layers are replaced by its state propagation (propagate,
    # masked=True). Each equals its readable form above (tests/test_recursive.py, tests/test_serve.py).

    @torch.no_grad()
    def masked_decode_step(self, tok, cache: RecursiveCache, exit_threshold: float | None = None,
                           return_exits=False, exit_rule: str | None = None):
        """decode_step in graph-safe form: the same tokens, exit loops and cache (masked_step, what
        graphs.compile_decode records, and the exit log, which a graph does not append to)."""
        if exit_threshold is not None:  # Middle-Cycle refuses it here, before the graph
            self.check_cycle("early exit (an exit threshold)")
        logits, exits = self.masked_step(tok, cache, exit_threshold, exit_rule)
        if isinstance(cache, RecursiveCache):  # a copy: a CUDA graph's outputs live until its next replay
            cache.exit_log.append(exits.clone())
        return (logits, exits) if return_exits else logits

    def masked_step(self, tok, cache: KVCache, exit_threshold: float | None = None, exit_rule: str | None = None):
        """The graph of masked_decode_step: tok (B,) at positions cache.lengths -> logits (B, V), exit loops (B,).

        Every row runs every loop. A row that leaves at loop e runs along through the deeper loops (a graph cannot
        skip work per row): its exit state h_e and exit loop are kept by masked selects, the K/V it writes into the
        deeper cache layers are replaced at the end by its state propagation (propagate, masked), and its logits are
        the head on h_e, as in the subset form. The threshold and the rule are constants of the compiled step (one
        graph each). Middle-Cycle sharing: every layer (the first, every loop, the last), then the head; no early exit
        (a loop's output is no exit there), every exit loop the last."""
        B, L = tok.size(0), self.config.n_loops
        x, h_exit = self.embed(tok[:, None]), None
        exits = torch.full((B,), L - 1, dtype=torch.long, device=tok.device)
        if self.config.sharing != "cycle":
            h = self.run_path(x, range(L), cache, unique=True)
            cache.lengths += 1
            return self.head(h)[:, 0], exits
        q_pos = cache.lengths[:, None]  # (B, 1)
        kv_len = cache.kv_len(1)
        left = torch.zeros(B, dtype=torch.bool, device=tok.device)
        for l in range(L):
            h = self.loop_step(x, l, q_pos, cache, kv_len=kv_len)
            if exit_threshold is not None:  # at the last loop every row still in leaves
                leave = self.leaving(x, h, l, exit_threshold, exit_rule)[0] & ~left
                exits = torch.where(leave, l, exits)
                h_exit = h if h_exit is None else torch.where(leave[:, None, None], h, h_exit)
                left = left | leave
            x = h
        if exit_threshold is not None and L > 1:
            self.propagate(h_exit, exits, q_pos, cache, masked=True)
        logits = self.exit_logits(h if h_exit is None else h_exit)[:, 0]
        cache.lengths += 1
        return logits, exits

    # graphs.compile_decode records the graph-safe form of decode_step, early exit included (Middle-Cycle: every
    # layer), and decodes through masked_decode_step from then on, which appends the exit log outside the graph
    graph_steps = ("masked_step",)
    graph_decode = "masked_decode_step"

    @torch.no_grad()
    def depthwise_step(self, h, loops, pos, live, cache: KVCache, threshold: float | None = None, rule=None):
        """The continuous depth-wise batching step (section 2.4, Figure 3) in graph-safe form, over every row of
        the cache (serve.py's slots): ONE pass of the shared block, each row at its own loop (per-row LoRA index,
        per-row cache layer loops*K + k), then who leaves (leaving), their state propagation and the head.

        h (S, 1, C) the state of each row's token in flight before this loop (its embedding at loop 0), loops (S,),
        pos (S,) its position, live (S,) bool: rows with a token in flight. A live row leaves at its last loop or,
        with a threshold, when its exit score (rule, default config.exit_rule) reaches it; an early leaver's deeper
        cache layers get its propagated K/V (masked writes). Rows that are not live run along: their results are
        dropped, and their K/V go to (loops*K + k, pos), which the owner keeps at a harmless place (a free slot's,
        or the next position a prefill chunk overwrites). -> out (S, 1, C) the states after this loop, leave (S,)
        bool, logits (S, V) of every row (the head on every row: a graph cannot pick the leaving ones). Equal to
        exit_pass's subset form on the live rows (tests/test_serve.py)."""
        self.check_cycle("depth-wise batching")
        q_pos = pos[:, None]
        out = self.loop_step(h, loops, q_pos, cache)
        leave, logits = self.leaving(h, out, loops, threshold, rule)
        leave = live & leave
        if threshold is not None:
            self.propagate(out, torch.where(leave, loops, self.config.n_loops - 1), q_pos, cache, masked=True)
        return out, leave, (logits if logits is not None else self.exit_logits(out)[:, 0])

    # -- accounting ----------------------------------------------------------------------------------------------

    def lora_param_count(self) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if ".lora_" in n)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """6 N_eff + 12 L H D T (PaLM), N_eff = matmul parameters a token passes through: the shared block B times,
        each LoRA once (its own loop), the final norm and the head (plus B-1 intermediate heads when training with exit
        losses), counted as model.GPT counts them: a Recursive model costs as much compute as its vanilla source."""
        c = self.config
        lora = self.lora_param_count()
        shared = count_params(self.blocks) - lora
        unique = count_params(self.unique_first) + count_params(self.unique_last)  # Middle-Cycle: run once
        heads = 1 + ((c.n_loops - 1) if training and c.exit_loss != "none" else 0)
        n = c.n_loops * shared + lora + unique + count_params(self.norm) + heads * c.n_embd * c.vocab_size
        f = 6 * n + 12 * c.n_layer * c.n_head * c.hd * seq_len
        return f if training else f / 3


def exit_coefficients(kind: str, n_loops: int, coef: float) -> list[float]:
    """Loss coefficient of each loop's output (section 3.7): weighted alpha_i = i / sum_j j; aggressive coef, ..., 1."""
    if kind == "weighted":
        total = n_loops * (n_loops + 1) / 2
        return [(i + 1) / total for i in range(n_loops)]
    if kind == "aggressive":
        return [coef] * (n_loops - 1) + [1.0]
    return [0.0] * (n_loops - 1) + [1.0]


# ----------------------------------------------------------------------------------------------------------------
# Config

INITS = ("stepwise", "average", "lower", "random")
SHARINGS = ("cycle", "middle_cycle")
EXIT_LOSSES = ("none", "weighted", "aggressive")
EXIT_RULES = ("softmax", "gate", "saturation")


@dataclass
class RecursiveConfig(GPTConfig):
    """GPTConfig plus looping, LoRA and early-exit fields. n_layer is the effective depth N; K = N / n_loops."""

    n_loops: int = 2  # B: how many times the shared block runs
    lora_rank_q: int = 0  # LoRA rank per component (Table G.1); 0 = no LoRA there. All 0 = Recursive Transformer
    lora_rank_kv: int = 0
    lora_rank_o: int = 0
    lora_rank_mlp: int = 0
    lora_bias: bool = False  # per-loop bias delta on the LoRA layers (set by conversion of sources with biases)
    exit_loss: str = "none"  # 'none' | 'weighted' | 'aggressive' (section 3.7)
    exit_coef: float = 0.1  # coefficient of each intermediate loop for 'aggressive'
    self_distill: bool = False  # KD from the detached final-loop logits into the intermediate ones
    exit_threshold: float | None = None  # default confidence threshold of generate(); None = no early exit
    # Which score decides an exit (exit_score): 'softmax' = the max softmax probability (the paper's confidence; the
    # head on every row at every loop), 'gate' = the learned exit gate below (O(d) per row, CALM's classifier),
    # 'saturation' = cosine of the loop's input and output hidden states (O(d), no parameters; CALM's saturation).
    exit_rule: str = "softmax"
    # A learned exit gate: per non-final loop one linear classifier on the final-norm'ed hidden state, trained (on
    # detached inputs: the LM is untouched) to predict that this loop's argmax equals the final loop's (the oracle).
    exit_gate: bool = False
    # Which layers loop: 'cycle' = all N layers are the K = N / B shared ones looped B times (this paper's CYCLE);
    # 'middle_cycle' = the first and the last layer unique, the middle N - 2 are K = (N - 2) / B shared layers looped
    # B times (Mixture-of-Recursions' Middle-Cycle). A loop ends at the final norm and head only under 'cycle': early
    # exit and its training are refused for 'middle_cycle'.
    sharing: str = "cycle"

    def validate(self):
        super().validate()
        need = self.need
        count, number = self.is_int, self.is_number  # never a bool (True is an int to Python)
        need(count(self.n_loops) and self.n_loops >= 1, f"n_loops={self.n_loops!r} must be a positive int",
             field="n_loops")
        need(self.sharing in SHARINGS, f"sharing={self.sharing!r} is not one of {SHARINGS}", field="sharing")
        if self.sharing == "cycle":
            need(self.n_layer % self.n_loops == 0, f"n_layer={self.n_layer} is not divisible by n_loops={self.n_loops} "
                                                   f"(the shared block needs K = n_layer / n_loops layers)")
        else:
            mid = self.n_layer - 2
            need(mid >= self.n_loops and mid % self.n_loops == 0,
                 f"sharing='middle_cycle': the n_layer - 2 = {mid} middle layers are not divisible by "
                 f"n_loops={self.n_loops} (the shared block needs K = (n_layer - 2) / n_loops >= 1 layers)")
            for bad, what in ((self.exit_loss != "none", f"exit_loss={self.exit_loss!r}"),
                              (self.exit_gate, "exit_gate"), (self.exit_threshold is not None, "exit_threshold")):
                need(not bad, f"{what} needs sharing='cycle': under 'middle_cycle' the unique last layer follows the "
                              f"loops, so a loop's output is no exit")
        top = max_ranks(self)
        for c in COMPONENTS:
            r = getattr(self, f"lora_rank_{c}")
            need(count(r) and r >= 0, f"lora_rank_{c}={r!r} must be an int >= 0", field=f"lora_rank_{c}")
            need(r <= top[c], f"lora_rank_{c}={r} exceeds min(out, in) = {top[c]} of the {c} projections "
                              f"(full rank); use --lora-rank-{c} {top[c]} or less")
        need(self.exit_loss in EXIT_LOSSES, f"exit_loss={self.exit_loss!r} is not one of {EXIT_LOSSES}")
        need(number(self.exit_coef) and self.exit_coef >= 0,
             f"exit_coef={self.exit_coef!r} must be a finite number >= 0", field="exit_coef")
        need(not self.self_distill or self.exit_loss != "none",
             "self_distill needs an exit loss (weighted or aggressive) to weight the intermediate terms")
        need(self.exit_threshold is None or (number(self.exit_threshold) and self.exit_threshold > 0),
             f"exit_threshold={self.exit_threshold!r} must be a number > 0 (or None: no early exit)",
             field="exit_threshold")
        for name in ("lora_bias", "self_distill", "exit_gate"):
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be true or false",
                 field=name)
        need(self.exit_rule in EXIT_RULES, f"exit_rule={self.exit_rule!r} is not one of {EXIT_RULES}")
        need(self.exit_rule != "gate" or self.exit_gate,
             "exit_rule='gate' needs a model with a trained exit gate (train with --exit-gate)")

    @property
    def n_first(self) -> int:  # unique layers before the loops (Middle-Cycle)
        return 1 if self.sharing == "middle_cycle" else 0

    @property
    def n_last(self) -> int:  # unique layers after the loops (Middle-Cycle)
        return 1 if self.sharing == "middle_cycle" else 0

    @property
    def n_shared(self) -> int:  # K
        return (self.n_layer - self.n_first - self.n_last) // self.n_loops

    @property
    def lora_ranks(self) -> dict[str, int]:
        return {c: getattr(self, f"lora_rank_{c}") for c in COMPONENTS}

    @property
    def relaxed(self) -> bool:
        return any(r > 0 for r in self.lora_ranks.values())


def _relaxed_preset(p: dict, rank: int) -> dict:
    top = max_ranks(GPTConfig(**p))
    return {**p, "n_loops": 2, **{f"lora_rank_{c}": min(rank, top[c]) for c in COMPONENTS}}


RECURSIVE_PRESETS = {name: {**p, "n_loops": 2} for name, p in PRESETS.items()}
# Default ranks: about a quarter of d_model (the paper's main Gemma setting is 512 of 2048), capped at full rank.
RELAXED_RANK = {"tiny": 16, "small": 64, "base": 128, "gemma-2b": 512, "tinyllama-1.1b": 512, "pythia-1b": 512}
RELAXED_PRESETS = {name: _relaxed_preset(p, RELAXED_RANK.get(name, 64)) for name, p in PRESETS.items()}


# ----------------------------------------------------------------------------------------------------------------
# Which vanilla layers the shared layers come from (Figure 2, Appendix F)


def stepwise_layers(N: int, K: int) -> list[int]:
    """Fixed-ends Stepwise: round(linspace(0, N-1, K)), Python round (half to even). N=6, K=3 -> [0, 2, 5]."""
    if K == 1:
        return [0]
    return [round(k * (N - 1) / (K - 1)) for k in range(K)]


def tying_sources(N: int, K: int, init: str, sharing: str = "cycle") -> list[list[int]]:
    """For each shared layer k, the vanilla layers it is made of (averaged when more than one). Middle-Cycle ties
    over the middle layers 1..N-2 only (the first and the last are copied as they are)."""
    if sharing == "middle_cycle":
        return [[i + 1 for i in s] for s in tying_sources(N - 2, K, init)]
    B = N // K
    if init == "stepwise":
        return [[i] for i in stepwise_layers(N, K)]
    if init == "lower":
        return [[k] for k in range(K)]
    if init == "average":
        return [[l * K + k for l in range(B)] for k in range(K)]
    raise ValueError(f"unknown tying init {init!r}; choose one of {INITS}")


# ----------------------------------------------------------------------------------------------------------------
# Conversion from a vanilla model (section 2.2, Figure 2, Appendix C)

SHAPE_FIELDS = [f.name for f in fields(GPTConfig) if f.name != "max_seq_len"]


@torch.no_grad()
def from_vanilla(src: GPT, n_loops: int = 2, init: str = "stepwise", lora_init: str = "svd", log=print,
                 generator=None, **overrides) -> RecursiveGPT:
    """Convert a vanilla GPT of N layers into a (Relaxed) Recursive Transformer with B = n_loops loops.

    init: 'stepwise' | 'average' | 'lower' | 'random' (the tied layers); lora_init: 'svd' (eq. 4) | 'zero'.
    overrides: RecursiveConfig fields (LoRA ranks, exit losses, max_seq_len >= the source's); GPTConfig shape
    fields must equal the source's. A source with LayerNorm or linear biases gets per-loop bias deltas on the LoRA
    layers so that eq. 4 stays exact (svd_lora.py). Returns the model on the source's device and dtype.
    """
    if not isinstance(src, GPT) or type(src.config) is not GPTConfig:
        raise ValueError(f"conversion starts from a vanilla model.GPT, got a {type(src).__name__} with a "
                         f"{type(src.config).__name__}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {INITS}")
    base = asdict(src.config)
    for name in SHAPE_FIELDS:
        if name in overrides and overrides[name] != base[name]:
            raise ValueError(f"shape mismatch: the vanilla source has {name}={base[name]!r}, the target asks for "
                             f"{overrides[name]!r}")
    if overrides.get("max_seq_len", base["max_seq_len"]) < base["max_seq_len"]:
        overrides["max_seq_len"] = base["max_seq_len"]
    cfg_dict = {**base, "n_loops": n_loops, **overrides}
    probe = RecursiveConfig(**cfg_dict)  # validates divisibility and ranks
    has_bias = probe.norm == "layer" or probe.attn_bias or probe.mlp_bias
    cfg = RecursiveConfig(**{**cfg_dict, "lora_bias": probe.relaxed and has_bias})
    N, K, B = cfg.n_layer, cfg.n_shared, cfg.n_loops
    p = src.lm_head.weight
    model = RecursiveGPT(cfg).to(device=p.device, dtype=p.dtype)
    kind = "relaxed" if cfg.relaxed else "recursive"
    if init == "random":
        log(f"convert: {kind} N={N} B={B} K={K}, init random: a fresh model, no pretrained weight used")
        return model

    model.tok_emb.load_state_dict(src.tok_emb.state_dict())
    model.norm.load_state_dict(src.norm.state_dict())
    if not cfg.tie_embeddings:
        model.lm_head.load_state_dict(src.lm_head.state_dict())
    first, last = cfg.n_first, cfg.n_last  # Middle-Cycle: the unique layers are the source's first and last ones
    for i, block in enumerate(model.unique_first):
        block.load_state_dict(src.blocks[i].state_dict())
    for i, block in enumerate(model.unique_last):
        block.load_state_dict(src.blocks[N - last + i].state_dict())
    sources = tying_sources(N, K, init, cfg.sharing)
    for k, block in enumerate(model.blocks):
        sds = [src.blocks[i].state_dict() for i in sources[k]]
        sd = {n: torch.stack([s[n].float() for s in sds]).mean(0).to(sds[0][n].dtype) for n in sds[0]}
        missing, unexpected = block.load_state_dict(sd, strict=False)
        assert not unexpected and all(".lora_" in m for m in missing), (missing, unexpected)
    log(f"convert: {kind} N={N} B={B} K={K}, init {init}: shared layer k <- vanilla layers "
        f"{[s if len(s) > 1 else s[0] for s in sources]}"
        + (f"; unique layers {list(range(first))} and {list(range(N - last, N))} copied (Middle-Cycle)"
           if cfg.sharing != "cycle" else ""))
    if cfg.relaxed:
        total = {}
        for k, block in enumerate(model.blocks):
            counts = init_lora(block, [src.blocks[first + l * K + k] for l in range(B)], lora_init,
                               generator=generator)
            total = {n: total.get(n, 0) + v for n, v in counts.items()}
        log(f"convert: LoRA ranks {cfg.lora_ranks}, init {lora_init}: {total['svd']} residuals by torch.linalg.svd "
            f"(float64), {total['lowrank']} by torch.svd_lowrank, {total['zero_residual']} exactly zero (standard "
            f"init), {total['standard']} standard init by request"
            + (f"; {total['revived']} dead norm channel(s) revived" if total["revived"] else "")
            + ("; per-loop bias deltas (the source has biases)" if cfg.lora_bias else ""))
    return model


# ----------------------------------------------------------------------------------------------------------------
# How train.py sees the two architectures


def add_args(ap: argparse.ArgumentParser):
    """Flags of recursive and relaxed (both specs share them). --loops is train.py's. A flag's `bounds` (min, above,
    max) are checked by train.py as it parses (cli.number: one line naming the flag); RecursiveConfig checks again."""
    g = ap.add_argument_group("recursive / relaxed")
    g.add_argument("--init", default=None, choices=INITS,
                   help="tying of looped layers when converting (--init-from): default stepwise for recursive, "
                        "average for relaxed (the paper's best); random = fresh init")
    g.add_argument("--sharing", default=None, choices=SHARINGS,
                   help="which layers loop: cycle (all, the default) or middle_cycle (the first and last layer unique, "
                        "the middle looped; Mixture-of-Recursions)")
    g.add_argument("--lora-rank", type=int, default=None, help="relaxed: LoRA rank of every component (default preset)")
    for c in COMPONENTS:
        g.add_argument(f"--lora-rank-{c}", type=int, default=None, help=f"relaxed: LoRA rank of the {c} projections")
    g.add_argument("--lora-init", default=None, choices=["svd", "zero"],
                   help="relaxed conversion: truncated-SVD init (eq. 4, default) or standard zero init")
    g.add_argument("--exit-loss", default=None, choices=EXIT_LOSSES, help="early-exit training loss (section 3.7)")
    g.add_argument("--exit-coef", type=float, default=None,
                   help="intermediate-loop coefficient of --exit-loss aggressive (default 0.1)").bounds = {"min": 0}
    g.add_argument("--self-distill", action="store_true", default=None,
                   help="KD from the detached final-loop logits into the intermediate ones")
    g.add_argument("--exit-threshold", type=float, default=None,
                   help="confidence threshold in (0, 1] for early exit in generate (default: none)"
                   ).bounds = {"above": 0, "max": 1}
    g.add_argument("--exit-gate", action="store_true", default=None,
                   help="train a learned exit gate (one linear classifier per non-final loop, detached inputs)")
    g.add_argument("--exit-rule", default=None, choices=EXIT_RULES,
                   help="exit score of generate / serve.py: softmax (max probability), gate (learned), saturation")


def config_overrides(args, relaxed: bool) -> dict:
    """RecursiveConfig fields set by the flags (only those given)."""
    o = {}
    if getattr(args, "loops", None) is not None:
        o["n_loops"] = args.loops
    ranks = {c: getattr(args, f"lora_rank_{c}", None) for c in COMPONENTS}
    base = getattr(args, "lora_rank", None)
    if relaxed:
        for c, r in ranks.items():
            r = base if r is None else r
            if r is not None:
                o[f"lora_rank_{c}"] = r
    elif base or any(ranks.values()) or getattr(args, "lora_init", None):
        raise ValueError("--lora-rank* and --lora-init are flags of --arch relaxed, not recursive")
    for name in ("sharing", "exit_loss", "exit_coef", "self_distill", "exit_threshold", "exit_gate", "exit_rule"):
        if getattr(args, name, None) is not None:
            o[name] = getattr(args, name)
    if getattr(args, "init", None) not in (None, "random") and not getattr(args, "init_from", None):
        raise ValueError(f"--init {args.init} converts a vanilla model: it needs --init-from a vanilla checkpoint")
    return o


# So that `python train.py --arch recursive|relaxed` alone takes about as long as vanilla's 300 steps on two CPU
# cores: a recursive step costs about a vanilla one (same effective depth), a relaxed step a little more (the LoRA
# matmuls), so relaxed runs fewer steps. RESULTS.md (Timings) has the wall times of these commands.
TRAIN_DEFAULTS = {"recursive": {"max_iters": 300}, "relaxed": {"max_iters": 250}}


def preset_rows(preset: str, options=None, relaxed: bool = False) -> list:
    """The rows `python bench.py presets --arch recursive,relaxed` prints for one preset (meta device): recursive =
    the vanilla model and the recursive one with B loops (options.loops, default 2), CYCLE and, where the preset's
    N - 2 middle layers divide by B, Middle-Cycle; relaxed = one row per LoRA rank
    of options.ranks (default 8,16,32,64; each component capped at its full rank, named in the label when capped).
    Every looped model sits beside the vanilla model as its baseline. options: bench.py's parsed flags, or None."""
    B = getattr(options, "loops", None) or 2
    ranks = [int(r) for r in (getattr(options, "ranks", None) or "8,16,32,64").split(",")]
    base = dict(PRESETS[preset])
    label = lambda model: f"{preset:{max(map(len, PRESETS))}s} {model:24s}"  # noqa: E731 - aligned across presets
    with torch.device("meta"):
        van = GPT(GPTConfig(**base))
        if not relaxed:
            rows = [(label("vanilla"), van, None),
                    (label(f"recursive B={B}"), RecursiveGPT(RecursiveConfig(**base, n_loops=B)), van)]
            if (base["n_layer"] - 2) % B == 0 and base["n_layer"] - 2 >= B:  # Middle-Cycle where its middle divides
                mid = RecursiveGPT(RecursiveConfig(**base, n_loops=B, sharing="middle_cycle"))
                rows.append((label(f"middle-cycle B={B}"), mid, van))
            return rows
        top, rows = max_ranks(van.config), []
        for r in ranks:
            rank = {c: min(r, top[c]) for c in COMPONENTS}
            capped = ",".join(f"{c}{v}" for c, v in rank.items() if v < r)
            cfg = RecursiveConfig(**base, n_loops=B, **{f"lora_rank_{c}": v for c, v in rank.items()})
            rows.append((label(f"relaxed B={B} r={r}" + (f" ({capped})" if capped else "")), RecursiveGPT(cfg), van))
        return rows


def stack_params(cfg: RecursiveConfig, layers) -> int:
    """The parameters of the layer stacks from the config alone (ArchSpec.stack_params): the K shared layers once,
    with a LoRA per loop of each component's rank, and Middle-Cycle's unique first and last layers."""
    return layers(cfg.n_shared, loops=cfg.n_loops, ranks=cfg.lora_ranks) + layers(cfg.n_first + cfg.n_last)


def _spec(name, presets, relaxed):
    return ArchSpec(name, RecursiveConfig, RecursiveGPT, presets, add_args=add_args,
                    config_overrides=lambda args, tok=None: config_overrides(args, relaxed),
                    train_defaults=TRAIN_DEFAULTS[name],
                    preset_rows=lambda preset, options=None: preset_rows(preset, options, relaxed),
                    stack_params=stack_params, stack_passes=lambda cfg: cfg.n_loops)


ARCH_SPECS = [_spec("recursive", RECURSIVE_PRESETS, False), _spec("relaxed", RELAXED_PRESETS, True)]
