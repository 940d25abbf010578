"""The ``odc`` backend behind torch's dispatcher: what torch's tools see of an odc group's collectives is what
they see of a gloo group's (``CommDebugMode``'s counts, the names in a ``torch.profiler`` trace), for every
collective the backend implements, on every torch leg; and the group's ODC operations ran on ODC."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _dist import run_ranks
from torch.distributed.tensor.debug import CommDebugMode

import odc
import odc.backend
from odc.backend._engines import per_node

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

TIMEOUT = datetime.timedelta(seconds=60)


def _calls(rank, world):
    """(name, call(group) -> what it computed, the ODC operation it must run or None) for every collective
    of torch.distributed's API that reaches a backend, ODC's and gloo's alike."""
    n = 6
    x = torch.arange(n, dtype=torch.float32) + 10 * rank

    def ag(g):
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, x, group=g)
        return out

    def ag_list(g):
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, x, group=g)
        return outs

    def ag_coalesced(g):
        outs = [torch.empty(world * n), torch.empty(world * 2)]
        with dist._coalescing_manager(group=g):
            dist.all_gather_into_tensor(outs[0], x, group=g)
            dist.all_gather_into_tensor(outs[1], x[:2].clone(), group=g)
        return outs

    def rs(g, op=dist.ReduceOp.SUM):
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, torch.cat([x + r for r in range(world)]), op=op, group=g)
        return out

    def rs_list(g):
        out = torch.empty(n)
        dist.reduce_scatter(out, [x + r for r in range(world)], group=g)
        return out

    def rs_coalesced(g):
        outs = [torch.empty(n), torch.empty(2)]
        with dist._coalescing_manager(group=g):
            dist.reduce_scatter_tensor(outs[0], torch.cat([x] * world), group=g)
            dist.reduce_scatter_tensor(outs[1], torch.cat([x[:2]] * world), group=g)
        return outs

    def ar(g, op=dist.ReduceOp.SUM):
        t = x.clone()
        dist.all_reduce(t, op=op, group=g)
        return t

    def ar_coalesced(g):
        ts = [x.clone(), x[:3].clone()]
        with dist._coalescing_manager(group=g):
            for t in ts:
                dist.all_reduce(t, group=g)
        return ts

    def bcast(g):
        t = x.clone()
        dist.broadcast(t, src=dist.get_global_rank(g, world - 1), group=g)
        return t

    def reduce(g):
        t = x.clone()
        dist.reduce(t, dst=dist.get_global_rank(g, 0), group=g)
        return t if rank == 0 else None

    def gather(g):
        outs = [torch.empty(n) for _ in range(world)] if rank == 0 else None
        dist.gather(x, outs, dst=dist.get_global_rank(g, 0), group=g)
        return outs

    def scatter(g):
        out = torch.empty(n)
        dist.scatter(out, [x + r for r in range(world)] if rank == 0 else None, src=dist.get_global_rank(g, 0),
                     group=g)
        return out

    def a2a(g):
        outs = [torch.empty(2) for _ in range(world)]
        dist.all_to_all(outs, [x[:2] + r for r in range(world)], group=g)
        return outs

    def a2a_single(g):
        out = torch.empty(world * 2)
        dist.all_to_all_single(out, torch.cat([x[:2] + r for r in range(world)]), group=g)
        return out

    def p2p(g):
        t = x.clone()
        peer = dist.get_global_rank(g, 1 - rank)
        if rank == 0:
            dist.send(t, dst=peer, group=g)
        else:
            dist.recv(t, src=peer, group=g)
        return t

    def barrier(g):
        dist.barrier(group=g)

    def fc_ag(g):
        return funcol.all_gather_tensor(x, 0, g).wait()

    def fc_rs(g):
        return funcol.reduce_scatter_tensor(torch.cat([x] * world), "sum", 0, g).wait()

    def fc_ar(g):
        return funcol.all_reduce(x, "sum", g).wait()

    return [
        ("all_gather_into_tensor", ag, "all_gather_single"),
        ("all_gather", ag_list, "allgather"),
        ("all_gather_into_tensor coalesced", ag_coalesced, "all_gather_single"),
        ("reduce_scatter_tensor", rs, "reduce_scatter_single"),
        ("reduce_scatter_tensor AVG", lambda g: rs(g, dist.ReduceOp.AVG), "reduce_scatter_single"),
        ("reduce_scatter", rs_list, "reduce_scatter"),
        ("reduce_scatter_tensor coalesced", rs_coalesced, "reduce_scatter_single_coalesced"),
        ("all_reduce", ar, "allreduce"),
        ("all_reduce MAX", lambda g: ar(g, dist.ReduceOp.MAX), None),
        ("all_reduce coalesced", ar_coalesced, "allreduce"),
        ("broadcast", bcast, None),
        ("reduce", reduce, None),
        ("gather", gather, None),
        ("scatter", scatter, None),
        ("all_to_all", a2a, None),
        ("all_to_all_single", a2a_single, None),
        ("send / recv", p2p, None),
        ("barrier", barrier, None),
        ("functional all_gather_tensor", fc_ag, "all_gather_single"),
        ("functional reduce_scatter_tensor", fc_rs, "reduce_scatter_single_coalesced"),
        ("functional all_reduce", fc_ar, "allreduce"),
    ]


def _seen(call, group):
    """What CommDebugMode counts and which collective names a profiler trace holds for ``call(group)``; None
    where the group's backend refuses the call (gloo on torch 2.11 has no list-form all-to-all)."""
    with CommDebugMode() as mode:
        try:
            result = call(group)
        except RuntimeError as e:
            if "does not support" not in str(e):
                raise
            return None
    counts = {str(op): n for op, n in mode.get_comm_counts().items() if n}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(group)
    names = sorted({e.key for e in prof.key_averages() if e.key.startswith(("c10d::", "_c10d_functional::"))})
    return counts, names, result


def _tools(rank, world, store):
    odc.register()
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    gloo = dist.new_group(backend="gloo")
    backend = odc.backend.get_process_group()
    rows = []
    for name, call, odc_op in _calls(rank, world):
        before = backend.op_counts[f"odc:{odc_op}"]
        odc_counts, odc_names, odc_result = _seen(call, dist.group.WORLD)
        ran_on_odc = backend.op_counts[f"odc:{odc_op}"] - before if odc_op else None
        on_gloo = _seen(call, gloo)
        if on_gloo is None:  # only the odc group's counts and names, against the expected ones
            rows.append((name, odc_counts, None, odc_names, None, ran_on_odc, True))
            continue
        gloo_counts, gloo_names, gloo_result = on_gloo
        same = _equal(odc_result, gloo_result)
        rows.append((name, odc_counts, gloo_counts, odc_names, gloo_names, ran_on_odc, same))
    dist.destroy_process_group()
    return rows


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


#: What CommDebugMode counts for some of the calls (gloo's counts, so the comparison can see an operation that
#: is missing on both sides, or counted twice).
_EXPECTED = {
    "all_gather_into_tensor": {"c10d._allgather_base_": 1},
    "reduce_scatter_tensor": {"c10d._reduce_scatter_base_": 1},
    "all_reduce": {"c10d.allreduce_": 1},
    "all_gather_into_tensor coalesced": {"c10d.allgather_into_tensor_coalesced_": 1},
    "all_to_all": {"c10d.alltoall_": 1},
    "functional all_gather_tensor": {"c10d_functional.all_gather_into_tensor": 1},
}


def test_torch_tools_see_the_same_collectives_on_odc_as_on_gloo():
    for rank, (status, rows) in run_ranks(_tools, 2, timeout=180).items():
        assert status == "ok", (rank, rows)
        for name, odc_counts, gloo_counts, odc_names, gloo_names, ran_on_odc, same in rows:
            if gloo_counts is None:  # gloo refuses it on this torch: the expected counts, and some name
                assert odc_counts == _EXPECTED[name] and odc_names, (name, odc_counts, odc_names)
                continue
            assert odc_counts == gloo_counts, (name, odc_counts, gloo_counts)
            assert odc_names == gloo_names and odc_names, (name, odc_names, gloo_names)
            assert same, (name, "odc and gloo computed different results")
            if name in _EXPECTED:
                assert odc_counts == _EXPECTED[name], (name, odc_counts)
            if ran_on_odc is not None:
                assert ran_on_odc >= 2, (name, "ran on gloo, not ODC (twice: counted and traced)")


def test_per_node_reads_torchruns_placement_from_global_ranks():
    assert per_node((0, 1, 2, 3, 4, 5, 6, 7), "4") == 4
    assert per_node((0, 2, 4, 6), "4") == 2  # one dp group of a 2 x 2 x 2 mesh: 2 nodes of 2
    assert per_node((0, 4), "4") == 1  # dp_replicate: one rank on each node
    assert per_node((0, 1), "4") == 2  # inside a node
    assert per_node((0, 1, 4), "4") is None  # 2 on one node, 1 on the other: not for this topology
    assert per_node((4, 0), "4") is None  # not node-major
    assert per_node((0, 1), None) is None and per_node((0, 1), "x") is None


def _c10d_kernel_at_backend_select() -> bool:
    """Whether a kernel sits at ``BackendSelect`` for ``c10d::allreduce_`` (odc's route; torch has none there)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")


def _route_lifetime(rank, world, store):
    from odc.backend import _route

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    seen = {"before": _c10d_kernel_at_backend_select()}
    for i in range(2):  # made, used, destroyed; then again (registered anew)
        groups = [dist.new_group(backend="odc"), dist.new_group(backend="odc")]
        t = torch.ones(4)
        dist.all_reduce(t, group=groups[0])
        seen[f"two alive {i}"] = (_c10d_kernel_at_backend_select(), _route.installed(), t.tolist())
        dist.destroy_process_group(groups[0])
        seen[f"one alive {i}"] = _c10d_kernel_at_backend_select()
        dist.all_reduce(t, group=groups[1])
        dist.destroy_process_group(groups[1])
        del groups
        seen[f"none alive {i}"] = (_c10d_kernel_at_backend_select(), _route.installed())
    t = torch.ones(4)
    dist.all_reduce(t)  # gloo's own kernels again
    seen["gloo"] = t.tolist()
    return seen


def test_the_route_kernels_go_with_the_last_odc_group():
    """Before, torch 2.11's route kernels stayed registered for good once the first ``odc`` group was made: every
    later gloo or NCCL collective of the process took a Python call on the way (torch 2.15 has Python backends
    and never registers them)."""
    from odc._c10d import python_backends

    routed = not python_backends()
    for rank, (status, seen) in run_ranks(_route_lifetime, 2, timeout=180).items():
        assert status == "ok", (rank, seen)
        assert seen["before"] is False, seen
        for i in range(2):
            assert seen[f"two alive {i}"] == (routed, routed, [2.0] * 4), seen
            assert seen[f"one alive {i}"] is routed, seen  # another odc group still lives
            assert seen[f"none alive {i}"] == (False, False), seen
        assert seen["gloo"] == [2.0] * 4, seen
