//! How the host communicator fails: a rank that leaves, a rank that never arrives, ranks that
//! disagree on the collective. Each ends in a named error within a bounded time, never a hang.

mod support;

use std::time::{Duration, Instant};

use tilearn_parallel::{BufferMut, Communicator, ParallelError, ReduceOp};

#[test]
fn a_rank_that_leaves_is_named_by_its_peers() {
    let start = Instant::now();
    let results = support::with_group(3, Duration::from_secs(20), |rank, comm| {
        if rank == 2 {
            drop(comm); // closes its sockets, as a crashed process would
            return None;
        }
        let mut x = vec![1.0f32; 100_000];
        Some(
            comm.all_reduce(BufferMut::from(&mut x), ReduceOp::Sum)
                .map(|w| w.wait()),
        )
    });
    for (rank, result) in results.into_iter().enumerate().take(2) {
        let err = match result.unwrap() {
            Ok(Ok(())) => panic!("rank {rank}: the collective succeeded without rank 2"),
            Ok(Err(e)) | Err(e) => e,
        };
        // rank 0's left neighbour is 2; rank 1 waits on rank 0, which fails in turn
        assert!(
            matches!(err, ParallelError::PeerLost { .. }),
            "rank {rank}: {err}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_rank_that_never_arrives_times_out() {
    let timeout = Duration::from_millis(500);
    let start = Instant::now();
    let results = support::with_group(2, timeout, |rank, comm| {
        if rank == 1 {
            std::thread::sleep(timeout * 4); // stays connected but never joins the collective
            return None;
        }
        let mut x = vec![1.0f32; 8];
        Some(
            comm.all_reduce(BufferMut::from(&mut x), ReduceOp::Sum)
                .unwrap_err(),
        )
    });
    let err = results[0].as_ref().unwrap();
    assert!(
        matches!(err, ParallelError::Timeout { peer, .. } if peer == "rank 1"),
        "{err}"
    );
    assert!(err.is_secondary());
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn ranks_that_disagree_on_the_collective_get_an_out_of_step_error() {
    let results = support::with_group(2, Duration::from_secs(5), |rank, comm| {
        let mut x = vec![1.0f32; 4 + rank]; // different lengths
        let result = comm
            .all_reduce(BufferMut::from(&mut x), ReduceOp::Sum)
            .map(|_| ());
        // Stay connected a moment, as an exiting process does: closing a socket with unread
        // bytes resets it, which could discard the error frame before the peer reads it.
        std::thread::sleep(Duration::from_millis(300));
        result
    });
    for (rank, result) in results.into_iter().enumerate() {
        // One rank sees the mismatch; it tells the other, which fails with that reason.
        let err = result.unwrap_err();
        let named = match &err {
            ParallelError::OutOfStep { .. } => true,
            ParallelError::Refused { message, .. } => message.contains("out of step"),
            _ => false,
        };
        assert!(named, "rank {rank}: {err}");
    }
}

#[test]
fn bad_arguments_are_errors() {
    support::with_group(2, Duration::from_secs(5), |_, comm| {
        let mut odd = vec![0f32; 3];
        let err = comm
            .reduce_scatter(BufferMut::from(&mut odd), ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, ParallelError::Buffer { .. }), "{err}");
        let err = comm.broadcast(BufferMut::from(&mut odd), 7).unwrap_err();
        assert!(
            matches!(err, ParallelError::InvalidRank { rank: 7, .. }),
            "{err}"
        );
        assert!(comm.new_group(&[1, 0]).is_err());
        assert!(comm.new_group(&[0, 5]).is_err());
    });
}
