"""`proctor check-config`: the resolved plan, or every problem found, printed.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from proctor.server.config.plan import load_plan
from proctor.server.config.schema import ConfigError

if typing.TYPE_CHECKING:
    pass



def check_config_command(path: str | Path, *, out=None) -> int:
    """`proctor check-config`: print the resolved plan (exit 0) or every problem (exit 1)."""
    out = out or sys.stdout
    try:
        plan = load_plan(path, files_must_exist=False)
    except ConfigError as exc:
        print_problems(path, exc, out=out)
        return 1
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
