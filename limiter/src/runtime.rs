//! The limiter's process-wide state, decided once at load from the
//! configuration.

use std::sync::OnceLock;

use gpushare_utils::config::{LimiterConfig, PodId};
use gpushare_utils::ledger::PodLedger;

use crate::hypervisor::Link;
use crate::quota::MemoryQuota;
use crate::throttle::Throttle;

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
    /// `None` when no compute limit is configured: launches are not patched.
    pub compute: Option<Throttle>,
    /// The node hypervisor, when one is configured: it sets the limits.
    pub hypervisor: Option<Link>,
    ledger: OnceLock<Option<PodLedger>>,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Reads the configuration and fixes the state; later calls return the first.
pub fn init_from_env() -> &'static State {
    STATE.get_or_init(|| match LimiterConfig::from_env() {
        Ok(config)
            if config.memory.is_empty()
                && config.compute.is_empty()
                && config.hypervisor.is_none() =>
        {
            State::Off
        }
        Ok(config) => {
            let hypervisor = match config.hypervisor.as_deref().map(|address| Link::new(address, config.pod.as_str())) {
                Some(Ok(link)) => Some(link),
                Some(Err(error)) => {
                    let message = format!("cuda-limiter: configuration error: CUDA_LIMITER_HYPERVISOR is set but {error}");
                    eprintln!("{message}; CUDA will refuse to initialise in this process");
                    return State::Refusing(message);
                }
                None => None,
            };
            let metered = !config.compute.is_empty() || hypervisor.is_some();
            State::Limiting(Box::new(Limiter {
                compute: metered.then(|| Throttle::new(config.compute)),
                memory: MemoryQuota::new(config.memory),
                pod: config.pod,
                hypervisor,
                ledger: OnceLock::new(),
            }))
        }
        Err(error) => {
            let message = format!("cuda-limiter: configuration error: {error}");
            // One clear line, also when logging is off.
            eprintln!("{message}; CUDA will refuse to initialise in this process");
            State::Refusing(message)
        }
    })
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

/// The hypervisor link, when one is configured.
pub fn hypervisor() -> Option<&'static Link> {
    limiter().and_then(|limiter| limiter.hypervisor.as_ref())
}

/// The pod's shared ledger, opened on first use. Unusable, it is reported
/// once, and limited devices refuse allocations rather than run unaccounted.
pub fn ledger() -> Option<&'static PodLedger> {
    let limiter = limiter()?;
    limiter
        .ledger
        .get_or_init(|| match PodLedger::open(limiter.pod.as_str()) {
            Ok(ledger) => Some(ledger),
            Err(error) => {
                eprintln!(
                    "cuda-limiter: pod ledger for {} unavailable ({error}); limited devices refuse allocations and launches",
                    limiter.pod
                );
                None
            }
        })
        .as_ref()
}
