//! Fail closed under a hypervisor: where a process's limits come from.
//!
//! A process with `CUDA_LIMITER_HYPERVISOR` set waits, bounded by
//! `CUDA_LIMITER_GRANT_TIMEOUT_MS` (5 s by default), for its grant: the pod's
//! limits object, published by the hypervisor, owned by a trusted uid and
//! writable by nobody else. Then the hypervisor's limits apply, read-only,
//! even if the hypervisor is down now or refused this process's
//! registration (its last limits still bind the pod). Otherwise (daemon
//! down, bad address, wrong or empty token, unknown pod, and no limits
//! object for the pod):
//! - with local limits in the environment, those apply (one line says so);
//! - without, CUDA refuses to initialise (`cuInit` fails) with one line.
//!
//! A refusal that cannot change (the hypervisor answered 4xx) ends the wait
//! at once.

use std::time::{Duration, Instant};

use gpushare_utils::limits::{LimitsError, PodLimits};
use gpushare_utils::shm::Trust;

use crate::hypervisor::{Link, LinkStatus};

/// Where the limits of this process come from.
pub enum Grant {
    /// The hypervisor's, mapped read-only.
    Hypervisor(PodLimits),
    /// The environment's (local mode, or the fallback).
    Local,
    /// None: CUDA is refused; the line already printed.
    Refused,
}

/// How often the wait looks at the link again.
const POLL: Duration = Duration::from_millis(10);

/// Waits for the hypervisor's grant; see the module documentation.
pub fn decide(
    link: &'static Link,
    pod: &str,
    trust: &Trust,
    timeout: Duration,
    local_limits: bool,
) -> Grant {
    link.start();
    let deadline = Instant::now() + timeout;
    let mut last;
    let reason = loop {
        match PodLimits::open_read_only(pod, trust) {
            Ok(limits) => {
                match link.status() {
                    LinkStatus::Registered => {}
                    // The hypervisor is away or refused this process: its
                    // last published limits still bind the pod.
                    LinkStatus::Pending(reason) | LinkStatus::Refused(reason) => eprintln!(
                        "cuda-limiter: not registered with the hypervisor at {} ({reason}); the pod's last published limits apply",
                        link.address()
                    ),
                }
                tracing::info!(limits = limits.name(), "hypervisor limits in force");
                return Grant::Hypervisor(limits);
            }
            // A squatted or foreign object never becomes right.
            Err(error @ (LimitsError::Shm(_) | LimitsError::Foreign { .. })) => {
                break error.to_string();
            }
            Err(error) => last = error.to_string(),
        }
        match link.status() {
            // Registered but nothing published yet: the hypervisor is about to.
            LinkStatus::Registered => {}
            // Refused (wrong or empty token, unknown pod): nothing will come.
            LinkStatus::Refused(reason) => break format!("{reason}; {last}"),
            LinkStatus::Pending(reason) => last = format!("{reason}; {last}"),
        }
        if Instant::now() >= deadline {
            break last;
        }
        std::thread::sleep(POLL);
    };
    let waited = timeout.as_millis();
    if local_limits {
        eprintln!(
            "cuda-limiter: no limits from the hypervisor at {} within {waited} ms ({reason}); the local limits apply",
            link.address()
        );
        Grant::Local
    } else {
        let message = format!(
            "cuda-limiter: no limits from the hypervisor at {} within {waited} ms ({reason}) and no local limit is set; CUDA refuses to initialise",
            link.address()
        );
        eprintln!("{message}");
        Grant::Refused
    }
}
