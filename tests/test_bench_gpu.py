"""bench.py gpu (bench_gpu.py) on a CPU: every section runs its code path at toy sizes and lands in --json with numeric
rows, a section that raises leaves the others' results and fails the command, the graphed steps are one graph per
batch (plt, block and double: CapturedStep copying in the token ids alone), the sections come in the GPU run's order,
and a per-token time is never negative. No speed is asserted, and nothing depends on the clock: the commands run with
their section caps off (uncapped: Clock(inf)), their rounds set by --repeats, so that a slow machine only makes them
slower; the caps themselves are tested on a clock that is already past them (CPU timings of graphed steps mean
nothing; the targets are judged on a GPU only)."""
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

import bench
import graphs
from conftest import ROOT
from harness import bench_gpu
from model import GPT, GPTConfig

# A stand-in for nanoGPT's model.py (a checkout is not part of this repository): its GPTConfig fields and its
# forward(idx, targets) -> (logits, loss), enough for the train section's plumbing (nanogpt_model, the ratio rows).
FAKE_NANOGPT = '''
from dataclasses import dataclass
import torch
import torch.nn.functional as F

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = False

class GPT(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.emb = torch.nn.Embedding(c.vocab_size, c.n_embd)
        self.mlp = torch.nn.Sequential(*[torch.nn.Linear(c.n_embd, c.n_embd) for _ in range(c.n_layer)])
        self.head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.head(self.mlp(self.emb(idx)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
'''


def numeric(row) -> bool:
    return any(isinstance(v, float) and math.isfinite(v) for v in row.values())


_Clock = bench_gpu.Clock


@pytest.fixture
def uncapped(monkeypatch):
    """bench.py gpu without its section caps: every size and every round of --repeats, however slow the machine."""
    monkeypatch.setattr(bench_gpu, "Clock", lambda minutes: _Clock(math.inf))


@pytest.mark.slow
def test_gpu_command_writes_every_section_and_survives_a_failing_one(tmp_path, monkeypatch, capsys, uncapped):
    nano = tmp_path / "nanogpt"
    nano.mkdir()
    (nano / "model.py").write_text(FAKE_NANOGPT)
    out = tmp_path / "g.json"
    bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--minutes", "30", "--repeats", "2", "--nanogpt",
                str(nano), "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["header"]["preset"] == "tiny" and res["header"]["copy_bandwidth_GBs"] > 0
    assert list(res["sections"]) == list(bench_gpu.SECTIONS)
    for name, sec in res["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"))
        assert sec["rows"] and all(numeric(r) for r in sec["rows"]), name  # no cap: nothing skipped
        for r in sec["rows"]:  # every graphed step compiled in its warm-up and never again
            assert r.get("recompiles_after_warmup", 0) == 0, (name, r)
        assert sec["warmup_s"] >= 0 and sec["cudagraphs"]["skips"] == 0
    rows = {(r["name"], r["batch"]): r for r in res["sections"]["decode"]["rows"]}
    assert {b for _, b in rows} == {1, 16, 64}
    assert rows[("ours graphed", 1)]["warmup_graphs"] == 1  # one graph per batch bucket
    assert "x_transformers" in rows[("ours graphed", 64)]
    serve = {(r["name"], r["slots"]): r for r in res["sections"]["serve"]["rows"]}
    for S in {s for _, s in serve}:
        for name in ("continuous", "depth-wise, no exit", "depth-wise + exit", "bare graphed decode step"):
            assert serve[(name, S)]["tok_per_s"] > 0
        assert serve[("transformers generate_batch", S)]["continuous_x"] > 0  # transformers' CB runs on a CPU
        assert serve[("continuous", S)]["x_bare_step"] > 0
    assert 64 in {s for _, s in serve}  # the target's slot count first
    for name in ("plt", "block", "double"):  # CapturedStep: each replay copied the token ids alone
        copied = [r["bytes_copied_per_replay"] for r in res["sections"][name]["rows"] if "bytes_copied_per_replay" in r]
        assert copied and all(c and all(b % 8 == 0 and graphs.batch_bucket(b // 8) == b // 8 for b in c)
                              for c in copied), (name, copied)
    assert {r["name"] for r in res["sections"]["train"]["rows"]} == {"ours eager", "ours compiled", "nanoGPT eager",
                                                                      "nanoGPT compiled"}
    assert "targets: not judged on cpu" in capsys.readouterr().out

    def broken(ctx, rows):
        rows.append({"name": "half done", "value": 1.0})
        raise RuntimeError("boom\nsecond line")
    def fine(ctx, rows):  # the section after the failing one (every real section ran above)
        rows.append({"name": "after", "value": 2.0})
    monkeypatch.setitem(bench_gpu.SECTION_FNS, "plt", broken)
    monkeypatch.setitem(bench_gpu.SECTION_FNS, "double", fine)
    with pytest.raises(SystemExit) as e:
        bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--minutes", "30", "--repeats", "1", "--only",
                    "plt,double", "--json", str(out)])
    assert e.value.code == 1
    captured = capsys.readouterr()
    assert "section plt failed: RuntimeError: boom\n" in captured.out
    assert captured.err.strip().splitlines() == ["failed: section plt: RuntimeError: boom"]
    res = json.loads(out.read_text())
    assert res["sections"]["plt"]["status"] == "failed" and res["sections"]["plt"]["error"] == "RuntimeError: boom"
    assert res["sections"]["plt"]["rows"] == [{"name": "half done", "value": 1.0}]  # what it had is kept
    assert res["sections"]["double"] == {**res["sections"]["double"], "status": "ok",
                                         "rows": [{"name": "after", "value": 2.0}]}  # the next section still runs


def test_graphed_decode_is_one_graph_per_bucket_and_the_bare_step_replays_it():
    """graphs.compile_decode with --graphs' backend compiles one graph per batch bucket, mutates only static tensors,
    reads nothing back to the host; the decode and serve sections' graphed step (the continuous server's, bare) is one
    graph per slot count that a serving run of that server replays: no recompile after the warm-up, and the server's
    greedy tokens are the eager ones."""
    from graph_check import GraphCheck

    import serve
    from harness.serve_requests import synthetic_requests

    torch.manual_seed(0)
    check = GraphCheck()
    eager = GPT(GPTConfig.from_preset("tiny")).eval()
    m = GPT(GPTConfig.from_preset("tiny")).eval()
    m.load_state_dict(eager.state_dict())
    graphs.compile_decode(m, "auto", check)
    P, N = 8, 4
    for B in (1, 16):
        idx = torch.randint(0, 4000, (B, P))
        assert torch.equal(m.generate(idx, N), eager.generate(idx, N))  # the graphed tokens are the eager ones
    assert check.graphs == 2 and check.unsafe == [] and check.syncs == []
    check = GraphCheck()
    srv = serve.ContinuousServer(GPT(GPTConfig.from_preset("tiny", max_seq_len=64)).eval(), 4, compile=True,
                                 backend=check)
    srv.model.load_state_dict(eager.state_dict())
    bare = bench_gpu.bare_step(srv, P, 3)
    bare()
    bare()
    reqs = synthetic_requests(6, 4000, "5:9", "6", "all", seed=0)
    done = srv.run(reqs, clock="step")
    assert check.graphs == 1 and check.unsafe == [] and check.syncs == []  # the bare step's graph, replayed
    for r in done:
        assert r.output == eager.generate(torch.tensor([r.prompt]), 6)[0, len(r.prompt):].tolist()


def test_the_gpu_run_brings_the_targets_first():
    """The order of the GPU run: bench.py gpu's sections decode, serve, plt, block, double, train, the targets' batch
    and slot count first (decode 1, 64, 16; serving 64, 16), and scripts/gpu_check.sh runs them in that order, each in
    its own process under its own timeout, the recovery rows after PLT and Block, through python3 or $PYTHON (the GPU
    machine has no `python`), with TORCH_LOGS=perf_hints; its steps' budgets fit one 10-minute call with room."""
    assert bench_gpu.SECTIONS == ("decode", "serve", "plt", "block", "double", "train")
    assert bench_gpu.Sizes().decode_batches[:2] == (1, 64) and bench_gpu.Sizes().serve_slots[0] == 64
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    steps = re.findall(r"^(section|step) (\w+) (\d+)", script, re.M)
    assert [name for _, name, _ in steps] == ["decode", "serve", "plt", "block", "recovery", "double", "train"]
    assert sum(int(secs) for *_, secs in steps) + 10 * len(steps) <= 540  # each timeout and its -k 10: 9 minutes
    assert 'PY=${PYTHON:-python3}' in script and not re.search(r"(^|[\s(])python ", script, re.M)
    assert "export TORCH_LOGS=${TORCH_LOGS:-perf_hints}" in script


def test_per_token_times_are_never_negative(monkeypatch):
    """generation_times' per-token time of a round is the slope of its generate times over n (1, the midpoint, N); a
    round whose times do not grow with n (noise above the decode time, as under load) is not measured (NaN), which
    med and spread leave out: no negative time is printed."""
    from harness import bench_decode
    from harness.bench_common import med, spread

    rounds_times = {"m/1": [0.010, 0.050], "m/4": [0.013, 0.020], "m/8": [0.017, 0.012]}  # round 2: noise
    monkeypatch.setattr(bench_decode, "rounds", lambda systems, repeats, device, warmup=1: rounds_times)
    model = SimpleNamespace(generate=lambda idx, n: None)
    t = bench_decode.generation_times({"m": model}, torch.zeros(1, 2, dtype=torch.long), 8, 2)
    assert t["m"]["ttft"] == [0.010, 0.050]
    assert t["m"]["token"][0] == pytest.approx(0.001, rel=1e-6) and math.isnan(t["m"]["token"][1])
    assert med(t["m"]["token"]) == pytest.approx(0.001) and "-" not in spread(t["m"]["token"], 1e3, ".3f")
    assert spread([math.nan]) == "-" and math.isnan(med([math.nan]))


def test_a_failing_section_fails_the_command_and_leaves_the_others(tmp_path, monkeypatch, capsys):
    """A section that raises -- a UsageError as well -- is `failed` in the JSON and on stdout, the sections after it
    still run, and the command ends with exit status 1 and one `failed:` line naming it."""
    from harness.cli import UsageError

    def refused(ctx, rows):
        raise UsageError("--preset tiny: no such thing")

    def fine(ctx, rows):
        ctx.row(rows, name="fine", value=1.0)
    monkeypatch.setitem(bench_gpu.SECTION_FNS, "plt", refused)
    monkeypatch.setitem(bench_gpu.SECTION_FNS, "block", fine)
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--only", "plt,block", "--json", str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["failed: section plt: UsageError: --preset tiny: no such thing"]
    res = json.loads(out.read_text())["sections"]
    assert res["plt"]["status"] == "failed" and res["block"]["status"] == "ok"
    assert res["block"]["rows"] == [{"name": "fine", "value": 1.0}]


@pytest.mark.parametrize("where", ["a directory", "a read-only directory"])
def test_json_to_a_directory_or_a_read_only_place_is_one_error_before_any_work(tmp_path, monkeypatch, capsys, where):
    """--json naming a directory, or a file in a directory that cannot be written, is one `error:` line and exit code
    2 before anything is measured, and leaves nothing behind."""
    import errno
    import os

    from conftest import one_error_line
    from harness import cli

    monkeypatch.setattr(bench_gpu, "copy_bandwidth", lambda *a: pytest.fail("work began"))
    if where == "a directory":
        target, match = tmp_path / "adir", "--json"
        target.mkdir()
    else:  # a read-only file system (root writes into a read-only directory: the file system refuses it here)
        def read_only(*a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(cli.tempfile, "mkstemp", read_only)
        target, match = tmp_path / "g.json", "not a writable directory (Read-only file system)"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    one_error_line(capsys, bench.main, ["gpu", "--device", "cpu", "--preset", "tiny", "--only", "plt", "--json",
                                        str(target)], match)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_fp16_on_a_cpu_runs_the_decode_section(tmp_path, uncapped):
    """--dtype fp16 --device cpu: the decode section runs its three systems in float16 (our weights into the graphed
    step's server, transformers' twin) and the command ends with status 0 only because it did."""
    out = tmp_path / "g.json"
    bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--dtype", "fp16", "--only", "decode", "--repeats", "1",
                "--minutes", "30", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["header"]["dtype"] == "float16"
    sec = res["sections"]["decode"]
    assert sec["status"] == "ok" and sec["rows"] and all(numeric(r) for r in sec["rows"])
    assert {r["name"] for r in sec["rows"]} == {"ours eager", "ours graphed", "transformers eager"}


def test_a_section_past_its_cap_still_measures_its_first_size(capsys):
    """The clock is read between sizes only: a section whose share of --minutes is spent before it starts still
    measures its first size, then skips the rest, each skip a row that says so."""
    clock = bench_gpu.Clock(1)
    clock.start_section(0.0, 1.0)  # a cap of 0 s
    ctx = bench_gpu.Ctx(None, torch.device("cpu"), torch.float32, bench_gpu.CPU_SIZES, clock)
    rows = []
    assert clock.over() and not ctx.capped(rows, "batch 1", batch=1)
    ctx.row(rows, name="measured", batch=1, ms=1.0)
    assert ctx.capped(rows, "batch 16", batch=16) and ctx.capped(rows, "batch 64", batch=64)
    assert [r.get("skipped") for r in rows] == [None, "section cap reached", "section cap reached"]
    assert "batch 16: skipped (section cap reached)" in capsys.readouterr().out


def test_a_batch_search_asked_to_stop_keeps_the_batches_it_measured():
    """The Block section's batch search is capped (a quarter of the section's cap per model): stop() is asked before
    each batch after the first, and a True ends the search with what it measured, never with nothing."""
    from harness.bench_decode import search_batch

    m = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=32, vocab_size=64, max_seq_len=64)).eval()
    with torch.no_grad():
        _, every = search_batch(m, 4, 12, 8, 2, "cpu")
        asked = []
        best, found = search_batch(m, 4, 12, 8, 2, "cpu", stop=lambda: asked.append(1) or len(asked) > 1)
    assert sorted(every) == [1, 2, 4, 8]
    assert sorted(found) == [1, 2] and best in found and len(asked) == 2
