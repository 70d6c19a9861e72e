"""bench.py: every benchmark section runs on CPU at toy sizes (smoke tests of the code paths; no speed is asserted --
speed claims live in the benchmarks' printed tables, never in tests)."""
import bench


def test_kernels_bench_runs_on_cpu(capsys):
    """`python bench.py kernels` on a CPU machine: says the Triton timing needs CUDA and times the references and
    stock alternatives at small sizes."""
    bench.main(["kernels", "--device", "cpu", "--dtype", "float32", "--warmup", "0", "--iters", "1"])
    out = capsys.readouterr().out
    assert "Triton kernels need CUDA" in out
    for section in ("multi_lora (BGMV", "stacked adapters", "gated_swa (prefill)", "gated_swa_decode",
                    "dual_attention"):
        assert section in out


def test_decode_bench_reports_bandwidth_and_ratio(capsys):
    bench.main(["decode", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "1",
                "--prompt-len", "8", "--new-tokens", "4"])
    out = capsys.readouterr().out
    assert "read bandwidth of this machine" in out and "ours / transformers" in out and "tok/s" in out


def test_archs_table_runs_every_architecture(capsys):
    bench.main(["archs", "--device", "cpu", "--repeats", "1", "--settings", "8/3", "--batch", "1"])
    out = capsys.readouterr().out
    for name in ("vanilla", "recursive", "relaxed", "block", "plt", "double"):
        assert f"      {name}" in out


def test_plt_double_and_serve_sections_run(capsys):
    common = ["--device", "cpu", "--preset", "tiny", "--repeats", "1", "--dtype", "float32"]
    bench.main(["plt", *common, "--batch", "1", "--prompt-len", "8", "--new-tokens", "3",
                "--variants", "vanilla,loop,clp,kv_share,plt"])
    bench.main(["double", *common, "--batch", "1", "--prompt-len", "8", "--new-tokens", "3"])
    bench.main(["serve", *common, "--requests", "6", "--prompt-len", "4", "--gen-len", "4", "--slots", "3",
                "--lora-rank", "4", "--exit-rate", "0.5"])
    out = capsys.readouterr().out
    kv = out.split("KV bytes per sequence at the end (Table 1): ")[1].split("\n")[0]
    assert "kv_share 11.0 KiB (+0.0% vs vanilla)" in kv and "loop 22.0 KiB (+100.0% vs vanilla)" in kv  # Table 1
    assert "PLT-2 / loop-2" in out
    assert "PLT-2 / vanilla" in out and "double / decoder-only" in out
    serve = out.split("== serving B=2")[1]
    for system in ("vanilla CSB", "depth-wise, no exit", "depth-wise + exit (gate)", "depth-wise + exit (softmax)"):
        assert system in serve
    assert "ceiling" in serve and "SIMULATED exits" in serve
    assert "== serving B=3: skipped, the 4 layers" in out  # tiny's 4 layers do not split into 3 loops


def test_double_bench_reports_ttft_prefix_per_token_and_kv(capsys):
    """The double decoder's serving numbers at a toy size, with and without rollover: 2 + 1 layers -> KV bytes 1/3."""
    common = ["double", "--device", "cpu", "--preset", "tiny", "--repeats", "1", "--dtype", "float32", "--batch", "1",
              "--prompt-len", "8", "--new-tokens", "5", "--ctx-layers", "2", "--gen-layers", "1"]
    for extra in ([], ["--rollover", "2", "--shared-prefix", "7"]):
        bench.main(common + extra)
        out = capsys.readouterr().out
        for what in ("TTFT", "after the cached prefix", "per-token", "KV bytes 0.333", "allocated caches"):
            assert what in out


def test_kernels_aot_table_compiles_for_both_targets():
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    res = subprocess.run([sys.executable, str(ROOT / "bench.py"), "kernels", "--aot", "--only",
                          "lora/tiny/r16/decode/float32"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("_lora_")]
    assert {(r[0], r[2]) for r in rows} == {(k, t) for k in ("_lora_shrink_kernel", "_lora_expand_kernel")
                                            for t in ("sm_80", "sm_90")}
    assert all(int(r[4].split("/")[0]) <= int(r[4].split("/")[1]) for r in rows)
    assert "4 compiles, 0 failed" in res.stdout
