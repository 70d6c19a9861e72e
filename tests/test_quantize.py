"""harness/quantize.py, weight-only int8: each product within the rounding bound of per-channel int8 (a weight moves
by at most half its channel's scale), the logits of a converted model near the fp model's, the eager and compiled
int8 decode giving the same tokens, and a converted model that keeps its dtype, device and caches."""
import copy

import pytest
import torch

import graphs
from harness.quantize import Int8Linear, int8_bytes, int8_linear, int8_weights, quantize_per_channel
from model import GPT, GPTConfig, Linear


def bound_holds(lin: Linear, q: Int8Linear) -> bool:
    """Every dequantized weight s_j * Q_ji within s_j / 2 of W_ji (rounding to the nearest multiple of s_j), so that
    an output moves by at most s_j / 2 * sum_i |x_i|: the whole error of weight-only int8 (the product itself is
    checked against the dequantized weight below)."""
    err = (q.scales[:, None].float() * q.qweight.float() - lin.weight.detach()).abs()
    return bool((err <= q.scales[:, None] / 2 * (1 + 1e-5)).all())


def test_each_int8_product_is_within_half_a_scale_per_weight():
    torch.manual_seed(0)
    lin = Linear(96, 40, bias=True)
    lin.weight.data[3] = 0.0  # an all-zero channel: scale 1, every weight 0, exact
    lin.weight.data[5, 7] = 40.0  # an outlier coarsens its own channel only (per-channel scales)
    q = Int8Linear(lin)
    x = torch.randn(2, 7, 96)
    assert q.qweight.dtype == torch.int8 and int(q.qweight.abs().max()) <= 127 and q.scales[3] == 1
    assert bound_holds(lin, q)
    bound = q.scales / 2 * x.abs().sum(-1, keepdim=True) + 1e-4
    assert ((q(x) - lin(x)).abs() <= bound).all() and (q(x) - lin(x))[..., 3].abs().max() < 1e-6
    others = [j for j in range(40) if j not in (3, 5)]
    assert (q.scales[others] < q.scales[5] / 50).all()
    torch.testing.assert_close(q.scales[others], lin.weight.detach()[others].abs().amax(1) / 127)  # the finest scale


def test_the_bound_catches_a_broken_quantizer():
    """The check above fails for one channel's scale 1% high and for a truncating quantizer (floor instead of round):
    the bound is tight enough to see either."""
    torch.manual_seed(0)
    lin = Linear(256, 64)
    q = Int8Linear(lin)
    assert bound_holds(lin, q)
    wrong = copy.deepcopy(q)
    wrong.scales[0] *= 1.01
    assert not bound_holds(lin, wrong)
    floor = copy.deepcopy(q)
    w, s = lin.weight.detach(), q.scales
    floor.qweight.copy_(torch.floor(w / s[:, None]).to(torch.int8))
    assert not bound_holds(lin, floor)


def test_int8_logits_stay_near_the_fp_logits():
    """A converted model's logits (every projection and the tied head int8) against the fp model's: relative RMS error
    under 3%. Why 3%: each product's error is a sum of `in` independent errors of at most s/2 (std s/sqrt(12)) against
    an output of std ~ sqrt(in) * std(W); with s = max|W|/127 and max|W| ~ 4 std(W) for Gaussian weights, a product
    moves by ~4/127/sqrt(12) ~ 0.9%, and a few such errors in a row (8 products on the path of a 4-layer model, partly
    averaged by the residual stream) stay ~1-2%. Measured here: ~1.1%."""
    torch.manual_seed(0)
    m = GPT(GPTConfig.from_preset("tiny")).eval()
    q = int8_weights(copy.deepcopy(m))
    idx = torch.randint(0, 4160, (2, 32))
    with torch.no_grad():
        a, b = m(idx)[0], q(idx)[0]
    rel = ((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()).item()
    assert 1e-3 < rel < 0.03, rel  # int8 really in use (not the fp weights), and near them
    assert all(isinstance(getattr(blk.attn, p), Int8Linear) for blk in q.blocks for p in ("q_proj", "o_proj"))
    assert isinstance(q.lm_head, Int8Linear) and q.tok_emb.weight is not None  # the embedding table stays fp
    lin_bytes = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    assert int8_bytes(q) == lin_bytes + 4 * sum(mod.out_features for mod in q.modules() if isinstance(mod, Int8Linear))


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_product_equals_its_dequantized_form(dtype, rows):
    """Both CPU paths of int8_linear -- torch's int8 product (_weight_int8pack_mm, up to GEMV_ROWS rows) and the
    dequantized F.linear (more rows) -- against the dequantized weight in fp32."""
    torch.manual_seed(0)
    w = torch.randn(48, 80)
    qw, s = quantize_per_channel(w)
    x = torch.randn(rows, 80, dtype=dtype)
    ref = torch.nn.functional.linear(x.float(), qw.float() * s[:, None])
    got = int8_linear(x, qw, s.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_a_converted_model_keeps_its_dtype_device_and_caches():
    m = int8_weights(GPT(GPTConfig.from_preset("tiny")).eval()).to(torch.bfloat16)
    assert m.lm_head.weight.dtype == torch.bfloat16 and m.lm_head.qweight.dtype == torch.int8
    assert m.new_cache(1, 8).k.dtype == torch.bfloat16
    assert m.generate(torch.zeros(1, 3, dtype=torch.long), 4).shape == (1, 7)


@pytest.mark.slow
def test_compiled_int8_decode_gives_the_eager_int8_tokens():
    """The int8 model through graphs.compile_decode (inductor's C++ backend, frozen int8 weights): the eager int8
    model's greedy tokens, one graph."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = int8_weights(GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, vocab_size=256,
                                   max_seq_len=64)).eval())
    idx = torch.randint(0, 256, (1, 6))
    ref = m.generate(idx, 6)
    counters.clear()
    graphs.compile_decode(m)
    assert torch.equal(m.generate(idx, 6), ref) and counters["stats"]["unique_graphs"] == 1
