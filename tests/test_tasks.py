"""tasks.py: dense p-hop against a brute-force reference, the token layout, scoring, and train.py on a task."""
import pytest
import torch

import train
from harness import checkpoint, tasks
from model import IGNORE


def brute_force_labels(sym: list[int], p: int) -> list[int]:
    """The definition read literally: hop(j) = 1 + the last k < j with sym[k] == sym[j]; label = sym[hop^p(j)]."""
    def hop(j):
        ks = [k for k in range(j) if sym[k] == sym[j]]
        return ks[-1] + 1 if ks else None

    out = []
    for j in range(len(sym)):
        cur = j
        for _ in range(p):
            cur = hop(cur)
            if cur is None:
                break
        out.append(IGNORE if cur is None else sym[cur])
    return out


@pytest.mark.parametrize("alphabet,length", [(2, 10), (4, 48), (7, 30)])
def test_hop_targets_equal_the_brute_force_definition(alphabet, length):
    gen = torch.Generator().manual_seed(alphabet)
    sym = torch.randint(alphabet, (40, length), generator=gen)
    p = torch.randint(1, 7, (40,), generator=gen)
    got = tasks.hop_targets(sym, p)
    for b in range(40):
        assert got[b].tolist() == brute_force_labels(sym[b].tolist(), int(p[b]))
    assert (got != IGNORE).any() and (got == IGNORE).any()


@pytest.mark.parametrize("pause", [0, 2])
def test_batch_layout_marker_symbols_fillers_and_labels(pause):
    task = tasks.PHopTask(hops=(2, 3), alphabet=4, length=12, pause=pause)
    x, y = task.batch(16, torch.Generator().manual_seed(0), seq_len=task.seq_len + 3)
    assert x.shape == y.shape == (16, 1 + 12 * (pause + 1) + 3)
    p = task.hops_of(x)
    assert set(p.tolist()) <= {2, 3} and len(set(p.tolist())) == 2
    g = pause + 1
    sym = x[:, 1:task.seq_len:g]
    assert sym.max() < 4
    fill = torch.ones_like(x, dtype=torch.bool)
    fill[:, 0] = False
    fill[:, 1:task.seq_len:g] = False
    assert (x[fill] == task.filler).all()
    for b in range(16):  # labels on the last token of each group, nowhere else
        assert y[b, g:task.seq_len:g].tolist() == brute_force_labels(sym[b].tolist(), int(p[b]))
    keep = torch.zeros_like(y, dtype=torch.bool)
    keep[:, g:task.seq_len:g] = True
    assert (y[~keep] == IGNORE).all()
    with pytest.raises(ValueError, match="shorter than the task"):
        task.batch(1, torch.Generator(), seq_len=task.seq_len - 1)


def test_same_generator_same_batch():
    task = tasks.PHopTask()
    a = task.batch(4, torch.Generator().manual_seed(3))
    b = task.batch(4, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_score_counts_per_hop():
    task = tasks.PHopTask(hops=(1, 4), alphabet=4, length=20)
    x, y = task.batch(32, torch.Generator().manual_seed(1))
    logits = torch.nn.functional.one_hot(y.clamp(min=0), task.n_vocab).float()
    perfect = task.score(logits, x, y)
    assert set(perfect) == {1, 4} and all(c == n > 0 for c, n in perfect.values())
    wrong = task.score(torch.roll(logits, 1, dims=-1), x, y)  # every answer shifted by one symbol id
    assert all(c == 0 for c, _ in wrong.values())
    total = {}
    tasks.add_counts(total, perfect)
    tasks.add_counts(total, wrong)
    assert tasks.accuracy_text(total) == "acc p1 0.500 p4 0.500"


def test_parse_hops():
    assert tasks.parse_hops("1-4") == (1, 2, 3, 4) and tasks.parse_hops("2,4") == (2, 4)
    for bad in ("0-2", "x", "9", ""):
        with pytest.raises(ValueError, match="--task-p"):
            tasks.parse_hops(bad)


def test_task_tokenizer_round_trip_through_the_checkpoint_spec():
    task = tasks.PHopTask(hops=(1, 2), alphabet=5, length=8, pause=1)
    tok = checkpoint.tokenizer_from_spec(task.spec())  # what resume and the other scripts do with a checkpoint's spec
    assert isinstance(tok, tasks.TaskTokenizer) and tok.n_vocab == task.n_vocab and tok.task == task
    x, _ = task.batch(1, torch.Generator().manual_seed(0))
    assert tok.encode(tok.decode(x[0].tolist())) == x[0].tolist()
    with pytest.raises(ValueError, match="not a token"):
        tok.encode("p1 z")


def task_args(tmp, *extra):
    return ["--data", "task:phop", "--task-p", "1-2", "--task-length", "16", "--batch-size", "8", "--eval-iters", "2",
            "--log-interval", "1", "--out-dir", str(tmp / "out"), "--lr", "3e-3", *extra]


@pytest.mark.parametrize("arch", ["plt", "block"])
def test_train_on_a_task_logs_accuracy_per_hop_and_resumes(tmp_path, capsys, arch):
    common = ["--arch", arch, "--max-iters", "6", "--eval-interval", "3", "--warmup-iters", "1"]
    straight = train.train(task_args(tmp_path / "a", *common))
    out = capsys.readouterr().out
    assert "acc p1 " in out and " p2 " in out
    val = [line for line in out.splitlines() if line.startswith("val step 6")]
    assert len(val) == 1 and "acc p1 " in val[0]
    assert set(straight["acc"]) == {1, 2} and all(0 <= a <= 1 for a in straight["acc"].values())
    # resume from the step-3 checkpoint (the task comes back from the checkpoint's tokenizer spec)
    train.train(task_args(tmp_path / "b", *common[:2], "--max-iters", "3", "--eval-interval", "3",
                          "--warmup-iters", "1", "--lr-decay-iters", "6"))
    resumed = train.train(task_args(tmp_path / "b", *common, "--resume"))
    assert resumed["loss"] == straight["loss"] and resumed["acc"] == straight["acc"]


def test_task_seq_len_too_short_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(task_args(tmp_path, "--seq-len", "10", "--max-iters", "1"))
    assert "error: --seq-len 10 is shorter than the task's 17 tokens" in capsys.readouterr().err
