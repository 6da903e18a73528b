//! The limiter's process-wide state, decided once at load from the
//! configuration, and the one decision taken later: where the limits come
//! from ([`Grant`]).

use std::sync::OnceLock;
use std::time::Duration;

use gpushare_utils::bucket::ComputeBucket;
use gpushare_utils::config::{LimiterConfig, MAX_DEVICES, PodId};
use gpushare_utils::ledger::{POD_REGION_PREFIX, PodLedger};
use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm::{Creation, Trust};

use crate::driver::Driver;
use crate::grant::{self, Grant};
use crate::hypervisor::Link;
use crate::quota::MemoryQuota;
use crate::spill::Spill;
use crate::throttle::Throttle;

/// How long a process under a hypervisor waits for its grant (milliseconds).
pub const GRANT_TIMEOUT_VARIABLE: &str = "CUDA_LIMITER_GRANT_TIMEOUT_MS";
/// A uid, besides this process's own and root, that may own the pod's regions.
pub const REGION_OWNER_VARIABLE: &str = "CUDA_LIMITER_REGION_OWNER";
/// `1`: run unlimited (with a warning) when the driver cannot be patched,
/// instead of refusing CUDA.
pub const ALLOW_UNPATCHED_VARIABLE: &str = "CUDA_LIMITER_ALLOW_UNPATCHED";
/// Default of [`GRANT_TIMEOUT_VARIABLE`].
const DEFAULT_GRANT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long opening the pod's ledger waits for a peer creating it.
const LEDGER_OPEN_TIMEOUT: Duration = Duration::from_secs(1);

/// What the limiter does in this process.
pub enum State {
    /// No limit is configured: nothing is patched, every call is the driver's.
    Off,
    /// The configuration is broken: CUDA is refused rather than run unlimited.
    Refusing(String),
    /// Limits are enforced.
    Limiting(Box<Limiter>),
}

/// The limits of this process's pod.
pub struct Limiter {
    pub pod: PodId,
    pub memory: MemoryQuota,
    /// Oversubscription: what may be served from host memory past the quota.
    pub spill: Spill,
    /// `None` when no compute limit is configured: launches are not patched.
    pub compute: Option<Throttle>,
    /// The node hypervisor, when one is configured: it sets the limits.
    link: Option<Link>,
    /// Whether the environment sets local limits (the fallback when the
    /// hypervisor grants none).
    local_limits: bool,
    grant_timeout: Duration,
    /// Owners the pod's regions may have.
    trust: Trust,
    allow_unpatched: bool,
    grant: OnceLock<Grant>,
    ledger: OnceLock<Option<PodLedger>>,
    /// Per CUDA ordinal: the pod's compute bucket there.
    buckets: [OnceLock<Option<ComputeBucket>>; MAX_DEVICES],
}

static STATE: OnceLock<State> = OnceLock::new();
/// Set when CUDA must be refused after load (the driver cannot be patched).
static REFUSAL: OnceLock<String> = OnceLock::new();

/// Reads the configuration and fixes the state; later calls return the first.
pub fn init_from_env() -> &'static State {
    STATE.get_or_init(|| match build() {
        Ok(state) => state,
        Err(message) => {
            // One clear line, also when logging is off.
            eprintln!("{message}; CUDA will refuse to initialise in this process");
            State::Refusing(message)
        }
    })
}

fn build() -> Result<State, String> {
    let config =
        LimiterConfig::from_env().map_err(|e| format!("cuda-limiter: configuration error: {e}"))?;
    if config.memory.is_empty() && config.compute.is_empty() && config.hypervisor.is_none() {
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
    let metered = !config.compute.is_empty() || link.is_some();
    Ok(State::Limiting(Box::new(Limiter {
        compute: metered.then(|| Throttle::new(config.compute)),
        memory: MemoryQuota::new(config.memory),
        spill: Spill::new(config.oversubscribe, config.spill_limit),
        pod: config.pod,
        link,
        local_limits,
        grant_timeout,
        trust: Trust::own_or_root(owner),
        allow_unpatched,
        grant: OnceLock::new(),
        ledger: OnceLock::new(),
        buckets: [const { OnceLock::new() }; MAX_DEVICES],
    })))
}

/// The state, once initialised.
pub fn get() -> Option<&'static State> {
    STATE.get()
}

/// The limits, when they are enforced.
pub fn limiter() -> Option<&'static Limiter> {
    match STATE.get() {
        Some(State::Limiting(limiter)) => Some(limiter),
        _ => None,
    }
}

/// The memory quota, when limits are enforced.
pub fn quota() -> Option<&'static MemoryQuota> {
    limiter().map(|limiter| &limiter.memory)
}

/// The compute throttle, when a compute limit is configured.
pub fn throttle() -> Option<&'static Throttle> {
    limiter().and_then(|limiter| limiter.compute.as_ref())
}

/// The configured hypervisor link, whether or not it granted anything.
pub fn link() -> Option<&'static Link> {
    limiter().and_then(|limiter| limiter.link.as_ref())
}

/// The hypervisor link, when the hypervisor's limits are in force.
pub fn hypervisor() -> Option<&'static Link> {
    let limiter = limiter()?;
    let link = limiter.link.as_ref()?;
    matches!(limiter.grant(), Grant::Hypervisor(_)).then_some(link)
}

/// The hypervisor's read-only limits, when they are in force.
pub fn hypervisor_limits() -> Option<&'static PodLimits> {
    match limiter()?.grant() {
        Grant::Hypervisor(limits) => Some(limits),
        _ => None,
    }
}

/// Where the limits come from, decided once (waiting, bounded, for the
/// hypervisor when one is configured).
pub fn grant() -> Option<&'static Grant> {
    limiter().map(Limiter::grant)
}

/// Refuses CUDA from now on with `message` (printed once, here).
pub fn refuse(message: String) {
    eprintln!("{message}");
    let _ = REFUSAL.set(message);
}

/// Why CUDA is refused after load, if it is.
pub fn refusal() -> Option<&'static str> {
    REFUSAL.get().map(String::as_str)
}

/// Whether the user opted out of refusing CUDA on an unpatchable driver.
pub fn allow_unpatched() -> bool {
    limiter().is_some_and(|limiter| limiter.allow_unpatched)
}

/// The pod's shared ledger, opened on first use. Unusable, it is reported
/// once, and limited devices refuse allocations rather than run unaccounted.
pub fn ledger() -> Option<&'static PodLedger> {
    let limiter = limiter()?;
    limiter
        .ledger
        .get_or_init(|| {
            let name = format!("{POD_REGION_PREFIX}{}", limiter.pod);
            match PodLedger::open_with(&name, &limiter.trust, &Creation::default(), LEDGER_OPEN_TIMEOUT) {
                Ok(ledger) => {
                    release_at_exit();
                    Some(ledger)
                }
                Err(error) => {
                    eprintln!(
                        "cuda-limiter: pod ledger for {} unavailable ({error}); limited devices refuse allocations and launches",
                        limiter.pod
                    );
                    None
                }
            }
        })
        .as_ref()
}

/// The ledger entry of CUDA device `device`, found by the GPU's UUID.
pub fn ledger_entry(device: usize) -> Option<usize> {
    let uuid = Driver::get().and_then(|driver| driver.device_uuid(device as i32))?;
    ledger_entry_of(&uuid)
}

/// The ledger entry of the GPU `uuid`.
pub fn ledger_entry_of(uuid: &str) -> Option<usize> {
    match ledger()?.device_for(uuid) {
        Ok(entry) => Some(entry),
        Err(error) => {
            tracing::error!(%error, uuid, "no ledger entry for this GPU");
            None
        }
    }
}

/// The pod's compute bucket on CUDA device `device`: its state in the
/// ledger, its limits in the hypervisor's read-only object when it granted
/// them, else in the ledger (local mode). `None`: no bucket can be had.
pub fn bucket(device: usize) -> Option<&'static ComputeBucket> {
    let limiter = limiter()?;
    limiter
        .buckets
        .get(device)?
        .get_or_init(|| {
            let uuid = Driver::get().and_then(|driver| driver.device_uuid(device as i32))?;
            let ledger = ledger()?;
            let entry = ledger_entry_of(&uuid)?;
            match limiter.grant() {
                Grant::Hypervisor(limits) => {
                    let state = ledger.compute_state(entry).ok()?;
                    let gpu = limits.find(&uuid)?;
                    Some(ComputeBucket::new(state, &gpu.compute))
                }
                Grant::Local => ledger.compute(entry).ok(),
                Grant::Refused => None,
            }
        })
        .as_ref()
}

impl Limiter {
    fn grant(&'static self) -> &'static Grant {
        self.grant.get_or_init(|| match &self.link {
            None => Grant::Local,
            Some(link) => grant::decide(
                link,
                self.pod.as_str(),
                &self.trust,
                self.grant_timeout,
                self.local_limits,
            ),
        })
    }
}

/// Gives this process's ledger slot back when it exits normally, so that the
/// next process's reports are right at once (statics are never dropped).
fn release_at_exit() {
    extern "C" fn release() {
        let released = std::panic::catch_unwind(|| {
            if let Some(ledger) = limiter()
                .and_then(|limiter| limiter.ledger.get())
                .and_then(Option::as_ref)
            {
                ledger.release_own_slot();
            }
        });
        if released.is_err() {
            eprintln!("cuda-limiter: internal fault while giving memory back at exit");
        }
    }
    // SAFETY: `release` is a plain function that never unwinds (it catches).
    if unsafe { libc::atexit(release) } != 0 {
        tracing::warn!(
            "cannot register the exit handler; a dead process's memory is reclaimed by the next scan"
        );
    }
}
