"""Text <-> token ids in the router process, with the `tokenizers` library only (no torch).

The router tokenizes prompts before choosing workers (prefix-cache affinity needs the ids) and
turns streamed ids back into text. It reads the model directory's tokenizer.json, the file
Hugging Face's fast tokenizers use, so ids match what `AutoTokenizer` would produce.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from configs.hf_eos import id_tuple, merged_eos_ids


class RouterTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: the router needs a fast tokenizer")
        self._tok = Tokenizer.from_file(str(path))
        config_path = Path(model_dir) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.vocab_size = int(config.get("vocab_size") or self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token_ids = merged_eos_ids(id_tuple(config.get("eos_token_id")), model_dir)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a character.

    Byte-level BPE splits a multi-byte character across tokens; decoding a prefix then ends in
    U+FFFD. Text is only released once it stops ending in U+FFFD, and it is always computed as
    decode(ids[prefix:]) minus decode(ids[prefix:read]) so a token's text may depend on its left
    neighbours (leading spaces, merges) exactly as a full decode would.
    """

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids up to here have been turned into emitted text

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty)."""
        self.token_ids += new_token_ids
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix : self._read])
        full_text = self.tokenizer.decode(self.token_ids[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, replacement characters included (the model's bytes)."""
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix : self._read])
        full_text = self.tokenizer.decode(self.token_ids[self._prefix :])
        self._prefix = self._read = len(self.token_ids)
        return full_text[len(prefix_text) :]
