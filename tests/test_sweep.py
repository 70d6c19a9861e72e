"""harness/sweep.py (`python eval.py sweep`): the grid and the seeds each side runs, resuming a stopped sweep without
running a recorded run again, a damaged results line as one error line, the best setting of each side, the table.
A fake runner stands in for train.py and eval.py: it writes a checkpoint file and prints the lines the sweep reads,
with a loss that is a known function of the run's flags."""
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import sys
import threading

import pytest

import eval as eval_cli
from harness import sweep
from harness.cli import Stopped, UsageError


def flag(cmd, name, default=None):
    return cmd[cmd.index(name) + 1] if name in cmd else default


def fake_loss(cmd) -> float:
    """Lowest at lr 2e-3 / wd 0.1 for vanilla, at lr 4e-3 / wd 0.5 for everything else; seeds move it a little."""
    lr, wd = float(flag(cmd, "--lr", 2e-3)), float(flag(cmd, "--weight-decay", 0.1))
    seed = int(flag(cmd, "--seed", 1337))
    arch = flag(cmd, "--arch")
    best_lr, best_wd = (2e-3, 0.1) if arch == "vanilla" else (4e-3, 0.5)
    return 4.0 + 0.1 * math.log2(lr / best_lr) ** 2 + abs(wd - best_wd) + (0.0 if arch == "vanilla" else 0.05) \
        + 0.001 * (seed % 7)


class FakeRunner:
    """train.py: a checkpoint file in --out-dir and a `val` line; eval.py: the score line of each evaluation. stop_at:
    the train.py call (1-based) that ends as a stopped run (exit code 130, its checkpoint written); fail: a predicate
    of the command for runs that train.py refuses (exit code 2)."""

    def __init__(self, stop_at=None, fail=lambda cmd: False, stop_eval_at=None, loss=None):
        self.train, self.evals, self.stop_at, self.fail, self.stop_eval_at = [], [], stop_at, fail, stop_eval_at
        self.loss = loss or fake_loss
        self.cpu = "fake CPU"
        self.mutex = threading.Lock()

    @contextlib.contextmanager
    def held(self):
        yield

    def run(self, cmd, log):
        script = os.path.basename(cmd[1])
        if script == "train.py":
            with self.mutex:  # two runs at once (--parallel): each call gets its own number
                self.train.append(cmd)
                number = len(self.train)
            out = flag(cmd, "--out-dir")
            os.makedirs(out, exist_ok=True)
            if "--resume" in cmd:
                with open(os.path.join(out, "args.json")) as f:
                    cmd = json.load(f)
            else:
                with open(os.path.join(out, "args.json"), "w") as f:
                    json.dump(cmd, f)
            with open(os.path.join(out, "ckpt.pt"), "w") as f:
                f.write("checkpoint")
            if number == self.stop_at:
                return 130, ["stopped: SIGTERM after step 10\n"]
            if self.fail(cmd):
                return 2, ["error: non-finite loss nan at step 12; stopping without writing a checkpoint\n"]
            loss = self.loss(cmd)
            if flag(cmd, "--data") == "task:phop":
                acc = " ".join(f"p{p} {min(1.0, 1 / loss + 0.1 * (4 - p)):.3f}" for p in range(1, 5))
                return 0, [f"step 800 loss {loss:.4f}\n", f"val step 800 loss {loss:.4f} ppl 50.0 acc {acc}\n"]
            return 0, [f"val step {flag(cmd, '--max-iters')} loss {loss:.4f} ppl 50.0\n"]
        with self.mutex:
            self.evals.append(cmd)
            number = len(self.evals)
        if number == self.stop_eval_at:
            return 130, ["stopped: interrupted (Ctrl-C)\n"]
        ck = score_ckpt(cmd)
        with open(os.path.join(os.path.dirname(ck), "args.json")) as f:
            loss = self.loss(json.load(f)) - 0.01
        if cmd[2] == "loss":
            return 0, [f"{ck} [plt step 800]: 1.0M parameters | 307,200 tokens | loss {loss:.4f} ppl 50.00\n"]
        if cmd[2] == "double-eval":
            return 0, [f"vanilla    1.18M non-emb | native loss {loss:.4f} | prefix-LM suffix loss {loss + 0.02:.4f}"
                       f" | {ck}\n"]
        return 0, ["validation: 20 x 16 windows\n"] + [f"   {p} block {loss:14.4f}\n" for p in cmd[4:-2]]


def score_ckpt(cmd):  # the checkpoint an evaluation command scores (the last one it names)
    return next(c for c in reversed(cmd) if c.endswith("ckpt.pt"))


def run_sweep(name, out, runner, **kw):
    return sweep.sweep(sweep.COMPARISONS[name], out, runner, echo=lambda s: None, **kw)


def grid_of(comp):
    return {(s.name, lr, wd) for s in comp.sides for lr in s.lrs for wd in s.wds}


def test_grid_then_each_sides_best_at_the_other_seeds(tmp_path):
    comp = sweep.COMPARISONS["double-tiny"]
    runner = FakeRunner()
    results = run_sweep("double-tiny", tmp_path, runner)
    side_of = {"vanilla": "decoder-only", "double": "double"}
    runs = [(side_of[flag(c, "--arch")], float(flag(c, "--lr")), float(flag(c, "--weight-decay")),
             int(flag(c, "--seed"))) for c in runner.train]
    # the whole 3 x 3 grid per side; the double decoder's best lr (4e-3) lies at the grid's upper edge: 8e-3 runs too,
    # at every weight decay, and is worse (the best stays)
    beyond = {("double", 8e-3, wd) for wd in (0.0, 0.1, 0.5)}
    assert len(runs) == 3 * 3 * 2 + 3 + 2 * 2 == sweep.total_runs(comp) + 3
    assert {(s, lr, wd) for s, lr, wd, seed in runs if seed == 1337} == grid_of(comp) | beyond
    assert sorted(r for r in runs if r[3] != 1337) == [("decoder-only", 2e-3, 0.1, 2), ("decoder-only", 2e-3, 0.1, 3),
                                                        ("double", 4e-3, 0.5, 2), ("double", 4e-3, 0.5, 3)]
    assert len(runner.evals) == len(runs)  # every run scored once, by double-eval
    assert all(c[2] == "double-eval" and c[3].endswith("ckpt.pt") for c in runner.evals)
    done = [r for r in results.values() if r["status"] == "done"]
    assert len(done) == len(runs)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert sum(json.loads(ln)["status"] == "done" for ln in lines) == len(runs)
    assert (tmp_path / "table.md").is_file() and (tmp_path / "plot.txt").is_file()


def loss_at(best: dict):
    """A fake loss lowest at best[arch] = (lr, wd)."""
    def loss(cmd):
        lr, wd = float(flag(cmd, "--lr", 2e-3)), float(flag(cmd, "--weight-decay", 0.1))
        b_lr, b_wd = best[flag(cmd, "--arch")]
        return 4.0 + 0.1 * math.log2(lr / b_lr) ** 2 + abs(wd - b_wd) + 0.001 * (int(flag(cmd, "--seed", 1337)) % 7)
    return loss


@pytest.mark.parametrize("extend", [0, 1, 3])
def test_a_best_at_an_edge_of_the_grid_runs_the_learning_rates_beyond_it(tmp_path, extend):
    """decoder-only's optimum lies below the grid (lr 5e-4), the double decoder's above it (1.6e-2): each side's grid
    grows one learning rate at a time beyond the edge its best lies on, `extend` times at most; the seeds run at the
    best of the grown grid; the table shows the grown grid and says where the best still lies at an edge."""
    comp = dataclasses.replace(sweep.COMPARISONS["double-tiny"], extend=extend)
    runner = FakeRunner(loss=loss_at({"vanilla": (5e-4, 0.1), "double": (1.6e-2, 0.0)}))
    sweep.sweep(comp, tmp_path, runner, echo=lambda s: None)
    ran = {}
    for c in runner.train:
        ran.setdefault(int(flag(c, "--seed")), set()).add((flag(c, "--arch"), float(flag(c, "--lr")),
                                                           float(flag(c, "--weight-decay"))))
    lrs = {a: sorted({lr for arch, lr, _ in ran[1337] if arch == a}) for a in ("vanilla", "double")}
    want_double = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2][:3 + extend]  # 3.2e-2 is worse than 1.6e-2: it stops there
    want_vanilla = [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3][2 - min(extend, 2):]  # 2.5e-4 is worse than 5e-4: it stops there
    assert lrs == {"vanilla": want_vanilla, "double": want_double}
    assert all(len([x for x in ran[1337] if x[0] == a and x[1] == lr]) == 3 for a in lrs for lr in lrs[a])  # every wd
    best = {"vanilla": max(want_vanilla[0], 5e-4), "double": min(want_double[-1], 1.6e-2)}
    assert ran[2] == ran[3] == {("vanilla", best["vanilla"], 0.1), ("double", best["double"], 0.0)}
    text = (tmp_path / "table.md").read_text()
    assert f"| double | {sweep._g(want_double[-1])} |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| double | {sweep._g(best['double'])} | 0 |"))
    assert ("lr" in row and "upper edge" in row) == (extend < 3)  # 1.6e-2 lies inside the grid grown 3 times
    assert f"{len(runner.train)} of {len(runner.train)} runs recorded" in text


def test_the_runs_left_count_what_is_still_to_run(tmp_path):
    """The progress line's count of queued runs is the runs still to run, not the run's place in the plan: a sweep
    whose only missing record is its third run has nothing queued once that run ends."""
    comp = dataclasses.replace(sweep.COMPARISONS["double-tiny"], extend=0)
    sweep.sweep(comp, tmp_path, FakeRunner(), echo=lambda s: None)
    path = tmp_path / "results.jsonl"
    third = sweep.grid_runs(comp, tmp_path, comp.steps, {})[2]
    path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines() if json.loads(ln)["key"] != third.key))
    (third.out / "ckpt.pt").unlink()
    lines, runner = [], FakeRunner()
    sweep.sweep(comp, tmp_path, runner, echo=lines.append)
    assert len(runner.train) == 1
    done = [ln for ln in lines if ln.startswith("[3/22] -> ")]
    assert len(done) == 1 and "queued" not in done[0], lines
    lines = []
    path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines()
                            if json.loads(ln)["kind"] != "seed"))  # the four seed runs to run again, after the grid
    sweep.sweep(comp, tmp_path, FakeRunner(), echo=lines.append)
    left = [int(re.search(r"for the (\d+) runs queued", ln).group(1)) if "queued" in ln else 0 for ln in lines
            if re.match(r"\[\d+/22\] -> ", ln)]
    assert left == [3, 2, 1, 0], lines


def test_a_stopped_sweep_resumes_and_runs_no_recorded_run_again(tmp_path):
    first = FakeRunner(stop_at=5)
    with pytest.raises(Stopped):
        run_sweep("double-tiny", tmp_path, first)
    recorded = sweep.read_results(tmp_path / "results.jsonl")
    assert sum(r["status"] == "done" for r in recorded.values()) == 4
    done_dirs = {r["ckpt"].rsplit("/", 1)[0] for r in recorded.values()}
    stopped_dir = flag(first.train[4], "--out-dir")
    second = FakeRunner()
    run_sweep("double-tiny", tmp_path, second)
    again = [flag(c, "--out-dir") for c in second.train]
    assert not set(again) & done_dirs  # no recorded run trained again
    assert len(second.train) == 25 - 4  # 18 grid runs, 3 beyond the double decoder's edge, 4 seed runs
    assert second.train[0][2] == "--resume" and again[0] == stopped_dir  # the stopped run continues from its ckpt
    results = sweep.read_results(tmp_path / "results.jsonl")
    assert sum(r["status"] == "done" for r in results.values()) == 25
    third = FakeRunner()
    run_sweep("double-tiny", tmp_path, third)  # everything recorded: nothing runs
    assert third.train == [] and third.evals == []


def test_a_resumed_run_stopped_again_stops_the_sweep_and_keeps_its_checkpoint(tmp_path):
    """A stop that reaches a resuming run (exit code 130) is a stop, not a checkpoint that cannot continue: the sweep
    stops at once, the checkpoint stays, and nothing is trained from scratch."""
    with pytest.raises(Stopped):
        run_sweep("double-tiny", tmp_path, FakeRunner(stop_at=2))
    again = FakeRunner(stop_at=1)
    with pytest.raises(Stopped):
        run_sweep("double-tiny", tmp_path, again)
    assert len(again.train) == 1 and again.train[0][2] == "--resume", again.train
    assert os.path.isfile(os.path.join(flag(again.train[0], "--out-dir"), "ckpt.pt"))


def test_a_run_trained_but_not_scored_is_only_scored(tmp_path):
    first = FakeRunner(stop_eval_at=3)
    with pytest.raises(Stopped):
        run_sweep("looped-corpus", tmp_path, first)
    assert len(first.train) == 3
    second = FakeRunner()
    run_sweep("looped-corpus", tmp_path, second)
    # 15 runs and vanilla-4 at lr 1e-3 (its best, 2e-3, lies at the grid's lower edge); the third run's training is
    # recorded: not trained again
    assert len(second.train) == 16 - 3
    assert score_ckpt(second.evals[0]) == score_ckpt(first.evals[2])


def test_a_failed_run_is_recorded_ranks_last_and_is_not_rerun(tmp_path):
    diverges = lambda cmd: flag(cmd, "--lr") == "0.008" and flag(cmd, "--plt-variant") == "loop"  # noqa: E731
    runner = FakeRunner(fail=diverges)
    results = run_sweep("looped-corpus", tmp_path, runner)
    failed = [r for r in results.values() if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["error"].startswith("error: non-finite loss")
    assert len(runner.train) == 16 and len(runner.evals) == 15  # a failed run is not scored
    again = FakeRunner()
    run_sweep("looped-corpus", tmp_path, again)
    assert again.train == []
    assert "failed" in (tmp_path / "table.md").read_text()


def test_a_damaged_results_line_is_one_error_line(tmp_path, capsys):
    run_sweep("relaxed", tmp_path, FakeRunner())
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3] + ['{"key": "abc", "status": "don'] + lines[3:]) + "\n")
    with pytest.raises(UsageError, match=r"line 4 is damaged"):
        sweep.read_results(path)
    with pytest.raises(SystemExit) as e:
        eval_cli.main(["sweep", "relaxed", "--out", str(tmp_path), "--table"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: results file") and "line 4" in err[0]
    path.write_text("\n".join(lines[:2] + ['{"key": "abc", "status": "done", "kind": "grid", "name": "x", '
                                           '"side": "relaxed", "lr": 0.001, "wd": 0.1, "seed": 1}']) + "\n")
    with pytest.raises(UsageError, match=r"line 3 .*'score' is not a finite number"):
        sweep.read_results(path)
    path.write_text("\n".join(lines[:1] + [re.sub(r'"status": "\w+"', '"status": "finished"', lines[1])]) + "\n")
    with pytest.raises(UsageError, match=r"line 2 .*'status' is 'finished'"):
        sweep.read_results(path)


def record(side, lr, wd, seed, score, status="done", kind="grid"):
    return {"key": "", "status": status, "kind": kind, "name": "", "side": side, "lr": lr, "wd": wd, "seed": seed,
            "score": score, "extras": {}}


def results_for(comp, tmp_path, scores: dict, status=None):
    """{(side, lr, wd): score} -> results keyed as the sweep keys them, at the grid seed."""
    grid = sweep.grid_runs(comp, tmp_path, comp.steps, sweep.source_runs(comp, tmp_path))
    out = {}
    for r in grid:
        if (r.side, r.lr, r.wd) in scores:
            st = (status or {}).get((r.side, r.lr, r.wd), "done")
            out[r.key] = {**record(r.side, r.lr, r.wd, r.seed, scores[(r.side, r.lr, r.wd)], st), "key": r.key}
    return grid, out


def test_best_per_side(tmp_path):
    comp = sweep.COMPARISONS["relaxed"]
    scores = {("recursive", lr, 0.1): s for lr, s in zip(comp.sides[0].lrs, [4.3, 4.1, 4.2])}
    scores.update({("relaxed", lr, 0.1): s for lr, s in zip(comp.sides[1].lrs, [4.0, 3.9, 4.5])})
    grid, results = results_for(comp, tmp_path, scores, {("relaxed", 2e-3, 0.1): "failed"})
    best = sweep.best_per_side(comp, grid, results)
    assert (best["recursive"].lr, best["relaxed"].lr) == (2e-3, 1e-3)  # the failed 3.9 ranks last
    del results[next(r.key for r in grid if r.side == "recursive" and r.lr == 4e-3)]
    assert "recursive" not in sweep.best_per_side(comp, grid, results)  # a side's grid not finished: no best yet
    comp = sweep.COMPARISONS["looped-phop"]  # accuracy: higher is better
    scores = {(s.name, lr, 0.1): v for s in comp.sides for lr, v in zip(s.lrs, [0.7, 0.9, 0.8])}
    grid, results = results_for(comp, tmp_path, scores)
    assert {s: r.lr for s, r in sweep.best_per_side(comp, grid, results).items()} == \
        {"loop-2": 2e-3, "vanilla-2": 2e-3, "vanilla-4": 2e-3}


def test_table(tmp_path):
    runner = FakeRunner()
    run_sweep("double-tiny", tmp_path, runner)
    comp = sweep.COMPARISONS["double-tiny"]
    text = sweep.table(comp, tmp_path, comp.steps, sweep.read_results(tmp_path / "results.jsonl"))
    assert "| decoder-only | 0.002 |" in text and "| double | 0.004 |" in text
    # the grid: the best cell of each side in bold; 9 cells per side
    dec = fake_loss(["--arch", "vanilla", "--lr", "0.002", "--weight-decay", "0.1", "--seed", "1337"]) - 0.01
    dbl = fake_loss(["--arch", "double", "--lr", "0.004", "--weight-decay", "0.5", "--seed", "1337"]) - 0.01
    assert f"**{dec:.3f}**" in text and f"**{dbl:.3f}**" in text
    # each side's best over its three seeds, its edges said
    row = next(ln for ln in text.splitlines() if ln.startswith("| double | 0.004 | 0.5 |"))
    means = {}
    for arch, lr, wd in (("vanilla", "0.002", "0.1"), ("double", "0.004", "0.5")):
        v = [fake_loss(["--arch", arch, "--lr", lr, "--weight-decay", wd, "--seed", s]) - 0.01
             for s in ("1337", "2", "3")]
        means[arch] = sum(v) / 3
        if arch == "double":
            assert f"{means[arch]:.3f} ± {(max(v) - min(v)) / 2:.3f}" in row
    # lr 0.004 lay at the grid's upper edge: 0.008 ran beyond it (at every wd) and lost, so only the wd edge is said
    assert "| double | 0.008 |" in text and "| decoder-only | 0.008 |" not in text
    assert "lr 0.004" not in row and "weight decay 0.5 is at the upper edge" in row
    dec_row = next(ln for ln in text.splitlines() if ln.startswith("| decoder-only | 0.002 | 0.1 |"))
    assert "edge" not in dec_row
    assert f"double − decoder-only, each at its best setting: **{means['double'] - means['vanilla']:+.3f}**" in text
    assert "Budget per run: 300 steps x 16 x 256 tokens (1.23M tokens)" in text
    assert "25 of 25 runs recorded" in text and "fake CPU" in text
    assert "python eval.py sweep double-tiny" in text
    plot = (tmp_path / "plot.txt").read_text()
    assert plot.count("<- best") == 2 and "best, seed 3" in plot


def test_sources_are_trained_once_and_every_uptraining_starts_from_them(tmp_path):
    runner = FakeRunner()
    run_sweep("block", tmp_path, runner)
    sources = [c for c in runner.train if "/sources/" in flag(c, "--out-dir")]
    assert len(sources) == 2  # the vanilla source, the block layout converted from it
    src = os.path.join(flag(sources[0], "--out-dir"), "ckpt.pt")
    assert flag(sources[1], "--init-from") == src
    assert all(flag(c, "--init-from") == src for c in runner.train if c not in sources)
    layout = os.path.join(flag(sources[1], "--out-dir"), "ckpt.pt")
    for c in runner.evals:  # a vanilla run is scored on the block layout's targets, a block run on its own
        scored = score_ckpt(c)
        assert c[2] == "block" and c[4] == (layout if "/runs/vanilla-" in scored else scored)
    again = FakeRunner()
    run_sweep("block", tmp_path, again)
    assert again.train == []


def test_reuse_copies_identical_runs_of_another_sweep(tmp_path):
    run_sweep("looped-corpus", tmp_path / "looped", FakeRunner())
    runner = FakeRunner()
    results = run_sweep("plt", tmp_path / "plt", runner, reuse=[tmp_path / "looped"])
    assert {flag(c, "--plt-variant") for c in runner.train} == {"plt"}  # vanilla-2 and loop-2 were copied
    assert len(runner.train) == 5
    assert sum("reused_from" in r for r in results.values()) == 10


def test_phop_is_scored_by_accuracy_from_the_val_line(tmp_path):
    runner = FakeRunner()
    results = run_sweep("looped-phop", tmp_path, runner)
    assert runner.evals == []
    rec = next(iter(results.values()))
    assert set(rec["extras"]) == {"p1", "p2", "p3", "p4"}
    assert rec["score"] == pytest.approx(sum(rec["extras"].values()) / 4)
    assert all(flag(c, "--data") == "task:phop" and flag(c, "--max-iters") == "800" for c in runner.train)


def test_child_runner_logs_and_holds_the_lock(tmp_path):
    lock = tmp_path / "cpu.lock"
    runner = sweep.ChildRunner(str(lock), pause=0)
    with runner.held():
        fd = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held: another process's `flock` would wait
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, lines = runner.run([sys.executable, "-c", "import sys; print('val step 3 loss 2.5 ppl 12'); "
                                  "print('error: x', file=sys.stderr); sys.exit(2)"], tmp_path / "run.log")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the run
    os.close(fd)
    assert code == 2 and sweep.parse_val(lines) == (2.5, None) and "error: x\n" in lines
    assert "val step 3 loss 2.5" in (tmp_path / "run.log").read_text()


def test_dry_run_prints_every_command(tmp_path, capsys):
    eval_cli.main(["sweep", "relaxed", "--out", str(tmp_path), "--dry-run"])
    out = capsys.readouterr().out
    assert out.count("python train.py") == 1 + 6 and "then: relaxed's best grid setting again at seeds 2, 3" in out
    assert not (tmp_path / "results.jsonl").exists()


class CountingRunner(FakeRunner):
    """FakeRunner that counts its holds of the lock and the runs in each."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.holds = []

    @contextlib.contextmanager
    def held(self):
        self.holds.append(len(self.train))
        try:
            yield
        finally:
            self.holds[-1] = len(self.train) - self.holds[-1]


def test_parallel_runs_share_a_hold_of_the_lock_and_give_the_same_results(tmp_path):
    one, two = FakeRunner(), CountingRunner()
    a = run_sweep("relaxed", tmp_path / "one", one)
    b = run_sweep("relaxed", tmp_path / "two", two, parallel=2)
    # the source alone, then in pairs: the 6 grid runs, lr 8e-3 of both sides (each side's best, 4e-3, lay at the
    # grid's upper edge) and the 4 seed runs
    assert two.holds == [1, 2, 2, 2, 2, 2, 2]
    assert {r["name"]: r["score"] for r in a.values()} == {r["name"]: r["score"] for r in b.values()}
    stopped = CountingRunner(stop_at=4)  # a child of the second pair is stopped: the sweep stops after the pair
    with pytest.raises(Stopped):
        run_sweep("relaxed", tmp_path / "three", stopped, parallel=2)
    assert len(stopped.train) == 5 and stopped.holds == [1, 2, 2]
    again = FakeRunner()
    run_sweep("relaxed", tmp_path / "three", again, parallel=2)
    assert len(again.train) == 13 - 4 and sum("--resume" in c for c in again.train) == 1  # 11 runs + 2 beyond the edge
