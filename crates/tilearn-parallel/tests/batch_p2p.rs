//! `batch_p2p`: sends and receives posted together complete even when both ranks send a message
//! larger than the sockets' buffers to each other at once (sequential blocking sends would wait
//! for each other forever), and messages between two ranks match in list order.

mod support;

use std::time::Duration;

use tilearn_parallel::buffer::{HostSlice, HostSliceMut};
use tilearn_parallel::{Communicator, P2pOp};

#[test]
fn ranks_exchange_large_messages_in_one_batch() {
    // 16 MiB each way: far beyond the kernel's socket buffers.
    let len = 4 << 20;
    let results = support::with_group(2, Duration::from_secs(30), |rank, comm| {
        let peer = 1 - rank;
        let first: Vec<f32> = (0..len).map(|i| (rank * 10 + i % 7) as f32).collect();
        let second: Vec<f32> = vec![rank as f32 + 0.5; 3];
        let (mut got_first, mut got_second) = (vec![0f32; len], vec![0f32; 3]);
        let mut ops = [
            P2pOp::Send {
                buf: HostSlice::F32(&first),
                peer,
            },
            P2pOp::Recv {
                buf: HostSliceMut::F32(&mut got_first),
                peer,
            },
            P2pOp::Send {
                buf: HostSlice::F32(&second),
                peer,
            },
            P2pOp::Recv {
                buf: HostSliceMut::F32(&mut got_second),
                peer,
            },
        ];
        comm.batch_p2p(&mut ops).unwrap();
        (got_first, got_second)
    });
    for (rank, (first, second)) in results.iter().enumerate() {
        let peer = 1 - rank;
        assert!(
            first
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (peer * 10 + i % 7) as f32)
        );
        assert_eq!(second, &vec![peer as f32 + 0.5; 3]);
    }
}

#[test]
fn a_peer_outside_the_group_is_named() {
    let errors = support::with_group(2, Duration::from_secs(10), |_, comm| {
        let data = [1f32];
        let mut ops = [P2pOp::Send {
            buf: HostSlice::F32(&data),
            peer: 5,
        }];
        comm.batch_p2p(&mut ops).unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("batch_p2p") && e.contains('5'), "{e}");
    }
}
