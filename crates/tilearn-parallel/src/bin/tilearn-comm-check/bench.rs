//! `tilearn-comm-check --bench`: bus bandwidth of the collectives on bf16 buffers, measured as
//! nccl-tests and `benches/pytorch_comm_baseline.py` measure it, so the two print comparable
//! lines: `iters` back-to-back in-place collectives after `warmup` ones, timed between two
//! events on the communication stream (NCCL) or by the host clock (host backend), the slowest
//! rank's time. For a buffer of S bytes over N ranks taking t seconds, algbw = S / t and busbw =
//! algbw × 2(N−1)/N for all-reduce, × (N−1)/N for reduce-scatter and all-gather (the bytes each
//! link carries, comparable across N).

use half::bf16;
use tilearn_parallel::{BufferMut, Communicator, ParallelError, ReduceOp, Result, Work};

use crate::backend::{Backend, Buffer};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub iters: usize,
    pub warmup: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            min_bytes: 1 << 20,
            max_bytes: 1 << 30,
            iters: 20,
            warmup: 5,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Op {
    const ALL: [Op; 3] = [Op::AllReduce, Op::ReduceScatter, Op::AllGather];

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `world` ranks.
    fn bus_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::ReduceScatter | Op::AllGather => (n - 1.0) / n,
        }
    }

    fn launch<'a>(self, comm: &'a dyn Communicator, buf: BufferMut<'a>) -> Result<Work<'a>> {
        match self {
            Op::AllReduce => comm.all_reduce(buf, ReduceOp::Sum),
            Op::ReduceScatter => comm.reduce_scatter(buf, ReduceOp::Sum),
            Op::AllGather => comm.all_gather(buf),
        }
    }
}

fn sizes(o: &BenchOptions, world: usize) -> Result<Vec<usize>> {
    let smallest = 2 * world;
    if o.min_bytes < smallest || o.min_bytes > o.max_bytes {
        return Err(ParallelError::Usage {
            flag: "--min-bytes/--max-bytes".into(),
            reason: format!(
                "need {smallest} ≤ --min-bytes ≤ --max-bytes (got {} and {})",
                o.min_bytes, o.max_bytes
            ),
        });
    }
    let mut out = Vec::new();
    let mut bytes = o.min_bytes;
    while bytes <= o.max_bytes {
        // Whole bf16 elements, a multiple of the world size (the sharded collectives need it).
        out.push((bytes / 2) / world * world);
        bytes *= 2;
    }
    Ok(out)
}

/// Seconds per collective of `op` on the first `elements` of `buffer`, the slowest rank's.
fn time_op(
    backend: &Backend,
    buffer: &mut Buffer<bf16>,
    op: Op,
    elements: usize,
    o: &BenchOptions,
) -> Result<f64> {
    let comm = backend.comm();
    for _ in 0..o.warmup {
        op.launch(comm, buffer.part(elements))?.wait()?;
    }
    comm.barrier()?;
    let start = backend.mark()?;
    let mut end = None;
    for i in 0..o.iters {
        let work = op.launch(comm, buffer.part(elements))?;
        if i + 1 == o.iters {
            // Marked before waiting, so host latency after the last collective is not counted.
            end = Some(backend.mark()?);
            work.wait()?;
        } else {
            // Collectives run in order on one stream: the last one's wait covers this one.
            drop(work);
        }
    }
    let end = end.expect("iters is at least 1");
    let seconds = start.seconds_to(&end)? / o.iters as f64;
    let slowest = backend.all_reduce(vec![seconds as f32], ReduceOp::Max)?;
    Ok(f64::from(slowest[0]))
}

pub fn run(backend: &Backend, o: &BenchOptions) -> Result<()> {
    let comm = backend.comm();
    let (rank, world) = (comm.rank(), comm.world_size());
    let sizes = sizes(o, world)?;
    let largest = *sizes.last().unwrap_or(&0);
    let mut buffer = backend.buffer(
        (0..largest)
            .map(|i| bf16::from_f32((i % 7) as f32 * 0.125))
            .collect(),
    )?;
    if rank == 0 {
        eprintln!(
            "bench: {} backend, {world} ranks, bf16, {} sizes from {} to {} bytes, {} iterations \
             after {} warm-up",
            comm.backend(),
            sizes.len(),
            sizes[0] * 2,
            largest * 2,
            o.iters,
            o.warmup
        );
    }
    for op in Op::ALL {
        for &elements in &sizes {
            let seconds = time_op(backend, &mut buffer, op, elements, o)?;
            let bytes = elements * 2;
            let algbw = bytes as f64 / seconds / 1e9;
            if rank == 0 {
                println!(
                    "{{\"impl\":\"tilearn\",\"backend\":\"{}\",\"op\":\"{}\",\"dtype\":\"bf16\",\
                     \"bytes\":{bytes},\"world\":{world},\"time_us\":{:.2},\"algbw_gbs\":{:.2},\
                     \"busbw_gbs\":{:.2}}}",
                    comm.backend(),
                    op.name(),
                    seconds * 1e6,
                    algbw,
                    algbw * op.bus_factor(world)
                );
            }
        }
    }
    comm.barrier()
}
