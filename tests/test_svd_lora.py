"""svd_lora.py: the LoRA layer (int and per-row loop indices), the truncated SVD of eq. 4, and init_lora."""
import pytest
import torch

import kernels
from eval import residual_energy
from model import GPT, Block, GPTConfig, Linear
from recursive import tying_sources
from svd_lora import LoRALinear, add_lora, init_lora, lora_params, max_ranks, norm_affine, svd_method, truncated_svd


def lora_layer(bias=True, bias_delta=True, n_loops=3, rank=4, din=12, dout=10):
    lin = LoRALinear(din, dout, bias=bias, n_loops=n_loops, rank=rank, bias_delta=bias_delta)
    with torch.no_grad():  # a nonzero delta in every loop
        lin.lora_B.normal_()
        if lin.lora_bias is not None:
            lin.lora_bias.normal_()
    return lin


def test_int_index_is_shared_plus_low_rank():
    lin = lora_layer()
    x = torch.randn(2, 5, 12)
    for l in range(3):
        ref = x @ (lin.weight + lin.lora_B[l] @ lin.lora_A[l]).T + lin.bias + lin.lora_bias[l]
        torch.testing.assert_close(lin(x, l), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)  # None: the shared layer alone
    torch.testing.assert_close(lin.delta_weight(1), lin.lora_B[1] @ lin.lora_A[1])


def test_per_row_index_equals_int_index_per_row():
    lin = lora_layer()
    x = torch.randn(4, 3, 12)
    idx = torch.tensor([2, 0, -1, 1])
    y = lin(x, idx)
    for r, l in enumerate(idx.tolist()):
        ref = lin(x[r:r + 1], None if l < 0 else l)  # -1 = no adapter (and no bias delta)
        torch.testing.assert_close(y[r:r + 1], ref, rtol=1e-5, atol=1e-5)
    # 2-D input (one token per row) goes through the same path
    torch.testing.assert_close(lin(x[:, 0], idx), y[:, 0], rtol=1e-5, atol=1e-5)


def test_per_row_index_gradients_match_int_index():
    # float64: the two paths sum the same products in another order, so they agree to ~1e-15 relative; in fp32 the
    # gap is a few ulps of the gradients' magnitude and depends on which CPU kernels PyTorch picks
    lin = lora_layer().double()
    x = torch.randn(3, 2, 12, dtype=torch.float64)
    lin(x, torch.tensor([1, 1, 1])).square().sum().backward()
    g_rows = [p.grad.clone() for p in (lin.weight, lin.lora_A, lin.lora_B, lin.lora_bias)]
    lin.zero_grad()
    lin(x, 1).square().sum().backward()
    for g, p in zip(g_rows, (lin.weight, lin.lora_A, lin.lora_B, lin.lora_bias)):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
    assert lin.lora_A.grad[0].abs().sum() == 0 and lin.lora_A.grad[1].abs().sum() > 0


def test_lora_rank_bounds():
    with pytest.raises(ValueError, match="exceeds min"):
        LoRALinear(8, 6, n_loops=2, rank=7)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRALinear(8, 6, n_loops=2, rank=0)
    with pytest.raises(ValueError, match="exceeds min"):
        truncated_svd(torch.randn(5, 9), 6)


def test_standard_init_is_gaussian_a_zero_b():
    lin = LoRALinear(64, 32, n_loops=2, rank=8, bias_delta=True)
    assert torch.all(lin.lora_B == 0) and torch.all(lin.lora_bias == 0)
    assert 0.5 / 8 < lin.lora_A.std() < 2 / 8  # N(0, 1/in): std 1/sqrt(64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x, 1), lin(x))


@pytest.mark.parametrize("method", ["svd", "lowrank"])
def test_truncated_svd_is_the_best_rank_r_approximation(method):
    torch.manual_seed(1)
    R = torch.randn(40, 6, dtype=torch.float64) @ torch.randn(6, 50, dtype=torch.float64)  # rank 6
    R += 1e-3 * torch.randn(40, 50, dtype=torch.float64)
    S = torch.linalg.svdvals(R)
    for r in (2, 6):
        B, A, used = truncated_svd(R, r, method)
        assert used == method and B.shape == (40, r) and A.shape == (r, 50)
        err = torch.linalg.matrix_norm(R - B @ A)
        best = S[r:].square().sum().sqrt()  # Eckart-Young
        assert err <= best * (1 + (1e-9 if method == "svd" else 1e-2)) + 1e-12
    B, A, _ = truncated_svd(R, 40, "svd")  # full rank: exact
    torch.testing.assert_close(B @ A, R, rtol=0, atol=1e-10)


def test_truncated_svd_auto_picks_lowrank_for_big_matrices():
    assert truncated_svd(torch.randn(64, 80), 8)[2] == "svd"
    assert truncated_svd(torch.randn(1100, 1200), 8)[2] == "lowrank"
    assert svd_method((1100, 1200), 400) == "svd" and svd_method((2048, 16384), 64) == "lowrank"


def _blocks(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(n):
        b = Block(cfg)
        with torch.no_grad():
            for name, p in b.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.copy_(torch.rand(p.shape, generator=g) + 0.5)
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        blocks.append(b)
    return blocks


def test_init_lora_delta_is_the_truncated_residual_of_the_effective_map():
    """Eq. 4 with scale 1: B_l A_l equals the rank-r truncated SVD of W_l diag(s_l / s') - W' exactly."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24)
    src = _blocks(cfg, 2)
    shared = _blocks(cfg, 1, seed=5)[0]
    add_lora(shared, 2, {"q": 3, "kv": 2, "o": 4, "mlp": 5})
    stats = init_lora(shared, src, "svd")
    assert stats["svd"] == 14 and stats["zero_residual"] == 0
    s_sh = norm_affine(shared.attn_norm)[0]
    for l in range(2):
        s_l = norm_affine(src[l].attn_norm)[0]
        R = src[l].attn.q_proj.weight.double() * (s_l / s_sh)[None] - shared.attn.q_proj.weight.double()
        B, A, _ = truncated_svd(R, 3)
        torch.testing.assert_close(shared.attn.q_proj.delta_weight(l).double(), B @ A, rtol=0, atol=1e-6)
        R = src[l].attn.o_proj.weight.double() - shared.attn.o_proj.weight.double()  # o_proj reads no norm
        B, A, _ = truncated_svd(R, 4)
        torch.testing.assert_close(shared.attn.o_proj.delta_weight(l).double(), B @ A, rtol=0, atol=1e-6)


def test_init_lora_zero_residual_and_zero_mode_use_standard_init():
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24)
    src = _blocks(cfg, 2)
    shared = Block(cfg)
    shared.load_state_dict(src[0].state_dict())  # loop 0 is the shared layer itself (Stepwise / Lower)
    add_lora(shared, 2, {"q": 4, "kv": 4, "o": 4, "mlp": 4})
    stats = init_lora(shared, src, "svd")
    assert stats["zero_residual"] == 7 and stats["svd"] == 7
    for m in shared.modules():
        if isinstance(m, LoRALinear):
            assert torch.all(m.lora_B[0] == 0) and m.lora_A[0].abs().sum() > 0  # A Gaussian, B zero
            assert m.lora_B[1].abs().sum() > 0
    stats = init_lora(shared, src, "zero")
    assert stats["standard"] == 14
    assert all(torch.all(m.lora_B == 0) for m in shared.modules() if isinstance(m, LoRALinear))
    with pytest.raises(ValueError, match="unknown LoRA init"):
        init_lora(shared, src, "pissa")


def _block_out(block, x, loop=None):
    from model import RotaryEmbedding

    rope = RotaryEmbedding(block.attn.head_dim, 16)(torch.arange(x.size(1)))  # (cos, sin)
    return block(x, rope, lora_idx=loop)


@pytest.mark.parametrize("dead_in", ["shared", "source"])
def test_dead_rmsnorm_channel_is_revived_and_full_rank_stays_exact(dead_in):
    """A ~0 channel of the shared RMSNorm scale (as in SmolLM2's MLP norms) is moved into the shared projections'
    columns: the shared block computes the same function, no fallback, and full-rank LoRA reproduces each loop's
    vanilla layer, including the one that reads the channel at full scale. A dead channel in a *source* layer alone
    needs nothing."""
    from svd_lora import revive_channels

    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24)
    src = _blocks(cfg, 2)
    with torch.no_grad():
        (src[0] if dead_in == "shared" else src[1]).mlp_norm.weight[3] = 1e-6
        src[0].attn_norm.weight[5] = 0.0
    shared = Block(cfg)
    shared.load_state_dict(src[0].state_dict())  # Stepwise: loop 1's layer is the shared one
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        before = _block_out(shared, x)
        probe = Block(cfg)
        probe.load_state_dict(shared.state_dict())
        assert revive_channels(probe) == (2 if dead_in == "shared" else 1)
        torch.testing.assert_close(_block_out(probe, x), before, rtol=1e-5, atol=1e-6)  # same function
        add_lora(shared, 2, max_ranks(cfg))
        stats = init_lora(shared, src, "svd")
    assert stats["norm_fallback"] == 0 and stats["zero_residual"] == 7  # loop 1 keeps the standard init
    with torch.no_grad():
        for l in range(2):
            torch.testing.assert_close(_block_out(shared, x, l), _block_out(src[l], x), rtol=1e-4, atol=1e-5)


def test_init_lora_near_zero_shared_layernorm_scale_falls_back_with_warning():
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24, norm="layer")
    src = _blocks(cfg, 2)
    shared = _blocks(cfg, 1, seed=3)[0]
    with torch.no_grad():
        shared.attn_norm.weight[3] = 0.0
    add_lora(shared, 2, {"q": 16, "kv": 8, "o": 16, "mlp": 16})
    with pytest.warns(UserWarning, match="~0"):
        stats = init_lora(shared, src, "svd")
    assert stats["norm_fallback"] == 3 * 2 and stats["revived"] == 0  # q, k, v x 2 loops, one channel each
    assert all(torch.isfinite(p).all() for p in shared.parameters())
    # the fallback column is the plain eq. 4 residual
    R = src[1].attn.q_proj.weight[:, 3] - shared.attn.q_proj.weight[:, 3]
    torch.testing.assert_close(shared.attn.q_proj.delta_weight(1)[:, 3], R, rtol=1e-4, atol=1e-5)


def test_add_lora_ranks_per_component_and_gelu_mlp():
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24, mlp="gelu", norm="layer",
                    attn_bias=True, mlp_bias=True)
    b = Block(cfg)
    w = b.attn.k_proj.weight.clone()
    add_lora(b, 3, {"q": 0, "kv": 2, "o": 0, "mlp": 5}, bias_delta=True)
    assert type(b.attn.q_proj) is Linear and type(b.attn.o_proj) is Linear
    assert b.attn.k_proj.rank == 2 and b.attn.v_proj.rank == 2 and b.mlp.up_proj.rank == 5
    assert not hasattr(b.mlp, "gate_proj") and b.mlp.down_proj.lora_bias.shape == (3, 16)
    assert torch.equal(b.attn.k_proj.weight, w) and b.attn.k_proj.bias is not None
    n = sum(p.numel() for name, p in b.named_parameters() if "lora_" in name)
    assert n == lora_params(cfg, {"kv": 2, "mlp": 5}, 3, bias_delta=True)
    assert max_ranks(cfg) == {"q": 16, "kv": 8, "o": 16, "mlp": 16}


def test_per_token_index_and_bad_index_shape():
    lin = lora_layer()
    x = torch.randn(3, 4, 12)
    idx = torch.tensor([[0, 1, 2, -1], [2, 2, 0, 1], [-1, -1, 1, 0]])  # (N, T): one loop per token
    y = lin(x, idx)
    for r in range(3):
        for t in range(4):
            l = int(idx[r, t])
            torch.testing.assert_close(y[r, t], lin(x[r, t][None], None if l < 0 else l)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, torch.tensor(2)), lin(x, 2))  # a 0-d tensor is one loop for all rows
    with pytest.raises(ValueError, match="fits neither the rows"):
        lin(x, torch.tensor([0, 1]))


def test_per_row_path_runs_multi_lora_and_equals_the_triton_kernel(monkeypatch):
    """LoRALinear's per-row path goes through kernels.multi_lora; with the Triton kernel in its place (run by the
    Triton interpreter on CPU, TRITON_INTERPRET=1 from conftest.py) the output equals running each loop separately."""
    if kernels.triton is None:
        pytest.skip("Triton is not installed; the reference path is tested by "
                    "test_per_row_index_equals_int_index_per_row")
    lin = lora_layer(din=24, dout=20, rank=5)
    x = torch.randn(4, 3, 24)
    idx = torch.tensor([2, 0, -1, 1])
    calls = []

    def triton_multi_lora(x_, A, B, i):
        calls.append((tuple(x_.shape), tuple(i.shape)))
        return kernels.multi_lora_triton(x_, A, B, i)

    with torch.no_grad():
        ref = torch.cat([lin(x[r:r + 1], None if l < 0 else l) for r, l in enumerate(idx.tolist())])
        ref_delta = kernels.multi_lora_ref(x, lin.lora_A, lin.lora_B, idx)
        monkeypatch.setattr(kernels, "multi_lora", triton_multi_lora)
        y = lin(x, idx)
        y2 = lin(x[:, 0], idx)  # (N, in): one token per row (decode)
    assert calls == [((4, 3, 24), (4,)), ((4, 1, 24), (4,))]  # idx stays per row: the kernel broadcasts over T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2, ref[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.multi_lora_triton(x, lin.lora_A.detach(), lin.lora_B.detach(), idx), ref_delta,
                               rtol=1e-5, atol=1e-5)


def test_multi_lora_dispatch_matches_reference_on_cpu():
    x, A, B = torch.randn(4, 3, 8), torch.randn(3, 2, 8), torch.randn(3, 5, 2)
    idx = torch.tensor([0, 2, -1, 1])
    torch.testing.assert_close(kernels.multi_lora(x, A, B, idx), kernels.multi_lora_ref(x, A, B, idx))


def test_residual_energy_reports_full_capture_at_full_rank():
    cfg = GPTConfig(n_layer=4, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24)
    van = GPT(cfg)
    res = residual_energy(list(van.blocks), tying_sources(4, 2, "average"), ranks=(1, 16))
    for comp, fr in res.items():
        assert 0 < fr[1] < 1 and abs(fr[16] - 1) < 1e-9, comp
