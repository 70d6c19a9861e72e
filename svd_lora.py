"""
svd_lora.py -- layer-wise LoRA for the Relaxed Recursive Transformer and its truncated-SVD initialisation.

Paper: "Relaxed Recursive Transformers: Effective Parameter Sharing with Layer-wise LoRA" (Bae et al.,
arXiv:2410.20672), section 2.3, eq. 3-5, Appendix C, Table G.1.

A Recursive Transformer (recursive.py) loops one block of K shared layers B times. The Relaxed variant gives every
shared linear layer one small LoRA per loop, so loop l computes

    h = W' x + B_l A_l x                                    (eq. 3; A_l (r, in), B_l (out, r); scale exactly 1)

and all parameters train, the shared W' included. What this file provides:

  * `LoRALinear`: a `model.Linear` holding the shared W' plus the stacked per-loop A (n_loops, r, in) and
    B (n_loops, out, r). Its forward takes `lora_idx` = None (no LoRA), an int (the whole batch sits at one loop:
    two plain matmuls) or a LongTensor (B,) with one loop per row, broadcast over the row's T tokens (continuous
    depth-wise batching, section 2.4), or (B, T) with one loop per token; -1 = no adapter. The per-row form runs
    `kernels.multi_lora`: the Triton BGMV kernel on CUDA at inference, the gather + bmm reference on CPU or when
    training; never a Python loop over rows.
  * `add_lora(block, ...)`: swaps the q, k, v, o, gate, up, down projections of a `model.Block` for LoRALinear,
    with a rank per component (q, kv, o, mlp) as in Table G.1; rank 0 leaves a component without LoRA.
  * `init_lora(shared_block, source_blocks, mode)`: the initialisation of eq. 4. For loop l the residual between
    the vanilla layer it stands for and the shared layer is factorised by a truncated SVD,

        U_r, S_r, V_r = TruncatedSVD(W_l - W', r),     B_l = U_r S_r,   A_l = V_r^T,

    so at full rank the relaxed model reproduces the vanilla model exactly (eq. 5). Where the residual is exactly
    zero (loop 1 of Stepwise or Lower: the shared layer *is* that vanilla layer) the standard LoRA init is used
    instead: A Gaussian, B zero (Appendix C). mode='zero' forces the standard init everywhere.

Eq. 4 on the *effective* linear map. The paper ties the norms too, so the input a shared projection sees is normed
with the shared scale s', while the vanilla layer normed it with its own s_l. For the projections that read a normed
input (q, k, v after attn_norm; gate, up after mlp_norm) the map to approximate is therefore

    W_l diag(s_l) n(x) = (W' + R_l) diag(s') n(x)   =>   R_l = W_l diag(s_l / s') - W'

(s = weight, or offset + weight with Gemma's norm_offset = 1). This is eq. 4 exactly when the tied norms equal the
vanilla ones (Stepwise, Lower, or any model whose norm weights agree) and the only choice that makes the full-rank
relaxed model reproduce the vanilla one when they differ (Average averages the norms). o_proj and down_proj read no
norm and use W_l itself. With LayerNorm shifts beta or linear biases (GPT-NeoX/Pythia layouts) the constant part of
the map differs as well; `LoRALinear` then carries a per-loop bias delta (out floats per loop) set in closed form,

    db_l = (W_l beta_l + b_l) - (W' + B_l A_l) beta' - b'

which is exact at any rank for the constant term. It exists only when the source has such biases.

Dead channels: a shared RMSNorm scale |s'_j| below 1e-3 * mean|s'| would silence channel j in every loop, while
a loop's vanilla layer may read it at full scale (pretrained LLMs have such channels: SmolLM2-135M's MLP norms, on
the channels of its massive activations, and Stepwise ties such a layer to one that reads the channel). Before the
residuals are taken, `revive_channels` moves the scale of such a channel into the shared projections that read it:
s'_j := mean|s'|, W'[:, j] *= s'_j(old) / s'_j(new). The shared block computes the same function, and every loop's
residual can now carry channel j, so eq. 5 stays exact. A LayerNorm (its shift would have to grow as the scale
shrinks) keeps the plain eq. 4 column (ratio 1) with a warning; reproduction is then not exact.

SVD: torch.linalg.svd in float64 when the matrix is small (min(out, in) <= 1024) or the rank is a large share of it;
else torch.svd_lowrank (randomized, q = r + 16, 4 power iterations) in float32. `init_lora` returns counts of both,
and recursive.py logs them.

Run:
    python eval.py energy --ckpt out/vanilla/ckpt.pt --loops 2 --init average   # residual energy captured per rank
    python -m pytest -q tests/test_svd_lora.py
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from model import Block, Linear, RMSNorm, linear


# ----------------------------------------------------------------------------------------------------------------
# The layer


class LoRALinear(Linear):
    """Shared weight W' (and bias b') plus one LoRA per loop: y = W' x + b' + B_l (A_l x) [+ db_l].

    lora_A (n_loops, r, in), lora_B (n_loops, out, r), lora_bias (n_loops, out) or None. No alpha / r factor: the
    effective scale is 1, so an SVD-initialised delta equals the truncated residual exactly (the pitfall of
    PEFT-style alpha/r != 1 is a start delta that is a multiple of the residual).
    """

    def __init__(self, in_features, out_features, bias=False, n_loops=2, rank=8, bias_delta=False):
        super().__init__(in_features, out_features, bias=bias)
        if rank < 1:
            raise ValueError(f"LoRALinear rank must be >= 1 (use a plain Linear for rank 0), got {rank}")
        if rank > min(in_features, out_features):
            raise ValueError(f"LoRA rank {rank} exceeds min(out, in) = {min(in_features, out_features)} of a "
                             f"{out_features}x{in_features} matrix")
        self.n_loops, self.rank = n_loops, rank
        self.lora_A = nn.Parameter(torch.empty(n_loops, rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(n_loops, out_features, rank))
        self.lora_bias = nn.Parameter(torch.empty(n_loops, out_features)) if bias_delta else None
        self.reset_lora()

    @torch.no_grad()
    def reset_lora(self, loops=None, generator=None):
        """Standard LoRA init (Hu et al.; Appendix C): A ~ N(0, 1/in), B = 0, bias delta 0 -> zero delta."""
        loops = range(self.n_loops) if loops is None else loops
        for l in loops:
            a = torch.randn(self.lora_A.shape[1:], generator=generator, dtype=torch.float32)
            self.lora_A[l].copy_(a / math.sqrt(self.in_features))
            self.lora_B[l].zero_()
            if self.lora_bias is not None:
                self.lora_bias[l].zero_()

    def delta_weight(self, loop: int) -> torch.Tensor:
        """B_l A_l (out, in): what loop `loop` adds to the shared weight."""
        return self.lora_B[loop] @ self.lora_A[loop]

    def forward(self, x, lora_idx=None):
        y = linear(x, self.weight, self.bias)
        if lora_idx is None:
            return y
        if isinstance(lora_idx, torch.Tensor) and lora_idx.dim() == 0:
            lora_idx = int(lora_idx)
        if not isinstance(lora_idx, torch.Tensor):  # one loop for the whole batch: two thin matmuls
            y = y + F.linear(F.linear(x, self.lora_A[lora_idx]), self.lora_B[lora_idx])
            return y if self.lora_bias is None else y + self.lora_bias[lora_idx]
        return y + self.per_row_delta(x, lora_idx).to(y.dtype)

    def per_row_delta(self, x, lora_idx):
        """The LoRA delta with one loop per row, -1 = none: x (N, in) or (N, T, in) and lora_idx (N,) (one loop for
        all T tokens of a row), or x (N, T, in) and lora_idx (N, T) (one loop per token). -> (N, [T,] out).

        Through kernels.multi_lora: the Triton BGMV kernel on CUDA at inference, else the reference that gathers
        each row's A and B and runs two batched matmuls (inside a compiled step, the stacked form). Never a Python
        loop over rows."""
        lead, n_in = x.shape[:-1], x.size(-1)
        if lora_idx.dim() == 1 and lora_idx.size(0) == x.size(0):  # per row: the kernel broadcasts over T itself
            delta = kernels.multi_lora(x.reshape(x.size(0), -1, n_in), self.lora_A, self.lora_B, lora_idx)
            idx_shape = (x.size(0),) + (1,) * (x.dim() - 2)
        elif lora_idx.shape == lead:  # per token: flatten to (N*T, in) rows
            delta = kernels.multi_lora(x.reshape(-1, n_in), self.lora_A, self.lora_B, lora_idx.reshape(-1))
            idx_shape = tuple(lead)
        else:
            raise ValueError(f"LoRALinear: lora_idx of shape {tuple(lora_idx.shape)} fits neither the rows "
                             f"({x.size(0)},) nor the tokens {tuple(lead)} of x {tuple(x.shape)}")
        delta = delta.reshape(*lead, self.out_features)
        if self.lora_bias is not None:  # per-loop bias delta, zero where the index is -1
            db = self.lora_bias[lora_idx.clamp(min=0)] * (lora_idx >= 0).to(delta.dtype)[..., None]
            delta = delta + db.reshape(*idx_shape, self.out_features)
        return delta

    def extra_repr(self):
        return (f"{super().extra_repr()}, n_loops={self.n_loops}, rank={self.rank}, "
                f"bias_delta={self.lora_bias is not None}")


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set(module: nn.Module, path: str, value: nn.Module):
    parent, _, name = path.rpartition(".")
    setattr(_get(module, parent) if parent else module, name, value)


def add_lora(block: Block, n_loops: int, ranks: dict[str, int], bias_delta: bool = False) -> Block:
    """Replace the projections of `block` by LoRALinear with the rank of their component (0 = leave as is).

    The shared weights are kept (copied into the new modules); the LoRA starts at the standard init.
    """
    for comp, paths in COMPONENTS.items():
        r = ranks.get(comp, 0)
        if r <= 0:
            continue
        for path in paths:
            if path == "mlp.gate_proj" and not hasattr(block.mlp, "gate_proj"):
                continue  # the plain GELU MLP (NeoX) has no gate
            old = _get(block, path)
            new = LoRALinear(old.in_features, old.out_features, bias=old.bias is not None, n_loops=n_loops, rank=r,
                             bias_delta=bias_delta).to(device=old.weight.device, dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                if old.bias is not None:
                    new.bias.copy_(old.bias)
            _set(block, path, new)
    return block


# ----------------------------------------------------------------------------------------------------------------
# Truncated SVD (eq. 4)


def svd_method(shape, r: int) -> str:
    """'svd' (exact, float64) when min(out, in) <= 1024 or r >= min(out, in) / 4, else 'lowrank' (randomized)."""
    m = min(shape)
    return "svd" if (m <= 1024 or 4 * r >= m) else "lowrank"


def truncated_svd(R: torch.Tensor, r: int, method: str = "auto") -> tuple[torch.Tensor, torch.Tensor, str]:
    """R (out, in) -> B = U_r S_r (out, r), A = V_r^T (r, in), and the method used ('svd' | 'lowrank').

    'auto': the exact torch.linalg.svd (float64) when min(out, in) <= 1024 or r >= min(out, in) / 4, else the
    randomized torch.svd_lowrank (float32, q = r + 16 oversampling, 4 power iterations), far cheaper when r is much
    smaller than the matrix.
    """
    m = min(R.shape)
    if r > m:
        raise ValueError(f"rank {r} exceeds min(out, in) = {m} of a {R.shape[0]}x{R.shape[1]} residual")
    if method == "auto":
        method = svd_method(R.shape, r)
    if method == "svd":
        U, S, Vh = torch.linalg.svd(R.double(), full_matrices=False)
        return U[:, :r] * S[:r], Vh[:r], "svd"
    if method == "lowrank":
        U, S, V = torch.svd_lowrank(R.float(), q=min(r + 16, m), niter=4)
        return (U[:, :r] * S[:r]).double(), V[:, :r].T.double(), "lowrank"
    raise ValueError(f"unknown SVD method {method!r}; choose auto, svd or lowrank")


def norm_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The elementwise affine part of a norm: y = n(x) * scale + shift -> (scale (C,), shift (C,) or None), float64."""
    if isinstance(norm, RMSNorm):
        return (norm.offset + norm.weight.double()), None
    if isinstance(norm, nn.LayerNorm):
        if norm.weight is None:
            raise ValueError("LayerNorm without an elementwise affine is not supported")
        return norm.weight.double(), (norm.bias.double() if norm.bias is not None else None)
    raise ValueError(f"unsupported norm {type(norm).__name__}")


def scale_ratio(s_src: torch.Tensor, s_shared: torch.Tensor, rel_tol: float = 1e-3):
    """s_src / s_shared, with ratio 1 (plain eq. 4) on channels whose shared scale is ~0. -> (ratio, n_fallback)."""
    tiny = s_shared.abs() < rel_tol * s_shared.abs().mean().clamp(min=1e-30)
    ratio = torch.where(tiny, torch.ones_like(s_src), s_src / torch.where(tiny, torch.ones_like(s_shared), s_shared))
    return ratio, int(tiny.sum())


@torch.no_grad()
def revive_channels(shared: Block, rel_tol: float = 1e-3) -> int:
    """Give every ~0 channel of the shared block's RMSNorm scales the mean scale, and divide it back out of the
    columns of the projections that read that norm (q, k, v after attn_norm; gate, up after mlp_norm): the block's
    function is unchanged (see the module docstring). -> the number of channels revived."""
    revived = 0
    for norm_name in sorted(set(NORM_OF.values())):
        norm = _get(shared, norm_name)
        if not isinstance(norm, RMSNorm):
            continue
        s, _ = norm_affine(norm)
        dead = s.abs() < rel_tol * s.abs().mean().clamp(min=1e-30)
        if not dead.any():
            continue
        new = torch.where(dead, s.abs().mean(), s)
        for path, of in NORM_OF.items():
            if of == norm_name and (path != "mlp.gate_proj" or hasattr(shared.mlp, "gate_proj")):
                w = _get(shared, path).weight
                w.copy_(w.double() * (s / new)[None, :])
        norm.weight.copy_(new - norm.offset)
        revived += int(dead.sum())
    return revived


@torch.no_grad()
def init_lora(shared: Block, sources: list[Block], mode: str = "svd", method: str = "auto", generator=None) -> dict:
    """Initialise every LoRA of the shared block `shared` from `sources[l]`, the vanilla block loop l stands for.

    mode 'svd' (eq. 4 on the effective linear map, see the module docstring) or 'zero' (standard init everywhere,
    so the relaxed model starts as the plain recursive one). Returns counts: {'svd', 'lowrank', 'zero_residual',
    'standard', 'norm_fallback', 'revived'}.
    """
    if mode not in ("svd", "zero"):
        raise ValueError(f"unknown LoRA init {mode!r}; choose svd or zero")
    stats = dict(svd=0, lowrank=0, zero_residual=0, standard=0, norm_fallback=0, revived=0)
    # the loops whose vanilla layer *is* the shared layer (loop 1 of Stepwise or Lower), told before any revival
    shared_sd = shared.state_dict()
    is_shared_layer = [all(torch.equal(shared_sd[k], v) for k, v in src.state_dict().items()) for src in sources]
    if mode == "svd":
        stats["revived"] = revive_channels(shared)
    for path in [p for paths in COMPONENTS.values() for p in paths]:
        if path == "mlp.gate_proj" and not hasattr(shared.mlp, "gate_proj"):
            continue
        lin = _get(shared, path)
        if not isinstance(lin, LoRALinear):
            continue  # rank 0 for this component
        if len(sources) != lin.n_loops:
            raise ValueError(f"{len(sources)} source blocks for {lin.n_loops} loops")
        W_sh = lin.weight.double()
        b_sh = lin.bias.double() if lin.bias is not None else 0.0
        shift_sh = None
        if path in NORM_OF:
            s_sh, shift_sh = norm_affine(_get(shared, NORM_OF[path]))
        for l, src_block in enumerate(sources):
            if mode == "zero":
                lin.reset_lora([l], generator)
                stats["standard"] += 1
                continue
            src = _get(src_block, path)
            W = src.weight.double()
            const = src.bias.double() if src.bias is not None else torch.zeros_like(W[:, 0])  # constant term
            if path in NORM_OF:
                s_src, shift_src = norm_affine(_get(src_block, NORM_OF[path]))
                ratio, n_bad = scale_ratio(s_src, s_sh)
                stats["norm_fallback"] += n_bad
                if shift_src is not None:
                    const = const + W @ shift_src
                W = W * ratio[None, :]  # W_l diag(s_l / s')
            R = W - W_sh
            if is_shared_layer[l] or not torch.any(R != 0):  # the shared layer itself: standard init (App. C)
                lin.reset_lora([l], generator)
                stats["zero_residual"] += 1
                Bm = torch.zeros_like(R[:, :lin.rank])
                Am = lin.lora_A[l].double()
            else:
                Bm, Am, used = truncated_svd(R, lin.rank, method)
                stats[used] += 1
                lin.lora_A[l].copy_(Am)
                lin.lora_B[l].copy_(Bm)
            if lin.lora_bias is not None:
                db = const - b_sh
                if shift_sh is not None:
                    db = db - (W_sh + Bm @ Am) @ shift_sh
                lin.lora_bias[l].copy_(db)
    if stats["norm_fallback"]:
        warnings.warn(f"{stats['norm_fallback']} channel(s) of a shared norm scale are ~0: their columns use the "
                      f"plain eq. 4 residual W_l - W' and the relaxed model does not reproduce the vanilla one exactly",
                      stacklevel=2)
    return stats


# ----------------------------------------------------------------------------------------------------------------
# Which projections exist, which rank component each belongs to (Table G.1), which norm feeds it, their sizes

COMPONENTS = {  # rank component (Table G.1) -> projections of model.Block it covers
    "q": ("attn.q_proj",),
    "kv": ("attn.k_proj", "attn.v_proj"),
    "o": ("attn.o_proj",),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
NORM_OF = {  # projections whose input is a normed hidden state, and that norm
    "attn.q_proj": "attn_norm", "attn.k_proj": "attn_norm", "attn.v_proj": "attn_norm",
    "mlp.gate_proj": "mlp_norm", "mlp.up_proj": "mlp_norm",
}


def component_shapes(cfg) -> dict[str, list[tuple[int, int]]]:
    """(out, in) of every projection of one block, per rank component."""
    d, hd, h = cfg.n_embd, cfg.hd, cfg.mlp_hidden
    return {
        "q": [(cfg.n_head * hd, d)],
        "kv": [(cfg.n_kv_head * hd, d)] * 2,
        "o": [(d, cfg.n_head * hd)],
        "mlp": [(h, d)] * (2 if cfg.mlp != "gelu" else 1) + [(d, h)],
    }


def max_ranks(cfg) -> dict[str, int]:
    """Largest useful rank per component: min(out, in) of its matrices (a full-rank LoRA)."""
    return {c: min(min(s) for s in shapes) for c, shapes in component_shapes(cfg).items()}


def check_one_rank(rank: int, cfg, flag: str = "--lora-rank"):
    """One LoRA rank for every component (serve.py's and bench.py serve's --lora-rank) is at most the smallest full
    rank of cfg's projections; else a ValueError naming the flag (a command's one line)."""
    top = max_ranks(cfg)
    c = min(top, key=top.get)
    if rank > top[c]:
        raise ValueError(f"{flag} {rank} exceeds the full rank of the {c} projections of this model (min(out, in) = "
                         f"{top[c]}): give {top[c]} or less")


def lora_params(cfg, ranks: dict[str, int], n_loops: int, bias_delta: bool = False) -> int:
    """Parameters of the LoRA modules of one shared block: n_loops * r * (in + out) per projection."""
    n = 0
    for c, shapes in component_shapes(cfg).items():
        if ranks.get(c, 0) > 0:
            n += sum(n_loops * (ranks[c] * (o + i) + (o if bias_delta else 0)) for o, i in shapes)
    return n
