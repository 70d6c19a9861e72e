"""
memory.py -- what a command is about to allocate, estimated before it allocates it: every command's memory check
(cli.check_memory, check_step_memory, check_model_fits) adds up these estimates and compares the total with what the
device has, so that a size no machine holds is one `error:` line, not an allocator traceback.

Every estimate is a dict {part: bytes, ..., "total": bytes} (`with_total`), and cli.check_memory names the parts of one
that cannot fit. The pieces: a model from its config alone (model_memory: weights and RoPE tables, before it is built)
or as built (module_bytes), the KV caches of decoding (model.kv_bytes, a model's kv_cache_bytes), one inference forward
(forward_memory), one training step (step_memory, least_step_memory); a command adds up its own with memory_sum. An
estimate, not a measured peak: temporaries inside a layer and allocator slack are not counted, so a run that passes
may still be tight, and one that is refused cannot fit.

What differs between architectures comes from their row of the architecture table (model.ArchSpec, found by
`arch_row` beside the config's class): `stack_params` counts a config's layer stacks, `stack_passes` how many times
one forward applies them. This file names no architecture's own config field.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from model import ArchSpec


def with_total(parts: dict) -> dict:
    """{part: bytes} -> the same with "total", their sum: the form of every memory estimate."""
    return {**parts, "total": sum(parts.values())}


def memory_sum(*estimates: dict) -> dict:
    """Estimates (with or without "total") -> one, their parts side by side (a part named twice is added up); parts of
    0 bytes are left out."""
    parts = {}
    for est in estimates:
        for k, v in est.items():
            if k != "total" and v:
                parts[k] = parts.get(k, 0) + v
    return with_total(parts)


def arch_row(cfg) -> ArchSpec | None:
    """The architecture table's row of a config: the ArchSpec of the file that defines the config's class (its
    ARCH_SPECS) whose config_cls the config is; None for a class without one."""
    specs = getattr(sys.modules.get(type(cfg).__module__), "ARCH_SPECS", ())
    return next((s for s in specs if s.config_cls is type(cfg)), None)


def param_bytes(*modules: nn.Module, buffers: bool = False) -> int:
    """Bytes of the unique parameters of the modules (tied weights once): what a forward pass reads; buffers=True
    adds their buffers (RoPE tables, masks)."""
    seen = {}
    for m in modules:
        for t in [*m.parameters(), *(m.buffers() if buffers else ())]:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def model_memory(cfg, elem: int = 4) -> dict:
    """What building a model of `cfg` allocates, from the config alone, before anything exists (cfg: a GPTConfig or
    a subclass, so that a config no machine holds is refused before its layers are even listed): its weights at
    `elem` bytes each -- embedding, head unless tied, final norm, and the layer stacks as the architecture's row counts
    them (ArchSpec.stack_params with `layers` below: a looped model's shared layers once with their per-loop LoRA, a
    Block Transformer's block decoder, embedder table and context projection; default n_layer standard layers) -- and
    its RoPE tables (float32 cos and sin of every position, and the temporaries that build them). Exact for model.GPT;
    an architecture's gates and extra norms are not counted.
    -> {"weights", "RoPE tables", "total"}"""
    hd = cfg.head_dim or cfg.n_embd // cfg.n_head
    norm = 2 if cfg.norm == "layer" else 1  # LayerNorm has a bias

    def layers(n, d=cfg.n_embd, heads=cfg.n_head, kv_heads=cfg.n_kv_head, head_dim=hd, mlp_hidden=cfg.mlp_hidden,
               loops=1, ranks=None):
        """Parameters of n standard layers (attention, MLP, two norms, biases) of these sizes, each with a LoRA of
        ranks {"q" | "kv" | "o" | "mlp": r} per loop."""
        q, k, m = heads * head_dim, kv_heads * head_dim, mlp_hidden
        mats = {"q": [(q, d)], "kv": [(k, d), (k, d)], "o": [(d, q)],
                "mlp": [(m, d)] * (1 if cfg.mlp == "gelu" else 2) + [(d, m)]}
        per = sum(o * i for shapes in mats.values() for o, i in shapes) + 2 * norm * d
        per += (q + 2 * k + d) * cfg.attn_bias + (m * (len(mats["mlp"]) - 1) + d) * cfg.mlp_bias
        per += sum(loops * r * (o + i) for c, r in (ranks or {}).items() for o, i in mats[c])  # LoRA, per loop
        return n * per

    row = arch_row(cfg)
    weights = row.stack_params(cfg, layers) if row is not None and row.stack_params else layers(cfg.n_layer)
    weights += cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2) + norm * cfg.n_embd
    return with_total({"weights": weights * elem, "RoPE tables": 4 * cfg.max_seq_len * hd * 4})


def module_bytes(*modules: nn.Module) -> int:
    """Bytes of built modules: their unique parameters and buffers (RoPE tables, masks)."""
    return param_bytes(*modules, buffers=True)


def forward_memory(cfg, batch: int, seq_len: int, elem: int = 4, logits_rows: int | None = None,
                   fp32_copies: int = 0) -> dict:
    """The largest tensors one inference forward (no gradients) of batch x seq_len tokens holds at once: the logits
    of `logits_rows` positions (default all batch x seq_len; a prefill scores only each row's last: batch) in the
    compute dtype, plus `fp32_copies` float32 copies of them (a loss upcasts them and takes their log-softmax: 2), and
    the hidden states of one layer (the residual stream and its normed copy, the MLP's inner activations).
    -> {"logits", "hidden states", "total"}"""
    rows = batch * seq_len if logits_rows is None else logits_rows
    return with_total({"logits": rows * cfg.vocab_size * (elem + 4 * fp32_copies),
                       "hidden states": batch * seq_len * (2 * cfg.n_embd + 3 * cfg.mlp_hidden) * elem})


def optimizer_bytes(model: nn.Module) -> int:
    """Gradients and AdamW's two moments: 3 x the bytes of the trainable parameters."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def saved_activation_bytes(model, spec: ArchSpec, B, T, n_vocab, device, autocast) -> tuple[int, float]:
    """One training forward of a (B, T) random batch (laid out by spec.prepare_batch) under saved_tensors_hooks ->
    (bytes autograd saves for the backward pass, parameters excluded and each storage counted once, logits bytes per
    token). The RNG state is left as it was."""
    gen = torch.Generator().manual_seed(0)
    xy = torch.randint(0, n_vocab, (B, T + 1), generator=gen)
    x, y, kw = xy[:, :-1], xy[:, 1:], {}
    if spec.prepare_batch is not None:
        x, y, kw = spec.prepare_batch(x, y, gen, model.config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        logits, loss = model(x.to(device), y.to(device), **kw)
    logit_bytes = logits.numel() * logits.element_size() / (B * T)
    del logits, loss
    model.train(was_training)
    return sum(seen.values()), logit_bytes


def step_memory(model, spec: ArchSpec, batch, seq_len, n_vocab, device, autocast, teacher=False) -> dict:
    """Bytes one training step of batch x seq_len tokens needs on top of the weights (which are in place already):
      * activations: what autograd keeps for the backward pass, probed (saved_activation_bytes) on one row at
        T = min(seq_len, 64) and T/2, fitted as a*T + c*T^2 (c > 0 where a path materialises a T x T attention matrix
        or mask; flash/SDPA paths give c = 0) and scaled to batch x seq_len;
      * one more logits-sized tensor for the gradient of the loss, and the teacher's logits with KD;
      * gradients and AdamW's moments (optimizer_bytes)."""
    T1 = min(seq_len, 64)
    b1, logit_bytes = saved_activation_bytes(model, spec, 1, T1, n_vocab, device, autocast)
    per_tok, quad = b1 / T1, 0.0
    if T1 >= 16:
        T2 = T1 // 2
        b2, _ = saved_activation_bytes(model, spec, 1, T2, n_vocab, device, autocast)
        quad = max(0.0, (b1 / T1 - b2 / T2) / (T1 - T2))
        per_tok = b1 / T1 - quad * T1
    B, T = batch, seq_len
    parts = {"activations": B * (per_tok * T + quad * T * T), "loss gradient": B * T * logit_bytes,
             "gradients + AdamW moments": optimizer_bytes(model)}
    if teacher:
        parts["teacher logits"] = B * T * logit_bytes
    return with_total(parts)


def least_step_memory(batch, seq_len, vocab_rows, dtype, model=None) -> dict:
    """A lower bound of one training step's bytes from sizes alone, checked before anything that grows with them is
    built or probed (a --seq-len of 1e8 would build RoPE tables of gigabytes, --loops 100000 would exhaust memory
    inside the probe of step_memory): the logits of the batch and their gradient (B x T x V each, in the compute
    dtype, which bounds the T x rot_dim RoPE tables too), and, given the model, the input of every block application
    that autograd keeps for the backward pass (B x T x n_embd per layer and pass: ArchSpec.stack_passes)."""
    B, T, elem = batch, seq_len, torch.finfo(dtype).bits // 8
    parts = {"logits and their gradient": 2 * B * T * vocab_rows * elem}
    if model is not None:
        cfg, blocks, row = model.config, getattr(model, "blocks", None), arch_row(model.config)
        passes = row.stack_passes(cfg) if row is not None and row.stack_passes else 1
        applied = (len(blocks) if isinstance(blocks, nn.ModuleList) else cfg.n_layer) * passes
        parts[f"block inputs ({applied} block applications)"] = B * T * applied * cfg.n_embd * elem
    return with_total(parts)
