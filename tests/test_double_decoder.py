"""double_decoder.py: the block-based double decoder (doubly-causal block attention, prefix-LM, cached generation).

Every test is an exact equivalence or a bad-input error: the LSE merge against one dense softmax (fp64), causality of
both decoders, each block's predictions against the [context | response] forward of that block, cached generation
(with and without rollover, with a reused prefix cache) against the training forward, incremental context extension
against the context decoder from scratch, the dual-key Triton kernel (interpreted on CPU) against the LSE merge, the
Appendix A.1 / A.2 accounting, and train.py smoke runs of both objectives.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
import double_decoder as ddm
import graphs
from double_decoder import (DoubleConfig, DoubleDecoder, baseline_config, check_partition, prepare_batch,
                            sample_blocks, splits_to_blk)
from model import GPT, IGNORE

V = 61


def tiny_cfg(**kw):
    base = dict(ctx_layers=2, gen_layers=1, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, max_seq_len=64,
                vocab_size=V)
    return DoubleConfig(**{**base, **kw})


def tiny_model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return DoubleDecoder(tiny_cfg(**kw)).to(dtype).eval()


def two_block(T, s):
    """The partition [0, s) | [s, T) as block ids (T,); s = 0 is the single block [0, T)."""
    return splits_to_blk([s] if s > 0 else [], T)


# ---- the merge: two attentions with LSE == one softmax over [self; cross] ---------------------------------------


def dense_union_attention(q, k_s, v_s, k_c, v_c, m_self, m_cross):
    """One softmax over the concatenated keys [self; cross] with the union mask (GQA heads repeated)."""
    H = q.size(1)
    k = torch.cat([k_s, k_c], 2).repeat_interleave(H // k_s.size(1), dim=1)
    v = torch.cat([v_s, v_c], 2).repeat_interleave(H // k_s.size(1), dim=1)
    mask = torch.cat([m_self, m_cross], -1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_lse_merge_equals_one_dense_softmax_fp64():
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, D = 2, 4, 2, 13, 8
    blk = torch.stack([splits_to_blk([2, 6, 9], T), splits_to_blk([5], T)])  # (B, T), rows differ
    pos = torch.arange(T).expand(B, T)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64) * 2
    k_s, v_s, k_c, v_c = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) * 2 for _ in range(4))
    m_self, m_cross = kernels.dual_masks(pos, blk, pos, blk, blk)
    assert not m_cross[:, 0][blk == 0].any() and m_cross.any()  # block-0 rows have no cross key, others do
    want, want_lse = dense_union_attention(q, k_s, v_s, k_c, v_c, m_self, m_cross)
    o1, l1 = kernels.attention_lse_ref(q, k_s, v_s, m_self)
    o2, l2 = kernels.attention_lse_ref(q, k_c, v_c, m_cross)
    assert torch.isneginf(l2.transpose(1, 2)[blk == 0]).all()  # empty cross side: lse -inf ...
    got, lse = kernels.merge_lse(o1, l1, o2, l2)
    assert torch.isfinite(got).all() and got.dtype == torch.float64  # ... but finite merged rows
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    # the module's entry point (the reference on CPU) is the same merge
    got2, _ = kernels.dual_attention(q, pos, blk, k_s, v_s, pos, blk, k_c, v_c, blk)
    torch.testing.assert_close(got2, want, rtol=1e-12, atol=1e-12)
    # block-0 rows are exactly causal self-attention
    o_self, _ = kernels.attention_lse_ref(q, k_s, v_s, m_self)
    b0 = (blk == 0)[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[b0], o_self[b0], rtol=1e-12, atol=1e-12)


def test_model_attention_is_one_softmax_over_self_and_cross_keys(monkeypatch):
    """The whole model in fp64 with kernels.dual_attention replaced by a dense softmax over [self; cross]."""
    m = tiny_model(torch.float64)
    x = torch.randint(0, V, (2, 17))
    blk = splits_to_blk([1, 5, 11], 17)  # a one-token block 0
    with torch.no_grad():
        ref = m(x, blk=blk)[0]

        def dense(q, q_pos, q_blk, k_s, v_s, s_pos, s_blk, k_c, v_c, c_blk, scale=None):
            ms, mc = kernels.dual_masks(q_pos, q_blk, s_pos, s_blk, c_blk)
            return dense_union_attention(q, k_s, v_s, k_c, v_c, ms, mc)

        monkeypatch.setattr(kernels, "dual_attention", dense)
        want = m(x, blk=blk)[0]
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)


def test_block0_rows_finite_in_forward_and_backward():
    torch.manual_seed(0)
    m = DoubleDecoder(tiny_cfg())
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    for blk in (splits_to_blk([1], 16), splits_to_blk([1, 2, 3], 16), torch.zeros(16, dtype=torch.long)):
        m.zero_grad()
        logits, loss = m(x, y, blk=blk)
        loss.backward()
        assert torch.isfinite(logits).all() and torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


# ---- causality and every target exactly once --------------------------------------------------------------------


def test_causality_of_both_decoders():
    m = tiny_model()
    T = 18
    blk = splits_to_blk([4, 9, 13], T)
    x = torch.randint(0, V, (1, T))
    with torch.no_grad():
        h = m.context_latents(x)
        logits = m(x, blk=blk)[0]
        for j in (0, 4, 7, 12, 17):
            x2 = x.clone()
            x2[0, j] = (x2[0, j] + 1) % V
            h2, logits2 = m.context_latents(x2), m(x2, blk=blk)[0]
            torch.testing.assert_close(h2[:, :j], h[:, :j], rtol=0, atol=0)  # context decoder: causal
            assert not torch.allclose(h2[:, j], h[:, j])
            torch.testing.assert_close(logits2[:, :j], logits[:, :j], rtol=0, atol=0)  # the model: causal
            assert not torch.allclose(logits2[:, j:], logits[:, j:])


def test_context_latents_are_normed():
    """h_t is the context decoder's output after its final RMSNorm: unit RMS per position (up to the norm's eps), and
    scaled by the norm's gains."""
    m = tiny_model()
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        h = m.context_latents(x)
        m.ctx_norm.weight.mul_(3.0)
        h3 = m.context_latents(x)
    rms = h.pow(2).mean(-1).sqrt()
    assert (rms > 0.9).all() and (rms <= 1.0 + 1e-6).all()
    torch.testing.assert_close(h3, 3 * h)


def test_latent_cosine_is_the_mean_cosine_over_pairs_of_positions():
    h = torch.randn(3, 7, 5)
    h[1] = h[1, :1] * torch.rand(7, 1) + 1e-3 * h[1]  # row 1: one direction, scaled per position -> cosine ~1
    u = F.normalize(h, dim=-1)
    cos = u @ u.transpose(1, 2)  # (B, T, T)
    off = ~torch.eye(7, dtype=torch.bool)
    torch.testing.assert_close(ddm.latent_cosine(h), cos[:, off].mean())
    assert ddm.latent_cosine(h[1:2]) > 0.99


def test_xavier_init_is_the_papers():
    """init="xavier": every hidden matrix Xavier-uniform with gain sqrt 2 (bound gain sqrt(6 / (fan_in + fan_out))), the
    embedding N(0, 0.02) as with gpt2; the same module tree, so every other test's equivalence holds for it too."""
    torch.manual_seed(0)
    m = DoubleDecoder(tiny_cfg(init="xavier", n_embd=64, mlp_hidden=128))
    for name, mod in m.named_modules():  # mod.weight: the effective weight (ctx_lr's parametrization applied)
        if isinstance(mod, torch.nn.Linear) and mod is not m.lm_head:
            p = mod.weight.detach()
            fan_out, fan_in = p.shape
            bound = math.sqrt(2) * math.sqrt(6 / (fan_in + fan_out))
            assert p.abs().max() <= bound and p.abs().max() > 0.95 * bound, name
    assert abs(m.tok_emb.weight.std().item() - 0.02) < 0.002


def test_ctx_lr_scales_the_context_decoders_adam_steps():
    """ctx_lr = s: the same function at init; one step of train.py's optimizer (and its schedule's group lr) moves
    every context-decoder matrix s times as far as with ctx_lr = 1, everything else alike (Adam's step does not depend
    on the gradient's scale); the weight decay per step stays lr x wd."""
    import train

    s, lr, wd = 0.25, 1e-2, 0.1
    models = [DoubleDecoder(tiny_cfg(ctx_lr=m)) for m in (1.0, s)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randint(0, V, (2, 20)), torch.randint(0, V, (2, 20))
    blk = splits_to_blk([6, 13], 20)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    for m in models:
        opt = train.make_optimizer(m, lr, wd, torch.device("cpu"))
        train.set_lr(opt, lr)  # what train.py's schedule does each step
        for group in opt.param_groups:
            assert group["lr"] * group["weight_decay"] in (0.0, pytest.approx(lr * wd))
        for group in opt.param_groups:
            group["eps"] = 1e-30  # no floor on |g|: the step is exactly lr x sign-like, whatever the gradient's scale
        m(x, y, blk=blk)[1].backward()
        opt.step()
    after = [m.state_dict() for m in models]
    ctx = [k for k in before[0] if k.startswith("ctx_blocks") and before[0][k].dim() == 2]
    assert len(ctx) == 2 * 7  # every matrix of both context layers
    for k in before[0]:
        d0, d1 = after[0][k] - before[0][k], after[1][k] - before[1][k]
        if k in ctx:  # Adam's step s times as long; the decay term lr x wd x w the same
            adam0, adam1 = d0 + lr * wd * before[0][k], d1 + lr * wd * before[1][k]
            torch.testing.assert_close(adam1, adam0 * s, rtol=1e-4, atol=1e-7)
        else:
            torch.testing.assert_close(d1, d0, rtol=1e-4, atol=1e-7)


def test_generation_decoder_reads_earlier_blocks_only_through_latents():
    """Doubly causal: with the latents of earlier blocks fixed, the gen decoder's earlier-block states are unused."""
    m = tiny_model()
    T, s = 14, 6
    x = torch.randint(0, V, (1, T))
    blk = two_block(T, s)
    with torch.no_grad():
        ref = m(x, blk=blk)[0]
        # the generation stack's own input of the first block is never read by block 1: scramble it
        emb = m.embed

        def scrambled(idx):
            e = emb(idx)
            return torch.cat([torch.randn_like(e[:, :s]), e[:, s:]], 1) if idx.size(1) == T else e

        h = m.context_latents(x)
        m.embed = scrambled
        m.context = lambda *a, **k: h  # keep the true latents
        got = m(x, blk=blk)[0]
    torch.testing.assert_close(got[:, s:], ref[:, s:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[:, :s], ref[:, :s])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_target_counted_once_with_its_own_context(seed):
    """For a random partition, block k's logits are exactly those of the forward with [x[:b_k] | x[b_k:b_{k+1}]]:
    each position predicts its next token once, with the context of its block. The loss is the mean over all B*T."""
    m = tiny_model()
    B, T = 2, 24
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    x, y2, kw = prepare_batch(x, y, gen, m.config)
    blk = kw["blk"]
    assert torch.equal(y2, y) and x.shape == (B, T)  # static length, no target dropped
    K = check_partition(blk, B, T)
    assert 3 <= K <= 8
    with torch.no_grad():
        logits, loss = m(x, y, blk=blk)
        ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none")
        torch.testing.assert_close(loss, ce.sum() / (B * T))
        starts = [0] + [t for t in range(1, T) if blk[t] != blk[t - 1]] + [T]
        covered = torch.zeros(T, dtype=torch.long)
        for b0, b1 in zip(starts[:-1], starts[1:]):
            want = m(x[:, :b1], blk=two_block(b1, b0))[0][:, b0:b1] if b0 else m(x[:, :b1], blk=blk[:b1] * 0)[0]
            torch.testing.assert_close(logits[:, b0:b1], want, rtol=1e-5, atol=1e-5)
            covered[b0:b1] += 1
    assert torch.equal(covered, torch.ones(T, dtype=torch.long))


def test_prepare_batch_is_seeded_and_samples_uniform_partitions():
    cfg = tiny_cfg()
    T = 40
    x = torch.zeros(1, T, dtype=torch.long)
    a = prepare_batch(x, x, torch.Generator().manual_seed(5), cfg)[2]["blk"]
    b = prepare_batch(x, x, torch.Generator().manual_seed(5), cfg)[2]["blk"]
    assert torch.equal(a, b)
    counts, split_hits = torch.zeros(9, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for _ in range(600):
        blk = sample_blocks(T, gen, cfg.min_blocks, cfg.max_blocks)
        counts[check_partition(blk, 1, T)] += 1
        split_hits[1:] += (blk[1:] != blk[:-1]).long()
    assert counts[:3].sum() == 0 and (counts[3:] > 50).all()  # K uniform in 3..8
    assert split_hits[0] == 0 and (split_hits[1:] > 20).all()  # every split point in [1, T-1] drawn


def test_prefixlm_objective_loss_on_suffix_only():
    cfg = tiny_cfg(objective="prefixlm")
    m = tiny_model(objective="prefixlm")
    B, T = 2, 20
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    seen = set()
    for seed in range(6):
        x2, y2, kw = prepare_batch(x, y, torch.Generator().manual_seed(seed), cfg)
        blk = kw["blk"]
        s = int((blk == 0).sum())
        seen.add(s)
        assert 1 <= s < T and torch.equal(blk, two_block(T, s)) and torch.equal(x2, x)
        assert (y2[:, :s] == IGNORE).all() and torch.equal(y2[:, s:], y[:, s:])
        with torch.no_grad():
            logits, loss = m(x2, y2, blk=blk)
        torch.testing.assert_close(loss, F.cross_entropy(logits[:, s:].reshape(-1, V), y[:, s:].reshape(-1)))
    assert len(seen) > 1  # the split point changes per batch


# ---- generation: cached decode == training forward on [prompt | response] -----------------------------------------


def cached_logits(m, idx, n, rollover=None, cache=None):
    """Greedy generation through prefill/decode_step -> (tokens (B, T + n), logits (B, n, V))."""
    B, T = idx.shape
    if cache is None:
        cache = m.new_cache(B, T - 1 + (n if rollover else 0), min(rollover or n + 1, n + 1),
                            keep_context=rollover is not None)
    out, steps = [idx], []
    logits = m.prefill(idx, cache)
    for i in range(n):
        steps.append(logits)
        tok = logits.argmax(-1)
        out.append(tok[:, None])
        if i + 1 < n:
            logits = m.decode_step(tok, cache, rollover)
    return torch.cat(out, 1), torch.stack(steps, 1)


@pytest.mark.parametrize("P", [1, 2, 7])
def test_cached_generation_reproduces_training_forward(P):
    m = tiny_model()
    B, n = 2, 9
    idx = torch.randint(0, V, (B, P))
    seq, steps = cached_logits(m, idx, n)
    with torch.no_grad():
        full = m(seq[:, :-1], blk=two_block(P + n - 1, P - 1))[0]  # [prompt[:-1] | prompt[-1], response]
    torch.testing.assert_close(steps, full[:, P - 1:], rtol=1e-5, atol=1e-5)
    assert torch.equal(m.generate(idx, n), seq)  # generate() is the same loop (greedy = argmax)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(m.generate(idx, n, 1.0, 10, g1), m.generate(idx, n, 1.0, 10, g2))


def test_separate_cross_kv_generation_and_parameters():
    shared, sep = tiny_model(), tiny_model(separate_cross_kv=True)
    c = sep.config
    assert sep.num_params() - shared.num_params() == c.gen_layers * 2 * c.n_embd * c.n_kv_head * c.hd
    # the parameters of the decoder-only model of the same depth, plus the context decoder's final norm (d gains)
    assert shared.num_params() == GPT(baseline_config(shared.config)).num_params() + c.n_embd
    idx = torch.randint(0, V, (1, 5))
    seq, steps = cached_logits(sep, idx, 6)
    with torch.no_grad():
        full = sep(seq[:, :-1], blk=two_block(10, 4))[0]
    torch.testing.assert_close(steps, full[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N", [1, 3])
def test_rollover_equals_forward_with_folded_blocks(N):
    """--rollover N: the partition of the run is [prompt[:-1] | N tokens | N tokens | ...]."""
    m = tiny_model()
    P, n = 4, 10
    idx = torch.randint(0, V, (2, P))
    seq, steps = cached_logits(m, idx, n, rollover=N)
    T = P + n - 1
    splits = list(range(P - 1, T, N))
    with torch.no_grad():
        full = m(seq[:, :-1], blk=splits_to_blk(splits, T))[0]
    torch.testing.assert_close(steps, full[:, P - 1:], rtol=1e-5, atol=1e-5)
    assert torch.equal(m.generate(idx, n, rollover=N), seq)


def test_incremental_context_extension_equals_scratch():
    m = tiny_model()
    B, T = 2, 15
    x = torch.randint(0, V, (B, T))
    cache = m.new_cache(B, T, 1, keep_context=True)
    for a, b in ((0, 5), (5, 6), (6, 15)):
        m.extend_context(x[:, a:b], cache)
    assert cache.ctx_len == T
    with torch.no_grad():
        h = m.context_latents(x)  # the context decoder from scratch
        rope = m.rope(torch.arange(T))
        for i, block in enumerate(m.gen_blocks):
            k, v = block.attn.project_cross(h, rope)
            torch.testing.assert_close(cache.cross.k[i], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.cross.v[i], v, rtol=1e-5, atol=1e-5)
    # and the context decoder's own K/V: as one extension over all T tokens (a causal prefill)
    scratch = m.new_cache(B, T, 1, keep_context=True)
    m.extend_context(x, scratch)
    torch.testing.assert_close(cache.ctx.k, scratch.ctx.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.ctx.v, scratch.ctx.v, rtol=1e-5, atol=1e-5)


def test_shared_prefix_cache_is_reused_across_requests():
    m = tiny_model()
    prefix = torch.randint(0, V, (1, 6))
    pcache = m.new_cache(1, 12, 6, keep_context=True)
    m.extend_context(prefix, pcache)  # once, for every request
    before = pcache.cross.k.clone()
    suffixes = torch.randint(0, V, (2, 3))
    reused = m.generate(suffixes, 5, cache=pcache.clone(batch=2))  # two requests at once
    one = m.generate(suffixes[1:], 5, cache=pcache.clone())  # a third request, alone
    assert torch.equal(pcache.cross.k, before) and pcache.ctx_len == 6  # the shared cache is untouched
    scratch = m.generate(torch.cat([prefix.expand(2, -1), suffixes], 1), 5)
    assert torch.equal(reused, scratch[:, 6:])
    assert torch.equal(one, scratch[1:, 6:])
    # and the logits of every step, not only their argmax
    _, steps = cached_logits(m, suffixes, 5, cache=pcache.clone(batch=2))
    _, want = cached_logits(m, torch.cat([prefix.expand(2, -1), suffixes], 1), 5)
    torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-5)


# ---- the compiled decode steps: one graph per step kind, capturable by CUDA graphs -------------------------------


@pytest.mark.parametrize("rollover,P", [(None, 5), (4, 5), (3, 1)], ids=["one-block", "rollover", "empty-context"])
def test_compiled_decode_is_one_graph_per_step_kind(rollover, P):
    """compile_decode on a static DoubleCache compiles the two step kinds: token_step (one graph) and, with rollover,
    rollover_step (the fold of a full block into the context, then the token: one more). Over 14 new tokens (three or
    four folds; with P = 1 the context is empty until the first) no other graph, none in a second generation, which
    reuses the first one's static cache (graphs.StaticCaches), nor in a shorter one, every tensor a step writes
    marked static; the greedy tokens equal the eager ones."""
    from graph_check import check_compiled_generate

    m = tiny_model()
    idx = torch.randint(0, V, (2, P))
    short = m.generate(idx, 9, rollover=rollover)
    kinds = 1 if rollover is None else 2
    check = check_compiled_generate(m, idx, 14, graphs=kinds, rollover=rollover)
    cache = m.graph_caches[2]
    assert torch.equal(m.generate(idx, 9, rollover=rollover), short) and check.graphs == kinds
    assert m.graph_caches[2] is cache


def test_compiled_decode_runs_flexattention_inside_the_graph_on_a_gpu(monkeypatch):
    """On a GPU a cached step's dual attention is FlexAttention (kernels.dual_attention): told that the CPU tensors
    are CUDA tensors, the compiled steps hold FlexAttention and still are one graph per kind, with the eager tokens
    (head dim 16: the smallest FlexAttention tiles on a GPU)."""
    from graph_check import GraphCheck

    m = tiny_model(n_head=2, n_kv_head=1)
    idx = torch.randint(0, V, (2, 5))
    ref = m.generate(idx, 8, rollover=3)
    monkeypatch.setattr(kernels, "_all_cuda", lambda tensors: True)
    check = GraphCheck()
    graphs.compile_decode(m, backend=check)
    assert torch.equal(m.generate(idx, 8, rollover=3), ref)
    assert check.graphs == 2 and check.unsafe == [] and check.syncs == [], (check.unsafe, check.syncs)
    assert any("flex_attention" in op for op in check.ops), check.ops


# ---- the FlexAttention training path (eager on CPU, compiled on CUDA) == the dense reference --------------------


@pytest.mark.parametrize("shape", ["T", "1T", "BT"])
def test_flex_forward_equals_dense_for_shared_and_per_row_partitions(shape):
    """B > 1 with one (T,) partition shared by the batch is what train.py passes; (1, T) and (B, T) are also allowed.
    CPU FlexAttention is eager and has no backward, so the forward is compared under no_grad."""
    m = tiny_model()
    B, T = 3, 24
    x = torch.randint(0, V, (B, T))
    shared = splits_to_blk([3, 10, 17], T)
    blk = {"T": shared, "1T": shared[None],
           "BT": torch.stack([shared, splits_to_blk([5], T), splits_to_blk([1, 2, 20], T)])}[shape]
    with torch.no_grad():
        m.config.attn_impl = "dense"
        want = m(x, blk=blk)[0]
        m.config.attn_impl = "flex"
        got = m(x, blk=blk)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the dual-key kernel (single softmax, Triton interpreted on CPU) == the LSE merge -----------------------------


def test_dual_kernel_path_equals_lse_merge_path(monkeypatch):
    if kernels.triton is None:
        pytest.skip("Triton is not installed; the kernel cannot run (its reference is tested above)")
    m = tiny_model()
    x = torch.randint(0, V, (2, 12))
    blk = splits_to_blk([1, 5, 8], 12)
    idx = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        ref_fwd = m(x, blk=blk)[0]
        ref_seq, ref_steps = cached_logits(m, idx, 4, rollover=2)
        calls = []

        def kernel(*a, **k):
            calls.append(1)
            return kernels.dual_attention_triton(*a, **k)

        monkeypatch.setattr(kernels, "dual_attention", kernel)
        fwd = m(x, blk=blk)[0]
        seq, steps = cached_logits(m, idx, 4, rollover=2)
    assert len(calls) > 0
    torch.testing.assert_close(fwd, ref_fwd, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps, ref_steps, rtol=1e-5, atol=1e-5)
    assert torch.equal(seq, ref_seq)


# ---- accounting (Appendix A.1, A.2) -----------------------------------------------------------------------------


def test_kv_cache_bytes_appendix_a1():
    m = tiny_model(ctx_layers=4, gen_layers=2)
    gpt = GPT(baseline_config(m.config))
    B, T_in, T_out = 3, 20, 7
    assert m.kv_cache_bytes(B, T_in + T_out) * 3 == gpt.kv_cache_bytes(B, T_in + T_out)  # L_dec / L = 1/3
    cache = m.new_cache(B, T_in, T_out)  # what generation really allocates, fp32
    assert cache.nbytes() == m.kv_cache_bytes(B, T_in + T_out, dtype_bytes=4)
    assert cache.context_nbytes() == 0  # a one-shot prompt keeps no context-decoder K/V
    kept = m.new_cache(B, T_in, T_out, keep_context=True)
    assert kept.nbytes() + kept.context_nbytes() == m.kv_cache_bytes(B, T_in + T_out, 4, context_len=T_in)


def test_flops_per_token_appendix_a2():
    """MHA, a 4d GELU MLP and a 2:1 split: per sequence L (76 T d^2 + 12 T^2 d) (+ the head and the norms)."""
    d, L, T = 64, 6, 32
    m = tiny_model(ctx_layers=4, gen_layers=2, n_head=4, n_kv_head=4, n_embd=d, mlp_hidden=4 * d, mlp="gelu")
    gpt = GPT(baseline_config(m.config))
    norms = sum(p.numel() for n, p in m.named_parameters() if "norm" in n)
    extra = 6 * (V * d + norms)  # the head and the norm gains: not in A.2's per-layer formula
    assert m.flops_per_token(T) * T == pytest.approx(L * (76 * T * d ** 2 + 12 * T ** 2 * d) + extra * T, rel=1e-12)
    gnorms = sum(p.numel() for n, p in gpt.named_parameters() if "norm" in n)
    want = L * (72 * T * d ** 2 + 12 * T ** 2 * d) + 6 * (V * d + gnorms) * T
    assert gpt.flops_per_token(T) * T == pytest.approx(want, rel=1e-12)
    assert m.flops_per_token(T, training=False) * 3 == pytest.approx(m.flops_per_token(T))


# ---- errors -----------------------------------------------------------------------------------------------------


def test_impossible_partitions_raise_clear_errors():
    m = tiny_model()
    x = torch.randint(0, V, (2, 8))
    with pytest.raises(ValueError, match="must lie in"):
        splits_to_blk([0, 3], 8)
    with pytest.raises(ValueError, match="must lie in"):
        splits_to_blk([3, 8], 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        splits_to_blk([3, 3], 8)
    with pytest.raises(ValueError, match="starts with block 0"):
        m(x, blk=torch.ones(8, dtype=torch.long))
    with pytest.raises(ValueError, match="steps of 0 or 1"):
        m(x, blk=torch.tensor([0, 0, 2, 2, 2, 3, 3, 3]))
    with pytest.raises(ValueError, match="steps of 0 or 1"):
        m(x, blk=torch.tensor([0, 1, 1, 0, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="shape"):
        m(x, blk=torch.zeros(7, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        m(x, blk=torch.zeros(8))
    with pytest.raises(ValueError, match="cannot be split"):
        sample_blocks(2, torch.Generator(), 3, 8)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        prepare_batch(x[:, :1], x[:, :1], torch.Generator(), tiny_cfg(objective="prefixlm"))
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_bad_configs_raise_clear_errors():
    for kw, msg in ((dict(ctx_layers=0), "ctx_layers"), (dict(gen_layers=-1), "gen_layers"),
                    (dict(min_blocks=5, max_blocks=4), "min_blocks"), (dict(max_blocks=100), "max_blocks"),
                    (dict(objective="span"), "objective"), (dict(attn_impl="fast"), "attn_impl"),
                    (dict(init="kaiming"), "init"), (dict(latent_norm="batch"), "latent_norm"),
                    (dict(ctx_lr=0.0), "ctx_lr"),
                    (dict(n_layer=7), "n_layer"), (dict(n_head=3), "n_head")):
        with pytest.raises(ValueError, match=msg):
            tiny_cfg(**kw)


def test_state_dict_keys_and_parameter_order_are_the_checkpoints():
    """DoubleDecoder subclasses model.GPT and hands its constructor the two stacks: the state_dict keys and the
    parameter order (an optimizer state is saved by position) are those of the checkpoints written before, and GPT's
    single stack `blocks` holds nothing."""
    block = ["attn_norm.weight", *(f"attn.{n}_proj.weight" for n in "qkvo"), "mlp_norm.weight",
             *(f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))]
    for kw, cross, latent in ((dict(), [], ["ctx_norm.weight"]),
                              (dict(separate_cross_kv=True, latent_norm="layer"),
                               ["attn.ck_proj.weight", "attn.cv_proj.weight"], ["ctx_norm.weight", "ctx_norm.bias"])):
        m = tiny_model(**kw)
        want = ["tok_emb.weight", *(f"ctx_blocks.{i}.{k}" for i in range(2) for k in block), *latent,
                *(f"gen_blocks.0.{k}" for k in block[:5] + cross + block[5:]), "norm.weight", "lm_head.weight"]
        assert list(m.state_dict()) == want
        params = [n for n, _ in m.named_parameters()]  # the tied head is the embedding: listed once
        assert params == [k for k in want if k != "lm_head.weight"]
        assert m.blocks is None and m.lm_head.weight is m.tok_emb.weight


def test_bad_generation_inputs_raise_clear_errors():
    m = tiny_model()
    idx = torch.randint(0, V, (1, 4))
    with pytest.raises(ValueError, match="rollover"):
        m.generate(idx, 3, rollover=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.generate(idx, 61)
    with pytest.raises(ValueError, match="at least one token"):
        m.generate(idx[:, :0], 3)
    one_shot = m.new_cache(1, 8, 2)
    m.prefill(idx, one_shot)
    with pytest.raises(ValueError, match="between blocks"):
        m.extend_context(idx, one_shot)
    m.decode_step(idx[:, 0], one_shot)  # the block now holds 2 tokens: full
    with pytest.raises(ValueError, match=r"KV cache holds 2 positions; the block \(a larger max_block, or a"):
        m.decode_step(idx[:, 0], one_shot)  # no rollover: no room for a third
    one_shot.reset()
    m.extend_context(idx, one_shot)
    with pytest.raises(ValueError, match="keep_context=False"):
        m.extend_context(idx, one_shot)
    with pytest.raises(ValueError, match="keep_context=False: a rollover extends the context"):
        m.generate(idx, 6, cache=m.new_cache(1, 8, 2), rollover=2)
    kept = m.new_cache(1, 8, 2, keep_context=True)
    with pytest.raises(ValueError, match="KV cache holds 8 positions; extending the context needs 9"):
        m.extend_context(torch.randint(0, V, (1, 9)), kept)
    with pytest.raises(ValueError, match="rows"):
        m.generate(torch.randint(0, V, (2, 3)), 2, cache=kept)


# ---- train.py: both objectives run end to end --------------------------------------------------------------------


def test_train_runs_both_objectives_and_evaluates(tmp_path, capsys):
    import train
    from harness import checkpoint
    from conftest import write_jsonl

    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(40)]
    data = write_jsonl(tmp_path / "corpus.jsonl", texts)
    cks = []
    for objective in ("blocks", "prefixlm"):
        out_dir = tmp_path / objective
        out = train.train(["--arch", "double", "--objective", objective, "--ctx-layers", "2", "--gen-layers", "1",
                           "--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out_dir),
                           "--max-iters", "2", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1",
                           "--sample-tokens", "4", "--device", "cpu", "--vocab-size", "300"])
        assert out["loss"] is not None and math.isfinite(out["loss"]) and math.isfinite(out["best_val_loss"])
        ck = checkpoint.load_checkpoint(out_dir / "ckpt.pt")
        model = checkpoint.model_from_checkpoint(ck)
        assert isinstance(model, DoubleDecoder) and model.config.objective == objective
        assert model.config.ctx_lr == 0.25  # train.py's default for --arch double (the fix of the module docstring)
        assert (model.config.ctx_layers, model.config.gen_layers, model.config.n_layer) == (2, 1, 3)
        cks.append(str(out_dir / "ckpt.pt"))
    capsys.readouterr()
    import eval

    # same windows and splits for both; the second line is paired against the first
    eval.main(["double-eval", *cks, "--batches", "2", "--batch-size", "2", "--device", "cpu", "--seed", "0"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "prefix-LM suffix loss" in ln]
    assert len(lines) == 2 and all("nan" not in ln for ln in lines) and "minus the first" in lines[1]
    eval.main(["double-eval", cks[0], "--sample", "def ", "--new-tokens", "6", "--rollover", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("== double") and "def " in out


def test_preset_table_sets_each_preset_against_its_decoder_only_baseline(capsys):
    """`python bench.py presets --arch double`: one row per preset, labelled by its split and width, with the
    decoder-only model of the same parameters (baseline_config: ctx + gen layers) as the baseline in brackets."""
    import bench

    bench.main(["presets", "--arch", "double"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "double:" and [ln.split()[:4] for ln in out[1:]] == [
        [name, f"{p['ctx_layers']}+{p['gen_layers']}", "d", str(p["n_embd"])] for name, p in ddm.PRESETS.items()]
    for (label, m, base), ln in zip((r for name in ddm.PRESETS for r in ddm.preset_rows(name)), out[1:]):
        assert isinstance(base, GPT) and not isinstance(base, DoubleDecoder) and ln.startswith(label)
        assert base.config.n_layer == m.config.ctx_layers + m.config.gen_layers
        assert m.num_params() - base.num_params() == m.config.n_embd  # the same parameters but the latents' norm
        assert f"(baseline {base.num_params() / 1e6:.2f}M, " in ln
