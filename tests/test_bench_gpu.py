"""bench.py gpu (bench_gpu.py) on a CPU: every section runs its code path at toy sizes and lands in --json with numeric
rows, a section that raises leaves the others' results, and the graphed decode it times is one graph per batch bucket
that the serving section's bare step replays without a recompile. No speed is asserted (CPU timings of graphed steps
under backend "eager" mean nothing; the targets are judged on a GPU only)."""
import json
import math

import pytest
import torch

import bench
import graphs
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


@pytest.mark.slow
def test_gpu_command_writes_every_section_and_survives_a_failing_one(tmp_path, monkeypatch, capsys):
    nano = tmp_path / "nanogpt"
    nano.mkdir()
    (nano / "model.py").write_text(FAKE_NANOGPT)
    out = tmp_path / "g.json"
    bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--minutes", "1", "--repeats", "2", "--nanogpt",
                str(nano), "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["header"]["preset"] == "tiny" and res["header"]["copy_bandwidth_GBs"] > 0
    assert list(res["sections"]) == list(bench_gpu.SECTIONS)
    for name, sec in res["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"))
        assert sec["rows"] and all(numeric(r) for r in sec["rows"] if "skipped" not in r), name
        for r in sec["rows"]:  # every graphed step compiled in its warm-up and never again
            assert r.get("recompiles_after_warmup", 0) == 0, (name, r)
    rows = {(r["name"], r["batch"]): r for r in res["sections"]["decode"]["rows"]}
    assert {b for _, b in rows} == {1, 16, 64}
    assert rows[("ours graphed", 1)]["warmup_graphs"] == 1  # one graph per batch bucket
    assert "x_transformers" in rows[("ours graphed", 64)]
    serve = {(r["name"], r["slots"]): r for r in res["sections"]["serve"]["rows"]}
    for S in (16, 64):
        for name in ("continuous", "depth-wise, no exit", "depth-wise + exit", "bare graphed decode step"):
            assert serve[(name, S)]["tok_per_s"] > 0
        assert serve[("transformers generate_batch", S)]["continuous_x"] > 0  # transformers' CB runs on a CPU
        assert serve[("continuous", S)]["x_bare_step"] > 0
    assert {r["name"] for r in res["sections"]["train"]["rows"]} == {"ours eager", "ours compiled", "nanoGPT eager",
                                                                      "nanoGPT compiled"}
    assert "targets: not judged on cpu" in capsys.readouterr().out

    def broken(ctx, rows):
        rows.append({"name": "half done", "value": 1.0})
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setitem(bench_gpu.SECTION_FNS, "plt", broken)
    bench.main(["gpu", "--device", "cpu", "--preset", "tiny", "--minutes", "0.5", "--repeats", "1", "--only",
                "decode,plt,double", "--json", str(out)])
    assert "section plt failed: RuntimeError: boom\n" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["sections"]["plt"]["status"] == "failed" and res["sections"]["plt"]["error"] == "RuntimeError: boom"
    assert res["sections"]["plt"]["rows"] == [{"name": "half done", "value": 1.0}]  # what it had is kept
    for name in ("decode", "double"):
        assert res["sections"][name]["status"] == "ok" and all(numeric(r) for r in res["sections"][name]["rows"])


def test_graphed_decode_is_one_graph_per_bucket_and_the_bare_step_replays_it():
    """The decode section's graphed model (compile_decode with --graphs' backend) compiles one graph per batch
    bucket, mutates only static tensors, reads nothing back to the host, and the serving section's bare step (the
    graphed generate's cache of that bucket) replays it: no recompile after the warm-up."""
    from graph_check import GraphCheck

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
    bare = bench_gpu.bare_step(m, 16, P, N, 3)
    bare()
    bare()
    m.generate(torch.randint(0, 4000, (1, P)), N)
    assert check.graphs == 2  # no recompile: the bare step and a second generation replay the warm-up's graphs
