//! Updates: `PUT` of an object or its status, and the store step every
//! write of an existing object ends with (server metadata carried over,
//! validation, generation, managedFields, finalization).

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::super::apply::{self, Scope};
use super::super::resources::Resource;
use super::super::status::{ApiError, Cause, Result, json_response};
use super::super::store::Store;
use super::super::{Params, State, Target, validate};
use super::{
    check_named, check_resource_version, current, dry_run, invalid_if, key, manager, meta,
    namespace_and_name, now, scope, store_remove, store_write, writer,
};

/// How an update's managedFields come about.
pub(super) enum Managed<'a> {
    /// Recorded as an `Update` by this manager.
    Update(&'a str),
    /// Already set (an apply).
    Set,
}

/// One write of an existing object: what it writes and how.
pub(super) struct Change<'a> {
    pub r: &'a Resource,
    pub managed: Managed<'a>,
    pub scope: Scope,
    pub dry: bool,
    pub now: &'a str,
}

/// The metadata the server keeps from the stored object, whatever a write sends.
const SERVER_METADATA: [&str; 9] = [
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
    "generateName",
];

/// Stores `new` over `old` (unless a dry run): server metadata carried
/// over, validated, generation raised when the spec changed; a deleted
/// object whose last finalizer went is removed. Unchanged objects keep
/// their resourceVersion.
pub(super) fn save_update(
    state: &State,
    store: &mut Store,
    change: Change<'_>,
    old: &Value,
    mut new: Value,
) -> Result<Value> {
    let Change {
        r,
        managed,
        scope,
        dry,
        now,
    } = change;
    let (ns, name) = namespace_and_name(old);
    if scope == Scope::Status {
        let applied = new.pointer("/metadata/managedFields").cloned();
        new["metadata"] = old["metadata"].clone();
        if let (Managed::Set, Some(fields)) = (&managed, applied) {
            meta(&mut new).insert("managedFields".to_owned(), fields);
        }
    }
    let old_meta = old["metadata"].as_object().cloned().unwrap_or_default();
    let m = meta(&mut new);
    // An apply's managedFields are its own; an update's are recorded below.
    let update = matches!(managed, Managed::Update(_));
    let carried = SERVER_METADATA
        .iter()
        .chain(update.then_some(&"managedFields"));
    for server in carried {
        match old_meta.get(*server) {
            Some(v) => m.insert((*server).to_owned(), v.clone()),
            None => m.remove(*server),
        };
    }
    new["apiVersion"] = json!(r.api_version());
    new["kind"] = json!(r.kind);
    let mut causes = Vec::new();
    validate::metadata(&new, &mut causes);
    validate::content(r, &new, &mut causes);
    validate::update(r, old, &new, &mut causes);
    if old_meta.contains_key("deletionTimestamp") {
        let before = old["metadata"]["finalizers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let added = new["metadata"]["finalizers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| !before.contains(f));
        if added {
            causes.push(Cause::forbidden(
                "metadata.finalizers",
                "no new finalizers can be added if the object is being deleted",
            ));
        }
    }
    invalid_if(r, &name, causes)?;
    if r.generation && spec_of(old) != spec_of(&new) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
        meta(&mut new).insert("generation".to_owned(), json!(generation));
    }
    if let Managed::Update(manager) = managed {
        let api_version = r.api_version();
        apply::record_update(
            &writer(r, &api_version, scope, manager, now),
            Some(old),
            &mut new,
        );
    }
    if new == *old || dry {
        return Ok(new);
    }
    let finalized = new["metadata"].get("deletionTimestamp").is_some()
        && new["metadata"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty);
    let key = key(r, &ns, &name);
    let stored = store_write(state, store, key.clone(), new);
    if finalized && let Some(gone) = store_remove(state, store, &key) {
        return Ok(gone);
    }
    Ok(stored)
}

/// The object without metadata and status: what `generation` counts.
fn spec_of(object: &Value) -> Value {
    let mut out = object.clone();
    if let Some(m) = out.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    out
}

/// `old` with `new`'s part as `scope` writes it.
fn scoped_write(r: &Resource, scope: Scope, old: &Value, new: Value) -> Value {
    // The part the write leaves as stored, and where it comes from.
    let (mut out, kept_from) = match scope {
        Scope::Status => (old.clone(), new),
        Scope::Main { .. } if r.status.is_some() => (new, old.clone()),
        Scope::Main { .. } => return new,
    };
    if let Some(m) = out.as_object_mut() {
        match kept_from.get("status") {
            Some(status) => m.insert("status".to_owned(), status.clone()),
            None => m.remove("status"),
        };
    }
    out
}

/// `PUT` of an object or its status.
pub(crate) fn update(
    state: &State,
    target: &Target,
    params: &Params,
    user_agent: &str,
    mut body: Value,
) -> Result<Response> {
    let r = target.resource;
    let name = target.name.clone().unwrap_or_default();
    let dry = dry_run(params, None)?;
    let manager = manager(params, user_agent)?;
    check_named(r, target, &name, &mut body)?;
    let mut store = state.store();
    let (_, found) = current(&store, target);
    let old = found.ok_or_else(|| ApiError::not_found(r, &name))?;
    check_resource_version(r, &name, &body, &old)?;
    finish_update(state, &mut store, target, &manager, dry, &old, body)
}

/// The end of a `PUT` or of a patch that is no apply: `body` written over
/// `old` in the part `target` names, as `manager`'s `Update`; answers 200.
pub(super) fn finish_update(
    state: &State,
    store: &mut Store,
    target: &Target,
    manager: &str,
    dry: bool,
    old: &Value,
    body: Value,
) -> Result<Response> {
    let r = target.resource;
    let scope = scope(r, target.status);
    let new = scoped_write(r, scope, old, body);
    let now = now();
    let change = Change {
        r,
        managed: Managed::Update(manager),
        scope,
        dry,
        now: &now,
    };
    let stored = save_update(state, store, change, old, new)?;
    Ok(json_response(&stored, StatusCode::OK))
}
