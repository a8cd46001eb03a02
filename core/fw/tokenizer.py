"""Tokenizer from a model directory's tokenizer.json, without transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tokenizer

from fw.model_registry import ModelError


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer: _Tokenizer, config: dict[str, Any], eos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.token_to_id(self.eos_token)

    @classmethod
    def from_dir(cls, path: str, eos_token_id: int | None = None) -> Tokenizer:
        directory = Path(path)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise ModelError(f"{path} has no tokenizer.json")
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(_Tokenizer.from_file(str(file)), config, eos_token_id)

    @property
    def backend(self) -> _Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (vocabulary, model type, decoder)."""
        return self._tok

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
