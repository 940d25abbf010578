//! `gather_perf`: ODC gather across local ranks, nccl-tests style.
//!
//! ```text
//! gather_perf -g 2 -b 64K -e 64M -f 4 -n 20 -w 5 -d f32 [-J out.json]
//! ```
//! Every rank publishes its shard of one bucket per size (version 0), then
//! each iteration gathers the whole bucket from every owner. `size` is the
//! gathered buffer; busbw = algbw · (n − 1) / n.

use std::process::ExitCode;

use odc_benches::{
    decode, encode, make_row, memcpy_gbps, pattern, perf_main, print_row, timed, PerfArgs, RankCtx,
    Row,
};

fn run(args: &PerfArgs, ctx: RankCtx) -> Result<Vec<Row>, String> {
    let RankCtx {
        rank,
        engine,
        page,
        sizes,
    } = ctx;
    let dtype = args.dtype;
    let esz = dtype.size_bytes();
    let mut rows = Vec::new();
    for (b, &size) in sizes.iter().enumerate() {
        let id = odc_core::BucketId(b);
        let layout = engine.bucket(id).map_err(|e| e.to_string())?.clone();
        let shard: Vec<f32> = layout.shard_range(rank).map(|i| pattern(rank, i)).collect();
        engine
            .publish(id, &encode(&shard, dtype), dtype, 0)
            .map_err(|e| e.to_string())?;
        let mut out = vec![0u8; layout.numel() * esz];
        let mean = timed(&page, args.warmup, args.iters, |_| {
            engine
                .gather(id, 0, &mut out, dtype)
                .map_err(|e| e.to_string())
        })?;
        let mut wrong = 0u64;
        if args.check != 0 {
            let got = decode(&out, dtype);
            let sl = layout.shard_len();
            wrong = got
                .iter()
                .enumerate()
                .filter(|&(i, &v)| v != pattern(i / sl, i))
                .count() as u64;
        }
        page.report(rank, mean, wrong);
        page.barrier()?;
        if rank == 0 {
            let moved = (size as usize) * (args.ranks - 1) / args.ranks;
            let row = make_row(args, size, "none", &page, memcpy_gbps(moved.max(1)));
            print_row(&row);
            rows.push(row);
        }
        page.barrier()?;
    }
    Ok(rows)
}

fn main() -> ExitCode {
    perf_main("gather_perf", run)
}
