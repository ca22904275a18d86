"""Learning curves: load training metrics from one or more runs, live, and say how training is going.

Sources are local paths, globs, or `ssh://[user@]host[:port]/path` (fetched with the user's own ssh config as
`ssh host cat -- path`, an argument list, never a shell string; the file is read, never executed). A file may be:

- eagle3lib's `RUN_DIR/train/metrics.jsonl`: one JSON object per line (`kind`, `step`, `loss_k`, `full_acc_k`,
  `cond_acc_k`, `tau_est`, ...). Unknown keys are kept when numeric and ignored otherwise.
- a speculators console log: its metric lines are `train/loss_0=2.346, train/full_acc_0=0.610, ..., epoch=0,
  lr=3.00e-05, global_step=12` (validation: `val/loss_0_epoch=..., epoch=0`), printed by rich's log handler, which
  prefixes `[HH:MM:SS] INFO` and wraps long records onto indented continuation lines. tqdm's `Epoch 0: ... 530/4430`
  bars and `Training epoch 1/3 started` lines give the run length for the ETA.

Files are read while training appends to them: a torn last line is ignored (a torn line in the middle, left by a crash
before a resume, is skipped and counted). Records that several ranks wrote alike are de-duplicated on (kind, step),
keeping rank 0 when ranks are labelled and the last copy otherwise, which is also right for a run resumed from a
checkpoint that re-logs a few steps.
"""

from __future__ import annotations

import glob
import json
import math
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import polars as pl

from eagle3lib.core.atomic import write_bytes_atomic
from eagle3lib.core.paths import REPO_ROOT

INT_COLUMNS = ("step", "total_steps", "tokens_seen", "samples_seen")
TEXT_COLUMNS = ("run", "kind")
TTT_PREFIXES = ("loss", "full_acc", "cond_acc")
SMOOTHED = ("loss", "tau_est", "tokens_per_s", "samples_per_s", "grad_norm")  # plus every per-TTT-step column
DEFAULT_METRICS = Path("train") / "metrics.jsonl"
_TTT_RE = re.compile(r"^(loss|full_acc|cond_acc)_(\d+)$")


# --------------------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class SshTarget:
    """`ssh://[user@]host[:port]/path`; `ssh://host/~/x` is x relative to the remote home directory."""

    host: str
    path: str
    user: str | None = None
    port: int | None = None

    @property
    def url(self) -> str:
        who = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        path = self.path if self.path.startswith("/") else f"/~/{self.path}"
        return f"ssh://{who}{self.host}{port}{path}"

    def command(self, timeout_s: float) -> list[str]:
        """The argument list run locally. The remote side receives one command line, so the path is quoted for it."""
        dest = f"{self.user}@{self.host}" if self.user else self.host
        port = ["-p", str(self.port)] if self.port else []
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s))}", *port, "--", dest,
                "cat", "--", shlex.quote(self.path)]


_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def parse_ssh_url(url: str) -> SshTarget:
    parts = urlsplit(url)
    if parts.scheme != "ssh":
        raise ValueError(f"{url}: not an ssh:// URL")
    host, user = parts.hostname, parts.username
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url}: bad port ({e})") from None
    if not host or not _NAME.match(host) or (user is not None and not _NAME.match(user)):
        raise ValueError(f"{url}: expected ssh://[user@]host[:port]/path with a plain host name (an ssh config alias works)")
    path = parts.path
    if path.startswith("/~/"):
        path = path[3:]  # ssh starts in the remote home directory
    if not path or path in ("/", "~"):
        raise ValueError(f"{url}: no file path after the host")
    return SshTarget(host=host, path=path, user=user, port=port)


@dataclass(frozen=True)
class Source:
    spec: str  # as configured (or the default)
    location: str  # absolute local path, or the ssh URL
    label: str
    ssh: SshTarget | None = None


def _default_label(path: str) -> str:
    p = Path(path)
    if p.parent.name == "train" and p.parent.parent.name:
        return p.parent.parent.name  # RUN_DIR/train/metrics.jsonl -> RUN_DIR's name
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def expand_sources(specs: list[str], default: Path, labels: list[str] | None = None) -> list[Source]:
    """Configured sources -> files (globs expanded, sorted). Relative paths are relative to the repo root."""
    out: list[Source] = []
    for spec in specs or [str(default)]:
        if spec.startswith("ssh://"):
            target = parse_ssh_url(spec)
            out.append(Source(spec, target.url, _default_label(target.path) or target.host, target))
            continue
        p = Path(spec).expanduser()
        p = p if p.is_absolute() else REPO_ROOT / p
        if glob.has_magic(str(p)):
            matches = sorted(m for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            if not matches:
                raise ValueError(f"metrics source {spec!r}: no file matches {p}")
            out += [Source(spec, m, _default_label(m)) for m in matches]
        else:
            if not p.is_file():
                hint = " (the train stage writes it; has it started in this run?)" if not specs else ""
                raise ValueError(f"metrics file not found: {p}{hint}")
            out.append(Source(spec, str(p), _default_label(str(p))))
    if labels:
        if len(labels) != len(out):
            raise ValueError(f"learning_curves.labels has {len(labels)} names for {len(out)} files: "
                             f"{[s.location for s in out]}")
        out = [Source(s.spec, s.location, lab, s.ssh) for s, lab in zip(out, labels, strict=True)]
    seen: dict[str, int] = {}
    unique = []
    for s in out:  # a legend needs distinct names
        n = seen[s.label] = seen.get(s.label, 0) + 1
        unique.append(s if n == 1 else Source(s.spec, s.location, f"{s.label} #{n}", s.ssh))
    return unique


def fetch(source: Source, timeout_s: float = 60.0) -> bytes:
    """The file's bytes: read locally, or `ssh host cat -- path` (BatchMode: never waits for a password)."""
    if source.ssh is None:
        return Path(source.location).read_bytes()
    cmd = source.ssh.command(timeout_s)
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout_s + 5, check=False)
    except FileNotFoundError:
        raise ValueError(f"{source.location}: no `ssh` client on this machine") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"{source.location}: ssh did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"{source.location}: could not fetch over ssh (exit {r.returncode}): "
                         f"{err[-1] if err else 'no message'}")
    return r.stdout


# --------------------------------------------------------------------------------------------------------- parsing
@dataclass
class Parsed:
    rows: list[dict[str, Any]]
    lines: int = 0
    torn_last_line: bool = False
    bad_lines: int = 0
    total_steps: int | None = None  # speculators logs: from tqdm bars x epochs


def _numeric(rec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rec.items():
        if k in TEXT_COLUMNS:
            out[k] = str(v)
        elif isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, int | float):
            out[k] = v
        # strings, lists, dicts: unknown extras, ignored
    return out


def parse_jsonl(data: bytes, where: str) -> Parsed:
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    complete_end = text.endswith("\n")
    if complete_end:
        lines = lines[:-1]
    res = Parsed(rows=[], lines=len(lines))
    for i, line in enumerate(lines):
        s = line.strip()
        if not s:
            continue
        try:
            rec = json.loads(s)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not complete_end:
                res.torn_last_line = True  # training is writing it right now
            else:
                res.bad_lines += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int | float) and not isinstance(rec.get("step"), bool):
            rec.setdefault("kind", "train")
            res.rows.append(_numeric(rec))
        else:
            res.bad_lines += 1
    return res


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_HEAD = re.compile(r"^(?P<time>\[[^\]]*\])?\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?P<msg>.*)$")
_PATH_TAIL = re.compile(r"\s+[\w<>.\-]+:\d+\s*$")  # rich's right-aligned `trainer.py:587`
_PAIR = re.compile(r"([A-Za-z_][\w./\-]*)=([^,\s]+)")
_CLOCK = re.compile(r"(\d{1,2}):(\d{2}):(\d{2})")
_TQDM = re.compile(r"Epoch \d+:\s*\d+%\|[^|]*\|\s*\d+/(\d+)")
_EPOCHS = re.compile(r"Training epoch \d+/(\d+) started")
SPECULATORS_LINE = re.compile(r"(?:^|[\s,])(?:train|val)/\w+=")


def _speculators_record(pairs: dict[str, float], last_step: int) -> dict[str, Any] | None:
    kind = "val" if any(k.startswith("val/") for k in pairs) else "train" if any(k.startswith("train/") for k in pairs) else None
    if kind is None:
        return None
    rec: dict[str, Any] = {"kind": kind}
    for k, v in pairs.items():
        if k.startswith(("train/", "val/")):
            name = k.split("/", 1)[1]
            if kind == "val":
                name = name.removesuffix("_epoch")
            rec[name.replace("/", "_")] = v
        elif k.startswith("profile/"):
            rec[k.removeprefix("profile/").replace("/", "_")] = v
        elif k == "lr" or k.startswith("lr/"):
            rec.setdefault("lr", v)  # several optimizers: lr/AdamW=...; the first one
        elif k == "global_step":
            rec["step"] = int(v)
        elif k == "epoch":
            rec["epoch"] = v
    rec.setdefault("step", last_step)  # validation lines carry no step: they follow the last train step
    return rec


def parse_speculators_log(data: bytes, where: str) -> Parsed:
    text = _ANSI.sub("", data.decode("utf-8", errors="replace"))
    physical = re.split(r"\r\n|\r|\n", text)
    records: list[tuple[str | None, list[str]]] = []  # (clock, message pieces)
    clock: str | None = None
    totals: list[int] = []
    epochs: list[int] = []
    for line in physical:
        if "poch" in line:
            totals += [int(m) for m in _TQDM.findall(line)]
            epochs += [int(m) for m in _EPOCHS.findall(line)]
        if not line.strip():
            continue
        m = _HEAD.match(line)
        if m:
            if m.group("time"):
                c = _CLOCK.search(m.group("time"))
                clock = ":".join(c.groups()) if c else clock
            records.append((clock, [_PATH_TAIL.sub("", m.group("msg"))]))
        elif line[0].isspace() and records:
            records[-1][1].append(_PATH_TAIL.sub("", line.strip()))  # rich's wrapped continuation
        else:
            records.append((None, [line.strip()]))  # a plain `%(message)s` line
    res = Parsed(rows=[], lines=len(physical))
    last_step = 0
    day, prev_s, t0 = 0, None, None
    for clk, pieces in records:
        msg = " ".join(pieces)
        if not SPECULATORS_LINE.search(msg):
            continue
        pairs = {}
        for k, v in _PAIR.findall(msg):
            try:
                pairs[k] = float(v)
            except ValueError:
                continue
        rec = _speculators_record(pairs, last_step)
        if rec is None:
            res.bad_lines += 1
            continue
        if rec["kind"] == "train":
            last_step = rec["step"]
        if clk is not None:
            h, mi, s = (int(x) for x in clk.split(":"))
            secs = h * 3600 + mi * 60 + s
            if prev_s is not None and secs < prev_s - 60:
                day += 1  # the clock passed midnight
            prev_s = secs
            secs += day * 86400
            t0 = secs if t0 is None else t0
            rec["elapsed_s"] = float(secs - t0)
        res.rows.append(rec)
    if totals and epochs:
        res.total_steps = max(totals) * max(epochs)
    return res


def detect_format(data: bytes) -> str | None:
    head = data[:2_000_000].decode("utf-8", errors="replace").splitlines()
    jsonish = sum(1 for ln in head if ln.lstrip().startswith("{"))
    spec = sum(1 for ln in head if SPECULATORS_LINE.search(ln))
    if jsonish == 0 and spec == 0:
        return None
    return "eagle3lib" if jsonish >= spec else "speculators"


# --------------------------------------------------------------------------------------------------------- frames
def rows_to_frame(rows: list[dict[str, Any]], label: str) -> pl.DataFrame:
    cols: dict[str, None] = {"run": None, "kind": None, "step": None}
    for r in rows:
        cols.update(dict.fromkeys(r))
    data = {}
    for c in cols:
        values = [label] * len(rows) if c == "run" else [r.get(c) for r in rows]
        if c in TEXT_COLUMNS:
            dtype = pl.Utf8
        elif c in INT_COLUMNS:
            values = [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else int(v) for v in values]
            dtype = pl.Int64
        else:
            dtype = pl.Float64
        data[c] = pl.Series(c, values, dtype=dtype, strict=False)
    return pl.DataFrame(data)


def dedupe(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """One record per (kind, step): rank 0's when records carry a rank, else the last copy (a resume re-logs steps)."""
    n = frame.height
    if "rank" in frame.columns and frame["rank"].drop_nulls().len():
        frame = frame.filter(pl.col("rank").is_null() | (pl.col("rank") == pl.col("rank").min()))
    frame = frame.unique(subset=["kind", "step"], keep="last", maintain_order=True).sort(["step", "kind"])
    return frame, n - frame.height


def ttt_steps(frame: pl.DataFrame) -> int:
    ks = [int(m.group(2)) for c in frame.columns if (m := _TTT_RE.match(c))]
    return max(ks) + 1 if ks else 0


def _complete(frame: pl.DataFrame) -> pl.DataFrame:
    """Derived columns: tau_est where missing, elapsed_s from time, tokens_seen of val records from the train rows."""
    K = ttt_steps(frame)
    full = [f"full_acc_{k}" for k in range(K) if f"full_acc_{k}" in frame.columns]
    if full:
        derived = 1 + pl.sum_horizontal([pl.col(c) for c in full])
        if "tau_est" in frame.columns:
            frame = frame.with_columns(pl.col("tau_est").fill_null(derived))
        else:
            frame = frame.with_columns(derived.alias("tau_est"))
    if "time" in frame.columns:
        # elapsed_s counts from the run's start, which may precede the first record: align on rows that have both
        offset = (frame["time"] - frame["elapsed_s"]).drop_nulls() if "elapsed_s" in frame.columns else None
        base = offset.median() if offset is not None and offset.len() else frame["time"].min()
        from_time = pl.col("time") - base
        if "elapsed_s" in frame.columns:
            frame = frame.with_columns(pl.col("elapsed_s").fill_null(from_time))
        else:
            frame = frame.with_columns(from_time.alias("elapsed_s"))
    if "tokens_seen" in frame.columns and frame.filter(pl.col("kind") == "val").height:
        train = frame.filter((pl.col("kind") == "train") & pl.col("tokens_seen").is_not_null()).select(
            "step", pl.col("tokens_seen").alias("_tok")).sort("step")
        if train.height:
            frame = frame.sort("step").join_asof(train, on="step", strategy="backward").with_columns(
                pl.col("tokens_seen").fill_null(pl.col("_tok"))).drop("_tok").sort(["step", "kind"])
    return frame


def smoothed_columns(frame: pl.DataFrame) -> list[str]:
    return [c for c in frame.columns if c in SMOOTHED or _TTT_RE.match(c)]


def add_smoothing(frame: pl.DataFrame, smoothing: float) -> pl.DataFrame:
    """`<col>_smooth`: bias-corrected EMA over the train records (TensorBoard's smoothing); val rows keep raw values."""
    cols = smoothed_columns(frame)
    train = pl.col("kind") == "train"

    def ema(c: str) -> pl.Expr:
        raw = pl.col(c)
        return raw if smoothing <= 0 else raw.ewm_mean(alpha=1 - smoothing, adjust=True, ignore_nulls=True)

    # val records are interleaved with train ones: smooth the train subset alone, then put both back in order
    tr = frame.filter(train).with_columns(ema(c).alias(f"{c}_smooth") for c in cols)
    va = frame.filter(~train).with_columns(pl.col(c).alias(f"{c}_smooth") for c in cols)
    return pl.concat([tr, va], how="diagonal_relaxed").sort(["step", "kind"])


def add_eta(frame: pl.DataFrame, total_steps: int | None, window: int) -> pl.DataFrame:
    """`steps_per_s` over the last `window` train records and `eta_s` = steps left / that rate, per train record."""
    train = frame.filter(pl.col("kind") == "train")
    if "elapsed_s" not in frame.columns or train["elapsed_s"].drop_nulls().len() < 2:
        return frame
    total = pl.lit(total_steps) if total_steps else (pl.col("total_steps") if "total_steps" in frame.columns else None)
    first = pl.col("step").first(), pl.col("elapsed_s").first()
    d_step = pl.col("step") - pl.col("step").shift(window - 1).fill_null(first[0])
    d_time = pl.col("elapsed_s") - pl.col("elapsed_s").shift(window - 1).fill_null(first[1])
    train = train.with_columns(pl.when(d_time > 0).then(d_step / d_time).otherwise(None).alias("steps_per_s"))
    if total is not None:
        train = train.with_columns(
            ((total - pl.col("step")).clip(lower_bound=0) / pl.col("steps_per_s")).alias("eta_s"))
    return pl.concat([train, frame.filter(pl.col("kind") != "train")], how="diagonal_relaxed").sort(["step", "kind"])


# --------------------------------------------------------------------------------------------------------- runs
@dataclass
class RunMetrics:
    source: Source
    format: str
    frame: pl.DataFrame
    lines: int
    records: int
    torn_last_line: bool
    bad_lines: int
    duplicates_dropped: int
    total_steps: int | None
    local_copy: str | None = None

    @property
    def label(self) -> str:
        return self.source.label


def load_run(source: Source, fmt: str = "auto", smoothing: float = 0.9, eta_window: int = 50,
             total_steps: int | None = None, timeout_s: float = 60.0, copy_dir: Path | None = None) -> RunMetrics:
    """Fetch, parse, de-duplicate and complete one metrics file; every error names the file."""
    where = source.location
    data = fetch(source, timeout_s)
    local_copy = None
    if source.ssh is not None and copy_dir is not None:  # what the report was made from, kept next to it
        safe = re.sub(r"[^\w.\-]+", "_", source.label).strip("_") or "remote"
        local_copy = str(copy_dir / f"{safe}{Path(source.ssh.path).suffix or '.log'}")
        write_bytes_atomic(local_copy, data)
    if not data.strip():
        raise ValueError(f"{where}: the metrics file is empty (training has not logged its first record yet?)")
    kind = detect_format(data) if fmt == "auto" else fmt
    if kind is None:
        raise ValueError(f"{where}: no metrics lines (expected JSON lines with a 'step', or speculators console lines "
                         "like 'train/loss_0=2.31, ..., global_step=12')")
    parsed = parse_jsonl(data, where) if kind == "eagle3lib" else parse_speculators_log(data, where)
    if not parsed.rows:
        raise ValueError(f"{where}: no metrics records among {parsed.lines} lines (format {kind}; "
                         f"{parsed.bad_lines} unreadable)")
    frame = rows_to_frame(parsed.rows, source.label)
    frame, dropped = dedupe(frame)
    frame = _complete(frame)
    total = total_steps or parsed.total_steps
    if total is None and "total_steps" in frame.columns and frame["total_steps"].drop_nulls().len():
        total = int(frame["total_steps"].drop_nulls()[-1])
    frame = add_smoothing(frame, smoothing)
    frame = add_eta(frame, total, eta_window)
    return RunMetrics(source, kind, frame, parsed.lines, len(parsed.rows), parsed.torn_last_line, parsed.bad_lines,
                      dropped, total, local_copy)


def combined(runs: list[RunMetrics]) -> pl.DataFrame:
    return pl.concat([r.frame for r in runs], how="diagonal_relaxed")


def _last(frame: pl.DataFrame, col: str) -> float | None:
    if col not in frame.columns:
        return None
    s = frame[col].drop_nulls()
    if not s.len():
        return None
    v = s[-1]
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def latest(run: RunMetrics) -> dict[str, Any]:
    """The latest values of one run, numbers only (None where the log has none)."""
    f = run.frame
    train, val = f.filter(pl.col("kind") == "train"), f.filter(pl.col("kind") == "val")
    K = ttt_steps(f)
    out: dict[str, Any] = {"step": _last(train, "step"), "total_steps": run.total_steps}
    if out["step"] is not None and run.total_steps:
        out["progress_pct"] = 100.0 * out["step"] / run.total_steps
    for c in ("epoch", "tokens_seen", "samples_seen", "loss", "loss_smooth"):
        out[c] = _last(train, c)
    for prefix in TTT_PREFIXES:
        for k in range(K):
            out[f"{prefix}_{k}"] = _last(train, f"{prefix}_{k}")
    for c in ("tau_est", "tau_est_smooth", "lr", "tokens_per_s", "samples_per_s", "grad_norm", "peak_mem_mb"):
        out[c] = _last(train, c)
    if val.height:
        out["val_step"] = _last(val, "step")
        for c in ("loss", *(f"full_acc_{k}" for k in range(K)), *(f"cond_acc_{k}" for k in range(K)), "tau_est"):
            out[f"val_{c}"] = _last(val, c)
    elapsed = _last(train, "elapsed_s")
    out["elapsed_h"] = elapsed / 3600 if elapsed is not None else None
    out["steps_per_s"] = _last(train, "steps_per_s")
    eta = train["eta_s"][-1] if "eta_s" in train.columns and train.height else None
    eta = float(eta) if eta is not None and math.isfinite(eta) else None
    out["eta_h"] = eta / 3600 if eta is not None else None
    t_last = _last(train, "time")
    if t_last is not None:
        out["last_record_age_min"] = (time.time() - t_last) / 60
        if eta is not None:
            out["finishes_at_unix"] = t_last + eta
    return {k: v for k, v in out.items() if v is not None}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == int(v) and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    return str(v)


def summary_table(runs: list[RunMetrics]) -> pl.DataFrame:
    """One table: a row per metric, a column per run, latest values formatted for reading."""
    per_run = [latest(r) for r in runs]
    metrics: dict[str, None] = {}
    for d in per_run:
        metrics.update(dict.fromkeys(d))
    cols: dict[str, list[str]] = {"metric": list(metrics)}
    for r, d in zip(runs, per_run, strict=True):
        vals = [_fmt(d[m]) if m in d else "" for m in metrics]
        if "finishes_at_unix" in d:
            vals[list(metrics).index("finishes_at_unix")] = datetime.fromtimestamp(d["finishes_at_unix"]).isoformat(
                sep=" ", timespec="minutes")
        cols[r.label] = vals
    return pl.DataFrame(cols).with_columns(
        pl.col("metric").replace("finishes_at_unix", "finishes_at (local time)"))


def sources_table(runs: list[RunMetrics]) -> pl.DataFrame:
    return pl.DataFrame({
        "run": [r.label for r in runs],
        "source": [r.source.location for r in runs],
        "format": [r.format for r in runs],
        "lines": [r.lines for r in runs],
        "records": [r.records for r in runs],
        "duplicates_dropped": [r.duplicates_dropped for r in runs],
        "torn_last_line": [r.torn_last_line for r in runs],
        "unreadable_lines": [r.bad_lines for r in runs],
    })


@dataclass
class LearningCurves:
    runs: list[RunMetrics]
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def frame(self) -> pl.DataFrame:
        return combined(self.runs)

    def summary(self) -> pl.DataFrame:
        return summary_table(self.runs)

    def sources(self) -> pl.DataFrame:
        return sources_table(self.runs)


def load_runs(cfg, default: Path, copy_dir: Path | None = None) -> list[RunMetrics]:
    sources = expand_sources(cfg.sources, default, cfg.labels)
    return [load_run(s, cfg.format, cfg.smoothing, cfg.eta_window, cfg.total_steps, cfg.ssh_timeout_s, copy_dir)
            for s in sources]


def run_learning_curves(ctx) -> LearningCurves:
    """The stage: load every configured run, write the summary (CSV) and the manifest, return the data to plot."""
    from eagle3lib.core.atomic import write_text_atomic
    from eagle3lib.core.manifest import StageTimer

    timer = StageTimer(ctx.dir, ctx.manifest_params())
    runs = load_runs(ctx.cfg, ctx.stage_dir("train") / "metrics.jsonl", ctx.dir / "fetched")
    lc = LearningCurves(runs)
    figures: dict[str, Any] = {"runs": len(runs), "records": sum(r.records for r in runs),
                               "duplicates_dropped": sum(r.duplicates_dropped for r in runs),
                               "torn_last_lines": sum(r.torn_last_line for r in runs),
                               "unreadable_lines": sum(r.bad_lines for r in runs)}
    for i, r in enumerate(runs):
        prefix = "" if i == 0 else f"run{i}."
        figures[f"{prefix}ttt_steps"] = ttt_steps(r.frame)
        figures.update({f"{prefix}{k}": v for k, v in latest(r).items() if k != "last_record_age_min"})
    lc.figures = figures
    write_text_atomic(ctx.dir / "summary.csv", lc.summary().write_csv())
    outputs = {"summary": "summary.csv"}
    copies = [r.local_copy for r in runs if r.local_copy]
    if copies:
        outputs["fetched"] = [str(Path(c).relative_to(ctx.dir)) for c in copies]
    timer.finish(figures, outputs)
    return lc
