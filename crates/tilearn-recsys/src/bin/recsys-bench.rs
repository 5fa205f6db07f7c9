//! The fused embedding-bag operator alone on the GPU: forward, and forward + backward + update,
//! as GB/s of rows moved beside the measured device copy bandwidth. One JSON line per
//! configuration. Needs a GPU (`--features cuda`).
//!
//! Bytes counted (f32 rows): forward = every entry's row read + the pooled output written;
//! backward + update = every entry's dout row read + each distinct row's weights read and
//! written + its state read and written (row-wise Adagrad 4 bytes per row, SparseAdam two
//! moments, SGD none). Ids, offsets and the sort's scratch traffic are not counted.
//!
//! `recsys-bench [--tables 26] [--rows 100000] [--dim 16] [--batch 16384] [--bag 1]
//!  [--zipf 1.05] [--optimizer adagrad|adam|sgd] [--iters 50]`

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::cuda::bench::{copy_bandwidth, median, time_steps};
use tilearn_recsys::cuda::{DeviceEmbeddingBag, DeviceJaggedBatch};
use tilearn_recsys::{
    EmbeddingTables, JaggedBatch, Pooling, SparseOptimizer, SparseState, TableLayout, TableSpec,
    Zipf,
};

struct Options {
    tables: usize,
    rows: usize,
    dim: usize,
    batch: usize,
    bag: usize,
    zipf: f64,
    optimizer: String,
    iters: usize,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        tables: 26,
        rows: 100_000,
        dim: 16,
        batch: 16_384,
        bag: 1,
        zipf: 1.05,
        optimizer: "adagrad".into(),
        iters: 50,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).ok_or(format!("{} needs a value", pair[0]))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{}: `{v}` is not a count", pair[0]))
        };
        match pair[0].as_str() {
            "--tables" => o.tables = num(value)?,
            "--rows" => o.rows = num(value)?,
            "--dim" => o.dim = num(value)?,
            "--batch" => o.batch = num(value)?,
            "--bag" => o.bag = num(value)?,
            "--iters" => o.iters = num(value)?,
            "--zipf" => o.zipf = value.parse().map_err(|_| format!("--zipf: `{value}`"))?,
            "--optimizer" => o.optimizer = value.clone(),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(o)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let o = parse()?;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let (optimizer, state_bytes_per_row) = match o.optimizer.as_str() {
        "adagrad" => (SparseOptimizer::row_wise_adagrad(0.01), 8),
        "adam" => (SparseOptimizer::adam(1e-3), 16 * o.dim),
        "sgd" => (SparseOptimizer::Sgd { lr: 0.01 }, 0),
        other => return Err(format!("--optimizer {other}: use adagrad, adam or sgd")),
    };
    let dev = GpuDevice::new(0).map_err(|e| err(&e))?;
    let stream = dev.stream();
    let spec = TableSpec {
        rows: o.rows,
        dim: o.dim,
        pooling: Pooling::Sum,
    };
    let layout = TableLayout::new(vec![spec; o.tables]).map_err(|e| err(&e))?;
    let tables = EmbeddingTables::new(layout.clone(), 0);
    let state = SparseState::new(optimizer, &layout).map_err(|e| err(&e))?;
    let mut op = DeviceEmbeddingBag::new(stream, &tables, &state).map_err(|e| err(&e))?;
    drop(tables);

    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let zipf = Zipf::new(o.rows, o.zipf);
    let entries = o.tables * o.batch * o.bag;
    let ids: Vec<u32> = (0..entries).map(|_| zipf.sample(&mut rng) as u32).collect();
    let offsets: Vec<u32> = (0..=o.tables * o.batch)
        .map(|k| (k * o.bag) as u32)
        .collect();
    let mut unique = 0usize;
    for t in 0..o.tables {
        let mut rows = ids[t * o.batch * o.bag..(t + 1) * o.batch * o.bag].to_vec();
        rows.sort_unstable();
        rows.dedup();
        unique += rows.len();
    }
    let batch = JaggedBatch::new(&layout, o.batch, offsets, ids).map_err(|e| err(&e))?;
    let dbatch = DeviceJaggedBatch::upload(stream, &layout, &batch).map_err(|e| err(&e))?;
    let width = layout.total_dim();
    let mut out = stream
        .alloc_zeros::<f32>(o.batch * width)
        .map_err(|e| err(&e))?;
    let dout = stream
        .clone_htod(&vec![1e-3f32; o.batch * width])
        .map_err(|e| err(&e))?;

    let copy = copy_bandwidth(stream, 2 << 30, 20).map_err(|e| err(&e))?;
    let row_bytes = 4 * o.dim;
    let fwd_bytes = entries * row_bytes + o.batch * width * 4;
    let fwd = time_steps(stream, 3, o.iters, |_| {
        op.forward(stream, &dbatch, &mut out).map_err(|e| fused(&e))
    })
    .map_err(|e| err(&e))?;
    let op_ref = &mut op;
    let step = time_steps(stream, 3, o.iters, |_| {
        op_ref
            .forward(stream, &dbatch, &mut out)
            .map_err(|e| fused(&e))?;
        op_ref
            .backward_update(stream, &dbatch, &dout)
            .map_err(|e| fused(&e))
    })
    .map_err(|e| err(&e))?;
    let bwd_bytes = entries * row_bytes + unique * (2 * row_bytes + state_bytes_per_row);
    let report = |what: &str, bytes: usize, times: &[f32]| {
        let ms = median(times);
        println!(
            "{}",
            serde_json::json!({
                "bench": "embedding_bag", "pass": what, "tables": o.tables, "rows": o.rows,
                "dim": o.dim, "batch": o.batch, "bag": o.bag, "zipf": o.zipf,
                "optimizer": o.optimizer, "entries": entries, "unique_rows": unique,
                "ms_median": ms, "gb_per_s": bytes as f64 / (ms * 1e-3) / 1e9,
                "copy_gb_per_s": copy,
            })
        );
    };
    report("forward", fwd_bytes, &fwd);
    report("forward_backward_update", fwd_bytes + bwd_bytes, &step);
    Ok(())
}

/// A recsys error in the optimizer bench's error type (what `time_steps` bodies return).
fn fused(e: &tilearn_recsys::RecsysError) -> tilearn_optim::cuda::FusedError {
    tilearn_optim::cuda::FusedError::Cuda {
        op: "embedding_bag",
        message: e.to_string(),
    }
}
