//! SIGINT/SIGTERM/SIGHUP to the launcher: remembered, so the supervisor stops every rank and exits
//! instead of leaving them behind.

use std::sync::Once;
use std::sync::atomic::{AtomicI32, Ordering};

static RECEIVED: AtomicI32 = AtomicI32::new(0);
static INSTALL: Once = Once::new();

extern "C" fn remember(signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Installs the handlers (once per process).
pub fn install() {
    INSTALL.call_once(|| {
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: `remember` is an `extern "C" fn(c_int)` that only stores to an atomic,
            // which is async-signal-safe; replacing the default disposition is our intent.
            unsafe {
                libc::signal(signal, remember as *const () as libc::sighandler_t);
            }
        }
    });
}

/// The last termination signal received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// A signal's conventional name.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}
