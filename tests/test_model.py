"""The vanilla decoder and the shared building blocks of model.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import graphs
from model import (GPT, IGNORE, GPTConfig, KVCache, RMSNorm, apply_rotary, attend, causal_mask_from_positions,
                   distill_loss, lm_loss, sample_next)


def tiny(**kw):
    base = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=48, vocab_size=97, max_seq_len=64)
    return GPTConfig(**{**base, **kw})


def test_causality():
    """A change at position t never changes the outputs before t."""
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 20))
    t = 11
    idx2 = idx.clone()
    idx2[:, t] = (idx2[:, t] + 1) % 97
    a, _ = m(idx)
    b, _ = m(idx2)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-4)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_cached_decoding_equals_full_forward_ragged(n_kv_head):
    """Prefill of right-padded prompts of different lengths, then decode steps with every row at its own position,
    gives the full forward's logits (fp32, tight tolerance)."""
    m = GPT(tiny(n_kv_head=n_kv_head)).eval()
    B, T = 4, 24
    idx = torch.randint(0, 97, (B, T))
    full, _ = m(idx)
    lens = torch.tensor([3, 7, 12, 1])
    cache = m.new_cache(B, 32)
    prompt = idx[:, :12].clone()
    prompt[torch.arange(12)[None, :] >= lens[:, None]] = 0  # garbage in the pads must not matter
    logits = m.prefill(prompt, cache, lens)
    rows = torch.arange(B)
    torch.testing.assert_close(logits, full[rows, lens - 1], atol=2e-5, rtol=0)
    for _ in range(10):
        pos = cache.lengths.clone()
        logits = m.decode_step(idx[rows, pos], cache)
        torch.testing.assert_close(logits, full[rows, pos], atol=2e-5, rtol=0)
    assert torch.equal(cache.lengths, lens + 10)


def test_chunked_prefill_equals_full_forward():
    """forward_cached over a second chunk attends to the first chunk through the cache."""
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 16))
    full, _ = m(idx)
    cache = m.new_cache(2, 16)
    m.prefill(idx[:, :9], cache)
    with torch.no_grad():
        h = m.forward_cached(idx[:, 9:], cache)
    torch.testing.assert_close(m.head(h), full[:, 9:], atol=2e-5, rtol=0)


def test_greedy_generation_matches_argmax_and_is_deterministic():
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (3, 5))
    out = m.generate(idx, 12)
    assert out.shape == (3, 17) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, m.generate(idx, 12))
    logits, _ = m(out)
    assert torch.equal(logits[:, 4:-1].argmax(-1), out[:, 5:])


def test_seeded_sampling_is_reproducible():
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 4))
    run = lambda seed: m.generate(idx, 20, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_sample_next_top_k_and_temperature():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]])
    assert sample_next(logits).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws.flatten().tolist()) <= {1, 2}
    assert (draws == 2).any()  # temperature 1 does sample the second-best token sometimes


def test_rope_relative():
    """Rotary embedding makes q·k depend on the position offset only."""
    m = GPT(tiny())
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def dot(i, j):
        cq, sq = m.rope(torch.tensor([i]))
        ck, sk = m.rope(torch.tensor([j]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(dot(7, 3), dot(20, 16))
    assert not torch.allclose(dot(7, 3), dot(7, 4))


def test_partial_rotary_leaves_tail_untouched():
    cfg = tiny(rotary_pct=0.5)
    m = GPT(cfg)
    x = torch.randn(1, 4, 3, cfg.hd)
    cos, sin = m.rope(torch.tensor([1, 2, 3]))
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., cfg.rot_dim:], x[..., cfg.rot_dim:])
    assert not torch.allclose(y[..., :cfg.rot_dim], x[..., :cfg.rot_dim])


def test_attend_gqa_equals_repeated_heads():
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(attend(q, k, v, is_causal=True), ref)
    mask = causal_mask_from_positions(torch.arange(5)[None].expand(2, 5), 5)
    torch.testing.assert_close(attend(q, k, v, mask=mask), ref)


def test_stacked_attention_equals_repeated_heads_and_greedy_decoding():
    """attend_stacked (CUDA's masked GQA: the G query heads of a KV head as G*T queries of it, no K/V copied) is the
    same attention as SDPA over repeated K/V heads, for one query per row (decode) and several (a prefill chunk), a
    per-row or a shared mask; a model decoding through it gives the greedy tokens of SDPA's own GQA."""
    import model

    torch.manual_seed(0)
    for T, rows in ((1, 2), (3, 2), (3, 1)):
        q, k, v = torch.randn(2, 12, T, 16), torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
        mask = torch.rand(rows, 1, T, 9) > 0.4
        mask[..., 0] = True
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
        torch.testing.assert_close(model.attend_stacked(q, k, v, mask), ref)
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 90, (3, 6))
    ref = m.generate(idx, 10)
    stacked = lambda q, k, v, mask=None, is_causal=False, scale=None: (  # noqa: E731 - every masked step stacked
        model.attend_stacked(q, k, v, mask, scale) if mask is not None else F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True))
    orig, model.attend = model.attend, stacked
    try:
        assert torch.equal(m.generate(idx, 10), ref)
    finally:
        model.attend = orig


def test_rmsnorm_offset():
    x = torch.randn(3, 8)
    n = RMSNorm(8, offset=1.0)
    assert torch.all(n.weight == 0)  # (1 + w) with w = 0 is the identity scale
    torch.testing.assert_close(n(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_kv_cache_per_row_layers_and_rows():
    c = KVCache(n_layer=3, batch=4, max_len=6, n_kv_head=2, head_dim=5)
    k, v = torch.randn(2, 2, 1, 5), torch.randn(2, 2, 1, 5)
    rows, layers, pos = torch.tensor([3, 1]), torch.tensor([2, 0]), torch.tensor([[4], [1]])
    view = c.layer(layers, rows)
    view.write(pos, k, v)
    assert torch.equal(c.k[2, 3, :, 4], k[0, :, 0]) and torch.equal(c.v[0, 1, :, 1], v[1, :, 0])
    assert (c.k != 0).sum() == k.numel()  # nothing else was written
    rk, rv = view.read(5)
    assert rk.shape == (2, 2, 5, 5) and torch.equal(rk[0, :, 4], k[0, :, 0]) and torch.equal(rv[1, :, 1], v[1, :, 0])


def test_param_counts_and_kv_bytes():
    cfg = tiny(tie_embeddings=False)
    m = GPT(cfg)
    d, hd = cfg.n_embd, cfg.hd
    per_layer = d * cfg.n_head * hd * 2 + d * cfg.n_kv_head * hd * 2 + 3 * d * cfg.mlp_hidden + 2 * d
    assert m.num_params() == cfg.n_layer * per_layer + d  # + final norm
    assert m.num_params(non_embedding=False) == m.num_params() + 2 * cfg.vocab_size * d
    tied = GPT(tiny())
    assert tied.num_params(non_embedding=False) == tied.num_params() + cfg.vocab_size * d
    cache = tied.new_cache(3, 40, dtype=torch.bfloat16)
    assert tied.kv_cache_bytes(3, 40, dtype_bytes=2) == cache.nbytes()


def test_loss_ignores_pad_targets():
    logits = torch.randn(2, 5, 11)
    y = torch.randint(0, 11, (2, 5))
    y2 = y.clone()
    y2[:, 3:] = IGNORE
    ref = F.cross_entropy(logits[:, :3].reshape(-1, 11), y[:, :3].reshape(-1))
    torch.testing.assert_close(lm_loss(logits, y2), ref)


def test_config_errors():
    with pytest.raises(ValueError, match="n_kv_head"):
        tiny(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="divisible"):
        tiny(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="mlp"):
        tiny(mlp="relu")
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.from_preset("huge")
    m = GPT(tiny())
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        m.generate(torch.zeros(1, 60, dtype=torch.long), 10)


# ---- distillation divergences against hand-computed values ----------------------------------------------------


def _probs(logits):
    return [math.exp(x) / sum(math.exp(y) for y in logits) for x in logits]


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd"])
def test_divergences_by_hand(kind):
    s_logits, t_logits = [0.3, -1.2, 2.0], [1.0, 0.5, -0.5]
    q, p = _probs(s_logits), _probs(t_logits)  # student q, teacher p
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b))  # noqa: E731
    m = [(x + y) / 2 for x, y in zip(p, q)]
    expected = {"fkl": kl(p, q), "rkl": kl(q, p), "jsd": 0.5 * kl(p, m) + 0.5 * kl(q, m),
                "tvd": 0.5 * sum(abs(x - y) for x, y in zip(p, q))}[kind]
    got = distill_loss(torch.tensor([[s_logits]]), torch.tensor([[t_logits]]), kind)
    assert abs(got.item() - expected) < 1e-6
    same = distill_loss(torch.tensor([[t_logits]]), torch.tensor([[t_logits]]), kind)
    assert abs(same.item()) < 1e-7


def test_divergence_mask_and_unknown():
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    full = distill_loss(s[mask.bool()], t[mask.bool()], "fkl")
    torch.testing.assert_close(distill_loss(s, t, "fkl", mask=mask), full)
    with pytest.raises(ValueError, match="unknown divergence"):
        distill_loss(s, t, "kl2")


def test_static_cache_and_compiled_decode_equal_eager_generation():
    """A static cache (attention over all max_len positions, masked) and the compiled decode step on it give the same
    greedy tokens as the eager dynamic path; the compiled step is really in use."""
    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 90, (2, 7))
    ref = m.generate(idx, 9)
    cache = m.new_cache(2, 16, static=True)
    assert torch.equal(m.generate(idx, 9, cache=cache), ref)
    graphs.compile_decode(m)
    assert m.static_cache and hasattr(m.decode_step, "_torchdynamo_orig_callable")
    assert torch.equal(m.generate(idx, 9), ref)


def test_kv_len_reads_up_to_the_last_query_and_raises_the_one_overflow_error():
    """KVCache.kv_len: max(lengths) + T for T new tokens, max(q_pos) + 1 for explicit positions, max_len when static;
    past max_len the overflow error names both counts. new_cache honours static (default: the model's static_cache)."""
    m = GPT(tiny())
    cache = m.new_cache(3, 10)
    assert isinstance(cache, KVCache) and not cache.static and cache.max_len == 10
    cache.lengths.copy_(torch.tensor([2, 7, 4]))
    assert cache.kv_len(1) == 8 and cache.kv_len(3) == 10 and cache.kv_len(torch.tensor([[3], [5], [0]])) == 6
    with pytest.raises(ValueError, match="KV cache holds 10 positions; this step needs 11"):
        cache.kv_len(4)
    with pytest.raises(ValueError, match="KV cache holds 10 positions; this step needs 12"):
        cache.kv_len(torch.tensor([11]))
    static = m.new_cache(3, 10, static=True)
    static.lengths.copy_(torch.tensor([2, 7, 4]))
    assert static.static and static.kv_len(1) == static.kv_len(torch.tensor([0])) == 10
    m.static_cache = True
    assert m.new_cache(1, 4).static and not m.new_cache(1, 4, static=False).static


def test_compiled_decode_is_one_graph_that_cuda_graphs_can_capture():
    """compile_decode on a static cache: one graph for every step of a generation (no recompile as positions and
    lengths advance), no graph break (fullgraph), and every input the step writes (k, v, lengths) marked static, so
    that on CUDA mode='reduce-overhead' captures it instead of skipping it; the tokens equal the eager ones. A cache
    built without the marks is caught."""
    from graph_check import check_compiled_generate

    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    idx = torch.randint(0, 90, (3, 5))
    check = check_compiled_generate(m, idx, 8, graphs=1, again=False)
    unmarked = m.new_cache(3, 16, static=False)
    unmarked.static = True  # static shapes, but k, v and lengths not marked
    m.prefill(idx, unmarked)
    m.decode_step(idx[:, 0], unmarked)
    assert check.graphs == 2 and sorted(check.unsafe) == ["l_args_1_k", "l_args_1_lengths", "l_args_1_v"], check.unsafe


def test_graph_check_names_every_host_sync():
    """GraphCheck.syncs: torch traces int(t), bool(t), nonzero and boolean-mask indexing into the graph without a
    break, but each reads a device value back to the host (no CUDA graph can hold it); their device-side forms
    (masked_fill, argmax as a tensor, torch.where) do not."""
    from graph_check import GraphCheck

    from graphs import compile_step

    x, m = torch.arange(4.0), torch.tensor([True, False, True, True])
    check = GraphCheck()
    sync = compile_step(lambda x, m: x[m].sum() + int(x.argmax()) + x.nonzero().sum() + x[0] * bool(x.any()),
                        backend=check)
    assert sync(x, m) == 5 + 3 + 6 + 0
    assert sorted(check.syncs) == ["aten._local_scalar_dense.default"] * 2 + ["aten.index.Tensor",
                                                                              "aten.nonzero.default"], check.syncs
    check = GraphCheck()
    compile_step(lambda x, m: x.masked_fill(~m, 0).sum() + x.argmax() + torch.where(x.any(), x, 0), backend=check)(x, m)
    assert check.graphs == 1 and check.syncs == []


def test_each_compiled_step_keeps_its_own_graphs():
    """compile_step gives every step its own dynamo cache: steps decorated in torch (no_grad, as every decode step)
    would otherwise share one, so more compiled steps than dynamo's recompile limit (the step kinds of several models
    in one process) would fail. One step holds a graph for every batch bucket."""
    from torch._dynamo.testing import CompileCounter

    from graphs import BATCH_BUCKETS, compile_step

    @torch.no_grad()
    def step(x):
        return x + 1

    counters = [CompileCounter() for _ in range(12)]  # more steps than the default limit (8)
    for c in counters:
        assert torch.equal(compile_step(step, backend=c)(torch.zeros(2)), torch.ones(2))
    assert [c.frame_count for c in counters] == [1] * 12
    c = CompileCounter()
    buckets = compile_step(step, backend=c)
    for b in BATCH_BUCKETS + BATCH_BUCKETS:
        buckets(torch.zeros(b))
    assert c.frame_count == len(BATCH_BUCKETS)


def test_batch_bucket():
    from graphs import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17, 256, 257, 600)] == [1, 2, 4, 8, 16, 32, 256, 512, 768]
    with pytest.raises(ValueError, match="batch must be >= 1"):
        batch_bucket(0)


def test_graphed_generate_pads_to_a_bucket_and_reuses_one_cache_per_bucket():
    """After compile_decode, generate() pads a batch to its bucket (3 -> 4 rows) and keeps one static cache per bucket,
    allocated once and reused by every later call (a CUDA graph replays on the same addresses): the eager greedy
    tokens, one graph per bucket, none more for another call, a longer prompt or another batch of the same bucket;
    seeded sampling as eager (the padding rows are not sampled)."""
    from graph_check import GraphCheck

    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    a, b = torch.randint(0, 90, (3, 5)), torch.randint(0, 90, (4, 9))
    ref_a, ref_b, ref_1 = m.generate(a, 8), m.generate(b, 6), m.generate(a[:1], 5)
    sampled = lambda: m.generate(a, 8, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(5))  # noqa
    ref_s = sampled()
    check = GraphCheck()
    graphs.compile_decode(m, backend=check)
    assert torch.equal(m.generate(a, 8), ref_a) and check.graphs == 1
    cache = m.graph_caches[4]
    assert cache.batch == 4 and cache.static and cache.max_len == 64  # 5 + 8 rounded up to 128, capped at the context
    assert torch.equal(m.generate(b, 6), ref_b) and torch.equal(sampled(), ref_s)
    assert check.graphs == 1 and m.graph_caches[4] is cache and check.unsafe == check.syncs == []
    assert torch.equal(m.generate(a[:1], 5), ref_1) and check.graphs == 2 and sorted(m.graph_caches) == [1, 4]
