"""Command line: `python -m eagle3lib run --profile tiny --run-dir runs/demo`, and a few helpers.

  run            execute stage notebooks in order into a run directory (see eagle3lib.pipeline.runner); --dry-run
                 says what each stage would do and why (eagle3lib.pipeline.plan)
  params         print a profile as validated, overrides applied
  stages         list the stages and their notebooks
  build-verifier build (or find in the cache) an embedded tiny verifier (tiny, tiny-long, tiny-kimi) and print its path
  export         write a drafter (either layout) in the speculators or the EAGLE layout: export CKPT --layout eagle --out DIR
  import         a drafter in the EAGLE layout (SpecForge, EAGLE, AQ-MedAI) into the speculators layout vLLM reads
  serve          run the profile's verifier as the generate stage would start it, on a given host and port, in the
                 foreground (one server per node for a multi-server generate run: params/launch/)
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3lib.config.profile import ParamsError, load_profile, parse_set


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3lib", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run stage notebooks into a run directory")
    r.add_argument("--profile", default="tiny", help="profile name in params/ or a YAML path (default: tiny)")
    r.add_argument("--run-dir", default=None, help="where every stage writes (default: runs/demo in the repository)")
    r.add_argument("--stages", default=None, help="comma-separated subset, in pipeline order (default: every stage but data_scaling)")
    r.add_argument("--set", action="append", dest="overrides", metavar="SECTION.KEY=VALUE", help="override a parameter")
    r.add_argument("--force", action="store_true", help="delete the selected stages' outputs and run them from scratch")
    r.add_argument("--dry-run", action="store_true", help="print what each selected stage would do (skip, run, resume, "
                   "repair, run again) and why, and touch nothing")
    p = sub.add_parser("params", help="print a validated profile")
    p.add_argument("--profile", default="tiny")
    p.add_argument("--set", action="append", dest="overrides", metavar="SECTION.KEY=VALUE")
    sub.add_parser("stages", help="list stages")
    b = sub.add_parser("build-verifier", help="build a tiny verifier (cached) and print its path")
    b.add_argument("--name", default="tiny", choices=["tiny", "tiny-long", "tiny-kimi"], help="which one (default: tiny)")
    b.add_argument("--ship", action="store_true", help="also copy it into the package (eagle3lib/assets/<name>-verifier)")
    e = sub.add_parser("export", help="write a drafter checkpoint in another layout (speculators or eagle)")
    e.add_argument("checkpoint", help="a drafter folder, either layout (e.g. runs/demo/train/final)")
    e.add_argument("--layout", required=True, choices=["speculators", "eagle"])
    e.add_argument("--out", required=True, help="the folder to write: new, empty, or an earlier checkpoint (replaced "
                   "atomically); a folder holding anything else is refused")
    i = sub.add_parser("import", help="an EAGLE-layout drafter into the speculators layout (= export --layout speculators)")
    i.add_argument("checkpoint")
    i.add_argument("--out", required=True)
    v = sub.add_parser("serve", help="run the profile's verifier in vLLM, as the generate stage would (foreground)")
    v.add_argument("--profile", default="tiny")
    v.add_argument("--set", action="append", dest="overrides", metavar="SECTION.KEY=VALUE")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    n = sub.add_parser("init", help="write a first profile from a model's config, tokenizer and chat template")
    n.add_argument("--model", required=True, help="a local model folder or a hub name")
    n.add_argument("--out", required=True, help="the profile to write, e.g. params/mymodel.yaml")
    n.add_argument("--gpu-gib", type=float, default=80, help="memory per GPU, for tensor_parallel_size (default 80)")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "run":
            from eagle3lib.core.paths import started_here
            from eagle3lib.pipeline.runner import StageFailed, run_pipeline

            stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages is not None else None
            if args.run_dir is None:
                from eagle3lib.core.paths import REPO_ROOT

                args.run_dir = str(REPO_ROOT / "runs" / "demo")
                print(f"run directory: {args.run_dir} (the default; choose one with --run-dir)", file=sys.stderr)
            try:
                with started_here():  # the stage notebooks start in the repository, not here
                    run_pipeline(args.profile, args.run_dir, stages, parse_set(args.overrides), args.force,
                                 args.dry_run)
            except StageFailed as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            except KeyboardInterrupt as e:
                # Each stage keeps what it finished (shards, checkpoints) and resumes from it; a traceback from
                # papermill's event loop would only hide that. Interrupted (core/stop.py) carries the signal's name.
                from eagle3lib.core.stop import Interrupted

                how = e if isinstance(e, Interrupted) else Interrupted(2)
                print(f"\ninterrupted by {how.name}: run the same command again to resume ({args.run_dir})",
                      file=sys.stderr)
                return how.exit_code
        elif args.cmd == "params":
            prof = load_profile(args.profile, parse_set(args.overrides))
            print(json.dumps({"profile": str(prof.path), **prof.as_dict()}, indent=2))
        elif args.cmd == "stages":
            from eagle3lib.config.stages import STAGES
            from eagle3lib.core.paths import NOTEBOOKS_DIR

            for s in STAGES:
                mark = "" if (NOTEBOOKS_DIR / s.notebook).exists() else "  (not in this checkout yet)"
                print(f"{s.name:16} notebooks/{s.notebook:24} [{s.section}]{mark}")
        elif args.cmd == "build-verifier":
            from eagle3lib.tiny.build import ship, tiny_verifier_path
            from eagle3lib.tiny.kimi import TinyKimiRecipe
            from eagle3lib.tiny.long import TinyLongRecipe
            from eagle3lib.tiny.recipe import TinyRecipe

            recipe = {"tiny-kimi": TinyKimiRecipe, "tiny-long": TinyLongRecipe}.get(args.name, TinyRecipe)()
            print(ship(recipe) if args.ship else tiny_verifier_path(recipe))
        elif args.cmd in ("export", "import"):
            from eagle3lib.model.interop import convert_drafter

            print(convert_drafter(args.checkpoint, getattr(args, "layout", "speculators"), args.out))
        elif args.cmd == "serve":
            return _serve(args)
        elif args.cmd == "init":
            from eagle3lib.pipeline.profile_init import write_profile

            out = write_profile(args.model, args.out, args.gpu_gib)
            print(f"{out}: written; read its comments, set generate.dataset, then: python -m eagle3lib params "
                  f"--profile {out}")
    except (ParamsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _serve(args) -> int:
    import os
    from pathlib import Path

    from eagle3lib.model.verifier import resolve_model
    from eagle3lib.vllm.server import server_for_verifier

    vcfg = load_profile(args.profile, parse_set(args.overrides)).verifier
    server = server_for_verifier(vcfg, resolve_model(vcfg.model), Path(os.devnull), port=args.port)
    cmd = server.command()
    cmd[cmd.index("--host") + 1] = args.host
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    _port_free(args.host, args.port)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.kv_cache_gib))
    os.execv(cmd[0], cmd)


def _port_free(host: str, port: int) -> None:
    """A port another process listens on: one line now, instead of vLLM's 40-line traceback after its start-up."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: a port in TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); another server is there, "
                             "choose another port") from None


if __name__ == "__main__":
    sys.exit(main())
