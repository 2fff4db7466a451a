"""Medusa heads (engine/model/medusa_heads.py): the published layout loads from every form it
comes in (Medusa-1 safetensors and .pt, a file named directly, Medusa-2's `medusa_head.` tensors
inside a whole model's safetensors), the heads compute Medusa's ResBlock maths, and each kind of
bad checkpoint fails naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.model.medusa_heads import MedusaConfig, MedusaHeads, load_medusa_heads, write_heads
from tests.helpers import write_medusa_heads

HIDDEN, VOCAB = 16, 40


def random_tensors(num_heads: int, num_layers: int, hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 0
                   ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
            tensors[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=gen)
        tensors[f"{i}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=gen)
    return tensors


def load(path, hidden: int = HIDDEN, vocab: int = VOCAB) -> MedusaHeads:
    return load_medusa_heads(path, hidden, vocab, torch.float32, "cpu")


def assert_loaded(heads: MedusaHeads, tensors: dict[str, torch.Tensor]) -> None:
    state = heads.state_dict()
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name


@pytest.mark.parametrize("file,prefix", [("medusa_lm_head.safetensors", ""), ("medusa_lm_head.pt", ""),
                                         ("medusa_lm_head.safetensors", "medusa_head."),
                                         ("medusa_lm_head.pt", "medusa_head.")])
def test_the_published_layout_loads_with_either_prefix(tmp_path, file, prefix):
    tensors = random_tensors(3, 2)
    write_medusa_heads(tmp_path, tensors, num_heads=3, num_layers=2, file=file, prefix=prefix)
    heads = load(tmp_path)
    assert (heads.cfg.num_heads, heads.cfg.num_layers) == (3, 2)
    assert_loaded(heads, tensors)
    assert_loaded(load(tmp_path / file), tensors)  # the weights file named directly


def test_medusa2_heads_are_read_out_of_a_whole_models_safetensors(tmp_path):
    tensors = random_tensors(2, 1)
    whole = {"medusa_head." + n: t for n, t in tensors.items()}
    whole["model.embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)  # the base model's: not the heads'
    save_file(whole, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                      "architectures": ["MedusaModel"]}))
    assert_loaded(load(tmp_path), tensors)


def test_heads_compute_medusas_resblocks_then_their_projection():
    cfg = MedusaConfig(num_heads=2, num_layers=2, hidden_size=HIDDEN, vocab_size=VOCAB)
    heads = MedusaHeads(cfg)
    tensors = random_tensors(2, 2)
    heads.load_state_dict(tensors)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = []
    for i in range(2):
        x = h
        for j in range(2):
            x = x + F.silu(x @ tensors[f"{i}.{j}.linear.weight"].T + tensors[f"{i}.{j}.linear.bias"])
        expected.append(x @ tensors[f"{i}.2.weight"].T)
    logits = heads.head_logits(h)
    assert logits.shape == (2, 5, VOCAB)
    torch.testing.assert_close(logits, torch.stack(expected))
    top1 = heads.top1(h, 1)
    assert top1.shape == (5, 1) and torch.equal(top1[:, 0], expected[0].argmax(-1))


def test_written_heads_are_the_published_layout_and_load_back(tmp_path):
    heads = MedusaHeads(MedusaConfig(3, 1, HIDDEN, VOCAB))
    heads.load_state_dict(random_tensors(3, 1, seed=2))
    write_heads(tmp_path, heads, "some/target")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 1, "hidden_size": HIDDEN, "vocab_size": VOCAB,
                      "base_model_name_or_path": "some/target"}
    assert (tmp_path / "medusa_lm_head.safetensors").is_file()
    assert_loaded(load(tmp_path), heads.state_dict())


def test_bad_heads_fail_naming_what_is_wrong(tmp_path):
    def heads_dir(name, tensors, num_heads=2, num_layers=1, **kw):
        return write_medusa_heads(tmp_path / name, tensors, num_heads, num_layers, **kw)

    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="none of medusa_lm_head.safetensors, medusa_lm_head.pt"):
        load(tmp_path / "empty")
    no_config = heads_dir("no-config", random_tensors(2, 1))
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json beside it"):
        load(no_config)
    bad_count = heads_dir("bad-count", random_tensors(2, 1))
    (bad_count / "config.json").write_text(json.dumps({"medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="medusa_num_heads must be a whole number >= 1, got None"):
        load(bad_count)

    missing = random_tensors(2, 1)
    del missing["1.0.linear.bias"]
    with pytest.raises(ValueError, match=r"lack 1 tensors for 2 heads of 1 layers \(config.json\), e.g. \['1.0.linear.bias'\]"):
        load(heads_dir("missing", missing))
    with pytest.raises(ValueError, match=r"tensors with no place in 2 heads of 1 layers \(config.json\): \['2.0"):
        load(heads_dir("extra", random_tensors(3, 1)))  # config.json says 2 heads, the file has 3
    misshaped = random_tensors(2, 1)
    misshaped["1.0.linear.bias"] = torch.zeros(HIDDEN + 1)
    with pytest.raises(ValueError, match=r"tensor '1.0.linear.bias' has shape \[17\], expected \[16\]"):
        load(heads_dir("misshaped", misshaped))

    with pytest.raises(ValueError, match="have hidden size 16, the target 32: heads must be trained on this target"):
        load(heads_dir("wide", random_tensors(2, 1)), hidden=32)
    with pytest.raises(ValueError, match="project to a vocabulary of 40, the target's has 64: heads must share"):
        load(heads_dir("vocab", random_tensors(2, 1)), vocab=64)

    # A .pt file is read with weights_only: anything but tensors and plain containers is refused.
    pickled = tmp_path / "pickled"
    heads_dir("pickled", random_tensors(2, 1), file="medusa_lm_head.pt")
    torch.save({"0.0.linear.weight": MedusaConfig(1, 1, 1, 1)}, pickled / "medusa_lm_head.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        load(pickled)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "heads.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .safetensors or .pt file"):
        load(tmp_path / "odd" / "heads.bin")
