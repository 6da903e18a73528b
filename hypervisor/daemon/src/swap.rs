//! Swapping pods to host memory and back: what an operator asks
//! (`POST …/pods/{id}/swap-out`, `…/swap-in`), what a swapped pod's trapped
//! CUDA call asks (`POST /api/v1/swap-in`), and the room made on a GPU for
//! a pod that needs memory it does not have free (`POST /api/v1/room`,
//! memory overcommit). `hypervisor-swap` does the driver's part; this module
//! picks the processes, keeps the pod's residency in its limits object alone
//! ([`residence`]: its processes' calls wait while it is away, a restarted
//! daemon finds it, the status reads it) and serialises swaps: one at a time
//! on the node, since each is bound by the same host link.
//!
//! Two paths ([`SwapPath`]): where every process of the pod backs its
//! memory itself (`CUDA_LIMITER_FAST_SWAP`), its limiters move it at the
//! speed of the link ([`fast`]); otherwise, or where one of them cannot,
//! the driver's checkpoint of every process. The board records which path
//! each swap took.
//!
//! A swap, once begun, runs to its end in a task of its own
//! ([`Hypervisor::exclusive`]): a request that stops waiting (its client
//! gone, its wait over) leaves no pod half-swapped, and a pod's residency
//! always says where the driver put its processes.
//!
//! What stays resident on a GPU that overcommits is the policy's
//! (`hypervisor-swap`'s `policy`, from the pods' uses that [`ahead`]
//! samples): idle pods go to make room on demand ([`room`]) and, to keep a
//! GPU's `headroom` free, ahead of need ([`ahead`]); trapped calls' swap-ins
//! are served in the order their pods asked ([`asked`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare_utils::clock::monotonic_ms;
use gpushare_utils::limits::Residency;
use gpushare_utils::protocol::SwapAnswer;
use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::asks::Asks;
use hypervisor_swap::{
    CheckpointDriver, Direction, DriverError, HostShort, ServingBoard, SwapBoard, SwapCause,
    SwapError, SwapPath, Swapped, Uses, WaitCause, stamp_age,
};
use residence::Residence;

use crate::{Hypervisor, lock};

mod ahead;
mod asked;
mod fast;
mod fast_move;
mod held;
mod kept;
mod relocate;
mod residence;
mod room;

pub(crate) use ahead::USE_SAMPLE;
pub use relocate::{DrainReport, MoveAnswer};
pub use room::{ROOM_ASKS_PER_POD, RoomMade, RoomSlot};

/// A swap-out begins once the pod's last call is this old: its processes
/// stamp calls from a coarse clock (a tick, a few milliseconds, behind at
/// most), so a call after that moment stamps a newer value, which the
/// check after the lock sees.
const QUIET_MS: u64 = 20;
/// How long a swap-out waits for the pod to be quiet that long.
const QUIET_WAIT: Duration = Duration::from_secs(1);

/// The daemon's swapping: the board, the driver (loaded at first use) and
/// the lock that keeps swaps one at a time.
#[derive(Default)]
pub(crate) struct Swapper {
    board: SwapBoard,
    /// Swaps by cause, waits by cause, the last swaps.
    serving: ServingBoard,
    /// Each pod's uses, sampled ([`ahead`]), which rank idle pods.
    uses: Uses,
    /// Swapped pods waiting for room, in the order they asked.
    asks: Asks,
    /// The room asks each pod has in flight ([`room`]).
    room_asks: room::RoomAsks,
    driver: Mutex<Option<Arc<CheckpointDriver>>>,
    /// Held by the swap under way ([`Hypervisor::exclusive`]).
    ops: Arc<tokio::sync::Mutex<()>>,
    /// Whether a pod's processes are preparing host copies ([`kept`]).
    preparing: AtomicBool,
    /// The pod whose processes are preparing them.
    being_prepared: Mutex<Option<String>>,
    /// What each pod held on its GPUs, by its ledger, when its processes
    /// were last asked for the copies they lacked; forgotten once they
    /// give their copies back ([`kept`]).
    prepared_at: Mutex<BTreeMap<String, u64>>,
    /// Pods' GPUs are given by Kubernetes (a DRA allocation, or a device
    /// plugin's device files, names each): pods swap, never move.
    pinned: AtomicBool,
    /// The pids pods named that are not theirs, logged once.
    pub(crate) unproven: crate::processes::Unproven,
}

/// Why a swap was not done.
#[derive(Debug, thiserror::Error)]
pub enum SwapRefusal {
    /// No such pod is scheduled.
    #[error("no pod {0}")]
    UnknownPod(String),
    /// The node has no such GPU.
    #[error("{0} is not a GPU of this node")]
    UnknownGpu(String),
    /// The driver cannot swap (no driver, or one without the checkpoint API).
    #[error("swap needs the driver's checkpoint API: {0}")]
    Unsupported(DriverError),
    /// Another swapped pod, which asked first, waits for room on a GPU of
    /// this one: this one waits behind it.
    #[error("{first} asked first and waits for room on the pod's GPU")]
    Behind {
        /// The first pod waiting there.
        first: String,
    },
    /// Swapping the pod out would pass the host-memory cap.
    #[error(
        "host memory for swapped pods is full: {on_host} of {limit} bytes taken, the pod holds {bytes}"
    )]
    HostFull {
        /// Bytes in host memory now: of swapped pods, and the host copies
        /// resident pods keep that could not be given back.
        on_host: u64,
        /// The cap (`[swap] host_limit`).
        limit: u64,
        /// What the pod would add.
        bytes: u64,
    },
    /// The host's memory cannot take what the checkpoint would put there.
    #[error(transparent)]
    HostShort(#[from] HostShort),
    /// The engine's refusal or failure.
    #[error(transparent)]
    Swap(#[from] SwapError),
    /// The scheduler does not allow the move (no such GPU, the pod is there
    /// already, a co-run GPU, limits that cannot follow).
    #[error("the pod cannot move: {0}")]
    Move(String),
    /// Kubernetes gave the pod its GPU: it may be swapped, not moved.
    #[error(
        "the pod's GPU was given by Kubernetes (its DRA allocation or device-plugin device names it); swap it instead"
    )]
    Pinned,
    /// The GPU the pod would move to, or come back to, lacks the memory it
    /// holds, and no idle pod could make the room.
    #[error("{gpu} has {free} bytes free; the pod holds {need}")]
    NoRoom {
        /// The GPU asked for.
        gpu: String,
        /// Bytes free there.
        free: u64,
        /// Bytes the pod holds on the GPU it leaves.
        need: u64,
    },
    /// The blocking task that called the driver did not finish.
    #[error("the swap task failed: {0}")]
    Task(String),
    /// The pod's processes share device memory by CUDA IPC: neither path
    /// can swap it (why, and what each process answered).
    #[error("{0}")]
    Shared(String),
    /// The pod's processes' own swap failed and left the pod in host
    /// memory (a swap-in, tried again at the next ask; or a swap-out that
    /// could not be undone).
    #[error("the fast swap failed, the pod stays in host memory: {0}")]
    Fast(String),
}

impl SwapRefusal {
    /// Whether the pod was left where it was asked to leave (a refusal) as
    /// opposed to a failure half-way that needs another try.
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            Self::Swap(SwapError::Restore(_)) | Self::Task(_) | Self::Fast(_)
        )
    }
}

impl Hypervisor {
    /// Each pod's swap history and the node's totals.
    pub(crate) fn swap_board(&self) -> &SwapBoard {
        &self.shared.swapper.board
    }

    /// Checkpoints every process of `pod` to host memory: its device memory
    /// is freed, its quota and ledger stay, and its processes' next CUDA
    /// call brings it back. A pod that is active (a CUDA call as the swap
    /// begins) or whose memory the driver cannot checkpoint runs on.
    pub async fn swap_out(&self, pod: &str) -> Result<SwapAnswer, SwapRefusal> {
        let pod = pod.to_owned();
        self.exclusive(move |hv| async move {
            let view = hv.view(&pod)?;
            hv.swap_out_counted(&view, SwapCause::Operator).await?;
            Ok(answer(&view))
        })
        .await
    }

    /// Restores every process of `pod` onto its GPUs (making room there
    /// first where the GPU overcommits), then lets them run.
    pub async fn swap_in(&self, pod: &str) -> Result<SwapAnswer, SwapRefusal> {
        let pod = pod.to_owned();
        self.exclusive(move |hv| async move {
            let view = hv.view(&pod)?;
            hv.swap_in_counted(&view, SwapCause::Operator).await?;
            Ok(answer(&view))
        })
        .await
    }

    /// A swap of `view`'s pod was done `direction` for `cause`: counted,
    /// and a pod brought back is left resident for a while where others
    /// can go; brought back for its call, that call's use runs through its
    /// wait.
    fn swapped(&self, view: &SwapView, direction: Direction, cause: SwapCause) {
        let pod = view.pod.as_str();
        self.shared.swapper.serving.swapped(pod, direction, cause);
        if direction == Direction::In {
            let waiting = (cause == SwapCause::Demand).then(|| view.region.last_call_ms());
            self.shared
                .swapper
                .uses
                .brought_back(pod, monotonic_ms(), waiting);
        }
    }

    /// [`Self::swap_out_locked`] of an idle pod, counted for `cause` where
    /// it was resident.
    async fn swap_out_counted(&self, view: &SwapView, cause: SwapCause) -> Result<(), SwapRefusal> {
        let away = view.region.residency() == Residency::Swapped;
        self.swap_out_locked(view, Wait::Quiet).await?;
        if !away {
            self.swapped(view, Direction::Out, cause);
        }
        Ok(())
    }

    /// [`Self::swap_in_locked`], counted for `cause` where the pod was
    /// away; what it took, `None` when it was resident.
    async fn swap_in_counted(
        &self,
        view: &SwapView,
        cause: SwapCause,
    ) -> Result<Option<Duration>, SwapRefusal> {
        // A move whose restore failed before (or that a restarted daemon
        // found) ends here, on the new GPU.
        let moving = view.region.pending_move().is_some();
        let took = self.swap_in_locked(view).await?;
        if let Some(took) = took {
            self.swapped(view, Direction::In, cause);
            if moving {
                self.swap_board().moved(&view.pod, took);
            }
        }
        Ok(took)
    }

    /// Runs `op` alone among the node's swaps, and to its end. Waiting for
    /// the swap under way ends with the caller (nothing has begun); once
    /// `op` begins it runs in a task of its own, which a caller that stops
    /// waiting (its client gone, its wait over) does not stop, so no swap
    /// is left half-done and no pod's residency other than the driver's.
    async fn exclusive<T, Op, Fut>(&self, op: Op) -> Result<T, SwapRefusal>
    where
        Op: FnOnce(Hypervisor) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, SwapRefusal>> + Send + 'static,
        T: Send + 'static,
    {
        let one = Arc::clone(&self.shared.swapper.ops).lock_owned().await;
        let hv = self.clone();
        tokio::spawn(async move {
            let _one = one;
            op(hv).await
        })
        .await
        .map_err(|error| SwapRefusal::Task(error.to_string()))?
    }

    fn view(&self, pod: &str) -> Result<SwapView, SwapRefusal> {
        self.core()
            .scheduler
            .swap_view(pod)
            .ok_or_else(|| SwapRefusal::UnknownPod(pod.to_owned()))
    }

    /// Pods' GPUs are given by Kubernetes from now on: they swap, never move.
    pub fn pin_placements(&self) {
        self.shared.swapper.pinned.store(true, Ordering::Relaxed);
    }

    fn placements_pinned(&self) -> bool {
        self.shared.swapper.pinned.load(Ordering::Relaxed)
    }

    async fn swap_out_locked(&self, view: &SwapView, wait: Wait) -> Result<u64, SwapRefusal> {
        let region = Arc::clone(&view.region);
        let residence = Residence::new(view, self.swap_board());
        if residence.residency() == Residency::Swapped {
            return Ok(0);
        }
        // What the processes really hold, by the driver: a pod's ledger
        // may add to it, never lower it below what the host must take.
        let pids = self.pids_of(&view.pod).await;
        let bytes = self.held_bytes(view, &pids).await;
        self.host_room_for(&view.pod, bytes).await?;
        // Where every process can, its limiter moves its memory itself; a
        // move needs the checkpoint (its processes are restored on the
        // other GPU).
        let fast = match wait {
            Wait::Quiet => self.fast_workers(&view.pod, &pids),
            Wait::No => None,
        };
        // The fast path fills the host copies its processes keep already
        // and pins only the rest; the checkpoint puts all of it in host
        // memory (checked again should the fast path be undone).
        let kept = match fast {
            Some(_) => self.swap_board().history(&view.pod).host_kept_bytes,
            None => 0,
        };
        host_takes(bytes.saturating_sub(kept))?;
        if let Some(workers) = fast {
            match self
                .fast_swap_out(view, &residence, &workers, &pids)
                .await?
            {
                fast::FastOut::Done(moved) => return Ok(moved),
                fast::FastOut::Active => return Err(SwapRefusal::Swap(SwapError::Active)),
                fast::FastOut::Shared(why) => return Err(SwapRefusal::Shared(why)),
                fast::FastOut::Undone(reason) => {
                    tracing::info!(pod = %view.pod, %reason, "the pod's processes could not swap themselves; the driver's checkpoint is tried");
                    host_takes(bytes)?;
                }
            }
        }
        // The driver takes a process holding memory shared by CUDA IPC
        // through its limiter, but cannot restore it.
        if let Some(why) = self.memory_shared(&view.pod).await {
            residence.swap_out_failed(&why);
            return Err(SwapRefusal::Shared(why));
        }
        let driver = self.checkpoint_driver().await?;
        let quiet = match wait {
            Wait::Quiet => quiet_stamp(&region).await,
            Wait::No => Some(region.last_call_ms()),
        };
        let outcome = match quiet {
            Some(stamp) => {
                // The residency first, then the stamp again after the lock:
                // a call that read the pod resident stamped before this
                // store (each side writes, then reads the other's word).
                residence.swapping_out();
                let idle_region = Arc::clone(&region);
                tokio::task::spawn_blocking(move || {
                    hypervisor_swap::swap_out(&driver, &pids, || {
                        wait == Wait::No || idle_region.last_call_ms() == stamp
                    })
                })
                .await
            }
            None => Ok(Err(SwapError::Active)),
        };
        match flatten(outcome) {
            Ok(timing) => {
                residence.swapped_out(Swapped {
                    path: SwapPath::Checkpoint,
                    bytes,
                    took: timing.total(),
                    kept: 0,
                });
                tracing::info!(pod = %view.pod, bytes, seconds = timing.total().as_secs_f64(), "pod swapped out");
                Ok(bytes)
            }
            Err(error) => {
                residence.swap_out_failed(&error.to_string());
                tracing::warn!(pod = %view.pod, %error, "swap-out not done; the pod runs on");
                Err(error)
            }
        }
    }

    /// Brings the pod back (onto the GPU it moves to, when a move is under
    /// way) by the path it left by; what it took, `None` when it was
    /// resident.
    async fn swap_in_locked(&self, view: &SwapView) -> Result<Option<Duration>, SwapRefusal> {
        let residence = Residence::new(view, self.swap_board());
        if residence.residency() == Residency::Resident {
            return Ok(None);
        }
        let room = std::time::Instant::now();
        if self.room_for(view).await? > 0 {
            let serving = &self.shared.swapper.serving;
            serving.waited(WaitCause::SwapOut, room.elapsed());
        }
        let began = std::time::Instant::now();
        let history = self.swap_board().history(&view.pod);
        if history.last_swap_out_path == Some(SwapPath::Fast) {
            // Processes checkpointed after their own swap-out (for a move)
            // are restored first, onto the GPU the pod moves to.
            if history.contexts_checkpointed {
                self.restore_processes(view, &residence).await?;
                self.swap_board().contexts_checkpointed(&view.pod, false);
            }
            let took = self.fast_swap_in(view, &residence, began).await?;
            let serving = &self.shared.swapper.serving;
            serving.waited(WaitCause::SwapIn, began.elapsed());
            return Ok(Some(took));
        }
        let timing = self.restore_processes(view, &residence).await?;
        // A pod an earlier run swapped may have left by either path.
        if history.last_swap_out_path.is_none() {
            self.fast_swap_in_after_restart(&view.pod).await;
        }
        self.copies_kept(view, false);
        residence.swapped_in(Swapped {
            path: SwapPath::Checkpoint,
            bytes: history.bytes_on_host,
            took: timing.total(),
            kept: 0,
        });
        tracing::info!(pod = %view.pod, seconds = timing.total().as_secs_f64(), "pod swapped in");
        let serving = &self.shared.swapper.serving;
        serving.waited(WaitCause::SwapIn, began.elapsed());
        Ok(Some(timing.total()))
    }

    /// The driver's restore of the pod's checkpointed processes (onto the
    /// GPU it moves to, when a move is under way, which ends it), which
    /// lets them run.
    async fn restore_processes(
        &self,
        view: &SwapView,
        residence: &Residence<'_>,
    ) -> Result<hypervisor_swap::Timing, SwapRefusal> {
        let pids = self.pids_of(&view.pod).await;
        let driver = self.checkpoint_driver().await?;
        let pending = self.pending_move(view);
        let pairs = match &pending {
            Some(to) => relocate::pairs(to, &self.node_gpus())?,
            None => Vec::new(),
        };
        residence.swapping_in();
        let outcome =
            tokio::task::spawn_blocking(move || hypervisor_swap::swap_in(&driver, &pids, &pairs))
                .await;
        match flatten(outcome) {
            Ok(timing) => {
                if pending.is_some() {
                    view.region.set_pending_move(None);
                }
                Ok(timing)
            }
            Err(error) => {
                residence.swap_in_failed(&error.to_string());
                tracing::error!(pod = %view.pod, %error, "swap-in failed; the pod stays in host memory");
                Err(error)
            }
        }
    }

    async fn checkpoint_driver(&self) -> Result<Arc<CheckpointDriver>, SwapRefusal> {
        if let Some(driver) = lock(&self.shared.swapper.driver).as_ref() {
            return Ok(Arc::clone(driver));
        }
        let library = self.core().settings.swap.cuda_library.clone();
        let loaded = tokio::task::spawn_blocking(move || CheckpointDriver::load(&library))
            .await
            .map_err(|e| SwapRefusal::Task(e.to_string()))?
            .map_err(SwapRefusal::Unsupported)?;
        let driver = Arc::new(loaded);
        *lock(&self.shared.swapper.driver) = Some(Arc::clone(&driver));
        Ok(driver)
    }
}

/// What a swap-out waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The pod quiet for [`QUIET_MS`], and still after the lock: an idle
    /// pod's swap, which an active pod refuses.
    Quiet,
    /// Nothing: the lock waits for the work the pod submitted, and its
    /// calls meanwhile wait in the driver until it is back (a move).
    No,
}

/// The pod's last-call stamp once it is [`QUIET_MS`] old; `None` when the
/// pod keeps calling for [`QUIET_WAIT`].
async fn quiet_stamp(region: &hypervisor_core::region::PodRegion) -> Option<u64> {
    let deadline = tokio::time::Instant::now() + QUIET_WAIT;
    loop {
        let stamp = region.last_call_ms();
        let age = stamp_age(stamp, monotonic_ms());
        if age >= QUIET_MS {
            return Some(stamp);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(QUIET_MS - age)).await;
    }
}

fn flatten<T>(
    outcome: Result<Result<T, SwapError>, tokio::task::JoinError>,
) -> Result<T, SwapRefusal> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(SwapRefusal::Swap(error)),
        Err(error) => Err(SwapRefusal::Task(error.to_string())),
    }
}

fn answer(view: &SwapView) -> SwapAnswer {
    SwapAnswer {
        residency: view.region.residency().as_str().to_owned(),
        message: String::new(),
    }
}

/// Whether the host's available memory takes `bytes` more, beside the
/// reserve kept for the rest of the node (where the kernel says).
fn host_takes(bytes: u64) -> Result<(), SwapRefusal> {
    match hypervisor_swap::host::available() {
        Some(available) => Ok(hypervisor_swap::host::takes(bytes, available)?),
        None => Ok(()),
    }
}

/// How long a trapped call's swap-in may take before the daemon answers
/// (the limiter asks again): a swap-out in progress finishes first.
pub(crate) fn swap_in_wait(room_wait: Duration) -> Duration {
    room_wait.max(Duration::from_secs(30))
}
