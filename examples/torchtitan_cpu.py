"""torchtitan 0.3.0 on CPU for the tests and examples: shims, generated assets, a small debug-model config.

torchtitan targets GPUs; on a CPU-only machine with gloo its trainer runs
once :func:`install` has, before torchtitan is imported,

- made torch report ``"cpu"`` as the available device type (torchtitan picks
  its device, device module and process-group backend from it at import);
- replaced the device memory monitor (``torch.cpu`` keeps no memory
  statistics) with one that reports nothing;
- replaced FlexAttention (compiled with inductor) by sdpa with the block
  mask's dense mask, and the compiled block-mask builder by the eager one;
- made ``set_pg_timeouts`` use a plain barrier (gloo takes no device ids).

:func:`cpu_model_spec` makes FSDP reduce with SUM (gloo has no PREMUL_SUM;
torchtitan sets a gradient divide factor of 1.0, which FSDP turns into a
PREMUL_SUM), and :func:`write_assets` writes a word-level tokenizer and a
c4-shaped JSON dataset (torchtitan's wheel ships neither).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import types

import torch

WORDS = [f"w{i}" for i in range(400)]


def install() -> None:
    """The CPU shims. Call before the first ``import torchtitan``; idempotent."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention, decoder

    metrics.DeviceMemoryMonitor = _NoMemoryMonitor
    attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_flex)
    attention.create_attention_mask = create_block_mask
    if hasattr(decoder, "create_attention_mask"):
        decoder.create_attention_mask = create_block_mask
    dist_utils.set_pg_timeouts = _set_pg_timeouts


class _NoMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def __init__(self, *args, **kwargs):
        pass

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self):
        pass


def _sdpa_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's call, computed by sdpa with the block mask's dense mask (document-causal)."""
    from torch.nn.attention.flex_attention import create_mask

    b, _, lq, _ = q.shape
    mask = create_mask(block_mask.mask_mod, b, 1, lq, k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None)


def _set_pg_timeouts(timeout, parallel_dims):
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        torch.distributed.set_timeout(timeout, group)


def cpu_model_spec(spec):
    """The model spec with FSDP's reduce-scatters as SUM (torchtitan's divide factor 1.0 keeps the sum)."""
    parallelize = spec.parallelize_fn

    def parallelize_for_gloo(model, **kw):
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(model, **kw)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    return dataclasses.replace(spec, parallelize_fn=parallelize_for_gloo)


def write_assets(root: str, documents: int = 400, seed: int = 0) -> tuple[str, str]:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and a c4-shaped dataset.

    Returns ``(hf_assets_path, dataset_path)``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    assets = os.path.join(root, "tokenizer")
    data = os.path.join(root, "c4_test")
    os.makedirs(assets, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(assets, "tokenizer.json"))
    with open(os.path.join(assets, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, f)
    rng = random.Random(seed)
    with open(os.path.join(data, "c4_sample.json"), "w") as f:
        for _ in range(documents):
            n = int(min(400, rng.lognormvariate(3.5, 0.8))) + 2
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")
    return assets, data


def debug_config(assets: str, dataset: str, *, seq_len: int = 128, local_batch_size: int = 2, steps: int = 2,
                 layers: int = 2, lr: float = 8e-4, dump: str = "/tmp/titan", spmd_backend: str = "spmd_types"):
    """torchtitan's llama3 debug-model config: ``layers`` blocks, ``seq_len``, fp32, no AC, compile or checkpoints.

    Seeded (``debug.seed=0``), so that runs in separate processes start from the same weights.
    ``spmd_backend="partial_dtensor"`` shards over the 1-D ``fsdp`` mesh; torchtitan's default
    (``spmd_types``) keeps global mesh state that a second trainer in one process trips over.
    """
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:layers]
    config.model_spec = cpu_model_spec(config.model_spec)
    config.hf_assets_path = assets
    config.dataloader.dataset_path = dataset
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.steps = steps
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.validator.enable = False
    config.optimizer.implementation = "foreach"
    config.parallelism.spmd_backend = spmd_backend
    config.debug.seed = 0
    config.dump_folder = dump
    for group in config.optimizer.param_groups:
        group.optimizer_kwargs["lr"] = lr
    return config
