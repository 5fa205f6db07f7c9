//! Fuzzing the wire: random, truncated, bit-flipped and oversized frames and payloads must give
//! errors, never a panic, a hang or an allocation beyond the frame limit; the store answers such
//! input with an error frame or a closed connection and keeps serving real clients.

use std::io::{Cursor, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_parallel::JobToken;
use tilearn_parallel::store::protocol::{Request, Response};
use tilearn_parallel::store::{StoreClient, StoreServer};
use tilearn_parallel::wire::frame::{
    FrameError, FrameKind, HEADER_LEN, MAGIC, VERSION, header, read_frame, write_frame,
};
use tilearn_parallel::wire::handshake::{Hello, Role};

const MAX: usize = 1 << 16;

fn valid_requests() -> Vec<Request> {
    vec![
        Request::Set {
            key: "addr/3".into(),
            value: b"10.0.0.1:4000".to_vec(),
        },
        Request::Get { key: "k".into() },
        Request::Wait {
            keys: vec!["a".into(), "b".into()],
            timeout: Duration::from_millis(5),
        },
        Request::Add {
            key: "n".into(),
            delta: -7,
        },
        Request::CompareSet {
            key: "c".into(),
            expected: Some(b"x".to_vec()),
            desired: b"y".to_vec(),
        },
        Request::CompareSet {
            key: "c".into(),
            expected: None,
            desired: vec![],
        },
        Request::Delete { key: "k".into() },
        Request::Heartbeat { rank: 4 },
        Request::Goodbye { rank: 4 },
        Request::Silent {
            max_age: Duration::from_secs(3),
        },
    ]
}

#[test]
fn random_and_mutated_bytes_never_panic_the_parsers() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let requests = valid_requests();
    for r in &requests {
        assert_eq!(&Request::decode(&r.encode()).unwrap(), r, "round trip");
    }
    let responses = [
        Response::Ok,
        Response::Value(Some(b"v".to_vec())),
        Response::Value(None),
        Response::Int(-1),
        Response::Bool(true),
        Response::Ranks(vec![1, 5]),
        Response::TimedOut,
    ];
    for r in &responses {
        assert_eq!(&Response::decode(&r.encode()).unwrap(), r, "round trip");
    }
    for i in 0..20_000 {
        // random payloads
        let len = rng.random_range(0..64);
        let mut bytes = vec![0u8; len];
        rng.fill_bytes(&mut bytes);
        let _ = Request::decode(&bytes);
        let _ = Response::decode(&bytes);
        let _ = Hello::decode(&bytes);
        // mutated valid payloads: truncation and bit flips
        let mut valid = requests[i % requests.len()].encode();
        if rng.random_bool(0.5) {
            valid.truncate(rng.random_range(0..=valid.len()));
        } else if !valid.is_empty() {
            let at = rng.random_range(0..valid.len());
            valid[at] ^= 1 << rng.random_range(0..8);
        }
        let _ = Request::decode(&valid);
        // random streams through the frame reader, half of them behind a valid magic
        let mut stream = vec![0u8; rng.random_range(0..64)];
        rng.fill_bytes(&mut stream);
        if rng.random_bool(0.5) && stream.len() >= 6 {
            stream[..4].copy_from_slice(&MAGIC);
            stream[4] = VERSION;
        }
        match read_frame(&mut Cursor::new(&stream), MAX) {
            Ok(frame) => assert!(frame.payload.len() <= MAX),
            Err(FrameError::TooLarge { len, max }) => assert!(len > max),
            Err(_) => {}
        }
    }
}

#[test]
fn oversized_and_truncated_frames_are_errors_before_any_allocation() {
    let mut huge = header(FrameKind::Request, u32::MAX as usize)
        .unwrap()
        .to_vec();
    huge.extend_from_slice(b"tiny");
    match read_frame(&mut Cursor::new(&huge), MAX) {
        Err(FrameError::TooLarge { len, max }) => {
            assert_eq!((len, max), (u32::MAX as u64, MAX as u64))
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let mut short = header(FrameKind::Request, 100).unwrap().to_vec();
    short.extend_from_slice(&[0u8; 10]);
    assert!(matches!(
        read_frame(&mut Cursor::new(&short), MAX),
        Err(FrameError::Io(_))
    ));
    let mut bad_kind = header(FrameKind::Data, 0).unwrap();
    bad_kind[5] = 200;
    assert!(matches!(
        read_frame(&mut Cursor::new(&bad_kind), MAX),
        Err(FrameError::Malformed(_))
    ));
    assert_eq!(HEADER_LEN, bad_kind.len());
}

/// Reads whatever the server answers until it closes or 5 s pass; returns the bytes.
fn drain(stream: &mut TcpStream) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    out
}

#[test]
fn the_store_answers_garbage_with_an_error_and_keeps_serving() {
    let token = JobToken::random();
    let server = StoreServer::bind("127.0.0.1:0", token.clone(), 2).unwrap();
    let addr = server.local_addr();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let start = Instant::now();
    for round in 0..12 {
        let mut stream = TcpStream::connect(addr).unwrap();
        let mut garbage = vec![0u8; rng.random_range(1..300)];
        rng.fill_bytes(&mut garbage);
        if round % 3 == 1 {
            // a valid-looking header that declares a gigantic payload
            garbage = header(FrameKind::Hello, u32::MAX as usize)
                .unwrap()
                .to_vec();
        }
        stream.write_all(&garbage).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let answer = drain(&mut stream);
        if !answer.is_empty() {
            let frame = read_frame(&mut Cursor::new(&answer), 1 << 16).unwrap();
            assert_eq!(frame.kind, FrameKind::Error, "round {round}");
        }
    }
    // After an admitted handshake: an oversized request frame is answered with an error frame.
    let mut stream = TcpStream::connect(addr).unwrap();
    let hello = Hello {
        role: Role::StoreClient,
        rank: 0,
        token: token.as_str().as_bytes().to_vec(),
    };
    write_frame(&mut stream, FrameKind::Hello, &[&hello.encode()]).unwrap();
    assert_eq!(
        read_frame(&mut stream, 64).unwrap().kind,
        FrameKind::Welcome
    );
    stream
        .write_all(&header(FrameKind::Request, 1 << 30).unwrap())
        .unwrap();
    let answer = drain(&mut stream);
    let frame = read_frame(&mut Cursor::new(&answer), 1 << 16).unwrap();
    assert_eq!(frame.kind, FrameKind::Error);
    assert!(String::from_utf8_lossy(&frame.payload).contains("over the store's limit"));
    // A well-framed but undecodable request gets an error answer on a still-open connection.
    let c = StoreClient::connect(&addr.to_string(), &token, 1, Duration::from_secs(5)).unwrap();
    c.set("still", b"serving").unwrap();
    assert_eq!(c.get("still").unwrap().as_deref(), Some(&b"serving"[..]));
    assert!(start.elapsed() < Duration::from_secs(30));
}
