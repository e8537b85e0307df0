"""`proctor check-config`: the resolved plan, or every problem found, printed.

Files the config names (model directories, token and TLS files) need not be on the checking
machine: a plan that is whole but names files missing here is printed as such, with what
`proctor serve` would refuse here, and exits 0."""

from __future__ import annotations

import sys
from pathlib import Path

from proctor.server.config.plan import load_plan
from proctor.server.config.schema import ConfigError


def check_config_command(path: str | Path, *, out=None) -> int:
    """`proctor check-config`: print the resolved plan (exit 0) or every problem (exit 1)."""
    out = out or sys.stdout
    try:
        plan = load_plan(path, files_must_exist=False)
    except ConfigError as exc:
        print_problems(path, exc, out=out)
        return 1
    if plan.missing_here:  # a plan that works, with files that are elsewhere: say what serving here would do
        print(f"{path}: OK as a plan; `proctor serve` on this machine would refuse it, {len(plan.missing_here)} "
              "file(s) it names are not here:", file=out)
        for missing in plan.missing_here:
            print(f"  - {missing}", file=out)
    else:
        print(f"{path}: OK", file=out)
    print(plan.summary(), file=out)
    return 0


def print_problems(path: str | Path, error: ConfigError, *, out=None) -> None:
    """A config file's problems, one per line under the file's name: what `check-config` prints,
    and what `proctor serve --config` prints (to stderr) before it exits 1, with no traceback."""
    out = out or sys.stdout
    print(f"{path}: {len(error.problems)} problem(s):", file=out)
    for problem in error.problems:
        print(f"  - {problem}", file=out)
