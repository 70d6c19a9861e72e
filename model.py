"""
model.py -- the vanilla decoder-only transformer and the building blocks every other file imports.

A Llama/Gemma-style decoder, written to be read top to bottom:

    RMSNorm / LayerNorm -> rotary embedding from explicit positions -> GQA attention through
    scaled_dot_product_attention (explicit mask, optional pre-allocated KV cache) -> gated MLP
    (SwiGLU or GeGLU) -> Block -> KVCache (kv_len: the keys a cached step reads, and the one overflow error) ->
    run_cached (the one cached layer stack) -> GPT (forward, new_cache, prefill, decode_step, generate).

After the model: sampling, the losses, the architecture table's row (ArchSpec), parameter counting and the
initialisation. A decode step recorded as one CUDA graph on static caches is graphs.py's (graphs.compile_decode);
what measures, estimates memory and picks devices is the harness's (harness/memory.py, harness/device.py).

`linear` and `attend` are plain PyTorch (F.linear; SDPA with GQA) with one hook, `tuned_ops`: cpu_tuning.py puts the
forms of the same math measured fastest on a CPU there when a command switches it on (bench.py, serve.py); nothing
in this file times anything or chooses by machine.

The other architectures of this repository (recursive.py, block_transformer.py, plt.py, double_decoder.py) do not
re-write any of this math. They import `Block`, `Attention`, `MLP`, `RMSNorm`, `RotaryEmbedding`, `KVCache`,
`run_cached`, `attend` and `sample_next`, subclass `GPT` for its embedding, head, cache constructor (`new_cache`
builds the class they name in `cache_cls`) and generate loop, and pass what is special about them as arguments:
RoPE positions that are block indices or offsets, a LoRA index per row (`lora_idx`, used by svd_lora.py), an
explicit attention mask, a cache layer.

Switches on `GPTConfig` also cover the three pretrained families of the papers (Llama/TinyLlama, Gemma, GPT-NeoX/
Pythia), so that hf.py can load a local Hugging Face checkpoint into GPT:
  * norm='rms' | 'layer' (LayerNorm with bias, NeoX), norm_offset=1.0 for Gemma's (1 + w) scale;
  * mlp='swiglu' | 'geglu' (tanh GELU, Gemma) | 'gelu' (plain 4x MLP, NeoX);
  * embed_scale (Gemma multiplies embeddings by sqrt(d)); head_dim different from n_embd / n_head;
  * parallel_residual (NeoX: x + attn(ln1 x) + mlp(ln2 x)), rotary_pct (partial rotary), attn_bias / mlp_bias.

Conventions (shared by every file):
  * tensors are (B, T, C) for activations, (B, H, T, D) for heads; a KV cache stores (B, H_kv, S, D);
  * a cache index equals the absolute position, so the causal mask of a cached step is `key_pos <= query_pos`;
  * targets equal to IGNORE (-100) carry no loss.

Run:
    python bench.py presets --arch vanilla   # the presets: parameters, KV bytes, FLOPs per token
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100  # target id that carries no loss (pads, prompt tokens of a prefix-LM, ...)


# ----------------------------------------------------------------------------------------------------------------
# Config


def check(ok: bool, msg: str, what: str = "config", field: str | None = None):
    """The one validation helper of every config and argument check: ValueError("bad <what>: <msg>") unless ok. The
    error carries the config field it is about (`.field`, or None), so that a loader can name the key of its own file
    that holds it (a GGUF file's llama.rope.freq_base for rope_theta)."""
    if not ok:
        e = ValueError(f"bad {what}: {msg}")
        e.field = field
        raise e


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

    def need(self, ok: bool, msg: str, field: str | None = None):
        """A failed check of this config: ValueError("bad <ConfigClass>: msg"), naming `field` (check's `.field`)."""
        check(ok, msg, type(self).__name__, field)

    def validate(self):
        """Every field's type and range, whatever wrote the config (a preset, flags, a checkpoint, a GGUF file's
        metadata, a config.json): the counts are ints >= 1 (never a float or a bool) that divide as attention needs,
        rope_theta and norm_eps finite and > 0, the switches bools. A failure names the field (check's `.field`)."""
        need = partial(check, what="GPTConfig")  # the shape fields: "bad GPTConfig" in every subclass too
        is_int, is_num = self.is_int, self.is_number
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            need(is_int(v) and v >= 1, f"{name}={v!r} must be a positive int", field=name)
        need(self.head_dim is None or (is_int(self.head_dim) and self.head_dim >= 1),
             f"head_dim={self.head_dim!r} must be None or a positive int", field="head_dim")
        need(self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}",
             field="n_kv_head")
        if self.head_dim is None:
            need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}",
                 field="n_head")
        need(self.hd % 2 == 0, f"head_dim={self.hd} must be even for rotary embeddings", field="head_dim")
        for name in ("rope_theta", "norm_eps"):  # NaN, 0, a negative or an infinite base or epsilon: garbage out
            v = getattr(self, name)
            need(is_num(v) and v > 0, f"{name}={v!r} must be a finite number > 0", field=name)
        need(is_num(self.rotary_pct) and 0.0 < self.rotary_pct <= 1.0,
             f"rotary_pct={self.rotary_pct!r} must be in (0, 1]", field="rotary_pct")
        need(self.rot_dim % 2 == 0, f"rotary dims {self.rot_dim} (head_dim * rotary_pct) must be even",
             field="rotary_pct")
        need(is_num(self.norm_offset), f"norm_offset={self.norm_offset!r} must be a finite number", field="norm_offset")
        need(self.norm in ("rms", "layer"), f"norm={self.norm!r} is not 'rms' or 'layer'", field="norm")
        need(self.mlp in ("swiglu", "geglu", "gelu"), f"mlp={self.mlp!r} is not 'swiglu', 'geglu' or 'gelu'",
             field="mlp")
        for name in ("tie_embeddings", "embed_scale", "parallel_residual", "attn_bias", "mlp_bias"):
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be true or false",
                 field=name)

    @staticmethod
    def is_int(v) -> bool:
        """A count of a config: an int, never a bool (True is an int to Python) or a float."""
        return isinstance(v, int) and not isinstance(v, bool)

    @staticmethod
    def is_number(v) -> bool:
        """A finite int or float, never a bool."""
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

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
# Norms


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w), computed in fp32 and cast back. offset=1 is Gemma's convention."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x):  # x * rsqrt(mean(x^2) + eps) * (offset + w), in one fused call
        w = self.weight.float() if self.offset == 0 else self.offset + self.weight.float()
        return F.rms_norm(x.float(), (x.size(-1),), w, self.eps).to(x.dtype)


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


# The one hook of this file. None: `linear` and `attend` below are plain PyTorch. cpu_tuning.enable() puts an object
# here whose linear(x, weight, bias) and attend(q, k, v, mask, is_causal, scale) compute the same math in the forms
# measured fastest on this CPU (bench.py's inference benchmarks and serve.py switch it on; train.py does not).
tuned_ops = None


def linear(x, weight, bias=None):
    """x W^T + b (F.linear): every projection and head of every model goes through here (see `tuned_ops` above)."""
    if tuned_ops is not None:
        return tuned_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward takes an optional `lora_idx` and ignores it, through `linear` above.

    Every projection in Attention and MLP is one of these (and the heads), so svd_lora.py can swap in a `LoRALinear`
    subclass that adds a per-loop (or per-row) low-rank delta without any change to the attention or MLP code.
    `lora_idx` is None, an int (one loop for the whole batch) or a LongTensor (B,) with one loop per row.
    """

    def forward(self, x, lora_idx=None):
        return linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------------------------------------------
# Attention


def attend(q, k, v, mask=None, is_causal=False, scale=None):
    """Scaled dot-product attention with GQA: q (B, H, T, D), k/v (B, H_kv, S, D) -> (B, H, T, D).

    `mask` is a bool tensor broadcastable to (B, H, T, S), True = may attend. With no mask and is_causal=True this
    is the flash path on GPU. H must be a multiple of H_kv; the KV heads are shared without being copied: SDPA's own
    GQA (enable_gqa) runs in its flash and math kernels only, and on CUDA a mask rules flash out and the math kernel
    copies K/V per query head, so a masked step there (decode, a prefill chunk) attends in the stacked form
    (attend_stacked). Attention.forward and the architectures that reuse it attend through here (see `tuned_ops`).
    """
    if tuned_ops is not None:
        return tuned_ops.attend(q, k, v, mask, is_causal, scale)
    if q.is_cuda and q.size(1) != k.size(1) and mask is not None and mask.dim() == 4 and mask.size(1) == 1:
        return attend_stacked(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
                                          enable_gqa=q.size(1) != k.size(1))


def attend_stacked(q, k, v, mask, scale=None):
    """attend's math with a mask the same for every head, mask (B|1, 1, T|1, S): the G = H / H_kv query heads of a
    KV head attend as G*T queries of it, q (B, H_kv, G*T, D) in one SDPA call without GQA -- no K/V copied."""
    (B, H, T, D), Hkv = q.shape, k.size(1)
    G = H // Hkv
    if mask.size(2) > 1:  # (B|1, 1, T, S) -> (B|1, 1, G*T, S), the rows in q's (g, t) order
        mask = mask[:, :, None].expand(-1, -1, G, -1, -1).flatten(2, 3)
    return F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), k, v, attn_mask=mask, scale=scale).view(
        B, H, T, D)


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

    static=True: a decode step attends over all max_len positions (the positional mask hides the unfilled ones)
    instead of the filled prefix, so every step has the same shapes and reads no length back to the host: what
    torch.compile / CUDA graphs need (gpt-fast's static cache). The results are the same.
    """

    def __init__(self, n_layer, batch, max_len, n_kv_head, head_dim, dtype=torch.float32, device="cpu", static=False):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.all_rows = torch.arange(batch, device=device)
        self.layer_ids, self.heads = torch.arange(n_layer, device=device), torch.arange(n_kv_head, device=device)
        self.static = static
        if static:  # a recorded step writes k, v and lengths in place: they keep their addresses (graphs.mark_static)
            for t in (self.k, self.v, self.lengths):
                torch._dynamo.mark_static_address(t, guard=False)

    @property
    def batch(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def kv_len(self, q_pos: torch.Tensor | int = 1) -> int:
        """How many keys a cached step reads: all max_len for a static cache (no host sync, fixed shapes); else up
        to its last query, max(q_pos) + 1 for queries at positions q_pos (any shape), or max(lengths) + T for T new
        tokens per row at lengths + (0..T-1). Raises the overflow error (`fits`) when the cache is too short."""
        if self.static:
            return self.max_len
        n = int(q_pos.max()) + 1 if isinstance(q_pos, torch.Tensor) else int(self.lengths.max()) + q_pos
        return self.fits(n)

    def fits(self, n: int, what: str = "this step needs") -> int:
        """n positions, checked against max_len: the one overflow error of every cache of this repository."""
        if n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {what} {n}")
        return n

    def layer(self, layer, rows=None) -> "LayerCache":
        """View of one layer (an int, or a LongTensor (B,) with one layer per row) for `rows` (default: all)."""
        return LayerCache(self, layer, self.all_rows if rows is None else rows)

    def reset(self, rows=None):
        """Forget rows (all by default): their length goes to 0, their stale entries stay masked."""
        if rows is None:
            self.lengths.zero_()
        else:
            self.lengths[rows] = 0

    def copy_rows(self, src: "KVCache", src_rows, dst_rows):
        """Rows src_rows of `src` (every layer, its max_len positions, and their lengths) -> rows dst_rows of this
        cache: a prefill cache into serving slots, or one shared prefix into every row (src_rows = [0, 0, ...])."""
        S = src.max_len
        if S > self.max_len or src.k.shape[::2] != self.k.shape[::2]:  # (layers, heads, head dim) must agree
            raise ValueError(f"cannot copy cache rows of shape {tuple(src.k.shape)} into {tuple(self.k.shape)}")
        src_rows = torch.as_tensor(src_rows, device=self.k.device)
        dst_rows = torch.as_tensor(dst_rows, device=self.k.device)
        self.k[:, dst_rows, :, :S] = src.k[:, src_rows]
        self.v[:, dst_rows, :, :S] = src.v[:, src_rows]
        self.lengths[dst_rows] = src.lengths[src_rows]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class LayerCache:
    """One layer of a KVCache for a set of rows: what Attention writes to and reads from."""

    def __init__(self, cache: KVCache, layer, rows):
        self.cache, self.layer, self.rows = cache, layer, rows

    def _index(self, pos):
        """(layer, row, head, position) index tensors of these rows' entries at positions pos (B, T): indexing the
        cache with them gives (B, T, H_kv, D). Every dimension but the last is a tensor, so that a write is one
        index_put_ on the whole cache -- in place in a compiled step too, where a write through a view of one layer
        is copied back into the whole cache at every layer (torch.compile's functionalization)."""
        c = self.cache
        layer = self.layer if isinstance(self.layer, torch.Tensor) else c.layer_ids[self.layer]  # (B,) or a 0-d view
        return layer.reshape(-1, 1, 1), self.rows[:, None, None], c.heads[None, None], pos[:, :, None]

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: torch.Tensor | None = None):
        """k, v (B, H_kv, T, D) go to positions pos (B, T) of this layer of these rows. where (B,) bool: only those
        rows take the new entries, the others write back what they hold (a read, a select and a write, the same for
        every row: the graph-safe form of writing a subset of rows)."""
        idx = self._index(pos)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H_kv, D), the indexed view's layout
        if where is not None:
            keep = where[:, None, None, None]
            k, v = torch.where(keep, k, self.cache.k[idx]), torch.where(keep, v, self.cache.v[idx])
        self.cache.k.index_put_(idx, k)
        self.cache.v.index_put_(idx, v)

    def read(self, kv_len: int):
        """-> k, v (B, H_kv, kv_len, D): a view when the layer is one int and the rows are all rows, else a gather:
        one index_select over the (layer, row) pairs of the cache seen as (n_layer * batch, H_kv, max_len, D), a single
        contiguous gather along one dimension where indexing by a layer tensor and a row tensor together is a slower
        advanced-indexing copy."""
        c = self.cache
        if not isinstance(self.layer, torch.Tensor) and self.rows is c.all_rows:
            return c.k[self.layer, :, :, :kv_len], c.v[self.layer, :, :, :kv_len]
        pairs = self.layer * c.batch + self.rows  # (B,) rows of the flattened view
        return tuple(t.flatten(0, 1)[:, :, :kv_len].index_select(0, pairs) for t in (c.k, c.v))


def start_prefill(idx, cache, lengths=None) -> torch.Tensor:
    """The checks of every architecture's prefill: prompts idx (B, T), right-padded, true lengths (B,) (default T)
    in [1, T], T within the cache's positions. Empties the cache; -> lengths on idx's device."""
    B, T = idx.shape
    lengths = torch.full((B,), T, device=idx.device) if lengths is None else lengths.to(idx.device)
    if int(lengths.min()) < 1 or int(lengths.max()) > T:
        raise ValueError(f"prompt lengths must be in [1, {T}]: every prompt needs at least one token")
    cache.fits(T, "the prompts need")
    cache.reset()
    return lengths


def run_cached(blocks, rope: RotaryEmbedding, x, cache: KVCache, fresh: bool = False, layers=None, rows=None,
               q_pos=None, kv_len: int | None = None, lora_idx=None):
    """The cached layer stack: inputs x (B, T, C) at positions cache.lengths + (0..T-1) through `blocks`, each block
    writing its K/V into its cache layer (layers[i], default i) -> hidden states (B, T, C). cache.lengths is left to
    the caller. Every decoder of this repository runs its cached steps through here (GPT, the Block Transformer's two
    decoders, the double decoder's context decoder, every loop of recursive.py).

    fresh=True is the prefill of an empty cache: attention runs causally over x itself (the flash path on GPU) and
    nothing is read back. Otherwise every query attends over the cache prefix under the positional causal mask: the
    filled prefix [0, max(q_pos) + 1), or all max_len positions for a static cache (no host sync, fixed shapes);
    kv_len overrides it (a caller that runs several stacks at the same positions computes it once).
    rows (B,) and q_pos (B, T): x belongs to these cache rows, at these positions (a server's chunked prefill into
    some of its slots); default all rows, at their lengths. layers[i] may be a LongTensor (B,), one cache layer per
    row, and lora_idx[i] is block i's LoRA index (svd_lora.py: an int, or (B,) one per row; default None): rows of
    a looped model that sit at different loops.
    """
    B, T, _ = x.shape
    if q_pos is None:
        q_pos = cache.lengths[:, None] + torch.arange(T, device=x.device)  # (B, T)
    mask = None
    if not fresh:
        kv_len = cache.kv_len(q_pos) if kv_len is None else cache.fits(kv_len)
        mask = causal_mask_from_positions(q_pos, kv_len)  # (B, 1, T, kv_len)
    cos_sin = rope(q_pos)
    for i, block in enumerate(blocks):
        x = block(x, cos_sin, lora_idx=None if lora_idx is None else lora_idx[i], mask=mask,
                  cache=cache.layer(i if layers is None else layers[i], rows), q_pos=q_pos)
    return x


def kv_bytes(n_layer, batch, seq_len, n_kv_head, head_dim, dtype_bytes=2) -> int:
    """Bytes of keys plus values for n_layer layers of full attention."""
    return 2 * n_layer * batch * seq_len * n_kv_head * head_dim * dtype_bytes


# ----------------------------------------------------------------------------------------------------------------
# The vanilla decoder


class GPT(nn.Module):
    """Decoder-only language model.

    forward(idx, targets=None) -> (logits, loss), nanoGPT's convention.
    Inference is explicit: new_cache(batch, max_len) -> prefill(idx, cache, lengths) -> decode_step(tok, cache),
    and generate() strings them together.
    """

    def __init__(self, cfg: GPTConfig, stacks: dict[str, nn.Module] | None = None):
        """stacks: what sits between the embedding and the final norm, by attribute name, registered in that order
        (the state_dict's order); default one stack, `blocks` = make_blocks(cfg). A model with other stacks passes
        them (double_decoder.py: a context and a generation decoder)."""
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        for name, module in (stacks if stacks is not None else {"blocks": self.make_blocks(cfg)}).items():
            setattr(self, name, module)
        self.norm = make_norm(cfg)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta)
        init_weights(self, cfg.n_layer)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def make_blocks(self, cfg) -> nn.ModuleList:
        """The layer stack (a subclass with other layers -- shared, LoRA, another attention -- overrides this)."""
        return nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))

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

    cache_cls = KVCache  # what new_cache builds; an architecture with another cache names its class here
    static_cache = False  # new caches are static (fixed shapes for a recorded step): set by graphs.compile_decode
    graph_caches = None  # set by graphs.compile_decode: the static generation caches, one per batch bucket

    def new_cache(self, batch: int, max_len: int | None = None, *args, dtype=None, device=None, static=None,
                  **kwargs):
        """The one cache constructor of every architecture: cache_cls(batch, max_len, dtype, device, static, **the
        cache's own arguments from cache_kwargs(*args, **kwargs)). max_len positions (default max_seq_len), the
        model's dtype and device by default; static (default: static_cache) attends over all max_len positions at
        every step (see KVCache); a cache that cannot be static refuses it."""
        p = self.lm_head.weight
        max_len = self.config.max_seq_len if max_len is None else max_len
        self.check_length(max_len)
        return self.cache_cls(batch=batch, max_len=max_len, dtype=dtype or p.dtype, device=device or p.device,
                              static=self.static_cache if static is None else static,
                              **self.cache_kwargs(*args, **kwargs))

    def cache_kwargs(self) -> dict:
        """What cache_cls takes besides batch, max_len, dtype, device and static: a KVCache's layers and heads."""
        c = self.config
        return dict(n_layer=c.n_layer, n_kv_head=c.n_kv_head, head_dim=c.hd)

    def forward_cached(self, idx, cache: KVCache, fresh: bool = False):
        """Tokens idx (B, T) at positions cache.lengths + (0..T-1) -> final hidden states (B, T, C), before the final
        norm; K/V written (run_cached). fresh=True: the prefill of an empty cache."""
        return run_cached(self.blocks, self.rope, self.embed(idx), cache, fresh)

    @torch.no_grad()
    def prefill_chunk(self, idx, q_pos, cache: KVCache, rows, first: bool = False):
        """One chunk of some rows' prompts (a server's chunked prefill): tokens idx (b, T), right-padded, at positions
        q_pos (b, T) of cache rows `rows` (b,), attending to the rows' earlier chunks through the cache -> hidden
        states (b, T, C) before the final norm; K/V written, cache.lengths untouched. first=True: every row's first
        chunk (positions 0..T-1): causal attention over the chunk itself, nothing read back (the prefill's path)."""
        return run_cached(self.blocks, self.rope, self.embed(idx), cache, first, rows=rows, q_pos=q_pos)

    @torch.no_grad()
    def prefill(self, idx, cache: KVCache, lengths=None):
        """Prompts idx (B, T), right-padded, with true lengths (B,) (default T) -> logits (B, V) of each row's last
        prompt token. The cache must be empty; afterwards cache.lengths == lengths."""
        B = idx.size(0)
        lengths = start_prefill(idx, cache, lengths)
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

    # The graph-safe steps graphs.compile_decode records: decode_step here; an architecture whose decode step chooses
    # between a few step kinds on the host (from step counts the host knows) names those kinds instead, and one whose
    # eager decode_step is not graph-safe names in graph_decode the method that decodes through them once recorded.
    graph_steps = ("decode_step",)
    graph_decode = "decode_step"

    def cache_size(self, prompt_len: int, max_new_tokens: int, **step_kwargs) -> tuple[int, dict]:
        """The positions a generation's cache needs and new_cache's other arguments (an architecture whose cache is
        sized otherwise overrides this, and cache_covers with it)."""
        return prompt_len + max_new_tokens, {}

    def cache_covers(self, have: dict, want: dict) -> bool:
        """Whether a cache built with cache_size's arguments `have` serves a generation that needs `want`."""
        return have == want

    def generation_cache(self, batch: int, prompt_len: int, max_new_tokens: int, **step_kwargs):
        """The cache generate() allocates, sized by cache_size: a new one, or after graphs.compile_decode the static
        cache of the batch's bucket (graph_caches), which may hold more rows than the batch."""
        need, kwargs = self.cache_size(prompt_len, max_new_tokens, **step_kwargs)
        if self.graph_caches is not None:
            return self.graph_caches.get_cache(batch, need, kwargs)
        return self.new_cache(batch, need, **kwargs)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0, top_k=None, generator=None, cache=None,
                 greedy_first: int = 0, **step_kwargs):
        """idx (B, T) -> (B, T + max_new_tokens): prefill, then one decode_step per new token. temperature 0 is
        greedy (argmax); else sampled with `generator`, after `greedy_first` argmax tokens (LLM-QAT's data from the
        model itself, Liu et al., arXiv:2305.17888: a greedy start, then sampling). The one generate loop of this
        repository: every architecture names its cache (cache_cls, sized by generation_cache) and overrides prefill
        and decode_step, and `step_kwargs` reach every decode_step (e.g. recursive.py's exit_threshold,
        double_decoder.py's rollover).
        `cache`: a cache to use instead of a new one (e.g. one holding a shared prefix)."""
        B, T = idx.shape
        self.check_length(T + max_new_tokens)
        if max_new_tokens <= 0:
            return idx
        if cache is None:
            cache = self.generation_cache(B, T, max_new_tokens, **step_kwargs)
        pad = max(cache.batch - B, 0)  # a batch bucket's cache (graphs.py): the padding rows decode along, unread
        logits = self.prefill(torch.cat([idx, idx.new_zeros(pad, T)]) if pad else idx, cache)
        out = [idx]
        for i in range(max_new_tokens):
            tok = sample_next(logits[:B], temperature if i >= greedy_first else 0.0, top_k, generator)
            out.append(tok[:, None])
            if i + 1 < max_new_tokens:
                if self.static_cache:  # compiled steps: each one a new CUDA-graph iteration, so a replay may
                    torch.compiler.cudagraph_mark_step_begin()  # overwrite the last step's (sampled) outputs
                logits = self.decode_step(torch.cat([tok, tok.new_zeros(pad)]) if pad else tok, cache, **step_kwargs)
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


@torch.no_grad()
def windows_loss(model, x, y, batch_size: int, device, wrap=lambda batches: batches) -> float:
    """Mean next-token cross-entropy of `model` (as it is: its dtype, no autocast) over windows x, y (N, T), in fp32
    over the full logits, `batch_size` windows per forward pass: the loss of the fixed evaluation set (`python eval.py
    loss`, train.py --curve-at). Each token's loss is added in float64, so the mean does not depend on how the windows
    are batched (a float32 sum per batch rounds differently for 2 x 4 windows than for 1 x 8). `wrap` wraps the batch
    starts (a progress bar)."""
    total = 0.0
    for i in wrap(range(0, len(x), batch_size)):
        logits = model(x[i:i + batch_size].to(device))[0].float()
        losses = F.cross_entropy(logits.flatten(0, 1), y[i:i + batch_size].to(device).flatten(), reduction="none")
        total += losses.double().sum().item()
    return total / y.numel()


def make_optimizer(model, lr, weight_decay, device):
    """AdamW; weight decay on matrices only; torch's fused kernel on CPU and CUDA (one pass over each tensor for the
    whole update; the plain per-tensor loop elsewhere). Same update to rounding (tests/test_train.py). Shared by
    train.py and bench.py's training benchmarks.

    A parameter with an `lr_scale` attribute (double_decoder.py's context decoder) gets a group of its own that
    trains at lr x lr_scale (the schedule multiplies it in: group["lr_scale"]); its weight decay is divided by the
    same factor, so the decay per step (lr x weight decay) stays that of every other matrix."""
    groups = {}
    for p in model.parameters():
        if p.requires_grad:
            s = getattr(p, "lr_scale", 1.0)
            groups.setdefault((p.dim() >= 2, s), []).append(p)
    groups = [{"params": ps, "lr_scale": s, "lr": lr * s, "weight_decay": weight_decay / s if decay else 0.0}
              for (decay, s), ps in groups.items()]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type in ("cpu", "cuda"))


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
    config_overrides: Callable | None = None  # (args, tok=None) -> config fields set by the flags (tok: train.py's)
    prepare_batch: Callable | None = None  # (x, y, generator, config) -> (x, y, forward kwargs)
    train_defaults: dict = field(default_factory=dict)  # defaults of train.py flags, e.g. {"max_iters": 200}
    kd_ok: bool = True  # False when prepare_batch re-lays the inputs out, so teacher logits would not align
    # (preset, options) -> [(label, model, baseline or None)], built on the meta device: the rows `python bench.py
    # presets` prints for this architecture (options: that command's parsed flags). None: one row, no baseline.
    preset_rows: Callable | None = None
    # (config, layers) -> the parameters of what sits between the embedding and the final norm, from the config alone
    # (the memory estimate made before a model is built, harness/memory.py), with layers(n, d, heads, kv_heads,
    # head_dim, mlp_hidden, loops=1, ranks=None) the parameters of n standard layers (sizes default to the config's).
    # None: config.n_layer standard layers.
    stack_params: Callable | None = None
    stack_passes: Callable | None = None  # (config) -> how often one forward runs its layers (loops); None: once

    def make_config(self, preset: str, **overrides):
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for {self.name}; choose one of {sorted(self.presets)}")
        return self.config_cls(**{**self.presets[preset], **overrides})

    def table(self, preset: str, options=None) -> list[tuple[str, nn.Module, nn.Module | None]]:
        """The preset's rows for `describe` (meta device: nothing is allocated)."""
        if self.preset_rows is not None:
            return self.preset_rows(preset, options)
        with torch.device("meta"):
            return [(preset, self.model_cls(self.make_config(preset)), None)]


ARCH_SPECS = [ArchSpec("vanilla", GPTConfig, GPT, PRESETS)]


# ----------------------------------------------------------------------------------------------------------------
# Parameter counting and initialisation (shared by every model in this repository)


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
