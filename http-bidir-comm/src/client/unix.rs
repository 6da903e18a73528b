//! The agent's transport for a server on a Unix socket (`http+unix://`
//! base URLs, [`crate::unix`]): ureq 3's connector interface with a
//! `UnixStream` in place of its TCP one, and a resolver that looks nothing
//! up (the request's host is a placeholder; no DNS, no `/etc/hosts` read
//! inside the process the client lives in).
//!
//! Timeouts and [`ureq::Agent::shutdown`] behave as on TCP: reads and writes
//! are bounded by the request's timeouts, and a shutdown interrupts a read
//! blocked in a long-poll.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use ureq::Error;
use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, ShutdownHandle, Transport,
};

/// Host of the URLs requests are sent to: only the socket is connected to.
pub(super) const PLACEHOLDER_BASE: &str = "http://localhost";

/// Connects every request to the socket at its path.
#[derive(Debug)]
pub(super) struct UnixConnector(pub(super) PathBuf);

impl Connector<()> for UnixConnector {
    type Out = UnixTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<()>,
    ) -> Result<Option<Self::Out>, Error> {
        let stream = UnixStream::connect(&self.0)?;
        let transport = UnixTransport {
            stream: Arc::new(Stream(stream)),
            buffers: LazyBuffers::new(
                details.config.input_buffer_size(),
                details.config.output_buffer_size(),
            ),
        };
        (details.register_shutdown)(Arc::downgrade(&transport.stream) as Weak<dyn ShutdownHandle>)?;
        Ok(Some(transport))
    }
}

/// Answers every lookup with one placeholder address, unused by
/// [`UnixConnector`].
#[derive(Debug)]
pub(super) struct NoLookup;

impl Resolver for NoLookup {
    fn resolve(
        &self,
        _uri: &Uri,
        _config: &Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, Error> {
        let mut addrs = self.empty();
        addrs.push(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        Ok(addrs)
    }
}

#[derive(Debug)]
struct Stream(UnixStream);

impl ShutdownHandle for Stream {
    fn shutdown(&self) {
        // Already closed: nothing to interrupt.
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

#[derive(Debug)]
pub(super) struct UnixTransport {
    /// Shared (weakly) with the agent's shutdown.
    stream: Arc<Stream>,
    buffers: LazyBuffers,
}

/// `Some(d)` for a timeout that must happen, as the socket options take it.
fn socket_timeout(timeout: NextTimeout) -> Option<std::time::Duration> {
    timeout.not_zero().map(|t| *t).filter(|t| !t.is_zero())
}

fn timed_out(kind: io::ErrorKind) -> bool {
    matches!(kind, io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
}

impl Transport for UnixTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        let timeout = timeout.for_write();
        if timeout.after.is_zero() {
            return Err(Error::Timeout(timeout.reason));
        }
        let stream = &self.stream.0;
        stream.set_write_timeout(socket_timeout(timeout))?;
        let output = &self.buffers.output()[..amount];
        (&*stream).write_all(output).map_err(|e| {
            if timed_out(e.kind()) {
                Error::Timeout(timeout.reason)
            } else {
                e.into()
            }
        })
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let timeout = timeout.for_read();
        if timeout.after.is_zero() {
            return Err(Error::Timeout(timeout.reason));
        }
        let stream = &self.stream.0;
        stream.set_read_timeout(socket_timeout(timeout))?;
        let input = self.buffers.input_append_buf();
        let amount = loop {
            match (&*stream).read(input) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if timed_out(e.kind()) => return Err(Error::Timeout(timeout.reason)),
                Err(e) => return Err(e.into()),
            }
        };
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        // A kept connection is reused only if nothing is waiting on it and the
        // server has not closed it (a read would block).
        let stream = &self.stream.0;
        if stream.set_nonblocking(true).is_err() {
            return false;
        }
        let mut byte = [0];
        let open =
            matches!((&*stream).read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        stream.set_nonblocking(false).is_ok() && open
    }
}
