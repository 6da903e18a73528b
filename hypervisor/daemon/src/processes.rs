//! Which processes are a pod's, by what the kernel says rather than what
//! the pod says.
//!
//! A pod names processes: its workers' pids (as they registered, or as an
//! adopted worker's id spells them) and the pids in its ledger, which its
//! processes write. The daemon stops, swaps, moves or waits for none of
//! them before it has proven it one of the pod's limited processes: it
//! maps the pod's very ledger ([`is_limited_process`]); under Kubernetes a
//! worker's pid is first found in the pod's cgroup. A neighbour's process,
//! pid 1, a process that has exited or a pid reused since fails the proof
//! at every look and is left alone, logged once. A registration that names
//! another pod's limited process is refused ([`is_anothers`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use gpushare_utils::pod::PodId;
use gpushare_utils::process::{FileId, mapped_files};
use http_bidir_comm::ClientId;

use crate::{Hypervisor, lock};

/// Whether the process `pid` (of the daemon's pid namespace) is one of the
/// limited processes of the pod whose ledger is `ledger`: it maps that
/// very file (device and inode, as the kernel lists its mappings, whatever
/// name or mount it was opened by). Every limited process of a pod maps
/// its ledger for as long as it runs, and no pod can make a neighbour's
/// process map its ledger; a process that chose to map a ledger not its
/// pod's (it could open the file) is treated as that pod's by its own
/// doing. A process that has exited (or is a zombie), whose pid was reused
/// by another, or that the daemon may not inspect is no pod's. The daemon
/// maps every ledger itself, and is never one.
pub(crate) fn is_limited_process(ledgers: &[FileId], pid: u32) -> bool {
    pid != std::process::id() && {
        let mapped = mapped_files(pid);
        ledgers.iter().any(|ledger| mapped.contains(ledger))
    }
}

/// Whether the process `pid` is another pod's than the one whose ledgers
/// are `own`: it maps one of `others` (the other pods' ledgers) and none of
/// `own`.
/// A process that maps none of them yet is not (a limiter maps its ledger
/// once its registration is answered); nothing is done to it before it is
/// proven its pod's.
pub(crate) fn is_anothers(pid: u32, own: &[FileId], others: &[FileId]) -> bool {
    let mapped = mapped_files(pid);
    !own.iter().any(|ledger| mapped.contains(ledger))
        && others.iter().any(|ledger| mapped.contains(ledger))
}

/// The pids each pod named that failed the proof at its last look, so that
/// each is logged once, not at every swap.
#[derive(Debug, Default)]
pub(crate) struct Unproven(Mutex<HashMap<String, BTreeSet<u32>>>);

impl Unproven {
    /// Records `pod`'s unproven pids of this look, logging those that were
    /// not so at the last one. Only this look's are kept: the set stays as
    /// small as what the pod can name (its workers and ledger slots).
    fn note(&self, pod: &str, now: BTreeSet<u32>) {
        let mut seen = lock(&self.0);
        let before = seen.remove(pod).unwrap_or_default();
        for pid in now.difference(&before) {
            tracing::warn!(
                pod,
                pid,
                "not one of the pod's processes (it does not map the pod's ledger): never stopped, swapped or waited for"
            );
        }
        if !now.is_empty() {
            seen.insert(pod.to_owned(), now);
        }
    }
}

impl Hypervisor {
    /// The pod's processes, by the daemon's pids, each proven the pod's:
    /// its workers' (an adopted worker's found again through the identity
    /// check, where there is one) and those of its ledger in the daemon's
    /// namespace, kept only where the process maps the pod's ledger.
    pub(crate) async fn pids_of(&self, pod: &str) -> Vec<u32> {
        let (mut named, unresolved, region) = {
            let core = self.core();
            let mut named = Vec::new();
            let mut unresolved = Vec::new();
            for id in core.workers.of_pod(pod) {
                let Some(worker) = core.workers.get(&id) else {
                    continue;
                };
                match worker.host_pid {
                    Some(pid) => named.push(pid),
                    None => unresolved.push((worker.pod.clone(), worker.pid)),
                }
            }
            let region = core.scheduler.swap_view(pod).map(|v| v.region);
            (named, unresolved, region)
        };
        let Some(region) = region else {
            return Vec::new();
        };
        let identity = self.shared.identity.get().cloned();
        let proved = tokio::task::spawn_blocking(move || {
            named.extend(region.pids());
            for (pod, pid) in unresolved {
                match &identity {
                    Some(identity) => named.extend(identity.verify(&pod, pid).ok()),
                    None => named.push(pid),
                }
            }
            // Where the daemon cannot tell its own mapping, nothing is proven.
            let ledgers = region.ledger_files();
            named
                .into_iter()
                .partition::<BTreeSet<u32>, _>(|&pid| is_limited_process(&ledgers, pid))
        })
        .await;
        match proved {
            Ok((proven, mut unproven)) => {
                // The daemon holds a slot in every pod's ledger itself.
                unproven.remove(&std::process::id());
                self.shared.swapper.unproven.note(pod, unproven);
                proven.into_iter().collect()
            }
            Err(error) => {
                tracing::error!(pod, %error, "the pod's processes could not be proven; none is acted on");
                Vec::new()
            }
        }
    }

    /// Records the daemon's pid of an adopted worker, screened as a
    /// registration is ([`Self::screen_worker`]); one that fails stays
    /// unknown (the pod's processes are then proven without it, and its
    /// pod takes the checkpoint).
    pub(crate) async fn find_host_pid(&self, id: &ClientId, pod: &PodId, token: &str, pid: u32) {
        match self.screen_worker(pod, token, pid).await {
            Ok(host_pid) => self.core().workers.set_host_pid(id, host_pid),
            Err(error) => {
                tracing::warn!(worker = %id, pod = %pod, %error, "an adopted worker's process was not found");
            }
        }
    }

    /// Why the process `pid` may not register as a worker of `pod`, as far
    /// as the kernel tells: under Kubernetes, it is outside the pod's
    /// cgroup; in every mode, it is another pod's limited process.
    /// Otherwise its pid in the daemon's namespace (the one it reported
    /// where no cgroup is checked), which is proven the pod's again before
    /// anything is done to it. The token is checked first, so strangers
    /// cannot make the daemon walk `/proc` (a wrong one is the
    /// registration's own 401).
    pub(crate) async fn screen_worker(
        &self,
        pod: &PodId,
        token: &str,
        pid: u32,
    ) -> Result<u32, String> {
        let (own, others) = {
            let core = self.core();
            if !core
                .scheduler
                .token(pod.as_str())
                .is_some_and(|t| t.matches(token))
            {
                return Ok(pid);
            }
            let mut own = Vec::new();
            let mut others = Vec::new();
            for view in core.scheduler.swap_views() {
                if view.pod == pod.as_str() {
                    own = view.region.ledger_files();
                } else {
                    others.extend(view.region.ledger_files());
                }
            }
            (own, others)
        };
        let identity = self.shared.identity.get().cloned();
        let pod = pod.clone();
        tokio::task::spawn_blocking(move || {
            let host_pid = match identity {
                Some(identity) => identity
                    .verify(&pod, pid)
                    .map_err(|error| error.to_string())?,
                None => pid,
            };
            // A pod whose objects could not be made yet has no ledger (nor
            // one whose mapping `/proc` does not show).
            if !own.is_empty() && is_anothers(host_pid, &own, &others) {
                return Err(format!(
                    "process {host_pid} is another pod's, not one of pod {pod}'s"
                ));
            }
            Ok(host_pid)
        })
        .await
        .unwrap_or_else(|error| Err(format!("identity check failed: {error}")))
    }
}
