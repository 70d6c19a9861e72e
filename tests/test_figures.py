"""The four figures of `python bench.py figures` (harness/figures.py) are records of what the code did: each equals
the paper's rule, written out here on its own, and a broken mechanism shows up in its record.

  * Figure 3 of the recursive paper: static batching admits a batch only once every slot is free; continuous batching
    runs each request's chunks then one pass per token; depth-wise batching each token's loops up to its recorded exit;
    the same tokens come out of all four servers, and on the time axis in loop-steps (a vanilla pass as wide as its
    loops, a depth-wise pass one loop) depth-wise with exit < depth-wise without exit < static batching.
  * Algorithm 1 of the PLT: L rows at one position per decode forward, the shared first-loop keys up to it, exactly w
    keys of its own window; Algorithm 3's gate is recorded per row and head.
  * Figure 1 of the Block Transformer: every earlier block for the block decoder, its own block only for the token
    decoder.
  * Figure 2 of the double decoder: the training forward's mask is the doubly-causal rule of its partition, and
    generation attends under the same rows.

Recording changes no token and leaves nothing behind: the paper files hold no trace field and the hooks are gone after
a record. The command writes the four PNGs, or says in one line that they need matplotlib."""
import sys

import pytest
import torch

import bench
import double_decoder
import plt
import serve
from harness import figures


def chunks(n: int, size: int) -> int:
    return -(-n // size)


# ----------------------------------------------------------------------------------------------------------------
# Relaxed Recursive Transformers, Figure 3


@pytest.fixture(scope="module")
def schedule():
    return figures.depthwise()


def panel(schedule, letter):
    return next(p for p in schedule["panels"] if p["label"].startswith(f"({letter})"))


def cells_of(trace, rid):
    """The cells of request rid's slot while it ran, pass by pass: ('p' | loop | 'all', token left)."""
    return [(c[1], c[2]) for _, cells in trace.passes for c in cells
            if c is not None and c[0] == rid and c[1] is not None]


def prefill_cells(r, chunk):
    return [("p", False)] * (chunks(len(r.prompt), chunk) - 1) + [("p", True)]


@pytest.mark.parametrize("letter,exits", [("c", False), ("d", True)])
def test_depthwise_schedule_is_each_requests_chunks_then_its_loops_up_to_each_exit(schedule, letter, exits):
    """Figure 3 from the run: a request's slot runs its prompt chunks (the last one emits the first token, after every
    loop), then for every later token the loops 0, 1, ... up to the loop its token left at (recorded in r.exits), the
    last of them emitting it; its tokens are the sequential generation's with the same exit rule. Without a threshold
    every token runs every loop. Not vacuous: slots are refilled, and with exits tokens leave early and rows at
    different loops share a step."""
    p = panel(schedule, letter)
    trace, served = p["trace"], p["served"]
    _, rec = schedule["models"]
    L, thr = schedule["loops"], schedule["threshold"] if exits else None
    for r in served:
        expect = prefill_cells(r, schedule["chunk"])
        assert r.exits[0] == L - 1
        for e in r.exits[1:]:
            expect += [(loop, loop == e) for loop in range(e + 1)]
        assert cells_of(trace, r.rid) == expect, r.rid
        ref, ref_exits = serve.sequential_generate(rec, r, exit_threshold=thr, exit_rule="softmax")
        assert r.output == ref and r.exits == ref_exits, r.rid
    steps = [[c[1] for c in cells if c is not None and c[1] is not None] for kind, cells in trace.passes
             if kind == "decode"]
    # with exits, rows at different loops share a step (without, every request queued from the start, they run in
    # step: a slot frees only after a token's last loop); tokens leave early only with the threshold
    assert any(len(set(loops)) > 1 for loops in steps) == exits
    assert any(e < L - 1 for r in served for e in r.exits) == exits
    held = [{c[0] for _, cells in trace.passes if cells[s] is not None for c in [cells[s]]} for s in range(trace.slots)]
    assert any(len(rids) > 1 for rids in held)  # refills


@pytest.mark.parametrize("letter", ["a", "b"])
def test_vanilla_schedules_are_each_requests_chunks_then_one_pass_per_token(schedule, letter):
    p = panel(schedule, letter)
    van, _ = schedule["models"]
    for r in p["served"]:
        expect = prefill_cells(r, schedule["chunk"]) + [("all", True)] * (r.max_new_tokens - 1)
        assert cells_of(p["trace"], r.rid) == expect, r.rid
        assert r.output == serve.sequential_generate(van, r)[0], r.rid


def test_static_batching_admits_a_batch_only_once_every_slot_is_free(schedule):
    """Static batching (the paper's (a)): the requests go in batches of `slots`, in order, and no pass holds requests
    of two batches; continuous batching (b) does mix them."""
    S = schedule["slots"]

    def batches_in_passes(p):
        return [{c[0] // S for c in cells if c is not None} for _, cells in p["trace"].passes]

    static = batches_in_passes(panel(schedule, "a"))
    assert all(len(b) == 1 for b in static)
    order = [min(b) for b in static]
    assert order == sorted(order) and order[-1] == (len(schedule["requests"]) - 1) // S
    assert any(len(b) > 1 for b in batches_in_passes(panel(schedule, "b")))


def test_depthwise_with_exit_takes_fewer_loop_steps_than_without_than_static_batching(schedule):
    """The figure's time axis, the rule written out: a pass in which a row ran one loop of the recursive model is one
    loop-step; a prefill chunk or a vanilla pass (every layer) is L loop-steps. All four servers produce the same
    tokens (every request its max_new_tokens); in loop-steps depth-wise with exit < depth-wise without < static
    batching -- Figure 3's (c) < (b) < (a) -- and the figure prints those numbers."""
    L = schedule["loops"]
    want = sum(r.max_new_tokens for r in schedule["requests"])
    steps = {}
    for p in schedule["panels"]:
        width = [1 if kind == "decode" and any(c is not None and c[1] not in (None, "all", "p") for c in cells) else L
                 for kind, cells in p["trace"].passes]
        steps[p["label"][1]] = sum(width)
        assert p["loop_steps"] == sum(width) and p["tokens"] == want == sum(len(r.output) for r in p["served"])
        assert f"{p['loop_steps']} loop-steps, {p['tokens']} tokens" in figures.depthwise_text(schedule)
    assert steps["d"] < steps["c"] < steps["a"], steps
    assert steps["b"] < steps["a"]
    left, decoded = figures.early_exits(schedule)
    assert 0 < left < decoded and f"{left} of {decoded} decoded tokens leave after loop 1" in \
        figures.depthwise_text(schedule)


def test_schedule_text_has_a_line_per_slot_a_cell_per_pass_and_no_raw_threshold(schedule):
    p = panel(schedule, "d")
    trace = p["trace"]
    lines = trace.text().splitlines()
    assert len(lines) == 2 + trace.slots and all(len(ln) == 7 + 3 * len(trace.passes) for ln in lines[1:])
    rid, what, left = trace.passes[0][1][0]  # the first pass: slot 0's first prompt chunk
    letter = chr(ord("a") + rid)
    assert what == "p" and lines[2][7:10] == f" {letter.upper() if left else letter}p"
    assert f"{schedule['threshold']:.3g}" not in figures.depthwise_text(schedule)


# ----------------------------------------------------------------------------------------------------------------
# Parallel Loop Transformer, Algorithms 1 and 3


def algorithm_1(prompt_len, new_tokens, loops, window):
    """Algorithm 1 as the paper writes it: after the prefill (line 1), one forward per further token i = n ..
    n + M - 2 (0-based positions), each of L rows at position i; every row attends over the shared first-loop keys
    0..i (loop 1 wrote i in this forward), rows of loop >= 2 also over their own last w keys."""
    return [dict(pos=i, rows=loops, shared=list(range(i + 1)), own=list(range(max(0, i - window + 1), i + 1)))
            for i in range(prompt_len, prompt_len + new_tokens - 1)]


def plt_record(d):
    return [dict(pos=f["pos"], rows=f["rows"], shared=f["layers"][0][0], own=f["layers"][0][1]) for f in d["forwards"]]


def test_plt_decode_forwards_are_algorithm_1():
    d = figures.plt_forwards()
    expect = algorithm_1(d["prompt_len"], d["tokens"].size(1) - d["prompt_len"], d["loops"], d["window"])
    assert plt_record(d) == expect
    assert all(layer == f["layers"][0] for f in d["forwards"] for layer in f["layers"])  # every layer alike
    assert len(d["forwards"][0]["layers"]) == d["n_layer"]
    for f in d["forwards"]:  # Algorithm 3's gate: one g in (0, 1) per later loop and head (random gates: they differ)
        assert len(f["gates"]) == d["loops"] - 1 and all(0 < g < 1 for row in f["gates"] for g in row)
    assert len({round(g, 4) for f in d["forwards"] for row in f["gates"] for g in row}) > 1
    cache = d["model"].new_cache(1, d["tokens"].size(1))  # no recorder: the same tokens
    assert torch.equal(d["model"].generate(d["tokens"][:, :d["prompt_len"]], len(expect) + 1, cache=cache),
                       d["tokens"])


def test_a_ring_that_evicts_the_wrong_slot_shows_in_the_plt_record(monkeypatch):
    """Break the window's bookkeeping where decoding keeps it (the ring writes position i into the slot of i + 1,
    evicting a key the window still needs): the first forward's window shows w - 1 keys."""
    def wrong_slot(self, q_pos):
        self.pos[self.rows, (q_pos + 1) % self.window] = q_pos

    monkeypatch.setattr(plt.RingKV, "advance", wrong_slot)
    bad = figures.plt_forwards()
    first = bad["forwards"][0]
    assert first["layers"][0][1] == list(range(first["pos"] - bad["window"] + 2, first["pos"] + 1))


def test_a_shared_mask_that_hides_the_current_key_shows_in_the_plt_record(monkeypatch):
    """Break the decode step's causal mask over the shared cache (key j visible iff j < i): the record shows it."""
    def strict(q_pos, kv_len):
        return (torch.arange(kv_len, device=q_pos.device) < q_pos[..., None])[:, None]

    monkeypatch.setattr(plt, "causal_mask_from_positions", strict)
    bad = figures.plt_forwards()
    assert [f["layers"][0][0] for f in bad["forwards"]] == [list(range(f["pos"])) for f in bad["forwards"]]


# ----------------------------------------------------------------------------------------------------------------
# Block Transformer, Figure 1


def test_block_token_decoder_reads_only_its_block_and_the_block_decoder_every_earlier_block():
    """To predict token g of block b: the block decoder read blocks 0..b-1 (the context embedding of block b), the token
    decoder block b's P prefix vectors and block b's tokens before g -- never a token of another block."""
    d = figures.block_fields()
    L, P = d["block_len"], d["prefix_len"]
    assert [f["token"] for f in d["fields"]] == list(range(d["prompt_len"], d["tokens"].size(1)))
    for f in d["fields"]:
        b = f["token"] // L
        assert f["block_keys"] == list(range(b)), f
        own_block = [("token", p) for p in range(b * L, f["token"])]
        assert f["token_keys"] == [("prefix", b, j) for j in range(P)] + own_block, f
    m = d["model"]
    assert torch.equal(m.generate(d["tokens"][:, :d["prompt_len"]], len(d["fields"])), d["tokens"])
    text = figures.block_text(d).splitlines()
    assert text[-1].split()[-1] == "PPoo^" and "------" in text[-1]  # the last token; the prompt's blocks not run


# ----------------------------------------------------------------------------------------------------------------
# Block-Based Double Decoders, Figure 2


def partition_rule(splits, T):
    """The paper's rule for a partition 0 = b_0 < b_1 < ... < b_K = T: the query at t in block k attends the context
    latents of every position in blocks m < k (cross) and its own block's positions s <= t (self)."""
    def block(p):
        return sum(b <= p for b in splits)

    return [dict(pos=t, self=[p for p in range(t + 1) if block(p) == block(t)],
                 cross=[p for p in range(T) if block(p) < block(t)]) for t in range(T)]


def generation_rule(prompt_len, rollover, t):
    """The partition generation makes: block 0 = the context (positions 0..n-2), then blocks of `rollover` tokens from
    the prompt's last token on. Query t sees the keys p of earlier blocks as context latents (cross) and those of its
    own block with p <= t (self). -> (cross, self) positions."""
    def block(p):
        return 0 if p < prompt_len - 1 else 1 + (p - prompt_len + 1) // rollover

    return [p for p in range(t + 1) if block(p) < block(t)], [p for p in range(t + 1) if block(p) == block(t)]


def check_double(d):
    tr = d["training"]
    T = tr["tokens"].size(1)
    for rows in tr["layers"]:
        assert rows == partition_rule(tr["splits"], T)
    for s in d["generation"]:
        n = s["prompt_len"]
        for rows in s["layers"]:
            assert [r["pos"] for r in rows] == list(range(n - 1, n - 1 + s["new_tokens"]))
            for r in rows:
                assert (r["cross"], r["self"]) == generation_rule(n, s["rollover"], r["pos"]), (n, s["rollover"], r)


def test_double_decoder_training_mask_is_the_doubly_causal_rule_of_its_partition_and_generation_uses_its_rows():
    """The training forward over the paper's 7 tokens with the partition (0, 2, 5, 7) attends, in every generation
    layer, under the doubly-causal rule of that partition: [BOS, A] without context, [B, C, D] with [BOS, A], [E, F]
    with all five. Generation from [BOS, A, B] with a new block every 3 tokens attends under the same rows."""
    d = figures.double_masks()
    check_double(d)
    tr, gen = d["training"], d["generation"][0]
    assert tr["splits"] == (2, 5) and len(tr["layers"]) == d["model"].config.gen_layers == 2
    assert gen["layers"][0] == tr["layers"][0][gen["prompt_len"] - 1:]
    assert any(r["cross"] == [] for r in d["generation"][1]["layers"][0])  # block 0 without context: no cross key
    for s in d["generation"]:
        assert torch.equal(d["model"].generate(s["tokens"][:, :s["prompt_len"]], s["new_tokens"],
                                               rollover=s["rollover"]), s["tokens"])


def test_a_cross_key_of_a_later_block_shows_in_the_double_decoder_record(monkeypatch):
    """Break the cross rule where the masks are built (the cross keys of every other block, not only the earlier
    ones): the training record no longer passes the doubly-causal check."""
    def leaky(q_pos, q_blk, s_pos, s_blk, c_blk):
        m_self = (s_blk[:, None, :] == q_blk[:, :, None]) & (s_pos[:, None, :] <= q_pos[:, :, None])
        return m_self[:, None], (c_blk[:, None, :] != q_blk[:, :, None])[:, None]

    monkeypatch.setattr(figures.kernels, "dual_masks", leaky)
    with pytest.raises(AssertionError):
        check_double(figures.double_masks())


def test_recording_leaves_nothing_in_the_models():
    """The paper files carry no trace field; the harness's hooks are removed once a figure is recorded."""
    assert not hasattr(plt.PLTCache, "trace") and not hasattr(double_decoder.DoubleCache, "trace")
    for m in (figures.plt_forwards()["model"], figures.double_masks()["model"]):
        assert not any(mod._forward_pre_hooks for mod in m.modules())


# ----------------------------------------------------------------------------------------------------------------
# The command


def test_figures_command_prints_four_grids_and_writes_four_pngs(tmp_path, capsys):
    bench.main(["figures", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for head in ("Figure 3", "Algorithm 1", "Block Transformer, Figure 1", "Double Decoders, Figure 2"):
        assert head in out
    pngs = sorted(p.name for p in tmp_path.iterdir())
    assert pngs == ["block.png", "depthwise.png", "double.png", "plt.png"]
    assert all((tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_figures_without_matplotlib_print_the_grids_and_one_line_that_the_pngs_need_it(tmp_path, capsys,
                                                                                       monkeypatch):
    """matplotlib hidden (an import of it fails, as where it is not installed): the text grids, then one line saying
    that the PNGs need matplotlib; nothing written."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bench.main(["figures", "--out", str(tmp_path / "none")])
    out = capsys.readouterr().out
    for grid in ("slot 0  Ap", "shared loop-1 cache", "PPoo^", "xxxxxss"):
        assert grid in out
    assert [line for line in out.splitlines() if "matplotlib" in line] == [
        line for line in out.splitlines() if "the PNGs need matplotlib (pip install matplotlib)" in line]
    assert len([line for line in out.splitlines() if "matplotlib" in line]) == 1
    assert not (tmp_path / "none").exists()


def test_figures_out_a_file_is_one_error_line(tmp_path, capsys):
    from conftest import one_error_line

    (tmp_path / "afile").write_text("x")
    one_error_line(capsys, bench.main, ["figures", "--out", str(tmp_path / "afile")],
                   f"--out {tmp_path / 'afile'} is a file, not a directory")
