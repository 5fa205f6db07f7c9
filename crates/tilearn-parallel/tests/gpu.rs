//! GPU tests (feature `cuda`, run on a machine with a CUDA GPU and NCCL):
//! NCCL with world size 1 (in process and through the launcher), and two ranks sharing one GPU
//! over the host communicator with device buffers staged through page-locked memory.

#![cfg(feature = "cuda")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use half::bf16;
use tilearn_parallel::launch::{LaunchConfig, Program, launch};
use tilearn_parallel::nccl::NcclCommunicator;
use tilearn_parallel::{BufferMut, Communicator, GroupOptions, ProcessGroup, RankEnv, ReduceOp};

/// The first GPU, or `None` (after printing why) when this machine has none.
fn gpu() -> Option<Arc<CudaContext>> {
    // SAFETY: only tries to dlopen the driver library (cudarc panics on use without it).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA driver (libcuda.so) on this machine");
        return None;
    }
    match CudaContext::new(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            println!("skipped: no CUDA GPU ({e})");
            None
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn nccl_with_one_rank_runs_every_collective() {
    let Some(ctx) = gpu() else { return };
    let group = ProcessGroup::init(RankEnv::single(), GroupOptions::default()).unwrap();
    let comm = NcclCommunicator::new(&group, &ctx).unwrap();
    let stream = ctx.default_stream();
    let input: Vec<f32> = (0..1001).map(|i| i as f32 / 8.0).collect();
    let mut dev = stream.clone_htod(&input).unwrap();
    comm.all_reduce(BufferMut::from(&mut dev), ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    comm.all_reduce(BufferMut::from(&mut dev), ReduceOp::ScaledSum(0.5))
        .unwrap()
        .wait()
        .unwrap();
    comm.all_reduce(BufferMut::from(&mut dev), ReduceOp::Avg)
        .unwrap()
        .wait_on_stream(&stream)
        .unwrap();
    let back = stream.clone_dtoh(&dev).unwrap();
    let want: Vec<f32> = input.iter().map(|x| x * 0.5).collect();
    assert_eq!(back, want);

    let halves: Vec<bf16> = input.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut dev = stream.clone_htod(&halves).unwrap();
    comm.reduce_scatter(BufferMut::from(&mut dev), ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    comm.all_gather(BufferMut::from(&mut dev))
        .unwrap()
        .wait()
        .unwrap();
    comm.broadcast(BufferMut::from(&mut dev), 0)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), halves);
    // ncclReduce to rank 0 (ZeRO-2's reduction of a bucket to its owner) leaves one rank's
    // values as they are.
    comm.reduce(BufferMut::from(&mut dev), ReduceOp::Sum, 0)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), halves);
    assert!(
        comm.reduce(BufferMut::from(&mut dev), ReduceOp::Sum, 1)
            .is_err()
    );
    // batch_p2p as one NCCL group: a rank may send to itself and receive what it sent, two
    // messages matched in list order (a lone ncclSend to self would wait for its ncclRecv).
    let first: Vec<f32> = (0..777).map(|i| (i * 3 % 11) as f32 - 4.5).collect();
    let second: Vec<bf16> = (0..5).map(|i| bf16::from_f32(i as f32 + 0.25)).collect();
    let (src1, src2) = (
        stream.clone_htod(&first).unwrap(),
        stream.clone_htod(&second).unwrap(),
    );
    let mut dst1 = stream.alloc_zeros::<f32>(first.len()).unwrap();
    let mut dst2 = stream.alloc_zeros::<bf16>(second.len()).unwrap();
    {
        use tilearn_parallel::P2pOp;
        use tilearn_parallel::device::{DeviceSlice, DeviceSliceMut};
        let mut ops = [
            P2pOp::SendDevice {
                buf: DeviceSlice::F32(src1.as_view()),
                peer: 0,
            },
            P2pOp::RecvDevice {
                buf: DeviceSliceMut::F32(dst1.as_view_mut()),
                peer: 0,
            },
            P2pOp::SendDevice {
                buf: DeviceSlice::BF16(src2.as_view()),
                peer: 0,
            },
            P2pOp::RecvDevice {
                buf: DeviceSliceMut::BF16(dst2.as_view_mut()),
                peer: 0,
            },
        ];
        comm.batch_p2p(&mut ops).unwrap();
        // Host buffers are refused with a typed error naming the operation.
        let host = [1f32];
        let err = comm
            .batch_p2p(&mut [P2pOp::Send {
                buf: tilearn_parallel::buffer::HostSlice::F32(&host),
                peer: 0,
            }])
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch_p2p"), "{err}");
    }
    assert_eq!(stream.clone_dtoh(&dst1).unwrap(), first);
    assert_eq!(stream.clone_dtoh(&dst2).unwrap(), second);
    // all_to_all (grouped ncclSend/ncclRecv through a scratch, copied back in place): with one
    // rank its one shard travels to itself and comes back unchanged; bf16 too.
    let mut dev = stream.clone_htod(&first).unwrap();
    comm.all_to_all(BufferMut::from(&mut dev))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), first);
    let mut dev = stream.clone_htod(&second).unwrap();
    comm.all_to_all(BufferMut::from(&mut dev))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), second);
    comm.barrier().unwrap();
    // Host memory is refused with a typed error, not a crash.
    let mut host = vec![0f32; 4];
    assert!(
        comm.all_reduce(BufferMut::from(&mut host), ReduceOp::Sum)
            .is_err()
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn nccl_through_the_launcher() {
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let program = Program::External {
        program: support::bin(
            "tilearn-comm-check",
            env!("CARGO_BIN_EXE_tilearn-comm-check"),
        ),
        args: vec![
            "--backend".into(),
            "nccl".into(),
            "--pid-dir".into(),
            dir.path().into(),
        ],
    };
    let config = LaunchConfig {
        nproc_per_node: 1,
        standalone: true,
        comm_timeout: Duration::from_secs(120),
        ..LaunchConfig::default()
    };
    launch(config, &program).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_ranks_share_one_gpu_over_the_host_communicator() {
    let Some(ctx) = gpu() else { return };
    let results = support::with_group(2, Duration::from_secs(60), |rank, comm| {
        let stream = ctx.new_stream().unwrap();
        comm.set_staging_stream(Arc::clone(&stream));
        let input: Vec<f32> = (0..4097).map(|i| (i % 17) as f32 + rank as f32).collect();
        let mut dev = stream.clone_htod(&input).unwrap();
        comm.all_reduce(BufferMut::from(&mut dev), ReduceOp::Avg)
            .unwrap()
            .wait()
            .unwrap();
        let mut halves = stream
            .clone_htod(&vec![bf16::from_f32(rank as f32 + 1.0); 10])
            .unwrap();
        comm.all_reduce(BufferMut::from(&mut halves), ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        (
            stream.clone_dtoh(&dev).unwrap(),
            stream.clone_dtoh(&halves).unwrap(),
        )
    });
    let want: Vec<f32> = (0..4097).map(|i| (i % 17) as f32 + 0.5).collect();
    for (avg, sum) in results {
        assert_eq!(avg, want);
        assert!(
            sum.iter().all(|x| x.to_f32() == 3.0),
            "bf16 sum over two ranks sharing the GPU: {sum:?}"
        );
    }
}

/// Batched point-to-point operations on device buffers over the host communicator (a GPU
/// pipeline stage's activations and gradients when its ranks share one GPU): each rank sends
/// an f32 and a bf16 device buffer to the other while receiving the other's, with a host
/// message in the same batch; every received value is the sender's exactly.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_ranks_exchange_device_buffers_in_one_batch_over_the_host_communicator() {
    use tilearn_parallel::P2pOp;
    use tilearn_parallel::buffer::{HostSlice, HostSliceMut};
    use tilearn_parallel::device::{DeviceSlice, DeviceSliceMut};
    let Some(ctx) = gpu() else { return };
    let values = |rank: usize, n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (i % 13) as f32 * 0.5 + 100.0 * rank as f32)
            .collect()
    };
    let results = support::with_group(2, Duration::from_secs(60), |rank, comm| {
        let stream = ctx.new_stream().unwrap();
        comm.set_staging_stream(ctx.new_stream().unwrap());
        let peer = 1 - rank;
        let f = stream.clone_htod(&values(rank, 3001)).unwrap();
        let halves: Vec<bf16> = values(rank, 65)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        let h = stream.clone_htod(&halves).unwrap();
        let mut f_in = stream.alloc_zeros::<f32>(3001).unwrap();
        let mut h_in = stream.alloc_zeros::<bf16>(65).unwrap();
        let host_out = [rank as f32 + 7.0];
        let mut host_in = [0f32];
        // The views borrow the buffers until the batch is done (the block's end).
        {
            let mut ops = [
                P2pOp::SendDevice {
                    buf: DeviceSlice::F32(f.as_view()),
                    peer,
                },
                P2pOp::RecvDevice {
                    buf: DeviceSliceMut::F32(f_in.as_view_mut()),
                    peer,
                },
                P2pOp::Send {
                    buf: HostSlice::F32(&host_out),
                    peer,
                },
                P2pOp::RecvDevice {
                    buf: DeviceSliceMut::BF16(h_in.as_view_mut()),
                    peer,
                },
                P2pOp::SendDevice {
                    buf: DeviceSlice::BF16(h.as_view()),
                    peer,
                },
                P2pOp::Recv {
                    buf: HostSliceMut::F32(&mut host_in),
                    peer,
                },
            ];
            comm.batch_p2p(&mut ops).unwrap();
        }
        (
            stream.clone_dtoh(&f_in).unwrap(),
            stream.clone_dtoh(&h_in).unwrap(),
            host_in[0],
        )
    });
    for (rank, (f, h, host)) in results.into_iter().enumerate() {
        let peer = 1 - rank;
        assert_eq!(f, values(peer, 3001), "rank {rank}: f32 from its peer");
        let want: Vec<bf16> = values(peer, 65)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        assert_eq!(h, want, "rank {rank}: bf16 from its peer");
        assert_eq!(host, peer as f32 + 7.0, "rank {rank}: the host message");
    }
}
