//! A pod's ledger as the daemon holds it, and its periodic check.
//!
//! The pods' uid owns the ledger (its processes write it), so a pod may
//! truncate, grow, `chmod` or remove it, or put a directory, a link, a FIFO
//! or a file of its own at its name: its next processes then find no
//! ledger they may use and are refused, or make one of their own that the
//! daemon does not read. Maintenance checks the name every second, as it
//! checks the node tables ([`PodRegion::check_ledger`]):
//! - a mode changed is set back in place ([`entry::restore_mode`]);
//! - anything else (shrunk, resized, removed, replaced, given another owner)
//!   is made again: a ledger of the pods' uid of the right size, owner and
//!   mode at the name (one a new process made after the pod removed the
//!   daemon's) is adopted, anything else is removed without being followed
//!   ([`super::squat`]) and the ledger made anew.
//!
//! Processes that mapped a ledger before it was replaced keep writing it.
//! The daemon keeps every ledger it held for the pod mapped, at most
//! [`MAX_LEDGER_REMAKES`] of them, and counts their processes as the pod's: the
//! audit charges what the driver says all of them hold beyond the current
//! ledger's count (`GpuLimits::unaccounted`), so processes on either side
//! of a replacement together stay within the quota.

use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use gpushare_utils::ledger::{PodLedger, REGION_SIZE};
use gpushare_utils::shm::{Creation, Squat, Trust};

use super::entry::{self, Entry, Made};
use super::{PodRegion, RegionError, SHM_DIR, squat};

/// How many times a pod's ledger is made again; past that a warning says
/// it is left as it is.
pub const MAX_LEDGER_REMAKES: usize = 8;

/// How long a remake waits for a ledger found half-made at the name (a
/// process of the pod making it) before it removes it.
const REMAKE_WAIT: Duration = Duration::from_millis(100);

/// What [`PodRegion::check_ledger`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerRepair {
    /// The ledger's mode was set back in place.
    ModeRestored,
    /// The ledger was made again (or one of the pods' uid adopted) after
    /// it was shrunk, resized, removed, replaced or given another owner.
    Remade(&'static str),
}

/// Every ledger the daemon held for the pod: the first, those that
/// replaced it, and which is the one at the name now.
pub(super) struct Ledgers {
    first: PodLedger,
    remade: [OnceLock<PodLedger>; MAX_LEDGER_REMAKES],
    /// 0: `first`; `n`: `remade[n - 1]`.
    current: AtomicUsize,
    /// The current ledger's inode; 0 where it could not be read.
    inode: AtomicU64,
    /// Made again [`MAX_LEDGER_REMAKES`] times, and tampered with once more: left.
    given_up: AtomicBool,
    /// How the daemon makes and adopts the pod's ledger.
    trust: Trust,
    creation: Creation,
}

impl Ledgers {
    /// `first`, just opened at `name` with `trust` and `creation`.
    pub(super) fn new(first: PodLedger, trust: Trust, creation: Creation) -> Self {
        let inode = inode_at(first.name());
        Self {
            first,
            remade: [const { OnceLock::new() }; MAX_LEDGER_REMAKES],
            current: AtomicUsize::new(0),
            inode: AtomicU64::new(inode),
            given_up: AtomicBool::new(false),
            trust,
            creation,
        }
    }

    /// The ledger at the pod's name now (as of the last check).
    pub(super) fn current(&self) -> &PodLedger {
        match self.current.load(Ordering::Acquire) {
            0 => &self.first,
            n => self
                .remade
                .get(n - 1)
                .and_then(OnceLock::get)
                .unwrap_or(&self.first),
        }
    }

    /// Every ledger held for the pod: processes may still write each.
    pub(super) fn all(&self) -> impl Iterator<Item = &PodLedger> {
        std::iter::once(&self.first).chain(self.remade.iter().filter_map(OnceLock::get))
    }

    fn made(&self) -> Made {
        Made {
            inode: self.inode.load(Ordering::Acquire),
            size: REGION_SIZE as u64,
            uid: self
                .creation
                .uid
                .unwrap_or_else(gpushare_utils::shm::effective_uid),
            mode: self.creation.mode & 0o755,
        }
    }

    /// Opens the ledger at the name (adopting a trusted one, making one
    /// where there is none); anything else there is removed without being
    /// followed and the ledger made anew.
    fn reopen(&self, name: &str) -> Result<PodLedger, RegionError> {
        let open = || PodLedger::open_with(name, &self.trust, &self.creation, REMAKE_WAIT);
        match open() {
            Ok(ledger) => Ok(ledger),
            Err(error) => {
                let error = RegionError::from(error);
                let found = super::squat_in(&error).unwrap_or(Squat::Unopenable);
                squat::remove(name).map_err(|source| RegionError::Squat {
                    name: name.to_owned(),
                    found,
                    source,
                })?;
                tracing::debug!(name, %found, %error, "removed what stood at a pod's ledger's name");
                Ok(open()?)
            }
        }
    }
}

impl PodRegion {
    /// Checks the pod's ledger at its name (maintenance, every second) and
    /// repairs what a process of the pods' uid did to it; says what it
    /// repaired. See the [module documentation](self).
    pub fn check_ledger(&self) -> Option<LedgerRepair> {
        let ledgers = &self.ledgers;
        let current = ledgers.current();
        let name = current.name().to_owned();
        let made = ledgers.made();
        let what = if current.is_shrunk() {
            "shrunk"
        } else {
            match entry::inspect(&name, &made) {
                Entry::Intact => return None,
                Entry::Mode(found) => match entry::restore_mode(&name, &made) {
                    Ok(()) => {
                        tracing::warn!(name, mode = %format!("{found:04o}"), "a pod's ledger's mode was changed: set back");
                        return Some(LedgerRepair::ModeRestored);
                    }
                    Err(error) => {
                        tracing::warn!(name, %error, "a pod's ledger's mode was changed and cannot be set back");
                        "given another mode"
                    }
                },
                Entry::Damaged(what) => what,
            }
        };
        let next = ledgers.current.load(Ordering::Acquire) + 1;
        let Some(slot) = ledgers.remade.get(next - 1) else {
            if !ledgers.given_up.swap(true, Ordering::AcqRel) {
                tracing::error!(
                    name,
                    what,
                    "a pod's ledger was tampered with again: left as it is (made again {MAX_LEDGER_REMAKES} times already)"
                );
            }
            return None;
        };
        let ledger = match ledgers.reopen(&name) {
            Ok(ledger) => ledger,
            Err(error) => {
                tracing::warn!(name, what, %error, "a pod's ledger was tampered with and cannot be made again: its new processes are refused");
                return None;
            }
        };
        let _ = slot.set(ledger);
        ledgers.inode.store(inode_at(&name), Ordering::Release);
        ledgers.current.store(next, Ordering::Release);
        tracing::warn!(
            name,
            what,
            "a pod's ledger was tampered with: made again (its processes that mapped the old one keep it, and are audited still)"
        );
        Some(LedgerRepair::Remade(what))
    }
}

/// The inode at `/dev/shm/<name>`; 0 where it cannot be read.
fn inode_at(name: &str) -> u64 {
    std::fs::symlink_metadata(format!("{SHM_DIR}/{name}")).map_or(0, |meta| meta.ino())
}
