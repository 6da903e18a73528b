//! `metadata.managedFields` bookkeeping: each manager's entry (manager,
//! operation, subresource, field set) read from and stored back into an
//! object, and what a non-apply write (`Update`) does to the owners.

use serde_json::{Value, json};

use super::fields::{self, Fields, Path};
use super::{Scope, Writer};

/// One managedFields entry's identity and set.
pub(super) struct Entry {
    raw: Value,
    pub(super) set: Fields,
}

impl Entry {
    pub(super) fn manager(&self) -> &str {
        self.raw["manager"].as_str().unwrap_or_default()
    }

    fn operation(&self) -> &str {
        self.raw["operation"].as_str().unwrap_or_default()
    }

    pub(super) fn subresource(&self) -> Option<&str> {
        self.raw.get("subresource").and_then(Value::as_str)
    }

    fn is(&self, manager: &str, operation: &str, scope: Scope) -> bool {
        self.manager() == manager
            && self.operation() == operation
            && self.subresource() == scope.subresource()
    }
}

/// The entries of `object`.
pub(super) fn entries(object: &Value) -> Vec<Entry> {
    object
        .pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|raw| Entry {
            raw: raw.clone(),
            set: raw
                .get("fieldsV1")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
        })
        .collect()
}

/// Stores `entries` as `object`'s managedFields, those with empty sets left out.
pub(super) fn store_entries(object: &mut Value, entries: Vec<Entry>) {
    let list: Vec<Value> = entries
        .into_iter()
        .filter(|e| !e.set.is_empty())
        .map(|mut e| {
            e.raw["fieldsV1"] = Value::Object(e.set);
            e.raw
        })
        .collect();
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        if list.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".to_owned(), Value::Array(list));
        }
    }
}

/// The index of `writer`'s entry for `operation` in `all`, added when
/// missing, its time and apiVersion now the writer's.
pub(super) fn entry_for(all: &mut Vec<Entry>, writer: &Writer<'_>, operation: &str) -> usize {
    let at = match all
        .iter()
        .position(|e| e.is(writer.manager, operation, writer.scope))
    {
        Some(i) => i,
        None => {
            let mut raw = json!({
                "manager": writer.manager, "operation": operation,
                "apiVersion": writer.api_version, "time": writer.now, "fieldsType": "FieldsV1",
            });
            if let Some(sub) = writer.scope.subresource() {
                raw["subresource"] = json!(sub);
            }
            all.push(Entry {
                raw,
                set: Fields::new(),
            });
            all.len() - 1
        }
    };
    all[at].raw["time"] = json!(writer.now);
    all[at].raw["apiVersion"] = json!(writer.api_version);
    at
}

/// Whether anyone's set in `entries` but `except` holds `path` (for an
/// item's `.`, anything inside the item).
pub(super) fn owned_by_others(entries: &[Entry], except: usize, path: &[String]) -> bool {
    let probe = match path.split_last() {
        Some((last, parent)) if last == "." => parent,
        _ => path,
    };
    entries
        .iter()
        .enumerate()
        .any(|(i, e)| i != except && fields::contains(&e.set, probe))
}

/// What a write (an `Update` by `writer`) did to the owners of `new`'s
/// fields; `old` is `None` on create.
pub(crate) fn record_update(writer: &Writer<'_>, old: Option<&Value>, new: &mut Value) {
    let empty = json!({});
    let before = old.unwrap_or(&empty);
    let new_set = fields::fields_of(writer.kind, new, writer.scope);
    let old_set = fields::fields_of(writer.kind, before, writer.scope);
    let changed: Vec<Path> = fields::leaves(&new_set)
        .into_iter()
        .filter(|p| fields::value_at(before, p) != fields::value_at(new, p))
        .collect();
    let removed: Vec<Path> = fields::leaves(&old_set)
        .into_iter()
        .filter(|p| fields::value_at(new, p).is_none())
        .collect();
    let mut all = old.map(entries).unwrap_or_default();
    if changed.is_empty() && removed.is_empty() {
        store_entries(new, all);
        return;
    }
    for e in &mut all {
        for p in changed.iter().chain(&removed) {
            fields::remove(&mut e.set, p);
        }
    }
    let at = entry_for(&mut all, writer, "Update");
    for p in &changed {
        fields::insert(&mut all[at].set, p);
    }
    store_entries(new, all);
}
