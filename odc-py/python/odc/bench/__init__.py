"""``odc-bench``: the collective-versus-ODC microbenchmark and the imbalance benchmark.

Subcommands:

- ``primitives`` — torch.distributed all-gather / reduce-scatter (gloo on
  CPU, nccl on GPU) against ODC gather / scatter-accumulate, nccl-tests
  style (``-g -b -e -f -n -w -d -c``), with the ODC/collective busbw ratio
  of every row (:mod:`odc.bench.primitives`).
- ``imbalance`` — an FSDP-shaped training loop with emulated compute over
  packed sequence lengths: Collective + LB-Micro / LocalSort against ODC +
  LB-Micro / LB-Mini / LocalSort, and what a user runs without ODC
  (verl-maxcount, dummy-pad, fsdp2-accum: :mod:`odc.bench.baselines`),
  measured speedups beside the packer's predictions
  (:mod:`odc.bench.imbalance`).
- ``train`` — real FSDP2 training of a Hugging Face transformer on packed
  variable-length microbatches, the same configurations, measured speedups
  and memory beside the packer's predictions with a cost model fitted to the
  model in the same run; ``--curves``: loss curves of ODC + LB-Mini, with
  and without compressed chunks, and Collective + LB-Micro
  (:mod:`odc.bench.train`).
- ``trainer`` — the same TRL ``SFTTrainer`` job three ways: TRL's best
  default (packing ``bfd`` + ``padding_free``), that plus ODC + LB-Mini
  (``odc.integrations.transformers.enable``), and LB-Mini's plan under FSDP2's
  own accumulation; time per step, peak memory, loss curves
  (:mod:`odc.bench.trainer`).
- ``weights`` — rollout weights: 4 trainer ranks serve an FSDP2 model, 2 reader
  processes read it whole in bf16 with :class:`odc.WeightReader`, against a
  full state dict gathered on rank 0 and broadcast over gloo; the copy or link
  limit; the trainer's step time while readers read (:mod:`odc.bench.weights`).

All launch their own local ranks (spawned processes sharing a TCPStore),
or run as one rank of a torchrun job when ``RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR`` are set. Tables go to stdout, ``--json FILE`` writes the
results, ``--plot FILE.png`` draws them (needs matplotlib).

Exit status: 0 ok, 1 a run failed or a result was wrong, 2 bad arguments.

Example::

    odc-bench primitives -g 2 -b 64K -e 64M -f 4 --json prim.json --plot prim.png
    odc-bench imbalance --world 4 --sweep minibatch-size=1,2,4,8 --run-seconds 10
    odc-bench train --sweep minibatch-size=4,8 --repeats 3 --plot train.png
    odc-bench trainer --sweep minibatch-size=4,8,16 --repeats 3 --json trainer.json --plot trainer.png
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .report import UsageError

if TYPE_CHECKING:
    from .imbalance import Config

__all__ = ["main"]

DEFAULT_SYNTHETIC = "lognormal:n=4096,median=10000,sigma=1.0,max=65536,seed=0"
SWEEPS = ("minibatch-size", "max-length", "packing-ratio", "world")
DTYPES = ("f32", "bf16", "f16")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _positive(kind: type, flag: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: not a {kind.__name__}") from None
        if not v > 0 or (isinstance(v, float) and math.isinf(v)):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: must be positive")
        return v

    return parse


def _size(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        from .report import parse_size

        try:
            return parse_size(text, flag)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


# What each command's --help ends with: command lines to copy, each with what it does.
EXAMPLES = {
    "odc-bench": """\
examples:
  odc-bench primitives -g 2 -b 64K -e 64M -f 4 --json prim.json --plot prim.png
      gloo's all-gather / reduce-scatter against ODC's gather / scatter-accumulate, 2 ranks
  odc-bench imbalance --world 4 --sweep minibatch-size=2,4,8 --run-seconds 3 --plot imbalance.png
      emulated compute on 4 ranks: measured speedups beside the packer's predictions
  odc-bench train --minibatch-size 4 --minibatches 4 --repeats 1 --plot train.png
      real FSDP2 training of a tiny Qwen2 on 2 ranks, collectives against ODC
  odc-bench memory --world 4 --per-node 2 --markdown
      bytes per rank of FSDP2 over gloo and of ODC, full and hybrid sharding
  odc-bench trainer --minibatch-size 4 --steps 4 --repeats 1 --plot trainer.png
      TRL's SFTTrainer three ways on 2 ranks: TRL's default, + ODC + LB-Mini, LB-Mini under FSDP2's accumulation
  odc-bench weights --sizes 256M --repeats 1 --steps 2
      rollout weights: 4 trainer ranks, 2 readers, ODC's one-sided reader against gather + broadcast

Tables go to stdout, the progress bar to stderr; the last line says where --json and --plot went.""",
    "primitives": """\
examples:
  odc-bench primitives -g 2 -b 64K -e 64M -f 4 -n 20 -w 5 --in-place --json prim.json --plot prim.png
      2 ranks, 64 KiB to 64 MiB by 4x, f32, out of place and in place, saved as JSON and a plot
  odc-bench primitives -g 2,4 -b 1M -e 16M -d bf16,f32
      2 and then 4 ranks, two dtypes
  odc-bench primitives --netns 2 -g 2 -b 64K -e 64M --transport fabric
      the ranks in two network namespaces (emulated hosts; root, iproute2), ODC over libfabric""",
    "imbalance": """\
examples:
  odc-bench imbalance --world 4 --sweep minibatch-size=2,4,8 --run-seconds 3 --plot imbalance.png
      4 ranks, three minibatch sizes, compute scaled so that the baseline computes 3 s per point
  odc-bench imbalance --world 8 --minibatch-size 8 --configs odc+lb-mini+steal --straggler 0:1.5
      work stealing from a rank that computes 1.5x slower than the plan thinks
  odc-bench imbalance --lengths lengths.txt --world 8 --cost linear --json imbalance.json
      your own sequence lengths (one per line) under a linear cost model""",
    "train": """\
examples:
  odc-bench train --minibatch-size 4 --minibatches 4 --repeats 1 --plot train.png
      every configuration once on 2 ranks: collectives, ODC, and the baselines without ODC
  odc-bench train --configs odc+lb-mini,verl-maxcount,dummy-pad,fsdp2-accum --json baselines.json
      ODC + LB-Mini against what users run instead (time, memory, losses and parameters)
  odc-bench train --sweep minibatch-size=4,8,16 --repeats 3 --json train.json --plot train.png
      the speedup table and plot over three minibatch sizes, 3 interleaved repeats
  odc-bench train --curves --minibatch-size 4 --minibatches 120 --plot curves.png
      loss curves of ODC + LB-Mini, uncompressed and with int8 pushes / fp8 gathers, against the
      collectives' on the same samples""",
    "trainer": """\
examples:
  odc-bench trainer --minibatch-size 4 --steps 4 --repeats 1 --plot trainer.png
      each arm once on 2 ranks, 4 packed rows per rank per step: time, memory, losses
  odc-bench trainer --sweep minibatch-size=4,8,16 --repeats 3 --json trainer.json --plot trainer.png
      the table of the docs: three minibatch sizes, 3 interleaved repeats (arm order rotated per repeat)
  odc-bench trainer --synthetic lognormal:n=4096,median=600,sigma=1.2,max=4096,seed=1 --max-length 4096
      a heavier tail: longer samples and rows""",
    "memory": """\
examples:
  odc-bench memory --world 4 --per-node 2 --markdown --json memory.json
      measured: 4 ranks in 2 emulated nodes, every sharding, as a Markdown table and JSON
  odc-bench memory --formula 32B --world 32 --per-node 8 --gather-dtype bf16
      by formula: a 32B-parameter model on 4 nodes of 8, bf16 gathers
  odc-bench memory --formula 70B --world 64 --per-node 8 --param-dtype bf16 --gather-dtype bf16 --formula-layers 80
      by formula: where FSDP2's accumulation (fsdp2-accum) stops fitting and ODC still does""",
    "weights": """\
examples:
  odc-bench weights --sizes 256M --repeats 1 --steps 2
      4 trainer ranks and 2 readers on this host: ODC's reader against gather + broadcast, once
  odc-bench weights --sizes 1G,4G --where host,netns,netns:10gbit --json weights.json
      the docs' table: one host, and readers in another network namespace (unshaped and 10 Gbit/s; root)""",
}


def _build_parser() -> _Parser:
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="odc-bench", description="Collective-versus-ODC benchmarks (see `odc-bench SUBCOMMAND -h`).",
                epilog=EXAMPLES["odc-bench"], formatter_class=raw)
    sub = p.add_subparsers(dest="command", metavar="{primitives,imbalance,train,trainer,memory,weights}",
                           parser_class=_Parser)

    pr = sub.add_parser("primitives", help="all-gather / reduce-scatter against ODC gather / scatter-accumulate",
                        description="nccl-tests-style sweep: collective baseline against ODC, same run.",
                        epilog=EXAMPLES["primitives"], formatter_class=raw)
    pr.add_argument("-g", "--ranks", default="2", help="world sizes to run, comma-separated (default 2)")
    pr.add_argument("-b", "--minbytes", type=_size("-b"), default=64 << 10, help="smallest size (default 64K)")
    pr.add_argument("-e", "--maxbytes", type=_size("-e"), default=64 << 20, help="largest size (default 64M)")
    pr.add_argument("-f", "--stepfactor", type=_positive(int, "-f"), default=4, help="size factor (default 4)")
    pr.add_argument("-n", "--iters", type=_positive(int, "-n"), default=20, help="timed iterations (default 20)")
    pr.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (default 5)")
    pr.add_argument("-d", "--datatype", default="f32", help="f32, bf16, f16, a comma list, or all (default f32)")
    pr.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results (default 1)")
    pr.add_argument("--in-place", action="store_true",
                    help="also time in-place all-gather (own shard already in the output; ODC gather skip_own)")
    pr.add_argument("--backend", default="auto", help="collective baseline: auto (nccl if CUDA, else gloo), gloo, nccl")
    pr.add_argument("--chunk-bytes", type=_size("--chunk-bytes"), default=None,
                    help="ODC push chunk (default: engine's)")
    pr.add_argument("--netns", type=_positive(int, "--netns"), default=None, metavar="N",
                    help="spread the ranks over N network namespaces joined by a bridge (emulated hosts; needs root "
                         "and iproute2): rank r runs in namespace r // (g / N), gloo and ODC cross the same links")
    pr.add_argument("--transport", choices=("auto", "shm", "fabric", "emu-ipc", "emu-shmem", "cuda-ipc", "nvshmem"),
                    default=None,
                    help="ODC transport (default: ODC_TRANSPORT, else shm; fabric with --netns; against nccl "
                         "cuda-ipc, or nvshmem across nodes)")
    _common(pr)

    im = sub.add_parser("imbalance", help="FSDP-shaped loop with emulated compute: collectives against ODC",
                        description="Measured speedup of ODC and packing strategies against the packer's prediction. "
                                    "Compute is EMULATED (sleep proportional to the cost model); "
                                    "communication is real.",
                        epilog=EXAMPLES["imbalance"], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = im.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="sequence lengths: one integer per line, or a JSON array")
    src.add_argument("--synthetic", metavar="SPEC",
                     help=f"synthetic lengths, as odc-pack (default {DEFAULT_SYNTHETIC})")
    im.add_argument("--world", type=_positive(int, "--world"), default=4, help="ranks D (default 4)")
    im.add_argument("--minibatch-size", type=_positive(int, "--minibatch-size"), default=4,
                    help="samples per rank per minibatch M (default 4)")
    im.add_argument("--max-tokens", type=_positive(int, "--max-tokens"), default=65536,
                    help="token budget of a microbatch (default 65536)")
    im.add_argument("--cost", default="quadratic", help="cost model, as odc-pack (default quadratic)")
    im.add_argument("--minibatches", type=_positive(int, "--minibatches"), default=4,
                    help="minibatches run (default 4)")
    im.add_argument("--layers", type=_positive(int, "--layers"), default=2, help="layers L (default 2)")
    im.add_argument("--layer-bytes", type=_size("--layer-bytes"), default=256 << 10,
                    help="f32 parameter bytes of one layer (default 256K)")
    scale = im.add_mutually_exclusive_group()
    scale.add_argument("--compute-scale", type=_positive(float, "--compute-scale"), default=None,
                       help="emulated seconds of one layer's forward per unit cost (backward: 2x; default 0.002)")
    scale.add_argument("--run-seconds", type=_positive(float, "--run-seconds"), default=None,
                       help="instead: pick the scale so Collective + LB-Micro computes this long (per sweep point)")
    im.add_argument("--configs", default=",".join(c[0] for c in _configs()),
                    help="configurations, comma-separated (the baseline collective+lb-micro always runs)")
    im.add_argument("--repeats", type=_positive(int, "--repeats"), default=1, help="runs per configuration (median)")
    im.add_argument("--seed", type=int, default=None,
                    help="shuffle seed of the sample order before minibatches are cut (default: dataset order)")
    im.add_argument("--sweep", metavar="NAME=V1,V2,..",
                    help=f"sweep one of: {', '.join(SWEEPS)} (max-length redraws the synthetic lengths with that max "
                         f"and scales --max-tokens with it; packing-ratio sets the token budget to ratio x max length; "
                         f"one table and one plot either way)")
    im.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="FSDP-style overlap: prefetch the next layer's gather, wait for pushes per microbatch "
                         "(auto: collectives overlap, ODC calls run inline)")
    im.add_argument("--no-comm-run", action="store_true",
                    help="skip each configuration's run without compute before its repeats (the +comm prediction: "
                         "the compute-only one plus that run's seconds)")
    im.add_argument("--chunk-bytes", type=_size("--chunk-bytes"), default=None,
                    help="ODC push chunk (default: engine's)")
    im.add_argument("--noise", type=_nonnegative_float("--noise"), default=0.0,
                    help="the emulated compute strays from the cost model the plans use: each sample's time is its "
                         "model cost times a lognormal factor of mean 1 and this sigma, seeded by --noise-seed "
                         "(0.3 = about 30%%; default 0: the model exactly)")
    im.add_argument("--noise-seed", type=int, default=0, help="seed of --noise (default 0)")
    im.add_argument("--straggler", metavar="RANK:FACTOR", type=_straggler, default=None,
                    help="slow one rank's compute by a factor, e.g. 0:1.5")
    _common(im)
    _train_parser(sub)
    _trainer_parser(sub)
    _weights_parser(sub)
    return p


def _weights_parser(sub: Any) -> None:
    w = sub.add_parser("weights", help="rollout weights: ODC's one-sided reader against gather + broadcast",
                       description="Time to a reader's usable bf16 model: ODC's WeightReader against a full state "
                                   "dict gathered on trainer rank 0 and broadcast over gloo, beside the copy or link "
                                   "limit, and the trainer's step time while readers read (odc.bench.weights).",
                       epilog=EXAMPLES["weights"], formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--sizes", default="1G", help="f32 model sizes, comma-separated (default 1G)")
    w.add_argument("--where", default="host",
                   help="setups, comma-separated: host, netns (2 network namespaces: trainers | readers), "
                        "netns:RATE (the link shaped with tc tbf, e.g. netns:10gbit) (default host)")
    w.add_argument("--trainers", type=_positive(int, "--trainers"), default=4, help="trainer ranks (default 4)")
    w.add_argument("--readers", type=_positive(int, "--readers"), default=2, help="reader processes (default 2)")
    w.add_argument("--trainer-hosts", type=_positive(int, "--trainer-hosts"), default=1,
                   help="netns setups: the trainer ranks over this many namespaces, each link shaped to RATE, the "
                        "readers' namespace unshaped when more than one (default 1)")
    w.add_argument("--dim", type=_positive(int, "--dim"), default=4096, help="layer width (default 4096)")
    w.add_argument("--repeats", type=_positive(int, "--repeats"), default=3, help="timed reads per arm (median)")
    w.add_argument("--steps", type=_positive(int, "--steps"), default=3,
                   help="trainer steps alone and with readers reading (default 3)")
    w.add_argument("--staging", choices=("whole", "pieces"), default="pieces",
                   help="the readers' WeightReader(staging=...) for trainer ranks over the network (default pieces: "
                        "two 64 MiB buffers, a copy in flight while the piece before is cast)")
    w.add_argument("--served-dtype", choices=("f32", "bf16"), default="f32",
                   help="the dtype the trainers serve (serve_weights(dtype=...)) and the baseline broadcasts "
                        "(default f32: the model's own)")
    w.add_argument("--json", metavar="FILE", help="write the rows and every process's measurements")


def _nonnegative_float(flag: str) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not v >= 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: must be a finite number >= 0")
        return v

    return parse


def _straggler(text: str) -> tuple[int, float]:
    rank, _, factor = text.partition(":")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, float("nan")
    if r < 0 or not 0 < f < float("inf"):
        raise argparse.ArgumentTypeError(f"--straggler {text!r}: RANK:FACTOR, a rank >= 0 and a factor > 0 (0:1.5)")
    return r, f


def _check_straggler(straggler: tuple[int, float] | None, world: int) -> None:
    """Refuses a ``--straggler`` rank that is not among the ``world`` ranks."""
    if straggler and straggler[0] >= world:
        raise UsageError(f"--straggler {straggler[0]}:{straggler[1]:g}: no rank {straggler[0]} among {world}")


def _strays(args: argparse.Namespace) -> list[str]:
    """How ``--noise`` and ``--straggler`` make the emulated compute stray from the cost model."""
    strays = [f"each sample's time = model cost x lognormal(mean 1, sigma {args.noise:g}, seed "
              f"{args.noise_seed})"] if args.noise else []
    if args.straggler:
        strays.append(f"rank {args.straggler[0]} computes {args.straggler[1]:g}x slower")
    return strays


def _train_parser(sub: Any) -> None:
    from .train_report import DEFAULT_SYNTHETIC as TRAIN_SYNTHETIC

    tr = sub.add_parser("train", help="real FSDP2 training of a transformer: collectives against ODC",
                        description="Measured speedup of ODC and packing strategies in real training (FSDP2, a Hugging "
                                    "Face model from a tiny config, packed variable-length rows, varlen attention) "
                                    "against the packer's prediction with a cost model fitted in the same run. "
                                    "--curves: loss curves instead.",
                        epilog=EXAMPLES["train"], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = tr.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="sequence lengths: one integer per line, or a JSON array")
    src.add_argument("--synthetic", metavar="SPEC",
                     help=f"synthetic lengths, as odc-pack (default {TRAIN_SYNTHETIC}: LongAlign's shape scaled 1/32)")
    tr.add_argument("--world", type=_positive(int, "--world"), default=2,
                    help="ranks D, at most one per core (default 2)")
    tr.add_argument("--minibatch-size", type=_positive(int, "--minibatch-size"), default=8,
                    help="samples per rank per minibatch M (default 8)")
    tr.add_argument("--sweep", metavar="minibatch-size=V1,V2,..", help="sweep the minibatch size (one table, one plot)")
    tr.add_argument("--max-tokens", type=_positive(int, "--max-tokens"), default=2048,
                    help="token budget of a microbatch (default 2048)")
    tr.add_argument("--minibatches", type=_positive(int, "--minibatches"), default=6,
                    help="minibatches per run (default 6; the first is not timed)")
    tr.add_argument("--repeats", type=_positive(int, "--repeats"), default=3,
                    help="interleaved runs per configuration (median; default 3)")
    from .train import DEFAULT_CONFIGS as TRAIN_DEFAULTS

    tr.add_argument("--configs", default=",".join(TRAIN_DEFAULTS),
                    help="configurations, comma-separated (the baseline collective+lb-micro always runs; default: "
                         "all but odc+lb-mini+steal, which runs LB-Mini's plan with work stealing: a rank out of "
                         "microbatches takes unstarted ones of the rank with the most predicted seconds left, and "
                         "the +det variants of the odc configurations, e.g. odc+lb-mini+det, which accumulate "
                         "gradients deterministically: odc.fsdp.enable(..., deterministic=True), and the compressed "
                         "ones, odc+lb-mini+int8, odc+lb-mini+int8-nofb and odc+lb-mini+fp8g-int8: "
                         "odc.fsdp.enable(..., compress={...}) on every push (and gather); with --curves, the "
                         "compressed ones named here are added to the curves' configurations)")
    tr.add_argument("--curves", action="store_true",
                    help="convergence: train collective+lb-micro, odc+lb-mini, the control collective+local-sort "
                         "and odc+lb-mini with compressed chunks (odc+lb-mini+int8: int8 pushes with error feedback; "
                         "odc+lb-mini+int8-nofb: without; odc+lb-mini+fp8g-int8: fp8 gathers and int8 pushes) on "
                         "the same samples and compare their loss curves")
    _model_flags(tr)
    tr.add_argument("--lr", type=_positive(float, "--lr"), default=1e-3, help="AdamW learning rate (default 1e-3)")
    tr.add_argument("--clip", type=_positive(float, "--clip"), default=1.0, help="gradient clip norm (default 1.0)")
    tr.add_argument("--fit-repeats", type=_positive(int, "--fit-repeats"), default=3,
                    help="timed runs per length for the cost fit (default 3)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the samples' tokens (default 0)")
    tr.add_argument("--straggler", metavar="RANK:FACTOR", type=_straggler, default=None,
                    help="slow one rank's compute by a factor >= 1, e.g. 1:1.5: after every microbatch it runs, "
                         "that rank sleeps FACTOR-1 times the microbatch's compute time (its thread's CPU time, "
                         "waits on peers not counted), in every configuration's runs (not in the cost fit nor the "
                         "fixed-cost calibration; the predictions ignore it). Real compute on one host is fairly "
                         "even: this is what makes odc+lb-mini+steal steal")
    _common(tr)

    me = sub.add_parser("memory", help="memory per rank: FSDP2 over gloo and ODC, full and hybrid sharding",
                        description="Trains odc-bench train's model for a few minibatches under each variant and "
                                    "prints the bytes per rank by kind (max over ranks).",
                        epilog=EXAMPLES["memory"], formatter_class=argparse.RawDescriptionHelpFormatter)
    me.add_argument("--world", type=_positive(int, "--world"), default=4, help="ranks (default 4)")
    me.add_argument("--per-node", type=_positive(int, "--per-node"), default=2,
                    help="ranks per emulated node for the hybrid rows (default 2)")
    me.add_argument("--steps", type=_positive(int, "--steps"), default=3, help="AdamW minibatches (default 3)")
    me.add_argument("--micros", type=_positive(int, "--micros"), default=2, help="microbatches each (default 2)")
    me.add_argument("--length", type=_positive(int, "--length"), default=256,
                    help="tokens per microbatch (default 256)")
    me.add_argument("--sharding", choices=("full", "hybrid", "hybrid-zero", "all"), default="all",
                    help="rows to measure (default all: FSDP2 and ODC, full and hybrid, and ODC hybrid-zero)")
    me.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    me.add_argument("--formula", metavar="PARAMS", type=_param_count,
                    help="print the bytes per rank by formula for a model of PARAMS parameters (7B, 1.5M, 32e9) on "
                         "--world ranks in nodes of --per-node instead of measuring; full, hybrid and hybrid with "
                         "the optimizer sharded over all ranks")
    me.add_argument("--gather-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="with --formula: the dtype ODC publishes and gathers (bf16 under a bf16 "
                         "MixedPrecisionPolicy; default fp32)")
    me.add_argument("--optim-bytes", type=_positive(int, "--optim-bytes"), default=8,
                    help="with --formula: optimizer state bytes per parameter (default 8: AdamW's two f32 moments)")
    me.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="with --formula: the dtype of the sharded parameters and of the gradients (default fp32)")
    me.add_argument("--formula-layers", type=_positive(int, "--formula-layers"), default=None, metavar="L",
                    help="with --formula: the model's decoder layers, for the working set a ZeRO-3 step holds "
                         "unsharded (two layers' parameters, one layer's gradients); without it that column holds "
                         "fsdp2-accum's whole unsharded model only")
    me.add_argument("--deterministic", action="store_true",
                    help="with --formula: ODC rows with deterministic accumulation (an exact accumulator, 16 bytes "
                         "per gradient-shard element)")
    _model_flags(me)
    me.add_argument("--json", metavar="FILE", help="write the results as JSON")
    me.add_argument("--timeout", type=_positive(float, "--timeout"), default=300.0,
                    help="seconds any wait on a peer may take (default 300)")


def _trainer_parser(sub: Any) -> None:
    from .trainer import DEFAULT_SYNTHETIC as TRAINER_SYNTHETIC

    tr = sub.add_parser("trainer", help="TRL's SFTTrainer: its best default, + ODC + LB-Mini (with and without FSDP2's "
                                        "accumulation), LB-Mini on fsdp2-accum",
                        description="The same SFTTrainer job (packing bfd + padding_free, a tiny Qwen2 from a config, "
                                    "real compute) four ways, interleaved: TRL's best default, that plus "
                                    "odc.integrations.transformers.enable (ODC + LB-Mini), the same with FSDP2's own "
                                    "accumulation (odc-accum: one push per step), and LB-Mini's plan without ODC under "
                                    "FSDP2's own accumulation (fsdp2-accum). Time per optimizer step, peak memory "
                                    "per rank, loss curves, ratios against TRL's default in the same run.",
                        epilog=EXAMPLES["trainer"], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = tr.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="sample lengths: one integer per line, or a JSON array")
    src.add_argument("--synthetic", metavar="SPEC",
                     help=f"synthetic lengths, as odc-pack (default {TRAINER_SYNTHETIC}: LongAlign's shape scaled "
                          "1/32)")
    tr.add_argument("--world", type=_positive(int, "--world"), default=2,
                    help="ranks, at most one per core (default 2)")
    tr.add_argument("--minibatch-size", type=_positive(int, "--minibatch-size"), default=8,
                    help="packed rows per rank per optimizer step M: TRL's gradient_accumulation_steps with "
                         "per_device_train_batch_size 1 (default 8)")
    tr.add_argument("--sweep", metavar="minibatch-size=V1,V2,..", help="sweep the minibatch size (one table, one plot)")
    tr.add_argument("--max-length", type=_positive(int, "--max-length"), default=2048,
                    help="TRL's max_length: tokens of a packed row, and ODC's microbatch budget (default 2048)")
    tr.add_argument("--steps", type=_positive(int, "--steps"), default=6,
                    help="optimizer steps per run (default 6; the first is not timed)")
    tr.add_argument("--repeats", type=_positive(int, "--repeats"), default=3,
                    help="interleaved runs per arm (median; arm order rotated per repeat; default 3)")
    _model_flags(tr)
    tr.add_argument("--lr", type=_positive(float, "--lr"), default=1e-3, help="AdamW learning rate (default 1e-3)")
    tr.add_argument("--clip", type=_positive(float, "--clip"), default=1.0, help="max_grad_norm (default 1.0)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the samples' tokens (default 0)")
    _common(tr)


def _param_count(text: str) -> int:
    from .memory import parse_count

    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="CONFIG", help="a local Hugging Face config (directory or config.json) instead "
                                                     "of the tiny Qwen2 below (random weights)")
    for flag, default, what in (("--hidden", 128, "hidden size"), ("--layers", 4, "decoder layers"),
                                ("--heads", 8, "attention heads"), ("--kv-heads", 2, "key/value heads"),
                                ("--intermediate", 352, "MLP width"), ("--vocab", 512, "vocabulary")):
        p.add_argument(flag, type=_positive(int, flag), default=default, help=f"{what} (default {default})")


def _model_spec(args: argparse.Namespace) -> Any:
    from .train import ModelSpec

    return ModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                     intermediate=args.intermediate, vocab=args.vocab, path=args.model or "")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    p.add_argument("--timeout", type=_positive(float, "--timeout"), default=300.0,
                   help="seconds any wait on a peer may take (default 300)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (tqdm: pip install 'fsdp-odc[bench]'; auto: when stderr is a "
                        "terminal and tqdm is installed)")


def _configs(bench: str = "imbalance") -> tuple[Config, ...]:
    """The configurations a benchmark can run."""
    if bench == "train":
        from .train import CONFIGS as TRAIN_CONFIGS

        return TRAIN_CONFIGS
    from .imbalance import CONFIGS

    return CONFIGS


def _check_outputs(args: argparse.Namespace) -> None:
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"--{flag} {path}: folder {folder} does not exist")
    if args.plot is not None:
        from .report import require_matplotlib

        require_matplotlib()


def _parse_configs(text: str, bench: str = "imbalance") -> list[str]:
    """The configurations ``--configs`` names, in the benchmarks' order, the baseline always first."""
    from .imbalance import BASELINE

    names = [c[0] for c in _configs(bench)]
    chosen = {BASELINE}
    for raw in text.split(","):
        c = raw.strip().lower().replace(" ", "")
        if c not in names:
            raise UsageError(f"--configs {c!r}: unknown configuration (choose from {', '.join(names)})")
        chosen.add(c)
    return [n for n in names if n in chosen]


def _progress_flag(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "on": True, "off": False}[args.progress]


def _title(kind: str) -> str:
    from .report import load_average

    return f"odc-bench {kind} on {socket.gethostname()}, load average {load_average()}"


# -- primitives --------------------------------------------------------------------------------------


def _primitives(args: argparse.Namespace) -> int:
    from . import launch, primitives
    from .report import Progress, say_written, write_json

    worlds = []
    for part in str(args.ranks).split(","):
        try:
            g = int(part)
        except ValueError:
            raise UsageError(f"-g {args.ranks!r}: not a list of integers") from None
        if g < 2:
            raise UsageError(f"-g {g}: need at least 2 ranks")
        worlds.append(g)
    if args.minbytes > args.maxbytes:
        raise UsageError(f"-b {args.minbytes} -e {args.maxbytes}: need minbytes <= maxbytes")
    if args.stepfactor < 2:
        raise UsageError(f"-f {args.stepfactor}: the step factor must be at least 2")
    if args.warmup_iters < 0:
        raise UsageError(f"-w {args.warmup_iters}: must not be negative")
    dtypes = list(DTYPES) if args.datatype == "all" else args.datatype.split(",")
    for d in dtypes:
        if d not in DTYPES:
            raise UsageError(f"-d {d!r}: unknown type (use f32, bf16, f16 or all)")
    backend = _collective_backend(args.backend, max(worlds))
    transport = args.transport or os.environ.get("ODC_TRANSPORT") or ("fabric" if args.netns else "shm")
    if backend == "nccl":
        # ODC runs on the same GPUs as the baseline (primitives._device_engine).
        if args.transport is not None and args.transport not in ("cuda-ipc", "nvshmem"):
            raise UsageError(f"--transport {args.transport} with --backend nccl: ODC then runs on the GPUs; "
                             "use cuda-ipc or nvshmem")
        if transport not in ("cuda-ipc", "nvshmem"):
            transport = "cuda-ipc"
    elif args.transport in ("cuda-ipc", "nvshmem"):
        raise UsageError(f"--transport {args.transport} moves CUDA tensors; the {backend} baseline runs on CPU "
                         "(use --backend nccl)")
    if args.netns is not None:
        if launch.under_torchrun():
            raise UsageError("--netns: launches its own ranks; not under torchrun")
        if transport == "shm":
            raise UsageError("--netns with --transport shm: shared memory does not cross hosts (use fabric or auto)")
        for g in worlds:
            if g % args.netns != 0:
                raise UsageError(f"-g {g} --netns {args.netns}: the ranks must split evenly over the namespaces")
        from .netns import unavailable_reason

        why = unavailable_reason()
        if why is not None:
            raise UsageError(f"--netns: {why}")
    elif args.transport is not None:
        os.environ["ODC_TRANSPORT"] = args.transport  # the spawned ranks inherit it
    _check_outputs(args)
    if launch.under_torchrun():
        worlds = [int(os.environ["WORLD_SIZE"])]
    leader = int(os.environ.get("RANK", "0")) == 0

    if backend == "gloo":
        link = "veth + bridge between network namespaces" if args.netns else "loopback"
        coll_label = f"gloo over TCP ({link})"
    else:
        coll_label = backend
    header = [_title("primitives"),
              f"collective baseline: {coll_label}; ODC: odc.Engine ({transport}); {args.warmup_iters} warm-up + "
              f"{args.iters} timed iterations, each between two barriers; check={args.check}; GB = 1e9 B, "
              f"busbw = algbw * (n-1)/n"]
    if args.netns is not None:
        header.append(f"ranks spread over {args.netns} network namespaces (veth + bridge), consecutive ranks per "
                      f"namespace; gloo and ODC cross the same links")
    all_rows: list[dict[str, Any]] = []
    for world in worlds:
        sizes = sum(len(primitives.sweep(args.minbytes, args.maxbytes, args.stepfactor, d, world)) for d in dtypes)
        steps = (3 if args.in_place else 2) * sizes
        bar = Progress(steps, f"primitives {world} ranks", _progress_flag(args))
        run: Callable[..., Any]
        if args.netns is not None:
            from . import netns

            run = functools.partial(netns.run_ranks, netns=args.netns, transport=transport)
        else:
            run = launch.run_ranks
        rows = run(
            primitives.primitives_rank, world, backend=backend,
            on_event=functools.partial(_row_progress, bar),
            dtypes=dtypes, min_bytes=args.minbytes, max_bytes=args.maxbytes, factor=args.stepfactor,
            iters=args.iters, warmup=args.warmup_iters, check=bool(args.check), timeout=args.timeout,
            chunk_bytes=args.chunk_bytes, in_place=args.in_place)
        bar.close()
        if not leader:
            continue
        all_rows.extend(rows)
        print(primitives.render(rows, header if world == worlds[0] else []))
        print(flush=True)
    if not leader:
        return 0
    doc = {"bench": "primitives", "backend": backend, "collective_transport": coll_label,
           "load_average": os.getloadavg(), "cpus": os.cpu_count(),
           "args": {"ranks": worlds, "minbytes": args.minbytes, "maxbytes": args.maxbytes,
                    "stepfactor": args.stepfactor, "iters": args.iters, "warmup_iters": args.warmup_iters,
                    "datatypes": dtypes, "check": args.check, "in_place": args.in_place, "netns": args.netns,
                    "transport": transport},
           "rows": all_rows}
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        primitives.plot(all_rows, args.plot, f"odc-bench primitives ({coll_label} vs odc over {transport}), busbw")
    say_written(args.json, args.plot)
    wrong = sum(r["collective"]["wrong"] + r["odc"]["wrong"] for r in all_rows)
    if wrong:
        print(f"odc-bench: error: {wrong} wrong elements (see #wrong)", file=sys.stderr)
        return 1
    return 0


def _collective_backend(choice: str, world: int) -> str:
    if choice not in ("auto", "gloo", "nccl"):
        raise UsageError(f"--backend {choice!r}: use auto, gloo or nccl")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "auto":
        return "nccl" if gpus >= world else "gloo"
    if choice == "nccl" and gpus == 0:
        raise UsageError("--backend nccl: no CUDA device is available")
    return choice


def _row_progress(bar: Any, kind: str, payload: Any) -> None:
    """``on_event`` of the primitives ranks: one progress step per row."""
    if kind == "row":
        bar.step(f"{payload['op']} {payload['size']}")


# -- imbalance ---------------------------------------------------------------------------------------


def _minibatch_sizes(args: argparse.Namespace, bench: str) -> list[int]:
    """The minibatch sizes of ``--sweep minibatch-size=A,B,...`` (else ``[--minibatch-size]``); a UsageError naming
    what is wrong (``bench``: the subcommand, for the message)."""
    if not args.sweep:
        return [args.minibatch_size]
    name, _, raw = args.sweep.partition("=")
    if name.strip() != "minibatch-size":
        raise UsageError(f"--sweep {name.strip()!r}: odc-bench {bench} sweeps minibatch-size only")
    try:
        sizes = [int(v) for v in raw.split(",")]
    except ValueError:
        raise UsageError(f"--sweep {args.sweep!r}: not a list of integers") from None
    if not sizes or any(v < 1 for v in sizes):
        raise UsageError(f"--sweep {args.sweep!r}: minibatch sizes must be positive")
    return sizes


def _input_lengths(args: argparse.Namespace, default_spec: str) -> tuple[list[int], str | None]:
    """The lengths of ``--lengths FILE`` or ``--synthetic SPEC`` (else ``default_spec``), and the spec (None for a
    file)."""
    from odc import packing
    from odc.errors import PackingError

    if args.lengths is not None:
        return _read_lengths(args.lengths), None
    spec = args.synthetic or default_spec
    try:
        return packing.synthetic(spec), spec
    except PackingError as e:
        raise UsageError(f"--synthetic {spec!r}: {e}") from None


def _read_lengths(path: str) -> list[int]:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UsageError(f"--lengths {path}: no such file") from None
    except OSError as e:
        raise UsageError(f"--lengths {path}: {e.strerror}") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError:
        raise UsageError(f"--lengths {path}: expected one integer per line or a JSON array") from None
    if not values:
        raise UsageError(f"--lengths {path}: the file holds no lengths")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"--lengths {path}: entry {i} is {v!r}; lengths must be positive integers")
    return values


def _with_max(spec: str, max_length: int) -> str:
    head, _, params = spec.partition(":")
    kept = [p for p in params.split(",") if p and not p.strip().startswith("max=")]
    return f"{head}:{','.join([*kept, f'max={max_length}'])}"


def _note_progress(bar: Any, kind: str, note: Any) -> None:
    """``on_event`` of the imbalance ranks: one progress step per minibatch run."""
    if kind == "progress":
        bar.step(note)


def _spec_max(spec: str) -> int:
    for p in spec.partition(":")[2].split(","):
        if p.strip().startswith("max="):
            return int(float(p.split("=", 1)[1]))
    return 65536


def _imbalance(args: argparse.Namespace) -> int:
    from odc import packing
    from odc.errors import PackingError

    from . import imbalance, launch
    from .report import Progress, say_written, write_json

    if args.world < 2:
        raise UsageError(f"--world {args.world}: need at least 2 ranks")
    try:
        packing.sequence_cost(1, args.cost)
    except PackingError as e:
        raise UsageError(f"--cost {args.cost!r}: {e}") from None
    chosen = _parse_configs(args.configs)
    configs = tuple(cfg for cfg in imbalance.CONFIGS if cfg[0] in chosen)
    base_lengths, spec = _input_lengths(args, DEFAULT_SYNTHETIC)
    sweep_name = None
    sweep_values: list[Any] = [None]  # ints, or floats for packing-ratio
    if args.sweep:
        sweep_name, _, raw = args.sweep.partition("=")
        sweep_name = sweep_name.strip()
        if sweep_name not in SWEEPS:
            raise UsageError(f"--sweep {sweep_name!r}: unknown parameter (choose from {', '.join(SWEEPS)})")
        if sweep_name == "max-length" and spec is None:
            raise UsageError("--sweep max-length: needs --synthetic lengths (it sets the distribution's max)")
        kind = float if sweep_name == "packing-ratio" else int
        sweep_values = []
        for v in raw.split(","):
            try:
                x = kind(v)
            except ValueError:
                raise UsageError(f"--sweep {sweep_name}={v!r}: not a {kind.__name__}") from None
            if not x > 0 or (sweep_name == "world" and x < 2):
                need = "at least 2" if sweep_name == "world" else "positive"
                raise UsageError(f"--sweep {sweep_name}={v}: must be {need}")
            sweep_values.append(x)
    _check_outputs(args)
    settings = imbalance.Settings(layers=args.layers, layer_bytes=args.layer_bytes, cost=args.cost,
                                  minibatches=args.minibatches, repeats=args.repeats, seed=args.seed, configs=configs,
                                  noise=args.noise, noise_seed=args.noise_seed, straggler=args.straggler)
    scale = args.compute_scale if (args.compute_scale or args.run_seconds) else 0.002
    base_max = _spec_max(spec) if spec else max(base_lengths)
    points = []
    for v in sweep_values:
        world, mbs, max_tokens, lengths = args.world, args.minibatch_size, args.max_tokens, base_lengths
        if sweep_name == "minibatch-size":
            mbs = v
        elif sweep_name == "world":
            world = v
        elif sweep_name == "max-length":
            assert spec is not None  # --sweep max-length was refused without --synthetic
            lengths = packing.synthetic(_with_max(spec, v))
            max_tokens = max(1, round(args.max_tokens / base_max * v))
        elif sweep_name == "packing-ratio":
            max_tokens = max(1, round(v * base_max))
        if launch.under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
        _check_straggler(args.straggler, world)
        try:
            points.append(imbalance.build_point(lengths, world=world, minibatch_size=mbs, max_tokens=max_tokens,
                                                settings=settings, compute_scale=scale, run_seconds=args.run_seconds,
                                                label=v))
        except PackingError as e:
            what = f" ({sweep_name}={v})" if sweep_name else ""
            raise UsageError(f"planning failed{what}: {e}") from None
    leader = int(os.environ.get("RANK", "0")) == 0
    results: list[dict[str, Any]] = []
    worlds = list(dict.fromkeys(p["world"] for p in points))
    for world in worlds:
        mine = [p for p in points if p["world"] == world]
        total = sum(p["num_minibatches"] * len(p["configs"]) for p in mine) * (args.repeats + (not args.no_comm_run))
        bar = Progress(total, f"imbalance {world} ranks", _progress_flag(args))
        out = launch.run_ranks(
            imbalance.imbalance_rank, world, backend="gloo",
            on_event=functools.partial(_note_progress, bar),
            points=mine, layers=args.layers, layer_bytes=args.layer_bytes, repeats=args.repeats,
            timeout=args.timeout, chunk_bytes=args.chunk_bytes, overlap=args.overlap, calibrate=not args.no_comm_run)
        bar.close()
        if leader:
            index = [i for i, p in enumerate(points) if p["world"] == world]
            results.extend({**r, "point": index[r["point"]]} for r in out)
    if not leader:
        return 0
    rows = imbalance.summarize(points, results, settings)
    src = f"--lengths {args.lengths}" if spec is None else f"--synthetic {spec}"
    scales = sorted({p["compute_scale"] for p in points})
    scale_txt = (f"{scales[0]:.3g}" if len(scales) == 1 else f"{scales[0]:.3g}..{scales[-1]:.3g}")
    fixed = [] if sweep_name == "world" else [f"{points[0]['world']} ranks"]
    if sweep_name != "minibatch-size":
        fixed.append(f"minibatch size {points[0]['minibatch_size']}")
    max_tokens = points[0]["max_tokens"]
    if sweep_name == "max-length":
        src += " (max swept)"
        max_tokens = f"{args.max_tokens / base_max:g} x max length"
    elif sweep_name == "packing-ratio":
        max_tokens = f"packing ratio x {base_max}"
    title = [
        _title("imbalance"),
        f"{', '.join(fixed)}; {args.layers} layers x {args.layer_bytes} B f32; {src}; cost {args.cost}; "
        f"{args.minibatches} minibatches; max tokens {max_tokens}",
        f"EMULATED COMPUTE (sleep): {scale_txt} s per unit cost per layer forward, backward 2x; "
        f"real communication (gloo collectives over TCP loopback / odc.Engine over shm); median of {args.repeats} "
        f"run(s)",
        f"bubble = 1 - compute / (D * time) measured | predicted by odc.packing; speedup vs {imbalance.BASELINE}; "
        f"error = measured / predicted - 1; +comm = the prediction plus the seconds its plan took run once "
        f"with no compute before the repeats (gathers, pushes, collectives, steps; no sleep)",
    ]
    strays = _strays(args)
    if strays:
        title.append("COMPUTE STRAYS FROM THE MODEL the plans and predictions use: " + "; ".join(strays))
    print(imbalance.render(rows, title, sweep_name), flush=True)
    if args.json:
        doc = {"bench": "imbalance", "load_average": os.getloadavg(), "cpus": os.cpu_count(),
               "emulated_compute": True,
               "args": {"world": args.world, "layers": args.layers, "layer_bytes": args.layer_bytes,
                        "lengths": args.lengths, "synthetic": spec, "minibatch_size": args.minibatch_size,
                        "max_tokens": args.max_tokens, "cost": args.cost, "minibatches": args.minibatches,
                        "compute_scale": args.compute_scale, "run_seconds": args.run_seconds, "repeats": args.repeats,
                        "seed": args.seed, "sweep": args.sweep, "noise": args.noise, "noise_seed": args.noise_seed,
                        "straggler": args.straggler},
               "rows": rows}
        write_json(args.json, doc)
    if args.plot:
        from .report import format_size

        where = "".join(f"{text}, " for text in fixed)
        stray = "; compute strays from the model: " + "; ".join(strays) if strays else ""
        short = (f"odc-bench imbalance: {where}{args.layers} layers x {format_size(args.layer_bytes)} f32, "
                 f"cost {args.cost}, {args.minibatches} minibatches\n"
                 f"EMULATED compute (sleep), real communication; measured vs predicted (odc.packing){stray}")
        imbalance.plot(rows, args.plot, short, sweep_name)
    say_written(args.json, args.plot)
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        print(f"odc-bench: error: {wrong} wrong results (see #wrong)", file=sys.stderr)
        return 1
    return 0


# -- memory ------------------------------------------------------------------------------------------


def _memory(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from . import launch, memory
    from .report import say_written, write_json

    if args.formula is not None:
        return _memory_formula(args)
    if launch.under_torchrun():
        raise UsageError("odc-bench memory launches its own ranks (one run per variant); not under torchrun")
    if args.world < 2:
        raise UsageError(f"--world {args.world}: need at least 2 ranks")
    hybrid = args.sharding != "full"
    if hybrid and (args.world % args.per_node or args.world == args.per_node or args.per_node < 2):
        raise UsageError(f"--world {args.world} --per-node {args.per_node}: the hybrid rows need at least two "
                         f"emulated nodes of at least 2 ranks each")
    _check_outputs(argparse.Namespace(json=args.json, plot=None))
    spec = _model_spec(args)
    rows = []
    for label, comm, sharding in memory.VARIANTS:
        if args.sharding not in ("all", sharding):
            continue
        per_rank = launch.run_ranks(memory.memory_rank, args.world, backend="gloo", spec=asdict(spec), comm=comm,
                                    sharding=sharding, per_node=args.per_node, steps=args.steps, micros=args.micros,
                                    length=args.length, timeout=args.timeout)
        worst = {k: (None if any(r[k] is None for r in per_rank) else max(r[k] for r in per_rank))
                 for k in memory.KEYS}
        rows.append({"label": label, "comm": comm, "sharding": sharding, "max": worst, "ranks": per_rank})
    # The same model by formula: what ODC's shared memory should be, against what the file system says.
    numel = _model_numel(spec)
    by_formula = {r["label"]: r for r in memory.formula(numel, args.world, args.per_node)}
    checks = []
    for r in rows:
        if r["comm"] == "odc":
            f = by_formula[r["label"]]
            r["formula"] = f
            shared_accum = f["accum"] if r["sharding"] != "full" else 0
            checks.append(f"{r['label']}: ODC shared memory {r['max']['odc_shm']:,} B measured, {f['odc_shm']:,.0f} B "
                          f"by formula (published {f['published']:,.0f} + accumulators the other nodes read "
                          f"{shared_accum:,.0f} + landing {f['landing']:,}; signal words and padding left out)")
    title = [_title("memory"),
             f"{args.world} ranks{f' (hybrid: nodes of {args.per_node}, emulated on this host)' if hybrid else ''}, "
             f"{spec.describe()}, fp32, "
             f"AdamW, {args.steps} minibatches of {args.micros} x {args.length} tokens; ODC shared memory = the "
             f"/dev/shm segments of the rank's engine (published shards, f32 accumulators, landing slots, signals)"]
    print(memory.render(rows, title, markdown=args.markdown), flush=True)
    for line in checks:
        print(f"# {line}", flush=True)
    if args.json:
        write_json(args.json, {"bench": "memory", "load_average": os.getloadavg(), "model": asdict(spec),
                               "params": numel, "args": vars(args), "rows": rows})
    say_written(args.json, plots=False)
    return 0


def _model_numel(spec: Any) -> int:
    """Parameters of the model of ``spec``, counted on the meta device (no weights allocated)."""
    import torch

    from .train import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(spec).parameters())


def _memory_formula(args: argparse.Namespace) -> int:
    from . import memory
    from .report import say_written, write_json

    if args.world % args.per_node:
        raise UsageError(f"--world {args.world} --per-node {args.per_node}: the world must be whole nodes")
    sizes = {"fp32": 4, "bf16": 2}
    gather = sizes[args.gather_dtype]
    try:
        rows = memory.formula(args.formula, args.world, args.per_node, param_bytes=sizes[args.param_dtype],
                              gather_bytes=gather, optim_bytes=args.optim_bytes, deterministic=args.deterministic,
                              layers=args.formula_layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    working = ("unsharded: fsdp2-accum's whole model for the minibatch; the others' working set of "
               f"{args.formula_layers} layers (two layers' parameters, one layer's gradients)" if args.formula_layers
               else "unsharded: fsdp2-accum's whole model for the minibatch (the others' per-layer working set left "
                    "out)")
    title = [f"odc-bench memory --formula: {args.formula:,} parameters, {args.world} ranks in nodes of "
             f"{args.per_node}; {args.param_dtype} sharded parameters and gradients, {args.optim_bytes} optimizer "
             f"bytes per parameter, ODC gathers {args.gather_dtype}; 2 MiB landing chunks within ODC_LANDING_MB=256",
             f"by formula, not measured (odc-bench memory without --formula measures a small model); activations "
             f"left out; {working}; hybrid-zero is the ZeRO++-style hybrid of docs/hybrid-zero.md"]
    print(memory.render_formula(rows, title, markdown=args.markdown), flush=True)
    if args.json:
        write_json(args.json, {"bench": "memory-formula", "params": args.formula, "args": vars(args), "rows": rows})
    say_written(args.json, plots=False)
    return 0


# -- entry point -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The ``odc-bench`` command line; returns (or, from the console script, exits with) its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    from .report import sample_load, set_command

    set_command(["odc-bench", *args])  # what the JSON files' provenance names
    sample_load()  # and the machine's load while the run lasts
    code = _main(args)
    if argv is None:
        raise SystemExit(code)
    return code


def _main(argv: list[str]) -> int:
    from .launch import BenchError

    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("missing subcommand: choose primitives, imbalance, train, trainer or memory")
        if args.command == "primitives":
            return _primitives(args)
        if args.command == "train":
            from .train_report import command

            return command(args, _model_spec(args))
        if args.command == "memory":
            return _memory(args)
        if args.command == "weights":
            from .weights import command as weights_command

            return weights_command(args)
        if args.command == "trainer":
            from .trainer import command as trainer_command

            return trainer_command(args, _model_spec(args))
        return _imbalance(args)
    except UsageError as e:
        print(f"odc-bench: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # -h / --help
        return int(e.code or 0)
    except BenchError as e:
        print(f"odc-bench: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        from .netns import NetnsError

        if not isinstance(e, NetnsError):
            raise
        print(f"odc-bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("odc-bench: interrupted", file=sys.stderr)
        return 130
