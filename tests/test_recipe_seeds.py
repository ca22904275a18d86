# .venv/bin/python -m pytest -q tests/test_recipe_seeds.py
"""Recipes over several training seeds (eagle3lib/studies/recipe_seeds.py): tau pooled over seeds per prompt, and a
difference to the reference recipe called supported only when its interval over prompts excludes 0 and every seed
agrees in sign. Hand-built per-prompt rows, so each verdict is known in advance; the stage's wiring: `recipes.seeds` is
checked by `params`, and the per-seed folders are named apart from the default seed's."""

from __future__ import annotations

import pytest

from eagle3lib.config.profile import ParamsError
from eagle3lib.config.stages import open_stage
from eagle3lib.studies.recipe_seeds import pool_rows, pool_seeds, recipe_summary, verdict, versus


def _rows(accepted: list[int], rounds: int = 10) -> list[dict]:
    """One row per prompt (p0, p1, ...): `rounds` verifications, accepted drafts as given, all at the first position."""
    return [{"id": f"p{i}", "rounds": rounds, "accepted": a, "accepted_per_pos": [a, 0, 0]}
            for i, a in enumerate(accepted)]


def test_seeds_pool_per_prompt_and_each_seed_keeps_its_tau():
    a, b = _rows([2, 4, 6, 8]), _rows([4, 4, 4, 4])
    pooled = pool_seeds([a, b])
    assert [(r["rounds"], r["accepted"]) for r in pooled] == [(20, 6), (20, 8), (20, 10), (20, 12)]
    s = recipe_summary([a, b])
    assert s["tau"] == pytest.approx(1 + 36 / 80) and s["tau_seeds"] == pytest.approx([1.5, 1.4])
    lo, hi = s["tau_interval"]
    assert lo < s["tau"] < hi  # prompts differ: an interval of some width
    assert [r["id"] for r in pool_seeds([a, b[:3]])] == ["p0", "p1", "p2"]  # only prompts every seed measured


def test_a_difference_is_supported_only_when_prompts_and_seeds_agree():
    ref = [_rows([5, 5, 5, 5, 5, 6]), _rows([5, 5, 5, 4, 5, 5])]
    better = [_rows([8, 8, 7, 8, 8, 8]), _rows([7, 7, 8, 7, 7, 7])]  # above the reference on every prompt, each seed
    c = versus(better, ref)
    assert c["supported"] and c["difference"] > 0 and c["difference_interval"][0] > 0
    assert all(d > 0 for d in c["difference_seeds"])
    assert verdict("better", "kl", c).startswith("better above kl: +0.2")
    # one seed far above, the other below: pooled over seeds it is above on every prompt (the interval excludes 0),
    # but the seeds disagree, so one seed's draw could have ranked it either way
    split = [_rows([9, 9, 9, 9, 9, 9]), _rows([4, 4, 4, 4, 4, 4])]
    c = versus(split, ref)
    assert c["difference_interval"][0] > 0 and c["difference_seeds"][0] > 0 > c["difference_seeds"][1]
    assert not c["supported"] and "not told apart from kl" in verdict("split", "kl", c)
    same = versus(ref, ref)  # a recipe against itself: difference 0, never supported
    assert same["difference"] == 0 and not same["supported"]


def test_the_table_rows_become_the_seeds_figures():
    def measured(seeds_accepted: list[list[int]], tps: list[float]) -> list[dict]:
        return [{"greedy": {"per_prompt": _rows(acc), "tokens_per_s": t, "outputs": {"p0": [1], "p1": [2]}}}
                for acc, t in zip(seeds_accepted, tps, strict=True)]

    def trained(est: list[float]) -> list[dict]:
        return [{"val_tau_est": e, "train_s": 10.0, "source": "trained here"} for e in est]

    rows = [{"recipe": "kl"}, {"recipe": "ce"}]
    m = {"kl": measured([[5, 5, 5], [5, 5, 6]], [100.0, 110.0]), "ce": measured([[8, 8, 8], [8, 7, 8]], [90.0, 100.0])}
    base = {"greedy": {"tokens_per_s": 50.0, "outputs": {"p0": [1], "p1": [3]}}}
    words = pool_rows(rows, m, {"kl": trained([1.5, 1.6]), "ce": trained([1.7, 1.9])}, base, ["greedy"])
    kl, ce = rows
    assert kl["tau_vllm_greedy"] == pytest.approx(1 + 31 / 60) and kl["tau_vllm_greedy_seeds"] == pytest.approx([1.5, 1 + 16 / 30])
    assert kl["tokens_per_s_greedy"] == 105.0 and kl["speedup_greedy"] == pytest.approx(2.1)
    assert kl["accept_rate_pos_greedy"] == pytest.approx([31 / 60, 0, 0]) and "vs_reference_greedy" not in kl
    assert ce["vs_reference_greedy"]["reference"] == "kl" and ce["vs_reference_greedy"]["supported"]
    assert ce["val_tau_est"] == pytest.approx(1.8) and ce["greedy_identical_frac"] == 0.5
    assert words == {"greedy": [verdict("ce", "kl", ce["vs_reference_greedy"])]}


def test_seeds_are_checked_and_folders_named_apart(tmp_path):
    from eagle3lib.studies.recipes import _folder

    with pytest.raises(ParamsError, match=r"recipes.seeds.*distinct seeds >= 0"):
        open_stage("recipes", "tiny", tmp_path, {"recipes.seeds": [0, 0]})
    assert open_stage("recipes", "tiny", tmp_path, {"recipes.seeds": [0, 1]}).cfg.seeds == [0, 1]
    assert _folder("kl", None) == "kl" and _folder("kl", 1) == "kl.seed-1" and _folder("dflash", 2) == "dflash.seed-2"


def test_the_report_table_has_one_comparison_column_named_by_the_reference():
    """The first recipe has no comparison of its own: its cell is empty under the same column as the others' (not a
    column of its own), and the plot draws the intervals."""
    from eagle3lib.reports.recipes import plot_recipes, recipes_table

    cmp = versus([_rows([8, 8, 7]), _rows([7, 8, 8])], [_rows([5, 5, 5]), _rows([5, 6, 5])])
    common = {"served_as": "chain", "parameters": 1, "steps": 1, "train_s": 1.0, "val_tau_est": 1.5, "source": "x",
              "speedup_greedy": 1.0, "greedy_identical_frac": 1.0, "accept_rate_pos_greedy": [0.5, 0.2, 0.1]}
    rows = [{"recipe": "kl", **common, "tau_vllm_greedy": 1.52, "tau_vllm_greedy_interval": [1.5, 1.55],
             "tau_vllm_greedy_seeds": [1.5, 1.53]},
            {"recipe": "ce", **common, "tau_vllm_greedy": 1.77, "tau_vllm_greedy_interval": [1.73, 1.8],
             "tau_vllm_greedy_seeds": [1.77, 1.77], "vs_reference_greedy": {"reference": "kl", **cmp}}]
    table = recipes_table({"modes": ["greedy"], "rows": rows})
    assert [c for c in table.columns if " vs " in c] == ["greedy vs kl"]
    assert table["greedy vs kl"].to_list() == [None, f"{cmp['difference']:+.2f} [{cmp['difference_interval'][0]:+.2f}, "
                                                     f"{cmp['difference_interval'][1]:+.2f}] supported"]
    assert table["greedy 95% interval"].to_list() == ["[1.50, 1.55]", "[1.73, 1.80]"]
    fig = plot_recipes({"modes": ["greedy"], "rows": rows, "ttt_steps": 3, "prompts": 3})
    from matplotlib.container import ErrorbarContainer

    (bars,) = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    whiskers = [tuple(seg[:, 1]) for seg in bars.lines[2][0].get_segments()]  # (low, high) per recipe
    assert whiskers == [pytest.approx((1.5, 1.55)), pytest.approx((1.73, 1.8))]
