//! The edge: the limiter's one static, decided once at load from the
//! configuration. Only the entry points read it: the constructor, the
//! exported `dlopen` and the loader, and the detour adapters; they hand
//! what it holds (the [`Context`], the quota, the throttle) down by
//! reference, so nothing below them reaches for a global.

use std::sync::OnceLock;
use std::time::Duration;

use gpushare_utils::limits::PodLimits;
use gpushare_utils::node_table::{
    self, NODE_REGION_VARIABLE, NodeTableNames, PRIORITY_REGION_VARIABLE, TableAccess,
};
use gpushare_utils::quote::quoted;

use crate::backing::Backing;
use crate::config::{LimiterConfig, MpsMode};
use crate::context::{Context, LocalLimits};
use crate::hypervisor::{FastSwap, Link};
use crate::mps::MpsRequirement;
use crate::provisioned::{self, Found};
use crate::quota::MemoryQuota;
use crate::residency::SwapGate;
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
/// The variables a provisioned container's pod file overrides.
const PROVISIONED_OVERRIDES: [&str; 8] = [
    "CUDA_LIMITER_POD",
    "CUDA_LIMITER_HYPERVISOR",
    "CUDA_LIMITER_TOKEN",
    "CUDA_LIMITER_TOKEN_FILE",
    REGION_OWNER_VARIABLE,
    ALLOW_UNPATCHED_VARIABLE,
    NODE_REGION_VARIABLE,
    PRIORITY_REGION_VARIABLE,
];
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
    /// Where calls that need the GPU wait while the pod is swapped out.
    pub swap: SwapGate,
    /// The device memory the limiter backs itself, for a fast swap.
    pub backing: Backing,
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
    let mut config =
        LimiterConfig::from_env().map_err(|e| format!("cuda-limiter: configuration error: {e}"))?;
    let provisioned = match provisioned::find()
        .map_err(|e| format!("cuda-limiter: configuration error: {e}"))?
    {
        Found::Local => None,
        Found::Provisioned(provisioned) => Some(provisioned),
        Found::Standby { preloaded } => {
            tracing::info!(
                preloaded = %preloaded.display(),
                "another copy of the limiter enforces this container's limits; this one stays off"
            );
            return Ok(State::Off);
        }
    };
    if let Some(provisioned) = &provisioned {
        provisioned.apply(&mut config, &PROVISIONED_OVERRIDES);
    }
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
                format!(
                    "cuda-limiter: configuration error: {name}={} is not a whole number",
                    quoted(&text)
                )
            }),
        }
    };
    let grant_timeout =
        number(GRANT_TIMEOUT_VARIABLE)?.map_or(DEFAULT_GRANT_TIMEOUT, Duration::from_millis);
    // Who owns trusted limits, and whether an unpatchable driver may run
    // unlimited: in a provisioned container the daemon's statement, never
    // the tenant's variables.
    let (owner, allow_unpatched, link) = match &provisioned {
        Some(provisioned) => (
            provisioned.file.limits_owner,
            false,
            Some(Link::new(
                &provisioned.file.hypervisor,
                config.pod.as_str(),
                &provisioned.file.token,
            )),
        ),
        None => (
            region_owner(number(REGION_OWNER_VARIABLE)?)?,
            allow_unpatched()?,
            link_from_env(&config)?,
        ),
    };
    let link = link.map(|link| link.offering_fast_swap(config.fast_swap));
    // Local limits are a fallback where the hypervisor grants nothing,
    // except in a provisioned container: there they only tighten.
    let local_limits = if provisioned.is_some() {
        LocalLimits::Tighten
    } else if !config.memory.is_empty() || !config.compute.is_empty() {
        LocalLimits::Fallback
    } else {
        LocalLimits::None
    };
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
    // The node tables' names: the daemon's, in a provisioned container.
    let names = provisioned
        .as_ref()
        .map_or_else(NodeTableNames::from_env, |p| p.file.node_tables.clone());
    let priority = Priority::new(
        config.class,
        Tuning::from_env()?,
        node_table::pod_key(config.pod.as_str()),
        tables.clone(),
        names.priority,
    );
    Ok(State::Limiting(Box::new(Limiter {
        compute: metered.then(|| Throttle::new(config.compute, priority, tables, names.activity)),
        memory: MemoryQuota::new(config.memory),
        spill: Spill::new(config.oversubscribe, config.spill_limit),
        mps: MpsRequirement::new(config.mps),
        swap: SwapGate::default(),
        backing: Backing::new(config.fast_swap),
        context: Context::new(config.pod, link, local_limits, grant_timeout, owner),
        allow_unpatched,
        refusal: OnceLock::new(),
    })))
}

fn region_owner(uid: Option<u64>) -> Result<Option<u32>, String> {
    uid.map(|uid| {
        u32::try_from(uid).map_err(|_| {
            format!("cuda-limiter: configuration error: {REGION_OWNER_VARIABLE}={uid} is not a uid")
        })
    })
    .transpose()
}

fn allow_unpatched() -> Result<bool, String> {
    match std::env::var(ALLOW_UNPATCHED_VARIABLE).as_deref() {
        Err(_) | Ok("" | "0") => Ok(false),
        Ok("1") => Ok(true),
        Ok(other) => Err(format!(
            "cuda-limiter: configuration error: {ALLOW_UNPATCHED_VARIABLE}={} is not 0 or 1",
            quoted(other)
        )),
    }
}

/// The link to the hypervisor the environment names, with its token.
fn link_from_env(config: &LimiterConfig) -> Result<Option<Link>, String> {
    let Some(address) = config.hypervisor.as_deref() else {
        return Ok(None);
    };
    Link::from_env(address, config.pod.as_str())
        .map(Some)
        .map_err(|error| {
            format!(
                "cuda-limiter: configuration error: CUDA_LIMITER_HYPERVISOR={} is set but {error}",
                quoted(address)
            )
        })
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

    /// Whether a JSON map names GPUs both by index and by UUID, and so must
    /// be checked against the driver's devices ([`Self::device_named_twice`]).
    pub(crate) fn maps_mix_indices_and_uuids(&self) -> bool {
        self.memory.configured().mixes_indices_and_uuids()
            || self
                .compute
                .as_ref()
                .is_some_and(|compute| compute.configured().mixes_indices_and_uuids())
    }

    /// The configuration error, one line, when a JSON map names one of the
    /// driver's devices twice, by its index and by its UUID.
    pub(crate) fn device_named_twice(&self) -> Option<String> {
        if !self.maps_mix_indices_and_uuids() {
            return None;
        }
        let driver = self.context.driver()?;
        let count = driver
            .device_count()?
            .min(gpushare_utils::MAX_DEVICES as u32);
        (0..count).find_map(|index| {
            let uuid = driver.device_uuid(index as i32)?;
            let compute = self.compute.as_ref().map(Throttle::configured);
            let error = self
                .memory
                .configured()
                .named_twice(index, &uuid)
                .or_else(|| compute.and_then(|limits| limits.named_twice(index, &uuid)))?;
            Some(format!("cuda-limiter: configuration error: {error}"))
        })
    }

    /// Returns once the pod is on its GPUs: at once, but for a stamp of the
    /// call, unless the hypervisor swapped it out ([`SwapGate`]).
    #[inline(always)]
    pub(crate) fn resident(&'static self) {
        self.swap.enter(&self.context);
    }

    /// Starts meeting the hypervisor, if one is configured (a CUDA
    /// process), ready to swap the memory this process backs on its word.
    pub(crate) fn start_link(&'static self) {
        if let Some(link) = self.context.link()
            && self.backing.enabled()
        {
            link.serve_swaps(self);
        }
        self.context.start_link();
    }

    /// Whether the user opted out of refusing CUDA on an unpatchable driver.
    pub(crate) fn allow_unpatched(&self) -> bool {
        self.allow_unpatched
    }
}

/// The hypervisor's `SwapOut` and `SwapIn`, carried out on the memory this
/// process backs.
impl FastSwap for Limiter {
    fn swap_out(&self) -> Result<gpushare_utils::protocol::FastSwapReport, String> {
        self.backing
            .swap_out(&self.context)
            .map_err(|error| error.to_string())
    }

    fn swap_in(&self) -> Result<gpushare_utils::protocol::FastSwapReport, String> {
        self.backing
            .swap_in(&self.context)
            .map_err(|error| error.to_string())
    }

    fn release_host(&self) -> Result<gpushare_utils::protocol::FastSwapReport, String> {
        self.backing
            .release_host(&self.context)
            .map_err(|error| error.to_string())
    }

    fn prepare_host(&self) -> Result<gpushare_utils::protocol::FastSwapReport, String> {
        self.backing
            .prepare_host(&self.context)
            .map_err(|error| error.to_string())
    }

    fn shares_memory(&self) -> bool {
        self.backing.shares_memory()
    }

    fn managed_bytes(&self) -> u64 {
        self.backing.managed_bytes()
    }
}
