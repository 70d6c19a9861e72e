"""model.linear's measured choice of CPU product: every candidate computes F.linear's math (to rounding), the chooser
never keeps a product its own measurement found slower than F.linear, measured times are reused (process, disk), and a
weight copy (transposed, oneDNN's layout) never outlives a change of the weight."""
import gc
import math

import pytest
import torch
import torch.nn.functional as F

import model
from model import LINEAR_COPIES, LINEAR_PRODUCTS, Linear, force_linear, linear, linear_product, pick_linear


@pytest.fixture(autouse=True)
def fresh_chooser(monkeypatch, tmp_path):
    """Empty process caches, a disk cache in tmp_path, no forced product (restored afterwards)."""
    monkeypatch.setattr(model, "_linear_choice", {})
    monkeypatch.setattr(model, "_linear_times", {})
    monkeypatch.setattr(model, "_linear_forced", [None])
    monkeypatch.setenv("LINEAR_CHOICE_CACHE", str(tmp_path / "linear_choice.json"))
    yield


def fake_timer(table, calls):
    """A time_linear_products that returns table[rows] (name -> seconds) and records its calls."""
    def timer(dtype, rows, out_f, in_f, names, repeats=3):
        calls.append((dtype, rows, out_f, in_f))
        return {k: table[rows][k] for k in names}
    return timer


def assert_rounding_close(y, x, w, b):
    """|y - F.linear| <= 2 eps_out (|y| + |b|) + 2 eps_fp32 sqrt(K) (|x| |W|^T): both results round their output (and
    the bias add) once in the output dtype, and accumulate the K products in fp32 in some order (random-walk error
    ~ sqrt(K) eps_fp32 times the sum of magnitudes)."""
    ref = F.linear(x, w, b).double()
    K = x.size(-1)
    mags = x.double().abs() @ w.double().abs().t()
    bias = b.double().abs() if b is not None else 0.0
    eps_out, eps_acc = torch.finfo(x.dtype).eps, torch.finfo(torch.float32).eps
    tol = 2 * eps_out * (ref.abs() + bias) + 2 * eps_acc * math.sqrt(K) * mags
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert ((y.double() - ref).abs() <= tol).all(), ((y.double() - ref).abs() - tol).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_every_forced_product_equals_f_linear_to_rounding(dtype, rows):
    w, b = torch.randn(96, 200, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 1, 200, dtype=dtype)  # (B, T, C) with one token per row: a decode step
    for name in LINEAR_PRODUCTS:
        if name == "mv" and rows > 1:
            continue
        force_linear(name)
        assert linear_product(dtype, rows, 96, 200) == name
        with torch.no_grad():
            for bias in (None, b):
                y = linear(x, w, bias)
                assert y.is_contiguous()  # later ops (SDPA's CPU kernel) need unit stride
                assert_rounding_close(y, x, w, bias)
        xg = x.clone().requires_grad_(True)  # training: F.linear itself, whatever is forced
        assert torch.equal(linear(xg, w, b), F.linear(xg, w, b))


def test_the_chooser_never_keeps_a_product_slower_than_f_linear(monkeypatch):
    """Fake timings through the seam: the fastest wins; ties keep F.linear; a weight copy needs a > 10% lead."""
    table = {1: dict(linear=1.0, mv=0.7, mm=0.8, xwt=0.65, dnn=0.66),  # copies 7% faster than mv: not worth it
             2: dict(linear=1.0, mm=1.2, xwt=0.85, dnn=0.9),  # xwt 15% faster than F.linear -> xwt
             4: dict(linear=1.0, mm=1.0, xwt=1.0, dnn=1.0),  # tie -> F.linear
             16: dict(linear=0.5, mm=0.9, xwt=0.6, dnn=0.3),  # dnn fastest
             64: dict(linear=2.0, mm=1.5, xwt=1.4, dnn=1.45)}  # mm (the copies only 3-7% better)
    want = {1: "mv", 2: "xwt", 4: "linear", 16: "dnn", 64: "mm"}
    calls = []
    monkeypatch.setattr(model, "time_linear_products", fake_timer(table, calls))
    for bucket, times in table.items():
        got = linear_product(torch.float32, bucket, 8, 8)
        assert got == want[bucket] == pick_linear(times) and times[got] <= times["linear"]
    assert linear_product(torch.float32, 3, 8, 8) == "linear" and linear_product(torch.float32, 40, 8, 8) == "mm"
    assert len(calls) == 5  # rows 3 and 40 fall in the buckets 4 and 64: timed once each
    g = torch.Generator().manual_seed(0)
    names = ["linear", "mv", "mm", "xwt", "dnn"]
    for _ in range(500):  # any timings: never slower than F.linear; a copy only with a > 10% lead
        times = dict(zip(names, (torch.rand(5, generator=g) + 0.1).tolist()))
        pick, plain = pick_linear(times), min(times[k] for k in names[:3])
        assert times[pick] <= times["linear"]
        if pick in LINEAR_COPIES:
            assert times[pick] * 1.1 < plain and times[pick] == min(times.values())
        else:
            assert times[pick] == plain and min(times["xwt"], times["dnn"]) * 1.1 >= plain


def test_measured_times_persist_on_disk_per_machine(monkeypatch):
    calls = []
    table = {2: dict(linear=1.0, mm=0.5, xwt=0.6, dnn=0.6)}
    monkeypatch.setattr(model, "time_linear_products", fake_timer(table, calls))
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 1
    monkeypatch.setattr(model, "_linear_choice", {})  # a new process: its caches are empty
    monkeypatch.setattr(model, "_linear_times", {})
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 1  # read from disk, not timed
    assert linear_product(torch.bfloat16, 2, 16, 8) == "mm" and len(calls) == 2  # another shape: timed
    monkeypatch.setattr(model, "_linear_choice", {})
    monkeypatch.setattr(model, "_linear_times", {})
    monkeypatch.setattr(model, "cpu_key", lambda: "another cpu")
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 3  # another machine: timed again


@pytest.mark.parametrize("name", LINEAR_COPIES)
def test_a_weight_copy_never_outlives_a_change_of_the_weight(name):
    """xwt and dnn read a cached copy of W: reused while W is unchanged, remade after an optimizer step,
    load_state_dict, .to()."""
    gc.collect()
    _, before = model.linear_report()  # copies of other tests' weights still alive in this process
    force_linear(name)
    lin = Linear(200, 96)
    x = torch.randn(4, 200)

    def check():
        with torch.no_grad():
            assert_rounding_close(lin(x), x, lin.weight, lin.bias)

    check()
    copy = model.weight_copy(lin.weight, name)
    assert model.weight_copy(lin.weight, name) is copy  # no new copy while the weight is unchanged
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).square().sum().backward()  # with gradients: F.linear
    opt.step()
    check()
    lin.load_state_dict({"weight": torch.randn(96, 200), "bias": torch.randn(96)})
    check()
    lin.to(torch.bfloat16)
    x = x.bfloat16()
    check()
    gc.collect()
    rows, nbytes = model.linear_report()
    assert nbytes - before == 96 * 200 * 2  # the one live copy of this weight, in bf16


def test_real_timing_returns_every_candidate(monkeypatch):
    """The real timer on a small probe (no assertion on speed): a time per candidate, and a report in GB/s."""
    monkeypatch.setattr(model, "LINEAR_PROBE_BYTES", 1 << 20)
    name = linear_product(torch.float32, 1, 64, 128)
    (row,), _ = model.linear_report()
    assert row["pick"] == name and list(row["gbps"]) == model.linear_candidates(torch.float32, 1)
    assert all(v > 0 for v in row["gbps"].values()) and row["shape"] == (64, 128) and row["rows"] == 1


def test_force_linear_rejects_unknown_products():
    with pytest.raises(ValueError, match="linear product"):
        force_linear("gemv")


def test_decode_bench_prints_the_choice_and_each_forced_product(monkeypatch, capsys):
    import bench

    monkeypatch.setattr(model, "LINEAR_PROBE_BYTES", 1 << 20)
    bench.main(["decode", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "1",
                "--prompt-len", "8", "--new-tokens", "3", "--no-hf", "--linear", "auto,dnn"])
    out = capsys.readouterr().out
    assert "ours: GPT.generate:" in out and "ours: GPT.generate [linear: dnn]:" in out
    assert "model.linear's choice per (rows, out x in)" in out and "rows   1    4160 x 128" in out
    assert "weight copies alive" in out and model._linear_forced == [None]


@pytest.mark.parametrize("name", [None, "linear", "mv", "mm", "xwt", "dnn"])
def test_zero_rows_give_an_empty_result(name):
    """A batch with no row (e.g. no row of a depth-wise step leaves at a loop) is F.linear's empty product."""
    w = torch.randn(6, 5)
    model.force_linear(name)
    try:
        with torch.no_grad():
            y = model.linear(torch.randn(0, 5), w)
    finally:
        model.force_linear(None)
    assert y.shape == (0, 6)
