"""Draft-model speculative decoding (engine/spec/draft_proposer.py) against plain decoding and HF.

Targets are random built-ins; drafts are the target itself (it must accept every proposal) or
the target cut to its first layers (same vocabulary, cheaper, right only sometimes). Every test
checks the greedy tokens equal plain decoding's and that the draft's own pages, like the
target's, are all free afterwards.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.spec.draft_proposer import DraftModelProposer
from tests.helpers import assert_no_page_leak, prefill_and_ship, write_truncated_model
from tests.integration.test_spec_decode import GREEDY, assert_hf_greedy, check_same, make_engine, prompts_of, run


def draft_config(draft_dir, **extra) -> dict:
    return {"method": "draft", "draft_model": str(draft_dir), "num_tokens": 4, "max_batch_seqs": 0, **extra}


def proposer_of(engine: LLMEngine) -> DraftModelProposer:
    proposer = engine.speculator.proposers["draft"]
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def assert_draft_pages_free(engine: LLMEngine) -> None:
    proposer = proposer_of(engine)
    assert not proposer.twins
    held = [page for page, refs in enumerate(proposer.page_manager.ref_counts) if refs]
    assert not held, f"draft pages still referenced: {held[:10]}"
    assert proposer.page_manager.num_free_pages == proposer.page_manager.num_pages


def assert_twins_rolled_back(engine: LLMEngine) -> None:
    """Between steps a twin holds KV only of its sequence's own tokens (never a rejected guess),
    never the last one, and no page past that KV."""
    proposer, page_size = proposer_of(engine), engine.config.page_size
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    for request_id, twin in proposer.twins.items():
        seq, draft = running[request_id], twin.seq
        assert draft.num_computed_tokens <= seq.num_tokens - 1
        assert draft.token_ids[: draft.num_computed_tokens] == seq.token_ids[: draft.num_computed_tokens]
        assert len(draft.page_table) == -(-draft.num_computed_tokens // page_size), request_id


def run_shipped(model_dir, speculative: dict, prompts: dict[str, list[int]]) -> tuple[LLMEngine, dict]:
    """Disaggregated: each prompt prefilled on a plain engine and shipped to a decode engine that
    speculates with `speculative`, which runs them to the end (its draft twins checked rolled back
    after every step). Returns the decode engine and its finished outputs by request id."""
    prefill = make_engine(model_dir)
    decode = make_engine(model_dir, speculative)
    outs: dict = {}
    for rid, ids in prompts.items():
        first = prefill_and_ship(prefill, decode, rid, ids)
        assert decode.add_prefilled_request(rid, ids, first, GREEDY) is None
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outs[out.request_id] = out
        assert_twins_rolled_back(decode)
    return decode, outs


def run_checked(engine: LLMEngine, arrivals: dict[int, dict[str, list[int]]], params: SamplingParams) -> dict:
    """tests/integration/test_spec_decode.py's `run`, checking the twins after every step."""
    return run(engine, arrivals, params, check=assert_twins_rolled_back)


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_dir):
    prompts = prompts_of(4, 30, seed=51)
    plain = run(make_engine(tiny_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(tiny_dir, draft_config(tiny_dir))
    spec = run_checked(engine, {0: dict(prompts)}, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert proposed > 0 and accepted == proposed
    totals = engine.speculator.totals["draft"]
    # k grows to 4 and stays: 1 + 4 tokens a verifying step, so about a fifth of the steps.
    assert totals.num_verified < 0.35 * len(prompts) * GREEDY.max_tokens
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_a_smaller_draft_keeps_greedy_output_the_targets(loopy_dir, hf_loopy, loopy_draft_dir):
    prompts = prompts_of(5, 30, seed=53)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir))
    spec = run_checked(engine, {0: dict(prompts)}, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed  # the one-layer draft is right sometimes, wrong other times
    assert_hf_greedy(spec, dict(list(prompts.items())[:2]), hf_loopy)
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_long_prompts_catch_up_in_chunks_alongside_prefills(loopy_dir, loopy_draft_dir):
    """A token budget of 24 chunks the 70-token prompts for the target and for the draft's
    catch-up alike; staggered arrivals mix prompt chunks, decodes and verifications."""
    prompts = prompts_of(3, 70, seed=55)
    arrivals = {0: {"r0": prompts["r0"]}, 9: {"r1": prompts["r1"]}, 15: {"r2": prompts["r2"]}}
    config = dict(max_num_batched_tokens=24, max_num_seqs=4)
    plain = run(make_engine(loopy_dir, **config), {k: dict(v) for k, v in arrivals.items()}, GREEDY)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir), **config)
    spec = run_checked(engine, arrivals, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_the_drafts_prompt_kv_is_computed_beside_the_targets_prefill(loopy_dir, loopy_draft_dir):
    """In-process, each prompt chunk the target computes is computed by the twin in the same step
    (a token budget of 24: a 70-token prompt in 3 chunks), so its first proposal starts from the
    first sampled token; a step of more sequences than max_batch_seqs leaves it to `propose`."""
    prompt = prompts_of(1, 70, seed=65)["r0"]
    plain = run(make_engine(loopy_dir), {0: {"r0": prompt}}, GREEDY)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir), max_num_batched_tokens=24, max_num_seqs=4)
    proposer = proposer_of(engine)
    engine.add_request("r0", prompt, GREEDY)
    seen = []  # (target's computed tokens, twin's) after each prefill step
    while not engine.scheduler.running or engine.scheduler.running[0].num_tokens == len(prompt):
        engine.step()
        seq = engine.scheduler.running[0]
        seen.append((min(seq.num_computed_tokens, len(prompt)), proposer.twins["r0"].seq.num_computed_tokens))
    assert seen == [(24, 24), (48, 48), (70, 70)]
    out = run(engine, {}, GREEDY)["r0"]
    assert out.token_ids == plain["r0"].token_ids and out.num_spec_proposed > 0
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)

    crowded = make_engine(loopy_dir, draft_config(loopy_draft_dir, max_batch_seqs=1))
    for rid, ids in prompts_of(2, 30, seed=67).items():
        crowded.add_request(rid, ids, GREEDY)
    crowded.step()  # both prompts in one step of 2 sequences: no speculation, no draft prefill
    assert not proposer_of(crowded).twins


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_frees_and_rebuilds_the_draft(loopy_dir, hf_loopy, loopy_draft_dir, prefix_caching):
    prompts = prompts_of(4, 28, seed=57)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir), num_pages=16,
                         enable_prefix_caching=prefix_caching)
    spec = run_checked(engine, {0: dict(prompts)}, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_spec_accepted for o in spec.values()) > 0
    assert_hf_greedy(spec, prompts, hf_loopy)
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_abort_mid_speculation_frees_the_drafts_pages(loopy_dir, loopy_draft_dir):
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir))
    prompts = prompts_of(3, 30, seed=59)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    for _ in range(6):
        engine.step()
    assert proposer_of(engine).page_manager.num_referenced_pages > 0
    for rid in prompts:
        assert engine.abort_request(rid)
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_decode_worker_recomputes_the_drafts_prompt_kv(loopy_dir, loopy_draft_dir):
    """Disaggregated: the target's prompt KV arrives from a prefill engine; the decode engine's
    draft computes its own from the prompt on the first speculating step."""
    prompts = prompts_of(3, 40, seed=61)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    decode, outs = run_shipped(loopy_dir, draft_config(loopy_draft_dir), prompts)
    for rid in prompts:  # (the first token's log-probability is the prefill side's)
        assert outs[rid].token_ids == plain[rid].token_ids, rid
    accepted = sum(o.num_spec_accepted for o in outs.values())
    assert 0 < accepted < sum(o.num_spec_proposed for o in outs.values())
    assert_no_page_leak(decode)
    assert_draft_pages_free(decode)


def test_sampling_with_a_point_mass_target_equals_greedy(loopy_dir, loopy_draft_dir):
    """Greedy draft proposals are point masses; with top_k=1 the target is one too, so rejection
    sampling must keep exactly the greedy tokens."""
    prompts = prompts_of(3, 25, seed=63)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    sampled = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True, temperature=0.8, top_k=1, seed=4)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir))
    proposed, accepted = check_same(plain, run(engine, {0: dict(prompts)}, sampled))
    assert 0 < accepted < proposed
    assert_draft_pages_free(engine)


def test_sampled_requests_verify_the_drafts_distributions(tiny_dir):
    """The model as its own draft and plain temperature sampling: the draft's distribution is the
    target's (q = p), so the general rule accepts nearly every guess; a point-mass rule would
    accept a guess only with probability p(guess). Seeded, a run repeats exactly."""
    prompts = prompts_of(3, 30, seed=67)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_dir, draft_config(tiny_dir))
        runs.append(run_checked(engine, {0: dict(prompts)}, params))
        assert_draft_pages_free(engine)
    assert all(runs[0][rid].token_ids == runs[1][rid].token_ids for rid in prompts)
    proposed = sum(o.num_spec_proposed for o in runs[0].values())
    accepted = sum(o.num_spec_accepted for o in runs[0].values())
    assert proposed > 40 and accepted >= 0.97 * proposed


def test_requests_choose_the_draft_where_one_is_loaded(loopy_dir, loopy_draft_dir):
    prompts = prompts_of(2, 30, seed=65)
    engine = make_engine(loopy_dir, {"method": "prompt_lookup", "draft_model": str(loopy_draft_dir)})
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative_method="draft")
    run(engine, {0: dict(prompts)}, params)
    assert engine.speculator.totals["draft"].num_proposed > 0
    assert "prompt_lookup" not in engine.speculator.totals
    # Without a draft model, asking for one decodes without speculation.
    plain_engine = make_engine(loopy_dir)
    run(plain_engine, {0: dict(prompts)}, params)
    assert not plain_engine.speculator.totals
    assert_draft_pages_free(engine)


def test_bad_draft_settings_fail_with_their_reason(tiny_dir, tmp_path):
    with pytest.raises(ValidationError, match="method 'draft' needs speculative.draft_model"):
        EngineConfig(speculative={"method": "draft"})
    with pytest.raises(ValidationError, match="draft_model runs on one process"):
        EngineConfig(speculative={"method": "draft", "draft_model": str(tiny_dir)}, tensor_parallel_size=2)
    with pytest.raises(FileNotFoundError, match="neither a built-in name"):
        LLMEngine(EngineConfig(speculative={"method": "draft", "draft_model": str(tmp_path / "missing")}))
    small_vocab = tmp_path / "small-vocab"
    write_truncated_model(tiny_dir, small_vocab, num_layers=1, vocab_size=2048)
    with pytest.raises(ValueError, match="vocab_size 2048, the target 4096: a draft must use the target's tokenizer"):
        LLMEngine(EngineConfig(model=str(tiny_dir), speculative={"method": "draft", "draft_model": str(small_vocab)}))
    with pytest.raises(ValueError, match="speculative_method must be one of none, prompt_lookup, draft, medusa"):
        SamplingParams(speculative_method="eagle")
    with pytest.raises(ValidationError, match="draft_quantization"):
        EngineConfig(speculative={"method": "draft", "draft_model": str(tiny_dir), "draft_quantization": "int4"})
    with pytest.raises(ValueError, match="draft_quantization int8 needs a bf16 draft on a CPU with AVX512-VNNI"):
        LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", speculative={
            "method": "draft", "draft_model": str(tiny_dir), "draft_quantization": "int8"}))


def test_a_draft_scoring_only_the_first_token_ids_guesses_among_them_and_stays_exact(loopy_dir, loopy_draft_dir):
    """speculative.draft_vocab_size: the random prompts' tokens run to 4000, so the loopy target
    repeats tokens the restricted draft can never guess; its output is still the target's."""
    prompts = prompts_of(4, 30, seed=83)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(loopy_dir, draft_config(loopy_draft_dir, draft_vocab_size=2000))
    proposer = proposer_of(engine)
    guessed: list[int] = []
    propose = proposer.propose
    proposer.propose = lambda seqs, ks: [guessed.extend(p.token_ids) or p for p in propose(seqs, ks)]  # type: ignore[method-assign]
    spec = run_checked(engine, {0: dict(prompts)}, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed
    assert guessed and max(guessed) < 2000
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)
    # Sampled: guesses are drawn from the restricted distribution (zero past the limit), which
    # goes with the proposal for the general rejection rule; a seeded run repeats.
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=9)
    runs = [run_checked(make_engine(loopy_dir, draft_config(loopy_draft_dir, draft_vocab_size=2000)),
                        {0: dict(prompts)}, params) for _ in range(2)]
    assert all(runs[0][rid].token_ids == runs[1][rid].token_ids for rid in prompts)
    assert sum(o.num_spec_accepted for o in runs[0].values()) > 0
