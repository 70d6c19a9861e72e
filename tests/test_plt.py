"""Tests of plt.py (Parallel Loop Transformer): staggered cached decoding equals the training forward, L=1 is the
vanilla model, the shift breaks same-position dependence, the window and the caches hold what is documented."""
import json

import pytest
import torch

import graphs
from model import GPT, GPTConfig
from plt import (LOOP_INPUT_NORMS, PLT, PLTAttention, PLTConfig, VARIANTS, config_overrides, shift_right,
                 variant_fields)

# LoopCoder-V2's forms (plt.py's docstring), one at a time and all together
FORMS = {"scales": dict(loop_emb_scale=0.7, loop_hidden_scale=0.05),
         "learned_scales": dict(learn_loop_scales=True, loop_emb_scale=0.7, loop_hidden_scale=0.3),
         "final_norm": dict(loop_final_norm=True),
         "residual_gate": dict(gate_input="residual"),
         "w+1": dict(window_keys="w+1"),
         "loopcoder": dict(loop_input_norm="none", loop_emb_scale=0.7, loop_hidden_scale=0.05, loop_final_norm=True,
                           gate_input="residual", window_keys="w+1")}

SHAPE = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, vocab_size=61, max_seq_len=32)
W = 4  # a small window, so that prompts of 2 and 7 tokens are shorter and longer than it and decoding wraps the ring
T = 11
# (clp, kv_share, gswa): the rows of Table 2 beyond vanilla, plus LoopCoder's sequential kv_share (+ gswa), and the
# sequential loop that re-injects the embedding (loop_embed, an ablation)
SWITCHES = {"loop": (False, False, False), "clp": (True, False, False), "kv_share": (True, True, False),
            "plt": (True, True, True), "seq_share": (False, True, False), "seq_gswa": (False, True, True),
            "loop_embed": (False, False, False)}


def randomize(model, std=0.25):
    """Weights far from the init (sharp attention, gates away from 0.5), so a wrong mask or order shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model.eval()


def make(n_loops=2, variant="plt", window=W, **kw):
    clp, kv_share, gswa = SWITCHES[variant]
    kw = {"loop_embed": variant == "loop_embed", **kw}
    cfg = PLTConfig(**{**SHAPE, **kw}, n_loops=n_loops, window=window, clp=clp, kv_share=kv_share, gswa=gswa)
    return randomize(PLT(cfg))


def decode_errors(model, idx, prompt_len, lengths=None, static=False):
    """Teacher-forced: prefill idx[:, :prompt_len] then feed the true next tokens; max |logits - forward logits|."""
    full, _ = model(idx)
    B, n = idx.shape
    cache = model.new_cache(B, n, static=static)
    rows = torch.arange(B)
    lengths = torch.full((B,), prompt_len) if lengths is None else lengths
    logits = model.prefill(idx[:, :prompt_len], cache, lengths)
    errs = [(logits - full[rows, lengths - 1]).abs().max()]
    for s in range(n - int(lengths.max())):
        pos = lengths + s
        logits = model.decode_step(idx[rows, pos], cache)
        errs.append((logits - full[rows, pos]).abs().max())
    return torch.stack(errs), cache


# -- cached staggered decoding == training forward ---------------------------------------------------------------


@pytest.mark.parametrize("variant", list(SWITCHES))
@pytest.mark.parametrize("n_loops", [2, 3])
@pytest.mark.parametrize("prompt_len", [2, 7])
@pytest.mark.parametrize("norm", LOOP_INPUT_NORMS)
def test_decode_matches_forward(variant, n_loops, prompt_len, norm):
    model = make(n_loops, variant, loop_input_norm=norm)
    idx = torch.randint(SHAPE["vocab_size"], (2, T))
    errs, cache = decode_errors(model, idx, prompt_len)
    assert errs.max() < 2e-5, errs
    assert int(cache.lengths[0]) == T
    assert full_logit_scale(model, idx) > 1.0  # the logits are far from 0: the tolerance above is tight


def full_logit_scale(model, idx):
    return model(idx)[0].std().item()


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("variant,n_loops", [("plt", 2), ("plt", 3), ("clp", 3), ("loop", 3), ("seq_gswa", 2),
                                             ("loop_embed", 3)])
@pytest.mark.parametrize("prompt_len", [2, 7])
def test_decode_matches_forward_in_each_production_form(form, variant, n_loops, prompt_len):
    """Every LoopCoder form decodes exactly like its training forward (CLP and sequential, prompts shorter and
    longer than the window, the ring wrapping). In fp64, where exact means ~1e-15 (the norms' fp32 inside can round
    a value the other way: 1e-6 allows that and nothing else)."""
    model = make(n_loops, variant, **FORMS[form]).double()
    idx = torch.randint(SHAPE["vocab_size"], (2, T))
    errs, cache = decode_errors(model, idx, prompt_len)
    assert errs.max() < 1e-6, errs
    assert full_logit_scale(model, idx) > 1.0
    if model.config.uses_gswa:
        assert cache.ring.window == W + (FORMS[form].get("window_keys") == "w+1")


def loop_io(model, idx):
    """The input of each loop (block 0's input) and its output H^(l) (the last block's output) in model(idx)."""
    ins, outs, L = [], [], model.config.n_loops
    h1 = model.blocks[0].register_forward_pre_hook(lambda m, a: ins.append(a[0]))
    h2 = model.blocks[-1].register_forward_hook(lambda m, a, o: outs.append(o))
    logits = model(idx)[0]
    h1.remove()
    h2.remove()
    assert len(ins) == len(outs) == L
    return ins, outs, logits


def rms_by_hand(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("variant", ["plt", "loop_embed"])
@pytest.mark.parametrize("form", ["paper", "scales", "learned_scales", "final_norm", "loopcoder"])
def test_loop_input_formula(form, variant):
    """The input of loop l >= 2 in the training forward, written out here: a * E + b * [0, S(H^(l-1))_0..T-2] with
    a = b = 1 (the paper), the configured or learned a, b, and S the final RMSNorm (loop_final_norm) or identity;
    with loop_embed (the sequential loop) a * E + b * S(H^(l-1)), not shifted."""
    fields = {**FORMS.get(form, {}), "loop_input_norm": "none"}
    model = make(3, variant, **fields)
    if model.loop_scales is not None:
        with torch.no_grad():
            model.loop_scales.copy_(torch.tensor([0.3, 1.7]))  # learned values, away from the initial ones
    a, b = (0.3, 1.7) if fields.get("learn_loop_scales") else (fields.get("loop_emb_scale", 1.0),
                                                               fields.get("loop_hidden_scale", 1.0))
    idx = torch.randint(SHAPE["vocab_size"], (2, 9))
    ins, outs, _ = loop_io(model, idx)
    e = ins[0]  # loop 1 reads E alone
    for l in (1, 2):
        h = outs[l - 1]
        if fields.get("loop_final_norm"):
            h = rms_by_hand(h, model.norm.weight, model.config.norm_eps)
        prev = h if variant == "loop_embed" else torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        torch.testing.assert_close(ins[l], a * e + b * prev, rtol=0, atol=1e-5)
    if model.loop_scales is not None:  # learned: both get a gradient
        model(idx)[0].square().mean().backward()
        assert model.loop_scales.grad.abs().min() > 0


def test_final_norm_is_the_heads_norm():
    """loop_final_norm uses the head's own final norm (shared weights), no new parameter; the last loop's H goes
    through it once, in the head."""
    base = make(2, "plt", loop_final_norm=False, loop_input_norm="none")
    normed = make(2, "plt", loop_final_norm=True, loop_input_norm="none")
    assert base.num_params() == normed.num_params()
    normed.load_state_dict(base.state_dict())
    with torch.no_grad():
        normed.norm.weight.mul_(2.0)  # the shared norm's scale reaches loop 2's input ...
    idx = torch.randint(SHAPE["vocab_size"], (1, 6))
    ins1, _, _ = loop_io(normed, idx)
    with torch.no_grad():
        normed.norm.weight.mul_(0.5)
    ins2, _, _ = loop_io(normed, idx)
    e = ins1[0]
    torch.testing.assert_close(ins1[1] - e, 2 * (ins2[1] - e), rtol=0, atol=1e-5)  # ... linearly


def attention_by_hand(attn, xn, residual, rope, shared, keys):
    """PLTAttention's G-SWA output written out: per head h and query i, softmax over own keys j in the window
    (i - j < keys) and over shared keys j <= i, the gate g = sigmoid(<RMSNorm(x_i), w_h> + b_h) from the residual x,
    g * local + (1 - g) * global, then o_proj. The projections are the attention's own (project_q / project_kv)."""
    q, (k, v) = attn.project_q(xn, rope, None), attn.project_kv(xn, rope, None)  # (B, H, T, D), (B, H_kv, T, D)
    ks, vs = shared
    B, H, n, D = q.shape
    G = H // k.size(1)
    gate = torch.sigmoid(rms_by_hand(residual, attn.gate_norm.weight, attn.gate_norm.eps) @ attn.gate_w.T
                         + attn.gate_b)  # (B, T, H)
    y = torch.zeros_like(q)
    for bb in range(B):
        for h in range(H):
            for i in range(n):
                lo = max(0, i - keys + 1)
                pl = torch.softmax(k[bb, h // G, lo:i + 1] @ q[bb, h, i] / D ** 0.5, 0)
                pg = torch.softmax(ks[bb, h // G, :i + 1] @ q[bb, h, i] / D ** 0.5, 0)
                g = gate[bb, i, h]
                y[bb, h, i] = g * (pl @ v[bb, h // G, lo:i + 1]) + (1 - g) * (pg @ vs[bb, h // G, :i + 1])
    return attn.o_proj(y.transpose(1, 2).reshape(B, n, H * D)), gate


@pytest.mark.parametrize("window_keys", ["w", "w+1"])
def test_residual_gate_formula(window_keys):
    """gate_input="residual": the G-SWA output against attention_by_hand (the gate from the block's input before
    the attention norm, one RMSNorm of the layer's own), in the training form; the logged gate mean is that g's."""
    from model import RotaryEmbedding

    cfg = PLTConfig(**SHAPE, n_loops=2, window=W, gate_input="residual", window_keys=window_keys)
    attn = randomize(PLTAttention(cfg))
    assert attn.gate_w.shape == (SHAPE["n_head"], SHAPE["n_embd"]) and attn.gate_norm.weight.shape == (SHAPE["n_embd"],)
    n = 9
    rope = RotaryEmbedding(cfg.rot_dim, n)(torch.arange(n))
    residual = torch.randn(2, n, SHAPE["n_embd"]) * 3
    xn = torch.randn(2, n, SHAPE["n_embd"])  # stands for attn_norm(residual): the gate must not read it
    shared = (torch.randn(2, 2, n, cfg.hd), torch.randn(2, 2, n, cfg.hd))
    expect, gate = attention_by_hand(attn, xn, residual, rope, shared, cfg.attn_window)
    attn.train()
    torch.testing.assert_close(attn(xn, rope, shared=shared, residual=residual), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(attn.gate_mean, gate.mean(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="residual"):
        attn(xn, rope, shared=shared)


@pytest.mark.parametrize("window_keys", ["w", "w+1"])
def test_gswa_window_keys(window_keys):
    """In a G-SWA loop, y_i depends on the loop's own input at j iff i - w < j <= i ("w"), i - w <= j <= i ("w+1")
    (shared K/V held fixed)."""
    cfg = PLTConfig(**SHAPE, n_loops=2, window=W, window_keys=window_keys)
    attn = randomize(PLTAttention(cfg))
    from model import RotaryEmbedding

    n = 11
    rope = RotaryEmbedding(cfg.rot_dim, n)(torch.arange(n))
    x = torch.randn(1, n, SHAPE["n_embd"])
    shared = (torch.randn(1, 2, n, cfg.hd), torch.randn(1, 2, n, cfg.hd))
    y = attn(x, rope, shared=shared)
    lo = W - 1 if window_keys == "w" else W  # the oldest own key i - lo
    for j in range(n):
        x2 = x.clone()
        x2[0, j] += 1.0
        changed = (attn(x2, rope, shared=shared) - y).abs().amax(-1)[0] > 1e-6  # (n,)
        expect = torch.tensor([(i - lo <= j <= i) for i in range(n)])
        assert torch.equal(changed, expect), (j, changed)


@pytest.mark.parametrize("variant", ["plt", "clp", "loop"])
def test_decode_ragged_prompts(variant):
    """Right-padded prompts of different lengths (one shorter, one longer than w) decode like their own forward."""
    model = make(3, variant)
    idx = torch.randint(SHAPE["vocab_size"], (2, T))
    lengths = torch.tensor([3, 8])
    errs, _ = decode_errors(model, idx, 8, lengths)
    assert errs.max() < 2e-5, errs


def test_decode_static_cache():
    """The fixed-shape mode for torch.compile attends over the whole (masked) cache: same logits."""
    model = make(2, "plt")
    idx = torch.randint(SHAPE["vocab_size"], (2, T))
    errs, _ = decode_errors(model, idx, 5, static=True)
    assert errs.max() < 2e-5, errs


def test_clp_decodes_in_one_forward_per_token():
    """CLP runs each layer once per decode step (on L rows); the sequential baseline runs it L times."""
    idx = torch.randint(SHAPE["vocab_size"], (2, 6))
    for variant, calls in (("plt", 1), ("loop", 3)):
        model = make(3, variant)
        cache = model.new_cache(2, 8)
        model.prefill(idx, cache)
        seen = []
        hook = model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
        model.decode_step(idx[:, -1], cache)
        hook.remove()
        assert len(seen) == calls
        assert seen[0] == ((2, 3, SHAPE["n_embd"]) if calls == 1 else (2, 1, SHAPE["n_embd"]))


# -- the Triton kernels on the decode and prefill paths -------------------------------------------------------------


@pytest.mark.parametrize("form", ["paper", "loopcoder"])  # loopcoder: the residual gate's values into the kernels
@pytest.mark.parametrize("variant,n_loops", [("plt", 3), ("seq_gswa", 2)])
def test_decode_through_triton_kernels(monkeypatch, variant, n_loops, form):
    """PLT's prefill (kernels.gated_swa) and decode (kernels.gated_swa_decode) forced onto the Triton kernels
    (TRITON_INTERPRET=1 on CPU, set by conftest) give the reference path's logits, which equal the forward's."""
    import kernels

    if kernels.triton is None:
        pytest.skip("Triton is not installed; the reference path is tested by test_decode_matches_forward")
    model = make(n_loops, variant, **FORMS.get(form, {}))
    idx = torch.randint(SHAPE["vocab_size"], (2, 10))
    lengths = torch.tensor([3, 7])  # shorter and longer than W = 4: row 0's ring wraps while decoding

    def run():
        cache = model.new_cache(2, 10)
        out = [model.prefill(idx[:, :7], cache, lengths)]
        rows = torch.arange(2)
        for s in range(2):
            out.append(model.decode_step(idx[rows, lengths + s], cache))
        return torch.stack(out)

    ref = run()
    calls = {"gated_swa_triton": 0, "gated_swa_decode_triton": 0}

    def counted(name):
        fn = getattr(kernels, name)

        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    # the dispatch functions look these names up in kernels' globals at call time
    monkeypatch.setattr(kernels, "use_triton", lambda *t: not (torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in t)))
    for name in calls:
        monkeypatch.setattr(kernels, name, counted(name))
    tri = run()
    assert calls["gated_swa_triton"] == SHAPE["n_layer"] * (n_loops - 1)  # prefill: every G-SWA loop and layer
    assert calls["gated_swa_decode_triton"] == 2 * SHAPE["n_layer"] * (1 if variant == "plt" else n_loops - 1)
    torch.testing.assert_close(tri, ref, rtol=0, atol=2e-5)
    full, _ = model(idx)  # training forward (parameters require grad: the reference path)
    assert calls["gated_swa_triton"] == SHAPE["n_layer"] * (n_loops - 1)
    torch.testing.assert_close(tri[0], full[torch.arange(2), lengths - 1], rtol=0, atol=2e-5)


# -- the compiled decode step: one graph that CUDA graphs can capture ----------------------------------------------


@pytest.mark.parametrize("variant,form", [("plt", "paper"), ("clp", "paper"), ("loop", "paper"), ("seq_gswa", "paper"),
                                          ("plt", "loopcoder"), ("seq_gswa", "loopcoder")])
def test_compiled_decode_is_one_graph_that_cuda_graphs_can_capture(variant, form):
    """compile_decode on a static PLTCache: one graph for every decode step of the CLP step (plt: the rings of G-SWA;
    clp: a full cache per loop) and of the sequential loop baseline (loop; seq_gswa: with rings), across ring wraps
    (12 new tokens after 5, W = 4), none more in a second generation of the same shape, every state tensor the step
    writes (the caches, the rings and their positions, the hidden states, the lengths) marked static; the greedy
    tokens equal the eager ones."""
    from graph_check import check_compiled_generate

    model = make(2, variant, **FORMS.get(form, {}))
    idx = torch.randint(SHAPE["vocab_size"], (2, 5))
    check_compiled_generate(model, idx, 12, graphs=1)


@pytest.mark.parametrize("form", ["paper", "loopcoder"])
def test_compiled_decode_through_the_triton_operator(monkeypatch, form):
    """On a GPU G-SWA's decode runs the Triton kernels: inside a compiled step through one opaque operator
    (kernels._gated_swa_decode_op), so the step stays one graph. Forced here onto the interpreted kernels: one graph,
    the operator in it, the eager tokens (loopcoder: the residual gate's values passed to the operator)."""
    import kernels
    from graph_check import GraphCheck

    if kernels.triton is None:
        pytest.skip("Triton is not installed")
    model = make(3, "plt", **FORMS.get(form, {}))
    idx = torch.randint(SHAPE["vocab_size"], (2, 5))
    ref = model.generate(idx, 8)
    monkeypatch.setattr(kernels, "_all_cuda", lambda tensors: True)
    check = GraphCheck()
    graphs.compile_decode(model, backend=check)
    assert torch.equal(model.generate(idx, 8), ref)
    assert check.graphs == 1 and check.unsafe == [] and check.syncs == [], (check.unsafe, check.syncs)
    assert "nano_inference.gated_swa_decode.default" in check.ops, check.ops


# -- L = 1 is the vanilla model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["loop", "plt"])
def test_one_loop_equals_vanilla(variant):
    gpt = randomize(GPT(GPTConfig(**SHAPE)))
    clp, kv_share, gswa = SWITCHES[variant]
    model = PLT.from_vanilla(gpt, n_loops=1, window=W, clp=clp, kv_share=kv_share, gswa=gswa).eval()
    assert model.num_params() == gpt.num_params()  # no gate with one loop
    idx = torch.randint(SHAPE["vocab_size"], (3, 10))
    y = torch.randint(SHAPE["vocab_size"], (3, 10))
    (a, la), (b, lb) = gpt(idx, y), model(idx, y)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-6)
    assert torch.equal(model.generate(idx[:, :4], 8), gpt.generate(idx[:, :4], 8))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(model.generate(idx[:, :4], 8, 1.0, 20, g1), gpt.generate(idx[:, :4], 8, 1.0, 20, g2))
    assert model.kv_cache_bytes(3, 100) == gpt.kv_cache_bytes(3, 100)


def test_from_vanilla_with_loops():
    """Conversion copies every weight; the only new parameters are the gates, which start at g = 0.5."""
    gpt = randomize(GPT(GPTConfig(**SHAPE)))
    model = PLT.from_vanilla(gpt, n_loops=2, window=W)
    for name, p in gpt.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    extra = set(model.state_dict()) - set(gpt.state_dict())
    assert extra == ({f"blocks.{j}.attn.{g}" for j in range(SHAPE["n_layer"]) for g in ("gate_w", "gate_b")} |
                     {"loop_norms.0.0.weight", "loop_norms.0.1.weight"})  # the loop-input norms (n_E, n_H), at 1
    model.train()
    model(torch.randint(SHAPE["vocab_size"], (2, 8)))
    assert abs(float(model.metrics["gate_local"]) - 0.5) < 1e-6


# -- the shift removes same-position dependence ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["clp", "kv_share", "plt", "loop", "loop_embed"])
@pytest.mark.parametrize("norm", ["none", "shared"])
def test_shift_breaks_same_position_dependence(variant, norm):
    """d H^(2)_i / d H^(1)_j is zero for j >= i with CLP (only earlier positions feed loop 2), nonzero at j = i
    without it. Built from the model's own pieces, checked against forward first."""
    model = make(2, variant, loop_input_norm=norm)
    idx = torch.randint(SHAPE["vocab_size"], (1, 9))
    n = idx.size(1)
    rope = model.rope(torch.arange(n))
    e = model.embed(idx)
    kv1 = []
    h1 = model.run_loop(e, rope, own_kv=kv1)
    shared = kv1 if model.config.kv_share else None
    h1_leaf = h1.detach().requires_grad_(True)  # K_share stays fixed: it is loop 1's internals, not H^(1)
    h2 = model.run_loop(model.loop_input(e, h1_leaf, 1), rope, shared)
    torch.testing.assert_close(model.head(h2), model(idx)[0], rtol=0, atol=1e-5)
    i = 5
    (grad,) = torch.autograd.grad(h2[0, i].sum(), h1_leaf)
    per_pos = grad[0].abs().sum(-1)  # (n,)
    if variant in ("loop", "loop_embed"):
        assert per_pos[i] > 1e-3
    else:
        assert torch.all(per_pos[i:] == 0)
        assert per_pos[i - 1] > 1e-3


@pytest.mark.parametrize("variant,norm,n_loops,pairs", [
    ("clp", "none", 3, 0), ("clp", "shared", 3, 1), ("plt", "per_loop", 3, 2), ("clp", "per_loop", 2, 1),
    ("loop", "shared", 3, 0),  # no CLP: loop l >= 2 reads H alone, nothing to normalise
    ("loop_embed", "shared", 3, 1), ("loop_embed", "per_loop", 3, 2), ("loop_embed", "none", 2, 0),  # E re-injected
])
def test_loop_input_norms(variant, norm, n_loops, pairs):
    """loop_input_norm builds the documented (n_E, n_H) pairs; each pair gets a gradient (per_loop: loop l uses pair
    l - 2); and with the norms the loop input no longer depends on the scale of H, which is the point of them."""
    model = make(n_loops, variant, loop_input_norm=norm)
    assert len(model.loop_norms) == pairs
    idx = torch.randint(SHAPE["vocab_size"], (2, 9))
    model(idx)[0].square().mean().backward()
    for pair in model.loop_norms:
        for norm_ in pair:
            assert norm_.weight.grad.abs().sum() > 0
    e, h = torch.randn(2, 9, SHAPE["n_embd"]) * 0.02, torch.randn(2, 9, SHAPE["n_embd"])
    for loop in range(1, n_loops):
        a, b = model.loop_input(e, h, loop), model.loop_input(e, 50 * h, loop)
        if pairs:  # the same input at any scale of H (up to the norm's eps)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        elif variant == "loop_embed":  # the raw sum at the same position
            torch.testing.assert_close(b - a, 49 * h)
        elif variant != "loop":  # the paper's raw sum: H^(l-1) at 50x swamps E
            torch.testing.assert_close(b - a, 49 * shift_right(h))


def test_shift_right():
    h = torch.arange(12.0).view(1, 4, 3)
    assert torch.equal(shift_right(h), torch.cat([torch.zeros(1, 1, 3), h[:, :3]], dim=1))


# -- the window ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_keys", ["w", "w+1"])
def test_ring_holds_last_w_positions(window_keys):
    """After prefill and decoding, each ring holds exactly positions max(0, n-w)..n-1 (slot = position % w; w + 1
    for window_keys="w+1"), and their K/V are the loop's own K/V of the training forward at those positions."""
    model = make(3, "plt", window_keys=window_keys)
    W = model.config.attn_window
    idx = torch.randint(SHAPE["vocab_size"], (2, T))
    lengths = torch.tensor([2, 7])
    for steps in (0, 1, T - 7):  # the longer row fills the cache; the shorter one wraps its ring
        cache = model.new_cache(2, T)
        model.prefill(idx[:, :7], cache, lengths)
        rows = torch.arange(2)
        for s in range(steps):
            model.decode_step(idx[rows, lengths + s], cache)
        _, kvs = model.hidden_states(idx, keep_kv=True)
        for b in range(2):
            n = int(lengths[b]) + steps
            held = sorted(p for p in cache.ring.pos[b].tolist() if p >= 0)
            assert held == list(range(max(0, n - W), n))
            for p in held:
                for loop in (1, 2):
                    for j in range(SHAPE["n_layer"]):
                        k, v = kvs[loop][j]
                        torch.testing.assert_close(cache.ring.k[j, b, loop - 1, :, p % W], k[b, :, p], atol=2e-5,
                                                   rtol=0)
                        torch.testing.assert_close(cache.ring.v[j, b, loop - 1, :, p % W], v[b, :, p], atol=2e-5,
                                                   rtol=0)


# -- KV cache bytes (Table 1) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["vanilla"] + list(VARIANTS)[1:])
@pytest.mark.parametrize("n_loops", [2, 3])
@pytest.mark.parametrize("seq_len", [3, 20])
@pytest.mark.parametrize("window_keys", ["w", "w+1"])
def test_kv_cache_bytes(variant, n_loops, seq_len, window_keys):
    cfg = PLTConfig(**SHAPE, window=W, window_keys=window_keys,
                    **variant_fields(variant, None if variant == "vanilla" else n_loops))
    model = PLT(cfg)
    W_ = W + (window_keys == "w+1")
    B, N, d = 3, SHAPE["n_layer"], SHAPE["n_kv_head"] * cfg.hd
    nd = 2 * B * N * seq_len * d  # K and V of one full cache, in elements
    L = cfg.n_loops
    expect = {"vanilla": nd, "loop": L * nd, "clp": L * nd, "kv_share": nd,
              "plt": nd + 2 * B * N * (L - 1) * min(W_, seq_len) * d}[variant]
    assert model.kv_cache_bytes(B, seq_len, dtype_bytes=4) == 4 * expect
    assert model.new_cache(B, seq_len).nbytes() == 4 * expect  # fp32 tensors actually allocated
    bf16 = model.new_cache(B, seq_len, dtype=torch.bfloat16)
    assert bf16.nbytes() == model.kv_cache_bytes(B, seq_len) == 2 * expect


# -- errors ----------------------------------------------------------------------------------------------------------


def test_config_errors():
    with pytest.raises(ValueError, match="window"):
        PLTConfig(**SHAPE, window=0)
    with pytest.raises(ValueError, match="n_loops"):
        PLTConfig(**SHAPE, n_loops=0)
    with pytest.raises(ValueError, match="gswa=True needs kv_share"):
        PLTConfig(**SHAPE, kv_share=False, gswa=True)
    with pytest.raises(ValueError, match="loop_embed=True needs clp=False"):
        PLTConfig(**SHAPE, loop_embed=True)
    with pytest.raises(ValueError, match="unknown PLT variant"):
        variant_fields("nope")
    with pytest.raises(ValueError, match="vanilla"):
        variant_fields("vanilla", 2)
    with pytest.raises(ValueError, match="bad GPTConfig"):
        PLTConfig(**{**SHAPE, "n_kv_head": 3})
    for field, bad in (("loop_emb_scale", -0.5), ("loop_hidden_scale", float("nan")), ("loop_emb_scale", True),
                       ("learn_loop_scales", 1), ("loop_final_norm", "yes"), ("loop_embed", 1), ("gate_input", "key"),
                       ("window_keys", "w+2")):
        with pytest.raises(ValueError, match=field):
            PLTConfig(**SHAPE, **{field: bad})


def test_runtime_errors():
    model = make(2, "plt")
    idx = torch.randint(SHAPE["vocab_size"], (2, 6))
    cache = model.new_cache(2, 6)
    with pytest.raises(ValueError, match="KV cache holds 6 positions; the prompts need 7"):
        model.prefill(torch.randint(SHAPE["vocab_size"], (2, 7)), cache)
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(idx, cache, torch.tensor([0, 6]))
    model.prefill(idx, cache)
    with pytest.raises(ValueError, match="KV cache holds 6 positions; this step needs 7"):
        model.decode_step(idx[:, 0], cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(SHAPE["vocab_size"], (1, SHAPE["max_seq_len"] + 1)))


# -- generate and train.py -------------------------------------------------------------------------------------------


def test_generate_greedy_and_seeded():
    model = make(2, "plt")
    idx = torch.randint(SHAPE["vocab_size"], (2, 5))
    out = model.generate(idx, 6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], idx)
    for t in range(5, 11):  # greedy: each token is the argmax of the full forward over what came before
        assert torch.equal(out[:, t], model(out[:, :t])[0][:, -1].argmax(-1))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a, b = model.generate(idx, 6, 1.0, 10, g1), model.generate(idx, 6, 1.0, 10, g2)
    assert torch.equal(a, b)


def test_flag_overrides():
    class A:
        loops, plt_variant, plt_window = 3, "kv_share", 16

    assert config_overrides(A) == dict(n_loops=3, clp=True, kv_share=True, gswa=False, window=16)
    A.plt_variant, A.loops, A.plt_window = None, None, None
    assert config_overrides(A) == dict(clp=True, kv_share=True, gswa=True)


def test_production_form_flags():
    """train.py's flags of the LoopCoder forms set their fields; the scales are checked as they are parsed."""
    import train

    table = train.arch_table()
    ap = train.build_parser(table)
    args = ap.parse_args(["--arch", "plt", "--plt-emb-scale", "0.7", "--plt-hidden-scale", "0.05",
                          "--plt-learn-scales", "--plt-loop-final-norm", "--plt-gate", "residual",
                          "--plt-window-keys", "w+1", "--plt-loop-norm", "none"])
    train.resolve_defaults(args, table["plt"])
    assert config_overrides(args) == dict(clp=True, kv_share=True, gswa=True, loop_input_norm="none",
                                          loop_emb_scale=0.7, loop_hidden_scale=0.05, learn_loop_scales=True,
                                          loop_final_norm=True, gate_input="residual", window_keys="w+1")
    args = ap.parse_args(["--arch", "plt", "--plt-variant", "loop", "--plt-loop-embed"])
    train.resolve_defaults(args, table["plt"])
    assert config_overrides(args) == dict(clp=False, kv_share=False, gswa=False, loop_embed=True)
    from harness.cli import UsageError

    for flag in ("--plt-emb-scale", "--plt-hidden-scale"):
        with pytest.raises(UsageError, match=f"argument {flag}: must be >= 0, got -1"):
            ap.parse_args(["--arch", "plt", flag, "-1"])


@pytest.mark.parametrize("variant", ["plt"])  # the other rows' flags: test_flag_overrides
def test_train_runs(tmp_path, variant):
    import train
    from harness import checkpoint
    from conftest import write_jsonl

    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(40)]
    data = write_jsonl(tmp_path / "corpus.jsonl", texts)
    out = train.train(["--arch", "plt", "--plt-variant", variant, "--loops", "2", "--plt-window", "8",
                       "--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "out"),
                       "--max-iters", "3", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1",
                       "--sample-tokens", "8", "--device", "cpu", "--vocab-size", "300"])
    assert out["loss"] is not None and torch.isfinite(torch.tensor(out["loss"]))
    ck = checkpoint.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    model = checkpoint.model_from_checkpoint(ck)
    assert isinstance(model, PLT) and model.config.n_loops == 2 and model.config.window == 8
    assert model.config.clp == (variant == "plt") and model.config.gswa == (variant == "plt")


def test_plt_forms_probe_and_table(tmp_path, capsys):
    """harness/plt_forms: the probe of a trained checkpoint (the paper's raw sum: rms(E) over rms(H^(1)) shifted,
    written out here on the same validation windows; the logit moves; learned a, b) and the table it feeds."""
    import eval as ev
    import train
    from conftest import write_jsonl
    from harness import plt_forms

    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(40)]
    data = write_jsonl(tmp_path / "corpus.jsonl", texts)
    cache = str(tmp_path / "cache")
    for name, flags in (("paper", ["--plt-loop-norm", "none"]), ("learned", ["--plt-learn-scales"])):
        train.train(["--arch", "plt", "--data", str(data), "--cache-dir", cache, "--out-dir", str(tmp_path / name),
                     "--max-iters", "2", "--batch-size", "2", "--seq-len", "32", "--eval-iters", "1",
                     "--sample-tokens", "0", "--device", "cpu", "--vocab-size", "300", *flags])
    got = plt_forms.probe(tmp_path / "paper" / "ckpt.pt", cache)
    ck, model, tok = ev.load_run(tmp_path / "paper" / "ckpt.pt", "cpu")
    ratios = []
    for x, _ in ev.val_windows(ck, tok, plt_forms.N_WINDOWS, 2, 32, 0, "cpu", cache):
        with torch.no_grad():
            e, h1 = model.embed(x), model.hidden_states(x)[0][0]
        ratios.append(float(e[:, 1:].pow(2).mean().sqrt() / h1[:, :-1].pow(2).mean().sqrt()))
    assert abs(got["e_share"] - sum(ratios) / len(ratios)) < 1e-5, (got, ratios)
    assert got["own"] > 0 and got["prev"] > 0 and got["scales"] is None
    learned = plt_forms.probe(tmp_path / "learned" / "ckpt.pt", cache)["scales"]
    assert len(learned) == 2 and learned != [1.0, 1.0]  # trained two steps away from their start
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(dict(row=r, seed=s, steps=2, val=v, e_share=0.5, own=1.0, prev=0.5,
                                               scales=None)) + "\n"
                               for r, s, v in (("paper", 0, 7.0), ("paper", 1, 7.2), ("shared", 0, 6.0))))
    capsys.readouterr()  # the training runs' output
    plt_forms.main(["table", "--results", str(results)])
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| 2 | paper | 7.100 ± 0.100 | 0.500 ± 0.000 | 1.00 ± 0.00 / 0.50 ± 0.00 | - | 0,1 |", out
    assert out[3].startswith("| 2 | shared | 6.000 ± 0.000 |")


# -- training: the CLP loop input keeps token i visible at position i --------------------------------------------


def train_markov(norm, seed, steps=60, V=256, T=32, lr=2e-2):
    """Train a 2-loop CLP model (no kv_share, so token i reaches loop 2 at position i only through E_i in the loop
    input) on sequences where token t+1 = perm[token t] with probability 1/2, else uniform. -> model, a held-out
    batch, its val loss, the loss floor (the task's entropy) and the uniform loss."""
    import math

    from train import lr_at, make_optimizer

    torch.manual_seed(seed)
    model = PLT(PLTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=192, vocab_size=V, max_seq_len=T,
                          n_loops=2, clp=True, kv_share=False, gswa=False, loop_input_norm=norm))
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(V, generator=gen)

    def batch():
        xs = [torch.randint(V, (16, 1), generator=gen)]
        for _ in range(T):
            noise = torch.rand(16, 1, generator=gen) < 0.5
            xs.append(torch.where(noise, torch.randint(V, (16, 1), generator=gen), perm[xs[-1]]))
        return torch.cat(xs, 1)

    opt = make_optimizer(model, lr, 0.1, torch.device("cpu"))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, steps // 10, steps, lr / 10)
        seq = batch()
        model(seq[:, :-1], seq[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    seq = batch()
    with torch.no_grad():
        val = model(seq[:, :-1], seq[:, 1:])[1].item()
    floor = -(0.5 + 0.5 / V) * math.log(0.5 + 0.5 / V) - 0.5 * (V - 1) / V * math.log(0.5 / V)
    return model, seq[:, :-1], val, floor, math.log(V)


@pytest.mark.parametrize("norm", ["shared", "none"])
def test_clp_training_uses_the_current_token(norm):
    """After a short training run the CLP model's logits at position i depend on token i: its loss gets most of the
    way from uniform to the task's floor, and replacing token i moves the logits at i more than replacing any
    earlier token does (the task is first-order Markov). With loop_input_norm="none" (the paper's raw sum) the same
    run fails on both counts: the residual stream H^(1) outgrows E (rms ratio 8-300 in these runs), E_i is a small
    part of loop 2's input, and the logits at i follow the earlier tokens instead (plt.py's docstring has the same
    failure at the real corpus' scale)."""
    model, x, val, floor, uniform = train_markov(norm, seed=0)
    i = 20
    with torch.no_grad():
        base = model(x)[0][:, i]

        def moved(j):  # mean L2 change of the logits at i when token j is replaced
            x2 = x.clone()
            x2[:, j] = (x2[:, j] + 1) % model.config.vocab_size
            return (model(x2)[0][:, i] - base).norm(dim=-1).mean()

        own, others = moved(i), max(moved(j) for j in range(i))
    works = norm != "none"
    assert (val < (floor + uniform) / 2) == works, (val, floor, uniform)
    assert (own > 3 * others) == works, (own, others)


def test_main_job_defaults_and_explicit_lr():
    """`python train.py --arch plt` runs the arch's defaults (800 steps at lr 4e-3); an explicit --lr wins; other
    archs keep train.py's 2e-3."""
    import train
    table = train.arch_table()
    ap = train.build_parser(table)
    for argv, lr, iters in ((["--arch", "plt"], 4e-3, 800), (["--arch", "plt", "--lr", "1e-3"], 1e-3, 800),
                            (["--arch", "vanilla"], 2e-3, 300)):
        args = ap.parse_args(argv)
        train.resolve_defaults(args, table[args.arch])
        assert (args.lr, args.max_iters) == (lr, iters), argv


def test_preset_table_lists_every_table2_row_against_vanilla(capsys):
    """`python bench.py presets --arch plt`: per preset, one row per Table 2 variant (label, the model of that variant)
    with the row `vanilla` (one loop of the same stack) as the baseline in brackets."""
    import bench
    from harness.bench_common import describe
    from plt import PRESETS, preset_rows

    bench.main(["presets", "--arch", "plt", "--preset", "tiny"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plt:" and [ln.split()[:4] for ln in out[1:]] == [
        ["tiny", v, f"L{1 if v == 'vanilla' else 2}", "w32"] for v in VARIANTS]
    base = out[1].split("non-emb params")[1].split()  # the vanilla row's own figures ...
    for ln in out[1:]:  # ... are every row's baseline
        assert ln.endswith(f"(baseline {base[0]}, {base[3]} MiB, {base[7]})"), ln
    rows = preset_rows("small")
    assert [r[1].config.n_loops for r in rows] == [1, 2, 2, 2, 2] and {r[2].config.n_loops for r in rows} == {1}
    assert [(r[1].config.clp, r[1].config.kv_share, r[1].config.gswa) for r in rows] == [
        (VARIANTS[v]["clp"], VARIANTS[v]["kv_share"], VARIANTS[v]["gswa"]) for v in VARIANTS]
    assert all(p.is_meta for r in rows for p in r[1].parameters()) and set(PRESETS) >= {"tiny", "small"}
    describe(*rows[-1])  # the row prints as bench.py prints it
    assert capsys.readouterr().out.startswith("small plt L2 w64")
