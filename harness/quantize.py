"""
quantize.py -- weight-only int8 for the decode path (gpt-fast's quantize.py, "int8 weight-only"), an opt-in.

A batch-1 decode step reads every weight once for one row of activations: its time is the weight bytes over the
memory bandwidth. Stored as int8 with one scale per output channel, the products read a quarter of fp32's bytes and
half of bf16's; the activations, the norms, the embedding table (one row is read per token) and the KV cache stay in
the model's dtype:

    s_j = max_i |W_ji| / 127                    (symmetric, per output channel j; an all-zero row gets s_j = 1)
    Q_ji = round(W_ji / s_j) in [-127, 127]     (int8)
    y_j = s_j * sum_i x_i Q_ji (+ b_j)          (on a CPU: torch's _weight_int8pack_mm, which inductor keeps too)

Each weight moves by at most s_j / 2, so an output moves by at most s_j / 2 * sum_i |x_i| (the bound
tests/test_quantize.py checks). The fp model stays the reference: int8_weights converts a model in place, and only
when a command asks (`python bench.py decode` times it beside the fp model; `python eval.py loss --int8` gives its
quality cost on the fixed evaluation set; RESULTS.md has both). A converted model is for inference: it has no
gradients and is not saved.

Run:
    python bench.py decode --weights smollm2-135m    # fp eager / compiled / int8 vs transformers and llama.cpp
    python eval.py loss --model smollm2-135m --int8   # the loss on the fixed evaluation set, int8 products
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

QMAX = 127  # symmetric: -127..127 (-128 unused, so that -W and W quantize alike)
GEMV_ROWS = 16  # int8_linear's int8 kernel up to this many rows (a decode step), a dequantized F.linear above


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) float -> (Q (out, in) int8, scales (out,) float32): s_j = max_i |W_ji| / 127, Q = round(W / s)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scales


def int8_linear(x, qweight, scales, bias=None):
    """x W^T (+ b) with W = scales[:, None] * qweight: x (..., in), qweight (out, in) int8, scales (out,) in x's dtype.
    On a CPU in fp32 / bf16 / fp16 with at most GEMV_ROWS rows (decoding) torch's int8 product (_weight_int8pack_mm:
    no dequantized copy of W); otherwise (a prefill, an evaluation: a matrix product, which that kernel is not) the
    weight dequantized to x's dtype, then F.linear and the scales (gpt-fast's form)."""
    rows = x.numel() // max(x.size(-1), 1)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < rows <= GEMV_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.size(-1)).contiguous(), qweight, scales)
        y = y.reshape(*x.shape[:-1], qweight.size(0))
    else:
        y = F.linear(x, qweight.to(x.dtype)) * scales
    return y if bias is None else y + bias


class Int8Linear(nn.Module):
    """model.Linear's interface (forward(x, lora_idx=None)) over an int8 weight with per-output-channel scales.
    `weight` is an empty tensor of the model's dtype on its device: what reads a model's dtype and device from a
    weight (model.GPT.new_cache reads its head's) reads the right ones."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, s = quantize_per_channel(linear.weight)
        dtype, device = linear.weight.dtype, linear.weight.device
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scales", s.to(device=device, dtype=dtype))
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x, lora_idx=None):
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def int8_weights(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` (model.Linear: the projections, the MLP, the head; a head tied to the embedding gets
    an int8 copy, the embedding table stays) replaced by an Int8Linear of its weight, in place -> model. A LoRA layer
    (svd_lora.LoRALinear) is refused: its per-loop deltas would be left out."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if type(child).__name__ == "LoRALinear":
                    raise ValueError("int8_weights converts plain Linear layers; this model has LoRA layers")
                setattr(module, name, Int8Linear(child))
    return model


def int8_bytes(model: nn.Module) -> int:
    """Bytes of the int8 weights and their scales of a converted model (what its products read per token)."""
    return sum(m.qweight.numel() + m.scales.numel() * m.scales.element_size() for m in model.modules()
               if isinstance(m, Int8Linear))
