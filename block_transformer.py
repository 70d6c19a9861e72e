"""
block_transformer.py -- the Block Transformer: global-to-local language modeling for fast inference.

Paper: "Block Transformer: Global-to-Local Language Modeling for Fast Inference" (Ho, Bae et al., NeurIPS 2024,
arXiv:2406.02657). Sections 2 (architecture), 2.1 and Appendix E (why it is fast), 3.7 and Appendices G.8 / N
(uptraining from a vanilla model), F.2 (prefix vs summation token decoders), H (random-length padding).

The model has three parts (section 2):

    tokens (B, T) --embedder--> block embeddings (B, T/L_B, D_blk)          (section 2.2: lookup + concatenate)
                  --block decoder--> context embeddings (B, T/L_B, D_blk)   (section 2.3: causal over blocks, RoPE
                                                                             positions = block indices)
    for every block i at once (blocks folded into the batch dimension):
        context embedding of block i --projection--> P prefix vectors       (section 2.4)
        token decoder over [prefix_1..prefix_P, t_0 .. t_{L_B-2}] of block i+1 -> logits of t_0 .. t_{L_B-1}

The block decoder is a stack of model.Block over one position per block, so its KV cache is L_B times shorter than a
vanilla model's. The token decoder is a stack of model.Block over P + L_B - 1 positions that never sees another block:
it needs no prefill and its cache is P + L_B - 1 entries, thrown away after every block (Table 1, Appendix E). That is
where the decode throughput comes from.

How it sits on model.py: `BlockConfig` is a `GPTConfig` whose own fields describe the TOKEN decoder (n_layer, n_head,
n_kv_head, n_embd, mlp_hidden), the style of both decoders (norm, MLP kind, RoPE, biases, head_dim, ...), the
vocabulary and the longest sequence in tokens (max_seq_len); `block_*` fields give the block decoder's shape (None: the
token decoder's). `BlockTransformer` is a `GPT`: GPT's embedding, layer stack, final norm and head ARE the token
decoder, and GPT.generate is its generate loop; the block decoder (a `Decoder`), the embedder and the prefix
projection are added. Every cached step of both decoders goes through model.run_cached.

Conventions of this file (the official code's, github.com/itsnamgyu/block-transformer):
  * forward(idx, targets) -> (logits (B, T, V), loss) with logits[:, t] predicting token t+1, as every model of this
    repository. The first block has no context embedding before it, so its tokens are never predicted:
    logits[:, :L_B-1] are zeros and their targets are ignored. T must be a multiple of L_B.
  * The last row of the vocabulary (vocab_size - 1, which train.py's padded vocabulary never gives a real token) is
    the pad id. Pads are embedded by the embedder as a fixed zero vector (Appendix H: pads are part of a block's
    embedding), are masked as keys in the token decoder, carry no loss, and are never predicted (their logit is -inf).
    Blocks that are entirely padding are skipped in the token decoder.
  * Random-length padding when packing (Appendix H), in prepare_batch(): per document a random left pad of
    0..L_B-1 pads, the document with its end-of-text token, then pads up to the block boundary; no block mixes two
    documents.
  * Uptraining (from_vanilla(), Appendix N / G.8): the lower half of a vanilla model's layers become the block
    decoder, the upper half the token decoder; the embedder starts as the mean of the block's vanilla token
    embeddings, the prefix projection as P copies of the identity; embedding, final norm and head go to the token
    decoder.
  * Prefix decoding (section 2.4) is the default; `context='summation'` is MEGABYTE's way (Appendix F.2): the context
    embedding is projected to L_B vectors added to the token decoder's inputs [start, t_0 .. t_{L_B-2}].

Generation (section 2.1, Appendix E) is GPT.generate's loop over `prefill` and `decode_step`, with a `BlockCache`:
the prefill runs the block decoder over the prompt's blocks (the prompt left-padded to a block boundary) and the token
decoder over the P prefix vectors; each decode step feeds one token to the token decoder, and the step that completes
a block runs the block decoder once on it and starts the next block's token decoder from the new context embedding.
These are the two step kinds (token_step, block_end_step) that compile_decode compiles, on static caches, for CUDA
graphs.

Run:
    python bench.py presets --arch block                     # presets: parameters, KV bytes, vanilla counterparts
    python train.py --arch block                             # pretrain the tiny preset
    python train.py --arch block --init-from out/vanilla/ckpt.pt --out-dir out/block-up   # uptrain (Appendix N)
    python train.py --arch block --preset tiny-matched       # the larger model with vanilla tiny's decode throughput
    python bench.py block                                    # throughput vs vanilla at the best batch of a cache
                                                             # budget, both settings at 1/4 length
    python bench.py block --scale 1 --setting decode-heavy   # the paper's 128/2048 setting (takes longer)
    python eval.py block --eval out/block/ckpt.pt out/vanilla/ckpt.pt   # val loss on the block model's targets
    python bench.py figures                                  # Figure 1's receptive fields, recorded from the KV caches
    python -m pytest -q tests/test_block_transformer.py
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import mark_static
from model import (GPT, IGNORE, ArchSpec, Block, GPTConfig, KVCache, Linear, RotaryEmbedding, count_params,
                   init_weights, kv_bytes, lm_loss, make_norm, run_cached)


# ----------------------------------------------------------------------------------------------------------------
# Embedder (section 2.2)


class Embedder(nn.Module):
    """L_B tokens -> one block embedding of width D_blk.

    lookup:      a table of width D_blk / L_B; the L_B embeddings are concatenated (section 2.2).
    lookup_proj: a table of width embed_dim; the L_B embeddings are concatenated and projected to D_blk by a Linear
                 (Appendix G.8). With embed_dim = D and the projection [I/L_B ... I/L_B] it is the mean of the block's
                 token embeddings, the uptraining init of Appendix N.
    The pad id is a fixed zero row (not trained), so pads add nothing to a block embedding.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.block_len, self.pad = cfg.block_len, cfg.pad
        self.scale = cfg.emb_dim ** 0.5 if cfg.embed_scale else None
        self.tok = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=cfg.pad)
        self.proj = Linear(cfg.block_len * cfg.emb_dim, cfg.block_n_embd) if cfg.embedder == "lookup_proj" else None

    def forward(self, blocks):  # (B, N, L_B) token ids -> (B, N, D_blk)
        e = self.tok(blocks)  # (B, N, L_B, E)
        if self.scale is not None:
            e = e * torch.tensor(self.scale, dtype=e.dtype)
        e = e.flatten(-2)  # (B, N, L_B * E): concatenation
        return self.proj(e) if self.proj is not None else e


# ----------------------------------------------------------------------------------------------------------------
# The block decoder: a stack of model.Block over block embeddings, with its own RoPE table


def run_blocks(blocks, rope, x, mask=None):
    """The parallel (training) pass of a layer stack: x (B, T, C) at the positions of rope = (cos, sin), causal or
    under an explicit bool mask (B|1, 1, T, T) -> (B, T, C). Both decoders' training forward."""
    for block in blocks:
        x = block(x, rope, mask=mask)
    return x


class Decoder(nn.Module):
    """Pre-norm blocks over input embeddings with explicit positions; no embedding, final norm or head.

    forward(x, pos, mask): the parallel (training) pass. forward_cached(x, cache, fresh): a prefill (fresh=True, empty
    cache) or decode step at positions cache.lengths + i, through model.run_cached.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x, pos, mask=None):  # x (B, T, C), pos (T,) or (B, T)
        return run_blocks(self.blocks, self.rope(pos), x, mask)

    def forward_cached(self, x, cache: KVCache, fresh: bool = False):
        return run_cached(self.blocks, self.rope, x, cache, fresh)


# ----------------------------------------------------------------------------------------------------------------
# Generation state


class BlockCache:
    """What generate() carries between steps of the two-level loop (section 2.1):

    blocks  the block decoder's KVCache, one position per block (ceil(max_len / L_B) + 1 positions: room for a
            left-padded prompt);
    local   the token decoder's KVCache of P + L_B - 1 entries, reset at every block;
    slots   the context slots (B, n_ctx, D_tok) of the block being decoded (its P prefix vectors or L_B summands);
    tokens  (B, L_B) the tokens of that block decoded so far, `k` of them (k: a host-side count, which picks the
            step kind; inside a step the token's index in its block comes from local.lengths, a device tensor).

    GPT.new_cache(batch, max_len) builds it for max_len tokens. static: both KV caches attend over all their
    positions at every step (KVCache), and every tensor a step writes in place is marked static (graphs.mark_static).
    """

    def __init__(self, cfg: BlockConfig, batch: int, max_len: int, dtype, device, static=False):
        b, n_blocks = cfg.block_decoder_config(), -(-max_len // cfg.block_len) + 1
        self.blocks = KVCache(b.n_layer, batch, n_blocks, b.n_kv_head, b.hd, dtype, device, static)
        self.local = KVCache(cfg.n_layer, batch, cfg.local_len, cfg.n_kv_head, cfg.hd, dtype, device, static)
        self.tokens = torch.zeros(batch, cfg.block_len, dtype=torch.long, device=device)
        self.slots = torch.zeros(batch, cfg.n_ctx, cfg.n_embd, dtype=dtype, device=device)
        self.k = 0
        if static:
            mark_static(self.tokens, self.slots)

    @property
    def batch(self) -> int:
        return self.tokens.size(0)

    def reset(self):
        """Forget every block and token (a reused cache: graphs.compile_decode's static caches)."""
        self.blocks.reset()
        self.local.reset()
        self.k = 0

    def nbytes(self) -> int:
        return self.blocks.nbytes() + self.local.nbytes()


# ----------------------------------------------------------------------------------------------------------------
# The model


class BlockTransformer(GPT):
    """Embedder -> block decoder (global, over blocks) -> token decoder (local, inside one block).

    The token decoder is model.GPT's own part: tok_emb, blocks, rope, norm, lm_head (and `embed`, `head`). forward(idx,
    targets) trains every block at once: blocks are folded into the batch dimension of the token decoder. generate()
    is GPT.generate over prefill / decode_step with a BlockCache (see the module docstring).
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)  # the token decoder: embedding, cfg.n_layer blocks, final norm, head (maybe tied)
        self.embedder = Embedder(cfg)
        self.block_decoder = Decoder(cfg.block_decoder_config())
        self.block_norm = make_norm(self.block_decoder.config)  # the block decoder's final norm: the context emb.
        self.ctx_proj = Linear(cfg.block_n_embd, cfg.n_ctx * cfg.n_embd)  # -> P prefix vectors (or L_B summands)
        init_weights(self, cfg.block_n_layer + cfg.n_layer)  # residual projections scaled by the total depth
        with torch.no_grad():
            self.embedder.tok.weight[cfg.pad].zero_()
        # The token decoder's position whose output predicts the block's first token t_0: the last prefix vector
        # (P - 1, prefix) or the start slot (0, summation). The inputs before t_0 are first_pred_pos + 1 positions,
        # and token k of the block sits at first_pred_pos + 1 + k.
        self.first_pred_pos = cfg.local_len - cfg.block_len

    # -- pieces --------------------------------------------------------------------------------------------------

    def head(self, h):  # (..., D_tok) -> (..., V); the pad id is never predicted
        logits = super().head(h)
        logits[..., self.config.pad] = float("-inf")
        return logits

    def check_blocks(self, T: int) -> int:
        L = self.config.block_len
        if T % L:
            raise ValueError(f"sequence length {T} is not a multiple of block_len L_B={L}")
        if T // L > self.config.max_blocks:
            raise ValueError(f"sequence of {T} tokens ({T // L} blocks) exceeds max_seq_len={self.config.max_seq_len}")
        return T // L

    def context(self, idx):
        """idx (B, T) -> context embeddings (B, N, D_blk): the one at block i carries blocks 0..i and predicts i+1."""
        B, T = idx.shape
        N = self.check_blocks(T)
        x = self.embedder(idx.view(B, N, self.config.block_len))  # (B, N, D_blk)
        h = self.block_decoder(x, torch.arange(N, device=idx.device))  # causal over blocks, RoPE position = block index
        return self.block_norm(h)

    def context_slots(self, ctx):
        """ctx (M, D_blk) -> (M, n_ctx, D_tok): the P prefix vectors (prefix) or the L_B summands (summation)."""
        return self.ctx_proj(ctx).view(ctx.size(0), self.config.n_ctx, self.config.n_embd)

    def first_inputs(self, c):
        """The token decoder's first inputs, before any token of the block: the P prefix vectors [P_1..P_P] (prefix),
        or the start vector (the pad row of the token embedding) plus the first summand (summation).
        c (M, n_ctx, D_tok) -> (M, first_pred_pos + 1, D_tok)."""
        if self.config.context == "prefix":
            return c
        return self.embed(torch.full((c.size(0), 1), self.config.pad, device=c.device)) + c[:, :1]

    def token_inputs(self, c, tokens, k0: int | torch.Tensor = 0):
        """Inputs for tokens (M, n), the tokens k0 .. k0+n-1 of a block; token k sits at position first_pred_pos + 1 + k
        and, with summation, gets the summand c[:, k + 1]. k0: an int, or (M,) per row (a decode step: a device
        tensor, so that one graph serves every index). -> (M, n, D_tok)"""
        e = self.embed(tokens)
        if self.config.context == "summation":
            if isinstance(k0, torch.Tensor):
                k = k0[:, None] + 1 + torch.arange(tokens.size(1), device=k0.device)  # (M, n)
                e = e + c.gather(1, k[..., None].expand(-1, -1, c.size(2)))
            else:
                e = e + c[:, k0 + 1:k0 + 1 + tokens.size(1)]
        return e

    def token_decoder(self, x, mask=None):
        """The token decoder's parallel pass over M independent blocks: x (M, S, D_tok) at positions 0..S-1."""
        return run_blocks(self.blocks, self.rope(torch.arange(x.size(1), device=x.device)), x, mask)

    def local_logits(self, ctx, blocks, pad_mask: bool = True, return_hidden: bool = False):
        """The token decoder on M independent blocks at once (blocks folded into the batch dimension).

        ctx (M, D_blk) context embeddings; blocks (M, L_B) the tokens to predict. Output k predicts blocks[:, k] from
        ctx and blocks[:, :k] only: no row ever sees another row. Pad tokens are masked as keys (pad_mask).
        -> logits (M, L_B, V) (or the final hidden states (M, L_B, D_tok) with return_hidden).
        """
        L, S = self.config.block_len, self.config.local_len
        c = self.context_slots(ctx)
        x = torch.cat([self.first_inputs(c), self.token_inputs(c, blocks[:, :L - 1])], dim=1)  # (M, S, D_tok)
        mask = None  # causal: the flash path on GPU
        if pad_mask:
            is_pad = F.pad(blocks[:, :L - 1] == self.config.pad, (self.first_pred_pos + 1, 0), value=False)  # (M, S)
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            mask = (causal[None] & ~is_pad[:, None, :])[:, None]  # (M, 1, S, S); the first slot is always visible
        h = self.token_decoder(x, mask)[:, self.first_pred_pos:]  # (M, L_B, D_tok): outputs predicting t_0..t_{L_B-1}
        return h if return_hidden else self.head(h)

    # -- training forward ----------------------------------------------------------------------------------------

    def forward(self, idx, targets=None):
        """idx (B, T), T a multiple of L_B -> logits (B, T, V), logits[:, t] predicting token t+1, and the loss.

        Row i of the token decoder (i = 0..N-1) takes the context embedding of block i and decodes block i+1 (for
        i = N-1 that block lies past the window: only its first token, targets[:, -1], is predicted). Tokens of the
        first block have no context: logits[:, :L_B-1] are zeros and those targets are ignored.
        """
        B, T = idx.shape
        cfg, L = self.config, self.config.block_len
        ctx = self.context(idx)  # (B, N, D_blk)
        N = ctx.size(1)
        nxt = F.pad(idx.view(B, N, L)[:, 1:], (0, 0, 0, 1), value=cfg.pad)  # (B, N, L): row i holds block i+1
        ctx, nxt = ctx.reshape(B * N, -1), nxt.reshape(B * N, L)
        # Pad tokens of real blocks (random padding, Appendix H). The row past the window holds placeholder pads whose
        # outputs are never used; its one used output (the last prefix slot) cannot see them under the causal mask.
        is_pad = (nxt == cfg.pad).view(B, N, L)
        is_pad[:, -1] = False
        is_pad = is_pad.view(B * N, L)
        if bool(is_pad.any()):  # one host sync; without pads the token decoder runs plain causal attention
            real_rows = (~is_pad.all(-1)).nonzero().squeeze(1)  # blocks that are entirely padding are skipped
            h = ctx.new_zeros(B * N, L, cfg.n_embd)
            h[real_rows] = self.local_logits(ctx[real_rows], nxt[real_rows], pad_mask=True,
                                             return_hidden=True).to(h.dtype)
        else:
            h = self.local_logits(ctx, nxt, pad_mask=False, return_hidden=True)  # (B*N, L, D_tok)
        h = h.reshape(B, N * L, -1)[:, :T - L + 1]  # hidden state predicting token t sits at t - 1 ...
        h = F.pad(h, (0, 0, L - 1, 0))  # ... so shift right by L_B - 1: (B, T, D_tok)
        logits = self.head(h)
        logits[:, :L - 1] = 0.0  # no context for the first block
        if targets is None:
            return logits, None
        targets = targets.masked_fill(targets == cfg.pad, IGNORE)  # pads carry no loss
        targets[:, :L - 1] = IGNORE
        return logits, lm_loss(logits, targets)

    # -- inference (section 2.1, Appendix E): GPT.generate over these methods ------------------------------------

    cache_cls = BlockCache  # GPT.new_cache(batch, max_len) builds it from the config (cache_kwargs)

    def cache_kwargs(self) -> dict:
        return dict(cfg=self.config)

    @torch.no_grad()
    def prefill_blocks(self, idx, cache: KVCache):
        """Prompts idx (B, T) -> the block decoder's prefill -> the context embedding (B, D_blk) that predicts the
        next block. The prompt is left-padded to a multiple of L_B (the pads are part of the first block's embedding,
        as in training, Appendix H)."""
        B, T = idx.shape
        L = self.config.block_len
        if T < 1:
            raise ValueError("generation needs a prompt of at least one token (the first block has no context)")
        idx = F.pad(idx, ((-T) % L, 0), value=self.config.pad)
        N = idx.size(1) // L
        cache.reset()
        h = self.block_decoder.forward_cached(self.embedder(idx.view(B, N, L)), cache, fresh=True)  # (B, N, D_blk)
        cache.lengths.fill_(N)
        return self.block_norm(h[:, -1])

    @torch.no_grad()
    def block_step(self, block, cache: KVCache):
        """A finished block (B, L_B) -> one block decoder decode step -> the next context embedding (B, D_blk)."""
        h = self.block_decoder.forward_cached(self.embedder(block[:, None]), cache)  # (B, 1, D_blk)
        cache.lengths += 1
        return self.block_norm(h[:, -1])

    @torch.no_grad()
    def start_block(self, ctx, cache: BlockCache):
        """A new block from its context embedding ctx (B, D_blk): the token decoder's local cache starts empty (the
        previous block's entries are forgotten) and takes the first_pred_pos + 1 first inputs (the P prefix vectors, or
        the start slot) in one step
        -> logits (B, V) of the block's first token."""
        cache.slots.copy_(self.context_slots(ctx))  # in place: the state of a captured step keeps its address
        x = self.first_inputs(cache.slots)  # (B, first_pred_pos + 1, D_tok)
        cache.local.reset()
        h = run_cached(self.blocks, self.rope, x, cache.local, fresh=True)
        cache.local.lengths.fill_(x.size(1))
        return self.head(h[:, -1])

    @torch.no_grad()
    def prefill(self, idx, cache: BlockCache):
        """Prompts idx (B, T) -> logits (B, V) of the first new token: the block decoder over the prompt's blocks,
        then the token decoder over the prefix vectors (the token decoder never sees the prompt's tokens)."""
        cache.k = 0
        return self.start_block(self.prefill_blocks(idx, cache.blocks), cache)

    @torch.no_grad()
    def decode_step(self, tok, cache: BlockCache):
        """The next token of every row tok (B,) -> logits (B, V) of the token after it. The host counts the block's
        tokens (cache.k) and picks one of two step kinds: inside a block, token_step; the token that completes a
        block, block_end_step."""
        cache.k += 1
        if cache.k == self.config.block_len:
            cache.k = 0
            return self.block_end_step(tok, cache)
        return self.token_step(tok, cache)

    # The two step kinds: compile_decode compiles each (one graph per kind and batch size). Neither reads a Python
    # number that changes from step to step: positions and the token's index in its block come from the caches'
    # lengths (device tensors), and every write goes in place into the cache's tensors.
    graph_steps = ("token_step", "block_end_step")

    @torch.no_grad()
    def token_step(self, tok, cache: BlockCache):
        """tok (B,), a token inside its block (not the last) -> logits (B, V): one token decoder step over the local
        cache (at most P + L_B - 1 entries)."""
        k = cache.local.lengths - (self.first_pred_pos + 1)  # (B,) tok's index in its block
        cache.tokens.scatter_(1, k[:, None], tok[:, None])
        x = self.token_inputs(cache.slots, tok[:, None], k0=k)  # (B, 1, D_tok)
        h = run_cached(self.blocks, self.rope, x, cache.local)
        cache.local.lengths += 1
        return self.head(h[:, -1])

    @torch.no_grad()
    def block_end_step(self, tok, cache: BlockCache):
        """tok (B,), the last token of its block -> logits (B, V) of the next block's first token: one block decoder
        step on the finished block, then the next block's prefix vectors through the token decoder (start_block)."""
        cache.tokens[:, -1] = tok
        return self.start_block(self.block_step(cache.tokens, cache.blocks), cache)

    # -- accounting ----------------------------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; non-embedding excludes the embedder's table, the token embedding and an untied head."""
        return count_params(self, (self.embedder.tok, self.tok_emb, self.lm_head) if non_embedding else ())

    def kv_cache_bytes(self, batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
        """KV bytes of generate() for seq_len tokens: the block decoder over ceil(seq_len / L_B) + 1 block positions
        (one spare for a left-padded prompt) plus the token decoder's P + L_B - 1 local entries (Table 1)."""
        c, b = self.config, self.block_decoder.config
        n_blocks = -(-seq_len // c.block_len) + 1
        return (kv_bytes(b.n_layer, batch, n_blocks, b.n_kv_head, b.hd, dtype_bytes)
                + kv_bytes(c.n_layer, batch, c.local_len, c.n_kv_head, c.hd, dtype_bytes))

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """6N per trained token, as GPT.flops_per_token, with each part weighted by how often it runs per token: the
        embedder projection, block decoder and context projection once per block (1/L_B), the token decoder on
        local_len positions per block (local_len / L_B), the head once; plus attention over seq_len / L_B blocks and
        over local_len positions. 1/3 of it for a forward pass alone."""
        c, L, S = self.config, self.config.block_len, self.config.local_len
        per_block = count_params(self.block_decoder) + count_params(self.ctx_proj)
        if self.embedder.proj is not None:
            per_block += count_params(self.embedder.proj)
        n = per_block / L + count_params(self.blocks) * S / L + c.n_embd * c.vocab_size
        b = self.block_decoder.config
        attn = (12 * b.n_layer * b.n_head * b.hd * (seq_len / L) / L
                + 12 * c.n_layer * c.n_head * c.hd * S * S / L)
        f = 6 * n + attn
        return f if training else f / 3


# ----------------------------------------------------------------------------------------------------------------
# Config


DECODER_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden")  # the shape of one decoder


@dataclass
class BlockConfig(GPTConfig):
    """GPTConfig = the token decoder's shape and both decoders' style; max_seq_len counts TOKENS (a multiple of
    block_len). block_<field> = the block decoder's shape, None = the token decoder's value."""

    n_layer: int = 2  # token decoder layers
    block_len: int = 4  # L_B, tokens per block
    prefix_len: int = 2  # P, prefix vectors the context embedding is projected into (context='prefix')
    embedder: str = "lookup"  # 'lookup' (section 2.2) | 'lookup_proj' (concat + Linear, Appendix G.8: uptraining)
    embed_dim: int | None = None  # lookup_proj: width of each token embedding (None -> block_n_embd)
    context: str = "prefix"  # 'prefix' (section 2.4) | 'summation' (MEGABYTE, Appendix F.2)
    block_n_layer: int | None = None  # block decoder (global, one position per block); None -> the token decoder's
    block_n_head: int | None = None
    block_n_kv_head: int | None = None
    block_n_embd: int | None = None
    block_mlp_hidden: int | None = None
    pad_id: int | None = None  # None -> vocab_size - 1 (the spare row of train.py's padded vocabulary)
    eot_id: int | None = None  # the tokenizer's end-of-text id, which separates documents; None: no random padding
    random_pad: bool = True  # Appendix H: random-length padding of each document in prepare_batch

    def __post_init__(self):
        for f in DECODER_FIELDS:
            if getattr(self, f"block_{f}") is None:
                setattr(self, f"block_{f}", getattr(self, f))
        super().__post_init__()

    def validate(self):
        super().validate()  # the token decoder ("bad GPTConfig: ...")
        need = self.need
        count = self.is_int  # never a bool (True is an int to Python)
        need(count(self.block_len) and self.block_len >= 1, f"block_len={self.block_len!r} must be a positive int",
             field="block_len")
        need(self.embedder in ("lookup", "lookup_proj"), f"embedder={self.embedder!r} is not 'lookup' or 'lookup_proj'")
        need(self.context in ("prefix", "summation"), f"context={self.context!r} is not 'prefix' or 'summation'")
        if self.context == "prefix":
            need(count(self.prefix_len) and self.prefix_len >= 1,
                 f"prefix_len={self.prefix_len!r} must be a positive int for prefix decoding", field="prefix_len")
        need(self.max_seq_len % self.block_len == 0,
             f"sequence length max_seq_len={self.max_seq_len} is not a multiple of block_len L_B={self.block_len} "
             f"(the training sequence length, --seq-len, must be)")
        if self.embedder == "lookup":
            need(self.block_n_embd % self.block_len == 0,
                 f"block decoder n_embd block_n_embd={self.block_n_embd} is not divisible by block_len "
                 f"L_B={self.block_len}: the lookup embedder concatenates L_B token embeddings of width n_embd / L_B "
                 f"(section 2.2); use embedder='lookup_proj' for other widths")
        need(self.embed_dim is None or (count(self.embed_dim) and self.embed_dim >= 1),
             f"embed_dim={self.embed_dim!r} must be None or a positive int", field="embed_dim")
        need(count(self.pad) and 0 <= self.pad < self.vocab_size,
             f"pad_id={self.pad_id!r} is not an id inside the vocabulary of {self.vocab_size}", field="pad_id")
        need(self.eot_id is None or (count(self.eot_id) and 0 <= self.eot_id < self.vocab_size
                                     and self.eot_id != self.pad),
             f"eot_id={self.eot_id!r} must be a vocabulary id other than the pad id {self.pad}", field="eot_id")
        need(isinstance(self.random_pad, bool), f"random_pad={self.random_pad!r} must be true or false",
             field="random_pad")
        try:
            self.block_decoder_config()
        except ValueError as e:
            need(False, f"block decoder: {e}")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "BlockConfig":
        """A preset of this file (GPTConfig.from_preset reads model.py's presets)."""
        return ARCH_SPECS[0].make_config(name, **overrides)

    # -- derived sizes -------------------------------------------------------------------------------------------

    @property
    def pad(self) -> int:
        return self.vocab_size - 1 if self.pad_id is None else self.pad_id

    @property
    def n_ctx(self) -> int:
        """Context slots the context embedding is projected into: P prefix vectors, or L_B summands."""
        return self.prefix_len if self.context == "prefix" else self.block_len

    @property
    def local_len(self) -> int:
        """Positions of the token decoder: [P prefix vectors, t_0..t_{L_B-2}] or [start, t_0..t_{L_B-2}]."""
        return (self.prefix_len if self.context == "prefix" else 1) + self.block_len - 1

    @property
    def max_blocks(self) -> int:
        """Positions of the block decoder: max_seq_len / L_B, plus one for a prompt left-padded to a block boundary."""
        return self.max_seq_len // self.block_len + 1

    @property
    def emb_dim(self) -> int:
        """Width of one token embedding in the embedder."""
        if self.embedder == "lookup":
            return self.block_n_embd // self.block_len
        return self.embed_dim or self.block_n_embd

    def gpt_fields(self, **overrides) -> dict:
        """This config's GPTConfig fields (the token decoder and the style), with overrides."""
        return {**{f.name: getattr(self, f.name) for f in fields(GPTConfig)}, **overrides}

    def block_decoder_config(self) -> GPTConfig:
        """The block decoder as a GPTConfig (its own shape, the shared style, max_blocks positions)."""
        return GPTConfig(**self.gpt_fields(**{f: getattr(self, f"block_{f}") for f in DECODER_FIELDS},
                                           max_seq_len=self.max_blocks))

    def vanilla_config(self) -> GPTConfig:
        """The vanilla model with the same non-embedding parameters (Table 3): the two decoders' layers stacked."""
        if any(getattr(self, f"block_{f}") != getattr(self, f) for f in DECODER_FIELDS[1:]):
            raise ValueError("the vanilla counterpart needs decoders of equal width, heads and MLP size")
        return GPTConfig(**self.gpt_fields(n_layer=self.block_n_layer + self.n_layer))


def halves(n_layer, n_head, n_kv_head, n_embd, mlp_hidden, **rest) -> dict:
    """BlockConfig fields from a vanilla shape: block and token decoders each take half the layers (Table 3); `rest`
    (any other GPTConfig or BlockConfig field) passes through."""
    return dict(n_layer=n_layer - n_layer // 2, block_n_layer=n_layer // 2, n_head=n_head, n_kv_head=n_kv_head,
                n_embd=n_embd, mlp_hidden=mlp_hidden, **rest)




PRESETS: dict[str, dict] = {
    # The vanilla presets of model.py split in two (equal non-embedding parameters, equal block / token decoders).
    "tiny": halves(4, 4, 2, 128, 384, max_seq_len=256, vocab_size=4160),  # CPU and tests
    # A larger Block Transformer sized so that it decodes as fast as vanilla `tiny` on a 2-core CPU: the quality
    # comparison at matched inference cost (RESULTS.md has it, with the bench.py block command that matched them).
    "tiny-matched": halves(8, 4, 2, 224, 672, max_seq_len=256, vocab_size=4160),
    "small": halves(8, 8, 4, 512, 1536, max_seq_len=1024, vocab_size=16448),
    "base": halves(12, 12, 4, 768, 3840, max_seq_len=1024, vocab_size=32832),
    # The Block Transformer rows of Table 3 (L = 2048, L_B = 4, P = 2, lookup embedder, MHA, Pythia vocabulary), with
    # this repository's SwiGLU MLP at the parameter count of a 4x GELU MLP. For GPU benchmarks.
    "t3-5m": halves(6, 8, 8, 256, 704, max_seq_len=2048, vocab_size=50304),
    "t3-19m": halves(6, 8, 8, 512, 1408, max_seq_len=2048, vocab_size=50304),
    "t3-85m": halves(12, 12, 12, 768, 2048, max_seq_len=2048, vocab_size=50304),
    "t3-302m": halves(24, 16, 16, 1024, 2752, max_seq_len=2048, vocab_size=50304),
    "t3-805m": halves(16, 16, 16, 2048, 5504, max_seq_len=2048, vocab_size=50304),
    "t3-1.2b": halves(24, 16, 16, 2048, 5504, max_seq_len=2048, vocab_size=50304),
}


# ----------------------------------------------------------------------------------------------------------------
# Random-length padding when packing documents (Appendix H)


def random_pad_documents(x, y, gen, block_len: int, pad_id: int, eot_id: int, return_source: bool = False):
    """Re-lay out a batch of packed windows so that no block mixes two documents.

    x, y (B, T) come from train.py as a random window of the token stream (y = x shifted by one), in which documents
    end with `eot_id`. Each document (its tokens and its end-of-text; the window's first and last pieces are partial
    documents) becomes [pad * r, document, pad * f] with r uniform in 0..L_B-1 (drawn from `gen`) and f filling the
    last block. The new sequence is cut back to T + 1 tokens. -> x, y (B, T) with y = IGNORE where the target is a pad;
    with return_source also src (B, T): the index in the raw window [x, y[:, -1]] of every target y[:, t] (-1 at
    pads), so another model can be scored on exactly these targets. Vectorised: no loop over rows or documents.
    """
    B, T = x.shape
    L = block_len
    seq = torch.cat([x, y[:, -1:]], dim=1)  # (B, W) the raw window, W = T + 1
    W = T + 1
    eot = (seq == eot_id).long()
    doc = torch.cumsum(eot, dim=1) - eot  # (B, W) document index of each token; an end-of-text closes its document
    n_tok = torch.zeros(B, W, dtype=torch.long).scatter_add_(1, doc, torch.ones_like(doc))  # (B, W) tokens per doc
    left = torch.randint(0, L, (B, W), generator=gen) * (n_tok > 0)  # random left pad per document
    span = left + n_tok
    span = span + (-span) % L  # right pad to the block boundary
    start = torch.cumsum(span, dim=1) - span  # where each document's span begins in the new layout
    first = torch.cumsum(n_tok, dim=1) - n_tok  # where each document begins in the raw window
    t = torch.arange(W).expand(B, W)
    new_pos = (start + left - first).gather(1, doc) + t  # (B, W) new position of every raw token
    width = int(span.sum(1).max())
    out = torch.full((B, width), pad_id, dtype=seq.dtype).scatter_(1, new_pos, seq)[:, :W]
    x2, y2 = out[:, :-1], out[:, 1:].clone()
    y2[y2 == pad_id] = IGNORE
    if not return_source:
        return x2, y2
    src = torch.full((B, width), -1, dtype=torch.long).scatter_(1, new_pos, t.contiguous())[:, 1:W]
    return x2, y2, src


def prepare_batch(x, y, gen, cfg: BlockConfig):
    """train.py's hook: random-length padding (Appendix H) when the config knows the end-of-text id."""
    if cfg.random_pad and cfg.eot_id is not None:
        x, y = random_pad_documents(x, y, gen, cfg.block_len, cfg.pad, cfg.eot_id)
    return x, y, {}


# ----------------------------------------------------------------------------------------------------------------
# Uptraining from a vanilla model (Appendix N, G.8)


def from_vanilla(gpt: GPT, block_len: int = 4, prefix_len: int = 2, max_seq_len: int | None = None,
                 eot_id: int | None = None, random_pad: bool = True) -> BlockTransformer:
    """Initialise a Block Transformer from a vanilla GPT (Appendix N; the official code's "partition" method).

    * lower half of the layers -> block decoder, upper half -> token decoder (same width, heads, MLP);
    * embedder: lookup_proj with the vanilla table (width D) and the projection [I/L_B ... I/L_B], so a block
      embedding starts as the mean of the block's vanilla token embeddings;
    * prefix projection: P copies of the identity (zero bias), so every prefix vector starts as the context embedding;
    * token decoder: the vanilla embedding, final norm and head.
    """
    v = gpt.config
    if v.n_layer < 2:
        raise ValueError(f"cannot split a {v.n_layer}-layer vanilla model into a block and a token decoder: "
                         f"it needs at least 2 layers")
    max_seq_len = max_seq_len or v.max_seq_len
    if max_seq_len % block_len:
        raise ValueError(f"sequence length {max_seq_len} is not a multiple of block_len L_B={block_len}")
    vf = {f.name: getattr(v, f.name) for f in fields(GPTConfig)}
    cfg = BlockConfig(**halves(**{**vf, "max_seq_len": max_seq_len}), block_len=block_len, prefix_len=prefix_len,
                      embedder="lookup_proj", embed_dim=v.n_embd, context="prefix", eot_id=eot_id,
                      random_pad=random_pad)
    model = BlockTransformer(cfg)
    nb, D = cfg.block_n_layer, v.n_embd
    p = next(gpt.parameters())
    model.to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        for i, block in enumerate(model.block_decoder.blocks):
            block.load_state_dict(gpt.blocks[i].state_dict())
        for i, block in enumerate(model.blocks):
            block.load_state_dict(gpt.blocks[nb + i].state_dict())
        model.embedder.tok.weight.copy_(gpt.tok_emb.weight)
        model.embedder.tok.weight[cfg.pad].zero_()
        eye = torch.eye(D, dtype=p.dtype, device=p.device)
        model.embedder.proj.weight.copy_(torch.cat([eye / block_len] * block_len, dim=1))  # (D, L_B * D): the mean
        model.embedder.proj.bias.zero_()
        model.ctx_proj.weight.copy_(torch.cat([eye] * prefix_len, dim=0))  # (P * D, D): P copies
        model.ctx_proj.bias.zero_()
        model.tok_emb.weight.copy_(gpt.tok_emb.weight)
        model.norm.load_state_dict(gpt.norm.state_dict())
        if not cfg.tie_embeddings:
            model.lm_head.weight.copy_(gpt.lm_head.weight)
    return model


# ----------------------------------------------------------------------------------------------------------------
# How train.py sees this architecture


def add_args(ap: argparse.ArgumentParser):
    """Flags of the Block Transformer (BlockConfig checks their values)."""
    g = ap.add_argument_group("block (Block Transformer)")
    g.add_argument("--block-len", type=int, default=None, help="block: tokens per block L_B (default: preset, 4)")
    g.add_argument("--block-prefix-len", type=int, default=None, help="block: prefix length P (default: preset, 2)")
    g.add_argument("--block-embedder", choices=["lookup", "lookup_proj"], default=None, help="block: embedder")
    g.add_argument("--block-context", choices=["prefix", "summation"], default=None,
                   help="block: how the token decoder gets the context embedding (summation = MEGABYTE)")
    g.add_argument("--block-no-random-pad", action="store_true",
                   help="block: pack documents without random-length padding (Appendix H)")


def config_overrides(args, tok=None) -> dict:
    """BlockConfig fields set by the flags, and the tokenizer's end-of-text id (random padding needs it)."""
    o = {k: v for k, v in dict(block_len=args.block_len, prefix_len=args.block_prefix_len,
                               embedder=args.block_embedder, context=args.block_context).items() if v is not None}
    if args.block_no_random_pad:
        o["random_pad"] = False
    if tok is not None:  # train.py passes its tokenizer
        o["eot_id"] = tok.eot
    return o


def preset_rows(preset: str, options=None) -> list:
    """The row `python bench.py presets --arch block` prints for one preset (meta device): the Block Transformer,
    labelled with its block / token decoder layers, L_B and P, beside its vanilla counterpart (the two decoders'
    layers stacked, Table 3) as the baseline. options (bench.py's flags) are not read."""
    cfg = BlockConfig.from_preset(preset)
    label = (f"{preset:{max(map(len, PRESETS))}s} block {cfg.block_n_layer:2d}L tok {cfg.n_layer:2d}L "
             f"L_B {cfg.block_len} P {cfg.prefix_len}")
    with torch.device("meta"):
        return [(label, BlockTransformer(cfg), GPT(cfg.vanilla_config()))]


def stack_params(cfg: BlockConfig, layers) -> int:
    """The parameters of the two decoders from the config alone (ArchSpec.stack_params): the token decoder's layers,
    the block decoder's layers and final norm, the embedder's table (and its projection, lookup_proj) and the context
    projection to the P prefix vectors (or L_B summands)."""
    bd, norm = cfg.block_n_embd, 2 if cfg.norm == "layer" else 1
    block = layers(cfg.block_n_layer, bd, cfg.block_n_head, cfg.block_n_kv_head, bd // cfg.block_n_head,
                   cfg.block_mlp_hidden) + norm * bd
    embedder = cfg.vocab_size * cfg.emb_dim + (cfg.block_len * cfg.emb_dim * bd if cfg.embedder == "lookup_proj" else 0)
    return layers(cfg.n_layer) + block + embedder + (bd + 1) * cfg.n_ctx * cfg.n_embd


ARCH_SPECS = [ArchSpec("block", BlockConfig, BlockTransformer, PRESETS, add_args=add_args,
                       config_overrides=config_overrides, prepare_batch=prepare_batch, kd_ok=False,
                       # so that `python train.py --arch block` alone takes about five minutes on two CPU cores
                       # (its wall time: RESULTS.md, Timings)
                       train_defaults={"max_iters": 1000}, preset_rows=preset_rows, stack_params=stack_params)]
