"""engine/spec/batch_policy.py and its use by the speculator: speculation is turned off in steps
with more than `max_batch_seqs` sequences (no proposer even runs) and bounded by
`max_batch_tokens` below that. No model: a real scheduler over sequences set up as decodes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from configs.engine import EngineSettings, SpeculativeConfig
from engine.page_manager import PageManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec import Speculator
from engine.spec.batch_policy import proposal_budget
from engine.spec.proposer import BaseProposer, Proposal


def test_budget_is_zero_above_the_sequence_threshold():
    config = SpeculativeConfig(method="prompt_lookup", max_batch_seqs=8, max_batch_tokens=0)
    assert proposal_budget(config, 8, 8, 2048) == 2040
    assert proposal_budget(config, 9, 9, 2048) == 0
    assert proposal_budget(config.model_copy(update={"max_batch_seqs": 0}), 500, 500, 2048) == 1548  # no limit


def test_budget_below_the_threshold_fills_up_to_max_batch_tokens_and_the_step_budget():
    config = SpeculativeConfig(method="prompt_lookup", max_batch_seqs=8, max_batch_tokens=48)
    assert proposal_budget(config, 4, 4, 2048) == 44
    assert proposal_budget(config, 2, 60, 2048) == 0  # a prompt chunk already passed 48
    assert proposal_budget(config, 4, 4, 10) == 6  # the scheduler's own budget is tighter


def test_default_and_validation():
    assert SpeculativeConfig().max_batch_seqs == 4
    for bad in (-1, 5000, "8", 2.0):
        with pytest.raises(ValidationError, match="max_batch_seqs"):
            EngineSettings.model_validate({"speculative": {"max_batch_seqs": bad}})


class AlwaysProposer(BaseProposer):
    """Proposes k copies of token 7 and counts the sequences it was asked about."""

    method = "prompt_lookup"

    def __init__(self) -> None:
        self.num_asked = 0

    def propose(self, seqs, max_num_tokens):
        self.num_asked += len(seqs)
        return [Proposal((7,) * k) for k in max_num_tokens]


def decoding_batch(num_seqs: int, scheduler: Scheduler) -> None:
    """`num_seqs` running sequences whose next step is an ordinary decode."""
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=32), i, 512)
        seq.token_ids.append(5)  # the first generated token, not yet computed
        seq.num_computed_tokens = 4
        seq.page_table = scheduler.pages.allocate(1)
        scheduler.add_running(seq)


@pytest.mark.parametrize("num_seqs", [1, 4, 6, 7, 12, 40])
def test_no_step_above_the_threshold_speculates(num_seqs):
    threshold = 6
    # (a fixed k: the adaptive one also turns down as the step grows, test_adaptive_k.py)
    config = SpeculativeConfig(method="prompt_lookup", num_tokens=3, max_batch_seqs=threshold, max_batch_tokens=0,
                               adaptive=False)
    proposer = AlwaysProposer()
    speculator = Speculator(config, {"prompt_lookup": proposer})
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(num_seqs, scheduler)
    out = scheduler.schedule()
    assert len(out.scheduled) == num_seqs
    speculator.plan(out, scheduler)
    num_drafted = sum(s.draft is not None for s in out.scheduled)
    if num_seqs > threshold:
        assert num_drafted == 0 and proposer.num_asked == 0  # not even proposed
    else:
        assert num_drafted == num_seqs and all(s.num_draft_tokens == 3 for s in out.scheduled)
