"""hf.from_pretrained (hf.py) against transformers' own Llama, Gemma and GPT-NeoX.

Each family is built tiny and random with transformers (odd sizes, GQA/MQA, head_dim != d / n_head, partial rotary,
both NeoX residual layouts), saved with save_pretrained, loaded with hf.from_pretrained, and compared in fp32: logits
on random ids, and greedy generation (our prefill + cached decode vs transformers' generate). Then the bad
directories, the checkpoint's tokenizer.json in train.py, `train.py --init-from hf:DIR --teacher DIR`, and
`python -m harness.hf DIR`. transformers and tokenizers are dev-only dependencies (requirements-dev.txt).
"""
import json
import sys
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GemmaConfig, GemmaForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                          LlamaForCausalLM)

import train
from conftest import write_jsonl
from harness import checkpoint, data, hf

V = 131  # an odd vocabulary
COMMON = dict(vocab_size=V, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # GQA 6/2, untied head, attention and MLP biases, a non-default rope theta
    "llama-gqa-bias": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=60, intermediate_size=83, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # tied embeddings, head_dim 16 != 60 / 6, GQA 6/3
    "llama-tied-headdim": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=60, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, tie_word_embeddings=True)),
    # MQA, head_dim 12 != 40 / 4, GeGLU, (1 + w) norms, sqrt(d) embedding scale, tied
    "gemma-mqa": (GemmaConfig, GemmaForCausalLM, dict(
        hidden_size=40, intermediate_size=71, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=12)),
    # Pythia layout: LayerNorm, parallel residual, rotary on 25% of the 16 head dims, biases, untied embed_out
    "neox-parallel": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(
        hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
        use_parallel_residual=True)),
    "neox-sequential": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(
        hidden_size=64, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5,
        use_parallel_residual=False, rope_parameters={"rope_type": "default", "rope_theta": 2000.0})),
}


def hf_model(case, **over):
    """A tiny transformers model with every parameter random (norm scales and biases too, so a misplaced one shows)."""
    cfg_cls, model_cls, kw = CASES[case]
    ref = model_cls(cfg_cls(**{**COMMON, **kw, **over}))
    gemma = case.startswith("gemma")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif "norm" in name and name.endswith("weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return ref.eval()


def save(ref, path, **kw):
    ref.save_pretrained(path, **kw)
    return path


def assert_matches(ours, ref, seq=23):
    idx = torch.randint(0, V, (2, seq))
    with torch.no_grad():
        expect = ref(idx).logits
        got, _ = ours(idx)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-5)
    prompt = idx[:, :5]
    expect = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          eos_token_id=None)
    assert torch.equal(ours.generate(prompt, 12), expect)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------------------------------
# The three families reproduce transformers


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_generation_match_transformers(tmp_path, case):
    ref = hf_model(case)
    ours = hf.from_pretrained(save(ref, tmp_path))
    c = ours.config
    assert (c.vocab_size, c.n_layer, c.max_seq_len) == (V, ref.config.num_hidden_layers, 64)
    assert ours.tokenizer_spec == {"kind": "hf", "path": str(tmp_path.resolve())}
    if c.tie_embeddings:
        assert ours.lm_head.weight is ours.tok_emb.weight
    assert_matches(ours, ref)


@pytest.mark.parametrize("case,old_keys", [
    ("llama-gqa-bias", {"rope_parameters": None, "rope_theta": 500.0}),
    ("neox-sequential", {"rope_parameters": None, "rotary_emb_base": 2000.0, "rotary_pct": 0.5}),
])
def test_transformers4_config_keys(tmp_path, case, old_keys):
    """config.json written by transformers < 5: rope_theta / rotary_emb_base / rotary_pct instead of rope_parameters."""
    ref = hf_model(case)
    save(ref, tmp_path)
    edit_config(tmp_path, **old_keys)
    assert_matches(hf.from_pretrained(f"hf:{tmp_path}"), ref, seq=9)


def test_sharded_checkpoint(tmp_path):
    ref = hf_model("llama-gqa-bias")
    save(ref, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert_matches(hf.from_pretrained(tmp_path), ref, seq=9)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(ValueError, match=shards[1]):
        hf.from_pretrained(tmp_path)


def test_bfloat16_load(tmp_path):
    ref = hf_model("gemma-mqa")
    ours = hf.from_pretrained(save(ref, tmp_path), dtype=torch.bfloat16)
    assert ours.tok_emb.weight.dtype == torch.bfloat16
    assert torch.equal(ours.blocks[1].attn.k_proj.weight, ref.model.layers[1].self_attn.k_proj.weight.bfloat16())
    idx = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0].float(), ref(idx).logits, atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------------------------------------------
# Bad directories and unsupported models give errors that name the problem


def test_no_directory_no_config_no_weights(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        hf.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        hf.from_pretrained(tmp_path)
    save(hf_model("llama-tied-headdim"), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no \\*.safetensors.*pytorch_model.bin"):
        hf.from_pretrained(tmp_path)


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "qwen2"}, "model_type 'qwen2' is not supported"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported.*soft-capping"),
    ({"model_type": None}, "model_type None is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_size": None}, "no 'hidden_size'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ({"num_key_value_heads": 4}, "not a multiple of n_kv_head=4"),
])
def test_unsupported_configs(tmp_path, changes, match):
    save(hf_model("llama-gqa-bias"), tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        hf.from_pretrained(tmp_path)


def test_neox_and_gemma_options_that_are_refused(tmp_path):
    save(hf_model("neox-parallel"), tmp_path)
    edit_config(tmp_path, hidden_act="gelu_new")
    with pytest.raises(ValueError, match="GPT-NeoX hidden_act 'gelu_new'"):
        hf.from_pretrained(tmp_path)
    edit_config(tmp_path, hidden_act="gelu", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.1})
    with pytest.raises(ValueError, match="rotary dims 1 .* must be even"):
        hf.from_pretrained(tmp_path)
    save(hf_model("gemma-mqa"), tmp_path)
    edit_config(tmp_path, hidden_act="silu")
    with pytest.raises(ValueError, match="Gemma activation 'silu'"):
        hf.from_pretrained(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    save(hf_model("llama-gqa-bias"), tmp_path)
    edit_config(tmp_path, intermediate_size=84)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight in model.safetensors has shape "
                                         r"\(83, 60\), but config.json implies \(84, 60\)"):
        hf.from_pretrained(tmp_path)


def test_missing_and_unknown_tensors(tmp_path):
    save(hf_model("neox-parallel"), tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    missing = dict(sd)
    del missing["gpt_neox.layers.1.attention.query_key_value.bias"]
    save_file(missing, f)
    with pytest.raises(ValueError, match="missing tensor.*gpt_neox.layers.1.attention.query_key_value.bias"):
        hf.from_pretrained(tmp_path)
    save_file({**sd, "gpt_neox.layers.0.attention.extra.weight": torch.zeros(3)}, f)
    with pytest.raises(ValueError, match=r"unknown tensor.*gpt_neox.layers.0.attention.extra.weight "
                                         r"\(model.safetensors\)"):
        hf.from_pretrained(tmp_path)
    # buffers of older checkpoints are not weights: skipped
    save_file({**sd, "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.zeros(2),
               "gpt_neox.layers.0.attention.bias": torch.zeros(1, 1, 4, 4)}, f)
    hf.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# The checkpoint's tokenizer, train.py --init-from hf:DIR / --teacher DIR, hf.py DIR

WORDS = ("the quick brown fox jumps over a lazy dog while small models learn to read and write python code "
         "def return import class for in if else print value list").split()


def texts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (40,), generator=g).tolist()) for _ in range(n)]


def hf_dir_with_tokenizer(path):
    """A Llama checkpoint with a byte-level BPE tokenizer.json whose post-processor adds BOS, like Llama's."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(20, seed=1), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == 300 and tok.token_to_id("</s>") == 2
    ref = hf_model("llama-tied-headdim", vocab_size=320)  # more rows than tokens, as Pythia's 50304 for 50277
    save(ref, path)
    tok.save(str(path / "tokenizer.json"))
    return ref, tok


def test_tokenizer_of_the_checkpoint(tmp_path, monkeypatch):
    _, hf_tok = hf_dir_with_tokenizer(tmp_path)
    tok = data.Tokenizer(checkpoint.load_source_tokenizer(f"hf:{tmp_path}"))
    assert tok.spec == {"kind": "hf", "path": str(tmp_path.resolve())}
    assert tok.eot == 2 and tok.n_vocab == hf_tok.get_vocab_size()
    text = "the lazy fox writes python"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[1:] == hf_tok.encode(text, add_special_tokens=False).ids  # BOS, as transformers
    assert tok.encode_batch([text, "dog"]) == [ids, tok.encode("dog")]
    assert tok.decode(ids) == text
    # the eos id comes from generation_config.json or tokenizer_config.json when config.json has none
    edit_config(tmp_path, eos_token_id=None)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert data.Tokenizer({"kind": "hf", "path": str(tmp_path)}).eot == 0
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no eos_token_id"):
        data.Tokenizer({"kind": "hf", "path": str(tmp_path)})
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.Tokenizer({"kind": "hf", "path": str(tmp_path)})
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        data.Tokenizer({"kind": "hf", "path": str(tmp_path)})


def test_train_finetunes_an_hf_checkpoint_with_itself_as_teacher(tmp_path):
    d = tmp_path / "hf"
    hf_dir_with_tokenizer(d)
    corpus = write_jsonl(tmp_path / "data" / "corpus.jsonl", texts(70))
    out = tmp_path / "out"
    common = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--max-iters", "2", "--batch-size",
              "2", "--seq-len", "16", "--eval-iters", "1", "--device", "cpu", "--dtype", "float32"]
    res = train.train(common + ["--init-from", f"hf:{d}", "--teacher", str(d), "--out-dir", str(out),
                                "--sample-tokens", "4"])
    assert res["loss"] == res["loss"] and res["best_val_loss"] < 20  # finite
    ck = checkpoint.load_checkpoint(out / "ckpt.pt")
    imported = hf.from_pretrained(d)
    assert ck["arch"] == "vanilla" and ck["step"] == 2
    assert ck["tokenizer"] == {"kind": "hf", "path": str(d.resolve())}
    assert ck["config"] == asdict(imported.config)
    tuned = checkpoint.model_from_checkpoint(ck)
    assert not torch.equal(tuned.blocks[0].attn.q_proj.weight, imported.blocks[0].attn.q_proj.weight)
    # the corpus was tokenized with the checkpoint's tokenizer.json: BOS before every document, EOS after
    cache = next((tmp_path / "cache").iterdir())
    tokens = data.read_shard(cache / json.loads((cache / "meta.json").read_text())["train"]["shards"][0])
    assert tokens[0] == 1 and tokens[-1] == 2 and (tokens == 2).sum() == (tokens == 1).sum()
    # a teacher with another tokenizer is refused
    with pytest.raises(ValueError, match="must be the same"):
        train.train(common + ["--vocab-size", "256", "--teacher", f"hf:{d}", "--out-dir", str(tmp_path / "o2")])


def test_hf_py_prints_greedy_continuation(tmp_path, monkeypatch, capsys):
    ref, tok = hf_dir_with_tokenizer(tmp_path)
    prompt = "the quick brown"
    ids = torch.tensor([tok.encode(prompt).ids])
    expect = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          eos_token_id=None)[0].tolist()
    if 2 in expect[ids.size(1):]:
        expect = expect[:expect.index(2, ids.size(1))]
    monkeypatch.setattr(sys, "argv", ["hf.py", str(tmp_path), "--prompt", prompt, "--max-new-tokens",
                                      "6", "--device", "cpu"])
    hf.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert "2 layers" in lines[0]
    assert lines[-1] == tok.decode(expect, skip_special_tokens=True) and lines[-1].startswith(prompt)


# ----------------------------------------------------------------------------------------------------------------
# End to end with the recursive issue: an imported model, converted by full-rank SVD relaxation, still reproduces
# transformers (real layouts: Llama biases and GQA, Gemma's (1 + w) norms and MQA, NeoX LayerNorm shifts and biases)


@pytest.mark.parametrize("case", ["llama-gqa-bias", "gemma-mqa", "neox-parallel"])
def test_full_rank_relaxed_conversion_of_an_import_matches_transformers(tmp_path, case):
    import recursive
    from svd_lora import max_ranks

    ref = hf_model(case, num_hidden_layers=4)  # 4 layers, B = 2 loops of K = 2 shared layers
    ours = hf.from_pretrained(save(ref, tmp_path))
    full = {f"lora_rank_{c}": r for c, r in max_ranks(ours.config).items()}
    idx = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        expect = ref(idx).logits
    for init in ("stepwise", "average", "lower"):
        rel = recursive.from_vanilla(ours, n_loops=2, init=init, **full, log=lambda s: None).eval()
        assert len(rel.blocks) == 2 and rel.config.lora_bias == (case != "gemma-mqa")  # biases: per-loop deltas
        with torch.no_grad():
            got, _ = rel(idx)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4, msg=f"{case} {init}")
        rec = recursive.from_vanilla(ours, n_loops=2, init=init, log=lambda s: None).eval()  # no LoRA: differs
        assert (rec(idx)[0] - expect).abs().max() > 1e-2, init
    prompt = idx[:, :5]  # greedy generation with per-loop KV caches equals transformers' (last init)
    gen = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                       eos_token_id=None)
    assert torch.equal(rel.generate(prompt, 8), gen)


@pytest.mark.parametrize("arch,extra", [("recursive", ["--loops", "2", "--init", "stepwise"]),
                                        ("relaxed", ["--loops", "2", "--init", "average", "--lora-rank", "4"]),
                                        ("block", [])])
def test_train_converts_an_hf_checkpoint(tmp_path, arch, extra):
    """`train.py --arch X --init-from hf:DIR` converts an imported model (every conversion, not only
    vanilla)."""
    d = tmp_path / "hf"
    hf_dir_with_tokenizer(d)
    corpus = write_jsonl(tmp_path / "data" / "corpus.jsonl", texts(70))
    out = tmp_path / "out"
    res = train.train(["--arch", arch, "--init-from", f"hf:{d}", "--out-dir", str(out), "--data", str(corpus),
                       "--cache-dir", str(tmp_path / "cache"), "--max-iters", "1", "--batch-size", "2",
                       "--seq-len", "16", "--eval-iters", "1", "--device", "cpu", "--dtype", "float32",
                       "--sample-tokens", "4", "--lr", "0"] + extra)  # lr 0: the weights stay the converted ones
    assert res["best_val_loss"] < 20  # finite
    ck = checkpoint.load_checkpoint(out / "ckpt.pt")
    assert ck["arch"] == arch and ck["tokenizer"] == {"kind": "hf", "path": str(d.resolve())}
    model = checkpoint.model_from_checkpoint(ck)
    imported = hf.from_pretrained(d)
    # copied by the conversion: the imported vocabulary, not the run's default tokenizer
    assert torch.equal(model.tok_emb.weight, imported.tok_emb.weight)
