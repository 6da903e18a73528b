//! Registered workers: the limiter processes of the pods, one id each.
//!
//! A worker id is `<pod>-<pid>-<n>`, with `n` counting up from the time the
//! hypervisor started in milliseconds, so ids stay unique across restarts. A
//! worker registered with an earlier run of the hypervisor (which forgot it)
//! is adopted again when it shows up with a well-formed id and its pod's
//! token: a restart costs the workers nothing.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use gpushare_utils::pod::PodId;
use gpushare_utils::protocol::{CommandResult, WorkerDevice};
use http_bidir_comm::ClientId;
use serde::Serialize;

/// One worker.
#[derive(Debug, Clone, Serialize)]
pub struct Worker {
    /// `<pod>-<pid>-<n>`: its id on the channel and in the API.
    pub id: ClientId,
    /// The pod it registered for (its token was that pod's).
    #[serde(serialize_with = "ser_pod")]
    pub pod: PodId,
    /// The pid it reported, as its own pid namespace numbers it.
    pub pid: u32,
    /// Its pid in the daemon's namespace, once known (registration found
    /// it; an adopted worker's is looked up when needed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_pid: Option<u32>,
    /// The hostname it reported (the pod's, in a container); empty for an
    /// adopted worker.
    pub hostname: String,
    /// The GPUs its process sees, by CUDA index and UUID, as reported at
    /// registration; empty for an adopted worker.
    pub devices: Vec<WorkerDevice>,
    /// Seconds since the epoch.
    pub registered_at: u64,
    /// Known from a channel or admission request rather than a registration
    /// (it registered with an earlier run of the hypervisor).
    pub adopted: bool,
    /// Whether its process backs its memory for a fast swap and answers
    /// `SwapOut` and `SwapIn` (as it registered; false for an adopted worker).
    pub fast_swap: bool,
    /// The last command sent, and the last answer received.
    pub last_command: Option<String>,
    /// The worker's answer to the last command it answered; `None` before
    /// the first.
    pub last_result: Option<CommandResult>,
}

fn ser_pod<S: serde::Serializer>(pod: &PodId, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(pod.as_str())
}

/// All registered workers.
#[derive(Debug)]
pub struct Workers {
    by_id: HashMap<ClientId, Worker>,
    next: u64,
}

impl Default for Workers {
    fn default() -> Self {
        Self::new()
    }
}

impl Workers {
    /// No workers; ids count up from the current time in milliseconds, so
    /// they do not repeat those of an earlier run.
    pub fn new() -> Self {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64);
        Self {
            by_id: HashMap::new(),
            next: now_ms,
        }
    }

    /// Registers a new worker of `pod`; returns its id.
    pub fn register(
        &mut self,
        pod: &PodId,
        pid: u32,
        hostname: String,
        devices: Vec<WorkerDevice>,
        fast_swap: bool,
    ) -> Option<ClientId> {
        let n = self.next;
        self.next += 1;
        // A pod id is ≤ 64 characters of the client id alphabet: always valid.
        let id = ClientId::new(format!("{pod}-{pid}-{n}")).ok()?;
        self.by_id.insert(
            id.clone(),
            Worker {
                id: id.clone(),
                pod: pod.clone(),
                pid,
                host_pid: None,
                hostname,
                devices,
                registered_at: hypervisor_observer::clock::unix_secs(),
                adopted: false,
                fast_swap,
                last_command: None,
                last_result: None,
            },
        );
        Some(id)
    }

    /// Takes back a worker an earlier run registered.
    pub fn adopt(&mut self, id: &ClientId, pod: &PodId, pid: u32) {
        self.by_id.entry(id.clone()).or_insert_with(|| Worker {
            id: id.clone(),
            pod: pod.clone(),
            pid,
            host_pid: None,
            hostname: String::new(),
            devices: Vec::new(),
            registered_at: hypervisor_observer::clock::unix_secs(),
            adopted: true,
            fast_swap: false,
            last_command: None,
            last_result: None,
        });
    }

    /// Records the daemon's pid of the worker `id`.
    pub fn set_host_pid(&mut self, id: &ClientId, host_pid: u32) {
        if let Some(worker) = self.by_id.get_mut(id) {
            worker.host_pid = Some(host_pid);
        }
    }

    /// The worker `id`; `None` where it never registered with this run, or
    /// was removed.
    pub fn get(&self, id: &ClientId) -> Option<&Worker> {
        self.by_id.get(id)
    }

    /// The worker `id`, to record a command sent or an answer.
    pub fn get_mut(&mut self, id: &ClientId) -> Option<&mut Worker> {
        self.by_id.get_mut(id)
    }

    /// Forgets the worker `id` (silent past the TTL, its pid gone, or its
    /// pod removed); returns it, `None` where it was not known.
    pub fn remove(&mut self, id: &ClientId) -> Option<Worker> {
        self.by_id.remove(id)
    }

    /// `pod`'s workers, in no order.
    pub fn in_pod<'a>(&'a self, pod: &'a str) -> impl Iterator<Item = &'a Worker> {
        self.by_id.values().filter(move |w| w.pod.as_str() == pod)
    }

    /// Whether the last answer of one of `pod`'s workers says `what`.
    pub fn last_answer_says(&self, pod: &str, what: impl Fn(&CommandResult) -> bool) -> bool {
        self.in_pod(pod)
            .any(|w| w.last_result.as_ref().is_some_and(&what))
    }

    /// Ids of `pod`'s workers, sorted.
    pub fn of_pod(&self, pod: &str) -> Vec<ClientId> {
        let mut ids: Vec<ClientId> = self.in_pod(pod).map(|w| w.id.clone()).collect();
        ids.sort();
        ids
    }

    /// How many workers `pod` has, checked against `max_workers_per_pod`.
    pub fn count_of_pod(&self, pod: &str) -> usize {
        self.in_pod(pod).count()
    }

    /// Every worker, sorted by id.
    pub fn all(&self) -> Vec<&Worker> {
        let mut all: Vec<&Worker> = self.by_id.values().collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// How many workers are registered, every pod together.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// Splits a worker id into pod and pid: `<pod>-<pid>-<n>`, read from the
/// right (pod ids may hold `-`).
pub fn parse_id(id: &str) -> Option<(&str, u32)> {
    let (rest, n) = id.rsplit_once('-')?;
    let (pod, pid) = rest.rsplit_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if pod.is_empty() || !digits(n) || !digits(pid) {
        return None;
    }
    Some((pod, pid.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_parse_back() {
        let mut workers = Workers::new();
        let pod = PodId::new("team-a.x").unwrap();
        let a = workers
            .register(&pod, 42, String::new(), vec![], false)
            .unwrap();
        let b = workers
            .register(&pod, 42, String::new(), vec![], false)
            .unwrap();
        assert_ne!(a, b);
        assert_eq!(parse_id(a.as_str()), Some(("team-a.x", 42)));
        assert_eq!(workers.of_pod("team-a.x"), {
            let mut v = vec![a.clone(), b.clone()];
            v.sort();
            v
        });
        assert_eq!(workers.count_of_pod("team-a"), 0);
        assert!(workers.remove(&a).is_some());
        assert_eq!(workers.len(), 1);
    }

    #[test]
    fn id_parsing_table() {
        let cases = [
            ("a-1-2", Some(("a", 1))),
            ("a-b-1-2", Some(("a-b", 1))),
            ("a-1", None),
            ("-1-2", None),
            ("a-x-2", None),
            ("a-1-", None),
            ("a-99999999999-2", None),
        ];
        for (id, want) in cases {
            assert_eq!(parse_id(id), want, "{id}");
        }
    }
}
