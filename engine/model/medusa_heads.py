"""Medusa heads: small networks on the target's last hidden state that guess the tokens after next.

Loaded beside the target by the engine (engine/engine.py) when `speculative.medusa_heads` is set;
engine/spec/medusa_proposer.py runs them, engine/model/train_medusa.py fits them. Medusa
(Cai et al. 2024) puts N heads on the target's final-norm hidden state h_t at position t (the
row whose logits give token t + 1): head i is `num_layers` residual blocks x + SiLU(W x + b)
followed by its own vocabulary projection, and guesses token t + 2 + i.

The published layout (read by `load_medusa_heads`, written by `write_heads`): Medusa-1's
`medusa_lm_head.safetensors` / `.pt` stores head i's blocks as `{i}.{j}.linear.weight` /
`.bias` and its projection as `{i}.{num_layers}.weight`, with `medusa_num_heads` and
`medusa_num_layers` in the directory's config.json; Medusa-2 checkpoints hold the same tensors
under `medusa_head.` inside the whole model's safetensors. `MedusaHeads` is
that module tree (an nn.ModuleList of nn.Sequential), so its state dict is the layout itself.
A `.pt` file is read with torch.load(weights_only=True): tensors only, never pickled code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import SkinnyLinear, linear, pack_weight

if TYPE_CHECKING:
    from engine.model.attention import AttentionBackend

CONFIG_FILE = "config.json"
# The heads' weight files, in the order they are looked for in a directory.
HEADS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")
MEDUSA2_PREFIX = "medusa_head."
ABOUT_FILE = "pdserve_medusa.json"  # how pdserve made them (engine/model/train_medusa.py)


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    hidden_size: int
    vocab_size: int

    def hf_config(self, base_model: str) -> dict:
        """config.json as Medusa writes it (its keys), plus the sizes the heads were made for."""
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "base_model_name_or_path": base_model}


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), Medusa's block (its linear starts at zero: the block starts as identity)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """Head i: ResBlock x num_layers, then Linear(hidden, vocab, bias=False)."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__([nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)],
                                        nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
                          for _ in range(cfg.num_heads)])
        self.cfg = cfg
        self.skinny: SkinnyLinear | None = None  # the engine's few-row kernel, set by prepare_for_serving
        self.shared_projection: Callable[[torch.Tensor], torch.Tensor] | None = None  # the target's, where tied

    def blocks(self, i: int) -> list[ResBlock]:
        """Head i's residual blocks."""
        return [block for block in self._head(i) if isinstance(block, ResBlock)]

    def projection(self, i: int) -> nn.Linear:
        """Head i's vocabulary projection."""
        last = self._head(i)[-1]
        assert isinstance(last, nn.Linear)
        return last

    def _head(self, i: int) -> nn.Sequential:
        head = self[i]
        assert isinstance(head, nn.Sequential)
        return head

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> [num_heads, n, vocab]: the first `num_heads` heads' logits."""
        return torch.stack([head(hidden) for head in list(self)[: num_heads or len(self)]])

    def prepare_for_serving(self, backend: AttentionBackend, target_output: torch.Tensor | None = None,
                            project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """After loading, for `top1` only: every linear into the engine's fast layout where its
        backend packs (oneDNN, and the packed GEMV kernel for one row). Each vocabulary projection
        is as big as the target's own, so multiplying it the way the target's is multiplied
        matters: 3 heads of code-small took 1.2 ms a step through F.linear, 0.75 ms packed. Heads
        whose projections all equal `target_output` (the target's own, plain: trained with
        `--tie-projection`) skip theirs: `project` (the target's compute_logits) multiplies every
        head's row in one product, reading the weight once (0.18 ms for 3 rows of code-small)."""
        self.skinny = backend.skinny_linear
        if project is not None and target_output is not None and all(
                self.projection(i).weight.shape == target_output.shape
                and torch.equal(self.projection(i).weight, target_output) for i in range(len(self))):
            self.shared_projection = project
        if backend.packs_linears:
            unused = {id(self.projection(i)) for i in range(len(self))} if self.shared_projection else set()
            for module in self.modules():
                if isinstance(module, nn.Linear) and id(module) not in unused:
                    pack_weight(module)

    @torch.inference_mode()
    def top1(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """hidden [n, hidden] -> [n, num_heads] int64: each head's most likely token."""
        rows = []  # each head's input to its projection, [n, hidden]
        for i in range(num_heads):
            x = hidden
            for block in self.blocks(i):
                x = x + F.silu(self._linear(block.linear, x))
            rows.append(x)
        if self.shared_projection is not None:  # one product over [n * num_heads, hidden]
            logits = self.shared_projection(torch.stack(rows, dim=1).flatten(0, 1)).view(len(hidden), num_heads, -1)
        else:
            logits = torch.stack([self._linear(self.projection(i), x) for i, x in enumerate(rows)], dim=1)
        return logits.argmax(dim=-1).cpu()  # [n, num_heads]

    def _linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias, self.skinny, getattr(module, "gemv", None))


def resolve_heads_path(name: str, cache_dir: str | None = None) -> Path:
    """`builtin:code-medusa` (heads for builtin:code-small, trained into the cache on first use)
    or a local directory / weights file."""
    from engine.model.builtin import BUILTIN_PREFIX, TRAINED_HEADS, ensure_builtin

    if name.startswith(BUILTIN_PREFIX):
        builtin = name[len(BUILTIN_PREFIX):]
        if builtin not in TRAINED_HEADS:
            raise ValueError(f"unknown built-in Medusa heads {name!r}; choose one of "
                             f"{[BUILTIN_PREFIX + n for n in TRAINED_HEADS]} or a directory")
        return ensure_builtin(builtin, cache_dir)
    return Path(name).expanduser()


def find_heads_file(path: Path) -> Path:
    """The weights file of heads at `path`: a file itself, or the first of HEADS_FILES in a directory."""
    if path.is_file():
        if path.suffix not in (".safetensors", ".pt"):
            raise ValueError(f"Medusa heads {str(path)!r}: expected a .safetensors or .pt file")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"Medusa heads {str(path)!r}: no such file or directory")
    for name in HEADS_FILES:
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"Medusa heads {str(path)!r}: the directory has none of {', '.join(HEADS_FILES)}")


def read_config(weights: Path) -> tuple[int, int]:
    """(medusa_num_heads, medusa_num_layers) from the config.json beside `weights`."""
    config_path = weights.parent / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"Medusa heads {str(weights)!r}: no {CONFIG_FILE} beside it (it names "
                                "medusa_num_heads and medusa_num_layers)")
    config = json.loads(config_path.read_text())
    num_heads, num_layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    for key, value in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "medusa_num_heads" else 0):
            raise ValueError(f"Medusa heads {str(config_path)!r}: {key} must be a whole number "
                             f"{'>= 1' if key == 'medusa_num_heads' else '>= 0'}, got {value!r}")
    return num_heads, num_layers


def read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    """The heads' tensors, named as in Medusa-1 (a Medusa-2 `medusa_head.` prefix removed)."""
    if weights.suffix == ".pt":
        # weights_only: a .pt file may carry pickled code; only tensors (and plain containers) load.
        state = torch.load(weights, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"Medusa heads {str(weights)!r}: expected a state dict, got {type(state).__name__}")
        tensors = dict(state)
    else:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            names = list(f.keys())
            if any(n.startswith(MEDUSA2_PREFIX) for n in names):  # a whole model: read the heads only
                names = [n for n in names if n.startswith(MEDUSA2_PREFIX)]
            tensors = {n: f.get_tensor(n) for n in names}
    if any(n.startswith(MEDUSA2_PREFIX) for n in tensors):
        tensors = {n.removeprefix(MEDUSA2_PREFIX): t for n, t in tensors.items() if n.startswith(MEDUSA2_PREFIX)}
    return tensors


def load_medusa_heads(path: Path, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                      device: str | torch.device) -> MedusaHeads:
    """Heads for a target of `hidden_size` and `vocab_size`. Raises (naming the file and the
    tensor) on a missing, unexpected or mis-shaped tensor, or sizes that are not the target's."""
    weights = find_heads_file(path)
    num_heads, num_layers = read_config(weights)
    tensors = read_tensors(weights)
    where = f"Medusa heads {str(weights)!r}"
    projection = tensors.get(f"0.{num_layers}.weight")
    if projection is not None and projection.dim() == 2:
        if projection.shape[1] != hidden_size:
            raise ValueError(f"{where} have hidden size {projection.shape[1]}, the target {hidden_size}: "
                             "heads must be trained on this target's hidden states")
        if projection.shape[0] != vocab_size:
            raise ValueError(f"{where} project to a vocabulary of {projection.shape[0]}, the target's has "
                             f"{vocab_size}: heads must share the target's tokenizer")
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, hidden_size, vocab_size))
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{where} lack {len(missing)} tensors for {num_heads} heads of {num_layers} layers "
                         f"(config.json), e.g. {missing[:3]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{where} have tensors with no place in {num_heads} heads of {num_layers} layers "
                         f"(config.json): {unexpected[:3]}")
    for name, param in expected.items():
        if tensors[name].shape != param.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(tensors[name].shape)}, expected "
                             f"{list(param.shape)} (hidden size {hidden_size}, vocabulary {vocab_size})")
    heads.load_state_dict({name: t.float() for name, t in tensors.items()})
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def write_heads(out: Path, heads: MedusaHeads, base_model: str, about: dict | None = None) -> None:
    """The published Medusa-1 layout: medusa_lm_head.safetensors and config.json (and `about`,
    what made them, as pdserve_medusa.json)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().float().contiguous().clone() for name, t in heads.state_dict().items()}
    save_file(tensors, str(out / HEADS_FILES[0]), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(heads.cfg.hf_config(base_model), indent=2) + "\n")
    if about is not None:
        (out / ABOUT_FILE).write_text(json.dumps(about, indent=2, sort_keys=True) + "\n")
