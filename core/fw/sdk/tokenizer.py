"""Tokenizer from a model directory's tokenizer.json, without transformers.

It answers the Hugging Face tokenizer calls that vLLM scripts make on ``LLM.get_tokenizer()``, with one
difference: ``decode`` skips special tokens unless told otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tokenizer

from fw.sdk.chat import apply_chat_template
from fw.sdk.errors import ModelError


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


class BatchEncoding(dict):
    """``tokenizer(text)``'s result: ``input_ids`` and ``attention_mask``, as keys or attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    def __init__(self, tokenizer: _Tokenizer, config: dict[str, Any], eos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.token_to_id(self.eos_token)
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)

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
        """The base vocabulary, without added tokens (``len(tokenizer)`` counts those too)."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text tokenized on another thread (fw serve does)
        # does not stall the event loop or the engine.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> BatchEncoding:
        """Token ids and attention mask of one text, or (unpadded) of each text of a list."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        ids_list = [e.ids for e in self._tok.encode_batch(text, add_special_tokens=add_special_tokens)]
        return BatchEncoding(input_ids=ids_list, attention_mask=[[1] * len(ids) for ids in ids_list])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        return self._tok.id_to_token(ids) if isinstance(ids, int) else [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        return self.token_to_id(tokens) if isinstance(tokens, str) else [self.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | BatchEncoding:
        """As Hugging Face's: token ids by default (transformers 4's list; ``return_dict=True``: 5's
        BatchEncoding; ``tokenize=False``: the text), no generation prompt unless asked; ``kwargs`` reach
        the template."""
        text = apply_chat_template(
            self, conversation, add_generation_prompt, chat_template,
            continue_final_message=continue_final_message, tools=tools, **kwargs,
        )
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False)
        return encoded if return_dict else encoded.input_ids
