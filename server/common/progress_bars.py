"""No progress bars where the output is a log: transformers' weight-loading bars (in this process
and, through the environment, in the replica workers it starts afterwards) would write their
redraws between a command's lines. On a terminal they stay. `proctor serve`, `quickstart` and
`demo` call it before anything loads a model."""

from __future__ import annotations

import os
import sys


def quiet_bars_in_logs() -> None:
    """Turn transformers' and the Hub's progress bars off when stderr is not a terminal."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by transformers at import
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # the trainer side's install may have no transformers: nothing draws bars then
        return
    transformers_logging.disable_progress_bar()
