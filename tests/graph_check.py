"""What the CPU can prove about a graph-safe step before it meets a GPU: a torch.compile backend that counts the
graphs compiled (one per step kind and shape: a second one for the same shape is a recompile) and lists every graph
input the step mutates that is not marked static (model.mark_static) -- on CUDA, torch skips the CUDA graph of such a
step ("skipping cudagraphs due to mutated inputs"), and every value in a graph that depends on tensor data (an
.item() / int(t), nonzero, a boolean-mask index: a host sync or a data-dependent shape, which dynamo traces into the
graph and which a CUDA graph cannot hold). Graph breaks need no counter: model.compile_step compiles with
fullgraph=True, so a break is an error."""
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_leaves


class GraphCheck:
    """backend=GraphCheck() for model.compile_step: .graphs (frames compiled), .unsafe (names of mutated inputs that
    are neither parameters, buffers nor static addresses), .data_dependent (names of the graph's nodes whose value or
    shape depends on tensor data). The graphs run as traced (no kernels generated)."""

    def __init__(self):
        self.graphs, self.unsafe, self.data_dependent = 0, [], []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.data_dependent += [n.name for n in gm.graph.nodes
                                if any(free_unbacked_symbols(v) for v in tree_leaves(n.meta.get("example_value")))]

        def forward_compiler(fgm, _inputs):
            for i, info in enumerate(TracingContext.get().fw_metadata.input_info):
                if info.mutates_data or info.mutates_metadata:
                    if getattr(example_inputs[i], "_dynamo_static_input_type", None) is None:
                        self.unsafe.append(names[i])
            return fgm.forward

        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)
