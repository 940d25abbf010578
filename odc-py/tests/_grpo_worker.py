"""Workers for test_integrations_grpo.py: TRL's ``GRPOTrainer`` on ODC, and the one-process reference it is held to.

Each rank builds the trainer as a user's script does (a tiny random Qwen2 from a config with a 16-token vocabulary,
so that sampled completions end at the EOS token after very different lengths; a word-level tokenizer made in
place; a reward that counts a completion's words; FSDP2 through the training arguments; CPU, gloo), calls
``odc.integrations.transformers.enable(trainer)`` and ``trainer.train()``. It records what each step generated
(TRL's ``_generate_and_score_completions`` output on this rank: prompts, completions, masks, advantages), how many
training forwards it ran per step (a forward pre-hook with gradients on, independent of the integration), the
Trainer's logs and, on rank 0, the full parameters.

:func:`reference` trains the same model in one process with plain torch on the recorded completions and
advantages of every rank: the per-token log-probabilities of each completion given its prompt, GRPO's clipped
surrogate (``-A · exp(logp - logp.detach())`` at the on-policy point), the loss type's normalization over the
whole step, SGD and the clip.
"""

from __future__ import annotations

import collections
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 16
SEED = 11
PROMPT = 4  # every prompt's tokens (no left padding: a padded row's positions would shift)
MAX_COMPLETION = 12
LR = 0.2
CLIP = 1.0
PER_DEVICE, ACCUM, GENERATIONS = 4, 2, 8
MAX_TOKENS = 24  # a microbatch's budget: one row of the longest completions, three of the shortest
SAPO_TEMPERATURES = (1.0, 1.05)  # GRPOConfig's defaults: positive advantages, the others
CISPO_EPS_MAX = 5.0  # epsilon_high for cispo, as TRL recommends (its default, epsilon, would scale by 0.2)


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model() -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def prompts() -> list[str]:
    g = torch.Generator().manual_seed(3)
    return [" ".join(f"t{int(t)}" for t in torch.randint(0, VOCAB - 2, (PROMPT,), generator=g)) for _ in range(16)]


def words(completions: list[str], **_: Any) -> list[float]:
    """The reward: a completion's word count (its length), so that every group's advantages differ."""
    return [float(len(c.split())) for c in completions]


def make_trainer(out_dir: str, steps: int, **extra: Any) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = {"output_dir": out_dir, "use_cpu": True, "report_to": [], "per_device_train_batch_size": PER_DEVICE,
            "gradient_accumulation_steps": ACCUM, "num_generations": GENERATIONS,
            "max_completion_length": MAX_COMPLETION, "max_steps": steps, "logging_steps": 1, "save_strategy": "no",
            "learning_rate": LR, "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0,
            "max_grad_norm": CLIP, "seed": SEED, "bf16": False, "temperature": 1.0, "disable_tqdm": True,
            "fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    args.update(extra)
    return GRPOTrainer(model=build_model(), reward_funcs=words, args=GRPOConfig(**args),
                       train_dataset=Dataset.from_dict({"prompt": prompts()}), processing_class=tokenizer())


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                      TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", OMP_NUM_THREADS="1")


def train(rank: int, out_dir: str, steps: int, loss_type: str) -> dict[str, Any]:
    """One GRPO run on ODC in this rank's process group; see the module doc for what it returns."""
    import _hf_worker

    import odc.fsdp
    import odc.integrations.transformers as odc_hf

    extra: dict[str, Any] = {"epsilon_high": CISPO_EPS_MAX} if loss_type == "cispo" else {}
    trainer = make_trainer(out_dir, steps, loss_type=loss_type, **extra)
    if loss_type == "sapo":
        assert (trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg) == SAPO_TEMPERATURES
    odc_hf.enable(trainer, max_tokens=MAX_TOKENS)
    rollouts: list[dict[str, Any]] = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs: Any) -> Any:
        out = generate(inputs)
        rollouts.append({k: out[k].detach().cpu().tolist() for k in
                         ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                          "num_items_in_batch")})
        return out

    trainer._generate_and_score_completions = recorded
    counts: collections.Counter = collections.Counter()

    def count(module: Any, _: Any) -> None:
        if module.training and torch.is_grad_enabled():
            counts[trainer.state.global_step] += 1

    trainer.model.register_forward_pre_hook(count)
    trainer.train()
    out: dict[str, Any] = {"logs": trainer.state.log_history, "counts": [counts[s] for s in range(steps)],
                           "rollouts": rollouts, "class": type(trainer).__name__,
                           "enabled": odc.fsdp.is_enabled(trainer.model)}
    params = _hf_worker.full_params(trainer.model)
    if rank == 0:
        out["params"] = params
    if out["enabled"]:
        odc.fsdp.disable(trainer.model)
    dist.barrier()
    return out


def refused(out_dir: str) -> dict[str, str]:
    """Each refused GRPO setting: the ConfigError's message, by case."""
    import odc
    import odc.integrations.transformers as odc_hf

    out: dict[str, str] = {}
    # Set on one built trainer where GRPOTrainer keeps them (beta > 0 would load a reference model by name).
    trainer = make_trainer(out_dir, 1)
    for case, owner, name, value in (("beta", trainer, "beta", 0.1), ("bnpo", trainer, "loss_type", "bnpo"),
                                     ("iterations", trainer, "num_iterations", 2),
                                     ("generation", trainer.args, "steps_per_generation", 4),
                                     ("entropy", trainer, "top_entropy_quantile", 0.5)):
        held = getattr(owner, name)
        setattr(owner, name, value)
        try:
            odc_hf.enable(trainer)
            out[case] = "enabled"
        except odc.ConfigError as e:
            out[case] = str(e)
        setattr(owner, name, held)
    return out


def suite_worker(rank: int, world: int, store: Any, root: str, steps: int, loss_types: list[str]) -> dict[str, Any]:
    _env(rank, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    out: dict[str, Any] = {t: train(rank, os.path.join(root, t), steps, t) for t in loss_types}
    out["refusals"] = refused(os.path.join(root, "refused"))
    dist.barrier()
    return out


# --- the one-process reference ---------------------------------------------------------------------------------


def step_rows(rollouts: list[dict[str, Any]]) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, completion ids, advantage) of every completion of one step, over every rank's rollout."""
    rows = []
    for r in rollouts:
        for p, pm, c, cm, a in zip(r["prompt_ids"], r["prompt_mask"], r["completion_ids"], r["completion_mask"],
                                   r["advantages"], strict=True):
            rows.append(([t for t, m in zip(p, pm, strict=True) if m], c[:sum(cm)], float(a)))
    return rows


def reference(per_rank: list[list[dict[str, Any]]], steps: int, loss_type: str) -> dict[str, Any]:
    """One process, plain torch: per step the loss and the pre-clip grad norm; the final parameters."""
    model = build_model()
    model.config.use_cache = False
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logs = []
    for step in range(steps):
        rows = step_rows([rank[step] for rank in per_rank])
        tokens = sum(len(c) for _, c, _ in rows)
        total = torch.zeros(())
        for prompt, completion, advantage in rows:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            ratio = torch.exp(logp - logp.detach())  # the importance ratio at the on-policy point: 1, its gradient
            if loss_type in ("dapo", "grpo", "luspo", "dr_grpo"):  # the clipped surrogate, unclipped at 1
                per_token = -advantage * ratio
            elif loss_type == "sapo":  # the soft gate, temperature by the advantage's sign
                t = SAPO_TEMPERATURES[0] if advantage > 0 else SAPO_TEMPERATURES[1]
                per_token = -advantage * torch.sigmoid(t * (ratio - 1)) * 4 / t
            elif loss_type in ("cispo", "vespo"):  # a detached weight (1 here: eps_max above 1; phi(1) = 1) on logp
                per_token = -advantage * logp
            else:
                raise ValueError(loss_type)
            if loss_type in ("dapo", "cispo", "vespo"):  # over the step's tokens
                total = total + per_token.sum() / tokens
            elif loss_type in ("grpo", "sapo"):  # each row's token mean, over the step's rows
                total = total + per_token.mean() / len(rows)
            elif loss_type == "luspo":  # each row's token sum, over the step's rows
                total = total + per_token.sum() / len(rows)
            else:  # dr_grpo: over rows times the longest a completion may be
                total = total + per_token.sum() / (len(rows) * MAX_COMPLETION)
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        logs.append({"loss": float(total.detach()), "grad_norm": float(norm), "rows": len(rows), "tokens": tokens})
    return {"logs": logs, "params": {k: v.detach().numpy() for k, v in model.state_dict().items()}}
