//! The fast path of a swap: each process's limiter moves the memory it
//! backs itself (`CUDA_LIMITER_FAST_SWAP`) to pinned host memory and back,
//! at the speed of the link, on the daemon's `SwapOut` and `SwapIn` over
//! the command channel. Taken where every process of the pod is a worker
//! that registered with the setting; the driver's checkpoint otherwise.
//!
//! Out: the residency says `swapping_out` first (the pod's calls wait at
//! the limiter's gate), the pod's last call is checked again (a call that
//! slipped in makes the pod active: it runs on), then every worker is
//! asked; `swapped` once all moved and NVML finds no more left on the
//! GPUs than their contexts take. A process that refuses or fails (and so
//! undid its own part), or memory left that the limiters do not back,
//! makes the others bring their memory back, and the caller then tries
//! the checkpoint. In: every worker is
//! asked to bring its memory back; `resident` once all did. What the
//! processes report moved is what the board counts in host memory.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use gpushare_utils::protocol::{Command, CommandResult};
use http_bidir_comm::ClientId;
use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::{SwapError, SwapPath, Swapped};

use super::residence::Residence;
use super::{SwapRefusal, quiet_stamp};
use crate::Hypervisor;

/// The longest a process has to answer: its copies run at the speed of
/// the link, but its first swap-out pins its host buffers as it copies
/// (about 3.5 GiB/s on an H200 host, 2.5 under a serving load), and a swap
/// queued behind it waits for it.
pub(super) const ANSWER_WITHIN: Duration = Duration::from_secs(120);

/// How long a pod's processes have to answer a swap of `bytes`, each
/// way: [`ANSWER_FLOOR`], and a second a GiB (pinning as it copies runs at
/// 2.5 GiB/s and more), within [`ANSWER_WITHIN`]. A process that does not
/// answer (stopped, or lying) holds the node's swaps that long, not two
/// minutes each way.
pub(super) fn answer_within(bytes: u64) -> Duration {
    let per_gib = Duration::from_secs(1).mul_f64(bytes as f64 / f64::from(1u32 << 30));
    (ANSWER_FLOOR + per_gib).min(ANSWER_WITHIN)
}

/// What every swap's answer may take whatever its size: the process waits
/// for its own work first.
const ANSWER_FLOOR: Duration = Duration::from_secs(10);

/// What a process may leave on its GPUs after its own swap-out: its
/// context and the driver's memory for it (0.3 to 0.6 GiB on an H100 or
/// H200, more with many modules loaded). One that leaves more holds memory
/// its limiter does not back (managed memory, memory the program maps with
/// the VMM API itself, pools of `cuMemAllocAsync`, IPC imports): the fast
/// swap-out is undone and the driver's checkpoint, which takes all of a
/// process, is tried instead.
const LEFT_PER_PROCESS: u64 = 1 << 30;

/// How a fast swap-out ended.
pub(super) enum FastOut {
    /// The pod is in host memory: these bytes.
    Done(u64),
    /// The pod called CUDA as the swap began: it runs on, nothing moved.
    Active,
    /// A process could not: every one brought its memory back, and the
    /// checkpoint may be tried; why.
    Undone(String),
    /// A process's memory is shared with another by CUDA IPC: every one
    /// brought its memory back, and the checkpoint must not be tried (the
    /// driver takes such a process but cannot restore it); why.
    Shared(String),
}

/// How long a health check before a checkpoint waits for the pod's
/// processes to say whether their memory is shared.
const SHARED_ASK_WITHIN: Duration = Duration::from_secs(5);

/// Why a pod whose processes share memory by CUDA IPC is not swapped.
const SHARED: &str = "the pod's processes share device memory by CUDA IPC, which the driver's \
     checkpoint takes but cannot restore: the pod stays on its GPU";

impl Hypervisor {
    /// The pod's workers, where every one of its processes `pids` is a
    /// worker that registered with the fast swap; `None` otherwise.
    pub(super) fn fast_workers(&self, pod: &str, pids: &[u32]) -> Option<Vec<ClientId>> {
        let core = self.core();
        let ids = core.workers.of_pod(pod);
        let mut covered = BTreeSet::new();
        for id in &ids {
            let worker = core.workers.get(id)?;
            if !worker.fast_swap {
                return None;
            }
            covered.insert(worker.host_pid?);
        }
        (!ids.is_empty() && pids.iter().all(|pid| covered.contains(pid))).then_some(ids)
    }

    /// Why the pod must not be checkpointed: one of its processes answers
    /// that its memory is shared by CUDA IPC through its limiter (every
    /// answer says; a health check asks). Only processes that back their
    /// memory share it so, and only they are asked: `None` at once where
    /// the pod has none, and where none says so within
    /// [`SHARED_ASK_WITHIN`].
    pub(super) async fn memory_shared(&self, pod: &str) -> Option<String> {
        let workers: Vec<ClientId> = self
            .core()
            .workers
            .in_pod(pod)
            .filter(|w| w.fast_swap)
            .map(|w| w.id.clone())
            .collect();
        if workers.is_empty() {
            return None;
        }
        let answers = self
            .ask(&workers, &Command::Health, SHARED_ASK_WITHIN)
            .await;
        answers
            .iter()
            .find(|(_, answer)| matches!(answer, Ok(result) if result.shared))
            .map(|(worker, _)| format!("{SHARED}: {worker} holds shared memory"))
    }

    /// Swaps the pod out through its `workers`; see the module documentation.
    /// An error only where a process could not bring its memory back after
    /// another failed: the pod then stays away, for its next swap-in.
    pub(super) async fn fast_swap_out(
        &self,
        view: &SwapView,
        residence: &Residence<'_>,
        workers: &[ClientId],
        pids: &[u32],
    ) -> Result<FastOut, SwapRefusal> {
        let Some(stamp) = quiet_stamp(&view.region).await else {
            return Ok(FastOut::Active);
        };
        residence.swapping_out();
        // The residency first, then the stamp again: a call that read the
        // pod resident stamped before the store.
        if view.region.last_call_ms() != stamp {
            residence.swap_out_failed(&SwapError::Active.to_string());
            return Ok(FastOut::Active);
        }
        let started = Instant::now();
        let within = answer_within(view.bytes());
        let answers = self.ask(workers, &Command::SwapOut, within).await;
        let (bytes, _, mut failures) = tally(&answers);
        if failures.is_empty()
            && let Some(why) = self.left_on_gpus(pids, &answers).await
        {
            failures.push(why);
        }
        let out = Swapped {
            path: SwapPath::Fast,
            bytes,
            took: started.elapsed(),
            kept: 0,
        };
        if failures.is_empty() {
            residence.swapped_out(out);
            tracing::info!(pod = %view.pod, bytes, seconds = out.took.as_secs_f64(), "pod swapped out by its processes");
            return Ok(FastOut::Done(bytes));
        }
        let reason = failures.join("; ");
        // A process that answered a failure undid its own swap-out; the
        // others went out, or may have (no answer in time).
        let went_out: Vec<ClientId> = answers
            .iter()
            .filter(|(_, answer)| !matches!(answer, Ok(result) if !result.ok))
            .map(|(worker, _)| worker.clone())
            .collect();
        let back = self.ask(&went_out, &Command::SwapIn, within).await;
        let (_, _, stuck) = tally(&back);
        let shared = answers
            .iter()
            .any(|(_, answer)| matches!(answer, Ok(result) if result.shared));
        if stuck.is_empty() && shared {
            let why = format!("{SHARED}: {reason}");
            residence.swap_out_failed(&why);
            tracing::warn!(pod = %view.pod, %reason, "the pod shares memory by CUDA IPC; it stays on its GPU");
            return Ok(FastOut::Shared(why));
        }
        if stuck.is_empty() {
            residence.fast_declined(&reason);
            tracing::info!(pod = %view.pod, %reason, "the fast swap-out was undone");
            return Ok(FastOut::Undone(reason));
        }
        let error = format!(
            "{reason}; and bringing it back failed: {}",
            stuck.join("; ")
        );
        residence.left_away(out, &error);
        tracing::error!(pod = %view.pod, %error, "a fast swap-out failed half-way; the pod stays in host memory");
        Err(SwapRefusal::Fast(error))
    }

    /// Why the pod cannot stay out by the fast path: its processes `pids`
    /// still hold more on the GPUs than their contexts take, by NVML (by
    /// their own reports where NVML cannot tell; where neither can, the
    /// checkpoint is safer); `None` where they do not.
    async fn left_on_gpus(
        &self,
        pids: &[u32],
        answers: &[(ClientId, Result<CommandResult, String>)],
    ) -> Option<String> {
        let allowed = LEFT_PER_PROCESS.saturating_mul(pids.len() as u64);
        let seen = self.nvml_bytes(pids).await;
        let left = if seen.is_empty() {
            answers
                .iter()
                .map(|(_, answer)| answer.as_ref().ok()?.swap.as_ref()?.unmoved_bytes)
                .try_fold(0u64, |sum, bytes| Some(sum.saturating_add(bytes?)))
        } else {
            Some(
                seen.values()
                    .fold(0u64, |sum, &bytes| sum.saturating_add(bytes)),
            )
        };
        match left {
            Some(left) if left <= allowed => None,
            Some(left) => Some(format!(
                "its processes still hold {left} bytes on the GPUs after their own swap-out, more than \
                 the {allowed} their contexts may: memory the limiter does not back (managed, mapped \
                 by the program itself, pools of cuMemAllocAsync, IPC)"
            )),
            None => Some(
                "what its processes still hold on the GPUs after their own swap-out cannot be told"
                    .to_owned(),
            ),
        }
    }

    /// Brings the pod back through its workers; what it took since
    /// `started` (a restore of its processes for a move included).
    pub(super) async fn fast_swap_in(
        &self,
        view: &SwapView,
        residence: &Residence<'_>,
        started: Instant,
    ) -> Result<Duration, SwapRefusal> {
        let workers = self.workers_of(&view.pod);
        residence.swapping_in();
        let within = answer_within(view.bytes());
        let answers = self.ask(&workers, &Command::SwapIn, within).await;
        let (bytes, kept, failures) = tally(&answers);
        if failures.is_empty() {
            let back = Swapped {
                path: SwapPath::Fast,
                bytes,
                took: started.elapsed(),
                // Copies are of the pod's memory on its GPUs: a process
                // reporting more is believed only up to that.
                kept: kept.min(view.bytes()),
            };
            residence.swapped_in(back);
            self.copies_kept(view, kept >= bytes);
            tracing::info!(pod = %view.pod, bytes, seconds = back.took.as_secs_f64(), "pod swapped in by its processes");
            return Ok(back.took);
        }
        let error = failures.join("; ");
        residence.swap_in_failed(&error);
        tracing::error!(pod = %view.pod, %error, "fast swap-in failed; the pod stays in host memory");
        Err(SwapRefusal::Fast(error))
    }

    /// After a swap-in by the checkpoint of a pod this run did not swap
    /// out (an earlier run did): each worker brings back what a fast
    /// swap-out of that run left in host memory; one without the setting,
    /// or with nothing away, has nothing to do.
    pub(super) async fn fast_swap_in_after_restart(&self, pod: &str) {
        let workers = self.workers_of(pod);
        for (worker, answer) in self.ask(&workers, &Command::SwapIn, ANSWER_WITHIN).await {
            match answer {
                Ok(CommandResult {
                    swap: Some(report), ..
                }) if report.bytes > 0 => {
                    tracing::info!(pod, %worker, bytes = report.bytes, "memory an earlier run left in host memory is back");
                }
                _ => {}
            }
        }
    }
}

/// The bytes the workers' answers say moved, the pinned host memory they
/// keep after, and why each that failed did.
fn tally(answers: &[(ClientId, Result<CommandResult, String>)]) -> (u64, u64, Vec<String>) {
    let (mut bytes, mut kept) = (0u64, 0u64);
    let mut failures = Vec::new();
    for (worker, answer) in answers {
        match answer {
            Ok(result) if result.ok => {
                if let Some(report) = &result.swap {
                    tracing::info!(%worker, ?report, "a process's fast swap");
                    bytes = bytes.saturating_add(report.bytes);
                    kept = kept.saturating_add(report.pinned_bytes);
                }
            }
            Ok(result) => failures.push(format!("{worker}: {}", result.message)),
            Err(why) => failures.push(format!("{worker}: {why}")),
        }
    }
    (bytes, kept, failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_swap_answer_is_awaited_for_its_size_within_bounds() {
        const GIB: u64 = 1 << 30;
        assert_eq!(answer_within(0), ANSWER_FLOOR);
        assert_eq!(answer_within(12 * GIB), Duration::from_secs(22));
        assert_eq!(answer_within(30 * GIB), Duration::from_secs(40));
        assert_eq!(answer_within(500 * GIB), ANSWER_WITHIN);
    }
}
