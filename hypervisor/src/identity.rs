//! Which pod a worker process is in, from the kernel rather than from what
//! it says: the pod UID in its cgroup path (`/proc/<pid>/cgroup`), which
//! subprocesses inherit whatever they do to their environment.
//!
//! A worker reports its pid as its own pid namespace numbers it; the
//! hypervisor (host PID namespace) finds the host process whose innermost
//! `NSpid` is that pid and whose cgroup names the pod the worker registers
//! for. No such process: the registration is refused, whatever the token.

use std::path::{Path, PathBuf};

use gpushare_utils::config::PodId;

/// Why a worker's identity was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("no process {pid} of pod {pod} on this node (by cgroup)")]
    NotInPod { pod: String, pid: u32 },
    #[error("cannot list {0}")]
    Proc(String),
}

/// Checks that a registering worker belongs to the pod it names.
pub trait WorkerIdentity: Send + Sync {
    /// The host pid of worker `pid` (its own namespace's number) of `pod`.
    fn verify(&self, pod: &PodId, pid: u32) -> Result<u32, IdentityError>;
}

/// [`WorkerIdentity`] through a `/proc` (the host's, with `hostPID`).
#[derive(Debug, Clone)]
pub struct CgroupIdentity {
    proc_root: PathBuf,
}

impl CgroupIdentity {
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
        }
    }

    fn matches(&self, host_pid: &Path, pod: &str, pid: u32) -> bool {
        let innermost = std::fs::read_to_string(host_pid.join("status"))
            .ok()
            .and_then(|status| {
                let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
                line.split_whitespace().last()?.parse::<u32>().ok()
            });
        innermost == Some(pid)
            && std::fs::read_to_string(host_pid.join("cgroup"))
                .ok()
                .and_then(|text| pod_uid(&text))
                .is_some_and(|uid| uid == pod)
    }
}

impl WorkerIdentity for CgroupIdentity {
    fn verify(&self, pod: &PodId, pid: u32) -> Result<u32, IdentityError> {
        // The worker shares the host PID namespace (hostPID pods): one look.
        if self.matches(&self.proc_root.join(pid.to_string()), pod.as_str(), pid) {
            return Ok(pid);
        }
        let entries = std::fs::read_dir(&self.proc_root)
            .map_err(|e| IdentityError::Proc(format!("{}: {e}", self.proc_root.display())))?;
        for entry in entries.flatten() {
            let Some(host_pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if self.matches(&entry.path(), pod.as_str(), pid) {
                return Ok(host_pid);
            }
        }
        Err(IdentityError::NotInPod {
            pod: pod.to_string(),
            pid,
        })
    }
}

/// The pod UID in a `/proc/<pid>/cgroup` text, for both cgroup drivers:
/// `…/kubepods-burstable-pod<uid with _>.slice/…` (systemd) and
/// `…/kubepods/burstable/pod<uid>/…` (cgroupfs).
pub fn pod_uid(cgroup: &str) -> Option<String> {
    for line in cgroup.lines() {
        let path = line.splitn(3, ':').nth(2)?;
        for segment in path.split('/') {
            let segment = segment.strip_suffix(".slice").unwrap_or(segment);
            let Some(at) = segment.rfind("pod") else {
                continue;
            };
            let before = &segment[..at];
            if !(before.is_empty() || before.ends_with('-')) {
                continue;
            }
            let uid = segment[at + 3..].replace('_', "-");
            if crate::provision::is_uid(&uid) {
                return Some(uid.to_ascii_lowercase());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4a";

    #[test]
    fn both_cgroup_drivers() {
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b7c8a52_3f1e_4a7e_9c4e_2f6f1d2c3b4a.slice/cri-containerd-abc.scope\n";
        let cgroupfs =
            "12:memory:/kubepods/besteffort/pod0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4a/4f9a\n";
        let guaranteed =
            "0::/kubepods.slice/kubepods-pod0b7c8a52_3f1e_4a7e_9c4e_2f6f1d2c3b4a.slice/x.scope\n";
        for text in [systemd, cgroupfs, guaranteed] {
            assert_eq!(pod_uid(text).as_deref(), Some(UID), "{text}");
        }
        for text in [
            "0::/user.slice/user-1000.slice/session-2.scope\n",
            "0::/\n",
            "0::/kubepods/podnot-a-uid/x\n",
        ] {
            assert_eq!(pod_uid(text), None, "{text}");
        }
    }
}
