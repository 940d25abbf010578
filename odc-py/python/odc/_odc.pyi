# Type stubs of the native module odc._odc (checked in; keep in step with odc-py/src).
from typing import Sequence

__version__: str

def plan_json(
    lengths: Sequence[int],
    world_size: int,
    minibatch_size: int,
    strategy: str,
    max_tokens: int,
    cost: str,
    seed: int,
) -> str: ...
def karmarkar_karp(weights: Sequence[float], k_partitions: int, equal_size: bool) -> list[list[int]]: ...
def sequence_cost(cost: str, length: int) -> float: ...
def synthetic(spec: str) -> list[int]: ...
def pack_cli(argv: Sequence[str]) -> int: ...
