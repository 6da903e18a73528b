//! The three classic patch types: JSON merge patch (RFC 7386), JSON patch
//! (RFC 6902, through the `json-patch` crate) and strategic merge patch.
//!
//! Strategic merge patch, for the lists [`schema`](super::schema) names:
//! lists with a merge key merge item by item (`{"$patch": "delete"}` in an
//! item removes it, a `{"$patch": "replace"}` item replaces the list),
//! lists of scalars with the merge strategy are unions, other lists are
//! replaced; maps merge recursively (`null` removes a key, `"$patch":
//! "replace"` / `"delete"` in a map replaces / removes it); and the
//! directives kubectl's three-way patches carry: `$setElementOrder/<list>`,
//! `$deleteFromPrimitiveList/<list>`, `$retainKeys`.

use serde_json::{Map, Value};

use super::schema::{self, Strategy};

/// RFC 7386.
pub(crate) fn merge(target: &mut Value, patch: &Value) {
    json_patch::merge(target, patch);
}

/// RFC 6902; `Err` says which operation failed.
pub(crate) fn json(target: &Value, patch: &Value) -> Result<Value, String> {
    let ops: json_patch::Patch =
        serde_json::from_value(patch.clone()).map_err(|e| format!("invalid JSON patch: {e}"))?;
    let mut out = target.clone();
    json_patch::patch(&mut out, &ops).map_err(|e| e.to_string())?;
    Ok(out)
}

/// A strategic merge patch of an object of `kind`.
pub(crate) fn strategic(kind: &str, target: &Value, patch: &Value) -> Result<Value, String> {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => Ok(map(kind, "", t, p)?
            .map(Value::Object)
            .unwrap_or_else(|| Value::Object(Map::new()))),
        _ => Err("a strategic merge patch must be a JSON object".to_owned()),
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

const ORDER: &str = "$setElementOrder/";
const DELETE_FROM: &str = "$deleteFromPrimitiveList/";

/// Merges `patch` into `target`; `None` when the patch deletes the map.
fn map(
    kind: &str,
    path: &str,
    target: &Map<String, Value>,
    patch: &Map<String, Value>,
) -> Result<Option<Map<String, Value>>, String> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("delete") => return Ok(None),
        Some("replace") => return Ok(Some(strip_map(patch))),
        Some("merge") | None => {}
        Some(other) => return Err(format!("unknown patch type: {other:?}")),
    }
    let mut out = target.clone();
    for (key, value) in patch {
        if key.starts_with('$') {
            continue;
        }
        let here = join(path, key);
        match value {
            Value::Null => {
                out.remove(key);
            }
            Value::Object(p) => match out.get(key) {
                Some(Value::Object(t)) => match map(kind, &here, t, p)? {
                    Some(merged) => {
                        out.insert(key.clone(), Value::Object(merged));
                    }
                    None => {
                        out.remove(key);
                    }
                },
                _ => {
                    if p.get("$patch").and_then(Value::as_str) == Some("delete") {
                        out.remove(key);
                    } else {
                        out.insert(key.clone(), Value::Object(strip_map(p)));
                    }
                }
            },
            Value::Array(p) => {
                let current = out.get(key).and_then(Value::as_array);
                let merged = list(kind, &here, current.map(Vec::as_slice), p)?;
                out.insert(key.clone(), Value::Array(merged));
            }
            scalar => {
                out.insert(key.clone(), scalar.clone());
            }
        }
    }
    for (key, value) in patch {
        if let Some(field) = key.strip_prefix(DELETE_FROM) {
            let gone = value.as_array().cloned().unwrap_or_default();
            if let Some(Value::Array(items)) = out.get_mut(field) {
                items.retain(|v| !gone.contains(v));
            }
        }
    }
    for (key, value) in patch {
        if let Some(field) = key.strip_prefix(ORDER) {
            let merge_key = match schema::list(kind, &join(path, field)).patch {
                Strategy::MergeKey(k) => Some(k),
                _ => None,
            };
            if let (Some(Value::Array(items)), Some(order)) = (out.get_mut(field), value.as_array())
            {
                reorder(items, order, merge_key);
            }
        }
    }
    if let Some(Value::Array(keep)) = patch.get("$retainKeys") {
        out.retain(|k, _| keep.iter().any(|kept| kept.as_str() == Some(k)));
    }
    Ok(Some(out))
}

fn list(
    kind: &str,
    path: &str,
    target: Option<&[Value]>,
    patch: &[Value],
) -> Result<Vec<Value>, String> {
    let replace = patch
        .iter()
        .any(|v| v.get("$patch").and_then(Value::as_str) == Some("replace"));
    let target = target.unwrap_or_default();
    match schema::list(kind, path).patch {
        _ if replace => Ok(patch
            .iter()
            .filter(|v| v.get("$patch").is_none())
            .map(strip)
            .collect()),
        Strategy::Replace => Ok(patch.iter().map(strip).collect()),
        Strategy::MergeSet => {
            let mut out = target.to_vec();
            for v in patch {
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
            Ok(out)
        }
        Strategy::MergeKey(merge_key) => {
            let mut out = target.to_vec();
            for item in patch {
                let Some(p) = item.as_object() else {
                    // Scalars in a keyed list: nothing to match them by.
                    return Err(format!("{path}: items must be objects"));
                };
                let Some(id) = p.get(merge_key) else {
                    return Err(format!(
                        "map: {item} does not contain declared merge key: {merge_key}"
                    ));
                };
                let at = out.iter().position(|t| t.get(merge_key) == Some(id));
                if p.get("$patch").and_then(Value::as_str) == Some("delete") {
                    out.retain(|t| t.get(merge_key) != Some(id));
                    continue;
                }
                match at {
                    Some(i) => {
                        let t = out[i].as_object().cloned().unwrap_or_default();
                        match map(kind, path, &t, p)? {
                            Some(merged) => out[i] = Value::Object(merged),
                            None => {
                                out.remove(i);
                            }
                        }
                    }
                    None => out.push(Value::Object(strip_map(p))),
                }
            }
            Ok(out)
        }
    }
}

/// Orders `items` as `order` lists them; the others keep their order after.
fn reorder(items: &mut [Value], order: &[Value], merge_key: Option<&str>) {
    let id = |v: &Value| match merge_key {
        Some(k) => v.get(k).cloned(),
        None => Some(v.clone()),
    };
    let rank = |v: &Value| {
        let mine = id(v);
        order
            .iter()
            .position(|o| id(o) == mine && mine.is_some())
            .unwrap_or(usize::MAX)
    };
    items.sort_by_key(rank);
}

fn strip_map(m: &Map<String, Value>) -> Map<String, Value> {
    m.iter()
        .filter(|(k, _)| !k.starts_with('$'))
        .map(|(k, v)| (k.clone(), strip(v)))
        .collect()
}

/// `v` without patch directives.
fn strip(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(strip_map(m)),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .filter(|i| i.get("$patch").is_none())
                .map(strip)
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn containers_merge_by_name() {
        let pod = json!({"spec": {"containers": [
            {"name": "a", "image": "a:1", "env": [{"name": "X", "value": "1"}]},
            {"name": "b", "image": "b:1"},
        ]}});
        let patch = json!({"spec": {"containers": [{"name": "a", "image": "a:2"}]}});
        let out = strategic("Pod", &pod, &patch).unwrap();
        assert_eq!(
            out,
            json!({"spec": {"containers": [
                {"name": "a", "image": "a:2", "env": [{"name": "X", "value": "1"}]},
                {"name": "b", "image": "b:1"},
            ]}})
        );
    }

    #[test]
    fn directives() {
        let pod = json!({"metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x", "y"]},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}], "tolerations": [{"key": "k"}]}});
        let patch = json!({
            "metadata": {"labels": {"a": null, "c": "3"}, "$deleteFromPrimitiveList/finalizers": ["x"]},
            "spec": {
                "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}],
                "containers": [{"name": "b", "$patch": "delete"}, {"name": "c", "image": "c"}],
                "tolerations": [{"key": "z"}],
            },
        });
        let out = strategic("Pod", &pod, &patch).unwrap();
        assert_eq!(
            out,
            json!({"metadata": {"labels": {"b": "2", "c": "3"}, "finalizers": ["y"]},
                "spec": {"containers": [{"name": "c", "image": "c"}, {"name": "a"}], "tolerations": [{"key": "z"}]}})
        );
        let replace = json!({"spec": {"containers": [{"$patch": "replace"}, {"name": "z"}]}});
        assert_eq!(
            strategic("Pod", &pod, &replace).unwrap()["spec"]["containers"],
            json!([{"name": "z"}])
        );
        let missing_key = json!({"spec": {"containers": [{"image": "x"}]}});
        assert!(strategic("Pod", &pod, &missing_key).is_err());
    }
}
