"""
kernels.py -- the special operators of this repository: a plain PyTorch reference for each (the math, readable first),
and a Triton kernel for each (speed on a GPU), behind one dispatch function per op.

Ops, and the model path that calls each
  multi_lora            y[t] = B[idx[t]] @ (A[idx[t]] @ x[t]): one LoRA per row (BGMV, as punica and vLLM): what
                        continuous depth-wise batching needs, rows sitting at different loops (svd_lora.LoRALinear
                        with a per-row loop index, serve.py's depth-wise server). idx = -1: no adapter. Without a GPU:
                        all adapters stacked into one masked LoRA (multi_lora_stacked); one adapter's rows at a time
                        (multi_lora_grouped) is the other CPU form, which cpu_tuning.py may pick by measurement.
  attention_lse         masked attention that also returns the log-sum-exp of each query row (any mask: reference).
  flex_attention_lse    FlexAttention (any block mask) that also returns the log-sum-exp (double decoder training).
  merge_lse             exact merge of two attentions over disjoint key sets into one softmax (double decoder).
  gated_swa             PLT's gated sliding-window attention (Algorithm 3 of the PLT paper), prefill / training form
                        (plt.PLTAttention over a whole sequence); on CPU and in training, gated_swa_sdpa.
  gated_swa_decode      the same for one query per row against a ring-buffer window and the shared first-loop cache
                        (plt.PLTAttention's decode step).
  dual_attention        one softmax over within-block self keys and earlier-block cross keys (double decoder
                        inference, the paper's "ideal method"). On a GPU it dispatches to two FlexAttention calls and
                        the merge (dual_attention_flex), not to its Triton kernel: see its dispatch.

Dispatch: each op runs its Triton kernel when the inputs are CUDA tensors, Triton imports, no input needs a gradient
(grad mode on and some input has requires_grad), and KERNELS_FALLBACK=1 is not set (and the kernel handles the dtype
and sizes: fp16/bf16/fp32, head dim <= 256, LoRA rank <= 256); otherwise the reference. The exception is
dual_attention, which runs FlexAttention under the same conditions (its dispatch says why).
Gradients: the kernels are forward-only (no autograd.Function). Training therefore runs through the references, which
autograd differentiates: a training forward has parameters that require grad (LoRA A/B, the gate, the projections
feeding q/k/v), so the dispatch picks the reference by itself. Inference (generate, serve) runs the kernels, as long
as it runs under torch.no_grad() / torch.inference_mode(). The kernels themselves are public
(`multi_lora_triton`, `gated_swa_triton`, `gated_swa_decode_triton`, `dual_attention_triton`), so the tests run
them on CPU tensors under TRITON_INTERPRET=1.
No kernel wrapper synchronizes with the host (no .item()), so they can be captured in CUDA graphs.

How the kernels work (each section says more)
  * Multi-LoRA: two kernels, as vLLM's lora_shrink / lora_expand. The shrink h = x A^T splits the input dimension
    over programs and writes fp32 partial sums (deterministic, no atomics); the expand sums the partials and
    multiplies by B^T. Both grids run over (adapter, row tile, ...): a program loads one adapter's weight tile once
    and applies it to the rows of its tile that use that adapter, so an adapter's weights are read once per row tile
    rather than once per row, and programs whose tile has no row of their adapter return at once.
  * Attention (gated SWA, dual): a FlashAttention-2 style forward. Online softmax in base 2 with fp32
    statistics and accumulators; bf16/fp16 tensor-core dots; fp32 inputs use IEEE dots so that fp32 results match
    the references to ~1e-6. A program owns a tile of (query, head) rows in which the G = H / H_kv query heads that
    share one K/V head are packed side by side ("GQA packing"): K/V are never copied and each K/V tile is loaded once
    for the whole group, which also fills the tensor-core tile when there is one query (decode). Key tiles that no
    row can see are never loaded, and key tiles that every row sees run without a mask.
  * Head dims that are not powers of two are padded to the next power of two (>= 16) with masked loads.

Each op's section reads in one order: the reference (the math), other PyTorch forms of it (CPU, training), the Triton
kernel, the dispatch. This file imports no other module of this repository; kernels_aot.py compiles its kernels ahead
of time for GPUs, and cpu_tuning.py may pick multi_lora's CPU form (cpu_lora_form) and the attention of
gated_swa_decode's CPU path (cpu_decode_attend) by measurement.

Run:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py   # the kernels on CPU tensors, against the references
    python bench.py kernels            # (CUDA) each kernel against its reference and the best stock alternative
    python bench.py kernels --aot      # every kernel compiled for sm_80 / sm_90 without a GPU (kernels_aot.py)
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the references still work and use_triton() says False
    triton = tl = None

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634  # the kernels work in base 2 (exp2 is one instruction); their lse is converted back
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # wider heads would not fit a tile in registers: they run the reference
MAX_LORA_RANK = 256  # likewise for the LoRA rank
FLEX_MIN_HEAD_DIM = 16  # compiled FlexAttention on CUDA needs head dims of at least 16 (its tl.dot tiles)


def _jit(fn):
    """triton.jit when Triton is installed (an interpreted function under TRITON_INTERPRET=1), else the bare
    function."""
    return triton.jit(fn) if triton is not None else fn


def _all_cuda(tensors) -> bool:
    return all(t.is_cuda for t in tensors)


def use_triton(*tensors) -> bool:
    """True when the Triton kernels should run on these inputs (see the module docstring)."""
    if os.environ.get("KERNELS_FALLBACK", "0") == "1":
        return False
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not _all_cuda(tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return triton is not None


def _kernel_fits(*tensors, head_dim=None, rank=None) -> bool:
    """The floating inputs share one dtype the kernels handle, and the head dim / LoRA rank fit a tile."""
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats or floats[0].dtype not in KERNEL_DTYPES or any(t.dtype != floats[0].dtype for t in floats):
        return False
    return (head_dim is None or head_dim <= MAX_HEAD_DIM) and (rank is None or rank <= MAX_LORA_RANK)


def _pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo): Triton tiles are powers of two, and tl.dot needs at least 16."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype) -> str:
    """fp32 inputs: exact IEEE products (CUDA cores); bf16/fp16 ignore the setting and use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM); 4 for the CPU interpreter (few programs)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


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


def multi_lora_stacked(x, A, B, idx):
    """Same contract as multi_lora_ref, computed as ONE LoRA of rank n*r over all adapters stacked, with each row's
    hidden units of the other adapters zeroed: h = x [A_0; ..; A_n-1]^T (N, T, n r), y = sum_a (h_a * mask_a) B_a^T.

    This is the paper's own way of batching rows at different loops ("we merge multiple LoRAs into a single, large
    LoRA module", Appendix K): every adapter's weights are read once per call (views, no copy) and nothing is
    gathered per row, at n times the (small) LoRA FLOPs. Equal to the reference up to summation order (the masked
    terms are exact zeros).
    """
    n, r, d_in = A.shape
    squeeze = x.dim() == 2
    if squeeze:
        x = x[:, None]
    N, T = x.shape[:2]
    h = x @ A.reshape(n * r, d_in).t().to(x.dtype)  # (N, T, n r)
    keep = (torch.arange(n, device=x.device)[None, :] == idx[:, None]).to(h.dtype)  # (N, n); idx -1 keeps nothing
    h = (h.view(N, T, n, r) * keep[:, None, :, None]).view(N * T, n, r).transpose(0, 1)  # (n, N T, r)
    y = torch.bmm(h, B.transpose(1, 2).to(h.dtype)).sum(0).view(N, T, -1)  # (N, T, out)
    return y[:, 0] if squeeze else y


def multi_lora_grouped(x, A, B, idx):
    """Same contract as multi_lora_ref, one adapter at a time: the rows of adapter a (found with one nonzero per
    adapter, not per row) go through its two thin matmuls and are scattered back. Exactly the LoRA FLOPs, n small
    gathers and scatters of activations; a host sync per adapter (CPU only: on a GPU the Triton kernel runs)."""
    squeeze = x.dim() == 2
    if squeeze:
        x = x[:, None]
    y = x.new_zeros(*x.shape[:2], B.size(1))  # (N, T, out); rows with idx -1 stay zero
    for a in range(A.size(0)):
        rows = (idx == a).nonzero().squeeze(1)
        if rows.numel():
            y[rows] = F.linear(F.linear(x[rows], A[a].to(x.dtype)), B[a].to(x.dtype))
    return y[:, 0] if squeeze else y


LORA_FORMS = {"stacked": multi_lora_stacked, "grouped": multi_lora_grouped}


# Kernels. Rows are the M = N*T token rows of x viewed as (M, in); row m uses adapter idx[m // T] (BGMV). The shrink
# writes h (splits, M, r) in fp32; the expand reads it back, rounds it to the input dtype (as the reference's first
# bmm does) and multiplies by B^T.


@_jit
def _lora_rows(pid_a, pid_m, idx_ptr, M, T, ZERO_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows that program (pid_a, pid_m) owns -> (adapter, rows (int64), row_ok): program a owns the rows m of
    row tile pid_m with idx[m // T] == a. With ZERO_PROGRAM the grid has one program more in front, a = -1, which
    owns the rows without an adapter (the expand writes their zeros)."""
    offs = tl.arange(0, BLOCK_M)
    if ZERO_PROGRAM:
        adapter = pid_a - 1
    else:
        adapter = pid_a
    rows = pid_m * BLOCK_M + offs
    ids = tl.load(idx_ptr + rows // T, mask=rows < M, other=-2)
    row_ok = (rows < M) & (ids == adapter)
    return adapter, rows.to(tl.int64), row_ok


@_jit
def _lora_shrink_kernel(x_ptr, a_ptr, h_ptr, idx_ptr,
                        M, K, R, T, K_PER_SPLIT,
                        stride_xm, stride_xk, stride_aa, stride_ar, stride_ak, stride_hs, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PREC: tl.constexpr):
    """h[split, m, :] = x[m, chunk] @ A[adapter, :, chunk]^T for one (adapter, row tile, input chunk).
    Grid (n_adapters, row tiles, splits)."""
    pid_a, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    adapter, rows, row_ok = _lora_rows(pid_a, pid_m, idx_ptr, M, T, False, BLOCK_M)
    if (adapter < 0) | (tl.max(row_ok.to(tl.int32), 0) == 0):
        return  # no row of this tile uses this adapter (or "no adapter": the expand writes those zeros)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    a_base = a_ptr + adapter.to(tl.int64) * stride_aa
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK); other adapters' rows not read
        a = tl.load(a_base + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # (BK, BR): a tile of A^T
        acc = tl.dot(x, a, acc, input_precision=DOT_PREC)
    tl.store(h_ptr + pid_k * stride_hs + rows[:, None] * stride_hm + offs_r[None, :], acc,
             mask=row_ok[:, None] & r_ok[None, :])


@_jit
def _lora_expand_kernel(h_ptr, b_ptr, y_ptr, idx_ptr,
                        M, N_OUT, R, T, SPLIT_K,
                        stride_hs, stride_hm, stride_ba, stride_bn, stride_br, stride_ym, stride_yn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PREC: tl.constexpr):
    """y[m, n-tile] = round(sum_split h[split, m]) @ B[adapter, n-tile, :]^T, or zeros for rows without an adapter.
    Grid (1 + n_adapters, row tiles, output tiles)."""
    pid_a, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    adapter, rows, row_ok = _lora_rows(pid_a, pid_m, idx_ptr, M, T, True, BLOCK_M)
    if tl.max(row_ok.to(tl.int32), 0) == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = row_ok[:, None] & n_ok[None, :]
    if adapter < 0:
        tl.store(y_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=y_mask)
    else:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(SPLIT_K):
            h += tl.load(h_ptr + s * stride_hs + rows[:, None] * stride_hm + offs_r[None, :],
                         mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + adapter.to(tl.int64) * stride_ba + offs_r[:, None] * stride_br
                     + offs_n[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # (BR, BN): B^T
        y = tl.dot(h.to(bt.dtype), bt, input_precision=DOT_PREC)
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=y_mask)


def _check_lora(x, A, B):
    if x.dim() not in (2, 3) or A.dim() != 3 or B.dim() != 3:
        raise ValueError(f"multi_lora: x must be (N, in) or (N, T, in), A (n, r, in), B (n, out, r); got "
                         f"{tuple(x.shape)}, {tuple(A.shape)}, {tuple(B.shape)}")
    if A.size(0) != B.size(0) or A.size(2) != x.size(-1) or B.size(2) != A.size(1):
        raise ValueError(f"multi_lora: shapes do not chain: x {tuple(x.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}")
    if A.size(1) > MAX_LORA_RANK:
        raise ValueError(f"multi_lora kernel: rank {A.size(1)} > {MAX_LORA_RANK}; use multi_lora_ref")


def _lora_launch(x2, A, B, idx, T, split_k, block_m):
    """Shrink + expand on x2 (M, in), idx (M / T,): one adapter per group of T rows."""
    M, K = x2.shape
    n, R, N_OUT = A.size(0), A.size(1), B.size(1)
    y = torch.empty(M, N_OUT, dtype=x2.dtype, device=x2.device)
    if M == 0 or N_OUT == 0:
        return y
    programs = n
    fp32 = x2.dtype == torch.float32
    BLOCK_M = block_m or (16 if M <= 16 else 32 if M <= 32 else 64)
    BLOCK_R = _pow2(R)
    BLOCK_K = 32 if fp32 else 64
    BLOCK_N = 64 if (fp32 or M <= 64) else 128
    row_tiles = _cdiv(M, BLOCK_M)
    k_tiles = max(1, _cdiv(K, BLOCK_K))
    if split_k is None:  # enough programs to fill the GPU when there are few rows (decode); at most 8 partials
        busy = row_tiles * max(1, min(programs, 8))
        split_k = max(1, min(8, k_tiles, _num_sms(x2.device) // busy))
    k_per_split = _cdiv(k_tiles, split_k) * BLOCK_K
    split_k = max(1, _cdiv(K, k_per_split))
    h = torch.empty(split_k, M, R, dtype=torch.float32, device=x2.device)
    prec = _dot_precision(x2.dtype)
    stages = 2 if fp32 else 3
    if programs > 0 and R > 0:
        _lora_shrink_kernel[(programs, row_tiles, split_k)](
            x2, A, h, idx, M, K, R, T, k_per_split,
            x2.stride(0), x2.stride(1), A.stride(0), A.stride(1), A.stride(2), h.stride(0), h.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PREC=prec,
            num_warps=4, num_stages=stages)
    else:
        h.zero_()
    expand_programs = programs + 1
    if expand_programs > 0:
        _lora_expand_kernel[(expand_programs, row_tiles, _cdiv(N_OUT, BLOCK_N))](
            h, B, y, idx, M, N_OUT, R, T, split_k,
            h.stride(0), h.stride(1), B.stride(0), B.stride(1), B.stride(2), y.stride(0), y.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PREC=prec,
            num_warps=4, num_stages=stages)
    return y


def multi_lora_triton(x, A, B, idx, *, split_k=None, block_m=None):
    """Triton BGMV: same contract as multi_lora_ref. split_k / block_m override the launch heuristics (tests).
    idx must lie in [-1, n_adapters) (not checked: that would synchronize)."""
    _check_lora(x, A, B)
    if idx.shape != (x.size(0),):
        raise ValueError(f"multi_lora: idx must be ({x.size(0)},), got {tuple(idx.shape)}")
    squeeze = x.dim() == 2
    N, T = x.size(0), 1 if squeeze else x.size(1)
    idx = idx.contiguous()  # the kernels index idx as a flat array (a strided view would read the wrong rows)
    y = _lora_launch(x.reshape(N * T, x.size(-1)), A, B, idx, T, split_k, block_m)
    return y if squeeze else y.view(N, T, -1)


# At CPU inference the tuned form: cpu_tuning.enable() puts here a function (x, A, B) -> "stacked" | "grouped" that
# names the form measured faster on this machine at these shapes. None: the plain dispatch below.
cpu_lora_form = None


def multi_lora(x, A, B, idx):
    """Dispatch (same contract as multi_lora_ref): the Triton kernel on CUDA at inference; else the stacked form when
    it reads less than the reference would gather (always the case for the loops of a recursive model), or the
    reference. On CPU without gradients, where cpu_tuning is enabled, the form it measured faster (cpu_lora_form).
    Inside a compiled step (torch.compile, e.g. serve.py's graph-captured depth-wise step) the stacked form: plain
    tensor ops that trace into one graph, where the dispatch would time forms on a CPU or launch a kernel by hand."""
    if torch.compiler.is_compiling():
        return multi_lora_stacked(x, A, B, idx)
    if use_triton(x, A, B, idx) and _kernel_fits(x, A, B, rank=A.size(1)):
        return multi_lora_triton(x, A, B, idx)
    if cpu_lora_form is not None and x.device.type == "cpu" and not torch.is_grad_enabled() and A.size(0) > 1:
        return LORA_FORMS[cpu_lora_form(x, A, B)](x, A, B, idx)
    if A.size(0) <= x.size(0):  # the reference gathers one adapter per row: stacking reads fewer weights
        return multi_lora_stacked(x, A, B, idx)
    return multi_lora_ref(x, A, B, idx)


# ----------------------------------------------------------------------------------------------------------------
# Attention with log-sum-exp, and the exact merge of two attentions


def _expand_kv(k, n_head):
    """(B, H_kv, S, D) -> (B, H, S, D) by repeating each KV head for its query group (reference code only)."""
    return k.repeat_interleave(n_head // k.size(1), dim=1) if k.size(1) != n_head else k


def attention_lse_ref(q, k, v, mask, scale=None):
    """Reference. q (B, H, T, D); k, v (B, H_kv, S, D); mask bool broadcastable to (B, H, T, S), True = visible.

    -> out (B, H, T, D) in q's dtype, lse (B, H, T) in fp32 (fp64 for fp64 inputs; natural log). A row with no
    visible key gets out = 0 and lse = -inf (never NaN), so that merge_lse gives it no weight.
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


def attention_lse(q, k, v, mask, scale=None):
    """Dispatch for attention_lse_ref. An arbitrary dense mask has no tile structure for a kernel to exploit, so this
    is always the reference; the structured masks have kernels (gated_swa, dual_attention)."""
    return attention_lse_ref(q, k, v, mask, scale)


_FLEX = {}


def flex_attention_lse(q, k, v, block_mask, scale=None):
    """FlexAttention with its log-sum-exp (natural log, fp32): compiled on CUDA, eager elsewhere (CPU correctness
    never depends on torch.compile). q (B, H, T, D), k, v (B, H_kv, S, D), a BlockMask built once per batch ->
    out (B, H, T, D), lse (B, H, T). A row with no visible key: out 0, lse -inf. Differentiable."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if not torch.is_grad_enabled():  # no graph is recorded: FlexAttention on CPU refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():  # inside a compiled step the step's compile covers it
        if "fn" not in _FLEX:  # dynamic=None: a new shape (an eager decode step reads one key more each step)
            _FLEX["fn"] = torch.compile(flex_attention)  # recompiles once with that size symbolic, not per size
        fn = _FLEX["fn"]
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1),
                  return_aux=AuxRequest(lse=True))
    return out, aux.lse


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


# Building blocks of the attention kernels. Scores are kept in base 2: s = (q . k) * scale * log2(e), so that
# softmax uses exp2; m (running max) is in the same units, and lse = (m + log2(l)) * ln(2) at the end.


@_jit
def _query_rows(pid_m, hk, T, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of query tile pid_m: BLOCK_M // G queries times the G query heads of K/V head hk (GQA packing).
    -> t (query index), h (query head), row_ok."""
    r = tl.arange(0, BLOCK_M)
    t = pid_m * (BLOCK_M // G) + r // G
    h = hk * G + r % G
    return t, h, (r < (BLOCK_M // G) * G) & (t < T)


@_jit
def _row_ptrs(base, t, h, stride_t, stride_h, offs_d, stride_d):
    return base + t.to(tl.int64)[:, None] * stride_t + h[:, None] * stride_h + offs_d[None, :] * stride_d


@_jit
def _softmax_step(acc, m_i, l_i, s, v, DOT_PREC: tl.constexpr):
    """One online-softmax update with a score tile s (BM, BN) (base 2, -inf = masked) and its values v (BN, BD)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: p = 0, never NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@_jit
def _finish(acc, m_i, l_i):
    """-> out = acc / l (0 on rows with no visible key), lse in natural log (-inf on those rows)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return out, lse


@_jit
def _attend_keys(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, d_ok,
                 row_lo, row_hi, start, stop, n_keys, qk_scale,
                 MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key tiles [start, stop) of one K/V head. Row i sees keys row_lo[i] <= j <= row_hi[i]; the mask is applied
    only when MASKED (an unmasked range must be visible to every row)."""
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n < n_keys)[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if MASKED:
            vis = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] <= row_hi[:, None])
            s = tl.where(vis, s, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    return acc, m_i, l_i


@_jit
def _attend_interval(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, d_ok,
                     row_lo, row_hi, row_ok, n_keys, qk_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Attention of a row tile over keys where row i sees the interval row_lo[i] <= j <= row_hi[i] (causal,
    block-local and sliding-window masks are all of this form). -> acc, m, l of the online softmax.

    Only key tiles inside the union of the rows' intervals are visited, and those inside their intersection (seen
    by every row) run without a mask: [start, mid_lo) masked, [mid_lo, mid_hi) unmasked, [mid_hi, stop) masked.
    """
    lo_any = tl.maximum(tl.min(tl.where(row_ok, row_lo, n_keys), 0), 0)
    stop = tl.minimum(tl.max(tl.where(row_ok, row_hi, -1), 0) + 1, n_keys)
    lo_all = tl.max(tl.where(row_ok, row_lo, 0), 0)
    hi_all = tl.min(tl.where(row_ok, row_hi, n_keys), 0) + 1
    start = (lo_any // BLOCK_N) * BLOCK_N
    full_lo = ((lo_all + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = (hi_all // BLOCK_N) * BLOCK_N
    has_full = full_lo < full_hi
    mid_lo = tl.where(has_full, full_lo, stop)
    mid_hi = tl.where(has_full, full_hi, stop)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                 offs_d, d_ok, row_lo, row_hi, start, mid_lo, n_keys, qk_scale, True, BLOCK_N,
                                 DOT_PREC)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                 offs_d, d_ok, row_lo, row_hi, mid_lo, mid_hi, n_keys, qk_scale, False, BLOCK_N,
                                 DOT_PREC)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                 offs_d, d_ok, row_lo, row_hi, mid_hi, stop, n_keys, qk_scale, True, BLOCK_N,
                                 DOT_PREC)
    return acc, m_i, l_i


def _check_attention(name, q, k, v):
    """q (B, H, T, D), k = v shape (B, H_kv, S, D) -> B, H, H_kv, T, D, or a ValueError naming the problem."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"{name}: q must be (B, H, T, D) and k, v one (B, H_kv, S, D) shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.size(0) != B or k.size(3) != D:
        raise ValueError(f"{name}: batch/head dim of k {tuple(k.shape)} do not match q {tuple(q.shape)}")
    if k.size(1) == 0 or H % k.size(1) != 0:
        raise ValueError(f"{name}: {H} query heads is not a multiple of {k.size(1)} K/V heads")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{name} kernel: head dim {D} > {MAX_HEAD_DIM}; use the reference")
    return B, H, k.size(1), T, D


def _attn_config(D, dtype, n_queries, G, block_m=None, block_n=None, two_outputs=False):
    """Tile sizes and launch options of the attention kernels, chosen for an H100 (BLOCK_M counts (query, head)
    rows) -> BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages."""
    if dtype == torch.float32:  # IEEE fp32 dots run on the CUDA cores: small tiles
        bm, bn, warps, stages = 64, 32, 4, 2
    elif D <= 64:
        bm, bn, warps, stages = 128, 64, 4, 3
    elif D <= 128:  # gated SWA keeps y_local alive through the second pass: a smaller row tile
        bm, bn, warps, stages = (64, 64, 4, 3) if two_outputs else (128, 64, 8, 3)
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    bm = min(bm, _pow2(n_queries * G))  # decode / short inputs: no tile of empty rows
    bm = max(block_m or bm, _pow2(G))  # a whole GQA group fits one tile
    return bm, block_n or bn, _pow2(D), warps, stages


# ----------------------------------------------------------------------------------------------------------------
# PLT: gated sliding-window attention (Algorithm 3 of the PLT paper)


def swa_mask(T, window, device):
    """(T, T) bool: key j is visible to query i iff i - window < j <= i, i.e. exactly `window` keys including i."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & (j > i - window)


def ring_window_mask(ring_pos, q_pos, window):
    """The decode form of swa_mask: ring_pos (B, W) the position each ring slot holds (-1 = empty), q_pos (B,) ->
    (B, W) bool: slot visible iff q_pos - window < ring_pos <= q_pos."""
    return (ring_pos >= 0) & (ring_pos <= q_pos[:, None]) & (ring_pos > q_pos[:, None] - window)


def plt_gate(q, gate_w, gate_b):
    """g = sigmoid(<q_h, w_h> + b_h): one scalar per head and query. q (B, H, T, D) (after RoPE), gate_w (H, D),
    gate_b (H,) -> (B, H, T) fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return torch.sigmoid(torch.einsum("bhtd,hd->bht", q.to(acc), gate_w.to(acc)) + gate_b.to(acc)[None, :, None])


def gate_mix(q, gate_w, gate_b, y_local, y_global, gate=None):
    """G-SWA's mix, the PLT paper's convention: g * y_local + (1 - g) * y_global with g = plt_gate(q), in fp32.
    q (B, H, T, D); y_local, y_global (B, H, T, D) -> (B, H, T, D) fp32 (callers cast back to q's dtype).
    gate (B, H, T), optional: g computed by the caller (plt.py's gate from the residual stream); gate_w and gate_b
    are then not read (None)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    g = (plt_gate(q, gate_w, gate_b) if gate is None else gate.to(acc))[..., None]
    return g * y_local.to(g.dtype) + (1 - g) * y_global.to(g.dtype)


def gated_swa_ref(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None, *, gate=None):
    """Reference, prefill/training form. q (B, H, T, D) queries of a non-first loop; k, v (B, H_kv, T, D) that loop's
    own keys/values; k_shared, v_shared (B, H_kv, T, D) the first loop's keys/values at the same positions.

    y_local = attention over own keys j with i - window < j <= i; y_global = causal attention over the shared keys;
    g = plt_gate(q), or the caller's `gate` (B, H, T) where given (gate_w, gate_b None then);
    out = g * y_local + (1 - g) * y_global (the PLT paper's convention). -> (B, H, T, D)
    """
    T = q.size(2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    y_local, _ = attention_lse_ref(q, k, v, swa_mask(T, window, q.device), scale)
    y_global, _ = attention_lse_ref(q, k_shared, v_shared, causal, scale)
    return gate_mix(q, gate_w, gate_b, y_local, y_global, gate).to(q.dtype)


def gated_swa_sdpa(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None, *, gate=None):
    """The training path: gated_swa_ref's math on torch's fused attention (same contract, differentiable).

    y_local is SDPA with the banded bool mask swa_mask, y_global is SDPA with is_causal; GQA through enable_gqa (K/V
    never copied), then the same gate and fp32 mix as the reference. On CPU both branches run SDPA's flash kernel,
    forward and backward (bool mask and GQA included), which never materialises the (T, T) scores in fp32 as the
    reference's einsums do.
    """
    T = q.size(2)
    gqa = q.size(1) != k.size(1)
    y_local = F.scaled_dot_product_attention(q, k, v, attn_mask=swa_mask(T, window, q.device), scale=scale,
                                             enable_gqa=gqa)
    y_global = F.scaled_dot_product_attention(q, k_shared, v_shared, is_causal=True, scale=scale, enable_gqa=gqa)
    return gate_mix(q, gate_w, gate_b, y_local, y_global, gate).to(q.dtype)


# Prefill kernel: one program computes, for its row tile, y_local (interval [t - window + 1, t] over the loop's own
# K/V), y_global (interval [0, t] over the shared K/V), the gate from the q tile it already holds, and the mix, and
# writes only the mixed output: no y_local / y_global / gate tensors go through memory.


@_jit
def _gate_mix(q, y_local, y_global, gw_ptr, gb_ptr, h, row_ok, offs_d, d_ok, stride_gwh, stride_gwd, stride_gb):
    """out = g * y_local + (1 - g) * y_global with g = sigmoid(<q, w_h> + b_h) per row, in fp32."""
    w = tl.load(gw_ptr + h[:, None] * stride_gwh + offs_d[None, :] * stride_gwd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    g = tl.sigmoid(tl.sum(q.to(tl.float32) * w, 1) + tl.load(gb_ptr + h * stride_gb, mask=row_ok, other=0.0))
    return g[:, None] * y_local + (1.0 - g[:, None]) * y_global


@_jit
def _gated_swa_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, gw_ptr, gb_ptr, g_ptr, o_ptr,
                      stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
                      stride_vb, stride_vh, stride_vt, stride_vd, stride_ksb, stride_ksh, stride_kst, stride_ksd,
                      stride_vsb, stride_vsh, stride_vst, stride_vsd, stride_gwh, stride_gwd, stride_gb,
                      stride_gateb, stride_gateh, stride_gatet, stride_ob, stride_oh, stride_ot, stride_od,
                      H_KV, T, D, WINDOW, qk_scale,
                      G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      DOT_PREC: tl.constexpr, GATE_GIVEN: tl.constexpr):
    """Grid (query tiles, B * H_kv). GATE_GIVEN: g is read from g_ptr (B, H, T) instead of computed from q."""
    pid_m, pid_bk = tl.program_id(0), tl.program_id(1)
    b, hk = (pid_bk // H_KV).to(tl.int64), pid_bk % H_KV
    t, h, row_ok = _query_rows(pid_m, hk, T, G, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(_row_ptrs(q_ptr + b * stride_qb, t, h, stride_qt, stride_qh, offs_d, stride_qd),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc, m_i, l_i = _attend_interval(q, k_ptr + b * stride_kb + hk * stride_kh, v_ptr + b * stride_vb + hk * stride_vh,
                                     stride_kt, stride_kd, stride_vt, stride_vd, offs_d, d_ok,
                                     tl.maximum(t - WINDOW + 1, 0), t, row_ok, T, qk_scale,
                                     BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
    y_local, _ = _finish(acc, m_i, l_i)
    acc, m_i, l_i = _attend_interval(q, ks_ptr + b * stride_ksb + hk * stride_ksh,
                                     vs_ptr + b * stride_vsb + hk * stride_vsh,
                                     stride_kst, stride_ksd, stride_vst, stride_vsd, offs_d, d_ok,
                                     t * 0, t, row_ok, T, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
    y_global, _ = _finish(acc, m_i, l_i)
    # the reference rounds both branch outputs to the input dtype before the fp32 mix; do the same
    y_local = y_local.to(o_ptr.dtype.element_ty).to(tl.float32)
    y_global = y_global.to(o_ptr.dtype.element_ty).to(tl.float32)
    if GATE_GIVEN:
        g = tl.load(g_ptr + b * stride_gateb + h * stride_gateh + t * stride_gatet, mask=row_ok, other=0.0)
        out = g[:, None] * y_local + (1.0 - g[:, None]) * y_global
    else:
        out = _gate_mix(q, y_local, y_global, gw_ptr, gb_ptr, h, row_ok, offs_d, d_ok, stride_gwh, stride_gwd,
                        stride_gb)
    tl.store(_row_ptrs(o_ptr + b * stride_ob, t, h, stride_ot, stride_oh, offs_d, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_gate(name, gate_w, gate_b, H, D, window, gate=None, gate_shape=None):
    if gate is not None:
        if tuple(gate.shape) != tuple(gate_shape):
            raise ValueError(f"{name}: gate must be {tuple(gate_shape)}; got {tuple(gate.shape)}")
    elif gate_w is None or gate_b is None or gate_w.shape != (H, D) or gate_b.shape != (H,):
        raise ValueError(f"{name}: gate_w must be ({H}, {D}) and gate_b ({H},); got "
                         f"{None if gate_w is None else tuple(gate_w.shape)}, "
                         f"{None if gate_b is None else tuple(gate_b.shape)}")
    if int(window) < 1:
        raise ValueError(f"{name}: window must be >= 1, got {window}")


def gated_swa_triton(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None, *, gate=None, block_m=None,
                     block_n=None):
    """Triton kernel: same contract as gated_swa_ref. block_m / block_n override the tile sizes (tests)."""
    B, H, H_kv, T, D = _check_attention("gated_swa", q, k, v)
    if k.size(2) != T or k_shared.shape != k.shape or v_shared.shape != k.shape:
        raise ValueError(f"gated_swa: k, v, k_shared, v_shared must all be {(B, H_kv, T, D)}; got {tuple(k.shape)}, "
                         f"{tuple(k_shared.shape)}, {tuple(v_shared.shape)}")
    _check_gate("gated_swa", gate_w, gate_b, H, D, window, gate, (B, H, T))
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    if B * H * T == 0:
        return out
    G = H // H_kv
    BM, BN, BD, warps, stages = _attn_config(D, q.dtype, T, G, block_m, block_n, two_outputs=True)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    gw, gb, g, g_strides = _gate_args(gate_w, gate_b, gate)
    _gated_swa_kernel[(_cdiv(T, BM // G), B * H_kv)](
        q, k, v, k_shared, v_shared, gw, gb, g, out, *q.stride(), *k.stride(), *v.stride(), *k_shared.stride(),
        *v_shared.stride(), *gw.stride(), gb.stride(0), *g_strides, *out.stride(), H_kv, T, D,
        int(window), scale * LOG2E, G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, DOT_PREC=_dot_precision(q.dtype),
        GATE_GIVEN=gate is not None, num_warps=warps, num_stages=stages)
    return out


def _gate_args(gate_w, gate_b, gate):
    """The kernels' gate arguments -> (gate_w, gate_b, gate in fp32, gate's 3 strides), a dummy for the unused side."""
    if gate is None:
        return gate_w, gate_b, gate_w, (0, 0, 0)
    g = gate.float()
    dummy = g.new_zeros(1, 1)
    return dummy, dummy[0], g, g.stride()


def gated_swa(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale=None, *, gate=None):
    """Dispatch (contract of gated_swa_ref): the Triton kernel where use_triton allows it (CUDA, no gradient needed),
    otherwise gated_swa_sdpa, the differentiable path (training on any device, and everything on CPU).
    gated_swa_ref stays the readable reference the tests compare both against."""
    gates = (gate,) if gate is not None else (gate_w, gate_b)
    if use_triton(q, k, v, k_shared, v_shared, *gates) and _kernel_fits(q, k, v, k_shared, v_shared,
                                                                        head_dim=q.size(-1)):
        return gated_swa_triton(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale, gate=gate)
    return gated_swa_sdpa(q, k, v, k_shared, v_shared, gate_w, gate_b, window, scale, gate=gate)


def _gated_swa_decode(attend, q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                      scale, gate=None):
    """The decode form's math with `attend(q, k, v, mask, scale) -> y` as the attention (GQA inside it)."""
    B, L1, H, D = q.shape
    qq = q.reshape(B * L1, H, 1, D)
    local_ok = ring_window_mask(ring_pos, q_pos, window)  # (B, W)
    y_local = attend(qq, k_ring.flatten(0, 1), v_ring.flatten(0, 1),
                     local_ok.repeat_interleave(L1, dim=0)[:, None, None, :], scale)  # (B*L1, H, 1, D)
    glob_ok = torch.arange(k_shared.size(2), device=q.device)[None, :] <= q_pos[:, None]  # (B, S)
    # (B, H, L1, D): the loops share the shared keys and the mask
    y_global = attend(q.transpose(1, 2), k_shared, v_shared, glob_ok[:, None, None, :], scale)
    y_global = y_global.transpose(1, 2).reshape(B * L1, H, 1, D)
    g = gate.reshape(B * L1, H, 1) if gate is not None else None
    return gate_mix(qq, gate_w, gate_b, y_local, y_global, g).reshape(B, L1, H, D).to(q.dtype)


def gated_swa_decode_ref(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale=None,
                         *, gate=None):
    """Reference, decode form: the L1 = L - 1 non-first loops of B sequences, one query each, all at position q_pos.

    q (B, L1, H, D); k_ring, v_ring (B, L1, H_kv, W, D) each loop's ring buffer of its last W = window keys/values;
    ring_pos (B, W) long, the position held by each slot (-1 = empty; the same for every loop); k_shared, v_shared
    (B, H_kv, S, D) the first loop's cache, which already holds position q_pos; q_pos (B,) long.
    Local keys: slots with q_pos - window < ring_pos <= q_pos. Global keys: shared positions j <= q_pos.
    gate (B, L1, H), optional: g given by the caller instead of plt_gate(q) (gate_w, gate_b None then).
    -> (B, L1, H, D)
    """
    return _gated_swa_decode(lambda q, k, v, m, s: attention_lse_ref(q, k, v, m, s)[0], q, k_ring, v_ring, ring_pos,
                             k_shared, v_shared, q_pos, gate_w, gate_b, window, scale, gate)


# At CPU inference the tuned attention: cpu_tuning.enable() puts here its attend(q, k, v, mask=, scale=), the form of
# model.attend measured fastest on this machine, so that G-SWA's decode attentions run in the same form as every other
# decode attention. None: SDPA.
cpu_decode_attend = None


def gated_swa_decode_sdpa(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                          scale=None, *, gate=None):
    """The CPU decode path: gated_swa_decode_ref's math (same contract) on torch's fused attention, two SDPA calls
    (the rings with their slot mask, the shared cache with j <= q_pos) with GQA through enable_gqa, then the same
    gate and fp32 mix. The reference's explicit softmax with log-sum-exp costs ~30 small ops per layer and step.
    Where cpu_tuning is enabled, cpu_decode_attend replaces SDPA in both calls."""
    def sdpa(q, k, v, mask, scale):
        if cpu_decode_attend is not None:
            return cpu_decode_attend(q, k, v, mask=mask, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1))

    return _gated_swa_decode(sdpa, q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                             scale, gate)


# Decode kernels (flash-decoding). The expensive read is the shared cache, which every loop and every query head
# of a GQA group shares: one program per (sequence, K/V head, split of the shared keys) holds all L1 * G query rows,
# so each shared K/V tile is read once. Splitting the shared keys over programs keeps the GPU busy at small batch.
# Further programs of the same grid attend over each loop's ring buffer. Each program writes (m, l, acc) partials;
# a second, small kernel merges the splits, adds the gate and mixes.


@_jit
def _gswa_decode_partial_kernel(q_ptr, kr_ptr, vr_ptr, rpos_ptr, ks_ptr, vs_ptr, qpos_ptr, ml_ptr, acc_ptr,
                                stride_qb, stride_ql, stride_qh, stride_qd,
                                stride_krb, stride_krl, stride_krh, stride_krw, stride_krd,
                                stride_vrb, stride_vrl, stride_vrh, stride_vrw, stride_vrd, stride_rb, stride_rw,
                                stride_ksb, stride_ksh, stride_kss, stride_ksd,
                                stride_vsb, stride_vsh, stride_vss, stride_vsd, stride_qpos,
                                H_KV, L1, W, S, D, WINDOW, CHUNK, NSPLIT, qk_scale,
                                G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (B * H_kv, NSPLIT + L1): part < NSPLIT attends over shared keys [part*CHUNK, (part+1)*CHUNK) with all
    rows; part = NSPLIT + l attends over loop l's ring with the rows of loop l. Rows r = (loop r // G, head r % G)."""
    pid, part = tl.program_id(0), tl.program_id(1)
    b, hk = (pid // H_KV).to(tl.int64), pid % H_KV
    r = tl.arange(0, BLOCK_M)
    loop, h = r // G, hk * G + r % G
    row_ok = r < L1 * G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qp = tl.load(qpos_ptr + b * stride_qpos).to(tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if part < NSPLIT:  # shared (first-loop) keys j <= q_pos of this split
        keep = row_ok
        slot = part
        q = tl.load(_row_ptrs(q_ptr + b * stride_qb, loop, h, stride_ql, stride_qh, offs_d, stride_qd),
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        k_base = ks_ptr + b * stride_ksb + hk * stride_ksh
        v_base = vs_ptr + b * stride_vsb + hk * stride_vsh
        stop = tl.minimum(tl.minimum(part * CHUNK + CHUNK, qp + 1), S)
        for n0 in range(part * CHUNK, stop, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < stop
            k = tl.load(k_base + offs_n[:, None] * stride_kss + offs_d[None, :] * stride_ksd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vss + offs_d[None, :] * stride_vsd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    else:  # loop lp's ring buffer: slots holding positions q_pos - window < p <= q_pos
        lp = part - NSPLIT
        keep = row_ok & (loop == lp)
        slot = NSPLIT
        q = tl.load(_row_ptrs(q_ptr + b * stride_qb, loop, h, stride_ql, stride_qh, offs_d, stride_qd),
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        k_base = kr_ptr + b * stride_krb + lp * stride_krl + hk * stride_krh
        v_base = vr_ptr + b * stride_vrb + lp * stride_vrl + hk * stride_vrh
        for n0 in range(0, W, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            rp = tl.load(rpos_ptr + b * stride_rb + offs_n * stride_rw, mask=offs_n < W, other=-1).to(tl.int32)
            n_ok = (rp >= 0) & (rp <= qp) & (rp > qp - WINDOW)
            k = tl.load(k_base + offs_n[:, None] * stride_krw + offs_d[None, :] * stride_krd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vrw + offs_d[None, :] * stride_vrd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    ws = pid.to(tl.int64) * (NSPLIT + 1) + slot  # workspace: ml (B*H_kv, NSPLIT+1, 2, BM), acc (.., BM, BD)
    tl.store(ml_ptr + ws * 2 * BLOCK_M + r, m_i, mask=keep)
    tl.store(ml_ptr + ws * 2 * BLOCK_M + BLOCK_M + r, l_i, mask=keep)
    tl.store(acc_ptr + ws * BLOCK_M * BLOCK_D + r[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])


@_jit
def _gswa_decode_combine_kernel(q_ptr, gw_ptr, gb_ptr, g_ptr, ml_ptr, acc_ptr, o_ptr,
                                stride_qb, stride_ql, stride_qh, stride_qd, stride_gwh, stride_gwd, stride_gb,
                                stride_gateb, stride_gatel, stride_gateh,
                                stride_ob, stride_ol, stride_oh, stride_od, H_KV, L1, D, NSPLIT,
                                G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                                GATE_GIVEN: tl.constexpr):
    """Grid (B * H_kv,): merge the shared-key splits (one softmax), normalize the ring part, gate and mix.
    GATE_GIVEN: g is read from g_ptr (B, L1, H) instead of computed from q."""
    pid = tl.program_id(0)
    b, hk = (pid // H_KV).to(tl.int64), pid % H_KV
    r = tl.arange(0, BLOCK_M)
    loop, h = r // G, hk * G + r % G
    row_ok = r < L1 * G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    ws0 = pid.to(tl.int64) * (NSPLIT + 1)
    m_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(NSPLIT):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (ws0 + s) * 2 * BLOCK_M + r, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_g = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for s in range(NSPLIT):
        w = tl.exp2(tl.load(ml_ptr + (ws0 + s) * 2 * BLOCK_M + r, mask=row_ok, other=float("-inf")) - m_use)
        l_g += w * tl.load(ml_ptr + (ws0 + s) * 2 * BLOCK_M + BLOCK_M + r, mask=row_ok, other=0.0)
        acc_g += w[:, None] * tl.load(acc_ptr + (ws0 + s) * BLOCK_M * BLOCK_D + r[:, None] * BLOCK_D + offs_d[None, :],
                                      mask=row_ok[:, None], other=0.0)
    y_global = acc_g / tl.where(l_g == 0.0, 1.0, l_g)[:, None]
    l_loc = tl.load(ml_ptr + (ws0 + NSPLIT) * 2 * BLOCK_M + BLOCK_M + r, mask=row_ok, other=0.0)
    acc_loc = tl.load(acc_ptr + (ws0 + NSPLIT) * BLOCK_M * BLOCK_D + r[:, None] * BLOCK_D + offs_d[None, :],
                      mask=row_ok[:, None], other=0.0)
    y_local = acc_loc / tl.where(l_loc == 0.0, 1.0, l_loc)[:, None]
    y_local = y_local.to(o_ptr.dtype.element_ty).to(tl.float32)  # rounded like the reference's branch outputs
    y_global = y_global.to(o_ptr.dtype.element_ty).to(tl.float32)
    if GATE_GIVEN:
        g = tl.load(g_ptr + b * stride_gateb + loop * stride_gatel + h * stride_gateh, mask=row_ok, other=0.0)
        out = g[:, None] * y_local + (1.0 - g[:, None]) * y_global
    else:
        q = tl.load(_row_ptrs(q_ptr + b * stride_qb, loop, h, stride_ql, stride_qh, offs_d, stride_qd),
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        out = _gate_mix(q, y_local, y_global, gw_ptr, gb_ptr, h, row_ok, offs_d, d_ok, stride_gwh, stride_gwd,
                        stride_gb)
    tl.store(_row_ptrs(o_ptr + b * stride_ob, loop, h, stride_ol, stride_oh, offs_d, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def gated_swa_decode_triton(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                            scale=None, *, gate=None, num_splits=None, block_n=None):
    """Triton kernels: same contract as gated_swa_decode_ref. num_splits / block_n override the heuristics (tests)."""
    if q.dim() != 4 or k_ring.dim() != 5 or k_ring.shape != v_ring.shape or k_shared.dim() != 4 \
            or k_shared.shape != v_shared.shape:
        raise ValueError(f"gated_swa_decode: q (B, L1, H, D), k_ring = v_ring (B, L1, H_kv, W, D), k_shared = "
                         f"v_shared (B, H_kv, S, D) expected; got {tuple(q.shape)}, {tuple(k_ring.shape)}, "
                         f"{tuple(v_ring.shape)}, {tuple(k_shared.shape)}, {tuple(v_shared.shape)}")
    B, L1, H, D = q.shape
    H_kv, W, S = k_ring.size(2), k_ring.size(3), k_shared.size(2)
    if k_ring.shape[:2] != (B, L1) or k_ring.size(4) != D or k_shared.shape[:2] != (B, H_kv) \
            or k_shared.size(3) != D or ring_pos.shape != (B, W) or q_pos.shape != (B,):
        raise ValueError(f"gated_swa_decode: inconsistent shapes q {tuple(q.shape)}, k_ring {tuple(k_ring.shape)}, "
                         f"ring_pos {tuple(ring_pos.shape)}, k_shared {tuple(k_shared.shape)}, q_pos "
                         f"{tuple(q_pos.shape)}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"gated_swa_decode: {H} query heads is not a multiple of {H_kv} K/V heads")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"gated_swa_decode kernel: head dim {D} > {MAX_HEAD_DIM}; use the reference")
    _check_gate("gated_swa_decode", gate_w, gate_b, H, D, window, gate, (B, L1, H))
    out = torch.empty(B, L1, H, D, dtype=q.dtype, device=q.device)
    if B * L1 * H == 0:
        return out
    G = H // H_kv
    BM, BD = _pow2(L1 * G), _pow2(D)
    fp32 = q.dtype == torch.float32
    BN = block_n or (32 if fp32 else 64)
    if num_splits is None:  # about two programs per SM for the shared keys, each at least 256 keys long
        num_splits = max(1, min(_cdiv(S, 256), _cdiv(2 * _num_sms(q.device), B * H_kv)))
    chunk = max(BN, _cdiv(_cdiv(max(S, 1), num_splits), BN) * BN)
    num_splits = max(1, _cdiv(S, chunk))
    ml = torch.empty(B * H_kv, num_splits + 1, 2, BM, dtype=torch.float32, device=q.device)
    acc = torch.empty(B * H_kv, num_splits + 1, BM, BD, dtype=torch.float32, device=q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    prec, stages = _dot_precision(q.dtype), (2 if fp32 else 3)
    _gswa_decode_partial_kernel[(B * H_kv, num_splits + L1)](
        q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, ml, acc, *q.stride(), *k_ring.stride(),
        *v_ring.stride(), *ring_pos.stride(), *k_shared.stride(), *v_shared.stride(), q_pos.stride(0),
        H_kv, L1, W, S, D, int(window), chunk, num_splits, scale * LOG2E,
        G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, DOT_PREC=prec, num_warps=4, num_stages=stages)
    gw, gb, g, g_strides = _gate_args(gate_w, gate_b, gate)
    _gswa_decode_combine_kernel[(B * H_kv,)](
        q, gw, gb, g, ml, acc, out, *q.stride(), *gw.stride(), gb.stride(0), *g_strides,
        *out.stride(), H_kv, L1, D, num_splits, G=G, BLOCK_M=BM, BLOCK_D=BD, GATE_GIVEN=gate is not None,
        num_warps=4)
    return out


@torch.library.custom_op("nano_inference::gated_swa_decode", mutates_args=())
def _gated_swa_decode_op(q: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, ring_pos: torch.Tensor,
                         k_shared: torch.Tensor, v_shared: torch.Tensor, q_pos: torch.Tensor,
                         gate_w: torch.Tensor | None, gate_b: torch.Tensor | None, window: int, scale: float | None,
                         gate: torch.Tensor | None) -> torch.Tensor:
    """gated_swa_decode_triton as one opaque operator of a compiled graph (PLT's compiled decode step): dynamo does
    not trace the launch code, and a CUDA graph captures the two launches like any other kernel."""
    return gated_swa_decode_triton(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                                   scale, gate=gate)


@_gated_swa_decode_op.register_fake
def _(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale, gate):
    return torch.empty_like(q)


def gated_swa_decode(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale=None, *,
                     gate=None):
    """Dispatch (contract of gated_swa_decode_ref): the Triton kernels where use_triton allows it (inside a compiled
    step through their operator, _gated_swa_decode_op), otherwise gated_swa_decode_sdpa; the reference stays what
    the tests compare both against."""
    gates = (gate,) if gate is not None else (gate_w, gate_b)
    if use_triton(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, *gates) and \
            _kernel_fits(q, k_ring, v_ring, k_shared, v_shared, head_dim=q.size(-1)):
        if torch.compiler.is_compiling():
            return _gated_swa_decode_op(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                                        scale, gate)
        return gated_swa_decode_triton(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window,
                                       scale, gate=gate)
    return gated_swa_decode_sdpa(q, k_ring, v_ring, ring_pos, k_shared, v_shared, q_pos, gate_w, gate_b, window, scale,
                                 gate=gate)


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


# Kernel: the paper's "ideal method" (section 3.1, left to future work there). One program walks the self keys, then
# the cross keys, with ONE running (max, sum, acc): the result is the softmax over the union of both key sets, i.e.
# exactly the LSE merge of the reference, without a second pass, a second output or the merge. Positions and block
# ids are arbitrary per key (padding included), so each key tile is classified from the min/max of its ids against
# the min/max of the row tile's: a tile that no row can see is skipped before its K/V are loaded, a tile that every
# row sees in full runs without a mask, the rest are masked element-wise.

_BIG = 2 ** 62  # neutral element of the min/max summaries (padding ids are "huge", so never BIG itself)


@_jit
def _dual_attention_kernel(q_ptr, qpos_ptr, qblk_ptr, ks_ptr, vs_ptr, spos_ptr, sblk_ptr, kc_ptr, vc_ptr, cblk_ptr,
                           o_ptr, lse_ptr,
                           stride_qb, stride_qh, stride_qt, stride_qd, stride_qpb, stride_qpt, stride_qbb, stride_qbt,
                           stride_ksb, stride_ksh, stride_kss, stride_ksd, stride_vsb, stride_vsh, stride_vss,
                           stride_vsd, stride_spb, stride_sps, stride_sbb, stride_sbs,
                           stride_kcb, stride_kch, stride_kcs, stride_kcd, stride_vcb, stride_vch, stride_vcs,
                           stride_vcd, stride_cbb, stride_cbs,
                           stride_ob, stride_oh, stride_ot, stride_od, stride_lb, stride_lh,
                           H_KV, T, S1, S2, D, qk_scale, BIG,
                           G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PREC: tl.constexpr):
    """Grid (query tiles, B * H_kv)."""
    pid_m, pid_bk = tl.program_id(0), tl.program_id(1)
    b, hk = (pid_bk // H_KV).to(tl.int64), pid_bk % H_KV
    t, h, row_ok = _query_rows(pid_m, hk, T, G, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(_row_ptrs(q_ptr + b * stride_qb, t, h, stride_qt, stride_qh, offs_d, stride_qd),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qp = tl.load(qpos_ptr + b * stride_qpb + t * stride_qpt, mask=row_ok, other=0)
    qb = tl.load(qblk_ptr + b * stride_qbb + t * stride_qbt, mask=row_ok, other=0)
    qb_lo, qb_hi = tl.min(tl.where(row_ok, qb, BIG), 0), tl.max(tl.where(row_ok, qb, -BIG), 0)
    qp_lo, qp_hi = tl.min(tl.where(row_ok, qp, BIG), 0), tl.max(tl.where(row_ok, qp, -BIG), 0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # self keys: visible iff s_blk == q_blk and s_pos <= q_pos
    ks_base, vs_base = ks_ptr + b * stride_ksb + hk * stride_ksh, vs_ptr + b * stride_vsb + hk * stride_vsh
    for n0 in range(0, S1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S1
        sb = tl.load(sblk_ptr + b * stride_sbb + offs_n * stride_sbs, mask=n_ok, other=0)
        sp = tl.load(spos_ptr + b * stride_spb + offs_n * stride_sps, mask=n_ok, other=0)
        sb_lo, sb_hi = tl.min(tl.where(n_ok, sb, BIG), 0), tl.max(tl.where(n_ok, sb, -BIG), 0)
        sp_lo, sp_hi = tl.min(tl.where(n_ok, sp, BIG), 0), tl.max(tl.where(n_ok, sp, -BIG), 0)
        if (sb_hi >= qb_lo) & (sb_lo <= qb_hi) & (sp_lo <= qp_hi):  # some row may see some key of this tile
            k = tl.load(ks_base + offs_n[:, None] * stride_kss + offs_d[None, :] * stride_ksd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(vs_base + offs_n[:, None] * stride_vss + offs_d[None, :] * stride_vsd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            # every row sees every key only if all ids are one block and all key positions <= every query position
            if (sb_lo != sb_hi) | (qb_lo != qb_hi) | (sb_lo != qb_lo) | (sp_hi > qp_lo) | (n0 + BLOCK_N > S1):
                vis = (sb[None, :] == qb[:, None]) & (sp[None, :] <= qp[:, None]) & n_ok[None, :]
                s = tl.where(vis, s, float("-inf"))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    # cross keys: visible iff c_blk < q_blk; the same running softmax continues
    kc_base, vc_base = kc_ptr + b * stride_kcb + hk * stride_kch, vc_ptr + b * stride_vcb + hk * stride_vch
    for n0 in range(0, S2, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S2
        cb = tl.load(cblk_ptr + b * stride_cbb + offs_n * stride_cbs, mask=n_ok, other=0)
        cb_lo, cb_hi = tl.min(tl.where(n_ok, cb, BIG), 0), tl.max(tl.where(n_ok, cb, -BIG), 0)
        if cb_lo < qb_hi:
            k = tl.load(kc_base + offs_n[:, None] * stride_kcs + offs_d[None, :] * stride_kcd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(vc_base + offs_n[:, None] * stride_vcs + offs_d[None, :] * stride_vcd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if (cb_hi >= qb_lo) | (n0 + BLOCK_N > S2):
                vis = (cb[None, :] < qb[:, None]) & n_ok[None, :]
                s = tl.where(vis, s, float("-inf"))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PREC)
    out, lse = _finish(acc, m_i, l_i)
    tl.store(_row_ptrs(o_ptr + b * stride_ob, t, h, stride_ot, stride_oh, offs_d, stride_od),
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + t, lse, mask=row_ok)


def dual_attention_triton(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None, *,
                          block_m=None, block_n=None):
    """Triton kernel: same contract as dual_attention_ref. block_m / block_n override the tile sizes (tests)."""
    B, H, H_kv, T, D = _check_attention("dual_attention (self keys)", q, k_s, v_s)
    _check_attention("dual_attention (cross keys)", q, k_c, v_c)
    if k_c.size(1) != H_kv:
        raise ValueError(f"dual_attention: self and cross keys have {H_kv} and {k_c.size(1)} heads")
    S1, S2 = k_s.size(2), k_c.size(2)
    for name, x, n in (("q_pos", q_pos, T), ("q_blk", q_blk, T), ("s_pos", s_pos, S1), ("s_blk", s_blk, S1),
                       ("c_blk", c_blk, S2)):
        if x.shape != (B, n) or x.is_floating_point():
            raise ValueError(f"dual_attention: {name} must be an integer tensor of shape ({B}, {n}), got "
                             f"{tuple(x.shape)} {x.dtype}")
    out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if B * H * T == 0:
        return out, lse
    G = H // H_kv
    BM, BN, BD, warps, stages = _attn_config(D, q.dtype, T, G, block_m, block_n)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    _dual_attention_kernel[(_cdiv(T, BM // G), B * H_kv)](
        q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, out, lse,
        *q.stride(), *q_pos.stride(), *q_blk.stride(), *k_s.stride(), *v_s.stride(), *s_pos.stride(),
        *s_blk.stride(), *k_c.stride(), *v_c.stride(), *c_blk.stride(), *out.stride(), lse.stride(0), lse.stride(1),
        H_kv, T, S1, S2, D, scale * LOG2E, _BIG,
        G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, DOT_PREC=_dot_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out, lse


def dual_attention_flex(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None):
    """The stock GPU path, same contract as dual_attention_ref: the two key sets' block masks from the ids, one
    FlexAttention with log-sum-exp over each (flex_attention_lse: compiled on CUDA, eager elsewhere), merge_lse."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T, S1, S2 = q.size(0), q.size(2), k_s.size(2), k_c.size(2)

    def self_mod(b, h, i, j):
        return (s_blk[b, j] == q_blk[b, i]) & (s_pos[b, j] <= q_pos[b, i])

    def cross_mod(b, h, i, j):
        return c_blk[b, j] < q_blk[b, i]

    o1, l1 = flex_attention_lse(q, k_s, v_s, create_block_mask(self_mod, B, None, T, S1, device=q.device), scale)
    o2, l2 = flex_attention_lse(q, k_c, v_c, create_block_mask(cross_mod, B, None, T, S2, device=q.device), scale)
    return merge_lse(o1, l1, o2, l2)


def dual_attention(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None):
    """Dispatch for dual_attention_ref (same contract). Where use_triton allows a kernel (CUDA, no gradient needed)
    this op runs dual_attention_flex, not its Triton kernel: the kernel's tiles were never tuned on a GPU, and on the
    one GPU measured (RESULTS.md, "On a GPU") two compiled FlexAttention calls beat it, so the kernel is not yet worth
    dispatching to. It stays public (dual_attention_triton) for `bench.py kernels` and the tests, which run it
    against the reference. Otherwise (CPU, gradients, head dims below FLEX_MIN_HEAD_DIM) the reference."""
    if use_triton(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk) and \
            _kernel_fits(q, k_s, v_s, k_c, v_c, head_dim=q.size(-1)) and q.size(-1) >= FLEX_MIN_HEAD_DIM:
        return dual_attention_flex(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale)
    return dual_attention_ref(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale)
