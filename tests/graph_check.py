"""What the CPU can prove about a graph-safe step before it meets a GPU: a torch.compile backend that counts the
graphs compiled (one per step kind and shape: a second one for the same shape is a recompile), lists every graph
input the step mutates that is not marked static (graphs.mark_static) -- on CUDA, torch skips the CUDA graph of such a
step ("skipping cudagraphs due to mutated inputs") -- and every op that reads a device value back to the host (int(t),
t.item(), bool(t), .tolist(), nonzero, boolean-mask indexing): torch traces these into the graph without a break, but
each is a host sync, and a CUDA graph cannot hold one. Graph breaks need no counter: graphs.compile_step compiles with
fullgraph=True, so a break is an error."""
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from graphs import compile_decode


def reads_back(node) -> bool:
    """An op whose result holds a number (a value or a size) that none of its inputs held: the host must read it from
    the device ("unbacked" in torch's terms)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    known = set().union(*(free_unbacked_symbols(a.meta.get("val")) for a in node.all_input_nodes))
    return bool(free_unbacked_symbols(node.meta.get("val")) - known)


class GraphCheck:
    """backend=GraphCheck() for graphs.compile_step: .graphs (frames compiled), .unsafe (names of mutated inputs that
    are neither parameters, buffers nor static addresses), .syncs (ops that read a device value back to the host),
    .ops (every op the graphs call). The graphs run as traced (no kernels generated)."""

    def __init__(self):
        self.graphs, self.unsafe, self.syncs, self.ops = 0, [], [], set()

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops.update(str(n.target) for n in gm.graph.nodes)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

        def forward_compiler(fgm, _inputs):
            for i, info in enumerate(TracingContext.get().fw_metadata.input_info):
                if info.mutates_data or info.mutates_metadata:
                    if getattr(example_inputs[i], "_dynamo_static_input_type", None) is None:
                        self.unsafe.append(names[i])
            self.syncs += [str(n.target) for n in fgm.graph.nodes if reads_back(n)]
            return fgm.forward

        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)


def check_compiled_generate(model, idx, max_new_tokens: int, graphs: int, again: bool = True, **kwargs) -> GraphCheck:
    """What every architecture's compiled decode passes: the eager greedy tokens of generate(idx, max_new_tokens,
    **kwargs), then compile_decode(backend=GraphCheck()): the same tokens in `graphs` graphs (one per step kind), no
    mutated input left unmarked, no read-back; again: a second generation gives them on the same static caches
    (graphs.StaticCaches' reuse) with no graph more. -> the GraphCheck, for a test's further assertions."""
    ref = model.generate(idx, max_new_tokens, **kwargs)
    check = GraphCheck()
    compile_decode(model, backend=check)
    assert torch.equal(model.generate(idx, max_new_tokens, **kwargs), ref)
    assert check.graphs == graphs and check.unsafe == [] and check.syncs == [], (check.unsafe, check.syncs)
    if again:
        caches = dict(model.graph_caches)
        assert torch.equal(model.generate(idx, max_new_tokens, **kwargs), ref) and check.graphs == graphs
        assert caches and all(model.graph_caches[rows] is c for rows, c in caches.items())
    return check
