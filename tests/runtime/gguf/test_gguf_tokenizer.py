"""Tokenizer and chat template from a GGUF file's metadata, against the Hugging Face files of the same model.

The trained built-in model (byte-level BPE, ``tokenizer.json``) is written as GGUF the way llama.cpp's converter
writes a ``gpt2`` vocabulary; a SentencePiece-style (``llama``) vocabulary is built here as a Hugging Face tokenizer
(BPE with byte fallback and ``▁`` spaces, merges ranked by piece score, as transformers converts SentencePiece) and
written with its scores. Comparison against llama.cpp's own tokenizer runs where ``llama-cpp-python`` is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from freetoken_agent.runtime.builtin import builtin_model_dir
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.gguf.tokenizer import tokenizer_from_metadata
from freetoken_agent.runtime.tokenizer.chat import ChatTemplate
from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

from tests.runtime.gguf.writer import write_gguf

MIXED = ("Hello world! It's 2024-06-01, we've got 12345 tokens.\n\n  def f(x):\n\treturn x**2  # square\n"
         "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский.\r\n"
         "<|im_start|>user\nhi<|im_end|> <tool_call>{\"a\": 1}</tool_call>   trailing   \n")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def builtin_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = builtin_model_dir()
    return write_gguf(src, tmp_path_factory.mktemp("b") / "builtin.gguf", experts="Q8_0", tokenizer=src)


def test_bpe_tokenizer_from_file_matches_hf(builtin_gguf: Path) -> None:
    from freetoken_agent.runtime.gguf.file import GGUFFile

    ours = tokenizer_from_metadata(GGUFFile(builtin_gguf).metadata)
    hf = Tokenizer.from_pretrained(builtin_model_dir())
    assert ours.encode(MIXED) == hf.encode(MIXED)
    assert ours.decode(ours.encode(MIXED)) == MIXED
    assert ours.eos_token == hf.eos_token and ours.eos_token_ids == hf.eos_token_ids
    assert ours.special_tokens["<|im_start|>"] == hf.special_tokens["<|im_start|>"]


def test_engine_from_gguf_has_tokenizer_template_and_stops(builtin_gguf: Path) -> None:
    engine = Engine.from_pretrained(builtin_gguf, require_tokenizer=True)
    folder = Engine.from_pretrained(builtin_model_dir())
    assert engine.render_chat(MESSAGES) == folder.render_chat(MESSAGES)
    assert engine.chat_template == ChatTemplate.from_pretrained(builtin_model_dir()).source
    assert sorted(engine.eos_token_ids) == sorted(folder.eos_token_ids)  # <|im_end|>, and <|endoftext|> as llama.cpp
    prompt = folder.tokenizer.encode(folder.render_chat(MESSAGES))
    assert engine.tokenizer.encode(engine.render_chat(MESSAGES)) == prompt
    # Q8_0 experts from the file (gguf's quantizer wrote them) vs the folder quantized to Q8_0 by ours: same rule
    q8 = Engine.from_pretrained(builtin_model_dir(), quant="q8")
    assert engine.generate(prompt, max_new_tokens=12).token_ids == q8.generate(prompt, max_new_tokens=12).token_ids


def _sentencepiece_hf(tmp_path: Path) -> tuple[Path, list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte pieces, then ``▁``-words and their pieces,
    scores decreasing with id; the HF tokenizer transformers would build for it (merges by merged-piece score)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HF

    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁jumps", "▁over", "▁lazy", "▁dog", "▁hello", "▁world", "ing",
             "ed", "▁a", "▁is", "er", "▁th", "▁he", "ll", "▁w", "or", "ld", "▁c", "af", "é", "▁2", "02", "4"]
    pieces: list[str] = []
    for w in words:  # every prefix of every word is a piece too (so merges can reach the word)
        for cut in range(1, len(w) + 1):
            if w[:cut] not in pieces:
                pieces.append(w[:cut])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = sorted(((-scores[normal[p]], normal[p[:c]], normal[p[c:]], p[:c], p[c:]) for p in normal
                     for c in range(1, len(p)) if p[:c] in normal and p[c:] in normal))
    tok = HF(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "add_bos_token": True}))
    return tmp_path, tokens, scores, types


def test_sentencepiece_tokenizer_from_file_matches_hf(tmp_path: Path) -> None:
    folder, tokens, scores, types = _sentencepiece_hf(tmp_path)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    ours = tokenizer_from_metadata(meta)
    hf = Tokenizer.from_pretrained(folder)
    text = "the quick brown fox jumps over the lazy dog, hello world! café 2024 日本 </s>"
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=True)[0] == 1  # llama vocabularies add <s> by default
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text))
    assert ours.eos_token_ids == [2]


def test_against_llama_cpp_tokenizer(builtin_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: the comparison with "
                                                        "llama.cpp's own tokenizer is skipped")
    llm = llama_cpp.Llama(model_path=str(builtin_gguf), vocab_only=True, verbose=False)
    ours = Engine.from_pretrained(builtin_gguf).tokenizer
    assert llm.tokenize(MIXED.encode(), add_bos=False, special=True) == ours.encode(MIXED)
