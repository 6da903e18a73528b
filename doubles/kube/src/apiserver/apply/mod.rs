//! Server-side apply and `metadata.managedFields`.
//!
//! Field sets are kept in the API server's own `FieldsV1` form
//! ([`fields`]): a tree of `f:<field>` (a map key), `k:{"name":"main"}` (an
//! item of a keyed list), `v:"x"` (an item of a set), and `.` (the item
//! itself); a node without children is an owned leaf. Lists are keyed,
//! sets or atomic as [`schema`](super::schema) says; an atomic list, a
//! scalar or an empty map is one leaf.
//!
//! - Every write records its manager ([`managers`]). A non-apply write
//!   (`Update`) takes the leaves it changed from every other manager, and
//!   leaves it removed are dropped from every set.
//! - An apply (`Apply`) conflicts when another manager owns a leaf of the
//!   applied configuration that it sets to a different value (409, one
//!   cause a field); with `force`, the leaf is taken from that manager.
//!   Leaves the manager applied before and leaves out now are removed from
//!   the object unless another manager owns them too.
//!
//! The fields the server owns (name, namespace, uid, resourceVersion,
//! generation, timestamps, managedFields, apiVersion, kind) are never in a
//! set; a write through the main resource owns no `status` field and one
//! through `/status` only those.

use serde_json::Value;

use super::schema::{self, ListType};

mod fields;
mod managers;

pub(crate) use managers::record_update;

/// Which part of an object a request writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Everything but `status` (the whole object where status is no
    /// subresource).
    Main { status_separate: bool },
    /// Only `status`.
    Status,
}

impl Scope {
    fn keeps(self, top: &str) -> bool {
        match self {
            Self::Main { status_separate } => !(status_separate && top == "status"),
            Self::Status => top == "status",
        }
    }

    /// `subresource` of a managedFields entry.
    fn subresource(self) -> Option<&'static str> {
        match self {
            Self::Status => Some("status"),
            Self::Main { .. } => None,
        }
    }
}

/// Who writes what, and when: the identity of a managedFields entry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writer<'a> {
    /// The object's kind (how its lists merge).
    pub kind: &'a str,
    pub api_version: &'a str,
    pub scope: Scope,
    pub manager: &'a str,
    pub now: &'a str,
}

/// A leaf another manager owns (as a leaf too) with another value.
#[derive(Debug, Clone)]
pub(crate) struct Conflict {
    pub manager: String,
    pub field: String,
}

/// Applies `config` as `writer` onto `live` (the current object, or a
/// bare one on create); the merged object with its managedFields, or the
/// conflicts.
pub(crate) fn apply(
    writer: &Writer<'_>,
    live: &Value,
    config: &Value,
    force: bool,
) -> Result<Value, Vec<Conflict>> {
    let scope = writer.scope;
    let applied = Value::Object(fields::scoped(config, scope));
    let set = fields::fields_of(writer.kind, config, scope);
    let mut all = managers::entries(live);
    let mut conflicts = Vec::new();
    for leaf in fields::leaves(&set) {
        if leaf.last().is_some_and(|l| l == ".")
            || fields::value_at(live, &leaf) == fields::value_at(config, &leaf)
        {
            continue;
        }
        for e in &mut all {
            // The manager's own entries (Apply or Update) never conflict with it.
            if e.manager() == writer.manager
                || e.subresource() != scope.subresource()
                || fields::node(&e.set, &leaf).is_none_or(|n| !n.is_empty())
            {
                continue;
            }
            if force {
                fields::remove(&mut e.set, &leaf);
            } else {
                conflicts.push(Conflict {
                    manager: e.manager().to_owned(),
                    field: fields::display(&leaf),
                });
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(conflicts);
    }
    let mut merged = live.clone();
    merge(writer.kind, "", &mut merged, &applied);
    let at = managers::entry_for(&mut all, writer, "Apply");
    let before = std::mem::take(&mut all[at].set);
    let mut dropped: Vec<fields::Path> = fields::leaves(&before)
        .into_iter()
        .filter(|p| !fields::contains(&set, p) && !managers::owned_by_others(&all, at, p))
        .collect();
    // Items after their fields, so each removal still finds its target.
    dropped.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in &dropped {
        fields::remove_at(&mut merged, p);
    }
    all[at].set = set;
    managers::store_entries(&mut merged, all);
    Ok(merged)
}

/// Merges an applied configuration into `live`: maps field by field, keyed
/// lists item by item, sets as unions, anything else replaced.
fn merge(kind: &str, path: &str, live: &mut Value, applied: &Value) {
    let (Some(target), Some(config)) = (live.as_object_mut(), applied.as_object()) else {
        *live = applied.clone();
        return;
    };
    for (k, v) in config {
        let here = fields::join(path, k);
        match (target.get_mut(k), v) {
            (_, Value::Null) => {
                target.remove(k);
            }
            (Some(current @ Value::Object(_)), Value::Object(_)) => merge(kind, &here, current, v),
            (Some(Value::Array(current)), Value::Array(items)) => {
                match schema::list(kind, &here).apply {
                    ListType::Map(keys) => {
                        for item in items {
                            let id = fields::item_key(item, keys);
                            let at = id.as_deref().and_then(|id| fields::find_item(current, id));
                            match at {
                                Some(i) => merge(kind, &here, &mut current[i], item),
                                None => current.push(item.clone()),
                            }
                        }
                    }
                    ListType::Set => {
                        for item in items {
                            if !current.contains(item) {
                                current.push(item.clone());
                            }
                        }
                    }
                    ListType::Atomic => *current = items.clone(),
                }
            }
            _ => {
                target.insert(k.clone(), v.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const MAIN: Scope = Scope::Main {
        status_separate: true,
    };

    #[test]
    fn field_sets_in_the_servers_form() {
        let pod = json!({"metadata": {"name": "p", "labels": {"a": "1"}},
            "spec": {"containers": [{"name": "main", "image": "x"}], "tolerations": [{"key": "k"}]},
            "status": {"phase": "Running"}});
        assert_eq!(
            Value::Object(fields::fields_of("Pod", &pod, MAIN)),
            json!({"f:metadata": {"f:labels": {"f:a": {}}}, "f:spec": {
                "f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:image": {}, "f:name": {}}},
                "f:tolerations": {}}})
        );
    }

    /// `manager` applies a config map with `data` onto `live`.
    fn apply_data(
        live: &Value,
        data: Option<Value>,
        manager: &str,
        force: bool,
    ) -> Result<Value, Vec<Conflict>> {
        let mut config =
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        if let Some(data) = data {
            config["data"] = data;
        }
        let writer = Writer {
            kind: "ConfigMap",
            api_version: "v1",
            scope: MAIN,
            manager,
            now: "2026-01-01T00:00:00Z",
        };
        apply(&writer, live, &config, force)
    }

    #[test]
    fn conflicts_force_and_removal() {
        let live = json!({"metadata": {"name": "c"}});
        let a = apply_data(&live, Some(json!({"x": "1", "y": "1"})), "a", false).unwrap();
        // Same value: shared, no conflict.
        let b = apply_data(&a, Some(json!({"x": "1"})), "b", false).unwrap();
        let conflicts = apply_data(&b, Some(json!({"y": "2"})), "b", false).unwrap_err();
        assert_eq!(
            (conflicts[0].manager.as_str(), conflicts[0].field.as_str()),
            ("a", ".data.y")
        );
        let forced = apply_data(&b, Some(json!({"x": "1", "y": "2"})), "b", true).unwrap();
        assert_eq!(forced["data"], json!({"x": "1", "y": "2"}));
        // a gives up everything: x stays (b owns it), y stays (b took it).
        let a_empty = apply_data(&forced, None, "a", false).unwrap();
        assert_eq!(a_empty["data"], json!({"x": "1", "y": "2"}));
        // b drops y: nobody owns it any more, so it goes.
        let b_less = apply_data(&a_empty, Some(json!({"x": "1"})), "b", false).unwrap();
        assert_eq!(b_less["data"], json!({"x": "1"}));
    }
}
