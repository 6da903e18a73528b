//! Step 1 of the protocol: create or open a region, and wait until it is ready.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::layout::*;
use super::{LedgerError, NO_REG, PodLedger, pack};
use crate::process::current_pid;
use crate::shm::{self, Creation, Trust};

/// The mapping, kept alive for as long as the pointer into it is used.
pub(super) struct Mapping {
    pub(super) region: NonNull<Region>,
    /// Unmaps (never unlinks) when dropped.
    pub(super) _map: shm::Mapping,
}

// SAFETY: the mapping is process-wide, every byte of it is an atomic, and
// `shm::Mapping` is only ever dropped (munmap), which any thread may do.
unsafe impl Send for Mapping {}
// SAFETY: as above: all access goes through `&Region`, whose fields are atomics.
unsafe impl Sync for Mapping {}

impl PodLedger {
    /// Creates or opens the ledger of `pod` (`/dev/shm/gpushare-pod-<pod>`) and
    /// registers this process in it.
    pub fn open(pod: &str) -> Result<Self, LedgerError> {
        Self::open_named(&Self::name_of(pod))
    }

    /// Creates or opens the ledger region `os_id` (a `/dev/shm` entry name,
    /// without `/`) and registers this process in it.
    pub fn open_named(os_id: &str) -> Result<Self, LedgerError> {
        Self::open_with(
            os_id,
            &Trust::own_or_root(None),
            &Creation::default(),
            OPEN_TIMEOUT,
        )
    }

    /// Creates (owner and mode from `creation`) or opens the ledger region
    /// `os_id` if its owner is `trust`ed, and registers this process in it.
    pub fn open_with(
        os_id: &str,
        trust: &Trust,
        creation: &Creation,
        timeout: Duration,
    ) -> Result<Self, LedgerError> {
        validate_name(os_id)?;
        let deadline = Instant::now() + timeout;
        let map = map_region(os_id, trust, creation, deadline, timeout)?;
        let region = ready_region(os_id, &map, deadline, timeout)?;
        let ledger = PodLedger {
            name: os_id.to_owned(),
            reg: AtomicU64::new(NO_REG),
            map: Mapping { region, _map: map },
        };
        let pid = current_pid();
        let slot = ledger.claim_slot(pid)?;
        ledger.reg.store(pack(pid, slot), Ordering::Release);
        Ok(ledger)
    }
}

pub(super) fn validate_name(name: &str) -> Result<(), LedgerError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.contains('/') {
        "contains '/'"
    } else if name.contains('\0') {
        "contains NUL"
    } else if name == "." || name == ".." {
        "is a directory name"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(LedgerError::InvalidName {
        name: name.to_owned(),
        reason,
    })
}

/// Creates the region, or opens it if it exists (and is trusted), riding
/// out the races with processes creating it at the same moment.
pub(super) fn map_region(
    name: &str,
    trust: &Trust,
    creation: &Creation,
    deadline: Instant,
    timeout: Duration,
) -> Result<shm::Mapping, LedgerError> {
    loop {
        if let Some(map) = shm::create(name, REGION_SIZE, creation)? {
            return Ok(map);
        }
        // Exists; `None`: unlinked since, or not sized yet by its creator.
        if let Some(map) = shm::open(name, REGION_SIZE, true, trust)? {
            return Ok(map);
        }
        if Instant::now() >= deadline {
            return Err(timeout_error(name, timeout));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub(super) fn timeout_error(name: &str, timeout: Duration) -> LedgerError {
    LedgerError::Timeout {
        name: name.to_owned(),
        waited_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Initialises the header if nobody has, waits for it to be ready, and checks
/// that the region is a ledger of this layout.
pub(super) fn ready_region(
    name: &str,
    map: &shm::Mapping,
    deadline: Instant,
    timeout: Duration,
) -> Result<NonNull<Region>, LedgerError> {
    let len = map.len();
    let size_mismatch = |found: u64| LedgerError::SizeMismatch {
        name: name.to_owned(),
        found,
        expected: REGION_SIZE as u64,
    };
    if len < size_of::<Header>() {
        return Err(size_mismatch(len as u64));
    }
    let base = map.base();
    // SAFETY: the mapping is at least `size_of::<Header>()` bytes (checked
    // above), page-aligned, and lives as long as `map`, which outlives this
    // borrow; `Header` is all atomics, so concurrent writers are fine.
    let header = unsafe { base.cast::<Header>().as_ref() };
    loop {
        match header.state.load(Ordering::Acquire) {
            STATE_READY => break,
            STATE_EMPTY if len == REGION_SIZE => {
                if header
                    .state
                    .compare_exchange(
                        STATE_EMPTY,
                        STATE_INITIALIZING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    header.magic.store(MAGIC, Ordering::Relaxed);
                    header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
                    header.size.store(REGION_SIZE as u64, Ordering::Relaxed);
                    header.state.store(STATE_READY, Ordering::Release);
                    break;
                }
            }
            STATE_EMPTY => return Err(size_mismatch(len as u64)),
            STATE_INITIALIZING => {
                if Instant::now() >= deadline {
                    return Err(timeout_error(name, timeout));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // Unknown: let the checks below name what is wrong.
            _ => break,
        }
    }
    let magic = header.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(LedgerError::BadMagic {
            name: name.to_owned(),
            found: magic,
        });
    }
    let version = header.version.load(Ordering::Acquire);
    if version != LAYOUT_VERSION {
        return Err(LedgerError::VersionMismatch {
            name: name.to_owned(),
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let size = header.size.load(Ordering::Acquire);
    if size != REGION_SIZE as u64 {
        return Err(size_mismatch(size));
    }
    if len != REGION_SIZE {
        return Err(size_mismatch(len as u64));
    }
    let state = header.state.load(Ordering::Acquire);
    if state != STATE_READY {
        return Err(LedgerError::BadState {
            name: name.to_owned(),
            found: state,
        });
    }
    Ok(base.cast::<Region>())
}
