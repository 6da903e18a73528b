//! The API's routes as data: [`ROUTES`], one entry per method and path,
//! naming who may call it, the CLI command that calls it and its handler.
//! The router is built from it ([`router`]); the fuzz test, the route
//! list in `docs/hypervisor.md` and the CLI are checked against it.

use futures::future::BoxFuture;
use poem::RouteMethod;
use poem::http::Method;

use super::*;

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// A pod's bearer token; a worker id in the body or path must be one of
    /// that pod's.
    Pod,
    /// The admin token, checked by the router before the handler runs; 403
    /// while the config sets none.
    Admin,
    /// Whoever reaches the listener: anyone on a TCP address; on the pods'
    /// socket the token decides what the answer holds.
    Listener,
    /// Anyone, on every listener.
    Anyone,
}

impl Caller {
    /// How the docs' route list names the caller.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pod => "pod token",
            Self::Admin => "admin token",
            Self::Listener => "by listener",
            Self::Anyone => "anyone",
        }
    }
}

/// A handler: the hypervisor, the request and the listener's audience.
type Handler = fn(Hypervisor, Request, Audience) -> BoxFuture<'static, Response>;

/// What answers a route.
#[derive(Clone, Copy)]
enum Serve {
    /// A handler of this crate.
    Handler(Handler),
    /// The command channel's hub (`http-bidir-comm`), nested at [`CHANNEL`].
    Channel,
}

/// Where the command channel's routes are nested.
const CHANNEL: &str = "/api/v1/channel";

/// One route of the API.
pub struct ApiRoute {
    /// Its method.
    pub method: Method,
    /// Its path; a `{name}` segment is a parameter.
    pub path: &'static str,
    /// Who may call it.
    pub caller: Caller,
    /// Also served on the metrics listener (`--metrics-listen`), which may
    /// face the cluster's network.
    pub probe: bool,
    /// The `hypervisor` command that calls it, its arguments written as the
    /// path's parameters (`swap out {id}`).
    pub cli: Option<&'static str>,
    /// What it does, in one line.
    pub summary: &'static str,
    serve: Serve,
}

impl ApiRoute {
    const fn new(
        method: Method,
        path: &'static str,
        caller: Caller,
        summary: &'static str,
        handler: Handler,
    ) -> Self {
        Self {
            method,
            path,
            caller,
            probe: false,
            cli: None,
            summary,
            serve: Serve::Handler(handler),
        }
    }

    /// A route of the command channel, which a pod's workers call.
    const fn channel(method: Method, path: &'static str, summary: &'static str) -> Self {
        Self {
            method,
            path,
            caller: Caller::Pod,
            probe: false,
            cli: None,
            summary,
            serve: Serve::Channel,
        }
    }

    const fn cli(mut self, cli: &'static str) -> Self {
        self.cli = Some(cli);
        self
    }

    const fn probe(mut self) -> Self {
        self.probe = true;
        self
    }

    /// The route the CLI command `command` calls: its words before the
    /// arguments (`swap out`, `status`).
    pub fn of_command(command: &str) -> Option<&'static Self> {
        ROUTES.iter().find(|route| {
            route.cli.is_some_and(|cli| {
                let words = cli.split(' ').take_while(|w| !w.starts_with(['{', '-']));
                words.eq(command.split(' '))
            })
        })
    }

    /// The path with each `{name}` replaced by its value in `params`.
    pub fn path_with(&self, params: &[(&str, &str)]) -> String {
        params
            .iter()
            .fold(self.path.to_owned(), |path, (name, value)| {
                path.replace(&format!("{{{name}}}"), value)
            })
    }
}

use Caller::{Admin, Anyone, Listener, Pod};

/// Every route of the API.
#[rustfmt::skip]
pub static ROUTES: &[ApiRoute] = &[
    ApiRoute::new(Method::POST, "/api/v1/workers", Pod, "a process of the pod registers: `Register` → `Registered`",
        |hv, req, _| Box::pin(async move { register(&hv, req).await })),
    ApiRoute::new(Method::POST, "/api/v1/admission", Pod, "budget for a GPU the scheduler counts: `BudgetRequest` → `BudgetGrant`",
        |hv, req, _| Box::pin(async move { admission(&hv, req).await })),
    ApiRoute::channel(Method::POST, "/api/v1/channel/clients/{worker}/hello", "a worker opens its command channel"),
    ApiRoute::channel(Method::GET, "/api/v1/channel/clients/{worker}/tasks", "a worker's long poll for its commands"),
    ApiRoute::channel(Method::POST, "/api/v1/channel/clients/{worker}/results", "a worker's answer to a command"),
    ApiRoute::new(Method::POST, "/api/v1/swap-in", Pod, "a trapped call of a swapped pod: `SwapInRequest` → `SwapAnswer`",
        |hv, req, _| Box::pin(async move { swap::worker_swap_in(&hv, req).await })),
    ApiRoute::new(Method::POST, "/api/v1/room", Pod, "room on a GPU for an allocation: `RoomRequest` → `RoomAnswer`",
        |hv, req, _| Box::pin(async move { swap::worker_room(&hv, req).await })),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/suspend", Admin, "the pod suspended, `Suspend` to its workers",
        |hv, req, _| Box::pin(async move { suspend(&hv, &req, true) })),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/resume", Admin, "the pod resumed, `Resume` to its workers",
        |hv, req, _| Box::pin(async move { suspend(&hv, &req, false) })),
    ApiRoute::new(Method::PUT, "/api/v1/pods/{id}/limits", Admin, "the pod's GPU limits until the next reload",
        |hv, req, _| Box::pin(async move { limits(&hv, req).await })),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/health", Admin, "`Health` to the pod's workers",
        |hv, req, _| Box::pin(async move { health(&hv, &req) })),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/swap-out", Admin, "the pod's device memory to host memory",
        |hv, req, _| Box::pin(async move { swap::operator(&hv, &req, true).await }))
        .cli("swap out {id}"),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/swap-in", Admin, "the pod's device memory back from host memory",
        |hv, req, _| Box::pin(async move { swap::operator(&hv, &req, false).await }))
        .cli("swap in {id}"),
    ApiRoute::new(Method::POST, "/api/v1/pods/{id}/move", Admin, "the pod moved to another GPU of the node",
        |hv, req, _| Box::pin(async move { swap::operator_move(&hv, req).await }))
        .cli("move {id} --to {gpu}"),
    ApiRoute::new(Method::POST, "/api/v1/gpus/{gpu}/drain", Admin, "every pod of the GPU moved off it, or swapped out",
        |hv, req, _| Box::pin(async move { swap::operator_drain(&hv, &req).await }))
        .cli("drain {gpu}"),
    ApiRoute::new(Method::POST, "/api/v1/reload", Admin, "the config file read again",
        |hv, _, _| Box::pin(async move { reload(&hv) })),
    ApiRoute::new(Method::GET, "/api/v1/status", Listener, "pods, GPUs and workers as JSON",
        |hv, req, audience| Box::pin(async move { status(&hv, &req, audience) }))
        .cli("status"),
    ApiRoute::new(Method::GET, "/metrics", Listener, "the status as Prometheus text",
        |hv, req, audience| Box::pin(async move { metrics(&hv, &req, audience) }))
        .probe(),
    ApiRoute::new(Method::GET, "/healthz", Anyone, "`ok`: the process answers",
        |_, _, _| Box::pin(async { Response::builder().body("ok") }))
        .probe(),
    ApiRoute::new(Method::GET, "/readyz", Anyone, "200 once nothing is pending; 503 naming what is",
        |hv, _, _| Box::pin(async move { readyz(&hv) }))
        .probe(),
];

/// The routes [`ROUTES`] gives `audience`, each path with its methods; the
/// admin token checked before every [`Caller::Admin`] handler; 404, 405 and
/// anything else poem refuses by itself answered in the API's JSON.
pub(crate) fn router(
    hv: &Hypervisor,
    audience: Audience,
) -> impl Endpoint<Output = Response> + 'static {
    let served = ROUTES
        .iter()
        .filter(|route| audience != Audience::Metrics || route.probe);
    let mut router = Route::new();
    if served
        .clone()
        .any(|route| matches!(route.serve, Serve::Channel))
    {
        router = router.nest(CHANNEL, hv.shared.hub.route());
    }
    let handled: Vec<(&ApiRoute, Handler)> = served
        .filter_map(|route| match route.serve {
            Serve::Handler(handler) => Some((route, handler)),
            Serve::Channel => None,
        })
        .collect();
    let mut paths: Vec<&str> = handled.iter().map(|(route, _)| route.path).collect();
    paths.sort_unstable();
    paths.dedup();
    for path in paths {
        let methods = handled.iter().filter(|(route, _)| route.path == path).fold(
            RouteMethod::new(),
            |methods, &(route, handler)| {
                let endpoint = endpoint(hv, handler, route.caller, audience);
                methods.method(route.method.clone(), endpoint)
            },
        );
        router = router.at(path.replace('{', ":").replace('}', ""), methods);
    }
    router
        .with(CatchPanic::new())
        .catch_all_error(|error: poem::Error| async move {
            json_error(error.status(), &error.to_string())
        })
}

/// An endpoint running `handler`, for a caller of `caller` on a listener
/// of `audience`.
fn endpoint(
    hv: &Hypervisor,
    handler: Handler,
    caller: Caller,
    audience: Audience,
) -> impl Endpoint<Output = Response> + 'static {
    let hv = hv.clone();
    make(move |req| {
        let hv = hv.clone();
        async move {
            if caller == Caller::Admin
                && let Err(refusal) = admin(&hv, &req)
            {
                return refusal.into_response();
            }
            handler(hv, req, audience).await
        }
    })
}
