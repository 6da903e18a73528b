//! A server's connections, bounded: whatever a client sends (for the
//! daemon: a pod), the server keeps answering.
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
//! - **Evictions before accepts**: an evicted connection closes on its own
//!   task; while more than [`MAX_CLOSING`] still hold their descriptors the
//!   acceptor waits for them (at most [`ACCEPT_PAUSE`]), so that a flood
//!   of connections does not run the server out of descriptors.
//! - **Accept errors** (out of descriptors) pause accepting briefly instead
//!   of spinning.
//! - **Refusals in JSON** ([`refusal`]): a request whose head passes
//!   [`MAX_HEADER_BYTES`] is answered 431 here;
//!   what hyper answers by itself (400, 414, 431, empty) is replaced by the
//!   same answer with a JSON body. Either way the connection then closes.
//!
//! The same bounds hold on TCP and on a Unix socket (the daemon's pods reach the
//! daemon through one): [`Listener`].

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

pub use crate::limits::ConnLimits;

use poem::http::uri::Scheme;
use poem::listener::Acceptor;
use poem::web::{LocalAddr, RemoteAddr};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UnixListener, UnixStream};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use refusal::{Answer, MAX_HEADER_BYTES};

mod refusal;

/// Connections the kernel may queue for the daemon to accept: as many as
/// it allows (it caps this at `net.core.somaxconn`, 4,096 by default). Once
/// the queue is full the kernel drops new TCP handshakes, and a client
/// whose handshake was dropped tries again a second later: behind a flood
/// of connections larger than tokio's default queue of 1,024, a probe
/// could wait that second while the daemon drained the flood.
const LISTEN_BACKLOG: u32 = 65_535;

/// Evicted connections that may still hold their descriptors before the
/// acceptor waits for them: well inside the descriptors the connection cap
/// leaves to the rest of the daemon (64).
const MAX_CLOSING: usize = 16;
/// The longest the acceptor waits: for evicted connections to close, or
/// after an accept error.
const ACCEPT_PAUSE: Duration = Duration::from_millis(20);

/// A TCP listener on `addr` (address reuse on, as `TcpListener::bind`
/// sets it) with the longest accept queue the kernel allows. Called on the
/// runtime that will serve it.
pub fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
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
    /// Evicted connections not dropped yet.
    closing: usize,
}

/// An acceptor's connections, and the signal that an evicted one closed.
#[derive(Default)]
struct Connections {
    table: Mutex<Table>,
    closed: Notify,
}

impl Connections {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A bound listener: TCP, or a Unix socket.
#[derive(Debug)]
pub enum Listener {
    /// A TCP listener (`--listen`, `--metrics-listen`): reached from the
    /// node, so the whole status is shown without a token.
    Tcp(TcpListener),
    /// A Unix socket (`--socket`), mounted into the pods: the status shows
    /// a pod its own alone, and only for its token.
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

impl Stream {
    fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            Self::Tcp(stream) => Pin::new(stream).poll_write(cx, data),
            Self::Unix(stream) => Pin::new(stream).poll_write(cx, data),
        }
    }
}

/// Accepts connections within [`ConnLimits`].
pub struct GuardedAcceptor {
    listener: Listener,
    local: LocalAddr,
    limits: ConnLimits,
    connections: Arc<Connections>,
}

impl GuardedAcceptor {
    /// Accepts on `listener` within `limits`; fails only where the
    /// listener's own address cannot be read.
    pub fn new(listener: impl Into<Listener>, limits: ConnLimits) -> io::Result<Self> {
        let listener = listener.into();
        let local = listener.local_addr()?;
        Ok(Self {
            listener,
            local,
            limits,
            connections: Arc::default(),
        })
    }

    /// Registers a new connection; `None` when it must be closed at once.
    fn admit(&self) -> Option<(u64, Arc<Shared>)> {
        let mut table = self.connections.table();
        if table.open.len() >= self.limits.max_connections {
            let oldest = table
                .open
                .iter()
                .find(|(_, c)| c.awaiting_headers.load(Ordering::Acquire))
                .map(|(id, _)| *id);
            match oldest.and_then(|id| table.open.remove(&id)) {
                Some(victim) => {
                    table.closing += 1;
                    victim.evict();
                }
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

    /// Waits, at most [`ACCEPT_PAUSE`], while more than [`MAX_CLOSING`]
    /// evicted connections still hold their descriptors.
    async fn wait_for_closing(&self) {
        let deadline = Instant::now() + ACCEPT_PAUSE;
        while self.connections.table().closing > MAX_CLOSING {
            let closed = self.connections.closed.notified();
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                return;
            }
        }
    }
}

impl Acceptor for GuardedAcceptor {
    type Io = Guarded;

    fn local_addr(&self) -> Vec<LocalAddr> {
        vec![self.local.clone()]
    }

    async fn accept(&mut self) -> io::Result<(Guarded, LocalAddr, RemoteAddr, Scheme)> {
        loop {
            self.wait_for_closing().await;
            let (stream, remote) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // EMFILE and friends: the pending connection stays queued;
                    // retrying at once would spin.
                    tracing::warn!(%error, "accept failed; pausing");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
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
                connections: Arc::clone(&self.connections),
                limits: self.limits,
                deadline: Some(Box::pin(tokio::time::sleep(self.limits.header_timeout))),
                tail: [0; 3],
                in_headers: true,
                head_bytes: 0,
                answer: None,
                answered: false,
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
    connections: Arc<Connections>,
    limits: ConnLimits,
    /// When the connection is closed unless it makes progress; `None` while
    /// a request is being served.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The last three bytes read, to find `\r\n\r\n` across reads.
    tail: [u8; 3],
    /// Bytes of the current request's headers have arrived.
    in_headers: bool,
    /// Bytes of the current request's head read so far.
    head_bytes: usize,
    /// The connection's own answer to a refused request, while it is written.
    answer: Option<Answer>,
    /// That answer is written: hyper reads the end of the stream and
    /// writes nothing more.
    answered: bool,
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
    /// the first byte of a new request starts the header timeout. False
    /// when the request's head has passed [`MAX_HEADER_BYTES`].
    fn saw(&mut self, data: &[u8]) -> bool {
        if data.is_empty() {
            return true;
        }
        if !self.shared.awaiting_headers.load(Ordering::Acquire) {
            return true; // a body, or bytes pipelined behind a request: served first
        }
        if !self.in_headers {
            self.in_headers = true;
            let header_timeout = self.limits.header_timeout;
            self.set_deadline(header_timeout);
        }
        let mut window = Vec::with_capacity(3 + data.len());
        window.extend_from_slice(&self.tail);
        window.extend_from_slice(data);
        let end = window.windows(4).position(|w| w == b"\r\n\r\n");
        // The blank line's last byte is `data[at]`.
        self.head_bytes += end.map_or(data.len(), |at| at + 1);
        if self.head_bytes > MAX_HEADER_BYTES {
            return false;
        }
        if end.is_some() {
            self.shared.awaiting_headers.store(false, Ordering::Release);
            self.in_headers = false;
            self.deadline = None;
            self.head_bytes = 0;
        }
        let keep = window.len().min(3);
        self.tail.copy_from_slice(&{
            let mut t = [0u8; 3];
            t[3 - keep..].copy_from_slice(&window[window.len() - keep..]);
            t
        });
        true
    }

    /// Writes the connection's own answer; ready once it is all written.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(answer) = &mut self.answer {
            let n = ready!(self.stream.poll_write(cx, answer.rest()))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            if answer.advance(n) {
                self.answer = None;
                self.answered = true;
            }
        }
        Poll::Ready(Ok(()))
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
        if this.answer.is_none() && !this.answered {
            let before = buf.filled().len();
            let read = match &mut this.stream {
                Stream::Tcp(stream) => Pin::new(stream).poll_read(cx, buf),
                Stream::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
            };
            match read {
                Poll::Ready(Ok(())) => {
                    let data = buf.filled()[before..].to_vec();
                    if this.saw(&data) {
                        return Poll::Ready(Ok(()));
                    }
                    // Hyper never sees this part: the connection answers 431.
                    buf.set_filled(before);
                    this.answer = Some(Answer::new(431));
                    tracing::debug!("request head too large; answered 431");
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending if this.expired(cx) => return Poll::Ready(Err(timed_out())),
                Poll::Pending => return Poll::Pending,
            }
        }
        // Refused here: the answer goes out, then hyper reads the end of the
        // stream (an unfinished head, so it writes nothing) and closes.
        match this.poll_answer(cx) {
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(timed_out())),
            answered => answered,
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
        if this.answer.is_none()
            && !this.answered
            && let Some(status) = refusal::hyper_refusal(data)
        {
            this.answer = Some(Answer::new(status));
        }
        if this.answer.is_some() || this.answered {
            // Hyper's empty refusal goes out as the JSON one; after an
            // answer of the connection's own, nothing more does.
            return this.poll_answer(cx).map_ok(|()| data.len());
        }
        let written = this.stream.poll_write(cx, data);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) && this.deadline.is_none() {
            // A response: the connection now idles until the next request.
            this.shared.awaiting_headers.store(true, Ordering::Release);
            this.tail = [0; 3];
            this.head_bytes = 0;
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
        let mut table = self.connections.table();
        if self.shared.evicted.load(Ordering::Acquire) {
            // Removed from the open ones when it was evicted.
            table.closing = table.closing.saturating_sub(1);
            drop(table);
            self.connections.closed.notify_one();
        } else {
            table.open.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests;
