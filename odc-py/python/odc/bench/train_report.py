"""The ``odc-bench train`` command: planning the sweep points, launching the ranks, tables, JSON and plots.

The rank side (model, data, the cost fit, the training runs) is
:mod:`odc.bench.train`. This module turns rank 0's results into the
measured-versus-predicted table (the paper's Tables 5–6), the loss curves
(its Figure 14) and their checks.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Any

from .report import UsageError, fmt, png_metadata, table

__all__ = ["PAIRS", "SAME_SAMPLES_TOLERANCE", "command", "pairs", "plot_curves", "render", "render_curves",
           "render_memory", "render_pairs", "summarize"]

# LongAlign's lengths (lognormal, median 10 000, max 65 536) scaled down 32x: what a CPU core trains in seconds.
DEFAULT_SYNTHETIC = "lognormal:n=4096,median=312,sigma=1.0,max=2048,seed=0"
CURVE_CONFIGS = ("collective+lb-micro", "odc+lb-mini", "collective+local-sort", "odc+lb-mini+int8",
                 "odc+lb-mini+int8-nofb", "odc+lb-mini+fp8g-int8")
"""What ``--curves`` trains: the baseline, ODC + LB-Mini, the float-reordering control and ODC + LB-Mini with int8
pushes (error feedback on and off) and with fp8 gathers and int8 pushes; ``--configs`` may add other compressed ones
(``odc.bench.train.COMPRESSED``)."""
# A compressed curve's target: within this many times the control's distance from the uncompressed run.
COMPRESSED_FACTOR = 2.0
# Minibatch 0 warms up (FSDP's lazy init, the first collectives, AdamW's state): it trains but is not timed.
WARMUP_MINIBATCHES = 1


def command(args: argparse.Namespace, spec_: Any) -> int:
    """Runs ``odc-bench train`` (the parsed command line, the model to train); returns the exit status."""
    from odc import packing
    from odc.errors import PackingError

    from . import (
        _check_outputs,
        _check_straggler,
        _input_lengths,
        _minibatch_sizes,
        _parse_configs,
        _progress_flag,
        _title,
        launch,
        train,
    )
    from .report import LoadSampler, Progress, say_written, write_json

    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else args.world
    if world < 2:
        raise UsageError(f"--world {world}: need at least 2 ranks")
    cores = os.cpu_count() or 1
    if world > cores and not launch.under_torchrun():
        raise UsageError(f"--world {world}: real compute needs a core per rank and this host has {cores}")
    if args.curves:
        extra = [c for c in _parse_configs(args.configs, "train") if c in train.COMPRESSED and c not in CURVE_CONFIGS]
        configs = [*CURVE_CONFIGS, *extra]
    else:
        configs = _parse_configs(args.configs, "train")
    straggler = args.straggler
    _check_straggler(straggler, world)
    if straggler is not None:
        rank, factor = straggler
        if factor < 1:
            raise UsageError(f"--straggler {rank}:{factor:g}: real compute cannot be sped up; the factor must be "
                             f">= 1")
    minimum = 1 if args.curves else WARMUP_MINIBATCHES + 1
    if args.minibatches < minimum:
        raise UsageError(f"--minibatches {args.minibatches}: need at least {minimum} (minibatch 0 is not timed)")
    base, spec = _input_lengths(args, DEFAULT_SYNTHETIC)
    src = f"--lengths {args.lengths}" if spec is None else f"--synthetic {spec}"
    sizes = _minibatch_sizes(args, "train")
    points = []
    for m in sizes:
        n = args.minibatches * m * world
        if n > len(base):
            raise UsageError(f"minibatch size {m}: {args.minibatches} minibatches of {world} x {m} samples need {n} "
                             f"lengths, the input has {len(base)}")
        lengths = list(base[:n])
        try:
            packing.plan(lengths, world, m, "lb-mini", args.max_tokens, "linear")
        except PackingError as e:
            raise UsageError(f"planning failed (minibatch size {m}): {e}") from None
        points.append({"label": m, "lengths": lengths, "minibatch_size": m, "max_tokens": args.max_tokens})
    _check_outputs(args)
    every = sorted({s for p in points for s in p["lengths"]})
    fit_lengths = train.fit_lengths(every)
    repeats = 1 if args.curves else args.repeats
    # A step for the cost fit, one for each communication mode's fixed costs (not with --curves), one per run.
    calibrated = 0 if args.curves else len({train.plan_mode(mode) for name, mode, _ in train.CONFIGS
                                            if name in configs})
    bar = Progress(1 + calibrated + len(points) * len(configs) * repeats, f"train {world} ranks",
                   _progress_flag(args))
    from dataclasses import asdict

    with LoadSampler() as load:
        out = launch.run_ranks(
            train.train_rank, world, backend="gloo",
            on_event=lambda kind, note: bar.step(note) if kind == "progress" else None,
            spec=asdict(spec_), points=points, configs=configs, repeats=repeats, fit_lengths=fit_lengths,
            fit_repeats=args.fit_repeats, lr=args.lr, clip=args.clip, timeout=args.timeout, seed=args.seed,
            skip=0 if args.curves else WARMUP_MINIBATCHES, calibrate=not args.curves, straggler=straggler)
    bar.close()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    fit = out["fit"]
    head = [
        _title("train"),
        load.describe(),
        f"{world} ranks x 1 thread (REAL COMPUTE), FSDP2 on CPU, {spec_.describe()}, fp32, AdamW lr {args.lr:g}, "
        f"torch clip_grad_norm_ {args.clip:g}; varlen attention (per-sample causal sdpa)",
        f"{src}; max tokens {args.max_tokens}; {args.minibatches} minibatches per run; collective = FSDP2's gloo "
        f"collectives (TCP loopback), odc = odc.fsdp.enable (shm)",
        f"cost model fitted in this run (odc.packing.fit_cost, single samples on an unsharded copy, every rank at "
        f"once): {fit['cost']} = {fit['a']:.3e}*s^2 + {fit['b']:.3e}*s seconds; residual rms "
        f"{100 * fit['rms_relative']:.1f}% (max {100 * fit['max_relative']:.1f}%); fixed cost per call "
        f"{1e3 * fit['overhead_s']:.1f} ms (not in the model)",
    ]
    if straggler is not None:
        head.append(f"straggler: rank {straggler[0]} computes {straggler[1]:g}x slower (after every microbatch it "
                    f"runs it sleeps {straggler[1] - 1:g}x the microbatch's CPU time), in every configuration's "
                    f"runs; not in the cost fit nor the fixed-cost calibration: the predictions (packer, +fixed) "
                    f"ignore it, the steal bound does not")
    doc = {"bench": "train", "load_average": os.getloadavg(), "load_samples": load.samples, "cpus": cores,
           "emulated_compute": False, "overheads": out["overheads"],
           "args": {k: v for k, v in vars(args).items() if k not in ("func",)}, "world": world,
           "model": asdict(spec_), "configs": configs, "fit": fit, "fit_timings": out["fit_timings"],
           "fit_lengths": fit_lengths}
    if args.curves:
        curves = out["points"][0]
        summary = curves_summary(curves, configs)
        print(render_curves(summary, head), flush=True)
        doc.update(curves=summary, runs=curves["runs"], diffs=curves["diffs"])
        if args.json:
            write_json(args.json, doc)
        if args.plot:
            plot_curves(summary, args.plot, f"odc-bench train --curves: {world} ranks, {spec_.describe()}\n"
                                            f"{src}, minibatch size {args.minibatch_size}")
        say_written(args.json, args.plot)
        return 0 if summary["ok"] else 1
    rows = summarize(points, out["points"], configs, fit, world)
    ovh = out["overheads"]
    head.append("fixed costs the per-sample model leaves out, measured apart (minibatches of 1 and 4 microbatches of "
                f"a {train.CALIBRATION_LENGTH}-token sample; accum = FSDP2's accumulation): per microbatch "
                + ", ".join(f"{m} {1e3 * o['microbatch_s']:.1f} ms" for m, o in ovh.items()) + "; per minibatch "
                + ", ".join(f"{m} {1e3 * o['minibatch_s']:.1f} ms" for m, o in ovh.items())
                + "; lb-micro plans with the collectives' fixed costs, lb-mini with those of the mode that runs it "
                  "(dummy-pad: the collectives')")
    sources = {r["plan_source"] for r in rows if r["strategy"] == "verl-maxcount"}
    if sources:
        head.append(f"without ODC: verl-maxcount = verl's split to the largest count (plans by {', '.join(sources)}), "
                    "dummy-pad = lb-mini padded with zero-loss microbatches, both over gloo; fsdp2-accum = lb-mini "
                    "under FSDP2's gradient accumulation (no sync but at each rank's last microbatch)")
    head.append(f"timed: minibatches {WARMUP_MINIBATCHES}..{args.minibatches - 1} (minibatch 0 warms up); "
                f"{repeats} interleaved repeats; speedup vs {train.BASELINE}: median of per-repeat ratios [min..max]; "
                f"packer = predicted by odc.packing with the fitted model (compute only); +fixed = the same plans "
                f"with the fixed costs added; error = measured / predicted - 1")
    head.append("dparam: largest |difference| of the final parameters from the collective run with the same plan "
                "(odc+lb-mini: the baseline; odc+lb-mini+steal: odc+lb-mini, the same plan without stealing, else "
                "the baseline; a +det configuration: the same one without +det, else its reference; 0 = bitwise "
                "equal; over "
                f"{PARAM_TOLERANCE:g} fails the run); vs base: from the baseline (the same samples packed "
                "differently: reordered float sums); loss: largest |difference| of a minibatch's loss from the "
                "baseline")
    print(render(rows, head, len(points) > 1), flush=True)
    print(render_time(rows, len(points) > 1), flush=True)
    print(render_memory(rows, len(points) > 1), flush=True)
    found = pairs(rows)
    if found:
        print(render_pairs(found, len(points) > 1), flush=True)
    doc["rows"] = rows
    doc["pairs"] = found
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot_speedups(rows, args.plot, f"odc-bench train: {world} ranks, REAL compute, {spec_.describe()}\n"
                                       f"{src}, max tokens {args.max_tokens}; measured: median and min-max of "
                                       f"{repeats} interleaved repeats")
    say_written(args.json, args.plot)
    bad = [r for r in rows if not r["params_ok"]]
    for r in bad:
        print(f"odc-bench: error: {r['config']} (minibatch size {r['label']}): final parameters differ from "
              f"{r['same_plan']} by {r['dparam']:.3g}", file=sys.stderr)
    return 1 if bad else 0


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _timed(run: dict[str, Any]) -> float:
    """Seconds of the timed minibatches (after the warm-up ones) of one run."""
    return float(run["timed_s"])


# A same-plan ODC run whose parameters differ from the collective's by more than this is flagged wrong:
# reordered f32 sums move AdamW's parameters by ~1e-6 to 1e-5 here; a lost or doubled gradient by ~lr = 1e-3.
PARAM_TOLERANCE = 1e-4


def _where_time_went(runs: list[dict[str, Any]], lengths: list[int], fit: dict[str, Any], world: int) -> dict[str, Any]:
    """Cost-model-free figures of the timed minibatches, over every rank and run.

    ``micro_over_fit``: seconds the microbatches took (forward + backward,
    waits inside them included) over what the fitted model predicts for
    them; ``busy``: the fraction of ``world x wall time`` ranks spent inside
    microbatches. Under ODC nothing waits inside a microbatch but a first
    gather, so ``1 - busy`` is the measured bubble (plus optimizer steps).
    """
    a: float = fit["a"]
    b: float = fit["b"]

    def cost(mb: list[int]) -> float:
        return sum(a * lengths[i] ** 2 + b * lengths[i] for i in mb)

    measured = predicted = 0.0
    busy = []
    for run in runs:
        inside = 0.0
        for rank in run["micro"]:
            for k, mb, t in rank:
                if k >= WARMUP_MINIBATCHES:
                    measured += t
                    predicted += cost(mb)
                    inside += t
        busy.append(inside / (world * run["timed_s"]) if run["timed_s"] > 0 else float("nan"))
    return {"micro_over_fit": _ratio(measured, predicted), "busy": statistics.median(busy)}


def summarize(points: list[dict[str, Any]], results: list[dict[str, Any]], configs: list[str], fit: dict[str, Any],
              world: int) -> list[dict[str, Any]]:
    """One row per (point, configuration): measured and predicted speedup, spread, checks."""
    from .train import BASELINE, CONFIGS, same_plan, steals

    strategies = {name: strategy for name, _, strategy in CONFIGS}
    modes = {name: mode for name, mode, _ in CONFIGS}

    rows = []
    for point, res in zip(points, results, strict=True):
        base_runs = res["runs"][BASELINE]
        for name in configs:
            runs = res["runs"][name]
            pred = res["predictions"][name]
            times = [_timed(r) for r in runs]
            ratios = [_ratio(_timed(b), _timed(r)) for b, r in zip(base_runs, runs, strict=True)]
            speedup = statistics.median(ratios)
            same = same_plan(name, configs)
            dparam = 0.0 if same == name else res["diffs"].get(f"{name} vs {same}", {}).get("max_abs", float("nan"))
            dloss = max(abs(a - b) for a, b in zip(runs[0]["losses"], base_runs[0]["losses"], strict=True))
            n_timed = len(runs[0]["minibatch_s"]) - WARMUP_MINIBATCHES
            rows.append({
                "label": point["label"],
                "minibatch_size": point["minibatch_size"],
                "max_tokens": point["max_tokens"],
                "config": name,
                "mode": modes[name],
                "strategy": strategies[name],
                "plan_source": pred.get("source"),
                "steal": steals(name),
                "microbatches": pred["microbatches"],
                "max_microbatches": max(max(m) for m in pred["microbatches"]),
                "time_per_minibatch_s": statistics.median(times) / max(1, n_timed),
                "time_spread_s": [min(times) / max(1, n_timed), max(times) / max(1, n_timed)],
                "predicted_time_per_minibatch_s": pred["seconds"] / max(1, n_timed),
                "bubble_predicted": pred["bubble"],
                "speedup_measured": speedup,
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
                "speedup_predicted": pred["speedup"],
                "error": _ratio(speedup, pred["speedup"]) - 1.0,
                "predicted_time_with_overheads_s": pred["seconds_with_overheads"] / max(1, n_timed),
                "speedup_predicted_with_overheads": pred["speedup_with_overheads"],
                "error_with_overheads": _ratio(speedup, pred["speedup_with_overheads"]) - 1.0,
                "same_plan": same,
                "dparam": dparam,
                "dparam_baseline": 0.0 if name == BASELINE else res["diffs"].get(f"{name} vs {BASELINE}", {}).get(
                    "max_abs", float("nan")),
                "params_ok": not (dparam > PARAM_TOLERANCE) and not math.isnan(dparam),
                # The first minibatch's gradients against the baseline's, relative to their largest entry (absent
                # from runs made before the check existed).
                "dgrad_baseline": 0.0 if name == BASELINE else res["diffs"].get(f"{name} vs {BASELINE}", {}).get(
                    "grad0_rel"),
                "dloss": dloss,
                # Microbatches run by a rank other than their owner, per timed minibatch (median over repeats).
                "stolen_per_minibatch": statistics.median(sum(r["stolen"][WARMUP_MINIBATCHES:]) / max(1, n_timed)
                                                          for r in runs) if steals(name) else None,
                "steal_bound": pred.get("steal_bound"),
                **_where_time_went(runs, point["lengths"], fit, world),
                "memory": _memory(runs),
                "runs": runs,
            })
            r = rows[-1]
            r["within_target"] = (r["dloss"] <= SAME_SAMPLES_TOLERANCE
                                  and (name == BASELINE or r["dparam_baseline"] <= SAME_SAMPLES_TOLERANCE))
    return rows


SAME_SAMPLES_TOLERANCE = 1e-5
"""What every configuration's losses and final parameters should stay within from collective + LB-Micro on the
same samples (reported per row; PARAM_TOLERANCE, against the same plan, is what fails a run)."""


def _memory(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's memory per rank, the largest over ranks: peak resident set (median over the repeats, and
    its rise over the run's start), the most parameter and gradient bytes held between microbatches, ODC's shared
    memory."""
    def worst(key: str, run: dict[str, Any]) -> Any:
        values = [m[key] for m in run["memory"]]
        return None if any(v is None for v in values) else max(values)

    peaks: list[int | None] = [worst("rss_peak", r) for r in runs]
    starts: list[int | None] = [worst("rss_start", r) for r in runs]
    rises = [p - s for p, s in zip(peaks, starts, strict=True) if p is not None and s is not None]
    known = [p for p in peaks if p is not None]
    return {
        "rss_peak": statistics.median(known) if len(known) == len(peaks) else None,
        "rss_rise": statistics.median(rises) if len(rises) == len(peaks) else None,
        "held": max(worst("held", r) for r in runs),
        "odc_shm": worst("odc_shm", runs[0]),
    }


PAIRS = ("odc+lb-micro", "verl-maxcount", "dummy-pad", "fsdp2-accum", "collective+lb-micro")
"""The configurations :func:`pairs` sets ODC + LB-Mini against, where both ran."""


def pairs(rows: list[dict[str, Any]], subject: str = "odc+lb-mini") -> list[dict[str, Any]]:
    """ODC + LB-Mini against each configuration of ``PAIRS`` that ran, per minibatch size: the measured ratio of
    times (median of the per-repeat ratios of the interleaved runs, min and max), the packer's compute-only
    prediction and the prediction with the fixed costs, and the error of each."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        at = {r["config"]: r for r in rows if r["label"] == label}
        if subject not in at:
            continue
        me = at[subject]
        for other in PAIRS:
            if other not in at:
                continue
            them = at[other]
            ratios = [_ratio(_timed(b), _timed(a)) for a, b in zip(me["runs"], them["runs"], strict=True)]
            measured = statistics.median(ratios)
            packer = _ratio(me["speedup_predicted"], them["speedup_predicted"])
            fixed = _ratio(me["speedup_predicted_with_overheads"], them["speedup_predicted_with_overheads"])
            out.append({"label": label, "subject": subject, "other": other, "measured": measured,
                        "min": min(ratios), "max": max(ratios), "packer": packer, "error": _ratio(measured, packer) - 1,
                        "with_fixed": fixed, "error_with_fixed": _ratio(measured, fixed) - 1,
                        "memory": {"subject": me["memory"], "other": them["memory"]}})
    return out


def render_pairs(found: list[dict[str, Any]], sweep: bool) -> str:
    """ODC + LB-Mini against each other configuration: measured and predicted ratios."""
    header = ["odc+lb-mini vs", "measured", "[min..max]", "packer", "error", "+fixed", "error"]
    widths = [22, 9, 13, 8, 7, 8, 7]
    if sweep:
        header.insert(0, "minibatch-size")
        widths.insert(0, 14)
    body = []
    for p in found:
        cells = [p["other"], f"{p['measured']:.3f}x", f"{p['min']:.3f}..{p['max']:.3f}", f"{p['packer']:.3f}x",
                 _pct(p["error"]), f"{p['with_fixed']:.3f}x", _pct(p["error_with_fixed"])]
        if sweep:
            cells.insert(0, p["label"])
        body.append(cells)
    title = ["odc+lb-mini against each configuration, the same minibatches: time of the other / time of odc+lb-mini "
             "(median of the per-repeat ratios of the interleaved runs); packer and +fixed: the same ratio predicted "
             "from the fitted costs alone and with the fixed costs measured before the runs"]
    return table(header, body, widths, title)


def render_memory(rows: list[dict[str, Any]], sweep: bool) -> str:
    """Memory per rank of every configuration and the same-samples check against the baseline."""
    header = ["config", "RSS peak", "RSS rise", "params+grads held", "ODC shm", "loss vs base", "params vs base",
              f"<= {SAME_SAMPLES_TOLERANCE:g}", "grad0 vs base"]
    widths = [22, 10, 10, 17, 9, 12, 14, 8, 13]
    if sweep:
        header.insert(0, "minibatch-size")
        widths.insert(0, 14)

    def mib(v: Any) -> str:
        return "-" if v is None else f"{v / 2**20:.1f}M"

    body = []
    for r in rows:
        m = r["memory"]
        cells = [r["config"], mib(m["rss_peak"]), mib(m["rss_rise"]), f"{m['held'] / 2**10:.0f}K", mib(m["odc_shm"]),
                 f"{r['dloss']:.1e}", "-" if r["dparam_baseline"] == 0 else f"{r['dparam_baseline']:.1e}",
                 "yes" if r["within_target"] else "NO",
                 "-" if not r.get("dgrad_baseline") else f"{r['dgrad_baseline']:.1e}"]
        if sweep:
            cells.insert(0, r["label"])
        body.append(cells)
    title = ["memory per rank (largest over ranks): RSS peak = the process's peak resident set during the run (CPU: "
             "no allocator figures; median of the repeats), RSS rise = peak - resident set at the run's start, "
             "params+grads held = the most bytes of parameter and gradient storage FSDP held after a microbatch "
             "(sharded and unsharded, from the tensors), ODC shm = the engine's shared memory (published shards, "
             "landing slots); loss / params vs base: largest |difference| of a minibatch's loss and of the final "
             "parameters from collective+lb-micro on the same samples; grad0 vs base: largest |difference| of the "
             "first minibatch's gradients from the baseline's over their largest |entry| (reordered f32 sums: "
             "~1e-7; a lost or doubled microbatch: ~1e-2 and up)"]
    return table(header, body, widths, title)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%" if not math.isnan(x) else "-"


def render(rows: list[dict[str, Any]], title: list[str], sweep: bool) -> str:
    """The measured and predicted speedups as a table, ``title`` lines first, one row per configuration."""
    from .train import BASELINE

    header = ["config", "mb/rank", "t/minibatch(s)", "[min..max]", "speedup", "[min..max]", "packer", "error",
              "+fixed", "error", "dparam", "vs base", "loss"]
    widths = [22, 7, 14, 13, 8, 13, 7, 7, 7, 7, 8, 8, 8]
    if sweep:
        header.insert(0, "minibatch-size")
        widths.insert(0, 14)

    def pct(x: float) -> str:
        return f"{100 * x:+.1f}%" if not math.isnan(x) else "-"

    body = []
    for r in rows:
        cells = [r["config"], r["max_microbatches"], fmt(r["time_per_minibatch_s"], 3),
                 f"{r['time_spread_s'][0]:.3f}..{r['time_spread_s'][1]:.3f}",
                 fmt(r["speedup_measured"], 3) + "x", f"{r['speedup_min']:.3f}..{r['speedup_max']:.3f}",
                 fmt(r["speedup_predicted"], 3) + "x", pct(r["error"]),
                 fmt(r["speedup_predicted_with_overheads"], 3) + "x", pct(r["error_with_overheads"]),
                 "-" if r["same_plan"] == r["config"] else f"{r['dparam']:.1e}",
                 "-" if r["config"] == BASELINE else f"{r['dparam_baseline']:.1e}", f"{r['dloss']:.1e}"]
        if sweep:
            cells.insert(0, r["label"])
        body.append(cells)
    return table(header, body, widths, title)


def render_time(rows: list[dict[str, Any]], sweep: bool) -> str:
    """Where the time went: microbatch seconds against the fitted model, busy fraction against the prediction."""
    header = ["config", "t/minibatch(s)", "packer(s)", "+fixed(s)", "micro/fit", "busy", "pred busy", "stolen/mb",
              "steal bound"]
    widths = [22, 14, 9, 9, 9, 7, 9, 9, 11]
    if sweep:
        header.insert(0, "minibatch-size")
        widths.insert(0, 14)
    body = []
    for r in rows:
        cells = [r["config"], fmt(r["time_per_minibatch_s"], 3), fmt(r["predicted_time_per_minibatch_s"], 3),
                 fmt(r["predicted_time_with_overheads_s"], 3), f"{r['micro_over_fit']:.3f}", f"{100 * r['busy']:.1f}%",
                 f"{100 * (1 - r['bubble_predicted']):.1f}%",
                 "-" if r["stolen_per_minibatch"] is None else f"{r['stolen_per_minibatch']:.2f}",
                 "-" if r["steal_bound"] is None else f"{100 * (1 - r['steal_bound']):.1f}%"]
        if sweep:
            cells.insert(0, r["label"])
        body.append(cells)
    title = ["where the time went (timed minibatches, every rank and repeat): t/minibatch measured, packer = the "
             "fitted costs alone, +fixed = with the measured fixed costs; micro/fit = seconds inside "
             "microbatches (forward + backward, collectives' waits included) / the fitted model's prediction for "
             "them; busy = time inside microbatches / (ranks x wall time), predicted = 1 - predicted bubble (under "
             "ODC 1 - busy is the measured bubble plus optimizer steps); stolen/mb = microbatches a rank ran from "
             "another rank's list, per minibatch (median of the repeats); steal bound = the busy fraction the "
             "stealing policy reaches on the fitted costs (and the straggler) with no fixed costs and no delays: "
             "microbatches are not split, so a minibatch still ends ragged by up to one"]
    return table(header, body, widths, title)


def plot_speedups(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Per minibatch size, per configuration: measured speedup (median, min-max) beside both predictions."""
    from .report import require_matplotlib

    plt = require_matplotlib()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels) + 1, 4.6), sharey=True, squeeze=False)
    width = 0.27
    for ax, label in zip(axes[0], labels, strict=True):
        sel = [r for r in rows if r["label"] == label]
        xs = range(len(sel))
        measured = [r["speedup_measured"] for r in sel]
        err = [[m - r["speedup_min"] for m, r in zip(measured, sel, strict=True)],
               [r["speedup_max"] - m for m, r in zip(measured, sel, strict=True)]]
        ax.bar([x - width for x in xs], measured, width, yerr=err, capsize=3, color="C0", label="measured")
        ax.bar(list(xs), [r["speedup_predicted"] for r in sel], width, color="C1",
               label="predicted: packer, fitted per-sample costs")
        ax.bar([x + width for x in xs], [r["speedup_predicted_with_overheads"] for r in sel], width, color="C2",
               label="predicted: + measured fixed costs")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["config"].replace("+", "\n") for r in sel], fontsize=7)
        ax.set_title(f"minibatch size {label}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    top = max(max(r["speedup_max"], r["speedup_predicted"], r["speedup_predicted_with_overheads"]) for r in rows)
    axes[0][0].set_ylim(0, 1.3 * top)
    axes[0][0].set_ylabel(f"speedup vs {rows[0]['config']}")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=png_metadata())  # which run drew it (the docs check it)
    plt.close(fig)


# -- convergence ---------------------------------------------------------------------------------------


def curves_summary(res: dict[str, Any], configs: list[str]) -> dict[str, Any]:
    """Loss curves of every configuration and how far each strays from the baseline.

    ``collective+local-sort`` is the control: the same collectives, the
    same samples per minibatch, only packed differently, so its distance
    from the baseline is what reordering float sums alone does. ODC +
    LB-Mini passes when its distance is within 4x the control's (or below
    1e-5 in loss). Each compressed configuration (``odc.bench.train.COMPRESSED``)
    is measured against the uncompressed run of the same plan (ODC +
    LB-Mini) and the baseline, largest and mean ``|loss difference|``, and
    held against ``COMPRESSED_FACTOR`` times the control's distance
    (reported, not part of ``ok``).
    """
    from .train import BASELINE, COMPRESSED

    base = res["runs"][BASELINE][0]["losses"]
    curves = {name: res["runs"][name][0]["losses"] for name in configs}
    dist = {name: max(abs(a - b) for a, b in zip(curves[name], base, strict=True))
            for name in configs if name != BASELINE}
    control = "collective+local-sort"
    odc_name = "odc+lb-mini"
    bound = max(4 * dist.get(control, 0.0), 1e-5)
    mean = {name: statistics.mean(abs(a - b) for a, b in zip(curves[name], base, strict=True))
            for name in configs if name != BASELINE}
    compressed = {}
    plain = curves.get(odc_name)
    for name in configs:
        if name not in COMPRESSED or plain is None:
            continue
        gaps = [abs(a - b) for a, b in zip(curves[name], plain, strict=True)]
        compressed[name] = {"compress": COMPRESSED[name], "max_vs_odc": max(gaps), "mean_vs_odc": statistics.mean(gaps),
                            "max_vs_baseline": dist[name], "mean_vs_baseline": mean[name],
                            "bound": COMPRESSED_FACTOR * dist.get(control, 0.0),
                            "within": max(gaps) <= COMPRESSED_FACTOR * dist.get(control, 0.0)}
    return {
        "losses": curves,
        "norms": {name: res["runs"][name][0]["norms"] for name in configs},
        "max_abs_loss_diff": dist,
        "mean_abs_loss_diff": mean,
        "compressed": compressed,
        "param_diffs": dict(res["diffs"]),
        "bound": bound,
        "fall": (base[0] - min(base[-5:])) if len(base) >= 5 else base[0] - base[-1],
        "ok": dist.get(odc_name, 0.0) <= bound,
    }


def render_curves(s: dict[str, Any], title: list[str]) -> str:
    """The loss curves' summary as a table: losses every few minibatches and the largest gaps."""
    names = list(s["losses"])
    n = len(s["losses"][names[0]])
    step = max(1, n // 12)
    picks = sorted(set(range(0, n, step)) | {n - 1})
    header = ["minibatch", *names]
    body = [[k, *[f"{s['losses'][c][k]:.6f}" for c in names]] for k in picks]
    out = [table(header, body, [9, *[max(12, len(c)) for c in names]], title)]
    for name, d in s["max_abs_loss_diff"].items():
        pd = {k: v for k, v in s["param_diffs"].items() if k.startswith(name + " vs ")}
        pd_txt = "; ".join(f"final parameters {k}: max |diff| {v['max_abs']:.2e}, relative norm {v['rel_norm']:.2e}"
                           for k, v in pd.items())
        out.append(f"# {name}: largest |loss difference| from collective+lb-micro {d:.2e}; {pd_txt}")
    out.append(f"# loss fell by {s['fall']:.3f} (first minibatch to the best of the last 5); "
               f"collective+local-sort differs from collective+lb-micro only in the order of float sums: the bound "
               f"for odc+lb-mini is 4x its distance ({s['bound']:.2e}): {'within' if s['ok'] else 'OUTSIDE'}")
    control = s["max_abs_loss_diff"].get("collective+local-sort", 0.0)
    for name, c in s.get("compressed", {}).items():
        out.append(f"# {name} (compress={c['compress']}): from odc+lb-mini max {c['max_vs_odc']:.2e}, mean "
                   f"{c['mean_vs_odc']:.2e}; from collective+lb-micro max {c['max_vs_baseline']:.2e}, mean "
                   f"{c['mean_vs_baseline']:.2e}; {c['max_vs_odc'] / control if control else math.inf:.1f}x the "
                   f"control's distance ({control:.2e}): {'within' if c['within'] else 'OUTSIDE'} "
                   f"{COMPRESSED_FACTOR:g}x")
    return "\n".join(out)


def plot_curves(s: dict[str, Any], path: str, title: str) -> None:
    """Both loss curves on one figure, with the distance from the baseline below."""
    from .report import require_matplotlib

    plt = require_matplotlib()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = s["losses"]["collective+lb-micro"]
    styles = {"collective+lb-micro": ("-", 2.4, "C0"), "odc+lb-mini": ("--", 1.4, "C1"),
              "collective+local-sort": (":", 1.4, "C2"), "odc+lb-mini+int8": ("-.", 1.2, "C3"),
              "odc+lb-mini+int8-nofb": ("-.", 1.0, "C4"), "odc+lb-mini+fp8g-int8": ("-", 1.0, "C5")}
    for name, losses in s["losses"].items():
        ls, lw, color = styles.get(name, ("-", 1.0, "black"))
        top.plot(range(len(losses)), losses, ls, lw=lw, color=color, label=name)
        if name != "collective+lb-micro":
            # Exactly equal losses have no place on a log scale: drawn at 1e-12.
            diffs = [max(abs(a - b), 1e-12) for a, b in zip(losses, base, strict=True)]
            bottom.semilogy(range(len(diffs)), diffs, ls, lw=1.2, color=color,
                            label=f"|{name} - collective+lb-micro|")
    top.set_ylabel("loss (mean over the minibatch's tokens)")
    top.set_title(title, fontsize=9)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_xlabel("minibatch (optimizer step)")
    bottom.set_ylabel("|loss difference|")
    bottom.grid(True, alpha=0.3, which="both")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=png_metadata())  # which run drew it (the docs check it)
    plt.close(fig)
