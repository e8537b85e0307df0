"""Placement: teachers sized against the pool, replicas on nodes with concrete device ids."""

from __future__ import annotations

import pytest

from proctor.server.worker.pool import PlacementError, TeacherDemand, plan_placement


def _devices(group) -> set[tuple[int, int]]:
    return {(s.node, d) for s in group.slices for d in s.devices}


def _assert_disjoint(plan) -> None:
    seen: set[tuple[int, int]] = set()
    for group in plan.groups:
        assert not (seen & _devices(group)), f"{group.group_id} reuses a device"
        seen |= _devices(group)
    assert len(seen) == plan.pool_size


def test_one_teacher_with_tp2_fills_16_devices_with_8_replicas():
    plan = plan_placement([TeacherDemand("t", per_replica=2, num_replicas=None)], n_gpus_per_node=16, nnodes=1)
    assert len(plan.groups) == 8
    assert [g.local_devices for g in plan.groups] == [(i, i + 1) for i in range(0, 16, 2)]
    assert plan.groups[3].visible_devices("cuda") == {"CUDA_VISIBLE_DEVICES": "6,7"}
    _assert_disjoint(plan)


def test_ascend_replicas_get_ascend_rt_visible_devices():
    plan = plan_placement([TeacherDemand("t", 4, None)], n_gpus_per_node=16, nnodes=1, device_kind="npu")
    assert plan.groups[1].visible_devices("npu") == {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert plan.groups[0].visible_devices("cpu") == {}


def test_two_teachers_of_8_devices_each_split_two_nodes_without_straddling():
    plan = plan_placement(
        [TeacherDemand("math", 2, 4), TeacherDemand("code", 2, 4)], n_gpus_per_node=8, nnodes=2
    )
    assert [len(plan.groups_of(n)) for n in ("math", "code")] == [4, 4]
    assert all(len(g.slices) == 1 and g.size == 2 for g in plan.groups)
    _assert_disjoint(plan)


def test_teachers_that_do_not_sum_to_the_pool_are_refused_with_the_numbers_and_the_fix():
    with pytest.raises(PlacementError) as err:
        plan_placement([TeacherDemand("math", 2, 4), TeacherDemand("code", 2, 2)], n_gpus_per_node=16, nnodes=1)
    message = str(err.value)
    assert "12 device(s)" in message and "pool of 16" in message
    assert "math: 4 × 2" in message and "code: 2 × 2" in message
    assert "teacher_models.math.num_replicas=6" in message and "teacher_models.code.num_replicas=4" in message


def test_oversubscribed_pool_is_refused():
    with pytest.raises(PlacementError, match="exceeds the pool of 8"):
        plan_placement([TeacherDemand("a", 2, 4), TeacherDemand("b", 2, 1)], n_gpus_per_node=8, nnodes=1)


def test_replica_that_would_straddle_two_nodes_is_refused():
    # 6 devices per node, replicas of 4: two fit (one per node), the third would need 2 + 2 across nodes.
    with pytest.raises(PlacementError, match="may not straddle nodes"):
        plan_placement([TeacherDemand("t", 4, 3)], n_gpus_per_node=6, nnodes=2)


def test_replica_bigger_than_a_node_takes_whole_nodes():
    plan = plan_placement([TeacherDemand("big", 16, 1), TeacherDemand("small", 2, 4)], n_gpus_per_node=8, nnodes=3)
    (big,) = plan.groups_of("big")
    assert [(s.node, len(s.devices)) for s in big.slices] == [(0, 8), (1, 8)]
    assert {g.node for g in plan.groups_of("small")} == {2}
    _assert_disjoint(plan)


def test_replica_bigger_than_a_node_but_not_whole_nodes_is_refused():
    with pytest.raises(PlacementError, match="not a whole number of nodes"):
        plan_placement([TeacherDemand("t", 12, 2)], n_gpus_per_node=8, nnodes=3)


def test_mixed_replica_sizes_pack_big_ones_first():
    plan = plan_placement([TeacherDemand("s", 2, 2), TeacherDemand("l", 4, 3)], n_gpus_per_node=8, nnodes=2)
    assert all(len(g.slices) == 1 for g in plan.groups)
    _assert_disjoint(plan)


def test_teacher_without_num_replicas_takes_what_the_others_leave():
    plan = plan_placement([TeacherDemand("fixed", 2, 2), TeacherDemand("rest", 2, None)], n_gpus_per_node=8, nnodes=1)
    assert len(plan.groups_of("rest")) == 2


def test_single_teacher_whose_replica_size_does_not_divide_the_pool_is_refused():
    with pytest.raises(PlacementError, match="3 does not divide 8"):
        plan_placement([TeacherDemand("t", 3, None)], n_gpus_per_node=8, nnodes=1)


def test_more_teachers_than_slots_of_one_architecture_share_groups_with_swapping():
    demands = [TeacherDemand(n, 1, None, architecture="qwen2[2/64/512]") for n in ("a", "b", "c")]
    plan = plan_placement(demands, n_gpus_per_node=2, nnodes=1)
    assert len(plan.groups) == 2
    assert all(g.shared and g.teachers == ("a", "b", "c") for g in plan.groups)
    assert [len(plan.groups_of(n)) for n in "abc"] == [2, 2, 2]
    assert "2 slots shared by weight swapping" in plan.summary()


def test_enough_slots_split_auto_teachers_without_sharing():
    demands = [TeacherDemand(n, 1, None, architecture="x") for n in ("a", "b", "c")]
    plan = plan_placement(demands, n_gpus_per_node=4, nnodes=1)
    assert [len(plan.groups_of(n)) for n in "abc"] == [2, 1, 1]
    assert not any(g.shared for g in plan.groups)


def test_teachers_of_different_architectures_cannot_share_a_group():
    demands = [TeacherDemand("a", 1, None, architecture="x"), TeacherDemand("b", 1, None, architecture="y")]
    with pytest.raises(PlacementError, match="architectures differ"):
        plan_placement(demands, n_gpus_per_node=1, nnodes=1)


def test_every_pool_problem_is_reported_at_once():
    with pytest.raises(PlacementError) as err:
        plan_placement([TeacherDemand("t", 1, None)], n_gpus_per_node=0, nnodes=0)
    assert len(err.value.problems) == 2
    assert "n_gpus_per_node" in err.value.problems[0] and "nnodes" in err.value.problems[1]
