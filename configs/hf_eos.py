"""The end-of-sequence token ids a Hugging Face checkpoint stops on: config.json's
`eos_token_id` plus generation_config.json's (chat models add an end-of-turn token there), each
an int, a list or null. Read by the engine (engine/model/config.py) and by the router, which
must know when a stream has already ended before it resumes one on another worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def id_tuple(value: Any) -> tuple[int, ...]:
    """HF configs give eos_token_id as an int, a list, or null."""
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def merged_eos_ids(config_eos: tuple[int, ...], model_dir: str | Path) -> tuple[int, ...]:
    """`config_eos` extended by generation_config.json's ids (what generate() stops on)."""
    gen_file = Path(model_dir) / "generation_config.json"
    if not gen_file.is_file():
        return config_eos
    return tuple(dict.fromkeys(config_eos + id_tuple(json.loads(gen_file.read_text()).get("eos_token_id"))))
