//! What the policy code (`quota`, `throttle`) works with, built once at load
//! and passed down by reference: the pod's shared state (its ledger, its
//! compute buckets), where its limits come from ([`Grant`]: the
//! hypervisor's or the local ones), and the driver libraries' function
//! tables as the loader finds them. Nothing here installs a hook or opens a
//! library.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;
use std::time::Duration;

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::bucket::ComputeBucket;
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use gpushare_utils::pod::PodId;
use gpushare_utils::shm::{Creation, Trust};

use crate::driver::{Driver, Nvml};
use crate::grant::{self, Grant};
use crate::hypervisor::Link;

/// How long opening the pod's ledger waits for a peer creating it.
const LEDGER_OPEN_TIMEOUT: Duration = Duration::from_secs(1);

/// This process's pod as the limiter reaches it, and the driver it reaches
/// the GPUs through.
/// What local limits (set in the environment) do beside a hypervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LocalLimits {
    /// None are set.
    None,
    /// They apply where the hypervisor grants none.
    Fallback,
    /// A provisioned container's: never a fallback; a lower one tightens
    /// the published quota.
    Tighten,
}

pub(crate) struct Context {
    pub pod: PodId,
    /// The node hypervisor, when one is configured: it sets the limits.
    link: Option<Link>,
    /// What the environment's local limits do.
    local_limits: LocalLimits,
    grant_timeout: Duration,
    /// Owners the pod's ledger may have: root, the process's own uid, the
    /// configured region owner.
    trust: Trust,
    /// Owners the pod's limits object may have: root and the configured
    /// region owner only. The limits are the daemon's to write; one created
    /// by the pod's own uid (before the daemon made it) is forged.
    limits_trust: Trust,
    grant: OnceLock<Grant>,
    ledger: OnceLock<Option<PodLedger>>,
    /// Per CUDA ordinal: the pod's compute bucket there.
    buckets: [OnceLock<Option<ComputeBucket>>; MAX_DEVICES],
    /// libcuda's functions, once the loader has seen it.
    driver: OnceLock<Driver>,
    /// libnvidia-ml's handle as the loader found it (`None`: absent).
    nvml_library: OnceLock<Option<usize>>,
    /// NVML's functions, resolved and initialised on first use.
    nvml: OnceLock<Option<Nvml>>,
}

impl Context {
    pub(crate) fn new(
        pod: PodId,
        link: Option<Link>,
        local_limits: LocalLimits,
        grant_timeout: Duration,
        region_owner: Option<u32>,
    ) -> Self {
        Self {
            pod,
            link,
            local_limits,
            grant_timeout,
            trust: Trust::own_or_root(region_owner),
            limits_trust: Trust::root_or(region_owner),
            grant: OnceLock::new(),
            ledger: OnceLock::new(),
            buckets: [const { OnceLock::new() }; MAX_DEVICES],
            driver: OnceLock::new(),
            nvml_library: OnceLock::new(),
            nvml: OnceLock::new(),
        }
    }

    /// The pod's limits as published now, without waiting for a grant
    /// (`None`: none published, or not by a trusted owner).
    pub(crate) fn published_limits(&self) -> Option<PodLimits> {
        PodLimits::open_read_only(self.pod.as_str(), &self.limits_trust).ok()
    }

    /// Owners a file the node daemon writes for the pod's processes may
    /// have: root, the process's own uid, the configured region owner.
    pub(crate) fn trust(&self) -> &Trust {
        &self.trust
    }

    /// The driver, once libcuda has been seen.
    pub(crate) fn driver(&self) -> Option<&Driver> {
        self.driver.get()
    }

    /// Resolves the driver's functions from a loaded libcuda (the loader,
    /// once); `None` if one it cannot do without is missing.
    pub(crate) fn load_driver(&self, handle: *mut c_void) -> Option<&Driver> {
        if let Some(driver) = self.driver.get() {
            return Some(driver);
        }
        let driver = Driver::load(handle)?;
        Some(self.driver.get_or_init(|| driver))
    }

    /// Records libnvidia-ml as the loader found it (`None`: absent).
    pub(crate) fn found_nvml(&self, handle: Option<*mut c_void>) {
        // A later sighting is the same library.
        let _first = self.nvml_library.set(handle.map(|handle| handle as usize));
    }

    /// NVML, initialised on first use; `None` before the loader looked for
    /// it, or where it is absent (then driver overhead cannot be measured; a
    /// warning says so once).
    pub(crate) fn nvml(&self) -> Option<&Nvml> {
        let library = *self.nvml_library.get()?;
        self.nvml
            .get_or_init(|| {
                let nvml = library.and_then(|handle| Nvml::open(handle as *mut c_void));
                if nvml.is_none() {
                    tracing::warn!(
                        "NVML unavailable: memory the driver takes for itself is not charged to the pod"
                    );
                }
                nvml
            })
            .as_ref()
    }

    /// The UUID of CUDA device `device`, as NVML prints it.
    pub(crate) fn device_uuid(&self, device: usize) -> Option<String> {
        self.driver()?.device_uuid(device as i32)
    }

    /// The configured hypervisor link, whether or not it granted anything.
    pub(crate) fn link(&self) -> Option<&Link> {
        self.link.as_ref()
    }

    /// Starts meeting the hypervisor, if one is configured (a CUDA process).
    pub(crate) fn start_link(&'static self) {
        if let Some(link) = &self.link {
            link.start(&self.driver);
        }
    }

    /// Where the limits come from, decided once (waiting, bounded, for the
    /// hypervisor when one is configured). Without one configured, the
    /// pod's limits still apply when the node's hypervisor published them.
    pub(crate) fn grant(&'static self) -> &'static Grant {
        self.grant.get_or_init(|| match &self.link {
            None => grant::published(
                self.pod.as_str(),
                &self.limits_trust,
                "CUDA_LIMITER_HYPERVISOR is not set",
            )
            .unwrap_or(Grant::Local),
            Some(link) => grant::decide(
                link,
                &self.driver,
                self.pod.as_str(),
                &self.limits_trust,
                self.grant_timeout,
                self.local_limits == LocalLimits::Fallback,
            ),
        })
    }

    /// Whether where the limits come from is decided ([`Self::grant`]):
    /// by `cuInit` where a hypervisor is configured, else by the first call
    /// that needed the limits. Asking [`Self::grant`] before `cuInit` would
    /// wait for a registration that waits for `cuInit`.
    pub(crate) fn grant_decided(&self) -> bool {
        self.grant.get().is_some()
    }

    /// Whether a lower local limit tightens the hypervisor's (a
    /// provisioned container).
    pub(crate) fn local_limits_tighten(&self) -> bool {
        self.local_limits == LocalLimits::Tighten
    }

    /// The hypervisor link, when the hypervisor's limits are in force.
    pub(crate) fn hypervisor(&'static self) -> Option<&'static Link> {
        let link = self.link.as_ref()?;
        matches!(self.grant(), Grant::Hypervisor(_)).then_some(link)
    }

    /// The hypervisor's read-only limits, when they are in force.
    pub(crate) fn hypervisor_limits(&'static self) -> Option<&'static PodLimits> {
        match self.grant() {
            Grant::Hypervisor(limits) => Some(limits),
            _ => None,
        }
    }

    /// The pod's shared ledger, opened on first use. Unusable, it is reported
    /// once, and limited devices refuse allocations rather than run unaccounted.
    pub(crate) fn ledger(&'static self) -> Option<&'static PodLedger> {
        self.ledger
            .get_or_init(|| {
                let name = PodLedger::name_of(self.pod.as_str());
                match PodLedger::open_with(&name, &self.trust, &Creation::default(), LEDGER_OPEN_TIMEOUT) {
                    Ok(ledger) => {
                        if !register_at_exit(self) {
                            tracing::warn!(
                                "cannot register the exit handler; a dead process's memory is reclaimed by the next scan"
                            );
                        }
                        Some(ledger)
                    }
                    Err(error) => {
                        eprintln!(
                            "cuda-limiter: pod ledger for {} unavailable ({error}); limited devices refuse allocations and launches",
                            self.pod
                        );
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The ledger entry of CUDA device `device`, found by the GPU's UUID.
    pub(crate) fn ledger_entry(&'static self, device: usize) -> Option<usize> {
        self.ledger_entry_of(&self.device_uuid(device)?)
    }

    /// The ledger entry of the GPU `uuid`.
    pub(crate) fn ledger_entry_of(&'static self, uuid: &str) -> Option<usize> {
        match self.ledger()?.device_for(uuid) {
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
    pub(crate) fn bucket(&'static self, device: usize) -> Option<&'static ComputeBucket> {
        self.buckets
            .get(device)?
            .get_or_init(|| {
                let uuid = self.device_uuid(device)?;
                let ledger = self.ledger()?;
                let entry = self.ledger_entry_of(&uuid)?;
                match self.grant() {
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
}

unsafe extern "C" {
    /// glibc's `atexit` with an argument.
    fn __cxa_atexit(
        function: extern "C" fn(*mut c_void),
        argument: *mut c_void,
        dso_handle: *mut c_void,
    ) -> c_int;
}

/// Work a value that lives as long as the process does when it exits
/// normally (statics are never dropped).
pub(crate) trait AtExit: Sync + 'static {
    /// What the work is, for the line printed if it panics ("while …").
    const WHAT: &'static str;
    fn at_exit(&'static self);
}

/// Has `value.at_exit()` run when the process exits normally, a panic in it
/// caught; false when it cannot be registered.
pub(crate) fn register_at_exit<T: AtExit>(value: &'static T) -> bool {
    extern "C" fn run<T: AtExit>(value: *mut c_void) {
        let ran = std::panic::catch_unwind(|| {
            // SAFETY: registered below from a `&'static T`.
            if let Some(value) = unsafe { value.cast::<T>().as_ref() } {
                value.at_exit();
            }
        });
        if ran.is_err() {
            eprintln!("cuda-limiter: internal fault {} at exit", T::WHAT);
        }
    }
    let argument = std::ptr::from_ref(value).cast_mut().cast::<c_void>();
    // SAFETY: `run` never unwinds (it catches), and its argument outlives the
    // process's exit handlers; no DSO handle: run at process exit.
    unsafe { __cxa_atexit(run::<T>, argument, std::ptr::null_mut()) == 0 }
}

/// Gives this process's ledger slot back when it exits normally, so that the
/// next process's reports are right at once.
impl AtExit for Context {
    const WHAT: &'static str = "while giving memory back";

    fn at_exit(&'static self) {
        if let Some(ledger) = self.ledger.get().and_then(Option::as_ref) {
            ledger.release_own_slot();
        }
    }
}
