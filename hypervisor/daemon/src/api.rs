//! The HTTP API. Every error body is `{"error": "..."}`; statuses: 400
//! malformed request, 401 bad or missing token, 403 admin API disabled, 404
//! unknown route, pod or GPU, 405 wrong method, 413 body over 64 KiB, 429 too
//! many workers.
//!
//! Workers (bearer token of their pod):
//! - `POST /api/v1/workers` `Register` → `Registered`.
//! - `POST /api/v1/admission` `BudgetRequest` (its own worker id) → `BudgetGrant`.
//! - `POST /api/v1/swap-in` `SwapInRequest`, `POST /api/v1/room`
//!   `RoomRequest` ([`swap`]).
//! - `/api/v1/channel/clients/{worker}/{hello,tasks,results}`: the command
//!   channel (`http-bidir-comm`), only for the worker's own id.
//!
//! Operators (bearer admin token; the admin API is off without one):
//! - `POST /api/v1/pods/{id}/suspend`, `POST /api/v1/pods/{id}/resume`.
//! - `PUT /api/v1/pods/{id}/limits` `{"gpus": [ ... ]}` (the config file's
//!   `[[pods.gpus]]` tables as JSON): until the next reload of the file.
//! - `POST /api/v1/pods/{id}/health`: `Health` to the pod's workers.
//! - `POST /api/v1/pods/{id}/swap-out`, `POST /api/v1/pods/{id}/swap-in`
//!   → `SwapAnswer` ([`swap`]).
//! - `POST /api/v1/reload`: read the config file again.
//!
//! Anyone who reaches a TCP listener (the node: in Kubernetes the daemon's
//! own loopback): `GET /api/v1/status` (JSON), `GET /metrics` (Prometheus),
//! `GET /healthz` (the process answers), `GET /readyz` (200 once nothing is
//! pending, e.g. the Kubernetes agent's start; 503 naming what is). The
//! metrics listener ([`metrics_routes`]) serves only these last three: it may
//! face the cluster, the rest only the node.
//!
//! On the Unix socket, which is mounted into the pods ([`Audience::Pods`]),
//! the status names other pods only for the admin token: a pod's token gets
//! its own pod alone (its GPUs' usage, workers and processes), no token a
//! 401; `/metrics` needs the admin token.

use std::future::Future;
use std::time::{Duration, Instant};

use gpushare_utils::bucket::{CAPACITY_NS, PPM, REFILL_BATCH_NS, monotonic_ns};
use gpushare_utils::ledger::MAX_DEVICES;
use gpushare_utils::pod::PodId;
use gpushare_utils::protocol::{
    BudgetGrant, BudgetRequest, MAX_HOSTNAME_LEN, MAX_UUID_LEN, Register, Registered,
};
use http_bidir_comm::ClientId;
use http_bidir_comm::server::read_body;
use http_bidir_comm::server::{Refusal, bearer, json_error, json_response, malformed};
use poem::endpoint::make;
use poem::http::StatusCode;
use poem::middleware::CatchPanic;
use poem::{Endpoint, EndpointExt, Request, Response, Route, get, post, put};
use serde::Serialize;
use serde_json::json;

use crate::{AuthError, Hypervisor};

mod swap;
use hypervisor_config::{self as config, LimitsBody};
use hypervisor_core::scheduler::{AdmissionTarget, ScheduleError};

/// Largest accepted request body.
pub const MAX_BODY: usize = 64 * 1024;
/// Longest an admission request is held for its pod's budget. That budget
/// is the pod's own refill at its rate (the request has rescheduled the
/// GPU first), which the limiter waits for on its bucket anyway: a pod
/// whose refill comes later is answered 0 at once and waits there, as a
/// pod the daemon counts does, and the answer's latency is the daemon's,
/// not the pod's limit.
pub const ADMISSION_WAIT: Duration = Duration::from_millis(1);

/// Who reaches a listener of the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Audience {
    /// The node's operators: a TCP address, the daemon's loopback in
    /// Kubernetes.
    Node,
    /// The pods too: the Unix socket whose folder is mounted into them.
    Pods,
}

pub(crate) fn routes(
    hv: &Hypervisor,
    audience: Audience,
) -> impl Endpoint<Output = Response> + 'static {
    let api = Route::new()
        .at(
            "/workers",
            post(ep(hv, |hv, req| async move { register(&hv, req).await })),
        )
        .at(
            "/admission",
            post(ep(hv, |hv, req| async move { admission(&hv, req).await })),
        )
        .at(
            "/status",
            get(ep(
                hv,
                move |hv, req| async move { status(&hv, &req, audience) },
            )),
        )
        .at(
            "/reload",
            post(ep(hv, |hv, req| async move { reload(&hv, &req) })),
        )
        .at(
            "/pods/:id/suspend",
            post(ep(hv, |hv, req| async move { suspend(&hv, &req, true) })),
        )
        .at(
            "/pods/:id/resume",
            post(ep(hv, |hv, req| async move { suspend(&hv, &req, false) })),
        )
        .at(
            "/pods/:id/health",
            post(ep(hv, |hv, req| async move { health(&hv, &req) })),
        )
        .at(
            "/pods/:id/swap-out",
            post(ep(hv, |hv, req| async move {
                swap::operator(&hv, &req, true).await
            })),
        )
        .at(
            "/pods/:id/swap-in",
            post(ep(hv, |hv, req| async move {
                swap::operator(&hv, &req, false).await
            })),
        )
        .at(
            "/pods/:id/move",
            post(ep(hv, |hv, req| async move {
                swap::operator_move(&hv, req).await
            })),
        )
        .at(
            "/gpus/:gpu/drain",
            post(ep(hv, |hv, req| async move {
                swap::operator_drain(&hv, &req).await
            })),
        )
        .at(
            "/swap-in",
            post(ep(hv, |hv, req| async move {
                swap::worker_swap_in(&hv, req).await
            })),
        )
        .at(
            "/room",
            post(ep(hv, |hv, req| async move {
                swap::worker_room(&hv, req).await
            })),
        )
        .at(
            "/pods/:id/limits",
            put(ep(hv, |hv, req| async move { limits(&hv, req).await })),
        )
        .nest("/channel", hv.shared.hub.route());
    Route::new()
        .nest("/api/v1", api)
        .at(
            "/metrics",
            get(ep(hv, move |hv, req| async move {
                match audience {
                    Audience::Pods => match admin(&hv, &req) {
                        Ok(()) => metrics(&hv),
                        Err(refusal) => refusal.into_response(),
                    },
                    Audience::Node => metrics(&hv),
                }
            })),
        )
        .at("/healthz", get(make(|_| async { "ok" })))
        .at("/readyz", get(ep(hv, |hv, _| async move { readyz(&hv) })))
        .with(CatchPanic::new())
        // Unknown routes (404), wrong methods (405) and anything else poem
        // refuses by itself answer in the same JSON as ours.
        .catch_all_error(|error: poem::Error| async move {
            json_error(error.status(), &error.to_string())
        })
}

/// `/metrics`, `/healthz` and `/readyz` alone: what probes and Prometheus
/// need, on a listener that may face the cluster's network.
pub(crate) fn metrics_routes(hv: &Hypervisor) -> impl Endpoint<Output = Response> + 'static {
    Route::new()
        .at("/metrics", get(ep(hv, |hv, _| async move { metrics(&hv) })))
        .at("/healthz", get(make(|_| async { "ok" })))
        .at("/readyz", get(ep(hv, |hv, _| async move { readyz(&hv) })))
        .with(CatchPanic::new())
        .catch_all_error(|error: poem::Error| async move {
            json_error(error.status(), &error.to_string())
        })
}

fn metrics(hv: &Hypervisor) -> Response {
    Response::builder()
        .content_type("text/plain; version=0.0.4")
        .body({
            let status = hv.status();
            let mut text = crate::metrics::render(&status);
            text.push_str(&crate::metrics::render_health(
                &status.gpus,
                &hv.unhealthy_gpus(),
            ));
            text
        })
}

fn readyz(hv: &Hypervisor) -> Response {
    let waiting = hv.waiting_for();
    if waiting.is_empty() {
        return Response::builder().body("ok");
    }
    json_error(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("not ready: {}", waiting.join(", ")),
    )
}

/// An endpoint running `f` with a handle on the hypervisor.
fn ep<F, Fut>(hv: &Hypervisor, f: F) -> impl Endpoint<Output = Response> + 'static
where
    F: Fn(Hypervisor, Request) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response> + Send + 'static,
{
    let hv = hv.clone();
    make(move |req| f(hv.clone(), req))
}

async fn register(hv: &Hypervisor, mut req: Request) -> Response {
    let Some(token) = bearer(&req).map(str::to_owned) else {
        return unauthorized();
    };
    let reg: Register = match json_body(&mut req).await {
        Ok(reg) => reg,
        Err(refusal) => return refusal,
    };
    let Ok(pod) = PodId::new(reg.pod.clone()) else {
        return unauthorized();
    };
    // A process sees at most this many GPUs; more is abuse, and would be
    // kept for the life of the worker.
    if reg.devices.len() > MAX_DEVICES {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!("at most {MAX_DEVICES} devices per worker"),
        );
    }
    if reg.hostname.len() > MAX_HOSTNAME_LEN {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!("hostname longer than {MAX_HOSTNAME_LEN} bytes"),
        );
    }
    if reg.devices.iter().any(|d| d.uuid.len() > MAX_UUID_LEN) {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!("device UUID longer than {MAX_UUID_LEN} bytes"),
        );
    }
    let host_pid = match screen(hv, &pod, &token, reg.pid).await {
        Ok(host_pid) => host_pid,
        Err(refusal) => return refusal.into_response(),
    };
    let registered = {
        let mut core = hv.core();
        if !core
            .scheduler
            .token(pod.as_str())
            .is_some_and(|t| t.matches(&token))
        {
            return unauthorized();
        }
        if core.workers.count_of_pod(pod.as_str()) >= core.settings.max_workers_per_pod {
            return json_error(
                StatusCode::TOO_MANY_REQUESTS,
                "too many workers for this pod",
            );
        }
        let Some(id) =
            core.workers
                .register(&pod, reg.pid, reg.hostname.clone(), reg.devices.clone())
        else {
            return json_error(StatusCode::BAD_REQUEST, "cannot form a worker id");
        };
        core.workers.set_host_pid(&id, host_pid);
        let devices = core
            .scheduler
            .device_limits(pod.as_str())
            .unwrap_or_default();
        Registered {
            worker_id: id.to_string(),
            pod: pod.to_string(),
            devices,
        }
    };
    if let Ok(id) = ClientId::new(registered.worker_id.clone()) {
        tracing::info!(worker = %id, pod = %pod, pid = reg.pid, "worker registered");
        // A queue on the channel from the start: a worker that never shows up
        // there expires after the TTL.
        hv.send(&[id], &gpushare_utils::protocol::Command::Health);
    }
    json_ok(&registered)
}

async fn admission(hv: &Hypervisor, mut req: Request) -> Response {
    let start = Instant::now();
    let Some(token) = bearer(&req).map(str::to_owned) else {
        return unauthorized();
    };
    let ask: BudgetRequest = match json_body(&mut req).await {
        Ok(ask) => ask,
        Err(refusal) => return refusal,
    };
    let Ok(id) = ClientId::new(ask.worker_id.clone()) else {
        return unauthorized();
    };
    let pod = match hv.authorize_worker(&id, &token) {
        Ok(pod) => pod,
        Err(AuthError::Unauthorized) => return unauthorized(),
        Err(AuthError::TooMany) => {
            return json_error(
                StatusCode::TOO_MANY_REQUESTS,
                "too many workers for this pod",
            );
        }
    };
    let target = hv
        .core()
        .scheduler
        .admission(pod.as_str(), &ask.uuid, Instant::now());
    let Some(target) = target else {
        return json_error(StatusCode::NOT_FOUND, "the pod has no such GPU");
    };
    // The hold counts from here: what came before (the body, the token, the
    // reschedule) is the daemon's own time, which the histogram records.
    let granted = wait_for_budget(hv, &target, Instant::now() + ADMISSION_WAIT).await;
    hv.shared.latency.record(start.elapsed(), granted > 0);
    json_ok(&BudgetGrant {
        granted_ns: granted,
    })
}

/// Waits until the pod's bucket holds budget (refilling it, since the
/// trapped thread is not), or `deadline`; returns the tokens, 0 on
/// timeout. A suspended pod, or one whose deficit refills at its rate only
/// after the deadline, is answered 0 at once: holding the request would
/// end the same way, with the thread blocked here instead of on its bucket.
async fn wait_for_budget(hv: &Hypervisor, target: &AdmissionTarget, deadline: Instant) -> u64 {
    let Some(bucket) = target.region.bucket(&target.uuid) else {
        return 0;
    };
    loop {
        // Registered before looking, so a wake-up in between is not lost.
        let notified = target.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if bucket
            .limits()
            .suspended
            .load(std::sync::atomic::Ordering::Acquire)
            != 0
        {
            return 0;
        }
        let rate = bucket.effective_rate_ppm();
        if rate == 0 {
            return CAPACITY_NS as u64;
        }
        let now_ns = monotonic_ns();
        let tokens = target.region.refill(&target.uuid, now_ns);
        if tokens > 0 {
            return tokens as u64;
        }
        // Time for the deficit to refill at this rate; a refill happens no
        // sooner than a batch after the last one.
        let deficit = tokens.unsigned_abs() + 1;
        let refill_ns = (u128::from(deficit) * u128::from(PPM) / u128::from(rate)) as u64;
        let now = Instant::now();
        if now + Duration::from_nanos(refill_ns) > deadline {
            return 0;
        }
        let last = bucket
            .refilled_at_ns
            .load(std::sync::atomic::Ordering::Acquire);
        let batch_ns = (last + REFILL_BATCH_NS).saturating_sub(now_ns);
        let until = (now + Duration::from_nanos(refill_ns.max(batch_ns))).min(deadline);
        tokio::select! {
            () = hv.shared.timer.sleep_until(until) => {}
            () = notified => {}
        }
    }
}

fn admin(hv: &Hypervisor, req: &Request) -> Result<(), Refusal> {
    let core = hv.core();
    let Some(admin) = &core.admin_token else {
        return Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "admin API disabled: set admin_token in the config",
        ));
    };
    match bearer(req) {
        Some(token) if admin.matches(token) => Ok(()),
        _ => Err(Refusal::unauthorized()),
    }
}

/// The status: all of it for the node, or with the admin token; only the
/// caller's pod for a pod's token on the pods' socket.
fn status(hv: &Hypervisor, req: &Request, audience: Audience) -> Response {
    let status = hv.status();
    if audience == Audience::Node || admin(hv, req).is_ok() {
        return json_ok(&status);
    }
    let Some(token) = bearer(req) else {
        return unauthorized();
    };
    let pod = {
        let core = hv.core();
        core.scheduler
            .pod_ids()
            .into_iter()
            .find(|pod| core.scheduler.token(pod).is_some_and(|t| t.matches(token)))
    };
    match pod {
        Some(pod) => json_ok(&status.of_pod(&pod)),
        None => unauthorized(),
    }
}

fn pod_param(req: &Request) -> Result<String, Refusal> {
    req.raw_path_param("id")
        .and_then(|id| PodId::new(id).ok())
        .map(|id| id.to_string())
        .ok_or_else(|| Refusal::new(StatusCode::NOT_FOUND, "no such pod"))
}

fn suspend(hv: &Hypervisor, req: &Request, suspended: bool) -> Response {
    if let Err(refusal) = admin(hv, req) {
        return refusal.into_response();
    }
    let pod = match pod_param(req) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let result = if suspended {
        hv.suspend(&pod)
    } else {
        hv.resume(&pod)
    };
    match result {
        Ok(ids) => json_ok(&json!({ "pod": pod, "suspended": suspended, "workers": ids })),
        Err(e) => schedule_error(&e),
    }
}

fn health(hv: &Hypervisor, req: &Request) -> Response {
    if let Err(refusal) = admin(hv, req) {
        return refusal.into_response();
    }
    let pod = match pod_param(req) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    match hv.ping(&pod) {
        Ok(ids) => json_ok(&json!({ "pod": pod, "workers": ids })),
        Err(e) => schedule_error(&e),
    }
}

async fn limits(hv: &Hypervisor, mut req: Request) -> Response {
    if let Err(refusal) = admin(hv, &req) {
        return refusal.into_response();
    }
    let pod = match pod_param(&req) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let parsed: LimitsBody = match json_body(&mut req).await {
        Ok(parsed) => parsed,
        Err(refusal) => return refusal,
    };
    let gpus = match config::resolve_gpus(&format!("pod {pod:?}"), &parsed.gpus) {
        Ok(gpus) => gpus,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    match hv.set_limits(&pod, gpus) {
        Ok((devices, ids)) => json_ok(&json!({ "pod": pod, "devices": devices, "workers": ids })),
        Err(e) => schedule_error(&e),
    }
}

fn reload(hv: &Hypervisor, req: &Request) -> Response {
    if let Err(refusal) = admin(hv, req) {
        return refusal.into_response();
    }
    match hv.reload() {
        Ok(report) => json_ok(&json!({
            "added": report.added,
            "changed": report.changed,
            "removed": report.removed,
            "failed": report.failed,
        })),
        Err(e) => json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

/// The JSON body of `req` (at most [`MAX_BODY`] bytes), or the answer
/// refusing it.
async fn json_body<T: serde::de::DeserializeOwned>(req: &mut Request) -> Result<T, Response> {
    let body = read_body(req, MAX_BODY)
        .await
        .map_err(http_bidir_comm::server::Refusal::into_response)?;
    serde_json::from_slice(&body).map_err(|e| malformed(&e))
}

fn schedule_error(e: &ScheduleError) -> Response {
    match e {
        ScheduleError::NoSuchPod(_) => json_error(StatusCode::NOT_FOUND, &e.to_string()),
        ScheduleError::Region { .. } => json_error(StatusCode::CONFLICT, &e.to_string()),
        ScheduleError::Invalid { .. } => json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

fn json_ok<B: Serialize>(body: &B) -> Response {
    json_response(StatusCode::OK, body)
}

fn unauthorized() -> Response {
    Refusal::unauthorized().into_response()
}

/// The refusal of a registration whose process is not in the pod it names,
/// as far as the kernel tells ([`Hypervisor::screen_worker`]); otherwise
/// the process's pid in the daemon's namespace.
async fn screen(hv: &Hypervisor, pod: &PodId, token: &str, pid: u32) -> Result<u32, Refusal> {
    hv.screen_worker(pod, token, pid).await.map_err(|error| {
        tracing::warn!(pod = %pod, pid, error, "registration refused");
        Refusal::new(StatusCode::FORBIDDEN, error)
    })
}
