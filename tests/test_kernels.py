"""kernels.py: every Triton kernel against its PyTorch reference (on CPU tensors under TRITON_INTERPRET=1, which
tests/conftest.py sets before kernels.py is imported when there is no GPU), the references against independent
dense formulations, and the dispatch rules (reference on CPU / with KERNELS_FALLBACK=1 / when a grad is needed).

fp32 throughout; the kernels use IEEE fp32 dots, so the tolerances are tight (1e-5 relative / absolute).
"""
import os

import pytest
import torch
import torch.nn.functional as F

import kernels as K
from harness.cpu_tuning import attend_grouped

TOL = dict(rtol=1e-5, atol=1e-5)
# Where to run the Triton kernels: the GPU when there is one (compiled), else CPU tensors under the interpreter.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tri(kernel, *args, **kw):
    """Run a Triton kernel on DEV with args moved there; the outputs come back to the CPU for comparison."""
    args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    out = kernel(*args, **kw)
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **(kw or TOL))


def test_interpreter_is_used_without_gpu():
    """The kernel tests below must really run the Triton kernels on CPU: Triton is installed and interpreting."""
    assert K.triton is not None, "Triton is not importable: the kernel tests cannot run"
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert isinstance(K._dual_attention_kernel, K.triton.runtime.interpreter.InterpretedFunction)


# ------------------------------------------------------------------------------------------------------------------
# multi-LoRA


def lora_loop(x, A, B, idx):
    """Independent reference: one row at a time."""
    x3 = x if x.dim() == 3 else x[:, None]
    out = torch.zeros(*x3.shape[:2], B.size(1), dtype=x.dtype)
    for i, a in enumerate(idx.tolist()):
        if a >= 0:
            out[i] = (x3[i] @ A[a].T) @ B[a].T
    return out if x.dim() == 3 else out[:, 0]


def lora_weights(n, r, d_in, d_out):
    """A, B scaled so that the outputs are O(1) (absolute tolerances then mean what they say)."""
    return torch.randn(n, r, d_in) * d_in ** -0.5, torch.randn(n, d_out, r) * r ** -0.5


@pytest.mark.parametrize("N,T,d_in,d_out,r,n", [
    (7, None, 37, 29, 5, 3),     # odd everything
    (1, None, 16, 16, 16, 1),    # one row
    (45, None, 70, 33, 24, 4),   # several row tiles (block_m 16 below)
    (5, 3, 20, 18, 7, 2),        # (N, T, in): idx per sequence
])
@pytest.mark.parametrize("split_k", [1, 3])
def test_multi_lora_triton(N, T, d_in, d_out, r, n, split_k):
    x = torch.randn(N, d_in) if T is None else torch.randn(N, T, d_in)
    A, B = lora_weights(n, r, d_in, d_out)
    idx = torch.randint(-1, n, (N,))
    idx[0] = -1 if N > 1 else 0  # at least one row without an adapter (and one with, when N = 1)
    ref = K.multi_lora_ref(x, A, B, idx)
    close(ref, lora_loop(x, A, B, idx))
    close(tri(K.multi_lora_triton, x, A, B, idx, split_k=split_k, block_m=16), ref)
    close(tri(K.multi_lora_triton, x, A, B, idx), ref)  # the launch heuristics


def test_multi_lora_triton_edge_cases():
    A, B = torch.randn(3, 6, 21), torch.randn(3, 11, 6)
    x = torch.randn(9, 21)
    y = tri(K.multi_lora_triton, x, A, B, torch.full((9,), -1))  # no row has an adapter: exact zeros
    assert torch.equal(y, torch.zeros(9, 11))
    assert tri(K.multi_lora_triton, x[:0], A, B, torch.zeros(0, dtype=torch.long)).shape == (0, 11)
    # non-contiguous inputs (strided x, a strided idx view, transposed A storage)
    xs = torch.randn(9, 42)[:, ::2]
    idx = torch.tensor([2, 0, 1, -1, 0, 2, 2, 1, 0, 5, 5, 5])[:9]
    idx_nc = torch.stack([idx, idx], 1)[:, 0]
    At = torch.randn(3, 21, 6).transpose(1, 2)
    close(tri(K.multi_lora_triton, xs, At, B, idx_nc), lora_loop(xs, At, B, idx))
    close(tri(K.multi_lora_triton, xs, At, B, idx.to(torch.int32)), lora_loop(xs, At, B, idx))


def test_multi_lora_bad_input():
    A, B = torch.randn(2, 4, 8), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="do not chain"):
        tri(K.multi_lora_triton, torch.randn(3, 9), A, B, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="idx"):
        tri(K.multi_lora_triton, torch.randn(3, 8), A, B, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="rank"):
        tri(K.multi_lora_triton, torch.randn(3, 8), torch.randn(1, 300, 8), torch.randn(1, 5, 300),
            torch.zeros(3).long())


# ------------------------------------------------------------------------------------------------------------------
# attention with LSE, merge_lse


def sdpa_lse(q, k, v, mask, scale):
    """Independent dense softmax in fp64 -> out, lse (rows with no key: 0, -inf)."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def test_attention_lse_ref_matches_sdpa():
    q, k, v = torch.randn(2, 4, 9, 8).double(), torch.randn(2, 2, 11, 8).double(), torch.randn(2, 2, 11, 8).double()
    mask = torch.rand(2, 1, 9, 11) < 0.6
    mask[..., 0] = True
    o, l = K.attention_lse_ref(q, k, v, mask)
    close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), rtol=1e-10, atol=1e-10)
    o2, l2 = sdpa_lse(q, k, v, mask, 8 ** -0.5)
    close(l, l2, rtol=1e-10, atol=1e-10)
    # a row without keys: out 0, lse -inf, no NaN
    mask[:, :, 3] = False
    o, l = K.attention_lse_ref(q, k, v, mask)
    assert torch.all(o[:, :, 3] == 0) and torch.all(l[:, :, 3] == float("-inf")) and not o.isnan().any()


def test_merge_lse_is_exact():
    """Attention over a key set split in two disjoint parts, merged, == attention over the whole set (fp64)."""
    q, k, v = (torch.randn(1, 2, 6, 5).double() for _ in range(3))
    mask = torch.rand(1, 1, 6, 6) < 0.7
    part = torch.rand(6) < 0.5  # key j in part 1 or part 2
    mask[..., 0, :] = part  # row 0: keys only in part 1 (part 2 empty)
    mask[..., 1, :] = ~part  # row 1: only part 2
    mask[..., 2, :] = False  # row 2: no key at all
    o, l = K.attention_lse_ref(q, k, v, mask)
    o1, l1 = K.attention_lse_ref(q, k, v, mask & part)
    o2, l2 = K.attention_lse_ref(q, k, v, mask & ~part)
    om, lm = K.merge_lse(o1, l1, o2, l2)
    close(om, o, rtol=1e-12, atol=1e-12)
    close(lm, l, rtol=1e-12, atol=1e-12)
    assert torch.all(om[:, :, 2] == 0) and torch.all(lm[:, :, 2] == float("-inf"))


# ------------------------------------------------------------------------------------------------------------------
# block-local attention


def blocks_from_lengths(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# ------------------------------------------------------------------------------------------------------------------
# gated sliding-window attention (PLT)


def gated_swa_by_hand(q, k, v, ks, vs, gw, gb, window, scale, gate=None):
    """Independent reference in fp64: explicit loops over heads and queries. gate (B, H, T): g given, not from q."""
    q, k, v, ks, vs, gw, gb = (x.double() for x in (q, k, v, ks, vs, gw, gb))
    B, H, T, D = q.shape
    G = H // k.size(1)
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                lo = max(0, i - window + 1)
                pl = torch.softmax(k[b, h // G, lo:i + 1] @ q[b, h, i] * scale, 0)
                pg = torch.softmax(ks[b, h // G, :i + 1] @ q[b, h, i] * scale, 0)
                g = torch.sigmoid(q[b, h, i] @ gw[h] + gb[h]) if gate is None else gate[b, h, i].double()
                out[b, h, i] = g * (pl @ v[b, h // G, lo:i + 1]) + (1 - g) * (pg @ vs[b, h // G, :i + 1])
    return out


def gswa_inputs(B, H, Hkv, T, D):
    return (torch.randn(B, H, T, D), *(torch.randn(B, Hkv, T, D) for _ in range(4)), torch.randn(H, D) * 0.5,
            torch.randn(H))


def test_gated_swa_ref_matches_hand_written_mix():
    args = gswa_inputs(1, 4, 2, 9, 6)
    gate = torch.rand(1, 4, 9)  # a gate given by the caller (plt.py's residual gate): gate_w, gate_b not read
    for window in (1, 3, 20):
        close(K.gated_swa_ref(*args, window).double(), gated_swa_by_hand(*args, window, 6 ** -0.5))
        close(K.gated_swa_ref(*args[:5], None, None, window, gate=gate).double(),
              gated_swa_by_hand(*args, window, 6 ** -0.5, gate=gate))


@pytest.mark.parametrize("H,Hkv,T,window", [(4, 2, 23, 5), (3, 3, 40, 1)])
def test_gated_swa_with_a_given_gate(H, Hkv, T, window):
    """gate= (B, H, T) replaces the gate from q on every path: the SDPA training path (output and gradients, the
    gate's included) and the Triton kernel equal the reference with that gate."""
    q, k, v, ks, vs, _, _ = gswa_inputs(2, H, Hkv, T, 20)
    gate = torch.rand(2, H, T)
    ref = K.gated_swa_ref(q, k, v, ks, vs, None, None, window, gate=gate)
    close(tri(K.gated_swa_triton, q, k, v, ks, vs, None, None, window, gate=gate.to(DEV), block_m=16, block_n=16),
          ref)
    args = [a.requires_grad_(True) for a in (q, k, v, ks, vs, gate)]
    fast = K.gated_swa_sdpa(*args[:5], None, None, window, gate=args[5])
    ref = K.gated_swa_ref(*args[:5], None, None, window, gate=args[5])
    close(fast, ref)
    grad_out = torch.randn_like(ref)
    for gf, gr in zip(torch.autograd.grad(fast, args, grad_out), torch.autograd.grad(ref, args, grad_out)):
        close(gf, gr)
    with pytest.raises(ValueError, match="gate must be"):
        tri(K.gated_swa_triton, q.detach(), k.detach(), v.detach(), ks.detach(), vs.detach(), None, None, window,
            gate=gate[:, :1].detach().to(DEV))


@pytest.mark.parametrize("H,Hkv,T,window", [
    (2, 2, 1, 4),      # T = 1
    (4, 2, 23, 5),     # window < T, G = 2
    (4, 1, 19, 40),    # window > T, MQA
    (8, 2, 37, 16),    # G = 4, window = tile
    (3, 3, 40, 1),     # window 1: only itself
])
def test_gated_swa_triton(H, Hkv, T, window):
    args = gswa_inputs(2 if T < 30 else 1, H, Hkv, T, 20)  # batch 2 where cheap (per-batch strides)
    ref = K.gated_swa_ref(*args, window)
    close(tri(K.gated_swa_triton, *args, window, block_m=16, block_n=16), ref)
    close(tri(K.gated_swa_triton, *args, window, scale=0.2), K.gated_swa_ref(*args, window, scale=0.2))


@pytest.mark.parametrize("H,Hkv,T,window", [(4, 2, 23, 5), (4, 1, 19, 40), (3, 3, 40, 1), (2, 2, 1, 4)])
def test_gated_swa_sdpa_matches_reference(H, Hkv, T, window):
    """The training path (SDPA branches + gate) == gated_swa_ref in fp32: the output and the gradient of every input
    (q, own k/v, shared k/v, gate_w, gate_b), with a non-default scale once."""
    for scale in (None, 0.2):
        args = [a.requires_grad_(True) for a in gswa_inputs(2, H, Hkv, T, 16)]
        ref = K.gated_swa_ref(*args, window, scale)
        fast = K.gated_swa_sdpa(*args, window, scale)
        close(fast, ref)
        grad_out = torch.randn_like(ref)
        # a softmax over one key has no gradient w.r.t. that key: own k with window 1 (or T = 1), shared k with T = 1
        no_grad = {i for i, single in ((1, min(window, T) == 1), (3, T == 1)) if single}
        grads = zip(torch.autograd.grad(fast, args, grad_out), torch.autograd.grad(ref, args, grad_out))
        for i, (gf, gr) in enumerate(grads):
            close(gf, gr)
            assert (gr.abs().sum() > 0) == (i not in no_grad), i


def test_gated_swa_bad_input():
    q, k, v, ks, vs, gw, gb = gswa_inputs(1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        tri(K.gated_swa_triton, q, k, v, ks, vs, gw, gb, 0)
    with pytest.raises(ValueError, match="gate_w"):
        tri(K.gated_swa_triton, q, k, v, ks, vs, gw[:1], gb, 2)
    with pytest.raises(ValueError, match="k_shared"):
        tri(K.gated_swa_triton, q, k, v, ks[:, :, :3], vs, gw, gb, 2)


def ring_from_prefill(k_loop, window, q_pos, W):
    """A ring buffer of W slots as a decode loop leaves it after writing positions 0..q_pos at slot p % W.
    k_loop (B, L1, Hkv, T, D) -> k_ring (B, L1, Hkv, W, D), ring_pos (B, W) (-1 = never written)."""
    B = k_loop.size(0)
    ring = torch.randn(B, *k_loop.shape[1:3], W, k_loop.size(-1))  # garbage in unwritten slots
    ring_pos = torch.full((B, W), -1, dtype=torch.long)
    for b in range(B):
        for p in range(int(q_pos[b]) + 1):
            ring[b, :, :, p % W] = k_loop[b, :, :, p]
            ring_pos[b, p % W] = p
    return ring, ring_pos


@pytest.mark.parametrize("H,Hkv,L1,window,W", [
    (4, 2, 2, 6, 6),     # ring = window
    (4, 1, 3, 5, 8),     # ring larger than the window: stale slots must be masked; MQA; L1 * G = 12
    (2, 2, 1, 30, 30),   # window larger than every position (ring partially filled)
    (6, 2, 2, 1, 1),     # window 1, G = 3
])
def test_gated_swa_decode_matches_prefill_last_row(H, Hkv, L1, window, W, monkeypatch):
    """Decode at position p with a ring buffer (partially filled or wrapped) == row p of the prefill reference, and
    the Triton decode kernels == the decode reference for several shared-key splits."""
    B, S, D = 2, 27, 20
    q_pos = torch.tensor([3, 22])  # batch 0: ring partly filled (when W > 4); batch 1: wrapped
    q = torch.randn(B, L1, H, S, D)
    k_loop, v_loop = torch.randn(B, L1, Hkv, S, D), torch.randn(B, L1, Hkv, S, D)
    ks, vs = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    gw, gb = torch.randn(H, D) * 0.5, torch.randn(H)
    k_ring, ring_pos = ring_from_prefill(k_loop, window, q_pos, W)
    torch.manual_seed(1)
    v_ring, ring_pos_v = ring_from_prefill(v_loop, window, q_pos, W)
    assert torch.equal(ring_pos, ring_pos_v)
    q_dec = torch.stack([q[b, :, :, int(q_pos[b])] for b in range(B)])  # (B, L1, H, D)
    ref = K.gated_swa_decode_ref(q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, gw, gb, window)
    for b in range(B):  # against the prefill reference on the first q_pos + 1 positions
        p = int(q_pos[b]) + 1
        for l in range(L1):
            full = K.gated_swa_ref(q[b:b + 1, l, :, :p], k_loop[b:b + 1, l, :, :p], v_loop[b:b + 1, l, :, :p],
                                   ks[b:b + 1, :, :p], vs[b:b + 1, :, :p], gw, gb, window)
            close(ref[b, l], full[0, :, -1])
    close(K.gated_swa_decode_sdpa(q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, gw, gb, window), ref)  # CPU path
    calls = []  # the CPU path with another attention in the hook: both attentions go through it, same result

    def grouped(q, k, v, mask=None, scale=None):
        calls.append(q.shape)
        return attend_grouped(q, k, v, mask, scale)
    monkeypatch.setattr(K, "cpu_decode_attend", grouped)
    close(K.gated_swa_decode_sdpa(q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, gw, gb, window), ref)
    assert calls == [(B * L1, H, 1, D), (B, H, L1, D)]
    for splits in (None, 1, 3):
        close(tri(K.gated_swa_decode_triton, q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, gw, gb, window,
                                        num_splits=splits, block_n=16), ref)
    # a gate given by the caller (B, L1, H): every decode path == the prefill reference's last row with that gate
    gate = torch.rand(B, L1, H)
    ref = K.gated_swa_decode_ref(q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, None, None, window, gate=gate)
    for b in range(B):
        p = int(q_pos[b]) + 1
        for l in range(L1):
            g = gate[b:b + 1, l, :, None].expand(1, H, p)  # the same g at every position: the last row reads its own
            full = K.gated_swa_ref(q[b:b + 1, l, :, :p], k_loop[b:b + 1, l, :, :p], v_loop[b:b + 1, l, :, :p],
                                   ks[b:b + 1, :, :p], vs[b:b + 1, :, :p], None, None, window, gate=g)
            close(ref[b, l], full[0, :, -1])
    close(K.gated_swa_decode_sdpa(q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, None, None, window, gate=gate), ref)
    close(tri(K.gated_swa_decode_triton, q_dec, k_ring, v_ring, ring_pos, ks, vs, q_pos, None, None, window,
              gate=gate.to(DEV), num_splits=3, block_n=16), ref)


def test_gated_swa_decode_bad_input():
    q = torch.randn(1, 2, 4, 8)
    kr, rp = torch.randn(1, 2, 2, 3, 8), torch.zeros(1, 3).long()
    ks, qp, gw, gb = torch.randn(1, 2, 5, 8), torch.tensor([2]), torch.randn(4, 8), torch.randn(4)
    with pytest.raises(ValueError, match="ring_pos"):
        tri(K.gated_swa_decode_triton, q, kr, kr, rp[:, :2], ks, ks, qp, gw, gb, 3)
    with pytest.raises(ValueError, match="multiple"):
        tri(K.gated_swa_decode_triton, torch.randn(1, 2, 3, 8), kr, kr, rp, ks, ks, qp, gw[:3], gb[:3], 3)


# ------------------------------------------------------------------------------------------------------------------
# dual-key attention (double decoder)


def dual_single_softmax_fp64(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale):
    """Independent reference: ONE softmax over the concatenated self + cross keys with the union mask, in fp64."""
    m_self = (s_blk[:, None, :] == q_blk[:, :, None]) & (s_pos[:, None, :] <= q_pos[:, :, None])
    m_cross = c_blk[:, None, :] < q_blk[:, :, None]
    mask = torch.cat([m_self, m_cross], -1)[:, None]
    return sdpa_lse(q, torch.cat([k_s, k_c], 2), torch.cat([v_s, v_c], 2), mask, scale)


def dual_inputs(B, H, Hkv, lengths, D, n_cross_pad=0, ids_dtype=torch.long):
    """Training layout: the self keys are the queries' own positions; the cross keys are one latent per position
    with the position's block id, followed by n_cross_pad padding keys (block id huge)."""
    T = sum(lengths)
    blk = blocks_from_lengths(lengths)[None].expand(B, T).to(ids_dtype)
    pos = torch.arange(T, dtype=ids_dtype)[None].expand(B, T)  # expanded: stride 0 over the batch
    c_blk = torch.cat([blk, torch.full((B, n_cross_pad), 2 ** 40, dtype=ids_dtype)], 1) if n_cross_pad else blk
    S2 = c_blk.size(1)
    return (torch.randn(B, H, T, D), pos, blk, torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D), pos, blk,
            torch.randn(B, Hkv, S2, D), torch.randn(B, Hkv, S2, D), c_blk)


def test_dual_ref_equals_single_softmax_over_union():
    args = dual_inputs(2, 4, 2, [3, 5, 4], 8, n_cross_pad=2)
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    o, l = K.dual_attention_ref(*args)
    o2, l2 = dual_single_softmax_fp64(*args, 8 ** -0.5)
    close(o, o2, rtol=1e-12, atol=1e-12)
    close(l, l2, rtol=1e-12, atol=1e-12)
    # block 0 has no cross keys: exactly causal self-attention over its own 3 positions there
    ob, lb = K.attention_lse_ref(args[0][:, :, :3], args[3][:, :, :3], args[4][:, :, :3],
                                 torch.ones(3, 3, dtype=torch.bool).tril())
    close(o[:, :, :3], ob, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("H,Hkv,lengths,pad", [
    (2, 2, [7, 10, 6], 0),
    (4, 2, [1, 30, 2], 3),          # a 1-token block 0; long middle block; padded cross keys
    (4, 1, [20, 20, 20], 0),        # MQA, several key tiles per block
    (8, 2, [5], 0),                 # one block: no cross keys anywhere
    (6, 2, [2, 3, 4, 5, 6, 7], 1),  # G = 3, many blocks
])
def test_dual_attention_triton(H, Hkv, lengths, pad):
    args = dual_inputs(2 if sum(lengths) < 30 else 1, H, Hkv, lengths, 24, n_cross_pad=pad)
    o_ref, l_ref = K.dual_attention_ref(*args)
    for bm, bn in ((16, 16), (None, None)):
        o, l = tri(K.dual_attention_triton, *args, block_m=bm, block_n=bn)
        assert torch.isfinite(o).all() and torch.isfinite(l).all()  # block 0 (no cross keys) included
        close(o, o_ref)
        close(l, l_ref)


def dual_decode_inputs(D=12):
    """Decode layout: T = 1 query per sequence at different positions and blocks; self keys are a cache with
    padding (s_blk = -1), cross keys a cache of earlier blocks' latents with padding (huge id); int32 ids; one row
    sees no key at all."""
    B, H, Hkv, S1, S2 = 3, 4, 2, 19, 9
    q = torch.randn(B, H, 1, D)
    q_pos = torch.tensor([[5], [18], [7]], dtype=torch.int32)
    q_blk = torch.tensor([[0], [3], [1]], dtype=torch.int32)
    s_pos = torch.arange(S1, dtype=torch.int32)[None].repeat(B, 1)
    s_blk = torch.tensor([[0] * 6 + [-1] * 13, [0] * 4 + [1] * 5 + [2] * 5 + [3] * 5, [-1] * 19], dtype=torch.int32)
    c_blk = torch.tensor([[2 ** 30] * 9, [0, 0, 1, 1, 1, 2, 2, 9, 9], [0, 0, 0, 2 ** 30, 2 ** 30, 1, 1, 1, 2]],
                         dtype=torch.int32)
    q_blk[2, 0] = 0  # batch 2: block 0, and no self key (all padding) and no cross key (none < 0): empty row
    k_s, v_s, k_c, v_c = torch.randn(B, Hkv, S1, D), torch.randn(B, Hkv, S1, D), torch.randn(B, Hkv, S2, D), \
        torch.randn(B, Hkv, S2, D)
    return (q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk)


def test_dual_attention_triton_decode_and_padding():
    """The decode layout of dual_decode_inputs; the row that sees no key gets out 0, lse -inf, as the reference."""
    args = dual_decode_inputs()
    o_ref, l_ref = K.dual_attention_ref(*args)
    assert torch.all(o_ref[2] == 0) and torch.all(l_ref[2] == float("-inf"))
    o, l = tri(K.dual_attention_triton, *args, block_n=16)
    close(o, o_ref)
    close(l, l_ref)


@pytest.mark.parametrize("layout", ["training", "decode"])
def test_dual_attention_flex_equals_reference(layout):
    """The path the dispatch takes on a GPU (block masks from the ids, two FlexAttention calls, the LSE merge; eager
    FlexAttention on CPU) == the reference: a 1-token block 0, GQA, padded cross keys; in the decode layout padded
    self keys, int32 ids and a row that sees no key (out 0, lse -inf)."""
    args = dual_inputs(2, 4, 2, [1, 9, 3], 16, n_cross_pad=2) if layout == "training" else dual_decode_inputs(16)
    o_ref, l_ref = K.dual_attention_ref(*args)
    o, l = tri(K.dual_attention_flex, *args)  # compiled on a GPU (head dim >= 16 there)
    close(o, o_ref)
    close(l, l_ref)


def test_dual_attention_triton_partial_tiles_fully_visible():
    """Chunked-prefill layout: queries at positions 31..34 of block 3; self keys = positions 20..30 of block 3 (11 keys,
    all visible to every query: a partial tile with no element masked); cross keys = 21 latents of blocks 0..2 (all
    visible; the second tile is partial). The kernel must still mask the keys past the end of each key set."""
    B, H, Hkv, D = 1, 4, 2, 16
    q = torch.randn(B, H, 4, D)
    q_pos, q_blk = torch.arange(31, 35)[None], torch.full((1, 4), 3)
    s_pos, s_blk = torch.arange(20, 31)[None], torch.full((1, 11), 3)
    c_blk = torch.tensor([[0] * 7 + [1] * 7 + [2] * 7])
    args = (q, q_pos, q_blk, torch.randn(B, Hkv, 11, D), torch.randn(B, Hkv, 11, D), s_pos, s_blk,
            torch.randn(B, Hkv, 21, D), torch.randn(B, Hkv, 21, D), c_blk)
    o_ref, l_ref = K.dual_attention_ref(*args)
    o, l = tri(K.dual_attention_triton, *args, block_m=16, block_n=16)
    close(o, o_ref)
    close(l, l_ref)


def test_dual_attention_bad_input():
    args = list(dual_inputs(1, 2, 2, [2, 3], 8))
    bad = list(args)
    bad[2] = args[2].float()  # float block ids
    with pytest.raises(ValueError, match="q_blk"):
        tri(K.dual_attention_triton, *bad)
    bad = list(args)
    bad[7], bad[8] = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="heads"):
        tri(K.dual_attention_triton, *bad)


# ------------------------------------------------------------------------------------------------------------------
# dispatch


def op_cases():
    """(dispatch, reference, triton, args) for every op, with small inputs."""
    x, A, B = torch.randn(5, 12), torch.randn(2, 3, 12), torch.randn(2, 7, 3)
    idx = torch.tensor([0, 1, -1, 1, 0])
    gsw = gswa_inputs(1, 2, 1, 6, 8)
    qd, kr = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 4, 8)
    dec = (qd, kr, torch.randn_like(kr), torch.tensor([[4, 5, 2, 3]]), torch.randn(1, 1, 6, 8),
           torch.randn(1, 1, 6, 8), torch.tensor([5]), gsw[5], gsw[6], 4)
    return [
        (K.multi_lora, K.multi_lora_stacked, "multi_lora_triton", (x, A, B, idx)),  # its CPU path (== the reference)
        (K.gated_swa, K.gated_swa_sdpa, "gated_swa_triton", (*gsw, 3)),  # its non-Triton path (== the reference)
        (K.gated_swa_decode, K.gated_swa_decode_sdpa, "gated_swa_decode_triton", dec),  # its CPU path (== ref)
        # on a GPU the dual attention runs FlexAttention, not its Triton kernel (see kernels.dual_attention)
        (K.dual_attention, K.dual_attention_ref, "dual_attention_flex", dual_inputs(1, 2, 1, [2, 4], 16)),
    ]


def flat(out):
    return out if isinstance(out, tuple) else (out,)


def spy(monkeypatch, name):
    calls = []
    real = getattr(K, name)

    def wrapped(*a, **kw):
        calls.append(name)
        return real(*a, **kw)
    monkeypatch.setattr(K, name, wrapped)
    return calls


@pytest.mark.parametrize("case", range(4))
def test_dispatch_cpu_uses_reference(case, monkeypatch):
    """CPU tensors: the dispatch never calls the kernel and returns exactly the reference."""
    monkeypatch.delenv("KERNELS_FALLBACK", raising=False)
    op, ref, kname, args = op_cases()[case]
    calls = spy(monkeypatch, kname)
    for a, b in zip(flat(op(*args)), flat(ref(*args))):
        assert torch.equal(a, b)
    assert calls == []


@pytest.mark.parametrize("case", range(4))
def test_dispatch_rules_on_a_gpu(case, monkeypatch):
    """On CUDA tensors the dispatch runs the kernel (the dual attention: FlexAttention) (== reference), never the dual
    attention's Triton kernel; KERNELS_FALLBACK=1 forces the reference; an input
    that requires grad runs the reference, and the gradient flows; fp64 (no kernel) runs the reference.
    Without a GPU the device check is told that the CPU tensors are CUDA tensors (the kernel runs interpreted)."""
    if DEV.type == "cuda":
        op, ref, kname, args = op_cases()[case]
        args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
    else:
        monkeypatch.setattr(K, "_all_cuda", lambda tensors: True)
        op, ref, kname, args = op_cases()[case]
    monkeypatch.delenv("KERNELS_FALLBACK", raising=False)
    calls = spy(monkeypatch, kname)
    unused = spy(monkeypatch, "dual_attention_triton")
    for a, b in zip(flat(op(*args)), flat(ref(*args))):
        close(a, b)
    assert calls == [kname]

    monkeypatch.setenv("KERNELS_FALLBACK", "1")
    for a, b in zip(flat(op(*args)), flat(ref(*args))):
        assert torch.equal(a, b)
    assert calls == [kname]
    monkeypatch.delenv("KERNELS_FALLBACK")

    x = args[0].clone().requires_grad_(True)
    out = flat(op(x, *args[1:]))[0]
    assert calls == [kname]
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    with torch.no_grad():  # no grad needed: the kernel again
        op(x, *args[1:])
    assert calls == [kname, kname]

    args64 = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    op(*args64)
    assert calls == [kname, kname] and unused == []


def test_module_docstring_states_gradient_choice():
    """The gradient choice is stated: training goes through the references (dispatch checks requires_grad)."""
    doc = " ".join(K.__doc__.split())
    assert "needs a gradient" in doc and "Training therefore runs through the references" in doc


@pytest.mark.parametrize("form", sorted(K.LORA_FORMS))
@pytest.mark.parametrize("shape", [(7, 12), (5, 3, 12)])
def test_multi_lora_cpu_forms_equal_reference_values_and_gradients(shape, form):
    """Both CPU forms of multi_lora (all adapters stacked with the other adapters' hidden units masked; one adapter's
    rows at a time) == the gather reference, rows without an adapter (-1) included, in values and every gradient."""
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    A = torch.randn(3, 4, 12, dtype=torch.float64, requires_grad=True)
    B = torch.randn(3, 9, 4, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 2, -1, 1, 2, 0, -1][:shape[0]])
    y1, y2 = K.LORA_FORMS[form](x, A, B, idx), K.multi_lora_ref(x, A, B, idx)
    close(y1, y2, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y1)
    close(torch.autograd.grad(y1, (x, A, B), g), torch.autograd.grad(y2, (x, A, B), g), rtol=1e-12, atol=1e-12)
    assert torch.all(y1[idx == -1] == 0)
