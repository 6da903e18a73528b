//! The objects, one resourceVersion counter for all of them (as etcd's
//! revision), and the history of changes that watches resume from and
//! paginated lists read their snapshot in. History is compacted, as etcd's
//! is: past a length, or when asked; a watch or a continue token older than
//! the compaction gets 410 Expired.

use std::collections::{BTreeMap, VecDeque};

use serde_json::{Value, json};

/// Where an object lives: resource plural, namespace ("" when
/// cluster-scoped), name. Ordered as the API server lists: by namespace,
/// then name.
pub type Key = (String, String, String);

/// What a change did, as watchers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// The object was created.
    Added,
    /// The object was written again (spec, status or metadata).
    Modified,
    /// The object is gone.
    Deleted,
}

impl EventType {
    /// The watch event's `type` as the API server writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, as watchers see it.
#[derive(Debug, Clone)]
pub struct Change {
    /// The resourceVersion the change made.
    pub rv: u64,
    /// The object changed: resource, namespace, name.
    pub key: Key,
    /// What the change did.
    pub kind: EventType,
    /// The object after the change (for a deletion, its last state with the
    /// deletion's resourceVersion).
    pub object: Value,
    /// The object before the change; `None` for an addition.
    pub previous: Option<Value>,
}

pub(crate) struct Store {
    /// Differs between servers and processes, so the UIDs (and the pod
    /// regions named after them) of parallel tests never meet.
    pub uid_prefix: String,
    pub rv: u64,
    pub next_uid: u64,
    pub objects: BTreeMap<Key, Value>,
    pub log: VecDeque<Change>,
    /// Every change after this resourceVersion is still in `log`.
    pub compacted: u64,
    /// How many changes `log` keeps before it compacts its older half.
    pub history_limit: usize,
}

impl Store {
    pub(crate) fn new(uid_prefix: String, history_limit: usize) -> Self {
        Self {
            uid_prefix,
            rv: 0,
            next_uid: 0,
            objects: BTreeMap::new(),
            log: VecDeque::new(),
            compacted: 0,
            history_limit: history_limit.max(1),
        }
    }

    /// A new UID.
    pub(crate) fn uid(&mut self) -> String {
        self.next_uid += 1;
        format!("{}-8000-{:012x}", self.uid_prefix, self.next_uid)
    }

    /// Stores `object` at `key` with the next resourceVersion; returns the
    /// change to publish.
    pub(crate) fn write(&mut self, key: Key, mut object: Value) -> Change {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let previous = self.objects.insert(key.clone(), object.clone());
        let kind = if previous.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(Change {
            rv: self.rv,
            key,
            kind,
            object,
            previous,
        })
    }

    /// Removes the object at `key`; returns the change to publish.
    pub(crate) fn remove(&mut self, key: &Key) -> Option<Change> {
        let previous = self.objects.remove(key)?;
        self.rv += 1;
        let mut object = previous.clone();
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        Some(self.record(Change {
            rv: self.rv,
            key: key.clone(),
            kind: EventType::Deleted,
            object,
            previous: Some(previous),
        }))
    }

    fn record(&mut self, change: Change) -> Change {
        self.log.push_back(change.clone());
        if self.log.len() > self.history_limit {
            let keep = self.history_limit / 2;
            let drop_to = self.log.len() - keep;
            self.compact_through(self.log[drop_to - 1].rv);
        }
        change
    }

    /// Forgets the history up to and including `rv`.
    pub(crate) fn compact_through(&mut self, rv: u64) {
        while self.log.front().is_some_and(|c| c.rv <= rv) {
            self.log.pop_front();
        }
        self.compacted = self.compacted.max(rv.min(self.rv));
    }

    /// The changes after `rv`, or `None` when history no longer reaches back
    /// that far.
    pub(crate) fn since(&self, rv: u64) -> Option<Vec<Change>> {
        (rv >= self.compacted).then(|| self.log.iter().filter(|c| c.rv > rv).cloned().collect())
    }

    /// The objects of `resource` as they were at `rv` (history rolled back),
    /// or `None` when it is compacted.
    pub(crate) fn snapshot(&self, resource: &str, rv: u64) -> Option<BTreeMap<Key, Value>> {
        if rv < self.compacted {
            return None;
        }
        let mut objects: BTreeMap<Key, Value> = self
            .objects
            .range(range_of(resource))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for change in self.log.iter().rev().take_while(|c| c.rv > rv) {
            if change.key.0 != resource {
                continue;
            }
            match &change.previous {
                Some(previous) => objects.insert(change.key.clone(), previous.clone()),
                None => objects.remove(&change.key),
            };
        }
        Some(objects)
    }

    /// The current objects of `resource`.
    pub(crate) fn of(&self, resource: &str) -> impl Iterator<Item = (&Key, &Value)> {
        self.objects.range(range_of(resource))
    }
}

/// The keys of one resource.
fn range_of(resource: &str) -> std::ops::RangeInclusive<Key> {
    (resource.to_owned(), String::new(), String::new())
        ..=(resource.to_owned(), "\u{10ffff}".to_owned(), String::new())
}
