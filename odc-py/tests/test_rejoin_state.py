"""What a rejoining node copies beside the tensors of a replica, in one process: every number of an optimizer's
``param_groups`` (its other settings compared), a GradScaler's and an LR scheduler's ``state_dict()``, bit for
bit through their JSON (``odc._rejoin``), and the refusals, each naming what differs or cannot be copied."""

from __future__ import annotations

import json
import math

import pytest
import torch

import odc
from odc import _rejoin
from odc.fsdp._private import Replica

pytestmark = pytest.mark.torch_versions  # torch's optimizers', schedulers' and GradScaler's state formats


def _loop(seed: int, steps: int, lr: float = 1e-2):
    """A model, AdamW, OneCycleLR and a CPU GradScaler after ``steps`` steps of a loop (the scaler's scale and
    the scheduler's learning rate and beta1 move every step or two)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for s in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(s))
        scaler.scale(model(x).square().sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, scaler


def test_encode_then_decode_gives_the_same_bits():
    values = [None, True, 0, -(2**70), -0.0, 5e-324, 1 / 3, math.inf, -math.inf, "lr", [1, (2.5, "a")],
              {1: "a", "b": (1,), (2, 3): None}]
    for v in values:
        back = _rejoin.decode(json.loads(json.dumps(_rejoin.encode(v, "v"))), "v")
        assert repr(back) == repr(v) and type(back) is type(v), (v, back)
    nan = _rejoin.decode(json.loads(json.dumps(_rejoin.encode(math.nan, "v"))), "v")
    assert math.isnan(nan)
    for t in (torch.tensor([1.5, math.nan, -0.0], dtype=torch.bfloat16), torch.tensor(7), torch.empty(0, 3),
              torch.tensor([True, False])):
        back = _rejoin.decode(json.loads(json.dumps(_rejoin.encode(t, "t"))), "t")
        assert back.dtype == t.dtype and back.shape == t.shape
        assert back.reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()


def test_encode_refuses_by_name_what_it_cannot_copy():
    with pytest.raises(odc.ConfigError, match=r"scheduler 0's state_dict\(\)\['f'\] is a builtins.function"):
        _rejoin.encode({"f": lambda s: s}, "scheduler 0's state_dict()")


@pytest.mark.parametrize("bad", [{"x": 1}, {"tensor": ["nope", [1], "00"]}, {"tensor": ["float32", [2], "00"]},
                                 {"tensor": ["float32", [-1], ""]}, {"dict": [[[1], 2]]}, {"tuple": 3}])
def test_decode_refuses_what_encode_does_not_write(bad):
    with pytest.raises(odc.MalformedError):
        _rejoin.decode(bad, "w")


def test_a_joiner_takes_every_number_and_the_scaler_and_scheduler_bit_for_bit():
    model, opt, sched, scaler = _loop(0, 5)
    mine = _loop(1, 0)  # a fresh loop, as a restarted node builds it
    assert mine[1].param_groups[0]["lr"] != opt.param_groups[0]["lr"]
    assert mine[3].state_dict() != scaler.state_dict()
    raw = Replica(model, [opt], scaler, [sched]).scalars()
    Replica(mine[0], [mine[1]], mine[3], [mine[2]]).load(raw, source=3)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in mine[1].param_groups] == strip
    assert mine[1].param_groups[0]["betas"] == opt.param_groups[0]["betas"]  # a tuple, moved by OneCycleLR
    assert mine[3].state_dict() == scaler.state_dict()
    assert mine[2].state_dict() == sched.state_dict()
    # And they go on alike: the same next learning rate and the same scale after the same steps.
    for s in range(3):
        for m, o, sh, sc in ((model, opt, sched, scaler), mine):
            o.zero_grad()
            sc.scale(sum(p.sum() for p in m.parameters())).backward()
            sc.step(o)
            sc.update()
            sh.step()
        assert mine[1].param_groups[0]["lr"] == opt.param_groups[0]["lr"], s
        assert mine[3].state_dict() == scaler.state_dict(), s


def test_a_tensor_learning_rate_is_copied_into_the_joiners_tensor():
    p = torch.nn.Parameter(torch.zeros(2))
    src = torch.optim.SGD([p], lr=torch.tensor(0.25))
    src.param_groups[0]["lr"].fill_(1 / 3)
    q = torch.nn.Parameter(torch.zeros(2))
    dst = torch.optim.SGD([q], lr=torch.tensor(0.5))
    held = dst.param_groups[0]["lr"]
    Replica(torch.nn.Module(), [dst]).load(Replica(torch.nn.Module(), [src]).scalars(), source=0)
    assert dst.param_groups[0]["lr"] is held and held.item() == torch.tensor(1 / 3).item()


def test_settings_that_are_not_numbers_must_already_be_equal():
    model, opt, sched, scaler = _loop(0, 1)
    raw = Replica(model, [opt], scaler, [sched]).scalars()
    m2, o2, s2, sc2 = _loop(1, 0)
    o2.param_groups[0]["amsgrad"] = True
    before = o2.param_groups[0]["lr"]
    with pytest.raises(odc.ConfigError, match=r"optimizer 0's param_groups\[0\]\['amsgrad'\] is True here but False "
                                              r"on rank 4"):
        Replica(m2, [o2], sc2, [s2]).load(raw, source=4)
    assert o2.param_groups[0]["lr"] == before  # nothing taken before everything compared


@pytest.mark.parametrize("case", ["no scaler here", "no scheduler here", "another scheduler", "an extra group key",
                                  "two optimizers"])
def test_what_the_members_passed_must_be_passed_alike(case):
    model, opt, sched, scaler = _loop(0, 1)
    raw = Replica(model, [opt], scaler, [sched]).scalars()
    m2, o2, s2, sc2 = _loop(1, 0)
    args, match = {
        "no scaler here": (([o2], None, [s2]), "the scaler: passed on rank 2"),
        "no scheduler here": (([o2], sc2, []), r"0 scheduler\(s\) here, 1 on rank 2"),
        "another scheduler": (([o2], sc2, [torch.optim.lr_scheduler.StepLR(o2, 1)]),
                              "scheduler 0 is a torch.optim.lr_scheduler.StepLR here but a "
                              "torch.optim.lr_scheduler.OneCycleLR on rank 2"),
        "an extra group key": (([o2], sc2, [s2]), r"param_groups\[0\] has 'tag' here only"),
        "two optimizers": (([o2, torch.optim.SGD(m2.parameters(), lr=1.0)], sc2, [s2]),
                           r"2 optimizer\(s\) here, 1 on rank 2"),
    }[case]
    if case == "an extra group key":
        o2.param_groups[0]["tag"] = "mine"
    with pytest.raises(odc.ConfigError, match=match):
        Replica(m2, *args).load(raw, source=2)


def test_what_cannot_be_copied_is_refused_at_the_check_and_served_as_a_refusal():
    model, opt, sched, scaler = _loop(0, 1)
    opt.param_groups[0]["hook"] = object()
    rep = Replica(model, [opt], scaler, [sched])
    with pytest.raises(odc.ConfigError, match=r"odc.fsdp.enable: optimizer 0's param_groups\[0\]\['hook'\] is a "
                                              r"builtins.object"):
        rep.check("odc.fsdp.enable")
    with pytest.warns(RuntimeWarning, match="cannot copy this replica"):
        raw = rep.scalars()
    m2, o2, s2, sc2 = _loop(1, 0)
    with pytest.raises(odc.ConfigError, match=r"rank 1, whose replica this rank copies, cannot serve its state: "
                                              r"optimizer 0's param_groups\[0\]\['hook'\]"):
        Replica(m2, [o2], sc2, [s2]).load(raw, source=1)


def test_a_buffer_that_is_not_a_contiguous_host_tensor_is_refused_by_name():
    model = torch.nn.Module()
    model.register_buffer("table", torch.zeros(3, 4).t())
    with pytest.raises(odc.ConfigError, match=r"odc.fsdp.rejoin: buffer table \(torch.float32, \(4, 3\)\) is not "
                                              "contiguous"):
        Replica(model, [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)]).check("odc.fsdp.rejoin")


@pytest.mark.parametrize("raw", [b"\xff", b"[1]", b'{"optimizers": []}', b'{"optimizers": [1], "scaler": null, '
                                 b'"schedulers": []}'])
def test_malformed_scalar_state_is_a_malformed_error(raw):
    m2, o2, s2, sc2 = _loop(1, 0)
    with pytest.raises(odc.MalformedError):
        Replica(m2, [o2], sc2, [s2]).load(raw, source=5)
