"""`finetune plan [QUERY] [flags]`: what fits, how fast, what it costs, and how to launch it.

The terminal's side: the plans printed (table, JSON, chart), their files written, `--simulate`.
The flags are cli/plan_flags.py's; `--serve` and `--html` hand the same flags to the web page's
backend (cli/plan_page.py). Imports no torch, transformers or accelerate unless --simulate asks
for a simulated step.
"""

from __future__ import annotations

import argparse
import json
import shlex

from finetune.cli.plan_flags import build_parser, build_request, model_dir, note
from finetune.cli.plan_page import page_answer, write_html
from finetune.errors import FinetuneError
from finetune.library_logs import quiet_libraries
from finetune.plan import report
from finetune.plan.choose import Request, plan
from finetune.plan.files import DEFAULT_CONFIG_DIR, write_configs


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        from finetune.plan import serve  # http.server: imported only when asked for

        return serve.run(args.host, args.port, page_answer, " ".join(args.query))
    request = build_request(args)
    if isinstance(request, list):
        return _what_fits(request, args, argv)
    plans, recommended = plan(request)
    config_dir = args.write_config or DEFAULT_CONFIG_DIR
    print(json.dumps(report.to_json(request, plans, recommended, config_dir), indent=2) if args.json
          else report.table(request, plans, recommended, config_dir))
    try:
        if args.png:
            note(f"wrote {report.draw_png(request, plans, recommended, args.png)}")
        if args.write_config:
            if recommended is None:
                raise FinetuneError("No plan fits, so there is no config to write.")
            for path in write_configs(plans[recommended], args.write_config):
                note(f"wrote {path}")
        write_html(args, argv)
    except OSError as e:
        raise FinetuneError(f"Cannot write {e.filename or args.write_config or args.png}: {e.strerror or e}.") from e
    if recommended is not None and not args.write_config:
        note(files_hint(argv, config_dir))
    if args.simulate:
        if not args.verbose:
            quiet_libraries()
        note(simulation_text(plans, recommended))
    return 0


def files_hint(argv: list[str], config_dir: str) -> str:
    """The launch command reads files this run of `plan` did not write; the command that writes them."""
    command = shlex.join(["finetune", "plan", *argv, "--write-config", config_dir])
    return f"The launch command reads {config_dir}/; write its files first with: {command}"


def simulation_text(plans: list, recommended: int | None) -> str:
    """Two fake-tensor steps of the recommended (else closest) plan's launch command, built as the
    trainer builds it; when --simulate cannot run that plan, of the best-ranked plan it can, saying so."""
    import tempfile

    from finetune.plan.choose import describe
    from finetune.train import simulate
    from finetune.train.dry_run import run_of_plan  # imports torch

    asked = plans[recommended if recommended is not None else 0]
    reason = simulate.cannot_simulate(asked.workload)
    chosen = asked if reason is None else next((p for p in plans if simulate.cannot_simulate(p.workload) is None), None)
    which = "recommended" if recommended is not None else "closest"
    heading = "" if reason is None else f"--simulate checks {simulate.CHECKS}; the {which} plan is {reason}."
    if chosen is None:
        return f"{heading} None of these plans is one it checks: nothing simulated."
    if heading:
        heading += f" Simulating the best plan it checks instead: {describe(chosen.workload)}.\n"
    with tempfile.TemporaryDirectory(prefix="finetune-simulate-") as workdir:
        write_configs(chosen, workdir)
        run = run_of_plan(chosen, workdir, workdir)
        return heading + simulate.compare_text(run, chosen.workload)


def _what_fits(requests: list[Request], args: argparse.Namespace, argv: list[str]) -> int:
    """No model named: the best plan of every catalog model on these GPUs. --write-config writes one
    folder per model that fits, --png one chart with each model's recommended plan."""
    if args.simulate:
        raise FinetuneError("--simulate needs one model: add --model NAME.")
    results = [(request, *plan(request)) for request in requests]
    print(json.dumps([report.to_json(r, p, i, model_dir(args.write_config, r)) for r, p, i in results], indent=2)
          if args.json else report.what_fits_table(results))
    if args.png:
        note(f"wrote {report.draw_what_fits_png(results, args.png)}")
    write_html(args, argv)
    if not args.write_config and any(recommended is not None for _, _, recommended in results):
        note(files_hint(argv, DEFAULT_CONFIG_DIR))
    if args.write_config:
        for request, plans, recommended in results:
            if recommended is not None:
                for path in write_configs(plans[recommended], model_dir(args.write_config, request)):
                    note(f"wrote {path}")
    return 0
