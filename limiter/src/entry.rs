//! The edge: the limiter's one static, decided once at load from the
//! configuration. Only the entry points read it: the constructor, the
//! exported `dlopen` and the loader, and the detour adapters; they hand
//! what it holds (the [`Context`], the quota, the throttle) down by
//! reference, so nothing below them reaches for a global.

use std::sync::OnceLock;
use std::time::Duration;

use gpushare_utils::activity::{self, TableAccess};
use gpushare_utils::limits::PodLimits;

use crate::config::{LimiterConfig, MpsMode};
use crate::context::Context;
use crate::hypervisor::Link;
use crate::mps::MpsRequirement;
use crate::quota::MemoryQuota;
use crate::spill::Spill;
use crate::throttle::Throttle;
use crate::throttle::priority::{Priority, Tuning};

/// How long a process under a hypervisor waits for its grant (milliseconds).
pub(crate) const GRANT_TIMEOUT_VARIABLE: &str = "CUDA_LIMITER_GRANT_TIMEOUT_MS";
/// A uid, besides this process's own and root, that may own the pod's regions.
pub(crate) const REGION_OWNER_VARIABLE: &str = "CUDA_LIMITER_REGION_OWNER";
/// `1`: run unlimited (with a warning) when the driver cannot be patched,
/// instead of refusing CUDA.
pub(crate) const ALLOW_UNPATCHED_VARIABLE: &str = "CUDA_LIMITER_ALLOW_UNPATCHED";
/// Default of [`GRANT_TIMEOUT_VARIABLE`].
const DEFAULT_GRANT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the limiter does in this process.
pub(crate) enum State {
    /// No limit is configured: nothing is patched, every call is the driver's.
    Off,
    /// The configuration is broken: CUDA is refused rather than run unlimited.
    Refusing(Refusal),
    /// Limits are enforced.
    Limiting(Box<Limiter>),
}

/// The limits of this process's pod, and what enforcing them needs.
pub(crate) struct Limiter {
    /// What the policy works with: the pod's shared state, the grant, the driver.
    pub context: Context,
    pub memory: MemoryQuota,
    /// Oversubscription: what may be served from host memory past the quota.
    pub spill: Spill,
    /// `None` when no compute limit is configured: launches are only
    /// checked for a library's first use (see `quota::LazyLibraries`).
    pub compute: Option<Throttle>,
    /// Whether CUDA runs only as an MPS client (a co-run GPU's pod).
    pub mps: MpsRequirement,
    allow_unpatched: bool,
    /// Set when CUDA must be refused after load (the driver cannot be patched).
    refusal: OnceLock<String>,
}

/// Why CUDA is refused in this process, said once, by the first `cuInit`:
/// a process that never initialises CUDA (a shell, a tool the container runs)
/// is not the one to tell, and one that does is told what happened to it.
pub(crate) struct Refusal {
    message: String,
    told: std::sync::Once,
}

impl Refusal {
    fn new(message: String) -> Self {
        Self {
            message,
            told: std::sync::Once::new(),
        }
    }

    /// Prints the one line saying that `cuInit` was refused and why, the
    /// first time it is called.
    pub(crate) fn tell(&self) {
        self.told
            .call_once(|| eprintln!("{}; cuInit refused", self.message));
    }
}

static STATE: OnceLock<State> = OnceLock::new();

/// Reads the configuration and fixes the state; later calls return the first.
pub(crate) fn init_from_env() -> &'static State {
    STATE.get_or_init(|| match build() {
        Ok(state) => state,
        // One clear line, also when logging is off, by the first cuInit.
        Err(message) => State::Refusing(Refusal::new(message)),
    })
}

fn build() -> Result<State, String> {
    let config =
        LimiterConfig::from_env().map_err(|e| format!("cuda-limiter: configuration error: {e}"))?;
    if config.memory.is_empty()
        && config.compute.is_empty()
        && config.class.is_empty()
        && config.hypervisor.is_none()
        && config.mps == MpsMode::Optional
    {
        return Ok(State::Off);
    }
    let number = |name: &str| -> Result<Option<u64>, String> {
        match std::env::var(name) {
            Err(_) => Ok(None),
            Ok(text) => text.trim().parse().map(Some).map_err(|_| {
                format!("cuda-limiter: configuration error: {name}={text:?} is not a whole number")
            }),
        }
    };
    let grant_timeout =
        number(GRANT_TIMEOUT_VARIABLE)?.map_or(DEFAULT_GRANT_TIMEOUT, Duration::from_millis);
    let owner = number(REGION_OWNER_VARIABLE)?
        .map(|uid| {
            u32::try_from(uid).map_err(|_| {
                format!(
                    "cuda-limiter: configuration error: {REGION_OWNER_VARIABLE}={uid} is not a uid"
                )
            })
        })
        .transpose()?;
    let allow_unpatched = match std::env::var(ALLOW_UNPATCHED_VARIABLE).as_deref() {
        Err(_) | Ok("" | "0") => false,
        Ok("1") => true,
        Ok(other) => {
            return Err(format!(
                "cuda-limiter: configuration error: {ALLOW_UNPATCHED_VARIABLE}={other:?} is not 0 or 1"
            ));
        }
    };
    let link = match config.hypervisor.as_deref() {
        Some(address) => Some(Link::new(address, config.pod.as_str()).map_err(|error| {
            format!("cuda-limiter: configuration error: CUDA_LIMITER_HYPERVISOR is set but {error}")
        })?),
        None => None,
    };
    let local_limits = !config.memory.is_empty() || !config.compute.is_empty();
    // Launches are metered wherever a compute limit may apply: configured
    // here, or given by the hypervisor (configured, or already published
    // for the pod: they apply even where the environment names no
    // hypervisor).
    let published = std::path::Path::new(&format!(
        "/dev/shm/{}",
        PodLimits::name_of(config.pod.as_str())
    ))
    .exists();
    let metered =
        !config.compute.is_empty() || !config.class.is_empty() || link.is_some() || published;
    // The node's tables: under a hypervisor, the ones it made; alone, this
    // process creates them when absent.
    let tables = if link.is_some() {
        TableAccess::managed(owner)
    } else {
        TableAccess::local(owner)
    };
    let priority = Priority::new(
        config.class,
        Tuning::from_env()?,
        activity::pod_key(config.pod.as_str()),
        tables.clone(),
    );
    Ok(State::Limiting(Box::new(Limiter {
        compute: metered.then(|| Throttle::new(config.compute, priority, tables)),
        memory: MemoryQuota::new(config.memory),
        spill: Spill::new(config.oversubscribe, config.spill_limit),
        mps: MpsRequirement::new(config.mps),
        context: Context::new(config.pod, link, local_limits, grant_timeout, owner),
        allow_unpatched,
        refusal: OnceLock::new(),
    })))
}

/// The state, once initialised.
pub(crate) fn state() -> Option<&'static State> {
    STATE.get()
}

/// The limits, when they are enforced.
pub(crate) fn limiter() -> Option<&'static Limiter> {
    match STATE.get() {
        Some(State::Limiting(limiter)) => Some(limiter),
        _ => None,
    }
}

/// Refuses CUDA from now on with `message` (printed once, here).
pub(crate) fn refuse(message: String) {
    eprintln!("{message}");
    if let Some(limiter) = limiter() {
        let _first = limiter.refusal.set(message);
    }
}

impl Limiter {
    /// Why CUDA is refused after load, if it is.
    pub(crate) fn refusal(&self) -> Option<&str> {
        self.refusal.get().map(String::as_str)
    }

    /// Whether the user opted out of refusing CUDA on an unpatchable driver.
    pub(crate) fn allow_unpatched(&self) -> bool {
        self.allow_unpatched
    }
}
