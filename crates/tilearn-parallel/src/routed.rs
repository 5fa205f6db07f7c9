//! `RoutedCommunicator`: one group of ranks seen through two backends, device buffers over one
//! (NCCL) and host buffers over the other (the host communicator).
//!
//! A model-parallel rank sends two kinds of traffic through the same group: activations,
//! partial sums and gradients as device buffers, and scalars (the loss, the gradient norm, the
//! overflow flag, the pieces of a saved model) as host buffers. NCCL takes device buffers only
//! and the host communicator stages device buffers through page-locked memory, so neither
//! alone is right for a rank with a GPU of its own: this routes each call by where its buffer
//! lives. Sub-groups are created in both backends (each `new_group` is collective in both, in
//! the same order on every rank), and the barrier is the host's (no device work to order).

use std::sync::Arc;
use std::time::Duration;

use crate::buffer::{Buffer, BufferMut};
use crate::communicator::{Communicator, P2pOp};
use crate::error::{ParallelError, Result};
use crate::reduce::ReduceOp;
use crate::work::Work;

/// Device buffers over `device`, host buffers over `host`; both span the same ranks.
pub struct RoutedCommunicator {
    device: Arc<dyn Communicator>,
    host: Arc<dyn Communicator>,
}

impl std::fmt::Debug for RoutedCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RoutedCommunicator(rank {} of {}: device buffers over {}, host buffers over {})",
            self.rank(),
            self.world_size(),
            self.device.backend(),
            self.host.backend()
        )
    }
}

impl RoutedCommunicator {
    /// Pairs two communicators of the same group (the same rank and size in both).
    pub fn new(
        device: Arc<dyn Communicator>,
        host: Arc<dyn Communicator>,
    ) -> Result<RoutedCommunicator> {
        if device.rank() != host.rank() || device.world_size() != host.world_size() {
            return Err(ParallelError::Usage {
                flag: "routed communicator".into(),
                reason: format!(
                    "internal: the {} communicator is rank {} of {} but the {} one rank {} of {}; \
                     both must span the same group",
                    device.backend(),
                    device.rank(),
                    device.world_size(),
                    host.backend(),
                    host.rank(),
                    host.world_size()
                ),
            });
        }
        Ok(RoutedCommunicator { device, host })
    }

    fn route(&self, host_buffer: bool) -> &dyn Communicator {
        if host_buffer {
            self.host.as_ref()
        } else {
            self.device.as_ref()
        }
    }
}

impl Communicator for RoutedCommunicator {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    /// The device backend's name: it carries the traffic that matters for speed.
    fn backend(&self) -> &'static str {
        self.device.backend()
    }

    fn timeout(&self) -> Duration {
        self.host.timeout().max(self.device.timeout())
    }

    fn all_reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.route(buf.is_host()).all_reduce(buf, op)
    }

    fn reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        self.route(buf.is_host()).reduce(buf, op, root)
    }

    fn reduce_scatter<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.route(buf.is_host()).reduce_scatter(buf, op)
    }

    fn all_gather<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        self.route(buf.is_host()).all_gather(buf)
    }

    fn broadcast<'a>(&'a self, buf: BufferMut<'a>, root: usize) -> Result<Work<'a>> {
        self.route(buf.is_host()).broadcast(buf, root)
    }

    fn send<'a>(&'a self, buf: Buffer<'a>, peer: usize) -> Result<Work<'a>> {
        self.route(buf.is_host()).send(buf, peer)
    }

    fn recv<'a>(&'a self, buf: BufferMut<'a>, peer: usize) -> Result<Work<'a>> {
        self.route(buf.is_host()).recv(buf, peer)
    }

    fn all_to_all<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        self.route(buf.is_host()).all_to_all(buf)
    }

    /// One backend runs the whole batch, so a batch must not mix host and device buffers (the
    /// two backends could not pair a send in one with a receive in the other).
    fn batch_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let host = ops.iter().filter(|op| op.is_host()).count();
        match host {
            0 if ops.is_empty() => Ok(()),
            0 => self.device.batch_p2p(ops),
            n if n == ops.len() => self.host.batch_p2p(ops),
            n => Err(ParallelError::Usage {
                flag: "batch_p2p".into(),
                reason: format!(
                    "internal: a batch of {} operations mixes {n} on host buffers with {} on \
                     device buffers; send each kind in a batch of its own",
                    ops.len(),
                    ops.len() - n
                ),
            }),
        }
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>> {
        let host = self.host.new_group(ranks)?;
        let device = self.device.new_group(ranks)?;
        match (device, host) {
            (Some(device), Some(host)) => Ok(Some(Box::new(RoutedCommunicator::new(
                Arc::from(device),
                Arc::from(host),
            )?))),
            (None, None) => Ok(None),
            (device, _) => Err(ParallelError::Usage {
                flag: "new_group".into(),
                reason: format!(
                    "internal: rank {} is {} the {} sub-group of {ranks:?} but {} the {} one",
                    self.rank(),
                    if device.is_some() { "in" } else { "outside" },
                    self.device.backend(),
                    if device.is_some() { "outside" } else { "in" },
                    self.host.backend()
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::host::run_on_threads;

    /// A stand-in for the device backend: counts the calls that reach it and fails them, so a
    /// host buffer routed there shows as an error.
    struct Refusing {
        rank: usize,
        world_size: usize,
        calls: Arc<AtomicUsize>,
    }

    impl Refusing {
        fn refuse(&self, op: &'static str) -> ParallelError {
            self.calls.fetch_add(1, Ordering::SeqCst);
            ParallelError::Unsupported {
                op,
                backend: "refusing",
                reason: "host buffers must not come here".into(),
            }
        }
    }

    impl Communicator for Refusing {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world_size
        }
        fn backend(&self) -> &'static str {
            "refusing"
        }
        fn timeout(&self) -> Duration {
            Duration::from_secs(1)
        }
        fn all_reduce<'a>(&'a self, _: BufferMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
            Err(self.refuse("all_reduce"))
        }
        fn reduce_scatter<'a>(&'a self, _: BufferMut<'a>, _: ReduceOp) -> Result<Work<'a>> {
            Err(self.refuse("reduce_scatter"))
        }
        fn all_gather<'a>(&'a self, _: BufferMut<'a>) -> Result<Work<'a>> {
            Err(self.refuse("all_gather"))
        }
        fn broadcast<'a>(&'a self, _: BufferMut<'a>, _: usize) -> Result<Work<'a>> {
            Err(self.refuse("broadcast"))
        }
        fn send<'a>(&'a self, _: Buffer<'a>, _: usize) -> Result<Work<'a>> {
            Err(self.refuse("send"))
        }
        fn recv<'a>(&'a self, _: BufferMut<'a>, _: usize) -> Result<Work<'a>> {
            Err(self.refuse("recv"))
        }
        fn all_to_all<'a>(&'a self, _: BufferMut<'a>) -> Result<Work<'a>> {
            Err(self.refuse("all_to_all"))
        }
        fn barrier(&self) -> Result<()> {
            Err(self.refuse("barrier"))
        }
        /// Members get a refusing sub-group numbered as the host backend numbers it.
        fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>> {
            Ok(ranks.iter().position(|&r| r == self.rank).map(|rank| {
                Box::new(Refusing {
                    rank,
                    world_size: ranks.len(),
                    calls: self.calls.clone(),
                }) as Box<dyn Communicator>
            }))
        }
    }

    #[test]
    fn host_buffers_take_the_host_backend_in_the_group_and_its_sub_groups() {
        let timeout = Duration::from_secs(20);
        let results = run_on_threads(3, timeout, |rank, host| {
            let calls = Arc::new(AtomicUsize::new(0));
            let device = Arc::new(Refusing {
                rank,
                world_size: 3,
                calls: calls.clone(),
            });
            let routed = RoutedCommunicator::new(device, Arc::new(host)).unwrap();
            assert_eq!(routed.backend(), "refusing");
            let mut sum = vec![rank as f32 + 0.5, 10.0 * rank as f32];
            routed
                .all_reduce(BufferMut::from(&mut sum), ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            routed.barrier().unwrap();
            // Ranks 0 and 2 form a sub-group; rank 1 is outside it.
            let sub = routed.new_group(&[0, 2]).unwrap();
            let mut gathered = vec![0.0f32; 2];
            if let Some(sub) = &sub {
                gathered[sub.rank()] = rank as f32 + 1.0;
                sub.all_gather(BufferMut::from(&mut gathered))
                    .unwrap()
                    .wait()
                    .unwrap();
                let mut ops = [];
                sub.batch_p2p(&mut ops).unwrap();
            }
            (sum, sub.is_some(), gathered, calls.load(Ordering::SeqCst))
        })
        .unwrap();
        for (rank, (sum, member, gathered, device_calls)) in results.into_iter().enumerate() {
            assert_eq!(sum, vec![0.5 + 1.5 + 2.5, 30.0], "rank {rank}");
            assert_eq!(member, rank != 1, "rank {rank}");
            if member {
                assert_eq!(gathered, vec![1.0, 3.0], "rank {rank}");
            }
            assert_eq!(
                device_calls, 0,
                "rank {rank}: a host buffer reached the device backend"
            );
        }
    }

    #[test]
    fn communicators_of_different_groups_are_refused() {
        let results = run_on_threads(2, Duration::from_secs(20), |rank, host| {
            let device = Arc::new(Refusing {
                rank: 1 - rank,
                world_size: 2,
                calls: Arc::new(AtomicUsize::new(0)),
            });
            RoutedCommunicator::new(device, Arc::new(host))
                .unwrap_err()
                .to_string()
        })
        .unwrap();
        for message in results {
            assert!(message.contains("must span the same group"), "{message}");
        }
    }
}
