//! Talking to an MPS control daemon the way NVIDIA documents it: the
//! control program without arguments, the command on its stdin and the
//! daemon's pipe folder in `CUDA_MPS_PIPE_DIRECTORY`. Also the folders a
//! daemon needs, and a daemon left over from an earlier run of ours.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_utils::served_gpu;

use super::CorunError;

/// The control daemon's pid file in its pipe folder.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The control daemon's socket in its pipe folder.
pub const SOCKET: &str = "control";

/// How often a wait on a process looks again.
const POLL: Duration = Duration::from_millis(10);

/// The control program, aimed at one daemon's pipe folder.
#[derive(Debug, Clone)]
pub struct Control {
    /// The `nvidia-cuda-mps-control` program (`--mps-control`).
    pub program: PathBuf,
    /// The daemon's pipe folder ([`pipe_dir`](crate::pipe_dir)), passed as
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe: PathBuf,
}

impl Control {
    /// Sends `command` and returns what the program printed; an error when
    /// it failed (no daemon: the real one prints "Cannot find MPS control
    /// daemon process" and exits 1) or took longer than `timeout`.
    pub fn send(&self, command: &str, timeout: Duration) -> Result<String, CorunError> {
        let mut child = Command::new(&self.program)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| CorunError::Spawn {
                program: self.program.clone(),
                source,
            })?;
        let failed = |detail: String| CorunError::Command {
            command: command.to_owned(),
            detail,
        };
        if let Some(mut stdin) = child.stdin.take()
            && let Err(error) = stdin.write_all(format!("{command}\n").as_bytes())
        {
            reap(&mut child);
            return Err(failed(format!("cannot write the command: {error}")));
        }
        // Answers are a few lines, far below a pipe's buffer: reading after
        // the exit cannot block the program.
        let Some(status) = wait_exit(&mut child, timeout) else {
            reap(&mut child);
            return Err(CorunError::Timeout {
                command: command.to_owned(),
                after: timeout,
            });
        };
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut out) = child.stdout.take() {
            let _ = out.read_to_string(&mut stdout);
        }
        if let Some(mut err) = child.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        if status.success() {
            Ok(stdout)
        } else {
            Err(failed(format!("{status}: {}", stderr.trim())))
        }
    }
}

/// Waits up to `timeout` for `child` to exit; its status, `None` if it did
/// not (or cannot be waited for).
pub(crate) fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
            Ok(None) | Err(_) => return None,
        }
    }
}

/// Kills `child` and waits for it.
fn reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Makes the folders of one daemon. The GPU's folder is 0755: only we may
/// replace the pipe, log and shared-memory folders in it. The pipe and log
/// folders are 0777, set explicitly past the umask: MPS starts each server
/// as the uid of its first client, and that server creates its pipes in the
/// pipe folder and writes `server.log` in the log folder, so pods of any uid
/// need to write there. Not sticky (01777): a server of the next uid must
/// be able to replace the pipes the previous uid's server left. The
/// shared-memory folder, where there is one, is 01777 as `/dev/shm` is: a
/// client may not remove another's files.
pub fn prepare_folders(pipe: &Path, log: &Path, shm: Option<&Path>) -> Result<(), CorunError> {
    make_folder(pipe, 0o777)?;
    make_folder(log, 0o777)?;
    if let Some(shm) = shm {
        make_folder(shm, 0o1777)?;
    }
    Ok(())
}

/// Writes GPU `uuid`'s UUID in its folder under `dir`, beside its pipe
/// folder ([`gpushare_utils::served_gpu`]): the daemon serves that GPU
/// alone, and a client whose `CUDA_VISIBLE_DEVICES` does not say so (a
/// process on the node, not a provisioned container) reads it there, so
/// that NVML's view of it and CUDA's agree.
pub fn name_served_gpu(dir: &Path, uuid: &str) -> Result<(), CorunError> {
    let gpu_dir = dir.join(uuid);
    served_gpu::write(&gpu_dir, uuid).map_err(|source| CorunError::ServedGpu {
        path: gpu_dir.join(served_gpu::FILE_NAME),
        source,
    })
}

/// `dir` (its parent 0755 where missing) with mode `mode`.
fn make_folder(dir: &Path, mode: u32) -> Result<(), CorunError> {
    let folder = |source| CorunError::Folder {
        path: dir.to_owned(),
        source,
    };
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)
            .map_err(folder)?;
    }
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(folder(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a folder",
            )));
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(dir).map_err(folder)?;
        }
        Err(error) => return Err(folder(error)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(folder)
}

/// Removes the socket and the pid file a daemon left in `pipe`.
pub fn remove_daemon_files(pipe: &Path) {
    for name in [SOCKET, PID_FILE] {
        let path = pipe.join(name);
        if let Err(error) = std::fs::remove_file(&path)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), %error, "cannot remove an MPS file");
        }
    }
}

/// The pid in `pipe`'s pid file, if it names a live process running
/// `program` (by file name, so a copy elsewhere or an upgraded binary
/// counts): a control daemon of an earlier run of ours.
pub fn leftover_daemon(pipe: &Path, program: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(pipe.join(PID_FILE)).ok()?;
    let pid: i32 = text.trim().parse().ok().filter(|pid| *pid > 0)?;
    if gpushare_utils::process::process_is_gone(pid, 0) {
        return None;
    }
    runs_program(pid, program).then_some(pid)
}

/// Whether process `pid` runs a program named as `program`: its executable,
/// else (where `/proc/<pid>/exe` is not ours to read) its `argv[0]`.
fn runs_program(pid: i32, program: &Path) -> bool {
    let Some(name) = program.file_name() else {
        return false;
    };
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .map(|exe| {
            // A binary replaced since the start reads as "<path> (deleted)".
            let text = exe.to_string_lossy().into_owned();
            PathBuf::from(text.trim_end_matches(" (deleted)"))
        });
    let path = exe.or_else(|| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let argv0 = cmdline.split(|b| *b == 0).next()?;
        Some(PathBuf::from(String::from_utf8_lossy(argv0).into_owned()))
    });
    path.is_some_and(|p| p.file_name() == Some(name))
}

/// Sends `signal` to `pid`.
pub(crate) fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill has no memory preconditions; a pid that is gone fails
    // with ESRCH, which is what we want to ignore.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Waits up to `timeout` for process `pid` (not our child) to be gone.
pub(crate) fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if gpushare_utils::process::process_is_gone(pid, 0) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_open_to_every_uid() {
        let root = std::env::temp_dir().join(format!("corun-folders-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (pipe, log, shm) = (root.join("G/pipe"), root.join("G/log"), root.join("G/shm"));
        let result = prepare_folders(&pipe, &log, Some(&shm));
        let modes: Vec<u32> = [&pipe, &log, &shm, &root.join("G")]
            .iter()
            .map(|d| std::fs::metadata(d).map_or(0, |m| m.permissions().mode() & 0o7777))
            .collect();
        // A file where a folder belongs is refused.
        std::fs::remove_dir(&log).ok();
        std::fs::write(&log, "").ok();
        let refused = prepare_folders(&pipe, &log, None);
        let _ = std::fs::remove_dir_all(&root);
        result.unwrap();
        assert_eq!(modes, [0o777, 0o777, 0o1777, 0o755]);
        assert!(matches!(refused, Err(CorunError::Folder { .. })));
    }

    #[test]
    fn the_gpu_is_named_beside_its_pipe_folder() {
        let root = std::env::temp_dir().join(format!("corun-served-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (pipe, log) = (root.join("GPU-ab/pipe"), root.join("GPU-ab/log"));
        prepare_folders(&pipe, &log, None).unwrap();
        let named = name_served_gpu(&root, "GPU-ab");
        let trust = gpushare_utils::shm::Trust::own_or_root(None);
        let read = served_gpu::read_beside(&pipe, &trust);
        let mode = std::fs::metadata(root.join("GPU-ab").join(served_gpu::FILE_NAME))
            .map_or(0, |m| m.permissions().mode() & 0o7777);
        let _ = std::fs::remove_dir_all(&root);
        named.unwrap();
        assert_eq!(read.unwrap(), "GPU-ab");
        assert_eq!(mode, 0o644);
    }

    #[test]
    fn a_pid_file_of_another_program_is_no_leftover() {
        let root = std::env::temp_dir().join(format!("corun-leftover-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        // Our own pid: alive, but this test binary is not the control program.
        std::fs::write(root.join(PID_FILE), format!("{}\n", std::process::id())).unwrap();
        let other = leftover_daemon(&root, Path::new("/usr/bin/nvidia-cuda-mps-control"));
        let exe = std::env::current_exe().unwrap();
        let ours = leftover_daemon(&root, &exe);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(other, None);
        assert_eq!(ours, Some(std::process::id() as i32));
    }
}
