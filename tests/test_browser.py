# .venv/bin/python -m pytest -q tests/test_browser.py
"""What a person sees, in a real browser: Debian's Chromium (installed here when missing; no browser download) driven
by Playwright. The rendered reports of a run (the session's tiny run: every stage) open offline with every link and
image resolving; JupyterLab opens the analysis notebooks as they ship, runs all their cells through its own menu, and
shows the figures with no error.
Screenshots go beside the test's output (and, with EAGLE3LIB_SCREENSHOTS=DIR, into DIR for the docs: docs/screenshots/)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
def _shots(tmp: Path) -> list[Path]:
    out = [tmp]
    if os.environ.get("EAGLE3LIB_SCREENSHOTS"):
        out.append(Path(os.environ["EAGLE3LIB_SCREENSHOTS"]))
    for d in out:
        d.mkdir(parents=True, exist_ok=True)
    return out


def _screenshot(page, name: str, dirs: list[Path]) -> None:
    for d in dirs:
        page.screenshot(path=str(d / name), full_page=False)


@pytest.fixture(scope="module")
def run(tiny_run) -> Path:
    """The session's tiny run (tests/conftest.py): every stage's report, as `make demo` leaves them. Read only."""
    return tiny_run.check()


@pytest.fixture(scope="module")
def runs(run, tmp_path_factory) -> Path:
    """RUNS/tiny: a copy of the run for JupyterLab, whose notebooks rewrite the stages they run (weights left out: the
    analysis notebooks read manifests and metrics)."""
    runs = tmp_path_factory.mktemp("lab-runs")
    shutil.copytree(run, runs / run.name, symlinks=True, ignore=shutil.ignore_patterns("*.safetensors", "*.log"))
    return runs


def _broken_images(page) -> list[str]:
    return page.evaluate("""() => Array.from(document.images)
        .filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80))""")


def test_reports_open_offline_with_every_link_and_image(browser, run, tmp_path):
    dirs = _shots(tmp_path)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    failed: list[str] = []
    page.on("requestfailed", lambda req: failed.append(req.url))
    page.goto((run / "index.html").as_uri())
    links = page.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
    local = [u for u in links if u.startswith("file://")]
    assert local, links
    assert not [u for u in links if not u.startswith(("file://", "#"))]  # an offline report links nothing remote
    assert "learning_curves" in page.inner_text("body") and "cost_projection" in page.inner_text("body")
    _screenshot(page, "index.png", dirs)
    for url in local:
        path = Path(re.sub(r"^file://", "", url).split("#")[0])
        assert path.exists(), f"index.html links {url}, which does not exist"
        if path.suffix != ".html":
            continue
        page.goto(url)
        assert _broken_images(page) == [], url
        text = page.inner_text("body")
        assert "Traceback" not in text and str(ROOT) not in text and str(run) not in text, url  # no machine paths
        if path.parent.name == "cost_projection":
            assert page.evaluate("() => document.images.length") >= 1  # the projection's plots, embedded
            assert re.search(r"\$[\d,]+", text), "no dollar figure in the cost report"
            _screenshot(page, "cost_projection_report.png", dirs)
    assert failed == [], failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(runs, tmp_path_factory):
    """`jupyter lab` on 127.0.0.1 with a token, serving the repository, finding runs in RUNS."""
    port, token = _free_port(), "eagle3lib-test-token"
    home = tmp_path_factory.mktemp("lab-home")
    served = home / "repo"  # a copy of notebooks/: running them in the UI must never write into the committed files
    shutil.copytree(ROOT / "notebooks", served / "notebooks")
    settings = {"notebook-extension/tracker": {"windowingMode": "none"},  # every cell rendered, not only those in view
                "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
                "docmanager-extension/plugin": {"autosave": False}}
    for name, value in settings.items():
        f = home / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))
    env = {**os.environ, "EAGLE3LIB_RUNS_DIR": str(runs), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings")}
    env.pop("EAGLE3LIB_HEADLESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}", "--allow-root",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}", token
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _run_all_cells(page) -> None:
    page.locator(".jp-Notebook").first.wait_for(timeout=120_000)
    # the kernel is up when the toolbar's status says Idle
    page.wait_for_function("() => document.body.innerText.includes('Idle')", timeout=120_000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_text("Run All Cells", exact=True).click()
    page.wait_for_function("""() => {
        const p = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')).map(e => e.innerText);
        return p.length > 0 && p.every(t => /\\[\\d+\\]/.test(t));
    }""", timeout=240_000, polling=500)


@pytest.mark.slow
@pytest.mark.parametrize(("notebook", "expected"), [
    ("learning_curves.ipynb", ["tau_est", "runs/tiny"]),
    ("cost_projection.ipynb", ["Time, cost and disk per stage", "runs/tiny", "$"]),
])
def test_jupyterlab_runs_the_notebook_as_it_ships(browser, lab, runs, tmp_path, notebook, expected):
    url, token = lab
    dirs = _shots(tmp_path)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    stem = notebook.removesuffix(".ipynb")  # a workspace of its own: only this notebook open
    page.goto(f"{url}/lab/workspaces/{stem}/tree/notebooks/{notebook}?reset&token={token}", timeout=120_000)
    _run_all_cells(page)
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    assert not [e for e in errors if "Error" in e or "Traceback" in e], errors
    images = page.evaluate("""() => Array.from(document.querySelectorAll('.jp-OutputArea-output img'))
        .map(i => [i.naturalWidth, i.naturalHeight])""")
    assert images and all(w > 0 and h > 0 for w, h in images), images
    text = page.locator(".jp-Notebook").inner_text()
    for want in expected:
        assert want in text, (want, text[:3000])
    page.locator(".jp-OutputArea-output img").first.scroll_into_view_if_needed()
    _screenshot(page, f"jupyterlab_{notebook.removesuffix('.ipynb')}.png", dirs)
    stage = notebook.removesuffix(".ipynb")
    m = json.loads((runs / "tiny" / stage / "manifest.json").read_text())
    assert m["status"] == "complete"
