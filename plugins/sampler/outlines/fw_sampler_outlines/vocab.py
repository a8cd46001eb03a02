"""Token id -> the bytes it adds to the output, the alphabet outlines-core matches regexes over.

Automata run over bytes, not token strings: a byte-level BPE token is a string of
stand-in characters (GPT-2's table; "Ġ" is a space) and a SentencePiece token spells a
space "▁" and stores unmergeable bytes as "<0xNN>" pieces. Reading the tokenizer's
decoder tells which spelling a vocabulary uses.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
    other 68 bytes (controls, space, soft hyphen...) take the code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if chr(b) not in table)
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not decoder:
        return []
    if decoder["type"] == "Sequence":
        return [step for d in decoder["decoders"] for step in _decoder_steps(d)]
    return [decoder]


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Every token id that can appear in generated text -> its bytes; special tokens (EOS among them) left out."""
    config = json.loads(tokenizer.to_str())
    steps = _decoder_steps(config.get("decoder"))
    kinds = {step["type"] for step in steps}
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds or bool((config.get("model") or {}).get("byte_fallback"))
    # SentencePiece spells spaces with a marker: a Metaspace decoder names it, or a Replace step maps it to " ".
    spaces = [step["replacement"] for step in steps if step["type"] == "Metaspace"]
    spaces += [
        step["pattern"]["String"]
        for step in steps
        if step["type"] == "Replace" and step["content"] == " " and "String" in step["pattern"]
    ]

    added = tokenizer.get_added_tokens_decoder()
    out: dict[int, bytes] = {}
    for text, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        token = added.get(token_id)
        if token is not None:
            if not token.special:  # user-added words are literal text, never byte-encoded
                out[token_id] = token.content.encode()
            continue
        if byte_level:
            # Characters outside the table (rare hand-added pieces) stand for themselves.
            data = b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in text)
        elif byte_fallback and (match := _BYTE_PIECE.fullmatch(text)):
            data = bytes([int(match.group(1), 16)])
        else:
            for marker in spaces:
                text = text.replace(marker, " ")
            data = text.encode()
        if data:
            out[token_id] = data
    return out
