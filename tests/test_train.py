"""train.py: tokenizer, corpus readers, token shards, checkpoints, the training loop, resume, KD and DDP."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import model as model_lib
import train
from conftest import ROOT, write_jsonl

# ---- a small real corpus: a few standard-library files as SlimPajama-style documents ----------------------------


def corpus_texts(n_files=30):
    _, files = train.stdlib_files()
    return [f.read_text(encoding="utf-8") for f in files[:200] if f.stat().st_size > 2000][:n_files]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    texts = corpus_texts()
    write_jsonl(d / "chunk1" / "example_train_0.jsonl", texts[: len(texts) // 2])
    write_jsonl(d / "chunk2" / "example_train_0.jsonl", texts[len(texts) // 2:])
    return d


def base_args(corpus, tmp, *extra):
    return ["--data", str(corpus), "--cache-dir", str(tmp / "cache"), "--out-dir", str(tmp / "out"),
            "--vocab-size", "512", "--batch-size", "4", "--seq-len", "64", "--eval-iters", "2", "--log-interval", "1",
            "--sample-tokens", "4", "--lr", "3e-3", *extra]


# ---- tokenizer --------------------------------------------------------------------------------------------------


def test_cut_tokenizer_round_trips_and_stays_in_range():
    tok = train.Tokenizer.from_args(1000, None)
    assert tok.n_vocab == 1001 and tok.eot == 1000
    text = "def f(x):\n    return x ** 2  # héllo wörld, 日本語 🙂\n"
    ids = tok.encode(text)
    assert max(ids) < 1000 and tok.decode(ids) == text
    full = train.Tokenizer.from_args(200_000, None)
    assert len(full.encode(text)) < len(ids)  # more merges, fewer tokens
    assert full.decode(full.encode(text)) == text
    assert train.padded_vocab(tok.n_vocab) > tok.n_vocab  # a spare row for pads
    with pytest.raises(ValueError, match="cut"):
        train.Tokenizer.from_args(100, None)


# ---- corpus readers ---------------------------------------------------------------------------------------------


def test_jsonl_and_zst_readers_skip_and_count_bad_lines(tmp_path):
    import zstandard

    lines = [json.dumps({"text": "good one", "meta": {"redpajama_set_name": "RedPajamaC4"}}).encode(),
             b"{not json", json.dumps({"meta": {}}).encode(), json.dumps({"text": 3}).encode(), b"\xff\xfe\x00bad",
             b"", json.dumps({"text": "code", "meta": {"redpajama_set_name": "RedPajamaGithub"}}).encode(),
             json.dumps({"text": "good two"}).encode()]
    raw = b"\n".join(lines) + b"\n"
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for name in ("a.jsonl", "b.jsonl.zst"):
        stats = train.SkipStats()
        docs = list(train.iter_jsonl_docs(tmp_path / name, stats, {"RedPajamaGithub"}))
        assert docs == ["good one", "good two"]
        assert stats.counts == {"malformed json": 1, "no text field": 2, "undecodable bytes": 1, "excluded set": 1}
    with pytest.warns(UserWarning, match="1 malformed json, 2 no text field, 1 undecodable bytes, 1 excluded set"):
        stats.warn()


def test_corrupt_zst_names_the_file(tmp_path):
    bad = tmp_path / "chunk1" / "example_train_3.jsonl.zst"
    bad.parent.mkdir()
    bad.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    with pytest.raises(train.DataError, match="example_train_3.jsonl.zst"):
        list(train.iter_jsonl_docs(bad, train.SkipStats()))


def test_find_shards_keeps_repeated_names_apart(tmp_path):
    for c in ("chunk1", "chunk2", "chunk10"):
        write_jsonl(tmp_path / "train" / c / "example_train_0.jsonl", ["x"])
    root, files = train.find_shards(str(tmp_path / "train"))
    assert len(files) == 3 and len({f.name for f in files}) == 1
    _, globbed = train.find_shards(str(tmp_path / "train" / "chunk1*" / "*.jsonl"))
    assert len(globbed) == 2
    with pytest.raises(train.DataError, match="no .jsonl"):
        train.find_shards(str(tmp_path / "nothing"))


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("")
    (tmp_path / "d" / "b.jsonl").write_text("{broken\n")
    tok = train.Tokenizer.from_args(512, None)
    with pytest.raises(train.DataError, match="nothing to train on"):
        train.prepare_corpus(str(tmp_path / "d"), tok, str(tmp_path / "cache"), verbose=False)


def test_prepare_corpus_split_cache_and_interrupted_write(tmp_path, corpus, monkeypatch):
    tok = train.Tokenizer.from_args(512, None)
    real_write = train.write_shard
    calls = []

    def dying_write(path, tokens):  # the process dies while the first shard is being written
        calls.append(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        train.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    assert not list((tmp_path / "cache").rglob("*.bin")) and not list((tmp_path / "cache").rglob("meta.json"))
    monkeypatch.setattr(train, "write_shard", real_write)
    out = train.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["tokens"] > 0 and meta["val"]["tokens"] > 0
    # every document ends with end-of-text, and train + val hold every document once
    n_docs = len(corpus_texts())
    eots = sum(int((train.read_shard(out / s) == tok.eot).sum()) for sp in ("train", "val")
               for s in meta[sp]["shards"])
    assert eots == n_docs
    # a second call reuses the cache
    assert train.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False) == out


def test_stdlib_split_is_deterministic_and_disjoint():
    root, files = train.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    tr, va = train.split_files(root, files)
    tr2, va2 = train.split_files(root, files)
    assert tr == tr2 and va == va2 and va and not set(tr) & set(va) and len(tr) + len(va) == len(files)


# ---- token shards -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_vocab,dtype", [(5000, np.uint16), (100_300, np.uint32)])
def test_token_shard_round_trip(tmp_path, n_vocab, dtype):
    w = train.ShardWriter(tmp_path, "train", n_vocab, shard_tokens=50)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, n_vocab - 1, size=int(n)).tolist() for n in rng.integers(1, 40, size=12)]
    for d in docs:
        w.add(d, n_vocab - 1)
    w.flush()
    got = np.concatenate([train.read_shard(tmp_path / p) for p in w.paths])
    want = np.concatenate([np.array(d + [n_vocab - 1]) for d in docs])
    assert len(w.paths) > 1 and got.dtype == dtype and np.array_equal(got, want)


def test_corrupt_token_shard(tmp_path):
    p = tmp_path / "s.bin"
    train.write_shard(p, np.arange(10, dtype=np.uint16))
    data = p.read_bytes()
    p.write_bytes(data[:-4])
    with pytest.raises(train.DataError, match="corrupt"):
        train.read_shard(p)
    p.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(train.DataError, match="not a token shard"):
        train.read_shard(p)


def test_batches_are_deterministic_windows(tmp_path, corpus):
    tok = train.Tokenizer.from_args(512, None)
    data = train.TokenData(train.prepare_corpus(str(corpus), tok, str(tmp_path / "c"), verbose=False), "train")
    x1, y1 = data.get_batch(3, 32, train.step_generator(1, 5))
    x2, y2 = data.get_batch(3, 32, train.step_generator(1, 5))
    x3, _ = data.get_batch(3, 32, train.step_generator(1, 6))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


# ---- training ---------------------------------------------------------------------------------------------------


def test_training_lowers_the_loss(tmp_path, corpus, capsys):
    res = train.train(base_args(corpus, tmp_path, "--max-iters", "30", "--eval-interval", "30", "--batch-size", "8"))
    out = capsys.readouterr().out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert all(k in out for k in ("lr ", "ms ", "tok/s ")) and "val step 30 loss" in out and "sample" in out
    ck = train.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["step"] == 30 and ck["arch"] == "vanilla" and ck["tokenizer"]["n"] == 512
    assert ck["best_val_loss"] == pytest.approx(res["best_val_loss"])
    m = train.model_from_checkpoint(ck)
    assert isinstance(m, model_lib.GPT) and "optimizer" in ck


def test_resume_equals_uninterrupted(tmp_path, corpus, monkeypatch):
    common = ["--max-iters", "12", "--eval-interval", "6", "--warmup-iters", "2"]
    straight = train.train(base_args(corpus, tmp_path / "a", *common))
    real_save = train.save_checkpoint

    def save_then_die(path, obj):
        real_save(path, obj)
        if obj["step"] == 6:
            raise KeyboardInterrupt  # the run is killed right after its step-6 checkpoint

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.train(base_args(corpus, tmp_path / "b", *common))
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    resumed = train.train(base_args(corpus, tmp_path / "b", *common, "--resume"))
    assert resumed["loss"] == straight["loss"]
    a = torch.load(tmp_path / "a" / "out" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "out" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    real_loss, real_save = model_lib.lm_loss, train.save_checkpoint
    state = {"poison": False}
    monkeypatch.setattr(model_lib, "lm_loss", lambda l, t: real_loss(l, t) * (float("nan") if state["poison"] else 1))

    def save_and_poison(path, obj):
        real_save(path, obj)
        state["poison"] = True

    monkeypatch.setattr(train, "save_checkpoint", save_and_poison)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 5"):
        train.train(base_args(corpus, tmp_path, "--max-iters", "8", "--eval-interval", "4"))
    ck = train.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["step"] == 4 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_corrupt_and_foreign_checkpoints(tmp_path):
    p = tmp_path / "ckpt.pt"
    p.write_bytes(os.urandom(256))
    with pytest.raises(train.CheckpointError, match="corrupt"):
        train.load_checkpoint(p)
    torch.save({"weights": torch.zeros(2)}, p)
    with pytest.raises(train.CheckpointError, match="not a checkpoint written by train.py"):
        train.load_checkpoint(p)
    good = {"format": train.CKPT_FORMAT, "arch": "vanilla", "config": vars(model_lib.GPTConfig()),
            "model": model_lib.GPT(model_lib.GPTConfig()).state_dict()}
    train.save_checkpoint(p, good)
    p.write_bytes(p.read_bytes()[:1000])  # truncated
    with pytest.raises(train.CheckpointError, match="corrupt"):
        train.load_checkpoint(p)
    with pytest.raises(train.CheckpointError, match="does not exist"):
        train.load_checkpoint(tmp_path / "missing.pt")
    good["config"] = {**good["config"], "n_embd": 64, "n_head": 4}
    with pytest.raises(train.CheckpointError, match="do not fit"):
        train.model_from_checkpoint(good)


def test_knowledge_distillation_run_and_tokenizer_mismatch(tmp_path, corpus, capsys):
    train.train(base_args(corpus, tmp_path / "t", "--max-iters", "4", "--eval-interval", "4"))
    teacher = str(tmp_path / "t" / "out" / "ckpt.pt")
    res = train.train(base_args(corpus, tmp_path / "s", "--max-iters", "3", "--eval-interval", "3",
                                "--teacher", teacher, "--kd", "jsd", "--kd-weight", "0.5"))
    assert np.isfinite(res["loss"])
    with pytest.raises(ValueError, match="tokenizer"):
        train.train(base_args(corpus, tmp_path / "m", "--max-iters", "1", "--teacher", teacher, "--vocab-size", "600"))
    with pytest.raises(ValueError, match="--kd needs --teacher"):
        train.train(base_args(corpus, tmp_path / "n", "--max-iters", "1", "--kd", "fkl"))


def test_torchrun_two_processes_gloo(tmp_path, corpus):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *base_args(corpus, tmp_path, "--max-iters", "3", "--eval-interval", "3", "--device", "cpu")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 2" in r.stdout and "step 3 loss" in r.stdout
    assert r.stdout.count("val step 3 loss") == 1  # only rank 0 logs
    assert train.load_checkpoint(tmp_path / "out" / "ckpt.pt")["step"] == 3
