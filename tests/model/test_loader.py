"""Loading HF checkpoint folders: sharded equals single-file, and every failure names the file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_hf_checkpoint
from twospeed.model.loader import CheckpointError, load_model, load_model_config


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    model = write_hf_checkpoint(tmp_path / "single", "qwen3")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = dict(load_model(tmp_path / "single").named_parameters())
    b = dict(load_model(tmp_path / "sharded").named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_weights_are_hf_weights_stacked(tmp_path):
    hf = write_hf_checkpoint(tmp_path, "qwen2")
    ours = load_model(tmp_path)
    attn = hf.model.layers[1].self_attn
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.bias,
                       torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


def test_config_fields(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    cfg = load_model_config(tmp_path)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (12, 4, 2)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_transformers4_rope_layout(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0


def test_unsupported_architecture(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(tmp_path)
    write_hf_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_model(tmp_path)


def test_missing_shard_named(tmp_path):
    model = write_hf_checkpoint(tmp_path / "a", "llama")
    model.save_pretrained(tmp_path / "b", max_shard_size="20KB")
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "b" / victim).unlink()
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_model(tmp_path / "b")


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_named(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        load_model(tmp_path)


def test_shape_mismatch_named(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(71, 40)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.up_proj\.weight.*\(71, 40\)"):
        load_model(tmp_path)


def test_unexpected_tensor_named(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        load_model(tmp_path)


def test_tied_checkpoint_with_stored_lm_head(tmp_path):
    """Some tied checkpoints still store lm_head.weight; it is the embedding and is skipped."""
    write_hf_checkpoint(tmp_path, "qwen2")
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load_model(tmp_path)
    assert model.head_shares_embedding  # the head reads the embedding table itself
