"""
bench_kernels.py -- the Triton kernels of kernels.py (`python bench.py kernels`, CUDA): each against its reference
and stock PyTorch (FlexAttention, SDPA), with the error beside the time; and (`kernels --aot`, no GPU needed) every
kernel compiled ahead of time for real GPU targets: shared memory, registers, spills.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

import kernels as K
from harness import kernels_aot
from harness.bench_common import med
from harness.cli import UsageError
from harness.device import pick_device, pick_dtype, timeit

# ----------------------------------------------------------------------------------------------------------------
# Kernels: python bench.py kernels (CUDA; each Triton kernel of kernels.py vs its reference and stock PyTorch)


def kernel_us(fn, device, warmup=10, iters=50) -> float:
    """Median time of one fn() call in microseconds, warm-up excluded (the warm-up also covers torch.compile and the
    Triton JIT).

    CUDA: a CUDA event pair around each call, with L2 flushed before each call (in a real forward pass the weights and
    caches of this layer are not in L2), and torch.cuda.synchronize() before the events are read. Other devices:
    device.timeit's wall clock.
    """
    if device.type != "cuda":
        return med(timeit(fn, device, warmup, iters)) * 1e6
    for _ in range(warmup):
        fn()
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for i in range(iters):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2] * 1e3


def _report(impl, us, nbytes=None, flops=None, base_us=None):
    bw = f"{nbytes / us / 1e3:9.1f} GB/s" if nbytes else " " * 14
    fl = f"{flops / us / 1e6:8.1f} TFLOP/s" if flops else " " * 16
    rel = f"   kernel is {us / base_us:5.2f}x faster" if base_us and us != base_us else ""
    print(f"    {impl:44s} {us:11.1f} us  {bw} {fl}{rel}")


def _maxerr(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _flex_lse():
    """(q, k, v, block_mask, scale=None, lse=True) -> (out, lse or None) through kernels.flex_attention_lse, or None
    when this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None

    def attn(q, k, v, block_mask, scale=None, lse=True):
        if lse:
            return K.flex_attention_lse(q, k, v, block_mask, scale)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1)), None
    return attn


def _random_blocks(T, n_blocks, gen, device):
    """Block ids (T,) of a random partition into n_blocks blocks (split points drawn as the double decoder does)."""
    splits = torch.randperm(T - 3, generator=gen)[: n_blocks - 1].sort().values + 2
    return torch.bucketize(torch.arange(T), splits, right=True).to(device)


def bench_aot(args):
    """`bench.py kernels --aot`: every Triton kernel compiled ahead of time for real GPU targets on this machine (no
    GPU needed): per kernel, launch case and target the shared memory against the target's limit, registers and
    spills (kernels_aot.aot_report; ~3 minutes for every case of every preset on 2 cores)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise UsageError("--aot compiles for a GPU: run it without TRITON_INTERPRET in the environment")
    targets = tuple(int(t) for t in args.aot_targets.split(","))
    cases = [c for c in kernels_aot.aot_cases() if not args.only or any(k in c.name for k in args.only.split(","))]
    if not cases:
        raise UsageError(f"--only {args.only}: no launch case name contains it (python bench.py kernels --aot runs "
                         f"them all)")
    print(f"triton {K.triton.__version__} | ahead-of-time compilation for {', '.join(f'sm_{t}' for t in targets)} | "
          f"{len(cases)} launch cases (the presets' shapes, decode and prefill, fp32/bf16/fp16)")
    print(f"{'kernel':28s} {'case':34s} {'target':6s} {'dtype':8s} {'shared':>14s} {'regs':>5s} {'spills':>7s}  error")
    rows = kernels_aot.aot_report(targets, cases)
    for r in rows:
        shared = f"{r['shared']}/{r['shared_limit']}" if r["shared"] is not None else "-"
        print(f"{r['kernel']:28s} {r['case'][:34]:34s} {r['target']:6s} {r['dtype']:8s} {shared:>14s} "
              f"{str(r['regs']):>5s} {str(r['spills']):>7s}  {r['error'] or ''}")
    bad = [r for r in rows if r["error"] or (r["shared"] or 0) > r["shared_limit"]]
    print(f"{len(rows)} compiles, {len(bad)} failed or over the shared-memory limit, "
          f"{sum(1 for r in rows if r['spills'])} with register spills")


KERNELS = ("lora", "gswa", "gswa_decode", "dual")  # bench.py kernels --only


def bench_kernels(args):
    if args.aot:
        return bench_aot(args)
    unknown = [k for k in args.only.split(",") if args.only and k not in KERNELS]
    if unknown:
        raise UsageError(f"--only {args.only}: {', '.join(unknown)} is not one of {', '.join(KERNELS)}")
    dev = pick_device(args.device)
    dtype = pick_dtype(dev, args.dtype)
    cuda = dev.type == "cuda"
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    triton = K.triton.__version__ if K.triton else None
    print(f"device {gpu}  dtype {dtype}  torch {torch.__version__}  triton {triton}")
    if not cuda:
        print("Triton kernels need CUDA: timing the references and stock alternatives only, at small shapes. "
              "CPU figures say nothing about the GPU targets; do not record them.")
    gen = torch.Generator().manual_seed(0)
    esz = torch.finfo(dtype).bits // 8
    run_triton = cuda and K.triton is not None
    flex = _flex_lse() if cuda else None
    want = set(args.only.split(",")) if args.only else set(KERNELS)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    iters = args.iters if args.iters is not None else (50 if cuda else 3)
    print(f"warm-up {warmup} calls, then the median (CUDA events) / mean (CPU clock) of {iters} timed calls")

    def ktime(fn, heavy=False):  # heavy: the dense references (T x T scores), fewer calls
        return kernel_us(fn, dev, min(warmup, 3) if heavy else warmup, min(iters, 10) if heavy else iters)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=dev, dtype=dtype)

    with torch.no_grad():
        if "lora" in want:
            # decode: batch 64 rows at 4 different loops (adapters), r = 64, d = 2048 (the target shape)
            N, d, r, n = (64, 2048, 64, 4) if cuda else (16, 256, 16, 4)
            x, W = rnd(N, d), rnd(d, d, s=d ** -0.5)
            A, Bm = rnd(n, r, d, s=d ** -0.5), rnd(n, d, r, s=r ** -0.5)
            idx = torch.randint(0, n, (N,), generator=gen).to(dev)

            def loop_over_adapters():
                y = torch.zeros(N, d, device=dev, dtype=dtype)
                for a in range(n):
                    rows = (idx == a).nonzero().squeeze(1)
                    y.index_copy_(0, rows, (x[rows] @ A[a].T) @ Bm[a].T)
                return y

            print(f"\nmulti_lora (BGMV, decode)  rows {N}  in = out = {d}  r {r}  adapters {n}  {dtype}")
            nbytes = esz * (2 * N * d + n * r * 2 * d)
            flops = 2 * N * r * 2 * d
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.multi_lora_triton(x, A, Bm, idx))
                err = _maxerr(K.multi_lora_triton(x, A, Bm, idx), K.multi_lora_ref(x, A, Bm, idx))
                print(f"    max |kernel - reference| = {err:.2e}")
                _report("triton shrink+expand", t_k, nbytes, flops)
            _report("reference: gather + bmm", ktime(lambda: K.multi_lora_ref(x, A, Bm, idx)), nbytes, flops, t_k)
            _report("stacked adapters, masked (the CPU path)", ktime(lambda: K.multi_lora_stacked(x, A, Bm, idx)),
                    nbytes, flops, t_k)
            _report("python loop over adapters", ktime(loop_over_adapters), nbytes, flops, t_k)
            t_base = ktime(lambda: F.linear(x, W))
            _report(f"base GEMM ({N} x {d} x {d}) it rides on", t_base, esz * (d * d + 2 * N * d), 2 * N * d * d)
            if t_k:
                print(f"    LoRA costs {100 * t_k / t_base:.0f}% of the base GEMM")

        Bt, H, Hkv, T, D = (4, 16, 4, 2048, 128) if cuda else (1, 4, 2, 128, 32)
        scale = 1.0 / math.sqrt(D)
        pos_b = torch.arange(T, device=dev)[None].expand(Bt, T).contiguous()

        if "gswa" in want:
            window = 64
            q, k, v, ks, vs = (rnd(Bt, H, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D),
                               rnd(Bt, Hkv, T, D))
            gw, gb = rnd(H, D, s=D ** -0.5), rnd(H)
            pairs = Bt * H * (T * (T + 1) // 2 + int(K.swa_mask(T, window, dev).sum()))
            flops, nbytes = 4 * D * pairs, esz * (2 * Bt * H * T * D + 4 * Bt * Hkv * T * D)
            print(f"\ngated_swa (prefill)  B {Bt}  H {H}/{Hkv}  T {T}  D {D}  window {window}  {dtype}")
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.gated_swa_triton(q, k, v, ks, vs, gw, gb, window))
                err = _maxerr(K.gated_swa_triton(q, k, v, ks, vs, gw, gb, window),
                              K.gated_swa_ref(q, k, v, ks, vs, gw, gb, window))
                print(f"    max |kernel - reference| = {err:.2e}")
                _report("triton (one kernel)", t_k, nbytes, flops)
            _report("reference (dense scores)", ktime(lambda: K.gated_swa_ref(q, k, v, ks, vs, gw, gb, window),
                                                       heavy=True), nbytes, flops, t_k)

            def gate_mix(q, y_loc, y_glob):
                g = K.plt_gate(q, gw, gb)[..., None]
                return (g * y_loc.float() + (1 - g) * y_glob.float()).to(q.dtype)

            if flex is not None:
                from torch.nn.attention.flex_attention import create_block_mask  # this torch has FlexAttention (flex)
                wm = create_block_mask(lambda b, h, i, j: (j <= i) & (j > i - window), None, None, T, T, device=dev)

                def stock():  # flex for the window, flash SDPA for the causal shared branch, gate and mix
                    y_loc, _ = flex(q, k, v, wm, lse=False)
                    y_glob = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=True)
                    return gate_mix(q, y_loc, y_glob)
                name = "flex(window) + SDPA(causal) + gate, compiled"
            else:
                wmask = K.swa_mask(T, window, dev)

                def stock():
                    y_loc = F.scaled_dot_product_attention(q, k, v, attn_mask=wmask, enable_gqa=True)
                    y_glob = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=True)
                    return gate_mix(q, y_loc, y_glob)
                name = "SDPA(window mask) + SDPA(causal) + gate"
            f = torch.compile(stock) if cuda else stock
            _report(name, ktime(f), nbytes, flops, t_k)

        if "gswa_decode" in want:
            Bd, L1, W, S = (64, 2, 64, 2048) if cuda else (4, 2, 16, 128)
            q = rnd(Bd, L1, H, D)
            kr, vr = rnd(Bd, L1, Hkv, W, D), rnd(Bd, L1, Hkv, W, D)
            ks, vs = rnd(Bd, Hkv, S, D), rnd(Bd, Hkv, S, D)
            q_pos = torch.full((Bd,), S - 1, device=dev)
            ring_pos = (torch.arange(S - W, S, device=dev)[None] + torch.zeros(Bd, 1, dtype=torch.long, device=dev))
            gw, gb = rnd(H, D, s=D ** -0.5), rnd(H)
            nbytes = esz * (2 * Bd * Hkv * S * D + 2 * Bd * L1 * Hkv * W * D + 2 * Bd * L1 * H * D)
            args_ = (q, kr, vr, ring_pos, ks, vs, q_pos, gw, gb, W)
            print(f"\ngated_swa_decode  batch {Bd}  loops {L1}+1  H {H}/{Hkv}  D {D}  window {W}  shared cache {S}  "
                  f"{dtype}")
            t_k = None
            if run_triton:
                t_k = ktime(lambda: K.gated_swa_decode_triton(*args_))
                print(f"    max |kernel - reference| = "
                      f"{_maxerr(K.gated_swa_decode_triton(*args_), K.gated_swa_decode_ref(*args_)):.2e}")
                _report("triton (split shared keys + combine)", t_k, nbytes)
            _report("reference", ktime(lambda: K.gated_swa_decode_ref(*args_)), nbytes, None, t_k)

            def stock_decode():  # two SDPA calls with masks, then the gate
                qq = q.reshape(Bd * L1, H, 1, D)
                ok = (ring_pos <= q_pos[:, None]) & (ring_pos > q_pos[:, None] - W) & (ring_pos >= 0)
                y_loc = F.scaled_dot_product_attention(qq, kr.flatten(0, 1), vr.flatten(0, 1), enable_gqa=True,
                                                       attn_mask=ok.repeat_interleave(L1, 0)[:, None, None])
                glob = (torch.arange(S, device=dev)[None] <= q_pos[:, None])[:, None, None]
                y_glob = F.scaled_dot_product_attention(q.transpose(1, 2), ks, vs, attn_mask=glob, enable_gqa=True)
                y_glob = y_glob.transpose(1, 2).reshape(Bd * L1, H, 1, D)
                g = K.plt_gate(qq, gw, gb)[..., None]
                return (g * y_loc.float() + (1 - g) * y_glob.float()).to(q.dtype).reshape(Bd, L1, H, D)
            f = torch.compile(stock_decode) if cuda else stock_decode
            _report("2 x SDPA + gate" + (", compiled" if cuda else ""), ktime(f), nbytes, None, t_k)

        if "dual" in want:  # the double decoder's setting: 4-8 blocks (a random partition, as in training)
            q = rnd(Bt, H, T, D)
            k_s, v_s, k_c, v_c = rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D), rnd(Bt, Hkv, T, D)
            for n_blocks in ((4, 8) if cuda else (4,)):
                blk_d = _random_blocks(T, n_blocks, gen, dev)[None].expand(Bt, T).contiguous()
                dargs = (q, pos_b, blk_d, k_s, v_s, pos_b, blk_d, k_c, v_c, blk_d, scale)
                m_self, m_cross = K.dual_masks(pos_b, blk_d, pos_b, blk_d, blk_d)
                pairs = int(m_self.sum() + m_cross.sum()) * H
                flops, nbytes = 4 * D * pairs, esz * (2 * Bt * H * T * D + 4 * Bt * Hkv * T * D)
                print(f"\ndual_attention  B {Bt}  H {H}/{Hkv}  T {T}  D {D}  {n_blocks} blocks (self keys {T}, cross "
                      f"keys {T})  {dtype}")
                t_k = None
                if run_triton:
                    t_k = ktime(lambda: K.dual_attention_triton(*dargs))
                    o1, l1 = K.dual_attention_triton(*dargs)
                    o2, l2 = K.dual_attention_ref(*dargs)
                    print(f"    max |kernel - reference| = {_maxerr(o1, o2):.2e} (out)  {_maxerr(l1, l2):.2e} (lse)")
                    _report("triton (one pass, one softmax)", t_k, nbytes, flops)
                _report("reference: 2 dense attentions + LSE merge",
                        ktime(lambda: K.dual_attention_ref(*dargs), heavy=True), nbytes, flops, t_k)
                if flex is not None:
                    from torch.nn.attention.flex_attention import create_block_mask  # this torch has it (flex)
                    sm = create_block_mask(
                        lambda b, h, i, j: (blk_d[b, j] == blk_d[b, i]) & (pos_b[b, j] <= pos_b[b, i]), Bt, None, T, T,
                        device=dev)
                    cm = create_block_mask(lambda b, h, i, j: blk_d[b, j] < blk_d[b, i], Bt, None, T, T, device=dev)

                    def two_flex():
                        o1, l1 = flex(q, k_s, v_s, sm, scale)
                        o2, l2 = flex(q, k_c, v_c, cm, scale)
                        return K.merge_lse(o1, l1.float(), o2, l2.float())
                    _report("2 x FlexAttention + LSE merge, compiled", ktime(torch.compile(two_flex)), nbytes,
                            flops, t_k)
