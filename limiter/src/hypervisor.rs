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
//!
//! Tokens: `CUDA_LIMITER_TOKEN`, or the file named by `CUDA_LIMITER_TOKEN_FILE`.

use std::sync::{Mutex, Once, OnceLock};
use std::time::Duration;

use gpushare_utils::protocol::{
    API_PREFIX, Admission, AdmissionRequest, Command, CommandResult, Register, Registered,
    WorkerDevice,
};

use crate::driver::Driver;
use http_bidir_comm::{Client, ClientOptions, Task};

/// How long a trapped launch waits for the hypervisor before trusting the
/// local bucket alone.
const ADMISSION_TIMEOUT: Duration = Duration::from_millis(100);
/// Registration retries back off up to this.
const REGISTER_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Why talking to the hypervisor failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("no token: set CUDA_LIMITER_TOKEN or CUDA_LIMITER_TOKEN_FILE")]
    NoToken,
    #[error("cannot read {path}: {source}")]
    TokenFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("request failed: {0}")]
    Transport(#[from] ureq::Error),
    #[error("hypervisor answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("bad answer: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("not registered yet")]
    NotRegistered,
    #[error("command channel: {0}")]
    Channel(#[from] http_bidir_comm::ChannelError),
}

/// How long registration waits for the application to initialise CUDA, so
/// that it can tell the hypervisor which GPUs it sees under which index.
const DEVICES_WAIT: Duration = Duration::from_secs(2);

/// The GPUs this process sees, by CUDA index (which container runtimes and
/// `CUDA_VISIBLE_DEVICES` renumber); empty if CUDA is not initialised in time.
fn visible_devices() -> Vec<WorkerDevice> {
    let Some(driver) = Driver::get() else {
        return Vec::new();
    };
    let started = std::time::Instant::now();
    let count = loop {
        match driver.device_count() {
            Some(count) => break count,
            None if started.elapsed() < DEVICES_WAIT => {
                std::thread::sleep(Duration::from_millis(10))
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
pub enum LinkStatus {
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

/// The hypervisor, as this process knows it.
pub struct Link {
    base: String,
    token: String,
    pod: String,
    agent: ureq::Agent,
    registered: OnceLock<Registered>,
    status: Mutex<LinkStatus>,
    started: Once,
}

impl Link {
    /// A link to `address` for `pod`, with the token from the environment.
    pub fn new(address: &str, pod: &str) -> Result<Self, LinkError> {
        let token = match (
            std::env::var("CUDA_LIMITER_TOKEN"),
            std::env::var("CUDA_LIMITER_TOKEN_FILE"),
        ) {
            (Ok(token), _) => token,
            (Err(_), Ok(path)) => std::fs::read_to_string(&path)
                .map_err(|source| LinkError::TokenFile { path, source })?,
            _ => return Err(LinkError::NoToken),
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_millis(200)))
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .new_agent();
        Ok(Self {
            base: address.trim_end_matches('/').to_owned(),
            token: token.trim().to_owned(),
            pod: pod.to_owned(),
            agent,
            registered: OnceLock::new(),
            status: Mutex::new(LinkStatus::Starting),
            started: Once::new(),
        })
    }

    /// The hypervisor's address, as configured.
    pub fn address(&self) -> &str {
        &self.base
    }

    /// Where registration stands.
    pub fn status(&self) -> LinkStatus {
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

    fn post<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
    ) -> Result<R, LinkError> {
        let url = format!("{}{API_PREFIX}{path}", self.base);
        let mut request = self
            .agent
            .post(&url)
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Content-Type", "application/json");
        if let Some(timeout) = timeout {
            request = request.config().timeout_global(Some(timeout)).build();
        }
        let mut response = request.send(serde_json::to_string(body)?)?;
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string()?;
        if !(200..300).contains(&status) {
            return Err(LinkError::Status { status, body: text });
        }
        Ok(serde_json::from_str(&text)?)
    }

    /// Registers this process; the limits are in the shared region.
    fn register(&self) -> Result<&Registered, LinkError> {
        if let Some(registered) = self.registered.get() {
            return Ok(registered);
        }
        let registered: Registered = self.post(
            "/workers",
            &Register {
                pod: self.pod.clone(),
                pid: std::process::id(),
                hostname: String::new(),
                devices: visible_devices(),
            },
            None,
        )?;
        tracing::info!(worker = registered.worker_id, devices = ?registered.devices, "registered");
        Ok(self.registered.get_or_init(|| registered))
    }

    /// Registers (retrying with backoff) and serves commands, on a thread of
    /// its own, once; returns at once.
    pub fn start(&'static self) {
        self.started.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-hypervisor".into())
                .spawn(move || self.run());
            if let Err(error) = spawned {
                self.set_status(LinkStatus::Refused(format!(
                    "cannot start the link thread: {error}"
                )));
            }
        });
    }

    fn run(&'static self) {
        let _guard = gpushare_utils::hook::DetourGuard::enter_always();
        let mut backoff = Duration::from_millis(50);
        if self.token.is_empty() {
            self.set_status(LinkStatus::Refused("the token is empty".to_owned()));
            return;
        }
        let registered = loop {
            match self.register() {
                Ok(registered) => break registered,
                // The hypervisor said no: asking again cannot change that.
                Err(LinkError::Status { status, body }) if (400..500).contains(&status) => {
                    let reason = format!("registration refused ({status}: {})", body.trim());
                    self.set_status(LinkStatus::Refused(reason));
                    return;
                }
                Err(error) => {
                    tracing::warn!(%error, ?backoff, "hypervisor registration failed; retrying");
                    self.set_status(LinkStatus::Unreachable(error.to_string()));
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(REGISTER_BACKOFF_MAX);
                }
            }
        };
        self.set_status(LinkStatus::Registered);
        let options = ClientOptions {
            token: Some(self.token.clone()),
            ..ClientOptions::default()
        };
        let channel = format!("{}{API_PREFIX}/channel", self.base);
        let handle = Client::new(&channel, &registered.worker_id, options)
            .and_then(|client| client.spawn_loop(|task: Task<Command>| self.handle(task.task)));
        match handle {
            // The loop reconnects by itself for the life of the process.
            Ok(handle) => handle.detach(),
            Err(error) => tracing::error!(%error, "command channel not started"),
        }
    }

    fn handle(&self, command: Command) -> CommandResult {
        // Suspension and limits are already in the shared region, written by
        // the hypervisor before it sent the command.
        let message = match &command {
            Command::Suspend => "suspended",
            Command::Resume => "resumed",
            Command::SetLimits { .. } => "limits applied",
            Command::Health => "healthy",
        };
        tracing::info!(?command, "hypervisor command");
        CommandResult {
            ok: true,
            message: message.to_owned(),
        }
    }

    /// Asks for budget for a trapped launch on the GPU `uuid`.
    pub fn admission(&self, uuid: &str, cost_ns: u64) -> Result<u64, LinkError> {
        let registered = self.registered.get().ok_or(LinkError::NotRegistered)?;
        let admission: Admission = self.post(
            "/admission",
            &AdmissionRequest {
                worker_id: registered.worker_id.clone(),
                uuid: uuid.to_owned(),
                cost_ns,
            },
            Some(ADMISSION_TIMEOUT),
        )?;
        Ok(admission.granted_ns)
    }
}
