"""Progress bars that suit where they are shown.

  a terminal                     tqdm's text bar
  JupyterLab                     a widget bar (ipywidgets), updated in place
  a notebook run headless        one summary line when the bar closes: items, time, rate. papermill keeps every
  (the runner sets HEADLESS_ENV) update a text bar prints, so a report would carry a red block of ~100 bar lines
"""

from __future__ import annotations

import io
import os
import sys

from tqdm import tqdm

HEADLESS_ENV = "EAGLE3LIB_HEADLESS"  # set by the runner for the kernels it starts; inherited by their children


def headless() -> bool:
    return os.environ.get(HEADLESS_ENV) == "1"


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _rate(n: float, seconds: float, unit: str, scale: bool) -> str:
    fmt = (lambda x: tqdm.format_sizeof(x)) if scale else (lambda x: f"{x:,.0f}" if x >= 100 or float(x).is_integer() else f"{x:,.1f}")
    return f"{fmt(n)} {unit} in {seconds:.1f} s ({fmt(n / seconds) if seconds > 0 else '-'} {unit}/s)"


def progress_bar(iterable=None, **kw):
    """`tqdm(iterable, **kw)` in a terminal, `tqdm.auto` (a widget) in JupyterLab, a `SummaryBar` headless."""
    if headless():
        return SummaryBar(iterable, **kw)
    if _in_notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.auto import tqdm as notebook_tqdm

            return notebook_tqdm(iterable, **kw)
        except ImportError:  # no widgets: a text bar rather than tqdm's "IProgress not found" warning
            pass
    return tqdm(iterable, **kw)


class SummaryBar(tqdm):
    """Counts like tqdm, prints nothing while running, and one line to stdout when closed."""

    def __init__(self, iterable=None, **kw):
        kw["file"] = io.StringIO()  # the running bar goes nowhere
        kw["mininterval"] = 3600.0
        self._summarised = False
        super().__init__(iterable, **kw)

    def close(self):
        if not self._summarised and not self.disable:
            self._summarised = True
            elapsed = self.format_dict.get("elapsed", 0.0)
            of = f" of {self.total:,.0f}" if self.total and self.n != self.total and not self.unit_scale else ""
            print(f"{self.desc or 'progress'}: {_rate(self.n, elapsed, self.unit, bool(self.unit_scale))}{of}",
                  file=sys.stdout, flush=True)
        super().close()
