"""Built-in checkpoints: made locally, since no hub is reachable.

The loader (engine/model/loader.py) resolves a `builtin:NAME` model to a directory in the cache,
building it on first use. `builtin:tiny` and `builtin:small` are made here: a byte-level BPE
tokenizer trained on a fixed local corpus (this Python's standard library sources) and a
deterministically, randomly initialised Llama checkpoint, both written in Hugging Face format
(engine/model/hf_files.py) so transformers (and any other tool) loads the same files. Building a
name twice gives identical bytes. `builtin:code-small` and `builtin:code-draft` are trained on
that corpus instead (engine/model/trained_builtins.py: minutes, not seconds); this module names
them and caches them the same way.

Why the init scale is large: with tied embeddings and the usual std=0.02, the residual stream
is dominated by the input embedding, so the tied output layer scores the current token
highest and greedy decoding repeats it forever - an equality test against any reference would
then pass almost blindly. A larger std lets the layers dominate, and continuations depend on
the prompt (tests/unit/test_builtin_models.py checks this)."""

from __future__ import annotations

import fcntl
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.model.hf_files import ModelShape, write_bpe_tokenizer, write_checkpoint

BUILTIN_PREFIX = "builtin:"
FORMAT_VERSION = "v1"  # bump when the recipe changes, so stale caches are not reused


@dataclass(frozen=True)
class BuiltinSpec(ModelShape):
    """A random built-in: its shape, then how it is made. The fields stay flat (asdict is
    pdserve_builtin.json, whose bytes must not change)."""

    init_std: float
    corpus_bytes: int  # how much of the corpus the tokenizer trains on
    seed: int


BUILTIN_SPECS = {
    "tiny": BuiltinSpec(4096, 256, 4, 8, 4, 704, 2048, init_std=0.2, corpus_bytes=2_000_000, seed=1234),
    "small": BuiltinSpec(32000, 768, 12, 12, 4, 2048, 4096, init_std=0.15, corpus_bytes=6_000_000, seed=5678),
}
# Trained on the corpus by engine/model/trained_builtins.py, which owns their recipes and cache names.
TRAINED_NAMES = ("code-small", "code-draft")
# Not models: Medusa heads for code-small (engine/model/medusa_heads.py), trained and cached the same
# way, named where heads are (speculative.medusa_heads), never where a model is.
TRAINED_HEADS = ("code-medusa",)


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + n for n in (*BUILTIN_SPECS, *TRAINED_NAMES)]


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def parse_builtin(model: str) -> str | None:
    """'builtin:tiny' -> 'tiny'; None for anything that is not a built-in name."""
    if not model.startswith(BUILTIN_PREFIX):
        return None
    name = model[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_SPECS and name not in TRAINED_NAMES:
        raise ValueError(f"unknown built-in model {model!r}; choose one of {builtin_names()}")
    return name


def cache_entry_name(name: str) -> str:
    """The cache directory's name: it changes with the recipe's version, so a stale build is never reused."""
    if name in TRAINED_NAMES or name in TRAINED_HEADS:
        from engine.model.trained_builtins import trained_cache_entry_name

        return trained_cache_entry_name(name)
    return f"builtin-{name}-{FORMAT_VERSION}"


def ensure_builtin(name: str, cache_dir: str | Path | None = None) -> Path:
    """Returns the directory of built-in model `name`, building it into the cache if absent."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    entry = cache_entry_name(name)
    target = root / entry
    # Builds are renamed into place whole: the weights file there means a finished one.
    weights = "medusa_lm_head.safetensors" if name in TRAINED_HEADS else "model.safetensors"
    if (target / weights).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One builder per entry: the workers of a cluster starting together would otherwise each
    # train a trained built-in for minutes. The others wait here, then find it finished.
    with open(root / f".{entry}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / weights).is_file():
            return target
        # Build beside the target and rename, so a crash never leaves a half-written model that a
        # later run would mistake for a finished one.
        tmp = Path(tempfile.mkdtemp(prefix=f".building-{name}-", dir=root))
        try:
            build_builtin(name, tmp, root)
            try:
                tmp.rename(target)
            except OSError:  # another process finished first; its bytes are identical
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def build_builtin(name: str, out_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Writes built-in model `name` in Hugging Face format into `out_dir` (a trained one whose
    recipe starts from another built-in, the draft, finds that one in `cache_dir`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if name in TRAINED_NAMES or name in TRAINED_HEADS:
        from engine.model.trained_builtins import build_trained

        return build_trained(name, out, cache_dir)
    spec = BUILTIN_SPECS[name]
    with tqdm(total=3, desc=f"building builtin:{name}", unit="step", disable=None) as bar:
        bar.set_postfix_str("training tokenizer")
        write_bpe_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, _corpus_lines(spec.corpus_bytes))
        bar.update()
        bar.set_postfix_str("initialising weights")
        tensors = _init_weights(spec)
        bar.update()
        bar.set_postfix_str("writing safetensors")
        write_checkpoint(out, spec.hf_config(), tensors, {"name": name, **asdict(spec)})
        bar.update()
    return out


def corpus_files() -> list[Path]:
    """The fixed corpus: this interpreter's top-level stdlib modules, in name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _corpus_lines(limit_bytes: int):
    total = 0
    for path in corpus_files():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            total += len(line)
            if total > limit_bytes:
                return
            yield line


def _init_weights(spec: BuiltinSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden_size // spec.num_heads
    h, kv = spec.num_heads * head_dim, spec.num_kv_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.init_std).contiguous()

    tensors = {"model.embed_tokens.weight": normal(spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(h, spec.hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, spec.hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, spec.hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = normal(spec.hidden_size, h) / spec.num_layers**0.5
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, spec.hidden_size)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, spec.hidden_size)
        tensors[p + "mlp.down_proj.weight"] = normal(spec.hidden_size, spec.intermediate_size) / spec.num_layers**0.5
        tensors[p + "input_layernorm.weight"] = torch.ones(spec.hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(spec.hidden_size)
    tensors["model.norm.weight"] = torch.ones(spec.hidden_size)
    return tensors

