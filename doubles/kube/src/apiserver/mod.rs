//! An in-process Kubernetes API server for tests: JSON objects in memory
//! and what real clients (kube-rs, `kubectl`, the Python client) use of
//! the real one, on plain HTTP on loopback.
//!
//! 1. **Discovery** ([`resources`]): `/version`, `/api`, `/api/v1`, `/apis`,
//!    `/apis/<group>[/<version>]` for the served resources (core namespaces,
//!    nodes, pods, config maps, secrets, services, service accounts,
//!    events; apps deployments and daemon sets; `resource.k8s.io/v1` device
//!    classes, resource claims, claim templates and slices), and an OpenAPI
//!    v3 index without schemas.
//! 2. **Reads** ([`read`], [`watch`]): get; list with `resourceVersion`
//!    (`resourceVersionMatch=Exact` reads history), `limit`/`continue`
//!    (a consistent snapshot; 410 once compacted), label and field
//!    selectors checked as the server checks them (400); watch by
//!    `?watch=true` or a `/watch/` path, starting with ADDED for the current
//!    objects when no resourceVersion is given, or resuming after one;
//!    `sendInitialEvents`; BOOKMARKs when asked; a resourceVersion older
//!    than the compacted history gets an ERROR event (410) and the end of
//!    the watch; an object that stops matching a selector is DELETED.
//! 3. **Writes** ([`write`]): create (name or generateName, validation
//!    ([`validate`]) with 422 and causes), update with resourceVersion
//!    preconditions (409), `/status` kept apart from the main resource,
//!    patches ([`patch`]: merge, JSON, strategic merge), server-side apply
//!    ([`apply`]: managedFields, conflicts, `force`), delete with finalizers
//!    (deletionTimestamp, removed when the last finalizer goes) and
//!    preconditions, `dryRun=All` for all of them.
//! 4. **Failures** ([`status`]) are `Status` objects.
//!
//! Not served: protobuf bodies but those of config maps, secrets,
//! namespaces and service accounts ([`protobuf`]), CBOR, the `scale`
//! subresource, tables (`kubectl get` prints its
//! own NAME/AGE columns), authentication, admission, controllers (nothing
//! garbage-collects owned objects or finishes a pod's graceful deletion: a
//! pod is removed at once, unless finalizers hold it), field validation
//! against schemas (`fieldValidation` is accepted and unknown fields kept),
//! managedFields written by clients (the server keeps its own).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use poem::http::{Method, StatusCode};
use poem::{Request, Response, Route};
use serde_json::Value;
use tokio::sync::broadcast;

mod apply;
mod dra_rules;
mod patch;
mod protobuf;
mod read;
mod resources;
mod schema;
mod status;
mod store;
mod validate;
mod watch;
mod write;

pub use store::{Change, EventType, Key};

use resources::Resource;
use status::{ApiError, json_response};
use store::Store;

/// How the server behaves where tests choose.
#[derive(Debug, Clone)]
pub struct Options {
    /// How often a watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
    /// How many changes history keeps before it compacts its older half.
    pub history_limit: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            bookmark_interval: Duration::from_secs(1),
            history_limit: 10_000,
        }
    }
}

pub(crate) struct State {
    store: Mutex<Store>,
    pub(crate) changes: broadcast::Sender<Change>,
    /// The resources (plural) whose watch events are held back, as a slow
    /// watch cache or network would: tests make a client's cache lag.
    pub(crate) held: tokio::sync::watch::Sender<BTreeSet<String>>,
    pub(crate) options: Options,
    addr: SocketAddr,
}

impl State {
    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the watchers; called with the store locked, so a watch that
    /// subscribes under the same lock misses nothing and sees nothing twice.
    pub(crate) fn publish(&self, change: Change) {
        // No watcher is listening: nothing to do.
        let _ = self.changes.send(change);
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
        Self::start_with(Options::default()).await
    }

    /// [`start`](Self::start) with `options`.
    pub async fn start_with(options: Options) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (changes, _) = broadcast::channel(4096);
        let state = Arc::new(State {
            store: Mutex::new(Store::new(uid_prefix(), options.history_limit)),
            changes,
            held: tokio::sync::watch::Sender::new(BTreeSet::new()),
            options,
            addr,
        });
        write::seed(&state);
        let acceptor = poem::listener::TcpAcceptor::from_tokio(listener)?;
        let served = Arc::clone(&state);
        let app = Route::new()
            .at(
                "/",
                poem::endpoint::make(|_: Request| async { ApiError::path_not_found().response() }),
            )
            .at(
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
                .run_with_graceful_shutdown(app, shutdown, Some(Duration::from_millis(200)))
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

    /// Writes a kubeconfig naming this server (no credentials; namespace
    /// `default`).
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    namespace: default\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// The object at `resource` (plural), `namespace` ("" when
    /// cluster-scoped), `name`, if any.
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        self.state.store().objects.get(&key).cloned()
    }

    /// Every object of `resource`, by namespace and name.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        self.state
            .store()
            .of(resource)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Stores `object` (created or replaced) as a controller with every
    /// right would: no validation, no preconditions; server fields filled.
    pub fn put(&self, resource: &str, object: Value) -> Value {
        write::put(&self.state, resource, object)
    }

    /// Deletes an object as a client's delete would (finalizers hold it,
    /// with a deletionTimestamp); returns its last state.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        write::delete_now(&self.state, resource, namespace, name)
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state.store().rv
    }

    /// Holds back the watch events of `resource` (plural) from every watch
    /// until the returned guard is dropped, when they are sent in order:
    /// a client's watch cache lags the store as on a slow server. Lists and
    /// gets see the store as it is.
    pub fn hold_watch_events(&self, resource: &str) -> WatchHold {
        self.state.held.send_modify(|held| {
            held.insert(resource.to_owned());
        });
        WatchHold {
            state: Arc::clone(&self.state),
            resource: resource.to_owned(),
        }
    }

    /// Compacts history up to now, as etcd's periodic compaction does:
    /// watches and continue tokens from before get 410 Expired.
    pub fn compact(&self) {
        let mut store = self.state.store();
        let rv = store.rv;
        store.compact_through(rv);
    }
}

/// Watch events of one resource held back; sent when this is dropped.
pub struct WatchHold {
    state: Arc<State>,
    resource: String,
}

impl Drop for WatchHold {
    fn drop(&mut self) {
        self.state.held.send_modify(|held| {
            held.remove(&self.resource);
        });
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// `pppppppp-ssss-4000`: the process id and a count of servers.
fn uid_prefix() -> String {
    static SERVERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = SERVERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0xffff;
    format!("{:08x}-{n:04x}-4000", std::process::id())
}

/// A request's query parameters.
#[derive(Debug, Default)]
pub(crate) struct Params(Vec<(String, String)>);

impl Params {
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> {
        self.0
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A boolean parameter (`true`, `1`).
    pub(crate) fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }
}

/// A request on a resource.
#[derive(Debug)]
pub(crate) struct Target {
    pub resource: &'static Resource,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub status: bool,
    /// Asked through a `/watch/` path.
    pub watch: bool,
}

enum Routed {
    Document(Value),
    Text(&'static str),
    Resource(Target),
}

fn route(state: &State, path: &str) -> Result<Routed, ApiError> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let doc = |v: Option<Value>| v.map(Routed::Document).ok_or_else(ApiError::path_not_found);
    match parts.as_slice() {
        ["version"] => Ok(Routed::Document(resources::version())),
        ["healthz" | "livez" | "readyz"] => Ok(Routed::Text("ok")),
        ["api"] => Ok(Routed::Document(resources::core_versions(
            &state.addr.to_string(),
        ))),
        ["apis"] => Ok(Routed::Document(resources::group_list())),
        ["api", "v1"] => doc(resources::resource_list("", "v1")),
        ["apis", group] => doc(resources::group(group)),
        ["apis", group, version] => doc(resources::resource_list(group, version)),
        ["openapi", "v3"] => Ok(Routed::Document(resources::openapi_index())),
        ["openapi", "v3", rest @ ..] => doc(resources::openapi(&rest.join("/"))),
        ["api", "v1", rest @ ..] => target("", "v1", rest).map(Routed::Resource),
        ["apis", group, version, rest @ ..] => target(group, version, rest).map(Routed::Resource),
        _ => Err(ApiError::path_not_found()),
    }
}

fn target(group: &str, version: &str, rest: &[&str]) -> Result<Target, ApiError> {
    let (watch, rest) = match rest {
        ["watch", rest @ ..] => (true, rest),
        _ => (false, rest),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if resources::find(group, version, plural).is_some_and(|r| r.namespaced) =>
        {
            let mut rest = vec![*plural];
            rest.extend_from_slice(tail);
            (Some((*ns).to_owned()), rest)
        }
        other => (None, other.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(*name), None),
        [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
        _ => return Err(ApiError::path_not_found()),
    };
    let resource = resources::find(group, version, plural).ok_or_else(ApiError::path_not_found)?;
    let status = match sub {
        None => false,
        Some("status") if resource.status.is_some() => true,
        Some(_) => return Err(ApiError::path_not_found()),
    };
    if (namespace.is_some() && !resource.namespaced)
        || (resource.namespaced && namespace.is_none() && name.is_some())
        || name.is_some_and(str::is_empty)
        || (watch && status)
    {
        return Err(ApiError::path_not_found());
    }
    Ok(Target {
        resource,
        namespace,
        name: name.map(str::to_owned),
        status,
        watch,
    })
}

/// The request body as JSON (YAML where the content type says so).
async fn body(req: &mut Request, content_type: &str) -> Result<Value, ApiError> {
    let bytes = req
        .take_body()
        .into_vec()
        .await
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let unsupported = |why: String| {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml; got {content_type}: {why}"
            ),
        )
    };
    if content_type.contains("protobuf") {
        return protobuf::decode(&bytes).map_err(unsupported);
    }
    if content_type.contains("cbor") {
        return Err(unsupported("CBOR is not read here".to_owned()));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    if content_type.contains("yaml") {
        let yaml: serde_yaml::Value = serde_yaml::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
        serde_json::to_value(yaml).map_err(|e| ApiError::bad_request(e.to_string()))
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("error decoding JSON: {e}")))
    }
}

async fn handle(state: Arc<State>, mut req: Request) -> Response {
    match serve(&state, &mut req).await {
        Ok(response) => response,
        Err(error) => error.response(),
    }
}

async fn serve(state: &Arc<State>, req: &mut Request) -> Result<Response, ApiError> {
    let target = match route(state, req.uri().path())? {
        Routed::Document(doc) if req.method() == Method::GET => {
            return Ok(json_response(&doc, StatusCode::OK));
        }
        Routed::Text(text) if req.method() == Method::GET => return Ok(Response::from(text)),
        Routed::Document(_) | Routed::Text(_) => {
            return Err(ApiError::new(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            ));
        }
        Routed::Resource(target) => target,
    };
    let params = Params(
        req.params::<Vec<(String, String)>>()
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
    );
    let content_type = req.content_type().unwrap_or_default().to_owned();
    let user_agent = req
        .header("user-agent")
        .unwrap_or_default()
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let method = req.method().clone();
    let watching = target.watch || params.flag("watch");
    match (method, target.name.is_some()) {
        (Method::GET, _) if watching => watch::serve(state, &target, &params),
        (Method::GET, false) => read::list(state, &target, &params),
        (Method::GET, true) => read::get(state, &target),
        (Method::POST, false) if !target.status => {
            let body = body(req, &content_type).await?;
            write::create(state, &target, &params, &user_agent, body)
        }
        (Method::PUT, true) => {
            let body = body(req, &content_type).await?;
            write::update(state, &target, &params, &user_agent, body)
        }
        (Method::PATCH, true) => {
            let body = body(req, &content_type).await?;
            write::patch(state, &target, &params, &user_agent, &content_type, body)
        }
        (Method::DELETE, true) => {
            let body = body(req, &content_type).await?;
            write::delete(state, &target, &params, body)
        }
        (Method::DELETE, false) => write::delete_collection(state, &target, &params),
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )),
    }
}
