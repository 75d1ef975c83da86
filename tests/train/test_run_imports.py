"""A run imports what it runs: the dry run and the planner's printing, launch files and search load only
when --dry-run asks for them (train/run.print_dry_run), each checked in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

# the dry run, and the planner modules only it reaches: its report, the files it names, the plan search
DRY_RUN_MODULES = ("finetune.train.dry_run", "finetune.plan.report", "finetune.plan.files", "finetune.plan.cluster",
                   "finetune.plan.choose", "finetune.plan.refusals", "finetune.plan.speed", "finetune.plan.speed_range",
                   "finetune.plan.traffic")


def loaded_after(statement: str) -> set[str]:
    """finetune's modules loaded in a fresh Python after `statement`."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps([m for m in sys.modules if m.startswith('finetune')]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_a_run_leaves_the_dry_runs_planner_modules_unloaded():
    assert loaded_after("import finetune.train.run") & set(DRY_RUN_MODULES) == set()
    # the list names what the dry run really loads, so the first check cannot pass on stale names
    assert set(DRY_RUN_MODULES) <= loaded_after("import finetune.train.run, finetune.train.dry_run")


# what only some runs use: the fit check (a GPU run's, with the planner's memory model), --fp8's
# float8 linears, --attention varlen's kernel
ON_REQUEST_MODULES = ("finetune.train.fit_check", "finetune.plan.memory", "finetune.plan.workload",
                      "finetune.train.fp8", "finetune.train.packed_attention")


def test_a_cpu_run_loads_neither_the_fit_check_nor_the_switches_it_was_not_given():
    assert loaded_after("import finetune.train.run") & set(ON_REQUEST_MODULES) == set()
    assert set(ON_REQUEST_MODULES) <= loaded_after(
        "import finetune.train.run, finetune.train.fit_check, finetune.train.fp8, finetune.train.packed_attention")
