//! The status report of the running hypervisor.

use hypervisor_status::status::{ProcessStatus, Status, WorkerStatus};

use super::*;

impl Hypervisor {
    /// Everything the metrics and `hypervisor status` show.
    pub fn status(&self) -> Status {
        let swap = self.swap_status();
        let core = self.core();
        let pods = core.scheduler.status(|pod| core.workers.count_of_pod(pod));
        let workers = core
            .workers
            .all()
            .into_iter()
            .map(|w| WorkerStatus {
                id: w.id.to_string(),
                pod: w.pod.to_string(),
                pid: w.pid,
                adopted: w.adopted,
                last_command: w.last_command.clone(),
                last_ok: w.last_result.as_ref().map(|r| r.ok),
            })
            .collect();
        let processes = core
            .utilization
            .iter()
            .map(|(gpu, u)| ProcessStatus {
                gpu_index: *gpu,
                pid: u.pid,
                // Meaningful where the hypervisor shares the pods' pid namespace.
                pod: core
                    .workers
                    .all()
                    .into_iter()
                    .find(|w| w.pid == u.pid)
                    .map(|w| w.pod.to_string()),
                sm_percent: u.sm_percent,
                memory_percent: u.memory_percent,
            })
            .collect();
        Status {
            instance: self.shared.hub.instance_id().to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            gpus: core.scheduler.gpus().to_vec(),
            pods,
            workers,
            processes,
            admission: self.shared.latency.snapshot(),
            corun: self
                .shared
                .corun
                .get()
                .map(|board| board.snapshot())
                .unwrap_or_default(),
            node_table_repairs: core.scheduler.tables().repairs(),
            turns: core.scheduler.turns_status(),
            swap,
        }
    }
}
