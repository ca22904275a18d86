"""The analysis sections: `learning_curves` (how is training going?), `cost_projection` (what will the hero run cost?)
and `compare_runs` (how do these runs differ?).

Neither stage runs a model: they read what the other stages wrote (metrics JSONL, manifests) or what a user enters by
hand, so both also work on a laptop against a log fetched from the training host.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle3lib.config.base import StageConfig

ProjectedStage = Literal["generate", "extract", "train"]


class LearningCurvesConfig(StageConfig):
    sources: list[str] = []  # metrics files (local paths, globs, ssh://user@host/path) or TensorBoard log folders; [] = RUN_DIR/train/metrics.jsonl
    labels: list[str] = []  # legend names, one per file after glob expansion; [] = the run folder's name
    format: Literal["auto", "eagle3lib", "speculators"] = "auto"  # auto: JSON lines vs speculators console lines
    smoothing: float = Field(0.9, ge=0.0, lt=1.0)  # EMA weight of the smoothed curves (0 = raw), TensorBoard-style
    x_axes: list[Literal["step", "tokens_seen"]] = ["step", "tokens_seen"]  # the per-TTT-step grid is drawn against each
    eta_window: int = Field(50, ge=2)  # recent train records the ETA's steps/second is measured over
    total_steps: int | None = None  # end of the run for the ETA when the log does not say it (speculators logs)
    ssh_timeout_s: float = 60.0  # per remote fetch, so a dead host fails with a message instead of hanging the notebook


class CostProjectionConfig(StageConfig):
    # --- where the projection runs
    hardware: list[str] = []  # rows of the hardware table to project onto; [] = every row
    hardware_file: str = "params/hardware.yaml"  # the hardware table (default: the repo's; a path you set is relative to where the run starts)
    reference_hardware: str = "rtx-pro-6000-x8"  # row the measured throughputs were taken on
    stages: list[ProjectedStage] = ["generate", "extract", "train"]  # stages costed; only these need measurements
    manifests_run_dir: str | None = None  # run whose manifests give the measurements; None = this run
    # --- measured throughputs on the reference hardware: None = read from that stage's manifest (figure name in [])
    generate_output_tokens_per_s: float | None = None  # [generate: output_tokens_per_s] generated tokens/s, whole box
    generate_gpus: int | None = None  # GPUs the generation measurement used; None = every GPU of the reference row
    extract_tokens_per_s: float | None = None  # [extract: tokens_per_s] prefill tokens/s while saving hidden states
    extract_bytes_per_token: float | None = None  # [extract: bytes_per_token] hidden-state bytes stored per token
    extract_gpus: int | None = None  # [extract: num_gpus, absent = 1; hand-entered throughput: the reference row's count]
    train_tokens_per_s: float | None = None  # [train: tokens_per_s] training tokens/s over all processes
    train_gpus: int | None = None  # [train: num_processes; hand-entered throughput: the reference row's count] GPUs used
    measurement_note: str = ""  # where hand-entered figures come from; shown next to them in the notebook
    # --- the hero run
    samples: int = Field(10_000, ge=1)  # training samples (prompts answered by the verifier)
    avg_tokens_per_sample: float = Field(4_000.0, gt=0)  # prompt + response tokens: what extraction and training see
    avg_output_tokens_per_sample: float | None = None  # generated tokens per sample; None = avg_tokens_per_sample
    epochs: float = Field(1.0, gt=0)  # training passes over the extracted tokens
    verifier_active_params: float | None = None  # active (per-token) verifier parameters: MFU = 2 x this x tokens/s
    drafter_params: float | None = None  # drafter parameters without the frozen embedding; None = no training MFU
    ttt_steps: int | None = None  # TTT steps for training FLOPs 6 x drafter_params x ttt_steps; None = train.ttt_steps
    text_bytes_per_token: float = 5.0  # disk per token of generated JSONL (text + JSON overhead), an estimate
    # --- offline vs online vs hybrid hidden states (eagle3lib/analysis/hidden_modes.py)
    storage_usd_per_tb_month: float = Field(25.0, ge=0)  # what the offline store's disk costs (cloud block or NFS
    # storage runs ~$20-100 per TB-month; 0 for disks already owned)
    storage_months: float = Field(1.0, gt=0)  # how long the store is kept (the run, its reruns, the next drafter)
    cache_budget_gb: float | None = Field(None, ge=0)  # hybrid's cache of the first epoch; None = train.cache_budget_gb
    hidden_states_samples: list[int] = []  # more hero-run sizes for the comparison (the kimi profile: 1M samples)
    # --- the speed model
    speed_factors: dict[str, float] = {}  # row -> measured speed relative to the reference (a measured pair) override
    factor_uncertainty: float = Field(0.25, ge=0.0, lt=1.0)  # widens the peak-ratio range: real != peak ratios
    scale_with_gpu_count: bool = True  # throughput scales with GPUs used (data parallel); False = same GPUs as measured
    sensitivity_range: tuple[float, float] = (0.25, 4.0)  # avg tokens/sample swept from x0.25 to x4 in the plot

    @field_validator("speed_factors")
    @classmethod
    def _positive_factors(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, f in v.items() if not f > 0]
        if bad:
            raise ValueError(f"speed factors must be > 0 (rows {bad})")
        return v

    @field_validator("sensitivity_range")
    @classmethod
    def _positive_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        # a geometric sweep: 0 or a negative factor has no meaning (numpy said "Geometric sequence cannot include zero")
        if not 0 < v[0] < v[1]:
            raise ValueError(f"expects two factors 0 < low < high, got {list(v)}")
        return v


class CompareRunsConfig(StageConfig):
    runs: list[str] = []  # run directories or globs (relative to where the run starts); [] = this run + every other run under runs/
    labels: list[str] = []  # one name per run after glob expansion; [] = each run folder's name
