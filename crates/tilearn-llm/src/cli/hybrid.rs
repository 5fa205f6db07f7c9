//! The 3D layout of a launched job: tensor-parallel size (`--tp-size`, else
//! `TILEARN_HYBRID_TP_SIZE`), pipeline-parallel size (`--pp-size`, else `TILEARN_HYBRID_PP_SIZE`)
//! and data parallelism over the rest, as Tilearn-Angel's `TILEARN_HYBRID_*` variables say.
//!
//! Rank layout (Megatron's): tensor parallelism innermost, then data, then pipeline:
//! `rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank`, so a tensor-parallel group is `tp`
//! consecutive ranks (one node's fast links) and a data-parallel group holds the ranks with the
//! same slices.

use std::sync::Arc;

use tilearn_parallel::Communicator;

use crate::{LlmError, Result};

/// `--tp-size`'s variable.
pub const TP_SIZE_ENV: &str = "TILEARN_HYBRID_TP_SIZE";
/// `--pp-size`'s variable.
pub const PP_SIZE_ENV: &str = "TILEARN_HYBRID_PP_SIZE";

fn usage(flag: &str, message: String) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message,
    }
}

/// A size from its flag, else its environment variable, else 1.
fn size_from(flag: Option<usize>, flag_name: &str, env: &str) -> Result<usize> {
    let size = match (flag, std::env::var(env)) {
        (Some(n), _) => n,
        (None, Ok(text)) if !text.trim().is_empty() => text.trim().parse().map_err(|_| {
            usage(
                env,
                format!("`{text}` is not a positive integer; set it to 1, 2, 4, …"),
            )
        })?,
        _ => 1,
    };
    if size == 0 {
        return Err(usage(flag_name, "must be at least 1".into()));
    }
    Ok(size)
}

/// The sizes of the three dimensions and this rank's coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridSizes {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
    pub pp_rank: usize,
}

impl HybridSizes {
    /// The layout of rank `rank` of `world` ranks.
    pub fn new(
        tp_flag: Option<usize>,
        pp_flag: Option<usize>,
        rank: usize,
        world: usize,
    ) -> Result<HybridSizes> {
        let tp = size_from(tp_flag, "--tp-size", TP_SIZE_ENV)?;
        let pp = size_from(pp_flag, "--pp-size", PP_SIZE_ENV)?;
        if !world.is_multiple_of(tp * pp) {
            return Err(usage(
                "--tp-size",
                format!(
                    "tp {tp} × pp {pp} = {} does not divide the {world} launched ranks; launch \
                     a multiple of it (--nproc-per-node × --nnodes)",
                    tp * pp
                ),
            ));
        }
        let dp = world / (tp * pp);
        Ok(HybridSizes {
            tp,
            pp,
            dp,
            tp_rank: rank % tp,
            dp_rank: rank / tp % dp,
            pp_rank: rank / (tp * dp),
        })
    }

    /// The ranks of each tensor-parallel group, in the order every rank creates them.
    fn tp_groups(&self) -> Vec<Vec<usize>> {
        let blocks = self.dp * self.pp;
        (0..blocks)
            .map(|b| (b * self.tp..(b + 1) * self.tp).collect())
            .collect()
    }

    /// The ranks of each data-parallel group (same pipeline stage, same slices).
    fn dp_groups(&self) -> Vec<Vec<usize>> {
        let mut groups = Vec::new();
        for pp in 0..self.pp {
            for tp in 0..self.tp {
                groups.push(
                    (0..self.dp)
                        .map(|dp| pp * self.dp * self.tp + dp * self.tp + tp)
                        .collect(),
                );
            }
        }
        groups
    }

    /// The ranks of each pipeline (one per stage, in stage order).
    fn pp_groups(&self) -> Vec<Vec<usize>> {
        let mut groups = Vec::new();
        for dp in 0..self.dp {
            for tp in 0..self.tp {
                groups.push(
                    (0..self.pp)
                        .map(|pp| pp * self.dp * self.tp + dp * self.tp + tp)
                        .collect(),
                );
            }
        }
        groups
    }

    /// The ranks of each model replica (all tp × pp ranks of one dp rank), ordered by stage
    /// then tp rank.
    fn replica_groups(&self) -> Vec<Vec<usize>> {
        (0..self.dp)
            .map(|dp| {
                let mut ranks = Vec::new();
                for pp in 0..self.pp {
                    for tp in 0..self.tp {
                        ranks.push(pp * self.dp * self.tp + dp * self.tp + tp);
                    }
                }
                ranks
            })
            .collect()
    }

    /// Whether the model is split over several ranks (tensor or pipeline parallelism).
    pub fn splits_model(&self) -> bool {
        self.tp > 1 || self.pp > 1
    }

    pub fn describe(&self) -> String {
        format!(
            "hybrid parallel: tp {} × dp {} × pp {} (this rank: tp {}, dp {}, pp {})",
            self.tp, self.dp, self.pp, self.tp_rank, self.dp_rank, self.pp_rank
        )
    }
}

/// This rank's communicators of the layout (`None` where the dimension is 1).
pub struct HybridGroups {
    pub tp: Option<Arc<dyn Communicator>>,
    pub dp: Option<Arc<dyn Communicator>>,
    pub pp: Option<Arc<dyn Communicator>>,
    /// Every rank of this rank's model replica (tp × pp), ordered by stage then tp rank.
    pub replica: Option<Arc<dyn Communicator>>,
}

impl HybridGroups {
    /// Collective over `world`: every rank creates every group, in the same order.
    pub fn new(sizes: &HybridSizes, world: &dyn Communicator) -> Result<HybridGroups> {
        let mine = |groups: Vec<Vec<usize>>, wanted: bool| -> Result<_> {
            let mut found: Option<Arc<dyn Communicator>> = None;
            for ranks in groups {
                if let Some(group) = world.new_group(&ranks)? {
                    found = Some(Arc::from(group));
                }
            }
            Ok(found.filter(|_| wanted))
        };
        let tp = mine(sizes.tp_groups(), sizes.tp > 1)?;
        let dp = mine(sizes.dp_groups(), sizes.dp > 1)?;
        let pp = mine(sizes.pp_groups(), sizes.pp > 1)?;
        let replica = mine(sizes.replica_groups(), sizes.splits_model())?;
        Ok(HybridGroups {
            tp,
            dp,
            pp,
            replica,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_is_innermost_then_data_then_pipeline() {
        let coords: Vec<_> = (0..8)
            .map(|r| {
                let s = HybridSizes::new(Some(2), Some(1), r, 8).unwrap();
                (s.tp_rank, s.dp_rank, s.pp_rank)
            })
            .collect();
        assert_eq!(coords[0], (0, 0, 0));
        assert_eq!(coords[1], (1, 0, 0));
        assert_eq!(coords[2], (0, 1, 0));
        assert_eq!(coords[7], (1, 3, 0));
        let s = HybridSizes::new(Some(2), Some(1), 0, 8).unwrap();
        assert_eq!(s.tp_groups()[1], vec![2, 3]);
        assert_eq!(s.dp_groups()[1], vec![1, 3, 5, 7]);
        // tp 2 × dp 2 × pp 2: stage 1 starts at rank 4.
        let s = HybridSizes::new(Some(2), Some(2), 5, 8).unwrap();
        assert_eq!((s.tp_rank, s.dp_rank, s.pp_rank), (1, 0, 1));
        assert_eq!(s.pp_groups()[1], vec![1, 5]);
        assert_eq!(s.replica_groups()[0], vec![0, 1, 4, 5]);
        assert_eq!(s.dp_groups()[2], vec![4, 6]);
    }

    /// The groups of a GPU split are cut from a routed world (device buffers over NCCL, host
    /// buffers over the host communicator). With a second host communicator of the same ranks
    /// standing in for NCCL, tp 2 × dp 2 on four ranks gets every group routed, each with the
    /// same rank and size in both backends, and the groups work: a host sum over each.
    #[test]
    fn groups_cut_from_a_routed_world_pair_both_backends() {
        use std::time::Duration;
        use tilearn_parallel::host::run_on_threads;
        use tilearn_parallel::{BufferMut, ReduceOp, RoutedCommunicator};

        let sums = run_on_threads(4, Duration::from_secs(30), |rank, host| {
            let host: Arc<dyn Communicator> = Arc::new(host);
            let device: Arc<dyn Communicator> =
                Arc::from(host.new_group(&[0, 1, 2, 3]).unwrap().unwrap());
            let world = RoutedCommunicator::new(device, host).unwrap();
            let sizes = HybridSizes::new(Some(2), Some(1), rank, 4).unwrap();
            let groups = HybridGroups::new(&sizes, &world).unwrap();
            let (tp, dp) = (groups.tp.unwrap(), groups.dp.unwrap());
            assert!(groups.pp.is_none());
            assert_eq!((tp.rank(), tp.world_size()), (sizes.tp_rank, 2));
            assert_eq!((dp.rank(), dp.world_size()), (sizes.dp_rank, 2));
            let mut values = [rank as f32, 10.0 * rank as f32];
            tp.all_reduce(BufferMut::from(&mut values[..1]), ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            dp.all_reduce(BufferMut::from(&mut values[1..]), ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            values
        })
        .unwrap();
        // tp groups {0, 1} and {2, 3}; dp groups {0, 2} and {1, 3}.
        assert_eq!(
            sums,
            vec![[1.0, 20.0], [1.0, 40.0], [5.0, 20.0], [5.0, 40.0]]
        );
    }

    #[test]
    fn sizes_that_do_not_fit_the_world_are_refused() {
        let err = HybridSizes::new(Some(3), None, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("does not divide the 4 launched ranks"),
            "{err}"
        );
        let err = HybridSizes::new(Some(0), None, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--tp-size"), "{err}");
    }
}
