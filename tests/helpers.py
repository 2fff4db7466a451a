"""Test helpers: the Hugging Face greedy reference and the page-accounting check."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Hugging Face greedy generate (EOS ignored): generated ids and each one's log-probability."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=None, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_no_page_leak(engine) -> None:
    """Every page is free or held only by the prefix cache."""
    stats = engine.page_stats()
    # Two independent views: the per-page reference counts, and the free/evictable pools.
    held = [page for page, refs in enumerate(engine.page_manager.ref_counts) if refs]
    assert not held, f"pages still referenced after all requests finished: {held[:10]} ({stats})"
    assert stats["free"] == stats["num_pages"], stats
