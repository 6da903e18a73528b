//! Create, update, patch and delete, as the API server's generic registry
//! does them: server-owned metadata kept (uid, creationTimestamp,
//! generation raised on spec changes), `/status` and the main resource
//! writing only their own part, validation before anything is stored,
//! preconditions, finalizers, managedFields recorded, `dryRun=All`
//! answering without storing.

use std::hash::BuildHasher;

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Map, Value, json};

use super::apply::{self, Scope};
use super::read::Filter;
use super::resources::{self, InitialStatus, Resource};
use super::status::{ApiError, Cause, Result, deleted, json_response};
use super::store::{Key, Store};
use super::{Params, State, Target, patch, validate};

/// Now, as metadata timestamps are written.
fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

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

fn key(r: &Resource, ns: &str, name: &str) -> Key {
    (r.plural.to_owned(), ns.to_owned(), name.to_owned())
}

fn meta(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    object["metadata"]
        .as_object_mut()
        .expect("metadata was made an object")
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

fn str_at<'a>(object: &'a Value, pointer: &str) -> Option<&'a str> {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// Five characters as the server's name generator draws them.
fn suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

fn invalid_if(r: &Resource, name: &str, causes: Vec<Cause>) -> Result<()> {
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(r, name, causes))
    }
}

/// An object to create, checked and filled; `managed` when its
/// managedFields are already set (apply).
fn prepare_create(
    store: &mut Store,
    r: &Resource,
    ns: &str,
    mut object: Value,
    manager: Option<&str>,
    now: &str,
) -> Result<Value> {
    check_type(r, &mut object)?;
    check_namespace(r, ns, &mut object)?;
    if str_at(&object, "/metadata/resourceVersion").is_some() {
        return Err(ApiError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    if str_at(&object, "/metadata/name").is_none()
        && let Some(prefix) = str_at(&object, "/metadata/generateName")
    {
        let prefix: String = prefix.chars().take(58).collect();
        meta(&mut object).insert("name".to_owned(), json!(format!("{prefix}{}", suffix())));
    }
    let m = meta(&mut object);
    for server in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
        "selfLink",
    ] {
        m.remove(server);
    }
    if manager.is_some() {
        m.remove("managedFields");
    }
    if let Some(initial) = r.status {
        let fields = object.as_object_mut().expect("checked to be an object");
        match initial {
            InitialStatus::Keep => {}
            InitialStatus::Clear => {
                fields.remove("status");
            }
            InitialStatus::PodPending => {
                fields.insert("status".to_owned(), json!({"phase": "Pending"}));
            }
            InitialStatus::NamespaceActive => {
                fields.insert("status".to_owned(), json!({"phase": "Active"}));
            }
        }
    }
    let name = str_at(&object, "/metadata/name")
        .unwrap_or_default()
        .to_owned();
    let mut causes = Vec::new();
    validate::create_metadata(r, &object, &mut causes);
    validate::metadata(&object, &mut causes);
    validate::content(r, &object, &mut causes);
    invalid_if(r, &name, causes)?;
    if r.namespaced && !store.objects.contains_key(&key(namespaces(), "", ns)) {
        return Err(ApiError::not_found(namespaces(), ns));
    }
    if store.objects.contains_key(&key(r, ns, &name)) {
        return Err(ApiError::already_exists(r, &name));
    }
    let uid = store.uid();
    let m = meta(&mut object);
    m.insert("uid".to_owned(), json!(uid));
    m.insert("creationTimestamp".to_owned(), json!(now));
    if r.generation {
        m.insert("generation".to_owned(), json!(1));
    }
    if let Some(manager) = manager {
        apply::record_update(
            r.kind,
            &r.api_version(),
            None,
            &mut object,
            scope(r, false),
            manager,
            now,
        );
    }
    Ok(object)
}

fn namespaces() -> &'static Resource {
    resources::by_plural("namespaces").expect("namespaces are served")
}

/// Stores a prepared object (unless a dry run) and answers 201.
fn commit_create(
    state: &State,
    store: &mut Store,
    r: &Resource,
    object: Value,
    dry: bool,
) -> Value {
    if dry {
        return object;
    }
    let ns = str_at(&object, "/metadata/namespace")
        .unwrap_or_default()
        .to_owned();
    let name = str_at(&object, "/metadata/name")
        .unwrap_or_default()
        .to_owned();
    let change = store.write(key(r, &ns, &name), object);
    let stored = change.object.clone();
    state.publish(change);
    stored
}

/// The namespaces every cluster has.
pub(crate) fn seed(state: &State) {
    let mut store = state.store();
    for name in ["default", "kube-system"] {
        let object = json!({"metadata": {"name": name}});
        if let Ok(object) = prepare_create(
            &mut store,
            namespaces(),
            "",
            object,
            Some("kube-apiserver"),
            &now(),
        ) {
            commit_create(state, &mut store, namespaces(), object, false);
        }
    }
}

/// `POST` to a collection.
pub(crate) fn create(
    state: &State,
    target: &Target,
    params: &Params,
    user_agent: &str,
    body: Value,
) -> Result<Response> {
    let r = target.resource;
    let dry = dry_run(params, None)?;
    let manager = manager(params, user_agent)?;
    let ns = target.namespace.clone().unwrap_or_default();
    let mut store = state.store();
    let object = prepare_create(&mut store, r, &ns, body, Some(&manager), &now())?;
    let stored = commit_create(state, &mut store, r, object, dry);
    Ok(json_response(&stored, StatusCode::CREATED))
}

/// How an update's managedFields come about.
enum Managed<'a> {
    /// Recorded as an `Update` by this manager.
    Update(&'a str),
    /// Already set (an apply).
    Set,
}

/// Stores `new` over `old` (unless a dry run): server metadata carried
/// over, validated, generation raised when the spec changed; a deleted
/// object whose last finalizer went is removed. Unchanged objects keep
/// their resourceVersion.
#[allow(clippy::too_many_arguments)]
fn save_update(
    state: &State,
    store: &mut Store,
    r: &Resource,
    old: &Value,
    mut new: Value,
    managed: Managed<'_>,
    scope: Scope,
    dry: bool,
    now: &str,
) -> Result<Value> {
    let ns = str_at(old, "/metadata/namespace")
        .unwrap_or_default()
        .to_owned();
    let name = str_at(old, "/metadata/name").unwrap_or_default().to_owned();
    if scope == Scope::Status {
        let applied = new.pointer("/metadata/managedFields").cloned();
        new["metadata"] = old["metadata"].clone();
        if let (Managed::Set, Some(fields)) = (&managed, applied) {
            meta(&mut new).insert("managedFields".to_owned(), fields);
        }
    }
    let old_meta = old["metadata"].as_object().cloned().unwrap_or_default();
    let m = meta(&mut new);
    for server in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
        "resourceVersion",
        "generateName",
    ] {
        match old_meta.get(server) {
            Some(v) => m.insert(server.to_owned(), v.clone()),
            None => m.remove(server),
        };
    }
    if let Managed::Update(_) = managed {
        match old_meta.get("managedFields") {
            Some(v) => m.insert("managedFields".to_owned(), v.clone()),
            None => m.remove("managedFields"),
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
        apply::record_update(
            r.kind,
            &r.api_version(),
            Some(old),
            &mut new,
            scope,
            manager,
            now,
        );
    }
    if new == *old {
        return Ok(new);
    }
    let finalized = new["metadata"].get("deletionTimestamp").is_some()
        && new["metadata"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty);
    if dry {
        return Ok(new);
    }
    let key = key(r, &ns, &name);
    let change = store.write(key.clone(), new);
    let stored = change.object.clone();
    state.publish(change);
    if finalized && let Some(change) = store.remove(&key) {
        let gone = change.object.clone();
        state.publish(change);
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

fn current(store: &Store, target: &Target) -> (Key, Option<Value>) {
    let key = key(
        target.resource,
        target.namespace.as_deref().unwrap_or_default(),
        target.name.as_deref().unwrap_or_default(),
    );
    let object = store.objects.get(&key).cloned();
    (key, object)
}

/// `old` with `new`'s part as `scope` writes it.
fn scoped_write(r: &Resource, scope: Scope, old: &Value, new: Value) -> Value {
    match scope {
        Scope::Status => {
            let mut out = old.clone();
            match new.get("status") {
                Some(status) => out["status"] = status.clone(),
                None => {
                    if let Some(m) = out.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
            out
        }
        Scope::Main { .. } if r.status.is_some() => {
            let mut out = new;
            if let Some(m) = out.as_object_mut() {
                match old.get("status") {
                    Some(status) => m.insert("status".to_owned(), status.clone()),
                    None => m.remove("status"),
                };
            }
            out
        }
        Scope::Main { .. } => new,
    }
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
    if let Some(theirs) = str_at(&body, "/metadata/resourceVersion")
        && Some(theirs) != str_at(&old, "/metadata/resourceVersion")
    {
        return Err(ApiError::modified(r, &name));
    }
    let scope = scope(r, target.status);
    let new = scoped_write(r, scope, &old, body);
    let stored = save_update(
        state,
        &mut store,
        r,
        &old,
        new,
        Managed::Update(&manager),
        scope,
        dry,
        &now(),
    )?;
    Ok(json_response(&stored, StatusCode::OK))
}

/// The patch types served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PatchType {
    Json,
    Merge,
    Strategic,
    Apply,
}

fn patch_type(content_type: &str) -> Result<PatchType> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    Ok(match media {
        "application/json-patch+json" => PatchType::Json,
        "application/merge-patch+json" => PatchType::Merge,
        "application/strategic-merge-patch+json" => PatchType::Strategic,
        "application/apply-patch+yaml" | "application/apply-patch+json" => PatchType::Apply,
        other => {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json; got {other:?}"
                ),
            ));
        }
    })
}

fn apply_conflict(r: &Resource, name: &str, conflicts: &[apply::Conflict]) -> ApiError {
    let count = conflicts.len();
    let listed = if count == 1 {
        format!(
            "conflict with {:?}: {}",
            conflicts[0].manager, conflicts[0].field
        )
    } else {
        let mut text = "conflicts with".to_owned();
        let mut managers: Vec<&str> = conflicts.iter().map(|c| c.manager.as_str()).collect();
        managers.dedup();
        for manager in managers {
            text.push_str(&format!("\n{manager:?}:"));
            for c in conflicts.iter().filter(|c| c.manager == manager) {
                text.push_str(&format!("\n- {}", c.field));
            }
        }
        text
    };
    let plural = if count == 1 { "" } else { "s" };
    let mut details = json!({"name": name, "kind": r.plural, "causes": conflicts.iter().map(|c| json!({
        "type": "FieldManagerConflict",
        "message": format!("conflict with {:?}", c.manager),
        "field": c.field,
    })).collect::<Vec<_>>()});
    if !r.group.is_empty() {
        details["group"] = json!(r.group);
    }
    ApiError {
        details: Some(details),
        ..ApiError::new(
            409,
            "Conflict",
            format!("Apply failed with {count} conflict{plural}: {listed}"),
        )
    }
}

/// `PATCH` of an object or its status.
pub(crate) fn patch(
    state: &State,
    target: &Target,
    params: &Params,
    user_agent: &str,
    content_type: &str,
    body: Value,
) -> Result<Response> {
    let r = target.resource;
    let name = target.name.clone().unwrap_or_default();
    let kind = patch_type(content_type)?;
    let dry = dry_run(params, None)?;
    let force = params.flag("force");
    if force && kind != PatchType::Apply {
        return Err(ApiError::bad_request(
            "force: Forbidden: may not be specified for non-apply patch",
        ));
    }
    let scope = scope(r, target.status);
    let now = now();
    let mut store = state.store();
    let (_, found) = current(&store, target);
    if kind == PatchType::Apply {
        let Some(manager) = params.get("fieldManager").filter(|m| !m.is_empty()) else {
            return Err(ApiError::bad_request(
                "PATCH requests with apply patch type must have a fieldManager",
            ));
        };
        let mut config = body;
        if !config.is_object() {
            return Err(ApiError::bad_request("an apply patch must be an object"));
        }
        if config.get("apiVersion").is_none() || config.get("kind").is_none() {
            return Err(ApiError::bad_request(
                "apiVersion and kind must be set in an apply configuration",
            ));
        }
        check_named(r, target, &name, &mut config)?;
        let live = match &found {
            Some(object) => object.clone(),
            None if target.status => return Err(ApiError::not_found(r, &name)),
            None => json!({
                "apiVersion": r.api_version(), "kind": r.kind,
                "metadata": {"name": name, "namespace": target.namespace},
            }),
        };
        let merged = apply::apply(
            r.kind,
            &r.api_version(),
            &live,
            &config,
            scope,
            manager,
            force,
            &now,
        )
        .map_err(|c| apply_conflict(r, &name, &c))?;
        return match found {
            None => {
                let ns = target.namespace.clone().unwrap_or_default();
                let object = prepare_create(&mut store, r, &ns, merged, None, &now)?;
                let stored = commit_create(state, &mut store, r, object, dry);
                Ok(json_response(&stored, StatusCode::CREATED))
            }
            Some(old) => {
                let stored = save_update(
                    state,
                    &mut store,
                    r,
                    &old,
                    merged,
                    Managed::Set,
                    scope,
                    dry,
                    &now,
                )?;
                Ok(json_response(&stored, StatusCode::OK))
            }
        };
    }
    let old = found.ok_or_else(|| ApiError::not_found(r, &name))?;
    let refused = |why: String| {
        ApiError::new(
            422,
            "Invalid",
            format!("the server rejected our request due to an error in our request: {why}"),
        )
    };
    let patched = match kind {
        PatchType::Json => patch::json(&old, &body).map_err(refused)?,
        PatchType::Merge => {
            if !body.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            let mut out = old.clone();
            patch::merge(&mut out, &body);
            out
        }
        PatchType::Strategic => patch::strategic(r.kind, &old, &body).map_err(refused)?,
        PatchType::Apply => unreachable!("handled above"),
    };
    if let Some(theirs) = str_at(&patched, "/metadata/resourceVersion")
        && Some(theirs) != str_at(&old, "/metadata/resourceVersion")
    {
        return Err(ApiError::modified(r, &name));
    }
    if let (Some(theirs), Some(ours)) = (
        str_at(&patched, "/metadata/uid"),
        str_at(&old, "/metadata/uid"),
    ) && theirs != ours
    {
        return Err(ApiError::conflict(
            r,
            &name,
            &format!(
                "Precondition failed: UID in precondition: {theirs}, UID in object meta: {ours}"
            ),
        ));
    }
    let manager = manager(params, user_agent)?;
    let new = scoped_write(r, scope, &old, patched);
    let stored = save_update(
        state,
        &mut store,
        r,
        &old,
        new,
        Managed::Update(&manager),
        scope,
        dry,
        &now,
    )?;
    Ok(json_response(&stored, StatusCode::OK))
}

/// What a delete did.
enum Deleted {
    /// Removed: its last state.
    Gone(Value),
    /// Held by finalizers: its state, now with a deletionTimestamp.
    Held(Value),
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
        if old["metadata"].get("deletionTimestamp").is_some() || dry {
            let mut held = old.clone();
            if dry {
                meta(&mut held).insert("deletionTimestamp".to_owned(), json!(now()));
            }
            return Deleted::Held(held);
        }
        let mut held = old.clone();
        let m = meta(&mut held);
        m.insert("deletionTimestamp".to_owned(), json!(now()));
        m.insert("deletionGracePeriodSeconds".to_owned(), json!(0));
        let change = store.write(key.clone(), held);
        let stored = change.object.clone();
        state.publish(change);
        return Deleted::Held(stored);
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
            if let Some(owner) = resources::by_plural(&k.0) {
                delete_key(state, store, owner, &k, &v, false);
            }
        }
    }
    match store.remove(key) {
        Some(change) => {
            let gone = change.object.clone();
            state.publish(change);
            Deleted::Gone(gone)
        }
        None => Deleted::Gone(old.clone()),
    }
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
    if let Some(uid) = str_at(&options, "/preconditions/uid") {
        let ours = str_at(&old, "/metadata/uid").unwrap_or_default();
        if uid != ours {
            return Err(ApiError::conflict(
                r,
                &name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {ours}"
                ),
            ));
        }
    }
    if let Some(rv) = str_at(&options, "/preconditions/resourceVersion") {
        let ours = str_at(&old, "/metadata/resourceVersion").unwrap_or_default();
        if rv != ours {
            return Err(ApiError::conflict(
                r,
                &name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {ours}"
                ),
            ));
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
    let mut items = Vec::new();
    for (key, old) in chosen {
        match delete_key(state, &mut store, r, &key, &old, dry) {
            Deleted::Gone(object) | Deleted::Held(object) => items.push(object),
        }
    }
    let rv = store.rv.to_string();
    Ok(json_response(
        &json!({"apiVersion": r.api_version(), "kind": format!("{}List", r.kind),
            "metadata": {"resourceVersion": rv}, "items": items}),
        StatusCode::OK,
    ))
}

/// [`FakeApiServer::put`](super::FakeApiServer::put).
pub(crate) fn put(state: &State, resource: &str, mut object: Value) -> Value {
    let mut store = state.store();
    if let Some(r) = resources::by_plural(resource) {
        object["apiVersion"] = json!(r.api_version());
        object["kind"] = json!(r.kind);
    }
    let ns = str_at(&object, "/metadata/namespace")
        .unwrap_or_default()
        .to_owned();
    let name = str_at(&object, "/metadata/name")
        .unwrap_or_default()
        .to_owned();
    if str_at(&object, "/metadata/uid").is_none() {
        let uid = store.uid();
        let m = meta(&mut object);
        m.insert("uid".to_owned(), json!(uid));
        m.insert("creationTimestamp".to_owned(), json!(now()));
    }
    let change = store.write((resource.to_owned(), ns, name), object);
    let stored = change.object.clone();
    state.publish(change);
    stored
}

/// [`FakeApiServer::delete`](super::FakeApiServer::delete).
pub(crate) fn delete_now(
    state: &State,
    resource: &str,
    namespace: &str,
    name: &str,
) -> Option<Value> {
    let r = resources::by_plural(resource)?;
    let mut store = state.store();
    let key = key(r, namespace, name);
    let old = store.objects.get(&key).cloned()?;
    Some(match delete_key(state, &mut store, r, &key, &old, false) {
        Deleted::Gone(object) | Deleted::Held(object) => object,
    })
}
