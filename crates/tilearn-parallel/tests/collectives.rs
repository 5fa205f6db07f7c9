//! Property tests of every host collective against a sequential reference: world sizes 1–5, odd
//! and tiny lengths, f32/bf16/f16, every reduce op. Inputs are multiples of 1/8 in [-8, 8], so
//! every f32 partial sum is exact and the only rounding is the final one to the buffer's dtype:
//! the results must equal the reference bit for bit, on every rank.

mod support;

use std::time::Duration;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_parallel::{BufferMut, CommElement, Communicator, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(20);
const CASES: usize = 40;

/// The deterministic input of `rank` in case `case` (every rank can compute everyone's).
fn input(case: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(case * 1000 + rank as u64);
    (0..len)
        .map(|_| rng.random_range(-64i32..=64) as f32 / 8.0)
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Case {
    seed: u64,
    len: usize,
    op: ReduceOp,
    root: usize,
}

fn cases(world: usize) -> Vec<Case> {
    let mut rng = ChaCha8Rng::seed_from_u64(world as u64);
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::ScaledSum(0.25),
        ReduceOp::Max,
        ReduceOp::Min,
    ];
    let fixed = [0usize, 1, 2, 3, 5, 7, 13, 1001];
    (0..CASES)
        .map(|i| Case {
            seed: world as u64 * 10_000 + i as u64,
            len: if i < fixed.len() {
                fixed[i]
            } else {
                2 * rng.random_range(0..2000) + 1
            },
            op: ops[i % ops.len()],
            root: rng.random_range(0..world),
        })
        .collect()
}

fn typed<T: CommElement>(values: &[f32]) -> Vec<T> {
    values.iter().map(|&v| T::from_f32(v)).collect()
}

fn widened<T: CommElement>(values: &[T]) -> Vec<f32> {
    values.iter().map(|&v| v.to_f32()).collect()
}

/// The reference rounded to `T` and back, as the backend's output must be.
fn rounded<T: CommElement>(values: &[f32]) -> Vec<f32> {
    widened(&typed::<T>(values))
}

fn check_dtype<T: CommElement>(world: usize, rank: usize, comm: &dyn Communicator) {
    for case in cases(world) {
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(case.seed, r, case.len)).collect();
        let what = format!("{} world {world} rank {rank} {case:?}", T::DTYPE);

        // all_reduce
        let mut buf = typed::<T>(&inputs[rank]);
        comm.all_reduce(BufferMut::from(&mut buf), case.op)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            widened(&buf),
            rounded::<T>(&case.op.reference(&inputs)),
            "all_reduce {what}"
        );

        // reduce_scatter and all_gather on `world` shards of the case's length
        let shard = case.len;
        let full: Vec<Vec<f32>> = (0..world)
            .map(|r| input(case.seed + 1, r, shard * world))
            .collect();
        let mut buf = typed::<T>(&full[rank]);
        comm.reduce_scatter(BufferMut::from(&mut buf), case.op)
            .unwrap()
            .wait()
            .unwrap();
        let own = rank * shard..(rank + 1) * shard;
        let expected = rounded::<T>(&case.op.reference(&full));
        assert_eq!(
            widened(&buf[own.clone()]),
            expected[own.clone()],
            "reduce_scatter {what}"
        );

        let mut gathered = vec![T::from_f32(f32::NAN); shard * world];
        gathered[own.clone()].copy_from_slice(&typed::<T>(&full[rank][own]));
        comm.all_gather(BufferMut::from(&mut gathered))
            .unwrap()
            .wait()
            .unwrap();
        let expected: Vec<f32> = (0..world)
            .flat_map(|r| rounded::<T>(&full[r][r * shard..(r + 1) * shard]))
            .collect();
        assert_eq!(widened(&gathered), expected, "all_gather {what}");

        // broadcast
        let mut buf = typed::<T>(&inputs[rank]);
        comm.broadcast(BufferMut::from(&mut buf), case.root)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            widened(&buf),
            rounded::<T>(&inputs[case.root]),
            "broadcast {what}"
        );

        // all_to_all: shard j of rank r goes to rank j, at position r
        let mut buf = typed::<T>(&full[rank]);
        comm.all_to_all(BufferMut::from(&mut buf))
            .unwrap()
            .wait()
            .unwrap();
        let expected: Vec<f32> = (0..world)
            .flat_map(|r| rounded::<T>(&full[r][rank * shard..(rank + 1) * shard]))
            .collect();
        assert_eq!(widened(&buf), expected, "all_to_all {what}");

        // send/recv between pairs (0↔1, 2↔3): the lower rank sends first
        let partner = rank ^ 1;
        if partner < world {
            let mine = typed::<T>(&inputs[rank]);
            let mut theirs = vec![T::from_f32(0.0); case.len];
            if rank < partner {
                comm.send((&mine[..]).into(), partner)
                    .unwrap()
                    .wait()
                    .unwrap();
                comm.recv(BufferMut::from(&mut theirs), partner)
                    .unwrap()
                    .wait()
                    .unwrap();
            } else {
                comm.recv(BufferMut::from(&mut theirs), partner)
                    .unwrap()
                    .wait()
                    .unwrap();
                comm.send((&mine[..]).into(), partner)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            assert_eq!(
                widened(&theirs),
                rounded::<T>(&inputs[partner]),
                "send/recv {what}"
            );
        }
        comm.barrier().unwrap();
    }
}

#[test]
fn every_collective_matches_the_sequential_reference() {
    for world in 1..=5 {
        support::with_group(world, TIMEOUT, |rank, comm| {
            check_dtype::<f32>(world, rank, &comm);
            check_dtype::<bf16>(world, rank, &comm);
            check_dtype::<f16>(world, rank, &comm);
        });
    }
}

#[test]
fn half_precision_sums_accumulate_in_f32() {
    // Rank 1 holds 1.0, ranks 0, 2, 3, 4 hold a quarter of the half type's last mantissa step.
    // The ring reduces the element starting at rank 1, so an accumulator in the half type would
    // round every partial sum back to 1.0; accumulating in f32 gives 1 + one step exactly.
    let world = 5;
    let bf16_step = 1.0 / 128.0; // bf16: 7 explicit mantissa bits
    let f16_step = 1.0 / 1024.0; // f16: 10
    let results = support::with_group(world, TIMEOUT, |rank, comm| {
        let value = |step: f32| if rank == 1 { 1.0 } else { step / 4.0 };
        let mut b = vec![bf16::from_f32(value(bf16_step))];
        let mut h = vec![f16::from_f32(value(f16_step))];
        comm.all_reduce(BufferMut::from(&mut b), ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        comm.all_reduce(BufferMut::from(&mut h), ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        (b[0].to_f32(), h[0].to_f32())
    });
    for (rank, (b, h)) in results.into_iter().enumerate() {
        assert_eq!(b, 1.0 + bf16_step, "bf16 on rank {rank}");
        assert_eq!(h, 1.0 + f16_step, "f16 on rank {rank}");
    }
}

#[test]
fn sub_groups_reduce_among_their_members_only() {
    let world = 5;
    let results = support::with_group(world, TIMEOUT, |rank, comm| {
        let evens = comm.new_group(&[0, 2, 4]).unwrap();
        let odds = comm.new_group(&[1, 3]).unwrap();
        let mine = evens
            .as_ref()
            .or(odds.as_ref())
            .expect("every rank is in one group");
        let mut x = vec![rank as f32; 7];
        mine.all_reduce(BufferMut::from(&mut x), ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        // The world still works after (and interleaved with) the groups.
        let mut y = vec![1.0f32; 3];
        comm.all_reduce(BufferMut::from(&mut y), ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        (mine.rank(), mine.world_size(), x[0], y[0])
    });
    let expected = [
        (0, 3, 6.0, 5.0),
        (0, 2, 4.0, 5.0),
        (1, 3, 6.0, 5.0),
        (1, 2, 4.0, 5.0),
        (2, 3, 6.0, 5.0),
    ];
    for (rank, (got, want)) in results.iter().zip(expected).enumerate() {
        assert_eq!(*got, want, "rank {rank}");
    }
}
