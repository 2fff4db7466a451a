"""Training a target model on the corpus: next-token cross-entropy, then the held-out loss.

`pdserve model train` and the first use of `builtin:code-small` (engine/model/trained_builtins.py)
run `train_checkpoint`: the corpus split (engine/model/train_corpus.py) -> a BPE tokenizer fitted
on the train split (engine/model/hf_files.py) -> token streams -> a seeded model
(engine/model/train_model.py) -> `train`, the shared loop (engine/model/train_loop.py) on the
next-token loss -> held-out loss and perplexity -> the checkpoint in Hugging Face format.
"""

from __future__ import annotations

import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.model.hf_files import ModelShape, write_bpe_tokenizer, write_checkpoint
from engine.model.train_corpus import WindowSampler, held_out_windows, split_corpus, token_stream
from engine.model.train_loop import Compute, LoopStats, TrainSettings, batched, describe_run, run_steps, using_threads
from engine.model.train_model import build_model, checkpoint_tensors


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in float32. logits [batch, seq, vocab], targets [batch, seq]."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, windows: torch.Tensor, compute: Compute, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats per token) over `windows` [n, seq_len + 1]."""
    model.eval()
    total, count = 0.0, 0
    with using_threads(compute.threads), compute.autocast():
        for batch in batched(windows, batch_size):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            total += next_token_loss(logits, batch[:, 1:]).item() * batch[:, 1:].numel()
            count += batch[:, 1:].numel()
    return total / count


def train(model: torch.nn.Module, sampler: WindowSampler, s: TrainSettings, compute: Compute,
          desc: str = "training", progress: bool | None = None) -> LoopStats:
    """s.steps steps of next-token training on `sampler`'s batches, in place."""

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        with compute.autocast():
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return next_token_loss(logits, batch[:, 1:])

    return run_steps(model, batch_loss, sampler, s, compute, desc, progress)


@dataclass(frozen=True)
class TrainReport:
    recipe: str
    shape: ModelShape
    settings: TrainSettings
    compute: Compute  # compile as it ran (False if compiling failed)
    stats: LoopStats
    held_out_loss: float
    held_out_tokens: int
    corpus: dict

    @property
    def perplexity(self) -> float:
        return math.exp(self.held_out_loss)

    def summary(self) -> str:
        st = self.stats
        return (f"trained {self.recipe} ({self.shape.num_parameters() / 1e6:.1f}M parameters): "
                f"{describe_run(st, self.compute)}; final train loss {st.last_loss:.3f}\n"
                f"held-out loss {self.held_out_loss:.4f} nats/token, perplexity {self.perplexity:.2f} "
                f"({self.held_out_tokens:,} tokens of {self.corpus['held_out_files']} held-out stdlib files)")

    def about(self) -> dict:
        """What pdserve_builtin.json records: everything that decides the bytes, and the result (no timings,
        so that two builds are byte-identical)."""
        return {"recipe": self.recipe, "kind": "trained target", "shape": asdict(self.shape),
                "settings": asdict(self.settings), "compute": asdict(self.compute), "corpus": self.corpus,
                "held_out_loss": round(self.held_out_loss, 6), "held_out_perplexity": round(self.perplexity, 4),
                "python": platform.python_version(), "torch": torch.__version__}


def train_checkpoint(out: Path, recipe: str, shape: ModelShape, s: TrainSettings, compute: Compute,
                     progress: bool | None = None) -> TrainReport:
    """Fits the tokenizer, trains the model and writes the checkpoint into `out` (made if absent)."""
    out.mkdir(parents=True, exist_ok=True)
    split = split_corpus()
    with tqdm(total=2, desc=f"preparing {recipe}", unit="stage", disable=None if progress is None
              else not progress) as bar:
        bar.set_postfix_str("fitting the tokenizer")
        write_bpe_tokenizer(out, shape.vocab_size, shape.max_position_embeddings, split.train_lines())
        bar.update()
        bar.set_postfix_str("tokenizing the corpus")
        train_stream = token_stream(out / "tokenizer.json", [split.read(f) for f in split.train])
        held_out = held_out_windows(token_stream(out / "tokenizer.json", [split.read(f) for f in split.held_out]),
                                    s.seq_len, s.eval_windows)
        bar.update()
    model = build_model(shape, s.seed)
    stats = train(model, WindowSampler(train_stream, s.seq_len, s.seed), s, compute, f"training {recipe}", progress)
    loss = held_out_loss(model, held_out, compute, s.batch_size)
    corpus = {"train_files": len(split.train), "held_out_files": len(split.held_out),
              "train_tokens": train_stream.numel(), "epochs": round(stats.tokens / train_stream.numel(), 3)}
    report = TrainReport(recipe, shape, s, Compute(compute.threads, compute.bf16, stats.compiled), stats, loss,
                         held_out[:, 1:].numel(), corpus)
    write_checkpoint(out, shape.hf_config(), checkpoint_tensors(model), report.about())
    return report
