"""FSDP2's own gradient accumulation (``set_requires_gradient_sync(False)`` with
``set_reshard_after_backward(False)`` on all but a rank's last microbatch) under odc.fsdp, uneven counts,
torch's clip: the same training as one process. scripts/soak.sh repeats it under load."""

from __future__ import annotations

import _accumulation as A
import _loops as L
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

pytest.importorskip("transformers")

# plan[s][r]: microbatches of rank r at step s (a rank with none at steps 1 and 2).
PLAN = [(2, 1, 3), (1, 3, 0), (0, 1, 2)]
CLIP = 0.3


def test_accumulation_with_uneven_counts_and_torch_clip_matches_one_process():
    out = all_ok(run_ranks(A.accumulation_worker, 3, timeout=600, plan=PLAN, clip=CLIP))
    want = out[0]["ref"]
    # The clip is active at every step: its coefficient is in the parameters.
    assert all(n > CLIP for n in want["norms"]), want["norms"]
    for rank, res in out.items():
        L.assert_close(res, want, 1e-5, 1e-4, f"rank {rank}")
