"""train.py: tokenizer, corpus readers, token shards, checkpoints, the training loop, resume, KD and DDP."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import model as model_lib
import train
from conftest import ROOT, write_jsonl
from harness import archs, checkpoint, cli, curve, data, memory

# ---- a small real corpus: a few standard-library files as SlimPajama-style documents ----------------------------


def corpus_texts(n_files=30):
    _, files = data.stdlib_files()
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
    tok = data.Tokenizer.from_args(1000, None)
    assert tok.n_vocab == 1001 and tok.eot == 1000
    text = "def f(x):\n    return x ** 2  # héllo wörld, 日本語 🙂\n"
    ids = tok.encode(text)
    assert max(ids) < 1000 and tok.decode(ids) == text
    full = data.Tokenizer.from_args(data.CL100K_RANKS, None)  # every rank: the full encoding
    assert full.spec["n"] is None
    assert len(full.encode(text)) < len(ids)  # more merges, fewer tokens
    assert full.decode(full.encode(text)) == text
    assert data.padded_vocab(tok.n_vocab) > tok.n_vocab  # a spare row for pads
    with pytest.raises(ValueError, match="cut"):
        data.Tokenizer.from_args(100, None)
    with pytest.raises(ValueError, match="--vocab-size 200000 exceeds the 100,256 merge ranks"):
        data.Tokenizer.from_args(200_000, None)  # not silently the full encoding


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
        stats = data.SkipStats()
        docs = list(data.iter_jsonl_docs(tmp_path / name, stats, {"RedPajamaGithub"}))
        assert docs == ["good one", "good two"]
        assert stats.counts == {"malformed json": 1, "no text field": 2, "undecodable bytes": 1, "excluded set": 1}
    # the warning names the file and line of the first bad line of each kind
    with pytest.warns(UserWarning, match=r"skipped documents: 1 document with malformed JSON \(first at "
                                         r".*b.jsonl.zst:2\), 2 documents without a text field \(first at "
                                         r".*b.jsonl.zst:3\), 1 document with undecodable bytes \(first at "
                                         r".*b.jsonl.zst:5\), 1 document of an excluded set$"):
        stats.warn()


def test_truncated_zst_is_an_error_naming_the_file(tmp_path):
    import zstandard

    docs = [f"document {i} " * 40 for i in range(400)]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()
    whole = zstandard.ZstdCompressor().compress(raw)
    d = tmp_path / "train"
    d.mkdir()
    (d / "example_train_0.jsonl.zst").write_bytes(whole[: len(whole) // 2])  # the usual broken download
    write_jsonl(d / "example_train_1.jsonl", docs[:50])
    tok = data.Tokenizer.from_args(512, None)
    with pytest.raises(cli.DataError, match=r"example_train_0.jsonl.zst is truncated"):
        data.prepare_corpus(str(d), tok, str(tmp_path / "cache"), verbose=False)
    # several frames in one file (zstd allows it) are read through, and the cut is found in the last one
    half = len(raw) // 2
    c = zstandard.ZstdCompressor()
    two = c.compress(raw[:half]) + c.compress(raw[half:])
    (d / "example_train_0.jsonl.zst").write_bytes(two)
    assert list(data.iter_jsonl_docs(d / "example_train_0.jsonl.zst", data.SkipStats())) == docs
    (d / "example_train_0.jsonl.zst").write_bytes(two[:-5])
    with pytest.raises(cli.DataError, match="truncated"):
        list(data.iter_jsonl_docs(d / "example_train_0.jsonl.zst", data.SkipStats()))


def test_corrupt_zst_names_the_file(tmp_path):
    bad = tmp_path / "chunk1" / "example_train_3.jsonl.zst"
    bad.parent.mkdir()
    bad.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    with pytest.raises(cli.DataError, match="example_train_3.jsonl.zst"):
        list(data.iter_jsonl_docs(bad, data.SkipStats()))


def test_find_shards_keeps_repeated_names_apart(tmp_path):
    for c in ("chunk1", "chunk2", "chunk10"):
        write_jsonl(tmp_path / "train" / c / "example_train_0.jsonl", ["x"])
    root, files = data.find_shards(str(tmp_path / "train"))
    assert len(files) == 3 and len({f.name for f in files}) == 1
    _, globbed = data.find_shards(str(tmp_path / "train" / "chunk1*" / "*.jsonl"))
    assert len(globbed) == 2
    with pytest.raises(cli.DataError, match="no .jsonl"):
        data.find_shards(str(tmp_path / "nothing"))


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("")
    (tmp_path / "d" / "b.jsonl").write_text("{broken\n")
    tok = data.Tokenizer.from_args(512, None)
    with pytest.warns(UserWarning, match="skipped documents: 1 document with malformed JSON"), \
            pytest.raises(cli.DataError, match="the training and validation splits are empty: no file of .* gave a "
                                                 "usable document; skipped: 1 document with malformed JSON"):
        data.prepare_corpus(str(tmp_path / "d"), tok, str(tmp_path / "cache"), verbose=False)


def test_empty_split_message_says_how_the_split_was_made(tmp_path):
    tok = data.Tokenizer.from_args(512, None)
    one = write_jsonl(tmp_path / "one" / "docs.jsonl", [f"doc {i}" for i in range(10)])
    with pytest.raises(cli.DataError, match=r"docs.jsonl is the only file, so the split is by document \(every "
                                              r"33rd document .*only 10 usable documents"):
        data.prepare_corpus(str(one), tok, str(tmp_path / "cache"), verbose=False)
    write_jsonl(tmp_path / "val.jsonl", [])
    with pytest.raises(cli.DataError, match="--val-data .*val.jsonl' gave no usable document"):
        data.prepare_corpus(str(one), tok, str(tmp_path / "cache"), val_data=str(tmp_path / "val.jsonl"),
                             verbose=False)


def test_damaged_token_cache_names_its_meta_json(tmp_path, corpus):
    tok = data.Tokenizer.from_args(512, None)
    out = data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    (out / "meta.json").write_text("{broken")
    with pytest.raises(cli.DataError, match=f"token cache {out / 'meta.json'} is damaged"):
        data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    with pytest.raises(cli.DataError, match="meta.json is damaged"):
        data.TokenData(out, "train")


def test_prepare_corpus_split_cache_and_interrupted_write(tmp_path, corpus, monkeypatch):
    tok = data.Tokenizer.from_args(512, None)
    real_write = data.write_shard
    calls = []

    def dying_write(path, tokens):  # the process dies while the first shard is being written
        calls.append(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    assert not list((tmp_path / "cache").rglob("*.bin")) and not list((tmp_path / "cache").rglob("meta.json"))
    monkeypatch.setattr(data, "write_shard", real_write)
    out = data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["tokens"] > 0 and meta["val"]["tokens"] > 0
    # every document ends with end-of-text, and train + val hold every document once
    n_docs = len(corpus_texts())
    eots = sum(int((data.read_shard(out / s) == tok.eot).sum()) for sp in ("train", "val")
               for s in meta[sp]["shards"])
    assert eots == n_docs
    # a second call reuses the cache
    assert data.prepare_corpus(str(corpus), tok, str(tmp_path / "cache"), verbose=False) == out


def test_stdlib_split_is_deterministic_and_disjoint():
    root, files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    tr, va = data.split_files(root, files)
    tr2, va2 = data.split_files(root, files)
    assert tr == tr2 and va == va2 and va and not set(tr) & set(va) and len(tr) + len(va) == len(files)


# ---- token shards -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_vocab,dtype", [(5000, np.uint16), (100_300, np.uint32)])
def test_token_shard_round_trip(tmp_path, n_vocab, dtype):
    w = data.ShardWriter(tmp_path, "train", n_vocab, shard_tokens=50)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, n_vocab - 1, size=int(n)).tolist() for n in rng.integers(1, 40, size=12)]
    for d in docs:
        w.add(d, n_vocab - 1)
    w.flush()
    got = np.concatenate([data.read_shard(tmp_path / p) for p in w.paths])
    want = np.concatenate([np.array(d + [n_vocab - 1]) for d in docs])
    assert len(w.paths) > 1 and got.dtype == dtype and np.array_equal(got, want)


def test_corrupt_token_shard(tmp_path):
    p = tmp_path / "s.bin"
    data.write_shard(p, np.arange(10, dtype=np.uint16))
    raw = p.read_bytes()
    p.write_bytes(raw[:-4])
    with pytest.raises(cli.DataError, match="corrupt"):
        data.read_shard(p)
    p.write_bytes(b"XXXX" + raw[4:])
    with pytest.raises(cli.DataError, match="not a token shard"):
        data.read_shard(p)


def test_batches_are_deterministic_windows(tmp_path, corpus):
    tok = data.Tokenizer.from_args(512, None)
    windows = data.TokenData(data.prepare_corpus(str(corpus), tok, str(tmp_path / "c"), verbose=False), "train")
    x1, y1 = windows.get_batch(3, 32, data.step_generator(1, 5))
    x2, y2 = windows.get_batch(3, 32, data.step_generator(1, 5))
    x3, _ = windows.get_batch(3, 32, data.step_generator(1, 6))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


# ---- training ---------------------------------------------------------------------------------------------------


def test_training_lowers_the_loss(tmp_path, corpus, capsys):
    res = train.train(base_args(corpus, tmp_path, "--max-iters", "30", "--eval-interval", "30", "--batch-size", "8"))
    out = capsys.readouterr().out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert all(k in out for k in ("lr ", "ms ", "tok/s ")) and "val step 30 loss" in out and "sample" in out
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["step"] == 30 and ck["arch"] == "vanilla" and ck["tokenizer"]["n"] == 512
    assert ck["best_val_loss"] == pytest.approx(res["best_val_loss"])
    m = checkpoint.model_from_checkpoint(ck)
    assert isinstance(m, model_lib.GPT) and "optimizer" in ck


def test_resume_equals_uninterrupted(tmp_path, corpus, monkeypatch):
    common = ["--max-iters", "12", "--eval-interval", "6", "--warmup-iters", "2"]
    straight = train.train(base_args(corpus, tmp_path / "a", *common))
    real_save = checkpoint.save_checkpoint

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
    real_loss, real_save = model_lib.lm_loss, checkpoint.save_checkpoint
    state = {"poison": False}
    monkeypatch.setattr(model_lib, "lm_loss", lambda l, t: real_loss(l, t) * (float("nan") if state["poison"] else 1))

    def save_and_poison(path, obj):
        real_save(path, obj)
        state["poison"] = True

    monkeypatch.setattr(train, "save_checkpoint", save_and_poison)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 5"):
        train.train(base_args(corpus, tmp_path, "--max-iters", "8", "--eval-interval", "4"))
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["step"] == 4 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_corrupt_and_foreign_checkpoints(tmp_path):
    p = tmp_path / "ckpt.pt"
    p.write_bytes(os.urandom(256))
    with pytest.raises(cli.CheckpointError, match="corrupt"):
        checkpoint.load_checkpoint(p)
    torch.save({"weights": torch.zeros(2)}, p)
    with pytest.raises(cli.CheckpointError, match="not a checkpoint written by train.py"):
        checkpoint.load_checkpoint(p)
    good = {"format": checkpoint.CKPT_FORMAT, "arch": "vanilla", "config": vars(model_lib.GPTConfig()),
            "model": model_lib.GPT(model_lib.GPTConfig()).state_dict()}
    checkpoint.save_checkpoint(p, good)
    p.write_bytes(p.read_bytes()[:1000])  # truncated
    with pytest.raises(cli.CheckpointError, match="corrupt"):
        checkpoint.load_checkpoint(p)
    with pytest.raises(cli.CheckpointError, match="does not exist"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt")
    good["config"] = {**good["config"], "n_embd": 64, "n_head": 4}
    with pytest.raises(cli.CheckpointError, match="do not fit"):
        checkpoint.model_from_checkpoint(good)


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


@pytest.mark.slow
def test_torchrun_two_processes_gloo(tmp_path, corpus):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *base_args(corpus, tmp_path, "--max-iters", "3", "--eval-interval", "3", "--device", "cpu")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 2" in r.stdout and "step 3 loss" in r.stdout
    assert r.stdout.count("val step 3 loss") == 1  # only rank 0 logs
    assert checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")["step"] == 3


# ---- resume restores the run's flags; --init-from of the same arch applies the recipe ---------------------------


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("teacher")
    train.train(base_args(corpus, tmp, "--max-iters", "4", "--eval-interval", "4", "--sample-tokens", "0"))
    return str(tmp / "out" / "ckpt.pt")


def test_init_from_and_teacher_of_one_checkpoint_read_it_once(tmp_path, corpus, teacher, monkeypatch):
    """--init-from CKPT --teacher CKPT and no tokenizer flag (CKPT's tokenizer): three roles, one read of the file
    (CRC-32, torch.load, checks)."""
    read, real = [], checkpoint.load_checkpoint
    monkeypatch.setattr(train, "load_checkpoint", lambda path: (read.append(str(path)), real(path))[1])
    argv = base_args(corpus, tmp_path, "--max-iters", "1", "--init-from", teacher, "--teacher", teacher, "--kd", "jsd")
    i = argv.index("--vocab-size")
    train.train(argv[:i] + argv[i + 2:])
    assert read == [teacher]


def _kill_after_step(monkeypatch, step):
    real_save = checkpoint.save_checkpoint

    def save_then_die(path, obj):
        real_save(path, obj)
        if obj["step"] == step:
            raise KeyboardInterrupt  # the run is killed right after this checkpoint

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    return real_save


def _weights(run_dir):
    return torch.load(run_dir / "out" / "ckpt.pt", weights_only=True)["model"]


def test_resume_with_and_without_retyped_flags_equals_uninterrupted_kd_run(tmp_path, corpus, teacher, monkeypatch):
    import shutil

    common = ["--max-iters", "8", "--eval-interval", "4", "--warmup-iters", "2", "--teacher", teacher, "--kd", "jsd",
              "--kd-weight", "0.5", "--seed", "7"]
    straight = train.train(base_args(corpus, tmp_path / "a", *common))
    real_save = _kill_after_step(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        train.train(base_args(corpus, tmp_path / "b", *common))
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    # b: only --resume and where the run is; c: the whole command typed again
    bare = train.train(["--resume", "--out-dir", str(tmp_path / "b" / "out"),
                        "--cache-dir", str(tmp_path / "b" / "cache")])
    retyped = train.train(base_args(corpus, tmp_path / "c", *common, "--resume"))
    for res in (bare, retyped):
        assert res["loss"] == straight["loss"] and res["total"] == straight["total"]
        assert res["total"] != res["loss"]  # the KD term is in the objective
        assert res["best_val_loss"] == straight["best_val_loss"]
    a = _weights(tmp_path / "a")
    for run in ("b", "c"):
        w = _weights(tmp_path / run)
        assert all(torch.equal(a[k], w[k]) for k in a)


def test_resume_refuses_contradicting_flags_and_extends_the_run_length(tmp_path, corpus, capsys):
    train.train(base_args(corpus, tmp_path, "--max-iters", "4", "--eval-interval", "2"))
    out = ["--resume", "--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    for flags, named in [(["--seq-len", "32"], "--seq-len 32 (the run had 64)"),
                         (["--arch", "relaxed"], "--arch relaxed (the run had vanilla)"),
                         (["--vocab-size", "600"], "--vocab-size 600 (the run had 512)"),
                         (["--preset", "small", "--lr", "1e-3"], "--preset small (the run had tiny), --lr 0.001"),
                         (["--teacher", str(tmp_path / "out" / "ckpt.pt")], "--teacher")]:
        with pytest.raises(cli.UsageError, match="contradict it: " + named.replace("(", r"\(").replace(")", r"\)")):
            train.train(out + flags)
    with pytest.raises(cli.UsageError, match="--max-iters 3 is below the step 4"):
        train.train(out + ["--max-iters", "3"])
    capsys.readouterr()
    train.train(out + ["--vocab-size", "512", "--max-iters", "6", "--eval-interval", "3"])  # same value: fine
    log = capsys.readouterr().out
    assert "resume: --max-iters 6 (the run had 4)" in log and "step 5 loss" in log and "step 4 loss" not in log
    assert checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")["step"] == 6


@pytest.fixture(scope="module")
def relaxed_ckpt(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relaxed")
    train.train(base_args(corpus, tmp, "--arch", "relaxed", "--max-iters", "2", "--eval-interval", "2",
                          "--sample-tokens", "0"))
    return tmp


def test_resume_accepts_a_flag_equal_to_the_checkpoint_config(tmp_path, corpus, relaxed_ckpt):
    import shutil

    shutil.copytree(relaxed_ckpt, tmp_path / "r")
    out = ["--resume", "--out-dir", str(tmp_path / "r" / "out"), "--cache-dir", str(tmp_path / "r" / "cache")]
    with pytest.raises(cli.UsageError, match="--loops 4 \\(the run had None\\)"):
        train.train(out + ["--loops", "4"])
    train.train(out + ["--loops", "2", "--max-iters", "3"])  # the run left --loops at the preset's 2
    assert checkpoint.load_checkpoint(tmp_path / "r" / "out" / "ckpt.pt")["step"] == 3


def test_init_from_same_arch_applies_post_training_flags(tmp_path, corpus, relaxed_ckpt, capsys):
    src = str(relaxed_ckpt / "out" / "ckpt.pt")
    train.train(base_args(corpus, tmp_path, "--arch", "relaxed", "--init-from", src, "--exit-loss", "aggressive",
                          "--exit-coef", "0.3", "--self-distill", "--max-iters", "1"))
    log = capsys.readouterr().out
    cfg = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")["config"]
    assert cfg["exit_loss"] == "aggressive" and cfg["exit_coef"] == 0.3 and cfg["self_distill"] is True
    assert "exit_loss 'none' -> 'aggressive'" in log
    assert "objective: LM cross-entropy + exit loss aggressive coef 0.3 + self-distill" in log
    step = next(line.split() for line in log.splitlines() if line.startswith("step 1 "))
    v = {k: float(x) for k, x in zip(step[2::2], step[3::2]) if k in ("loss", "total", "loss_l1", "kd_l1", "loss_l2")}
    assert v["loss"] == v["loss_l2"] and v["total"] == pytest.approx(0.3 * (v["loss_l1"] + v["kd_l1"]) + v["loss"],
                                                                     abs=2e-4)
    # the weights are the checkpoint's: the first training loss equals the source model's loss on that batch
    ck = checkpoint.load_checkpoint(src)
    m = checkpoint.model_from_checkpoint(ck).train()
    windows = data.TokenData(data.prepare_corpus(str(corpus), data.Tokenizer(ck["tokenizer"]),
                                                 str(tmp_path / "cache"), verbose=False), "train")
    x, y = windows.get_batch(4, 64, data.step_generator(1337, 0, 0, 0))
    with torch.no_grad():
        assert m(x, y)[1].item() == pytest.approx(v["loss"], abs=1e-4)
    with pytest.raises(cli.UsageError, match="lora_rank_q 16 -> 4.*would change its parameters"):
        train.train(base_args(corpus, tmp_path / "x", "--arch", "relaxed", "--init-from", src, "--lora-rank", "4"))


def test_logged_loss_is_the_lm_loss_and_the_header_names_the_extra_terms(tmp_path, corpus, teacher, capsys):
    def first_step(*flags):
        train.train(base_args(corpus, tmp_path / str(len(flags)), "--max-iters", "1", "--sample-tokens", "0", *flags))
        log = capsys.readouterr().out
        words = next(line.split() for line in log.splitlines() if line.startswith("step 1 "))
        return dict(zip(words[2::2], words[3::2])), log

    plain, _ = first_step()
    kd, log = first_step("--teacher", teacher, "--kd-weight", "2")
    assert f"objective: LM cross-entropy + KD fkl x2.0 (temperature 1.0) from {teacher}" in log
    assert kd["loss"] == plain["loss"]  # the same model and batch: the LM cross-entropy, without the KD term
    assert float(kd["total"]) == pytest.approx(float(kd["loss"]) + 2 * float(kd["kd"]), abs=2e-4)
    assert float(kd["kd"]) > 0
    relaxed, _ = first_step("--arch", "relaxed")
    early, log = first_step("--arch", "relaxed", "--exit-loss", "weighted")
    assert "objective: LM cross-entropy + exit loss weighted" in log
    assert early["loss"] == relaxed["loss"] and float(early["total"]) != float(early["loss"])


def test_nan_validation_loss_is_never_written(tmp_path, corpus, monkeypatch):
    real_loss, real_save = model_lib.lm_loss, checkpoint.save_checkpoint
    state = {"poison": False}

    def loss(logits, targets):  # finite in training, NaN in evaluation (no grad) once poisoned
        out = real_loss(logits, targets)
        return out * float("nan") if state["poison"] and not torch.is_grad_enabled() else out

    def save_and_poison(path, obj):
        real_save(path, obj)
        state["poison"] = True

    monkeypatch.setattr(model_lib, "lm_loss", loss)
    monkeypatch.setattr(train, "save_checkpoint", save_and_poison)
    with pytest.raises(FloatingPointError, match=r"non-finite validation loss nan at step 4; .*stays at .* \(step 2\)"):
        train.train(base_args(corpus, tmp_path, "--max-iters", "6", "--eval-interval", "2"))
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["step"] == 2 and math.isfinite(ck["val_loss"])
    # a real divergence: whichever guard fires, no checkpoint holds a non-finite loss or weight
    monkeypatch.setattr(model_lib, "lm_loss", real_loss)
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    with pytest.raises(FloatingPointError, match="non-finite"):
        train.train(base_args(corpus, tmp_path / "d", "--lr", "1e9", "--warmup-iters", "0", "--max-iters", "4",
                              "--eval-interval", "1"))
    path = tmp_path / "d" / "out" / "ckpt.pt"
    if path.exists():
        ck = checkpoint.load_checkpoint(path)
        assert math.isfinite(ck["val_loss"]) and all(torch.isfinite(v).all() for v in ck["model"].values())


# ---- the memory check -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["vanilla", "relaxed", "block", "plt", "double"])
def test_step_memory_estimate_matches_the_activations_of_a_full_batch(arch):
    import contextlib

    table = archs.arch_table()
    spec = table[arch]
    T = 192
    model = spec.model_cls(spec.make_config("tiny", vocab_size=576, max_seq_len=T))
    est = memory.step_memory(model, spec, 3, T, 513, torch.device("cpu"), contextlib.nullcontext())
    real, _ = memory.saved_activation_bytes(model, spec, 3, T, 513, torch.device("cpu"), contextlib.nullcontext())
    # extrapolated from 1-row probes at T = 32 and 64: SDPA paths keep O(T) per row; plt's G-SWA reference and the
    # double decoder's dense path keep T x T masks/scores (the fitted quadratic term; the latter also draws a random
    # block partition per batch)
    assert est["activations"] == pytest.approx(real, rel=0.03)


def test_a_batch_that_cannot_fit_is_refused_before_the_first_step(tmp_path, corpus, monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "available_memory", lambda device: (50_000_000, "test budget"))
    monkeypatch.setattr(train, "make_optimizer", lambda *a: calls.append(a))
    with pytest.raises(cli.UsageError, match=r"--batch-size 64 x --seq-len 64 needs about 0.\d+ GB \([\d,]+ bytes\) "
                                               r"per training step \(activations .* but cpu has 0.05 GB available"):
        train.train(base_args(corpus, tmp_path, "--batch-size", "64", "--max-iters", "1"))
    assert not calls  # refused before the optimizer (and any activation) was allocated


def test_init_from_same_arch_keeps_settings_no_flag_was_typed_for(tmp_path, corpus):
    # plt's config_overrides returns its Table 2 row even without flags: only typed flags may change the checkpoint's
    train.train(base_args(corpus, tmp_path / "a", "--arch", "plt", "--plt-variant", "clp", "--max-iters", "1"))
    src = str(tmp_path / "a" / "out" / "ckpt.pt")
    train.train(base_args(corpus, tmp_path / "b", "--arch", "plt", "--init-from", src, "--plt-window", "16",
                          "--max-iters", "1"))
    cfg = checkpoint.load_checkpoint(tmp_path / "b" / "out" / "ckpt.pt")["config"]
    assert (cfg["clp"], cfg["kv_share"], cfg["gswa"], cfg["window"]) == (True, False, False, 16)
    with pytest.raises(cli.UsageError, match="holds a plt model, and gswa False -> True would change its param"):
        train.train(base_args(corpus, tmp_path / "c", "--arch", "plt", "--init-from", src, "--plt-variant", "plt"))


def test_cpu_optimizer_is_the_fused_adamw_and_steps_like_the_per_tensor_loop():
    """make_optimizer runs torch's fused AdamW on CPU (speed); three steps of it move every parameter as the plain
    per-tensor AdamW with the same groups does, to rounding."""
    torch.manual_seed(0)
    cfg = model_lib.GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=48, vocab_size=97,
                              max_seq_len=16)
    models = [model_lib.GPT(cfg) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = train.make_optimizer(models[0], 1e-2, 0.1, torch.device("cpu"))
    assert all(g["fused"] for g in fused.param_groups)
    ps = list(models[1].parameters())
    loop = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for step in range(3):
        x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
        for m, opt in zip(models, (fused, loop)):
            m(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ---- the recovery curve (--curve-at) and a mixed-in corpus (--mix-data) ------------------------------------------


def _curve(run_dir):
    return curve.read_curve(run_dir / "out" / "curve.jsonl")


def test_curve_points_are_the_eval_loss_of_the_fixed_set_and_survive_a_resume(tmp_path, corpus, monkeypatch, capsys):
    """--curve-at: the loss at the first step at or past each token count (4 x 64 = 256 tokens per step), the number
    `python eval.py loss` gives that model on the first --curve-tokens of the validation split; a run stopped (Ctrl-C)
    right after its step-2 point, so that its checkpoint comes after the point, records each point once when resumed."""
    import contextlib

    import eval as ev

    flags = ["--max-iters", "6", "--eval-interval", "2", "--sample-tokens", "0", "--curve-at", "0,300,1e3,1536",
             "--curve-tokens", "512"]
    train.train(base_args(corpus, tmp_path / "a", *flags))
    curve = _curve(tmp_path / "a")
    assert [(c["step"], c["tokens"]) for c in curve] == [(0, 0), (2, 512), (4, 1024), (6, 1536)]
    assert "curve step 2 tokens 512 loss" in capsys.readouterr().out
    loss = ev.run(["loss", "--model", str(tmp_path / "a" / "out" / "ckpt.pt"), "--data", str(corpus), "--cache-dir",
                   str(tmp_path / "a" / "cache"), "--tokens", "512", "--seq-len", "64", "--device", "cpu"])["loss"]
    assert curve[-1]["loss"] == loss and curve[-1]["eval_tokens"] == 512 and curve[-1]["non_emb"] > 0
    assert curve[0]["loss"] > curve[-1]["loss"]
    asked, real_point = [], train.curve_point
    monkeypatch.setattr(train, "stop_signals", lambda at_once: contextlib.nullcontext(asked))
    monkeypatch.setattr(train, "curve_point", lambda run, step, between: (real_point(run, step, between),
                                                                        step == 2 and asked.append("SIGINT")))
    with pytest.raises(cli.Stopped, match="after step 2"):
        train.train(base_args(corpus, tmp_path / "b", *flags))
    monkeypatch.undo()
    train.train(base_args(corpus, tmp_path / "b", *flags, "--resume"))
    assert [(c["step"], c["loss"]) for c in _curve(tmp_path / "b")] == [(c["step"], c["loss"]) for c in curve]


class _Const:
    """A stand-in corpus whose every window is the token `v` (MixedData reads only shards and get_batch)."""

    def __init__(self, v):
        self.v, self.shards, self.split = v, [np.zeros(10)], "train"

    def get_batch(self, batch, seq_len, gen):
        torch.rand(batch, generator=gen)  # draws like TokenData
        return torch.full((batch, seq_len), self.v), torch.full((batch, seq_len), self.v)


def test_mixed_data_draws_each_window_from_its_corpus_at_the_given_share():
    mix = data.MixedData([_Const(1), _Const(2)], [0.75, 0.25])
    x, y = mix.get_batch(4000, 3, data.step_generator(0, 1))
    assert torch.equal(x, y) and set(x.unique().tolist()) == {1, 2} and bool((x == x[:, :1]).all())
    assert abs(float((x[:, 0] == 2).float().mean()) - 0.25) < 0.03
    again, _ = mix.get_batch(4000, 3, data.step_generator(0, 1))
    other, _ = mix.get_batch(4000, 3, data.step_generator(0, 2))
    assert torch.equal(again, x) and not torch.equal(other, x)  # a pure function of the batch's generator
    assert len(mix.shards) == 2


def test_mix_data_run_trains_on_both_corpora(tmp_path, corpus, capsys):
    other = write_jsonl(tmp_path / "mix" / "a.jsonl", ["zebra quagga okapi " * 200] * 3)
    train.train(base_args(corpus, tmp_path, "--max-iters", "1", "--sample-tokens", "0", "--mix-data",
                          str(tmp_path / "mix"), "--mix-weight", "0.25"))
    out = capsys.readouterr().out
    assert f"75% of the windows from {corpus}" in out and f"25% from {tmp_path / 'mix'}" in out
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["args"]["mix_data"] == str(tmp_path / "mix") and ck["args"]["mix_weight"] == 0.25
    assert other.exists()


# ---- the divergence warning knows where the run started ---------------------------------------------------------

V = 49152  # SmolLM2's vocabulary: ln V + 1 = 11.80
DIVERGENCE = [  # (what, --init-from, resumed at step, best validation loss so far, this one, the warning, a note?)
    ("random start, first evaluation below ln V + 1", None, 0, math.inf, 10.0, None, False),
    ("random start, first evaluation above ln V + 1", None, 0, math.inf, 12.5,
     "validation loss 12.5000 at step 10, the first evaluation, is above ln(49152) + 1 = 11.8027, a nat worse than a "
     "uniform guess, where a model from random weights starts: the run has diverged (lower --lr, now 0.0003)", False),
    ("a converted start above ln V + 1", "smollm2-135m", 0, math.inf, 12.5, None, True),
    ("a converted start, then a nat above it", "smollm2-135m", 0, 12.5, 13.6,
     "validation loss 13.6000 at step 10 is more than a nat above the best of this run so far (12.5000): the run has "
     "diverged (lower --lr, now 0.0003)", False),
    ("a converted start, then recovering", "smollm2-135m", 0, 12.5, 9.0, None, False),
    ("a resumed run without an evaluation", None, 4, math.inf, 12.5, None, True),
    ("a resumed run, a nat above its best", None, 4, 3.0, 4.1, "more than a nat above the best of this run so far "
                                                             "(3.0000)", False),
]


@pytest.mark.parametrize("what,init,start,best,val,warning,note", DIVERGENCE, ids=[r[0] for r in DIVERGENCE])
def test_the_divergence_warning_compares_with_the_start(capsys, what, init, start, best, val, warning, note):
    import types
    import warnings

    run = types.SimpleNamespace(tok=types.SimpleNamespace(n_vocab=V), best_val=best, start_step=start,
                                warned_divergence=False, master=True,
                                args=types.SimpleNamespace(lr=3e-4, init_from=init, out_dir="out/x"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train.check_val_loss(run, val, 10)
    messages = [str(w.message) for w in said]
    assert messages == [] if warning is None else (len(messages) == 1 and warning in messages[0]), messages
    assert ("note: validation loss" in capsys.readouterr().out) == note


# ---- --resume parses every saved flag as if typed ----------------------------------------------------------------

SAVED_FLAGS = [  # (the run, the saved flag edited, its value, the message after "checkpoint PATH: its saved flag ")
    ("vanilla", "batch_size", 0, "--batch-size = 0 is refused as if typed (must be >= 1, got 0)"),
    ("vanilla", "batch_size", "16", "--batch-size = '16' is not an integer"),
    ("vanilla", "batch_size", 16.0, "--batch-size = 16.0 is not an integer"),
    ("vanilla", "grad_accum", True, "--grad-accum = True is not an integer"),
    ("vanilla", "seq_len", None, "--seq-len = None is missing, but --seq-len takes a value"),
    ("vanilla", "seq_len", 100000, "--seq-len 100000 exceeds the context of its model (64 positions)"),
    ("vanilla", "lr", float("nan"), "--lr = nan is refused as if typed (must be a finite number, got nan)"),
    ("vanilla", "weight_decay", -1.0, "--weight-decay = -1.0 is refused as if typed (must be >= 0, got -1.0)"),
    ("vanilla", "kd", "xyz", "--kd = 'xyz' is refused as if typed (invalid choice: 'xyz'"),
    ("vanilla", "dtype", "fp8", "--dtype = 'fp8' is refused as if typed (invalid choice: 'fp8'"),
    ("vanilla", "arch", "nope", "--arch = 'nope' is refused as if typed (invalid choice: 'nope'"),
    ("vanilla", "arch", "plt", "--arch 'plt' contradicts its model, a vanilla one; a run of it would write a "
                               "checkpoint nothing can load"),
    ("vanilla", "data", 5, "--data = 5 is not text"),
    ("vanilla", "val_data", "", "--val-data = '' is refused as if typed (expected a path, got ''"),
    ("vanilla", "exclude_sets", ["a"], "--exclude-sets = a list is not text"),
    ("vanilla", "compile", "yes", "--compile = 'yes' is not true or false"),
    ("vanilla", "seed", -1, "--seed = -1 is refused as if typed (must be >= 0, got -1)"),
    ("vanilla", "task_p", "99", "--task-p = '99' is refused as if typed ('99': hops must lie in 1..8"),
    ("vanilla", "device", "cuda:7", "--device cuda:7: "),
    ("relaxed", "loops", 3, "--loops = 3 contradicts its relaxed config (or the architecture refuses it)"),
    ("relaxed", "lora_rank_q", 5, "--lora-rank-q = 5 contradicts its relaxed config"),
]


@pytest.fixture(scope="module")
def vanilla_ckpt(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vanilla")
    train.train(base_args(corpus, tmp, "--max-iters", "1", "--sample-tokens", "0"))
    return tmp


@pytest.mark.parametrize("run,dest,value,match", SAVED_FLAGS, ids=[f"{r[0]} {r[1]}={r[2]!r}" for r in SAVED_FLAGS])
def test_resume_parses_every_saved_flag_as_if_typed(tmp_path, capsys, monkeypatch, vanilla_ckpt, relaxed_ckpt, run,
                                                    dest, value, match):
    """One bad field of a checkpoint's saved run arguments is one line naming the file and the flag, before the model
    is built (never one of a dozen tracebacks, never a checkpoint under another architecture's name)."""
    src = {"vanilla": vanilla_ckpt, "relaxed": relaxed_ckpt}[run]
    ck = torch.load(src / "out" / "ckpt.pt", weights_only=True)
    ck["args"] = {**ck["args"], dest: value}
    path = tmp_path / "out" / "ckpt.pt"
    checkpoint.save_checkpoint(path, ck)
    monkeypatch.setattr(train, "build_models", lambda *a: pytest.fail("the model was built"))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", "--out-dir", str(path.parent), "--cache-dir", str(src / "cache"), "--max-iters", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {path}: its saved flag {match}"), err[0]


def test_resume_takes_the_saved_flags_that_are_sound(tmp_path, vanilla_ckpt, relaxed_ckpt):
    """The unedited checkpoints resume (so that each row above fails for its own edit)."""
    import shutil

    for src in (vanilla_ckpt, relaxed_ckpt):
        shutil.copytree(src / "out", tmp_path / src.name)
        train.train(["--resume", "--out-dir", str(tmp_path / src.name), "--cache-dir", str(src / "cache"),
                     "--max-iters", "3", "--sample-tokens", "0"])
        assert checkpoint.load_checkpoint(tmp_path / src.name / "ckpt.pt")["step"] == 3


def test_resume_writes_the_token_cache_where_the_command_says(tmp_path, monkeypatch, vanilla_ckpt):
    """The checkpoint's saved cache_dir (here ../ out of the run's directory) never decides where --resume writes the
    token cache: this command's --cache-dir, or its default data_cache in the working directory."""
    ck = torch.load(vanilla_ckpt / "out" / "ckpt.pt", weights_only=True)
    ck["args"] = {**ck["args"], "cache_dir": str(tmp_path / "run" / ".." / "escaped")}
    checkpoint.save_checkpoint(tmp_path / "run" / "ckpt.pt", ck)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    train.train(["--resume", "--out-dir", str(tmp_path / "run"), "--max-iters", "2", "--sample-tokens", "0"])
    assert not (tmp_path / "escaped").exists() and any((tmp_path / "cwd" / "data_cache").iterdir())


# ---- one run per --out-dir: the lock file ------------------------------------------------------------------------


def _live_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    return p, p.pid


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


LOCKS = [  # (what, the owner line of the lock file found in --out-dir, refused?, the message)
    ("a live run", lambda pid, start, host: f"{pid} {start} {host}\n", True,
     "--out-dir {out} is in use by another train.py run (pid {pid}; lock file {out}/train.lock): two runs would "
     "overwrite each other's checkpoints"),
    ("a live run on another machine", lambda pid, start, host: f"{pid} {start} elsewhere\n", True,
     "is in use by another train.py run (pid {pid} on elsewhere; lock file"),
    ("a dead run (kill -9)", lambda pid, start, host: f"{_dead_pid()} 1 {host}\n", False,
     "--out-dir {out}: its lock file {out}/train.lock was left by pid "),
    ("a reused pid (another start time)", lambda pid, start, host: f"{pid} 1 {host}\n", False,
     "--out-dir {out}: its lock file {out}/train.lock was left by pid {pid}, which is no longer running"),
    ("an old lock file without an owner line", None, False, "was left by a run, which is no longer running"),
]


@pytest.mark.parametrize("what,line,refused,match", LOCKS, ids=[r[0] for r in LOCKS])
def test_an_out_dir_in_use_by_another_run_is_refused(tmp_path, corpus, capsys, monkeypatch, what, line, refused,
                                                     match):
    import socket

    out = tmp_path / "out"
    out.mkdir()
    proc, pid = _live_process()
    try:
        lock = out / "train.lock"
        if line is None:
            lock.write_text("garbage")
            os.utime(lock, (0, 0))  # written long ago
        else:
            lock.write_text(line(pid, cli._process_start(pid), socket.gethostname()))
        before = lock.read_text()
        if refused:
            monkeypatch.setattr(train, "build_models", lambda *a: pytest.fail("the run started"))
        with pytest.raises(SystemExit) as e:
            train.main(base_args(corpus, tmp_path, "--max-iters", "1", "--sample-tokens", "0"))
            raise SystemExit(0)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        said = [ln for ln in err if match.format(out=out, pid=pid) in ln]
        assert len(said) == 1, err
        if refused:
            assert e.value.code == 2 and said[0].startswith("error: ") and lock.read_text() == before
            assert not (out / "ckpt.pt").exists()
        else:
            assert e.value.code == 0 and said[0].startswith("warning: ") and not lock.exists()  # taken, then released
            assert checkpoint.load_checkpoint(out / "ckpt.pt")["step"] == 1
    finally:
        proc.kill()
        proc.wait()


STOPS = [  # (what, where the run stops, the exception, its exit code)
    ("an error after the lock", "build_models", cli.UsageError("a batch that cannot fit"), 2),
    ("Ctrl-C during setup", "load_data", KeyboardInterrupt(), 130),
    ("SIGTERM during setup", "load_data", "SIGTERM", 130),
    ("SIGTERM in the first step", "batch_on_device", "SIGTERM", 130),
]


@pytest.mark.parametrize("what,where,exc,code", STOPS, ids=[r[0] for r in STOPS])
def test_the_lock_is_removed_however_the_run_ends(tmp_path, corpus, capsys, monkeypatch, what, where, exc, code):
    """...and SIGTERM before the first step (during setup) is `stopped: ...` and exit code 130 like Ctrl-C."""
    import signal

    real = getattr(train, where)

    def stop(*a, **k):
        if exc == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)  # the handler raises at the next bytecode, or the loop stops after this step
        raise exc

    monkeypatch.setattr(train, where, stop)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, "--max-iters", "3", "--sample-tokens", "0"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == code and len(err) == 1 and err[0].startswith("error: " if code == 2 else "stopped: "), err
    assert out.is_dir() and not (out / "train.lock").exists()
    monkeypatch.setattr(train, where, real)
    train.train(base_args(corpus, tmp_path, "--max-iters", "1", "--sample-tokens", "0"))  # the directory is free again


def test_resume_of_run_arguments_without_arch_keeps_the_checkpoints(tmp_path, relaxed_ckpt):
    """Saved run arguments without an --arch (an older or edited file): the run goes on as the checkpoint's
    architecture, so that the checkpoint it writes loads (never under the default's name)."""
    ck = torch.load(relaxed_ckpt / "out" / "ckpt.pt", weights_only=True)
    ck["args"] = {k: v for k, v in ck["args"].items() if k != "arch"}
    checkpoint.save_checkpoint(tmp_path / "out" / "ckpt.pt", ck)
    train.train(["--resume", "--out-dir", str(tmp_path / "out"), "--cache-dir", str(relaxed_ckpt / "cache"),
                 "--max-iters", "3", "--sample-tokens", "0"])
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert ck["arch"] == ck["args"]["arch"] == "relaxed" and ck["step"] == 3
    checkpoint.model_from_checkpoint(ck)
