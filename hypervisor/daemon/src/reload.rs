//! A new configuration: applied to the scheduler and pushed to workers.

use std::time::Instant;

use gpushare_utils::protocol::Command;

use hypervisor_config::{self as config, ConfigError, Settings};
use hypervisor_core::scheduler::ApplyReport;
use hypervisor_core::spec::PodSpec;

use super::*;

impl Hypervisor {
    /// Makes the pods exactly `specs` (what a Kubernetes pod watcher would
    /// call); tells the workers of changed pods, forgets those of removed
    /// ones and their swap history.
    pub fn apply(&self, specs: Vec<PodSpec>) -> ApplyReport {
        let (report, notify, forget) = {
            let mut core = self.core();
            let report = core.scheduler.apply(specs, Instant::now());
            let mut notify = Vec::new();
            for pod in &report.changed {
                if let Ok(devices) = core.scheduler.device_limits(pod) {
                    notify.push((core.workers.of_pod(pod), devices));
                }
            }
            let mut forget = Vec::new();
            for pod in &report.removed {
                for id in core.workers.of_pod(pod) {
                    core.workers.remove(&id);
                    forget.push(id);
                }
            }
            (report, notify, forget)
        };
        for id in &forget {
            self.shared.hub.remove_client(id);
        }
        for pod in &report.removed {
            self.swap_board().forget(pod);
        }
        for (ids, devices) in notify {
            self.send(&ids, &Command::SetLimits { devices });
        }
        log_report(&report);
        report
    }

    /// Reads the config file again and applies it. The listen address and the
    /// worker TTL need a restart; everything else takes effect now. A file
    /// that cannot be read or resolved (a token file that is a FIFO, say)
    /// refuses the reload and the old config stays.
    pub fn reload(&self) -> Result<ApplyReport, ConfigError> {
        let Some(path) = self.shared.config_path.clone() else {
            return Ok(ApplyReport::default());
        };
        let (before, config) = off_the_workers(|| (stamp(&path), config::load(&path)));
        let config = config?;
        {
            let mut core = self.core();
            core.config_stamp = before;
            core.admin_token = config.admin_token.clone();
            if config.settings.worker_ttl != core.settings.worker_ttl {
                tracing::warn!("worker_ttl_ms changes take effect at the next restart");
            }
            core.settings = Settings {
                worker_ttl: core.settings.worker_ttl,
                ..config.settings.clone()
            };
            core.scheduler.set_region_options(config.regions);
        }
        if config.listen != self.shared.listen {
            tracing::warn!(listen = %config.listen, "listen address changes take effect at the next restart");
        }
        Ok(self.apply(config.pods))
    }
}

/// Runs `read`, which may wait on the file system (up to
/// [`config::LOAD_TIMEOUT`]), so that the runtime's other tasks (the API,
/// `/healthz`, SIGTERM) do not wait with it: on a multi-threaded runtime
/// this worker's tasks move to another thread meanwhile. Reloads come from
/// SIGHUP, the file's poll and the admin route, all on that runtime.
fn off_the_workers<T>(read: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(read)
        }
        _ => read(),
    }
}
