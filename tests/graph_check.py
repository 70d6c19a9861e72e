"""What the CPU can prove about a graph-safe step before it meets a GPU: a torch.compile backend that counts the
graphs compiled (one per step kind and shape: a second one for the same shape is a recompile) and lists every graph
input the step mutates that is not marked static (model.mark_static) -- on CUDA, torch skips the CUDA graph of such a
step ("skipping cudagraphs due to mutated inputs"). Graph breaks need no counter: model.compile_step compiles with
fullgraph=True, so a break is an error."""
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext


class GraphCheck:
    """backend=GraphCheck() for model.compile_step: .graphs (frames compiled), .unsafe (names of mutated inputs that
    are neither parameters, buffers nor static addresses). The graphs run as traced (no kernels generated)."""

    def __init__(self):
        self.graphs, self.unsafe = 0, []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

        def forward_compiler(fgm, _inputs):
            for i, info in enumerate(TracingContext.get().fw_metadata.input_info):
                if info.mutates_data or info.mutates_metadata:
                    if getattr(example_inputs[i], "_dynamo_static_input_type", None) is None:
                        self.unsafe.append(names[i])
            return fgm.forward

        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)
