//! The rendezvous store: every request, waits and their timeouts, admission, heartbeats.

use std::time::{Duration, Instant};

use tilearn_parallel::store::{LAUNCHER_RANK, StoreClient, StoreServer};
use tilearn_parallel::{JobToken, ParallelError};

const TIMEOUT: Duration = Duration::from_secs(5);

fn server(world: usize) -> (StoreServer, JobToken, String) {
    let token = JobToken::random();
    let server = StoreServer::bind("127.0.0.1:0", token.clone(), world).unwrap();
    let addr = server.local_addr().to_string();
    (server, token, addr)
}

#[test]
fn set_get_add_compare_delete() {
    let (server, token, addr) = server(2);
    assert!(server.local_addr().ip().is_loopback());
    let a = StoreClient::connect(&addr, &token, 0, TIMEOUT).unwrap();
    let b = StoreClient::connect(&addr, &token, 1, TIMEOUT).unwrap();
    assert_eq!(a.get("k").unwrap(), None);
    a.set("k", b"v1").unwrap();
    assert_eq!(b.get("k").unwrap().as_deref(), Some(&b"v1"[..]));
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(b.add("n", -5).unwrap(), -3);
    // compare_set: absent → set; wrong expectation → unchanged; right one → swapped
    assert_eq!(
        a.compare_set("c", None, b"x").unwrap().as_deref(),
        Some(&b"x"[..])
    );
    assert_eq!(
        b.compare_set("c", None, b"y").unwrap().as_deref(),
        Some(&b"x"[..])
    );
    assert_eq!(
        b.compare_set("c", Some(b"x"), b"z").unwrap().as_deref(),
        Some(&b"z"[..])
    );
    assert!(a.delete("c").unwrap());
    assert!(!a.delete("c").unwrap());
    // add on a non-integer value is an error answer, and the connection stays usable
    let err = a.add("k", 1).unwrap_err();
    assert!(matches!(err, ParallelError::Refused { .. }), "{err}");
    assert_eq!(a.get("k").unwrap().as_deref(), Some(&b"v1"[..]));
    // a launcher is admitted too
    StoreClient::connect(&addr, &token, LAUNCHER_RANK, TIMEOUT).unwrap();
}

#[test]
fn wait_is_released_by_a_set_and_times_out_otherwise() {
    let (_server, token, addr) = server(2);
    let a = StoreClient::connect(&addr, &token, 0, TIMEOUT).unwrap();
    let start = Instant::now();
    let err = a.wait(&["never"], Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, ParallelError::StoreTimeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));

    std::thread::scope(|s| {
        s.spawn(|| {
            let b = StoreClient::connect(&addr, &token, 1, TIMEOUT).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            b.set("x", b"1").unwrap();
            b.set("y", b"2").unwrap();
        });
        a.wait(&["x", "y"], TIMEOUT).unwrap();
        assert_eq!(a.wait_get("y", TIMEOUT).unwrap(), b"2");
    });
}

#[test]
fn foreign_tokens_and_ranks_are_refused() {
    let (_server, token, addr) = server(2);
    let err = StoreClient::connect(&addr, &JobToken::random(), 0, TIMEOUT).unwrap_err();
    assert!(
        matches!(&err, ParallelError::Refused { message, .. } if message.contains("not a rank of this job")),
        "{err}"
    );
    let err = StoreClient::connect(&addr, &token, 2, TIMEOUT).unwrap_err();
    assert!(
        matches!(&err, ParallelError::Refused { message, .. } if message.contains("rank 2")),
        "{err}"
    );
}

#[test]
fn silent_ranks_are_those_whose_heartbeats_stopped() {
    let (_server, token, addr) = server(3);
    let c = StoreClient::connect(&addr, &token, 0, TIMEOUT).unwrap();
    c.heartbeat(0).unwrap();
    c.heartbeat(1).unwrap();
    c.heartbeat(2).unwrap();
    c.goodbye(2).unwrap(); // finished: never silent
    std::thread::sleep(Duration::from_millis(150));
    c.heartbeat(0).unwrap();
    assert_eq!(c.silent_ranks(Duration::from_millis(100)).unwrap(), vec![1]);
    assert_eq!(
        c.silent_ranks(Duration::from_secs(60)).unwrap(),
        Vec::<usize>::new()
    );
}

#[test]
fn dropping_the_server_releases_waiting_clients() {
    let (server, token, addr) = server(1);
    let c = StoreClient::connect(&addr, &token, 0, TIMEOUT).unwrap();
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            drop(server);
        });
        assert!(c.wait(&["never"], Duration::from_secs(30)).is_err());
    });
    assert!(start.elapsed() < Duration::from_secs(5));
}
