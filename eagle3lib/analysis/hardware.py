"""The hardware table (params/hardware.yaml): one row per machine (GPU, count, peak BF16 FLOP/s, memory bandwidth and
size, price), read by the cost projection and the deployment plan."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3lib.config.profile import load_yaml_strict
from eagle3lib.core.hints import did_you_mean
from eagle3lib.core.paths import REPO_ROOT


class HardwareRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu: str
    count: int
    bf16_tflops: float  # per GPU, dense
    mem_bw_tbs: float  # per GPU
    mem_gb: float
    interconnect: str = ""
    usd_per_hour: float  # the whole machine
    usd_per_hour_range: tuple[float, float] | None = None
    owned: bool = False
    purchase_usd: float | None = None
    name: str = ""

    @property
    def price_lo(self) -> float:
        return self.usd_per_hour_range[0] if self.usd_per_hour_range else self.usd_per_hour

    @property
    def price_hi(self) -> float:
        return self.usd_per_hour_range[1] if self.usd_per_hour_range else self.usd_per_hour


def resolve_path(p: str | Path) -> Path:
    p = Path(p).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def load_hardware(path: str | Path) -> dict[str, HardwareRow]:
    path = resolve_path(path)
    if not path.is_file():
        raise ValueError(f"hardware table not found: {path}")
    try:
        raw = load_yaml_strict(path) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    rows = raw.get("hardware") if isinstance(raw, dict) else None
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{path}: expected a 'hardware:' mapping of row name -> figures")
    table = {}
    for name, fields in rows.items():
        try:
            row = HardwareRow.model_validate({**(fields or {}), "name": str(name)})
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{path}: hardware row '{name}': {msgs}") from None
        if row.count < 1 or row.bf16_tflops <= 0 or row.mem_bw_tbs <= 0 or row.usd_per_hour < 0:
            raise ValueError(f"{path}: hardware row '{name}': count, bf16_tflops and mem_bw_tbs must be > 0, "
                             "usd_per_hour >= 0")
        table[str(name)] = row
    return table


def get_row(table: dict[str, HardwareRow], name: str, path: str | Path = "params/hardware.yaml",
            key: str = "") -> HardwareRow:
    """Row `name` of the table at `path`; `key` is the setting that named it (a table of one's own may lack rows the
    shipped one has, and the fix is in the setting or in the table)."""
    if name not in table:
        raise ValueError(f"{key + ': ' if key else ''}unknown hardware '{name}': not a row of {resolve_path(path)}"
                         f"{did_you_mean(name, table)}; rows: {', '.join(table)}")
    return table[name]
