"""block_transformer.py: cached generation == parallel forward, locality, random-length padding, uptraining init,
config errors, KV accounting, train.py integration (from scratch and --init-from vanilla) and the bench."""
import argparse
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import block_transformer as bt
from block_transformer import BlockConfig, BlockTransformer, from_vanilla, random_pad_documents
from conftest import write_jsonl
from harness import cpu_tuning
from model import GPT, GPTConfig, IGNORE, lm_loss

V = 67  # vocabulary of the unit tests; the pad id is V - 1


def tiny_cfg(**kw) -> BlockConfig:
    d = dict(vocab_size=V, max_seq_len=32, block_len=4, prefix_len=2, block_n_layer=2, n_layer=2,
             block_n_embd=32, n_embd=32, block_n_head=4, block_n_kv_head=2, n_head=4, n_kv_head=2,
             block_mlp_hidden=48, mlp_hidden=48)
    d.update(kw)
    return BlockConfig(**d)


def tiny_model(**kw) -> BlockTransformer:
    m = BlockTransformer(tiny_cfg(**kw)).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: sharper, more varied logits (no argmax near-ties)
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
    return m


def real_tokens(*shape):
    return torch.randint(0, V - 1, shape)  # never the pad id


# ----------------------------------------------------------------------------------------------------------------
# Cached generation == the parallel (training) forward


VARIANTS = [(dict(), 5), (dict(), 8), (dict(context="summation"), 6), (dict(embedder="lookup_proj", embed_dim=12), 7),
            (dict(prefix_len=3), 5), (dict(block_len=2, max_seq_len=30), 5)]


@pytest.mark.parametrize("kw,prompt_len", VARIANTS, ids=["prefix", "prefix-aligned", "summation", "lookup_proj", "P3",
                                                          "LB2"])
def test_greedy_generation_equals_argmax_of_forward(kw, prompt_len):
    m = tiny_model(**kw)
    L = m.config.block_len
    idx = real_tokens(3, prompt_len)
    n_new = m.config.max_seq_len - prompt_len - 4 - (-prompt_len) % L
    out = m.generate(idx, n_new)  # batched: 3 prompts at once
    assert out.shape == (3, prompt_len + n_new) and torch.equal(out[:, :prompt_len], idx)
    # The training forward on the generated sequence, left-padded as generate() pads the prompt.
    lp = (-prompt_len) % L
    seq = F.pad(out, (lp, (-(lp + out.size(1))) % L), value=m.config.pad)
    logits, _ = m(seq)
    pred = logits.argmax(-1)[:, lp + prompt_len - 1: lp + out.size(1) - 1]  # logits[:, t] predicts t + 1
    assert torch.equal(pred, out[:, prompt_len:])
    # rows are independent: one row alone gives the same continuation
    assert torch.equal(m.generate(idx[1:2], n_new), out[1:2])


def test_sampled_generation_is_seeded_and_draws_from_the_model():
    m = tiny_model()
    idx = real_tokens(2, 6)
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = m.generate(idx, 16, temperature=1.0, top_k=5, generator=gen(1))
    b = m.generate(idx, 16, temperature=1.0, top_k=5, generator=gen(1))
    c = m.generate(idx, 16, temperature=1.0, top_k=5, generator=gen(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, m.generate(idx, 16))  # not greedy
    # every sampled token is among the top 5 of the parallel model's logits at its position
    seq = F.pad(a, (2, 0), value=m.config.pad)
    logits, _ = m(seq)
    top5 = logits.topk(5, dim=-1).indices[:, 2 + 5: 2 + a.size(1) - 1]  # (B, 16, 5)
    assert (top5 == a[:, 6:, None]).any(-1).all()


def test_static_caches_give_the_same_generation():
    """GPT.new_cache builds the BlockCache; static=True makes both its KV caches static (every step attends over all
    positions, masked): the same greedy tokens."""
    m = tiny_model()
    idx = real_tokens(2, 6)
    cache = m.new_cache(2, 26, static=True)
    assert isinstance(cache, bt.BlockCache) and cache.blocks.static and cache.local.static
    assert torch.equal(m.generate(idx, 20, cache=cache), m.generate(idx, 20))


@pytest.mark.parametrize("kw", [dict(), dict(context="summation")], ids=["prefix", "summation"])
def test_compiled_decode_is_two_graphs_that_cuda_graphs_can_capture(kw):
    """compile_decode compiles the two step kinds, token_step (inside a block) and block_end_step (a block's last
    token: the block decoder's step, then the next block's prefix): one graph each over a generation of several blocks,
    none more in a second generation of the same shape (on the same caches: no recompile as the block index, the
    token's index in its block and the block decoder's cache advance), every tensor a step writes marked static (what
    CUDA graphs need), and the eager greedy tokens."""
    from graph_check import check_compiled_generate

    m = tiny_model(**kw)
    idx = real_tokens(3, 6)
    check_compiled_generate(m, idx, 18, graphs=2)  # 18 tokens after a 6-token prompt: blocks 2..6 (L_B = 4)


def test_generation_caches_are_small_and_kv_bytes_match_them():
    m = tiny_model()
    cache = m.new_cache(3, 32, dtype=torch.bfloat16)
    blk, loc = cache.blocks, cache.local
    assert loc.max_len == m.config.prefix_len + m.config.block_len - 1  # P + L_B - 1 <= P + L_B entries
    assert blk.max_len == 32 // 4 + 1  # block positions (+1 for a left-padded prompt)
    assert m.kv_cache_bytes(3, 32, dtype_bytes=2) == cache.nbytes() == blk.nbytes() + loc.nbytes()
    v = GPT(m.config.vanilla_config())
    assert m.kv_cache_bytes(3, 32) < v.kv_cache_bytes(3, 32) / 2
    # the token decoder's local cache never grows past P + L_B - 1 while generating (it is reset every block)
    seen = []
    orig = m.decode_step

    def spy(tok, cache):
        out = orig(tok, cache)
        seen.append((cache.local.max_len, int(cache.local.lengths.max()), cache.k))
        return out

    m.decode_step = spy
    m.generate(real_tokens(2, 3), 20)
    assert len(seen) == 19 and all(n <= cap == 5 for cap, n, _ in seen)
    assert [k for _, _, k in seen] == [1, 2, 3, 0] * 4 + [1, 2, 3]  # a new block after every 4th token


# ----------------------------------------------------------------------------------------------------------------
# Locality


def test_logits_do_not_depend_on_later_tokens():
    m = tiny_model()
    idx = real_tokens(2, 32)
    logits, _ = m(idx)
    for t in (5, 14, 31):
        idx2 = idx.clone()
        idx2[:, t:] = real_tokens(2, 32 - t)
        logits2, _ = m(idx2)
        torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2[:, t:], logits[:, t:])


def test_with_fixed_context_a_block_never_sees_other_blocks():
    m = tiny_model()
    L = 4
    idx = real_tokens(2, 32)
    ctx = m.context(idx)
    m.context = lambda _idx: ctx  # hold every context embedding fixed
    logits, _ = m(idx)
    for j in (1, 4, 7):  # block j is decoded from ctx of block j-1: logits at [j*L - 1, (j+1)*L - 1)
        idx2 = real_tokens(2, 32)
        idx2[:, j * L:(j + 1) * L] = idx[:, j * L:(j + 1) * L]  # every other block changes
        logits2, _ = m(idx2)
        sl = slice(j * L - 1, (j + 1) * L - 1)
        torch.testing.assert_close(logits2[:, sl], logits[:, sl], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2, logits)
    # the same through local_logits: rows folded into the batch dimension are independent
    c, blocks = torch.randn(5, 32), real_tokens(5, L)
    out = m.local_logits(c, blocks)
    c2, blocks2 = torch.randn(5, 32), real_tokens(5, L)
    c2[2], blocks2[2] = c[2], blocks[2]
    torch.testing.assert_close(m.local_logits(c2, blocks2)[2], out[2], rtol=0, atol=1e-5)


def test_blocks_are_folded_into_the_batch_dimension():
    m = tiny_model()
    calls = []
    orig = m.token_decoder
    m.token_decoder = lambda x, mask=None: calls.append(x.shape) or orig(x, mask)
    pos = []
    m.block_decoder.rope.register_forward_hook(lambda mod, args, out: pos.append(args[0]))
    m(real_tokens(3, 32))
    assert calls == [torch.Size([3 * 8, m.config.local_len, 32])]  # one call over all 24 blocks
    assert len(pos) == 1 and torch.equal(pos[0].flatten(), torch.arange(8))  # RoPE positions = block indices
    # generation: the prefill is at blocks 0..N-1 (prompt left-padded to 2 blocks), each decode step at the next
    pos.clear()
    m.generate(real_tokens(1, 6), 10)
    assert [p.flatten().tolist() for p in pos] == [[0, 1], [2], [3]]


# ----------------------------------------------------------------------------------------------------------------
# Random-length padding (Appendix H)


def packed_window(B=4, W=97, eot=0, gen=None):
    """Rows of a token stream where every token of document d is the id d + 1 and documents end with eot."""
    rows = []
    for b in range(B):
        toks, d = [], 0
        while len(toks) < W:
            n = int(torch.randint(1, 12, (1,), generator=gen))
            toks += [d % 60 + 1] * n + [eot]
            d += 1
        rows.append(toks[:W])
    seq = torch.tensor(rows)
    return seq[:, :-1], seq[:, 1:]


def test_random_padding_never_mixes_documents():
    g = torch.Generator().manual_seed(0)
    pad, eot, L = V - 1, 0, 4
    x, y = packed_window(gen=g)
    x2, y2 = random_pad_documents(x, y, g, L, pad, eot)
    assert x2.shape == x.shape and y2.shape == y.shape
    full = torch.cat([x2, torch.where(y2[:, -1:] == IGNORE, pad, y2[:, -1:])], 1)
    assert torch.equal(torch.where(y2 == IGNORE, pad, y2), full[:, 1:])  # y is x shifted by one
    assert ((y2 == IGNORE) == (full[:, 1:] == pad)).all()  # every pad target is ignored, nothing else
    lefts = set()
    for b in range(x.size(0)):
        real = full[b][full[b] != pad]
        seq = torch.cat([x[b], y[b, -1:]])
        assert torch.equal(real, seq[:real.numel()])  # order kept, nothing lost but the tail
        for blk in x2[b].view(-1, L).tolist():
            toks = [t for t in blk if t != pad]
            docs = {t for t in toks if t != eot}
            assert len(docs) <= 1, f"block {blk} mixes documents"
            assert eot not in toks[:-1], f"block {blk} continues after an end of text"
            where = [i for i, t in enumerate(blk) if t != pad]
            assert where == list(range(where[0], where[0] + len(where))) if where else True  # pads only at the edges
            if where and where[0] > 0:
                lefts.add(where[0])
    assert lefts >= {1, 2, 3}  # random left pads of 1..L_B-1 occur (0 too, but it is not visible as a pad)


def test_prepare_batch_needs_the_end_of_text_id():
    x, y = packed_window(B=2, W=33, eot=5)
    g = torch.Generator().manual_seed(0)
    x1, y1, kw = bt.prepare_batch(x, y, g, tiny_cfg())  # no eot_id: unchanged
    assert kw == {} and x1 is x and y1 is y
    x2, y2, _ = bt.prepare_batch(x, y, g, tiny_cfg(eot_id=5))
    assert (x2 == V - 1).any() and (y2 == IGNORE).any()
    x3, _, _ = bt.prepare_batch(x, y, g, tiny_cfg(eot_id=5, random_pad=False))
    assert x3 is x


def test_pad_targets_carry_no_loss_and_padding_blocks_are_skipped():
    m = tiny_model()
    pad, L = m.config.pad, 4
    idx, tgt = real_tokens(2, 32), real_tokens(2, 32)
    idx[0, 8:16] = pad  # two blocks of padding (blocks 2 and 3) in row 0
    idx[1, 20:22] = pad  # a partly padded block in row 1
    tgt[0, 7:15] = pad
    logits, loss = m(idx, tgt)
    masked = tgt.masked_fill(tgt == pad, IGNORE)
    masked[:, :L - 1] = IGNORE  # the first block has no context embedding: never predicted
    torch.testing.assert_close(loss, lm_loss(logits, masked))
    assert torch.isfinite(loss)
    # the pad logit is never predicted, and the loss does not change whatever the model says at pad targets
    assert (logits[:, L - 1:, pad] == float("-inf")).all()
    # blocks that are entirely padding never reach the token decoder
    rows = []
    orig = m.token_decoder
    m.token_decoder = lambda x, mask=None: rows.append(x.size(0)) or orig(x, mask)
    m(idx)
    assert rows == [2 * 8 - 2]
    # the kept rows get exactly what the token decoder gives them without skipping
    ctx = m.context(idx).reshape(16, -1)
    nxt = F.pad(idx.view(2, 8, L)[:, 1:], (0, 0, 0, 1), value=pad).reshape(16, L)
    ref = m.local_logits(ctx, nxt).view(2, 8 * L, -1)[:, :32 - L + 1]
    torch.testing.assert_close(logits[1, L - 1:], ref[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[0, L - 1:L - 1 + 4], ref[0, :4], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Uptraining from a vanilla model (Appendix N)


def test_uptraining_init_matches_its_definition():
    v = GPT(GPTConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=48, vocab_size=V, max_seq_len=32))
    m = from_vanilla(v, block_len=4, prefix_len=3).eval()
    c = m.config
    assert (c.block_n_layer, c.n_layer, c.embedder, c.context) == (2, 2, "lookup_proj", "prefix")
    # lower half -> block decoder, upper half -> token decoder
    for i in range(2):
        for (k, a), b in zip(m.block_decoder.blocks[i].state_dict().items(), v.blocks[i].state_dict().values()):
            assert torch.equal(a, b), k
        for (k, a), b in zip(m.blocks[i].state_dict().items(), v.blocks[2 + i].state_dict().values()):
            assert torch.equal(a, b), k
    # embedder: the mean of the block's vanilla token embeddings
    blocks = real_tokens(2, 5, 4)
    torch.testing.assert_close(m.embedder(blocks), v.tok_emb(blocks).mean(2), rtol=1e-5, atol=1e-6)
    # prefix projection: every prefix slot equals the context embedding
    ctx = m.context(real_tokens(2, 16)).reshape(8, -1)
    slots = m.context_slots(ctx)
    assert slots.shape == (8, 3, 32)
    torch.testing.assert_close(slots, ctx[:, None].expand(8, 3, 32), rtol=0, atol=1e-6)
    # the token decoder's embedding, final norm and head are the vanilla ones
    assert torch.equal(m.tok_emb.weight, v.tok_emb.weight) and torch.equal(m.lm_head.weight, v.lm_head.weight)
    assert torch.equal(m.norm.weight, v.norm.weight)
    # and it runs: generation still equals the forward
    out = m.generate(real_tokens(2, 4), 12)
    assert torch.equal(m(out)[0].argmax(-1)[:, 3:15], out[:, 4:])


# ----------------------------------------------------------------------------------------------------------------
# Config and input errors


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match=r"block_n_embd=34 is not divisible by block_len L_B=4"):
        tiny_cfg(block_n_embd=34)
    with pytest.raises(ValueError, match=r"max_seq_len=30 is not a multiple of block_len L_B=4"):
        tiny_cfg(max_seq_len=30)
    with pytest.raises(ValueError, match="context='cross' is not"):
        tiny_cfg(context="cross")
    with pytest.raises(ValueError, match="eot_id=66 must be a vocabulary id other than the pad id"):
        tiny_cfg(eot_id=66)
    with pytest.raises(ValueError, match="^bad GPTConfig: n_embd=32 is not divisible by n_head=5"):  # token decoder
        tiny_cfg(n_head=5, n_kv_head=5)
    with pytest.raises(ValueError, match="^bad BlockConfig: block decoder: bad GPTConfig: n_embd=32 is not divisible "
                                         "by n_head=5"):
        tiny_cfg(block_n_head=5, block_n_kv_head=5)
    with pytest.raises(ValueError, match="^bad BlockConfig: block_len=0 must be a positive int"):
        tiny_cfg(block_len=0)
    with pytest.raises(ValueError, match="unknown preset"):
        BlockConfig.from_preset("huge")
    m = tiny_model()
    with pytest.raises(ValueError, match="sequence length 10 is not a multiple of block_len L_B=4"):
        m(real_tokens(1, 10))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        m.generate(real_tokens(1, 30), 8)
    v = GPT(GPTConfig(n_layer=1, n_embd=32, mlp_hidden=48, vocab_size=V, max_seq_len=32))
    with pytest.raises(ValueError, match="needs at least 2 layers"):
        from_vanilla(v)
    v = GPT(GPTConfig(n_layer=2, n_embd=32, mlp_hidden=48, vocab_size=V, max_seq_len=32))
    with pytest.raises(ValueError, match="sequence length 30 is not a multiple of block_len L_B=4"):
        from_vanilla(v, max_seq_len=30)


def test_presets_have_equal_decoders_and_match_vanilla_parameters():
    for name in ("tiny", "small", "t3-85m"):  # the others only scale these up (meta-device builds cost time)
        c = BlockConfig.from_preset(name)
        assert c.block_len == 4 and c.prefix_len == 2 and c.embedder == "lookup"
        assert all(getattr(c, f"block_{f}") == getattr(c, f) for f in bt.DECODER_FIELDS)
        with torch.device("meta"):
            m, v = BlockTransformer(c), GPT(c.vanilla_config())
        # equal decoders; the vanilla model of Table 3 stacks both: equal but for the prefix projection
        extra = c.block_n_embd * c.prefix_len * c.n_embd + c.prefix_len * c.n_embd
        assert m.num_params() - v.num_params() == extra + c.block_n_embd, name  # + the block decoder's final norm


def test_bench_presets_row_puts_the_block_model_beside_its_vanilla_counterpart(capsys):
    import bench

    bench.main(["presets", "--arch", "block", "--preset", "tiny-matched"])
    row = [line for line in capsys.readouterr().out.splitlines() if "non-emb" in line]
    c = BlockConfig.from_preset("tiny-matched")
    with torch.device("meta"):
        m, v = BlockTransformer(c), GPT(c.vanilla_config())
    assert len(row) == 1 and "tiny-matched block  4L tok  4L L_B 4 P 2 " in row[0]
    assert f"{m.num_params() / 1e6:8.2f}M" in row[0] and f"(baseline {v.num_params() / 1e6:.2f}M" in row[0]


# ----------------------------------------------------------------------------------------------------------------
# train.py: from scratch and uptrained from a vanilla checkpoint; the bench


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("block")
    words = "def class return import self value index block token prefix context decoder cache".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=g))
            for n in torch.randint(5, 60, (80,), generator=g)]
    data = write_jsonl(d / "corpus.jsonl", docs)
    common = ["--data", str(data), "--cache-dir", str(d / "cache"), "--vocab-size", "300", "--seq-len", "32",
              "--batch-size", "4", "--eval-iters", "1", "--sample-tokens", "6", "--device", "cpu",
              "--dtype", "float32", "--max-iters", "2"]
    import train

    train.train(["--arch", "vanilla", "--out-dir", str(d / "vanilla"), *common])
    return d, common


def test_train_block_from_scratch_and_uptrained(corpus):
    import train
    from harness import checkpoint
    from harness.data import padded_vocab

    d, common = corpus
    res = train.train(["--arch", "block", "--out-dir", str(d / "scratch"), *common])
    assert res["loss"] is not None
    ck = checkpoint.load_checkpoint(d / "scratch" / "ckpt.pt")
    cfg = ck["config"]
    # the tokenizer's end-of-text id (300) reached the config, so prepare_batch pads documents; pad = spare last row
    assert ck["arch"] == "block" and cfg["eot_id"] == 300 and cfg["vocab_size"] == padded_vocab(301)
    assert BlockConfig.from_dict(cfg).pad == cfg["vocab_size"] - 1 > 300
    assert isinstance(checkpoint.model_from_checkpoint(ck), BlockTransformer)

    van = str(d / "vanilla" / "ckpt.pt")
    res = train.train(["--arch", "block", "--init-from", van, "--out-dir", str(d / "up"), "--block-prefix-len", "3",
                       *common])
    assert res["loss"] is not None
    ck = checkpoint.load_checkpoint(d / "up" / "ckpt.pt")
    cfg = ck["config"]
    assert (cfg["embedder"], cfg["prefix_len"], cfg["block_n_layer"], cfg["n_layer"], cfg["eot_id"]) == \
           ("lookup_proj", 3, 2, 2, 300)
    with pytest.raises(ValueError, match="uptraining from a vanilla model"):
        train.train(["--arch", "block", "--init-from", van, "--block-context", "summation",
                     "--out-dir", str(d / "x"), *common])
    with pytest.raises(ValueError, match="not a multiple of block_len"):
        train.train(["--arch", "block", "--out-dir", str(d / "x"), *common, "--seq-len", "30"])


def test_bench_block_batch_search_and_ratio(capsys):
    """`python bench.py block` at toy sizes: in both settings, the largest batch whose generation caches fit the budget
    (the paper's maximum batch), a search over 1, 2, 4, ... up to it, rounds at batch 1, the best batch and --batches,
    and the ratio line."""
    import bench
    from harness import bench_decode

    bench.main(["block", "--preset", "tiny", "--scale", str(1 / 32), "--budget-mib", "1", "--repeats", "1",
                "--dtype", "float32", "--device", "cpu", "--batches", "3"])
    out = capsys.readouterr().out
    block, vanilla = bench_decode.block_pair("tiny", None, torch.device("cpu"), torch.float32, 68)
    sections = out.split("\n-- ")[1:]
    assert len(sections) == 2
    for sec, (setting, (P, G)) in zip(sections, (("decode-heavy", (4, 64)), ("prefill-heavy", (64, 4)))):
        per_seq = {k: bench_decode.generation_bytes(m, P, G) for k, m in (("vanilla", vanilla), ("block", block))}
        assert per_seq["block"] < per_seq["vanilla"]
        top = {k: 2 ** 20 // n for k, n in per_seq.items()}
        assert sec.startswith(f"{setting}: prompt {P}, {G} new tokens")
        assert f"largest batch in 1 MiB: vanilla {top['vanilla']}, block {top['block']}" in sec
        best = {}
        for k in ("vanilla", "block"):
            line = next(x for x in sec.splitlines() if x.startswith(f"   batch search, {k} "))
            found = [int(c.split(":")[0]) for c in line.split("): ")[1].split(" -> ")[0].split(", ")]
            assert found == sorted({2 ** i for i in range(top[k].bit_length())} | {top[k]})  # 1, 2, 4, ..., the max
            best[k] = int(line.split(" -> batch ")[1])
        rows = {(r[0], int(r[1])) for r in (x.split() for x in sec.splitlines()) if r[:1] in (["vanilla"], ["block"])}
        assert rows == {(k, b) for k in best for b in (1, 3, best[k])}
        assert f"best batch: vanilla {best['vanilla']}, block {best['block']} -> block / vanilla = " in sec


def test_bench_block_runs_one_setting_alone(capsys):
    import bench

    bench.main(["block", "--preset", "tiny", "--scale", str(1 / 64), "--budget-mib", "1", "--repeats", "1",
                "--dtype", "float32", "--device", "cpu", "--setting", "prefill-heavy", "--search-tokens", "0"])
    out = capsys.readouterr().out
    assert "-- prefill-heavy" in out and "-- decode-heavy" not in out
    assert "batch search" not in out  # --search-tokens 0: the budget's largest batch is timed, as in the paper
    top = out.split("largest batch in 1 MiB: ")[1].split("\n")[0]  # "vanilla V, block B"
    assert f"best batch: {top} -> block / vanilla" in out


def test_bench_block_times_no_first_use_choice(monkeypatch, capsys):
    """cpu_tuning measures a shape's CPU form on its first use (each projection's per row bucket, the decode attention's
    per batch and key-count bucket: seconds at a large batch). The batch search runs its window of decode steps once
    untimed (every step kind of a block) and the rounds warm up on the whole setting, so no measurement falls inside
    a timed window: the search's clock or a timed round."""
    import types
    import bench
    from harness import bench_decode

    log = []
    monkeypatch.setenv("LINEAR_CHOICE_CACHE", "")  # every choice measured in this process, none read from disk
    for cache in ("_linear_choice", "_linear_times", "_decode_choice"):
        monkeypatch.setattr(cpu_tuning, cache, {})
    for name in ("fastest", "time_linear_products"):
        real = getattr(cpu_tuning, name)
        monkeypatch.setattr(cpu_tuning, name, lambda *a, real=real, **k: log.append("measure") or real(*a, **k))
    ticks = iter(range(1, 10 ** 9))
    monkeypatch.setattr(bench_decode, "time", types.SimpleNamespace(perf_counter=lambda: log.append("clock") or
                                                                    next(ticks)))
    real_rounds = bench_decode.rounds

    def rounds(*a, **k):
        log.append("rounds")
        try:
            return real_rounds(*a, **k)
        finally:
            log.append("end")
    monkeypatch.setattr(bench_decode, "rounds", rounds)
    bench.main(["block", "--preset", "tiny", "--scale", str(1 / 32), "--budget-mib", "1", "--repeats", "1",
                "--dtype", "float32", "--device", "cpu", "--setting", "decode-heavy", "--search-tokens", "4"])
    assert "batch search, block" in capsys.readouterr().out
    assert log.count("measure") > 0 and log.count("clock") > 2 and log.count("rounds") == 1
    timed, clocks = False, 0
    for x in log:
        if x in ("clock", "rounds", "end"):
            clocks += x == "clock"
            timed = x == "rounds" or (x == "clock" and clocks % 2 == 1)
        assert not (timed and x == "measure"), log


def test_block_profile_groups_count_every_product_and_attention(monkeypatch):
    """bench.py block --profile: every projection lands in the matmul group whichever CPU product cpu_tuning runs it
    with (F.linear, torch.mv, mm, the transposed copy, oneDNN's layout), one event per product, and every attention
    call in the attention group, SDPA or cpu_tuning's grouped decode form."""
    from torch.profiler import ProfilerActivity, profile
    from harness import bench_decode

    m = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, vocab_size=V, max_seq_len=64)).eval()
    idx = torch.randint(0, V, (1, 5))  # one row: torch.mv applies to the decode steps
    calls = {"linear": 0, "attend": 0}
    for op in calls:
        real = getattr(cpu_tuning.TUNED, op)
        monkeypatch.setattr(cpu_tuning.TUNED, op, lambda *a, op=op, real=real, **k: calls.__setitem__(op, calls[op] + 1)
                            or real(*a, **k))
    products = [p for p in cpu_tuning.LINEAR_PRODUCTS if p != "dnn" or torch.backends.mkldnn.is_available()]
    for product in products:
        for form in ("sdpa", "grouped"):
            monkeypatch.setattr(cpu_tuning, "decode_attention", lambda q, k, mask, timer=None, form=form: form)
            cpu_tuning.force_linear(product)
            try:
                with torch.no_grad(), cpu_tuning.switched_on():
                    m.generate(idx, 3)  # weight copies made, outside the profile
                    calls.update(linear=0, attend=0)
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        m.generate(idx, 3)
            finally:
                cpu_tuning.force_linear(None)
            groups = bench_decode.profile_groups(prof.key_averages())
            assert calls["attend"] == 2 * 3 and calls["linear"] > 0, calls  # 2 layers x 3 forward passes
            assert groups["attention"]["calls"] == calls["attend"], (product, form, groups)
            assert groups["matmul"]["calls"] == calls["linear"], (product, form, groups)
            assert 0 < groups["attention"]["us"] + groups["matmul"]["us"] <= groups["total"] * 1.01


def test_block_profile_records_a_window_of_decode_steps_at_the_mean_context(monkeypatch):
    """bench.py block --profile: exactly n decode steps in the profile (no prefill, none of the untimed steps before
    them), at the context search_window gives, for the Block Transformer and vanilla alike; the summary names them."""
    from harness import bench_decode

    P, G, n = 8, 16, 4
    ctx = bench_decode.search_window(P, G, n)[1]
    for m in (tiny_model(), GPT(tiny_cfg().vanilla_config()).eval()):
        seen = []
        real = m.decode_step
        monkeypatch.setattr(m, "decode_step", lambda tok, cache, real=real: seen.append(
            torch.autograd._profiler_enabled()) or real(tok, cache))
        prefill = m.prefill
        monkeypatch.setattr(m, "prefill", lambda idx, cache, prefill=prefill: seen.append(("prefill", idx.shape))
                            or prefill(idx, cache))
        with torch.no_grad():
            text = bench_decode.profile_decode(m, P, G, 3, n, "cpu")
        assert seen == [("prefill", (3, ctx))] + [False] * n + [True] * n, seen
        assert text.startswith(f"{n} decode steps at context {ctx}: ") and "attention" in text and "other" in text


def test_halves_config_reuses_gptconfig():
    c = BlockConfig(**bt.halves(6, 4, 2, 64, 96, vocab_size=V, max_seq_len=32))
    assert isinstance(c, GPTConfig)
    assert (c.n_layer, c.block_n_layer, c.block_n_embd, c.block_n_head, c.block_mlp_hidden) == (3, 3, 64, 4, 96)
    assert BlockConfig.from_dict(dataclasses.asdict(c)) == c
    assert BlockConfig.from_preset("tiny") == BlockConfig(**bt.PRESETS["tiny"])  # this file's presets, not model.py's
    assert c.vanilla_config() == GPTConfig(n_layer=6, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=96, vocab_size=V,
                                           max_seq_len=32)
    blk = c.block_decoder_config()
    assert (blk.n_layer, blk.max_seq_len) == (3, 32 // 4 + 1)  # one position per block (+1: a left-padded prompt)


def test_hooks_use_the_tokenizer_train_passes():
    """config_overrides and train.py's conversion take train.py's tokenizer (tok=) instead of rebuilding it from the
    arguments."""
    import train

    class Tok:
        eot, n_vocab = 7, 60

    args = argparse.Namespace(arch="block", block_len=None, block_prefix_len=None, block_embedder=None,
                              block_context=None, block_no_random_pad=False, vocab_size=None, tokenizer=None,
                              init_from=None,
                              seq_len=32)
    assert bt.config_overrides(args, tok=Tok()) == {"eot_id": 7}  # rebuilt from these args it would be 4096
    v = GPT(GPTConfig(n_layer=2, n_embd=32, mlp_hidden=48, vocab_size=V, max_seq_len=32))
    assert train.convert(args, v, Tok()).config.eot_id == 7
    Tok.n_vocab = V
    with pytest.raises(ValueError, match="no spare row"):
        train.convert(args, v, Tok())


def test_random_padding_source_positions_name_the_same_targets():
    g = torch.Generator().manual_seed(3)
    x, y = packed_window(B=3, W=65, eot=0, gen=g)
    x2, y2, src = random_pad_documents(x, y, torch.Generator().manual_seed(1), 4, V - 1, 0, return_source=True)
    x3, y3 = random_pad_documents(x, y, torch.Generator().manual_seed(1), 4, V - 1, 0)
    assert torch.equal(x2, x3) and torch.equal(y2, y3)  # the same layout with or without the source positions
    seq = torch.cat([x, y[:, -1:]], 1)
    real = y2 != IGNORE
    assert ((src >= 0) == real).all() and (src[~real] == -1).all()
    assert torch.equal(seq.gather(1, src.clamp(min=0))[real], y2[real])  # target t of the layout = raw token src[t]
    scored = real.clone()
    scored[:, :3] = False  # what the block model scores: never the first L_B - 1 targets, so src >= 1 ...
    assert (src[scored] >= 1).all()  # ... and another model predicts raw token src from raw position src - 1
    assert torch.equal(y.gather(1, (src - 1).clamp(min=0))[scored], y2[scored])
    for b in range(3):  # raw order is kept
        assert (src[b][real[b]].diff() > 0).all()


@pytest.mark.parametrize("kw,batch", [(dict(), 4), (dict(context="summation"), 4), (dict(), 1), (dict(), 70)],
                         ids=["prefix", "summation", "batch1", "batch70"])
def test_bf16_cached_decoding_stays_close_to_the_fp32_forward(kw, batch):
    """bf16 (the dtype of the CPU benchmarks): the cached decode steps, teacher-forced on an fp32 greedy sequence, give
    logits within 0.06 of the fp32 forward's (their std is ~0.6; measured max errors 0.015-0.028 over 3 seeds) and
    the same argmax at >= 95% of the steps (measured 97.7-100%). The bf16 steps run with cpu_tuning switched on, as
    the benchmarks run them: batches 1, 4 and 70 take its products for one row, a few rows and (past 64) F.linear."""
    m = tiny_model(**kw)
    idx = real_tokens(batch, 6)
    out = m.generate(idx, 22)  # fp32
    ref = m(F.pad(out, (2, 2), value=m.config.pad))[0][:, 2 + 5:2 + 27]  # (B, 22, V) fp32 logits of the new tokens
    mb = copy.deepcopy(m).to(torch.bfloat16)
    cache = mb.generation_cache(batch, 6, 22)
    with cpu_tuning.switched_on():
        got = [mb.prefill(idx, cache)]
        for k in range(21):
            got.append(mb.decode_step(out[:, 6 + k], cache))
    got = torch.stack(got, 1).float()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))  # the pad logit only
    err = (got - ref)[finite].abs().max()
    assert err < 0.06, float(err)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
