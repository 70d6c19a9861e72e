"""serve.py: depth-wise batching (with and without early exit) and the vanilla baselines give exactly what each
request gets when generated alone, eager or through compiled steps (one graph per step kind, no recompile, nothing
mutated that a CUDA graph could not replay); chunked prefill; no request lost or duplicated; bad requests fail
alone; seeded sampling. The serving benchmark's command (bench_serve.py, `python bench.py serve`): tables, errors,
limits."""
import json
import os

import pytest
import torch

import bench
import serve
from graph_check import GraphCheck
from harness import bench_serve, serve_demo, serve_hooks, serve_requests
from model import GPT, GPTConfig
from recursive import from_vanilla

CFG = dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=64, vocab_size=96, max_seq_len=64)


def _models():
    torch.manual_seed(0)
    van = GPT(GPTConfig(**CFG))
    with torch.no_grad():  # sharper softmaxes: wide gaps between the top logits (no argmax near-ties)
        van.tok_emb.weight.mul_(40.0)
    rel = from_vanilla(van, n_loops=2, init="average", lora_init="svd", log=lambda *_: None,
                       lora_rank_q=4, lora_rank_kv=4, lora_rank_o=4, lora_rank_mlp=4)
    return van.eval(), rel.eval()


VAN, REL = _models()


def _requests(n, seed, gen="1:8", rate=0.5):
    # arrivals in decode steps (clock='step'): Poisson with gaps of mean 1/rate steps
    return serve_requests.synthetic_requests(n, CFG["vocab_size"], "1:12", gen, "poisson", rate, seed)


def test_relaxed_model_has_nonzero_lora():
    lora_B = [p for n, p in REL.named_parameters() if n.endswith("lora_B")]
    assert lora_B and all(p.abs().sum() > 0 for p in lora_B)


def test_depthwise_no_exit_equals_sequential():
    reqs = _requests(52, seed=1)
    seen, orig = [], REL.loop_step

    def spy(x, loops, *a, **k):  # records whether a step had rows at different loops (per-row LoRA and cache)
        seen.append(isinstance(loops, torch.Tensor))
        return orig(x, loops, *a, **k)

    REL.loop_step = spy
    try:
        out = serve.DepthWiseServer(REL, slots=6, exit_threshold=None).run(reqs, clock="step")
    finally:
        del REL.loop_step
    assert sum(seen) > 10, "the schedule never mixed loops within a step"
    for r in out:
        assert r.error is None
        ref, ref_exits = serve.sequential_generate(REL, r)
        assert r.output == ref, r.rid
        assert r.exits == [REL.config.n_loops - 1] * len(ref)


def test_depthwise_early_exit_equals_sequential_with_same_rule():
    reqs = _requests(50, seed=2)
    thr = bench_serve.calibrate_threshold(REL, reqs, exit_rate=0.5)
    out = serve.DepthWiseServer(REL, slots=5, exit_threshold=thr).run(reqs, clock="step")
    n_early = 0
    for r in out:
        ref, ref_exits = serve.sequential_generate(REL, r, exit_threshold=thr)
        assert r.output == ref, r.rid
        assert r.exits == ref_exits, r.rid
        n_early += sum(e < REL.config.n_loops - 1 for e in r.exits)
    assert n_early > 20  # exits really happened


def test_depthwise_early_exit_differs_from_no_exit_path():
    # the exit rule matters: with a threshold the outputs/exits are not those of the full-depth path
    reqs = _requests(20, seed=3)
    thr = bench_serve.calibrate_threshold(REL, reqs, exit_rate=0.7)
    a = serve.DepthWiseServer(REL, slots=4, exit_threshold=thr).run(reqs, clock="step")
    b = serve.DepthWiseServer(REL, slots=4).run(reqs, clock="step")
    assert [r.exits for r in a] != [r.exits for r in b]


def test_vanilla_continuous_and_static_equal_sequential():
    reqs = _requests(50, seed=4, gen="1:6")
    for static in (False, True):
        out = serve.ContinuousServer(VAN, slots=7, static=static).run(reqs, clock="step")
        for r in out:
            assert r.error is None
            assert r.output == serve.sequential_generate(VAN, r)[0], (static, r.rid)


# ----------------------------------------------------------------------------------------------------------------
# Compiled steps: what the CPU can prove about the CUDA-graph path (graphs.compile_step, tests/graph_check.py)


def _servers(kind, **kw):
    """A server of each step kind: its model, the server, and the reference of each request (tokens, exits)."""
    thr = bench_serve.calibrate_threshold(REL, _requests(8, seed=12), exit_rate=0.5)
    sampled = dict(temperature=8.0, top_k=20, seed=3)
    return {"continuous": lambda: serve.ContinuousServer(VAN, 5, **kw),
            "static": lambda: serve.ContinuousServer(VAN, 5, static=True, **kw),
            "continuous, sampled": lambda: serve.ContinuousServer(VAN, 5, **sampled, **kw),
            "depth-wise": lambda: serve.DepthWiseServer(REL, 5, **kw),
            "depth-wise + exits": lambda: serve.DepthWiseServer(REL, 5, thr, **kw),
            "depth-wise + exits, sampled": lambda: serve.DepthWiseServer(REL, 5, thr, **sampled, **kw)}[kind]()


KINDS = ["continuous", "static", "continuous, sampled", "depth-wise", "depth-wise + exits",
         "depth-wise + exits, sampled"]


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_server_steps_are_graphs_that_give_the_eager_tokens(kind):
    """A serving run with arrivals, early exits, finished requests freeing slots and a prompt prefilled in chunks,
    through compiled steps (backend GraphCheck, fullgraph: a graph break is an error): one graph (one step kind per
    server), no recompile in a second run, no mutated input that is not marked static and no value that depends on
    tensor data (what makes torch skip CUDA graphs), and the tokens and exit loops of the eager engine, which equal
    each request generated alone."""
    reqs = _requests(24, seed=11)
    reqs[3].prompt = list(range(40))  # four chunks of 12: the others decode meanwhile
    check = GraphCheck()
    srv = _servers(kind, compile=True, backend=check, prefill_chunk=12)
    first = srv.run(reqs, clock="step")
    assert check.graphs == 1 and check.unsafe == check.syncs == [], (check.unsafe, check.syncs)
    again = srv.run(reqs, clock="step")  # warm: no recompile
    assert check.graphs == 1
    eager = _servers(kind, prefill_chunk=12).run(reqs, clock="step")
    assert [r.output for r in first] == [r.output for r in again] == [r.output for r in eager]
    assert [r.exits for r in first] == [r.exits for r in eager]
    exits = [e for r in eager for e in r.exits if e is not None]
    assert "exits" not in kind or 0 < exits.count(0) < len(exits)  # early exits happened, not only
    for r in eager:
        ref = serve.sequential_generate(srv.model, r, srv.temperature, srv.top_k, srv.seed,
                                        getattr(srv, "threshold", None))
        assert r.output == ref[0] and (ref[1] is None or r.exits == ref[1]), r.rid


def test_compiled_step_state_not_marked_static_is_caught(monkeypatch):
    """Break it: a server whose state tensors are not marked static compiles, but the check names every tensor the
    step writes in place (on CUDA, torch would run it without a CUDA graph)."""
    monkeypatch.setattr(serve, "mark_static", lambda *t: None)
    check = GraphCheck()
    _servers("depth-wise + exits", compile=True, backend=check).run(_requests(6, seed=13), clock="step")
    assert sorted(n.rsplit("self_", 1)[-1] for n in check.unsafe) == ["h", "loop", "position"], check.unsafe  # (the
    # cache marks its own k and v)


@pytest.mark.parametrize("kind", ["continuous", "continuous, sampled", "depth-wise + exits",
                                  "depth-wise + exits, sampled"])
def test_a_compiled_iteration_reads_the_device_once(monkeypatch, kind):
    """At most one device-to-host transfer per iteration (the prefill's first tokens, the step's tokens, exit flags
    and loops together): counted over every way a tensor reaches the host, in a warm compiled run."""
    srv = _servers(kind, compile=True, backend="eager", prefill_chunk=12)
    reqs = _requests(20, seed=14)
    reqs[2].prompt = list(range(30))
    srv.run(reqs, clock="step")
    reads, iterations, real = [0], [0], serve.Server.iterate

    def counting_iterate(self):
        iterations[0] += 1
        return real(self)

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, **k: (reads.__setitem__(0, reads[0] + 1),
                                                                                  _m(self, *a, **k))[1])
    monkeypatch.setattr(serve.Server, "iterate", counting_iterate)
    srv.run(reqs, clock="step")
    monkeypatch.undo()
    assert 0 < reads[0] <= iterations[0], (reads[0], iterations[0])


def test_chunked_prefill_lets_the_others_decode_and_equals_sequential():
    """A 50-token prompt prefilled 5 tokens per iteration: the requests already decoding emit tokens during its
    prefill (not after it), and every request still equals its sequential generation (both servers)."""
    reqs = serve_requests.synthetic_requests(4, CFG["vocab_size"], "3", "12", seed=15)
    long = reqs[3]
    long.prompt, long.arrival = [int(t) for t in torch.randint(0, 90, (50,))], 2
    for srv in (serve.ContinuousServer(VAN, 4, prefill_chunk=5), serve.DepthWiseServer(REL, 4, prefill_chunk=5)):
        out = srv.run(reqs, clock="step")
        during = [t for r in out[:3] for t in r.token_times if t < out[3].t_first]
        assert len(during) >= 2 * 9, (srv.name, len(during))  # 3 requests x the 9 further chunks
        for r in out:
            assert r.output == serve.sequential_generate(srv.model, r)[0], (srv.name, r.rid)


def test_static_batching_admits_whole_batches_only():
    """static=True: a batch fills every slot at once and the next starts only when the whole batch is done, so with
    every request there at the start the decode steps are, per batch of `slots` requests, its longest output - 1;
    continuous batching needs fewer."""
    reqs = serve_requests.synthetic_requests(11, CFG["vocab_size"], "2:6", "1:9", seed=16)
    static, cont = serve.ContinuousServer(VAN, 4, static=True), serve.ContinuousServer(VAN, 4)
    out = static.run(reqs, clock="step")
    batches = [reqs[i:i + 4] for i in range(0, 11, 4)]
    assert static.n_steps == sum(max(r.max_new_tokens for r in b) - 1 for b in batches)
    for first, then in zip(batches, batches[1:]):
        assert max(out[r.rid].t_done for r in first) < min(out[r.rid].t_first for r in then)
    cont.run(reqs, clock="step")
    assert cont.n_steps < static.n_steps


@pytest.mark.parametrize("kind", ["vanilla", "depth-wise"])
def test_eos_ends_a_request_and_a_first_token_eos_is_not_counted_again(kind):
    """eos_id: a request ends at its first eos (its output: the sequential one up to it). One whose prefill samples
    eos as its first token is done before any decode step, and its row, still live for the step of that iteration,
    emits nothing: with one slot every step is a full one, so full_tokens is every token a step emitted, each output
    less its first."""
    model = VAN if kind == "vanilla" else REL
    reqs = serve_requests.synthetic_requests(12, CFG["vocab_size"], "2:8", "3:6", seed=17)
    refs = [serve.sequential_generate(model, r)[0] for r in reqs]
    eos = refs[0][0]  # request 0 ends on the token its prefill samples
    srv = (serve.ContinuousServer if kind == "vanilla" else serve.DepthWiseServer)(model, 1, eos_id=eos,
                                                                                  hook=serve_hooks.Metrics())
    out = srv.run(reqs, clock="step")
    for r, ref in zip(out, refs):
        assert r.output == (ref[:ref.index(eos) + 1] if eos in ref else ref), r.rid
    assert out[0].output == [eos] and out[0].max_new_tokens > 1
    assert srv.hook.full_tokens == sum(len(r.output) - 1 for r in out)


def test_500_requests_none_lost_or_duplicated():
    reqs = _requests(500, seed=5, gen="1:2", rate=8.0)
    bad = {7: dict(prompt=[]), 99: dict(max_new_tokens=0), 250: dict(prompt=[1, 2, CFG["vocab_size"]]),
           401: dict(prompt=list(range(CFG["max_seq_len"])))}
    for rid, change in bad.items():
        for k, v in change.items():
            setattr(reqs[rid], k, v)
    thr = bench_serve.calibrate_threshold(REL, reqs, 0.5)
    out = serve.DepthWiseServer(REL, slots=16, exit_threshold=thr).run(reqs, clock="step")
    assert sorted(r.rid for r in out) == list(range(500))
    for r in out:
        if r.rid in bad:
            assert r.error and not r.output
        else:
            assert r.error is None and len(r.output) == r.max_new_tokens and r.t_done is not None


def test_bad_requests_get_their_own_error():
    reqs = _requests(12, seed=6)
    reqs[1].prompt = []
    reqs[3].prompt = [5, -1, 2]
    reqs[4].prompt = [5, CFG["vocab_size"] + 3]
    reqs[6].prompt = list(range(CFG["max_seq_len"] + 1))
    reqs[8].max_new_tokens = 0
    reqs[9].max_new_tokens = -2
    reqs[10].prompt, reqs[10].max_new_tokens = [1] * 40, 30  # fits alone, not with its output
    expect = {1: "empty prompt", 3: "outside the vocabulary", 4: "outside the vocabulary", 6: "longer than the context",
              8: "max_new_tokens", 9: "max_new_tokens", 10: "exceeds the context"}
    for srv in (serve.DepthWiseServer(REL, 4), serve.ContinuousServer(VAN, 4),
                serve.ContinuousServer(VAN, 4, static=True)):
        out = srv.run(reqs, clock="step")
        for r in out:
            if r.rid in expect:
                assert r.error and expect[r.rid] in r.error, (r.rid, r.error)
                assert r.output == []
            else:
                assert r.error is None and r.output == serve.sequential_generate(srv.model, r)[0]


def test_jsonl_requests(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join([json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": 4}),
                            "{not json",
                            json.dumps({"max_new_tokens": 2}),
                            json.dumps({"prompt_ids": [4, 5], "max_new_tokens": 3, "arrival": 2})]))
    reqs = serve_requests.jsonl_requests(f)
    out = serve.ContinuousServer(VAN, 2).run(reqs, clock="step")
    assert [r.error is None for r in out] == [True, False, False, True]
    assert "line 2" in out[1].error and "prompt" in out[2].error
    assert out[0].output == serve.sequential_generate(VAN, out[0])[0] and len(out[3].output) == 3


def test_same_seed_same_sampled_outputs():
    reqs = _requests(16, seed=7, gen="2:6")
    kw = dict(temperature=8.0, top_k=20)
    a = serve.DepthWiseServer(REL, 4, seed=11, **kw).run(reqs, clock="step")
    b = serve.DepthWiseServer(REL, 3, seed=11, **kw).run(reqs, clock="step")  # another schedule
    c = serve.DepthWiseServer(REL, 4, seed=12, **kw).run(reqs, clock="step")
    assert [r.output for r in a] == [r.output for r in b]
    assert [r.output for r in a] != [r.output for r in c]
    for r in a[:6]:  # and each equals the request generated alone with its own generator
        assert r.output == serve.sequential_generate(REL, r, temperature=8.0, top_k=20, seed=11)[0]
    v = serve.ContinuousServer(VAN, 4, seed=11, **kw).run(reqs, clock="step")
    for r in v[:6]:
        assert r.output == serve.sequential_generate(VAN, r, temperature=8.0, top_k=20, seed=11)[0]


def test_metrics_and_bad_args():
    reqs = _requests(10, seed=8)
    srv = serve.DepthWiseServer(REL, 4, exit_threshold=bench_serve.calibrate_threshold(REL, reqs),
                                hook=serve_hooks.Metrics())
    d = bench_serve.summarize(srv, srv.run(reqs, clock="step"))
    assert d["tokens"] == sum(r.max_new_tokens for r in reqs) and d["tok_per_s"] > 0
    assert 1.0 <= d["mean_exit_loop"] <= 2.0 and 0 < d["occupancy"] <= 1.0
    with pytest.raises(ValueError, match="slots and prefill_chunk must be >= 1"):
        serve.DepthWiseServer(REL, 0)
    with pytest.raises(ValueError, match="range"):
        serve_requests.parse_range("9:3")
    with pytest.raises(ValueError, match="rate"):
        serve_requests.arrival_times(3, "poisson", 0.0, torch.Generator())


def bench_serve_main(*argv):
    """`python bench.py serve` at the tiny preset: one dtype, B = 2, one round, no warm-up."""
    return bench.main(["serve", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--loops", "2",
                       "--lora-rank", "4", "--repeats", "1", "--warmup", "0", *argv])


def test_each_bad_request_reason_in_the_table_and_in_json(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    lines = [{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}, "{not json", "", {"max_new_tokens": 2},
             {"prompt_ids": [1, 99999], "max_new_tokens": 3}, {"prompt_ids": [], "max_new_tokens": 3},
             {"prompt_ids": [1, 2], "max_new_tokens": 0}, {"prompt_ids": [5] * 300, "max_new_tokens": 2}]
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    bench_serve_main("--requests-file", str(f), "--json")
    out = capsys.readouterr().out
    rows = json.loads(out.splitlines()[-1])["serve"]
    expect = {"1": "bad request line 2 of", "2": "line 4 of", "3": "r.jsonl:5: prompt token id 99999 is outside",
              "4": "r.jsonl:6: empty prompt", "5": "r.jsonl:7: max_new_tokens=0",
              "6": "r.jsonl:8: prompt of 300 tokens"}
    assert len(rows) == 4
    for row in rows:  # every system: request id -> its reason, and the counts by reason
        assert row["errors"] == 6 and set(row["request_errors"]) == set(expect)
        assert all(expect[k] in v for k, v in row["request_errors"].items()), row["request_errors"]
        assert row["errors_by_reason"] == {"bad request line": 2, "bad max_new_tokens": 1, "empty prompt": 1,
                                           "prompt longer than context": 1, "token id outside vocabulary": 1}
    assert ("request errors (every system): 2 bad request line, 1 bad max_new_tokens, 1 empty prompt, 1 prompt longer "
            "than context, 1 token id outside vocabulary") in out


def test_no_valid_request_with_a_given_threshold_reports_zeros(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt_ids": []}\n{oops\n')
    for thr in ("0.9", "auto"):
        res = bench_serve_main("--requests-file", str(f), "--exit-threshold", thr, "--json")
        out = capsys.readouterr().out
        assert res["serve"] and all(r["tokens"] == 0 and r["errors"] == 2 for r in res["serve"])
        assert "end-to-end" not in out and "request errors (every system): 1 bad request line, 1 empty prompt" in out
        json.loads(out.splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} in --json"))  # strict JSON


def _gated():
    torch.manual_seed(5)
    van = GPT(GPTConfig(**{**CFG, "n_layer": 3}))
    with torch.no_grad():
        van.tok_emb.weight.mul_(40.0)
    rel = from_vanilla(van, n_loops=3, init="average", lora_init="svd", log=lambda *_: None, exit_gate=True,
                       lora_rank_q=4, lora_rank_kv=4, lora_rank_o=4, lora_rank_mlp=4)
    with torch.no_grad():
        rel.exit_gate.weight.normal_(0, 1.0)
    return rel.eval()


@pytest.mark.parametrize("rule", ["gate", "saturation"])
@pytest.mark.parametrize("temperature", [0.0, 8.0])
def test_depthwise_with_o_d_exit_rules_equals_sequential(rule, temperature):
    rel = _gated()
    reqs = _requests(30, seed=4)
    thr = bench_serve.calibrate_threshold(rel, reqs, exit_rate=0.5, rule=rule)
    kw = dict(temperature=temperature, top_k=20, seed=3)
    heads = []
    real = rel.exit_logits
    rel.exit_logits = lambda h: (heads.append(h.size(0)), real(h))[1]
    try:
        out = serve.DepthWiseServer(rel, slots=5, exit_threshold=thr, exit_rule=rule, **kw).run(reqs, clock="step")
    finally:
        del rel.exit_logits
    exits = [e for r in out for e in r.exits]
    assert sum(heads) == sum(len(r.output) - 1 for r in out)  # the head ran on leaving rows only
    assert 0 < sum(e < 2 for e in exits[1:]) and len(set(exits)) == 3  # exits at every loop
    for r in out:
        ref, ref_exits = serve.sequential_generate(rel, r, exit_threshold=thr, exit_rule=rule, **kw)
        assert r.output == ref and r.exits == ref_exits, r.rid


# ----------------------------------------------------------------------------------------------------------------
# Hostile inputs: nothing hangs, nothing is silently wrong; a bad request is its own error, a bad run one line


def test_bad_arrivals_and_lines_of_a_requests_file_are_per_request_errors(tmp_path):
    """A requests file read line by line: an arrival that is no time in [0, MAX_ARRIVAL_S] (NaN, Infinity, 1e9, -1),
    prompt_ids that are not a list, a line that is not UTF-8 -- each is its own error; the good lines are served."""
    ok = {"prompt_ids": [1, 2, 3], "max_new_tokens": 2}
    lines = [json.dumps(ok).encode(), json.dumps({**ok, "arrival": float("nan")}).encode(),
             b'{"prompt_ids": [1], "arrival": Infinity}', json.dumps({**ok, "arrival": 1e9}).encode(),
             json.dumps({**ok, "arrival": -1}).encode(), b'{"prompt_ids": "abc"}',
             b'{"prompt_ids": [1, 2], "note": "caf\xe9"}', json.dumps({**ok, "arrival": 3}).encode()]
    f = tmp_path / "r.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    out = serve.ContinuousServer(VAN, 2).run(serve_requests.jsonl_requests(f), clock="step")
    expect = {1: "line 2 of", 2: "line 3 of", 3: "line 4 of", 4: "line 5 of", 5: "r.jsonl:6: prompt_ids must be a list "
              "of token ids", 6: "bad request line 7 of"}
    for rid, what in expect.items():
        assert what in out[rid].error and not out[rid].output, (rid, out[rid].error)
    for rid, arrival in ((1, "nan"), (2, "inf"), (3, "1000000000.0"), (4, "-1")):
        assert f"arrival {arrival} must be a time in [0, 3600] seconds" in out[rid].error
    assert "not UTF-8 text" in out[6].error and out[5].error_kind == "prompt ids not a list"
    assert [len(out[i].output) for i in (0, 7)] == [2, 2] and out[7].t_arrive is not None


def test_a_request_that_never_arrives_is_refused_not_waited_for():
    for t in (float("nan"), float("inf"), -1.0):
        reqs = _requests(3, seed=9)
        reqs[1].arrival = t
        with pytest.raises(ValueError, match=f"request 1: arrival {t} is not a time >= 0"):
            serve.ContinuousServer(VAN, 2).run(reqs, clock="step")


def test_binary_files_directories_and_spans(tmp_path):
    """A binary file: one error per line (each names its line), none served; a directory or a missing file: one
    UsageError naming it; Poisson arrivals spread beyond MAX_ARRIVAL_S (--rate 1e-9): one UsageError naming --rate."""
    f = tmp_path / "bin.jsonl"
    f.write_bytes(bytes(range(11, 256)) * 8 + b"\n\xff\xfe{\n")  # no \n (10) in the first line
    reqs = serve_requests.jsonl_requests(f)
    assert len(reqs) == 2 and all(f"line {i + 1} of {f}: not UTF-8 text" in r.invalid for i, r in enumerate(reqs))
    with pytest.raises(serve_requests.UsageError, match=f"--requests-file {tmp_path} is a directory"):
        serve_requests.jsonl_requests(tmp_path)
    with pytest.raises(serve_requests.UsageError, match="cannot read it"):
        serve_requests.jsonl_requests(tmp_path / "none.jsonl")
    with pytest.raises(serve_requests.UsageError, match="--rate 1e-09: the 4 Poisson arrivals span .* beyond the 3600"):
        serve_requests.arrival_times(4, "poisson", 1e-9, torch.Generator().manual_seed(0))


SERVE_LIMITS = [  # the run's own limits: one line, before any server runs
    (["--requests", "1e8"], "argument --requests: must be <= 100000, got 100000000"),
    (["--requests", "100000000"], "argument --requests: must be <= 100000, got 100000000"),
    (["--requests", "2.5"], "argument --requests: expected an integer, got '2.5'"),
    (["--arrival", "poisson", "--rate", "1e-9"], "--rate 1e-09: the 2 Poisson arrivals span"),
    (["--slots", "100000000"], "--slots 100,000,000: the servers' KV caches need"),
    (["--batch-memory-mb", "1e12"], "--batch-memory-mb 1e+12 (slots "),
    (["--preset", "base", "--lora-rank", "0", "--slots", "1000000"], "--slots 1,000,000: the servers' KV caches need"),
]


@pytest.mark.parametrize("argv,match", SERVE_LIMITS, ids=[" ".join(a) for a, _ in SERVE_LIMITS])
def test_serve_limits_are_one_line_before_serving(capsys, argv, match):
    from test_cli_errors import _one_error_line

    _one_error_line(capsys, lambda a: bench_serve_main(*a), ["--requests", "2", *argv], match)


def test_memory_check_counts_every_servers_cache(capsys, monkeypatch):
    """The KV bytes of the message are the caches' own: tiny (4 layers, 2 KV heads of 32) at 8 + 8 + 8 positions
    (prompt, new tokens, margin), fp32, is 2 * 4 * 24 * 2 * 32 * 4 = 48 KiB per slot (the relaxed model's B*K = 4
    cache layers alike); 16 slots x 4 servers (CSB, depth-wise without exit, two exit rules) = 4 x 768 KiB. Chunked
    prefill writes into the slots: no temporary cache."""
    monkeypatch.setattr(bench_serve, "available_memory", lambda device: (10 ** 6, "test"))
    with pytest.raises(SystemExit):
        bench_serve_main("--requests", "2", "--prompt-len", "8", "--gen-len", "8")
    err = capsys.readouterr().err
    assert f"need 0.00315 GB ({4 * 16 * 48 * 2 ** 10:,} bytes" in err and "has 0.001 GB (1,000,000 bytes) available " \
        "(test)" in err


@pytest.mark.slow
def test_serve_command_with_a_directory(tmp_path):
    """Through the interpreter: exit code 2, one stderr line naming the directory, no traceback."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "serve", "--requests-file", str(tmp_path),
                        "--warmup", "0", "--preset", "tiny"], capture_output=True, text=True, timeout=120)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and err == [f"error: --requests-file {tmp_path} is a directory, not a JSONL file"], \
        r.stderr


def test_bench_says_where_the_exits_come_from_and_when_the_model_is_too_small(capsys, monkeypatch):
    """Every setting of `python bench.py serve` says whether its exits are SIMULATED (no --ckpt: random weights, or
    the pretrained vanilla model converted without training) or REAL, and at the tiny preset that the depth-wise
    bargain needs a model whose weights dominate a step."""
    bench_serve_main("--requests", "2", "--gen-len", "2", "--rules", "softmax")
    out = capsys.readouterr().out
    assert "SIMULATED exits: no --ckpt, the depth-wise model is random weights" in out
    assert "SMALL MODEL (" in out and "(the base preset)" in out
    monkeypatch.setattr(bench_serve, "SMALL_MODEL_PARAMS", 0)
    bench_serve_main("--requests", "2", "--gen-len", "2", "--rules", "softmax")
    assert "SMALL MODEL (" not in capsys.readouterr().out


def test_demo_serves_every_system_and_prints_its_table(capsys, monkeypatch):
    """`python serve.py` (the small preset by default; here tiny): the same requests through vanilla continuous and
    static batching and depth-wise batching without and with simulated exits, a warm-up of one batch each, then the
    servers interleaved round by round; every token generated by every system, exits between loop 1 and 2, each
    column explained under the table."""
    args = serve_demo.demo_parser().parse_args([])
    assert (args.preset, args.lora_rank, args.requests, args.slots, args.rounds, args.compile) == \
        ("small", 0, 32, 16, 3, None)
    runs, real = [], serve.Server.run
    monkeypatch.setattr(serve.Server, "run", lambda srv, reqs, clock="wall": (runs.append((srv.name, len(reqs))),
                                                                              real(srv, reqs, clock))[1])
    serve_demo.main(["--preset", "tiny", "--requests", "6", "--slots", "3", "--rounds", "2", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "exits SIMULATED (random weights)" in out and "steps eager" in out
    names = [name for name, _ in runs[:4]]
    assert names[0] == "vanilla continuous" and runs == [(n, 3) for n in names] + [(n, 6) for n in names] * 2
    assert "warm-up " in out and " 2 interleaved rounds of 6 requests take about " in out
    table, legend = out.split("x continuous\n")[1].split("\n\n")[:2]
    rows = {line[:30].strip(): line[30:].split() for line in table.splitlines()}
    assert list(rows) == names[:1] + ["vanilla static", "depth-wise no exit", names[3]]
    assert names[3].startswith("depth-wise softmax>=")
    assert len({r[0] for r in rows.values()}) == 1  # every system generated every token
    assert rows["vanilla continuous"][-2:] == ["1.00", "(1.00..1.00)"] and 1.0 < float(rows[names[3]][-3]) < 2.0
    assert [line.split()[0] for line in legend.splitlines()] == ["tokens", "tok/s", "loaded", "step", "exit", "x"]


@pytest.mark.parametrize("threads, load, cores, want", [
    (2, 0.1, 2, 2),   # idle: torch's threads
    (2, 0.6, 2, 1),   # one core's worth of other work (rounded): the free core
    (2, 2.1, 2, 1),   # both cores busy (a two-process training job): one thread, never zero
    (2, 7.0, 2, 1),
    (8, 3.2, 8, 5),   # five cores free of eight
    (4, 0.0, 16, 4),  # never more than torch's
])
def test_demo_threads_on_a_busy_cpu(threads, load, cores, want):
    """busy_threads: the cores other jobs leave free (cores - load, rounded), at most torch's threads, at least 1."""
    assert serve_demo.busy_threads(threads, load, cores) == want


def test_busy_cores_reads_the_cpu_counters(monkeypatch, tmp_path):
    """busy_cores: the share of non-idle ticks between two reads of /proc/stat's cpu line, times the cores."""
    lines = iter(["cpu  100 0 100 800 0 0 0 0 0 0\n", "cpu  250 0 250 1000 0 0 0 0 0 0\n"])  # 300 busy of 500 ticks

    def fake_open(path, *a, **k):
        assert path == "/proc/stat"
        f = tmp_path / "stat"
        f.write_text(next(lines))
        return open(f)
    monkeypatch.setattr(serve_demo, "open", fake_open, raising=False)
    monkeypatch.setattr(serve_demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(serve_demo.time, "sleep", lambda s: None)
    assert serve_demo.busy_cores() == pytest.approx(2 * 300 / 500)


def test_demo_threads_flag_and_the_callers_threads_kept(capsys):
    """--threads N runs the demo on N threads and says so in its header; the caller's thread count is restored."""
    before = torch.get_num_threads()
    n = 2 if before == 1 and (os.cpu_count() or 1) >= 2 else 1  # not the caller's count (the suite runs on 1)
    serve_demo.main(["--preset", "tiny", "--requests", "3", "--slots", "3", "--rounds", "1", "--dtype", "float32",
                     "--device", "cpu", "--threads", str(n)])
    assert f" | threads {n}\n" in capsys.readouterr().out
    assert torch.get_num_threads() == before


def test_demo_schedule_prints_figure_3_of_its_run(capsys):
    """`python serve.py --schedule N`: after the table, the first N forward passes of the depth-wise server with exits
    on the same requests, one line per slot (a ScheduleTrace): every slot starts with its prompt's prefill pass,
    and the decode steps run rows at loops 1 and 2, tokens leaving at both."""
    serve_demo.main(["--preset", "tiny", "--requests", "5", "--slots", "3", "--rounds", "1", "--dtype", "float32",
                     "--schedule", "12"])
    out = capsys.readouterr().out
    grid = out.split("Figure 3 (continuous depth-wise batching), traced from the run above:\n")[1].splitlines()
    assert grid[3].startswith("depth-wise softmax>=") and ": forward passes 1..12 of " in grid[3]
    rows = grid[5:]
    assert len(rows) == 3 and all(r.startswith("slot ") and len(r) == 7 + 3 * 12 and r[9] == "p" for r in rows)
    cells = {c for r in rows for c in r[7:].split()}
    assert {c[1] for c in cells} >= {"p", "1", "2"} and any(c == c.upper() and c[1] in "12" for c in cells)
