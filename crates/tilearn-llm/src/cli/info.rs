//! `tilearn info`: what this build can use on this machine.

use clap::Args;

use crate::Result;

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Also print the NUMA nodes, the GPUs' nodes and the CPU affinity plans.
    #[arg(long)]
    pub topology: bool,
}

pub fn run(args: InfoArgs) -> Result<()> {
    println!("tilearn {}", env!("CARGO_PKG_VERSION"));
    let info = tilearn_ops::backend::probe();
    println!(
        "cuda kernels: {}",
        if info.cuda_compiled {
            "compiled in"
        } else {
            "not compiled (build with --features cuda)"
        }
    );
    match &info.cuda_driver {
        Ok(version) => println!("cuda driver: {version}"),
        Err(why) => println!("cuda driver: not available: {why}"),
    }
    if info.devices.is_empty() {
        println!("devices: cpu only");
    } else {
        for (i, d) in info.devices.iter().enumerate() {
            println!("device cuda:{i}: {d}");
        }
    }
    let found = |r: &std::result::Result<(), String>| match r {
        Ok(()) => "found".to_string(),
        Err(why) => format!("not found: {why}"),
    };
    println!("cublasLt: {}", found(&info.cublaslt));
    println!("nccl: {}", found(&info.nccl));
    println!(
        "cpu threads: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if args.topology {
        super::topology::print_topology();
    }
    Ok(())
}
