"""
model.py -- the vanilla decoder-only transformer and the building blocks every other file imports.

A Llama/Gemma-style decoder, written to be read top to bottom:

    RMSNorm / LayerNorm -> rotary embedding from explicit positions -> GQA attention through
    scaled_dot_product_attention (explicit mask, optional pre-allocated KV cache) -> gated MLP
    (SwiGLU or GeGLU) -> Block -> KVCache -> GPT (forward, prefill, decode_step, generate).

The other architectures of this repository (recursive.py, block_transformer.py, plt.py, double_decoder.py) do not
re-write any of this math. They import `Block`, `Attention`, `MLP`, `RMSNorm`, `RotaryEmbedding`, `KVCache`, `attend`
and `sample_next`, and pass what is special about them as arguments: RoPE positions that are block indices or
offsets, a LoRA index per row (`lora_idx`, used by svd_lora.py), an explicit attention mask, a cache layer.

Switches on `GPTConfig` also cover the three pretrained families of the papers (Llama/TinyLlama, Gemma, GPT-NeoX/
Pythia), so that `GPT.from_pretrained(dir)` can load a local Hugging Face checkpoint:
  * norm='rms' | 'layer' (LayerNorm with bias, NeoX), norm_offset=1.0 for Gemma's (1 + w) scale;
  * mlp='swiglu' | 'geglu' (tanh GELU, Gemma) | 'gelu' (plain 4x MLP, NeoX);
  * embed_scale (Gemma multiplies embeddings by sqrt(d)); head_dim different from n_embd / n_head;
  * parallel_residual (NeoX: x + attn(ln1 x) + mlp(ln2 x)), rotary_pct (partial rotary), attn_bias / mlp_bias.

Conventions (shared by every file):
  * tensors are (B, T, C) for activations, (B, H, T, D) for heads; a KV cache stores (B, H_kv, S, D);
  * a cache index equals the absolute position, so the causal mask of a cached step is `key_pos <= query_pos`;
  * targets equal to IGNORE (-100) carry no loss.

Run:
    python model.py                       # print the presets: parameters, KV bytes, FLOPs per token
    python model.py --preset small        # one preset
    python model.py --hf DIR --prompt "The capital of France is"   # greedy continuation of a local HF checkpoint
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100  # target id that carries no loss (pads, prompt tokens of a prefix-LM, ...)


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # n_head = MHA, 1 = MQA, in between = GQA
    n_embd: int = 128
    head_dim: int | None = None  # None -> n_embd // n_head (Gemma decouples the two)
    mlp_hidden: int = 384  # inner size of the MLP (per branch for gated MLPs)
    vocab_size: int = 4160
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0  # fraction of head_dim that is rotated (NeoX: 0.25)
    norm: str = "rms"  # 'rms' | 'layer'
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # RMSNorm scale is (norm_offset + w); Gemma uses 1.0
    mlp: str = "swiglu"  # 'swiglu' | 'geglu' | 'gelu'
    tie_embeddings: bool = True
    embed_scale: bool = False  # multiply token embeddings by sqrt(n_embd) (Gemma)
    parallel_residual: bool = False  # NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    attn_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"bad GPTConfig: {msg}")

        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "max_seq_len"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be a positive int")
        need(self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim is None:
            need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        need(self.hd % 2 == 0, f"head_dim={self.hd} must be even for rotary embeddings")
        need(0.0 < self.rotary_pct <= 1.0, f"rotary_pct={self.rotary_pct} must be in (0, 1]")
        need(self.rot_dim % 2 == 0, f"rotary dims {self.rot_dim} (head_dim * rotary_pct) must be even")
        need(self.norm in ("rms", "layer"), f"norm={self.norm!r} is not 'rms' or 'layer'")
        need(self.mlp in ("swiglu", "geglu", "gelu"), f"mlp={self.mlp!r} is not 'swiglu', 'geglu' or 'gelu'")

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def rot_dim(self) -> int:
        return int(self.hd * self.rotary_pct)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"GPTConfig got unknown fields {sorted(unknown)}")
        return cls(**d)


PRESETS: dict[str, dict] = {
    # CPU and tests: ~0.8M non-embedding parameters, trains in minutes on 2 cores.
    "tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384, max_seq_len=256, vocab_size=4160),
    # Decoder-only baselines of double_decoder.py's presets (same width, ctx + gen layers, same non-embedding params):
    # tiny6 for its `tiny` (4 + 2 layers, ~1.2M), mini for its `mini` (6 + 3 layers, d 256, ~7M).
    "tiny6": dict(n_layer=6, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384, max_seq_len=256, vocab_size=4160),
    "mini": dict(n_layer=9, n_head=4, n_kv_head=2, n_embd=256, mlp_hidden=768, max_seq_len=256, vocab_size=4160),
    # ~25M non-embedding parameters.
    "small": dict(n_layer=8, n_head=8, n_kv_head=4, n_embd=512, mlp_hidden=1536, max_seq_len=1024, vocab_size=16448),
    # ~125M non-embedding parameters.
    "base": dict(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, mlp_hidden=3840, max_seq_len=1024, vocab_size=32832),
    # Shapes of the papers' pretrained base models, for GPU benchmarks with random weights.
    "gemma-2b": dict(n_layer=18, n_head=8, n_kv_head=1, n_embd=2048, head_dim=256, mlp_hidden=16384, mlp="geglu",
                     norm_offset=1.0, embed_scale=True, norm_eps=1e-6, vocab_size=256000, max_seq_len=8192),
    "tinyllama-1.1b": dict(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, mlp_hidden=5632, vocab_size=32000,
                           max_seq_len=2048, tie_embeddings=False),
    "pythia-1b": dict(n_layer=16, n_head=8, n_kv_head=8, n_embd=2048, mlp_hidden=8192, mlp="gelu", norm="layer",
                      rotary_pct=0.25, parallel_residual=True, attn_bias=True, mlp_bias=True, tie_embeddings=False,
                      vocab_size=50304, max_seq_len=2048),
}


# ----------------------------------------------------------------------------------------------------------------
# Device and dtype


def pick_device(flag: str = "auto") -> torch.device:
    """cuda > mps > cpu unless a device is named."""
    if flag != "auto":
        return torch.device(flag)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, flag: str = "auto") -> torch.dtype:
    """bf16 where the device supports it (CUDA with bf16, MPS), else fp32; or the named dtype."""
    if flag != "auto":
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[flag]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "mps":
        return torch.bfloat16
    return torch.float32


# ----------------------------------------------------------------------------------------------------------------
# Norms


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w), computed in fp32 and cast back. offset=1 is Gemma's convention."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def make_norm(cfg: GPTConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.n_embd
    if cfg.norm == "layer":
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, cfg.norm_offset)


# ----------------------------------------------------------------------------------------------------------------
# Rotary position embedding (RoFormer; the "rotate half" layout of Llama/NeoX, so HF weights load unpermuted)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by an explicit positions tensor.

    Positions are whatever the caller says: token indices for a plain decoder, block indices for the Block
    Transformer's block decoder, absolute positions of context latents for the double decoder's cross keys.
    Only the first `rot_dim` channels of each head are rotated (partial rotary, NeoX's rotary_pct).
    """

    def __init__(self, rot_dim: int, max_len: int, theta: float = 10000.0):
        super().__init__()
        self.rot_dim, self.theta = rot_dim, theta
        inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(max_len)

    def _build(self, max_len: int):
        t = torch.arange(max_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # (S, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (S, rot)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (T,) or (B, T) long -> cos, sin of shape (B|1, 1, T, rot) ready to broadcast over heads."""
        if pos.dim() == 1:
            pos = pos[None]
        return self.cos[pos][:, None], self.sin[pos][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); rotates the first cos.size(-1) channels, in fp32."""
    rot = cos.size(-1)
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out.to(x.dtype), xp], dim=-1) if xp.numel() else out.to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Linear layers that accept a LoRA index


class Linear(nn.Linear):
    """nn.Linear whose forward takes an optional `lora_idx` and ignores it.

    Every projection in Attention and MLP is one of these, so svd_lora.py can swap in a `LoRALinear` subclass that
    adds a per-loop (or per-row) low-rank delta without any change to the attention or MLP code.
    `lora_idx` is None, an int (one loop for the whole batch) or a LongTensor (B,) with one loop per row.
    """

    def forward(self, x, lora_idx=None):
        return F.linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------------------------------------------
# Attention


def attend(q, k, v, mask=None, is_causal=False, scale=None):
    """Scaled dot-product attention with GQA: q (B, H, T, D), k/v (B, H_kv, S, D) -> (B, H, T, D).

    `mask` is a bool tensor broadcastable to (B, H, T, S), True = may attend. With no mask and is_causal=True this
    is the flash path on GPU. H must be a multiple of H_kv; the KV heads are shared without being copied.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                          scale=scale, enable_gqa=q.size(1) != k.size(1))


def causal_mask_from_positions(q_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """q_pos (B, T) absolute positions -> bool mask (B, 1, T, kv_len): key j is visible iff j <= q_pos.

    This is the mask of every cached step, because a cache index equals the absolute position.
    """
    keys = torch.arange(kv_len, device=q_pos.device)
    return keys[None, None, None, :] <= q_pos[:, None, :, None]


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, RoPE from explicit positions, and an optional KV cache.

    The pieces are separate methods so that other architectures can recombine them without copying the math:
    `project_qkv` (projections + RoPE), the module-level `attend` (SDPA), `project_out`.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.hd
        d, hd = cfg.n_embd, cfg.hd
        self.q_proj = Linear(d, cfg.n_head * hd, bias=cfg.attn_bias)
        self.k_proj = Linear(d, cfg.n_kv_head * hd, bias=cfg.attn_bias)
        self.v_proj = Linear(d, cfg.n_kv_head * hd, bias=cfg.attn_bias)
        self.o_proj = Linear(cfg.n_head * hd, d, bias=cfg.attn_bias)

    def split_heads(self, x, n):  # (B, T, n*D) -> (B, n, T, D)
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def project_q(self, x, rope, lora_idx=None):
        return apply_rotary(self.split_heads(self.q_proj(x, lora_idx), self.n_head), *rope)

    def project_kv(self, x, rope, lora_idx=None):
        """Keys and values of hidden states x (B, T, C) at the positions given by rope -> (B, H_kv, T, D) each."""
        k = apply_rotary(self.split_heads(self.k_proj(x, lora_idx), self.n_kv_head), *rope)
        v = self.split_heads(self.v_proj(x, lora_idx), self.n_kv_head)
        return k, v

    def project_out(self, y, lora_idx=None):  # (B, H, T, D) -> (B, T, C)
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D), lora_idx)

    def forward(self, x, rope, mask=None, cache=None, q_pos=None, lora_idx=None):
        """x (B, T, C); rope = (cos, sin) for the T positions.

        No cache: causal self-attention over x (or over `mask`, bool (B|1, 1, T, T)).
        With a cache (a LayerCache view): write this step's K/V at positions q_pos (B, T), then, if a mask
        (B, 1, T, kv_len) is given, attend over the cache prefix [0, kv_len) with it. Without a mask (a fresh prefill,
        q_pos = 0..T-1 in every row) it skips the read-back and attends causally over x itself.
        """
        q = self.project_q(x, rope, lora_idx)
        k, v = self.project_kv(x, rope, lora_idx)
        if cache is not None:
            cache.write(q_pos, k, v)
            if mask is not None:  # a cached step: read the whole visible prefix back
                k, v = cache.read(mask.size(-1))
        return self.project_out(attend(q, k, v, mask=mask, is_causal=mask is None), lora_idx)


# ----------------------------------------------------------------------------------------------------------------
# MLP


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act = SiLU (SwiGLU) or tanh-GELU (GeGLU); or NeoX's up -> GELU -> down."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.kind = cfg.mlp
        d, h, b = cfg.n_embd, cfg.mlp_hidden, cfg.mlp_bias
        if self.kind != "gelu":
            self.gate_proj = Linear(d, h, bias=b)
        self.up_proj = Linear(d, h, bias=b)
        self.down_proj = Linear(h, d, bias=b)

    def forward(self, x, lora_idx=None):
        if self.kind == "gelu":
            return self.down_proj(F.gelu(self.up_proj(x, lora_idx)), lora_idx)
        g = self.gate_proj(x, lora_idx)
        g = F.silu(g) if self.kind == "swiglu" else F.gelu(g, approximate="tanh")
        return self.down_proj(g * self.up_proj(x, lora_idx), lora_idx)


# ----------------------------------------------------------------------------------------------------------------
# Block


class Block(nn.Module):
    """Pre-norm transformer block. `attn_cls` lets a file swap in an Attention subclass (e.g. PLT's gated SWA).

    forward(x, rope, lora_idx=None, **attn_kwargs): the attention keyword arguments (mask, cache, q_pos, or a
    subclass's own) are passed through untouched.
    """

    def __init__(self, cfg: GPTConfig, attn_cls=Attention):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.attn_norm = make_norm(cfg)
        self.attn = attn_cls(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, lora_idx=None, **attn_kwargs):
        a = self.attn(self.attn_norm(x), rope, lora_idx=lora_idx, **attn_kwargs)
        if self.parallel:
            return x + a + self.mlp(self.mlp_norm(x), lora_idx)
        x = x + a
        return x + self.mlp(self.mlp_norm(x), lora_idx)


# ----------------------------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Pre-allocated keys and values for `n_layer` attention layers: k, v of shape (n_layer, B, H_kv, S, D).

    A cache index equals the absolute position, and `lengths` (B,) counts the filled positions of each row, so the
    rows of one batch can sit at different positions (ragged prompts, continuous batching). Stale entries past a
    row's length are never read: the positional causal mask hides them. A "layer" is whatever the owner says:
    recursive.py uses one per (loop, layer), so a serving step whose rows sit at different loops passes one layer
    index per row.

    Attention never sees this class, only a `LayerCache` view from `cache.layer(i, rows)` with two methods,
    write(pos, k, v) and read(kv_len). Other files give their own caches (ring buffers, per-block caches) the same
    two methods.
    """

    def __init__(self, n_layer, batch, max_len, n_kv_head, head_dim, dtype=torch.float32, device="cpu"):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.all_rows = torch.arange(batch, device=device)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def layer(self, layer, rows=None) -> "LayerCache":
        """View of one layer (an int, or a LongTensor (B,) with one layer per row) for `rows` (default: all)."""
        return LayerCache(self, layer, self.all_rows if rows is None else rows)

    def reset(self, rows=None):
        """Forget rows (all by default): their length goes to 0, their stale entries stay masked."""
        if rows is None:
            self.lengths.zero_()
        else:
            self.lengths[rows] = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class LayerCache:
    """One layer of a KVCache for a set of rows: what Attention writes to and reads from."""

    def __init__(self, cache: KVCache, layer, rows):
        self.cache, self.layer, self.rows = cache, layer, rows

    def _index(self, pos):
        # advanced indices around the head slice -> the indexed view has shape (B, T, H_kv, D)
        if isinstance(self.layer, torch.Tensor):
            return self.layer[:, None], self.rows[:, None], slice(None), pos
        return self.layer, self.rows[:, None], slice(None), pos

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, H_kv, T, D) go to positions pos (B, T) of this layer of these rows."""
        idx = self._index(pos)
        self.cache.k[idx] = k.transpose(1, 2)
        self.cache.v[idx] = v.transpose(1, 2)

    def read(self, kv_len: int):
        """-> k, v (B, H_kv, kv_len, D): a view when the layer is one int and the rows are all rows, else a gather."""
        c = self.cache
        if not isinstance(self.layer, torch.Tensor) and self.rows is c.all_rows:
            return c.k[self.layer, :, :, :kv_len], c.v[self.layer, :, :, :kv_len]
        layer = self.layer if isinstance(self.layer, torch.Tensor) else torch.full_like(self.rows, self.layer)
        return c.k[layer, self.rows, :, :kv_len], c.v[layer, self.rows, :, :kv_len]


def kv_bytes(n_layer, batch, seq_len, n_kv_head, head_dim, dtype_bytes=2) -> int:
    """Bytes of keys plus values for n_layer layers of full attention."""
    return 2 * n_layer * batch * seq_len * n_kv_head * head_dim * dtype_bytes


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def sample_next(logits, temperature=0.0, top_k=None, generator=None):
    """logits (B, V) -> next token ids (B,). temperature 0 is argmax; else softmax(logits / T) over the top_k.

    With a `generator` (on the logits' device) sampling is reproducible.
    """
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# Distillation divergences (train.py adds them to the CE loss; recursive.py uses them for self-distillation)


def distill_loss(student_logits, teacher_logits, kind="fkl", temperature=1.0, mask=None):
    """Mean over tokens of a divergence between teacher p and student q (logits (..., V), same tokenizer).

    fkl = KL(p || q), rkl = KL(q || p), jsd = (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2,
    tvd = 0.5 * sum |p - q|. `mask` (...) selects the tokens that count. Teacher gradients are not taken.
    """
    t = temperature
    s = F.log_softmax(student_logits.float() / t, dim=-1)
    p = F.log_softmax(teacher_logits.detach().float() / t, dim=-1)
    if kind == "fkl":
        d = (p.exp() * (p - s)).sum(-1)
    elif kind == "rkl":
        d = (s.exp() * (s - p)).sum(-1)
    elif kind == "jsd":
        m = torch.logaddexp(p, s) - math.log(2.0)
        d = 0.5 * ((p.exp() * (p - m)).sum(-1) + (s.exp() * (s - m)).sum(-1))
    elif kind == "tvd":
        d = 0.5 * (p.exp() - s.exp()).abs().sum(-1)
    else:
        raise ValueError(f"unknown divergence {kind!r}; choose fkl, rkl, jsd or tvd")
    if mask is not None:
        return (d * mask).sum() / mask.sum().clamp(min=1)
    return d.mean()


def lm_loss(logits, targets):
    """Next-token cross entropy in fp32; targets == IGNORE carry no loss."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)


# ----------------------------------------------------------------------------------------------------------------
# Parameter, memory and FLOP accounting (shared by every model in this repository)


def count_params(module: nn.Module, exclude: tuple[nn.Module, ...] = ()) -> int:
    """Unique parameters of module, minus those of the `exclude` modules (tied weights are counted once)."""
    skip = {id(p) for m in exclude for p in m.parameters()}
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            n += p.numel()
    return n


def init_weights(module: nn.Module, n_layer: int, std: float = 0.02):
    """GPT-2 init: N(0, std) for linears and embeddings, residual projections scaled by 1/sqrt(2 n_layer)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            scale = 1.0 / math.sqrt(2 * n_layer) if name.endswith(("o_proj", "down_proj")) else 1.0
            nn.init.normal_(m.weight, 0.0, std * scale)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of known CUDA devices (for MFU), None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# ----------------------------------------------------------------------------------------------------------------
# The vanilla decoder


class GPT(nn.Module):
    """Decoder-only language model.

    forward(idx, targets=None) -> (logits, loss), nanoGPT's convention.
    Inference is explicit: new_cache(batch, max_len) -> prefill(idx, cache, lengths) -> decode_step(tok, cache),
    and generate() strings them together.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta)
        init_weights(self, cfg.n_layer)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    # -- pieces --------------------------------------------------------------------------------------------------

    def embed(self, idx):  # (B, T) -> (B, T, C)
        x = self.tok_emb(idx)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.n_embd ** 0.5, dtype=x.dtype)
        return x

    def head(self, h):  # (B, T, C) -> (B, T, V), final norm included
        return self.lm_head(self.norm(h))

    def check_length(self, n: int):
        if n > self.config.max_seq_len:
            raise ValueError(f"sequence of {n} tokens exceeds max_seq_len={self.config.max_seq_len}")

    # -- training forward ----------------------------------------------------------------------------------------

    def forward(self, idx, targets=None):
        """idx (B, T) token ids -> logits (B, T, V) and, with targets (B, T), the mean next-token loss."""
        B, T = idx.shape
        self.check_length(T)
        rope = self.rope(torch.arange(T, device=idx.device))
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(x)
        return logits, (lm_loss(logits, targets) if targets is not None else None)

    # -- inference -----------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        cfg, p = self.config, self.lm_head.weight
        max_len = max_len or cfg.max_seq_len
        self.check_length(max_len)
        return KVCache(cfg.n_layer, batch, max_len, cfg.n_kv_head, cfg.hd, dtype or p.dtype, device or p.device)

    def forward_cached(self, idx, cache: KVCache, fresh: bool = False):
        """Run tokens idx (B, T) at positions cache.lengths + (0..T-1) through the stack, writing K/V.

        Returns the final hidden states (B, T, C) before the final norm. fresh=True is the prefill of an empty cache:
        attention runs causally over the new tokens (flash on GPU) instead of reading the cache back.
        """
        B, T = idx.shape
        q_pos = cache.lengths[:, None] + torch.arange(T, device=idx.device)  # (B, T)
        kv_len = T if fresh else int(cache.lengths.max()) + T
        if kv_len > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {kv_len}")
        mask = None if fresh else causal_mask_from_positions(q_pos, kv_len)
        rope = self.rope(q_pos)
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, mask=mask, cache=cache.layer(i), q_pos=q_pos)
        return x

    @torch.no_grad()
    def prefill(self, idx, cache: KVCache, lengths=None):
        """Prompts idx (B, T), right-padded, with true lengths (B,) (default T) -> logits (B, V) of each row's last
        prompt token. The cache must be empty; afterwards cache.lengths == lengths."""
        B, T = idx.shape
        lengths = torch.full((B,), T, device=idx.device) if lengths is None else lengths.to(idx.device)
        if int(lengths.min()) < 1:
            raise ValueError("every prompt needs at least one token")
        cache.reset()
        h = self.forward_cached(idx, cache, fresh=True)  # pads write K/V past each row's length: masked later
        cache.lengths.copy_(lengths)
        last = h[torch.arange(B, device=idx.device), lengths - 1]  # (B, C)
        return self.head(last[:, None])[:, 0]

    @torch.no_grad()
    def decode_step(self, tok, cache: KVCache):
        """One new token per row tok (B,) at position cache.lengths -> logits (B, V); lengths advance by one."""
        h = self.forward_cached(tok[:, None], cache)
        cache.lengths += 1
        return self.head(h)[:, 0]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0, top_k=None, generator=None):
        """idx (B, T) -> (B, T + max_new_tokens). temperature 0 is greedy (argmax)."""
        B, T = idx.shape
        self.check_length(T + max_new_tokens)
        cache = self.new_cache(B, T + max_new_tokens)
        logits = self.prefill(idx, cache)
        out = [idx]
        for i in range(max_new_tokens):
            tok = sample_next(logits, temperature, top_k, generator)
            out.append(tok[:, None])
            if i + 1 < max_new_tokens:
                logits = self.decode_step(tok, cache)
        return torch.cat(out, dim=1)

    # -- accounting ----------------------------------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; non-embedding excludes the token embedding and an untied head (Kaplan et al.)."""
        return count_params(self, (self.tok_emb, self.lm_head) if non_embedding else ())

    def kv_cache_bytes(self, batch: int, seq_len: int, dtype_bytes: int = 2) -> int:
        c = self.config
        return kv_bytes(c.n_layer, batch, seq_len, c.n_kv_head, c.hd, dtype_bytes)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """6N + 12 L H D T per trained token (PaLM, Appendix B), N = matmul parameters incl. the head; 1/3 of it for
        a forward pass alone."""
        c = self.config
        n = self.num_params(non_embedding=True) + c.n_embd * c.vocab_size
        f = 6 * n + 12 * c.n_layer * c.n_head * c.hd * seq_len
        return f if training else f / 3

    # -- pretrained checkpoints ----------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "GPT":
        """Load a local Hugging Face checkpoint directory (config.json + *.safetensors): Llama/TinyLlama/SmolLM, Gemma or
        GPT-NeoX/Pythia. See the section "Pretrained checkpoints" below (`load_hf_model`)."""
        return load_hf_model(path, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# How train.py and serve.py see an architecture


@dataclass
class ArchSpec:
    """One row of train.py's architecture table. Every architecture file exposes `ARCH_SPECS = [ArchSpec(...)]`.

    The model class takes its config and provides forward(idx, targets=None, **kw) -> (logits, loss),
    generate(idx, max_new_tokens, temperature, top_k, generator), num_params(non_embedding), kv_cache_bytes(batch,
    seq_len) and flops_per_token(seq_len). The config is a dataclass with vocab_size and max_seq_len fields and a
    from_dict classmethod.
    """

    name: str
    config_cls: type
    model_cls: type
    presets: dict
    add_args: Callable | None = None  # (argparse parser) -> None: flags of this architecture
    config_overrides: Callable | None = None  # (args) -> dict of config fields set by those flags
    convert: Callable | None = None  # (args, vanilla GPT) -> model: --init-from a vanilla checkpoint
    prepare_batch: Callable | None = None  # (x, y, generator, config) -> (x, y, forward kwargs)
    train_defaults: dict = field(default_factory=dict)  # defaults of train.py flags, e.g. {"max_iters": 200}
    kd_ok: bool = True  # False when prepare_batch re-lays the inputs out, so teacher logits would not align

    def make_config(self, preset: str, **overrides):
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for {self.name}; choose one of {sorted(self.presets)}")
        return self.config_cls(**{**self.presets[preset], **overrides})


ARCH_SPECS = [ArchSpec("vanilla", GPTConfig, GPT, PRESETS)]


# ----------------------------------------------------------------------------------------------------------------
# Pretrained checkpoints: a local Hugging Face directory -> GPT
#
# nanoGPT's `from_pretrained('gpt2')` for the three base-model families the papers convert (Gemma 2B, TinyLlama 1.1B,
# Pythia 1B). Nothing is downloaded: the directory is what `huggingface-cli download` or `save_pretrained` leaves on
# disk, config.json plus model.safetensors (or the shards listed in model.safetensors.index.json). Three steps:
#   1. config.json -> GPTConfig (`hf_config_to_gpt`). Every family is a handful of switches on GPTConfig; anything the
#      blocks above cannot reproduce exactly (rope scaling, another activation, Gemma 2, ...) is a ValueError that
#      names it, never a silently different model;
#   2. a plan (`hf_tensor_plan`): every tensor the checkpoint must hold, its shape, and where it goes in GPT's state
#      dict. Only GPT-NeoX needs a real conversion: its fused query_key_value interleaves [q, k, v] per head;
#   3. the safetensors are checked against the plan (a missing, unknown or misshapen tensor is a ValueError naming
#      the tensor and its file) and loaded one tensor at a time into a GPT built on the meta device, so the weights
#      are held once. The rotary tables are computed, never read. The "rotate half" RoPE layout of the blocks above
#      is the one of Llama/NeoX in transformers, so q_proj/k_proj load without a permutation.
# The model remembers which tokenizer it needs: `model.tokenizer_spec = {"kind": "hf", "path": DIR}` (train.py
# tokenizes with DIR/tokenizer.json through the optional `tokenizers` package).

HF_FAMILIES = ("llama", "gemma", "gpt_neox")
_REQUIRED = object()


def _hf_get(hf: dict, key: str, default=_REQUIRED, where="config.json"):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is _REQUIRED:
        raise ValueError(f"{where} has no {key!r}")
    return default


def _hf_rope(hf: dict, where: str, neox: bool) -> tuple[float, float]:
    """-> (rope_theta, rotary fraction). transformers < 5 writes rope_theta + rope_scaling (NeoX: rotary_emb_base +
    rotary_pct); transformers 5 writes one `rope_parameters` dict. Only plain RoPE is supported: scaled variants
    (linear, dynamic, yarn, llama3, longrope) change the frequencies and are refused."""
    rp = hf.get("rope_parameters") or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters {rp!r} are not supported")
    scaling = hf.get("rope_scaling") or {}
    for src in (rp, scaling):
        kind = src.get("rope_type", src.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: rope type {kind!r} (RoPE scaling) is not supported; only the default RoPE is")
    theta = rp.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    # transformers' Llama and Gemma rotate the whole head whatever partial_rotary_factor says; NeoX reads it
    # (default 0.25, Pythia's value)
    pct = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))) if neox else 1.0
    return float(theta), float(pct)


def hf_config_to_gpt(hf: dict, where: str = "config.json") -> tuple[str, GPTConfig]:
    """A Hugging Face config.json (as a dict) -> (family, GPTConfig). Defaults of absent optional keys are those of
    transformers' config classes; the sizes must be present."""
    family = hf.get("model_type")
    if family not in HF_FAMILIES:
        hint = " (Gemma 2/3 add logit soft-capping, sliding-window layers and extra norms)" \
            if str(family).startswith("gemma") else ""
        raise ValueError(f"{where}: model_type {family!r} is not supported{hint}; supported: {', '.join(HF_FAMILIES)}")
    if hf.get("quantization_config"):
        raise ValueError(f"{where}: quantized checkpoints ({hf['quantization_config'].get('quant_method', '?')}) "
                         f"are not supported; use the unquantized weights")
    get = lambda key, default=_REQUIRED: _hf_get(hf, key, default, where)  # noqa: E731
    d, n_head = get("hidden_size"), get("num_attention_heads")
    common = dict(n_layer=get("num_hidden_layers"), n_head=n_head, n_embd=d, mlp_hidden=get("intermediate_size"),
                  vocab_size=get("vocab_size"))
    theta, pct = _hf_rope(hf, where, neox=family == "gpt_neox")
    if family == "gpt_neox":
        act = get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{where}: GPT-NeoX hidden_act {act!r} is not supported; only 'gelu' (exact, Pythia)")
        cfg = dict(common, n_kv_head=n_head, max_seq_len=get("max_position_embeddings", 2048), rope_theta=theta,
                   rotary_pct=pct, norm="layer", norm_eps=float(get("layer_norm_eps", 1e-5)), mlp="gelu",
                   tie_embeddings=bool(get("tie_word_embeddings", False)),
                   parallel_residual=bool(get("use_parallel_residual", True)),
                   attn_bias=bool(get("attention_bias", True)), mlp_bias=True)
    else:
        head_dim = get("head_dim", 256 if family == "gemma" else d // n_head)
        if family == "llama":
            act = get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"{where}: Llama hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
            extra = dict(mlp="swiglu", tie_embeddings=bool(get("tie_word_embeddings", False)),
                         max_seq_len=get("max_position_embeddings", 2048), mlp_bias=bool(get("mlp_bias", False)))
        else:  # gemma: GeGLU, RMSNorm scale (1 + w), embeddings * sqrt(d)
            act = hf.get("hidden_activation") or get("hidden_act", "gelu_pytorch_tanh")
            if act not in ("gelu", "gelu_pytorch_tanh"):  # transformers reads Gemma's legacy 'gelu' as tanh-GELU
                raise ValueError(f"{where}: Gemma activation {act!r} is not supported; only 'gelu_pytorch_tanh'")
            if hf.get("use_bidirectional_attention"):
                raise ValueError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported")
            extra = dict(mlp="geglu", norm_offset=1.0, embed_scale=True,
                         tie_embeddings=bool(get("tie_word_embeddings", True)),
                         max_seq_len=get("max_position_embeddings", 8192))
        cfg = dict(common, **extra, n_kv_head=get("num_key_value_heads", n_head),
                   head_dim=None if head_dim * n_head == d else head_dim, rope_theta=theta, norm="rms",
                   norm_eps=float(get("rms_norm_eps", 1e-6)), attn_bias=bool(get("attention_bias", False)))
    try:
        return family, GPTConfig(**cfg)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _split_neox_qkv(t: torch.Tensor, prefix: str, kind: str, n_head: int, hd: int) -> dict:
    """NeoX's query_key_value (3 H D, ...) stacks, per head, [q_h, k_h, v_h] (D rows each), not [q, k, v]."""
    q, k, v = t.view(n_head, 3 * hd, *t.shape[1:]).split(hd, dim=1)  # each (H, D, ...)
    return {f"{prefix}{name}_proj.{kind}": x.reshape(n_head * hd, *t.shape[1:]) for name, x in zip("qkv", (q, k, v))}


def hf_tensor_plan(family: str, c: GPTConfig) -> dict[str, tuple[tuple, Callable]]:
    """Every tensor the checkpoint must hold: HF name -> (shape, fn(tensor) -> {GPT state-dict name: tensor})."""
    d, hd, H, Hkv, m, V = c.n_embd, c.hd, c.n_head, c.n_kv_head, c.mlp_hidden, c.vocab_size
    plan = {}

    def put(name, shape, ours):
        plan[name] = (tuple(shape), lambda t: {ours: t})

    def linear(name, n_out, n_in, ours, bias):
        put(f"{name}.weight", (n_out, n_in), f"{ours}.weight")
        if bias:
            put(f"{name}.bias", (n_out,), f"{ours}.bias")

    def norm(name, ours):
        put(f"{name}.weight", (d,), f"{ours}.weight")
        if c.norm == "layer":  # LayerNorm has a bias
            put(f"{name}.bias", (d,), f"{ours}.bias")

    if family == "gpt_neox":
        put("gpt_neox.embed_in.weight", (V, d), "tok_emb.weight")
        norm("gpt_neox.final_layer_norm", "norm")
        head = "embed_out.weight"
        for i in range(c.n_layer):
            s, o = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            norm(s + "input_layernorm", o + "attn_norm")
            norm(s + "post_attention_layernorm", o + "mlp_norm")
            for kind, shape in [("weight", (3 * H * hd, d))] + ([("bias", (3 * H * hd,))] if c.attn_bias else []):
                plan[f"{s}attention.query_key_value.{kind}"] = (
                    shape, lambda t, o=o, kind=kind: _split_neox_qkv(t, o + "attn.", kind, H, hd))
            linear(s + "attention.dense", d, H * hd, o + "attn.o_proj", c.attn_bias)
            linear(s + "mlp.dense_h_to_4h", m, d, o + "mlp.up_proj", c.mlp_bias)
            linear(s + "mlp.dense_4h_to_h", d, m, o + "mlp.down_proj", c.mlp_bias)
    else:  # llama, gemma
        put("model.embed_tokens.weight", (V, d), "tok_emb.weight")
        norm("model.norm", "norm")
        head = "lm_head.weight"
        for i in range(c.n_layer):
            s, o = f"model.layers.{i}.", f"blocks.{i}."
            norm(s + "input_layernorm", o + "attn_norm")
            norm(s + "post_attention_layernorm", o + "mlp_norm")
            for name, n_out in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                linear(f"{s}self_attn.{name}_proj", n_out, d, f"{o}attn.{name}_proj", c.attn_bias)
            linear(s + "self_attn.o_proj", d, H * hd, o + "attn.o_proj", c.attn_bias)
            linear(s + "mlp.gate_proj", m, d, o + "mlp.gate_proj", c.mlp_bias)
            linear(s + "mlp.up_proj", m, d, o + "mlp.up_proj", c.mlp_bias)
            linear(s + "mlp.down_proj", d, m, o + "mlp.down_proj", c.mlp_bias)
    if not c.tie_embeddings:
        put(head, (V, d), "lm_head.weight")
    return plan


# Non-weights that older checkpoints carry: rotary tables and NeoX's causal-mask buffers. Skipped.
_HF_IGNORED = (".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
# Another name a checkpoint may give a tensor (transformers 5 loads NeoX's embed_out into lm_head)
_HF_ALIASES = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}


def hf_weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards of model.safetensors.index.json (each must
    exist), else model.safetensors, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{index} lists shard(s) {missing} that are missing from {path}")
        return [path / f for f in files]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = (f" (it holds {bins}: re-save them as safetensors, e.g. with transformers: "
                f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR))") if bins else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    return files


def load_hf_model(path, dtype=torch.float32, device="cpu") -> "GPT":
    """Load a local Hugging Face checkpoint (llama, gemma or gpt_neox) into GPT; see the section comment above."""
    path = Path(str(path)[3:] if str(path).startswith("hf:") else path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: a Hugging Face checkpoint is a directory with config.json and "
                         f"*.safetensors")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("loading a Hugging Face checkpoint needs the package `safetensors`: "
                          "pip install safetensors") from e
    hf = json.loads((path / "config.json").read_text())
    family, cfg = hf_config_to_gpt(hf, where=str(path / "config.json"))
    plan = hf_tensor_plan(family, cfg)
    aliases = _HF_ALIASES.get(family, {})

    # where each tensor lives, checked against the plan before anything is read
    handles, where = {}, {}
    for f in hf_weight_files(path):
        handles[f] = safe_open(str(f), framework="pt", device="cpu")
        for key in handles[f].keys():
            name = aliases.get(key, key)
            if name in where:
                raise ValueError(f"tensor {key!r} is in both {where[name][0].name} and {f.name}")
            where[name] = (f, key)
    tied_head = "lm_head.weight" if family != "gpt_neox" else "embed_out.weight"
    unknown = sorted(n for n in where if n not in plan and not n.endswith(_HF_IGNORED)
                     and not (cfg.tie_embeddings and n == tied_head))
    if unknown:
        raise ValueError(f"{path}: unknown tensor(s) for a {family} model: "
                         + ", ".join(f"{n} ({where[n][0].name})" for n in unknown[:8])
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    missing = [n for n in plan if n not in where]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) " + ", ".join(missing[:8])
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for name, (shape, _) in plan.items():
        f, key = where[name]
        got = tuple(handles[f].get_slice(key).get_shape())
        if got != shape:
            raise ValueError(f"tensor {key} in {f.name} has shape {got}, but config.json implies {shape}")

    with torch.device("meta"):  # no memory, no random init: every parameter is assigned below
        model = GPT(cfg)
    sd = {}
    for name, (_, fn) in plan.items():
        f, key = where[name]
        sd.update(fn(handles[f].get_tensor(key).to(device=device, dtype=dtype)))
    if cfg.tie_embeddings and tied_head in where:  # a tied checkpoint that stores its head too: it must be the same
        f, key = where[tied_head]
        if not torch.equal(handles[f].get_tensor(key).to(device=device, dtype=dtype), sd["tok_emb.weight"]):
            raise ValueError(f"config.json says tie_word_embeddings, but {key} in {f.name} differs from the embedding")
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(sd) == expected, f"plan and model disagree: {sorted(set(sd) ^ expected)}"
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta).to(device)  # fp32 tables
    model.tokenizer_spec = {"kind": "hf", "path": str(path.resolve())}
    return model


def hf_tokenizer(path):
    """-> (tokenizers.Tokenizer of DIR/tokenizer.json, end-of-text id). `tokenizers` is an optional dependency.

    The end-of-text id is config.json's eos_token_id (the first one, if a list), else generation_config.json's, else
    the id of tokenizer_config.json's eos_token.
    """
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:
        raise ImportError("tokenizing with a Hugging Face tokenizer.json needs the optional package `tokenizers`: "
                          "pip install tokenizers") from e
    path = Path(path)
    f = path / "tokenizer.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: the checkpoint directory has no tokenizer.json (a tokenizer.model "
                                f"alone is not supported; save the fast tokenizer with transformers)")
    tok = HFTokenizer.from_file(str(f))
    eos = None
    for name in ("config.json", "generation_config.json"):
        if eos is None and (path / name).is_file():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None and (path / "tokenizer_config.json").is_file():
        t = json.loads((path / "tokenizer_config.json").read_text()).get("eos_token")
        eos = tok.token_to_id(t.get("content") if isinstance(t, dict) else t) if t else None
    if eos is None:
        raise ValueError(f"{path}: no eos_token_id in config.json, generation_config.json or tokenizer_config.json; "
                         f"it is needed to separate documents")
    return tok, int(eos)


def hf_main(args):
    """python model.py --hf DIR --prompt "...": load a checkpoint and print a greedy continuation (a sanity check)."""
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    model = GPT.from_pretrained(args.hf, dtype=dtype, device=device).eval()
    tok, eos = hf_tokenizer(model.tokenizer_spec["path"])
    c = model.config
    print(f"{args.hf}: {c.n_layer} layers, d {c.n_embd}, heads {c.n_head}/{c.n_kv_head}, vocab {c.vocab_size}, "
          f"{model.num_params(False) / 1e6:.1f}M parameters | {device} {dtype}")
    ids = tok.encode(args.prompt).ids  # with the tokenizer's special tokens (Llama/Gemma: BOS), as transformers does
    n = min(args.max_new_tokens, c.max_seq_len - len(ids))
    out = model.generate(torch.tensor([ids], device=device), n)[0].tolist()
    new = out[len(ids):]
    if eos in new:
        new = new[:new.index(eos)]
    print(tok.decode(ids + new, skip_special_tokens=True))


# ----------------------------------------------------------------------------------------------------------------


def _describe(name: str, cfg: GPTConfig):
    with torch.device("meta"):
        m = GPT(cfg)
    print(f"{name:16s} layers {cfg.n_layer:3d}  d {cfg.n_embd:5d}  heads {cfg.n_head:3d}/{cfg.n_kv_head:<3d}  "
          f"non-emb params {m.num_params() / 1e6:8.2f}M  total {m.num_params(False) / 1e6:8.2f}M  "
          f"KV bytes/token {m.kv_cache_bytes(1, 1) / 1024:7.1f} KiB (bf16)  "
          f"train GFLOP/token @T={cfg.max_seq_len} {m.flops_per_token(cfg.max_seq_len) / 1e9:6.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default=None, help="print one preset (default: all)")
    ap.add_argument("--hf", default=None, help="local Hugging Face checkpoint directory to load and run")
    ap.add_argument("--prompt", default="The capital of France is", help="prompt for --hf")
    ap.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate for --hf")
    ap.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto")
    args = ap.parse_args()
    if args.hf:
        hf_main(args)
        return
    for name in [args.preset] if args.preset else PRESETS:
        _describe(name, GPTConfig.from_preset(name))


if __name__ == "__main__":
    main()
