//! Which worker may do what.

use gpushare_utils::pod::PodId;
use gpushare_utils::protocol::Command;
use http_bidir_comm::ClientId;

use hypervisor_core::workers::{self};

use super::*;

/// Why a worker request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// No such worker (nor one that could be adopted), or the wrong token.
    Unauthorized,
    /// The pod has as many workers as it may.
    TooMany,
}

impl Hypervisor {
    /// Checks that `id` is a worker of the pod whose token is `token`,
    /// adopting a worker an earlier run registered; returns its pod.
    pub fn authorize_worker(&self, id: &ClientId, token: &str) -> Result<PodId, AuthError> {
        let (adopted, pid) = {
            let mut core = self.core();
            if let Some(worker) = core.workers.get(id) {
                let pod = worker.pod.clone();
                return match core.scheduler.token(pod.as_str()) {
                    Some(t) if t.matches(token) => Ok(pod),
                    _ => Err(AuthError::Unauthorized),
                };
            }
            let (pod, pid) = workers::parse_id(id.as_str()).ok_or(AuthError::Unauthorized)?;
            let pod = match (core.scheduler.token(pod), core.scheduler.pod_id(pod)) {
                (Some(t), Some(pod)) if t.matches(token) => pod.clone(),
                _ => return Err(AuthError::Unauthorized),
            };
            if core.workers.count_of_pod(pod.as_str()) >= core.settings.max_workers_per_pod {
                return Err(AuthError::TooMany);
            }
            core.workers.adopt(id, &pod, pid);
            (pod, pid)
        };
        tracing::info!(worker = %id, pod = %adopted, "worker of an earlier run adopted");
        // Gives the worker a queue on the channel, so that it expires if
        // silent; its answer says whether it takes the fast swap.
        self.send(std::slice::from_ref(id), &Command::Health);
        // Its pid in the daemon's namespace, proven as a registration's is,
        // so that the fast swap can cover it as it covers the others.
        let hv = self.clone();
        let (worker, pod, token) = (id.clone(), adopted.clone(), token.to_owned());
        tokio::spawn(async move { hv.find_host_pid(&worker, &pod, &token, pid).await });
        Ok(adopted)
    }
}
