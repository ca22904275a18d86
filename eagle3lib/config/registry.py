"""The one registry of the pipeline's stages: each row names its notebook, its profile section and that section's
typed config class. Profiles validate against `SECTIONS` (derived from the rows, plus the shared `verifier` section),
the runner runs the rows in order, the parameter reference renders them: a stage added here is known everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3lib.config.analysis import CompareRunsConfig, CostProjectionConfig, LearningCurvesConfig
from eagle3lib.config.base import StageConfig
from eagle3lib.config.data_scaling import DataScalingConfig
from eagle3lib.config.deployment import DeploymentConfig
from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.generate import GenerateConfig
from eagle3lib.config.recipes import RecipesConfig
from eagle3lib.config.train import TrainConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.config.verifier_report import VerifierReportConfig


@dataclass(frozen=True)
class Stage:
    name: str  # run-directory subfolder and --stages name
    notebook: str  # file in notebooks/
    section: str  # profile section holding its parameters
    section_cls: type[StageConfig]  # that section's typed config (the one table profiles validate against)
    title: str  # one line for the index page
    always_run: bool = False  # analysis of other stages' outputs: re-run each time, since a skip would show stale curves
    needs: str = ""  # the input it reads from an earlier stage (relative to the run): how a notebook opened without a
    # run_dir finds a run to work on
    make: str = ""  # the command that makes that input, for the message when no run has it
    default: bool = True  # in a run without --stages; False: a stage that costs more than a first run should pay
    # (data_scaling trains the drafter once more per fraction), run by naming it (`make scaling`)
    headline: tuple[str, ...] = ()  # the figures the run index shows first (fnmatch patterns over the manifest's
    # figure names): what a reader opens the run for, not the first keys written


STAGES: tuple[Stage, ...] = (
    Stage("verifier", "00_verifier.ipynb", "verifier_report", VerifierReportConfig,
          "Verifier: what the drafter will imitate",
          headline=("model", "architecture", "attention", "parameters", "num_layers", "aux_layer_ids")),
    Stage("generate", "01_generate.ipynb", "generate", GenerateConfig, "Generate: the verifier's own responses",
          headline=("samples_ok", "samples_total", "samples_failed", "samples_truncated", "output_tokens",
                    "output_tokens_per_s")),
    Stage("extract", "02_extract.ipynb", "extract", ExtractConfig,
          "Extract: hidden states for training", needs="generate/manifest.json",
          make="--stages generate", headline=("samples", "tokens", "bytes", "tokens_per_s", "final_state_top1_agreement")),
    Stage("train", "03_train.ipynb", "train", TrainConfig, "Train: the EAGLE-3 drafter", needs="extract/store.json",
          make="--stages generate,extract", headline=("steps", "best_val_tau_est", "val_tau_est", "final_loss",
                                                      "tokens_per_s", "drafter_layer", "stopped_early")),
    Stage("evaluate", "04_evaluate.ipynb", "evaluate", EvaluateConfig, "Evaluate: measured acceptance length",
          needs="train/final/config.json", make="--stages generate,extract,train",
          headline=("tau_vllm_greedy", "tau_lib_greedy", "tau_vllm_sampled", "vllm_speedup", "tau_val_est", "ttt_steps",
                    "k_best_gpu_model")),
    Stage("data_scaling", "data_scaling.ipynb", "data_scaling", DataScalingConfig,
          "Data scaling: how much data buys how much acceptance",
          needs="train/manifest.json", make="--stages generate,extract,train,evaluate", default=False,
          always_run=True,  # every point it has trained is reused: a rerun costs seconds, and never shows a stale fit
          headline=("ceiling_tau", "target_tau", "samples_needed", "tokens_needed", "points")),
    Stage("recipes", "recipes.ipynb", "recipes", RecipesConfig,
          "Recipes: which drafting recipe accepts most, served by vLLM",
          needs="extract/store.json", make="--stages generate,extract", default=False,
          always_run=True,  # every recipe it has trained and measured is reused: a rerun costs seconds
          headline=("best_recipe_*", "recipes", "tau_vllm_greedy_*")),
    Stage("learning_curves", "learning_curves.ipynb", "learning_curves", LearningCurvesConfig,
          "Learning curves", always_run=True,
          needs="train/metrics.jsonl", make="--stages generate,extract,train",
          headline=("runs", "step", "best_val_tau_est", "val_tau_est", "loss", "eta_h")),
    Stage("cost_projection", "cost_projection.ipynb", "cost_projection", CostProjectionConfig,
          "Cost projection for the full run",
          always_run=True, needs="train/manifest.json", make="--stages generate,extract,train",
          headline=("samples", "*.total_usd", "*.total_hours", "total_disk_gb")),
    Stage("compare_runs", "compare_runs.ipynb", "compare_runs", CompareRunsConfig,
          "Compare runs side by side", always_run=True,
          needs="train/manifest.json", make="--stages generate,extract,train", headline=("runs", "*.tau_vllm_greedy")),
    Stage("deployment", "deployment.ipynb", "deployment", DeploymentConfig,
          "Deployment: which K at which concurrency (a GPU model)",
          always_run=True, needs="evaluate/results.json", make="--stages generate,extract,train,evaluate",
          headline=("*.stops_paying_at", "*.best_k_c1", "*.speedup_c1", "cpu_model_over_measured_median",
                    "published_model_over_measured_median")),
)

# section -> its config class: the verifier's (read by every stage that starts or loads it), then each stage's own
SECTIONS: dict[str, type[StageConfig]] = {"verifier": VerifierConfig, **{s.section: s.section_cls for s in STAGES}}
