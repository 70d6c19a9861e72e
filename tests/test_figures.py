"""The four figures of `python bench.py figures` (harness/figures.py) are records of what the code did: each equals
the paper's rule, written out here on its own -- Figure 3's depth-wise schedule (each request's cells are its prompt
chunks, then per token the loops up to its recorded exit, and its tokens are those of sequential decoding), Algorithm 1
of the PLT (L rows at one position per decode forward, the shared first-loop keys up to it, exactly w keys of its own
window), the Block Transformer's two levels (every earlier block for the block decoder, its own block only for the
token decoder), the double decoder's doubly-causal mask -- and a broken mechanism shows up in its record. Recording
changes no token. The command writes the four PNGs, or the text alone without matplotlib."""
import pytest
import torch

import bench
import kernels
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


def cells_of(trace, rid):
    """The cells of request rid's slot while it ran, pass by pass: ('p' | loop | 'all', token left)."""
    return [(c[1], c[2]) for _, cells in trace.passes for c in cells
            if c is not None and c[0] == rid and c[1] is not None]


def test_depthwise_schedule_is_each_requests_chunks_then_its_loops_up_to_each_exit(schedule):
    """Figure 3 from the run: a request's slot runs its prompt chunks (the last one emits the first token, after every
    loop), then for every later token the loops 0, 1, ... up to the loop its token left at (recorded in r.exits), the
    last of them emitting it; its tokens are the sequential generation's with the same exit rule. Not vacuous: rows at
    different loops share a step, tokens leave early, slots are refilled."""
    trace, served = schedule[next(k for k in schedule if k.startswith("depth-wise"))]
    van, rec = schedule["models"]
    L, chunk = schedule["loops"], schedule["chunk"]
    for r in served:
        expect = [("p", False)] * (chunks(len(r.prompt), chunk) - 1) + [("p", True)]
        assert r.exits[0] == L - 1
        for e in r.exits[1:]:
            expect += [(loop, loop == e) for loop in range(e + 1)]
        assert cells_of(trace, r.rid) == expect, r.rid
        ref, ref_exits = serve.sequential_generate(rec, r, exit_threshold=schedule["threshold"], exit_rule="softmax")
        assert r.output == ref and r.exits == ref_exits, r.rid
    steps = [[c[1] for c in cells if c is not None and c[1] is not None] for kind, cells in trace.passes
             if kind == "decode"]
    assert any(len(set(loops)) > 1 for loops in steps)  # rows at different loops in one step
    assert any(e < L - 1 for r in served for e in r.exits)  # early exits
    held = [{c[0] for _, cells in trace.passes if cells[s] is not None for c in [cells[s]]} for s in range(trace.slots)]
    assert any(len(rids) > 1 for rids in held)  # refills


def test_continuous_schedule_is_each_requests_chunks_then_one_step_per_token(schedule):
    trace, served = schedule["vanilla continuous"]
    van, _ = schedule["models"]
    for r in served:
        expect = [("p", False)] * (chunks(len(r.prompt), schedule["chunk"]) - 1) + [("p", True)]
        assert cells_of(trace, r.rid) == expect + [("all", True)] * (r.max_new_tokens - 1), r.rid
        assert r.output == serve.sequential_generate(van, r)[0], r.rid


def test_schedule_text_has_a_line_per_slot_and_a_cell_per_pass(schedule):
    trace, _ = schedule[next(k for k in schedule if k.startswith("depth-wise"))]
    lines = trace.text().splitlines()
    assert len(lines) == 2 + trace.slots and all(len(ln) == 7 + 3 * len(trace.passes) for ln in lines[1:])
    rid, what, left = trace.passes[0][1][0]  # the first pass: slot 0's first prompt chunk
    letter = chr(ord("a") + rid)
    assert what == "p" and lines[2][7:10] == f" {letter.upper() if left else letter}p"


# ----------------------------------------------------------------------------------------------------------------
# Parallel Loop Transformer, Algorithm 1


def algorithm_1(prompt_len, new_tokens, loops, window):
    """Algorithm 1 as the paper writes it: after the prefill (line 1), one forward per further token i = n ..
    n + M - 2 (0-based positions), each of L rows at position i; every row attends over the shared first-loop keys
    0..i (loop 1 wrote i in this forward), rows of loop >= 2 also over their own last w keys."""
    return [dict(pos=i, rows=loops, shared=list(range(i + 1)), own=list(range(max(0, i - window + 1), i + 1)))
            for i in range(prompt_len, prompt_len + new_tokens - 1)]


def test_plt_decode_forwards_are_algorithm_1(monkeypatch):
    d = figures.plt_forwards()
    expect = algorithm_1(d["prompt_len"], d["tokens"].size(1) - d["prompt_len"], d["loops"], d["window"])
    got = [dict(pos=f["pos"], rows=f["rows"], shared=f["layers"][0][0], own=f["layers"][0][1]) for f in d["forwards"]]
    assert got == expect
    assert all(layer == f["layers"][0] for f in d["forwards"] for layer in f["layers"])  # every layer alike
    assert len(d["forwards"][0]["layers"]) == d["n_layer"]
    cache = d["model"].new_cache(1, d["tokens"].size(1))  # no recorder: the same tokens
    assert torch.equal(d["model"].generate(d["tokens"][:, :d["prompt_len"]], len(got) + 1, cache=cache), d["tokens"])


def test_a_window_that_drops_the_current_key_shows_in_the_plt_record(monkeypatch):
    """Break the window rule where the decode step applies it (w - 1 keys, the current one left out): the record
    shows it."""
    def without_current(ring_pos, q_pos, window):
        return (ring_pos >= 0) & (ring_pos < q_pos[:, None]) & (ring_pos > q_pos[:, None] - window)

    good = figures.plt_forwards()
    monkeypatch.setattr(kernels, "ring_window_mask", without_current)
    monkeypatch.setattr(plt, "ring_window_mask", without_current)
    bad = figures.plt_forwards()
    assert [f["layers"][0][1] for f in bad["forwards"]] == [list(range(f["pos"] - good["window"] + 1, f["pos"]))
                                                            for f in bad["forwards"]]


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


# ----------------------------------------------------------------------------------------------------------------
# Block-Based Double Decoders, Figure 2


def doubly_causal(prompt_len, rollover, t):
    """The paper's rule for the partition generation makes: block 0 = the context (positions 0..n-2), then blocks of
    `rollover` tokens from the prompt's last token on. Query t sees the keys p of earlier blocks as context latents
    (cross) and those of its own block with p <= t (self). -> (cross, self) positions."""
    def block(p):
        return 0 if p < prompt_len - 1 else 1 + (p - prompt_len + 1) // rollover

    return [p for p in range(t + 1) if block(p) < block(t)], [p for p in range(t + 1) if block(p) == block(t)]


def check_double(settings):
    for s in settings:
        n = s["prompt_len"]
        assert [r["pos"] for r in s["rows"]] == list(range(n - 1, n - 1 + s["new_tokens"]))
        for r in s["rows"]:
            assert (r["cross"], r["self"]) == doubly_causal(n, s["rollover"], r["pos"]), (n, s["rollover"], r)


def test_double_decoder_generation_mask_is_doubly_causal():
    settings = figures.double_masks()
    check_double(settings)
    assert any(r["cross"] == [] for r in settings[0]["rows"])  # block 0 without context: no cross key at all
    for s in settings:
        m = s["model"]
        assert torch.equal(m.generate(s["tokens"][:, :s["prompt_len"]], s["new_tokens"], rollover=s["rollover"]),
                           s["tokens"])


def test_a_cross_key_of_a_later_block_shows_in_the_double_decoder_record(monkeypatch):
    """Break the cross rule where the masks are built (the cross keys of every other block, not only the earlier
    ones): block 0's dummy key shows up in the record, which no longer passes the doubly-causal check."""
    def leaky(q_pos, q_blk, s_pos, s_blk, c_blk):
        m_self = (s_blk[:, None, :] == q_blk[:, :, None]) & (s_pos[:, None, :] <= q_pos[:, :, None])
        return m_self[:, None], (c_blk[:, None, :] != q_blk[:, :, None])[:, None]

    monkeypatch.setattr(kernels, "dual_masks", leaky)
    with pytest.raises(AssertionError):
        check_double(figures.double_masks())


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


def test_figures_without_matplotlib_print_the_text_and_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(figures, "_pyplot", lambda: None)
    bench.main(["figures", "--out", str(tmp_path / "none")])
    out = capsys.readouterr().out
    assert "text only (matplotlib is not installed" in out and "Algorithm 1" in out
    assert not (tmp_path / "none").exists()


def test_figures_out_a_file_is_one_error_line(tmp_path, capsys):
    from conftest import one_error_line

    (tmp_path / "afile").write_text("x")
    one_error_line(capsys, bench.main, ["figures", "--out", str(tmp_path / "afile")],
                   f"--out {tmp_path / 'afile'} is a file, not a directory")
