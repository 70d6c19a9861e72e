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
