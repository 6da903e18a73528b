//! Commands to workers: suspend, resume, limits, health, and the fast
//! swap's, whose answers the daemon waits for ([`Hypervisor::ask`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpushare_utils::protocol::{Command, CommandResult, PodGpuLimits};
use http_bidir_comm::{ClientId, TaskId};
use tokio::sync::oneshot;

use hypervisor_core::scheduler::ScheduleError;
use hypervisor_core::spec::GpuSpec;

use super::*;

impl Hypervisor {
    /// Sends `command` to the workers `ids` (queued on the channel).
    pub fn send(&self, ids: &[ClientId], command: &Command) {
        let name = command_name(command);
        {
            let mut core = self.core();
            for id in ids {
                if let Some(worker) = core.workers.get_mut(id) {
                    worker.last_command = Some(name.to_owned());
                }
            }
        }
        for id in ids {
            if let Err(error) = self.shared.hub.submit(id, command.clone()) {
                tracing::error!(worker = %id, %error, "command not queued");
            }
        }
    }

    /// Sends `command` to each of the workers `ids` and waits, at most
    /// `within`, for each one's answer: by worker, its answer, or why none
    /// came (not queued, not answered in time).
    pub(crate) async fn ask(
        &self,
        ids: &[ClientId],
        command: &Command,
        within: Duration,
    ) -> Vec<(ClientId, Result<CommandResult, String>)> {
        let name = command_name(command);
        let mut waiting = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(worker) = self.core().workers.get_mut(id) {
                worker.last_command = Some(name.to_owned());
            }
            // The waiter is in place before the task can be answered.
            let mut awaited = lock(&self.shared.awaited.0);
            let answer = match self.shared.hub.submit(id, command.clone()) {
                Ok(task) => {
                    let (sender, receiver) = oneshot::channel();
                    awaited.insert((id.clone(), task), sender);
                    Ok((task, receiver))
                }
                Err(error) => Err(format!("not queued: {error}")),
            };
            waiting.push((id.clone(), answer));
        }
        let mut answers = Vec::with_capacity(waiting.len());
        let deadline = tokio::time::Instant::now() + within;
        for (id, answer) in waiting {
            let answer = match answer {
                Ok((task, receiver)) => {
                    let answer = tokio::time::timeout_at(deadline, receiver).await;
                    lock(&self.shared.awaited.0).remove(&(id.clone(), task));
                    match answer {
                        Ok(Ok(result)) => Ok(result),
                        Ok(Err(_)) => Err("the answer was lost".to_owned()),
                        Err(_) => Err(format!("no answer within {within:?}")),
                    }
                }
                Err(error) => Err(error),
            };
            answers.push((id, answer));
        }
        answers
    }

    /// The workers of `pod`.
    pub fn workers_of(&self, pod: &str) -> Vec<ClientId> {
        self.core().workers.of_pod(pod)
    }

    /// The worker `id`, as the daemon knows it now.
    pub fn worker(&self, id: &ClientId) -> Option<hypervisor_core::workers::Worker> {
        self.core().workers.get(id).cloned()
    }

    /// Suspends `pod`: the flag in its region, then `Suspend` to its workers.
    pub fn suspend(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        self.set_suspended(pod, true)
    }

    /// Resumes `pod`: the flag cleared, then `Resume` to its workers.
    pub fn resume(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        self.set_suspended(pod, false)
    }

    pub(crate) fn set_suspended(
        &self,
        pod: &str,
        suspended: bool,
    ) -> Result<Vec<ClientId>, ScheduleError> {
        let ids = {
            let mut core = self.core();
            core.scheduler
                .set_suspended(pod, suspended, Instant::now())?;
            core.workers.of_pod(pod)
        };
        let command = if suspended {
            Command::Suspend
        } else {
            Command::Resume
        };
        self.send(&ids, &command);
        Ok(ids)
    }

    /// Replaces `pod`'s GPU limits until the next reload of the config file;
    /// writes its region and sends `SetLimits` to its workers.
    pub fn set_limits(
        &self,
        pod: &str,
        gpus: Vec<GpuSpec>,
    ) -> Result<(Vec<PodGpuLimits>, Vec<ClientId>), ScheduleError> {
        let (devices, ids) = {
            let mut core = self.core();
            let devices = core.scheduler.set_gpus(pod, gpus, Instant::now())?;
            (devices, core.workers.of_pod(pod))
        };
        self.send(
            &ids,
            &Command::SetLimits {
                devices: devices.clone(),
            },
        );
        Ok((devices, ids))
    }

    /// Sends `Health` to `pod`'s workers.
    pub fn ping(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        let ids = {
            let core = self.core();
            if core.scheduler.pod_id(pod).is_none() {
                return Err(ScheduleError::NoSuchPod(pod.to_owned()));
            }
            core.workers.of_pod(pod)
        };
        self.send(&ids, &Command::Health);
        Ok(ids)
    }

    pub(crate) fn ping_all(&self) {
        let ids: Vec<ClientId> = self
            .core()
            .workers
            .all()
            .into_iter()
            .map(|w| w.id.clone())
            .collect();
        self.send(&ids, &Command::Health);
    }
}

pub(crate) fn command_name(command: &Command) -> &'static str {
    match command {
        Command::Suspend => "suspend",
        Command::Resume => "resume",
        Command::SetLimits { .. } => "set_limits",
        Command::Health => "health",
        Command::SwapOut => "swap_out",
        Command::SwapIn => "swap_in",
        Command::ReleaseHost => "release_host",
        Command::PrepareHost => "prepare_host",
    }
}

/// The commands whose answer someone waits for, by worker and task.
#[derive(Default)]
pub(crate) struct Awaited(Mutex<HashMap<(ClientId, TaskId), oneshot::Sender<CommandResult>>>);

impl Awaited {
    /// Hands `result`, the answer of `client` to `task`, to whoever waits
    /// for it (no one, for most commands).
    pub(crate) fn answered(&self, client: &ClientId, task: TaskId, result: CommandResult) {
        let waiter = lock(&self.0).remove(&(client.clone(), task));
        if let Some(waiter) = waiter {
            // The asker may have stopped waiting: its answer then goes nowhere.
            let _unwaited = waiter.send(result);
        }
    }
}
