//! The swap routes: the operators' `POST /api/v1/pods/{id}/swap-out`,
//! `…/swap-in`, `…/move` and `POST /api/v1/gpus/{gpu}/drain` (admin
//! token), and the workers' `POST /api/v1/swap-in` (a
//! trapped call of a swapped pod) and `POST /api/v1/room` (an allocation
//! the GPU could not hold), with their pod's token.

use gpushare_utils::protocol::{RoomAnswer, RoomRequest, SwapAnswer, SwapInRequest};

use hypervisor_core::spec::{GpuSelector, SpecError};

use super::*;
use crate::SwapRefusal;
use crate::swap::swap_in_wait;

/// A GPU in a request body: its NVML index, or its UUID (or index) as text.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum GpuName {
    Index(u32),
    Text(String),
}

impl GpuName {
    fn selector(&self) -> Result<GpuSelector, SpecError> {
        match self {
            Self::Index(index) => GpuSelector::index(*index),
            Self::Text(text) => GpuSelector::parse(text),
        }
    }
}

/// The body of `POST /api/v1/pods/{id}/move`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    /// The GPU the pod goes to.
    to: GpuName,
    /// The GPU it leaves; may be left out for a pod on one GPU.
    from: Option<GpuName>,
}

/// `POST /api/v1/pods/{id}/move`: the pod moved to another GPU of the node.
pub(super) async fn operator_move(hv: &Hypervisor, mut req: Request) -> Response {
    let pod = match pod_param(&req) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let body: MoveBody = match json_body(&mut req).await {
        Ok(body) => body,
        Err(refusal) => return refusal,
    };
    let (to, from) = match (
        body.to.selector(),
        body.from.as_ref().map(GpuName::selector).transpose(),
    ) {
        (Ok(to), Ok(from)) => (to, from),
        (Err(error), _) | (_, Err(error)) => {
            return json_error(StatusCode::BAD_REQUEST, &error.to_string());
        }
    };
    match hv.move_pod(&pod, from.as_ref(), &to).await {
        Ok(answer) => json_ok(&answer),
        Err(error) => refusal(&error),
    }
}

/// `POST /api/v1/gpus/{gpu}/drain`: every pod of the GPU moved off it, or
/// swapped out where it cannot move.
pub(super) async fn operator_drain(hv: &Hypervisor, req: &Request) -> Response {
    let gpu = match GpuSelector::parse(req.raw_path_param("gpu").unwrap_or_default()) {
        Ok(gpu) => gpu,
        Err(error) => return json_error(StatusCode::BAD_REQUEST, &error.to_string()),
    };
    match hv.drain_gpu(&gpu).await {
        Ok(report) => json_ok(&report),
        Err(error) => refusal(&error),
    }
}

/// `POST /api/v1/pods/{id}/swap-out` or `…/swap-in`.
pub(super) async fn operator(hv: &Hypervisor, req: &Request, out: bool) -> Response {
    let pod = match pod_param(req) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let result = if out {
        hv.swap_out(&pod).await
    } else {
        hv.swap_in(&pod).await
    };
    match result {
        Ok(answer) => json_ok(&answer),
        Err(error) => refusal(&error),
    }
}

/// `POST /api/v1/swap-in`: answers once the worker's pod is resident, or
/// its swap-in failed, or the wait is over (the worker asks again).
pub(super) async fn worker_swap_in(hv: &Hypervisor, mut req: Request) -> Response {
    let Some(token) = bearer(&req).map(str::to_owned) else {
        return unauthorized();
    };
    let ask: SwapInRequest = match json_body(&mut req).await {
        Ok(ask) => ask,
        Err(refusal) => return refusal,
    };
    let pod = match worker_pod(hv, &ask.worker_id, &token) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let wait = swap_in_wait(hv.core().settings.swap.room_wait);
    match tokio::time::timeout(wait, hv.swap_in_asked(&pod)).await {
        Ok(Ok(answer)) => json_ok(&answer),
        Ok(Err(error)) => refusal(&error),
        Err(_) => json_ok(&SwapAnswer {
            residency: hv.pod_swap(&pod).state.as_str().to_owned(),
            message: format!("not back within {} s; ask again", wait.as_secs()),
        }),
    }
}

/// `POST /api/v1/room`: idle pods of the GPU swapped out for the worker's
/// allocation, waiting for busy ones to go idle where only they could make
/// it, within the configured wait (a room begun runs to its end after it).
pub(super) async fn worker_room(hv: &Hypervisor, mut req: Request) -> Response {
    let Some(token) = bearer(&req).map(str::to_owned) else {
        return unauthorized();
    };
    let ask: RoomRequest = match json_body(&mut req).await {
        Ok(ask) => ask,
        Err(refusal) => return refusal,
    };
    if ask.uuid.len() > MAX_UUID_LEN {
        return json_error(StatusCode::BAD_REQUEST, "device UUID too long");
    }
    let pod = match worker_pod(hv, &ask.worker_id, &token) {
        Ok(pod) => pod,
        Err(refusal) => return refusal.into_response(),
    };
    let Some(_asking) = hv.room_slot(&pod) else {
        return json_error(
            StatusCode::TOO_MANY_REQUESTS,
            "the pod has as many room asks in flight as it may; no room made",
        );
    };
    let wait = hv.core().settings.swap.room_wait;
    let asked = std::time::Instant::now();
    let made = tokio::time::timeout(
        wait,
        hv.make_room(&ask.uuid, ask.bytes, &pod, ask.driver_free, wait),
    )
    .await
    .unwrap_or_default();
    hv.waited_for_room(asked.elapsed());
    let freed = made.freed;
    json_ok(&RoomAnswer {
        freed,
        room: made.room,
        message: if freed == 0 && !made.room {
            "no room made: the pod is not placed there or may hold no more, no idle pod could go, \
             or the GPU does not overcommit"
                .to_owned()
        } else {
            String::new()
        },
    })
}

fn worker_pod(hv: &Hypervisor, worker_id: &str, token: &str) -> Result<String, Refusal> {
    let Ok(id) = ClientId::new(worker_id.to_owned()) else {
        return Err(Refusal::unauthorized());
    };
    match hv.authorize_worker(&id, token) {
        Ok(pod) => Ok(pod.to_string()),
        Err(AuthError::Unauthorized) => Err(Refusal::unauthorized()),
        Err(AuthError::TooMany) => Err(Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too many workers for this pod",
        )),
    }
}

/// 404 unknown pod or GPU, 503 no checkpoint API, 409 a refusal (the pod stays
/// where it was), 500 a swap-in that failed (the pod stays in host memory).
fn refusal(error: &SwapRefusal) -> Response {
    let status = match error {
        SwapRefusal::UnknownPod(_) | SwapRefusal::UnknownGpu(_) => StatusCode::NOT_FOUND,
        SwapRefusal::Unsupported(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ if error.is_refusal() => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    json_error(status, &error.to_string())
}
