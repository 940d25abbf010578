"""Elastic rejoin on torch tensors: the state a replica copies, and who copies whose.

:meth:`odc.Engine.admit` (the member ranks, at the boundary where a round
admitted nodes) and :meth:`odc.Engine.rejoin` (the restarted node's ranks)
build the next generation of an elastic job with these helpers: its first
member nodes, the source of each joining rank (the same local rank on a
member node, the joining nodes spread over the members), and the state as
one flat byte buffer with its layout, which the joiner checks against its
own before it takes any of it.

The state that is not tensors (an optimizer's ``param_groups`` numbers, a
``GradScaler``'s and an LR scheduler's ``state_dict()``) travels beside it
as one JSON document (:func:`scalar_state`, :func:`encode`): every float
as Python writes it (``repr``, which reads back to the same bits), tuples,
dicts and tensors tagged so that they come back as they left. The joiner
compares it with its own before it takes any of it (:func:`load_scalar_state`):
numbers are copied, anything else must already be equal, and a difference
is refused naming where it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, MalformedError

if TYPE_CHECKING:
    import torch


#: The longest the registration of a generation that admits a node waits for a rank by default, in seconds.
REGISTER_WINDOW_S = 60.0


def register_window(timeout: float, explicit: float | None) -> float:
    """How long a new generation's registration waits for its ranks: ``explicit``, else the engine's timeout
    up to :data:`REGISTER_WINDOW_S` (a rank that died meanwhile must not hold the members longer)."""
    return float(explicit) if explicit is not None else min(float(timeout), REGISTER_WINDOW_S)


def source_node(joining: Sequence[int], old: Sequence[int], node: int) -> int:
    """The member node whose replica joining ``node`` copies: joiners spread round robin over ``old``."""
    return sorted(old)[sorted(joining).index(node) % len(old)]


def readers(rank: int, local_world: int, joining: Sequence[int], old: Sequence[int]) -> list[int]:
    """The joining ranks that copy ``rank``'s replica state (same local rank, node by :func:`source_node`)."""
    node, local = divmod(rank, local_world)
    return [j * local_world + local for j in sorted(joining) if source_node(joining, old, j) == node]


def layout(state: Sequence[torch.Tensor]) -> list[list[Any]]:
    """``[dtype, shape]`` of each state tensor, in order (what source and joiner compare)."""
    return [[str(t.dtype), list(t.shape)] for t in state]


def check_state(state: Sequence[torch.Tensor], what: str) -> None:
    """Every state tensor lives in host memory and is contiguous (the copy is of its bytes)."""
    for i, t in enumerate(state):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ConfigError(
                f"{what}: state[{i}] ({t.dtype}, {tuple(t.shape)}) on {t.device}"
                f"{'' if t.is_contiguous() else ', not contiguous'}: the replica state is copied as the "
                "bytes of contiguous host tensors"
            )


def pack(state: Sequence[torch.Tensor]) -> torch.Tensor:
    """The state's bytes, one after another, as one flat uint8 tensor."""
    import torch

    parts = [t.detach().reshape(-1).view(torch.uint8) for t in state]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def unpack(flat: torch.Tensor, state: Sequence[torch.Tensor]) -> None:
    """Copies ``flat``'s bytes into the state tensors, in order (laid out as :func:`pack` made it)."""
    import torch

    at = 0
    with torch.no_grad():
        for t in state:
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(flat[at : at + n])
            at += n


def compare_layouts(mine: list[list[Any]], raw: bytes, source: int) -> None:
    """Checks the layout rank ``source`` wrote (``raw``, :func:`layout`'s list as JSON) against this rank's.

    Raises:
        MalformedError: ``raw`` is not a layout :func:`layout` writes: not UTF-8 JSON, not a list of
            ``[dtype, shape]`` pairs, a dtype that is not a torch dtype's name, a shape that is not a list of
            at most 64 integers in ``[0, 2**63)``; the message names rank ``source`` and the field
            (``layout``, ``state[3]``, ``state[3].dtype``, ``state[3].shape[1]``).
        ConfigError: a well-formed layout that differs from this rank's, naming the first state tensor
            whose dtype or shape differs (or both counts).
    """
    import reprlib

    def bad(field: str, value: Any, expected: str) -> MalformedError:
        return MalformedError(
            f"rank {source} wrote a malformed rejoin state layout: {field} is {reprlib.repr(value)}, "
            f"expected {expected}"
        )

    if not isinstance(raw, (bytes, bytearray)):
        raise bad("layout", raw, "the bytes of a JSON list")
    try:
        theirs = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: JSONDecodeError, or an integer over Python's digit limit.
        raise bad("layout", bytes(raw[:80]), f"UTF-8 JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(theirs, list):
        raise bad("layout", theirs, "a list of [dtype, shape] pairs")
    for i, entry in enumerate(theirs):
        if not isinstance(entry, list) or len(entry) != 2:
            raise bad(f"state[{i}]", entry, "a [dtype, shape] pair")
        dtype, shape = entry
        name = dtype[6:] if isinstance(dtype, str) and dtype.startswith("torch.") else ""
        if not (name.isascii() and name.isidentifier() and len(name) <= 32):
            raise bad(f"state[{i}].dtype", dtype, 'a torch dtype\'s name ("torch.float32")')
        if not isinstance(shape, list) or len(shape) > 64:
            raise bad(f"state[{i}].shape", shape, "a list of at most 64 sizes")
        for j, size in enumerate(shape):
            if type(size) is not int or not 0 <= size < 2**63:
                raise bad(f"state[{i}].shape[{j}]", size, "an integer in [0, 2**63)")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            raise ConfigError(
                f"rejoin: state[{i}] is {a[0]} {tuple(a[1])} here but {b[0]} {tuple(b[1])} on rank {source}, "
                "whose replica this rank copies: pass the same tensors in the same order (the parameter "
                "shards, then the optimizer state) on both sides"
            )
    if len(mine) != len(theirs):
        raise ConfigError(
            f"rejoin: {len(mine)} state tensors here, {len(theirs)} on rank {source}, whose replica this rank "
            "copies: pass the same tensors in the same order on both sides"
        )


def name_first_difference(mine: list[list[Any]], raw: bytes, names: Sequence[str]) -> str:
    """What the first state tensor whose layout differs from the source's is (``names[i]``: a parameter, a
    buffer, an optimizer's state of one), for a note on :func:`compare_layouts`' error; empty where the
    source's layout cannot be read or no name applies."""
    try:
        theirs = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return ""
    if not isinstance(theirs, list):
        return ""
    for i, a in enumerate(mine):
        if i >= len(theirs) or a != theirs[i]:
            return f"state[{i}] is {names[i]}" if i < len(names) else ""
    return ""


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON data that :func:`decode` turns back into the same value, bit for bit.

    ``None``, bools, ints, floats (as ``repr`` writes them, NaN and the
    infinities included) and strings stand for themselves, lists are lists;
    a tuple is ``{"tuple": [...]}``, a dict ``{"dict": [[key, value], ...]}``
    (any keys, in order) and a tensor ``{"tensor": [dtype, shape, hex bytes]}``
    (moved to the host), so every JSON object is a tag.

    Raises:
        ConfigError: naming ``where`` and the type, for a value that cannot be copied to another process
            this way (a function, a module, an object of another kind).
    """
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, f"{where} (a key)"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        return {"tensor": [str(t.dtype).removeprefix("torch."), list(value.shape),
                           t.view(torch.uint8).numpy().tobytes().hex() if t.numel() else ""]}
    shown = repr(value)
    raise ConfigError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__} "
        f"({shown[:80]}{'...' if len(shown) > 80 else ''}), which elastic rejoin cannot copy to a joining node: "
        "it copies None, bools, numbers, strings, lists, tuples, dicts and tensors"
    )


def decode(data: Any, where: str) -> Any:
    """The value :func:`encode` made ``data`` of.

    Raises:
        MalformedError: ``data`` is not something :func:`encode` writes (naming ``where``).
    """
    import torch

    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(body))
        if tag == "dict" and isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body):
            out = {}
            for k, v in body:
                key = decode(k, f"{where} (a key)")
                try:
                    out[key] = decode(v, f"{where}[{key!r}]")
                except TypeError:  # an unhashable key
                    raise MalformedError(f"rejoin: {where}: the key {key!r} cannot be a dict key") from None
            return out
        if tag == "tensor" and isinstance(body, list) and len(body) == 3:
            name, shape, hexed = body
            dtype = getattr(torch, name, None) if isinstance(name, str) else None
            if (not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not isinstance(hexed, str)
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
                raise MalformedError(f"rejoin: {where}: {str(body)[:120]} is not a tensor's [dtype, shape, bytes]")
            try:
                raw = bytes.fromhex(hexed)
            except ValueError:
                raise MalformedError(f"rejoin: {where}: the tensor's bytes are not hexadecimal") from None
            numel = math.prod(shape)
            size = torch.empty((), dtype=dtype).element_size()
            if len(raw) != numel * size:
                raise MalformedError(
                    f"rejoin: {where}: {len(raw)} bytes for a {name} tensor of shape {tuple(shape)} "
                    f"({numel * size} bytes)"
                )
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    shown = repr(data)
    raise MalformedError(f"rejoin: {where}: {shown[:120]} is not a value a member's encode writes")


def _kind(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def scalar_state(optimizers: Sequence[Any], scaler: Any, schedulers: Sequence[Any]) -> dict[str, Any]:
    """A replica's state that is not a tensor of it, as JSON data (:func:`encode`): each optimizer's
    ``param_groups`` entries but ``params`` and the per-parameter state that is not a tensor (``[parameter
    index, key, value]``), ``scaler.state_dict()`` and each scheduler's ``state_dict()``, with their classes.

    Raises:
        ConfigError: naming the value that cannot be copied.
    """
    import torch

    opts = []
    for i, opt in enumerate(optimizers):
        groups = [
            {str(k): encode(v, f"optimizer {i}'s param_groups[{g}][{k!r}]") for k, v in sorted(group.items())
             if k != "params"}
            for g, group in enumerate(opt.param_groups)
        ]
        params = [p for group in opt.param_groups for p in group["params"]]
        loose = [[j, str(key), encode(value, f"optimizer {i}'s state {key!r} of its parameter {j}")]
                 for j, p in enumerate(params) for key, value in sorted(opt.state.get(p, {}).items())
                 if not isinstance(value, torch.Tensor)]
        opts.append({"param_groups": groups, "state": loose})
    return {
        "optimizers": opts,
        "scaler": None if scaler is None else {"type": _kind(scaler),
                                               "state": encode(scaler.state_dict(), "the scaler's state_dict()")},
        "schedulers": [{"type": _kind(s), "state": encode(s.state_dict(), f"scheduler {i}'s state_dict()")}
                       for i, s in enumerate(schedulers)],
    }


def _numeric(data: Any) -> bool:
    """Whether encoded ``data`` is a number (not a bool), a tensor, or a list or tuple of those."""
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return True
    if isinstance(data, list):
        return all(_numeric(v) for v in data)
    if isinstance(data, dict) and len(data) == 1:
        ((tag, body),) = data.items()
        return tag == "tensor" or (tag == "tuple" and isinstance(body, list) and all(_numeric(v) for v in body))
    return False


def _same_shape(a: Any, b: Any) -> bool:
    """Whether two numeric encodings hold numbers in the same places (tensors of the same dtype and shape)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        ((tag, x),) = a.items()
        y = b[tag]
        if tag == "tensor":
            return bool(x[:2] == y[:2])
        return _same_shape(x, y)
    return False


def _shown(data: Any, where: str) -> str:
    try:
        text = repr(decode(data, where))
    except MalformedError:
        text = repr(data)
    return text if len(text) <= 80 else text[:80] + "..."


def load_scalar_state(raw: bytes, optimizers: Sequence[Any], scaler: Any, schedulers: Sequence[Any],
                      source: int) -> None:
    """Takes rank ``source``'s :func:`scalar_state` (``raw``, its JSON) into this rank's ``optimizers``,
    ``scaler`` and ``schedulers``, once all of it was compared with this rank's own: every number of a
    ``param_groups`` entry (a tensor too) is copied, every other value must be equal already, the
    per-parameter state that is not a tensor is copied, and the scaler and each scheduler load the source's
    ``state_dict()`` (the same class, the same keys).

    Raises:
        ConfigError: naming the first difference that cannot be copied (another optimizer setting, a
            scheduler or scaler on one side only or of another class, a value the source could not encode).
        MalformedError: ``raw`` is not what :func:`scalar_state` writes.
    """
    import torch

    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedError(f"rejoin: rank {source}'s scalar state is not JSON ({e})") from None
    theirs_of = f"on rank {source}, whose replica this rank copies"
    if isinstance(doc, dict) and isinstance(doc.get("refused"), str):
        raise ConfigError(f"rejoin: rank {source}, whose replica this rank copies, cannot serve its state: "
                          f"{doc['refused']}")
    if not (isinstance(doc, dict) and isinstance(doc.get("optimizers"), list)
            and isinstance(doc.get("schedulers"), list) and "scaler" in doc):
        raise MalformedError(f"rejoin: rank {source}'s scalar state lacks its optimizers, scaler or schedulers")
    mine = scalar_state(optimizers, scaler, schedulers)
    todo: list[Any] = []  # what to set, once everything compared

    if len(doc["optimizers"]) != len(optimizers):
        raise ConfigError(f"rejoin: {len(optimizers)} optimizer(s) here, {len(doc['optimizers'])} {theirs_of}: "
                          "pass the optimizers the members passed to enable, in the same order")
    for i, (opt, ours, theirs) in enumerate(zip(optimizers, mine["optimizers"], doc["optimizers"], strict=True)):
        if not (isinstance(theirs, dict) and isinstance(theirs.get("param_groups"), list)
                and isinstance(theirs.get("state"), list)):
            raise MalformedError(f"rejoin: rank {source}'s optimizer {i} lacks its param_groups or state")
        if len(theirs["param_groups"]) != len(ours["param_groups"]):
            raise ConfigError(f"rejoin: optimizer {i} has {len(ours['param_groups'])} param_groups here, "
                              f"{len(theirs['param_groups'])} {theirs_of}")
        for g, (group, a, b) in enumerate(zip(opt.param_groups, ours["param_groups"], theirs["param_groups"],
                                              strict=True)):
            if not isinstance(b, dict):
                raise MalformedError(f"rejoin: rank {source}'s optimizer {i} param_groups[{g}] is not a dict")
            if a.keys() != b.keys():
                only = sorted(a.keys() ^ b.keys())[0]
                side = "here" if only in a else theirs_of
                raise ConfigError(
                    f"rejoin: optimizer {i}'s param_groups[{g}] has {only!r} {side} only: build the optimizer "
                    "(and a scheduler, which adds keys such as 'initial_lr') as the members did"
                )
            for key in a:
                where = f"optimizer {i}'s param_groups[{g}][{key!r}]"
                if _numeric(a[key]) and _numeric(b[key]) and _same_shape(a[key], b[key]):
                    todo.append((group, key, decode(b[key], where)))
                elif a[key] != b[key]:
                    raise ConfigError(
                        f"rejoin: {where} is {_shown(a[key], where)} here but {_shown(b[key], where)} {theirs_of}: "
                        "elastic rejoin copies numbers and refuses any other difference; build the optimizer with "
                        "the members' settings"
                    )
        params = [p for group in opt.param_groups for p in group["params"]]
        for entry in theirs["state"]:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                    and 0 <= entry[0] < len(params) and isinstance(entry[1], str)):
                raise MalformedError(f"rejoin: rank {source}'s optimizer {i} state entry {str(entry)[:80]}")
        keys = {(j, key) for j, key, _ in ours["state"]}
        their_keys = {(j, key) for j, key, _ in theirs["state"]}
        if keys != their_keys:
            j, key = sorted(keys ^ their_keys)[0]
            raise ConfigError(f"rejoin: optimizer {i}'s state {key!r} of its parameter {j} is a value other than "
                              f"a tensor {'here' if (j, key) in keys else theirs_of} only")
        for j, key, value in theirs["state"]:
            todo.append((opt.state[params[j]], key, decode(value, f"optimizer {i}'s state {key!r}")))

    def loader(obj: Any, ours: Any, theirs: Any, what: str) -> None:
        if ours is None or theirs is None:
            if ours is not theirs:
                raise ConfigError(f"rejoin: {what}: passed here but not {theirs_of}" if theirs is None else
                                  f"rejoin: {what}: passed {theirs_of}, not here: pass it to rejoin as the members "
                                  "passed it to enable")
            return
        if not isinstance(theirs, dict) or "type" not in theirs or "state" not in theirs:
            raise MalformedError(f"rejoin: rank {source}'s {what} lacks its type or state")
        if theirs["type"] != ours["type"]:
            raise ConfigError(f"rejoin: {what} is a {ours['type']} here but a {theirs['type']} {theirs_of}")
        state = decode(theirs["state"], f"{what}'s state_dict()")
        mine_keys = set(decode(ours["state"], what))
        if not isinstance(state, dict) or set(state) != mine_keys:
            raise ConfigError(f"rejoin: {what}'s state_dict() has the keys {sorted(mine_keys)} here but "
                              f"{sorted(state) if isinstance(state, dict) else state!r} {theirs_of}")
        todo.append((obj, None, state))

    loader(scaler, mine["scaler"], doc["scaler"], "the scaler")
    if len(doc["schedulers"]) != len(schedulers):
        raise ConfigError(f"rejoin: {len(schedulers)} scheduler(s) here, {len(doc['schedulers'])} {theirs_of}: "
                          "pass the schedulers the members passed to enable, in the same order")
    for i, (sched, ours, theirs) in enumerate(zip(schedulers, mine["schedulers"], doc["schedulers"], strict=True)):
        loader(sched, ours, theirs, f"scheduler {i}")

    with torch.no_grad():
        for target, key, value in todo:
            if key is None:
                target.load_state_dict(value)
            elif isinstance(value, torch.Tensor) and isinstance(target.get(key), torch.Tensor):
                target[key].copy_(value)
            else:
                target[key] = value
