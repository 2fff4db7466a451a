"""engine/spec/draft_decode.py: the draft's catch-up batch and its follow-up batches, derived from
the previous one's tensors, equal what the model runner would build from the sequences."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.forward_batch import ForwardBatch
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.draft_decode import catch_up_batch, next_decode_batch
from engine.spec.proposer import Proposal

PAGE_SIZE = 4


def seq_of(request_id: str, num_tokens: int, first_page: int) -> Sequence:
    """A sequence whose last token's KV is not computed yet, with pages for 3 more tokens."""
    seq = Sequence(request_id, list(range(100, 100 + num_tokens)), SamplingParams(), num_tokens, 64)
    seq.num_computed_tokens = num_tokens - 1
    seq.page_table = list(range(first_page, first_page + -(-(num_tokens + 3) // PAGE_SIZE)))
    return seq


def built(seqs: list[Sequence]) -> ForwardBatch:
    runner = ModelRunner(None, None, PAGE_SIZE, "cpu")  # type: ignore[arg-type]  # build_batch only
    return runner.build_batch([ScheduledSeq(seq, 1) for seq in seqs])[0]


def assert_same(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    used = b.page_table.shape[1]  # the derived batch may keep wider padding
    assert torch.equal(a.page_table[:, :used], b.page_table)
    assert a.num_decode_seqs == b.num_decode_seqs


def test_follow_up_batches_equal_the_runners_as_rows_drop_out():
    seqs = [seq_of("a", 7, 10), seq_of("b", 4, 20), seq_of("c", 12, 30)]
    batch = catch_up_batch(seqs, PAGE_SIZE, torch.device("cpu"))
    assert_same(batch, built(seqs))
    for step, keep in enumerate([None, [0, 2], [1]]):
        for seq in seqs:
            seq.num_computed_tokens += 1
        live = seqs if keep is None else [seqs[i] for i in keep]
        for seq in live:
            seq.token_ids.append(500 + step)
        fed = torch.tensor([seq.token_ids[-1] for seq in live])
        batch = next_decode_batch(batch, fed, None if keep is None else torch.tensor(keep), PAGE_SIZE)
        assert_same(batch, built(live))
        seqs = live


def test_a_catch_up_of_several_tokens_is_decode_entries_guessing_from_each_last():
    """Twin a has 3 tokens without KV, b one: 4 one-token entries, laid out as the runner lays out a
    verification (a's last token then the two after it), logits at a's last entry and b's; the
    next step feeds each one token after its last."""
    a, b = seq_of("a", 7, 10), seq_of("b", 4, 20)
    a.num_computed_tokens = 4
    batch = catch_up_batch([a, b], PAGE_SIZE, torch.device("cpu"))
    short = Sequence("a", a.token_ids[:5], SamplingParams(), 5, 64)
    short.num_computed_tokens, short.page_table = 4, a.page_table
    runner = ModelRunner(None, None, PAGE_SIZE, "cpu")  # type: ignore[arg-type]  # build_batch only
    as_verify = runner.build_batch([ScheduledSeq(short, 1).with_draft(Proposal(tuple(a.token_ids[5:])), "x"),
                                    ScheduledSeq(b, 1)])[0]
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens"):
        assert torch.equal(getattr(batch, name), getattr(as_verify, name)), name
    assert batch.num_decode_seqs == 4
    assert batch.logits_indices.tolist() == [2, 3]
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(600)
    following = next_decode_batch(batch, torch.tensor([600, 600]), None, PAGE_SIZE)
    assert_same(following, built([a, b]))
