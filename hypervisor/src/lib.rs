//! The per-node GPU-sharing hypervisor.
//!
//! Pods share GPUs; the limiter inside each pod's processes enforces memory
//! quotas and compute shares locally, against the pod's shared-memory region.
//! This daemon owns those regions: it writes the limits, splits each GPU's
//! time among the pods that want it, and answers the launches that found no
//! budget. The life of a pod:
//!
//! 1. **Config.** The operator lists pods in a TOML file ([`config`]); each
//!    becomes a [`spec::PodSpec`] and [`scheduler::Scheduler::apply`] opens
//!    its ledger and creates its read-only limits object ([`region`]; one
//!    planted by another user is replaced), and writes its quotas and rates there, by GPU
//!    UUID. A reload (SIGHUP, or the file changing) applies the
//!    new list the same way; a Kubernetes pod watcher can later feed the
//!    same `apply`.
//! 2. **Registration.** Each limited process registers
//!    (`POST /api/v1/workers` with its pod's token) and gets a worker id and
//!    its pod's limits ([`api`]).
//! 3. **Channel.** The worker long-polls `/api/v1/channel` (the
//!    `http-bidir-comm` hub) for [`Command`](gpushare_utils::protocol::Command)s:
//!    suspend, resume, new limits, health. Only its own id, with its pod's token.
//! 4. **Launches.** A launch with budget in the shared bucket goes at once,
//!    without the hypervisor. Every 10 ms the scheduler reads each bucket's
//!    demand and sets its rate: weighted fair shares by water-filling
//!    ([`fairshare`]), caps honoured, elastic pods taking idle time.
//! 5. **Trap.** A launch without budget asks `POST /api/v1/admission`: the
//!    hypervisor marks the pod active (rescheduling the GPU at once if the
//!    pod was idle), refills the bucket for the waiting thread and answers
//!    when it holds budget again (at most 50 ms later; 0 if it does not).
//! 6. **Faults.** A worker silent for the TTL (or whose pid is gone) is
//!    removed and its pod's dead processes' memory given back. A restart of
//!    the hypervisor leaves the regions, so pods keep their limits meanwhile;
//!    workers of the earlier run are adopted again on their next request.
//! 7. **Abuse.** Connections are bounded ([`conn`]): header and idle
//!    timeouts, a cap that closes the oldest half-open one. Each pod's ledger
//!    is audited against NVML's per-process memory.
//! 8. **Observing.** `GET /metrics` (Prometheus), `GET /api/v1/status` (JSON,
//!    and `hypervisor status` as a table); GPUs are seen through NVML
//!    ([`observer`]), or simulated in tests.
//!
//! Why these crates: `poem`/`tokio` serve HTTP (shared with
//! `http-bidir-comm`); `clap` the command line; `toml` the config file;
//! `nvml-wrapper` NVML, loaded at run time so the binary needs no NVIDIA
//! library to build or to run with simulated GPUs; `subtle` constant-time
//! token comparison; `ureq` the `status` command's request; `anyhow` the
//! binary's error reports.

pub mod api;
pub mod clock;
pub mod config;
pub mod conn;
pub mod corun;
pub mod daemon;
pub mod deviceplugin;
pub mod dra;
pub mod fairshare;
pub mod file_error;
pub mod identity;
pub mod kubernetes;
pub mod limiter_files;
pub mod metrics;
pub mod node_tables;
pub mod observer;
pub mod priority;
pub mod provision;
pub mod quantity;
pub mod region;
pub mod scheduler;
pub mod serve;
pub mod source;
pub mod spec;
pub mod status;
pub mod timer;
pub mod workers;

pub use daemon::{Error, Hypervisor, Options};
pub use serve::RunningHypervisor;
