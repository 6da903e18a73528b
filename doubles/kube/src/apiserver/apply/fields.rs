//! Field sets in the API server's `FieldsV1` form, and the paths they name
//! in an object: building a set from an object, walking, adding and
//! removing its leaves, and reading or removing what a path names.

use serde_json::{Map, Value, json};

use super::Scope;
use crate::apiserver::schema::{self, ListType};

/// A `FieldsV1` tree.
pub(crate) type Fields = Map<String, Value>;

/// A path in a field set, one element a level.
pub(crate) type Path = Vec<String>;

/// The metadata the server owns: in no field set.
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
pub(super) fn scoped(object: &Value, scope: Scope) -> Map<String, Value> {
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

/// `path.key`, the dotted path [`schema`] looks lists up by.
pub(super) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// `k:{...}` for an item of a list keyed by `keys` (those it has).
pub(super) fn item_key(item: &Value, keys: &[&str]) -> Option<String> {
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
pub(super) fn node<'a>(set: &'a Fields, path: &[String]) -> Option<&'a Fields> {
    let mut here = set;
    for p in path {
        here = here.get(p)?.as_object()?;
    }
    Some(here)
}

/// Whether `path` is in `set` (as a leaf or above one).
pub(super) fn contains(set: &Fields, path: &[String]) -> bool {
    node(set, path).is_some()
}

pub(super) fn insert(set: &mut Fields, path: &[String]) {
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
pub(super) fn remove(set: &mut Fields, path: &[String]) {
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

/// The index in `items` of the item a `k:` or `v:` element names.
pub(super) fn find_item(items: &[Value], element: &str) -> Option<usize> {
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

/// The JSON pointer in `object` of a field-set path, if it names anything.
fn pointer(object: &Value, path: &[String]) -> Option<String> {
    let mut here = object;
    let mut out = String::new();
    for element in path {
        let token = if let Some(field) = element.strip_prefix("f:") {
            here = here.get(field)?;
            field.replace('~', "~0").replace('/', "~1")
        } else if element == "." {
            continue;
        } else {
            let items = here.as_array()?;
            let i = find_item(items, element)?;
            here = &items[i];
            i.to_string()
        };
        out.push('/');
        out.push_str(&token);
    }
    Some(out)
}

/// The value of `object` at a field-set path.
pub(crate) fn value_at<'a>(object: &'a Value, path: &[String]) -> Option<&'a Value> {
    object.pointer(&pointer(object, path)?)
}

/// Removes what `path` names from `object`, and the maps that leaves empty.
pub(super) fn remove_at(object: &mut Value, path: &[String]) {
    let path = match path.split_last() {
        Some((last, parent)) if last == "." => parent,
        _ => path,
    };
    let Some((last, parent)) = path.split_last() else {
        return;
    };
    let Some(container) = pointer(object, parent).and_then(|p| object.pointer_mut(&p)) else {
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
