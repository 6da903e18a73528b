//! Server-side apply and `metadata.managedFields`.
//!
//! Field sets are kept in the API server's own `FieldsV1` form: a tree of
//! `f:<field>` (a map key), `k:{"name":"main"}` (an item of a keyed list),
//! `v:"x"` (an item of a set), and `.` (the item itself); a node without
//! children is an owned leaf. Lists are keyed, sets or atomic as
//! [`schema`](super::schema) says; an atomic list, a scalar or an empty map
//! is one leaf.
//!
//! - Every write records its manager. A non-apply write (`Update`) takes
//!   the leaves it changed from every other manager, and leaves it removed
//!   are dropped from every set.
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

use serde_json::{Map, Value, json};

use super::schema::{self, ListType};

/// A `FieldsV1` tree.
pub(crate) type Fields = Map<String, Value>;

/// A path in a field set, one element a level.
pub(crate) type Path = Vec<String>;

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

const SERVER_METADATA: &[&str] = &[
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
    "generateName",
];

/// `object` reduced to the fields a write in `scope` owns.
fn scoped(object: &Value, scope: Scope) -> Map<String, Value> {
    let mut out = Map::new();
    let Some(fields) = object.as_object() else {
        return out;
    };
    for (k, v) in fields {
        if k == "apiVersion" || k == "kind" {
            continue;
        }
        if k == "metadata" {
            if scope == Scope::Status {
                continue;
            }
            let meta: Map<String, Value> = v
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(mk, _)| !SERVER_METADATA.contains(&mk.as_str()))
                .map(|(mk, mv)| (mk.clone(), mv.clone()))
                .collect();
            if !meta.is_empty() {
                out.insert(k.clone(), Value::Object(meta));
            }
            continue;
        }
        if scope.keeps(k) {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// `k:{...}` for an item of a list keyed by `keys` (those it has).
fn item_key(item: &Value, keys: &[&str]) -> Option<String> {
    let mut sorted: Vec<&&str> = keys.iter().collect();
    sorted.sort();
    let parts: Vec<String> = sorted
        .iter()
        .filter_map(|k| item.get(**k).map(|v| format!("{}:{v}", json!(k))))
        .collect();
    (!parts.is_empty()).then(|| format!("k:{{{}}}", parts.join(",")))
}

fn fields_of_map(kind: &str, path: &str, map: &Map<String, Value>) -> Fields {
    let mut out = Fields::new();
    for (k, v) in map {
        let here = join(path, k);
        let node = match v {
            Value::Object(m) if !m.is_empty() => Value::Object(fields_of_map(kind, &here, m)),
            Value::Array(items) if !items.is_empty() => match schema::list(kind, &here).apply {
                ListType::Map(keys) => {
                    let mut sub = Fields::new();
                    for item in items {
                        let (Some(id), Some(m)) = (item_key(item, keys), item.as_object()) else {
                            continue;
                        };
                        let mut own = fields_of_map(kind, &here, m);
                        own.insert(".".to_owned(), json!({}));
                        sub.insert(id, Value::Object(own));
                    }
                    Value::Object(sub)
                }
                ListType::Set => Value::Object(
                    items
                        .iter()
                        .map(|i| (format!("v:{i}"), json!({})))
                        .collect(),
                ),
                ListType::Atomic => json!({}),
            },
            _ => json!({}),
        };
        out.insert(format!("f:{k}"), node);
    }
    out
}

/// The field set of `object` (of `kind`) in `scope`.
pub(crate) fn fields_of(kind: &str, object: &Value, scope: Scope) -> Fields {
    fields_of_map(kind, "", &scoped(object, scope))
}

/// Every leaf path of `set`.
pub(crate) fn leaves(set: &Fields) -> Vec<Path> {
    let mut out = Vec::new();
    fn walk(set: &Fields, prefix: &mut Path, out: &mut Vec<Path>) {
        for (k, v) in set {
            prefix.push(k.clone());
            match v.as_object() {
                Some(children) if !children.is_empty() => walk(children, prefix, out),
                _ => out.push(prefix.clone()),
            }
            prefix.pop();
        }
    }
    walk(set, &mut Vec::new(), &mut out);
    out
}

/// The node of `set` at `path`.
fn node<'a>(set: &'a Fields, path: &[String]) -> Option<&'a Fields> {
    let mut here = set;
    for p in path {
        here = here.get(p)?.as_object()?;
    }
    Some(here)
}

/// Whether `path` is in `set` (as a leaf or above one).
fn contains(set: &Fields, path: &[String]) -> bool {
    node(set, path).is_some()
}

fn insert(set: &mut Fields, path: &[String]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    let child = set
        .entry(first.clone())
        .or_insert_with(|| json!({}))
        .as_object_mut();
    if let Some(child) = child {
        insert(child, rest);
    }
}

/// Removes `path` and the nodes it leaves empty.
fn remove(set: &mut Fields, path: &[String]) {
    match path {
        [] => {}
        [last] => {
            set.remove(last);
        }
        [first, rest @ ..] => {
            let empty = match set.get_mut(first).and_then(Value::as_object_mut) {
                Some(child) => {
                    let had = !child.is_empty();
                    remove(child, rest);
                    had && child.is_empty()
                }
                None => false,
            };
            if empty {
                set.remove(first);
            }
        }
    }
}

fn find_item(items: &[Value], element: &str) -> Option<usize> {
    if let Some(key) = element.strip_prefix("k:") {
        let want: Map<String, Value> = serde_json::from_str(key).ok()?;
        items
            .iter()
            .position(|i| want.iter().all(|(k, v)| i.get(k) == Some(v)))
    } else if let Some(value) = element.strip_prefix("v:") {
        let want: Value = serde_json::from_str(value).ok()?;
        items.iter().position(|i| *i == want)
    } else {
        None
    }
}

/// The value of `object` at a field-set path.
pub(crate) fn value_at<'a>(object: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut here = object;
    for element in path {
        here = if let Some(field) = element.strip_prefix("f:") {
            here.get(field)?
        } else if element == "." {
            here
        } else {
            let items = here.as_array()?;
            &items[find_item(items, element)?]
        };
    }
    Some(here)
}

/// Removes what `path` names from `object`, and the maps that leaves empty.
fn remove_at(object: &mut Value, path: &[String]) {
    let path = match path.split_last() {
        Some((last, parent)) if last == "." => parent,
        _ => path,
    };
    let Some((last, parent)) = path.split_last() else {
        return;
    };
    let Some(container) = value_at_mut(object, parent) else {
        return;
    };
    if let Some(field) = last.strip_prefix("f:") {
        if let Some(map) = container.as_object_mut() {
            map.remove(field);
        }
    } else if let Some(items) = container.as_array_mut()
        && let Some(i) = find_item(items, last)
    {
        items.remove(i);
    }
    let now_empty = match container {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    // An emptied map or list is dropped with its field, as an omitted one is.
    if now_empty && parent.last().is_some_and(|p| p.starts_with("f:")) && parent.len() > 1 {
        remove_at(object, parent);
    }
}

fn value_at_mut<'a>(object: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    let mut here = object;
    for element in path {
        here = if let Some(field) = element.strip_prefix("f:") {
            here.get_mut(field)?
        } else if element == "." {
            here
        } else {
            let items = here.as_array_mut()?;
            let i = find_item(items, element)?;
            &mut items[i]
        };
    }
    Some(here)
}

/// Prints a path as a conflict names it: `.spec.containers[name="main"].image`.
pub(crate) fn display(path: &[String]) -> String {
    let mut out = String::new();
    for element in path {
        if let Some(field) = element.strip_prefix("f:") {
            out.push('.');
            out.push_str(field);
        } else if let Some(key) = element.strip_prefix("k:") {
            let keys: Map<String, Value> = serde_json::from_str(key).unwrap_or_default();
            let inner: Vec<String> = keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push_str(&format!("[{}]", inner.join(",")));
        } else if let Some(value) = element.strip_prefix("v:") {
            out.push_str(&format!("[{value}]"));
        }
    }
    out
}

/// One managedFields entry's identity and set.
struct Entry {
    raw: Value,
    set: Fields,
}

impl Entry {
    fn manager(&self) -> &str {
        self.raw["manager"].as_str().unwrap_or_default()
    }
    fn operation(&self) -> &str {
        self.raw["operation"].as_str().unwrap_or_default()
    }
    fn subresource(&self) -> Option<&str> {
        self.raw.get("subresource").and_then(Value::as_str)
    }
    fn is(&self, manager: &str, operation: &str, scope: Scope) -> bool {
        self.manager() == manager
            && self.operation() == operation
            && self.subresource() == scope.subresource()
    }
}

fn entries(object: &Value) -> Vec<Entry> {
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

fn store_entries(object: &mut Value, entries: Vec<Entry>) {
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

fn new_entry(manager: &str, operation: &str, api_version: &str, scope: Scope, now: &str) -> Entry {
    let mut raw = json!({
        "manager": manager, "operation": operation, "apiVersion": api_version,
        "time": now, "fieldsType": "FieldsV1",
    });
    if let Some(sub) = scope.subresource() {
        raw["subresource"] = json!(sub);
    }
    Entry {
        raw,
        set: Fields::new(),
    }
}

/// Whether anyone's set in `entries` but `except` holds `path` (for an
/// item's `.`, anything inside the item).
fn owned_by_others(entries: &[Entry], except: usize, path: &[String]) -> bool {
    let probe = match path.split_last() {
        Some((last, parent)) if last == "." => parent,
        _ => path,
    };
    entries
        .iter()
        .enumerate()
        .any(|(i, e)| i != except && contains(&e.set, probe))
}

/// What a write in `scope` (an `Update` by `manager`) did to the owners of
/// `new`'s fields; `old` is `None` on create.
pub(crate) fn record_update(
    kind: &str,
    api_version: &str,
    old: Option<&Value>,
    new: &mut Value,
    scope: Scope,
    manager: &str,
    now: &str,
) {
    let empty = json!({});
    let before = old.unwrap_or(&empty);
    let new_set = fields_of(kind, new, scope);
    let old_set = fields_of(kind, before, scope);
    let changed: Vec<Path> = leaves(&new_set)
        .into_iter()
        .filter(|p| value_at(before, p) != value_at(new, p))
        .collect();
    let removed: Vec<Path> = leaves(&old_set)
        .into_iter()
        .filter(|p| value_at(new, p).is_none())
        .collect();
    let mut all = old.map(entries).unwrap_or_default();
    if changed.is_empty() && removed.is_empty() {
        store_entries(new, all);
        return;
    }
    for e in &mut all {
        for p in changed.iter().chain(&removed) {
            remove(&mut e.set, p);
        }
    }
    let at = match all.iter().position(|e| e.is(manager, "Update", scope)) {
        Some(i) => i,
        None => {
            all.push(new_entry(manager, "Update", api_version, scope, now));
            all.len() - 1
        }
    };
    for p in &changed {
        insert(&mut all[at].set, p);
    }
    all[at].raw["time"] = json!(now);
    all[at].raw["apiVersion"] = json!(api_version);
    store_entries(new, all);
}

/// A leaf another manager owns (as a leaf too) with another value.
#[derive(Debug, Clone)]
pub(crate) struct Conflict {
    pub manager: String,
    pub field: String,
}

/// Applies `config` as `manager` onto `live` (the current object, or a
/// bare one on create); the merged object with its managedFields, or the
/// conflicts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    kind: &str,
    api_version: &str,
    live: &Value,
    config: &Value,
    scope: Scope,
    manager: &str,
    force: bool,
    now: &str,
) -> Result<Value, Vec<Conflict>> {
    let applied = Value::Object(scoped(config, scope));
    let set = fields_of(kind, config, scope);
    let mut all = entries(live);
    let mine = all.iter().position(|e| e.is(manager, "Apply", scope));
    let mut conflicts = Vec::new();
    for leaf in leaves(&set) {
        if leaf.last().is_some_and(|l| l == ".") {
            continue;
        }
        if value_at(live, &leaf) == value_at(config, &leaf) {
            continue;
        }
        for (i, e) in all.iter_mut().enumerate() {
            if Some(i) == mine
                || e.manager() == manager
                || e.subresource() != scope.subresource()
                || node(&e.set, &leaf).is_none_or(|n| !n.is_empty())
            {
                continue;
            }
            if force {
                remove(&mut e.set, &leaf);
            } else {
                conflicts.push(Conflict {
                    manager: e.manager().to_owned(),
                    field: display(&leaf),
                });
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(conflicts);
    }
    let mut merged = live.clone();
    merge(kind, "", &mut merged, &applied);
    let at = match mine {
        Some(i) => i,
        None => {
            all.push(new_entry(manager, "Apply", api_version, scope, now));
            all.len() - 1
        }
    };
    let before = std::mem::take(&mut all[at].set);
    let mut dropped: Vec<Path> = leaves(&before)
        .into_iter()
        .filter(|p| !contains(&set, p) && !owned_by_others(&all, at, p))
        .collect();
    // Items after their fields, so each removal still finds its target.
    dropped.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in &dropped {
        remove_at(&mut merged, p);
    }
    all[at].set = set;
    all[at].raw["time"] = json!(now);
    all[at].raw["apiVersion"] = json!(api_version);
    store_entries(&mut merged, all);
    Ok(merged)
}

/// Merges an applied configuration into `live`: maps field by field, keyed
/// lists item by item, sets as unions, anything else replaced.
fn merge(kind: &str, path: &str, live: &mut Value, applied: &Value) {
    let (Some(target), Some(fields)) = (live.as_object_mut(), applied.as_object()) else {
        *live = applied.clone();
        return;
    };
    for (k, v) in fields {
        let here = join(path, k);
        match (target.get_mut(k), v) {
            (_, Value::Null) => {
                target.remove(k);
            }
            (Some(current @ Value::Object(_)), Value::Object(_)) => merge(kind, &here, current, v),
            (Some(Value::Array(current)), Value::Array(items)) => {
                match schema::list(kind, &here).apply {
                    ListType::Map(keys) => {
                        for item in items {
                            let id = item_key(item, keys);
                            let at = id.as_deref().and_then(|id| find_item(current, id));
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
            Value::Object(fields_of("Pod", &pod, MAIN)),
            json!({"f:metadata": {"f:labels": {"f:a": {}}}, "f:spec": {
                "f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:image": {}, "f:name": {}}},
                "f:tolerations": {}}})
        );
    }

    #[test]
    fn conflicts_force_and_removal() {
        let now = "2026-01-01T00:00:00Z";
        let cm = |data: Value| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": data});
        let live = json!({"metadata": {"name": "c"}});
        let a = apply(
            "ConfigMap",
            "v1",
            &live,
            &cm(json!({"x": "1", "y": "1"})),
            MAIN,
            "a",
            false,
            now,
        )
        .unwrap();
        // Same value: shared, no conflict.
        let b = apply(
            "ConfigMap",
            "v1",
            &a,
            &cm(json!({"x": "1"})),
            MAIN,
            "b",
            false,
            now,
        )
        .unwrap();
        let conflicts = apply(
            "ConfigMap",
            "v1",
            &b,
            &cm(json!({"y": "2"})),
            MAIN,
            "b",
            false,
            now,
        )
        .unwrap_err();
        assert_eq!(
            (conflicts[0].manager.as_str(), conflicts[0].field.as_str()),
            ("a", ".data.y")
        );
        let forced = apply(
            "ConfigMap",
            "v1",
            &b,
            &cm(json!({"x": "1", "y": "2"})),
            MAIN,
            "b",
            true,
            now,
        )
        .unwrap();
        assert_eq!(forced["data"], json!({"x": "1", "y": "2"}));
        // a gives up everything: x stays (b owns it), y stays (b took it).
        let bare = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        let a_empty = apply("ConfigMap", "v1", &forced, &bare, MAIN, "a", false, now).unwrap();
        assert_eq!(a_empty["data"], json!({"x": "1", "y": "2"}));
        // b drops y: nobody owns it any more, so it goes.
        let b_less = apply(
            "ConfigMap",
            "v1",
            &a_empty,
            &cm(json!({"x": "1"})),
            MAIN,
            "b",
            false,
            now,
        )
        .unwrap();
        assert_eq!(b_less["data"], json!({"x": "1"}));
    }
}
