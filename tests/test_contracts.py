# Run: .venv/bin/python -m pytest -q tests/test_contracts.py
"""Each stage's contract (its row in config/registry.py): every key it reads from another section is declared, found
in the code rather than listed here; changing a declared key after a complete run makes exactly the stages that read
it stale; `run --dry-run` says what a run would do and why, touching nothing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_layout import GRAPH, MODULES, ROOT

from eagle3lib.config.registry import STAGES, Stage

PROFILE_NAMES = {"ctx", "profile", "prof"}  # what stage code calls a profile or a stage context


def _section_of(node: ast.AST, named: dict[str, str]) -> str | None:
    """The section a node is: `X.section("S")`, `X.verifier` on a profile or context, or a name bound to one."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "section"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    if isinstance(node, ast.Attribute) and node.attr == "verifier":
        base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        return "verifier" if base in PROFILE_NAMES else None
    if isinstance(node, ast.Name):
        return named.get(node.id)
    return None


def reads_in(tree: ast.AST) -> set[str]:
    """Keys of profile sections a piece of code reads: "S.key" for `<S>.key` and `getattr(<S>, "key")`, "S" where the
    section is handed on whole (an argument, a return value)."""
    found: set[str] = set()
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        named: dict[str, str] = {}
        for node in ast.walk(scope):  # `x = p.section("S")` and `a, b = p.section("S"), ctx.verifier`
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                pairs = (zip(node.targets[0].elts, node.value.elts, strict=False)
                         if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(node.targets[0], node.value)])
                for target, value in pairs:
                    if isinstance(target, ast.Name) and (s := _section_of(value, {})):
                        named[target.id] = s
        used: set[int] = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and (s := _section_of(node.value, named)):
                found.add(f"{s}.{node.attr}")
                used.add(id(node.value))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and (s := _section_of(node.args[0], named))):
                found.add(f"{s}.{node.args[1].value}")
                used.add(id(node.args[0]))
            elif isinstance(node, ast.Assign):
                used |= {id(node.value)} | {id(v) for v in getattr(node.value, "elts", [])}
        for node in ast.walk(scope):  # a section used otherwise: handed on whole
            if id(node) not in used and not isinstance(node, ast.Name) and (s := _section_of(node, {})):
                found.add(s)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in named:
                parent_attr = any(isinstance(p, ast.Attribute) and p.value is node for p in ast.walk(scope))
                parent_get = any(isinstance(p, ast.Call) and getattr(p.func, "id", "") == "getattr" and p.args
                                 and p.args[0] is node for p in ast.walk(scope))
                if not (parent_attr or parent_get):
                    found.add(named[node.id])
    return found


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH.get(m, ())
    return seen


def _notebook_tree(stage: Stage) -> ast.AST:
    cells = json.loads((ROOT / "notebooks" / stage.notebook).read_text())["cells"]
    return ast.parse("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))


# modules that read a whole profile outside any stage: the pre-run checks and the CLI (not a stage's dependency)
NOT_A_STAGE = {"eagle3lib.pipeline", "eagle3lib.config", "eagle3lib.__main__"}


def _declared(stage: Stage, key: str) -> bool:
    section = key.split(".", 1)[0]
    if section == stage.section:
        return True
    return any(r.key == key or r.key == section for r in stage.reads)


def undeclared_reads() -> list[str]:
    bad = []
    for stage in STAGES:
        modules = _closure(f"eagle3lib.stages.{stage.name}")
        trees = [(m, ast.parse(MODULES[m].read_text())) for m in sorted(modules)
                 if not any(m == p or m.startswith(p + ".") for p in NOT_A_STAGE)]
        trees.append((f"notebooks/{stage.notebook}", _notebook_tree(stage)))
        for where, tree in trees:
            for key in sorted(reads_in(tree)):
                if key.split(".", 1)[0] in {s.section for s in STAGES} | {"verifier"} and not _declared(stage, key):
                    bad.append(f"{stage.name}: {where} reads {key}")
    return bad


def test_every_cross_section_read_in_the_code_is_declared():
    """Found in the code: each `section("S")` read (an attribute of it, or the section handed on whole) in the modules a
    stage imports and in its notebook is declared in the stage's registry row."""
    bad = undeclared_reads()
    assert not bad, "reads of other sections that config/registry.py does not declare:\n" + "\n".join(bad)


def test_the_scan_finds_reads_of_every_shape():
    """The scanner above is what the test rests on: it must see each way code reads a section."""
    code = '''
def f(ctx, profile):
    a = ctx.profile.section("train").decay
    t = profile.section("extract")
    b = t.backend
    c = getattr(ctx.profile.section("deployment"), "context_tokens", None)
    d, v = ctx.profile.section("evaluate"), ctx.verifier
    g(d)
    return v.model
'''
    assert reads_in(ast.parse(code)) == {"train.decay", "extract.backend", "deployment.context_tokens", "evaluate",
                                         "verifier.model"}


def test_a_read_the_row_does_not_declare_fails_at_the_read(tmp_path):
    from eagle3lib.config.contract import UndeclaredRead
    from eagle3lib.config.stages import open_stage

    ctx = open_stage("cost_projection", "tiny", tmp_path / "run")
    assert ctx.profile.section("train").ttt_steps == ctx.profile.unscoped.section("train").ttt_steps  # declared
    with pytest.raises(UndeclaredRead, match=r"cost_projection stage read train\.lr"):
        _ = ctx.profile.section("train").lr
    with pytest.raises(UndeclaredRead, match="the cost_projection stage read the verifier section"):
        _ = ctx.verifier
    ev = open_stage("evaluate", "tiny", tmp_path / "run")  # deployment is read only for the K sweep
    with pytest.raises(UndeclaredRead, match="only when evaluate.ttt_steps_sweep is set"):
        ev.profile.section("deployment")
    ev = open_stage("evaluate", "tiny", tmp_path / "run", {"evaluate.ttt_steps_sweep": [1, 2]})
    assert ev.profile.section("deployment").tp_layer_overhead_us > 0


# ---- staleness from the contract, on a run whose stages completed as a run completes them

SWEEP = {"evaluate.ttt_steps_sweep": [1, 2]}  # evaluate measured a K sweep: its K plan read deployment


def _complete_run(run: Path, overrides: dict) -> None:
    """Every stage a default run skips once complete, completed in order with the params and input ids a real run
    records (config/stages.py's StageContext.timer, the same call the stages make)."""
    from eagle3lib.config.stages import open_stage

    for name in ("verifier", "generate", "extract", "train", "evaluate"):
        open_stage(name, "tiny", run, overrides).timer().finish({})


def _stale(run: Path, overrides: dict) -> set[str]:
    from eagle3lib.config.profile import load_profile
    from eagle3lib.pipeline.plan import plan

    prof = load_profile("tiny", overrides)
    steps = plan([s for s in STAGES if not s.always_run], run, prof, force=False)
    return {s.name for s, d in steps if d.action == "again"}  # (extract's store is not made here: "repair")


# a key -> the stages that read it and the ones after them, whose input is then made again (written from what each
# stage does with it, not from the registry)
EXPECTED = {
    "deployment.tp_layer_overhead_us": (60.0, {"evaluate"}),  # the K sweep's GPU plan
    "cost_projection.hardware": (["h200-x8"], {"evaluate"}),
    "train.decay": (0.5, {"train", "evaluate"}),  # the validation estimate evaluate sets beside served tau
    "train.ttt_steps": (2, {"train", "evaluate"}),  # evaluate's default K
    "train.hidden_states": ("online", {"extract", "train", "evaluate"}),  # extract stores tokens only
    "extract.backend": ("vllm", {"extract", "train", "evaluate"}),  # online states come through it
    "generate.turns": ("first", {"generate", "extract", "train", "evaluate"}),  # evaluate counts prompts seen in training
    "verifier.model": ("builtin:tiny-kimi", {"verifier", "generate", "extract", "train", "evaluate"}),
    "evaluate.n_prompts": (3, {"evaluate"}),
    "verifier.server_url": ("http://127.0.0.1:9", set()),  # operational: where the server runs
    "generate.concurrency": (3, set()),
    "train.log_every": (3, set()),
    "train.nproc_per_node": (2, set()),  # the batch is global: 1 and 2 processes take the same steps
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_changing_a_key_makes_the_stages_that_read_it_stale_and_leaves_the_others_fresh(tmp_path, key):
    value, stale = EXPECTED[key]
    _complete_run(tmp_path / "run", SWEEP)
    assert _stale(tmp_path / "run", SWEEP) == set()
    assert _stale(tmp_path / "run", {**SWEEP, key: value}) == stale


def test_every_declared_key_makes_its_stage_stale(tmp_path):
    """Each key a row declares, changed alone: the stage declaring it runs again (and only stages whose contract holds
    it, directly or through the stage before them)."""
    from eagle3lib.config.registry import SECTIONS

    _complete_run(tmp_path / "run", SWEEP)
    new = {"train.hidden_states": "online", "train.ttt_steps": 2, "train.cache_budget_gb": 9.0,
           "generate.dataset": str(ROOT / "eagle3lib/assets/prompts"), "generate.turns": "first",
           "cost_projection.hardware": ["h200-x8"]}
    whole = {"verifier": "verifier.max_model_len", "train": "train.lr", "extract": "extract.max_sample_tokens",
             "deployment": "deployment.tp_layer_overhead_us", "evaluate": "evaluate.seed",
             "cost_projection": "cost_projection.samples"}
    tried = set()
    for stage in STAGES:
        for read in stage.reads:
            key = whole[read.key] if read.field is None else read.key
            value = new.get(key)
            if value is None:
                field = SECTIONS[key.split(".")[0]].model_fields[key.split(".")[1]]
                value = field.default * 2 + 1 if isinstance(field.default, (int, float)) else field.default
            tried.add(key)
            if stage.always_run:  # recorded, but it runs each time anyway
                continue
            assert stage.name in _stale(tmp_path / "run", {**SWEEP, key: value}), f"{stage.name}: {key}"
    assert tried >= set(new)


def test_dry_run_names_the_changed_key_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    _complete_run(run, SWEEP)
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    sets = ["--set", "evaluate.ttt_steps_sweep=[1,2]"]
    cmd = [sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--dry-run", *sets,
           "--stages", "verifier,generate,extract,train,evaluate"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert all(" skip " in lines[s] for s in ("verifier", "generate", "train", "evaluate")), r.stdout
    assert "repair" in lines["extract"] and "store.json is missing" in lines["extract"]  # no store made here
    r = subprocess.run([*cmd, "--set", "deployment.tp_layer_overhead_us=60"], capture_output=True, text=True)
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert "run again from scratch" in lines["evaluate"] and "deployment.tp_layer_overhead_us: 130.0 -> 60.0" in \
        lines["evaluate"], r.stdout
    assert " skip " in lines["train"]
    r = subprocess.run([*cmd, "--set", "train.decay=0.5"], capture_output=True, text=True)
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert "train.decay: 0.8 -> 0.5" in lines["train"] and "its input stage train runs before it" in lines["evaluate"]
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    assert not list(run.glob(".*previous*"))


def test_every_operational_key_is_a_field_of_its_section():
    """A misspelt name in a section's OPERATIONAL set would silently make that key count (or another not count)."""
    from eagle3lib.config.registry import SECTIONS

    bad = [f"{name}.{key}" for name, cls in SECTIONS.items() for key in cls.OPERATIONAL if key not in cls.model_fields]
    assert not bad, bad
