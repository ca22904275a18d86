# .venv/bin/python -m pytest -q tests/test_docs.py
"""The documentation site (mkdocs.yml, docs/): the parameter reference generated from the config classes lists every
key of every section with its why; `make docs`'s build is strict (a broken link, anchor or missing page fails it) and
offline; in Chromium, from the file system, the navigation reaches the parameter reference and search finds a key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_browser import _screenshot, _shots

from eagle3lib.config.profile import SECTIONS, section_class
from eagle3lib.config.reference import field_comments, markdown, reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_lists_every_key_of_every_section_with_its_why():
    ref = reference()
    assert list(ref) == list(SECTIONS)
    for section, params in ref.items():
        assert [p.key for p in params] == list(section_class(section).model_fields), section
        assert all(p.why for p in params), [f"{section}.{p.key}" for p in params if not p.why]
    text = markdown()
    for section, params in ref.items():
        for p in params:
            assert f"| `{p.key}` |" in text, f"{section}.{p.key}"
    train = {p.key: p for p in ref["train"]}
    assert train["packed_row_tokens"].range == ">= 8" and train["packed_row_tokens"].default == "2048"
    assert train["lr"].range == "> 0" and train["lr"].why.startswith("peak AdamW learning rate")
    assert "<think>" not in text  # escaped: a tag would swallow the rest of the cell


def test_a_comment_that_wraps_onto_the_next_lines_is_read_whole():
    """A long why continues on `# ...` lines below its field; a `#` inside a string is not a comment."""
    from eagle3lib.config.data_scaling import DataScalingConfig

    _, why = field_comments(DataScalingConfig)["schedule"]
    assert why.startswith("steps: every fraction trains") and why.endswith("(cheaper: a fraction f costs f of the full run)")
    from eagle3lib.config.verifier import VerifierConfig

    assert field_comments(VerifierConfig)["extra_server_args"][1].startswith("passed verbatim to vLLM's api_server")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WARNING" not in r.stderr, r.stderr
    return out


def test_the_site_builds_strict_and_offline_with_every_page(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    docs = {p.relative_to(ROOT / "docs").with_suffix(".html").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert docs <= pages
    html = (site / "reference" / "parameters.html").read_text()
    for section in SECTIONS:
        assert f"<code>{section}</code>" in html
    assert html.count("<tr>") > sum(len(section_class(s).model_fields) for s in SECTIONS)
    for page in site.rglob("*.html"):  # nothing fetched from the network: no remote scripts, styles, fonts or images
        text = page.read_text()
        assert not re.search(r"src=\"(https?:)?//", text) and not re.search(r"<link[^>]+href=\"(https?:)?//", text), page


@pytest.mark.slow
def test_the_site_opens_from_the_file_system_and_navigates_to_the_reference(browser, site, tmp_path):
    """Navigation from file://; search from a local HTTP server (browsers start no Web Worker for a file:// page),
    with no network either way (every request outside the site is counted as an error)."""
    import http.server
    import threading
    from functools import partial

    page = browser.new_page(viewport={"width": 1400, "height": 1600})  # the whole navigation sidebar in view
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}"))
    page.on("request", lambda r: None if r.url.startswith(("file://", "http://127.0.0.1", "data:", "blob:"))
            else errors.append(f"outside the site: {r.url}"))
    page.goto((site / "index.html").as_uri())
    page.get_by_role("link", name="Parameters").first.click()
    page.wait_for_url(re.compile(r"reference/parameters\.html"))
    assert page.locator("td code", has_text="packed_row_tokens").count() >= 1
    # a reader sees key, type, default and why at once on a 1280-px screen, and a union type as `str | None`
    page.set_viewport_size({"width": 1280, "height": 900})
    box = page.locator("th", has_text="why").first.bounding_box()
    assert box is not None and box["x"] + box["width"] <= 1280, box
    assert page.locator("td code", has_text="str | None").count() >= 1
    assert "\\|" not in page.locator("article").inner_text()
    _screenshot(page, "docs_parameters.png", _shots(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(http.server.SimpleHTTPRequestHandler,
                                                                        directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
        search = page.locator("input[data-md-component=search-query]")
        search.click()
        # the theme searches on keyup, and on the worker's "ready" with whatever the box then holds: a fill() (no key
        # events) that lands after the worker is ready is never searched, which failed one CI run. So wait for
        # ready, then type key by key, as a reader does
        meta = page.locator(".md-search-result__meta")
        page.wait_for_function("() => !/Initializing/i.test(document.querySelector('.md-search-result__meta')"
                               "?.textContent ?? 'Initializing')", timeout=90_000)
        search.press_sequentially("packed_row_tokens")
        try:
            page.locator(".md-search-result__item").first.wait_for(timeout=60_000)
        except Exception as e:
            raise AssertionError(f"no search result; the theme says {meta.text_content()!r}") from e
        finally:
            _screenshot(page, "docs_search.png", _shots(tmp_path))
        hrefs = [a.get_attribute("href") for a in page.locator(".md-search-result__item a").all()]
        assert any("reference/parameters.html" in h for h in hrefs), hrefs
        _screenshot(page, "docs_search.png", _shots(tmp_path))
    finally:
        server.shutdown()
    # from file:// the theme looks for a script form of the search index, which only the offline plugin writes
    # (with its CDN shim): search needs the local server, as mkdocs.yml says; nothing else may fail
    assert not [e for e in errors if "file://" not in e or "/search/search_index.js" not in e], errors


def test_architecture_names_every_library_module():
    """ARCHITECTURE.md is how a newcomer finds a module: one added without a word there fails here."""
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "eagle3lib").rglob("*.py"))
               if p.name != "__init__.py" and p.parent.name != "eagle3lib" and "assets" not in p.parts
               and not re.search(rf"(`|/){re.escape(p.stem)}(`|\.py|\b)", doc)]
    assert not missing, f"modules ARCHITECTURE.md does not name: {missing}"


def test_the_readme_stays_a_front_page():
    """The README is what a newcomer reads first: at most 120 lines; results history lives in docs/results.md."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines; move detail to docs/"


FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|tokens/s|\btau\b.*\d\.\d\d")  # a speedup, a throughput or an acceptance length
SOURCE = re.compile(r"\.venv/bin/python|make [a-z]|python -m eagle3lib|eagle3lib (run|init|params|export)|--stages|"
                    r"benchmarks/|https?://|^Source: ", re.M)  # the command that measures it, or where it was published


def test_a_figure_in_the_docs_says_how_it_was_measured():
    """Every section of docs/ that states a measured figure names the command that reproduces it (or, for a figure
    measured elsewhere, its published source). results.md is the lab notebook: its entries carry theirs one by one."""
    missing = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.name == "results.md" or "reference" in page.parts:
            continue
        for section in re.split(r"\n(?=#{1,4} )", page.read_text()):
            lines = section.split("\n")
            measured = any(FIGURE.search(line) and re.search(r"\d", line) for line in lines)
            if measured and not SOURCE.search(section):
                missing.append(f"{page.relative_to(ROOT)}: {lines[0][:80]}")
    assert not missing, "sections with figures and no command or source:\n" + "\n".join(missing)


def test_architectures_parameter_table_is_the_registrys():
    """The table of what each stage reads is rendered from the stage registry; a row changed without the document
    (or the document edited by hand) fails here."""
    from eagle3lib.config.registry import contract_table

    doc = (ROOT / "ARCHITECTURE.md").read_text()
    assert contract_table() in doc, "ARCHITECTURE.md's contract table differs from config/registry.py:\n" + contract_table()


def _layer_diagram() -> dict[str, int]:
    """ARCHITECTURE.md's layer diagram as {package: layer}: every `name/` (and `__main__`) under a `layer N` line."""
    block = (ROOT / "ARCHITECTURE.md").read_text().split("```")[1]
    placed, layer = {}, None
    for line in block.splitlines():
        if m := re.match(r"layer (\d+)", line):
            layer = int(m.group(1))
        for name in re.findall(r"(?:^|\s{2,})(\w+)/(?=\s)", line) + re.findall(r"\b(__main__)\b", line):
            placed.setdefault(name, layer)
    return placed


def test_architectures_layer_diagram_places_each_package_where_the_layout_test_does():
    """A package described in the wrong layer (or not at all) fails here, not only a module left out."""
    from test_layout import LAYERS

    assert _layer_diagram() == LAYERS


def test_architectures_command_list_is_the_clis():
    import contextlib
    import io

    from eagle3lib.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    commands = re.search(r"\{([a-z,-]+)\}", out.getvalue()).group(1).split(",")
    line = next(ln for ln in (ROOT / "ARCHITECTURE.md").read_text().splitlines() if "the CLI: python -m eagle3lib" in ln)
    assert line.split("python -m eagle3lib ", 1)[1].split(" | ") == commands
