//! Which pod a worker process is in, from the kernel rather than from what
//! it says: the pod UID in its cgroup path (`/proc/<pid>/cgroup`), which
//! subprocesses inherit whatever they do to their environment.
//!
//! A worker reports its pid as its own pid namespace numbers it; the
//! hypervisor (host PID namespace) finds the host process whose innermost
//! `NSpid` is that pid and whose cgroup names the pod the worker registers
//! for, or one of the pods that share that identity's claims (a claim used
//! by several pods is one quota, in the Kubernetes agent). No such
//! process: the registration is refused, whatever the token.

use std::path::{Path, PathBuf};

use gpushare_utils::pod::PodId;

/// Why a worker's identity was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    /// No host process has that pid as its innermost one and a cgroup of
    /// an accepted pod: the worker is not what it claims, or has exited.
    #[error("no process {pid} of pod {pod} on this node (by cgroup)")]
    NotInPod {
        /// The pod the worker registered for.
        pod: String,
        /// The pid the worker reported, in its own pid namespace.
        pid: u32,
    },
    /// The `/proc` folder could not be listed; the path and the error.
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
    /// Looks at processes under `proc_root`: `/proc` when the daemon shares
    /// the host's pid namespace, or where the host's is mounted.
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
        }
    }

    fn matches(&self, host_pid: &Path, pods: &dyn Fn(&str) -> bool, pid: u32) -> bool {
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
                .is_some_and(|uid| pods(&uid))
    }

    /// The host pid of worker `pid` of `pod`, whose process may be in any
    /// pod that `accept` takes (by pod UID).
    pub fn find(
        &self,
        pod: &PodId,
        pid: u32,
        accept: &dyn Fn(&str) -> bool,
    ) -> Result<u32, IdentityError> {
        // The worker shares the host PID namespace (hostPID pods): one look.
        if self.matches(&self.proc_root.join(pid.to_string()), accept, pid) {
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
            if self.matches(&entry.path(), accept, pid) {
                return Ok(host_pid);
            }
        }
        Err(IdentityError::NotInPod {
            pod: pod.to_string(),
            pid,
        })
    }
}

impl WorkerIdentity for CgroupIdentity {
    fn verify(&self, pod: &PodId, pid: u32) -> Result<u32, IdentityError> {
        self.find(pod, pid, &|uid| uid == pod.as_str())
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
            if gpushare_utils::pod::is_uid(&uid) {
                return Some(uid.to_ascii_lowercase());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_of_another_pod_of_the_claim_is_accepted_only_when_asked() {
        let proc = std::env::temp_dir().join(format!("gpushare-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&proc);
        // Host pid 900, pid 7 in its container, in pod B.
        let entry = proc.join("900");
        std::fs::create_dir_all(&entry).unwrap();
        std::fs::write(entry.join("status"), "Name:\tpython\nNSpid:\t900\t7\n").unwrap();
        let pod_b = "b0000000-0000-4000-8000-00000000000b";
        std::fs::write(
            entry.join("cgroup"),
            format!("0::/kubepods/besteffort/pod{pod_b}/c1\n"),
        )
        .unwrap();
        let identity = CgroupIdentity::new(&proc);
        let pod_a = PodId::new("a0000000-0000-4000-8000-00000000000a".to_owned()).unwrap();
        assert!(identity.verify(&pod_a, 7).is_err());
        let shared = |uid: &str| uid == pod_a.as_str() || uid == pod_b;
        assert_eq!(identity.find(&pod_a, 7, &shared), Ok(900));
        std::fs::remove_dir_all(&proc).unwrap();
    }

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
