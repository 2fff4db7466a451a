"""From a model name to a ready model and tokenizer: resolve, read config, load weights.

First stop of engine start-up (engine/engine.py). `builtin:NAME` resolves to the built-in
checkpoint (built into the cache on first use: seconds for the random ones, minutes of training
for `builtin:code-small` / `builtin:code-draft`); anything else must be a local Hugging Face
directory with config.json and safetensors weights (a single file or an index of shards).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine import huge_pages
from engine.model.attention import AttentionBackend
from engine.model.builtin import builtin_names, ensure_builtin, parse_builtin
from engine.model.compute_dtype import DTYPES  # noqa: F401  (re-exported for the benchmarks)
from engine.model.config import ModelConfig
from engine.model.layers import ParallelContext
from engine.model.llama import LlamaForCausalLM


def resolve_model_path(model: str, cache_dir: str | None = None) -> Path:
    builtin = parse_builtin(model)
    if builtin is not None:
        return ensure_builtin(builtin, cache_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is neither a built-in name ({', '.join(builtin_names())}) nor a local directory"
        )
    return path


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, in the order HF itself prefers: the single file, the
    sharded index, then any other *.safetensors (but never Mistral's consolidated.* copy, which
    holds the same weights under other names)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (pickled .bin checkpoints are not loaded)")
    return files


def load_model(path: Path, dtype: torch.dtype, device: str, backend: AttentionBackend,
               ctx: ParallelContext | None = None, layers: range | None = None,
               int8_layers: bool = False) -> LlamaForCausalLM:
    """The model, or the shard `ctx` / `layers` select (engine/parallel/model_shard.py);
    `int8_layers`: its decoder layers' few-row products on int8 weights (a draft's:
    speculative.draft_quantization)."""
    cfg = ModelConfig.from_dir(path)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, backend, ctx, layers).to(dtype)

    def tensors():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)

    model.load_weights(tensors())
    model.pack_weights(int8_layers)
    # Every decode step streams all the weights: onto huge pages (engine/huge_pages.py).
    packed_output = [model.packed_output] if model.packed_output is not None else []
    huge_pages.collapse([*model.parameters(), *packed_output, *model.gemv_buffers()])
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
