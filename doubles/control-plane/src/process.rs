//! One component of the control plane as a child process: its output in a
//! log file of the cluster's folder, asked to stop with SIGTERM (then
//! killed) when dropped, and killed by the kernel if the test process dies
//! first (the parent-death signal), so that none outlives its test.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

/// Has the kernel kill `command`'s process when the one that started it
/// dies (the parent-death signal), so that none outlives its test.
pub fn dies_with_parent(command: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only
    // calls prctl, which is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A running component.
pub(crate) struct Component {
    /// Its name (`kube-apiserver`, …).
    pub(crate) name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Component {
    /// Starts `program name args…`, its output to `<dir>/<name>.log`.
    pub(crate) fn start(
        program: &Path,
        name: &'static str,
        args: &[String],
        dir: &Path,
    ) -> Result<Self, Error> {
        let log = dir.join(format!("{name}.log"));
        let io = |what: &str, source| Error::Io {
            what: format!("{what} {name}"),
            source,
        };
        let out = File::create(&log).map_err(|e| io("log of", e))?;
        let err = out.try_clone().map_err(|e| io("log of", e))?;
        let mut command = Command::new(program);
        command
            .arg(name)
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        dies_with_parent(&mut command);
        let child = command.spawn().map_err(|e| io("start", e))?;
        Ok(Self { name, child, log })
    }

    /// Fails with the end of its log if it has exited.
    pub(crate) fn check(&mut self) -> Result<(), Error> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(Error::Exited {
                component: self.name,
                status: status.to_string(),
                log: self.log_tail(),
            }),
            Err(source) => Err(Error::Io {
                what: format!("wait for {}", self.name),
                source,
            }),
        }
    }

    /// The last lines of its log.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after `grace`; waits for it.
    pub(crate) fn stop(&mut self, grace: Duration) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}
