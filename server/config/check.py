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
        print(f"{path}: {len(exc.problems)} problem(s):", file=out)
        for problem in exc.problems:
            print(f"  - {problem}", file=out)
        return 1
    print(f"{path}: OK", file=out)
    print(plan.summary(), file=out)
    return 0
