"""engine/spec/fused_draft.py: a draft's greedy follow-up steps in one compiled call
(kernels/cpu/greedy_steps.cpp) against the Python loop of engine/spec/draft_proposer.py, in bf16
where the draft's layers run fused: the same guesses, the same KV for them, the same output."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sequence import Sequence
from engine.spec.draft_proposer import DraftModelProposer
from kernels import cpu_ops, packed_linear
from tests.integration.test_draft_spec import assert_draft_pages_free, draft_config, proposer_of
from tests.integration.test_spec_decode import GREEDY, check_same, make_engine, prompts_of, run

if cpu_ops.load() is None:
    pytest.skip(f"CPU extension unavailable: {cpu_ops.load_error()}", allow_module_level=True)


def _engine(target_dir, draft_dir, fused: bool, **speculative):
    if speculative.get("draft_quantization") == "int8" and not packed_linear.int8_supported():
        pytest.skip("no int8 products here (they need AVX512-VNNI and AVX512-BF16)")
    engine = make_engine(target_dir, draft_config(draft_dir, **speculative), dtype="bfloat16")
    proposer = proposer_of(engine)
    if proposer.fused_steps is None:
        pytest.skip("no fused draft steps on this CPU (the packed GEMV needs AVX512-BF16)")
    if not fused:
        proposer.fused_steps = None
    return engine


@pytest.fixture
def compiled_calls(monkeypatch) -> list[int]:
    """The rows of every compiled greedy_steps call made during the test."""
    calls: list[int] = []
    real = cpu_ops.greedy_steps

    def counted(input_ids, *args):
        calls.append(input_ids.shape[0])
        return real(input_ids, *args)

    monkeypatch.setattr(cpu_ops, "greedy_steps", counted)
    return calls


def _twin_kv(p: DraftModelProposer, request_id: str) -> list[torch.Tensor]:
    """The KV rows the twin holds, layer by layer, in token order."""
    twin, kv = p.twins[request_id].seq, p.draft.kv_cache
    slots = [twin.page_table[t // p.page_size] * p.page_size + t % p.page_size for t in range(twin.num_computed_tokens)]
    rows = []
    for layer in range(p.draft.config.num_layers):
        for cache in kv.layer(layer):
            rows.append(cache.flatten(0, 1)[slots].clone())  # [tokens, kv_heads, head_dim]
    return rows


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_compiled_steps_guess_and_store_what_the_python_loop_does(loopy_dir, loopy_draft_dir, compiled_calls,
                                                                  quantization):
    """Three twins at different lengths asking for different k (rows leave the compiled batch as
    their guesses run out); a second round after a partial acceptance (a one-token catch-up
    each); a third after every guess was accepted (two tokens: the last guess and the target's)
    or none was and the sequence moved on by five (catch-ups of 2, 5 and 2 decode entries).
    int8: the draft's layers multiply by int8 weights on both paths (speculative.draft_quantization)."""
    proposers = [proposer_of(_engine(loopy_dir, loopy_draft_dir, fused, draft_quantization=quantization))
                 for fused in (True, False)]
    if quantization == "int8":
        layer = proposers[0].draft.runner.model.layers[0]
        assert layer.mlp.gate_up_proj.gemv.blocked.dtype == torch.uint8
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    lengths, ks = (9, 23, 40), [5, 2, 4]
    results = []
    for p in proposers:
        seqs = [Sequence(f"r{i}", [(7 * i + 3 * t) % 3000 + 1 for t in range(n)], params, 0, 256)
                for i, n in enumerate(lengths)]
        first = p.propose(seqs, ks)
        for seq, proposal in zip(seqs, first):  # the target takes each twin's first guess and adds one
            p.on_verified(seq, 1)
            seq.token_ids += [proposal.token_ids[0], 11]
        second = p.propose(seqs, [3, 3, 3])
        for i, (seq, proposal) in enumerate(zip(seqs, second)):
            if i == 1:  # nothing accepted; the sequence gains five tokens
                p.on_verified(seq, 0)
                seq.token_ids += [21, 22, 23, 24, 25]
            else:  # all accepted, and the target's own
                p.on_verified(seq, len(proposal))
                seq.token_ids += [*proposal.token_ids, 13]
        third = p.propose(seqs, [4, 2, 3])
        results.append(([x.token_ids for x in first], [x.token_ids for x in second], [x.token_ids for x in third],
                        [_twin_kv(p, s.request_id) for s in seqs],
                        [(p.twins[s.request_id].seq.token_ids, p.twins[s.request_id].seq.num_computed_tokens)
                         for s in seqs]))
        for seq in seqs:
            p.release(seq)
        assert p.page_manager.num_free_pages == p.page_manager.num_pages
    fused, python = results
    # One call a round (the Python side made none): the first after the prompts' catch-up (a
    # prompt chunk, in Python), then whole proposals from their catch-up entries.
    assert compiled_calls == [3, 3, 2 + 5 + 2]
    assert [len(t) for t in fused[0]] == ks and all(len(t) == 3 for t in fused[1])
    assert [len(t) for t in fused[2]] == [4, 2, 3]
    assert fused[:3] == python[:3]
    assert fused[4] == python[4]
    for a, b in zip(fused[3], python[3]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("draft_vocab_size, quantization", [(None, "none"), (2000, "none"), (None, "int8")])
def test_greedy_output_is_the_targets_with_compiled_draft_steps(loopy_dir, loopy_draft_dir, draft_vocab_size,
                                                               quantization, compiled_calls):
    """End to end in bf16: the same tokens, proposals and acceptances as with the Python loop
    (and as plain decoding), every draft page free at the end; a draft head cut to the first
    token ids takes the skinny kernel inside the same loop; an int8 draft stays exact."""
    prompts = prompts_of(4, 30, seed=61)
    plain = run(make_engine(loopy_dir, dtype="bfloat16"), {0: dict(prompts)}, GREEDY)
    outs = []
    for fused in (True, False):
        engine = _engine(loopy_dir, loopy_draft_dir, fused, draft_vocab_size=draft_vocab_size,
                         draft_quantization=quantization)
        before = len(compiled_calls)
        outs.append(run(engine, {0: dict(prompts)}, GREEDY))
        assert_draft_pages_free(engine)
        assert (len(compiled_calls) > before) == fused  # the compiled loop ran where it was kept, only there
    proposed, accepted = check_same(plain, outs[0])
    assert 0 < accepted < proposed
    for rid in prompts:
        a, b = outs[0][rid], outs[1][rid]
        assert a.token_ids == b.token_ids
        assert (a.num_spec_proposed, a.num_spec_accepted) == (b.num_spec_proposed, b.num_spec_accepted)
