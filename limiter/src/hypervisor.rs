//! The link to the node hypervisor, when `CUDA_LIMITER_HYPERVISOR` names one.
//!
//! 1. When the process first loads the driver, a background thread registers
//!    it (`POST /api/v1/workers` with the pod's token) and retries with
//!    backoff until the hypervisor answers. The hypervisor owns the pod's
//!    region: it writes the quotas and the compute rates there, and marks the
//!    buckets managed.
//! 2. The same thread then runs the command channel (long-poll), answering
//!    suspend/resume/limit changes/health; their effect is already in the
//!    shared region, so answering is all that is left.
//! 3. A launch that finds no budget traps: it asks for admission
//!    (`POST /api/v1/admission`) and waits for the answer, bounded by a short
//!    timeout. If the hypervisor is down, the launch waits for the local
//!    bucket instead: the last limits stay in force.
//! 4. A call of a pod the hypervisor swapped out asks for it back
//!    (`POST /api/v1/swap-in`, answered once it is back: bounded at
//!    [`SWAP_IN_TIMEOUT`]; see [`crate::residency`]). An allocation within the
//!    quota that the GPU cannot hold asks it to make room
//!    (`POST /api/v1/room`: it swaps idle pods out, bounded at
//!    [`ROOM_TIMEOUT`]).
//!
//! 5. With `CUDA_LIMITER_FAST_SWAP`, the registration says so, and the
//!    channel's `SwapOut` and `SwapIn` move the memory the limiter backs
//!    to host memory and back ([`FastSwap`], on this thread, answered with
//!    what was moved).
//!
//! Tokens: in a provisioned container the pod file's ([`crate::provisioned`]);
//! elsewhere `CUDA_LIMITER_TOKEN`, or the file named by `CUDA_LIMITER_TOKEN_FILE`.

use std::path::Path;
use std::sync::{Mutex, Once, OnceLock};
use std::time::Duration;

use gpushare_utils::limits::Residency;
use gpushare_utils::protocol::{
    API_PREFIX, BudgetGrant, BudgetRequest, Command, CommandResult, FastSwapReport, Register,
    Registered, RoomAnswer, RoomRequest, SwapAnswer, SwapInRequest, WorkerDevice,
};
use gpushare_utils::quote::Clipped;
use gpushare_utils::small_file::{self, SmallFileError};

use crate::driver::Driver;
use http_bidir_comm::{Backoff, ChannelError, Client, ClientOptions, Requester, Task};

/// How long a trapped launch waits for the hypervisor before trusting the
/// local bucket alone.
const ADMISSION_TIMEOUT: Duration = Duration::from_millis(100);
/// How long a call of a swapped-out pod waits for the hypervisor's answer:
/// it comes once the pod is back, after any swap-out under way ends (about
/// 15 s) and the restore (about 5 s for 32 GiB).
const SWAP_IN_TIMEOUT: Duration = Duration::from_secs(120);
/// How long an allocation waits for the hypervisor to make room: as long
/// as swapping a pod out may take.
const ROOM_TIMEOUT: Duration = Duration::from_secs(60);
/// Registration retries back off from this...
const REGISTER_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// ...up to this, as do the command channel's reconnects. The hypervisor is
/// on the same node: a retry a second costs it nothing, and a worker is
/// listed again within a second of a restarted daemon answering (with a
/// longer step, an outage of two seconds could leave it unlisted for three
/// more).
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Why talking to the hypervisor failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    #[error("no token: set CUDA_LIMITER_TOKEN or CUDA_LIMITER_TOKEN_FILE")]
    NoToken,
    #[error("cannot read {}: {source}", Clipped(.path))]
    TokenFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing token file {}: {reason}", Clipped(.path))]
    TokenFileRefused { path: String, reason: String },
    #[error("request failed: {0}")]
    Request(#[from] ChannelError),
    #[error("not registered yet")]
    NotRegistered,
    /// Behaves like an unreachable hypervisor: retried, the pod's last
    /// published limits or the local ones apply.
    #[error("unusable address: {}", Clipped(.0))]
    Address(String),
    /// The hypervisor answered a swap-in with the pod elsewhere.
    #[error("the pod is {}, not back on its GPUs: {}", Clipped(.residency), Clipped(.message))]
    NotBack { residency: String, message: String },
}

/// The token in the file at `path`, read so that no file can hang or exhaust
/// the process that loads the library (every process of a container does):
/// a regular file (not a FIFO, a socket or `/dev/zero`) of at most
/// [`TOKEN_FILE_MAX`](small_file::TOKEN_FILE_MAX) bytes, opened
/// non-blocking ([`small_file`]). Symbolic links are followed: Kubernetes
/// mounts secrets through them.
fn read_token_file(path: &str) -> Result<String, LinkError> {
    small_file::read_text(Path::new(path), small_file::TOKEN_FILE_MAX).map_err(
        |error| match error {
            SmallFileError::Io(source) => LinkError::TokenFile {
                path: path.to_owned(),
                source,
            },
            refused => LinkError::TokenFileRefused {
                path: path.to_owned(),
                reason: refused.to_string(),
            },
        },
    )
}

/// How long registration waits for the application to initialise CUDA, so
/// that it can tell the hypervisor which GPUs it sees under which index.
const DEVICES_WAIT: Duration = Duration::from_secs(2);

/// The GPUs this process sees, by CUDA index (which container runtimes and
/// `CUDA_VISIBLE_DEVICES` renumber); empty if CUDA is not initialised in time.
fn visible_devices(driver: Option<&Driver>) -> Vec<WorkerDevice> {
    let Some(driver) = driver else {
        return Vec::new();
    };
    let started = std::time::Instant::now();
    let count = loop {
        match driver.device_count() {
            Some(count) => break count,
            None if started.elapsed() < DEVICES_WAIT => {
                std::thread::sleep(Duration::from_millis(10));
            }
            None => return Vec::new(),
        }
    };
    (0..count)
        .filter_map(|index| {
            let uuid = driver.device_uuid(index as i32)?;
            Some(WorkerDevice { index, uuid })
        })
        .collect()
}

/// Where registration stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkStatus {
    /// The first registration has not been answered yet.
    Starting,
    /// The hypervisor could not be reached (down, wrong address); retrying.
    Unreachable(String),
    /// Registered: the hypervisor knows this process.
    Registered,
    /// The hypervisor refused this process for good (wrong or empty token,
    /// unknown pod, malformed request): no retry.
    Refused(String),
}

/// The process's own swap of the memory the limiter backs, which the
/// channel's `SwapOut` and `SwapIn` ask for: the entry's, which holds that
/// memory (this module cannot reach it).
pub(crate) trait FastSwap: Sync {
    /// Moves the backed memory to host memory; what was moved, or why not.
    fn swap_out(&self) -> Result<FastSwapReport, String>;
    /// Brings it back at the same addresses.
    fn swap_in(&self) -> Result<FastSwapReport, String>;
    /// Gives back the host copies of the memory on the GPU.
    fn release_host(&self) -> Result<FastSwapReport, String>;
    /// Makes and pins the host copies the memory on the GPU lacks.
    fn prepare_host(&self) -> Result<FastSwapReport, String>;
    /// Whether its device memory is shared with another process by CUDA
    /// IPC: no swap may move it.
    fn shares_memory(&self) -> bool;
    /// Bytes of managed memory it holds, which its own swap cannot move.
    fn managed_bytes(&self) -> u64;
}

/// The hypervisor, as this process knows it.
pub(crate) struct Link {
    /// As configured, without a trailing `/`.
    address: String,
    token: String,
    pod: String,
    /// Registration and admission requests (the command channel has its own
    /// client); an address the client cannot use is kept as its error.
    requests: Result<Requester, String>,
    registered: OnceLock<Registered>,
    status: Mutex<LinkStatus>,
    started: Once,
    /// Whether the process backs its memory for a fast swap (its
    /// registration says so).
    offers_fast_swap: bool,
    /// Who carries out `SwapOut` and `SwapIn`, once the entry has said.
    fast_swap: OnceLock<&'static dyn FastSwap>,
}

impl Link {
    /// A link to `address` for `pod`, with the token from the environment.
    pub(crate) fn from_env(address: &str, pod: &str) -> Result<Self, LinkError> {
        let token = match (
            std::env::var("CUDA_LIMITER_TOKEN"),
            std::env::var("CUDA_LIMITER_TOKEN_FILE"),
        ) {
            (Ok(token), _) => token,
            (Err(_), Ok(path)) => read_token_file(&path)?,
            _ => return Err(LinkError::NoToken),
        };
        Ok(Self::new(address, pod, &token))
    }

    /// A link to `address` for `pod` with `token` (a provisioned
    /// container's, from its pod file).
    pub(crate) fn new(address: &str, pod: &str, token: &str) -> Self {
        let token = token.trim().to_owned();
        let options = ClientOptions {
            token: Some(token.clone()),
            connect_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_secs(2),
            ..ClientOptions::default()
        };
        let base = format!("{}{API_PREFIX}", address.trim_end_matches('/'));
        Self {
            address: address.trim_end_matches('/').to_owned(),
            token,
            pod: pod.to_owned(),
            requests: Requester::new(&base, options).map_err(|error| error.to_string()),
            registered: OnceLock::new(),
            status: Mutex::new(LinkStatus::Starting),
            started: Once::new(),
            offers_fast_swap: false,
            fast_swap: OnceLock::new(),
        }
    }

    /// The same link, telling the hypervisor at registration whether the
    /// process backs its memory for a fast swap (`CUDA_LIMITER_FAST_SWAP`).
    pub(crate) fn offering_fast_swap(mut self, offers: bool) -> Self {
        self.offers_fast_swap = offers;
        self
    }

    /// `swap` carries out the channel's `SwapOut` and `SwapIn` from now on
    /// (the first one set stays).
    pub(crate) fn serve_swaps(&self, swap: &'static dyn FastSwap) {
        let _first = self.fast_swap.set(swap);
    }

    /// The hypervisor's address as a message shows it: at most
    /// [`SHOWN_CHARS`](gpushare_utils::quote::SHOWN_CHARS) characters.
    pub(crate) fn address(&self) -> Clipped<'_> {
        Clipped(&self.address)
    }

    /// Where registration stands.
    pub(crate) fn status(&self) -> LinkStatus {
        self.status.lock().map_or_else(
            |poisoned| poisoned.into_inner().clone(),
            |status| status.clone(),
        )
    }

    fn set_status(&self, status: LinkStatus) {
        match self.status.lock() {
            Ok(mut current) => *current = status,
            Err(poisoned) => *poisoned.into_inner() = status,
        }
    }

    fn requests(&self) -> Result<&Requester, LinkError> {
        self.requests
            .as_ref()
            .map_err(|error| LinkError::Address(error.clone()))
    }

    /// Registers this process; the limits are in the shared region.
    fn register(&self, driver: Option<&Driver>) -> Result<&Registered, LinkError> {
        if let Some(registered) = self.registered.get() {
            return Ok(registered);
        }
        let registered: Registered = self.requests()?.post_json(
            "/workers",
            &Register {
                pod: self.pod.clone(),
                pid: std::process::id(),
                hostname: String::new(),
                devices: visible_devices(driver),
                fast_swap: self.offers_fast_swap,
            },
            None,
        )?;
        tracing::info!(worker = registered.worker_id, devices = ?registered.devices, "registered");
        Ok(self.registered.get_or_init(|| registered))
    }

    /// Registers (retrying with backoff) and serves commands, on a thread of
    /// its own, once; returns at once. Registration tells the GPUs `driver`
    /// shows, once the loader has resolved it.
    pub(crate) fn start(&'static self, driver: &'static OnceLock<Driver>) {
        self.started.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-hypervisor".into())
                .spawn(move || self.run(driver));
            if let Err(error) = spawned {
                self.set_status(LinkStatus::Refused(format!(
                    "cannot start the link thread: {error}"
                )));
            }
        });
    }

    fn run(&'static self, driver: &'static OnceLock<Driver>) {
        let _guard = gpushare_hook::DetourGuard::enter_always();
        let seed = u64::from(std::process::id());
        let mut backoff = Backoff::new(REGISTER_BACKOFF_MIN, RECONNECT_BACKOFF_MAX, seed);
        if self.token.is_empty() {
            self.set_status(LinkStatus::Refused("the token is empty".to_owned()));
            return;
        }
        let registered = loop {
            match self.register(driver.get()) {
                Ok(registered) => break registered,
                // The hypervisor said no: asking again cannot change that.
                Err(LinkError::Request(ChannelError::Status { status, message }))
                    if (400..500).contains(&status) =>
                {
                    let reason = format!("registration refused ({status}: {})", message.trim());
                    self.set_status(LinkStatus::Refused(reason));
                    return;
                }
                Err(error) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(%error, ?delay, "hypervisor registration failed; retrying");
                    self.set_status(LinkStatus::Unreachable(error.to_string()));
                    std::thread::sleep(delay);
                }
            }
        };
        self.set_status(LinkStatus::Registered);
        let options = ClientOptions {
            token: Some(self.token.clone()),
            backoff_max: RECONNECT_BACKOFF_MAX,
            ..ClientOptions::default()
        };
        let Ok(requests) = &self.requests else {
            return;
        };
        let channel = format!("{}/channel", requests.base_url());
        let handle = Client::new(&channel, &registered.worker_id, options)
            .and_then(|client| client.spawn_loop(|task: Task<Command>| self.handle(task.task)));
        match handle {
            // The loop reconnects by itself for the life of the process.
            Ok(handle) => handle.detach(),
            Err(error) => tracing::error!(%error, "command channel not started"),
        }
    }

    fn handle(&self, command: Command) -> CommandResult {
        // The channel's own thread: the driver calls a swap makes go
        // straight to the driver, past the quota's detours (the memory
        // stays charged while it is away) and the residency gate.
        let _guard = gpushare_hook::DetourGuard::enter_always();
        tracing::info!(?command, "hypervisor command");
        // Suspension and limits are already in the shared region, written by
        // the hypervisor before it sent the command.
        let message = match &command {
            Command::Suspend => "suspended",
            Command::Resume => "resumed",
            Command::SetLimits { .. } => "limits applied",
            Command::Health => "healthy",
            Command::SwapOut => return self.swap(|swap| swap.swap_out(), "swapped out"),
            Command::SwapIn => return self.swap(|swap| swap.swap_in(), "swapped in"),
            Command::ReleaseHost => {
                return self.swap(|swap| swap.release_host(), "host copies given back");
            }
            Command::PrepareHost => {
                return self.swap(|swap| swap.prepare_host(), "host copies prepared");
            }
        };
        self.answer(true, message.to_owned(), None)
    }

    /// An answer to a command, with what every answer says of this
    /// process: whether it takes the fast swap (a daemon that adopts it
    /// after a restart learns it so), and whether its device memory is
    /// shared by CUDA IPC (the hypervisor asks before a checkpoint).
    fn answer(&self, ok: bool, message: String, swap: Option<FastSwapReport>) -> CommandResult {
        let fast = self.fast_swap.get();
        CommandResult {
            ok,
            message,
            swap,
            shared: fast.is_some_and(|swap| swap.shares_memory()),
            fast_swap: fast.is_some(),
            managed_bytes: fast.map_or(0, |swap| swap.managed_bytes()),
        }
    }

    /// Carries out one direction of a fast swap, if this process can.
    fn swap(
        &self,
        direction: impl FnOnce(&dyn FastSwap) -> Result<FastSwapReport, String>,
        done: &str,
    ) -> CommandResult {
        let outcome = match self.fast_swap.get() {
            Some(swap) => direction(*swap),
            None => Err(
                "this process cannot swap its memory itself: CUDA_LIMITER_FAST_SWAP is not set"
                    .to_owned(),
            ),
        };
        match outcome {
            Ok(report) => {
                tracing::info!(?report, "{done}");
                self.answer(true, done.to_owned(), Some(report))
            }
            Err(message) => {
                tracing::warn!(reason = %message, "fast swap not done");
                self.answer(false, message, None)
            }
        }
    }

    /// Asks for budget for a trapped launch on the GPU `uuid`.
    pub(crate) fn admission(&self, uuid: &str, cost_ns: u64) -> Result<u64, LinkError> {
        let registered = self.registered.get().ok_or(LinkError::NotRegistered)?;
        let admission: BudgetGrant = self.requests()?.post_json(
            "/admission",
            &BudgetRequest {
                worker_id: registered.worker_id.clone(),
                uuid: uuid.to_owned(),
                cost_ns,
            },
            Some(ADMISSION_TIMEOUT),
        )?;
        Ok(admission.granted_ns)
    }

    /// Asks for the pod back on its GPUs; answered once it is, or could not
    /// be ([`LinkError::NotBack`]).
    pub(crate) fn swap_in(&self) -> Result<(), LinkError> {
        let registered = self.registered.get().ok_or(LinkError::NotRegistered)?;
        let answer: SwapAnswer = self.requests()?.post_json(
            "/swap-in",
            &SwapInRequest {
                worker_id: registered.worker_id.clone(),
            },
            Some(SWAP_IN_TIMEOUT),
        )?;
        if answer.residency == Residency::Resident.as_str() {
            Ok(())
        } else {
            Err(LinkError::NotBack {
                residency: answer.residency,
                message: answer.message,
            })
        }
    }

    /// Asks for room for `bytes` on the GPU `uuid`, which the driver could
    /// not find for an allocation within the pod's quota: the hypervisor
    /// swaps idle pods out there and says how much it freed.
    pub(crate) fn room(
        &self,
        uuid: &str,
        bytes: u64,
        driver_free: Option<u64>,
    ) -> Result<RoomAnswer, LinkError> {
        let registered = self.registered.get().ok_or(LinkError::NotRegistered)?;
        let answer = self.requests()?.post_json(
            "/room",
            &RoomRequest {
                worker_id: registered.worker_id.clone(),
                uuid: uuid.to_owned(),
                bytes,
                driver_free,
            },
            Some(ROOM_TIMEOUT),
        )?;
        Ok(answer)
    }
}
