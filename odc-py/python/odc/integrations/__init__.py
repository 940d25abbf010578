"""ODC inside the trainers people run.

Each integration is imported on demand (its trainer is an optional
dependency: ``pip install 'fsdp-odc[hf]'``, ``'fsdp-odc[verl]'`` or
``'fsdp-odc[torchtitan]'``):

- :mod:`odc.integrations.transformers`: ``enable(trainer)`` before
  ``trainer.train()``; a Hugging Face ``Trainer`` or TRL ``SFTTrainer`` under
  accelerate's FSDP2 trains on ODC, each optimizer step's samples planned
  with LB-Mini over the global batch, each rank its own microbatch count.

- :mod:`odc.integrations.verl`: ``enable()`` before verl builds its engines;
  the actor's and critic's FSDP2 modules run on ODC, each rank keeps its own
  microbatch count, and each minibatch is balanced across ranks with LB-Mini.
  :mod:`odc.integrations.verl_auto` calls it when imported, for verl's
  ``external_lib`` / ``VERL_USE_EXTERNAL_MODULES`` hooks.
- :mod:`odc.integrations.torchtitan`: a ``Trainer`` subclass that puts the
  model on ODC at its first step (after weights, optimizers and any
  checkpoint are in place) and, given an LB-Mini plan over documents, runs
  each rank's own microbatch count per step.

What moves a minibatch's samples between ranks lives in
:mod:`odc.integrations._exchange` (no trainer imported there); the Hugging
Face integration's step loader in :mod:`odc.integrations._hf_data`.
"""

from __future__ import annotations

__all__: list[str] = []
