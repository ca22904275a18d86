"""Where training metrics come from, and how their lines are read.

Sources are local paths, globs, or `ssh://[user@]host[:port]/path` (fetched with the user's own ssh config as
`ssh host cat -- path`, an argument list, never a shell string; the file is read, never executed). A file may be:

- eagle3lib's `RUN_DIR/train/metrics.jsonl`: one JSON object per line (`kind`, `step`, `loss_k`, `full_acc_k`,
  `cond_acc_k`, `tau_est`, ...). Unknown keys are kept when numeric and ignored otherwise.
- a speculators console log: its metric lines are `train/loss_0=2.346, train/full_acc_0=0.610, ..., epoch=0,
  lr=3.00e-05, global_step=12` (validation: `val/loss_0_epoch=..., epoch=0`), printed by rich's log handler, which
  prefixes `[HH:MM:SS] INFO` and wraps long records onto indented continuation lines. tqdm's `Epoch 0: ... 530/4430`
  bars and `Training epoch 1/3 started` lines give the run length for the ETA.
- a TensorBoard log directory (eagle3lib's `RUN_DIR/train/tensorboard/`, or another tool's): every folder under it
  holding event files is one run, read with TensorBoard's own reader (eagle3lib/trackers/tensorboard_log.py); tags
  `train/x` and `val/x` become field x of that kind.

Files are read while training appends to them: a torn last line is ignored (a torn line in the middle, left by a crash
before a resume, is skipped and counted).
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from eagle3lib.core.paths import REPO_ROOT

TEXT_COLUMNS = ("run", "kind")


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
    tensorboard: bool = False  # a folder of TensorBoard event files, not a file


def _default_label(path: str) -> str:
    p = Path(path)
    if p.parent.name == "train" and p.parent.parent.name:
        return p.parent.parent.name  # RUN_DIR/train/metrics.jsonl -> RUN_DIR's name
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def _tensorboard_label(run: Path, root: Path) -> str:
    if run.name == "tensorboard" and run.parent.name == "train" and run.parent.parent.name:
        return run.parent.parent.name  # RUN_DIR/train/tensorboard -> RUN_DIR's name
    return str(run.relative_to(root)) if run != root else run.name


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
        if p.is_dir():
            from eagle3lib.trackers.tensorboard_log import event_dirs

            runs = event_dirs(p)
            if not runs:
                raise ValueError(f"metrics source {spec!r}: {p} is a folder without TensorBoard event files")
            out += [Source(spec, str(d), _tensorboard_label(d, p), tensorboard=True) for d in runs]
            continue
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


def parse_tensorboard(source: Source) -> Parsed:
    from eagle3lib.trackers.tensorboard_log import read_tensorboard

    try:
        rows = [r for r in read_tensorboard(source.location) if r["kind"] in ("train", "val")]
    except Exception as e:  # a damaged event file: name it
        raise ValueError(f"{source.location}: TensorBoard could not read these event files ({type(e).__name__}: {e})") from None
    return Parsed(rows=[_numeric(r) for r in rows], lines=len(rows))


def detect_format(data: bytes) -> str | None:
    head = data[:2_000_000].decode("utf-8", errors="replace").splitlines()
    jsonish = sum(1 for ln in head if ln.lstrip().startswith("{"))
    spec = sum(1 for ln in head if SPECULATORS_LINE.search(ln))
    if jsonish == 0 and spec == 0:
        return None
    return "eagle3lib" if jsonish >= spec else "speculators"
