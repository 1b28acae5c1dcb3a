"""The demo checkpoint is a real HF Llama folder: transformers loads it cleanly; it is reproducible byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from twospeed.builtin import demo
from twospeed.builtin.demo import DEMO_CONFIG, build_demo_tokenizer, demo_checkpoint_path, write_demo_checkpoint
from twospeed.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def fast_build(monkeypatch) -> None:
    """Make write_demo_checkpoint cheap (tiny weights, no tokenizer training) for tests of its file handling."""
    monkeypatch.setattr(demo, "demo_state_dict", lambda: {"x": torch.zeros(1)})
    monkeypatch.setattr(demo, "write_demo_tokenizer", lambda path: path)


def test_layout_and_tensors(ckpt):
    assert {p.name for p in ckpt.iterdir()} == FILES
    assert json.loads((ckpt / "config.json").read_text()) == DEMO_CONFIG
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == DEMO_CONFIG["eos_token_id"]
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [256, 512]  # 4 kv heads * 64
        o_std = f.get_tensor("model.layers.3.self_attn.o_proj.weight").float().std().item()
        q_std = f.get_tensor("model.layers.3.self_attn.q_proj.weight").float().std().item()
    assert len(names) == 2 + 9 * DEMO_CONFIG["num_hidden_layers"] and "lm_head.weight" not in names
    assert q_std == pytest.approx(0.02, rel=0.05) and o_std == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)


def test_tokenizer_matches_config(ckpt):
    tok = Tokenizer.from_pretrained(ckpt)
    assert tok.vocab_size == DEMO_CONFIG["vocab_size"] == 8192
    assert tok.bos_token_id == DEMO_CONFIG["bos_token_id"] and tok.eos_token_ids == {DEMO_CONFIG["eos_token_id"]}
    assert tok.encode("hi")[0] == tok.bos_token_id  # the post-processor prepends bos
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_loads_and_runs_in_transformers(ckpt):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.LlamaForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert all(not v for v in info.values()), info  # no missing / unexpected / mismatched keys
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 8192
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([Tokenizer.from_pretrained(ckpt).encode("The model reads the prompt.")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 8192) and torch.isfinite(logits).all()
    # Random weights, but not degenerate: the next-token choice varies along the sequence.
    assert logits[0].float().argmax(-1).unique().numel() > 1


def test_tokenizer_build_is_deterministic(ckpt):
    assert build_demo_tokenizer().to_str(pretty=True) == (ckpt / "tokenizer.json").read_text(encoding="utf-8")


def test_build_in_another_process_is_identical(ckpt, tmp_path):
    # A fresh process has fresh hash seeds and thread pools: checks the BPE trainer and the weights are
    # deterministic across processes, not only within one.
    code = "import sys; from twospeed.builtin.demo import write_demo_checkpoint; write_demo_checkpoint(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], env=env, check=True, timeout=120)
    assert file_hashes(tmp_path / "other") == file_hashes(ckpt)


def test_losing_a_build_race_keeps_the_winner(ckpt, tmp_path, monkeypatch):
    # The loser's rename fails because the winner's folder is there; it keeps that folder and cleans up.
    target = shutil.copytree(ckpt, tmp_path / "shared")
    fast_build(monkeypatch)  # a loser with other bytes
    assert write_demo_checkpoint(target) == target
    assert file_hashes(target) == file_hashes(ckpt)
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]


def test_write_refuses_a_foreign_folder(tmp_path, monkeypatch):
    fast_build(monkeypatch)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_demo_checkpoint(tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # temp folder cleaned up


def test_demo_checkpoint_path_uses_cache_env(ckpt, tmp_path, monkeypatch):
    builds = []

    def fake_write(path):  # copy the module's build instead of building again
        builds.append(path)
        shutil.copytree(ckpt, path)
        return path

    monkeypatch.setattr(demo, "write_demo_checkpoint", fake_write)
    monkeypatch.setenv("TWOSPEED_CACHE", str(tmp_path))
    path = demo_checkpoint_path()
    assert path.parent == tmp_path and path.name.startswith("demo-") and (path / "model.safetensors").is_file()
    assert demo_checkpoint_path() == path and builds == [path]  # built once, then reused
    monkeypatch.delenv("TWOSPEED_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_checkpoint_path().parent == tmp_path / "home" / ".cache" / "twospeed"
