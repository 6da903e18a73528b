//! The sweeper: removes clients silent for the TTL and, with
//! [`HubConfig::redeliver_after`], queues unanswered tasks again.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::wire::{ClientId, TaskId};

use super::*;

impl<R: Send + 'static> Inner<R> {
    pub(super) fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeper_running.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(sweeper(Arc::downgrade(self)));
            }
            Err(_) => self.sweeper_running.store(false, Ordering::Release),
        }
    }

    pub(super) fn sweep_interval(&self) -> Duration {
        let mut base = self.config.client_ttl;
        if let Some(redeliver) = self.config.redeliver_after {
            base = base.min(redeliver);
        }
        (base / 4).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    pub(super) fn sweep(&self, now: Instant) -> usize {
        let ttl = self.config.client_ttl;
        let mut gone = Vec::new();
        {
            let mut clients = self.lock();
            let expired: Vec<ClientId> = clients
                .iter()
                .filter(|(_, e)| e.active_polls == 0 && now.duration_since(e.last_seen) >= ttl)
                .map(|(id, _)| id.clone())
                .collect();
            for id in expired {
                if let Some(entry) = clients.remove(&id) {
                    gone.push(removed(id, entry, now));
                }
            }
            if let Some(after) = self.config.redeliver_after {
                for entry in clients.values_mut() {
                    requeue_stale(entry, now, after);
                }
            }
        }
        let count = gone.len();
        for client in gone {
            tracing::info!(client = %client.client, "client expired");
            if self.events.send(HubEvent::Expired(client)).is_err() {
                tracing::debug!("hub events receiver dropped; expiry not reported");
            }
        }
        count
    }
}

/// Clears the "sweeper running" flag when the sweeper task ends, including when
/// its runtime shuts down, so a later request in another runtime starts a new one.
pub(super) struct SweeperGuard<R: Send + 'static>(Weak<Inner<R>>);

impl<R: Send + 'static> Drop for SweeperGuard<R> {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.sweeper_running.store(false, Ordering::Release);
        }
    }
}

pub(super) async fn sweeper<R: Send + 'static>(hub: Weak<Inner<R>>) {
    let _guard = SweeperGuard(hub.clone());
    loop {
        let interval = match hub.upgrade() {
            Some(inner) => inner.sweep_interval(),
            None => return,
        };
        tokio::time::sleep(interval).await;
        match hub.upgrade() {
            Some(inner) => {
                inner.sweep(Instant::now());
            }
            None => return,
        }
    }
}

pub(super) fn requeue_stale(entry: &mut Entry, now: Instant, after: Duration) {
    let stale: Vec<TaskId> = entry
        .unanswered
        .iter()
        .filter(|(_, d)| now.duration_since(d.at) >= after)
        .map(|(id, _)| *id)
        .collect();
    if stale.is_empty() {
        return;
    }
    // Oldest first, ahead of newer work.
    for id in stale.into_iter().rev() {
        if let Some(Delivered {
            json: Some(json), ..
        }) = entry.unanswered.remove(&id)
        {
            entry.queue.push_front(Queued { id, json });
        }
    }
    entry.notify.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_expires_idle_and_requeues_stale() {
        let config = HubConfig {
            client_ttl: Duration::from_secs(10),
            redeliver_after: Some(Duration::from_secs(1)),
            ..HubConfig::default()
        };
        let (hub, mut events) = Hub::<u8, u8>::new(config);
        let idle = ClientId::new("idle").unwrap();
        let busy = ClientId::new("busy").unwrap();
        let t = hub.submit(&idle, 1).unwrap();
        hub.submit(&busy, 2).unwrap();
        assert!(matches!(hub.inner.take(&busy), Take::Tasks(_)));
        hub.inner.begin_poll(&busy).ok();
        let later = Instant::now() + Duration::from_secs(11);
        assert_eq!(hub.inner.sweep(later), 1);
        let Ok(HubEvent::Expired(gone)) = events.try_recv() else {
            panic!("expected an expiry event");
        };
        assert_eq!((gone.client, gone.undelivered), (idle, vec![t]));
        // The busy client's delivered task went back to its queue.
        let info = hub.client(&busy).unwrap();
        assert_eq!((info.queued, info.unanswered, info.polling), (1, 0, true));
    }
}
