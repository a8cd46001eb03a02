"""The tokenizer a GGUF file carries (``tokenizer.ggml.*`` metadata), rebuilt as a ``tokenizers.Tokenizer``.

Two vocabulary kinds cover the supported architectures:

* ``gpt2``: byte-level BPE with the file's merges. The text is first split by the regex that
  ``tokenizer.ggml.pre`` names (the one the vocabulary was trained with), as llama.cpp does.
* ``llama``: SentencePiece BPE. Spaces become ``▁`` (plus one in front when ``add_space_prefix``),
  characters missing from the vocabulary fall back to ``<0xXX>`` byte tokens, and the merges,
  which the file does not store, follow from the vocabulary: a token that two others concatenate
  to is their merge, ranked by its score.

Tokens typed CONTROL (and the UNKNOWN token) become special added tokens, USER_DEFINED ones plain
added tokens, so that both are matched whole in the text.
"""

from __future__ import annotations

import logging
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from fw.sdk.errors import ModelError
from fw.sdk.tokenizer import Tokenizer
from fw_quant_gguf.checkpoint import metadata

log = logging.getLogger("fw")

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Single digits split off before the GPT-2 regex.
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)

# tokenizer.ggml.pre -> the split regexes, applied in turn.
_PRE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "phi-2"), (_GPT2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2,)),
}
# Llama 3's vocabularies (as llama.cpp treats them): a word that is itself a token skips the merges, and BOS is
# added unless the file says otherwise.
_LLAMA3_VOCABS = {"llama-bpe", "llama3", "llama-v3", "falcon3"}


def _byte_level(reader: GGUFReader, tokens: list[str], pre: str) -> HFTokenizer:
    merges = metadata(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ModelError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    if pre not in _PRE:
        log.warning("GGUF pre-tokenizer %r is unknown to fw-quant-gguf; splitting text as GPT-2 does", pre)
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre in _LLAMA3_VOCABS)
    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE.get(pre, _PRE["default"])]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(reader: GGUFReader, tokens: list[str], types: list[int]) -> HFTokenizer:
    scores = metadata(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise ModelError("GGUF llama tokenizer has no tokenizer.ggml.scores")
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == NORMAL}
    merges = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                merges.append((-scores[i], normal[left], normal[right], left, right))
    merges.sort()
    unk_id = metadata(reader, "tokenizer.ggml.unknown_token_id", 0)
    model = models.BPE(
        {t: i for i, t in enumerate(tokens)},
        [(left, right) for *_, left, right in merges],
        unk_token=tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def load(reader: GGUFReader) -> Tokenizer:
    kind = metadata(reader, "tokenizer.ggml.model")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelError("GGUF file has no tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        tok = _byte_level(reader, tokens, pre)
    elif kind == "llama":
        tok = _sentencepiece(reader, tokens, types)
    else:
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in (CONTROL, UNKNOWN)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )

    bos_id = metadata(reader, "tokenizer.ggml.bos_token_id")
    eos_id = metadata(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp's default where the file has no flag: SentencePiece vocabularies and Llama 3's add BOS.
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama" or pre in _LLAMA3_VOCABS)
    add_eos = metadata(reader, "tokenizer.ggml.add_eos_token", False)
    _add_bos_eos(tok, tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    config: dict[str, Any] = {
        "chat_template": metadata(reader, "tokenizer.chat_template"),
        "bos_token": None if bos_id is None else tokens[bos_id],
        "eos_token": None if eos_id is None else tokens[eos_id],
    }
    return Tokenizer(tok, config, eos_id)


def _add_bos_eos(tok: HFTokenizer, tokens: list[str], bos_id: int | None, eos_id: int | None) -> None:
    if bos_id is None and eos_id is None:
        return
    specials = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    bos = [tokens[bos_id]] if bos_id is not None else []
    eos = [tokens[eos_id]] if eos_id is not None else []
    tok.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos], special_tokens=list(dict.fromkeys(specials))
    )
