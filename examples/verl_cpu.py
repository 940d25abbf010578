"""verl on CPU for the tests and examples: a "cpu" platform, engines built through verl's registry, PPO batches.

verl 0.9.1 runs its FSDP2 engine on CPU once a platform plug-in says the
device is ``"cpu"`` (``current_device()`` the string ``"cpu"``, backend gloo)
and its engine classes are registered for that device (verl registers them
for ``cuda`` and ``npu``). Models are tiny random Qwen2 checkpoints written
to a directory (nothing downloaded), trained with sdpa attention, padded
inputs (``use_remove_padding=False``), no torch.compile and fp32 throughout.

A PPO minibatch is built as verl's trainer hands it to the actor and the
critic: prompts left-padded and responses right-padded to the batch's widths,
then ``left_right_2_no_padding`` (nested ``input_ids`` / ``position_ids``),
with ``old_log_probs``, ``advantages``, ``values`` and ``returns`` per response
token. Critics load with sdpa instead of verl's flash-attention 2.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

VOCAB = 128
PROMPT = 4  # prompt tokens of every sample; a sample of n tokens has an n - PROMPT token response


def install_cpu_platform() -> None:
    """Registers and selects verl's "cpu" platform and registers verl's FSDP engines for it. Idempotent."""
    os.environ["VERL_PLATFORM"] = "cpu"
    warnings.filterwarnings("ignore", message=".*engine is not available.*")
    from torch.distributed.fsdp import _init_utils
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    # verl builds FSDP1 (strategy="fsdp") with sync_module_states=True, which FSDP1 refuses for CPU parameters
    # (NCCL cannot broadcast them); gloo broadcasts CPU tensors, so on this CPU platform that check is lifted.
    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    # verl's checkpoints save and restore the device RNG through the device module.
    if not hasattr(torch.cpu, "set_rng_state"):
        torch.cpu.get_rng_state, torch.cpu.set_rng_state = torch.get_rng_state, torch.set_rng_state
    if PlatformRegistry.get("cpu") is None:

        class PlatformCPU(PlatformBase):
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = torch.cpu  # verl compares against torch.cpu to skip memory statistics

            def is_available(self):
                return True

            def current_device(self):
                return "cpu"  # verl moves tensors with .to(get_device_id())

            def device_count(self):
                return 1

            def set_device(self, device_index):
                pass

            def synchronize(self, device_index=None):
                pass

            def manual_seed(self, seed):
                torch.manual_seed(seed)

            def manual_seed_all(self, seed):
                torch.manual_seed(seed)

            def set_allocator_settings(self, settings):
                pass

            def empty_cache(self):
                pass

            def get_device_capability(self, device_index=0):
                return None, None

            def communication_backend_name(self):
                return "gloo"

            def visible_devices_envvar(self):
                return "CUDA_VISIBLE_DEVICES"

            @contextlib.contextmanager
            def nvtx_range(self, msg):
                yield

            def profiler_start(self):
                pass

            def profiler_stop(self):
                pass

            def ray_resource_name(self):
                return "CPU"

            def ray_noset_envvars(self):
                return []

            def is_ipc_supported(self):
                return False

            def cudart(self):
                return None

        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    # Forward-only engines (the reference model) offload to pinned host memory, which needs a GPU driver.
    policy = impl.CPUOffloadPolicy
    if not isinstance(policy, functools.partial):
        impl.CPUOffloadPolicy = functools.partial(_unpinned, policy)
    # verl's FSDP1 weight export first moves the flat parameters to f"{device}:{id}" ("cpu:cpu" on this platform,
    # not a device torch parses); on CPU they are there already.
    impl.load_fsdp_model_to_gpu = _already_on_cpu
    # verl loads a critic with flash-attention 2; sdpa on CPU.
    import verl.utils.model as vmodel

    vmodel.load_valuehead_model = _value_model_sdpa
    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            EngineRegistry._engines[model_type][backend].setdefault("cpu", cls)


def _already_on_cpu(module):
    """verl's ``load_fsdp_model_to_gpu`` on the CPU platform: the parameters are on the device already."""


def _unpinned(policy, **kw):
    return policy(**{**kw, "pin_memory": False})


def _value_model_sdpa(local_path, torch_dtype, model_config, trust_remote_code):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(local_path, torch_dtype=torch_dtype, config=model_config,
                                                           attn_implementation="sdpa",
                                                           trust_remote_code=trust_remote_code)


def write_model(path: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB) -> str:
    """A tiny random Qwen2ForCausalLM checkpoint (tied embeddings, grouped-query attention) in ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=8192, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def configs(model_dir: str, max_tokens: int, *, forward_only: bool = False, lr: float = 1e-2, clip: float = 1.0,
            model_type: str = "language_model", external_lib: str | None = None, remove_padding: bool = False,
            **engine_kw):
    """verl's model, engine, optimizer, checkpoint and actor configs for a CPU fp32 FSDP2 engine.

    ``external_lib`` is the model config's hook verl imports before it builds
    the engine (``odc.integrations.verl_auto`` puts the engine on ODC);
    ``remove_padding`` packs a microbatch's samples into one row
    (``use_remove_padding``) attended per sample by :func:`use_varlen_attention`'s
    sdpa (what flash-attention's varlen kernel computes on GPUs), instead of
    padding every sample to the microbatch's longest; ``engine_kw`` override
    ``FSDPEngineConfig`` fields.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    attn = use_varlen_attention() if remove_padding else "sdpa"
    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=remove_padding,
                          enable_gradient_checkpointing=False, override_config={"attn_implementation": attn},
                          model_type=model_type, external_lib=external_lib)
    engine = FSDPEngineConfig(**{
        "strategy": "fsdp2", "use_torch_compile": False, "forward_only": forward_only,
        "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        "use_dynamic_bsz": True, "max_token_len_per_gpu": max_tokens, **engine_kw})
    optim = FSDPOptimizerConfig(lr=lr, clip_grad=clip, total_training_steps=100, weight_decay=0.0)
    actor = FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=max_tokens,
                            ppo_mini_batch_size=1)
    return model, engine, optim, CheckpointConfig(), actor


def use_varlen_attention() -> str:
    """Registers examples/hf_sft.py's per-sample causal sdpa with transformers; returns its name."""
    import importlib.util

    from transformers import AttentionInterface

    spec = importlib.util.spec_from_file_location("hf_sft", os.path.join(os.path.dirname(__file__), "hf_sft.py"))
    hf_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_sft)
    AttentionInterface.register(hf_sft.VARLEN, hf_sft.varlen_attention)
    return hf_sft.VARLEN


def build_engine(model_dir: str, max_tokens: int, **kw):
    """An initialized engine from verl's registry (``EngineRegistry.new``), as verl's TrainingWorker makes it.

    Seeded, so that a critic's value head (not in the checkpoint) starts the same in every engine built.
    """
    from verl.workers.engine import EngineRegistry

    torch.manual_seed(0)
    model, engine, optim, ckpt, _ = configs(model_dir, max_tokens, **kw)
    eng = EngineRegistry.new(model_type=model.model_type, backend=engine.strategy, model_config=model,
                             engine_config=engine, optimizer_config=optim, checkpoint_config=ckpt)
    eng.initialize()
    return eng


def ppo_loss(model_dir: str, max_tokens: int):
    from verl.workers.utils.losses import ppo_loss as loss

    return functools.partial(loss, config=configs(model_dir, max_tokens)[4])


def value_loss(max_tokens: int):
    from verl.workers.config import CriticConfig
    from verl.workers.utils.losses import value_loss as loss

    return functools.partial(loss, config=CriticConfig(strategy="fsdp2", use_dynamic_bsz=True,
                                                      ppo_max_token_len_per_gpu=max_tokens))


def ppo_batch(lengths: list[int], *, seed: int, width: int, global_batch: int, max_tokens: int, nan: bool = False,
              remove_padding: bool = False):
    """One rank's PPO minibatch: samples of ``lengths`` tokens (prompt + response), responses padded to ``width``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    prompts = torch.randint(1, VOCAB, (n, PROMPT), generator=g)
    responses = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, PROMPT + width, dtype=torch.long)
    mask[:, :PROMPT] = 1
    for i, total in enumerate(lengths):
        r = total - PROMPT
        responses[i, :r] = torch.randint(1, VOCAB, (r,), generator=g)
        mask[i, PROMPT:PROMPT + r] = 1
    advantages = torch.randn(n, width, generator=g)
    if nan:
        advantages[0, 0] = float("nan")
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask[:, PROMPT:].clone(),
        "old_log_probs": -3.0 - torch.rand(n, width, generator=g), "advantages": advantages,
        "values": torch.randn(n, width, generator=g), "returns": torch.randn(n, width, generator=g),
    }, batch_size=n)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, global_batch_size=global_batch, use_remove_padding=remove_padding,
                         use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens, calculate_entropy=False)
    return td


@contextlib.contextmanager
def count_forwards(module):
    """Counts the root module's forwards (one per microbatch): yields a list whose length is the count."""
    calls: list[int] = []
    handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def full_params(module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (a collective); FSDP1's by their original names."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(module):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in module.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}
