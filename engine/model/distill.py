"""Distilling a draft model from a target: the draft learns the target's next-token distributions.

`pdserve model distill` and the first use of `builtin:code-draft` (engine/model/trained_builtins.py)
run `distill_checkpoint`: the target checkpoint (its tokenizer is the draft's) -> the corpus's
train split as token streams (engine/model/train_corpus.py) -> a seeded draft
(engine/model/train_model.py), starting from every target tensor it shares by name and shape ->
`distill`, the shared loop (engine/model/train_loop.py) minimising KL(target || draft) at
temperature 1 on the same text -> held-out loss, KL and top-1 agreement with the target (what
speculative decoding's acceptance rate follows) -> the checkpoint in Hugging Face format.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.model.hf_files import ModelShape, copy_tokenizer, write_checkpoint
from engine.model.own_text import MixedSampler, OwnText, own_text_windows
from engine.model.train import next_token_loss
from engine.model.train_corpus import BatchSource, WindowSampler, held_out_windows, split_corpus, token_stream
from engine.model.train_loop import Compute, LoopStats, TrainSettings, batched, describe_run, run_steps, using_threads
from engine.model.train_model import build_model, checkpoint_tensors, load_hf_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def kl_to_target(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_target || p_draft), softmax at temperature 1, in float32.
    Both [..., vocab]. Zero exactly when the draft's distributions equal the target's."""
    vocab = target_logits.shape[-1]
    target_logp = F.log_softmax(target_logits.float().reshape(-1, vocab), dim=-1)
    draft_logp = F.log_softmax(draft_logits.float().reshape(-1, vocab), dim=-1)
    return F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")


def init_from_target(draft: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    """Copies into the draft every target tensor with the same name and shape (with the same
    width: the embedding, the final norm and the first layers); returns their names."""
    target_state = target.state_dict()
    copied = []
    with torch.no_grad():
        for name, param in sorted(draft.named_parameters()):
            source = target_state.get(name)
            if source is not None and source.shape == param.shape:
                param.copy_(source)
                copied.append(name)
    return copied


def distill(draft: PreTrainedModel, target: PreTrainedModel, sampler: BatchSource, s: TrainSettings,
            compute: Compute, desc: str = "distilling", progress: bool | None = None) -> LoopStats:
    """s.steps steps moving the draft's next-token distributions towards the (frozen) target's."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}); a draft must share its target's tokenizer")
    target.eval().requires_grad_(False)

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with compute.autocast():
            with torch.no_grad():
                target_logits = target(input_ids=inputs, use_cache=False).logits
            draft_logits = draft(input_ids=inputs, use_cache=False).logits
        return kl_to_target(target_logits, draft_logits)

    return run_steps(draft, batch_loss, sampler, s, compute, desc, progress)


@dataclass(frozen=True)
class AgreementStats:
    draft_loss: float  # next-token cross-entropy against the text, nats/token
    target_loss: float
    kl: float  # mean KL(target || draft)
    top1_agreement: float  # fraction of positions where the draft's argmax is the target's
    tokens: int


@torch.no_grad()
def held_out_agreement(draft: torch.nn.Module, target: torch.nn.Module, windows: torch.Tensor, compute: Compute,
                       batch_size: int) -> AgreementStats:
    draft.eval()
    target.eval()
    sums = {"draft": 0.0, "target": 0.0, "kl": 0.0, "agree": 0.0}
    count = 0
    with using_threads(compute.threads), compute.autocast():
        for batch in batched(windows, batch_size):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            n = targets.numel()
            target_logits = target(input_ids=inputs, use_cache=False).logits.float()
            draft_logits = draft(input_ids=inputs, use_cache=False).logits.float()
            sums["draft"] += next_token_loss(draft_logits, targets).item() * n
            sums["target"] += next_token_loss(target_logits, targets).item() * n
            sums["kl"] += kl_to_target(target_logits, draft_logits).item() * n
            sums["agree"] += (draft_logits.argmax(-1) == target_logits.argmax(-1)).sum().item()
            count += n
    return AgreementStats(sums["draft"] / count, sums["target"] / count, sums["kl"] / count, sums["agree"] / count,
                          count)


@dataclass(frozen=True)
class DistillReport:
    recipe: str
    target: str
    shape: ModelShape
    settings: TrainSettings
    compute: Compute  # compile as it ran
    stats: LoopStats
    held_out: AgreementStats
    copied_from_target: int  # tensors the draft started from
    own_text: OwnText | None = None  # the target's own windows in each batch (engine/model/own_text.py)

    def summary(self) -> str:
        st, h = self.stats, self.held_out
        return (f"distilled {self.recipe} ({self.shape.num_parameters() / 1e6:.1f}M parameters) from {self.target}: "
                f"{describe_run(st, self.compute)}; final train KL {st.last_loss:.3f}\n"
                f"held-out ({h.tokens:,} tokens): draft loss {h.draft_loss:.4f} (perplexity {math.exp(h.draft_loss):.2f}),"
                f" target loss {h.target_loss:.4f} (perplexity {math.exp(h.target_loss):.2f}), KL(target||draft) "
                f"{h.kl:.4f}, top-1 agreement with the target {h.top1_agreement:.1%}")

    def about(self) -> dict:
        return {"recipe": self.recipe, "kind": "distilled draft", "target": self.target, "shape": asdict(self.shape),
                "settings": asdict(self.settings), "compute": asdict(self.compute),
                "copied_from_target": self.copied_from_target,
                "own_text": asdict(self.own_text) if self.own_text is not None else None,
                "held_out": {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self.held_out).items()},
                "python": platform.python_version(), "torch": torch.__version__}


def check_target(target_dir: Path, shape: ModelShape) -> None:
    """Fails at once, with what is wrong, where a target cannot be distilled into a draft of
    `shape`: before minutes of work, and before the output directory is made."""
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"the target {target_dir} is not a Hugging Face checkpoint: it has no config.json")
    if not (target_dir / "tokenizer.json").is_file():
        raise ValueError(f"the target {target_dir} has no tokenizer.json; the draft shares the target's tokenizer "
                         "(a fast tokenizer's tokenizer.json)")
    vocab_size = json.loads((target_dir / "config.json").read_text()).get("vocab_size")
    if vocab_size != shape.vocab_size:
        raise ValueError(f"the target {target_dir} has a vocabulary of {vocab_size} tokens and the draft one of "
                         f"{shape.vocab_size}: a draft shares its target's tokenizer (builtin:code-small's, or a "
                         "checkpoint trained with it)")


def distill_checkpoint(target_dir: Path, out: Path, recipe: str, target_name: str, shape: ModelShape,
                       s: TrainSettings, compute: Compute, progress: bool | None = None,
                       own: OwnText | None = None) -> DistillReport:
    """Distils a draft of `shape` from the checkpoint in `target_dir` and writes it into `out` (made if
    absent); with `own`, part of every batch is text the target wrote (engine/model/own_text.py)."""
    check_target(target_dir, shape)
    out.mkdir(parents=True, exist_ok=True)
    target = load_hf_model(target_dir)
    copy_tokenizer(target_dir, out)
    split = split_corpus()
    train_stream = token_stream(out / "tokenizer.json", [split.read(f) for f in split.train])
    held_out = held_out_windows(token_stream(out / "tokenizer.json", [split.read(f) for f in split.held_out]),
                                s.seq_len, s.eval_windows)
    draft = build_model(shape, s.seed)
    copied = init_from_target(draft, target)
    sampler: BatchSource = WindowSampler(train_stream, s.seq_len, s.seed)
    if own is not None:
        written = own_text_windows(target, train_stream, s.seq_len, own, s.seed, compute, progress)
        sampler = MixedSampler(sampler, written, own.per_batch, s.seed)
    stats = distill(draft, target, sampler, s, compute, f"distilling {recipe}", progress)
    agreement = held_out_agreement(draft, target, held_out, compute, s.batch_size)
    report = DistillReport(recipe, target_name, shape, s, Compute(compute.threads, compute.bf16, stats.compiled),
                           stats, agreement, len(copied), own)
    write_checkpoint(out, shape.hf_config(), checkpoint_tensors(draft), report.about())
    return report
