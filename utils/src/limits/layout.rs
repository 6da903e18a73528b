//! The limits object's layout (see the table in [`super`]): the header,
//! one [`GpuLimits`] per GPU entry, and the offsets checked at compile
//! time.

use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::MAX_DEVICES;
use crate::bucket::BucketLimits;
use crate::pod::PodClass;

/// Header of the limits object.
#[repr(C)]
#[derive(Debug)]
pub struct LimitsHeader {
    /// [`LIMITS_MAGIC`] once the hypervisor has created the object.
    pub magic: AtomicU64,
    /// [`LIMITS_VERSION`] of the layout the hypervisor wrote.
    pub version: AtomicU32,
    /// 0 until the hypervisor publishes the pod's limits, then 2.
    pub state: AtomicU32,
    /// Bumped on every change.
    pub generation: AtomicU64,
    /// Where the pod's device memory is ([`Residency::code`]): 0, on its
    /// GPUs, in objects written before swapping existed too.
    pub residency: AtomicU32,
    /// Bit `i` set while the hypervisor counts the pod as wanting GPU entry
    /// `i` (it saw the pod launch or wait there within its active window):
    /// its rates already count the pod in, so a launch waiting for budget
    /// there waits for the local refill without asking. Zero means "ask",
    /// so version 1 holds it.
    pub demand: AtomicU32,
    /// A move of the pod to another GPU waiting for its processes' restore:
    /// the [`uuid_key`] of the GPU the checkpointed processes were on, and
    /// of the GPU they go to, so that a restarted hypervisor restores them
    /// there. 0: none. Zero means "absent", so version 1 holds them.
    pub moving_from: AtomicU64,
    /// See [`Self::moving_from`].
    pub moving_to: AtomicU64,
    /// Bits `4i..4i+4`: the pods taking turns on GPU entry `i`'s GPU (batch
    /// pods that want it, at most 15), as the hypervisor counts them: how
    /// long a launch waits for a turn at most. 0: not counted (version 1).
    pub turn_pods: AtomicU64,
    /// Unused; zero.
    pub reserved: [AtomicU64; 1],
}

pub(super) const TURN_PODS_BITS: u32 = 4;
/// The most pods [`LimitsHeader::turn_pods`] counts on a GPU.
pub const MAX_TURN_PODS: u64 = (1 << TURN_PODS_BITS) - 1;

/// Where a pod's device memory is. Only the hypervisor moves a pod between
/// these; its processes read it before each CUDA call that needs the GPU,
/// and a call that finds the pod anywhere but [`Residency::Resident`] waits
/// (and asks the hypervisor to bring the pod back). On the wire and in the
/// status, its [`Residency::as_str`] name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// On its GPUs: calls go on.
    Resident,
    /// Being checkpointed to host memory.
    SwappingOut,
    /// In host memory: the pod holds no device memory.
    Swapped,
    /// Being restored to a GPU.
    SwappingIn,
}

impl Residency {
    /// The value stored in [`LimitsHeader::residency`].
    pub fn code(self) -> u32 {
        match self {
            Self::Resident => 0,
            Self::SwappingOut => 1,
            Self::Swapped => 2,
            Self::SwappingIn => 3,
        }
    }

    /// The state a stored value means; an unknown value is not resident
    /// (fail closed: the call waits and asks).
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Resident,
            1 => Self::SwappingOut,
            3 => Self::SwappingIn,
            _ => Self::Swapped,
        }
    }

    /// Its name in the status, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::SwappingOut => "swapping_out",
            Self::Swapped => "swapped",
            Self::SwappingIn => "swapping_in",
        }
    }
}

/// One GPU's limits.
#[repr(C)]
#[derive(Debug)]
pub struct GpuLimits {
    /// [`uuid_key`] of the GPU; 0: entry unused.
    pub key: AtomicU64,
    /// Bytes the pod may hold on the GPU; 0 = unlimited.
    pub quota: AtomicU64,
    /// Compute share, ceiling, suspension, managed flag.
    pub compute: BucketLimits,
    /// The pod's [`PodClass`] on the GPU ([`PodClass::code`]; 0, batch, in
    /// objects written before classes).
    pub class: AtomicU32,
    /// On a co-run GPU: the MPS active thread percentage (1..=100) a client
    /// of the pod that starts now takes, which depends on whether a latency
    /// pod shares the GPU; 0: none given, the provisioned variable stands.
    /// Zero means "absent", so version 1 holds it.
    pub sm_percent: AtomicU32,
    /// Bytes of host memory the pod may spill to past its quota
    /// (oversubscription); 0 = none. Zero means "absent", so version 1 holds it.
    pub spill_limit: AtomicU64,
    /// Bytes the driver attributes to the pod's processes on the GPU beyond
    /// what its ledger counts (the hypervisor's audit): charged to the pod
    /// as driver-held memory. Zero means "absent", so version 1 holds it.
    pub unaccounted: AtomicU64,
    /// Where the hypervisor moved the pod here from another GPU: the
    /// [`uuid_key`] of the GPU its spec places it on, so that a restarted
    /// hypervisor places it here still. 0: not moved. Zero means "absent",
    /// so version 1 holds it.
    pub placed_as: AtomicU64,
}

impl GpuLimits {
    /// The pod's class on the GPU.
    pub fn class(&self) -> PodClass {
        PodClass::from_code(self.class.load(Ordering::Acquire))
    }

    /// Sets the pod's class on the GPU (hypervisor only).
    pub fn set_class(&self, class: PodClass) {
        self.class.store(class.code(), Ordering::Release);
    }

    /// The active thread percentage a new MPS client of the pod takes on
    /// the GPU, when the hypervisor gives one (1..=100).
    pub fn sm_percent(&self) -> Option<u8> {
        match self.sm_percent.load(Ordering::Acquire) {
            percent @ 1..=100 => u8::try_from(percent).ok(),
            _ => None,
        }
    }

    /// Sets [`Self::sm_percent`] (hypervisor only); 0 clears it.
    pub fn set_sm_percent(&self, percent: u8) {
        self.sm_percent
            .store(u32::from(percent.min(100)), Ordering::Release);
    }
}

/// The whole object.
#[repr(C)]
#[derive(Debug)]
pub struct LimitsRegion {
    /// Magic, version, publication state and generation.
    pub header: LimitsHeader,
    /// One entry per GPU of the pod, found by [`uuid_key`]; unused entries
    /// have key 0.
    pub gpus: [GpuLimits; MAX_DEVICES],
}

/// Size of the object in bytes.
pub const LIMITS_SIZE: usize = size_of::<LimitsRegion>();

const _: () = {
    assert!(size_of::<LimitsHeader>() == 64);
    assert!(offset_of!(LimitsHeader, residency) == 24);
    assert!(offset_of!(LimitsHeader, demand) == 28);
    assert!(offset_of!(LimitsHeader, moving_from) == 32);
    assert!(offset_of!(LimitsHeader, moving_to) == 40);
    assert!(offset_of!(LimitsHeader, turn_pods) == 48);
    assert!(MAX_DEVICES <= 32, "one demand bit per entry");
    assert!(MAX_DEVICES * TURN_PODS_BITS as usize <= 64);
    assert!(size_of::<GpuLimits>() == 64);
    assert!(LIMITS_SIZE == 64 + MAX_DEVICES * 64);
    assert!(offset_of!(GpuLimits, compute) == 16);
    assert!(offset_of!(GpuLimits, class) == 32);
    assert!(offset_of!(GpuLimits, sm_percent) == 36);
    assert!(offset_of!(GpuLimits, spill_limit) == 40);
    assert!(offset_of!(GpuLimits, unaccounted) == 48);
    assert!(offset_of!(GpuLimits, placed_as) == 56);
};
