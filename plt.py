"""
plt.py -- the Parallel Loop Transformer (PLT): a looped transformer that decodes as fast as a plain one.

Paper: "Parallel Loop Transformer for Efficient Test-Time Computation Scaling" (Wu et al., ByteDance Seed,
arXiv:2510.24824). What this file implements, in the paper's order:

  * the looped transformer (section 2.1): the WHOLE N-layer stack is applied L times with the same weights;
  * cross-loop parallelism, CLP (section 2.2.1, Algorithm 2 for training, Algorithm 1 for decoding): loop l >= 2
    reads E + shift_right(H^(l-1)), so loop l at position i depends on loop l-1 only at positions < i. At decode time
    the L loops of one step (loop 1 of token i, loop 2 at position i fed by loop 1's state at i-1, ...) are
    independent and run as ONE forward of a micro-batch of L rows;
  * first-loop KV sharing (section 2.2.2): loops >= 2 keep their own queries but attend over the K/V of loop 1
    (K_share, V_share), so only one full KV cache is stored;
  * gated sliding-window attention, G-SWA (Algorithm 3): loops >= 2 also attend over their OWN last w keys/values,
    and a per-head sigmoid gate mixes the two: y = g * y_local + (1 - g) * y_global;
  * the KV memory of Table 1 (`kv_cache_bytes`); the latency comparison of Table 3 is `python bench.py plt`.

The switches reproduce the rows of Table 2 (`--plt-variant` in train.py, or the config fields):

    row  variant    config                                              KV cache per layer (Table 1)
    (1)  vanilla    n_loops=1                                           n d
    (2)  loop       clp=False kv_share=False gswa=False  (sequential)   L n d     latency ~ L t
    (3)  clp        clp=True  kv_share=False gswa=False                 L n d     latency ~ t
    (4)  kv_share   clp=True  kv_share=True  gswa=False                 n d
    (5)  plt        clp=True  kv_share=True  gswa=True  (PLT)           n d + (L-1) w d
   (d = n_kv_head * head_dim here; K and V are both counted.)  kv_share / gswa also work without clp (LoopCoder's
   sequential design); gswa without kv_share is refused (Algorithm 3 has no global branch without K_share).

Conventions of this file (where the paper, public code and libraries differ):
  * H^(l) is the output of the last block of loop l BEFORE the final norm (the residual stream); the final norm is
    part of the classifier head, as in model.GPT.head. That is what is shifted and added to E.
  * Window: query i sees its own keys j with i - w < j <= i, exactly w keys including itself (kernels.swa_mask;
    the paper's "the w most recent KV entries"; vLLM's convention; FlexAttention examples and flash-attn's
    window_size=(w, 0) use w + 1 keys: window_keys="w+1" below).
  * Gate: g = sigmoid(<q_h, w_h> + b_h) per head from the query after RoPE (kernels.plt_gate), and the paper's mix
    g * y_local + (1 - g) * y_global. LoopCoder puts g on the global branch; its gate maps to this one by negating
    w_h and b_h. The gate starts at w_h = 0, b_h = 0, i.e. g = 0.5, an even mix: neither branch is favoured at the
    start and the gradient through g(1 - g) = 1/4 is the largest the sigmoid allows.
  * Positions: every loop sees the tokens at their own positions 0..T-1 (RoPE); the shift only moves the hidden
    states, never the positions.

Deviation: the loop input (config field loop_input_norm, --plt-loop-norm; "none" is the paper's raw sum
E + shift_right(H)). With the raw sum the CLP rows did not learn at this scale: H is the un-normalised residual stream
and outgrows the embeddings early in training, so token i all but vanishes from its own loop-2 input. The
default "shared" normalises the two summands with one learned pair of RMSNorms for every loop >= 2,
n_E(E) + n_H(shift_right(H)); "per_loop" gives each loop its own pair. Training and decode_step both go through
PLT.clp_input, so decoding still equals the forward exactly; tests/test_plt.py also trains a CLP model briefly and
checks that its logits at i depend on token i. The measurements behind it: RESULTS.md, "The loop input".

Production forms: IQuest's LoopCoder-V2 (7B, 2 loops, window 64; its public serving code in vLLM, SGLang and MLX)
runs G-SWA and first-loop KV sharing with four departures from the paper, each a config field here whose default is
the paper's form (flags in add_args; RESULTS.md, "The loop input", trains each against the paper's and "shared"):

    field (flag)                            the paper (default)              LoopCoder's form
    loop_emb_scale, loop_hidden_scale       E + shift_right(H)               a * E + b * shift_right(H), a and b
      (--plt-emb-scale, --plt-hidden-scale)                                  scalars (plt_emb_scale, plt_hidden_scale)
    learn_loop_scales (--plt-learn-scales)  a = b = 1, fixed                 a, b learned (one pair, from the values
                                                                             above)
    loop_final_norm (--plt-loop-final-norm) loop l+1 reads H^(l)             it reads norm(H^(l)), the head's shared
                                                                             final norm (plt_normalize_per_loop)
    gate_input (--plt-gate)                 "query": g_h = sigmoid(<q_h,     "residual": g_h = sigmoid(<n(x), w_h> +
                                            w_h> + b_h), q after RoPE        b_h), x the block's input before its
                                            (Algorithm 3's f_gate(Q))        attention norm, n a norm of the layer's
                                                                             own (plt_gate_use_hidden_states)
    window_keys (--plt-window-keys)         "w": keys i-w < j <= i           "w+1": keys i-w <= j <= i (flash-attn
                                                                             window_size=(w, 0), LoopCoder's training)

The full input of loop l >= 2 at position i is a * n_E(e_i) + b * n_H(S(h^(l-1)_(i-1))) with S the final norm or the
identity (loop_state) and n_E, n_H the loop_input_norm pair or identities (clp_input); LoopCoder's is loop_input_norm
"none", loop_final_norm on and its a, b. The residual gate keeps this file's orientation (g on the local branch; start
at g = 0.5). With "w+1" the rings hold w + 1 slots, so decoding still equals the forward exactly, and Table 1's
(L-1) w d becomes (L-1)(w+1) d. Every form goes through the same clp_input / loop_state / PLTAttention code in
training and in decode_step (tests/test_plt.py checks each formula against its own writing-out, and decode == forward
for each). LoopCoder itself decodes its loops one after another (no CLP); here a and b apply where E is added (CLP
rows, loop_embed), loop_final_norm, the gate and the window to every row that has a next loop, a gate or a window.

One ablation, neither the paper's nor LoopCoder's: loop_embed (--plt-loop-embed, with --plt-variant loop) gives the
sequential loop CLP's input at the same position, a * n_E(e_i) + b * n_H(S(h^(l-1)_i)), no shift. It separates the two
things CLP changes in loop 2's input, the token's embedding read again and the previous position's state (RESULTS.md,
"Table 2 at CPU scale").

Decoding (Algorithm 1): `prefill` runs the training forward on the prompt and keeps K_share/V_share (one KV cache
layer per stack layer), each non-first loop's last w keys/values (ring buffers: slot = position % w), and each
loop's last hidden state. Each `decode_step` then runs ONE forward of the stack on L rows per sequence, all at
position i: row 0 = e_i (loop 1), row l = e_i + h^(l)_(i-1) (loop l+1). Inside every layer loop 1's new K/V is
written to the shared cache first, because the other rows attend to position i too. The last row's logits give
token i+1, exactly the training forward's logits at position i (tests/test_plt.py checks every position). The
sequential loop baseline (clp=False) decodes with L forwards per token and one KV cache per loop. (The paper
names row l by the token whose chain it continues, "loop l+1 of token i-l"; here it is named by the position it
computes, i, as in Algorithm 2's training indexing. It is the same computation.) compile_decode (model.GPT's)
compiles decode_step on a static PLTCache for CUDA graphs: one graph per batch size, G-SWA's decode kernels inside it
as one operator (kernels.gated_swa_decode).

Kernels: G-SWA goes through kernels.gated_swa (a whole sequence: training forward, prefill) and
kernels.gated_swa_decode (one query per non-first-loop row against its ring buffer and the shared cache). They run
the Triton kernels on CUDA when nothing needs a gradient (prefill, decoding, evaluation) and the reference's math on
SDPA otherwise (training, CPU: kernels.gated_swa_sdpa / gated_swa_decode_sdpa); all follow the conventions above
(gate from q after RoPE, per-head gate_w (H, D) and gate_b (H,), or the residual gate's values passed in as `gate`;
a window of `window` keys, which PLTAttention sets to w or w + 1). tests/test_plt.py forces the
Triton path on CPU (TRITON_INTERPRET=1) and checks it against the reference. Loop 1 and the non-G-SWA variants
attend through model.attend, the two attentions of gated_swa_decode's CPU path through SDPA; a command that switches
cpu_tuning.py on puts the decode form it measured fastest behind both (model.tuned_ops, kernels.cpu_decode_attend).

Table 2 at equal parameters and tokens, one command per row (`--loops 3` for PLT-3), the protocol and the results in
RESULTS.md:
    python train.py --arch plt --plt-variant loop --eval-iters 20 --seed 1337 --out-dir out/plt-loop

Run:
    python train.py --arch plt                                  # PLT-2 tiny on the default corpus
    python train.py --arch plt --plt-variant loop               # a Table 2 row: vanilla|loop|clp|kv_share|plt
    python train.py --arch plt --loops 3 --plt-window 32        # PLT-3, window 32
    python train.py --arch plt --plt-loop-norm none --plt-emb-scale 0.707 --plt-hidden-scale 0.053 --plt-loop-final-norm
                    --plt-gate residual --plt-window-keys w+1   # LoopCoder-V2's forms (one command line)
    python -m harness.plt_forms run                             # the loop-input / gate forms side by side (RESULTS)
    python train.py --arch plt --init-from out/vanilla/ckpt.pt  # uptrain a vanilla checkpoint into a PLT
    python bench.py presets --arch plt                          # presets x variants: parameters, KV bytes, FLOPs
    python bench.py plt                                         # Table 3: decode latency vs vanilla and loop-2
    python bench.py plt --variants vanilla,loop,clp,kv_share,plt --batch 4,16 --preset small --device cuda
    python bench.py figures                                     # Algorithm 1 recorded from the decode forwards
    python -m pytest -q tests/test_plt.py
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import mark_static
from kernels import gated_swa, gated_swa_decode, plt_gate
from model import (GPT, ArchSpec, Attention, Block, GPTConfig, KVCache, attend, causal_mask_from_positions, kv_bytes,
                   lm_loss, make_norm, start_prefill)


# ----------------------------------------------------------------------------------------------------------------
# Cross-loop parallelism: the shift of Algorithm 2


def shift_right(h: torch.Tensor) -> torch.Tensor:
    """(B, T, C) -> (B, T, C): position i gets h[i - 1], position 0 gets zeros (line 4 of Algorithm 2)."""
    return F.pad(h[:, :-1], (0, 0, 1, 0))


# ----------------------------------------------------------------------------------------------------------------
# Decoding state (Algorithm 1): the shared (or per-loop) full KV cache, the G-SWA ring buffers, the last hidden
# state of each loop


class RingKV:
    """The sliding windows of the non-first loops: k, v (N, B, L-1, H_kv, W, D) and pos (B, W).

    Position p lives in slot p % W; pos holds the position in each slot (-1 = empty), the same for every loop and
    layer. After the step at position i a row holds exactly positions max(0, i-W+1)..i, the keys its window needs.
    W = min(window, max_len): a ring never needs more slots than there are positions.
    """

    def __init__(self, n_layer, batch, n_later_loops, n_kv_head, window, head_dim, dtype, device):
        shape = (n_layer, batch, n_later_loops, n_kv_head, window, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.full((batch, window), -1, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)

    @property
    def window(self) -> int:
        return self.k.size(4)

    def seed(self, lengths):
        """Slot positions after a prefill of `lengths` (B,) tokens: the latest p < length with p % W == slot."""
        last = lengths[:, None] - 1
        p = last - (last - torch.arange(self.window, device=lengths.device)) % self.window  # (B, W)
        self.pos.copy_(torch.where(p >= 0, p, -1))

    def seed_kv(self, layer, loop, k, v):
        """k, v (B, H_kv, T, D): a loop's K/V over the prompt; copy the positions `pos` names into the slots."""
        p = self.pos.clamp(min=0)  # empty slots copy position 0: masked by pos = -1
        self.k[layer, :, loop] = k.transpose(1, 2)[self.rows[:, None], p].transpose(1, 2)  # (B, H_kv, W, D)
        self.v[layer, :, loop] = v.transpose(1, 2)[self.rows[:, None], p].transpose(1, 2)

    def advance(self, q_pos):
        """A new step at positions q_pos (B,): its slot now holds q_pos (the position w steps back leaves)."""
        self.pos[self.rows, q_pos % self.window] = q_pos

    def write(self, layer, slot, k, v, loop=None):
        """k, v (B, L-1, H_kv, D) for all loops, or (B, H_kv, D) for one `loop`, go to each row's slot (B,)."""
        if loop is None:
            self.k[layer, self.rows, :, :, slot] = k
            self.v[layer, self.rows, :, :, slot] = v
        else:
            self.k[layer, self.rows, loop, :, slot] = k
            self.v[layer, self.rows, loop, :, slot] = v

    def nbytes(self) -> int:  # keys and values (pos is bookkeeping: 8 bytes per slot per row)
        return 2 * self.k.numel() * self.k.element_size()


class PLTCache:
    """All decoding state of a batch of B sequences.

    kv      a model.KVCache. With kv_share: loop 1's K/V, one layer per stack layer (K_share, V_share). Without:
            every loop's own K/V, laid out for how the loops run: CLP rows b * L + l (one batched read per layer),
            sequential layers l * N + j.
    ring    RingKV of the non-first loops (gswa only).
    hidden  (B, L-1, C): h^(l) at the last position, for the inputs e_i + h^(l)_(i-1) of the next step (CLP only).
    lengths (B,) tokens seen per row = the position of the next token.
    static  attend over the whole pre-allocated cache (masked) instead of its filled prefix: fixed shapes and no
            host sync per step, for torch.compile / CUDA graphs (kv's: kv.kv_len reads all max_len positions); every
            state tensor is marked static (graphs.mark_static), since the step writes each in place.
    """

    def __init__(self, cfg: PLTConfig, batch, max_len, dtype, device, static=False):
        L, N, H, D = cfg.n_loops, cfg.n_layer, cfg.n_kv_head, cfg.hd
        self.n_loops, self.n_layer = L, N
        self.shares_kv, self.parallel = cfg.shares_kv, cfg.parallel
        if self.shares_kv:
            self.kv = KVCache(N, batch, max_len, H, D, dtype, device, static)
        elif self.parallel:
            self.kv = KVCache(N, batch * L, max_len, H, D, dtype, device, static)
        else:
            self.kv = KVCache(L * N, batch, max_len, H, D, dtype, device, static)
        w = min(cfg.attn_window, max_len)
        self.ring = RingKV(N, batch, L - 1, H, w, D, dtype, device) if cfg.uses_gswa else None
        self.hidden = torch.zeros(batch, L - 1, cfg.n_embd, dtype=dtype, device=device) if self.parallel else None
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.batch, self.max_len = batch, max_len
        if static:  # a compiled step writes all of these in place: they keep their addresses (kv marks its own)
            ring = (self.ring.k, self.ring.v, self.ring.pos) if self.ring is not None else ()
            mark_static(self.lengths, *ring, *([self.hidden] if self.hidden is not None else []))

    @property
    def static(self) -> bool:
        return self.kv.static

    def fits(self, n: int, what: str = "this step needs") -> int:  # the full cache's overflow check (KVCache.fits)
        return self.kv.fits(n, what)

    def own_layer(self, loop, layer) -> int:  # sequential layout without kv_share
        return loop * self.n_layer + layer

    def store(self, layer, loop, pos, k, v):
        """Prefill: keep loop `loop`'s K/V (B, H, T, D) of stack layer `layer` at positions pos (B, T) where this
        layout holds them: loop 1's as K_share; with kv_share a non-first loop keeps only its window (the rings, see
        RingKV.seed_kv); without kv_share every loop its own, at rows b * L + l (CLP) or layer l * N + j."""
        if self.shares_kv:
            if loop == 0:
                self.kv.layer(layer).write(pos, k, v)
        elif self.parallel:
            rows = torch.arange(self.batch, device=pos.device) * self.n_loops + loop
            self.kv.layer(layer, rows).write(pos, k, v)
        else:
            self.kv.layer(self.own_layer(loop, layer)).write(pos, k, v)

    def reset(self):
        self.lengths.zero_()
        if self.ring is not None:
            self.ring.pos.fill_(-1)

    def nbytes(self) -> int:
        """Bytes of every key and value held (the full cache and the rings)."""
        return self.kv.nbytes() + (self.ring.nbytes() if self.ring is not None else 0)


@dataclass
class DecodeStep:
    """What every layer of one decode step needs, computed once per step."""

    cache: PLTCache
    q_pos: torch.Tensor  # (B,) position of the new token in each row
    kv_len: int  # how much of the full cache to read
    mask: torch.Tensor  # (B, 1, 1, kv_len): key j visible iff j <= q_pos
    slot: torch.Tensor | None = None  # (B,) ring slot of q_pos
    row_pos: torch.Tensor | None = None  # (B*L, 1) and (B*L, 1, 1, kv_len): the same for the rows of a per-loop
    row_mask: torch.Tensor | None = None  # CLP cache without kv_share


def _to_rows(t):  # (B, H, L, D) -> (B*L, H, 1, D): one row per (sequence, loop)
    B, H, L, D = t.shape
    return t.transpose(1, 2).reshape(B * L, H, 1, D)


def _from_rows(t, B, L):  # (B*L, H, 1, D) -> (B, H, L, D)
    return t.reshape(B, L, t.size(1), t.size(3)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# The attention of a PLT layer


class PLTAttention(Attention):
    """model.Attention plus the per-head gate of G-SWA, and the three ways a PLT layer attends.

    The projections (q/k/v/o, RoPE) are the parent's; the attention math is `model.attend` (causal, SDPA) and
    `kernels.gated_swa` / `kernels.gated_swa_decode` (Algorithm 3). Every parameter, the gate included, is shared
    by all loops. `forward(x, rope, mode=...)` picks the form:

      mode="seq"        a whole sequence of one loop (training forward, prefill);
      mode="clp_step"   one decode step of all L loops at once: x (B, L, C), row l = loop l+1 (Algorithm 1);
      mode="loop_step"  one decode step of one loop (the sequential baseline, clp=False).
    """

    def __init__(self, cfg: PLTConfig):
        super().__init__(cfg)
        self.window = cfg.attn_window  # keys of the window: w, or w + 1 with window_keys="w+1"
        self.gswa = cfg.uses_gswa
        self.gate_from_residual = self.gswa and cfg.gate_input == "residual"
        if self.gswa:  # f_gate: one scalar per head; starts at g = 0.5 (see the module docstring)
            if self.gate_from_residual:  # from RMSNorm(x) of the block's input x: w_h is (C,), the norm its own
                self.gate_norm = make_norm(cfg)
                self.gate_w = nn.Parameter(torch.zeros(cfg.n_head, cfg.n_embd))
            else:  # from q_h after RoPE (Algorithm 3's f_gate(Q))
                self.gate_w = nn.Parameter(torch.zeros(cfg.n_head, cfg.hd))
            self.gate_b = nn.Parameter(torch.zeros(cfg.n_head))
        self.gate_mean = None  # mean g of the last training forward (a logged metric)

    def residual_gate(self, residual):
        """gate_input="residual": residual (B, T, C), the block's input before its attention norm -> g (B, H, T) fp32,
        g_h = sigmoid(<n(x), w_h> + b_h) with n this layer's own norm (LoopCoder's plt_gate_use_hidden_states)."""
        acc = torch.promote_types(residual.dtype, torch.float32)  # as kernels.plt_gate: fp32 or wider
        x = self.gate_norm(residual).to(acc)
        return torch.sigmoid(torch.einsum("btc,hc->bht", x, self.gate_w.to(acc)) + self.gate_b.to(acc)[:, None])

    def gate_args(self, residual):
        """(gate_w, gate_b, gate) for kernels.gated_swa*: the query gate's weights, or the residual gate's values
        (B, H, T) for a residual (B, T, C)."""
        if not self.gate_from_residual:
            return self.gate_w, self.gate_b, None
        if residual is None:
            raise ValueError("gate_input='residual' needs the block's input: call the block with residual=x")
        return None, None, self.residual_gate(residual)

    def forward(self, x, rope, lora_idx=None, mode="seq", **kw):
        if mode == "seq":
            return self.seq_attention(x, rope, lora_idx=lora_idx, **kw)
        if mode == "clp_step":
            return self.clp_step(x, rope, lora_idx=lora_idx, **kw)
        if mode == "loop_step":
            return self.loop_step(x, rope, lora_idx=lora_idx, **kw)
        raise ValueError(f"unknown PLTAttention mode {mode!r}")

    def seq_attention(self, x, rope, shared=None, own_kv=None, lora_idx=None, residual=None):
        """x (B, T, C) of one loop at positions 0..T-1; residual (B, T, C) the block's input before its norm (read by
        the residual gate only).

        shared None: causal attention over the loop's own K/V (loop 1; every loop without kv_share).
        shared = (K_share, V_share) (B, H_kv, T, D): a loop >= 2 with kv_share; global attention over them, gated with
        a window over its own K/V if gswa (Algorithm 3). `own_kv` (a list) receives this loop's own (k, v), or None.
        """
        q = self.project_q(x, rope, lora_idx)  # (B, H, T, D)
        k = v = None
        if shared is None:
            k, v = self.project_kv(x, rope, lora_idx)  # (B, H_kv, T, D)
            y = attend(q, k, v, is_causal=True)
        elif not self.gswa:  # row (4): no K/V of its own at all
            y = attend(q, *shared, is_causal=True)
        else:  # row (5): g * SWA(q, k, v, w) + (1 - g) * Attn(q, K_share, V_share)
            k, v = self.project_kv(x, rope, lora_idx)
            gate_w, gate_b, gate = self.gate_args(residual)
            y = gated_swa(q, k, v, *shared, gate_w, gate_b, self.window, gate=gate)
            if self.training:
                with torch.no_grad():
                    self.gate_mean = (plt_gate(q, gate_w, gate_b) if gate is None else gate).mean()
        if own_kv is not None:
            own_kv.append((k, v))
        return self.project_out(y, lora_idx)  # (B, T, C)

    def clp_step(self, x, rope, step, layer, lora_idx=None, residual=None):
        """x (B, L, C): row l is loop l+1 at position step.q_pos (B,) of each sequence; rope broadcasts over rows.
        residual (B, L, C): the block's input (the residual gate's)."""
        cache = step.cache
        B, L, _ = x.shape
        q = self.project_q(x, rope, lora_idx)  # (B, H, L, D): the L loops sit on the time axis
        if not cache.shares_kv:  # rows (3)/(1): every loop its own full cache, rows b * L + l of cache.kv
            k, v = self.project_kv(x, rope, lora_idx)  # (B, H_kv, L, D)
            layer_kv = cache.kv.layer(layer)
            layer_kv.write(step.row_pos, _to_rows(k), _to_rows(v))
            ks, vs = layer_kv.read(step.kv_len)  # (B*L, H_kv, kv_len, D)
            y = attend(_to_rows(q), ks, vs, mask=step.row_mask)  # (B*L, H, 1, D)
            return self.project_out(_from_rows(y, B, L), lora_idx)
        layer_kv = cache.kv.layer(layer)
        if not self.gswa:  # row (4): only loop 1 writes K/V; all L rows attend over the shared cache at once
            k, v = self.project_kv(x[:, :1], rope, lora_idx)  # (B, H_kv, 1, D)
            layer_kv.write(step.q_pos[:, None], k, v)
            ks, vs = layer_kv.read(step.kv_len)
            return self.project_out(attend(q, ks, vs, mask=step.mask), lora_idx)
        k, v = self.project_kv(x, rope, lora_idx)  # (B, H_kv, L, D)
        layer_kv.write(step.q_pos[:, None], k[:, :, :1], v[:, :, :1])  # loop 1 first: the other rows see position i too
        ks, vs = layer_kv.read(step.kv_len)  # (B, H_kv, kv_len, D)
        y_first = attend(q[:, :, :1], ks, vs, mask=step.mask)  # (B, H, 1, D)
        ring = cache.ring  # the windows of loops 2..L, one row each
        ring.write(layer, step.slot, k[:, :, 1:].transpose(1, 2), v[:, :, 1:].transpose(1, 2))
        gate_w, gate_b, gate = self.gate_args(None if residual is None else residual[:, 1:])
        y_later = gated_swa_decode(q[:, :, 1:].transpose(1, 2), ring.k[layer], ring.v[layer], ring.pos, ks, vs,
                                   step.q_pos, gate_w, gate_b, self.window,
                                   gate=None if gate is None else gate.transpose(1, 2))  # (B, L-1, H, D)
        return self.project_out(torch.cat([y_first, y_later.transpose(1, 2)], dim=2), lora_idx)

    def loop_step(self, x, rope, step, layer, loop, lora_idx=None, residual=None):
        """x (B, 1, C): loop `loop` (0-based) at position step.q_pos; the loops of a token run one after another.
        residual (B, 1, C): the block's input (the residual gate's)."""
        cache = step.cache
        q = self.project_q(x, rope, lora_idx)  # (B, H, 1, D)
        if loop == 0 or not cache.shares_kv:  # a full cache of its own
            k, v = self.project_kv(x, rope, lora_idx)
            layer_kv = cache.kv.layer(cache.own_layer(loop, layer))
            layer_kv.write(step.q_pos[:, None], k, v)
            ks, vs = layer_kv.read(step.kv_len)
            return self.project_out(attend(q, ks, vs, mask=step.mask), lora_idx)
        ks, vs = cache.kv.layer(layer).read(step.kv_len)  # loop 1 already wrote position i in this step
        if not self.gswa:
            return self.project_out(attend(q, ks, vs, mask=step.mask), lora_idx)
        k, v = self.project_kv(x, rope, lora_idx)
        ring, this_loop = cache.ring, slice(loop - 1, loop)  # this loop's ring, kept as a dimension of 1
        ring.write(layer, step.slot, k[:, :, 0], v[:, :, 0], loop=loop - 1)
        gate_w, gate_b, gate = self.gate_args(residual)
        y = gated_swa_decode(q.transpose(1, 2), ring.k[layer, :, this_loop], ring.v[layer, :, this_loop], ring.pos, ks,
                             vs, step.q_pos, gate_w, gate_b, self.window,
                             gate=None if gate is None else gate.transpose(1, 2))  # (B, 1, H, D)
        return self.project_out(y.transpose(1, 2), lora_idx)


# ----------------------------------------------------------------------------------------------------------------
# The model


class PLT(GPT):
    """Looped decoder with cross-loop parallelism, first-loop KV sharing and gated SWA.

    From model.GPT it keeps the embedding, the final norm + head (`head`), RoPE, the parameter count and the
    length check; the blocks are model.Block with PLTAttention. Everything about loops and caches is below.
    forward(idx, targets) -> (logits, loss); new_cache -> prefill -> decode_step; generate.
    """

    def __init__(self, cfg: PLTConfig):
        super().__init__(cfg)  # GPT's init (GPT-2) and weight tie, over make_blocks' stack; the gates stay at g = 0.5
        # the loop-input norms (n_E, n_H) of loop_input_norm; they start at weight 1: E and H^(l-1) at unit rms each
        self.loop_norms = nn.ModuleList(nn.ModuleList([make_norm(cfg), make_norm(cfg)])
                                        for _ in range(cfg.n_loop_norm_pairs))
        # learn_loop_scales: (a, b) of a * E + b * shift_right(H) as one learned pair, from the configured values
        self.loop_scales = (nn.Parameter(torch.tensor([cfg.loop_emb_scale, cfg.loop_hidden_scale]))
                            if cfg.learn_loop_scales and cfg.adds_embedding else None)
        self.metrics = {}

    def make_blocks(self, cfg: PLTConfig) -> nn.ModuleList:
        """The N-layer stack every loop runs: model.Block with PLTAttention."""
        return nn.ModuleList(Block(cfg, attn_cls=PLTAttention) for _ in range(cfg.n_layer))

    # -- training forward (Algorithm 2) --------------------------------------------------------------------------

    def loop_input(self, e, h, loop):
        """Input of loop `loop` (0-based, >= 1) from the embeddings e and H^(loop) of the loop before, (B, T, C):
        clp_input(E, shift_right(S(H))) with CLP, else S(H) itself (the sequential looped transformer), or with
        loop_embed clp_input(E, S(H)) at the same position (the ablation between the two); S is loop_state (the
        identity, or the final norm)."""
        h = self.loop_state(h)
        if self.config.clp:
            return self.clp_input(e, shift_right(h), loop)
        return self.clp_input(e, h, loop) if self.config.loop_embed else h

    def loop_state(self, h):
        """What the next loop reads of a loop's output H (B, T, C): H itself (the paper), or with loop_final_norm the
        shared final norm of the head, norm(H) (LoopCoder's plt_normalize_per_loop)."""
        return self.norm(h) if self.config.loop_final_norm else h

    def clp_input(self, e, h_prev, loop):
        """e (B, T, C) embeddings at positions i, h_prev (B, T, C) the previous loop's state S(H) at positions i - 1
        (at i with loop_embed) -> the input of loop `loop` (0-based, >= 1) at i: a * n_E(e) + b * n_H(h_prev), where
        n_E, n_H are the loop-input norms (identities with loop_input_norm="none") and a, b the scales (fixed or
        learned). The paper: e + h_prev.

        Training (shift_right) and decode_step (the cached h^(l)_(i-1)) both call this, so they compute the same."""
        e_part, h_part = self.clp_summands(e, h_prev, loop)
        return e_part + h_part

    def clp_summands(self, e, h_prev, loop):
        """The two summands of clp_input: (a * n_E(e), b * n_H(h_prev))."""
        c = self.config
        if self.loop_norms:
            norm_e, norm_h = self.loop_norms[0 if len(self.loop_norms) == 1 else loop - 1]
            e, h_prev = norm_e(e), norm_h(h_prev)
        if self.loop_scales is not None:
            return self.loop_scales[0] * e, self.loop_scales[1] * h_prev
        if (c.loop_emb_scale, c.loop_hidden_scale) != (1, 1):
            return c.loop_emb_scale * e, c.loop_hidden_scale * h_prev
        return e, h_prev

    def run_loop(self, x, rope, shared=None, own_kv=None):
        """One pass of the N-layer stack over a whole sequence x (B, T, C) -> H (B, T, C), before the final norm.

        shared: per layer (K_share, V_share) for a loop >= 2 with kv_share, else None; own_kv: a list that receives
        per layer the loop's own (k, v) (None where it computes none).
        """
        for j, block in enumerate(self.blocks):  # residual: the block's input, for the residual gate
            x = block(x, rope, mode="seq", shared=None if shared is None else shared[j], own_kv=own_kv, residual=x)
        return x

    def hidden_states(self, idx, keep_kv=False):
        """idx (B, T) -> [H^(1), ..., H^(L)] each (B, T, C), and per loop the per-layer own (k, v) if keep_kv."""
        cfg = self.config
        B, T = idx.shape
        self.check_length(T)
        rope = self.rope(torch.arange(T, device=idx.device))
        e = self.embed(idx)  # E
        own_kvs = [[] if (keep_kv or (loop == 0 and cfg.shares_kv)) else None for loop in range(cfg.n_loops)]
        hs = [self.run_loop(e, rope, own_kv=own_kvs[0])]  # loop 1 is the plain model on E; it yields K_share, V_share
        shared = own_kvs[0] if cfg.shares_kv else None
        for loop in range(1, cfg.n_loops):
            hs.append(self.run_loop(self.loop_input(e, hs[-1], loop), rope, shared, own_kv=own_kvs[loop]))
        return hs, own_kvs

    def forward(self, idx, targets=None):
        """idx (B, T) -> logits (B, T, V) from H^(L), and with targets (B, T) the next-token cross entropy."""
        hs, _ = self.hidden_states(idx)
        logits = self.head(hs[-1])
        if self.training and self.config.uses_gswa:
            self.metrics = {"gate_local": torch.stack([b.attn.gate_mean for b in self.blocks]).mean()}
        return logits, (lm_loss(logits, targets) if targets is not None else None)

    # -- inference (Algorithm 1) ---------------------------------------------------------------------------------

    cache_cls = PLTCache  # GPT.new_cache builds it from the config (cache_kwargs)

    def cache_kwargs(self) -> dict:
        return dict(cfg=self.config)

    def forward_cached(self, *args, **kwargs):
        raise NotImplementedError("PLT decodes with prefill(idx, cache) and decode_step(tok, cache)")

    @torch.no_grad()
    def prefill(self, idx, cache: PLTCache, lengths=None):
        """Prompts idx (B, T), right-padded, true lengths (B,) (default T) -> logits (B, V) of each last token.

        Runs the training forward and keeps what decoding needs (line 1 of Algorithm 1): the full K/V (shared or
        per loop), the rings seeded from the last w positions, and h^(l) at the last position of every loop.
        """
        cfg = self.config
        B, T = idx.shape
        lengths = start_prefill(idx, cache, lengths)
        hs, own_kvs = self.hidden_states(idx, keep_kv=True)
        pos = torch.arange(T, device=idx.device).expand(B, T)
        rows = torch.arange(B, device=idx.device)
        for j in range(cfg.n_layer):
            for loop in range(cfg.n_loops):
                k, v = own_kvs[loop][j]
                if k is not None:  # a loop with kv_share computes no K/V of its own unless it runs G-SWA
                    cache.store(j, loop, pos, k, v)
        if cache.ring is not None:
            cache.ring.seed(lengths)
            for j in range(cfg.n_layer):
                for loop in range(1, cfg.n_loops):
                    cache.ring.seed_kv(j, loop - 1, *own_kvs[loop][j])
        last = lengths - 1
        if cache.hidden is not None:
            cache.hidden.copy_(torch.stack([h[rows, last] for h in hs[:-1]], dim=1))  # (B, L-1, C)
        cache.lengths.copy_(lengths)
        return self.head(hs[-1][rows, last][:, None])[:, 0]

    def start_step(self, cache: PLTCache) -> DecodeStep:
        """The DecodeStep of the next token (at position cache.lengths) that every layer reads; the rings advance to
        that position (its slot now holds it)."""
        q_pos = cache.lengths.clone()
        kv_len = cache.kv.kv_len(q_pos)
        step = DecodeStep(cache, q_pos, kv_len, causal_mask_from_positions(q_pos[:, None], kv_len))
        if cache.ring is not None:
            cache.ring.advance(q_pos)
            step.slot = q_pos % cache.ring.window
        if cache.parallel and not cache.shares_kv:
            step.row_pos = q_pos.repeat_interleave(cache.n_loops)[:, None]
            step.row_mask = step.mask.repeat_interleave(cache.n_loops, dim=0)
        return step

    @torch.no_grad()
    def decode_step(self, tok, cache: PLTCache):
        """One new token per row tok (B,) at position cache.lengths -> logits (B, V) of the next token.

        CLP: one forward of the stack on rows (B, L, C) = e_i, e_i + h^(1)_(i-1), ..., e_i + h^(L-1)_(i-1) (each
        through clp_input and loop_state, as in training). Sequential (clp=False): L forwards, loop l+1 reading loop
        l's output (through loop_state).
        """
        step = self.start_step(cache)
        rope = self.rope(step.q_pos[:, None])  # (B, 1, 1, rot): all rows of a sequence share the position
        e = self.embed(tok[:, None])  # (B, 1, C)
        if cache.parallel:  # (B, L, C): row 0 gets e_i alone, row l the input of loop l+1 from h^(l)_(i-1)
            x = torch.cat([e] + [self.clp_input(e, self.loop_state(cache.hidden[:, l - 1:l]), l)
                                 for l in range(1, cache.n_loops)], 1)
            for j, block in enumerate(self.blocks):
                x = block(x, rope, mode="clp_step", step=step, layer=j, residual=x)
            cache.hidden.copy_(x[:, :-1])  # h^(1..L-1)_i for the next step
        else:
            x = e
            for loop in range(self.config.n_loops):
                if loop:
                    x = self.loop_input(e, x, loop)
                for j, block in enumerate(self.blocks):
                    x = block(x, rope, mode="loop_step", step=step, layer=j, loop=loop, residual=x)
        cache.lengths += 1
        return self.head(x[:, -1:])[:, 0]

    # generate() is model.GPT's: prefill, then decode_step per token, both overridden above.

    # -- accounting ----------------------------------------------------------------------------------------------

    def kv_cache_bytes(self, batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
        """Table 1: n d (vanilla, kv_share), L n d (loop, clp), n d + (L-1) w d (PLT) per layer; K and V counted,
        d = n_kv_head * head_dim. The window is capped at seq_len (a ring never holds more than the sequence)."""
        c = self.config
        full = kv_bytes(c.n_layer, batch, seq_len, c.n_kv_head, c.hd, dtype_bytes)
        if not c.shares_kv:
            return c.n_loops * full
        if not c.uses_gswa:
            return full
        return full + (c.n_loops - 1) * kv_bytes(c.n_layer, batch, min(c.attn_window, seq_len), c.n_kv_head, c.hd,
                                                 dtype_bytes)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """6 (L N_body + N_head) + 12 N H D (keys attended) per trained token; each loop attends over seq_len keys
        (its own or K_share), G-SWA loops over min(w, seq_len) more. 1/3 of it for a forward pass alone."""
        c = self.config
        body, head = self.num_params(non_embedding=True), c.n_embd * c.vocab_size
        keys = c.n_loops * seq_len + (c.n_loops - 1) * min(c.attn_window, seq_len) * c.uses_gswa
        f = 6 * (c.n_loops * body + head) + 12 * c.n_layer * c.n_head * c.hd * keys
        return f if training else f / 3

    # -- from a vanilla model ------------------------------------------------------------------------------------

    @classmethod
    def from_vanilla(cls, gpt: GPT, **fields) -> "PLT":
        """A PLT with the weights of a vanilla model.GPT (same shapes); the gates start at g = 0.5. With n_loops=1 it
        computes exactly what gpt computes."""
        cfg = PLTConfig(**{**asdict(gpt.config), **fields})
        p = gpt.lm_head.weight
        model = cls(cfg).to(device=p.device, dtype=p.dtype)
        missing, unexpected = model.load_state_dict(gpt.state_dict(), strict=False)
        new = ("gate_w", "gate_b", "gate_norm.weight", "gate_norm.bias")  # the gates; loop_norms, loop_scales below
        if unexpected or any(not (k.endswith(new) or k.startswith(("loop_norms.", "loop_scales"))) for k in missing):
            raise ValueError(f"vanilla weights do not fit the PLT: missing {missing}, unexpected {unexpected}")
        return model


# ----------------------------------------------------------------------------------------------------------------
# Config: the fields, the rows of Table 2, the presets


LOOP_INPUT_NORMS = ("none", "shared", "per_loop")
GATE_INPUTS = ("query", "residual")
WINDOW_KEYS = ("w", "w+1")


@dataclass
class PLTConfig(GPTConfig):
    n_loops: int = 2  # L: how many times the whole N-layer stack is applied
    window: int = 64  # w: keys of the gated sliding window, the current one included (the paper uses 64)
    clp: bool = True  # cross-loop parallelism: loop l >= 2 reads E + shift_right(H^(l-1)) instead of H^(l-1)
    kv_share: bool = True  # loops >= 2 attend over loop 1's K/V (K_share, V_share) instead of their own
    gswa: bool = True  # loops >= 2 add a gated sliding window over their own K/V (needs kv_share)
    # CLP loop input (a deviation, see the module docstring): "none" is the paper's raw sum E + shift_right(H);
    # "shared" normalises both summands with learned norms, n_E(E) + n_H(shift_right(H)), one pair for every loop
    # >= 2; "per_loop" gives each loop >= 2 its own pair. Used only where E is added (clp or loop_embed, n_loops > 1).
    loop_input_norm: str = "shared"
    # The production forms (IQuest's LoopCoder-V2, its public serving code; the module docstring). Each default is the
    # paper's form.
    loop_emb_scale: float = 1.0  # a of the CLP loop input a * E + b * shift_right(H) (the paper: 1)
    loop_hidden_scale: float = 1.0  # b (the paper: 1)
    learn_loop_scales: bool = False  # a and b learned: one pair for every loop >= 2, starting at the values above
    loop_final_norm: bool = False  # the next loop reads norm(H^(l)) through the head's final norm (LoopCoder)
    # An ablation, not a row of Table 2: the sequential loop (clp=False) re-injects the token's embedding, loop l+1
    # reading a * n_E(e_i) + b * n_H(h^(l)_i): CLP's input at the same position, without the shift (RESULTS.md).
    loop_embed: bool = False
    gate_input: str = "query"  # G-SWA's gate from q after RoPE (Algorithm 3), or "residual": from norm(block input)
    window_keys: str = "w"  # G-SWA's window: "w" keys (the paper), or "w+1" (i-w..i: LoopCoder's training window)

    def validate(self):
        super().validate()
        need = self.need
        for name in ("n_loops", "window"):  # never a bool (True is an int to Python)
            need(self.is_int(getattr(self, name)) and getattr(self, name) >= 1,
                 f"{name}={getattr(self, name)!r} must be an int >= 1", field=name)
        for name in ("clp", "kv_share", "gswa", "learn_loop_scales", "loop_final_norm", "loop_embed"):
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be True or False",
                 field=name)
        for name in ("loop_emb_scale", "loop_hidden_scale"):
            need(self.is_number(getattr(self, name)) and getattr(self, name) >= 0,
                 f"{name}={getattr(self, name)!r} must be a finite number >= 0", field=name)
        for name, allowed in (("loop_input_norm", LOOP_INPUT_NORMS), ("gate_input", GATE_INPUTS),
                              ("window_keys", WINDOW_KEYS)):
            need(getattr(self, name) in allowed, f"{name}={getattr(self, name)!r} must be one of {allowed}",
                 field=name)
        need(not (self.gswa and not self.kv_share),
             "gswa=True needs kv_share=True: G-SWA (Algorithm 3) mixes a window over a loop's own K/V with global "
             "attention over the first loop's shared K/V; without kv_share there is no shared K/V to mix with")
        need(not (self.loop_embed and self.clp),
             "loop_embed=True needs clp=False: it adds E to the sequential loop's input, and CLP's input already "
             "has it (use --plt-variant loop)", field="loop_embed")

    # what is actually active (with one loop there is nothing to share or gate)
    @property
    def shares_kv(self) -> bool:
        return self.kv_share and self.n_loops > 1

    @property
    def uses_gswa(self) -> bool:
        return self.gswa and self.shares_kv

    @property
    def parallel(self) -> bool:  # CLP decoding: one forward of L rows per token
        return self.clp and self.n_loops > 1

    @property
    def attn_window(self) -> int:  # keys in G-SWA's window (and slots of a ring): w, or w + 1
        return self.window + (self.window_keys == "w+1")

    @property
    def adds_embedding(self) -> bool:  # loops >= 2 read E again (CLP, or the sequential loop with loop_embed)
        return (self.clp or self.loop_embed) and self.n_loops > 1

    @property
    def n_loop_norm_pairs(self) -> int:  # (n_E, n_H) pairs of the loop input where E is added
        if not self.adds_embedding or self.loop_input_norm == "none":
            return 0
        return 1 if self.loop_input_norm == "shared" else self.n_loops - 1


# The rows of Table 2 (section 3.1). `n_loops` is set only by vanilla; the others keep the preset's / --loops' L.
VARIANTS: dict[str, dict] = {
    "vanilla": dict(n_loops=1, clp=False, kv_share=False, gswa=False),
    "loop": dict(clp=False, kv_share=False, gswa=False),
    "clp": dict(clp=True, kv_share=False, gswa=False),
    "kv_share": dict(clp=True, kv_share=True, gswa=False),
    "plt": dict(clp=True, kv_share=True, gswa=True),
}

PRESETS: dict[str, dict] = {
    # CPU and tests. Two layers looped twice: the FLOPs of vanilla's 4-layer tiny, so a training step costs the same.
    # Every Table 2 row at equal parameters: the same preset with --plt-variant vanilla|loop|clp|kv_share|plt. The
    # window is 32 (the paper's 64 would cover a quarter of the 256-token context here, so G-SWA would hardly be local).
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384, max_seq_len=256, vocab_size=4160,
                 n_loops=2, window=32),
    # GQA 4:1 as in the paper's dense ablation (16 query / 4 KV heads), at small scale. ~25M non-embedding params.
    "small": dict(n_layer=8, n_head=8, n_kv_head=2, n_embd=512, mlp_hidden=1536, max_seq_len=1024,
                  vocab_size=16448, n_loops=2, window=64),
    "base": dict(n_layer=12, n_head=12, n_kv_head=3, n_embd=768, mlp_hidden=3072, max_seq_len=1024,
                 vocab_size=32832, n_loops=2, window=64),
    # The paper's OLMo2 dense ablation (Appendix A.3): 16 layers, d 1536, 16/4 heads, MLP 8192 (OLMo counts both
    # SwiGLU halves, so 4096 per branch here). For GPU benchmarks with random weights.
    "ablation-dense": dict(n_layer=16, n_head=16, n_kv_head=4, n_embd=1536, mlp_hidden=4096, max_seq_len=4096,
                           vocab_size=50304, n_loops=2, window=64),
    # The dense 1.2B of Appendix A.2: 16 layers, d 2048, 32/8 heads, MLP 16384 (8192 per SwiGLU branch).
    "dense-1.2b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, max_seq_len=4096,
                       vocab_size=50304, n_loops=2, window=64),
}


def variant_fields(name: str, n_loops: int | None = None) -> dict:
    """Config fields of a Table 2 row; n_loops (L) is added unless the row is vanilla (L = 1)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown PLT variant {name!r}; choose one of {list(VARIANTS)}")
    fields_ = dict(VARIANTS[name])
    if name == "vanilla":
        if n_loops not in (None, 1):
            raise ValueError(f"variant 'vanilla' has one loop, but --loops {n_loops} was given")
    elif n_loops is not None:
        fields_["n_loops"] = n_loops
    return fields_


# ----------------------------------------------------------------------------------------------------------------
# How train.py and bench.py see this architecture


def add_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("plt (Parallel Loop Transformer; the number of loops L is --loops)")
    g.add_argument("--plt-variant", default=None, choices=list(VARIANTS),
                   help="row of Table 2: vanilla (L=1) | loop (sequential) | clp | kv_share | plt (default: plt)")
    g.add_argument("--plt-window", type=int, default=None, help="G-SWA window w in keys, current included (64)")
    g.add_argument("--plt-loop-norm", default=None, choices=LOOP_INPUT_NORMS,
                   help="CLP loop input (and --plt-loop-embed's): none = the paper's E + shift_right(H); shared / "
                        "per_loop = learned norms on both summands (default shared; see plt.py)")
    # LoopCoder-V2's forms (plt.py's docstring); unset = the paper's
    g.add_argument("--plt-emb-scale", type=float, default=None,
                   help="a of the CLP loop input a*E + b*shift_right(H), and of --plt-loop-embed's (default 1, "
                        "the paper)").bounds = {"min": 0}
    g.add_argument("--plt-hidden-scale", type=float, default=None,
                   help="b of the CLP loop input a*E + b*shift_right(H), and of --plt-loop-embed's (default 1, "
                        "the paper)").bounds = {"min": 0}
    g.add_argument("--plt-learn-scales", action="store_true", default=None,
                   help="learn a and b (one pair, starting at --plt-emb-scale / --plt-hidden-scale)")
    g.add_argument("--plt-loop-final-norm", action="store_true", default=None,
                   help="the next loop reads the previous loop's state through the shared final norm (LoopCoder's "
                        "plt_normalize_per_loop)")
    g.add_argument("--plt-loop-embed", action="store_true", default=None,
                   help="with --plt-variant loop: loop l+1 also reads the token's embedding, n_E(E) + n_H(H^(l)) at "
                        "the same position (CLP's input without the shift; an ablation)")
    g.add_argument("--plt-gate", default=None, choices=GATE_INPUTS,
                   help="G-SWA gate from the query (default, Algorithm 3) or from the normed pre-attention residual "
                        "(LoopCoder's plt_gate_use_hidden_states)")
    g.add_argument("--plt-window-keys", default=None, choices=WINDOW_KEYS,
                   help="G-SWA window of w keys (default, the paper) or w+1 (i-w..i, LoopCoder's training window)")


# flag dest -> PLTConfig field, for the flags that set one field each
FLAG_FIELDS = {"plt_window": "window", "plt_loop_norm": "loop_input_norm", "plt_emb_scale": "loop_emb_scale",
               "plt_hidden_scale": "loop_hidden_scale", "plt_learn_scales": "learn_loop_scales",
               "plt_loop_final_norm": "loop_final_norm", "plt_loop_embed": "loop_embed", "plt_gate": "gate_input",
               "plt_window_keys": "window_keys"}


def config_overrides(args, tok=None) -> dict:
    out = variant_fields(args.plt_variant or "plt", getattr(args, "loops", None))
    for dest, field in FLAG_FIELDS.items():
        if getattr(args, dest, None) is not None:
            out[field] = getattr(args, dest)
    return out


def preset_rows(preset: str, options=None) -> list:
    """`python bench.py presets --arch plt`: every Table 2 row of the preset, the row `vanilla` (the same stack once)
    as the baseline in brackets (meta device: nothing is allocated). Decode latency: `python bench.py plt`."""
    p = PRESETS[preset]
    with torch.device("meta"):
        base = PLT(PLTConfig(**{**p, **variant_fields("vanilla")}))
        rows = []
        for v in VARIANTS:
            cfg = PLTConfig(**{**p, **variant_fields(v)})
            rows.append((f"{preset} {v} L{cfg.n_loops} w{cfg.window}", PLT(cfg), base))
    return rows


# The main job (`python train.py --arch plt`): 800 steps of 16 x 256 tokens at lr 4e-3, Table 2's protocol (RESULTS.md;
# its wall time under "Timings"): one rate for every row, the tuned best of the 2-layer vanilla and the sequential loop
# at this budget. PLT-2 alone is best at 1.6e-2 or above (the `plt` sweep: `--lr 1.6e-2`, 0.18 nats lower at seed 1337).
ARCH_SPECS = [ArchSpec("plt", PLTConfig, PLT, PRESETS, add_args=add_args, config_overrides=config_overrides,
                       train_defaults={"max_iters": 800, "lr": 4e-3}, preset_rows=preset_rows,
                       stack_passes=lambda cfg: cfg.n_loops)]
