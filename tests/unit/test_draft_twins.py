"""engine/spec/draft_proposer.py's page accounting with no model: a stand-in runner whose "draft"
always guesses the last token + 1, so every twin's KV length and page count is known exactly
after each propose, verification, rejection, dropped proposal and release."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.page_manager import PageManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec.draft_proposer import DraftModelProposer

VOCAB, PAGE_SIZE = 64, 4


def one_hot_next(tokens) -> torch.Tensor:
    """Logits whose argmax is each token + 1 (the twin's "model")."""
    logits = torch.zeros(len(tokens), VOCAB)
    for row, token in enumerate(tokens):
        logits[row, (int(token) + 1) % VOCAB] = 1.0
    return logits


class CountingRunner:
    """Logits (standing in for the hidden rows; the twin draft's `logits` passes them through)
    whose argmax is each sampling sequence's last token + 1; records the step sizes: a long
    catch-up through `execute_hidden`, a short one's decode entries and the follow-up one-token
    steps through `executor.run`."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.steps: list[list[int]] = []  # tokens computed per scheduled twin, per call
        self.executor = SimpleNamespace(run=self._run_decodes)

    def execute_hidden(self, scheduled):
        self.steps.append([s.num_new_tokens for s in scheduled])
        sampled = [s for s in scheduled if s.samples]
        return one_hot_next([s.seq.token_ids[-1] for s in sampled]), sampled

    def _run_decodes(self, batch):
        self.steps.append([1] * batch.num_decode_seqs)
        return one_hot_next(batch.input_ids[batch.logits_indices].tolist())


def proposer(num_pages: int = 32, max_catch_up_tokens: int = 64) -> DraftModelProposer:
    draft = SimpleNamespace(runner=CountingRunner(), page_manager=PageManager(num_pages, PAGE_SIZE, False),
                            max_model_len=128, logits=lambda hidden: hidden,
                            fused_steps=lambda: None, guess_cost=0.3)  # its follow-up steps: executor.run
    return DraftModelProposer(draft, max_catch_up_tokens)  # type: ignore[arg-type]


def decoding(request_id: str = "a", prompt_len: int = 10) -> Sequence:
    seq = Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), 0, 128)
    seq.token_ids.append(30)  # the first generated token
    return seq


def twin_state(p: DraftModelProposer, seq: Sequence) -> tuple[int, int]:
    twin = p.twins[seq.request_id].seq
    return twin.num_computed_tokens, len(twin.page_table)


def test_guesses_then_rollback_to_the_accepted_run():
    p, seq = proposer(), decoding()
    [proposal] = p.propose([seq], [3])
    assert proposal.token_ids == (31, 32, 33)
    assert p.draft.runner.steps == [[11], [1], [1]]  # catch-up of prompt + token, then 2 fed guesses
    assert p.computed_prompt  # its prompt was not prefilled here: the cost policy leaves this step out
    assert twin_state(p, seq) == (13, 4)  # 11 tokens + guesses 31, 32 computed; 13 tokens = 4 pages
    p.on_verified(seq, 1)  # 31 accepted, 32 rejected
    assert twin_state(p, seq) == (12, 3)
    seq.token_ids += [31, 50]  # what the engine appends: the accepted guess and the target's token
    [proposal] = p.propose([seq], [2])
    assert proposal.token_ids == (51, 52)
    assert p.draft.runner.steps[-2:] == [[1], [1]]  # only the target's token was new
    assert not p.computed_prompt
    p.on_verified(seq, 2)
    assert twin_state(p, seq) == (14, 4)  # 13 tokens + 51 (52 was never fed)
    p.release(seq)
    assert not p.twins and p.page_manager.num_free_pages == 32


def test_a_dropped_proposal_is_rolled_back_by_the_next_sync():
    p, seq = proposer(), decoding()
    p.propose([seq], [4])
    assert twin_state(p, seq) == (14, 4)
    seq.token_ids.append(7)  # the step ran without the proposal (no target pages): a plain token
    [proposal] = p.propose([seq], [1])
    assert proposal.token_ids == (8,)
    assert twin_state(p, seq) == (12, 3)  # back to the 11 shared tokens, then 7 computed
    p.on_verified(seq, 0)
    p.release(seq)
    assert p.page_manager.num_free_pages == 32


def test_a_long_catch_up_is_chunked_and_proposes_nothing_until_done():
    p, seq = proposer(max_catch_up_tokens=8), decoding(prompt_len=20)
    assert p.propose([seq], [2])[0].token_ids == ()
    assert p.propose([seq], [2])[0].token_ids == ()
    assert twin_state(p, seq) == (16, 4)
    assert p.propose([seq], [2])[0].token_ids == (31, 32)
    assert p.computed_prompt  # its last 4 prompt tokens were in this call's catch-up
    # The last 5 (at most MAX_DECODE_CATCH_UP) as one-token decode entries, then the fed guess.
    assert p.draft.runner.steps == [[8], [8], [1, 1, 1, 1, 1], [1]]
    p.release(seq)
    assert p.page_manager.num_free_pages == 32


def test_a_prompt_catch_up_is_declined_where_the_tokens_left_cannot_repay_it():
    """A twin without the prompt's KV (a request that joined a busy decode worker) catches up
    only with at most CATCH_UP_PER_TOKEN_LEFT catch-up tokens per token the request has left; a
    twin that has the prompt proposes to the last token."""
    from engine.spec.draft_proposer import CATCH_UP_PER_TOKEN_LEFT

    p = proposer()
    assert CATCH_UP_PER_TOKEN_LEFT == 10
    late = Sequence("late", list(range(1, 11)), SamplingParams(max_tokens=2), 0, 128)
    late.token_ids.append(30)  # 11 tokens to catch up, 1 left: 11 > 10 x 1
    assert late.num_tokens_left == 1
    assert p.propose([late], [1])[0].token_ids == () and p.draft.runner.steps == []
    assert p.page_manager.num_free_pages == 32  # nothing computed, no page taken
    roomier = Sequence("roomier", list(range(1, 11)), SamplingParams(max_tokens=3), 0, 128)
    roomier.token_ids.append(30)  # 2 left: 11 <= 20
    assert p.propose([roomier], [1])[0].token_ids == (31,)
    prefilled = Sequence("prefilled", list(range(1, 11)), SamplingParams(max_tokens=2), 0, 128)
    p.prefill([(prefilled, 10)])  # its prompt beside the target's
    prefilled.num_computed_tokens = 10
    prefilled.token_ids.append(30)
    assert p.propose([prefilled], [1])[0].token_ids == (31,)  # 1 left, but only the first token to catch up
    for seq in (late, roomier, prefilled):
        p.release(seq)
    assert not p.twins and p.page_manager.num_free_pages == 32


def test_no_proposal_where_the_drafts_pages_are_short():
    p = proposer(num_pages=4)
    first, second = decoding("a"), decoding("b")
    a, b = p.propose([first, second], [3, 3])
    assert a.token_ids == (31, 32, 33) and b.token_ids == ()  # 4 pages: one twin's 13 tokens
    for seq in (first, second):
        p.release(seq)
    assert p.page_manager.num_free_pages == 4


def test_a_decode_workers_prompt_ahead_in_chunks_within_the_batch_threshold():
    """Speculator.expect / prefill_ahead: a request whose KV is on its way gets its draft prompt
    KV a chunk per call, only where its step would speculate; a join keeps it, a forget frees it."""
    from configs.engine import SpeculativeConfig
    from engine.spec import Speculator

    p = proposer()
    speculator = Speculator(SpeculativeConfig(method="none", max_batch_seqs=4, cost_policy=False), {"draft": p})
    params = SamplingParams(max_tokens=8, speculative_method="draft")
    joining, dropped = (Sequence(rid, list(range(1, 21)), params, 0, 128) for rid in "ab")
    speculator.expect(joining)
    speculator.expect(dropped)
    assert not speculator.prefill_ahead(num_step_seqs=5, max_tokens=64)  # past max_batch_seqs: no draft work
    assert not p.twins
    assert speculator.prefill_ahead(num_step_seqs=4, max_tokens=12)
    assert speculator.prefill_ahead(num_step_seqs=4, max_tokens=12)
    assert p.draft.runner.steps == [[12], [8]]
    assert speculator.prefill_ahead(num_step_seqs=1, max_tokens=64)
    assert not speculator.prefill_ahead(num_step_seqs=1, max_tokens=64)  # both prompts done
    assert twin_state(p, joining) == (20, 5) and twin_state(p, dropped) == (20, 5)
    speculator.joined("a")
    speculator.forget("a")  # joined: the running sequence owns its twin now
    speculator.forget("b")
    assert list(p.twins) == ["a"] and p.page_manager.num_free_pages == 32 - 5
    joining.token_ids.append(30)  # as it joins: the prefill worker's first token
    [proposal] = p.propose([joining], [2])
    assert proposal.token_ids == (31, 32) and not p.computed_prompt
    assert p.draft.runner.steps[-2:] == [[1], [1]]  # the first token alone, then the fed guess
