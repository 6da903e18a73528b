//! Creates: `POST` to a collection (and an apply that finds no object),
//! the namespaces every cluster starts with, and the test's direct `put`.

use std::hash::BuildHasher;

use poem::Response;
use poem::http::StatusCode;
use serde_json::{Value, json};

use super::super::resources::{InitialStatus, Resource, by_plural};
use super::super::status::{ApiError, Result, json_response};
use super::super::store::Store;
use super::super::{Params, State, Target, apply, validate};
use super::{
    check_namespace, check_type, dry_run, invalid_if, key, manager, meta, namespace_and_name,
    namespaces, now, scope, store_write, str_at, writer,
};

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

/// An object to create, checked and filled; its managedFields recorded as
/// `manager`'s, or kept when `None` (an apply set them).
pub(super) fn prepare_create(
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
    if let (Some(initial), Some(fields)) = (r.status, object.as_object_mut()) {
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
        let api_version = r.api_version();
        let writer = writer(r, &api_version, scope(r, false), manager, now);
        apply::record_update(&writer, None, &mut object);
    }
    Ok(object)
}

/// Stores a prepared object (unless a dry run); the object as stored.
pub(super) fn commit_create(
    state: &State,
    store: &mut Store,
    r: &Resource,
    object: Value,
    dry: bool,
) -> Value {
    if dry {
        return object;
    }
    let (ns, name) = namespace_and_name(&object);
    store_write(state, store, key(r, &ns, &name), object)
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

/// [`FakeApiServer::put`](super::super::FakeApiServer::put).
pub(crate) fn put(state: &State, resource: &str, mut object: Value) -> Value {
    let mut store = state.store();
    if let Some(r) = by_plural(resource) {
        object["apiVersion"] = json!(r.api_version());
        object["kind"] = json!(r.kind);
    }
    let (ns, name) = namespace_and_name(&object);
    if str_at(&object, "/metadata/uid").is_none() {
        let uid = store.uid();
        let m = meta(&mut object);
        m.insert("uid".to_owned(), json!(uid));
        m.insert("creationTimestamp".to_owned(), json!(now()));
    }
    store_write(state, &mut store, (resource.to_owned(), ns, name), object)
}
