//! A hypervisor of the limiter tests' own: it registers workers
//! (`POST /api/v1/workers`, any token) and serves the command channel
//! through `http-bidir-comm`'s hub, so that a test sends a probe's limiter
//! commands and reads its answers, without the node daemon (whose own tests
//! are the system tests').

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpushare_utils::protocol::{Command, CommandResult, Register, Registered};
use http_bidir_comm::{ClientId, Hub, HubConfig, HubEvent, HubEvents};
use poem::listener::{Acceptor, Listener, TcpListener};
use poem::web::Json;
use poem::{EndpointExt, Route, handler, post};

/// How long a test waits for a registration or an answer.
const WITHIN: Duration = Duration::from_secs(20);

/// The registrations received, in order.
type Registrations = Arc<Mutex<Vec<Register>>>;

/// The hypervisor, served on loopback for as long as it lives.
pub(crate) struct FakeHypervisor {
    runtime: tokio::runtime::Runtime,
    hub: Hub<Command, CommandResult>,
    events: HubEvents<CommandResult>,
    registrations: Registrations,
    url: String,
}

#[handler]
fn registration_route(
    Json(register): Json<Register>,
    registrations: poem::web::Data<&Registrations>,
) -> Json<Registered> {
    let worker_id = worker_id(&register);
    let pod = register.pod.clone();
    registrations.lock().unwrap().push(register);
    Json(Registered {
        worker_id,
        pod,
        devices: Vec::new(),
    })
}

fn worker_id(register: &Register) -> String {
    format!("{}-{}-1", register.pod, register.pid)
}

impl FakeHypervisor {
    pub(crate) fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let registrations = Registrations::default();
        let (hub, events, url) = runtime.block_on(async {
            let (hub, events) = Hub::<Command, CommandResult>::new(HubConfig::default());
            let app = Route::new()
                .at("/api/v1/workers", post(registration_route))
                .nest("/api/v1/channel", hub.route())
                .data(Arc::clone(&registrations));
            let acceptor = TcpListener::bind("127.0.0.1:0")
                .into_acceptor()
                .await
                .unwrap();
            let address = acceptor.local_addr()[0].as_socket_addr().copied().unwrap();
            tokio::spawn(poem::Server::new_with_acceptor(acceptor).run(app));
            (hub, events, format!("http://{address}"))
        });
        Self {
            runtime,
            hub,
            events,
            registrations,
            url,
        }
    }

    /// Where the limiter finds it (`CUDA_LIMITER_HYPERVISOR`).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The registration of the process `pid`, once it came.
    pub(crate) fn registration(&self, pid: u32) -> Register {
        let deadline = Instant::now() + WITHIN;
        loop {
            let found = self
                .registrations
                .lock()
                .unwrap()
                .iter()
                .find(|r| r.pid == pid)
                .cloned();
            if let Some(register) = found {
                return register;
            }
            assert!(Instant::now() < deadline, "process {pid} never registered");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `command` to the worker of process `pid` and waits for its answer.
    pub(crate) fn ask(&mut self, pid: u32, command: Command) -> CommandResult {
        let id = ClientId::new(worker_id(&self.registration(pid))).unwrap();
        let task = self.hub.submit(&id, command).unwrap();
        let events = &mut self.events;
        self.runtime.block_on(async {
            tokio::time::timeout(WITHIN, async {
                loop {
                    match events.recv().await {
                        Some(HubEvent::Result {
                            client,
                            id: answered,
                            result,
                        }) if client == id && answered == task => return result,
                        Some(_) => {}
                        None => panic!("the hub stopped"),
                    }
                }
            })
            .await
            .expect("an answer in time")
        })
    }
}
