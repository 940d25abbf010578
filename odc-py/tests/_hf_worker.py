"""Workers for test_integrations_transformers.py: Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` on ODC, and the
one-process reference they are held to.

Each rank builds the trainer as a user's script does (a tiny random Llama or Qwen2 from a config, a word-level
tokenizer made in place, nothing downloaded; FSDP2 through the training arguments' ``fsdp_config``; CPU, gloo),
calls ``odc.integrations.transformers.enable(trainer)`` and ``trainer.train()``. It returns the Trainer's logs,
how many microbatches it ran in each step (a forward pre-hook, independent of the integration) and, on rank 0,
the full parameters and the dataset rows as the trainer prepared them.

:func:`reference` trains the same model in one process with a plain torch loop: each step's rows (the documented
order: ``torch.randperm`` seeded with ``seed + epoch``, consecutive rows per step), cut into their samples, the
sum of every sample's token losses divided by the step's count of loss tokens, AdamW, the clip and the linear
schedule the Trainer uses.
"""

from __future__ import annotations

import collections
import datetime
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 96
SEED = 7
MAX_LENGTH = 48
LR = 1e-3
CLIP = 0.5

# Per kind: the model, the trainer, rows per rank per microbatch, accumulation, the microbatch budget.
KINDS = {
    "trainer": {"model": "llama", "per_device": 2, "accum": 2, "max_tokens": 40},
    "sft-packed": {"model": "qwen2", "per_device": 1, "accum": 2, "max_tokens": None},
    "sft": {"model": "qwen2", "per_device": 2, "accum": 1, "max_tokens": None},
}


def rows_for(kind: str, world: int) -> int:
    """Dataset rows of the unpacked kinds: two whole steps and one more row, so that the last step of the epoch
    leaves a rank with no sample."""
    k = KINDS[kind]
    return 2 * k["per_device"] * k["accum"] * world + 1


def samples(kind: str, world: int) -> list[list[int]]:
    """Token ids of the dataset's samples: lengths 3 to 40; for TRL's packing, a few long samples (40 to 46
    tokens) among short ones (2 to 6), which TRL packs into 13 rows that LB-Mini plans unevenly, with one rank
    left without a sample in a step, on 2 and on 3 ranks."""
    if kind == "sft-packed":
        g = torch.Generator().manual_seed(1025)
        lengths = [int(torch.randint(40, 47, (1,), generator=g)) if float(torch.rand(1, generator=g)) < 0.35
                   else int(torch.randint(2, 7, (1,), generator=g)) for _ in range(23)]
    else:
        g = torch.Generator().manual_seed(1000 + world)
        lengths = [int(x) for x in torch.randint(3, 41, (rows_for(kind, world),), generator=g)]
    return [torch.randint(0, VOCAB - 2, (length,), generator=g).tolist() for length in lengths]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>")


def build_model(name: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    config = (Qwen2Config(tie_word_embeddings=True, **shape) if name == "qwen2"
              else LlamaConfig(tie_word_embeddings=False, **shape))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class Rows(torch.utils.data.Dataset):
    """The plain Trainer's dataset: ``input_ids`` and ``labels``, the first 0, 1 or 2 tokens of sample ``i`` a
    prompt (label -100; a sample without one has a label at its first token, which no other sample of its packed
    row may learn to predict)."""

    def __init__(self, ids: list[list[int]]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.ids[i]
        prompt = i % 3
        return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


class Stream(torch.utils.data.IterableDataset):
    """A dataset read as a stream (no length, no indexed rows)."""

    def __init__(self, rows: Any):
        self.rows = rows

    def __iter__(self) -> Any:
        return iter(self.rows[i] for i in range(len(self.rows)))


def pad_collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """A user's padding collator (right padding, labels -100 on the padding)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [VOCAB - 2] * (width - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
    mask = torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def arguments(kind: str, out_dir: str, steps: int, **extra: Any) -> dict[str, Any]:
    k = KINDS[kind]
    args = {"output_dir": out_dir, "use_cpu": True, "report_to": [], "per_device_train_batch_size": k["per_device"],
            "gradient_accumulation_steps": k["accum"], "max_steps": steps, "logging_steps": 1,
            "save_strategy": "no", "learning_rate": LR, "lr_scheduler_type": "linear", "warmup_steps": 1,
            "weight_decay": 0.0, "max_grad_norm": CLIP, "seed": SEED, "bf16": False,
            "fsdp": True, "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                          "transformer_layer_cls_to_wrap":
                                          ["LlamaDecoderLayer" if k["model"] == "llama" else "Qwen2DecoderLayer"]},
            "disable_tqdm": True}
    args.update(extra)
    return args


def make_trainer(kind: str, world: int, out_dir: str, steps: int, **extra: Any) -> Any:
    k = KINDS[kind]
    model = build_model(k["model"])
    ids = samples(kind, world)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        return Trainer(model=model, args=TrainingArguments(**arguments(kind, out_dir, steps, **extra)),
                       train_dataset=Rows(ids), data_collator=pad_collate)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    packed = kind == "sft-packed"
    config = SFTConfig(**arguments(kind, out_dir, steps, **extra), packing=packed, packing_strategy="bfd",
                       padding_free=packed, max_length=MAX_LENGTH, dataset_num_proc=None)
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": ids}),
                      processing_class=tokenizer())


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                      TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", OMP_NUM_THREADS="1")


def full_params(model: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().float().numpy() for k, v in sd.items()}


def train(rank: int, kind: str, out_dir: str, steps: int, world: int, on_odc: bool = True,
          save_steps: int | None = None, resume: str | None = None, **enable: Any) -> dict[str, Any]:
    """One training run of ``kind`` in this rank's process group; see the module doc for what it returns."""
    import odc.fsdp
    import odc.integrations.transformers as odc_hf

    extra: dict[str, Any] = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    if enable.get("accumulation") in (odc_hf.FSDP2_ACCUM, odc_hf.ACCUM_ON_ODC):  # one all-gather per group per step
        extra["fsdp_config"] = {**arguments(kind, out_dir, steps)["fsdp_config"], "reshard_after_forward": False}
    trainer = make_trainer(kind, world, out_dir, steps, **extra)
    if on_odc:
        odc_hf.enable(trainer, max_tokens=KINDS[kind]["max_tokens"], **enable)
    else:  # FSDP2's own collectives and the Trainer's own data path, on CPU as under ODC
        odc_hf._fsdp_on_cpu(trainer)
    counts: collections.Counter = collections.Counter()

    def count(module: Any, _: Any) -> None:
        if module.training:
            counts[trainer.state.global_step] += 1

    trainer.model.register_forward_pre_hook(count)
    trainer.train(resume_from_checkpoint=resume)
    out: dict[str, Any] = {"logs": trainer.state.log_history, "counts": [counts[s] for s in range(steps)],
                           "class": type(trainer).__name__, "enabled": odc.fsdp.is_enabled(trainer.model)}
    params = full_params(trainer.model)
    if rank == 0:
        out["params"] = params
        out["rows"] = [dict(trainer.train_dataset[i]) for i in range(len(trainer.train_dataset))]
    if out["enabled"]:
        odc.fsdp.disable(trainer.model)  # the next case's engine replaces this one
    dist.barrier()
    return out


def suite_worker(rank: int, world: int, store: Any, cases: list[dict[str, Any]], refusals: str | None = None
                 ) -> dict[str, Any]:
    """Runs ``cases`` (each :func:`train`'s keywords, with a ``name``) one after the other in one process group,
    then, given a folder, :func:`refusals`; returns each case's result by name."""
    _env(rank, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    out = {case["name"]: train(rank, world=world, **{k: v for k, v in case.items() if k != "name"})
           for case in cases}
    if refusals is not None:
        out["refusals"] = refused(world, refusals)
    return out


def refused(world: int, out_dir: str) -> dict[str, str]:
    """Each refused setting on a trainer built as a user would: the ConfigError's message, by case."""
    import types

    import odc
    import odc.integrations.transformers as odc_hf

    out: dict[str, str] = {}

    def attempt(case: str, trainer: Any, **kwargs: Any) -> None:
        try:
            odc_hf.enable(trainer, **kwargs)
            out[case] = "enabled"
        except odc.ConfigError as e:
            out[case] = str(e)

    def built(kind: str = "trainer", **extra: Any) -> Any:
        return make_trainer(kind, world, out_dir, 2, **extra)

    # accelerate's Accelerator sets ACCELERATE_USE_FSDP=true in the process once it is given an FSDP plugin (the
    # earlier cases), and reads it for every later one: a script without FSDP starts without it.
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    attempt("no fsdp", built(fsdp=False, fsdp_config=None))
    attempt("sampling", built(train_sampling_strategy="group_by_length"))
    attempt("tokens", built(average_tokens_across_devices=False))
    attempt("auto batch", built(auto_find_batch_size=True))
    trainer = built()
    trainer.train_dataset = Stream(trainer.train_dataset)
    attempt("iterable", trainer)
    trainer = built()
    trainer.model_accepts_loss_kwargs = False  # a model whose forward takes no num_items_in_batch
    attempt("mean loss", trainer)
    # What cannot be built on a CPU machine (FSDP1, DeepSpeed, tensor/context/sequence parallelism, HSDP, a model
    # over several devices) is set on the built trainer where the Trainer and accelerate keep it.
    trainer = built()
    odc_hf._fsdp_on_cpu(trainer)
    trainer.accelerator.state.fsdp_plugin.fsdp_version = 1
    attempt("fsdp1", trainer)
    trainer = built()  # transformers 5.24 takes fsdp_config={"cpu_offload": True}, 5.9 fsdp="full_shard offload"
    odc_hf._fsdp_on_cpu(trainer)
    trainer.accelerator.state.fsdp_plugin.cpu_offload = torch.distributed.fsdp.CPUOffloadPolicy()
    attempt("offload", trainer)
    trainer = built()
    trainer.is_deepspeed_enabled = True
    attempt("deepspeed", trainer)
    for case, sizes in (("tp", {"tp_size": 2}), ("cp", {"cp_size": 2}), ("sp", {"sp_size": 2}),
                        ("hsdp", {"dp_replicate_size": 2})):
        trainer = built()
        trainer.accelerator.state.parallelism_config = types.SimpleNamespace(
            **{"tp_size": 1, "cp_size": 1, "sp_size": 1, "dp_replicate_size": 1, **sizes})
        attempt(case, trainer)
        trainer.accelerator.state.parallelism_config = None
    trainer = built()
    trainer.is_model_parallel = True
    attempt("model parallel", trainer)
    from trl import DPOTrainer

    attempt("dpo", DPOTrainer.__new__(DPOTrainer))
    attempt("not a trainer", object())
    trainer = built()
    attempt("strategy", trainer, strategy="verl-native")
    attempt("budget", trainer, max_tokens=0)
    attempt("cost", trainer, cost="cubic")
    attempt("accumulation", trainer, accumulation="zero2")
    attempt("accum resharding", trainer, accumulation="fsdp2-accum")  # reshard_after_forward left True
    attempt("compress format", trainer, compress={"push": "int4"})
    attempt("compress deterministic", trainer, compress={"push": "int8"}, deterministic=True)
    attempt("cross node", trainer, cross_node="ring")
    attempt("compress accum", trainer, compress={"push": "int8"}, accumulation="fsdp2-accum")
    dist.barrier()
    return out


# --- the one-process reference ---------------------------------------------------------------------------------


def _step_samples(rows: list[dict[str, Any]], kind: str, world: int, step: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of every sample of optimizer step ``step`` (counted from 0 over the epochs)."""
    k = KINDS[kind]
    per = k["per_device"] * k["accum"] * world
    per_epoch = math.ceil(len(rows) / per)
    epoch, at = divmod(step, per_epoch)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    out = []
    for i in order[at * per:(at + 1) * per]:
        row = rows[i]
        ids = list(row["input_ids"])
        labels = list(row["labels"]) if "labels" in row else ids
        cuts = list(row.get("seq_lengths") or [len(ids)])
        start = 0
        for n in cuts:
            out.append((ids[start:start + n], labels[start:start + n]))
            start += n
    return out


def reference(kind: str, rows: list[dict[str, Any]], world: int, steps: int) -> dict[str, Any]:
    """One process, a plain torch loop: per step the loss, the pre-clip grad norm, the top-1 accuracy and the
    tokens seen; the final parameters."""
    from transformers import get_scheduler

    model = build_model(KINDS[kind]["model"])
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=steps)
    logs = []
    for step in range(steps):
        batch = _step_samples(rows, kind, world, step)
        count = sum(sum(1 for t in labels[1:] if t != -100) for _, labels in batch)
        total, correct = torch.zeros(()), 0
        for ids, labels in batch:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total = total + F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            correct += int(((logits.argmax(-1) == target) & (target != -100)).sum())
        loss = total / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        logs.append({"loss": float(loss.detach()), "grad_norm": float(norm), "mean_token_accuracy": correct / count,
                     "tokens": sum(len(ids) for ids, _ in batch)})
    return {"logs": logs, "params": {k: v.detach().numpy() for k, v in model.state_dict().items()}}
