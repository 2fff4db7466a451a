"""`pdserve model` from the command line: what `--help` says (the recipes' numbers are written in
cluster/cmd_model.py, which must not import torch, so they are checked against the recipes
here), and a clear error, before any work, for each bad argument."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster import cmd_model
from cluster.cli import build_parser, main
from engine.model.trained_builtins import DRAFT, MEDUSA_RECIPE, RECIPES, TARGET


def usage_error(argv: list[str], capsys) -> str:
    """argparse's exit (status 2) for `argv`; returns its message on one line."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_names_the_commands_and_the_built_ins(capsys):
    text = help_text(["model"], capsys)
    for command in ("build", "train", "distill", "train-medusa"):
        assert command in text
    text = help_text(["model", "build"], capsys)
    for name in ("builtin:tiny", "builtin:small", "builtin:code-small", "builtin:code-draft", "PDSERVE_TRAIN_STEPS"):
        assert name in text
    assert "builtin:code-small" in help_text([], capsys)


def test_help_explains_each_command_with_the_recipes_numbers(capsys):
    for command, name, steps, seed in [("train", TARGET, cmd_model.TARGET_STEPS, cmd_model.TARGET_SEED),
                                       ("distill", DRAFT, cmd_model.DRAFT_STEPS, cmd_model.DRAFT_SEED)]:
        text = help_text(["model", command], capsys)
        for option in ("--out", "--steps", "--seed", "--threads", "--compile", "--force"):
            assert option in text
        settings = RECIPES[name].settings
        assert (steps, seed) == (settings.steps, settings.seed)
        assert f"(default {steps})" in text and f"(default {seed})" in text
    assert "--target" in help_text(["model", "distill"], capsys)
    for help_line, name in [(cmd_model.TARGET_HELP, TARGET), (cmd_model.DRAFT_HELP, DRAFT)]:
        shape = RECIPES[name].shape
        assert help_line.startswith(f"{shape.num_parameters() / 1e6:.1f}M parameters: hidden {shape.hidden_size}, "
                                    f"{shape.num_layers} layers")
    s = RECIPES[TARGET]
    assert f"vocabulary {s.shape.vocab_size}, context {s.settings.seq_len}" in cmd_model.TARGET_HELP
    assert cmd_model.BATCH_HELP == f"{s.settings.batch_size} windows of {s.settings.seq_len} tokens"
    assert RECIPES[DRAFT].settings.batch_size == s.settings.batch_size
    assert RECIPES[DRAFT].settings.seq_len == s.settings.seq_len
    own = RECIPES[DRAFT].own_text
    assert own is not None and cmd_model.DRAFT_OWN_TEXT_HELP == (
        f"{own.per_batch} windows of each batch ({own.num_windows} windows, each {own.prompt_len} tokens of text "
        f"then {s.settings.seq_len + 1 - own.prompt_len} of its own)")
    assert cmd_model.DRAFT_OWN_TEXT_HELP in " ".join(help_text(["model", "distill"], capsys).split())
    # Each model is trained on windows of its whole context: positions past the windows would be untrained.
    for name in (TARGET, DRAFT):
        assert RECIPES[name].shape.max_position_embeddings == RECIPES[name].settings.seq_len


def test_train_medusa_help_shows_its_recipes_numbers(capsys):
    text = help_text(["model", "train-medusa"], capsys)
    for option in ("--out", "--target", "--num-heads", "--num-layers", "--steps", "--seed", "--threads", "--force"):
        assert option in text
    s = MEDUSA_RECIPE.settings
    assert (cmd_model.MEDUSA_STEPS, cmd_model.MEDUSA_SEED) == (s.steps, s.seed)
    assert (cmd_model.MEDUSA_HEADS, cmd_model.MEDUSA_LAYERS) == (MEDUSA_RECIPE.num_heads, MEDUSA_RECIPE.num_layers)
    assert cmd_model.MEDUSA_BATCH_HELP == f"{s.batch_size} windows of {s.seq_len} tokens"
    assert f"optimiser steps of {cmd_model.MEDUSA_BATCH_HELP} (default {s.steps})" in text
    assert f"(default {MEDUSA_RECIPE.num_heads})" in text and "medusa_num_heads" in text


@pytest.mark.parametrize("make_target, message", [
    (lambda tmp: fake_checkpoint(tmp / "t", vocab_size=None), "is not a Hugging Face checkpoint: it has no config.json"),
    (lambda tmp: fake_checkpoint(tmp / "t", tokenizer=False), "has no tokenizer.json"),
])
def test_a_target_heads_cannot_be_fitted_to_is_a_clear_error(tmp_path, capsys, make_target, message):
    out = tmp_path / "heads"
    assert main(["model", "train-medusa", "--target", str(make_target(tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and message in err, err
    assert not out.exists()


def test_the_parser_does_not_import_torch():
    # Every `pdserve` command builds the whole parser, the router's among them (no torch there).
    code = "import sys; from cluster.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["model", "train"], "the following arguments are required: --out"),
    (["model", "train", "--out", "x", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["model", "train", "--out", "x", "--steps", "ten"], "argument --steps: 'ten' is not a whole number"),
    (["model", "distill", "--out", "x", "--steps", "-3"], "argument --steps: must be at least 1, got -3"),
    (["model", "train", "--out", "x", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["model", "train", "--out", "x", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["model", "distill", "--out", "x", "--compile", "maybe"], "argument --compile: invalid choice: 'maybe'"),
    (["model", "fit", "--out", "x"], "invalid choice: 'fit'"),
])
def test_bad_arguments_are_usage_errors_naming_the_option(argv, message, capsys):
    assert message in usage_error(argv, capsys)


def test_an_unwritable_output_directory_is_refused_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    for command in (["model", "train"], ["model", "distill", "--target", str(tmp_path / "nowhere")],
                    ["model", "build", "builtin:code-small"]):
        with pytest.raises(SystemExit, match="is not a directory"):
            main([*command, "--out", str(a_file)])
        with pytest.raises(SystemExit, match=r"is not empty \(use --force to overwrite\)"):
            main([*command, "--out", str(full)])
    assert (full / "keep.txt").read_text() == "x"


def fake_checkpoint(path, vocab_size: int | None = 8192, tokenizer: bool = True):
    path.mkdir()
    if vocab_size is not None:
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


@pytest.mark.parametrize("make_target, message", [
    (lambda tmp: tmp / "nowhere", "is neither a built-in name (builtin:tiny, builtin:small, builtin:code-small, "
                                  "builtin:code-draft) nor a local directory"),
    (lambda tmp: fake_checkpoint(tmp / "t", vocab_size=None), "is not a Hugging Face checkpoint: it has no config.json"),
    (lambda tmp: fake_checkpoint(tmp / "t", tokenizer=False), "has no tokenizer.json"),
    (lambda tmp: fake_checkpoint(tmp / "t", vocab_size=4096),
     "has a vocabulary of 4096 tokens and the draft one of 8192: a draft shares its target's tokenizer"),
])
def test_a_target_that_cannot_be_distilled_is_a_clear_error(tmp_path, capsys, make_target, message):
    out = tmp_path / "draft"
    assert main(["model", "distill", "--target", str(make_target(tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and message in err, err
    assert not out.exists()  # nothing made for a run that did not start


def test_an_unknown_built_in_name_lists_the_known_ones(tmp_path, capsys):
    assert main(["model", "build", "builtin:code-huge", "--out", str(tmp_path / "x")]) == 2
    assert "unknown built-in model 'builtin:code-huge'; choose one of" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="'code-small' is not a built-in model name .*builtin:code-small"):
        main(["model", "build", "code-small", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
