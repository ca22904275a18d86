"""The one registry of the pipeline's stages: each row is a stage's whole contract. It names the stage's notebook, its
profile section and that section's typed config class, the stage whose outputs it consumes, every key it reads from
other sections (`reads`), the files it writes before any result (`bookkeeping`) and the declared outputs a user may
delete (`disposable`).

Everything else derives from the rows: profiles validate against `SECTIONS`; a stage's manifest records its own section
and the values of its declared reads (config/contract.py), so changing one of them makes it stale; a stage reading a key
it did not declare fails at the read (`UndeclaredRead`); the runner runs the rows in order, decides skip / resume / run
again from them and sets aside only what they call bookkeeping; ARCHITECTURE.md's parameter table is rendered from them
(`contract_table`, checked by tests/test_docs.py)."""

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
class Read:
    """A key of another section that a stage reads: "train.decay", or a whole section ("train") when the stage hands
    it down whole. `when`: a key of the stage's own section; the read happens (and is recorded) only when it is set."""

    key: str
    when: str = ""

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def field(self) -> str | None:
        return self.key.split(".", 1)[1] if "." in self.key else None


VERIFIER = Read("verifier")  # the model the stage serves, loads or drafts for
# Files every attempt of any stage writes before any result: a failed attempt holding nothing else produced nothing
COMMON_BOOKKEEPING = frozenset({"manifest.json", "report.html", ".writer.lock"})


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
    input_stage: str | None = None  # the stage whose outputs it consumes: it is stale once that one completes again
    reads: tuple[Read, ...] = ()  # every key of another section it reads (recorded in its manifest: a change makes it
    # stale); its own section is always recorded
    bookkeeping: frozenset[str] = COMMON_BOOKKEEPING  # files it writes before any result (not outputs worth keeping)
    disposable: frozenset[str] = frozenset()  # declared outputs a user may delete without undoing the stage
    store: bool = False  # its outputs are a hidden-state store: checked (names, sizes) before a skip, and a repair
    # makes the same data again, so the stages after it keep theirs

    def read_keys(self, own: object | None = None) -> list[Read]:
        """The reads in force for this stage's own config `own` (a read with `when` only when that key is set)."""
        return [r for r in self.reads if not r.when or own is None or bool(getattr(own, r.when))]


STAGES: tuple[Stage, ...] = (
    Stage("verifier", "00_verifier.ipynb", "verifier_report", VerifierReportConfig,
          "Verifier: what the drafter will imitate",
          headline=("model", "architecture", "attention", "parameters", "num_layers", "aux_layer_ids"),
          reads=(VERIFIER,)),
    Stage("generate", "01_generate.ipynb", "generate", GenerateConfig, "Generate: the verifier's own responses",
          headline=("samples_ok", "samples_total", "samples_failed", "samples_truncated", "output_tokens",
                    "output_tokens_per_s"),
          reads=(VERIFIER,),
          # the settings its records were made with, and the prompts its run selected
          bookkeeping=COMMON_BOOKKEEPING | {"generate_key.json", "prompt_ids.json"}),
    Stage("extract", "02_extract.ipynb", "extract", ExtractConfig,
          "Extract: hidden states for training", needs="generate/manifest.json",
          make="--stages generate", headline=("samples", "tokens", "bytes", "tokens_per_s", "final_state_top1_agreement"),
          input_stage="generate",
          reads=(VERIFIER, Read("train.hidden_states")),  # online training stores tokens only
          bookkeeping=COMMON_BOOKKEEPING | {"store.json", "index.jsonl"}, store=True),
    Stage("train", "03_train.ipynb", "train", TrainConfig, "Train: the EAGLE-3 drafter", needs="extract/store.json",
          make="--stages generate,extract", headline=("steps", "best_val_tau_est", "val_tau_est", "final_loss",
                                                      "tokens_per_s", "drafter_layer", "stopped_early"),
          input_stage="extract",
          reads=(VERIFIER, Read("extract")),  # online / hybrid states are computed through extract's backend
          bookkeeping=COMMON_BOOKKEEPING | {"draft_vocab.safetensors"},
          disposable=frozenset({"last_step_checkpoint"})),  # resumable state, often a run's largest files
    Stage("evaluate", "04_evaluate.ipynb", "evaluate", EvaluateConfig, "Evaluate: measured acceptance length",
          needs="train/final/config.json", make="--stages generate,extract,train",
          headline=("tau_vllm_greedy", "tau_lib_greedy", "tau_vllm_sampled", "vllm_speedup", "tau_val_est", "ttt_steps",
                    "k_best_gpu_model"),
          input_stage="train",
          reads=(VERIFIER,
                 Read("train"),  # ttt_steps (the default K), decay (the estimate), its trackers (evaluate's table)
                 Read("generate.dataset"), Read("generate.turns"),  # prompts seen in training
                 # the K sweep's modelled GPU speedup (k_best_gpu_model): the deployment plan's machine
                 Read("deployment", when="ttt_steps_sweep"), Read("cost_projection.hardware", when="ttt_steps_sweep"))),
    Stage("data_scaling", "data_scaling.ipynb", "data_scaling", DataScalingConfig,
          "Data scaling: how much data buys how much acceptance",
          needs="train/manifest.json", make="--stages generate,extract,train,evaluate", default=False,
          always_run=True,  # every point it has trained is reused: a rerun costs seconds, and never shows a stale fit
          headline=("ceiling_tau", "target_tau", "samples_needed", "tokens_needed", "points"),
          # each point is the train stage's run on a share of the data, served as evaluate serves; costed as
          # cost_projection costs
          input_stage="train", reads=(VERIFIER, Read("train"), Read("evaluate"), Read("cost_projection"))),
    Stage("recipes", "recipes.ipynb", "recipes", RecipesConfig,
          "Recipes: which drafting recipe accepts most, served by vLLM",
          needs="extract/store.json", make="--stages generate,extract", default=False,
          always_run=True,  # every recipe it has trained and measured is reused: a rerun costs seconds
          headline=("best_recipe_*", "recipes", "tau_vllm_greedy_*"),
          input_stage="extract", reads=(VERIFIER, Read("train"), Read("evaluate"))),  # each recipe: train's + its own
    Stage("learning_curves", "learning_curves.ipynb", "learning_curves", LearningCurvesConfig,
          "Learning curves", always_run=True,
          needs="train/metrics.jsonl", make="--stages generate,extract,train",
          headline=("runs", "step", "best_val_tau_est", "val_tau_est", "loss", "eta_h")),
    Stage("cost_projection", "cost_projection.ipynb", "cost_projection", CostProjectionConfig,
          "Cost projection for the full run",
          always_run=True, needs="train/manifest.json", make="--stages generate,extract,train",
          headline=("samples", "*.total_usd", "*.total_hours", "total_disk_gb"),
          reads=(Read("train.ttt_steps"), Read("train.cache_budget_gb"))),
    Stage("compare_runs", "compare_runs.ipynb", "compare_runs", CompareRunsConfig,
          "Compare runs side by side", always_run=True,
          needs="train/manifest.json", make="--stages generate,extract,train", headline=("runs", "*.tau_vllm_greedy")),
    Stage("deployment", "deployment.ipynb", "deployment", DeploymentConfig,
          "Deployment: which K at which concurrency (a GPU model)",
          always_run=True, needs="evaluate/results.json", make="--stages generate,extract,train,evaluate",
          headline=("*.stops_paying_at", "*.best_k_c1", "*.speedup_c1", "cpu_model_over_measured_median",
                    "published_model_over_measured_median"),
          input_stage="evaluate",
          reads=(VERIFIER, Read("train"),  # the drafter's shape when no drafter is trained
                 Read("cost_projection.hardware"))),  # the rows it plans for when deployment.hardware is empty
)

# section -> its config class: the verifier's (read by every stage that starts or loads it), then each stage's own
SECTIONS: dict[str, type[StageConfig]] = {"verifier": VerifierConfig, **{s.section: s.section_cls for s in STAGES}}
STAGE_BY_NAME = {s.name: s for s in STAGES}


def contract_table() -> str:
    """ARCHITECTURE.md's parameter table (tests/test_docs.py keeps the two equal): per stage, its own section, its
    declared reads of other sections (conditional ones with their condition) and the stage whose outputs it consumes."""
    lines = ["| stage | its section | reads of other sections | consumes |", "|---|---|---|---|"]
    for s in STAGES:
        reads = ", ".join(f"`{r.key}`" + (f" (when `{s.section}.{r.when}`)" if r.when else "") for r in s.reads)
        lines.append(f"| {s.name} | `{s.section}` | {reads or '-'} | {s.input_stage or '-'} |")
    return "\n".join(lines)


def _check_rows() -> None:
    """A row naming an unknown section, field or stage fails at import, not when that read is first made."""
    names = {s.name for s in STAGES}
    for s in STAGES:
        problems = [f"unknown input stage {s.input_stage}"] if s.input_stage not in (None, *names) else []
        for r in s.reads:
            if r.section not in SECTIONS or r.section == s.section:
                problems.append(f"reads {r.key}: not another stage's section")
            elif r.field is not None and r.field not in SECTIONS[r.section].model_fields:
                problems.append(f"reads {r.key}: no such key")
            if r.when and r.when not in s.section_cls.model_fields:
                problems.append(f"reads {r.key} when {s.section}.{r.when}: no such key")
        if problems:
            raise ValueError(f"config/registry.py, stage {s.name}: {'; '.join(problems)}")


_check_rows()
