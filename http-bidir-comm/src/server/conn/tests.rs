//! The listener's accept queue under a flood of connections.

use std::time::Instant;

use super::*;

/// A listener that accepts nothing still queues more handshakes than
/// tokio's default of 1,024: a client behind them connects at once.
/// Past a full queue the kernel drops the handshake, and the client's
/// connect returns only when it tries again, a second later.
#[test]
fn the_accept_queue_holds_a_flood_of_connections() {
    const QUEUED: u64 = 1_500;
    let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok());
    if somaxconn.is_some_and(|max| max < QUEUED) || raise_fd_limit() < QUEUED + 256 {
        eprintln!("skipped: the kernel's queue or this process's descriptors are too few");
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("runtime");
    let _entered = runtime.enter();
    let listener = bind_tcp(SocketAddr::from(([127, 0, 0, 1], 0))).expect("listen");
    let addr = listener.local_addr().expect("address");
    let mut queued = Vec::new();
    for n in 0..QUEUED {
        let started = Instant::now();
        queued.push(std::net::TcpStream::connect(addr).expect("connect"));
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "connection {n} took {took:?}"
        );
    }
}
