//! The background tasks: the scheduler tick, maintenance (with the swap
//! headroom kept), the pods' uses sampled, the channel's events, health
//! pings, SIGHUP.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_utils::protocol::CommandResult;
use http_bidir_comm::{ClientId, HubEvent};
use tokio::task::JoinHandle;

use hypervisor_core::scheduler::ApplyReport;
use hypervisor_observer::ObserverError;

use super::*;

/// How often the scheduler runs on its own.
pub const TICK: Duration = Duration::from_millis(10);

/// How often maintenance runs (and the config file is looked at).
pub const MAINTENANCE: Duration = Duration::from_secs(1);

/// How often the co-run GPUs with elastic pods are asked how busy they
/// were: as often as an H100 takes a sample (every 200 ms). Asking every
/// 100 ms found a new sample every other time and cost the daemon 1 to 2%
/// of a core at 32 pods.
pub const BUSY_POLL: Duration = Duration::from_millis(200);

impl Hypervisor {
    pub(crate) fn spawn_tasks(&self) -> Vec<JoinHandle<()>> {
        let mut tasks = Vec::new();
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(TICK);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                hv.tick();
            }
        }));
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(MAINTENANCE).await;
                hv.maintain().await;
            }
        }));
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(crate::swap::USE_SAMPLE);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                hv.sample_uses();
            }
        }));
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(BUSY_POLL);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                hv.note_busy().await;
            }
        }));
        if let Some(mut events) = lock(&self.shared.events).take() {
            let hv = self.clone();
            tasks.push(tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    hv.on_event(event);
                }
            }));
        }
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let interval = hv.core().settings.health_interval;
                tokio::time::sleep(interval.unwrap_or(MAINTENANCE)).await;
                if interval.is_some() {
                    hv.ping_all();
                }
            }
        }));
        if let Some(mut changes) = self.gpu_health_changes() {
            let hv = self.clone();
            tasks.push(tokio::spawn(async move {
                let mut drained = std::collections::BTreeSet::new();
                while changes.changed().await.is_ok() {
                    hv.drain_the_unhealthy(&mut drained).await;
                }
            }));
        }
        if self.shared.handle_sighup {
            let hv = self.clone();
            tasks.push(tokio::spawn(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let mut hangups = match signal(SignalKind::hangup()) {
                    Ok(s) => s,
                    Err(error) => {
                        tracing::error!(%error, "cannot listen for SIGHUP; reloads on file change only");
                        return;
                    }
                };
                while hangups.recv().await.is_some() {
                    tracing::info!("SIGHUP: reloading the config");
                    if let Err(error) = hv.reload() {
                        tracing::error!(%error, "config not reloaded; the old one stays");
                    }
                }
            }));
        }
        tasks
    }

    /// One scheduling round over every GPU.
    pub fn tick(&self) {
        self.core().scheduler.tick(Instant::now(), None);
    }

    /// Asks the co-run GPUs with elastic pods how busy they were, off the
    /// async threads (NVML), and tells the scheduler
    /// ([`hypervisor_core::scheduler::capacity`]).
    async fn note_busy(&self) {
        let watched = self.core().scheduler.busy_watched();
        if watched.is_empty() {
            return;
        }
        let observer = Arc::clone(&self.shared.observer);
        let read = tokio::task::spawn_blocking(move || {
            watched
                .into_iter()
                .filter_map(|(index, uuid)| match observer.busy_percent(index) {
                    Ok(busy) => busy.map(|busy| (uuid, busy)),
                    Err(error) => {
                        tracing::debug!(%error, gpu = index, "no busy sample");
                        None
                    }
                })
                .collect::<Vec<_>>()
        })
        .await;
        match read {
            Ok(samples) if !samples.is_empty() => {
                let now = Instant::now();
                let mut core = self.core();
                for (uuid, busy) in samples {
                    core.scheduler.note_busy(&uuid, busy, now);
                }
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "GPU busy task failed"),
        }
    }

    pub(crate) async fn maintain(&self) {
        let observer = Arc::clone(&self.shared.observer);
        let observed = tokio::task::spawn_blocking(move || {
            let gpus = observer.gpus()?;
            let mut utilization = Vec::new();
            let mut memory = std::collections::BTreeMap::new();
            for gpu in &gpus {
                match observer.process_utilization(gpu.index) {
                    Ok(samples) => utilization.extend(samples.into_iter().map(|s| (gpu.index, s))),
                    Err(error) => {
                        tracing::debug!(%error, gpu = gpu.index, "no process utilization");
                    }
                }
                match observer.process_memory(gpu.index) {
                    Ok(processes) => {
                        memory.insert(gpu.uuid.to_ascii_lowercase(), processes);
                    }
                    Err(error) => tracing::debug!(%error, gpu = gpu.index, "no process memory"),
                }
            }
            Ok::<_, ObserverError>((gpus, utilization, memory))
        })
        .await;
        match observed {
            Ok(Ok((gpus, utilization, memory))) => {
                let mut core = self.core();
                core.scheduler.update_gpus(gpus, Instant::now());
                core.utilization = utilization;
                for m in core.scheduler.audit(&memory) {
                    tracing::warn!(
                        pod = m.pod,
                        gpu = m.uuid,
                        ledger = m.ledger,
                        nvml = m.nvml,
                        "the pod's processes hold more GPU memory than its ledger reports"
                    );
                }
            }
            Ok(Err(error)) => tracing::warn!(%error, "GPU observation failed"),
            Err(error) => tracing::warn!(%error, "GPU observation task failed"),
        }
        // Every pod may write the node tables: a damaged one is repaired.
        self.core().scheduler.check_tables();
        self.sweep_swapped().await;
        // Swap-outs take seconds: maintenance does not wait for them.
        let hv = self.clone();
        tokio::spawn(async move { hv.keep_headroom().await });
        let hv = self.clone();
        tokio::spawn(async move { hv.prepare_ahead().await });
        let dead_workers = {
            let mut core = self.core();
            let added = core.scheduler.retry_failed(Instant::now());
            if !added.is_empty() {
                tracing::info!(?added, "regions opened on retry");
            }
            for (pod, bytes) in core.scheduler.reclaim_dead() {
                tracing::info!(pod, bytes, "memory of dead processes given back");
            }
            if core.settings.check_pids {
                core.workers
                    .all()
                    .into_iter()
                    .filter(|w| pid_is_gone(w.pid))
                    .map(|w| w.id.clone())
                    .collect()
            } else {
                Vec::new()
            }
        };
        for id in dead_workers {
            self.remove_worker(&id, "its process is gone");
        }
        let changed = match (&self.shared.config_path, self.core().config_stamp) {
            (Some(path), old) => {
                let now = stamp(path);
                now.is_some() && now != old
            }
            (None, _) => false,
        };
        if changed {
            tracing::info!("config file changed: reloading");
            if let Err(error) = self.reload() {
                tracing::error!(%error, "config not reloaded; the old one stays");
                // Do not retry the same broken file every second.
                let now = self.shared.config_path.as_deref().and_then(stamp);
                self.core().config_stamp = now;
            }
        }
    }

    pub(crate) fn on_event(&self, event: HubEvent<CommandResult>) {
        match event {
            HubEvent::Expired(removed) => {
                self.remove_worker(&removed.client, "silent on the channel for the TTL");
            }
            HubEvent::Result { client, id, result } => {
                if !result.ok {
                    tracing::warn!(worker = %client, message = result.message, "command failed");
                }
                if let Some(worker) = self.core().workers.get_mut(&client) {
                    // An adopted worker's setting, unknown until it answers.
                    if worker.adopted {
                        worker.fast_swap = result.fast_swap;
                    }
                    worker.last_result = Some(result.clone());
                }
                self.shared.awaited.answered(&client, id, result);
            }
            HubEvent::Hello { client, first, .. } => {
                tracing::debug!(worker = %client, first, "hello on the channel");
            }
        }
    }

    /// Forgets worker `id` and gives back its pod's dead processes' memory.
    pub fn remove_worker(&self, id: &ClientId, reason: &str) -> bool {
        let removed = {
            let mut core = self.core();
            let removed = core.workers.remove(id);
            if let Some(worker) = &removed {
                let bytes = core.scheduler.reclaim_pod(worker.pod.as_str());
                tracing::info!(worker = %id, pod = %worker.pod, reason, reclaimed = bytes, "worker removed");
            }
            removed.is_some()
        };
        self.shared.hub.remove_client(id);
        removed
    }
}

pub(crate) fn log_report(report: &ApplyReport) {
    if report.added.is_empty()
        && report.changed.is_empty()
        && report.removed.is_empty()
        && report.failed.is_empty()
    {
        return;
    }
    tracing::info!(
        added = ?report.added,
        changed = ?report.changed,
        removed = ?report.removed,
        failed = ?report.failed,
        "pods applied"
    );
}

/// Whether no process `pid` exists (in the hypervisor's pid namespace), or it
/// is a zombie (its GPU memory is freed already).
pub(crate) fn pid_is_gone(pid: u32) -> bool {
    match i32::try_from(pid) {
        Ok(pid) if pid > 0 => gpushare_utils::process::process_is_gone(pid, 0),
        _ => true,
    }
}
