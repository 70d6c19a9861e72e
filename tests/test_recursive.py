"""recursive.py: tying and conversion, exactness of the relaxed model at full rank, per-row loops, early exit with
state propagation, the early-exit training objective, train.py integration and the oracle mode."""

import pytest
import torch

import graphs
from conftest import write_jsonl
from eval import exit_analysis
from harness.memory import model_memory, param_bytes
from model import GPT, GPTConfig, KVCache, distill_loss, lm_loss
from recursive import (ARCH_SPECS, RecursiveCache, RecursiveConfig, RecursiveGPT, exit_coefficients, from_vanilla,
                       stepwise_layers, tying_sources)
from svd_lora import LoRALinear, lora_params, max_ranks

SMALL = dict(n_layer=6, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=48, vocab_size=96, max_seq_len=48)
LAYOUTS = {
    "llama": dict(),
    "gemma": dict(norm_offset=1.0, mlp="geglu", embed_scale=True),
    "neox": dict(norm="layer", attn_bias=True, mlp_bias=True, parallel_residual=True, rotary_pct=0.5, mlp="gelu",
                 tie_embeddings=False),
}
quiet = dict(log=lambda s: None)


def vanilla(layout="llama", seed=0, **kw):
    """A vanilla model with random non-unit positive norm scales and random biases (not the trivial init)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**SMALL, **LAYOUTS[layout], **kw})
    m = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5) if cfg.norm_offset == 0 else p.uniform_(-0.5, 0.5)  # scale in [0.5, 1.5]
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return m


def full_ranks(cfg):
    return {f"lora_rank_{c}": r for c, r in max_ranks(cfg).items()}


def ranks(r):
    return {f"lora_rank_{c}": r for c in ("q", "kv", "o", "mlp")}


def clone_cache(c: KVCache) -> KVCache:
    new = KVCache(c.k.size(0), c.k.size(1), c.max_len, c.k.size(2), c.k.size(4), c.k.dtype, c.k.device)
    new.k.copy_(c.k), new.v.copy_(c.v), new.lengths.copy_(c.lengths)
    return new


# ----------------------------------------------------------------------------------------------------------------
# Tying strategies and conversion


def test_stepwise_keeps_first_and_last_layer():
    assert stepwise_layers(6, 3) == [0, 2, 5]  # linspace 0, 2.5, 5 with Python round (half to even)
    assert stepwise_layers(6, 2) == [0, 5]
    assert stepwise_layers(18, 9) == [0, 2, 4, 6, 8, 11, 13, 15, 17]  # Gemma 2B, B=2
    assert stepwise_layers(22, 11)[0] == 0 and stepwise_layers(22, 11)[-1] == 21
    assert stepwise_layers(4, 1) == [0]
    assert tying_sources(6, 3, "lower") == [[0], [1], [2]]
    assert tying_sources(6, 2, "average") == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("init", ["stepwise", "average", "lower"])
def test_conversion_copies_the_right_layers(init):
    van = vanilla("neox")
    m = from_vanilla(van, n_loops=2, init=init, **quiet)
    src = {"stepwise": [[0], [2], [5]], "lower": [[0], [1], [2]], "average": [[0, 3], [1, 4], [2, 5]]}[init]
    for k, block in enumerate(m.blocks):
        for name, p in block.state_dict().items():  # every weight, norms (weight and bias) included
            want = torch.stack([van.blocks[i].state_dict()[name] for i in src[k]]).mean(0)
            torch.testing.assert_close(p, want, rtol=0, atol=1e-7, msg=f"{init} layer {k} {name}")
    for mod in ("tok_emb", "norm", "lm_head"):
        for name, p in getattr(m, mod).state_dict().items():
            assert torch.equal(p, getattr(van, mod).state_dict()[name])
    assert len(m.blocks) == 3 and m.config.n_layer == 6 and m.num_params() < van.num_params()


def test_random_init_uses_no_pretrained_weight():
    van = vanilla()
    m = from_vanilla(van, n_loops=2, init="random", **quiet)
    assert not torch.equal(m.tok_emb.weight, van.tok_emb.weight)
    assert not torch.equal(m.blocks[0].attn.q_proj.weight, van.blocks[0].attn.q_proj.weight)


def test_one_loop_without_lora_reproduces_vanilla_exactly():
    van = vanilla("gemma")
    m = from_vanilla(van, n_loops=1, init="lower", **quiet).eval()
    idx = torch.randint(0, 96, (2, 17))
    assert torch.equal(m(idx)[0], van(idx)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("init", ["stepwise", "average", "lower"])
def test_relaxed_full_rank_svd_reproduces_vanilla(layout, init):
    van = vanilla(layout)
    m = from_vanilla(van, n_loops=2, init=init, **full_ranks(van.config), **quiet).eval()
    assert m.config.lora_bias == (layout == "neox")  # bias deltas only for sources with biases
    idx = torch.randint(0, 96, (2, 24))
    ref = van(idx)[0]
    torch.testing.assert_close(m(idx)[0], ref, rtol=0, atol=2e-5)
    # and the plain recursive model (or a low rank) does not: the test is not vacuous
    rec = from_vanilla(van, n_loops=2, init=init, **quiet).eval()
    assert (rec(idx)[0] - ref).abs().max() > 1e-2


def test_rank_zero_and_zero_init_equal_the_recursive_model():
    van = vanilla("neox")
    rec = from_vanilla(van, n_loops=3, init="average", **quiet).eval()
    r0 = from_vanilla(van, n_loops=3, init="average", **ranks(0), **quiet).eval()
    z = from_vanilla(van, n_loops=3, init="average", lora_init="zero", **ranks(4), **quiet).eval()
    svd = from_vanilla(van, n_loops=3, init="average", **ranks(4), **quiet).eval()
    idx = torch.randint(0, 96, (2, 16))
    assert r0.state_dict().keys() == rec.state_dict().keys()
    assert torch.equal(r0(idx)[0], rec(idx)[0])
    torch.testing.assert_close(z(idx)[0], rec(idx)[0], rtol=0, atol=1e-5)
    assert (svd(idx)[0] - rec(idx)[0]).abs().max() > 1e-3


def test_conversion_errors():
    van = vanilla()
    with pytest.raises(ValueError, match="not divisible by n_loops=4"):
        from_vanilla(van, n_loops=4, **quiet)
    with pytest.raises(ValueError, match="shape mismatch: .* n_embd=32"):
        from_vanilla(van, n_loops=2, n_embd=64, **quiet)
    with pytest.raises(ValueError, match="lora_rank_kv=17 exceeds"):
        from_vanilla(van, n_loops=2, lora_rank_kv=17, **quiet)
    with pytest.raises(ValueError, match="unknown init"):
        from_vanilla(van, n_loops=2, init="upper", **quiet)
    rec = from_vanilla(van, n_loops=2, **quiet)
    with pytest.raises(ValueError, match="vanilla model.GPT"):  # a checkpoint of another architecture
        from_vanilla(rec, n_loops=2, **quiet)


def test_config_errors():
    with pytest.raises(ValueError, match="n_layer=6 is not divisible by n_loops=4"):
        RecursiveConfig(**SMALL, n_loops=4)
    with pytest.raises(ValueError, match="lora_rank_q=33 exceeds min"):
        RecursiveConfig(**SMALL, lora_rank_q=33)
    with pytest.raises(ValueError, match="lora_rank_mlp=-1"):
        RecursiveConfig(**SMALL, lora_rank_mlp=-1)
    with pytest.raises(ValueError, match="self_distill needs an exit loss"):
        RecursiveConfig(**SMALL, self_distill=True)
    with pytest.raises(ValueError, match="exit_loss"):
        RecursiveConfig(**SMALL, exit_loss="sum")
    cfg = RecursiveConfig(**SMALL, n_loops=3, **ranks(4))
    assert RecursiveConfig.from_dict(cfg.__dict__) == cfg and cfg.n_shared == 2 and cfg.relaxed


def test_parameter_counts():
    van = vanilla()
    rec = RecursiveGPT(RecursiveConfig(**SMALL, n_loops=2))
    rel = RecursiveGPT(RecursiveConfig(**SMALL, n_loops=2, **ranks(4)))
    per_layer = sum(p.numel() for p in van.blocks[0].parameters())
    assert rec.num_params() == van.num_params() - 3 * per_layer
    assert rel.num_params() == rec.num_params() + 3 * lora_params(rel.config, rel.config.lora_ranks, 2)
    assert rec.kv_cache_bytes(2, 10) == van.kv_cache_bytes(2, 10)  # one cache layer per effective layer
    assert rec.flops_per_token(16) == pytest.approx(van.flops_per_token(16))  # same compute, half the weights


# ----------------------------------------------------------------------------------------------------------------
# Inference: per-row loops, cached decoding, early exit with state propagation


def relaxed_model(layout="neox", n_loops=3, r=4, seed=0):
    van = vanilla(layout, seed=seed)
    return from_vanilla(van, n_loops=n_loops, init="average", **ranks(r), **quiet).eval()


def test_per_row_loops_equal_running_each_loop_separately():
    m = relaxed_model("neox")  # bias deltas too
    torch.manual_seed(1)
    lengths = torch.tensor([5, 3, 7, 4])
    prompts = torch.randint(0, 96, (4, 7))
    cache = m.new_cache(4, 12)
    m.prefill(prompts, cache, lengths)
    x = torch.randn(4, 1, 32)
    loops = torch.tensor([2, 0, 1, 2])
    q_pos = cache.lengths[:, None].clone()
    with torch.no_grad():
        c_mixed = clone_cache(cache)
        h_mixed = m.loop_step(x, loops, q_pos, c_mixed)
        c_sep = clone_cache(cache)
        h_sep = torch.cat([m.loop_step(x[r:r + 1], int(loops[r]), q_pos[r:r + 1], c_sep, rows=torch.tensor([r]))
                           for r in range(4)])
        torch.testing.assert_close(h_mixed, h_sep, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_mixed.k, c_sep.k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_mixed.v, c_sep.v, rtol=1e-5, atol=1e-6)
        for l in range(3):  # the whole batch at one loop (plain matmuls, a cache view) agrees row by row
            h_l = m.loop_step(x, l, q_pos, clone_cache(cache))
            torch.testing.assert_close(h_mixed[loops == l], h_l[loops == l], rtol=1e-5, atol=1e-5)
        # state propagation with per-row exit loops equals the per-row calls
        frm = torch.tensor([0, 1, 2, 0])
        c_a, c_b = clone_cache(cache), clone_cache(cache)
        m.propagate(h_mixed, frm, q_pos, c_a)
        for r in range(4):
            m.propagate(h_mixed[r:r + 1], int(frm[r]), q_pos[r:r + 1], c_b, rows=torch.tensor([r]))
        torch.testing.assert_close(c_a.k, c_b.k, rtol=1e-5, atol=1e-6)
        assert not torch.equal(c_a.k, cache.k)


@pytest.mark.parametrize("r", [0, 4])
def test_state_propagation_writes_each_skipped_layers_kv(r):
    """propagate: for every row, every loop l' it skips and every shared layer k, cache layer l' * K + k holds layer
    k's K/V of the exit state (attn_norm, k/v projections, loop l''s LoRA) at the row's position; the layers of the
    loops it ran are untouched. r = 0 is the recursive model, whose K/V are projected once for all loops."""
    m = relaxed_model("neox", r=r) if r else from_vanilla(vanilla("neox"), n_loops=3, init="average", **quiet).eval()
    assert any(isinstance(b.attn.k_proj, LoRALinear) for b in m.blocks) == (r > 0)
    K, L = m.config.n_shared, m.config.n_loops
    torch.manual_seed(2)
    cache = m.new_cache(4, 12)
    m.prefill(torch.randint(0, 96, (4, 6)), cache, torch.tensor([6, 2, 5, 3]))
    h = torch.randn(4, 1, 32)
    q_pos = cache.lengths[:, None].clone()
    for frm in (torch.tensor([0, 1, 0, 1]), 0):
        c = clone_cache(cache)
        with torch.no_grad():
            m.propagate(h, frm, q_pos, c)
            for row in range(4):
                f = int(frm[row]) if isinstance(frm, torch.Tensor) else frm
                p = int(q_pos[row])
                for lp in range(L):
                    for k, block in enumerate(m.blocks):
                        layer = lp * K + k
                        got_k, got_v = c.k[layer, row, :, p], c.v[layer, row, :, p]  # (H_kv, D)
                        if lp <= f:  # a loop the row ran: what the prefill left there
                            assert torch.equal(got_k, cache.k[layer, row, :, p])
                            continue
                        kk, vv = block.attn.project_kv(block.attn_norm(h[row:row + 1]), m.rope(q_pos[row:row + 1]),
                                                       lora_idx=lp)
                        torch.testing.assert_close(got_k, kk[0, :, 0], rtol=1e-5, atol=1e-6)
                        torch.testing.assert_close(got_v, vv[0, :, 0], rtol=1e-5, atol=1e-6)


def test_cached_generation_equals_full_forward_and_no_exit_threshold():
    m = relaxed_model("llama")
    idx = torch.randint(0, 96, (3, 6))
    out = m.generate(idx, 12)
    full = m(out)[0].argmax(-1)  # greedy: every new token is the argmax of the full forward
    assert torch.equal(full[:, 5:-1], out[:, 6:])
    out2, exits = m.generate(idx, 12, exit_threshold=1.01, return_exits=True)  # threshold > 1: never exits
    assert torch.equal(out, out2) and torch.all(exits == 2)


def test_static_cache_gives_the_same_generation_with_and_without_exits():
    """GPT.new_cache builds the RecursiveCache and honours static (decode_step reads all max_len positions): the same
    greedy tokens and exit loops as the dynamic cache."""
    m = relaxed_model("llama")
    idx = torch.randint(0, 96, (3, 6))
    cache = m.new_cache(3, 14, static=True)
    assert isinstance(cache, RecursiveCache) and cache.static
    with torch.no_grad():  # about half the prompt tokens are that confident after loop 1
        mid = float(m.exit_confidence(m.loop_logits(idx)[0]).median())
    for thr in (None, mid):
        ref = m.generate(idx, 8, exit_threshold=thr, return_exits=True)
        m.static_cache = True  # the cache generate() builds is static now
        out = m.generate(idx, 8, exit_threshold=thr, return_exits=True)
        m.static_cache = False
        assert thr is None or 0 < int((ref[1][:, 1:] < 2).sum()) < ref[1][:, 1:].numel()  # some exit early, not all
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def forward_with_exits(m, idx, exit_loops):
    """Full (uncached) recomputation applying given exit decisions: a token with exit loop e keeps its hidden state
    h^e for all deeper loops, and every deeper layer sees h^e as its input (so its K/V come from attn_norm(h^e)).
    -> logits after every loop (L, B, T, V) (the last = the logits the tokens exit with) and the K/V of every
    (loop, layer)."""
    T = idx.size(1)
    rope = m.rope(torch.arange(T))
    x, ks, vs, per_loop = m.embed(idx), [], [], []
    for l in range(m.config.n_loops):
        frozen = (exit_loops < l)[..., None]
        x0 = x
        for block in m.blocks:
            k, v = block.attn.project_kv(block.attn_norm(x), rope, lora_idx=l)
            ks.append(k), vs.append(v)
            x = torch.where(frozen, x0, block(x, rope, lora_idx=l))
        per_loop.append(m.head(x))
    return torch.stack(per_loop), torch.stack(ks), torch.stack(vs)


class PlannedExits:
    """A stand-in for RecursiveGPT.exit_confidence that makes decode_step's exits follow a plan (B, steps): at loop l
    of step s it returns 1.0 for the active rows whose planned exit loop is l, else 0.0. decode_step still makes
    every decision itself (confidence >= threshold, then propagation); the plan only fixes which rows exit, so the
    test always sees every exit loop. It also checks that decode_step asks about exactly the still-active rows."""

    def __init__(self, plan, n_loops):
        self.plan, self.L = plan, n_loops
        self.reset()

    def reset(self):
        self.s, self.l = 0, 0

    def __call__(self, logits):
        col = self.plan[:, self.s]
        active = (col >= self.l).nonzero().squeeze(1)  # rows still running at loop l (decode_step keeps row order)
        assert logits.size(0) == active.numel(), (self.s, self.l)
        conf = (col[active] == self.l).float()
        self.l += 1
        if self.l > self.L - 2 or not bool((col >= self.l).any()):  # no call at this loop: next step
            self.s, self.l = self.s + 1, 0
        return conf


def decode_with_exits(m, idx, n, thr, pick):
    """Prefill + (n - 1) decode steps with early exit -> (logits (B, n, V), tokens (B, n), exits (B, n)); exits[:, i]
    is the exit loop of the token fed at position T - 1 + i (the prompt's last token runs all loops)."""
    B, T = idx.shape
    cache = m.new_cache(B, T + n)
    logits = [m.prefill(idx, cache)]
    toks, exits = [pick(logits[0])], [torch.full((B,), m.config.n_loops - 1)]
    for _ in range(n - 1):
        lg, e = m.decode_step(toks[-1], cache, exit_threshold=thr, return_exits=True)
        logits.append(lg), toks.append(pick(lg)), exits.append(e)
    return torch.stack(logits, 1), torch.stack(toks, 1), torch.stack(exits, 1), cache


def check_against_recomputation(m, idx, logits, toks, exits, cache):
    """Cached decoding with exits == a full recomputation with the same exits (logits and every K/V entry), and the
    deeper-loop entries of exited tokens were filled by state propagation (not left at zero). -> per-loop logits."""
    B, T = idx.shape
    L, K = m.config.n_loops, m.config.n_shared
    seq = torch.cat([idx, toks[:, :-1]], 1)  # every token that was fed
    exit_loops = torch.cat([torch.full((B, T - 1), L - 1), exits], 1)
    per_loop, ref_k, ref_v = forward_with_exits(m, seq, exit_loops)
    torch.testing.assert_close(logits, per_loop[-1][:, T - 1:], rtol=1e-4, atol=1e-4)
    S = seq.size(1)
    torch.testing.assert_close(cache.k[:, :, :, :S], ref_k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :S], ref_v, rtol=1e-4, atol=1e-5)
    exited = (exit_loops < L - 1).nonzero().tolist()
    for b, p in exited:
        for lp in range(int(exit_loops[b, p]) + 1, L):
            assert cache.k[lp * K:(lp + 1) * K, b, :, p].abs().amin(-1).gt(0).all()
            assert cache.v[lp * K:(lp + 1) * K, b, :, p].abs().amin(-1).gt(0).all()
    return per_loop, exit_loops


@torch.no_grad()
def test_early_exit_decoding_equals_recomputation_with_the_same_exits():
    m = relaxed_model("llama", n_loops=3)
    torch.manual_seed(3)
    B, T, n = 4, 5, 10
    idx = torch.randint(0, 96, (B, T))
    # 1) a fixed exit plan covering every exit loop, every row and mixed loops within one step
    plan = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 0, 2],
                         [1, 0, 0, 2, 2, 1, 1, 0, 1],
                         [2, 2, 1, 1, 0, 0, 2, 0, 0],
                         [0, 1, 2, 2, 1, 0, 0, 0, 2]])  # (B, n - 1); column 7: every row exits at loop 0
    stub = PlannedExits(plan, 3)
    m.exit_confidence = stub  # instance attribute: decode_step calls self.exit_confidence
    logits, toks, exits, cache = decode_with_exits(m, idx, n, 0.5, lambda lg: lg.argmax(-1))
    assert torch.equal(exits[:, 1:], plan) and stub.s == n - 1  # the plan was followed, one step per decode
    check_against_recomputation(m, idx, logits, toks, exits, cache)
    # generate() takes the same path (same exits, same tokens)
    stub.reset()
    out, ex = m.generate(idx, n, exit_threshold=0.5, return_exits=True)
    assert torch.equal(out[:, T:], toks) and torch.equal(ex, exits)
    del m.exit_confidence
    # 2) the real rule: max softmax probability >= threshold. Sampled tokens (seeded) keep the text varied.
    m.lm_head.weight.mul_(10.0)  # a sharper head, so that confidences spread over (0, 1)
    # threshold: the median first-loop confidence on random text, so that about half of the tokens exit at loop 1
    # (with ~36 sampled tokens, all-or-none has a chance of about 2^-35; the fixed plan above covers every loop)
    thr = float(m.exit_confidence(m.loop_logits(torch.randint(0, 96, (4, 16)))[0]).median())
    g = torch.Generator().manual_seed(0)
    logits, toks, exits, cache = decode_with_exits(
        m, idx, n, thr, lambda lg: torch.multinomial(torch.softmax(lg, -1), 1, generator=g)[:, 0])
    per_loop, exit_loops = check_against_recomputation(m, idx, logits, toks, exits, cache)
    conf = m.exit_confidence(per_loop)[:, :, T:]  # (L, B, n - 1): confidence after each loop, decoded tokens
    e = exit_loops[:, T:]  # (the prompt's last token, at T - 1, never exits)
    for l in range(2):  # exit at the first loop whose confidence reaches thr (margin for float noise)
        assert torch.all(conf[l][e == l] >= thr - 1e-4)
        assert torch.all(conf[l][e > l] < thr + 1e-4)
    assert (e < 2).any() and (e == 2).any(), e  # some tokens exit early, some run all loops


# ----------------------------------------------------------------------------------------------------------------
# Early-exit training objective (section 3.7)


@pytest.mark.parametrize("kind,sd", [("weighted", False), ("aggressive", False), ("aggressive", True),
                                     ("weighted", True)])
def test_exit_losses(kind, sd):
    m = relaxed_model("llama", n_loops=3)
    m.config.exit_loss, m.config.self_distill, m.config.exit_coef = kind, sd, 0.1
    m.train()
    idx, tgt = torch.randint(0, 96, (2, 10)), torch.randint(0, 96, (2, 10))
    tgt[0, :3] = -100
    logits, loss = m(idx, tgt)
    per_loop = m.loop_logits(idx)
    torch.testing.assert_close(logits, per_loop[-1])
    coefs = [1 / 6, 2 / 6, 3 / 6] if kind == "weighted" else [0.1, 0.1, 1.0]
    assert exit_coefficients(kind, 3, 0.1) == pytest.approx(coefs)
    mask = (tgt != -100).float()
    want = sum(c * (lm_loss(lg, tgt) + (distill_loss(lg, per_loop[-1], "fkl", mask=mask) if sd and i < 2 else 0))
               for i, (c, lg) in enumerate(zip(coefs, per_loop)))
    torch.testing.assert_close(loss, want)
    assert set(m.metrics) == {"loss_l1", "loss_l2", "loss_l3"} | ({"kd_l1", "kd_l2"} if sd else set())
    torch.testing.assert_close(m.metrics["loss_l1"], lm_loss(per_loop[0], tgt))
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    # through the gradient: the final loop's logits get only their own CE term's gradient (the KD teacher is
    # detached); an intermediate loop's get its CE and, with self-distillation, its KD term's gradient
    leaves = [lg.detach().requires_grad_() for lg in per_loop]
    grads = torch.autograd.grad(m.exit_objective(leaves, tgt), leaves)
    for i, (c, leaf, g) in enumerate(zip(coefs, leaves, grads)):
        term = lm_loss(leaf, tgt)
        if sd and i < len(leaves) - 1:
            term = term + distill_loss(leaf, leaves[-1].detach(), "fkl", mask=mask)
        torch.testing.assert_close(g, torch.autograd.grad(c * term, leaf)[0], rtol=1e-6, atol=1e-10)


def test_exit_analysis_endpoints_equal_static_exits():
    """The threshold curve runs real cached decoding with exits and state propagation. Threshold 0 exits every token
    after loop 1, whose states never depend on deeper loops: its loss is the static loop-1 loss. A threshold above 1
    never exits: the final loop's loss. In between, the shares add up to 1 and the loss lies between the two here."""
    torch.manual_seed(0)
    van = GPT(GPTConfig(n_layer=4, n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=48, vocab_size=64, max_seq_len=24))
    m = from_vanilla(van, n_loops=2, init="average", lora_rank_q=4, lora_rank_kv=4, lora_rank_o=4, lora_rank_mlp=4,
                     log=lambda *a: None).eval()
    x, y = torch.randint(0, 64, (3, 20)), torch.randint(0, 64, (3, 20))
    mid_t = float(m.exit_confidence(m.loop_logits(x)[0]).median())  # about half the tokens are that confident
    res = exit_analysis(m, x, y, thresholds=(0.0, mid_t, 2.0))
    zero, mid, never = res["curve"]
    assert zero["share"] == [1.0, 0.0] and never["share"] == [0.0, 1.0] and abs(sum(mid["share"]) - 1) < 1e-9
    assert 0 < mid["share"][0] < 1  # the middle threshold really splits the tokens
    assert abs(zero["loss"] - res["loop_loss"][0]) < 1e-4 and abs(never["loss"] - res["loop_loss"][1]) < 1e-4
    assert never["agree"] == 1.0 and res["oracle"].sum() == res["tokens"] == 3 * 19


def test_no_exit_loss_and_eval_mode_are_plain_cross_entropy():
    m = relaxed_model("llama", n_loops=3)
    idx, tgt = torch.randint(0, 96, (2, 10)), torch.randint(0, 96, (2, 10))
    logits, loss = m(idx, tgt)
    torch.testing.assert_close(loss, lm_loss(logits, tgt))
    m.config.exit_loss = "aggressive"  # eval mode: the final loop's CE, comparable across exit-loss settings
    torch.testing.assert_close(m.eval()(idx, tgt)[1], loss)
    assert not torch.allclose(m.train()(idx, tgt)[1], loss)


# ----------------------------------------------------------------------------------------------------------------
# train.py integration and the command-line modes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    words = "def class return import self value index loop layer shared token cache exit".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (80,), generator=g)) for _ in range(70)]
    data = write_jsonl(d / "corpus.jsonl", docs)
    common = ["--data", str(data), "--cache-dir", str(d / "cache"), "--vocab-size", "300", "--seq-len", "32",
              "--batch-size", "4", "--eval-iters", "1", "--sample-tokens", "4", "--device", "cpu",
              "--dtype", "float32"]
    import train

    train.train(["--arch", "vanilla", "--max-iters", "3", "--out-dir", str(d / "vanilla"), *common])
    return d, common


def test_train_converts_and_uptrains_relaxed(corpus, capsys):
    import train
    from harness import checkpoint

    d, common = corpus
    van_ckpt = str(d / "vanilla" / "ckpt.pt")
    res = train.train(["--arch", "relaxed", "--init-from", van_ckpt, "--loops", "2", "--init", "average",
                       "--lora-rank", "8", "--lora-rank-kv", "4", "--max-iters", "3", "--out-dir", str(d / "relaxed"),
                       "--teacher", van_ckpt, "--kd", "fkl", "--exit-loss", "aggressive", "--self-distill",
                       "--exit-gate", *common])
    assert res["loss"] is not None
    assert " gate_acc " in capsys.readouterr().out  # the gate's training metrics in the step lines
    ck = checkpoint.load_checkpoint(d / "relaxed" / "ckpt.pt")
    assert ck["arch"] == "relaxed"
    cfg = ck["config"]
    assert (cfg["n_loops"], cfg["lora_rank_q"], cfg["lora_rank_kv"], cfg["exit_loss"], cfg["self_distill"],
            cfg["exit_gate"]) == (2, 8, 4, "aggressive", True, True)
    assert ck["model"]["exit_gate.weight"].abs().sum() > 0  # trained, saved
    model = checkpoint.model_from_checkpoint(ck)
    torch.testing.assert_close(model.exit_gate.weight, ck["model"]["exit_gate.weight"])
    assert isinstance(model, RecursiveGPT) and isinstance(model.blocks[0].attn.q_proj, LoRALinear)
    # `python eval.py exits` reads it back: per-loop losses, the oracle and the threshold curve on validation text
    import eval

    eval.main(["exits", "--ckpt", str(d / "relaxed" / "ckpt.pt"), "--device", "cpu", "--batches", "1",
                "--batch-size", "2", "--seq-len", "32", "--thresholds", "0.5,1"])
    out = capsys.readouterr().out
    assert "62 validation tokens" in out and "oracle exit" in out and "loop 2: loss" in out
    assert all(f"exit rule {r} (" in out for r in ("softmax", "gate", "saturation"))


def test_train_recursive_conversion_and_errors(corpus):
    import train
    from harness import checkpoint

    d, common = corpus
    van_ckpt = str(d / "vanilla" / "ckpt.pt")
    train.train(["--arch", "recursive", "--init-from", van_ckpt, "--init", "stepwise", "--max-iters", "1",
                 "--out-dir", str(d / "recursive"), *common])
    ck = checkpoint.load_checkpoint(d / "recursive" / "ckpt.pt")
    assert ck["arch"] == "recursive" and ck["config"]["lora_rank_q"] == 0 and ck["config"]["n_loops"] == 2
    rec_ckpt = str(d / "recursive" / "ckpt.pt")
    with pytest.raises(ValueError, match="from a recursive checkpoint"):  # another architecture's checkpoint
        train.train(["--arch", "relaxed", "--init-from", rec_ckpt, "--max-iters", "1", *common,
                     "--out-dir", str(d / "x")])
    with pytest.raises(ValueError, match="not divisible by n_loops=3"):  # 4 vanilla layers, 3 loops
        train.train(["--arch", "recursive", "--init-from", van_ckpt, "--loops", "3", "--max-iters", "1", *common,
                     "--out-dir", str(d / "x")])
    with pytest.raises(ValueError, match="needs --init-from"):
        train.train(["--arch", "recursive", "--init", "average", "--max-iters", "1", *common,
                     "--out-dir", str(d / "x")])
    with pytest.raises(ValueError, match="flags of --arch relaxed"):
        train.train(["--arch", "recursive", "--lora-rank", "4", "--max-iters", "1", *common,
                     "--out-dir", str(d / "x")])


def test_arch_specs_and_preset_rows(capsys):
    import bench

    assert [s.name for s in ARCH_SPECS] == ["recursive", "relaxed"]
    rel = ARCH_SPECS[1].make_config("tiny")
    assert rel.relaxed and rel.n_loops == 2 and ARCH_SPECS[0].make_config("tiny").relaxed is False
    bench.main(["presets", "--arch", "recursive,relaxed", "--preset", "tiny", "--loops", "2", "--ranks", "8,64"])
    out = capsys.readouterr().out
    assert "vanilla" in out and "recursive B=2" in out and "relaxed B=2 r=64" in out
    # the relaxed row holds the recursive model plus K = 2 shared blocks' LoRA of rank 64 for B = 2 loops
    rows = {line.split("non-emb")[0].split(None, 1)[1].strip(): line for line in out.splitlines() if "non-emb" in line}
    with torch.device("meta"):
        rec = RecursiveGPT(RecursiveConfig.from_preset("tiny", n_loops=2)).num_params()
    lora = 2 * lora_params(GPTConfig.from_preset("tiny"), dict.fromkeys(["q", "kv", "o", "mlp"], 64), n_loops=2)
    assert f"{rec / 1e6:8.2f}M" in rows["recursive B=2"] and f"{(rec + lora) / 1e6:8.2f}M" in rows["relaxed B=2 r=64"]


# ---- the learned exit gate and the O(d) exit rules --------------------------------------------------------------


def gated_model(seed=0):
    van = vanilla(seed=seed, n_layer=4)
    return from_vanilla(van, n_loops=2, init="average", lora_init="svd", log=lambda *_: None, exit_gate=True,
                        **ranks(4))


def test_exit_gate_learns_alone_and_leaves_the_lm_gradients_unchanged():
    m = gated_model().train()
    idx = torch.randint(0, m.config.vocab_size, (2, 12))
    tgt = torch.randint(0, m.config.vocab_size, (2, 12))
    tgt[:, :3] = -100
    logits, loss = m(idx, tgt)
    loss.backward()
    gate_grad = m.exit_gate.weight.grad.clone()
    trunk = {n: p.grad.clone() for n, p in m.named_parameters() if not n.startswith("exit_gate")}
    assert gate_grad.abs().sum() > 0 and set(m.metrics) >= {"gate_loss", "gate_acc"}
    m.zero_grad()
    m.exit_gate = None  # the same model without its gate: the LM's gradients must be exactly the same
    _, plain = m(idx, tgt)
    plain.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, trunk[n], rtol=0, atol=0, msg=n)


def test_exit_gate_target_is_the_oracle():
    m = gated_model().train()
    idx = torch.randint(0, m.config.vocab_size, (3, 10))
    hs = m.loop_hidden(idx)
    lg = [m.head(h) for h in hs]
    target = (lg[0].argmax(-1) == lg[1].argmax(-1)).float()
    with torch.no_grad():
        m.exit_gate.weight.zero_()
        m.exit_gate.bias.fill_(3.0)  # predicts "exit" everywhere: the loss is the BCE of logit 3 against the oracle
    loss = m.gate_objective(hs, [None, lg[1]], torch.zeros_like(idx))
    want = torch.nn.functional.binary_cross_entropy_with_logits(torch.full_like(target, 3.0), target)
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("rule", ["gate", "saturation", "softmax"])
def test_exit_rules_decode_equals_recomputation_and_heads_only_leaving_rows(rule):
    m = gated_model(seed=1).eval()
    with torch.no_grad():
        m.exit_gate.weight.normal_(0, 1.0)
    idx = torch.randint(0, m.config.vocab_size, (4, 5))
    x0 = m.embed(idx)
    h0 = m.loop_hidden(idx)[0]
    scores, _ = m.exit_score(x0.flatten(0, 1)[:, None], h0.flatten(0, 1)[:, None],
                             torch.zeros(idx.numel(), dtype=torch.long), rule)
    thr = float(scores.detach().flatten().median())  # about half the tokens exit at loop 1
    head_rows, real_head = [], m.exit_logits
    m.exit_logits = lambda h: (head_rows.append(h.size(0)), real_head(h))[1]
    try:
        out, exits = m.generate(idx, 10, exit_threshold=thr, exit_rule=rule, return_exits=True)
    finally:
        del m.exit_logits
    assert 0 < int((exits[:, 1:] == 0).sum()) < exits[:, 1:].numel()  # some exit early, some do not
    decode_heads = head_rows  # the prefill's head is not an exit head
    if rule == "softmax":  # its score is the head: every row at loop 0, the remaining ones at loop 1
        assert sum(decode_heads) == 9 * 4 + int((exits[:, 1:] == 1).sum())
    else:  # the head runs once per emitted token, on the leaving rows only
        assert sum(decode_heads) == 9 * 4
    # each token equals a full recomputation of its loops from the cache it saw (the existing exit check)
    cache = m.new_cache(4, 15)
    m.prefill(idx, cache)
    for t in range(9):
        lg, e = m.decode_step(out[:, 5 + t], cache, thr, return_exits=True, exit_rule=rule)
        assert torch.equal(e, exits[:, t + 1])
        assert torch.equal(lg.argmax(-1), out[:, 6 + t])


# ---- the graph-safe steps: masked decoding, compiled --------------------------------------------------------------


def three_loop_gated(seed=0):
    """B = 3 loops of 2 shared layers, LoRA rank 4, a random exit gate: exits can happen at every loop."""
    m = from_vanilla(vanilla(seed=seed), n_loops=3, init="average", lora_init="svd", exit_gate=True, **ranks(4),
                     **quiet).eval()
    with torch.no_grad():
        m.exit_gate.weight.normal_(0, 1.0)
        m.lm_head.weight.mul_(10.0)  # a sharper head: confidences spread over (0, 1)
    return m


@torch.no_grad()
def middle_threshold(m, idx, rule, share=0.5):
    """Halfway between two neighbouring loop-0 exit scores of the tokens of idx, so that about `share` of them leave
    at loop 1 and no score sits on the threshold (float noise cannot flip a decision between two forms of a step)."""
    x, h = m.embed(idx).flatten(0, 1)[:, None], m.loop_hidden(idx)[0].flatten(0, 1)[:, None]
    s = m.exit_score(x, h, torch.zeros(idx.numel(), dtype=torch.long), rule)[0].sort().values
    i = int(len(s) * (1 - share))
    return float(s[i - 1] + s[i]) / 2


@torch.no_grad()
@pytest.mark.parametrize("rule,share,loops", [("softmax", 0.5, [0, 2]), ("gate", 0.5, [0, 1, 2]),
                                              ("saturation", 0.4, [0, 1, 2])])
def test_masked_decode_step_equals_the_subset_form(rule, share, loops):
    """masked_decode_step, decode_step's graph-safe form (every row runs every loop; a row that left runs along and
    its deeper K/V are replaced by its state propagation at the end), equals the subset form step by step: the same
    exit loops, logits and cache, with tokens leaving at every loop (under softmax, random weights are never
    confident at loop 2 after failing at loop 1: the first and the last)."""
    m = three_loop_gated()
    gen = torch.Generator().manual_seed(4)
    idx, toks = torch.randint(0, 96, (6, 5), generator=gen), torch.randint(0, 96, (6, 10), generator=gen)
    thr = middle_threshold(m, torch.cat([idx, toks], 1), rule, share)
    subset, masked = m.new_cache(6, 16), m.new_cache(6, 16)
    m.prefill(idx, subset), m.prefill(idx, masked)
    seen = []
    for t in range(toks.size(1)):  # teacher-forced: both forms see the same tokens
        a, ea = m.decode_step(toks[:, t], subset, thr, return_exits=True, exit_rule=rule)
        b, eb = m.masked_decode_step(toks[:, t], masked, thr, return_exits=True, exit_rule=rule)
        assert torch.equal(ea, eb), t
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        seen += ea.tolist()
    torch.testing.assert_close(masked.k, subset.k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masked.v, subset.v, rtol=1e-5, atol=1e-6)
    assert sorted(set(seen)) == loops, seen
    assert torch.equal(torch.stack(masked.exit_log), torch.stack(subset.exit_log))


def test_compiled_decode_is_one_graph_per_exit_setting_with_the_eager_tokens():
    """compile_decode (backend GraphCheck: fullgraph, every in-place write marked static): greedy generation without
    exits and with exits under two rules gives the subset form's tokens and exit loops; one graph per (threshold,
    rule) on the batch bucket (5 rows -> 8), and a second round of generations compiles nothing more."""
    import copy

    from graph_check import GraphCheck

    m = three_loop_gated()
    idx = torch.randint(0, 96, (5, 5), generator=torch.Generator().manual_seed(6))
    settings = [(None, None)] + [(middle_threshold(m, idx, rule), rule) for rule in ("softmax", "gate")]
    refs = [m.generate(idx, 10, exit_threshold=t, exit_rule=r, return_exits=True) for t, r in settings]
    assert all(len(set(ex[:, 1:].flatten().tolist())) > 1 for _, ex in refs[1:])  # exits happen
    check = GraphCheck()
    c = graphs.compile_decode(copy.deepcopy(m), backend=check)
    for i, ((t, r), ref) in enumerate(zip(settings * 2, refs * 2)):
        out, ex = c.generate(idx, 10, exit_threshold=t, exit_rule=r, return_exits=True)
        assert torch.equal(out, ref[0]) and torch.equal(ex, ref[1]), (t, r)
        assert check.graphs == min(i + 1, len(settings))
    assert check.unsafe == check.syncs == [] and list(c.graph_caches) == [8]


@torch.no_grad()
def test_depthwise_step_equals_exit_pass_on_the_live_rows():
    """depthwise_step, the graph-safe serving step over every row: on the live rows (each at its own loop) the
    states, leave decisions and logits of exit_pass's subset form, and the same cache where they write; rows that are
    not live leave nothing but their own row's entries at their own loop and position."""
    m = three_loop_gated()
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 96, (6, 6), generator=gen)
    base = m.new_cache(6, 12)
    m.prefill(prompts, base, torch.tensor([6, 4, 5, 3, 6, 2]))
    h = torch.randn(6, 1, 32, generator=gen)
    loops, pos = torch.tensor([0, 1, 2, 0, 1, 2]), base.lengths.clone()
    live = torch.tensor([True, True, True, True, False, True])
    thr = middle_threshold(m, prompts, "gate")
    a, b = clone_cache(base), clone_cache(base)
    out, leave, logits = m.depthwise_step(h, loops, pos, live, a, thr, "gate")
    rows = live.nonzero().squeeze(1)
    h2, leave2, lg2 = m.exit_pass(h[rows], loops[rows], pos[rows, None], b, rows=rows, threshold=thr, rule="gate")
    torch.testing.assert_close(out[rows], h2, rtol=1e-5, atol=1e-5)
    assert torch.equal(leave[rows], leave2) and not leave[~live].any() and leave2.any() and not leave2.all()
    torch.testing.assert_close(logits[rows][leave2], lg2, rtol=1e-5, atol=1e-5)
    K = m.config.n_shared
    for r in range(6):  # the row that is not live wrote its own loop's layers at its own position: nothing else
        differ = ((a.k[:, r] - b.k[:, r]).abs() > 1e-5).any(-1).nonzero().tolist()  # (layer, head, position)
        assert r == 4 and all(l // K == int(loops[r]) and p == int(pos[r]) for l, _, p in differ) or not differ, r


def test_exit_gate_added_in_post_training_from_a_gateless_checkpoint(corpus, tmp_path):
    import train
    from harness import checkpoint

    d, common = corpus
    plain = tmp_path / "plain"
    train.train(["--arch", "recursive", "--init-from", str(d / "vanilla" / "ckpt.pt"), "--max-iters", "1",
                 "--out-dir", str(plain), *common])
    src = checkpoint.load_checkpoint(plain / "ckpt.pt")
    assert not src["config"]["exit_gate"] and not any(k.startswith("exit_gate") for k in src["model"])
    train.train(["--arch", "recursive", "--init-from", str(plain / "ckpt.pt"), "--exit-gate", "--exit-loss",
                 "aggressive", "--max-iters", "2", "--lr", "0", "--out-dir", str(tmp_path / "gate"), *common])
    ck = checkpoint.load_checkpoint(tmp_path / "gate" / "ckpt.pt")
    assert ck["config"]["exit_gate"] and ck["model"]["exit_gate.weight"].shape == (2 - 1, ck["config"]["n_embd"])
    for k, v in src["model"].items():  # lr 0: every loaded weight unchanged, the gate added beside them
        torch.testing.assert_close(ck["model"][k], v, rtol=0, atol=0, msg=k)


# ----------------------------------------------------------------------------------------------------------------
# Middle-Cycle sharing (Mixture-of-Recursions): the first and the last layer unique, the middle looped


def middle(layout="llama", n_loops=2, init="stepwise", **kw):
    return from_vanilla(vanilla(layout), n_loops=n_loops, init=init, sharing="middle_cycle", **kw, **quiet).eval()


@pytest.mark.parametrize("init", ["stepwise", "average", "lower"])
def test_middle_cycle_conversion_keeps_the_first_and_last_layer_and_ties_the_middle(init):
    van = vanilla("neox")
    m = middle("neox", init=init)
    assert (m.config.n_shared, len(m.unique_first), len(m.unique_last)) == (2, 1, 1)
    for mine, src in ((m.unique_first[0], van.blocks[0]), (m.unique_last[0], van.blocks[5])):
        for name, p in mine.state_dict().items():  # copied exactly, norms and biases included
            assert torch.equal(p, src.state_dict()[name]), name
    # the middle layers 1..4, K = 2: Stepwise round(linspace(1, 4, 2)), Average (1, 3) and (2, 4), Lower 1, 2
    src = {"stepwise": [[1], [4]], "average": [[1, 3], [2, 4]], "lower": [[1], [2]]}[init]
    assert tying_sources(6, 2, init, "middle_cycle") == src
    for k, block in enumerate(m.blocks):
        for name, p in block.state_dict().items():
            want = torch.stack([van.blocks[i].state_dict()[name] for i in src[k]]).mean(0)
            torch.testing.assert_close(p, want, rtol=0, atol=1e-7, msg=f"{init} layer {k} {name}")


def test_middle_cycle_one_loop_and_full_rank_relaxed_reproduce_vanilla():
    """The layer order and the per-loop sources are right: one loop of the N - 2 middle layers is the vanilla model
    exactly, and so is B = 2 with full-rank SVD LoRA (loop l of shared layer k stands for vanilla layer 1 + l*K + k);
    the plain B = 2 model is not (the test is not vacuous)."""
    van = vanilla("neox")
    idx = torch.randint(0, 96, (2, 20))
    ref = van(idx)[0]
    assert torch.equal(middle("neox", n_loops=1, init="lower")(idx)[0], ref)
    full = middle("neox", init="average", **full_ranks(van.config))
    torch.testing.assert_close(full(idx)[0], ref, rtol=0, atol=2e-5)
    assert (middle("neox")(idx)[0] - ref).abs().max() > 1e-2


@pytest.mark.parametrize("ranks_", [0, 4])
def test_middle_cycle_cached_decoding_equals_the_full_forward(ranks_):
    """prefill + decode_step through the KV cache (a cache layer for each unique layer too, N in all) give the full
    forward's logits at every position, with a dynamic and with a static cache."""
    m = middle("llama", **ranks(ranks_))
    idx = torch.randint(0, 96, (3, 14))
    full = m(idx)[0]
    for static in (False, True):
        cache = m.new_cache(3, 14, static=static)
        assert cache.k.size(0) == 6  # 1 + B*K + 1 cache layers
        steps = [m.prefill(idx[:, :5], cache)]
        steps += [m.decode_step(idx[:, t], cache) for t in range(5, 14)]
        torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], rtol=0, atol=1e-5)
        assert cache.k[0].abs().sum() > 0 and cache.k[5].abs().sum() > 0  # the unique layers' K/V are written
    out, exits = m.generate(idx[:, :5], 8, return_exits=True)
    assert torch.equal(m(out)[0][:, 4:-1].argmax(-1), out[:, 5:]) and torch.all(exits == 1)


@torch.no_grad()
def test_middle_cycle_chunked_prefill_equals_the_prefill():
    """prefill_chunk (a server's chunked prefill into some cache rows) runs the whole depth order, the unique first
    and last layers included: two chunks into rows 3 and 1 of a 4-row cache write what prefill writes (every cache
    layer) and end on its last hidden state."""
    m = middle("llama", **ranks(4))
    idx = torch.randint(0, 96, (2, 9))
    ref_cache, cache = m.new_cache(2, 12), m.new_cache(4, 12)
    ref = m.prefill(idx, ref_cache)
    rows, pos = torch.tensor([3, 1]), torch.arange(9).expand(2, 9)
    m.prefill_chunk(idx[:, :5], pos[:, :5], cache, rows, first=True)
    h = m.prefill_chunk(idx[:, 5:], pos[:, 5:], cache, rows)
    torch.testing.assert_close(m.head(h[:, -1:])[:, 0], ref, rtol=0, atol=1e-5)
    for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):  # all N = 6 cache layers, the unique ones too
        torch.testing.assert_close(a[:, rows, :, :9], b[:, :, :, :9], rtol=0, atol=1e-5)


def test_middle_cycle_compiled_decode_is_one_graph_per_bucket_with_the_eager_tokens():
    """compile_decode of Middle-Cycle sharing (backend GraphCheck): greedy generation gives the eager tokens and exit
    loops, one graph per batch bucket (3 rows -> 4, 6 rows -> 8) whatever the number of tokens (the exit log is
    appended outside the graph), and a second round compiles nothing more."""
    import copy

    from graph_check import GraphCheck

    m = middle()
    gen = torch.Generator().manual_seed(6)
    idxs = [torch.randint(0, 96, (b, 5), generator=gen) for b in (3, 6)]
    refs = [m.generate(idx, 6, return_exits=True) for idx in idxs]
    check = GraphCheck()
    c = graphs.compile_decode(copy.deepcopy(m), backend=check)
    for i, (idx, ref) in enumerate(zip(idxs * 2, refs * 2)):
        out, ex = c.generate(idx, 6, return_exits=True)
        assert torch.equal(out, ref[0]) and torch.equal(ex, ref[1]) and torch.all(ex == 1)
        assert check.graphs == min(i + 1, len(idxs))
    assert check.unsafe == check.syncs == [] and sorted(c.graph_caches) == [4, 8]


def test_middle_cycle_parameters_flops_and_preset_rows(capsys):
    van = vanilla()
    m = middle()
    per_layer = sum(p.numel() for p in van.blocks[0].parameters())
    assert m.num_params() == van.num_params() - 2 * per_layer  # 6 layers -> 1 + 2 shared + 1
    assert m.num_params() == from_vanilla(van, n_loops=2, **quiet).num_params() + per_layer
    assert m.flops_per_token(16) == pytest.approx(van.flops_per_token(16))  # the same effective depth
    assert m.kv_cache_bytes(2, 10) == van.kv_cache_bytes(2, 10)
    for mm in (m, middle(**ranks(4))):  # the estimate from the config alone: the unique layers counted, LoRA per loop
        assert model_memory(mm.config)["weights"] == param_bytes(mm)
    import bench

    bench.main(["presets", "--arch", "recursive", "--preset", "tiny6"])
    assert "middle-cycle B=2" in capsys.readouterr().out  # 6 layers: 1 + 2 x 2 + 1


def test_middle_cycle_refuses_what_assumes_cycle():
    with pytest.raises(ValueError, match="sharing='middle_cycle': the n_layer - 2 = 4 middle layers are not divisible"):
        RecursiveConfig(**SMALL, n_loops=3, sharing="middle_cycle")
    with pytest.raises(ValueError, match="sharing='bogus' is not one of"):
        RecursiveConfig(**SMALL, sharing="bogus")
    for field in (dict(exit_loss="aggressive"), dict(exit_gate=True), dict(exit_threshold=0.5)):
        with pytest.raises(ValueError, match="needs sharing='cycle'"):
            RecursiveConfig(**SMALL, sharing="middle_cycle", **field)
    m = middle()
    idx = torch.randint(0, 96, (2, 8))
    with pytest.raises(ValueError, match="assumes sharing='cycle'"):
        exit_analysis(m, idx, idx, [0.5])
    with pytest.raises(ValueError, match="assumes sharing='cycle'"):
        m.generate(idx, 2, exit_threshold=0.5)
    cache = m.new_cache(2, 8)
    m.prefill(idx[:, :1], cache)
    with pytest.raises(ValueError, match="assumes sharing='cycle'"):  # depth-wise serving's primitive
        m.exit_pass(m.embed(idx[:, 1:2]), 0, cache.lengths[:, None], cache)


def test_train_middle_cycle_conversion_and_refusal(corpus, capsys):
    import eval as ev
    import train
    from harness import checkpoint

    d, common = corpus
    van_ckpt = str(d / "vanilla" / "ckpt.pt")
    train.train(["--arch", "recursive", "--init-from", van_ckpt, "--sharing", "middle_cycle", "--max-iters", "1",
                 "--out-dir", str(d / "middle"), *common])
    ck = checkpoint.load_checkpoint(d / "middle" / "ckpt.pt")
    assert ck["config"]["sharing"] == "middle_cycle" and "unique_last.0.mlp_norm.weight" in ck["model"]
    with pytest.raises(ValueError, match="exit_loss='aggressive' needs sharing='cycle'"):
        train.train(["--arch", "recursive", "--init-from", van_ckpt, "--sharing", "middle_cycle", "--exit-loss",
                     "aggressive", "--max-iters", "1", "--out-dir", str(d / "x"), *common])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # eval.py exits: one line, no per-loop analysis of a Middle-Cycle model
        ev.main(["exits", "--ckpt", str(d / "middle" / "ckpt.pt"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "shares its layers middle_cycle" in err[0], err
