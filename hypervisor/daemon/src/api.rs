//! The HTTP API: its routes are the table [`ROUTES`] (who may call each,
//! the CLI command that calls it, its handler), from which [`router`]
//! builds each listener's. Every error body is `{"error": "..."}`;
//! statuses: 400 malformed request, 401 bad or missing token, 403 admin API
//! disabled, 404 unknown route, pod or GPU, 405 wrong method, 413 body over
//! 64 KiB, 429 too many workers.
//!
//! A TCP listener (the node: in Kubernetes the daemon's own loopback)
//! serves every route to whoever reaches it, bar the admin token's. The
//! metrics listener ([`Audience::Metrics`]) serves only the probes' routes
//! (`/metrics`, `/healthz`, `/readyz`): it may face the cluster. On the
//! Unix socket, which is mounted into the pods ([`Audience::Pods`]), the
//! status names other pods only for the admin token: a pod's token gets its
//! own pod alone (its GPUs' usage, workers and processes), no token a 401;
//! `/metrics` needs the admin token.

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
use poem::{Endpoint, EndpointExt, Request, Response, Route};
use serde::Serialize;
use serde_json::json;

use crate::{AuthError, Hypervisor};

mod routes;
mod swap;
use hypervisor_config::{self as config, LimitsBody};
use hypervisor_core::scheduler::{AdmissionTarget, ScheduleError};
pub(crate) use routes::router;
pub use routes::{ApiRoute, Caller, ROUTES};

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
    /// Prometheus and probes: `--metrics-listen`, which may face the
    /// cluster's network.
    Metrics,
}

/// The status as Prometheus text; on the pods' socket, for the admin token
/// alone.
fn metrics(hv: &Hypervisor, req: &Request, audience: Audience) -> Response {
    if audience == Audience::Pods
        && let Err(refusal) = admin(hv, req)
    {
        return refusal.into_response();
    }
    Response::builder()
        .content_type("text/plain; version=0.0.4")
        .body({
            let status = hv.status();
            let mut text = hypervisor_status::metrics::render(&status);
            text.push_str(&hypervisor_status::metrics::render_health(
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
        let Some(id) = core.workers.register(
            &pod,
            reg.pid,
            reg.hostname.clone(),
            reg.devices.clone(),
            reg.fast_swap,
        ) else {
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
    if audience != Audience::Pods || admin(hv, req).is_ok() {
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

fn reload(hv: &Hypervisor) -> Response {
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
