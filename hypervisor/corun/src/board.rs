//! What the supervisor knows of each co-run GPU's MPS control daemon, shared
//! with the status, the metrics and `/readyz`.

use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use super::mps_log::ServerFailure;

/// The state of one GPU's MPS control daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum MpsState {
    /// Started (or about to be), not answering yet.
    Starting,
    /// Answering since `since`.
    Up {
        /// Unix seconds at which it first answered `get_server_list` since
        /// it was last started.
        since: u64,
    },
    /// Not running since `since`, for `reason`; the supervisor starts it
    /// again after its backoff.
    Down {
        /// Why, for the operator: how it exited, or why it could not start.
        reason: String,
        /// Unix seconds at which it went down.
        since: u64,
    },
    /// Stopped with the hypervisor.
    Stopped,
}

/// One co-run GPU as the status shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorunGpuStatus {
    /// The GPU's UUID.
    pub gpu: String,
    /// Whether its control daemon answers; flattened into the status as a
    /// `state` tag and that state's fields.
    #[serde(flatten)]
    pub state: MpsState,
    /// Times the control daemon was started again after it exited, never
    /// answered or stopped answering.
    pub restarts: u64,
    /// The control daemon's pid while it runs.
    #[serde(default)]
    pub pid: Option<u32>,
    /// MPS servers that exited failing (each refused or dropped its
    /// clients), as the daemon's log notes them.
    #[serde(default)]
    pub server_failures: u64,
    /// The last of them.
    #[serde(default)]
    pub last_server_failure: Option<LastServerFailure>,
}

/// A server failure and when the supervisor read it (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastServerFailure {
    /// Which server exited, with what status and last line.
    #[serde(flatten)]
    pub failure: ServerFailure,
    /// Unix seconds at which the supervisor read the exit in the log.
    pub at: u64,
}

impl CorunGpuStatus {
    /// Whether the control daemon answers, so clients started now get MPS
    /// (what `/readyz` asks of every co-run GPU).
    pub fn is_up(&self) -> bool {
        matches!(self.state, MpsState::Up { .. })
    }
}

/// Every co-run GPU's state, in the order of the options.
#[derive(Debug)]
pub struct MpsBoard {
    gpus: Mutex<Vec<CorunGpuStatus>>,
}

impl MpsBoard {
    /// Every GPU of `gpus` starting.
    pub fn new(gpus: &[String]) -> Self {
        Self {
            gpus: Mutex::new(
                gpus.iter()
                    .map(|gpu| CorunGpuStatus {
                        gpu: gpu.clone(),
                        state: MpsState::Starting,
                        restarts: 0,
                        pid: None,
                        server_failures: 0,
                        last_server_failure: None,
                    })
                    .collect(),
            ),
        }
    }

    /// A copy, for the status.
    pub fn snapshot(&self) -> Vec<CorunGpuStatus> {
        self.lock().clone()
    }

    /// What `/readyz` waits for: one line per GPU whose daemon is not up.
    pub fn waiting(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|g| !g.is_up())
            .map(|g| match &g.state {
                MpsState::Down { reason, .. } => format!("MPS of GPU {} is down: {reason}", g.gpu),
                MpsState::Stopped => format!("MPS of GPU {} is stopped", g.gpu),
                _ => format!("MPS of GPU {} is starting", g.gpu),
            })
            .collect()
    }

    /// Applies `change` to GPU `gpu`'s entry.
    pub(crate) fn update(&self, gpu: &str, change: impl FnOnce(&mut CorunGpuStatus)) {
        if let Some(entry) = self.lock().iter_mut().find(|g| g.gpu == gpu) {
            change(entry);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<CorunGpuStatus>> {
        // Every update is one assignment: a poisoned lock still holds a
        // consistent list.
        self.gpus.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_as_json_and_readiness() {
        let board = MpsBoard::new(&["GPU-a".into(), "GPU-b".into()]);
        board.update("GPU-a", |g| g.state = MpsState::Up { since: 5 });
        board.update("GPU-b", |g| {
            g.state = MpsState::Down {
                reason: "exited with status 1".into(),
                since: 6,
            };
            g.restarts = 2;
            g.server_failures = 1;
            g.last_server_failure = Some(LastServerFailure {
                failure: ServerFailure {
                    server: 9,
                    status: 1,
                    reason: Some("Failed to start : invalid argument".into()),
                },
                at: 4,
            });
        });
        assert_eq!(
            board.waiting(),
            ["MPS of GPU GPU-b is down: exited with status 1"]
        );
        let json = serde_json::to_value(board.snapshot()).unwrap();
        assert_eq!(
            json,
            serde_json::json!([
                {"gpu": "GPU-a", "state": "up", "since": 5, "restarts": 0, "pid": null,
                 "server_failures": 0, "last_server_failure": null},
                {"gpu": "GPU-b", "state": "down", "reason": "exited with status 1",
                 "since": 6, "restarts": 2, "pid": null, "server_failures": 1,
                 "last_server_failure": {"server": 9, "status": 1,
                     "reason": "Failed to start : invalid argument", "at": 4}},
            ])
        );
        let back: Vec<CorunGpuStatus> = serde_json::from_value(json).unwrap();
        assert_eq!(back, board.snapshot());
    }
}
