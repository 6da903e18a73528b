//! Processes as `/proc` and `kill(2)` see them: this process's pid and pid
//! namespace, `/proc/<pid>/stat`, and the one pid-liveness check of the
//! workspace.

use std::io;
use std::os::unix::fs::MetadataExt;

/// This process's pid, in its own pid namespace.
pub fn current_pid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

/// Inode of this process's pid namespace, 0 if `/proc` cannot tell.
pub fn own_pid_ns() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |meta| meta.ino())
}

/// The two fields of `/proc/<pid>/stat` the ledger needs.
pub struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// Field 22: start time in clock ticks after boot.
    pub start_time: u64,
}

/// Reads the state and start time from a `/proc/<pid>/stat` file at `path`.
pub fn read_proc_stat(path: &str) -> io::Result<ProcStat> {
    let text = std::fs::read_to_string(path)?;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat");
    // Field 2 (comm) is parenthesised and may contain spaces and ')'.
    let (_, rest) = text.rsplit_once(')').ok_or_else(malformed)?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields
        .next()
        .and_then(|field| field.chars().next())
        .ok_or_else(malformed)?;
    let start_time = fields
        .nth(22 - 4)
        .and_then(|field| field.parse().ok())
        .ok_or_else(malformed)?;
    Ok(ProcStat { state, start_time })
}

/// Whether the process registered as (`pid`, `start_time`) has exited: no such
/// pid, a zombie (the driver has freed its memory), or a different process
/// that reuses the pid. `start_time` 0 (unknown) checks only existence.
/// Anything `/proc` cannot tell counts as alive.
pub fn process_is_gone(pid: i32, start_time: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that the pid exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    match read_proc_stat(&format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.state == 'Z'
                || stat.state == 'X'
                || (start_time != 0 && stat.start_time != start_time)
        }
        Err(err) => err.kind() == io::ErrorKind::NotFound,
    }
}
