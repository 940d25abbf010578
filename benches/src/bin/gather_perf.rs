//! `gather_perf`: ODC gather across local ranks, nccl-tests style.
//!
//! ```text
//! gather_perf -g 2 -b 64K -e 64M -f 4 -n 20 -w 5 -d f32 [-J out.json]
//! ```
//! Every rank publishes its shard of one bucket per size (version 0), then
//! each iteration gathers the whole bucket from every owner. `size` is the
//! gathered buffer; busbw = algbw · (n − 1) / n. Like nccl-tests it times
//! an out-of-place run (`gather`: every shard, this rank's too, is copied
//! into the output) and an in-place one (`gather_remote`: this rank's shard
//! is already in the output, as in FSDP, whose all-gather input aliases its
//! output; only the n − 1 remote shards move).

use std::process::ExitCode;

use odc_benches::{
    decode, encode, make_in_place, make_row, pattern, perf_main, print_row, slowest_best,
    timed_interleaved, CopyWork, PerfArgs, PerfHelp, RankCtx, Row,
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
    let esz = dtype.size_bytes();
    let mut rows = Vec::new();
    for (b, &size) in sizes.iter().enumerate() {
        let id = odc_core::BucketId(b);
        let layout = engine.bucket(id).map_err(|e| e.to_string())?.clone();
        // Under hybrid sharding every node holds the same shards.
        let me = args.shard_index(rank);
        let shard: Vec<f32> = layout.shard_range(me).map(|i| pattern(me, i)).collect();
        worker
            .publish(id, &encode(&shard, dtype), dtype, 0)
            .map_err(|e| e.to_string())?;
        let mut out = vec![0u8; layout.numel() * esz];
        // In place: this rank's shard already sits in the output; only the
        // remote shards move.
        let mut out_ip = vec![0u8; layout.numel() * esz];
        let own = layout.shard_range(me);
        let own = own.start.min(layout.numel())..own.end.min(layout.numel());
        let mine = encode(&shard[..own.len()], dtype);
        out_ip[own.start * esz..own.end * esz].copy_from_slice(&mine);
        // The bytes a rank reads from its peers, copied without the engine
        // (rank 0's limit on buffers of its own). Out-of-place and in-place
        // run in separate loops, each interleaved with the ceiling and the
        // limit: in one loop the second would read shards the first has
        // just brought into the cache, which the ceiling's copy would not.
        let moved = ((size as usize) * (args.ranks - 1) / args.ranks).max(4);
        let mut ceiling_work = CopyWork::new(moved);
        let mut limit_work = (rank == 0).then(|| CopyWork::new(moved));
        let mut baselines = |op: &mut dyn FnMut(usize) -> Result<(), String>| {
            timed_interleaved(
                &page,
                args.warmup,
                args.iters,
                &mut [op, &mut |_| ceiling_work.run(), &mut |_| {
                    limit_work.as_mut().map_or(Ok(()), CopyWork::run)
                }],
            )
        };
        let oop = baselines(&mut |_| {
            worker
                .gather(id, 0, &mut out, dtype)
                .map_err(|e| e.to_string())
        })?;
        let ip = baselines(&mut |_| {
            worker
                .gather_remote(id, 0, &mut out_ip, dtype)
                .map_err(|e| e.to_string())
        })?;
        let times = [oop[0], ip[0]];
        page.report(rank, times[0].mean, count_wrong(args, &layout, &out));
        page.barrier()?;
        let row = (rank == 0).then(|| make_row(args, size, "none", &page, 0.0));
        page.barrier()?;
        page.report(rank, times[1].mean, count_wrong(args, &layout, &out_ip));
        page.barrier()?;
        let in_place = (rank == 0).then(|| make_in_place(args, size, &page));
        page.barrier()?;
        // [operation, ceiling, limit], each the slowest rank's fastest.
        let slow_oop = slowest_best(&page, rank, &oop)?;
        let slow_ip = slowest_best(&page, rank, &ip)?;
        if let (Some(mut row), Some(ip_row)) = (row, in_place) {
            row.in_place = Some(ip_row);
            // The better variant (by mean) and the baselines of its loop.
            let (op_t, base, slow) = if ip_row.busbw >= row.busbw {
                (ip[0], ip[1], slow_ip)
            } else {
                (oop[0], oop[1], slow_oop)
            };
            row.set_baselines(moved, &slow, op_t, base);
            print_row(&row);
            rows.push(row);
        }
        page.barrier()?;
    }
    Ok(rows)
}

/// Elements of a gathered `out` that differ from the pattern (0 unless `-c 1`).
fn count_wrong(args: &PerfArgs, layout: &odc_core::BucketLayout, out: &[u8]) -> u64 {
    if args.check == 0 {
        return 0;
    }
    let sl = layout.shard_len();
    decode(out, args.dtype)
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != pattern(i / sl, i))
        .count() as u64
}

const HELP: PerfHelp = PerfHelp {
    about: "ODC gather across local ranks, nccl-tests style, against the same copies done without the engine",
    examples: "\
Examples:
  gather_perf -g 2 -b 64K -e 64M -f 4 -n 20 -w 5
      2 ranks, 64 KiB to 64 MiB by 4x, f32, 20 timed iterations after 5
  gather_perf -g 4 -d bf16 -J gather.json
      4 ranks, bf16, the rows also as JSON
  gather_perf -g 2 --transport fabric
      over libfabric (built with --features fabric)

Columns: size count type redop | time algbw busbw #wrong, out of place and in
place (this rank's shard already in the output); GB = 1e9 B, busbw = algbw *
(n-1)/n; %ceil against the same reads done by every rank at once.",
};

fn main() -> ExitCode {
    perf_main("gather_perf", HELP, true, run)
}
