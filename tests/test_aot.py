"""Every Triton kernel of kernels.py compiles ahead of time (kernels_aot.py) for sm_80 (A100) and sm_90 (H100) on a
machine without a GPU (Triton's bundled ptxas), as the launchers launch it for the presets, and fits the target's
shared memory.

The compile runs in a child process without TRITON_INTERPRET (conftest sets it when there is no GPU, and then
@triton.jit makes interpreter functions that cannot be compiled), with an empty Triton cache so that every kernel is
really compiled. The cases are a representative subset of kernels_aot.aot_cases(): every kernel, both targets, the three
dtypes, decode and prefill, the largest tiles (LoRA rank 256, head dim 96 padded to 128, a GQA group of 3);
`kernels_aot.aot_report()` compiles them all.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from harness import kernels_aot

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (80, 90)
# name prefixes of the cases compiled here; fp32 prefill at small tiles: the largest fp32 tiles spill registers and
# take ptxas 5-15 s each (kernels_aot.aot_report() compiles them)
CASES = ("lora/gemma-2b/r256/decode/", "lora/gemma-2b/r256/prefill/bfloat16", "lora/gemma-2b/r256/prefill/float16",
         "lora/tiny/r16/prefill/float32", "lora/tiny/r16/serve8/bfloat16",
         "plt/ablation-dense/prefill/bfloat16", "plt/ablation-dense/prefill/float16", "plt/tiny/prefill/float32",
         "plt/ablation-dense/decode/", "dd/base/decode/", "dd/base/prefill/bfloat16", "dd/base/prefill/float16",
         "dd/tiny/prefill/float32")


def _launched_kernels():
    """The Triton functions kernels.py launches with a grid (`name[grid](...)`)."""
    src = (ROOT / "kernels.py").read_text()
    return {name for name in re.findall(r"(\w+)\[\(", src) if isinstance(getattr(kernels, name, None),
                                                                       kernels.triton.runtime.KernelInterface)}


def _selected():
    return [c for c in kernels_aot.aot_cases() if c.name.startswith(CASES)]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    script = ("import json, sys\nfrom harness import kernels_aot\n"
              "cases = [c for c in kernels_aot.aot_cases() if c.name in sys.argv[1:]]\n"
              f"print(json.dumps(kernels_aot.aot_report({TARGETS}, cases)))\n")
    out = subprocess.run([sys.executable, "-c", script, *(c.name for c in _selected())], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_aot_presets_match_the_models():
    """kernels_aot.AOT_PRESETS is the presets' kernel shapes, written out (kernels.py imports no model file)."""
    import double_decoder
    import plt
    import recursive

    def heads(p):
        return dict(H=p["n_head"], H_kv=p["n_kv_head"], D=p.get("head_dim") or p["n_embd"] // p["n_head"])

    lora = {}
    for name, p in recursive.RELAXED_PRESETS.items():
        ranks = tuple(sorted({r for k, r in p.items()
                              if k.startswith("lora_rank_") and 0 < r <= kernels.MAX_LORA_RANK}))
        if ranks:
            lora[name] = dict(d=p["n_embd"], n_loops=p["n_loops"], ranks=ranks)
    assert kernels_aot.AOT_PRESETS == {
        "lora": lora,
        "plt": {n: dict(heads(p), window=p["window"], L1=p["n_loops"] - 1) for n, p in plt.PRESETS.items()},
        "dd": {n: heads(p) for n, p in double_decoder.PRESETS.items()},
    }


def test_cases_cover_every_kernel():
    launched = _launched_kernels()
    assert len(launched) >= 6
    assert {k for c in kernels_aot.aot_cases() for k in kernels_aot.aot_kernels(c)} == launched
    assert {k for c in _selected() for k in kernels_aot.aot_kernels(c)} == launched
    for prefix in CASES:  # a renamed preset must not silently empty the selection
        assert any(c.name.startswith(prefix) for c in kernels_aot.aot_cases()), prefix


@pytest.mark.slow  # the rows fixture compiles in a subprocess
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", sorted(_launched_kernels()))
def test_compiles_and_fits(rows, kernel, target):
    mine = [r for r in rows if r["kernel"] == kernel and r["target"] == f"sm_{target}"]
    assert {r["dtype"] for r in mine} == {"float16", "bfloat16", "float32"}
    for r in mine:
        assert r["error"] is None, f"{r['case']}: {r['error']}"
        assert r["ptx_entry"], r["case"]
        assert 0 <= r["shared"] <= kernels_aot.AOT_TARGETS[target]["shared"], r
        assert 0 < r["regs"] <= 255 and r["spills"] >= 0, r
