"""CPU-seconds of serving processes, for benchmarks that report load-independent figures."""

from __future__ import annotations

import psutil


def process_cpu(proc: psutil.Process) -> float:
    """User + system CPU-seconds of one process (0 once it is gone)."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def descendants_cpu(proc: psutil.Process) -> float:
    """CPU-seconds of a process's live descendants (replica workers, vLLM's EngineCore and workers)."""
    return sum(process_cpu(child) for child in proc.children(recursive=True))


def tree_cpu(pid: int) -> float:
    """CPU-seconds of a serving tree: the process `pid` and its live descendants."""
    root = psutil.Process(pid)
    return process_cpu(root) + descendants_cpu(root)
