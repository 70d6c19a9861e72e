"""cpu_tuning.py, the CPU forms chosen by measurement: off, model.linear / model.attend / kernels.multi_lora are plain
PyTorch; switched on, every form computes the plain math (to rounding), the linear chooser never keeps a product its
own measurement found slower than F.linear, measured times are reused (process, disk), a weight copy (transposed,
oneDNN's layout) never outlives a change of the weight, and each choice is timed once per shape."""
import gc
import math

import pytest
import torch
import torch.nn.functional as F

import kernels as K
import model
from harness import cpu_tuning
from harness.cpu_tuning import LINEAR_COPIES, LINEAR_PRODUCTS, force_linear, linear, linear_product, pick_linear
from model import GPT, GPTConfig, Linear, attend


@pytest.fixture(autouse=True)
def fresh_chooser(monkeypatch, tmp_path):
    """Empty process caches, a disk cache in tmp_path, no forced product (restored afterwards)."""
    monkeypatch.setattr(cpu_tuning, "_linear_choice", {})
    monkeypatch.setattr(cpu_tuning, "_linear_times", {})
    monkeypatch.setattr(cpu_tuning, "_linear_forced", [None])
    monkeypatch.setenv("LINEAR_CHOICE_CACHE", str(tmp_path / "linear_choice.json"))
    yield


def fake_timer(table, calls, spot=1.0):
    """A time_linear_products that returns table[rows] (name -> seconds) and records its calls that measure every
    candidate; a call for one product (recorded_times' check of a recorded pick) returns its time x spot."""
    def timer(dtype, rows, out_f, in_f, names, repeats=3):
        if len(names) == 1:
            return {names[0]: table[rows][names[0]] * spot}
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
    monkeypatch.setattr(cpu_tuning, "time_linear_products", fake_timer(table, calls))
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
    monkeypatch.setattr(cpu_tuning, "time_linear_products", fake_timer(table, calls))
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 1
    monkeypatch.setattr(cpu_tuning, "_linear_choice", {})  # a new process: its caches are empty
    monkeypatch.setattr(cpu_tuning, "_linear_times", {})
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 1  # read from disk, not timed
    assert linear_product(torch.bfloat16, 2, 16, 8) == "mm" and len(calls) == 2  # another shape: timed
    monkeypatch.setattr(cpu_tuning, "_linear_choice", {})
    monkeypatch.setattr(cpu_tuning, "_linear_times", {})
    monkeypatch.setattr(cpu_tuning, "cpu_key", lambda: "another cpu")
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 3  # another machine: timed again


NOW = 1.9e9  # the fake clock's time of the first measurement


def test_the_disk_cache_records_the_cpu_and_the_time_of_its_measurements(monkeypatch, tmp_path):
    import json
    import types

    monkeypatch.setattr(cpu_tuning, "time", types.SimpleNamespace(time=lambda: NOW, perf_counter=lambda: 0.0))
    table = {2: dict(linear=1.0, mm=0.5, xwt=0.6, dnn=0.6)}
    monkeypatch.setattr(cpu_tuning, "time_linear_products", fake_timer(table, []))
    linear_product(torch.bfloat16, 2, 8, 16)
    disk = json.loads((tmp_path / "linear_choice.json").read_text())
    names = cpu_tuning.linear_candidates(torch.bfloat16, 2)
    assert disk == {cpu_tuning.cpu_key(): {"bfloat16 2 8x16": {"times": {k: table[2][k] for k in names},
                                                               "measured": NOW}}}


DAY = 86400.0
RECORDS = [  # (what, edit of the record on disk, the recorded pick timed now / its record, days later, re-timed?)
    ("the pick times as recorded", None, 1.0, 1, False),
    ("the pick 1.5x slower: within LINEAR_FAR_OFF", None, 1.5, 1, False),
    ("the pick 1.8x faster: within LINEAR_FAR_OFF", None, 1 / 1.8, 1, False),
    ("the pick far slower than recorded", None, 3.0, 1, True),
    ("the pick far faster: the record was taken under load", None, 0.3, 1, True),
    ("a record older than LINEAR_CACHE_DAYS", None, 1.0, 31, True),
    ("a record from the future (the clock moved back)", None, 1.0, -1, True),
    ("a record without its time (an older file)", lambda e: e["times"], 1.0, 1, True),
    ("a record of other candidates", lambda e: {**e, "times": {"linear": 1.0, "mm": 0.5}}, 1.0, 1, True),
    ("a record with a time that is not a number", lambda e: {**e, "times": {**e["times"], "mm": "fast"}}, 1.0, 1, True),
]


@pytest.mark.parametrize("what,edit,spot,days,retimed", RECORDS, ids=[r[0] for r in RECORDS])
def test_a_later_run_retimes_a_record_that_no_longer_holds(monkeypatch, tmp_path, what, edit, spot, days, retimed):
    """A new process reads the record of a shape, times its pick once (fake timer) and measures every candidate again
    when that is far off the record or the record is stale; else it takes the record without measuring more."""
    import json
    import types

    clock = [NOW]
    monkeypatch.setattr(cpu_tuning, "time", types.SimpleNamespace(time=lambda: clock[0], perf_counter=lambda: 0.0))
    table, calls = {2: dict(linear=1.0, mm=0.5, xwt=0.6, dnn=0.6)}, []
    monkeypatch.setattr(cpu_tuning, "time_linear_products", fake_timer(table, calls))
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm" and len(calls) == 1
    path = tmp_path / "linear_choice.json"
    disk = json.loads(path.read_text())
    if edit is not None:
        entry = disk[cpu_tuning.cpu_key()]["bfloat16 2 8x16"]
        disk[cpu_tuning.cpu_key()]["bfloat16 2 8x16"] = edit(entry)
        path.write_text(json.dumps(disk))
    monkeypatch.setattr(cpu_tuning, "_linear_choice", {})  # a new process, later
    monkeypatch.setattr(cpu_tuning, "_linear_times", {})
    monkeypatch.setattr(cpu_tuning, "time_linear_products", fake_timer(table, calls, spot))
    clock[0] = NOW + days * DAY
    assert linear_product(torch.bfloat16, 2, 8, 16) == "mm"
    assert len(calls) == 1 + retimed
    record = json.loads(path.read_text())[cpu_tuning.cpu_key()]["bfloat16 2 8x16"]
    assert record["measured"] == (clock[0] if retimed else NOW)


@pytest.mark.parametrize("name", LINEAR_COPIES)
def test_a_weight_copy_never_outlives_a_change_of_the_weight(name):
    """xwt and dnn read a cached copy of W: reused while W is unchanged, remade after an optimizer step,
    load_state_dict, .to()."""
    gc.collect()
    _, before = cpu_tuning.linear_report()  # copies of other tests' weights still alive in this process
    force_linear(name)
    lin = Linear(200, 96)
    x = torch.randn(4, 200)

    def check():
        with torch.no_grad(), cpu_tuning.switched_on():  # model.Linear -> model.linear -> the forced product
            assert_rounding_close(lin(x), x, lin.weight, lin.bias)

    check()
    copy = cpu_tuning.weight_copy(lin.weight, name)
    assert cpu_tuning.weight_copy(lin.weight, name) is copy  # no new copy while the weight is unchanged
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
    rows, nbytes = cpu_tuning.linear_report()
    assert nbytes - before == 96 * 200 * 2  # the one live copy of this weight, in bf16


def test_real_timing_returns_every_candidate(monkeypatch):
    """The real timer on a small probe (no assertion on speed): a time per candidate, and a report in GB/s."""
    monkeypatch.setattr(cpu_tuning, "LINEAR_PROBE_BYTES", 1 << 20)
    name = linear_product(torch.float32, 1, 64, 128)
    (row,), _ = cpu_tuning.linear_report()
    assert row["pick"] == name and list(row["gbps"]) == cpu_tuning.linear_candidates(torch.float32, 1)
    assert all(v > 0 for v in row["gbps"].values()) and row["shape"] == (64, 128) and row["rows"] == 1


def test_force_linear_rejects_unknown_products():
    with pytest.raises(ValueError, match="linear product"):
        force_linear("gemv")


def test_decode_bench_prints_the_choice_and_each_forced_product(monkeypatch, capsys):
    import bench

    monkeypatch.setattr(cpu_tuning, "LINEAR_PROBE_BYTES", 1 << 20)
    bench.main(["decode", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--repeats", "1",
                "--prompt-len", "8", "--new-tokens", "3", "--systems", "eager", "--linear", "auto,dnn"])
    out = capsys.readouterr().out
    assert "ours eager  " in out and "ours eager [linear: dnn] " in out
    assert "cpu_tuning's linear product per (rows, out x in)" in out and "rows   1    4160 x 128" in out
    assert "weight copies alive" in out and cpu_tuning._linear_forced == [None]
    # the benchmark switched the tuning off again
    assert model.tuned_ops is None and K.cpu_decode_attend is None and K.cpu_lora_form is None


@pytest.mark.parametrize("name", [None, "linear", "mv", "mm", "xwt", "dnn"])
def test_zero_rows_give_an_empty_result(name):
    """A batch with no row (e.g. no row of a depth-wise step leaves at a loop) is F.linear's empty product."""
    w = torch.randn(6, 5)
    force_linear(name)
    try:
        with torch.no_grad():
            y = linear(torch.randn(0, 5), w)
    finally:
        force_linear(None)
    assert y.shape == (0, 6)


# ----------------------------------------------------------------------------------------------------------------
# Off: plain PyTorch. On: the same math, and the switch restores what was there.


def test_off_the_models_run_plain_pytorch():
    """With the tuning off (the default), model.linear is F.linear, model.attend is SDPA and multi_lora at CPU
    inference is the stacked form, exactly, at decode shapes and under bf16 autocast training alike."""
    assert model.tuned_ops is None and K.cpu_decode_attend is None and K.cpu_lora_form is None
    w, x = torch.randn(37, 24), torch.randn(3, 1, 24)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(model.linear(x, w), F.linear(x, w))
        assert torch.equal(attend(q, k, v, mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                       enable_gqa=True))
        xa, A, B = torch.randn(6, 16), torch.randn(2, 4, 16), torch.randn(2, 8, 4)
        idx = torch.tensor([0, 1, 1, 0, -1, 1])
        assert torch.equal(K.multi_lora(xa, A, B, idx), K.multi_lora_stacked(xa, A, B, idx))
    qb = q.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(qb, k.bfloat16(), v.bfloat16(), is_causal=True)
    assert torch.equal(y, F.scaled_dot_product_attention(qb, k.bfloat16(), v.bfloat16(), is_causal=True,
                                                         enable_gqa=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switched_on_decoding_gives_the_plain_logits_to_rounding(dtype):
    """A model's cached decode steps with the tuning switched on (every product forced in turn, and the measured
    choice) give the plain path's logits to rounding; leaving the with block restores plain PyTorch."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, vocab_size=96,
                      max_seq_len=32)).to(dtype).eval()
    idx = torch.randint(0, 96, (3, 5))
    steps = torch.randint(0, 96, (3, 4))

    def logits():
        cache = m.new_cache(3, 16)
        out = [m.prefill(idx, cache)]
        out += [m.decode_step(steps[:, i], cache) for i in range(steps.size(1))]
        return torch.stack(out, 1).float()

    plain = logits()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for name in [None, "mm", "xwt", "dnn"]:
        force_linear(name)
        try:
            with cpu_tuning.switched_on():
                assert cpu_tuning.enabled()
                torch.testing.assert_close(logits(), plain, **tol)
        finally:
            force_linear(None)
        assert model.tuned_ops is None and K.cpu_decode_attend is None and K.cpu_lora_form is None
    assert torch.equal(logits(), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 65])
def test_linear_inference_paths_equal_f_linear(dtype, rows):
    """model.linear switched on (the measured product of each row count; 65 rows: F.linear) == F.linear: to fp32
    rounding in fp32, within bf16 rounding (1e-2 relative) in bf16; with gradients it is F.linear itself."""
    torch.manual_seed(0)
    w, b = torch.randn(37, 24, dtype=dtype), torch.randn(37, dtype=dtype)
    x = torch.randn(rows, 1, 24, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    with cpu_tuning.switched_on():
        with torch.no_grad():
            for bias in (None, b):
                y = model.linear(x, w, bias)
                assert y.shape == (rows, 1, 37) and y.dtype == dtype
                torch.testing.assert_close(y.float(), F.linear(x, w, bias).float(), **tol)
        xg = x.clone().requires_grad_(True)
        assert torch.equal(model.linear(xg, w, b), F.linear(xg, w, b))


# ----------------------------------------------------------------------------------------------------------------
# Attention: the training precision and the decode form


@pytest.mark.parametrize("t32,t16,want", [(1.0, 2.0, "fp32"), (1.0, 0.95, "fp32"), (1.0, 0.8, "bf16")])
def test_attend_under_cpu_bf16_autocast_training_takes_the_measured_precision(t32, t16, want, monkeypatch):
    """Switched on, CPU training under bf16 autocast: the attention runs in the precision measured faster at this
    shape (bf16 only when > 10% faster). fp32: exactly the fp32 attention rounded to bf16; bf16: exactly bf16 SDPA.
    Gradients flow."""
    monkeypatch.setattr(cpu_tuning, "_attention_choice", {})
    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    fake = {"fp32": t32, "bf16": t16}
    assert cpu_tuning.attention_precision(qb, kb, None, True, None, True, timer=fake.__getitem__) == want
    with cpu_tuning.switched_on(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(qb, kb, vb, is_causal=True)  # the choice above is kept for this shape
    if want == "fp32":
        ref = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), is_causal=True, enable_gqa=True)
        ref = ref.bfloat16()
    else:
        ref = F.scaled_dot_product_attention(qb.detach(), kb, vb, is_causal=True, enable_gqa=True)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    y.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_attention_precision_is_measured_once_per_shape(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "_attention_choice", {})
    q, k = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    got = cpu_tuning.attention_precision(q, k, None, True, None, False)  # the real timer: a choice, no speed asserted
    assert got in ("fp32", "bf16") and len(cpu_tuning._attention_choice) == 1
    calls = []
    assert cpu_tuning.attention_precision(q, k, None, True, None, False, timer=calls.append) == got and not calls


@pytest.mark.parametrize("mask_shape", [None, (3, 1, 2, 11), (3, 4, 2, 11), (2, 11), (1, 1, 1, 11)])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_attend_grouped_equals_sdpa(mask_shape, heads):
    """The decode form of attention (grouped batched matmuls, fp32 accumulation) == SDPA for every mask broadcast
    and GQA: fp64 to 1e-12; bf16 inputs to the rounding of the bf16 output (2^-8 relative); a query with no visible
    key gives 0 as SDPA does."""
    from harness.cpu_tuning import attend_grouped

    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, H, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, Hkv, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=g) < 0.6
    if mask is not None:
        mask[..., 0] = True
        if mask.dim() == 4 and mask.size(0) == 3:
            mask[1, :, 0] = False  # row 1's first query sees nothing
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
    torch.testing.assert_close(attend_grouped(q, k, v, mask), ref, rtol=1e-12, atol=1e-12)
    if mask is not None and mask.dim() == 4 and mask.size(0) == 3:
        assert torch.all(attend_grouped(q, k, v, mask)[1, :, 0] == 0)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    yb = attend_grouped(qb, kb, vb, mask)
    refb = F.scaled_dot_product_attention(qb.double(), kb.double(), vb.double(), attn_mask=mask, enable_gqa=H != Hkv)
    assert yb.dtype == torch.bfloat16
    assert torch.all((yb.double() - refb).abs() <= 2 ** -8 * refb.abs() + 1e-6)


@pytest.mark.parametrize("form", ["sdpa", "grouped"])
def test_decoding_attention_runs_the_form_measured_faster(form, monkeypatch):
    """Switched on, no-grad CPU attention with one query per row runs the form decode_attention measured faster at
    the shape (timed once, then kept): exactly that form's output; with gradients it is SDPA whatever was measured."""
    monkeypatch.setattr(cpu_tuning, "_decode_choice", {})
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = False
    times = {"sdpa": 1.0, "grouped": 2.0} if form == "sdpa" else {"sdpa": 2.0, "grouped": 1.0}
    assert cpu_tuning.decode_attention(q, k, mask, timer=times.__getitem__) == form
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with cpu_tuning.switched_on():
        with torch.no_grad():
            y = attend(q, k, v, mask=mask)
        assert torch.equal(y, sdpa if form == "sdpa" else cpu_tuning.attend_grouped(q, k, v, mask))
        assert len(cpu_tuning._decode_choice) == 1  # kept, not timed again
        assert torch.equal(attend(q.requires_grad_(), k, v, mask=mask), sdpa)


def test_plt_decoding_sends_its_gated_window_attentions_through_the_measured_form(monkeypatch):
    """A PLT decode step attends three times per layer (loop 1 over the shared cache; G-SWA's window over the rings
    and its global branch over the shared cache): switched on, with the grouped form measured faster, all three run
    attend_grouped, and the logits equal the plain path's to rounding."""
    import plt

    torch.manual_seed(0)
    m = plt.PLT(plt.PLTConfig(**{**plt.PRESETS["tiny"], "n_loops": 3, "window": 4})).eval()
    B, H, D = 3, m.config.n_head, m.config.hd
    idx, steps = torch.randint(0, 4160, (B, 6)), torch.randint(0, 4160, (B, 3))

    def logits():
        cache = m.new_cache(B, 16)
        out = [m.prefill(idx, cache)]
        out += [m.decode_step(steps[:, i], cache) for i in range(steps.size(1))]
        return torch.stack(out, 1)

    with torch.no_grad():
        plain = logits()
        seen, grouped = [], cpu_tuning.attend_grouped
        monkeypatch.setattr(cpu_tuning, "decode_attention", lambda *a, **kw: "grouped")
        monkeypatch.setattr(cpu_tuning, "attend_grouped",
                            lambda q, k, v, mask=None, scale=None: seen.append(tuple(q.shape)) or grouped(q, k, v, mask,
                                                                                                        scale))
        with cpu_tuning.switched_on():
            tuned = logits()
    torch.testing.assert_close(tuned, plain, rtol=1e-4, atol=1e-4)
    # per decode step and layer: loop 1 (B, H, 1, D), the rings (B * 2, H, 1, D), the shared cache (B, H, 2, D)
    assert sorted(set(seen)) == sorted({(B, H, 1, D), (2 * B, H, 1, D), (B, H, 2, D)})
    assert len(seen) == 3 * steps.size(1) * m.config.n_layer


# ----------------------------------------------------------------------------------------------------------------
# The LoRA form, and the one timing rule


@pytest.mark.parametrize("faster", ["stacked", "grouped"])
def test_multi_lora_runs_the_form_measured_faster(monkeypatch, faster):
    """Switched on, at CPU inference multi_lora runs the form lora_form measured faster at these shapes (timed once,
    then kept), and its result equals the reference whichever it is."""
    monkeypatch.setattr(cpu_tuning, "_lora_form", {})
    timed = []

    def timer(form):
        timed.append(form)
        return 1.0 if form == faster else 2.0

    x, A, B = torch.randn(6, 16), torch.randn(2, 4, 16), torch.randn(2, 8, 4)
    idx = torch.tensor([0, 1, 1, 0, -1, 1])
    assert cpu_tuning.lora_form(x, A, B, timer=timer) == faster and len(timed) == 12  # warm-up + 5 rounds of both
    calls = []
    monkeypatch.setitem(K.LORA_FORMS, faster, lambda *a: calls.append(1) or K.multi_lora_ref(*a))
    with torch.no_grad(), cpu_tuning.switched_on():
        y = K.multi_lora(x, A, B, idx)
    assert calls == [1] and len(timed) == 12  # the kept choice, not timed again
    torch.testing.assert_close(y, K.multi_lora_ref(x, A, B, idx), rtol=0, atol=0)


def test_fastest_keeps_the_default_unless_beaten_by_the_gain():
    from harness.cpu_tuning import fastest

    assert fastest({"a": 1.0, "b": 0.5}.__getitem__, ("a", "b")) == "b"
    assert fastest({"a": 1.0, "b": 0.95}.__getitem__, ("a", "b"), gain=1.10) == "a"
    assert fastest({"a": 1.0, "b": 2.0}.__getitem__, ("a", "b")) == "a"


@pytest.mark.parametrize("eager, compiled, want", [(2.0, 1.0, True), (1.0, 2.0, False), (1.05, 1.0, False)])
def test_the_compiled_decode_is_kept_only_where_it_measured_faster(monkeypatch, eager, compiled, want):
    """compiled_decode_faster (auto): the fake timer's seconds per token decide (compiled only with a 10% lead), the
    model is left compiled or eager accordingly, and the times land on disk under this machine's key; a new process
    reads them back and times the recorded pick once instead of measuring both; --compile / --no-compile as told."""
    import graphs

    calls = []

    def timer(m, batch, is_compiled):
        calls.append(is_compiled)
        return compiled if is_compiled else eager

    m = GPT(GPTConfig.from_preset("tiny")).eval()
    assert cpu_tuning.compiled_decode_faster(m, 3, timer=timer) is want
    assert (m.graph_caches is not None) is want and len(calls) == 2 + 2 * 3  # a warm-up each, 3 rounds
    disk = cpu_tuning._read_cache(str(cpu_tuning.os.environ["LINEAR_CHOICE_CACHE"]))
    assert disk[cpu_tuning.cpu_key()][cpu_tuning.decode_key(m, 3)]["times"] == {"eager": eager, "compiled": compiled}
    assert cpu_tuning.decode_key(m, 3).endswith("float32 4 rows")  # the batch bucket
    calls.clear()
    fresh = GPT(GPTConfig.from_preset("tiny")).eval()
    assert cpu_tuning.compiled_decode_faster(fresh, 4, timer=timer) is want
    assert calls == ([True, True] if want else [False])  # the compile, then the pick timed once
    plain = GPT(GPTConfig.from_preset("tiny")).eval()
    assert cpu_tuning.compiled_decode_faster(plain, 1, flag=True) and plain.graph_caches is not None
    assert not cpu_tuning.compiled_decode_faster(plain, 1, flag=False)
    graphs.uncompile_decode(plain)
    assert plain.graph_caches is None and not plain.static_cache and "decode_step" not in vars(plain)
