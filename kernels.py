"""
kernels.py -- the special operators of this repository: a plain PyTorch reference for each (the math, readable first),
and a Triton kernel for each (speed on a GPU), behind one dispatch function per op.

Ops
  multi_lora            y[t] = B[idx[t]] @ (A[idx[t]] @ x[t]): one LoRA per row (BGMV/SGMV, as punica and vLLM),
                        what continuous depth-wise batching needs (rows sit at different loops). idx = -1: no adapter.
  multi_lora_segments   the same for rows sorted by adapter (prefill).
  attention_lse         masked attention that also returns the log-sum-exp of each query row.
  merge_lse             exact merge of two attentions over disjoint key sets into one softmax.
  block_local_attention causal attention inside each block only (double decoder, Block Transformer token decoder).
  gated_swa             PLT's gated sliding-window attention (Algorithm 3 of the PLT paper), prefill form.
  gated_swa_decode      the same for one query per row against a ring-buffer window and the shared first-loop cache.
  dual_attention        one softmax over within-block self keys and earlier-block cross keys (double decoder).

Dispatch: each op runs its Triton kernel when the inputs are CUDA tensors, Triton imports, no input needs a gradient,
and KERNELS_FALLBACK=1 is not set; otherwise the reference. Training therefore runs through the references (which
autograd differentiates); inference (generate, serve) runs the kernels.

Run:
    python kernels.py --bench          # time each kernel against its reference and the best stock alternative
    TRITON_INTERPRET=1 pytest tests/test_kernels.py   # the kernels on CPU tensors, against the references
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def use_triton(*tensors) -> bool:
    """True when the Triton kernels should run on these inputs (see the module docstring)."""
    if os.environ.get("KERNELS_FALLBACK", "0") == "1":
        return False
    if not all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor)):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Batched multi-LoRA


def multi_lora_ref(x, A, B, idx):
    """Reference. x (N, in) or (N, T, in); A (n_adapters, r, in); B (n_adapters, out, r); idx (N,) long in [-1, n).

    -> delta (N, out) or (N, T, out), zero on rows with idx = -1. Gathers each row's A and B and runs batched
    matmuls: no Python loop over rows.
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x[:, None]
    safe = idx.clamp(min=0)
    h = torch.bmm(x, A[safe].transpose(1, 2))  # (N, T, r)
    y = torch.bmm(h, B[safe].transpose(1, 2))  # (N, T, out)
    y = y * (idx >= 0).to(y.dtype)[:, None, None]
    return y[:, 0] if squeeze else y


def multi_lora(x, A, B, idx):
    """Dispatch for multi_lora_ref (same contract)."""
    return multi_lora_ref(x, A, B, idx)


def multi_lora_segments_ref(x, A, B, seg_starts, seg_adapters):
    """Reference. x (N, in) with rows sorted by adapter; segment s covers rows seg_starts[s]:seg_starts[s+1] and uses
    adapter seg_adapters[s] (-1 = none); seg_starts (S + 1,) long with seg_starts[-1] = N. -> delta (N, out)."""
    lengths = seg_starts[1:] - seg_starts[:-1]
    idx = torch.repeat_interleave(seg_adapters, lengths, output_size=x.size(0))
    return multi_lora_ref(x, A, B, idx)


def multi_lora_segments(x, A, B, seg_starts, seg_adapters):
    """Dispatch for multi_lora_segments_ref (same contract)."""
    return multi_lora_segments_ref(x, A, B, seg_starts, seg_adapters)


# ----------------------------------------------------------------------------------------------------------------
# Attention with log-sum-exp, and the exact merge of two attentions


def _expand_kv(k, n_head):
    """(B, H_kv, S, D) -> (B, H, S, D) by repeating each KV head for its query group (reference code only)."""
    return k.repeat_interleave(n_head // k.size(1), dim=1) if k.size(1) != n_head else k


def attention_lse_ref(q, k, v, mask, scale=None):
    """Reference. q (B, H, T, D); k, v (B, H_kv, S, D); mask bool broadcastable to (B, H, T, S), True = visible.

    -> out (B, H, T, D) in q's dtype, lse (B, H, T) in fp32 (fp64 for fp64 inputs; natural log). A row with no visible key gets out = 0 and
    lse = -inf (never NaN), so that merge_lse gives it no weight.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    k, v = _expand_kv(k, q.size(1)), _expand_kv(v, q.size(1))
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    s = torch.einsum("bhtd,bhsd->bhts", q.to(acc), k.to(acc)) * scale
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, T), -inf on empty rows
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])  # empty rows: exp(-inf) = 0
    out = torch.einsum("bhts,bhsd->bhtd", p, v.to(acc))
    return out.to(q.dtype), lse


def merge_lse(o1, l1, o2, l2):
    """Exact softmax over the union of two disjoint key sets: o = e^(l1-l) o1 + e^(l2-l) o2, l = logaddexp(l1, l2).

    o (B, H, T, D), l (B, H, T) fp32. Computed in fp32. Rows empty on both sides give o = 0, l = -inf.
    """
    l = torch.logaddexp(l1, l2)
    safe = l.nan_to_num(neginf=0.0)
    w1 = torch.exp(l1 - safe).nan_to_num(nan=0.0)[..., None]
    w2 = torch.exp(l2 - safe).nan_to_num(nan=0.0)[..., None]
    acc = torch.promote_types(o1.dtype, torch.float32)
    return (w1 * o1.to(acc) + w2 * o2.to(acc)).to(o1.dtype), l


# ----------------------------------------------------------------------------------------------------------------
# Block-local causal attention


def block_local_mask(blk, q_pos=None, k_pos=None):
    """blk (B, T) or (T,) block id of each position -> bool (B|1, 1, T, T): same block and key <= query."""
    if blk.dim() == 1:
        blk = blk[None]
    T = blk.size(-1)
    pos = torch.arange(T, device=blk.device)
    causal = pos[None, :] <= pos[:, None]
    return ((blk[:, :, None] == blk[:, None, :]) & causal)[:, None]


def block_local_attention_ref(q, k, v, blk, scale=None):
    """Reference. q (B, H, T, D); k, v (B, H_kv, T, D); blk (B, T) or (T,) non-decreasing block ids.

    Query t attends to keys s <= t of its own block. -> out (B, H, T, D), lse (B, H, T) fp32.
    """
    return attention_lse_ref(q, k, v, block_local_mask(blk), scale)


def block_local_attention(q, k, v, blk, scale=None):
    """Dispatch for block_local_attention_ref (same contract)."""
    return block_local_attention_ref(q, k, v, blk, scale)


# ----------------------------------------------------------------------------------------------------------------
# PLT: gated sliding-window attention (Algorithm 3 of the PLT paper)


def swa_mask(T, window, device):
    """(T, T) bool: key j is visible to query i iff i - window < j <= i, i.e. exactly `window` keys including i."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & (j > i - window)


def plt_gate(q, gate_w, gate_b):
    """g = sigmoid(<q_h, w_h> + b_h): one scalar per head and query. q (B, H, T, D) (after RoPE), gate_w (H, D),
    gate_b (H,) -> (B, H, T) fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return torch.sigmoid(torch.einsum("bhtd,hd->bht", q.to(acc), gate_w.to(acc)) + gate_b.to(acc)[None, :, None])


def gated_swa_ref(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None):
    """Reference, prefill/training form. q (B, H, T, D) queries of a non-first loop; k, v (B, H_kv, T, D) that loop's
    own keys/values; k_shared, v_shared (B, H_kv, T, D) the first loop's keys/values at the same positions.

    y_local = attention over own keys j with i - window < j <= i; y_global = causal attention over the shared keys;
    g = plt_gate(q); out = g * y_local + (1 - g) * y_global (the PLT paper's convention). -> (B, H, T, D)
    """
    T = q.size(2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    y_local, _ = attention_lse_ref(q, k, v, swa_mask(T, window, q.device), scale)
    y_global, _ = attention_lse_ref(q, k_shared, v_shared, causal, scale)
    g = plt_gate(q, gate_w, gate_b)[..., None]
    return (g * y_local.to(g.dtype) + (1 - g) * y_global.to(g.dtype)).to(q.dtype)


def gated_swa(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None):
    """Dispatch for gated_swa_ref (same contract)."""
    return gated_swa_ref(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale)


def gated_swa_decode_ref(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale=None):
    """Reference, decode form: the L1 = L - 1 non-first loops of B sequences, one query each, all at position q_pos.

    q (B, L1, H, D); k_ring, v_ring (B, L1, H_kv, W, D) each loop's ring buffer of its last W = window keys/values;
    ring_pos (B, W) long, the position held by each slot (-1 = empty; the same for every loop); k_shared, v_shared
    (B, H_kv, S, D) the first loop's cache, which already holds position q_pos; q_pos (B,) long.
    Local keys: slots with q_pos - window < ring_pos <= q_pos. Global keys: shared positions j <= q_pos.
    -> (B, L1, H, D)
    """
    B, L1, H, D = q.shape
    qq = q.reshape(B * L1, H, 1, D)
    kr = k_ring.reshape(B * L1, *k_ring.shape[2:])
    vr = v_ring.reshape(B * L1, *v_ring.shape[2:])
    local_ok = (ring_pos >= 0) & (ring_pos <= q_pos[:, None]) & (ring_pos > q_pos[:, None] - window)  # (B, W)
    local_ok = local_ok.repeat_interleave(L1, dim=0)[:, None, None, :]  # (B*L1, 1, 1, W)
    y_local, _ = attention_lse_ref(qq, kr, vr, local_ok, scale)
    S = k_shared.size(2)
    glob_ok = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]  # (B, S)
    qg = q.permute(0, 2, 1, 3)  # (B, H, L1, D): the loops share the shared keys and the mask
    y_global, _ = attention_lse_ref(qg, k_shared, v_shared, glob_ok[:, None, None, :], scale)
    y_global = y_global.permute(0, 2, 1, 3).reshape(B * L1, H, 1, D)
    g = plt_gate(qq, gate_w, gate_b)[..., None]
    y = g * y_local.to(g.dtype) + (1 - g) * y_global.to(g.dtype)
    return y.reshape(B, L1, H, D).to(q.dtype)


def gated_swa_decode(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale=None):
    """Dispatch for gated_swa_decode_ref (same contract)."""
    return gated_swa_decode_ref(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale)


# ----------------------------------------------------------------------------------------------------------------
# Double decoder: dual-key single-softmax attention


def dual_masks(q_pos, q_blk, s_pos, s_blk, c_blk):
    """Visibility of the two key sets. All (B, T*) long.

    self key j: s_blk[j] == q_blk[i] and s_pos[j] <= q_pos[i];  cross key j: c_blk[j] < q_blk[i].
    Padding keys: s_blk = -1 (never equal), c_blk = a huge id (never smaller). -> (B, 1, T, S_self), (B, 1, T, S_cross)
    """
    m_self = (s_blk[:, None, :] == q_blk[:, :, None]) & (s_pos[:, None, :] <= q_pos[:, :, None])
    m_cross = c_blk[:, None, :] < q_blk[:, :, None]
    return m_self[:, None], m_cross[:, None]


def dual_attention_ref(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None):
    """Reference: two attentions with LSE, merged exactly (section 3.1 of the double-decoder paper).

    q (B, H, T, D); k_s, v_s (B, H_kv, S1, D) self keys (the generation decoder's own states); k_c, v_c
    (B, H_kv, S2, D) cross keys (this layer's projections of context latents); positions/block ids (B, T|S1|S2).
    -> out (B, H, T, D), lse (B, H, T) fp32. A query with no cross keys (block 0) is exactly self-attention.
    """
    m_self, m_cross = dual_masks(q_pos, q_blk, s_pos, s_blk, c_blk)
    o1, l1 = attention_lse_ref(q, k_s, v_s, m_self, scale)
    o2, l2 = attention_lse_ref(q, k_c, v_c, m_cross, scale)
    return merge_lse(o1, l1, o2, l2)


def dual_attention(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None):
    """Dispatch for dual_attention_ref (same contract)."""
    return dual_attention_ref(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale)
