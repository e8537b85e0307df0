"""Placement: split the teacher device pool among teachers and give every replica its devices.

The pool is `n_gpus_per_node × nnodes` devices, as in verl's distillation resource pool. A
teacher replica needs `TP × DP × PP` devices; a teacher needs `num_replicas` of them. The
plan is computed once, before anything loads, so that a configuration that cannot work is
refused with numbers and the name of the teacher to change, instead of failing on the
cluster an hour later.

Rules (verl's, plus what verl leaves implicit):

- one teacher without `num_replicas` fills the pool; several teachers must sum exactly to it;
  teachers without `num_replicas` among several share what the others leave;
- a replica never straddles a node unless it needs more devices than a node has; then it
  takes whole nodes;
- when the pool holds fewer replica slots than there are teachers (of one architecture)
  asking for automatic sizing, those teachers *share* the slots: each slot is a replica
  group that keeps one teacher's weights on its devices and the others' in CPU memory,
  swapping them in on demand (see `proctor.server.engines.swap`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# The environment variable that restricts a process to its devices, by device kind.
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


class PlacementError(ValueError):
    """The teachers do not fit the pool; `problems` says, for each, what to change."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def _count(n: int, noun: str) -> str:
    """`1 device`, `2 devices`: what a person reads in a summary."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class TeacherDemand:
    """What one teacher asks of the pool."""

    name: str
    per_replica: int  # TP × DP × PP
    num_replicas: int | None  # None (or verl's 0): size it automatically
    architecture: str | None = None  # None: unknown, never shared

    def __post_init__(self) -> None:
        if self.per_replica < 1:
            raise ValueError(f"teacher {self.name!r}: a replica needs at least one device")


@dataclass(frozen=True)
class NodeSlice:
    """The devices a replica holds on one node (node-local device ids)."""

    node: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaGroupPlan:
    """One set of devices running one engine: a replica of one teacher, or a shared group."""

    group_id: str
    teachers: tuple[str, ...]  # more than one: weights are swapped between them
    slices: tuple[NodeSlice, ...]

    @property
    def shared(self) -> bool:
        return len(self.teachers) > 1

    @property
    def size(self) -> int:
        return sum(len(s.devices) for s in self.slices)

    @property
    def node(self) -> int:
        """The node the engine's process lives on (the first of a multi-node replica)."""
        return self.slices[0].node

    @property
    def local_devices(self) -> tuple[int, ...]:
        """Device ids on the engine's own node."""
        return self.slices[0].devices

    def visible_devices(self, kind: str) -> dict[str, str]:
        """`{CUDA_VISIBLE_DEVICES: "2,3"}` (or the Ascend name) for the engine's process."""
        name = VISIBLE_DEVICES_ENV.get(kind)
        if name is None:
            return {}
        return {name: ",".join(str(d) for d in self.local_devices)}

    def describe(self, kind: str) -> str:
        where = ", ".join(f"node {s.node} [{','.join(map(str, s.devices))}]" for s in self.slices)
        env = " ".join(f"{k}={v}" for k, v in self.visible_devices(kind).items())
        who = " + ".join(self.teachers)
        return f"{self.group_id}: {who} on {where}" + (f" ({env})" if env else "")


@dataclass
class PlacementPlan:
    """Every replica group with its devices, and which groups serve which teacher."""

    n_gpus_per_node: int
    nnodes: int
    device_kind: str
    groups: list[ReplicaGroupPlan] = field(default_factory=list)

    @property
    def pool_size(self) -> int:
        return self.n_gpus_per_node * self.nnodes

    def groups_of(self, teacher: str) -> list[ReplicaGroupPlan]:
        return [g for g in self.groups if teacher in g.teachers]

    def teachers(self) -> list[str]:
        seen: dict[str, None] = {}
        for group in self.groups:
            for name in group.teachers:
                seen.setdefault(name)
        return list(seen)

    def summary(self) -> str:
        """What `proctor check-config` prints: the pool, each teacher, each replica's devices."""
        lines = [f"pool: {_count(self.nnodes, 'node')} × {_count(self.n_gpus_per_node, self.device_kind + ' device')} "
                 f"= {self.pool_size}"]
        for name in self.teachers():
            groups = self.groups_of(name)
            shared = [g for g in groups if g.shared]
            note = f", {_count(len(shared), 'slot')} shared by weight swapping" if shared else ""
            lines.append(f"teacher {name}: {_count(len(groups), 'replica')} of {_count(groups[0].size, 'device')} each{note}")
        lines.extend(f"  {g.describe(self.device_kind)}" for g in self.groups)
        return "\n".join(lines)


def plan_placement(
    demands: Sequence[TeacherDemand], *, n_gpus_per_node: int, nnodes: int, device_kind: str = "cuda"
) -> PlacementPlan:
    """Size every teacher, then place its replicas on nodes; raise PlacementError with all problems."""
    problems: list[str] = []
    if n_gpus_per_node < 1:
        problems.append(f"distillation.n_gpus_per_node is {n_gpus_per_node}: it must be at least 1")
    if nnodes < 1:
        problems.append(
            f"distillation.nnodes is {nnodes}: set it to the number of teacher nodes "
            "(the pool is n_gpus_per_node × nnodes devices)"
        )
    if not demands:
        problems.append("distillation.teacher_models is empty: configure at least one teacher")
    if problems:
        raise PlacementError(problems)
    sizes = _size_teachers(demands, n_gpus_per_node * nnodes)
    plan = PlacementPlan(n_gpus_per_node=n_gpus_per_node, nnodes=nnodes, device_kind=device_kind)
    plan.groups = _place(sizes, n_gpus_per_node, nnodes)
    return plan


@dataclass(frozen=True)
class _GroupDemand:
    teachers: tuple[str, ...]
    per_replica: int
    count: int


def _size_teachers(demands: Sequence[TeacherDemand], pool: int) -> list[_GroupDemand]:
    """How many replica groups of what size each teacher (or sharing set of teachers) gets."""
    fixed = [d for d in demands if d.num_replicas]
    auto = [d for d in demands if not d.num_replicas]
    used = sum(d.num_replicas * d.per_replica for d in fixed)
    sizing = ", ".join(f"{d.name}: {d.num_replicas} × {d.per_replica}" for d in fixed)
    if not auto:
        if used != pool:
            raise PlacementError([_mismatch(demands, used, pool, sizing)])
        return [_GroupDemand((d.name,), d.per_replica, d.num_replicas) for d in fixed]

    left = pool - used
    groups = [_GroupDemand((d.name,), d.per_replica, d.num_replicas) for d in fixed]
    if left <= 0:
        raise PlacementError(
            [
                f"teachers with num_replicas use {used} device(s) ({sizing}) of a pool of {pool}, "
                f"leaving none for {', '.join(d.name for d in auto)}: lower their num_replicas, "
                "grow the pool (distillation.n_gpus_per_node × nnodes) or give every teacher num_replicas"
            ]
        )
    if len(auto) == 1:
        return [*groups, _fill_with_one(auto[0], left)]
    return groups + _split_among(auto, left)


def _fill_with_one(d: TeacherDemand, left: int) -> _GroupDemand:
    """The one teacher without num_replicas takes every device left, in whole replicas."""
    if left % d.per_replica:
        raise PlacementError(
            [
                f"teacher {d.name!r} fills the {left} remaining device(s) automatically, but its replicas need "
                f"{d.per_replica} device(s) each (TP × DP × PP) and {d.per_replica} does not divide {left}: "
                f"change its tensor/data/pipeline parallel sizes or set num_replicas on the teachers"
            ]
        )
    return _GroupDemand((d.name,), d.per_replica, left // d.per_replica)


def _split_among(auto: Sequence[TeacherDemand], left: int) -> list[_GroupDemand]:
    """Several teachers without num_replicas share the devices left: as many replica slots as
    fit, split as evenly as possible, or shared by weight swapping when there are fewer slots
    than teachers. Their replicas must be of one size: with several, no split is the obvious one."""
    per_replica = {d.per_replica for d in auto}
    if len(per_replica) > 1:
        raise PlacementError(
            [
                "several teachers without num_replicas need different replica sizes ("
                + ", ".join(f"{d.name}: {d.per_replica}" for d in auto)
                + "): set num_replicas on each of them so that the sum is "
                f"{left} device(s)"
            ]
        )
    (size,) = per_replica
    if left % size:
        raise PlacementError(
            [
                f"{left} device(s) left for {', '.join(d.name for d in auto)}, not a multiple of their replica size "
                f"{size} (TP × DP × PP): set num_replicas on the teachers or change the pool"
            ]
        )
    slots = left // size
    if slots >= len(auto):
        # Enough slots: split them as evenly as possible, earlier teachers take the remainder.
        base, extra = divmod(slots, len(auto))
        return [_GroupDemand((d.name,), size, base + (1 if i < extra else 0)) for i, d in enumerate(auto)]
    return [_shared_slots(auto, slots, size)]


def _shared_slots(auto: Sequence[TeacherDemand], slots: int, size: int) -> _GroupDemand:
    """Fewer slots than teachers: they share the slots and swap weights, if their weights fit
    one another (one known architecture); otherwise say why they cannot."""
    architectures = {d.architecture for d in auto}
    if None in architectures or len(architectures) > 1:
        unknown = [d.name for d in auto if d.architecture is None]
        why = (
            f"the architecture of {', '.join(unknown)} cannot be read (no config.json at its model_path yet)"
            if unknown
            else "their architectures differ ("
            + ", ".join(f"{d.name}: {d.architecture}" for d in auto)
            + ")"
        )
        each = "1 device" if size == 1 else f"{size} devices"
        replicas = "1 replica" if slots == 1 else f"{slots} replicas"
        raise PlacementError(
            [
                f"{len(auto)} teachers ({', '.join(d.name for d in auto)}) but room for only {replicas} "
                f"({each} each): the teachers can take turns on them, swapping weights, only when all "
                f"have one architecture, and {why}; fix that, or grow the pool "
                "(n_gpus_per_node × nnodes), or give each teacher num_replicas"
            ]
        )
    return _GroupDemand(tuple(d.name for d in auto), size, slots)


def _mismatch(demands: Sequence[TeacherDemand], used: int, pool: int, sizing: str) -> str:
    """The verl sum rule's message, plus which teacher to change and by how much."""
    diff = pool - used
    advice = []
    for d in demands:
        target = d.num_replicas + diff // d.per_replica if diff % d.per_replica == 0 else None
        if target is not None and target >= 1:
            advice.append(f"teacher_models.{d.name}.num_replicas={target}")
    fix = f"set {' or '.join(advice)}" if advice else "change num_replicas of the teachers"
    verb = "exceeds" if used > pool else "leaves devices idle in"
    return (
        f"teachers need {used} device(s) (num_replicas × TP × DP × PP: {sizing}), which {verb} the pool of "
        f"{pool} (n_gpus_per_node × nnodes): {fix}, or make the pool {used} devices"
    )


def _place(groups: list[_GroupDemand], per_node: int, nnodes: int) -> list[ReplicaGroupPlan]:
    """First-fit-decreasing on nodes: big replicas first, whole nodes for multi-node replicas."""
    free = [list(range(per_node)) for _ in range(nnodes)]
    problems: list[str] = []
    slices_of: dict[tuple[int, int], tuple[NodeSlice, ...]] = {}
    order = sorted(
        ((gi, ri) for gi, g in enumerate(groups) for ri in range(g.count)),
        key=lambda k: -groups[k[0]].per_replica,
    )
    for gi, ri in order:
        group = groups[gi]
        size = group.per_replica
        label = " + ".join(group.teachers)
        if size > per_node:
            if size % per_node:
                problems.append(
                    f"teacher {label}: a replica needs {size} devices (TP × DP × PP), more than a node's "
                    f"{per_node} and not a whole number of nodes: make TP × DP × PP a multiple of "
                    f"n_gpus_per_node ({per_node}) or at most {per_node}"
                )
                break
            whole = [n for n in range(nnodes) if len(free[n]) == per_node][: size // per_node]
            if len(whole) < size // per_node:
                problems.append(f"teacher {label}: no {size // per_node} whole free node(s) left for replica {ri}")
                break
            slices_of[(gi, ri)] = tuple(NodeSlice(n, tuple(free[n])) for n in whole)
            for n in whole:
                free[n] = []
            continue
        node = next((n for n in range(nnodes) if len(free[n]) >= size), None)
        if node is None:
            left = ", ".join(f"node {n}: {len(f)}" for n, f in enumerate(free) if f)
            problems.append(
                f"teacher {label}: replica {ri} needs {size} devices on one node but only fragments are left "
                f"({left}); a replica may not straddle nodes: make n_gpus_per_node ({per_node}) a multiple "
                f"of every replica size (TP × DP × PP), or change the teachers' parallel sizes"
            )
            break
        slices_of[(gi, ri)] = (NodeSlice(node, tuple(free[node][:size])),)
        free[node] = free[node][size:]
    if problems:
        raise PlacementError(problems)
    plans = []
    for gi, group in enumerate(groups):
        for ri in range(group.count):
            prefix = "shared" if len(group.teachers) > 1 else group.teachers[0]
            plans.append(ReplicaGroupPlan(f"{prefix}-{ri}", group.teachers, slices_of[(gi, ri)]))
    return plans
