"""Fitting Medusa heads to a frozen target: head i learns the token i + 2 positions past each hidden state.

`pdserve model train-medusa` and the first use of `builtin:code-medusa`
(engine/model/trained_builtins.py) run `train_medusa_checkpoint`: the target checkpoint (frozen,
float32, as transformers loads it) -> the corpus's train split as token streams under the
target's tokenizer (engine/model/train_corpus.py) -> heads (engine/model/medusa_heads.py) that
start as Medusa's do, each block the identity and each projection a copy of the target's own
vocabulary projection -> `run_steps`, the shared loop (engine/model/train_loop.py), on the
Medusa-1 loss -> held-out loss and top-1 accuracy per head, before and after -> the published
layout (medusa_lm_head.safetensors + config.json).

The loss (Medusa-1): at every position t of a window the target's final-norm hidden state h_t
(the row whose logits give token t + 1) feeds every head, and head i's cross-entropy is against
the text's token t + 2 + i, weighted by HEAD_DECAY ** i (later heads are harder and matter less:
a guess counts only if every earlier one was accepted). With soft labels (Medusa's
self-distillation) head i instead learns the target's own distribution for that token, the
target's logits at position t + 1 + i (KL(target || head)): what is accepted is the target's
choice, not the text's.
"""

from __future__ import annotations

import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.distill import kl_to_target
from engine.model.medusa_heads import MedusaConfig, MedusaHeads, write_heads
from engine.model.train_corpus import WindowSampler, held_out_windows, split_corpus, token_stream
from engine.model.train_loop import Compute, LoopStats, TrainSettings, batched, describe_run, run_steps, using_threads
from engine.model.train_model import load_hf_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_DECAY = 0.8  # Medusa's weighting of head i's loss: HEAD_DECAY ** i


def init_heads(cfg: MedusaConfig, target: PreTrainedModel) -> MedusaHeads:
    """Medusa's start: every block the identity (zero linear), every projection the target's lm_head."""
    heads = MedusaHeads(cfg)
    output = target.get_output_embeddings()
    assert isinstance(output, torch.nn.Linear)  # a causal LM's vocabulary projection
    with torch.no_grad():
        for i in range(cfg.num_heads):
            for block in heads.blocks(i):
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            heads.projection(i).weight.copy_(output.weight)
    return heads.float()


def medusa_losses(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor,
                  target_logits: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Head i's mean loss for each i. hidden [batch, seq, hidden] the target's at the window's
    inputs, tokens [batch, seq + 1] the window: head i at position t scores token t + 2 + i, by
    cross-entropy against the text or, given the target's logits [batch, seq, vocab] at the same
    inputs, by KL to the target's distribution for that token (its logits at t + 1 + i)."""
    seq = hidden.shape[1]
    losses = []
    for i, head in enumerate(heads):
        logits = head(hidden[:, : seq - 1 - i])  # [batch, seq - 1 - i, vocab]
        if target_logits is None:
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 2 + i :].flatten()))
        else:
            losses.append(kl_to_target(target_logits[:, 1 + i :], logits))
    return losses


def target_hidden(target: PreTrainedModel, inputs: torch.Tensor) -> torch.Tensor:
    """[batch, seq] -> [batch, seq, hidden]: the final-norm hidden states the lm_head reads
    (the decoder's output, without the head on top)."""
    with torch.no_grad():
        return target.base_model(input_ids=inputs, use_cache=False).last_hidden_state


def train_heads(heads: MedusaHeads, target: PreTrainedModel, sampler: WindowSampler, s: TrainSettings,
                compute: Compute, desc: str = "training Medusa heads", progress: bool | None = None,
                soft_labels: bool = False) -> LoopStats:
    """s.steps steps of the Medusa-1 loss on `sampler`'s windows, the target frozen."""
    target.eval().requires_grad_(False)
    weights = [HEAD_DECAY**i for i in range(len(heads))]
    output = target.get_output_embeddings()
    assert isinstance(output, torch.nn.Linear)

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        with compute.autocast():
            hidden = target_hidden(target, batch[:, :-1])
            target_logits = None
            if soft_labels:
                with torch.no_grad():
                    target_logits = output(hidden)
            losses = medusa_losses(heads, hidden, batch, target_logits)
        return torch.stack([w * loss for w, loss in zip(weights, losses)]).sum() / sum(weights)

    return run_steps(heads, batch_loss, sampler, s, compute, desc, progress)


@dataclass(frozen=True)
class HeadStats:
    losses: tuple[float, ...]  # per head, nats/token against the text
    top1: tuple[float, ...]  # per head, fraction of positions whose argmax is the text's token

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)


@torch.no_grad()
def held_out_heads(heads: MedusaHeads, target: PreTrainedModel, windows: torch.Tensor, compute: Compute,
                   batch_size: int) -> HeadStats:
    heads.eval()
    n = len(heads)
    loss_sums, hit_sums, counts = [0.0] * n, [0.0] * n, [0] * n
    with using_threads(compute.threads), compute.autocast():
        for batch in batched(windows, batch_size):
            hidden = target_hidden(target, batch[:, :-1])
            seq = hidden.shape[1]
            for i, head in enumerate(heads):
                logits = head(hidden[:, : seq - 1 - i]).float()
                expected = batch[:, 2 + i :]
                loss_sums[i] += F.cross_entropy(logits.flatten(0, 1), expected.flatten(), reduction="sum").item()
                hit_sums[i] += (logits.argmax(-1) == expected).sum().item()
                counts[i] += expected.numel()
    heads.train()
    return HeadStats(tuple(a / c for a, c in zip(loss_sums, counts)), tuple(a / c for a, c in zip(hit_sums, counts)))


@dataclass(frozen=True)
class MedusaReport:
    recipe: str
    target: str
    heads: MedusaConfig
    settings: TrainSettings
    compute: Compute
    stats: LoopStats
    before: HeadStats  # held out, the heads as initialised
    after: HeadStats
    soft_labels: bool = False
    tied_projection: bool = False

    def summary(self) -> str:
        st, a = self.stats, self.after
        per_head = ", ".join(f"head {i} (token +{i + 2}): loss {loss:.3f}, top-1 {top1:.1%}"
                             for i, (loss, top1) in enumerate(zip(a.losses, a.top1)))
        labels = "the target's distributions (KL)" if self.soft_labels else "the text"
        tied = ", projections tied to the target's" if self.tied_projection else ""
        return (f"trained {self.recipe}: {self.heads.num_heads} Medusa heads of {self.heads.num_layers} layer(s) on "
                f"{self.target}{tied}, against {labels}: {describe_run(st, self.compute)}; final train loss "
                f"{st.last_loss:.3f}\n"
                f"held-out loss {self.before.mean_loss:.4f} -> {a.mean_loss:.4f} nats/token (mean over heads); "
                f"{per_head}")

    def about(self) -> dict:
        return {"recipe": self.recipe, "kind": "medusa heads", "target": self.target, "heads": asdict(self.heads),
                "settings": asdict(self.settings), "compute": asdict(self.compute), "head_decay": HEAD_DECAY,
                "soft_labels": self.soft_labels, "tied_projection": self.tied_projection,
                "held_out_before": asdict(self.before), "held_out_after": asdict(self.after),
                "python": platform.python_version(), "torch": torch.__version__}


def train_medusa_checkpoint(target_dir: Path, out: Path, recipe: str, target_name: str, num_heads: int,
                            num_layers: int, s: TrainSettings, compute: Compute, progress: bool | None = None,
                            soft_labels: bool = False, tied_projection: bool = False) -> MedusaReport:
    """Fits `num_heads` heads of `num_layers` blocks to the checkpoint in `target_dir` (against the
    text, or the target's distributions with `soft_labels`; with `tied_projection` only the blocks
    learn, each projection staying the target's own); writes them into `out`."""
    # Before minutes of work, and before the output directory is made.
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"the target {target_dir} is not a Hugging Face checkpoint: it has no config.json")
    if not (target_dir / "tokenizer.json").is_file():
        raise ValueError(f"the target {target_dir} has no tokenizer.json (the corpus is tokenized with it)")
    target = load_hf_model(target_dir)
    cfg = MedusaConfig(num_heads, num_layers, target.config.hidden_size, target.config.vocab_size)
    split = split_corpus()
    train_stream = token_stream(target_dir / "tokenizer.json", [split.read(f) for f in split.train])
    held_out = held_out_windows(token_stream(target_dir / "tokenizer.json", [split.read(f) for f in split.held_out]),
                                s.seq_len, s.eval_windows)
    heads = init_heads(cfg, target)
    if tied_projection:  # written out all the same: the published layout has a projection per head
        for i in range(num_heads):
            heads.projection(i).weight.requires_grad_(False)
    before = held_out_heads(heads, target, held_out, compute, s.batch_size)
    stats = train_heads(heads, target, WindowSampler(train_stream, s.seq_len, s.seed), s, compute,
                        f"training {recipe}", progress, soft_labels)
    after = held_out_heads(heads, target, held_out, compute, s.batch_size)
    if not math.isfinite(after.mean_loss):
        raise RuntimeError(f"{recipe}: the held-out loss is {after.mean_loss}")
    report = MedusaReport(recipe, target_name, cfg, s, Compute(compute.threads, compute.bf16, stats.compiled), stats,
                          before, after, soft_labels, tied_projection)
    write_heads(out, heads, target_name, report.about())
    return report
