//! The hub: one queue of tasks per client, and what each client was handed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::{Notify, mpsc};

use crate::wire::{ClientId, TaskId};

use super::*;

/// Per-client task queues shared between the hypervisor and the HTTP routes.
/// Cloning is cheap (one `Arc`).
pub struct Hub<T, R> {
    pub(super) inner: Arc<Inner<R>>,
    pub(super) _types: PhantomData<fn(T) -> R>,
}

impl<T, R> Clone for Hub<T, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            _types: PhantomData,
        }
    }
}

impl<T, R> fmt::Debug for Hub<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hub")
            .field("instance", &self.inner.instance)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(super) struct Inner<R> {
    pub(super) config: HubConfig,
    pub(super) instance: String,
    pub(super) next_task: AtomicU64,
    pub(super) clients: Mutex<HashMap<ClientId, Entry>>,
    pub(super) events: mpsc::UnboundedSender<HubEvent<R>>,
    pub(super) sweeper_running: AtomicBool,
}

pub(super) struct Entry {
    pub(super) queue: VecDeque<Queued>,
    pub(super) unanswered: BTreeMap<TaskId, Delivered>,
    pub(super) notify: Arc<Notify>,
    pub(super) last_seen: Instant,
    pub(super) active_polls: u32,
    pub(super) metadata: Value,
    pub(super) hello: bool,
}

pub(super) struct Queued {
    pub(super) id: TaskId,
    pub(super) json: Arc<str>,
}

pub(super) struct Delivered {
    // Kept only when redelivery is on.
    pub(super) json: Option<Arc<str>>,
    pub(super) at: Instant,
}

pub(super) struct TooManyClients;

pub(super) enum Take {
    Tasks(String),
    Wait(Arc<Notify>),
    Gone,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Self {
            queue: VecDeque::new(),
            unanswered: BTreeMap::new(),
            notify: Arc::new(Notify::new()),
            last_seen: now,
            active_polls: 0,
            metadata: Value::Null,
            hello: false,
        }
    }
}

impl<T, R> Hub<T, R>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    /// A hub and the receiver of its events. Drop the receiver to ignore events.
    pub fn new(config: HubConfig) -> (Self, HubEvents<R>) {
        let (events, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            config,
            instance: instance_id(),
            next_task: AtomicU64::new(1),
            clients: Mutex::new(HashMap::new()),
            events,
            sweeper_running: AtomicBool::new(false),
        });
        // Outside a runtime the sweeper starts with the first request instead.
        inner.ensure_sweeper();
        let hub = Self {
            inner,
            _types: PhantomData,
        };
        (hub, rx)
    }

    /// Queues `task` for `client` and wakes its waiting long-poll. A client the
    /// hub does not know yet is created (it then expires after the TTL unless
    /// it shows up).
    pub fn submit(&self, client: &ClientId, task: T) -> Result<TaskId, SubmitError> {
        let json: Arc<str> = serde_json::to_string(&task)?.into();
        let id = TaskId(self.inner.next_task.fetch_add(1, Ordering::Relaxed));
        let mut clients = self.inner.lock();
        let entry = clients
            .entry(client.clone())
            .or_insert_with(|| Entry::new(Instant::now()));
        entry.queue.push_back(Queued { id, json });
        // notify_one stores a permit when no poll waits, so a poll that starts
        // between its queue check and its wait still wakes.
        entry.notify.notify_one();
        Ok(id)
    }

    /// Snapshot of all known clients, sorted by id.
    pub fn clients(&self) -> Vec<ClientInfo> {
        let now = Instant::now();
        let clients = self.inner.lock();
        let mut out: Vec<ClientInfo> = clients
            .iter()
            .map(|(id, entry)| info(id, entry, now))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Snapshot of one client.
    pub fn client(&self, id: &ClientId) -> Option<ClientInfo> {
        let now = Instant::now();
        self.inner.lock().get(id).map(|entry| info(id, entry, now))
    }

    /// Removes a client now, without an event; returns what it held. A long-poll
    /// of it in progress ends at its next wake-up.
    pub fn remove_client(&self, id: &ClientId) -> Option<RemovedClient> {
        let now = Instant::now();
        let entry = self.inner.lock().remove(id)?;
        entry.notify.notify_waiters();
        Some(removed(id.clone(), entry, now))
    }

    /// Runs one expiry (and redelivery) sweep now; returns how many clients
    /// expired. The background sweeper does the same on its own.
    pub fn expire_now(&self) -> usize {
        self.inner.sweep(Instant::now())
    }

    /// This hub's instance id, sent in every response as [`INSTANCE_HEADER`].
    pub fn instance_id(&self) -> &str {
        &self.inner.instance
    }

    /// The configuration the hub runs with.
    pub fn config(&self) -> &HubConfig {
        &self.inner.config
    }
}

pub(super) enum Answer {
    Accepted,
    UnknownClient,
    UnknownTask,
}

impl<R: Send + 'static> Inner<R> {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<ClientId, Entry>> {
        // Nothing panics while holding the lock; if something did, the map is
        // still consistent enough to serve (every update is a single step).
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn entry_for<'a>(
        &self,
        clients: &'a mut HashMap<ClientId, Entry>,
        id: &ClientId,
        now: Instant,
    ) -> Result<&'a mut Entry, TooManyClients> {
        if !clients.contains_key(id) && clients.len() >= self.config.max_clients {
            return Err(TooManyClients);
        }
        let entry = clients.entry(id.clone()).or_insert_with(|| Entry::new(now));
        entry.last_seen = now;
        Ok(entry)
    }

    pub(super) fn begin_poll(&self, id: &ClientId) -> Result<(), TooManyClients> {
        let mut clients = self.lock();
        let entry = self.entry_for(&mut clients, id, Instant::now())?;
        entry.active_polls = entry.active_polls.saturating_add(1);
        Ok(())
    }

    pub(super) fn end_poll(&self, id: &ClientId) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.active_polls = entry.active_polls.saturating_sub(1);
            entry.last_seen = Instant::now();
        }
    }

    pub(super) fn take(&self, id: &ClientId) -> Take {
        let mut clients = self.lock();
        let Some(entry) = clients.get_mut(id) else {
            return Take::Gone;
        };
        if entry.queue.is_empty() {
            return Take::Wait(Arc::clone(&entry.notify));
        }
        let now = Instant::now();
        let count = entry.queue.len().min(self.config.max_batch.max(1));
        let keep_json = self.config.redeliver_after.is_some();
        let mut body = String::from("[");
        for (i, task) in entry.queue.drain(..count).enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str("{\"id\":");
            body.push_str(&task.id.0.to_string());
            body.push_str(",\"task\":");
            body.push_str(&task.json);
            body.push('}');
            entry.unanswered.insert(
                task.id,
                Delivered {
                    json: keep_json.then_some(task.json),
                    at: now,
                },
            );
        }
        body.push(']');
        while entry.unanswered.len() > self.config.max_unanswered {
            entry.unanswered.pop_first();
        }
        Take::Tasks(body)
    }

    pub(super) fn answer(&self, id: &ClientId, task: TaskId) -> Answer {
        let mut clients = self.lock();
        let Some(entry) = clients.get_mut(id) else {
            return Answer::UnknownClient;
        };
        entry.last_seen = Instant::now();
        if entry.unanswered.remove(&task).is_some() {
            return Answer::Accepted;
        }
        // A redelivered task may be answered by its first delivery's result.
        if let Some(pos) = entry.queue.iter().position(|q| q.id == task)
            && self.config.redeliver_after.is_some()
        {
            entry.queue.remove(pos);
            return Answer::Accepted;
        }
        Answer::UnknownTask
    }

    pub(super) fn hello(&self, id: &ClientId, metadata: Value) -> Result<bool, TooManyClients> {
        let mut clients = self.lock();
        let entry = self.entry_for(&mut clients, id, Instant::now())?;
        let first = !entry.hello;
        entry.hello = true;
        entry.metadata = metadata;
        Ok(first)
    }
}

pub(super) fn info(id: &ClientId, entry: &Entry, now: Instant) -> ClientInfo {
    let polling = entry.active_polls > 0;
    let idle = if polling {
        Duration::ZERO
    } else {
        now.duration_since(entry.last_seen)
    };
    ClientInfo {
        id: id.clone(),
        metadata: entry.metadata.clone(),
        hello: entry.hello,
        last_seen: system_time_ago(idle),
        idle,
        polling,
        queued: entry.queue.len(),
        unanswered: entry.unanswered.len(),
    }
}

pub(super) fn removed(client: ClientId, entry: Entry, now: Instant) -> RemovedClient {
    RemovedClient {
        client,
        last_seen: system_time_ago(now.duration_since(entry.last_seen)),
        undelivered: entry.queue.iter().map(|q| q.id).collect(),
        unanswered: entry.unanswered.keys().copied().collect(),
        metadata: entry.metadata,
    }
}

pub(super) fn system_time_ago(ago: Duration) -> SystemTime {
    SystemTime::now()
        .checked_sub(ago)
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A fresh id per hub, from the process's random hasher keys, the pid and the clock.
pub(super) fn instance_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_then_take_builds_the_documented_array() {
        let (hub, _events) = Hub::<String, u32>::new(HubConfig::default());
        let id = ClientId::new("c").unwrap();
        let a = hub.submit(&id, "x".to_owned()).unwrap();
        let b = hub.submit(&id, "y".to_owned()).unwrap();
        let Take::Tasks(body) = hub.inner.take(&id) else {
            panic!("expected tasks");
        };
        let parsed: Vec<crate::Task<String>> = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!((parsed[0].id, parsed[1].id), (a, b));
        assert_eq!(hub.client(&id).unwrap().unanswered, 2);
        assert!(matches!(hub.inner.answer(&id, a), Answer::Accepted));
        assert!(matches!(hub.inner.answer(&id, a), Answer::UnknownTask));
    }
}
