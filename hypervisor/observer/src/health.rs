//! GPU health: what NVML reports (critical XIDs, uncorrectable ECC errors, a
//! GPU lost), classified once against the [`HealthPolicy`] and kept per GPU
//! UUID on a [`HealthBoard`] that the slice, the device plugin and the
//! metrics read.
//!
//! Two kinds of fault:
//! - **Sticky** (XIDs, uncorrectable ECC): NVML never says the GPU is well
//!   again; the GPU needs a reset, after which the daemon restarts (its pod
//!   is restarted) with a clean board.
//! - **Lost** (`GPU_IS_LOST` on a query, or the GPU no longer enumerates):
//!   cleared as soon as the GPU answers again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use serde::Serialize;
use tokio::sync::watch;

/// XIDs caused by the application, not the GPU (NVIDIA's device plugin
/// ignores the same ones): 13 graphics engine exception, 31 memory page
/// fault, 43 the GPU stopped processing (a kernel was killed), 45 preemptive
/// clean-up after a process ended, 68 video decoder exception, 109 context
/// switch timeout.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// XID 79: the GPU has fallen off the bus.
pub const XID_FALLEN_OFF_THE_BUS: u64 = 79;

/// Something NVML said about one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// A critical XID error; `None` where NVML did not say which.
    Xid(Option<u64>),
    /// A corrected (single-bit) ECC error.
    EccCorrected,
    /// An uncorrected (double-bit) ECC error.
    EccUncorrected,
    /// A query answered `GPU_IS_LOST`, or the GPU no longer enumerates.
    Lost,
    /// The GPU answers queries (again).
    Found,
}

/// Why a GPU is unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// A critical XID that is not the application's; `None`: unknown XID.
    Xid(Option<u64>),
    /// An uncorrected ECC error.
    Ecc,
    /// The GPU does not answer.
    Lost,
}

impl Fault {
    /// The reason as a label value: `xid-79`, `xid-unknown`,
    /// `ecc-uncorrected`, `gpu-lost`.
    pub fn reason(&self) -> String {
        match self {
            Self::Xid(Some(xid)) => format!("xid-{xid}"),
            Self::Xid(None) => "xid-unknown".to_owned(),
            Self::Ecc => "ecc-uncorrected".to_owned(),
            Self::Lost => "gpu-lost".to_owned(),
        }
    }

    /// Whether work on the GPU cannot go on (it is lost or off the bus), so
    /// pods using it should leave rather than only no new ones come.
    pub fn evicts(&self) -> bool {
        matches!(self, Self::Lost | Self::Xid(Some(XID_FALLEN_OFF_THE_BUS)))
    }
}

/// Why an event changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// Health checks are off (`--disable-health-checks`).
    Disabled,
    /// An XID on the ignore list: the application's fault.
    ApplicationXid(u64),
    /// A corrected ECC error: the GPU did its job.
    Corrected,
}

/// What an event means for the GPU's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Health is unchanged, for the reason given.
    Ignore(Ignored),
    /// The GPU is unhealthy from now on (until it answers again, for
    /// [`Fault::Lost`]; until the daemon restarts, for the others).
    Fault(Fault),
    /// The GPU answers again: a [`Fault::Lost`] is cleared, sticky faults stay.
    Recovered,
}

/// Which events count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// False with `--disable-health-checks`: every event is ignored, no
    /// event thread is started and every GPU is published healthy.
    pub enabled: bool,
    /// XIDs that leave the GPU healthy.
    pub ignored_xids: BTreeSet<u64>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            ignored_xids: DEFAULT_IGNORED_XIDS.into_iter().collect(),
        }
    }
}

/// A malformed ignore list.
#[derive(Debug, thiserror::Error)]
#[error("XID list {list:?}: {item:?} is not a number (comma-separated XIDs, or `none`)")]
pub struct XidListError {
    list: String,
    item: String,
}

impl HealthPolicy {
    /// Parses a comma-separated XID list (`13,31,43`); empty or `none`:
    /// no XID is ignored.
    pub fn parse_xids(list: &str) -> Result<BTreeSet<u64>, XidListError> {
        let trimmed = list.trim();
        if trimmed.is_empty() || trimmed.eq_ignore_ascii_case("none") {
            return Ok(BTreeSet::new());
        }
        trimmed
            .split(',')
            .map(|item| {
                item.trim().parse().map_err(|_| XidListError {
                    list: list.to_owned(),
                    item: item.trim().to_owned(),
                })
            })
            .collect()
    }

    /// What `event` means under this policy.
    pub fn classify(&self, event: HealthEvent) -> Verdict {
        if !self.enabled {
            return Verdict::Ignore(Ignored::Disabled);
        }
        match event {
            HealthEvent::Xid(Some(xid)) if self.ignored_xids.contains(&xid) => {
                Verdict::Ignore(Ignored::ApplicationXid(xid))
            }
            HealthEvent::Xid(xid) => Verdict::Fault(Fault::Xid(xid)),
            HealthEvent::EccCorrected => Verdict::Ignore(Ignored::Corrected),
            HealthEvent::EccUncorrected => Verdict::Fault(Fault::Ecc),
            HealthEvent::Lost => Verdict::Fault(Fault::Lost),
            HealthEvent::Found => Verdict::Recovered,
        }
    }
}

/// An unhealthy GPU, as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Unhealthy {
    /// The fault that decides the GPU's fate: lost first, then the sticky one.
    pub fault: Fault,
    /// Unix seconds at which the GPU became unhealthy.
    pub since: i64,
}

/// The faults of one GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Condition {
    /// An XID or ECC fault and when it came; kept until the daemon restarts.
    sticky: Option<(Fault, i64)>,
    /// When the GPU stopped answering; cleared when it answers again.
    lost: Option<i64>,
}

impl Condition {
    fn unhealthy(&self) -> Option<Unhealthy> {
        let since = match (self.sticky, self.lost) {
            (Some((_, a)), Some(b)) => a.min(b),
            (Some((_, a)), None) | (None, Some(a)) => a,
            (None, None) => return None,
        };
        let fault = match (self.sticky, self.lost) {
            (Some((fault, _)), _) if fault.evicts() => fault,
            (_, Some(_)) => Fault::Lost,
            (Some((fault, _)), None) => fault,
            (None, None) => return None,
        };
        Some(Unhealthy { fault, since })
    }

    /// Applies `verdict` at `now`.
    fn apply(&mut self, verdict: Verdict, now: i64) {
        match verdict {
            Verdict::Ignore(_) => {}
            Verdict::Fault(Fault::Lost) => {
                self.lost.get_or_insert(now);
            }
            // The first sticky fault stays unless a later one is worse.
            Verdict::Fault(fault) => match self.sticky {
                Some((old, _)) if old.evicts() || !fault.evicts() => {}
                _ => self.sticky = Some((fault, now)),
            },
            Verdict::Recovered => self.lost = None,
        }
    }
}

/// The health of the node's GPUs, by UUID; written by the observer's NVML
/// thread (or a test), read by whoever publishes it. Each change is logged
/// once, here.
pub struct HealthBoard {
    policy: HealthPolicy,
    gpus: Mutex<BTreeMap<String, Condition>>,
    /// Bumped on every change, to wake those who publish health.
    changes: watch::Sender<u64>,
}

impl HealthBoard {
    /// A board on which every GPU is healthy, classifying events by `policy`.
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            policy,
            gpus: Mutex::new(BTreeMap::new()),
            changes: watch::Sender::new(0),
        }
    }

    /// The policy events are classified by; the NVML observer starts its
    /// event thread only where it is enabled.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Records `event` on GPU `uuid`; returns whether its health changed.
    pub fn record(&self, uuid: &str, event: HealthEvent) -> bool {
        let verdict = self.policy.classify(event);
        if let Verdict::Ignore(why) = verdict {
            match why {
                Ignored::ApplicationXid(xid) => {
                    tracing::info!(gpu = uuid, xid, "XID ignored: the application's fault");
                }
                Ignored::Corrected => tracing::debug!(gpu = uuid, "corrected ECC error"),
                Ignored::Disabled => {}
            }
            return false;
        }
        let now = unix_now();
        let (before, after) = {
            let mut gpus = self.gpus.lock().unwrap_or_else(PoisonError::into_inner);
            let condition = gpus.entry(uuid.to_owned()).or_default();
            let before = *condition;
            condition.apply(verdict, now);
            let after = *condition;
            if after == Condition::default() {
                gpus.remove(uuid);
            }
            (before, after)
        };
        self.changed(uuid, before, after)
    }

    /// The GPUs that are unhealthy now, by UUID.
    pub fn unhealthy(&self) -> BTreeMap<String, Unhealthy> {
        self.gpus
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(|(uuid, c)| Some((uuid.clone(), c.unhealthy()?)))
            .collect()
    }

    /// Changes (to a counter) whenever a GPU's health does.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Logs and announces a change from `before` to `after`, if it is one.
    fn changed(&self, uuid: &str, before: Condition, after: Condition) -> bool {
        if before == after {
            return false;
        }
        match (before.unhealthy(), after.unhealthy()) {
            (_, Some(now)) => tracing::warn!(
                gpu = uuid,
                reason = now.fault.reason(),
                evicts = now.fault.evicts(),
                "GPU unhealthy"
            ),
            (Some(was), None) => {
                tracing::info!(gpu = uuid, was = was.fault.reason(), "GPU healthy again");
            }
            (None, None) => {}
        }
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
        true
    }
}

fn unix_now() -> i64 {
    i64::try_from(crate::clock::unix_secs()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xids_are_classified_as_nvidia_does() {
        let policy = HealthPolicy::default();
        for xid in DEFAULT_IGNORED_XIDS {
            assert_eq!(
                policy.classify(HealthEvent::Xid(Some(xid))),
                Verdict::Ignore(Ignored::ApplicationXid(xid))
            );
        }
        for xid in [48, 63, 64, 74, 79, 94, 95, 119] {
            assert_eq!(
                policy.classify(HealthEvent::Xid(Some(xid))),
                Verdict::Fault(Fault::Xid(Some(xid)))
            );
        }
        assert_eq!(
            policy.classify(HealthEvent::Xid(None)),
            Verdict::Fault(Fault::Xid(None))
        );
        assert_eq!(
            policy.classify(HealthEvent::EccCorrected),
            Verdict::Ignore(Ignored::Corrected)
        );
        assert_eq!(
            policy.classify(HealthEvent::EccUncorrected),
            Verdict::Fault(Fault::Ecc)
        );
        assert_eq!(
            policy.classify(HealthEvent::Lost),
            Verdict::Fault(Fault::Lost)
        );
        let off = HealthPolicy {
            enabled: false,
            ..HealthPolicy::default()
        };
        assert_eq!(
            off.classify(HealthEvent::Lost),
            Verdict::Ignore(Ignored::Disabled)
        );
    }

    #[test]
    fn reasons_effects_and_lists() {
        assert_eq!(Fault::Xid(Some(79)).reason(), "xid-79");
        assert_eq!(Fault::Xid(None).reason(), "xid-unknown");
        assert_eq!(Fault::Lost.reason(), "gpu-lost");
        assert!(Fault::Lost.evicts() && Fault::Xid(Some(79)).evicts());
        assert!(!Fault::Xid(Some(48)).evicts() && !Fault::Ecc.evicts());
        assert_eq!(
            HealthPolicy::parse_xids(" 13, 79 ").unwrap(),
            BTreeSet::from([13, 79])
        );
        assert!(HealthPolicy::parse_xids("none").unwrap().is_empty());
        assert!(HealthPolicy::parse_xids("").unwrap().is_empty());
        assert!(HealthPolicy::parse_xids("13,x").is_err());
    }

    #[test]
    fn sticky_faults_stay_and_lost_clears() {
        let board = HealthBoard::new(HealthPolicy::default());
        let changes = board.subscribe();
        assert!(!board.record("a", HealthEvent::Xid(Some(13))));
        assert!(!board.record("a", HealthEvent::Found));
        assert!(board.unhealthy().is_empty());
        assert!(!changes.has_changed().unwrap());

        assert!(board.record("a", HealthEvent::Xid(Some(48))));
        assert!(changes.has_changed().unwrap());
        // Still XID 48: a second one is no change; answering queries is not
        // a reset.
        assert!(!board.record("a", HealthEvent::Xid(Some(94))));
        assert!(!board.record("a", HealthEvent::Found));
        assert_eq!(board.unhealthy()["a"].fault, Fault::Xid(Some(48)));
        // A worse one replaces it.
        assert!(board.record("a", HealthEvent::Xid(Some(79))));
        assert_eq!(board.unhealthy()["a"].fault, Fault::Xid(Some(79)));

        assert!(board.record("b", HealthEvent::Lost));
        assert!(!board.record("b", HealthEvent::Lost));
        assert_eq!(board.unhealthy()["b"].fault, Fault::Lost);
        assert!(board.record("b", HealthEvent::Found));
        assert!(!board.unhealthy().contains_key("b"));

        // Lost over a sticky XID: lost while it lasts, the XID after.
        assert!(board.record("c", HealthEvent::Xid(Some(48))));
        assert!(board.record("c", HealthEvent::Lost));
        assert_eq!(board.unhealthy()["c"].fault, Fault::Lost);
        assert!(board.record("c", HealthEvent::Found));
        assert_eq!(board.unhealthy()["c"].fault, Fault::Xid(Some(48)));
        assert_eq!(board.unhealthy().keys().collect::<Vec<_>>(), ["a", "c"]);
    }
}
