//! The daemon's connections, bounded: whatever a pod sends, the daemon keeps
//! answering.
//!
//! - **Header-read timeout**: a request's headers (up to the blank line) must
//!   arrive within [`ConnLimits::header_timeout`] of its first byte, or of the
//!   connection opening; a connection that never finishes them is closed.
//! - **Idle timeout**: a kept-alive connection with no request for
//!   [`ConnLimits::idle_timeout`] is closed. A request being served (a
//!   long-poll) has no deadline: the handler bounds it.
//! - **Connection cap**: at [`ConnLimits::max_connections`] open, a new
//!   connection closes the oldest one still waiting for its headers (the
//!   half-open ones an attacker holds), else is itself closed at once.
//! - **Accept errors** (out of descriptors) pause accepting briefly instead
//!   of spinning.
//!
//! The same bounds hold on TCP and on the Unix socket the pods reach the
//! daemon through ([`Listener`]).

use std::collections::BTreeMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use poem::http::uri::Scheme;
use poem::listener::Acceptor;
use poem::web::{LocalAddr, RemoteAddr};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::time::{Instant, Sleep};

/// Bounds on connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// What the acceptor knows of one open connection.
#[derive(Default)]
struct Shared {
    /// Waiting for a request's headers (or for its first request).
    awaiting_headers: AtomicBool,
    evicted: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Shared {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        if let Some(waker) = self
            .waker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            waker.wake();
        }
    }
}

#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Arc<Shared>>,
}

/// A bound listener: TCP, or a Unix socket.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Self::Tcp(listener)
    }
}

impl From<UnixListener> for Listener {
    fn from(listener: UnixListener) -> Self {
        Self::Unix(listener)
    }
}

impl Listener {
    fn local_addr(&self) -> io::Result<LocalAddr> {
        Ok(match self {
            Self::Tcp(listener) => LocalAddr(listener.local_addr()?.into()),
            Self::Unix(listener) => LocalAddr(listener.local_addr()?.into()),
        })
    }

    async fn accept(&self) -> io::Result<(Stream, RemoteAddr)> {
        Ok(match self {
            Self::Tcp(listener) => {
                let (stream, addr) = listener.accept().await?;
                (Stream::Tcp(stream), RemoteAddr(addr.into()))
            }
            Self::Unix(listener) => {
                let (stream, addr) = listener.accept().await?;
                (Stream::Unix(stream), RemoteAddr(addr.into()))
            }
        })
    }
}

/// An accepted connection of either kind.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// Accepts connections within [`ConnLimits`].
pub struct GuardedAcceptor {
    listener: Listener,
    local: LocalAddr,
    limits: ConnLimits,
    table: Arc<Mutex<Table>>,
}

impl GuardedAcceptor {
    pub fn new(listener: impl Into<Listener>, limits: ConnLimits) -> io::Result<Self> {
        let listener = listener.into();
        let local = listener.local_addr()?;
        Ok(Self {
            listener,
            local,
            limits,
            table: Arc::default(),
        })
    }

    /// Registers a new connection; `None` when it must be closed at once.
    fn admit(&self) -> Option<(u64, Arc<Shared>)> {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.open.len() >= self.limits.max_connections {
            let oldest = table
                .open
                .iter()
                .find(|(_, c)| c.awaiting_headers.load(Ordering::Acquire))
                .map(|(id, _)| *id);
            match oldest.and_then(|id| table.open.remove(&id)) {
                Some(victim) => victim.evict(),
                None => return None,
            }
        }
        let id = table.next;
        table.next += 1;
        let shared = Arc::new(Shared::default());
        shared.awaiting_headers.store(true, Ordering::Release);
        table.open.insert(id, Arc::clone(&shared));
        Some((id, shared))
    }
}

impl Acceptor for GuardedAcceptor {
    type Io = Guarded;

    fn local_addr(&self) -> Vec<LocalAddr> {
        vec![self.local.clone()]
    }

    async fn accept(&mut self) -> io::Result<(Guarded, LocalAddr, RemoteAddr, Scheme)> {
        loop {
            let (stream, remote) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // EMFILE and friends: the pending connection stays queued;
                    // retrying at once would spin.
                    tracing::warn!(%error, "accept failed; pausing");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            let Some((id, shared)) = self.admit() else {
                tracing::debug!("connection cap reached; closing a new connection");
                continue;
            };
            let guarded = Guarded {
                stream,
                id,
                shared,
                table: Arc::clone(&self.table),
                limits: self.limits,
                deadline: Some(Box::pin(tokio::time::sleep(self.limits.header_timeout))),
                tail: [0; 3],
                in_headers: true,
            };
            return Ok((guarded, self.local.clone(), remote, Scheme::HTTP));
        }
    }
}

/// A connection under the limits.
pub struct Guarded {
    stream: Stream,
    id: u64,
    shared: Arc<Shared>,
    table: Arc<Mutex<Table>>,
    limits: ConnLimits,
    /// When the connection is closed unless it makes progress; `None` while
    /// a request is being served.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The last three bytes read, to find `\r\n\r\n` across reads.
    tail: [u8; 3],
    /// Bytes of the current request's headers have arrived.
    in_headers: bool,
}

impl Guarded {
    fn set_deadline(&mut self, after: Duration) {
        let at = Instant::now() + after;
        match &mut self.deadline {
            Some(sleep) => sleep.as_mut().reset(at),
            None => self.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
        }
    }

    /// Notes `data` read: the end of a request's headers lifts the deadline;
    /// the first byte of a new request starts the header timeout.
    fn saw(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if !self.shared.awaiting_headers.load(Ordering::Acquire) {
            return; // a body, or bytes pipelined behind a request: served first
        }
        if !self.in_headers {
            self.in_headers = true;
            let header_timeout = self.limits.header_timeout;
            self.set_deadline(header_timeout);
        }
        let mut window = Vec::with_capacity(3 + data.len());
        window.extend_from_slice(&self.tail);
        window.extend_from_slice(data);
        if window.windows(4).any(|w| w == b"\r\n\r\n") {
            self.shared.awaiting_headers.store(false, Ordering::Release);
            self.in_headers = false;
            self.deadline = None;
        }
        let keep = window.len().min(3);
        self.tail.copy_from_slice(&{
            let mut t = [0u8; 3];
            t[3 - keep..].copy_from_slice(&window[window.len() - keep..]);
            t
        });
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.shared.evicted.load(Ordering::Acquire) {
            return true;
        }
        *self
            .shared
            .waker
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
        self.deadline
            .as_mut()
            .is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready())
    }
}

/// Raises the soft limit on open files to the hard one, so that the
/// connection cap, not the descriptor table, bounds the daemon; returns it.
pub fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: a valid rlimit; raising the soft limit up to the hard one
        // needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    limit.rlim_cur
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "connection closed by the daemon's limits",
    )
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = match &mut this.stream {
            Stream::Tcp(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
        };
        match read {
            Poll::Ready(Ok(())) => {
                let data = buf.filled()[before..].to_vec();
                this.saw(&data);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.shared.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(timed_out()));
        }
        let written = match &mut this.stream {
            Stream::Tcp(stream) => Pin::new(stream).poll_write(cx, data),
            Stream::Unix(stream) => Pin::new(stream).poll_write(cx, data),
        };
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) && this.deadline.is_none() {
            // A response: the connection now idles until the next request.
            this.shared.awaiting_headers.store(true, Ordering::Release);
            this.tail = [0; 3];
            let idle = this.limits.idle_timeout;
            this.set_deadline(idle);
        }
        written
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Tcp(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Tcp(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open
            .remove(&self.id);
    }
}
