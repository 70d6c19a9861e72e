"""
kernels_aot.py -- ahead-of-time compilation of kernels.py's Triton kernels for real GPUs, on a machine without one.

A build tool, not a kernel: it checks that every kernel compiles for sm_80 (A100) and sm_90 (H100) as the models
launch it, and fits the target's shared memory, registers and spills reported.

Run:
    python bench.py kernels --aot                 # the whole table: every case of every preset, both targets
    python -m pytest -q tests/test_aot.py         # a representative subset, in a child process
"""
from __future__ import annotations

import functools
import os

import torch

import kernels
from kernels import (KERNEL_DTYPES, dual_attention_triton, gated_swa_decode_triton, gated_swa_triton,
                     multi_lora_triton, triton)

# ----------------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation for real GPUs, without a GPU
#
# A case calls a public launcher (multi_lora_triton, gated_swa_triton, gated_swa_decode_triton,
# dual_attention_triton) on CPU tensors of a preset's shapes and layouts while the kernels are replaced by recorders,
# so what is compiled is exactly what the launcher passes (tile sizes, constexprs, num_warps / num_stages, strides).
# Triton's own argument binder then specializes those arguments as a launch on a GPU would (dtypes; ints equal to 1
# become constexprs; pointers and ints divisible by 16 get the divisibility hint), and triton.compile lowers them to
# PTX and a cubin (Triton's bundled ptxas) for the target. The SM count the launch heuristics read is the target's.
# Lengths that vary at run time (KV length, split counts) are specialized by Triton on ==1 and %16: a case fixes one
# representative value of each. Needs the real compiler: Triton imported without TRITON_INTERPRET=1.

AOT_TARGETS = {  # capability -> SMs, opt-in max shared memory per block (bytes)
    80: dict(sms=108, shared=166912),  # A100
    90: dict(sms=132, shared=232448),  # H100 SXM
}


# The kernel shapes of the presets that launch kernels (written out: this module imports no model file;
# tests/test_aot.py derives them from plt.PRESETS, double_decoder.PRESETS and recursive.RELAXED_PRESETS and checks
# they are equal). LoRA: model width d, loops, the ranks <= MAX_LORA_RANK; PLT: heads, head dim, window, non-first
# loops L1; double decoder: heads and head dim.
AOT_PRESETS = {
    "lora": {"tiny": dict(d=128, n_loops=2, ranks=(16,)), "tiny6": dict(d=128, n_loops=2, ranks=(64,)),
             "mini": dict(d=256, n_loops=2, ranks=(64,)), "small": dict(d=512, n_loops=2, ranks=(64,)),
             "base": dict(d=768, n_loops=2, ranks=(128,)), "gemma-2b": dict(d=2048, n_loops=2, ranks=(256,)),
             "tinyllama-1.1b": dict(d=2048, n_loops=2, ranks=(256,))},
    "plt": {"tiny": dict(H=4, H_kv=2, D=32, window=32, L1=1), "small": dict(H=8, H_kv=2, D=64, window=64, L1=1),
            "base": dict(H=12, H_kv=3, D=64, window=64, L1=1),
            "ablation-dense": dict(H=16, H_kv=4, D=96, window=64, L1=1),
            "dense-1.2b": dict(H=32, H_kv=8, D=64, window=64, L1=1)},
    "dd": {"tiny": dict(H=4, H_kv=2, D=32), "mini": dict(H=4, H_kv=2, D=64), "small": dict(H=8, H_kv=4, D=64),
           "base": dict(H=12, H_kv=4, D=64)},
}


def _aot_heads(B, H, T, D, dtype, transposed=False):
    """(B, H, T, D) in the model's layouts: contiguous (after RoPE), or split_heads' transposed view of (B, T, H*D)."""
    if transposed:
        return torch.empty(B, T, H, D, dtype=dtype).transpose(1, 2)
    return torch.empty(B, H, T, D, dtype=dtype)


def _aot_lora(N, T, d, n_loops, rank, dtype):
    """svd_lora.LoRALinear on a d x d projection: x (N, T, d), one loop index per row."""
    A, B = torch.empty(n_loops, rank, d, dtype=dtype), torch.empty(n_loops, d, rank, dtype=dtype)
    multi_lora_triton(torch.empty(N, T, d, dtype=dtype), A, B, torch.zeros(N, dtype=torch.long))


def _aot_gated_swa(B, T, H, H_kv, D, window, dtype):
    """plt.PLTAttention over a prompt of T tokens."""
    q = _aot_heads(B, H, T, D, dtype)
    k, v, ks, vs = (_aot_heads(B, H_kv, T, D, dtype, transposed=i % 2 == 1) for i in range(4))
    gated_swa_triton(q, k, v, ks, vs, torch.empty(H, D, dtype=dtype), torch.empty(H, dtype=dtype), window)


def _aot_gated_swa_decode(B, L1, H, H_kv, D, window, kv_len, max_len, dtype):
    """plt.PLTAttention's decode step: the non-first loops' queries of (B, H, L, D), the rings (B, L1, H_kv, W, D),
    the shared cache read as (B, H_kv, kv_len, D) out of (B, H_kv, max_len, D)."""
    q = _aot_heads(B, H, L1 + 1, D, dtype)[:, :, 1:].transpose(1, 2)
    ring = torch.empty(B, L1, H_kv, window, D, dtype=dtype)
    ks = torch.empty(B, H_kv, max_len, D, dtype=dtype)[:, :, :kv_len]
    gated_swa_decode_triton(q, ring, ring, torch.empty(B, window, dtype=torch.long), ks, ks,
                            torch.empty(B, dtype=torch.long), torch.empty(H, D, dtype=dtype),
                            torch.empty(H, dtype=dtype), window)


def _aot_dual(B, T, S1, S2, H, H_kv, D, dtype):
    """double_decoder's generation layer: T queries, S1 self keys, S2 cross keys; ids as DualIds builds them."""
    ids = torch.arange(max(T, S1, S2)).expand(B, -1)
    q = _aot_heads(B, H, T, D, dtype)
    k_s, v_s = _aot_heads(B, H_kv, S1, D, dtype), _aot_heads(B, H_kv, S1, D, dtype, transposed=True)
    k_c, v_c = _aot_heads(B, H_kv, S2, D, dtype), _aot_heads(B, H_kv, S2, D, dtype, transposed=True)
    dual_attention_triton(q, ids[:, :T], ids[:, :T], k_s, v_s, ids[:, :S1], ids[:, :S1], k_c, v_c, ids[:, :S2])


class AOTCase:
    """One launch of the models: `launch()` calls a public launcher on CPU tensors of the case's shapes."""

    def __init__(self, name, dtype, launch):
        self.name, self.dtype, self.launch = name, dtype, launch

    def __repr__(self):
        return f"AOTCase({self.name})"


def aot_cases():
    """Every kernel launch of the presets' inference paths, per dtype -> [AOTCase]. Decode (one token: a batch of 1
    and a depth-wise serving batch of 8 rows for LoRA) and prefill (a 256-token prompt); the PLT decode reads a
    shared cache of 200 of 1024 positions; the double decoder's layer sees 256 self keys and 512 cross keys."""
    cases = []
    for dtype in KERNEL_DTYPES:
        dt = str(dtype).removeprefix("torch.")
        for name, s in AOT_PRESETS["lora"].items():
            for rank in s["ranks"]:
                for phase, N, T in (("decode", 1, 1), ("serve8", 8, 1), ("prefill", 1, 256)):
                    cases.append(AOTCase(f"lora/{name}/r{rank}/{phase}/{dt}", dtype, functools.partial(
                        _aot_lora, N, T, s["d"], s["n_loops"], rank, dtype)))
        for name, s in AOT_PRESETS["plt"].items():
            cases.append(AOTCase(f"plt/{name}/prefill/{dt}", dtype, functools.partial(
                _aot_gated_swa, 1, 256, s["H"], s["H_kv"], s["D"], s["window"], dtype)))
            cases.append(AOTCase(f"plt/{name}/decode/{dt}", dtype, functools.partial(
                _aot_gated_swa_decode, 1, s["L1"], s["H"], s["H_kv"], s["D"], s["window"], 200, 1024, dtype)))
        for name, s in AOT_PRESETS["dd"].items():
            for phase, T, S1 in (("decode", 1, 16), ("prefill", 256, 256)):
                cases.append(AOTCase(f"dd/{name}/{phase}/{dt}", dtype, functools.partial(
                    _aot_dual, 1, T, S1, 512, s["H"], s["H_kv"], s["D"], dtype)))
    return cases


def _aot_record(case, sms):
    """-> [(kernel name, args, kwargs)] of the launches case.launch() makes with `sms` SMs, no kernel run: every
    Triton function of kernels.py is replaced by a recorder meanwhile (not thread-safe)."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.name, args, kwargs))

    g = vars(kernels)  # the launchers look their kernels and _num_sms up there
    saved = {n: f for n, f in g.items() if isinstance(f, triton.runtime.KernelInterface)}
    saved["_num_sms"] = kernels._num_sms
    try:
        g.update({n: Recorder(n) for n in saved if n != "_num_sms"}, _num_sms=lambda device: sms)
        case.launch()
    finally:
        g.update(saved)
    return calls


def aot_kernels(case):
    """Names of the kernels a case launches, in launch order."""
    return [name for name, _, _ in _aot_record(case, AOT_TARGETS[90]["sms"])]


def aot_compile(kernel_name, target, case):
    """Compile kernel `kernel_name` as `case` launches it, for a GPU of capability `target` (80 or 90) -> Triton's
    CompiledKernel: .asm["ptx"], .asm["cubin"], .metadata.shared (bytes), .metadata.num_warps / num_stages."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = getattr(kernels, kernel_name)
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{kernel_name} is a {type(fn).__name__}: kernels.py was imported with TRITON_INTERPRET=1; "
                           "compile in a process without it")
    launches = [(args, kwargs) for name, args, kwargs in _aot_record(case, AOT_TARGETS[target]["sms"])
                if name == kernel_name]
    if not launches:
        raise ValueError(f"{case.name} does not launch {kernel_name}")
    args, kwargs = launches[0]
    gpu = GPUTarget("cuda", target, 32)
    backend = make_backend(gpu)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)


def _cubin_resources(cubin: bytes, kernel_name: str):
    """-> (registers per thread, stack frame bytes per thread) read from the cubin by Triton's bundled cuobjdump.
    The stack frame is where ptxas spills registers (the same figure as ptxas -v's "bytes stack frame", which it
    prints next to the spill stores): CompiledKernel.n_regs / n_spills need a GPU (they come from loading it)."""
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"Function {kernel_name}:\s*REG:(\d+) STACK:(\d+)", out)
    return int(m.group(1)), int(m.group(2))


def aot_report(targets=(80, 90), cases=None):
    """Compile every kernel of every case (default: aot_cases()) for each target -> rows (dicts): kernel, case,
    target ("sm_90"), dtype, shared (bytes), shared_limit, regs, spills (stack frame bytes per thread, ptxas -v's
    figure), ptx_entry (the PTX defines the kernel's entry), seconds (compile time; ~0 on a Triton cache hit),
    error (None, or the compile error: one failing kernel does not stop the report)."""
    import time

    rows = []
    for case in aot_cases() if cases is None else cases:
        for kernel in dict.fromkeys(aot_kernels(case)):
            for target in targets:
                row = dict(kernel=kernel, case=case.name, target=f"sm_{target}",
                           dtype=str(case.dtype).removeprefix("torch."), shared=None,
                           shared_limit=AOT_TARGETS[target]["shared"], regs=None, spills=None, ptx_entry=None,
                           seconds=None, error=None)
                t0 = time.perf_counter()
                try:
                    ck = aot_compile(kernel, target, case)
                    row["regs"], row["spills"] = _cubin_resources(ck.asm["cubin"], ck.metadata.name)
                    row["shared"], row["ptx_entry"] = ck.metadata.shared, f".entry {kernel}(" in ck.asm["ptx"]
                except Exception as e:  # reported in its row
                    row["error"] = f"{type(e).__name__}: {e}"
                row["seconds"] = round(time.perf_counter() - t0, 3)
                rows.append(row)
    return rows
