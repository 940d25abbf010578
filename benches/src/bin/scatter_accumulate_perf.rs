//! `scatter_accumulate_perf`: ODC scatter-accumulate across local ranks,
//! nccl-tests style.
//!
//! ```text
//! scatter_accumulate_perf -g 2 -b 64K -e 64M -f 4 -n 20 -w 5 -d f32 [-J out.json]
//! ```
//! Each iteration pushes the whole gradient bucket (every owner's slice) and
//! finishes the minibatch, which returns once this rank's own gradient shard
//! is final — the semantics of a reduce-scatter. `size` is the pushed
//! buffer; busbw = algbw · (n − 1) / n. Sums are checked at the end of each
//! size (integer-valued data, exact in every dtype).

use std::process::ExitCode;

use odc_benches::{
    encode, make_row, pattern, perf_main, print_row, slowest_best, timed_interleaved, CopyAddPipe,
    PerfArgs, PerfHelp, RankCtx, Row,
};

fn run(args: &PerfArgs, ctx: RankCtx) -> Result<Vec<Row>, String> {
    let RankCtx {
        rank,
        engine,
        page,
        sizes,
    } = ctx;
    let worker = engine.host().map_err(|e| e.to_string())?;
    let dtype = args.dtype;
    let mut rows = Vec::new();
    let mut minibatch = 0u64;
    let chunk = engine.config().chunk_bytes;
    for (b, &size) in sizes.iter().enumerate() {
        let id = odc_core::BucketId(b);
        let layout = engine.bucket(id).map_err(|e| e.to_string())?.clone();
        let grads: Vec<f32> = (0..layout.numel()).map(|i| pattern(rank, i)).collect();
        let grads = encode(&grads, dtype);
        // Every push of the previous size was acknowledged before the
        // barrier that ended it, so zeroing here races with nothing.
        worker.zero_grad(id).map_err(|e| e.to_string())?;
        // The bytes a rank pushes to its peers and its f32 accumulator,
        // copied and added without the engine in the engine's thread layout.
        let moved = ((size as usize) * (args.ranks - 1) / args.ranks).max(4);
        let mut pipe = CopyAddPipe::new(moved, layout.shard_len() * 4, chunk)?;
        let times = {
            let (pipe, worker) = (std::cell::RefCell::new(&mut pipe), &worker);
            timed_interleaved(
                &page,
                args.warmup,
                args.iters,
                &mut [
                    &mut |_| {
                        worker
                            .scatter_accumulate(id, &grads, dtype, 1.0)
                            .map_err(|e| e.to_string())?;
                        worker
                            .finish_minibatch(minibatch)
                            .map_err(|e| e.to_string())?;
                        minibatch += 1;
                        Ok(())
                    },
                    &mut |_| pipe.borrow_mut().run(),
                    &mut |_| {
                        if rank == 0 {
                            pipe.borrow_mut().run()
                        } else {
                            Ok(())
                        }
                    },
                ],
            )?
        };
        let mut wrong = 0u64;
        if args.check != 0 {
            let mut acc = vec![0f32; layout.shard_len()];
            worker
                .read_grad_shard(id, &mut acc)
                .map_err(|e| e.to_string())?;
            let reps = (args.warmup + args.iters) as f32;
            let range = layout.shard_range(args.shard_index(rank));
            for (j, i) in range.enumerate() {
                let want = if i < layout.numel() {
                    reps * (0..args.ranks).map(|r| pattern(r, i)).sum::<f32>()
                } else {
                    0.0
                };
                if acc[j] != want {
                    wrong += 1;
                }
            }
        }
        page.report(rank, times[0].mean, wrong);
        page.barrier()?;
        let row = (rank == 0).then(|| make_row(args, size, "sum", &page, 0.0));
        page.barrier()?;
        // [operation, ceiling, limit], each the slowest rank's fastest.
        let slow = slowest_best(&page, rank, &times)?;
        if let Some(mut row) = row {
            row.set_baselines(moved, &slow, times[0], times[1]);
            print_row(&row);
            rows.push(row);
        }
        page.barrier()?;
    }
    Ok(rows)
}

const HELP: PerfHelp = PerfHelp {
    about: "ODC scatter-accumulate across local ranks, nccl-tests style, against the same copies and adds done \
            without the engine",
    examples: "\
Examples:
  scatter_accumulate_perf -g 2 -b 64K -e 64M -f 4 -n 20 -w 5
      2 ranks, 64 KiB to 64 MiB by 4x, f32, 20 timed iterations after 5
  scatter_accumulate_perf -g 4 -d bf16 -J scatter.json
      4 ranks, bf16 gradients, the rows also as JSON
  scatter_accumulate_perf -g 2 -b 256K -e 64M --deterministic
      into the exact (deterministic) accumulator

Each iteration pushes the whole bucket and finishes the minibatch (a
reduce-scatter's semantics). Columns: size count type redop | time algbw
busbw #wrong; GB = 1e9 B, busbw = algbw * (n-1)/n.",
};

fn main() -> ExitCode {
    perf_main("scatter_accumulate_perf", HELP, false, run)
}
