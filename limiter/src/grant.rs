//! Fail closed under a hypervisor: where a process's limits come from.
//!
//! A process with `CUDA_LIMITER_HYPERVISOR` set waits, bounded by
//! `CUDA_LIMITER_GRANT_TIMEOUT_MS` (5 s by default), for its grant: the
//! hypervisor accepted its registration (or cannot be reached at all), and
//! the pod's limits object is published, owned by a trusted uid and writable
//! by nobody else. Then the hypervisor's limits apply, read-only; a
//! hypervisor that is down leaves the pod's last published limits in force.
//! Otherwise (registration refused: wrong or empty token, unknown pod; or no
//! limits object: daemon down or unreachable since before the pod started):
//! - with local limits in the environment, those apply (one line says so);
//! - without, CUDA refuses to initialise (`cuInit` fails) with one line.
//!
//! A refusal that cannot change (the hypervisor answered 4xx, or the limits
//! object is squatted) ends the wait at once.
//!
//! Wherever the pod's limits are published, local limits never replace
//! them: the environment only chooses the pod. A process of the pod that
//! drops `CUDA_LIMITER_HYPERVISOR`, or that sets local limits and whose
//! registration is refused (a wrong token), runs on the pod's published
//! limits.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpushare_utils::limits::{LimitsError, PodLimits};
use gpushare_utils::shm::Trust;

use crate::driver::Driver;
use crate::hypervisor::{Link, LinkStatus};

/// Where the limits of this process come from.
pub(crate) enum Grant {
    /// The hypervisor's, mapped read-only.
    Hypervisor(PodLimits),
    /// The environment's (local mode, or the fallback).
    Local,
    /// None: CUDA is refused; the line already printed.
    Refused,
}

/// How often the wait looks at the link again.
const POLL: Duration = Duration::from_millis(10);

/// Waits for the hypervisor's grant; see the module documentation. `driver`
/// is where the link finds the GPUs this process sees, once it has them.
pub(crate) fn decide(
    link: &'static Link,
    driver: &'static OnceLock<Driver>,
    pod: &str,
    trust: &Trust,
    timeout: Duration,
    local_limits: bool,
) -> Grant {
    link.start(driver);
    let started = Instant::now();
    let deadline = started + timeout;
    let mut last = "no answer from the hypervisor".to_owned();
    let reason = loop {
        let status = link.status();
        if let LinkStatus::Refused(reason) = status {
            // Wrong or empty token, unknown pod: this process is not the
            // pod's, and nothing will change that.
            break reason;
        }
        if matches!(status, LinkStatus::Registered | LinkStatus::Unreachable(_)) {
            match PodLimits::open_read_only(pod, trust) {
                Ok(limits) => {
                    if let LinkStatus::Unreachable(reason) = status {
                        eprintln!(
                            "cuda-limiter: the hypervisor at {} is unreachable ({reason}); the pod's last published limits apply",
                            link.address()
                        );
                    }
                    tracing::info!(limits = limits.name(), "hypervisor limits in force");
                    return Grant::Hypervisor(limits);
                }
                // A squatted or foreign object never becomes right.
                Err(error @ (LimitsError::Shm(_) | LimitsError::Foreign { .. })) => {
                    break error.to_string();
                }
                Err(error) => {
                    last = match status {
                        LinkStatus::Unreachable(reason) => format!("{reason}; {error}"),
                        _ => error.to_string(),
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            break last;
        }
        std::thread::sleep(POLL);
    };
    // What happened: a refusal that came at once says so, not the timeout.
    let waited = started.elapsed().as_millis();
    if local_limits {
        let why = format!(
            "no grant from the hypervisor at {} ({reason}) and local limits are set",
            link.address()
        );
        if let Some(grant) = published(pod, trust, &why) {
            return grant;
        }
        eprintln!(
            "cuda-limiter: no limits from the hypervisor at {} after {waited} ms ({reason}); the local limits apply",
            link.address()
        );
        Grant::Local
    } else {
        let message = format!(
            "cuda-limiter: no limits from the hypervisor at {} after {waited} ms ({reason}) and no local limit is set; CUDA refuses to initialise",
            link.address()
        );
        eprintln!("{message}");
        Grant::Refused
    }
}

/// The pod's published limits, when a trusted owner published them; says
/// once why they apply (`why`: what kept the hypervisor from granting them).
pub(crate) fn published(pod: &str, trust: &Trust, why: &str) -> Option<Grant> {
    let limits = PodLimits::open_read_only(pod, trust).ok()?;
    eprintln!(
        "cuda-limiter: {why}; the limits the node's hypervisor published for pod {pod} apply"
    );
    Some(Grant::Hypervisor(limits))
}
