"""The peers' shared checkpoint: bench_engine.py's ~100M Llama with a real tokenizer, in HF and GGUF form.

Run with the converter venv that setup.sh builds (it has transformers, sentencepiece and gguf-py):

    benchmarks/peers/.work/venv-convert/bin/python benchmarks/peers/make_checkpoint.py [--force]

Writes under benchmarks/peers/.work/models/:
  llama100m-fp32/, llama100m-bf16/   HF folders (config, safetensors, tokenizer.model + tokenizer.json,
                                      tokenizer_config.json with a chat template); the same random weights
  llama100m-f32.gguf, llama100m-bf16.gguf   llama.cpp's convert_hf_to_gguf.py of those folders
  llama100m-q8_0.gguf                 the bf16 folder quantized to q8_0 by the same converter

Why a trained tokenizer: all three engines must load the same checkpoint by name, and text in, text out.
A 32000-piece SentencePiece BPE with byte fallback, trained here on a synthetic corpus, lets llama.cpp's
converter take its sentencepiece path (no pre-tokenizer hash to register), and transformers converts it to
the tokenizer.json that twospeed and vLLM read. Normalization is identity and whitespace is kept, as in
Llama 2's tokenizer, so the HF conversion and llama.cpp's SPM tokenizer split text the same way; the script
checks that on sample text before it writes anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
LLAMA_SRC_GLOB = "llama-cpp-python-*/vendor/llama.cpp"

# bench_engine.py's SHAPE, repeated here because this script runs outside the project venv.
SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True)

# Plain-text role markers, no added special tokens: every engine tokenizes them the same way.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@dataclass(slots=True)
class CheckpointConfig:
    """Everything that fixes the checkpoint's bytes."""

    out: Path = WORK / "models"
    name: str = "llama100m"
    seed: int = 0
    vocab_size: int = SHAPE["vocab_size"]
    corpus_lines: int = 120_000
    gguf_types: dict[str, str] = field(default_factory=lambda: {"fp32": "f32", "bf16": "bf16"})
    # llama.cpp's quantized types, converted from one of the HF folders: q8_0 of the bf16 weights is what
    # twospeed's int8 is measured against (benchmarks/bench_quant.py)
    quantized_ggufs: dict[str, str] = field(default_factory=lambda: {"q8_0": "bf16"})


# -- the corpus ------------------------------------------------------------------------------------
# Words the lab's prompts and the demo use, so benchmark text tokenizes into real multi-letter pieces.
COMMON = ("account order invoice shipment refund customer warehouse carrier delay status region policy update "
          "report ticket priority escalate review approve reject balance payment credit window schedule route "
          "inventory supplier contract clause renewal discount margin forecast quarter budget audit compliance "
          "incident outage latency deploy rollback service cluster replica backup restore metric alert "
          "threshold owner team project milestone deadline summary detail evidence source record field value "
          "the a of to and in for with on by from at as is was are be this that it which you your we our "
          "assistant user system tool call answer question passage summarise careful tools json name arguments "
          "throughput prefill decode token cache block request stream batch memory bandwidth compute kernel "
          "attention query key layer weight model server client").split()
ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr st sp sk sl sm sn ch sh th wh qu".split()
VOWELS = "a e i o u ai ea ee oa oo ou io".split()
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "ck", "ng", "rk", "ll", "ss"]
PUNCT = [",", ".", ":", ";", "?", "!", " -", " (", ")", "\"", "'s"]


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """n distinct made-up words of 1-4 syllables: enough distinct substrings for 32k BPE merges."""
    seen: set[str] = set()
    while len(seen) < n:
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                       for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
        seen.add(word)
    return sorted(seen)


def corpus(cfg: CheckpointConfig) -> list[str]:
    """Zipf-weighted sentences over common and made-up words, with digits, punctuation, JSON and some bytes
    beyond ASCII (so the byte-fallback pieces are real)."""
    rng = random.Random(cfg.seed)
    lexicon = COMMON + pseudo_words(rng, 60_000)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(lexicon))))
    lines = []
    for i in range(cfg.corpus_lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(6, 30))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        text = " ".join(w + (rng.choice(PUNCT) if rng.random() < 0.12 else "") for w in words)
        if rng.random() < 0.15:
            text += f" {rng.randint(0, 99999)}"
        if rng.random() < 0.05:
            text = json.dumps({"name": rng.choice(lexicon), "arguments": {"id": rng.randint(0, 9999)}})
        if rng.random() < 0.02:
            text += " café naïve über — “quoted” 東京 ✓"
        lines.append(text)
    return lines


# -- the tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(cfg: CheckpointConfig, folder: Path) -> Path:
    """SentencePiece BPE, Llama 2's trainer settings that matter for agreement: byte fallback, identity
    normalization, whitespace kept, digits split; ids 0 unk, 1 <s>, 2 </s>."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("\n".join(corpus(cfg)) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(folder / "tokenizer"), model_type="bpe",
            vocab_size=cfg.vocab_size, byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=2, input_sentence_size=0, minloglevel=2)
    (folder / "tokenizer.vocab").unlink(missing_ok=True)
    return folder / "tokenizer.model"


def write_tokenizer_files(folder: Path) -> None:
    """tokenizer.json (transformers' sentencepiece -> fast conversion), tokenizer_config.json with the chat
    template; then check the fast tokenizer splits sample text exactly as sentencepiece does."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    from tokenizers import decoders, normalizers

    tok = LlamaTokenizer.from_pretrained(folder, add_bos_token=True, add_eos_token=False, legacy=True)
    # sentencepiece's add_dummy_prefix prepends "▁" to every text; tokenizers' Metaspace skips it when the
    # text already starts with a space. Llama 2's own tokenizer.json prepends in the normalizer instead, as here.
    backend = tok.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
    samples = ["Hello world", "The order 12345 was refunded.", "  two  spaces", "café naïve 東京 ✓ 🙂",
               "{\"name\": \"lookup_order\", \"arguments\": {\"id\": 7}}", "line one\nline two\ttab",
               " ".join(COMMON)]
    for s in samples:
        want = [sp.bos_id()] + sp.encode(s)
        got = fast.encode(s).ids
        if got != want:
            raise SystemExit(f"tokenizer.json disagrees with sentencepiece on {s!r}:\n  sp   {want}\n  fast {got}")
        if fast.decode(got, skip_special_tokens=True) != s:
            raise SystemExit(f"tokenizer.json does not round-trip {s!r}: {fast.decode(got)!r}")


# -- the weights -----------------------------------------------------------------------------------
def write_models(cfg: CheckpointConfig, tokenizer_dir: Path) -> dict[str, Path]:
    """One random LlamaForCausalLM (seeded as bench_engine.py seeds it), saved as fp32 and as bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config).eval()
    folders = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        folder = cfg.out / f"{cfg.name}-{label}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.to(dtype).save_pretrained(tmp)
        for f in tokenizer_dir.iterdir():
            shutil.copy2(f, tmp / f.name)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        folders[label] = folder
    return folders


def convert_gguf(folder: Path, outtype: str, out: Path) -> None:
    """llama.cpp's own converter, from the vendor tree setup.sh unpacked."""
    srcs = sorted(WORK.glob(LLAMA_SRC_GLOB))
    if not srcs:
        raise SystemExit("llama.cpp source not found under .work/: run benchmarks/peers/setup.sh first")
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, str(srcs[-1] / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(tmp),
           "--outtype", outtype]
    log = out.with_suffix(".convert.log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"convert_hf_to_gguf.py failed ({rc}); see {log}")
    tmp.rename(out)


def build(cfg: CheckpointConfig, force: bool = False) -> dict[str, Path]:
    """Everything, skipping what exists unless force."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    paths = {label: cfg.out / f"{cfg.name}-{label}" for label in cfg.gguf_types}
    ggufs = {label: cfg.out / f"{cfg.name}-{t}.gguf" for label, t in cfg.gguf_types.items()}
    if force or not all((p / "tokenizer.json").is_file() and (p / "model.safetensors").is_file()
                        for p in paths.values()):
        t0 = time.monotonic()
        tok_dir = cfg.out / f"{cfg.name}-tokenizer"
        if force or not (tok_dir / "tokenizer.model").is_file():
            tok_dir.mkdir(parents=True, exist_ok=True)
            train_tokenizer(cfg, tok_dir)
            print(f"tokenizer trained in {time.monotonic() - t0:.0f} s")
        write_tokenizer_files(tok_dir)
        paths = write_models(cfg, tok_dir)
        print(f"HF folders written: {', '.join(str(p) for p in paths.values())}")
    for label, gguf in ggufs.items():
        if force or not gguf.is_file():
            convert_gguf(paths[label], cfg.gguf_types[label], gguf)
            print(f"GGUF written: {gguf}")
    for outtype, source in cfg.quantized_ggufs.items():
        gguf = ggufs[outtype] = cfg.out / f"{cfg.name}-{outtype}.gguf"
        if force or not gguf.is_file():
            convert_gguf(paths[source], outtype, gguf)  # convert_hf_to_gguf.py quantizes q8_0 itself
            print(f"GGUF written: {gguf}")
    return {**{f"hf-{k}": v for k, v in paths.items()}, **{f"gguf-{k}": v for k, v in ggufs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=WORK / "models", help="folder for the models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = ap.parse_args()
    for key, path in build(CheckpointConfig(out=args.out, seed=args.seed), force=args.force).items():
        print(f"{key}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
