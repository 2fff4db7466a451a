"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens greedily.

The speculator (engine/spec/speculator.py) calls `propose` for the step's speculating decodes.
Each target sequence has a twin here: a Sequence over the draft's own pages (engine/spec/
draft_model.py) holding the same tokens, whose KV the draft computes. One `propose` call:
  0. prefill (colocated: where the engine prefills the target, in steps small enough to
     speculate; on a decode worker: while the request's KV is on its way, the speculator's
     `prefill_ahead`): the twin computes the same prompt chunk, so the first proposal's catch-up is
     the first sampled token alone (one compiled call) and the prompt's draft cost lands in the
     time to first token, with the target's own prefill, not in the first decode step;
  1. sync: the twin keeps the KV of its tokens that are still the sequence's (its last proposals
     may have been rejected, or never verified); the rest is rolled back and the sequence's new
     tokens (the accepted run and the target's own token; on first use, whatever of the prompt
     was not prefilled, as on a decode worker whose request's KV arrived first) are queued;
  2. one draft step over all twins computes those tokens (when every twin's are at most
     MAX_DECODE_CATCH_UP, one-token decode entries each; else a prompt chunk or a decode each,
     the catch-up per call capped at the engine's token budget, so a long prompt is chunked over
     steps and proposes nothing until done) and takes the argmax after each sequence's last token;
  3. k - 1 more draft decode steps, each feeding the previous guess, for the twins that want more
     (their batches derived from the previous one's tensors: engine/spec/draft_decode.py).
Where the twins are all greedy and the draft's layers run in one call, steps 3 (and 2 too, when
its catch-ups are decode entries, as after each verification) go to one compiled call instead:
engine/spec/fused_draft.py, the same guesses and KV.
The twin then holds KV for the sequence's tokens and the first k - 1 guesses. `on_verified`
rolls it back to the accepted ones and frees the pages past them; `release` frees all of the
twin's pages when the sequence finishes, aborts or is preempted.

A greedy request's guesses are the draft's argmax (point masses: the output stays exactly the
target's greedy tokens). A sampled request's guesses are drawn from the draft's distribution
under the request's own temperature, top-k and top-p, which go with the proposal as
`draft_probs` for the general rejection rule (engine/spec/rejection.py): the output is
distributed as the target's. A seeded request's draft draws come from a generator of its own,
seeded from the request's seed but not equal to it: the draft's draws must be independent of the
verification's, which use the request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.draft_decode import catch_up_batch, decode_inputs, next_decode_batch
from engine.spec.draft_model import DraftModel
from engine.spec.proposer import NO_PROPOSAL, BaseProposer, Proposal
from engine.spec.rejection import target_probs

# Mixes a request's seed into its draft generator's (an LCG step): same seed, same draft draws,
# but never the verification's own stream.
_SEED_MULTIPLIER, _SEED_INCREMENT = 6364136223846793005, 1442695040888963407

# A catch-up of at most this many tokens (each twin's) is computed as one-token decode entries,
# in the compiled call where it serves: after a verification it is one token, or two when every
# guess was accepted; prompts and longer runs go through the runner as prompt chunks.
MAX_DECODE_CATCH_UP = 8
# A draft whose twin has not computed the sequence's prompt (it joined a busy decode worker, or the
# cost policy had the method off at its prefill) catches up only where the tokens left can repay
# it: at most this many catch-up tokens per token left. On a 2-core Zen 4 a catch-up costs ~0.05
# ms a token (~15 ms for 300 on one core) and a speculated token saves ~0.5 ms of a ~1.2 ms small-
# batch step, so a request that first speculates at the tail of a burst, with a few tokens left,
# would pay more than it saves (docs/benchmarks.md, "A recipe that trains in 15 minutes").
CATCH_UP_PER_TOKEN_LEFT = 10


@dataclass
class DraftTwin:
    seq: Sequence  # the draft's: tokens, pages, num_computed_tokens (KV in the draft's cache)
    num_synced_tokens: int = 0  # leading tokens known to equal the target sequence's


class DraftModelProposer(BaseProposer):
    method = "draft"
    prefills = True

    def __init__(self, draft: DraftModel, max_catch_up_tokens: int) -> None:
        self.draft = draft
        self.page_manager = draft.page_manager
        self.page_size = draft.page_manager.page_size
        self.max_catch_up_tokens = max_catch_up_tokens
        self.twins: dict[str, DraftTwin] = {}  # by request id
        self.fused_steps = draft.fused_steps()  # None: the follow-up steps run in Python
        self.guess_cost = draft.guess_cost

    # -- the proposer interface -----------------------------------------------------------------
    def prefill(self, chunks: Seq[tuple[Sequence, int]]) -> None:
        """The target computes these prompt chunks in this step: each twin computes its KV through
        the same tokens (from wherever its own KV ends: a prefix the target had cached is
        computed here), in one draft step; a twin whose pages are short is left for `propose`."""
        step = []
        for seq, n in chunks:
            twin = self._twin(seq).seq
            end = seq.num_computed_tokens + n
            if twin.num_computed_tokens >= end or not self._allocate_through(twin, end):
                continue
            twin.token_ids[twin.num_computed_tokens:] = seq.token_ids[twin.num_computed_tokens:end]
            step.append(ScheduledSeq(twin, end - twin.num_computed_tokens))
        if not step:
            return
        self.draft.runner.execute_hidden(step)  # KV only: the guesses start after the target's first token
        for s in step:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.twins[s.seq.request_id].num_synced_tokens = s.seq.num_computed_tokens

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        guesses: dict[int, list[int]] = {}  # index in seqs -> tokens proposed so far
        draws: dict[int, list[torch.Tensor]] = {}  # index in seqs -> [vocab] distributions (sampled requests)
        wants: dict[int, int] = {}  # index in seqs -> k
        step: list[ScheduledSeq] = []
        index_of: dict[int, int] = {}  # id(twin sequence) -> index in seqs
        budget = self.max_catch_up_tokens
        self.computed_prompt = False
        for i, (seq, k) in enumerate(zip(seqs, max_num_tokens)):
            # Guess j is fed at position num_tokens + j - 1: stay inside the draft's context.
            k = min(k, self.draft.max_model_len - seq.num_tokens)
            if k <= 0 or budget <= 0:
                continue
            twin = self._sync(seq)
            num_new = seq.num_tokens - twin.seq.num_computed_tokens  # >= 1 (sync keeps the last token)
            if (twin.seq.num_computed_tokens < seq.num_prompt_tokens
                    and num_new > CATCH_UP_PER_TOKEN_LEFT * seq.num_tokens_left):
                continue  # its prompt's KV would cost more than its proposals can save
            chunk = min(num_new, budget)
            # Pages through the catch-up and, when it completes, the k - 1 guesses fed back.
            end = twin.seq.num_computed_tokens + chunk + (k - 1 if chunk == num_new else 0)
            if not self._allocate_through(twin.seq, end):
                continue  # the draft's pages are short: no proposal for this one now
            budget -= chunk
            self.computed_prompt |= twin.seq.num_computed_tokens < seq.num_prompt_tokens
            step.append(ScheduledSeq(twin.seq, chunk))
            index_of[id(twin.seq)] = i
            if chunk == num_new:
                wants[i], guesses[i] = k, []
        # Catch-up step, then one decode step per further guess over the twins still guessing,
        # each batch derived from the last one. A short catch-up (every twin's, after a
        # verification) is packed as one-token decode entries; a long one (a prompt, a run of
        # prompt lookup's accepted tokens) is a prompt chunk, built by the runner.
        twins = [s.seq for s in step]
        short = len(wants) == len(step) and all(s.num_new_tokens <= MAX_DECODE_CATCH_UP for s in step)
        if step and short and self._fused_serves(twins, sum(s.num_new_tokens for s in step)):
            self._guess_fused(twins, index_of, guesses, wants)  # the whole proposal in one compiled call
        elif step:
            runner = self.draft.runner
            batch: ForwardBatch | None = None
            if short:
                batch = catch_up_batch(twins, self.page_size, runner.device)
                hidden, live = runner.executor.run(batch), twins
            else:
                hidden, sampled = runner.execute_hidden(step)
                live = [s.seq for s in sampled]
            logits = self.draft.logits(hidden)
            for s in step:
                s.seq.num_computed_tokens += s.num_new_tokens
            while live:
                rows = self._take_guesses(logits, live, index_of, guesses, draws, wants)
                if not rows:
                    break
                live_next = [live[row] for row in rows]
                if batch is None and self._fused_serves(live_next, len(live_next)):
                    self._guess_fused(live_next, index_of, guesses, wants)
                    break
                if batch is None:
                    batch = catch_up_batch(live_next, self.page_size, runner.device)
                else:
                    fed = torch.tensor([seq.token_ids[-1] for seq in live_next])
                    keep = None if len(rows) == len(live) else torch.tensor(rows)
                    batch = next_decode_batch(batch, fed, keep, self.page_size)
                logits = self.draft.logits(runner.executor.run(batch))
                live = live_next
                for seq in live:
                    seq.num_computed_tokens += 1
        proposals = [NO_PROPOSAL] * len(seqs)
        for i, tokens in guesses.items():
            proposals[i] = Proposal(tuple(tokens), torch.stack(draws[i]) if i in draws else None)
        return proposals

    def _take_guesses(self, logits: torch.Tensor, seqs: list[Sequence], index_of: dict[int, int],
                      guesses: dict[int, list[int]], draws: dict[int, list[torch.Tensor]],
                      wants: dict[int, int]) -> list[int]:
        """Each twin's next guess from its row of `logits`; returns the rows of the twins that
        want another (their guess appended to their tokens: fed next step, its KV the next position's)."""
        more = []
        for row, (seq, token) in enumerate(zip(seqs, logits.argmax(dim=-1).tolist())):
            i = index_of[id(seq)]
            if not seq.params.greedy:
                q = target_probs(logits[row : row + 1], seq.params)[0]  # [vocab]
                token = int(torch.multinomial(q, 1, generator=seq.generator)[0])
                draws.setdefault(i, []).append(q)
            guesses[i].append(token)
            if len(guesses[i]) < wants[i]:
                seq.token_ids.append(token)
                more.append(row)
        return more

    def _fused_serves(self, seqs: list[Sequence], num_rows: int) -> bool:
        """Whether the compiled loop takes these twins, whose first step has `num_rows` entries."""
        fused = self.fused_steps
        return fused is not None and fused.serves(num_rows) and all(seq.params.greedy for seq in seqs)

    def _guess_fused(self, seqs: list[Sequence], index_of: dict[int, int], guesses: dict[int, list[int]],
                     wants: dict[int, int]) -> None:
        """The rest of each twin's guesses in one compiled call (engine/spec/fused_draft.py), from
        its tokens without KV on: what the loop in `propose` makes of them, guesses, fed tokens
        and KV alike."""
        assert self.fused_steps is not None
        remaining = [wants[index_of[id(seq)]] - len(guesses[index_of[id(seq)]]) for seq in seqs]
        out = self.fused_steps(*decode_inputs(seqs), torch.tensor(remaining, dtype=torch.int64)).tolist()
        for col, (seq, n) in enumerate(zip(seqs, remaining)):
            new = [row[col] for row in out[:n]]
            guesses[index_of[id(seq)]] += new
            seq.token_ids += new[:-1]  # every guess but the last is fed back, its KV computed
            seq.num_computed_tokens = seq.num_tokens

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        """The first `num_accepted` guesses are the sequence's now: keep their KV, drop the rest."""
        twin = self.twins.get(seq.request_id)
        if twin is None:
            return
        keep = min(twin.seq.num_computed_tokens, twin.num_synced_tokens + num_accepted)
        self._roll_back(twin.seq, keep)
        twin.num_synced_tokens = keep

    def release(self, seq: Sequence) -> None:
        twin = self.twins.pop(seq.request_id, None)
        if twin is not None:
            self._roll_back(twin.seq, 0)

    # -- the twin's KV ----------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> DraftTwin:
        """The sequence's twin, its KV rolled back to the tokens still the sequence's (never the
        last one, whose logits the guesses start from) and its tokens the sequence's."""
        twin = self._twin(seq)
        draft, target = twin.seq.token_ids, seq.token_ids
        limit = min(twin.seq.num_computed_tokens, seq.num_tokens - 1)
        agree = min(twin.num_synced_tokens, limit)
        while agree < limit and draft[agree] == target[agree]:
            agree += 1
        self._roll_back(twin.seq, agree)
        draft[agree:] = target[agree:]
        twin.num_synced_tokens = seq.num_tokens
        return twin

    def _twin(self, seq: Sequence) -> DraftTwin:
        """The sequence's twin, made (holding nothing) on first use."""
        twin = self.twins.get(seq.request_id)
        if twin is None:
            twin = DraftTwin(Sequence(seq.request_id, [], seq.params, 0, seq.max_total_tokens))
            if seq.params.seed is not None:
                seed = (seq.params.seed * _SEED_MULTIPLIER + _SEED_INCREMENT) % 2**64
                twin.seq.generator = torch.Generator().manual_seed(seed)
            self.twins[seq.request_id] = twin
        return twin

    def _allocate_through(self, seq: Sequence, num_tokens: int) -> bool:
        need = max(0, -(-num_tokens // self.page_size) - len(seq.page_table))
        if not self.page_manager.can_allocate(need):
            return False
        seq.page_table += self.page_manager.allocate(need)
        return True

    def _roll_back(self, seq: Sequence, num_tokens: int) -> None:
        """KV through `num_tokens` stays; the pages past it go back to the draft's free list."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        del seq.token_ids[num_tokens:]
        keep = -(-num_tokens // self.page_size)
        if len(seq.page_table) > keep:
            self.page_manager.release(reversed(seq.page_table[keep:]))
            del seq.page_table[keep:]
