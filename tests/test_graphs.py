"""graphs.py's CapturedStep on a CPU: the code path of a CUDA graph of the eager step (its signatures, its recorded
arguments, its copies) without the graph. Every architecture's decode records one graph per step kind and batch
bucket on its static cache, replays it copying in the token ids alone (no weight, no cache: what torch's "cudagraphs"
backend copied at every step), and gives the eager tokens; a step that would not replay as recorded is refused."""
import copy

import pytest
import torch

import block_transformer as bt
import double_decoder as dd
import graphs
import plt
from model import GPT, GPTConfig


def models():
    torch.manual_seed(0)
    return {"vanilla": GPT(GPTConfig.from_preset("tiny")).eval(),
            "plt": plt.PLT(plt.PLTConfig(**{**plt.PRESETS["tiny"], "max_seq_len": 64})).eval(),
            "block": bt.BlockTransformer(bt.BlockConfig.from_preset("tiny")).eval(),
            "double": dd.DoubleDecoder(dd.DoubleConfig(**{**dd.PRESETS["tiny"], "max_seq_len": 64})).eval()}


@pytest.mark.parametrize("arch", ["vanilla", "plt", "block", "double"])
def test_captured_decode_replays_copying_only_the_token_ids(arch):
    """Two generations of 3 rows (bucket 4) and one of 1 row: the eager tokens; one record per step kind and bucket
    (Block: token_step and block_end_step; double with rollover: token_step and rollover_step), none more for the
    second generation (the same static cache, the same addresses); every replay copied 4 x 8 bytes (or 1 x 8): the
    token ids, nothing else."""
    m = models()[arch]
    kw = {"rollover": 4} if arch == "double" else {}
    a, b = torch.randint(0, 100, (3, 8)), torch.randint(0, 100, (1, 5))
    ref_a, ref_b = m.generate(a, 9, **kw), m.generate(b, 9, **kw)
    c = graphs.compile_decode(copy.deepcopy(m), "capture")
    steps = [getattr(c, name) for name in c.graph_steps]
    assert all(isinstance(s, graphs.CapturedStep) for s in steps)
    assert torch.equal(c.generate(a, 9, **kw), ref_a) and torch.equal(c.generate(a, 9, **kw), ref_a)
    assert [len(s.graphs) for s in steps] == [1] * len(steps)  # one per kind at bucket 4, kept by the second call
    assert all(s.copied and set(s.copied) == {4 * 8} for s in steps), [s.copied for s in steps]
    for s in steps:
        s.copied.clear()
    assert torch.equal(c.generate(b, 9, **kw), ref_b)
    assert [len(s.graphs) for s in steps] == [2] * len(steps) and all(set(s.copied) == {8} for s in steps)
    assert sorted(c.graph_caches) == [1, 4]


def test_a_cache_whose_tensors_moved_is_recorded_again_never_replayed_stale():
    """The signature holds the address of every tensor of the cache: a step given a cache whose lengths tensor was
    replaced (a new address a recorded graph would not read) is recorded anew."""
    m = models()["vanilla"]
    step = graphs.CapturedStep(m.decode_step)
    cache = m.new_cache(2, 16, static=True)
    m.prefill(torch.randint(0, 100, (2, 3)), cache)
    tok = torch.zeros(2, dtype=torch.long)
    step(tok, cache)
    step(tok, cache)
    assert len(step.graphs) == 1 and step.copied == [16]
    cache.lengths = cache.lengths.clone()
    step(tok, cache)
    assert len(step.graphs) == 2


def test_a_step_that_changes_host_state_is_refused():
    """A replay runs the recorded kernels only: a step that moves a host count of its cache (here the Block
    Transformer's decode_step, which counts the block's tokens and picks the step kind) cannot be recorded."""
    m = models()["block"]
    cache = m.new_cache(1, 16, static=True)
    m.prefill(torch.randint(0, 100, (1, 4)), cache)
    with pytest.raises(ValueError, match=r"decode_step changed BlockCache.k on the host"):
        graphs.CapturedStep(m.decode_step)(torch.zeros(1, dtype=torch.long), cache)


def test_compiled_cpu_decode_is_one_inductor_graph_per_bucket_with_the_eager_tokens():
    """graphs.compile_decode on a CPU: inductor's C++ backend with frozen weights (graphs.CPU_OPTIONS), compiled with
    fullgraph=True (a graph break would be an error), one graph for every step of a batch bucket -- none more for a
    second generation, another prompt length or another batch of the bucket -- and the eager greedy tokens."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, vocab_size=256,
                      max_seq_len=64)).eval()
    a, b = torch.randint(0, 256, (2, 5)), torch.randint(0, 256, (1, 9))
    ref_a, ref_b = m.generate(a, 7), m.generate(b, 4)
    counters.clear()
    graphs.compile_decode(m)
    assert graphs.CPU_OPTIONS["freezing"] and m.decode_step._torchdynamo_orig_callable
    assert torch.equal(m.generate(a, 7), ref_a) and torch.equal(m.generate(a, 7), ref_a)
    assert torch.equal(m.generate(b, 4), ref_b)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # buckets 2 and 1
    assert sorted(m.graph_caches) == [1, 2]
    with graphs.eager_decode(m):  # the eager step again for a with block
        assert m.graph_caches is None and torch.equal(m.generate(a, 7), ref_a)
    assert sorted(m.graph_caches) == [1, 2] and counters["stats"]["unique_graphs"] == 2
