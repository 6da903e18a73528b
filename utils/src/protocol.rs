//! What the limiter and the node hypervisor say to each other over HTTP.
//!
//! - `POST /api/v1/workers` with [`Register`] (bearer token of the pod)
//!   → [`Registered`]: the worker's id and its pod's limits. The hypervisor
//!   has created the pod's shared-memory region by then; the limiter maps it.
//! - The `http-bidir-comm` channel under `/api/v1/channel`, client id = the
//!   worker id: the hypervisor sends [`Command`]s, the worker answers with
//!   [`CommandResult`]s.
//! - `POST /api/v1/admission` with [`BudgetRequest`] (bearer token): sent
//!   by a launch that found no budget in the shared bucket (trap); answered
//!   with [`BudgetGrant`] once the hypervisor has granted budget to the pod.
//! - `POST /api/v1/swap-in` with [`SwapInRequest`] (bearer token): sent by a
//!   CUDA call that found its pod swapped out (trap); answered with
//!   [`SwapAnswer`] once the pod is back on its GPUs, or could not be.
//! - `POST /api/v1/room` with [`RoomRequest`] (bearer token): sent by an
//!   allocation within the pod's quota that the GPU could not hold; the
//!   hypervisor swaps out idle pods of that GPU (memory overcommit) and
//!   answers [`RoomAnswer`].
//!
//! Limits live in the shared region (quota, bucket rate and ceiling, the
//! suspended flag); the messages carry them too so a worker can log them and
//! so a region can be rebuilt after a hypervisor restart.

use serde::{Deserialize, Serialize};

/// The API version prefix.
pub const API_PREFIX: &str = "/api/v1";

/// A GPU as the worker sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDevice {
    /// CUDA index in the worker's process.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
}

/// The longest hostname a registration may carry, in bytes (a DNS name's
/// limit; Linux hostnames are at most 64). The daemon keeps it for the life
/// of the worker, so it is bounded like everything else a pod can send.
pub const MAX_HOSTNAME_LEN: usize = 253;
/// The longest GPU or MIG UUID a registration may carry, in bytes (a MIG
/// device's `MIG-GPU-…/gi/ci` form is about 50).
pub const MAX_UUID_LEN: usize = 96;

/// A limiter process introducing itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    /// The process's pod id ([`crate::pod::PodId`]).
    pub pod: String,
    /// The process's id, as the process sees it.
    pub pid: u32,
    /// Hostname of the process, for logs; may be empty.
    #[serde(default)]
    pub hostname: String,
    /// Devices visible to the process, when it already knows them.
    #[serde(default)]
    pub devices: Vec<WorkerDevice>,
    /// Whether the process backs its large allocations itself
    /// (`CUDA_LIMITER_FAST_SWAP`), so that it can answer
    /// [`Command::SwapOut`] and [`Command::SwapIn`]; false from older limiters.
    #[serde(default)]
    pub fast_swap: bool,
}

/// The limits of one GPU for one pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodGpuLimits {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Memory quota in bytes; 0 = unlimited.
    pub memory_bytes: u64,
    /// Compute share in percent (0 = unlimited).
    pub share_percent: u8,
    /// Elastic ceiling in percent.
    pub ceiling_percent: u8,
    /// Weight among pods waiting for the GPU.
    pub weight: u32,
}

/// The hypervisor's answer to [`Register`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    /// Id the hypervisor gave the worker: its client id on the channel.
    pub worker_id: String,
    /// The worker's pod id.
    pub pod: String,
    /// The pod's limits on each of its GPUs.
    pub devices: Vec<PodGpuLimits>,
}

/// Commands the hypervisor sends a worker over the channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Command {
    /// Launches block until resumed (the shared flag already says so; this
    /// lets the worker log it and answer).
    Suspend,
    /// Launches go on again (the shared flag already says so).
    Resume,
    /// New limits (also written to the shared region).
    SetLimits {
        /// The pod's limits on each of its GPUs.
        devices: Vec<PodGpuLimits>,
    },
    /// Liveness check.
    Health,
    /// Move the device memory the process backs itself to pinned host
    /// memory and give the GPU's back. Sent while the pod's residency says
    /// `swapping_out`, so its calls wait at the limiter's gate; a process
    /// without `CUDA_LIMITER_FAST_SWAP` refuses (`ok: false`).
    SwapOut,
    /// Bring that memory back, at the same addresses, before the pod's
    /// calls go on.
    SwapIn,
    /// Give back the pinned host copies the process keeps of its memory on
    /// the GPU (kept so that its next swap-out runs at the speed of the
    /// link): the node's host memory for swaps is wanted elsewhere. Those
    /// of memory in host memory stay; the report's `bytes` says what went.
    ReleaseHost,
    /// Make and pin the host copies of the process's memory on the GPU
    /// that has none yet, while the pod runs on: its next swap-out then
    /// only copies, at the speed of the link, instead of pinning fresh
    /// memory as it copies (seconds for tens of GiB). Sent for idle pods
    /// likely to go next, within the node's host memory for swaps; the
    /// report's `pinned_new_bytes` says what was pinned.
    PrepareHost,
}

/// A worker's answer to a [`Command`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResult {
    /// Whether the worker carried the command out.
    pub ok: bool,
    /// What the worker did, or why it failed; may be empty.
    #[serde(default)]
    pub message: String,
    /// What a [`Command::SwapOut`], [`Command::SwapIn`],
    /// [`Command::ReleaseHost`] or [`Command::PrepareHost`] moved; absent
    /// from other answers and from older workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap: Option<FastSwapReport>,
    /// The worker's device memory is shared with another process by CUDA
    /// IPC (exported or imported): neither its own swap nor the driver's
    /// checkpoint, which cannot restore imported memory, may move it.
    /// False from older workers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// The worker backs its memory for a fast swap and answers `SwapOut`
    /// and `SwapIn` (`CUDA_LIMITER_FAST_SWAP`), as it registered: a daemon
    /// that adopts it after a restart learns the setting from its first
    /// answer. False from older workers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fast_swap: bool,
    /// Bytes of managed memory (`cuMemAllocManaged`) the worker holds,
    /// which its limiter cannot move and NVML does not show: while any is
    /// held its own swap declines, and only the driver's checkpoint may
    /// take it. 0 from older workers.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub managed_bytes: u64,
}

fn is_zero(bytes: &u64) -> bool {
    *bytes == 0
}

/// What one process's swap of the memory it backs itself moved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FastSwapReport {
    /// Bytes copied (to host memory for a swap-out, back for a swap-in).
    pub bytes: u64,
    /// Allocations moved.
    pub allocations: u64,
    /// Bytes the process holds on its GPUs that this path does not move
    /// (contexts, modules, allocations the limiter did not back): the
    /// driver's per-process figure beyond the backed memory on the GPU,
    /// after the swap; `None` where the driver cannot say.
    #[serde(default)]
    pub unmoved_bytes: Option<u64>,
    /// Pinned host memory the process holds for its swaps after this one
    /// (made at an allocation's first swap-out, kept until the allocation
    /// is freed or [`Command::ReleaseHost`]).
    pub pinned_bytes: u64,
    /// Host memory this command pinned that was not pinned before: for a
    /// swap-out, what it pinned as it copied (zero where the copies were
    /// kept or prepared ahead, [`Command::PrepareHost`]).
    #[serde(default)]
    pub pinned_new_bytes: u64,
    /// What each part took.
    pub durations: SwapDurations,
}

/// What each part of a process's swap took, in microseconds of the
/// monotonic clock; zero for the parts of the other direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapDurations {
    /// Waiting for the process's work (every context that holds backed memory).
    pub sync_us: u64,
    /// Pinning host memory not pinned yet (within `copy_us`: a chunk is
    /// pinned as the copy of the one before runs).
    pub pin_us: u64,
    /// Waiting for host memory to be faulted in ahead of its pinning
    /// (within `copy_us`).
    #[serde(default)]
    pub fault_wait_us: u64,
    /// Copying to host memory, pinning included.
    pub copy_us: u64,
    /// Unmapping and releasing the device memory (for a
    /// [`Command::ReleaseHost`]: giving back the host copies).
    pub release_us: u64,
    /// Creating device memory and mapping it at the same addresses.
    pub map_us: u64,
    /// Copying back to the device.
    pub copy_back_us: u64,
}

/// A trapped launch asking for budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetRequest {
    /// The id [`Registered`] gave the worker.
    pub worker_id: String,
    /// `GPU-…` UUID of the device.
    pub uuid: String,
    /// GPU nanoseconds the launch is estimated to take.
    pub cost_ns: u64,
}

/// The hypervisor's grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetGrant {
    /// GPU nanoseconds added to the pod's bucket for this request.
    pub granted_ns: u64,
}

/// A trapped call of a swapped-out pod asking for it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapInRequest {
    /// The id [`Registered`] gave the worker.
    pub worker_id: String,
}

/// The hypervisor's answer to [`SwapInRequest`] and to the operators'
/// swap requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapAnswer {
    /// Where the pod's memory is now ([`crate::limits::Residency::as_str`]).
    pub residency: String,
    /// Why the pod is not where it was asked to be; empty when it is.
    #[serde(default)]
    pub message: String,
}

/// An allocation the GPU could not hold, within the pod's quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomRequest {
    /// The id [`Registered`] gave the worker.
    pub worker_id: String,
    /// `GPU-…` UUID of the device.
    pub uuid: String,
    /// Bytes the allocation needs.
    pub bytes: u64,
    /// What the driver said was free on the device as it refused
    /// (`cuMemGetInfo`), where the worker could ask: NVML counts as free
    /// memory the driver keeps for itself, so the hypervisor makes room
    /// by this figure's shortfall, not by NVML's alone.
    #[serde(default)]
    pub driver_free: Option<u64>,
}

/// The hypervisor's answer to [`RoomRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomAnswer {
    /// Bytes of device memory the hypervisor freed on the GPU for the
    /// request (swapping other pods out); 0: none, the allocation fails.
    pub freed: u64,
    /// Why nothing was freed; empty otherwise.
    #[serde(default)]
    pub message: String,
    /// The GPU has free what was asked for as the hypervisor answers, by
    /// NVML: freed by this request, or by another swap meanwhile (an idle
    /// pod swapped out ahead of need while the request waited for it). The
    /// allocation is worth trying again. False from older hypervisors.
    #[serde(default)]
    pub room: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_tagged_json() {
        let json = serde_json::to_string(&Command::SetLimits {
            devices: vec![PodGpuLimits {
                uuid: "GPU-1".into(),
                memory_bytes: 1 << 30,
                share_percent: 30,
                ceiling_percent: 100,
                weight: 1,
            }],
        })
        .expect("encode");
        assert!(
            json.starts_with(r#"{"kind":"set_limits","devices":[{"uuid":"GPU-1""#),
            "{json}"
        );
        let back: Command = serde_json::from_str(r#"{"kind":"suspend"}"#).expect("decode");
        assert_eq!(back, Command::Suspend);
        let back: Command = serde_json::from_str(r#"{"kind":"swap_out"}"#).expect("decode");
        assert_eq!(back, Command::SwapOut);
    }

    #[test]
    fn answers_and_registrations_of_older_peers_still_parse() {
        let old: CommandResult =
            serde_json::from_str(r#"{"ok":true,"message":"healthy"}"#).expect("decode");
        assert_eq!(old.swap, None);
        let json = serde_json::to_string(&old).expect("encode");
        assert!(!json.contains("swap"), "no report, no field: {json}");
        assert!(!old.shared && !json.contains("shared"), "{json}");
        assert!(!old.fast_swap && !json.contains("fast_swap"), "{json}");
        let old: Register = serde_json::from_str(r#"{"pod":"a","pid":7}"#).expect("decode");
        assert!(!old.fast_swap);
    }
}
