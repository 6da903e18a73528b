//! Deletes: `DELETE` of an object (finalizers hold it, preconditions
//! checked) or of a collection, and the test's direct delete.

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::super::read::Filter;
use super::super::resources::{Resource, by_plural};
use super::super::status::{ApiError, Result, deleted, json_response};
use super::super::store::{Key, Store};
use super::super::{Params, State, Target};
use super::{
    check_precondition, current, dry_run, key, meta, now, store_remove, store_write, str_at,
};

/// What a delete did.
enum Deleted {
    /// Removed: its last state.
    Gone(Value),
    /// Held by finalizers: its state, now with a deletionTimestamp.
    Held(Value),
}

impl Deleted {
    fn object(self) -> Value {
        match self {
            Self::Gone(object) | Self::Held(object) => object,
        }
    }
}

/// Deletes the object at `key` (finalizers hold it); a namespace takes its
/// objects with it.
fn delete_key(
    state: &State,
    store: &mut Store,
    r: &Resource,
    key: &Key,
    old: &Value,
    dry: bool,
) -> Deleted {
    let has_finalizers = old["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty());
    if has_finalizers {
        let mut held = old.clone();
        if old["metadata"].get("deletionTimestamp").is_some() || dry {
            if dry {
                meta(&mut held).insert("deletionTimestamp".to_owned(), json!(now()));
            }
            return Deleted::Held(held);
        }
        let m = meta(&mut held);
        m.insert("deletionTimestamp".to_owned(), json!(now()));
        m.insert("deletionGracePeriodSeconds".to_owned(), json!(0));
        return Deleted::Held(store_write(state, store, key.clone(), held));
    }
    if dry {
        return Deleted::Gone(old.clone());
    }
    if r.plural == "namespaces" {
        let inside: Vec<(Key, Value)> = store
            .objects
            .iter()
            .filter(|((_, ns, _), _)| *ns == key.2)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, v) in inside {
            if let Some(owner) = by_plural(&k.0) {
                delete_key(state, store, owner, &k, &v, false);
            }
        }
    }
    Deleted::Gone(store_remove(state, store, key).unwrap_or_else(|| old.clone()))
}

/// `DELETE` of an object, with optional `DeleteOptions`.
pub(crate) fn delete(
    state: &State,
    target: &Target,
    params: &Params,
    options: Value,
) -> Result<Response> {
    let r = target.resource;
    let name = target.name.clone().unwrap_or_default();
    let dry = dry_run(params, Some(&options))?;
    let mut store = state.store();
    let (key, found) = current(&store, target);
    let old = found.ok_or_else(|| ApiError::not_found(r, &name))?;
    for (what, pointer) in [("UID", "uid"), ("ResourceVersion", "resourceVersion")] {
        if let Some(theirs) = str_at(&options, &format!("/preconditions/{pointer}")) {
            let ours = str_at(&old, &format!("/metadata/{pointer}")).unwrap_or_default();
            check_precondition(r, &name, what, theirs, ours)?;
        }
    }
    Ok(match delete_key(state, &mut store, r, &key, &old, dry) {
        Deleted::Held(object) => json_response(&object, StatusCode::ACCEPTED),
        Deleted::Gone(object) if r.returns_deleted => json_response(&object, StatusCode::OK),
        Deleted::Gone(object) => json_response(
            &deleted(r, &name, &object["metadata"]["uid"]),
            StatusCode::OK,
        ),
    })
}

/// `DELETE` of a collection: every selected object; answers their list.
pub(crate) fn delete_collection(
    state: &State,
    target: &Target,
    params: &Params,
) -> Result<Response> {
    let r = target.resource;
    let dry = dry_run(params, None)?;
    let filter = Filter::new(target, params)?;
    let mut store = state.store();
    let chosen: Vec<(Key, Value)> = store
        .of(r.plural)
        .filter(|((_, ns, _), v)| filter.matches(ns, v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let items: Vec<Value> = chosen
        .into_iter()
        .map(|(key, old)| delete_key(state, &mut store, r, &key, &old, dry).object())
        .collect();
    let rv = store.rv.to_string();
    Ok(json_response(
        &json!({"apiVersion": r.api_version(), "kind": format!("{}List", r.kind),
            "metadata": {"resourceVersion": rv}, "items": items}),
        StatusCode::OK,
    ))
}

/// [`FakeApiServer::delete`](super::super::FakeApiServer::delete).
pub(crate) fn delete_now(
    state: &State,
    resource: &str,
    namespace: &str,
    name: &str,
) -> Option<Value> {
    let r = by_plural(resource)?;
    let mut store = state.store();
    let key = key(r, namespace, name);
    let old = store.objects.get(&key).cloned()?;
    Some(delete_key(state, &mut store, r, &key, &old, false).object())
}
