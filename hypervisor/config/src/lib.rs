//! The config file (TOML), read at start and again on SIGHUP or when its
//! modification time changes.
//!
//! ```toml
//! listen = "127.0.0.1:7070"          # IP:port; --listen overrides it
//! admin_token_file = "/etc/gpushare/admin-token"   # or admin_token / admin_token_env
//! worker_ttl_ms = 30000              # a worker silent this long is removed
//! health_interval_ms = 10000         # Health ping to every worker; 0 = off
//! check_pids = false                 # remove workers whose pid is gone (hostPID only)
//! max_connections = 4096             # open HTTP connections; beyond, the oldest
//!                                    # one still sending headers is closed
//! header_timeout_ms = 5000           # a request's headers must arrive this fast
//! idle_timeout_ms = 60000            # a kept-alive connection idle this long is closed
//! region_mode = "0640"               # mode of /dev/shm/gpushare-pod-*; never g+w or o+w
//! region_gid = 1000                  # chown group of the regions (region_uid too)
//!
//! [swap]                             # an operator may always swap pods out and in
//! overcommit = true                  # or [0, 2]: GPUs whose idle pods the daemon swaps
//!                                    # out when another pod needs memory (default: none)
//! overcommit_ratio = 1.5             # Kubernetes places quotas up to this times their
//!                                    # memory (1 to 10; default 2)
//! idle_after_ms = 30000              # idle: no CUDA call for this long
//! latency_pods = "last"              # last | never: latency pods among those swapped
//! ranking = "lru-2"                  # lru-2 | lru: which idle pods go first
//! min_resident_ms = 5000             # a pod brought back stays this long if others can go
//! headroom = "12g"                   # kept free ahead of need on each such GPU (default 0)
//! host_limit = "64g"                 # host memory for swapped pods (default: half the node's)
//! room_wait_ms = 60000               # longest an allocation or swap-in waits for room
//! prepare_ahead = "26g"              # host copies pinned ahead for the pods that go next
//!                                    # (default: twice headroom)
//! cuda_library = "libcuda.so.1"      # the driver whose checkpoint API swaps
//!
//! [[pods]]
//! id = "a"
//! token_file = "tokens/a"            # or token = "…" or token_env = "VAR": exactly one
//! [[pods.gpus]]
//! uuid = "GPU-3430f778-7a25-704c-9090-8b0bb2478114"   # or index = 0
//! memory = "4g"                      # size string or bytes; 0/absent = unlimited
//! weight = 1                         # default 1
//! cap = 30                           # percent, hard cap
//! share = 25                         # percent, guaranteed when contended
//! policy = "fixed"                   # fixed | elastic | none; default: fixed with
//!                                    # a cap, elastic with only a share, else none
//! class = "batch"                    # batch | latency: latency pods are served
//!                                    # first, batch pods wait while one is active
//! oversubscribe = true               # past the quota, serve linear allocations from
//!                                    # pinned host memory (default false)
//! spill_limit = "16g"                # pod-wide cap of that host memory on this GPU
//!                                    # (implies oversubscribe; default with it: a
//!                                    # quarter of the node's memory; 0 = none)
//! ```
//!
//! Limits follow the GPU's UUID (an `index` is resolved to the UUID of that
//! NVML index), whatever index a container's `CUDA_VISIBLE_DEVICES` gives it.
//!
//! Relative `token_file` paths are relative to the config file's folder.
//! The config file and token files must be regular files (a FIFO or a
//! device is refused, never waited on) of at most 1 MiB and 4 KiB
//! ([`files`]); errors show at most 200 characters of any value
//! ([`gpushare_utils::quote`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_utils::pod::{PodClass, PodId};
use gpushare_utils::quote::quoted;
use gpushare_utils::units::parse_size;
use serde::Deserialize;

use hypervisor_core::region::RegionOptions;
use hypervisor_core::spec::{self, GpuSelector, GpuSpec, PodSpec, Policy, Token};

mod error;
mod files;
mod overcommit;
mod settings;
mod swap;

pub use error::ConfigError;
pub use files::{CONFIG_MAX_BYTES, LOAD_TIMEOUT};
pub use overcommit::{MemoryCapacity, OvercommitRatio};
pub use settings::{ConnLimits, Settings, SwapSettings};

/// Where the hypervisor listens when neither the file nor `--listen` says.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";

/// The whole file, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Where the API listens ([`DEFAULT_LISTEN`] when the file does not
    /// say); `--listen` overrides it.
    pub listen: SocketAddr,
    /// The token of the admin API; `None`: no `admin_token*` key is set,
    /// and the admin API is off.
    pub admin_token: Option<Token>,
    /// Worker and connection tuning.
    pub settings: Settings,
    /// Mode and ownership of the pods' region files.
    pub regions: RegionOptions,
    /// The pods of the file, in its order, ids unique.
    pub pods: Vec<PodSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: Option<String>,
    admin_token: Option<String>,
    admin_token_file: Option<PathBuf>,
    admin_token_env: Option<String>,
    worker_ttl_ms: Option<u64>,
    health_interval_ms: Option<u64>,
    check_pids: Option<bool>,
    max_workers_per_pod: Option<usize>,
    max_connections: Option<usize>,
    header_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    region_mode: Option<String>,
    region_uid: Option<u32>,
    region_gid: Option<u32>,
    swap: Option<swap::RawSwap>,
    #[serde(default)]
    pods: Vec<RawPod>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPod {
    id: String,
    token: Option<String>,
    token_file: Option<PathBuf>,
    token_env: Option<String>,
    #[serde(default)]
    gpus: Vec<RawGpu>,
}

/// One `[[pods.gpus]]` table; also the JSON of the admin limits body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGpu {
    /// The GPU's `GPU-…`/`MIG-…` UUID; exactly one of this and `index`.
    pub uuid: Option<String>,
    /// The GPU's NVML index, resolved to its UUID; exactly one of this and
    /// `uuid`.
    pub index: Option<u32>,
    /// Memory quota; absent or 0: unlimited.
    pub memory: Option<SizeValue>,
    /// Weight among the pods that want the GPU; absent: 1.
    pub weight: Option<u32>,
    /// Hard cap, percent of the GPU's time (1 to 100).
    pub cap: Option<u8>,
    /// Share guaranteed when contended, percent (0 to the cap).
    pub share: Option<u8>,
    /// `fixed`, `elastic` or `none`; absent: [`Policy::default_for`] the cap
    /// and share.
    pub policy: Option<String>,
    /// `latency` or `batch`; absent: batch.
    pub class: Option<String>,
    /// Past the quota, serve linear allocations from pinned host memory;
    /// `false` turns spilling off whatever `spill_limit` says.
    pub oversubscribe: Option<bool>,
    /// Pod-wide cap of that host memory on this GPU (implies
    /// `oversubscribe`; 0: none); see [`spec::spill_cap`].
    pub spill_limit: Option<SizeValue>,
}

/// A memory size: bytes, or a size string such as `"4g"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    /// A number: bytes.
    Bytes(u64),
    /// A size string (`"4g"`, `"512m"`), parsed by [`parse_size`].
    Text(String),
}

/// Body of `PUT /api/v1/pods/{id}/limits`: the pod's new GPU list.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    /// Every GPU the pod may use from now on, as in the file's
    /// `[[pods.gpus]]`; GPUs left out are no longer the pod's.
    pub gpus: Vec<RawGpu>,
}

/// Reads and resolves the file at `path` (tokens from files and the
/// environment included), within [`LOAD_TIMEOUT`].
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let owned = path.to_owned();
    files::within_timeout(path, move || {
        let text = files::read_config(&owned)?;
        let base = owned.parent().unwrap_or_else(|| Path::new("."));
        parse(&text, &owned, base)
    })
}

/// Resolves `text` as if read from `path`; relative token files are under `base`.
pub fn parse(text: &str, path: &Path, base: &Path) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        path: path.to_owned(),
        // toml's message spans lines (it quotes the source); keep one line.
        message: one_line(&e.to_string()),
    })?;
    let listen_text = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = listen_text
        .parse()
        .map_err(|_| ConfigError::Listen(listen_text.to_owned()))?;
    let admin_token = resolve_token(
        "admin token",
        raw.admin_token.as_deref(),
        raw.admin_token_file.as_deref(),
        raw.admin_token_env.as_deref(),
        base,
        true,
    )?;
    let defaults = Settings::default();
    let settings = Settings {
        worker_ttl: raw
            .worker_ttl_ms
            .map_or(defaults.worker_ttl, |ms| Duration::from_millis(ms.max(100))),
        health_interval: match raw.health_interval_ms {
            None => defaults.health_interval,
            Some(0) => None,
            Some(ms) => Some(Duration::from_millis(ms.max(100))),
        },
        check_pids: raw.check_pids.unwrap_or(defaults.check_pids),
        max_workers_per_pod: raw
            .max_workers_per_pod
            .unwrap_or(defaults.max_workers_per_pod)
            .max(1),
        connections: ConnLimits {
            max_connections: raw
                .max_connections
                .unwrap_or(defaults.connections.max_connections)
                .max(16),
            header_timeout: raw
                .header_timeout_ms
                .map_or(defaults.connections.header_timeout, |ms| {
                    Duration::from_millis(ms.max(100))
                }),
            idle_timeout: raw
                .idle_timeout_ms
                .map_or(defaults.connections.idle_timeout, |ms| {
                    Duration::from_millis(ms.max(100))
                }),
        },
        swap: swap::settings(raw.swap)?,
    };
    let mode = match raw.region_mode.as_deref() {
        None => None,
        Some(text) => match u32::from_str_radix(text.trim().trim_start_matches("0o"), 8) {
            Ok(mode) if mode <= 0o777 && mode & 0o022 == 0 => Some(mode),
            _ => return Err(ConfigError::RegionMode(text.to_owned())),
        },
    };
    let regions = RegionOptions {
        mode,
        uid: raw.region_uid,
        gid: raw.region_gid,
    };
    let mut pods = Vec::with_capacity(raw.pods.len());
    for pod in raw.pods {
        let what = format!("pod {}", quoted(&pod.id));
        let id = PodId::new(pod.id.clone()).map_err(|e| ConfigError::Spec {
            what: what.clone(),
            source: e.into(),
        })?;
        let token = resolve_token(
            &what,
            pod.token.as_deref(),
            pod.token_file.as_deref(),
            pod.token_env.as_deref(),
            base,
            false,
        )?
        .ok_or_else(|| ConfigError::TokenSource {
            what: what.clone(),
            keys: "token, token_file and token_env",
        })?;
        let gpus = resolve_gpus(&what, &pod.gpus)?;
        let spec = PodSpec::new(id, token, gpus).map_err(|source| ConfigError::Spec {
            what: what.clone(),
            source,
        })?;
        pods.push(spec);
    }
    spec::check_pods(&pods).map_err(ConfigError::Pods)?;
    Ok(Config {
        listen,
        admin_token,
        settings,
        regions,
        pods,
    })
}

/// Resolves a GPU list (from the file or an admin request) for `what`.
pub fn resolve_gpus(what: &str, raw: &[RawGpu]) -> Result<Vec<GpuSpec>, ConfigError> {
    let mut gpus = Vec::with_capacity(raw.len());
    for (n, gpu) in raw.iter().enumerate() {
        let what = format!("{what} gpu #{}", n + 1);
        let spec_err = |source| ConfigError::Spec {
            what: what.clone(),
            source,
        };
        let selector = match (&gpu.uuid, gpu.index) {
            (Some(uuid), None) => GpuSelector::uuid(uuid).map_err(spec_err)?,
            (None, Some(index)) => GpuSelector::index(index).map_err(spec_err)?,
            _ => return Err(ConfigError::GpuSelector { what }),
        };
        let size = |value: &Option<SizeValue>| match value {
            None => Ok(None),
            Some(SizeValue::Bytes(bytes)) => Ok(Some(*bytes)),
            Some(SizeValue::Text(text)) => {
                parse_size(text)
                    .map(Some)
                    .map_err(|source| ConfigError::Size {
                        what: what.clone(),
                        source,
                    })
            }
        };
        let memory_bytes = size(&gpu.memory)?.unwrap_or(0);
        let spill_bytes = spec::spill_cap(gpu.oversubscribe, size(&gpu.spill_limit)?);
        let policy = match &gpu.policy {
            None => None,
            Some(text) => Some(Policy::parse(text).ok_or_else(|| ConfigError::Policy {
                what: what.clone(),
                value: text.clone(),
            })?),
        };
        let class = match &gpu.class {
            None => PodClass::Batch,
            Some(text) => PodClass::parse(text).ok_or_else(|| ConfigError::Class {
                what: what.clone(),
                value: text.clone(),
            })?,
        };
        gpus.push(
            GpuSpec::new(
                selector,
                memory_bytes,
                gpu.weight.unwrap_or(1),
                gpu.cap,
                gpu.share,
                policy,
            )
            .map_err(spec_err)?
            .with_class(class)
            .with_spill(spill_bytes),
        );
    }
    spec::check_gpus(&gpus).map_err(|source| ConfigError::Spec {
        what: what.to_owned(),
        source,
    })?;
    Ok(gpus)
}

fn resolve_token(
    what: &str,
    inline: Option<&str>,
    file: Option<&Path>,
    env: Option<&str>,
    base: &Path,
    optional: bool,
) -> Result<Option<Token>, ConfigError> {
    let keys = if optional {
        "admin_token, admin_token_file and admin_token_env"
    } else {
        "token, token_file and token_env"
    };
    let text = match (inline, file, env) {
        (None, None, None) if optional => return Ok(None),
        (Some(token), None, None) => token.to_owned(),
        (None, Some(file), None) => files::read_token(what, &base.join(file))?,
        (None, None, Some(var)) => std::env::var(var).map_err(|_| ConfigError::TokenEnv {
            what: what.to_owned(),
            var: var.to_owned(),
        })?,
        _ => {
            return Err(ConfigError::TokenSource {
                what: what.to_owned(),
                keys,
            });
        }
    };
    // Files and variables often end in a newline.
    Token::new(text.trim())
        .map(Some)
        .map_err(|source| ConfigError::Spec {
            what: what.to_owned(),
            source,
        })
}

/// Risky choices a config may make, one line each: worth saying, not refusing.
pub fn warnings(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if !config.listen.ip().is_loopback() {
        out.push(format!(
            "listen = {} is not a loopback address: tokens travel in clear text to anyone who can reach it",
            config.listen
        ));
    }
    for (n, a) in config.pods.iter().enumerate() {
        for b in &config.pods[n + 1..] {
            if a.token == b.token {
                out.push(format!(
                    "pods {} and {} share one token: each can act as the other",
                    a.id, b.id
                ));
            }
        }
        let by_index = a
            .gpus
            .iter()
            .any(|g| matches!(g.gpu, GpuSelector::Index(_)));
        let by_uuid = a.gpus.iter().any(|g| matches!(g.gpu, GpuSelector::Uuid(_)));
        if by_index && by_uuid {
            out.push(format!(
                "pod {} names GPUs both by index and by UUID: one GPU given twice keeps only its first limits",
                a.id
            ));
        }
    }
    let mut shares: std::collections::BTreeMap<String, u32> = std::collections::BTreeMap::new();
    for pod in &config.pods {
        for gpu in &pod.gpus {
            let floor = u32::from(gpu.share_percent.unwrap_or(0));
            *shares.entry(gpu.gpu.to_string()).or_default() += floor;
        }
    }
    for (gpu, total) in shares {
        if total > 100 {
            out.push(format!(
                "GPU {gpu}: guaranteed shares add up to {total}%: they cannot all be honoured"
            ));
        }
    }
    out
}

fn one_line(message: &str) -> String {
    let mut parts = message.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = parts.next().unwrap_or_default().to_owned();
    // The last line holds the reason; the ones between quote the source.
    match parts.next_back() {
        Some(last) if last != first => format!("{first}: {last}"),
        _ => first,
    }
}
