//! Host copies that resident pods' processes keep of their fast swaps.
//!
//! A process that swapped its memory out by the fast path keeps its pinned
//! host copies after it is back on the GPU: its next swap-out then runs at
//! the speed of the link instead of pinning first. Those copies are host
//! memory all the same, so they count against `[swap] host_limit` beside
//! the bytes of pods away; when a swap-out needs room under the cap, other
//! pods' kept copies are given back (`Command::ReleaseHost`), the largest
//! first, before the swap-out is refused.

use gpushare_utils::protocol::{Command, CommandResult};

use super::SwapRefusal;
use super::fast::ANSWER_WITHIN;
use crate::Hypervisor;

impl Hypervisor {
    /// Makes room under `[swap] host_limit` for `pod`'s swap-out of
    /// `bytes`; see the module documentation. The pod's own kept copies
    /// hold its bytes already: it needs only the rest.
    pub(super) async fn host_room_for(&self, pod: &str, bytes: u64) -> Result<(), SwapRefusal> {
        let limit = self.core().settings.swap.host_limit;
        loop {
            let report = self.swap_status();
            let own = report
                .pods
                .get(pod)
                .map_or(0, |p| p.history.host_kept_bytes);
            let needed = bytes.saturating_sub(own);
            let on_host = report
                .totals
                .bytes_on_host
                .saturating_add(report.totals.host_kept_bytes)
                .saturating_sub(own);
            if on_host.saturating_add(needed) <= limit {
                return Ok(());
            }
            let largest = report
                .pods
                .iter()
                .filter(|(other, swap)| *other != pod && swap.history.host_kept_bytes > 0)
                .max_by_key(|(_, swap)| swap.history.host_kept_bytes)
                .map(|(other, _)| other.clone());
            let full = SwapRefusal::HostFull {
                on_host,
                limit,
                bytes: needed,
            };
            match largest {
                // Nothing given back: refused rather than asked again.
                Some(other) if self.release_host_of(&other).await > 0 => {}
                _ => return Err(full),
            }
        }
    }

    /// Asks `pod`'s processes to give back the host copies they keep;
    /// records what they keep after (a process that did not answer keeps
    /// its own). The bytes given back.
    pub(super) async fn release_host_of(&self, pod: &str) -> u64 {
        let workers = self.workers_of(pod);
        let answers = self
            .ask(&workers, &Command::ReleaseHost, ANSWER_WITHIN)
            .await;
        let mut released = 0u64;
        for (worker, answer) in answers {
            match answer {
                Ok(CommandResult {
                    ok: true,
                    swap: Some(report),
                    ..
                }) => released = released.saturating_add(report.bytes),
                Ok(CommandResult { message, .. }) => {
                    tracing::warn!(pod, %worker, %message, "host copies not given back");
                }
                Err(why) => tracing::warn!(pod, %worker, %why, "host copies not given back"),
            }
        }
        let board = self.swap_board();
        let kept = board.history(pod).host_kept_bytes.saturating_sub(released);
        board.host_released(pod, kept);
        tracing::info!(
            pod,
            released,
            kept,
            "a resident pod's host copies given back for another's swap"
        );
        released
    }
}
