//! tilearn-hostbench: what CPU/NUMA placement does to the host side of training on this machine.
//!
//! For each placement given to `--bind-cores` it runs, on a fresh thread placed that way:
//! * `h2d_pinned` (only with the `cuda` feature and a GPU): page-locked host buffer → device
//!   copies of `--copy-mib` MiB, median of `--copy-iters` after two warm-up copies, each timed
//!   from launch to stream synchronisation; the result is checked by copying it back once. It
//!   also reports on which NUMA nodes the buffer's pages really are.
//! * `loader`: batches/s and tokens/s of the training data loader over the embedded corpus
//!   (`--batch` × `--seq-len`), median of `--repeats` runs of `--loader-batches` batches.
//!
//! Placements: `none` (the scheduler's choice, default memory policy), `numa` / `exclusive`
//! (this rank's plan from tilearn-affinity: main thread, loader thread and preferred memory
//! node), and `far` (every CPU and the memory of a node that is *not* the GPU's: what a bad
//! placement costs; skipped on a one-node machine). One JSON object per line on stdout, the
//! first describing the machine and the plan. On a one-node machine `none` and `numa` are
//! expected to match; the numbers say so rather than a claim.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use serde_json::{Value, json};
use tilearn_affinity::{BindMode, CpuSet, LocalRank, Plan, RankPlan, Topology};
use tilearn_engine::data::{
    DataLoader, LoaderOptions, TokenDataset, WorkerHook, prepare_embedded_default,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Placement {
    None,
    Numa,
    Exclusive,
    Far,
}

#[derive(Debug, Parser)]
#[command(
    name = "tilearn-hostbench",
    about = "Host-to-device copy and data loader throughput with and without CPU/NUMA pinning"
)]
struct Args {
    /// Placements to measure, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "none,numa,far"
    )]
    bind_cores: Vec<Placement>,
    /// Size of each host-to-device copy.
    #[arg(long, default_value_t = 256)]
    copy_mib: usize,
    /// Timed copies (the median is reported).
    #[arg(long, default_value_t = 10)]
    copy_iters: usize,
    /// Windows per loader batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Batches per timed loader run.
    #[arg(long, default_value_t = 2000)]
    loader_batches: usize,
    /// Timed loader runs (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Token shards to load (default: the embedded corpus, generated into a temporary directory).
    #[arg(long)]
    data: Option<PathBuf>,
}

/// Where one placement puts the measuring thread, the loader thread and new memory.
struct Place {
    name: &'static str,
    main: Option<CpuSet>,
    loader: Option<CpuSet>,
    memory_node: Option<usize>,
}

fn main() {
    let args = Args::parse();
    if let Err(message) = run(&args) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.copy_iters == 0 || args.repeats == 0 || args.loader_batches == 0 || args.copy_mib == 0 {
        return Err(
            "--copy-mib, --copy-iters, --loader-batches and --repeats must be at least 1".into(),
        );
    }
    let local = LocalRank::from_env().map_err(|e| e.to_string())?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let topology = Topology::detect();
    let numa = Plan::for_local_ranks(
        &topology,
        BindMode::Numa,
        local.world_size,
        visible.as_deref(),
    );
    let exclusive = Plan::for_local_ranks(
        &topology,
        BindMode::Exclusive,
        local.world_size,
        visible.as_deref(),
    );
    let rank_numa = numa
        .rank(local.rank)
        .cloned()
        .ok_or("no plan for this rank")?;
    let (visible_gpus, _) = topology.visible_gpus(visible.as_deref());
    let cuda_ordinal = (!visible_gpus.is_empty()).then(|| local.rank % visible_gpus.len());
    emit(json!({
        "bench": "context",
        "local_rank": local.rank,
        "local_world_size": local.world_size,
        "numa_nodes": topology.nodes.iter().map(|n| json!({"id": n.id, "cpus": n.cpus.to_string()})).collect::<Vec<_>>(),
        "allowed_cpus": topology.allowed.to_string(),
        "gpus_in_sysfs": topology.gpus.len(),
        "cuda_ordinal": cuda_ordinal,
        "gpu": rank_numa.gpu,
        "gpu_node": rank_numa.numa_node,
        "plan_numa": rank_numa,
        "plan_exclusive": exclusive.rank(local.rank),
        "warnings": numa.warnings,
        "affinity_opt_out": tilearn_affinity::opt_out_reason(),
    }));

    let (dataset, scratch) = open_data(args)?;
    let dataset = Arc::new(dataset);
    for &placement in &args.bind_cores {
        let place = match resolve(placement, &topology, &rank_numa, exclusive.rank(local.rank)) {
            Ok(place) => place,
            Err(why) => {
                let name = format!("{placement:?}").to_lowercase();
                for bench in ["h2d_pinned", "loader"] {
                    emit(json!({"bench": bench, "bind": name, "skipped": why}));
                }
                continue;
            }
        };
        let dataset = Arc::clone(&dataset);
        std::thread::scope(|s| {
            s.spawn(|| measure(args, &place, (cuda_ordinal, local.rank), dataset));
        });
    }
    if let Some(dir) = scratch {
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(())
}

fn emit(value: Value) {
    println!("{value}");
}

/// The shards to read, and the temporary directory to delete afterwards if we made one.
fn open_data(args: &Args) -> Result<(TokenDataset, Option<PathBuf>), String> {
    if let Some(dir) = &args.data {
        return Ok((TokenDataset::open(dir).map_err(|e| e.to_string())?, None));
    }
    let dir = std::env::temp_dir().join(format!("tilearn-hostbench-{}", std::process::id()));
    prepare_embedded_default(&dir, 7, 20_000).map_err(|e| e.to_string())?;
    let dataset = TokenDataset::open(&dir).map_err(|e| e.to_string())?;
    Ok((dataset, Some(dir)))
}

fn resolve(
    placement: Placement,
    topology: &Topology,
    numa: &RankPlan,
    exclusive: Option<&RankPlan>,
) -> Result<Place, String> {
    let planned = |name: &'static str, rank: &RankPlan| match &rank.binding {
        Some(b) => Ok(Place {
            name,
            main: Some(b.main.clone()),
            loader: Some(b.loader.clone()),
            memory_node: rank.numa_node,
        }),
        None => Err(format!(
            "the plan does not pin this rank: {}",
            rank.unpinned_reason.as_deref().unwrap_or("no reason given")
        )),
    };
    match placement {
        Placement::None => Ok(Place {
            name: "none",
            main: None,
            loader: None,
            memory_node: None,
        }),
        Placement::Numa => planned("numa", numa),
        Placement::Exclusive => planned("exclusive", exclusive.ok_or("no exclusive plan")?),
        Placement::Far => {
            let gpu_node = numa.numa_node.ok_or("the GPU's NUMA node is unknown")?;
            let far = topology
                .nodes
                .iter()
                .filter(|n| n.id != gpu_node)
                .map(|n| (n.id, n.cpus.intersection(&topology.allowed)))
                .find(|(_, cpus)| !cpus.is_empty())
                .ok_or("no other NUMA node with usable CPUs (one-node machine)")?;
            Ok(Place {
                name: "far",
                main: Some(far.1.clone()),
                loader: Some(far.1),
                memory_node: Some(far.0),
            })
        }
    }
}

/// Runs on a fresh thread: places it, then measures.
/// `gpu` is the CUDA ordinal from sysfs (if found) and the local rank (to pick one without it).
fn measure(args: &Args, place: &Place, gpu: (Option<usize>, usize), dataset: Arc<TokenDataset>) {
    let base = json!({
        "bind": place.name,
        "cpus": place.main.as_ref().map(|c| c.to_string()),
        "loader_cpus": place.loader.as_ref().map(|c| c.to_string()),
        "preferred_memory_node": place.memory_node,
    });
    let with = |mut fields: Value| {
        if let (Some(out), Some(base)) = (fields.as_object_mut(), base.as_object()) {
            for (k, v) in base {
                out.insert(k.clone(), v.clone());
            }
        }
        fields
    };
    if let Err(e) = place_thread(place) {
        for bench in ["h2d_pinned", "loader"] {
            emit(with(
                json!({"bench": bench, "skipped": format!("placing the thread failed: {e}")}),
            ));
        }
        return;
    }
    emit(with(h2d_json(args, gpu)));
    emit(with(loader_json(args, place, dataset)));
}

fn place_thread(place: &Place) -> tilearn_affinity::Result<()> {
    if let Some(cpus) = &place.main {
        tilearn_affinity::pin_current_thread(cpus)?;
    }
    match place.memory_node {
        Some(node) => tilearn_affinity::prefer_memory_node(node),
        None => tilearn_affinity::reset_memory_policy(),
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn loader_json(args: &Args, place: &Place, dataset: Arc<TokenDataset>) -> Value {
    match loader_bench(args, place, dataset) {
        Ok(v) => v,
        Err(e) => json!({"bench": "loader", "error": e}),
    }
}

fn loader_bench(args: &Args, place: &Place, dataset: Arc<TokenDataset>) -> Result<Value, String> {
    let hook: Option<WorkerHook> = match (&place.loader, place.memory_node) {
        (None, _) => None,
        (Some(cpus), node) => {
            let cpus = cpus.clone();
            Some(Box::new(move || {
                if let Err(e) = tilearn_affinity::pin_current_thread(&cpus) {
                    eprintln!("warning: pinning the loader thread: {e}");
                }
                if let Some(node) = node
                    && let Err(e) = tilearn_affinity::prefer_memory_node(node)
                {
                    eprintln!("warning: loader memory policy: {e}");
                }
            }))
        }
    };
    let options = LoaderOptions::new(args.batch, args.seq_len, 1);
    let mut loader = DataLoader::with_options(dataset, options, hook).map_err(|e| e.to_string())?;
    let tokens_per_batch = (args.batch * args.seq_len) as f64;
    // Warm-up: the worker starts, the shards' pages come into the page cache.
    for _ in 0..loader.batches_per_epoch().min(50) {
        loader.next_batch().map_err(|e| e.to_string())?;
    }
    let mut rates = Vec::with_capacity(args.repeats);
    let mut checksum = 0u64;
    for _ in 0..args.repeats {
        let start = Instant::now();
        for _ in 0..args.loader_batches {
            let batch = loader.next_batch().map_err(|e| e.to_string())?;
            // Read the batch so the consumer side is not optimised away.
            checksum = checksum.wrapping_add(u64::from(batch.input_ids[batch.input_ids.len() - 1]));
        }
        rates.push(args.loader_batches as f64 / start.elapsed().as_secs_f64());
    }
    let all = rates.clone();
    let batches_per_s = median(&mut rates);
    Ok(json!({
        "bench": "loader",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "batches_per_run": args.loader_batches,
        "batches_per_s": batches_per_s,
        "tokens_per_s": batches_per_s * tokens_per_batch,
        "runs_batches_per_s": all,
        "checksum": checksum,
    }))
}

#[cfg(not(feature = "cuda"))]
fn h2d_json(_args: &Args, _gpu: (Option<usize>, usize)) -> Value {
    json!({"bench": "h2d_pinned", "skipped": "built without the cuda feature (rebuild with --features cuda)"})
}

#[cfg(feature = "cuda")]
fn h2d_json(args: &Args, (ordinal, local_rank): (Option<usize>, usize)) -> Value {
    let info = tilearn_ops::backend::probe();
    if !info.cuda_usable() {
        return json!({"bench": "h2d_pinned", "skipped": "no usable CUDA driver/device (see `tilearn info`)"});
    }
    // A container may hide sysfs while the driver still sees the GPUs: then rank → ordinal
    // directly (the placement comparison is moot there, but the bandwidth is still reported).
    let ordinal = ordinal.unwrap_or(local_rank % info.devices.len());
    match cuda::h2d(ordinal, args.copy_mib << 20, args.copy_iters) {
        Ok(v) => v,
        Err(e) => json!({"bench": "h2d_pinned", "error": e}),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use cudarc::driver::{CudaContext, sys};
    use serde_json::{Value, json};

    pub(super) fn h2d(ordinal: usize, bytes: usize, iters: usize) -> Result<Value, String> {
        let err = |what: &'static str| move |e: cudarc::driver::DriverError| format!("{what}: {e}");
        let ctx = CudaContext::new(ordinal).map_err(err("creating the CUDA context"))?;
        let attribute = |a| ctx.attribute(a).map_err(err("reading a device attribute"));
        let driver_bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let stream = ctx.default_stream();
        // Plain page-locked memory (flags 0, what cudaHostAlloc/pin_memory give), not the
        // write-combined kind `alloc_pinned` picks: the loader's batches are written and read
        // by the CPU. SAFETY: every byte is written by `fill` below before any copy reads it.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
            .map_err(err("allocating page-locked host memory"))?;
        let pattern = 0x5a_u8;
        host.as_mut_slice()
            .map_err(err("mapping the host buffer"))?
            .fill(pattern);
        let pages = page_histogram(host.as_slice().map_err(err("mapping the host buffer"))?);
        let mut device = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(err("allocating device memory"))?;
        for _ in 0..2 {
            stream
                .memcpy_htod(&host, &mut device)
                .map_err(err("warm-up copy"))?;
        }
        stream.synchronize().map_err(err("synchronize"))?;
        let mut seconds = Vec::with_capacity(iters);
        for _ in 0..iters {
            let start = Instant::now();
            stream
                .memcpy_htod(&host, &mut device)
                .map_err(err("copy"))?;
            stream.synchronize().map_err(err("synchronize"))?;
            seconds.push(start.elapsed().as_secs_f64());
        }
        let back = stream
            .clone_dtoh(&device)
            .map_err(err("copying back for the check"))?;
        let wrong = back.iter().filter(|&&b| b != pattern).count();
        if wrong != 0 {
            return Err(format!("{wrong} of {bytes} bytes differ after the copy"));
        }
        let mut gbps: Vec<f64> = seconds.iter().map(|s| bytes as f64 / s / 1e9).collect();
        let runs = gbps.clone();
        let median = super::median(&mut gbps);
        Ok(json!({
            "bench": "h2d_pinned",
            "cuda_ordinal": ordinal,
            "driver_bus_id": driver_bus_id,
            "bytes": bytes,
            "iters": iters,
            "median_gb_per_s": median,
            "min_gb_per_s": gbps[0],
            "max_gb_per_s": gbps[gbps.len() - 1],
            "runs_gb_per_s": runs,
            "buffer_pages_per_node": pages,
        }))
    }

    /// On which NUMA nodes 256 pages spread over the buffer lie (key "unknown" for pages the
    /// kernel does not report).
    fn page_histogram(buffer: &[u8]) -> BTreeMap<String, usize> {
        let samples = 256.min(buffer.len());
        let step = (buffer.len() / samples).max(1);
        let addresses: Vec<*const u8> = (0..samples).map(|i| buffer[i * step..].as_ptr()).collect();
        let mut histogram = BTreeMap::new();
        match tilearn_affinity::page_nodes(&addresses) {
            Ok(nodes) => {
                for node in nodes {
                    let key = node.map_or("unknown".to_string(), |n| n.to_string());
                    *histogram.entry(key).or_insert(0) += 1;
                }
            }
            Err(e) => {
                histogram.insert(format!("error: {e}"), samples);
            }
        }
        histogram
    }
}
