"""Server configuration: verl's `distillation:` block as-is, plus proctor's `server:` block.

A user's verl (or verl-omni) YAML is the source of truth for the teachers, so it is read
as verl reads it: same field names, same defaults (those of verl's
`trainer/config/distillation/distillation.yaml`, which is what a verl run gets), Hydra
`+key` overrides written into the YAML (the `+` is stripped, dotted keys are expanded), and
`${oc.select:...}` interpolations resolved against the same document. What verl leaves
implicit becomes an explicit message here: unknown keys are reported (with the nearest known
name), the default `teacher_model` entry that verl silently drops when other teachers are
added is an error that says what to rename, and the pool sizes are checked by
`proctor.server.worker.pool` with the numbers and the teacher to change.

Every problem is collected before anything is reported, so `proctor check-config` lists
them all at once rather than one per run.

Layout: `schema` (the blocks), `reading` (Hydra/verl normalisation, unknown keys, YAML),
`plan` (the resolved serving plan), `builder` (Router and runtime settings from a plan),
`check` (the `check-config` printout).
"""

from proctor.server.config.builder import (
    build_router,
    load_server_config,
    server_options,
    single_teacher_router,
)
from proctor.server.config.check import check_config_command, print_problems
from proctor.server.config.plan import ServingPlan, load_config, load_plan, resolve_plan
from proctor.server.config.reading import parse_config, read_yaml
from proctor.server.config.schema import ConfigError, ProctorConfig

__all__ = [
    "ConfigError",
    "ProctorConfig",
    "ServingPlan",
    "build_router",
    "check_config_command",
    "load_config",
    "load_plan",
    "load_server_config",
    "parse_config",
    "print_problems",
    "read_yaml",
    "resolve_plan",
    "server_options",
    "single_teacher_router",
]
