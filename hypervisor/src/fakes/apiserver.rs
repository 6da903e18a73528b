//! An in-process Kubernetes API server for tests: JSON objects in memory,
//! one resourceVersion counter, and what kube-rs clients use of the real
//! one for any resource path (`/api/v1/...`, `/apis/<group>/<version>/...`):
//! list and watch (`resourceVersion`, `fieldSelector`, `labelSelector`,
//! `timeoutSeconds`), get, create, update (`PUT`, optimistic concurrency on
//! `metadata.resourceVersion`), patch (merge, strategic merge and apply
//! patches, all applied as JSON merge patches), delete, and the `status`
//! subresource. Errors are `Status` objects, as kube-rs expects.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use poem::http::{Method, StatusCode};
use poem::{Request, Response, Route};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::selector::Selector;

/// Where an object lives: resource plural, namespace ("" when cluster-scoped), name.
pub type Key = (String, String, String);

/// One change, as watchers see it.
#[derive(Debug, Clone)]
pub struct Change {
    pub rv: u64,
    pub resource: String,
    pub namespace: String,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub kind: &'static str,
    pub object: Value,
}

#[derive(Default)]
pub(crate) struct Store {
    /// Differs between servers and processes, so the UIDs (and the pod
    /// regions named after them) of parallel tests never meet.
    uid_prefix: String,
    rv: u64,
    next_uid: u64,
    objects: BTreeMap<Key, Value>,
    pub(crate) log: Vec<Change>,
}

pub(crate) struct State {
    store: Mutex<Store>,
    pub(crate) changes: broadcast::Sender<Change>,
}

impl State {
    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The server; stops when dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    state: Arc<State>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl FakeApiServer {
    /// Serves on an ephemeral loopback port, on the current tokio runtime.
    pub async fn start() -> std::io::Result<Self> {
        let (changes, _) = broadcast::channel(4096);
        let state = Arc::new(State {
            store: Mutex::new(Store {
                uid_prefix: uid_prefix(),
                ..Store::default()
            }),
            changes,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let acceptor = poem::listener::TcpAcceptor::from_tokio(listener)?;
        let served = Arc::clone(&state);
        let app = Route::new().at(
            "/*path",
            poem::endpoint::make(move |req: Request| {
                let state = Arc::clone(&served);
                async move { handle(state, req).await }
            }),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            let _ = poem::Server::new_with_acceptor(acceptor)
                .run_with_graceful_shutdown(
                    app,
                    shutdown,
                    Some(std::time::Duration::from_millis(200)),
                )
                .await;
        });
        Ok(Self {
            addr,
            state,
            stop: Some(stop),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig naming this server (no credentials).
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// The object at `key`, if any.
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        self.state.store().objects.get(&key).cloned()
    }

    /// Every object of `resource`, by namespace and name.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        self.state
            .store()
            .objects
            .iter()
            .filter(|((r, _, _), _)| r == resource)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Stores `object` (created or replaced) as a client's write would.
    pub fn put(&self, resource: &str, object: Value) -> Value {
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let key = (resource.to_owned(), namespace, name);
        let mut store = self.state.store();
        let kind = if store.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        commit(&self.state, &mut store, key, object, kind)
    }

    /// Removes an object as a client's delete would; returns it.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        let mut store = self.state.store();
        remove(&self.state, &mut store, &key)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A request path: resource, namespace, name, subresource, and the list's apiVersion.
#[derive(Debug)]
struct Target {
    api_version: String,
    resource: String,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api_version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ((*version).to_owned(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, resource, tail @ ..] => (Some((*ns).to_owned()), {
            let mut v = vec![*resource];
            v.extend_from_slice(tail);
            v
        }),
        other => (None, other.to_vec()),
    };
    let target = Target {
        api_version,
        resource: (*rest.first()?).to_owned(),
        namespace,
        name: rest.get(1).map(|s| (*s).to_owned()),
        subresource: rest.get(2).map(|s| (*s).to_owned()),
    };
    (rest.len() <= 3).then_some(target)
}

fn list_kind(resource: &str) -> &'static str {
    match resource {
        "pods" => "PodList",
        "nodes" => "NodeList",
        "namespaces" => "NamespaceList",
        "events" => "EventList",
        "resourceclaims" => "ResourceClaimList",
        "resourceclaimtemplates" => "ResourceClaimTemplateList",
        "resourceslices" => "ResourceSliceList",
        "deviceclasses" => "DeviceClassList",
        _ => "List",
    }
}

pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    Response::builder()
        .status(code)
        .content_type("application/json")
        .body(
            json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": message, "reason": reason,
                "code": code.as_u16(),
            })
            .to_string(),
        )
}

fn ok(value: &Value, code: StatusCode) -> Response {
    Response::builder()
        .status(code)
        .content_type("application/json")
        .body(value.to_string())
}

pub(crate) struct Query {
    pub fields: Selector,
    pub labels: Selector,
    pub watch: bool,
    pub resource_version: Option<u64>,
    pub timeout: Option<std::time::Duration>,
}

fn query(req: &Request) -> Result<Query, Box<Response>> {
    let params: BTreeMap<String, String> = req.params().unwrap_or_default();
    let bad = |what: &str| Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", what));
    let fields = Selector::parse(params.get("fieldSelector").map_or("", String::as_str))
        .ok_or_else(|| bad("malformed fieldSelector"))?;
    let labels = Selector::parse(params.get("labelSelector").map_or("", String::as_str))
        .ok_or_else(|| bad("malformed labelSelector"))?;
    let resource_version = match params.get("resourceVersion").map(String::as_str) {
        None | Some("") => None,
        Some(text) => Some(text.parse().map_err(|_| bad("malformed resourceVersion"))?),
    };
    Ok(Query {
        fields,
        labels,
        watch: matches!(params.get("watch").map(String::as_str), Some("true" | "1")),
        resource_version,
        timeout: params
            .get("timeoutSeconds")
            .and_then(|s| s.parse().ok())
            .map(std::time::Duration::from_secs),
    })
}

pub(crate) fn selected(q: &Query, namespace: Option<&str>, ns_of: &str, object: &Value) -> bool {
    namespace.is_none_or(|ns| ns == ns_of)
        && q.fields.matches_fields(object)
        && q.labels.matches_labels(object)
}

async fn handle(state: Arc<State>, mut req: Request) -> Response {
    let Some(target) = parse_path(req.uri().path()) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "no such path");
    };
    let q = match query(&req) {
        Ok(q) => q,
        Err(response) => return *response,
    };
    let body = match req.method() {
        &Method::POST | &Method::PUT | &Method::PATCH => {
            let bytes = req.take_body().into_vec().await.unwrap_or_default();
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(body) => Some(body),
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
            }
        }
        _ => None,
    };
    let content_type = req.content_type().unwrap_or_default().to_owned();
    let ns = target.namespace.clone().unwrap_or_default();
    let key = |name: &str| (target.resource.clone(), ns.clone(), name.to_owned());
    match (req.method().clone(), target.name.clone()) {
        (Method::GET, None) if q.watch => super::apiserver_watch::watch(
            &state,
            target.resource.clone(),
            target.namespace.clone(),
            q,
        ),
        (Method::GET, None) => {
            let store = state.store();
            let items: Vec<Value> = store
                .objects
                .iter()
                .filter(|((r, n, _), v)| {
                    *r == target.resource && selected(&q, target.namespace.as_deref(), n, v)
                })
                .map(|(_, v)| v.clone())
                .collect();
            ok(
                &json!({
                    "apiVersion": target.api_version, "kind": list_kind(&target.resource),
                    "metadata": {"resourceVersion": store.rv.to_string()}, "items": items,
                }),
                StatusCode::OK,
            )
        }
        (Method::GET, Some(name)) => match state.store().objects.get(&key(&name)) {
            Some(object) => ok(object, StatusCode::OK),
            None => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{} {name:?} not found", target.resource),
            ),
        },
        (Method::POST, None) => {
            let mut object = body.unwrap_or_default();
            let name = match object.pointer("/metadata/name").and_then(Value::as_str) {
                Some(name) => name.to_owned(),
                None => {
                    let Some(prefix) = object
                        .pointer("/metadata/generateName")
                        .and_then(Value::as_str)
                    else {
                        return status(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "Invalid",
                            "metadata.name is required",
                        );
                    };
                    let n = state.store().next_uid + 1;
                    format!("{prefix}{n:05x}")
                }
            };
            object["metadata"]["name"] = json!(name);
            if target.namespace.is_some() {
                object["metadata"]["namespace"] = json!(ns);
            }
            let mut store = state.store();
            if store.objects.contains_key(&key(&name)) {
                return status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("{name:?} already exists"),
                );
            }
            let stored = commit(&state, &mut store, key(&name), object, "ADDED");
            ok(&stored, StatusCode::CREATED)
        }
        (Method::PUT, Some(name)) => {
            let mut store = state.store();
            let Some(current) = store.objects.get(&key(&name)).cloned() else {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name:?} not found"),
                );
            };
            let mut object = body.unwrap_or_default();
            let asked = object
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str);
            let have = current
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str);
            if asked.is_some_and(|a| Some(a) != have) {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "the object has been modified",
                );
            }
            if target.subresource.as_deref() == Some("status") {
                let mut merged = current.clone();
                merged["status"] = object.get("status").cloned().unwrap_or(Value::Null);
                object = merged;
            } else if let Some(old) = current.get("status") {
                object["status"] = old.clone();
            }
            object["metadata"]["uid"] = current["metadata"]["uid"].clone();
            object["metadata"]["creationTimestamp"] =
                current["metadata"]["creationTimestamp"].clone();
            let stored = commit(&state, &mut store, key(&name), object, "MODIFIED");
            ok(&stored, StatusCode::OK)
        }
        (Method::PATCH, Some(name)) => {
            if content_type.starts_with("application/json-patch") {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "JSON patch is not served",
                );
            }
            let mut store = state.store();
            let existing = store.objects.get(&key(&name)).cloned();
            let apply = content_type.starts_with("application/apply-patch");
            let mut object = match existing {
                Some(object) => object,
                None if apply => json!({"metadata": {"name": name}}),
                None => {
                    return status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{name:?} not found"),
                    );
                }
            };
            merge(&mut object, &body.unwrap_or_default());
            if target.namespace.is_some() {
                object["metadata"]["namespace"] = json!(ns);
            }
            let kind = if store.objects.contains_key(&key(&name)) {
                "MODIFIED"
            } else {
                "ADDED"
            };
            let stored = commit(&state, &mut store, key(&name), object, kind);
            ok(&stored, StatusCode::OK)
        }
        (Method::DELETE, Some(name)) => {
            let mut store = state.store();
            match remove(&state, &mut store, &key(&name)) {
                Some(object) => ok(&object, StatusCode::OK),
                None => status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("{name:?} not found"),
                ),
            }
        }
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "not served",
        ),
    }
}

/// `pppppppp-ssss-4000`: the process id and a count of servers.
fn uid_prefix() -> String {
    static SERVERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = SERVERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0xffff;
    format!("{:08x}-{n:04x}-4000", std::process::id())
}

/// RFC 7386 merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn commit(
    state: &State,
    store: &mut Store,
    key: Key,
    mut object: Value,
    kind: &'static str,
) -> Value {
    store.rv += 1;
    if object
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .is_none()
    {
        store.next_uid += 1;
        let n = store.next_uid;
        object["metadata"]["uid"] = json!(format!("{}-8000-{n:012x}", store.uid_prefix));
        object["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    }
    object["metadata"]["resourceVersion"] = json!(store.rv.to_string());
    store.objects.insert(key.clone(), object.clone());
    record(state, store, key, object.clone(), kind);
    object
}

fn remove(state: &State, store: &mut Store, key: &Key) -> Option<Value> {
    let mut object = store.objects.remove(key)?;
    store.rv += 1;
    object["metadata"]["resourceVersion"] = json!(store.rv.to_string());
    record(state, store, key.clone(), object.clone(), "DELETED");
    Some(object)
}

fn record(state: &State, store: &mut Store, key: Key, object: Value, kind: &'static str) {
    let change = Change {
        rv: store.rv,
        resource: key.0,
        namespace: key.1,
        kind,
        object,
    };
    store.log.push(change.clone());
    // No watcher is listening: nothing to do.
    let _ = state.changes.send(change);
}
