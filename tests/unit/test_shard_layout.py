"""Which heads and layers each rank of a TP x PP worker holds (engine/parallel/layout.py), and the
wire form of a step command (engine/parallel/shard_executor.py)."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.parallel.layout import ShardLayout
from engine.parallel.shard_executor import body_len, decode_batch, encode_batch


def test_ranks_stages_and_slices():
    layouts = [ShardLayout(2, 3, r) for r in range(6)]
    assert [(lo.pp_rank, lo.tp_rank) for lo in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [lo.rank_of(lo.pp_rank, lo.tp_rank) for lo in layouts] == list(range(6))
    # 7 layers over 3 stages: contiguous, the first stage takes the extra one, none dropped.
    assert [layouts[0].stage_layers(7, p) for p in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert layouts[3].kv_heads(4) == slice(2, 4)
    assert layouts[0].is_first_stage and not layouts[0].is_last_stage and layouts[5].is_last_stage


def _cfg(**overrides) -> ModelConfig:
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    return ModelConfig.from_hf_dict({**base, **overrides})


def test_models_that_do_not_split_are_named():
    ShardLayout(2, 2, 0).check_model(_cfg())
    with pytest.raises(ValueError, match=r"does not divide the model's num_key_value_heads \(2\)"):
        ShardLayout(4, 1, 0).check_model(_cfg())
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size \(90\)"):
        ShardLayout(4, 1, 0).check_model(_cfg(num_key_value_heads=4, intermediate_size=90))
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        ShardLayout(1, 3, 0).check_model(_cfg())


def test_page_budget_follows_the_most_loaded_rank():
    cfg = _cfg(num_hidden_layers=3)  # 2 stages: 2 layers and 1
    whole = ShardLayout(1, 1, 0).page_bytes(cfg, 16, torch.float32)
    assert whole == cfg.kv_bytes_per_token(4) * 16
    assert ShardLayout(2, 2, 3).page_bytes(cfg, 16, torch.float32) == whole * 2 // 3 // 2


def test_engine_config_world_size_and_bounds():
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        EngineConfig(tensor_parallel_size=0)


def test_step_command_round_trips():
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([9, 0, 1, 2]),
        slot_mapping=torch.tensor([41, 16, 17, 18]), page_table=torch.tensor([[2, 3], [1, 0]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), context_lens=torch.tensor([10, 3], dtype=torch.int32),
        num_decode_seqs=1, logits_indices=torch.tensor([0, 3]),
    )
    header, body = encode_batch(batch)
    assert body_len(header) == body.numel()
    back = decode_batch(header, body, "cpu")
    for name in ("input_ids", "positions", "slot_mapping", "page_table", "query_start_loc", "context_lens",
                 "logits_indices"):
        got, want = getattr(back, name), getattr(batch, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert back.num_decode_seqs == 1
