//! A rank's heartbeat: a thread that tells the store every interval that this rank is alive. When
//! rank 0 hosts the store (torchrun, srun), the same thread is the watchdog: a rank silent for
//! longer than the heartbeat timeout ends rank 0 with a message naming it, and torchrun or Slurm
//! then stops the rest.

use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::store::StoreClient;

/// The running heartbeat; dropping it says goodbye to the store (this rank ends on purpose).
pub struct Heartbeat {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Heartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Heartbeat")
    }
}

/// The beat period for a heartbeat timeout: a tenth of it, between 50 ms and 5 s.
pub fn interval_for(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(5))
}

impl Heartbeat {
    /// Beats for `rank` over `store` (a connection of its own, so a long `wait` on the main one
    /// cannot delay it). With `watch`, also ends the process when another rank goes silent.
    pub fn start(store: StoreClient, rank: usize, timeout: Duration, watch: bool) -> Heartbeat {
        let (stop, stopped) = mpsc::channel::<()>();
        let interval = interval_for(timeout);
        let thread = std::thread::Builder::new()
            .name("tilearn-heartbeat".into())
            .spawn(move || {
                loop {
                    // A store that cannot be reached means rank 0 or the launcher is gone, which
                    // the collectives and the launcher report; the beat just keeps trying.
                    let _ = store.heartbeat(rank);
                    if watch
                        && let Ok(silent) = store.silent_ranks(timeout)
                        && let Some(first) = silent.first()
                    {
                        eprintln!(
                            "error: rank {first} stopped answering (no heartbeat for {} s)",
                            timeout.as_secs_f64()
                        );
                        std::process::exit(1);
                    }
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => continue,
                        _ => break,
                    }
                }
                let _ = store.goodbye(rank);
            });
        Heartbeat {
            stop: Some(stop),
            thread: thread.ok(),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            // The thread only returns; a panic in it was already printed.
            let _ = thread.join();
        }
    }
}
