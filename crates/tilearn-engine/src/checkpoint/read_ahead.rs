//! Reading a memory-mapped checkpoint file ahead of the code that decodes it, so the disk stays
//! busy while that code converts a piece and hands it to the GPU.
//!
//! A load touches the mapping piece by piece; without help, the kernel reads a page range only
//! when a decoding thread faults on it (in read-ahead-sized requests, 128 KiB by default), and
//! the disk idles while a piece is converted and copied. [`ReadAhead::run`] starts
//! [`READERS`] threads that `pread` the file front to back in [`CHUNK_BYTES`] requests (large,
//! sequential, as `dd` reads) into a scratch buffer and so into the page cache; the consumer
//! then finds its pages cached. The readers stay at most `window` bytes ahead of the consumer's
//! progress ([`ReadAhead::advance`], called as each piece's pages are handed back), so the page
//! cache holds a bounded window of the file and host memory grows only by the readers' scratch
//! buffers ([`READERS`] × [`CHUNK_BYTES`]). Two readers, so one request is in flight while the
//! other reader copies its chunk out.
//!
//! The readers are a hint: a read error only stops them, and the consumer's own access reports
//! the problem. A consumer that skips part of the file (a ZeRO rank reading its shard of a whole
//! optimizer file) costs at most one window of unneeded reading per gap.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Bytes the readers may be ahead of the consumer (the page-cache window of one load).
pub(crate) const WINDOW_BYTES: u64 = 256 << 20;
/// Bytes per `pread`.
pub(crate) const CHUNK_BYTES: u64 = 8 << 20;
/// Reader threads per file.
pub(crate) const READERS: usize = 2;

/// The read-ahead state of one file.
pub(crate) struct ReadAhead {
    state: Mutex<State>,
    wake: Condvar,
    window: u64,
    chunk: u64,
    /// Bytes the readers have read (what the tests check).
    read: AtomicU64,
}

struct State {
    /// The consumer is done with the file up to here (bytes from its start).
    consumed: u64,
    /// The first byte no reader has claimed yet.
    next: u64,
    /// Set when the consumer finished (or failed): the readers exit.
    stop: bool,
}

/// Stops the readers when dropped (also when the consumer panics), so the scope can join them.
struct StopOnDrop<'a>(&'a ReadAhead);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.wake.notify_all();
    }
}

impl ReadAhead {
    /// Read-ahead at most `window` bytes ahead of the consumer, in requests of `chunk` bytes.
    pub fn new(window: u64, chunk: u64) -> ReadAhead {
        ReadAhead {
            state: Mutex::new(State {
                consumed: 0,
                next: 0,
                stop: false,
            }),
            wake: Condvar::new(),
            window: window.max(1),
            chunk: chunk.clamp(1, window.max(1)),
            read: AtomicU64::new(0),
        }
    }

    /// Records that the consumer is done with the file up to byte `end`.
    pub fn advance(&self, end: u64) {
        let mut state = self.lock();
        if end > state.consumed {
            state.consumed = end;
            drop(state);
            self.wake.notify_all();
        }
    }

    /// Bytes the readers have read so far.
    #[cfg(test)]
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Runs `consume` while [`READERS`] threads read the first `len` bytes of `file` ahead of
    /// it (see the module docs); they are stopped and joined before this returns.
    pub fn run<R>(&self, file: &File, len: u64, consume: impl FnOnce() -> R) -> R {
        self.lock().stop = false;
        std::thread::scope(|scope| {
            for _ in 0..READERS {
                scope.spawn(|| self.read(file, len));
            }
            let _stop = StopOnDrop(self);
            consume()
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a few integers updated in one step each: a panic elsewhere cannot leave
        // it inconsistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next chunk a reader should read, waiting while it would be more than a window
    /// ahead; `None` once the file is read or the consumer is done.
    fn claim(&self, len: u64) -> Option<Range<u64>> {
        let mut state = self.lock();
        loop {
            if state.stop {
                return None;
            }
            // Bytes the consumer already passed are not worth reading.
            state.next = state.next.max(state.consumed);
            if state.next >= len {
                return None;
            }
            let limit = state.consumed.saturating_add(self.window).min(len);
            if state.next < limit {
                let start = state.next;
                state.next = (start + self.chunk).min(limit);
                return Some(start..state.next);
            }
            state = self
                .wake
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// One reader: reads claimed chunks into a scratch buffer (the page cache keeps them).
    fn read(&self, file: &File, len: u64) {
        let mut scratch = vec![0u8; self.chunk as usize];
        while let Some(chunk) = self.claim(len) {
            let mut pos = chunk.start;
            while pos < chunk.end {
                let want = (chunk.end - pos) as usize;
                match file.read_at(&mut scratch[..want], pos) {
                    Ok(0) => return,
                    Ok(n) => {
                        pos += n as u64;
                        self.read.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // Only a hint: the consumer's own reads report the error.
                    Err(_) => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::{Duration, Instant};

    use super::*;

    fn file_of(len: usize) -> (tempfile::NamedTempFile, File) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![7u8; len]).unwrap();
        f.flush().unwrap();
        let file = File::open(f.path()).unwrap();
        (f, file)
    }

    /// Waits (up to 10 s) until the readers have read `bytes`.
    fn wait_for(ahead: &ReadAhead, bytes: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while ahead.bytes_read() < bytes {
            assert!(
                Instant::now() < deadline,
                "read {} of {bytes}",
                ahead.bytes_read()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn readers_stay_one_window_ahead_of_the_consumer() {
        let len = 100_000u64;
        let (_keep, file) = file_of(len as usize);
        let ahead = ReadAhead::new(10_000, 3_000);
        ahead.run(&file, len, || {
            wait_for(&ahead, 10_000);
            // Give a reader that ignored the window time to overshoot.
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(ahead.bytes_read(), 10_000, "read past the window");
            ahead.advance(4_000);
            wait_for(&ahead, 14_000);
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(ahead.bytes_read(), 14_000);
            // The consumer jumps ahead: the bytes it skipped are not read.
            ahead.advance(95_000);
            wait_for(&ahead, 19_000);
        });
        assert_eq!(
            ahead.bytes_read(),
            19_000,
            "nothing read after the consumer finished"
        );
    }

    #[test]
    fn a_consumer_that_stops_early_or_panics_does_not_hang_the_readers() {
        let len = 50_000u64;
        let (_keep, file) = file_of(len as usize);
        let ahead = ReadAhead::new(1_000, 500);
        // Returns without advancing: the readers wait for progress and must still be stopped.
        assert_eq!(ahead.run(&file, len, || 5), 5);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ahead.run(&file, len, || panic!("consumer failed"))
        }));
        assert!(panicked.is_err());
        // A whole file read with the window always open.
        let whole = ReadAhead::new(u64::MAX, 4_096);
        whole.run(&file, len, || wait_for(&whole, len));
        assert_eq!(whole.bytes_read(), len);
    }
}
