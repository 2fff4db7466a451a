"""What a proposer's guess of one token costs, over a plain decode step of the target, for the
adaptive k (engine/spec/adaptive.py): set on each proposer as `guess_cost` when the engine builds
it (engine/engine.py).

A decode step of one sequence reads every weight it multiplies by once and little else, so it
takes about the time its weights take to read, on a CPU as on a GPU: a guess costs what the
weights it reads weigh against the target's. Measured on builtin:code-small with
builtin:code-draft (2-core AVX-512 CPU, benchmarks/spec_costs.py): the estimate is 0.31, a guess
took 0.22 of a target step alone and 0.31 in turn with the target's steps (each evicts some of the
other's weights from the caches).
"""

from __future__ import annotations

from engine.model.config import ModelConfig
from engine.model.medusa_heads import MedusaConfig


def decode_weights(cfg: ModelConfig, vocab_rows: int | None = None) -> tuple[int, int]:
    """(the decoder layers', the vocabulary projection's) weights one decode step multiplies by;
    `vocab_rows`: a projection cut to its first rows (speculative.draft_vocab_size)."""
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, k, v, o
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    rows = cfg.vocab_size if vocab_rows is None else min(vocab_rows, cfg.vocab_size)
    return cfg.num_layers * (attention + mlp), rows * cfg.hidden_size


def draft_guess_cost(draft: ModelConfig, target: ModelConfig, vocab_rows: int | None, int8_layers: bool) -> float:
    """A draft model's guess: its decoder layers (1 byte a weight when int8, else the target's
    width) and its possibly cut projection, against the target's step."""
    layers, projection = decode_weights(draft, vocab_rows)
    return (layers * (0.5 if int8_layers else 1.0) + projection) / sum(decode_weights(target))


def medusa_guess_cost(heads: MedusaConfig, target: ModelConfig) -> float:
    """A Medusa head's guess: its residual blocks (hidden x hidden each) and its projection."""
    per_head = heads.num_layers * heads.hidden_size ** 2 + heads.vocab_size * heads.hidden_size
    return per_head / sum(decode_weights(target))
