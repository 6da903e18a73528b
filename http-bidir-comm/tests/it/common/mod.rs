//! Test harness: a hub served on 127.0.0.1 (loopback only) by a tokio runtime
//! of its own, plus small helpers. Each test binary uses a subset.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use http_bidir_comm::{ClientOptions, Hub, HubEvent, HubEvents};
use poem::listener::TcpAcceptor;
use poem::{Route, Server};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Where the hub's routes are nested, as the hypervisor would.
pub(crate) const PREFIX: &str = "/api/v1";

pub(crate) struct TestServer {
    pub addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
}

impl TestServer {
    /// Serves `hub` on an ephemeral loopback port.
    pub(crate) fn start<T, R>(hub: &Hub<T, R>) -> Self
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        Self::start_on(hub, 0)
    }

    /// Serves `hub` on loopback `port` (0: ephemeral). Retries the bind for a
    /// while, as a restarted server would.
    pub(crate) fn start_on<T, R>(hub: &Hub<T, R>, port: u16) -> Self
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt.block_on(async {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let socket = tokio::net::TcpSocket::new_v4().expect("socket");
                socket.set_reuseaddr(true).expect("reuseaddr");
                match socket.bind(addr).and_then(|()| socket.listen(1024)) {
                    Ok(listener) => break listener,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("bind {addr}: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("bind {addr}: {e}"),
                }
            }
        });
        let addr = listener.local_addr().expect("local addr");
        let app = {
            let _rt = rt.enter();
            Route::new().nest(PREFIX, hub.route())
        };
        let acceptor = {
            let _rt = rt.enter();
            TcpAcceptor::from_tokio(listener).expect("acceptor")
        };
        rt.spawn(async move {
            if let Err(e) = Server::new_with_acceptor(acceptor).run(app).await {
                eprintln!("server ended: {e}");
            }
        });
        Self { addr, rt: Some(rt) }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}{PREFIX}", self.addr)
    }

    /// Stops the server the hard way: every task (listener, connections,
    /// parked long-polls) is dropped and its sockets closed, like a crash.
    pub(crate) fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Options for tests: short waits and backoff so failures show quickly.
pub(crate) fn fast_options() -> ClientOptions {
    ClientOptions {
        long_poll_wait: Duration::from_secs(2),
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_millis(500),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        stop_timeout: Duration::from_secs(3),
        ..ClientOptions::default()
    }
}

/// Waits up to `within` for an event matching `want`; other events are dropped.
pub(crate) fn wait_event<R>(
    events: &mut HubEvents<R>,
    within: Duration,
    mut want: impl FnMut(&HubEvent<R>) -> bool,
) -> Option<HubEvent<R>> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match events.try_recv() {
            Ok(event) if want(&event) => return Some(event),
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    None
}

/// A plain agent that reports every status instead of failing on 4xx/5xx.
pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .new_agent()
}

/// Sends `request` as raw bytes on a fresh connection and returns the status
/// of the answer, or `None` if none came within the timeout. The request
/// should say `Connection: close`: the answer is read to the end.
pub(crate) fn raw_status(addr: SocketAddr, request: &[u8]) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(3)))
        .ok()?;
    // The server may answer (413) and close before reading the whole body.
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                answer.extend_from_slice(&buf[..n]);
                if answer.len() > 4 << 20 {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let line = answer.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    line.strip_prefix("HTTP/1.1 ")
        .or_else(|| line.strip_prefix("HTTP/1.0 "))?
        .get(..3)?
        .parse()
        .ok()
}
