"""eval.py recovery and samples: the recovery experiment's CPU path on a tiny vanilla checkpoint that stands in for
SmolLM2 (trained here for a few steps), the teacher samples, and what every row's train.py flags build."""
import contextlib
import json
import os
import signal

import pytest
import torch

import eval as ev
import train
from conftest import write_jsonl
from harness import checkpoint, cli, recovery
from model import GPT, GPTConfig


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 4-layer vanilla checkpoint of a few steps on a small word corpus of two files (one is the validation split)."""
    d = tmp_path_factory.mktemp("recovery")
    words = "def class return import self value index loop layer shared token cache exit".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (80,), generator=g)) for _ in range(80)]
    write_jsonl(d / "corpus" / "a.jsonl", docs[:40])
    write_jsonl(d / "corpus" / "b.jsonl", docs[40:])
    common = ["--data", str(d / "corpus"), "--cache-dir", str(d / "cache"), "--device", "cpu"]
    train.train(["--arch", "vanilla", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4", "--max-iters", "3",
                 "--eval-iters", "1", "--sample-tokens", "0", "--out-dir", str(d / "src"), "--dtype", "float32",
                 *common])
    return d, str(d / "src" / "ckpt.pt"), common


def test_every_row_is_a_conversion_train_py_builds(source, tmp_path):
    """The flags of rows (a)-(e) and (a+samples), one step each through train.py: the models the command compares,
    with the parameter ordering the rows promise."""
    d, src, common = source
    args = ev.build_parser().parse_args(["recovery", "--lora-rank", "4"])
    n_params = {}
    rows = recovery.recovery_rows(4, {"q": 32, "kv": 32, "o": 32, "mlp": 32}, args, tmp_path)
    for row, (label, flags) in rows.items():
        if row == "a+samples":
            write_jsonl(tmp_path / "samples" / "s.jsonl", ["return self value"] * 20)
        train.train([*flags, "--init-from", src, "--teacher", src, "--max-iters", "1", "--eval-iters", "1",
                     "--seq-len", "32", "--batch-size", "2", "--sample-tokens", "0", "--dtype", "float32",
                     "--out-dir", str(tmp_path / row), *common])
        ck = checkpoint.load_checkpoint(tmp_path / row / "ckpt.pt")
        n_params[row] = checkpoint.model_from_checkpoint(ck).num_params()
        assert ck["args"]["teacher"] == src
    assert n_params["a"] == n_params["b"] == n_params["a+samples"] < n_params["c"] < n_params["e"]
    assert n_params["a"] < n_params["d"] < n_params["e"]  # Middle-Cycle: 1 + 1 shared + 1 of the 4 layers


@pytest.mark.slow
def test_recovery_command_builds_the_curves_in_calls_then_serves_real_exits(source, capsys):
    """The command's CPU path, as a few GPU calls would run it: (1) --minutes times row (a) and fixes the budget,
    rows a and b train; (2) another budget on the same results is refused before any work; (3) a+samples (teacher
    samples generated first) and the exits stage are added, row (a) is kept, not retrained. Checked against the
    commands it stands on: each curve starts at the conversion's and ends at the checkpoint's `eval.py loss`."""
    d, src, common = source
    out = d / "out"
    base = ["recovery", "--source", src, "--data", str(d / "corpus"), "--cache-dir", str(d / "cache"), "--out-dir",
            str(out), "--batch-size", "2", "--seq-len", "32", "--eval-tokens", "256", "--device", "cpu"]
    ev.main([*base, "--minutes", "0.002", "--rows", "a,b"])
    text = capsys.readouterr().out
    settings, rows, _ = recovery.read_recovery(out / "recovery.jsonl")
    budget = settings["tokens"]
    assert budget % 64 == 0 and budget >= 64 and set(rows) == {"a", "b"}
    for r in "ab":
        assert rows[r]["points"][0][0] == 0 and rows[r]["points"][-1][0] == budget
    loss = lambda *a: ev.run(["loss", "--data", str(d / "corpus"), "--cache-dir", str(d / "cache"),  # noqa: E731
                              "--tokens", "256", "--seq-len", "32", "--device", "cpu", "--model", *a])["loss"]
    assert rows["a"]["points"][0][1] == pytest.approx(loss(src, "--arch", "recursive", "--init", "stepwise"), abs=1e-5)
    for r in "ab":  # another process: the same numbers up to the summation order of its threads
        assert rows[r]["points"][-1][1] == pytest.approx(loss(str(out / "rows" / r / "ckpt.pt")), abs=1e-5)
    assert "looped (a) - same-size non-looped (b): 0 " in text and (out / "recovery.md").read_text() in text
    capsys.readouterr()

    with pytest.raises(SystemExit):
        ev.main([*base, "--tokens", str(budget + 64), "--rows", "c"])
    assert f"holds rows of {budget:,} tokens, here --tokens {budget + 64:,}" in capsys.readouterr().err

    kept = (out / "rows" / "a" / "ckpt.pt").stat().st_mtime_ns
    ev.main([*base, "--rows", "a,a+samples", "--stages", "curves,exits", "--thresholds", "0.5,0.9"])
    text = capsys.readouterr().out
    assert (out / "rows" / "a" / "ckpt.pt").stat().st_mtime_ns == kept  # in the results already: not retrained
    manifest = json.loads((out / "samples" / "manifest.json").read_text())
    assert sum(manifest["shards"].values()) >= budget // 2  # share 0.5 of the budget, each sample seen about once
    settings, rows, exits = recovery.read_recovery(out / "recovery.jsonl")
    assert set(rows) == {"a", "b", "a+samples"} and rows["a+samples"]["points"][-1][0] == budget
    assert "(a) with teacher samples - (a) on" in text
    assert exits["row"] in ("a", "a+samples") and [p["threshold"] for p in exits["gate"]] == [0.5, 0.9]
    assert exits["served"]["original"]["tokens"] > 0 and exits["served"]["gate>=0.9"]["tokens"] > 0
    assert exits["post_curve"][0][1] == pytest.approx(rows[exits["row"]]["points"][-1][1], abs=1e-5)
    table = (out / "exits.md").read_text()
    assert table in text and "| gate>=0.5 |" in table and "| original |" in table
    ev.main(["recovery", "--out-dir", str(out), "--stages", "table"])  # the tables again, from the results alone
    assert capsys.readouterr().out.startswith((out / "recovery.md").read_text())


def test_samples_are_seeded_per_shard_and_continue_where_they_stopped(source, tmp_path, capsys):
    d, src, _ = source
    flags = ["samples", "--model", src, "--length", "16", "--batch-size", "3", "--device", "cpu"]
    ev.main([*flags, "--tokens", "30", "--out", str(tmp_path / "x")])
    ev.main([*flags, "--tokens", "60", "--out", str(tmp_path / "x")])  # goes on from the shards there
    ev.main([*flags, "--tokens", "60", "--out", str(tmp_path / "y")])  # at once
    for name in json.loads((tmp_path / "y" / "manifest.json").read_text())["shards"]:
        assert (tmp_path / "x" / name).read_text() == (tmp_path / "y" / name).read_text()
    lines = (tmp_path / "y" / "samples_00000.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["meta"]["redpajama_set_name"] == "TeacherSamples"
                                   for line in lines)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # other settings into the same directory
        ev.main([*flags, "--tokens", "60", "--out", str(tmp_path / "y"), "--seed", "7"])
    assert "holds samples of other settings (seed 1337, here 7)" in capsys.readouterr().err


def test_generate_is_greedy_for_the_first_tokens_then_samples():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=48, vocab_size=64,
                      max_seq_len=32)).eval()
    idx = torch.randint(0, 64, (8, 1))
    greedy = m.generate(idx, 12)
    hot = lambda k, s: m.generate(idx, 12, temperature=5.0, generator=torch.Generator().manual_seed(s),  # noqa: E731
                                  greedy_first=k)
    assert torch.equal(hot(4, 0)[:, :5], greedy[:, :5])  # the first 4 new tokens are the argmax
    assert not torch.equal(hot(4, 0)[:, 5:], greedy[:, 5:])  # then sampled (at temperature 5, not the argmax)
    assert torch.equal(hot(4, 0), hot(4, 0)) and not torch.equal(hot(0, 0)[:, 1:5], greedy[:, 1:5])


def test_crossing_says_where_a_row_ends_below_its_baseline():
    t = [0, 1000, 10000, 100000]
    assert recovery.crossing(t, [0.5, 0.2, -0.1, -0.2]) == "crosses below between 1k and 10k tokens and stays below"
    assert recovery.crossing(t, [-0.1, -0.2, -0.1, -0.3]) == "below at every point"
    assert recovery.crossing(t, [0.6, 0.5, -0.1, 0.2]) == ("not below at the end: +0.600 at 0 -> +0.200 at 100k "
                                                           "(below at 10k only)")
    assert recovery.curve_points(40000, None) == [0, 10000, 30000, 40000]
    assert recovery.curve_points(10 ** 7, None)[-3:] == [1000000, 3000000, 10 ** 7]


def test_a_sigterm_to_recovery_is_passed_on_to_the_run_it_started(tmp_path):
    """`kill PID` of eval.py recovery while a train.py child runs: the child is stopped too (SIGTERM passed on, then
    waited for), never left running on its own; the parent ends as stopped (Terminated)."""
    child = tmp_path / "child.py"  # stands in for train.py: says its pid, then runs on
    child.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    pids = []

    def on_line(line):  # the child runs: SIGTERM to this process alone
        pids.append(int(line))
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    try:
        with cli._sigterm_interrupts(), pytest.raises(cli.Terminated):
            recovery.run_script(str(child), [], keep=on_line)
        with pytest.raises(ProcessLookupError):  # stopped and reaped
            os.kill(pids[0], 0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
