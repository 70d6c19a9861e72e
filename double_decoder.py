"""
double_decoder.py -- the block-based double decoder: doubly-causal block attention, trained like a decoder-only model,
served like an encoder-decoder.

Paper: "Block-Based Double Decoders" (Alexander, Bradley, Harsha and Labovich, arXiv:2605.18807). Sections 3.1
(architecture), 3.2 / Appendix A.2 (FLOPs), 3.3 / Appendix A.1 (KV cache, time to first token, prefix caching), 4 (the
prefix-LM objective), Appendix A.4 (hyper-parameters). Official code: ashlab11/block-based-double-decoder.

Two stacks of model.Block share one token embedding (and the tied head):

    tokens x (B, T) --embedding--> (B, T, C)
        context decoder:    a plain causal decoder (ctx_layers Blocks) -> final norm -> latents h (B, T, C)
        generation decoder: gen_layers Blocks whose attention is DualAttention -> norm -> head -> logits (B, T, V)

A block partition 0 = b_0 < b_1 < ... < b_K = T splits the sequence into K contiguous blocks (block ids `blk`,
(T,) long). In every generation-decoder layer the query at position t of block k attends to ONE softmax over two key
sets (section 3.1, Figure 2): within-block keys, that layer's own states at positions s <= t of block k (causal
self-attention), and cross-block keys, that layer's k/v projections of the latents of blocks m < k. Both are
attentions that also return their log-sum-exp, merged exactly in fp32 (kernels.dual_attention):
    o = e^{l1 - l} o1 + e^{l2 - l} o2,  l = logaddexp(l1, l2)
Block-0 rows have no cross keys and are plain causal self-attention. Logits[:, t] predict token t+1 and every token
is a target exactly once per forward, whatever the partition. Training runs both decoders once over all T positions
(the cross keys are the latents of ALL positions, hidden by the block mask): no per-block loop, no dynamic shapes.

Generation (section 3.3): the context is every prompt token but the last, which opens the generation block. The
context decoder runs once over the context, every generation layer projects the latents to its cross K/V once, and
generated tokens join the current block with a self-attention cache of that block only (time to first token
~ L_ctx / L). A shared prompt prefix's context cache is computed once and reused (DoubleCache.clone), and
`rollover=N` folds the current block into the context every N tokens. decode_step picks one of two step kinds on the
host, token_step or rollover_step (the fold, then the token); compile_decode compiles both, on static caches, for
CUDA graphs.

Choices and deviations (config fields; the paper's behaviour one flag away):
  * cross K/V share the self k/v projections (the official default); --separate-cross-kv adds separate ones;
  * RoPE with absolute positions on both sides (cross keys at their latents' positions); no attention sink;
  * attention: FlexAttention on CUDA, else the differentiable reference (kernels.dual_attention; --dd-attn dense
    forces it); cached steps go through kernels.dual_attention, which on CUDA runs FlexAttention too, not the fused
    single-softmax Triton kernel (kernels.py says why);
  * objective: random block partitions (--min-blocks, --max-blocks) or the prefix-LM split (--objective prefixlm);
  * init: GPT-2 per stack; --dd-init xavier is the paper's; latents normed by cfg.norm, --latent-norm layer is the
    official LayerNorm;
  * deviation: the context decoder trains at ctx_lr = 0.25 times the learning rate (train.py's default for --arch
    double; --ctx-lr 1 is the paper's), because at the paper's single rate its latents collapse to one vector within
    the first steps. train.py logs `latent_cos` (latent_cosine). The measurements behind it: RESULTS.md, "Training
    dynamics of the double decoder".

Run:
    python bench.py presets --arch double                     # presets: parameters, KV bytes, FLOPs vs decoder-only
    python train.py --arch double                             # pretrain tiny with random block partitions
    python train.py --arch double --objective prefixlm        # the prefix-LM objective of section 4
    python eval.py double-eval out/double/ckpt.pt --sample "def " --rollover 16   # generate, folding every 16 tokens
    python bench.py double --preset small --threads 1 --batch 1 --prompt-len 128   # TTFT, per token, KV vs decoder-only
    python bench.py figures                                   # Figure 2: the masks of training and generation
    python -m pytest -q tests/test_double_decoder.py
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from graphs import mark_static
from model import (IGNORE, ArchSpec, Attention, Block, GPT, GPTConfig, KVCache, Linear, apply_rotary,
                   check, init_weights, kv_bytes, lm_loss, make_norm, run_cached)


# ----------------------------------------------------------------------------------------------------------------
# Dual attention: one softmax over within-block self keys and earlier-block cross keys


@dataclass
class DualIds:
    """Positions and block ids of queries, self keys and cross keys (B, T*) long, as kernels.dual_masks reads them:
    self key j visible iff s_blk[j] == q_blk[i] and s_pos[j] <= q_pos[i]; cross key j iff c_blk[j] < q_blk[i]."""

    q_pos: torch.Tensor
    q_blk: torch.Tensor
    s_pos: torch.Tensor
    s_blk: torch.Tensor
    c_blk: torch.Tensor


@dataclass
class DualStep:
    """One cached generation step (DoubleDecoder.gen_step builds it once for every generation layer): where the new
    tokens' K/V go in the block's cache and how many keys of each cache the step reads."""

    self_kv: KVCache  # the current block's K/V, index = position - ctx_len
    cross: KVCache  # each generation layer's K/V of the context latents
    self_idx: torch.Tensor  # (B, n) the new tokens' indices in the block's cache
    self_len: int  # the self keys read: the block's tokens after this step (a static cache: all max_block)
    cross_len: int  # the cross keys read: the context's length, or 1, block 0's masked dummy key (static: max_len)


# The block ids of a cached step: the context's latents all count as one block, CONTEXT_BLOCK, before the current
# block, CURRENT_BLOCK, so its tokens see every latent and, causally, each other. Before any context (block 0) the step
# reads one dummy cross key with NO_BLOCK, an id above every query's: a cross key is seen only from a later block.
CONTEXT_BLOCK, CURRENT_BLOCK = 0, 1
NO_BLOCK = 1 << 30


class DualAttention(Attention):
    """A generation-decoder layer's attention: model.Attention (q/k/v/o projections, RoPE, GQA) plus the cross keys.

    forward(x, rope, ctx=latents, ids=DualIds)              training: cross K/V projected here from the latents
    forward(x, rope, ids=DualIds, flex=(self_bm, cross_bm))  training on CUDA: FlexAttention instead of the reference
    forward(x, rope, ids=DualIds, step=DualStep, layer=i)    cached step of generation layer i
    """

    def __init__(self, cfg: DoubleConfig):
        super().__init__(cfg)
        self.separate = cfg.separate_cross_kv
        if self.separate:  # --separate-cross-kv: 2 d (H_kv D) more parameters per layer
            self.ck_proj = Linear(cfg.n_embd, cfg.n_kv_head * cfg.hd, bias=cfg.attn_bias)
            self.cv_proj = Linear(cfg.n_embd, cfg.n_kv_head * cfg.hd, bias=cfg.attn_bias)

    def project_cross(self, h, rope, lora_idx=None):
        """Cross keys/values of latents h (B, S, C) at the positions given by rope -> (B, H_kv, S, D) each."""
        if not self.separate:
            return self.project_kv(h, rope, lora_idx)
        k = apply_rotary(self.split_heads(self.ck_proj(h, lora_idx), self.n_kv_head), *rope)
        v = self.split_heads(self.cv_proj(h, lora_idx), self.n_kv_head)
        return k, v

    def forward(self, x, rope, lora_idx=None, ids: DualIds | None = None, ctx=None, flex=None,
                step: DualStep | None = None, layer: int = 0):
        q = self.project_q(x, rope, lora_idx)  # (B, H, T, D)
        k_s, v_s = self.project_kv(x, rope, lora_idx)  # (B, H_kv, T, D): this block's own states
        if step is not None:  # cached step: the new K/V join the block's cache; the cross K/V were cached once
            self_kv = step.self_kv.layer(layer)
            self_kv.write(step.self_idx, k_s, v_s)
            k_s, v_s = self_kv.read(step.self_len)  # (B, H_kv, self_len, D)
            k_c, v_c = step.cross.layer(layer).read(step.cross_len)  # (B, H_kv, cross_len, D)
        elif flex is not None:
            k_c, v_c = self.project_cross(ctx, rope, lora_idx)  # (B, H_kv, T, D): latents of ALL positions
            o1, l1 = kernels.flex_attention_lse(q, k_s, v_s, flex[0])
            o2, l2 = kernels.flex_attention_lse(q, k_c, v_c, flex[1])
            return self.project_out(kernels.merge_lse(o1, l1, o2, l2)[0], lora_idx)
        else:
            k_c, v_c = self.project_cross(ctx, rope, lora_idx)
        y, _ = kernels.dual_attention(q, ids.q_pos, ids.q_blk, k_s, v_s, ids.s_pos, ids.s_blk, k_c, v_c, ids.c_blk)
        return self.project_out(y, lora_idx)


def flex_block_masks(blk: torch.Tensor, T: int):
    """blk (T,), (1, T) or (B, T) on the device -> (self BlockMask, cross BlockMask), built once per batch for all
    layers. A shared partition gives a batch-broadcast mask (B=None) whose mask_mod never indexes by batch:
    FlexAttention calls it with the batch index of q (0..B-1), which a (1, T) tensor does not have for B > 1.

    self: kv <= q and same block; cross: block(kv) < block(q) -- the official code's masks (without its sink).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if blk.dim() == 2 and blk.size(0) == 1:
        blk = blk[0]
    if blk.dim() == 1:  # one partition for the whole batch: a broadcast mask whose mask_mod ignores b
        nb, bid = None, lambda b, i: blk[i]
    else:
        nb, bid = blk.size(0), lambda b, i: blk[b, i]

    def self_mod(b, h, q, kv):
        return (kv <= q) & (bid(b, kv) == bid(b, q))

    def cross_mod(b, h, q, kv):
        return bid(b, kv) < bid(b, q)

    return (create_block_mask(self_mod, nb, None, T, T, device=blk.device),
            create_block_mask(cross_mod, nb, None, T, T, device=blk.device))


# ----------------------------------------------------------------------------------------------------------------
# Inference caches


class DoubleCache:
    """Everything generation keeps (Appendix A.1), all rows at the same positions:

    ctx      KVCache (ctx_layers, B, H_kv, max_len, D): the context decoder's K/V, index = position. Kept only when
             the context will be extended (rollover, prefix reuse); a one-shot prompt needs none (keep_context=False).
    cross    KVCache (gen_layers, B, H_kv, max_len, D): each generation layer's K/V of the latents h_0..h_{n-1}.
    self_kv  KVCache (gen_layers, B, H_kv, max_block, D): the current block's K/V, index = position - ctx_len.
    tokens   (B, max_block) the current block's tokens (folded into the context by a rollover).
    ctx_len  n, the context's length = the position where the current block starts; block_len its tokens so far.
             Both are counted twice: as host ints (the checks, the step kind, an eager step's key counts) and on the
             device as the lengths of cross (and ctx) and of self_kv, which place every key inside a step.

    static: every step reads all max_len cross keys and all max_block self keys (masked), so its shapes never change,
    and every tensor a step writes is marked static (KVCache, graphs.mark_static): what a captured step needs.
    """

    def __init__(self, cfg: DoubleConfig, batch: int, max_len: int, max_block: int, keep_context: bool, dtype, device,
                 static=False):
        H, D, S = cfg.n_kv_head, cfg.hd, max(max_len, 1)
        self.config, self.static = cfg, static
        self.ctx = KVCache(cfg.ctx_layers, batch, S, H, D, dtype, device, static) if keep_context else None
        self.cross = KVCache(cfg.gen_layers, batch, S, H, D, dtype, device, static)
        self.self_kv = KVCache(cfg.gen_layers, batch, max(max_block, 1), H, D, dtype, device, static)
        self.tokens = torch.zeros(batch, max(max_block, 1), dtype=torch.long, device=device)
        self.ctx_len, self.block_len = 0, 0
        if static:
            mark_static(self.tokens)

    @property
    def batch(self) -> int:
        return self.tokens.size(0)

    def clone(self, batch: int | None = None) -> "DoubleCache":
        """An independent copy (prefix caching: clone the shared prefix's cache per request), rows broadcast from a
        1-row cache to `batch` rows if given."""
        k = self.cross.k
        new = DoubleCache(self.config, batch or self.batch, self.cross.max_len, self.self_kv.max_len,
                          self.ctx is not None, k.dtype, k.device, self.static)
        new.copy_from(self)
        return new

    def copy_from(self, src: "DoubleCache"):
        """src's caches, block tokens and lengths -> this cache's buffers (KVCache.copy_rows), each row from src's
        row, or from src's one row broadcast: a shared prefix into a pre-allocated cache."""
        check(src.batch in (1, self.batch) and (src.ctx is None) == (self.ctx is None),
              f"a cache of {src.batch} rows (context kept: {src.ctx is not None}) cannot be copied into one of "
              f"{self.batch} rows (context kept: {self.ctx is not None}); only a 1-row cache broadcasts", "cache copy")
        rows = torch.arange(self.batch, device=self.tokens.device)
        src_rows = rows if src.batch == self.batch else torch.zeros_like(rows)
        for dst, kv in ((self.ctx, src.ctx), (self.cross, src.cross), (self.self_kv, src.self_kv)):
            if kv is not None:
                dst.copy_rows(kv, src_rows, rows)
        self.tokens[:, :src.tokens.size(1)] = src.tokens[src_rows]
        self.ctx_len, self.block_len = src.ctx_len, src.block_len

    def reset(self):
        """Forget the context and the block (the buffers stay allocated; stale entries are never read)."""
        self.ctx_len, self.block_len = 0, 0
        for kv in (self.ctx, self.cross, self.self_kv):
            if kv is not None:
                kv.reset()

    def nbytes(self) -> int:
        """Bytes of the generation-time caches (cross + self K/V): what Appendix A.1 counts."""
        return self.cross.nbytes() + self.self_kv.nbytes()

    def context_nbytes(self) -> int:
        """Bytes of the context decoder's K/V (0 when not kept)."""
        return self.ctx.nbytes() if self.ctx is not None else 0


# ----------------------------------------------------------------------------------------------------------------
# The model


def latent_cosine(h: torch.Tensor) -> torch.Tensor:
    """Mean cosine between the latents h (B, T, C) of different positions of the same row -> 0-d fp32 tensor.

    1 when the context decoder has collapsed to one output vector (see the module docstring; the values of real runs:
    RESULTS.md, "Training dynamics of the double decoder").
    """
    B, T, _ = h.shape
    u = F.normalize(h.float(), dim=-1).sum(1)  # (B, C): |sum_i u_i|^2 = sum_{i,j} cos_ij
    return ((u.pow(2).sum(-1) - T) / max(T * (T - 1), 1)).mean()


class DoubleDecoder(GPT):
    """Block-based double decoder (section 3.1).

    From model.GPT it keeps the shared token embedding (`embed`), the final norm + tied head (`head`), RoPE, the
    length check, the parameter count, the generate loop and compile_decode (over the step kinds of graph_steps);
    its two stacks take the place of GPT's one (`blocks`, None here: GPT's forward_cached, which runs it, does not
    apply to this model).
    forward(idx, targets=None, blk=None) -> (logits, loss); blk = block ids (T,) or (B, T) (default: the even partition
    into max_blocks blocks). Inference: new_cache -> [extend_context (shared prefix)] -> prefill -> decode_step, and
    GPT.generate strings them together (cache_size sizes the cache; `rollover` reaches every decode_step).
    """

    blocks = None  # GPT's single stack

    def __init__(self, cfg: DoubleConfig):
        ctx_blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.ctx_layers))  # the context decoder
        # the latents h are normed (official: encoder_norm, a LayerNorm)
        ctx_norm = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps) if cfg.latent_norm == "layer" else make_norm(cfg)
        gen_blocks = nn.ModuleList(Block(cfg, attn_cls=DualAttention) for _ in range(cfg.gen_layers))
        # GPT's embedding, final norm, (tied) head, RoPE and GPT-2 init around the two stacks, registered between the
        # embedding and the final norm in this order: the state_dict keys and parameter order of every checkpoint
        super().__init__(cfg, stacks=dict(ctx_blocks=ctx_blocks, ctx_norm=ctx_norm, gen_blocks=gen_blocks))
        if cfg.init == "xavier":  # the paper's (and the official code's) init of every hidden matrix
            for m in self.modules():
                if isinstance(m, nn.Linear) and m is not self.lm_head:
                    nn.init.xavier_uniform_(m.weight, gain=math.sqrt(2))
        else:
            init_weights(self.ctx_blocks, cfg.ctx_layers)  # each residual stream scaled by its own depth
            init_weights(self.gen_blocks, cfg.gen_layers)
        if cfg.ctx_lr != 1.0:  # model.make_optimizer gives these matrices lr x ctx_lr
            for m in self.ctx_blocks.modules():
                if isinstance(m, nn.Linear):
                    m.weight.lr_scale = cfg.ctx_lr

    # -- pieces ---------------------------------------------------------------------------------------------------

    def default_partition(self, T: int, device=None) -> torch.Tensor:
        """The partition of forward(idx) without blk: min(max_blocks, T) blocks of (nearly) equal length."""
        K = min(self.config.max_blocks, T)
        return splits_to_blk([T * i // K for i in range(1, K)], T, device)

    def context(self, x, rope):
        """Context decoder: embeddings x (B, T, C) -> latents h (B, T, C), causal, after the context norm. (Cached:
        extend_context runs the same blocks through model.run_cached.)"""
        for block in self.ctx_blocks:
            x = block(x, rope)
        return self.ctx_norm(x)

    def context_latents(self, idx):
        """idx (B, T) -> latents h (B, T, C) of the context decoder (no cache)."""
        return self.context(self.embed(idx), self.rope(torch.arange(idx.size(1), device=idx.device)))

    # -- training forward ----------------------------------------------------------------------------------------

    def forward(self, idx, targets=None, blk=None):
        """idx (B, T), blk block ids (T,) or (B, T) -> logits (B, T, V) and the mean loss over every target."""
        B, T = idx.shape
        self.check_length(T)
        blk = self.default_partition(T) if blk is None else blk
        n_blocks = check_partition(blk, B, T)
        self.metrics = {"blocks": float(n_blocks)}
        blk = blk.to(idx.device)
        pos = torch.arange(T, device=idx.device)
        rope = self.rope(pos)  # absolute positions for queries, self keys and cross keys alike
        x = self.embed(idx)  # (B, T, C), the input of both decoders
        h = self.context(x, rope)  # (B, T, C) latents of every position (masked per block below)
        if torch.is_grad_enabled():  # a 0-d tensor: train.py formats it at its log lines only (no per-step sync)
            self.metrics["latent_cos"] = latent_cosine(h.detach())
        # 'auto': on CUDA FlexAttention, its block masks built once for every layer (training, eval, scoring);
        # elsewhere kernels.dual_attention, i.e. the reference.
        impl = self.config.attn_impl
        use_flex = impl == "flex" or (impl == "auto" and idx.is_cuda)
        flex = flex_block_masks(blk, T) if use_flex else None
        b2 = blk.expand(B, T)
        ids = DualIds(pos.expand(B, T), b2, pos.expand(B, T), b2, b2)
        for block in self.gen_blocks:
            x = block(x, rope, ids=ids, ctx=h, flex=flex)
        logits = self.head(x)
        return logits, (lm_loss(logits, targets) if targets is not None else None)

    # -- inference -----------------------------------------------------------------------------------------------

    cache_cls = DoubleCache  # GPT.new_cache(batch, max_context, max_block, keep_context=False) builds it

    def cache_kwargs(self, max_block: int, keep_context: bool = False) -> dict:
        """new_cache's max_len is the context's positions; max_block the block's tokens; keep_context keeps the
        context decoder's K/V (to extend the context: rollover, a shared prefix)."""
        return dict(cfg=self.config, max_block=max_block, keep_context=keep_context)

    def cache_size(self, prompt_len: int, max_new_tokens: int, rollover: int | None = None) -> tuple[int, dict]:
        """GPT.generation_cache's sizing hook: the context holds prompt[:-1] (and, with rollover N, every folded
        block: it is kept for the extensions); the block holds the new tokens, or N of them."""
        grow = max_new_tokens if rollover is not None else 0
        return prompt_len - 1 + grow, dict(max_block=min(rollover or max_new_tokens, max_new_tokens),
                                           keep_context=rollover is not None)

    def cache_covers(self, have: dict, want: dict) -> bool:
        """A static cache serves a generation with a block as long or shorter and the same context keeping."""
        return have["keep_context"] == want["keep_context"] and have["max_block"] >= want["max_block"]

    @torch.no_grad()
    def extend_context(self, idx, cache: DoubleCache):
        """Append tokens idx (B, n) to the context: the context decoder runs over them only (incremental, against its
        own cache), every generation layer appends their cross K/V. Only between blocks (block_len == 0)."""
        B, n = idx.shape
        start = cache.ctx_len
        if n == 0:
            return
        if cache.block_len:
            raise ValueError("the context can only be extended between blocks; this cache holds an open block")
        if B != cache.batch:
            raise ValueError(f"{B} rows of tokens for a cache of {cache.batch} rows")
        cache.cross.fits(start + n, "extending the context needs")
        self.check_length(start + n)
        if start > 0 and cache.ctx is None:
            raise ValueError("this cache was built with keep_context=False: the context decoder's K/V were not kept, "
                             "so its context cannot be extended (new_cache(..., keep_context=True))")
        self.append_context(idx, cache, fresh=start == 0)
        cache.ctx_len = start + n

    def append_context(self, idx, cache: DoubleCache, fresh: bool = False):
        """extend_context's work, checks done: idx (B, n) at the positions after the context (the device count
        cache.cross.lengths). fresh: the context is empty, so the context decoder attends causally over idx alone."""
        B, n = idx.shape
        q_pos = cache.cross.lengths[:, None] + torch.arange(n, device=idx.device)  # (B, n) absolute positions
        rope = self.rope(q_pos)
        x = self.embed(idx)
        if cache.ctx is None:  # a one-shot prompt (fresh): the context decoder's K/V are not kept
            h = self.context(x, rope)  # (B, n, C)
        else:  # against the cached prefix (cache.ctx.lengths == cache.cross.lengths)
            h = self.ctx_norm(run_cached(self.ctx_blocks, self.rope, x, cache.ctx, fresh=fresh))
        for i, block in enumerate(self.gen_blocks):
            k, v = block.attn.project_cross(h, rope)  # once per layer, reused by every later step
            cache.cross.layer(i).write(q_pos, k, v)
        for kv in (cache.ctx, cache.cross):
            if kv is not None:
                kv.lengths += n

    def check_step(self, cache: DoubleCache, n: int = 1):
        """Before n tokens join the block (host ints only): room in the block's cache and within max_seq_len."""
        cache.self_kv.fits(cache.block_len + n, "the block (a larger max_block, or a rollover) needs")
        if cache.ctx_len + cache.block_len + n > self.config.max_seq_len:
            raise ValueError(f"position {cache.ctx_len + cache.block_len + n - 1} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")

    def gen_step(self, tok, cache: DoubleCache):
        """Tokens tok (B, n) join the current block -> final hidden states (B, n, C) before the final norm.

        Every position comes from the device counts (self_kv.lengths: the block's tokens so far; cross.lengths: the
        context's), so the step reads no Python number that changes from step to step. A static cache's step reads
        every key, the unfilled ones masked by their positions and block ids; otherwise it reads the block's tokens
        and the context only (cache.block_len, cache.ctx_len: the host's count of the same)."""
        B, n = tok.shape
        dev = tok.device
        ctx_len = cache.cross.lengths[:, None]  # (B, 1)
        self_idx = cache.self_kv.lengths[:, None] + torch.arange(n, device=dev)  # (B, n) index in the block's cache
        q_pos = ctx_len + self_idx  # (B, n) absolute positions
        if cache.static:
            S1, S2 = cache.self_kv.max_len, cache.cross.max_len
        else:  # the filled keys only; before any context (block 0) one dummy cross key, masked by its block id
            S1, S2 = cache.block_len + n, max(cache.ctx_len, 1)
        s_idx, c_idx = torch.arange(S1, device=dev), torch.arange(S2, device=dev)

        def block_ids(width, block):  # (B, width) long, all `block`
            return torch.full((B, width), block, dtype=torch.long, device=dev)

        # self key j sits at position ctx_len + j (those past the new tokens: hidden by the causal test); cross key j
        # is the latent of position j, an earlier block's if j < ctx_len, else no block's (NO_BLOCK: never seen)
        c_blk = torch.where(c_idx < ctx_len, CONTEXT_BLOCK, NO_BLOCK)  # (B, S2)
        ids = DualIds(q_pos, block_ids(n, CURRENT_BLOCK), ctx_len + s_idx, block_ids(S1, CURRENT_BLOCK), c_blk)
        step = DualStep(cache.self_kv, cache.cross, self_idx, S1, S2)
        rope = self.rope(q_pos)
        x = self.embed(tok)
        for i, block in enumerate(self.gen_blocks):
            x = block(x, rope, ids=ids, step=step, layer=i)
        cache.tokens.scatter_(1, self_idx, tok)
        cache.self_kv.lengths += n
        return x

    def fold(self, cache: DoubleCache, n: int):
        """Rollover: the current block's n tokens become context (the context decoder is extended over exactly them,
        the generation layers append their cross K/V) and the next token opens a new, empty block. The device work
        only: decode_step moves the host's counts."""
        self.append_context(cache.tokens[:, :n], cache)
        cache.self_kv.lengths.zero_()

    @torch.no_grad()
    def prefill(self, idx, cache: DoubleCache):
        """Prompts idx (B, T) -> logits (B, V) of the first new token. The context grows by idx[:, :-1] (after any
        prefix already in the cache) and idx[:, -1] opens the generation block."""
        if idx.size(1) < 1:
            raise ValueError("every prompt needs at least one token")
        if cache.block_len:
            raise ValueError("prefill needs a cache between blocks (block_len == 0): clone the prefix cache first")
        if idx.size(0) != cache.batch:
            raise ValueError(f"the cache has {cache.batch} rows and the prompts {idx.size(0)}: clone it with "
                             f"batch={idx.size(0)}")
        self.extend_context(idx[:, :-1], cache)
        self.check_step(cache)
        logits = self.token_step(idx[:, -1].contiguous(), cache)  # the block's first token: decode's step kind
        cache.block_len = 1
        return logits

    @torch.no_grad()
    def decode_step(self, tok, cache: DoubleCache, rollover: int | None = None):
        """One new token per row tok (B,) -> logits (B, V). With rollover N, a block of N tokens is folded into the
        context before the next token opens a new block. The host keeps the counts (cache.ctx_len, block_len), checks
        them and picks one of two step kinds: token_step, or rollover_step when the block is full."""
        n_fold = cache.block_len if rollover is not None and cache.block_len >= rollover else 0
        if n_fold:
            if cache.ctx is None:
                raise ValueError("this cache was built with keep_context=False: a rollover extends the context "
                                 "(new_cache(..., keep_context=True))")
            cache.cross.fits(cache.ctx_len + n_fold, "the rollover needs")
            cache.ctx_len, cache.block_len = cache.ctx_len + n_fold, 0  # the counts the token after the fold sees
        self.check_step(cache)
        logits = self.rollover_step(tok, cache, n_fold) if n_fold else self.token_step(tok, cache)
        cache.block_len += 1
        return logits

    # The two step kinds: compile_decode compiles each (one graph per kind, batch size and rollover length). With a
    # static cache neither reads a count that changes from step to step (see gen_step).
    graph_steps = ("token_step", "rollover_step")

    @torch.no_grad()
    def token_step(self, tok, cache: DoubleCache):
        """tok (B,) joins the current block -> logits (B, V) of the next token."""
        return self.head(self.gen_step(tok[:, None], cache))[:, 0]

    @torch.no_grad()
    def rollover_step(self, tok, cache: DoubleCache, n_fold: int):
        """The block's n_fold tokens are folded into the context (fold), then tok opens a new block -> logits (B, V)."""
        self.fold(cache, n_fold)
        return self.head(self.gen_step(tok[:, None], cache))[:, 0]

    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0, top_k=None, generator=None, cache=None,
                 rollover: int | None = None):
        """GPT.generate (prefill, then decode_step(tok, cache, rollover=N) per token: the fold of a full block happens
        inside decode_step). rollover N: fold the block into the context every N tokens. cache: a cache already
        holding a shared prefix (from extend_context; used in place, clone it to reuse it): idx continues after that
        prefix, so its positions count towards max_seq_len."""
        check(rollover is None or rollover >= 1, f"must be a positive number of tokens, got {rollover}", "rollover")
        self.check_length((cache.ctx_len if cache is not None else 0) + idx.size(1) + max_new_tokens)
        return super().generate(idx, max_new_tokens, temperature, top_k, generator, cache, rollover=rollover)

    # -- accounting ----------------------------------------------------------------------------------------------

    def kv_cache_bytes(self, batch: int, seq_len: int, dtype_bytes: int = 2, context_len: int = 0) -> int:
        """Appendix A.1: 2 b L_dec (T_in + T_out) (H_kv D) bytes, seq_len = T_in + T_out.

        Counted: the generation decoder's cross K/V of the T_in context latents plus its self K/V of the T_out block
        tokens, L_dec layers; the ratio to a decoder-only model of the same depth is L_dec / L. Not counted: the
        context decoder's K/V, needed only during the prefill -- unless the context is kept for extension (rollover,
        prefix reuse): pass context_len to add its L_ctx layers over that many positions.
        """
        c = self.config
        return (kv_bytes(c.gen_layers, batch, seq_len, c.n_kv_head, c.hd, dtype_bytes)
                + kv_bytes(c.ctx_layers, batch, context_len, c.n_kv_head, c.hd, dtype_bytes))

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Appendix A.2 in model.py's 6N + 12 L H D T form: 6 (N + the cross K/V projections applied to the latents,
        which reuse the self k/v weights when shared) + 12 (L_ctx + L_dec) H D T. As in A.2 the two attentions of a
        generation layer are counted as one (their masks are disjoint: together they are one causal attention); the
        dense reference computes both in full. With a 2:1 split, d = H D, 4d MLP: L(76 T d^2 + 12 T^2 d) per sequence.
        """
        c = self.config
        n = self.num_params(non_embedding=True) + c.n_embd * c.vocab_size
        if not c.separate_cross_kv:
            n += c.gen_layers * 2 * c.n_embd * c.n_kv_head * c.hd
        f = 6 * n + 12 * (c.ctx_layers + c.gen_layers) * c.n_head * c.hd * seq_len
        return f if training else f / 3


# ----------------------------------------------------------------------------------------------------------------
# Block partitions (section 3.1): block ids per position, checked, sampled once per batch


def splits_to_blk(splits, T: int, device=None) -> torch.Tensor:
    """Split points b_1 < ... < b_{K-1} (each in [1, T-1]) -> block ids (T,): blk[t] = #{b_i <= t}.

    This is the official code's `bucketize(arange(T), splits, right=True)`.
    """
    splits = torch.as_tensor(splits, dtype=torch.long, device=device).reshape(-1)
    if splits.numel() and (int(splits.min()) < 1 or int(splits.max()) > T - 1):
        raise ValueError(f"split points must lie in [1, {T - 1}] for a sequence of {T} tokens; got {splits.tolist()}")
    if splits.numel() > 1 and bool((splits[1:] <= splits[:-1]).any()):
        raise ValueError(f"split points must be strictly increasing (no empty block); got {splits.tolist()}")
    return torch.bucketize(torch.arange(T, device=splits.device), splits, right=True)


def check_partition(blk: torch.Tensor, B: int, T: int) -> int:
    """Validate block ids (T,) or (B, T): integers, start at 0, step by 0 or 1 (contiguous, non-empty blocks).

    -> the largest number of blocks of a row. Raises ValueError naming the problem.
    """
    if not isinstance(blk, torch.Tensor) or blk.dtype not in (torch.int32, torch.int64):
        raise ValueError("blk must be an integer tensor of block ids, (T,) or (B, T)")
    if blk.dim() not in (1, 2) or blk.size(-1) != T or (blk.dim() == 2 and blk.size(0) not in (1, B)):
        raise ValueError(f"blk has shape {tuple(blk.shape)}; expected ({T},) or ({B}, {T})")
    b = blk.reshape(-1, T)
    if bool((b[:, 0] != 0).any()):
        raise ValueError("a block partition starts with block 0 at position 0")
    step = b[:, 1:] - b[:, :-1]
    if bool(((step != 0) & (step != 1)).any()):
        raise ValueError("block ids must be non-decreasing by steps of 0 or 1 (contiguous, non-empty blocks)")
    return int(b[:, -1].max()) + 1


def sample_blocks(T: int, gen: torch.Generator, min_blocks: int, max_blocks: int) -> torch.Tensor:
    """K ~ uniform{min_blocks..max_blocks} (at most T), then K - 1 distinct split points uniform in [1, T-1].

    -> block ids (T,). The official collator draws 2..7 split points uniformly from [2, T-1).
    """
    if T < min_blocks:
        raise ValueError(f"a sequence of {T} tokens cannot be split into min_blocks={min_blocks} non-empty blocks")
    hi = min(max_blocks, T)
    K = int(torch.randint(min_blocks, hi + 1, (1,), generator=gen))
    splits = (torch.randperm(T - 1, generator=gen)[: K - 1] + 1).sort().values
    return splits_to_blk(splits, T)


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class DoubleConfig(GPTConfig):
    """GPTConfig (width, heads, MLP, norm, RoPE: the same for both stacks) plus the double-decoder fields.

    n_layer is derived: ctx_layers + gen_layers (the depth of the decoder-only model of the same parameters).
    """

    n_layer: int | None = None  # = ctx_layers + gen_layers
    ctx_layers: int = 8  # L_enc of the paper: the context decoder
    gen_layers: int = 4  # L_dec: the generation decoder (the paper's 2/3 : 1/3 split, section 4)
    separate_cross_kv: bool = False  # False: cross K/V use the self k/v projections (official default)
    objective: str = "blocks"  # 'blocks' (random block partitions) | 'prefixlm' (one split, loss on the suffix)
    min_blocks: int = 3  # blocks per training partition: uniform in [min_blocks, max_blocks]
    max_blocks: int = 8
    attn_impl: str = "auto"  # 'auto' (flex on CUDA, else dense) | 'dense' (kernels.dual_attention) | 'flex'
    init: str = "gpt2"  # 'gpt2' (model.init_weights per stack) | 'xavier' (paper Table 1: Xavier-uniform, gain sqrt 2)
    latent_norm: str = "rms"  # the context decoder's final norm: 'rms' (cfg.norm) | 'layer' (LayerNorm with bias)
    ctx_lr: float = 1.0  # the context decoder's lr as a multiple of train.py's --lr (train.py's default: 0.25)

    def __post_init__(self):
        if self.n_layer is None and isinstance(self.ctx_layers, int) and isinstance(self.gen_layers, int):
            self.n_layer = self.ctx_layers + self.gen_layers
        super().__post_init__()

    def validate(self):
        need = self.need  # "bad DoubleConfig: ..."
        for name in ("ctx_layers", "gen_layers", "min_blocks", "max_blocks"):  # never a bool (True is an int)
            need(self.is_int(getattr(self, name)) and getattr(self, name) >= 1,
                 f"{name}={getattr(self, name)!r} must be a positive int", field=name)
        need(self.n_layer == self.ctx_layers + self.gen_layers,
             f"n_layer={self.n_layer} must equal ctx_layers + gen_layers = {self.ctx_layers + self.gen_layers}")
        need(self.min_blocks <= self.max_blocks, f"min_blocks={self.min_blocks} > max_blocks={self.max_blocks}")
        need(self.max_blocks <= self.max_seq_len,
             f"max_blocks={self.max_blocks} non-empty blocks do not fit in max_seq_len={self.max_seq_len} tokens")
        need(self.objective in ("blocks", "prefixlm"), f"objective={self.objective!r} is not 'blocks' or 'prefixlm'")
        need(self.attn_impl in ("auto", "dense", "flex"), f"attn_impl={self.attn_impl!r} is not auto, dense or flex")
        need(self.init in ("gpt2", "xavier"), f"init={self.init!r} is not 'gpt2' or 'xavier'")
        need(self.latent_norm in ("rms", "layer"), f"latent_norm={self.latent_norm!r} is not 'rms' or 'layer'")
        need(self.is_number(self.ctx_lr) and self.ctx_lr > 0, f"ctx_lr={self.ctx_lr!r} must be a finite number > 0",
             field="ctx_lr")
        need(isinstance(self.separate_cross_kv, bool), f"separate_cross_kv={self.separate_cross_kv!r} must be true or "
                                                       f"false", field="separate_cross_kv")
        super().validate()


PRESETS: dict[str, dict] = {
    # CPU and tests: the paper's 2 : 1 split at model.py's tiny width; model.py's `tiny6` (6 layers) is the
    # decoder-only model of the same non-embedding parameters (1.2M).
    "tiny": dict(ctx_layers=4, gen_layers=2, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384, max_seq_len=256,
                 vocab_size=4160),
    # The larger CPU size of the comparison: 6 + 3 layers at d 256 (head dim 64, as the paper); model.py's `mini`
    # (9 layers) is its decoder-only baseline (~7M non-embedding parameters).
    "mini": dict(ctx_layers=6, gen_layers=3, n_head=4, n_kv_head=2, n_embd=256, mlp_hidden=768, max_seq_len=256,
                 vocab_size=4160),
    # The paper's depth profile (8 context + 4 generation layers vs 12 decoder layers), head dim 64. ~38M non-emb.
    "small": dict(ctx_layers=8, gen_layers=4, n_head=8, n_kv_head=4, n_embd=512, mlp_hidden=1536, max_seq_len=1024,
                  vocab_size=16448),
    # Parameter-matched to model.py's vanilla `base` (12 layers, d 768): ~125M non-embedding.
    "base": dict(ctx_layers=8, gen_layers=4, n_head=12, n_kv_head=4, n_embd=768, mlp_hidden=3840, max_seq_len=1024,
                 vocab_size=32832),
}


def baseline_config(cfg: DoubleConfig) -> GPTConfig:
    """The decoder-only model of the same parameters: every GPTConfig field of cfg, n_layer = ctx + gen layers."""
    return GPTConfig(**{f.name: getattr(cfg, f.name) for f in fields(GPTConfig)})


# ----------------------------------------------------------------------------------------------------------------
# How train.py and bench.py see this architecture


def prepare_batch(x, y, gen, cfg: DoubleConfig):
    """train.py hook: one partition per batch from the step's generator -> (x, y, {"blk": (T,) block ids}).

    'blocks':   3-8 uniform blocks; every target counts once (y unchanged).
    'prefixlm': one split s ~ uniform [1, T-1]; prefix x[:s] is the context, x[s:] one generation block; targets of the
                prefix positions (y[:, :s], which include the first suffix token) are IGNORE: loss on the suffix only.
    """
    T = x.size(1)
    if cfg.objective == "prefixlm":
        if T < 2:
            raise ValueError("the prefix-LM objective needs sequences of at least 2 tokens")
        s = int(torch.randint(1, T, (1,), generator=gen))
        blk = (torch.arange(T) >= s).long()
        y = y.clone()
        y[:, :s] = IGNORE
        return x, y, {"blk": blk}
    return x, y, {"blk": sample_blocks(T, gen, cfg.min_blocks, cfg.max_blocks)}


def add_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("double (block-based double decoder)")
    g.add_argument("--objective", choices=["blocks", "prefixlm"], default=None,
                   help="double: random block partitions (pretraining) or one prefix/suffix split (section 4)")
    g.add_argument("--ctx-layers", type=int, default=None, help="double: context-decoder layers (default: preset)")
    g.add_argument("--gen-layers", type=int, default=None, help="double: generation-decoder layers (default: preset)")
    g.add_argument("--min-blocks", type=int, default=None, help="double: fewest blocks of a training partition (3)")
    g.add_argument("--max-blocks", type=int, default=None, help="double: most blocks of a training partition (8)")
    g.add_argument("--separate-cross-kv", action="store_true",
                   help="double: separate k/v projections for the cross keys (default: shared with the self k/v)")
    g.add_argument("--dd-init", choices=["gpt2", "xavier"], default=None,
                   help="double: weight init (gpt2: model.init_weights per stack; xavier: the paper's, gain sqrt 2)")
    g.add_argument("--latent-norm", choices=["rms", "layer"], default=None,
                   help="double: the context decoder's final norm (rms: as every other norm; layer: LayerNorm + bias)")
    g.add_argument("--ctx-lr", type=float, default=None,
                   help="double: the context decoder's learning rate as a multiple of --lr (default 0.25; 1: the "
                        "paper's)").bounds = {"above": 0}  # checked by train.py as it parses; DoubleConfig again
    g.add_argument("--dd-attn", choices=["auto", "dense", "flex"], default=None,
                   help="double: training attention (auto = FlexAttention on CUDA, the dense reference elsewhere)")


def config_overrides(args, tok=None) -> dict:
    names = {"dd_attn": "attn_impl", "dd_init": "init"}  # flag -> field; the other flags are named as their fields
    flags = ("objective", "ctx_layers", "gen_layers", "min_blocks", "max_blocks", "latent_norm", "ctx_lr", *names)
    out = {names.get(a, a): getattr(args, a) for a in flags if getattr(args, a, None) is not None}
    if getattr(args, "separate_cross_kv", False):
        out["separate_cross_kv"] = True
    if "ctx_layers" in out or "gen_layers" in out:
        out["n_layer"] = None  # derived again from the new depths
    return out


def preset_rows(preset: str, options=None) -> list:
    """`python bench.py presets --arch double`: the preset against its baseline, the decoder-only model of the same
    parameters (baseline_config), both on the meta device. Timing and checkpoint evaluation: `python bench.py double`,
    `python eval.py double-eval`."""
    cfg = DoubleConfig(**PRESETS[preset])
    with torch.device("meta"):
        return [(f"{preset} {cfg.ctx_layers}+{cfg.gen_layers} d {cfg.n_embd}", DoubleDecoder(cfg),
                 GPT(baseline_config(cfg)))]


# 240 steps rather than train.py's 300: a tiny double-decoder step costs more than a vanilla one on CPU (the dense
# reference computes the generation layer's two T x T attentions in full), and fewer steps keep the default run near
# vanilla's wall time (RESULTS.md, "Timings"). ctx_lr 0.25: the deviation of the module docstring.
ARCH_SPECS = [ArchSpec("double", DoubleConfig, DoubleDecoder, PRESETS, add_args=add_args,
                       config_overrides=config_overrides, prepare_batch=prepare_batch,
                       train_defaults={"max_iters": 240, "ctx_lr": 0.25}, preset_rows=preset_rows)]
