"""verl's own ``rearrange_micro_batches`` with the data-parallel sync (its all-reduces over the default gloo group),
on this rank's share of each case: what odc-bench's verl-maxcount (odc.bench.baselines.verl_split) is checked
against. Runs in the verl worker's group (tests/_verl_worker.py), on verl's pins."""

from __future__ import annotations

import random


def split_cases(seed: int, count: int, world: int = 2) -> list[tuple[list[list[int]], int]]:
    """Random per-rank lengths (the same count on every rank, as verl's balance hands them out) and budgets, tight
    enough that the ranks' balanced splits often overflow the budget at the largest count."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        budget = rng.choice([64, 100, 256])
        n = rng.randint(1, 12)
        out.append(([[rng.randint(1, budget) for _ in range(n)] for _ in range(world)], budget))
    return out


def synced_split(rank: int, cases) -> list[list[list[int]]]:
    """This rank's microbatches (positions in its lengths) per case ``(lengths per rank, max_token_len)``, from
    verl's function synced over the default process group."""
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    out = []
    for per_rank, max_token_len in cases:
        lengths = per_rank[rank]
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        for i, s in enumerate(lengths):
            mask[i, :s] = 1
        batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lengths)])
        _, idx = rearrange_micro_batches(batch, max_token_len, dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
        out.append([[int(i) for i in p] for p in idx])
    return out
