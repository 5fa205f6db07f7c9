//! One rank as a child process: its own process group (so the launcher can stop everything it
//! started, grandchildren included), killed with the launcher on Linux (PR_SET_PDEATHSIG), and
//! its output forwarded line by line with a `[rank N]` prefix.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;

use crate::error::{ParallelError, Result};
use crate::launch::config::Program;
use crate::launch::signals;

/// A started rank.
#[derive(Debug)]
pub struct RankProcess {
    pub rank: usize,
    child: Child,
    pub exit: Option<ExitStatus>,
    /// The launcher sent it a signal (its death is not a cause).
    pub stopped_by_launcher: bool,
    forwarders: Vec<JoinHandle<()>>,
}

/// Starts `program` as `rank` with `env` added to the launcher's environment.
pub fn spawn(program: &Program, rank: usize, env: &[(String, String)]) -> Result<RankProcess> {
    let (path, args) = match program {
        Program::CurrentExe(args) => (
            std::env::current_exe()
                .map_err(|e| ParallelError::io("finding this executable", e))?
                .into_os_string(),
            args.clone(),
        ),
        Program::External { program, args } => (program.clone(), args.clone()),
    };
    let mut command = Command::new(&path);
    command
        .args(&args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let launcher_pid = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // system calls (setpgid, prctl, getppid, _exit) without allocating.
    unsafe {
        command.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died between fork and prctl: nobody would kill us later.
                if libc::getppid() != launcher_pid {
                    libc::_exit(1);
                }
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|source| ParallelError::Spawn {
        program: path.to_string_lossy().into_owned(),
        source,
    })?;
    let prefix = format!("[rank {rank}] ");
    let mut forwarders = Vec::new();
    if let Some(out) = child.stdout.take() {
        forwarders.push(forward(out, prefix.clone(), false));
    }
    if let Some(err) = child.stderr.take() {
        forwarders.push(forward(err, prefix, true));
    }
    Ok(RankProcess {
        rank,
        child,
        exit: None,
        stopped_by_launcher: false,
        forwarders,
    })
}

fn forward(pipe: impl Read + Send + 'static, prefix: String, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    // A closed terminal is no reason to stop the rank: drop the line.
                    let _ = if to_stderr {
                        write_prefixed(&mut std::io::stderr().lock(), &prefix, &line)
                    } else {
                        write_prefixed(&mut std::io::stdout().lock(), &prefix, &line)
                    };
                }
            }
        }
    })
}

fn write_prefixed(out: &mut impl Write, prefix: &str, line: &[u8]) -> std::io::Result<()> {
    out.write_all(prefix.as_bytes())?;
    out.write_all(line)?;
    out.flush()
}

impl RankProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Records the exit status if the process has ended.
    pub fn poll(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self
                .child
                .try_wait()
                .map_err(|e| ParallelError::io(format!("waiting for rank {}", self.rank), e))?;
        }
        Ok(self.exit)
    }

    pub fn running(&self) -> bool {
        self.exit.is_none()
    }

    /// Sends `signal` to the rank's whole process group.
    pub fn signal_group(&mut self, signal: i32) {
        if self.running() {
            self.stopped_by_launcher = true;
        }
        // SAFETY: kill(2) with a negative pid signals the process group the child leads (it
        // called setpgid(0, 0)); ESRCH (already gone) is harmless.
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), signal);
        }
    }

    /// After the rank exited: kills whatever it left in its process group and waits for the
    /// output forwarders to drain.
    pub fn finish(&mut self) {
        // SAFETY: as in `signal_group`; the group is empty (ESRCH) unless the rank left
        // children behind, which must not outlive the job.
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
        for forwarder in self.forwarders.drain(..) {
            // A forwarder only returns at end of pipe; a panic there was printed already.
            let _ = forwarder.join();
        }
    }

    /// Why this rank ended badly, in words, or `None` if it succeeded.
    pub fn failure(&self) -> Option<String> {
        let status = self.exit?;
        if status.success() {
            return None;
        }
        Some(match (status.code(), status.signal()) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(signal)) => {
                format!("was killed by signal {signal} ({})", signals::name(signal))
            }
            _ => format!("ended with {status}"),
        })
    }
}
