//! Create, update, patch and delete, as the API server's generic registry
//! does them: server-owned metadata kept (uid, creationTimestamp,
//! generation raised on spec changes), `/status` and the main resource
//! writing only their own part, validation before anything is stored,
//! preconditions, finalizers, managedFields recorded, `dryRun=All`
//! answering without storing.
//!
//! This module holds what the requests share: the request's checks
//! (type, namespace, name, dry run, field manager, preconditions) and the
//! store's writes; [`create`], [`update`], [`patching`] and [`delete`] one
//! kind of request each.

use serde_json::{Map, Value, json};

use super::apply::{Scope, Writer};
use super::resources::{self, Resource};
use super::status::{ApiError, Cause, Result};
use super::store::{Key, Store};
use super::{Params, State, Target};

mod create;
mod delete;
mod patching;
mod update;

pub(crate) use create::{create, put, seed};
pub(crate) use delete::{delete, delete_collection, delete_now};
pub(crate) use patching::patch;
pub(crate) use update::update;

/// Now, as metadata timestamps are written.
fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Whether the request is a dry run (`dryRun=All` in the query or in
/// `options`, the body of a delete).
fn dry_run(params: &Params, options: Option<&Value>) -> Result<bool> {
    let from_body = options
        .and_then(|o| o.get("dryRun"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str);
    let mut dry = false;
    for value in params.all("dryRun").chain(from_body) {
        if value != "All" {
            return Err(ApiError::bad_request(format!(
                "dryRun: Unsupported value: {value:?}: supported values: \"All\""
            )));
        }
        dry = true;
    }
    Ok(dry)
}

/// `fieldManager`, else what the client's User-Agent names.
fn manager(params: &Params, user_agent: &str) -> Result<String> {
    let name = params
        .get("fieldManager")
        .filter(|m| !m.is_empty())
        .unwrap_or(if user_agent.is_empty() {
            "unknown"
        } else {
            user_agent
        });
    if name.len() > 128 {
        return Err(ApiError::bad_request(
            "fieldManager: Too long: may not be more than 128 bytes",
        ));
    }
    Ok(name.to_owned())
}

fn scope(r: &Resource, status: bool) -> Scope {
    if status {
        Scope::Status
    } else {
        Scope::Main {
            status_separate: r.status.is_some(),
        }
    }
}

/// A write of `r` in `scope` by `manager` at `now`.
fn writer<'a>(
    r: &'a Resource,
    api_version: &'a str,
    scope: Scope,
    manager: &'a str,
    now: &'a str,
) -> Writer<'a> {
    Writer {
        kind: r.kind,
        api_version,
        scope,
        manager,
        now,
    }
}

fn key(r: &Resource, ns: &str, name: &str) -> Key {
    (r.plural.to_owned(), ns.to_owned(), name.to_owned())
}

/// The metadata of `object`, made an object if it is not one.
fn meta(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    object["metadata"]
        .as_object_mut()
        .expect("metadata was made an object")
}

fn str_at<'a>(object: &'a Value, pointer: &str) -> Option<&'a str> {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// The namespace ("" when cluster-scoped) and name of `object`.
fn namespace_and_name(object: &Value) -> (String, String) {
    let text = |pointer| str_at(object, pointer).unwrap_or_default().to_owned();
    (text("/metadata/namespace"), text("/metadata/name"))
}

/// Refuses a body of another type; fills in apiVersion and kind.
fn check_type(r: &Resource, object: &mut Value) -> Result<()> {
    if !object.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    }
    let want = r.api_version();
    if let Some(v) = object.get("apiVersion").and_then(Value::as_str)
        && v != want
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({v}) does not match the expected API version ({want})"
        )));
    }
    if let Some(k) = object.get("kind").and_then(Value::as_str)
        && k != r.kind
    {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): kind is {k}",
            r.kind
        )));
    }
    object["apiVersion"] = json!(want);
    object["kind"] = json!(r.kind);
    Ok(())
}

/// The checks of a body written to a named object's URL: its type, its
/// namespace, and a name that is the URL's.
fn check_named(r: &Resource, target: &Target, name: &str, object: &mut Value) -> Result<()> {
    check_type(r, object)?;
    check_namespace(r, target.namespace.as_deref().unwrap_or_default(), object)?;
    match str_at(object, "/metadata/name") {
        Some(theirs) if theirs != name => Err(ApiError::bad_request(format!(
            "the name of the object ({theirs}) does not match the name on the URL ({name})"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a body naming another namespace; sets the request's.
fn check_namespace(r: &Resource, ns: &str, object: &mut Value) -> Result<()> {
    let m = meta(object);
    if !r.namespaced {
        m.remove("namespace");
        return Ok(());
    }
    match m.get("namespace").and_then(Value::as_str) {
        Some(theirs) if !theirs.is_empty() && theirs != ns => Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        )),
        _ => {
            m.insert("namespace".to_owned(), json!(ns));
            Ok(())
        }
    }
}

/// Refuses a write whose body names another resourceVersion than `old`'s
/// (an update's optimistic concurrency).
fn check_resource_version(r: &Resource, name: &str, body: &Value, old: &Value) -> Result<()> {
    match str_at(body, "/metadata/resourceVersion") {
        Some(theirs) if Some(theirs) != str_at(old, "/metadata/resourceVersion") => {
            Err(ApiError::modified(r, name))
        }
        _ => Ok(()),
    }
}

/// Refuses a write whose precondition `theirs` (of field `what`, `UID` or
/// `ResourceVersion`) is not the object's `ours`.
fn check_precondition(
    r: &Resource,
    name: &str,
    what: &str,
    theirs: &str,
    ours: &str,
) -> Result<()> {
    if theirs == ours {
        return Ok(());
    }
    Err(ApiError::conflict(
        r,
        name,
        &format!(
            "Precondition failed: {what} in precondition: {theirs}, {what} in object meta: {ours}"
        ),
    ))
}

fn invalid_if(r: &Resource, name: &str, causes: Vec<Cause>) -> Result<()> {
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(r, name, causes))
    }
}

fn namespaces() -> &'static Resource {
    resources::by_plural("namespaces").expect("namespaces are served")
}

/// The object `target` names, with its key.
fn current(store: &Store, target: &Target) -> (Key, Option<Value>) {
    let key = key(
        target.resource,
        target.namespace.as_deref().unwrap_or_default(),
        target.name.as_deref().unwrap_or_default(),
    );
    let object = store.objects.get(&key).cloned();
    (key, object)
}

/// Stores `object` at `key` and tells the watchers; the object stored.
fn store_write(state: &State, store: &mut Store, key: Key, object: Value) -> Value {
    let change = store.write(key, object);
    let stored = change.object.clone();
    state.publish(change);
    stored
}

/// Removes the object at `key` and tells the watchers; its last state.
fn store_remove(state: &State, store: &mut Store, key: &Key) -> Option<Value> {
    let change = store.remove(key)?;
    let gone = change.object.clone();
    state.publish(change);
    Some(gone)
}
