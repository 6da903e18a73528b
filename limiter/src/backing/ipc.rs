//! CUDA IPC of the memory the limiter backs (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle`, `cuIpcCloseMemHandle`).
//!
//! The driver's legacy IPC cannot export memory of its VMM API, which is
//! what backed memory is; a program that shares device memory between its
//! processes (PyTorch's `torch.multiprocessing`, a server handing tensors
//! to workers) would fail with the fast swap on. So the limiter shares it
//! the VMM way, behind the same calls:
//!
//! - **Export.** The range's physical memory (created exportable, see
//!   `Vmm::create`) is exported once as a file descriptor, kept in this
//!   process's table of exports under a random id, and the program gets a
//!   handle of 64 bytes that names this process's export server (a random
//!   abstract Unix socket, started at the first export), the id and the
//!   size ([`Ticket`]). A handle is a capability, as the driver's is: who
//!   holds it may map the memory. The descriptor goes when the program
//!   frees the range.
//! - **Import.** A handle of this shape is fetched from the exporting
//!   process's server (the descriptor passed over the socket), imported,
//!   mapped at a range of the importer's own and made readable and
//!   writable by its current device: the same bytes, as the driver's IPC
//!   gives. Any other handle is the driver's. Imported memory is charged
//!   to the exporter alone, as the driver's IPC memory is (and as NVML
//!   shows it).
//! - **Close** unmaps and frees the importer's range; the memory stays the
//!   exporter's.
//!
//! **Swap.** Shared memory cannot be moved by one process: the importers'
//! mappings would keep the old memory and miss the bytes coming back; and
//! the driver's checkpoint takes a process holding imported memory but
//! cannot restore it (measured on an H200, driver 580: the restore is
//! refused, and the pod would stay away). So a process that exported a
//! range, or imported one, declines the fast swap (`SwapError::Shared`)
//! and says its memory is shared, and the hypervisor leaves its pod on
//! the GPU, saying why, rather than try the checkpoint.
//!
//! Both processes run under the limiter with the fast swap on (a pod's
//! processes share its environment); the server is reached by name in the
//! network namespace the pod's containers share.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::{Backing, vmm};
use crate::context::Context;
use crate::driver::DriverError;
use crate::sys::{CUdeviceptr, CUresult};

/// The first bytes of a handle the limiter made.
const MAGIC: [u8; 8] = *b"gpshipc1";

/// The longest a server's answer, or an importer's request, may take.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// What a handle of backed memory names: the exporting process's server,
/// the export's id there and the memory's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    server: u64,
    export: u64,
    size: u64,
}

impl Ticket {
    /// The 64 bytes of the handle: the magic, then the three values (little
    /// endian), then zeros.
    pub(crate) fn to_bytes(self) -> [u8; 64] {
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(&MAGIC);
        for (i, value) in [self.server, self.export, self.size]
            .into_iter()
            .enumerate()
        {
            bytes[8 + 8 * i..16 + 8 * i].copy_from_slice(&value.to_le_bytes());
        }
        bytes
    }

    /// The ticket a handle holds; `None` for a handle the limiter did not
    /// make (the driver's own).
    pub(crate) fn from_bytes(bytes: &[u8; 64]) -> Option<Self> {
        if bytes[..8] != MAGIC || bytes[32..].iter().any(|&b| b != 0) {
            return None;
        }
        let value = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(word)
        };
        Some(Self {
            server: value(0),
            export: value(1),
            size: value(2),
        })
    }
}

/// Why memory could not be shared; the program gets [`IpcError::code`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum IpcError {
    #[error("the driver lacks the functions sharing needs")]
    NoDriver,
    #[error("the memory is in host memory (the pod is swapped out)")]
    Away,
    #[error("exporting the memory failed: {0}")]
    Export(DriverError),
    #[error("starting the export server failed: {0}")]
    Serve(std::io::Error),
    #[error("fetching the memory from its exporting process failed: {0}")]
    Fetch(std::io::Error),
    #[error("its exporting process no longer exports it")]
    Gone,
    #[error("importing the memory failed: {0}")]
    Import(DriverError),
    #[error("mapping the imported memory failed: {0}")]
    Map(DriverError),
    #[error("the limiter's books are poisoned")]
    Poisoned,
}

impl IpcError {
    /// What the program gets: the driver's answer where it refused, else
    /// `CUDA_ERROR_INVALID_VALUE`, as for a handle that cannot be opened.
    pub(crate) fn code(&self) -> CUresult {
        match self {
            Self::Export(error) | Self::Import(error) | Self::Map(error) => error.code(),
            _ => CUresult::ERROR_INVALID_VALUE,
        }
    }
}

impl<T> From<PoisonError<T>> for IpcError {
    fn from(_: PoisonError<T>) -> Self {
        Self::Poisoned
    }
}

/// An exported range's descriptor and size.
struct Export {
    fd: OwnedFd,
    size: u64,
}

type Exports = Arc<Mutex<BTreeMap<u64, Export>>>;

/// This process's exports, its server and its imports.
#[derive(Default)]
pub(super) struct Ipc {
    exports: Exports,
    /// The server's name, once started (or why it could not be).
    server: OnceLock<Result<u64, String>>,
    /// Imported ranges of this process: address and size.
    imports: Mutex<BTreeMap<CUdeviceptr, u64>>,
}

impl Ipc {
    /// Forgets an export: its range is freed.
    pub(super) fn forget(&self, export: u64) {
        if let Ok(mut exports) = self.exports.lock() {
            exports.remove(&export);
        }
    }

    /// The server's name, started at the first call.
    fn server(&self) -> Result<u64, IpcError> {
        let exports = Arc::clone(&self.exports);
        self.server
            .get_or_init(|| serve(exports).map_err(|error| error.to_string()))
            .clone()
            .map_err(|error| IpcError::Serve(std::io::Error::other(error)))
    }
}

impl Backing {
    /// The handle of the backed range holding `pointer` (the caller found
    /// it backed; `Gone` if it was freed since), exported at its first
    /// export. The pod must be on its GPUs.
    pub(crate) fn export_ipc(
        &self,
        ctx: &Context,
        pointer: CUdeviceptr,
    ) -> Result<Ticket, IpcError> {
        let vmm = vmm(ctx).ok_or(IpcError::NoDriver)?;
        let server = self.ipc.server()?;
        let mut book = self.book.lock()?;
        let Some((_, backed)) = book
            .range_mut(..=pointer)
            .next_back()
            .filter(|(base, backed)| pointer - **base < backed.requested)
        else {
            return Err(IpcError::Gone);
        };
        let size = backed.size;
        if let Some(export) = backed.exported {
            return Ok(Ticket {
                server,
                export,
                size,
            });
        }
        let memory = backed.memory.ok_or(IpcError::Away)?;
        let fd = vmm.export(memory).map_err(IpcError::Export)?;
        let export = random().map_err(IpcError::Serve)?;
        self.ipc.exports.lock()?.insert(export, Export { fd, size });
        backed.exported = Some(export);
        tracing::info!(
            address = pointer,
            size,
            "backed memory exported for CUDA IPC"
        );
        Ok(Ticket {
            server,
            export,
            size,
        })
    }

    /// Maps the memory `ticket` names at a range of this process's own, for
    /// its current device; the range's address.
    pub(crate) fn import_ipc(
        &self,
        ctx: &Context,
        ticket: Ticket,
    ) -> Result<CUdeviceptr, IpcError> {
        let driver = ctx.driver().ok_or(IpcError::NoDriver)?;
        let vmm = driver.vmm.as_ref().ok_or(IpcError::NoDriver)?;
        let device = driver.current_device().map_err(IpcError::Map)?;
        let (fd, size) = fetch(ticket)?;
        let memory = vmm.import(fd.as_fd()).map_err(IpcError::Import)?;
        drop(fd);
        let mapped = vmm
            .granularity(device)
            .and_then(|granule| vmm.reserve(size, granule.max(1)))
            .and_then(|address| match vmm.map(address, size, memory, device) {
                Ok(()) => Ok(address),
                Err(error) => {
                    let _freed = vmm.free_address(address, size);
                    Err(error)
                }
            });
        // Mapped, the memory lives as long as the mapping; unmapped, it goes.
        let _released = vmm.release(memory);
        let address = mapped.map_err(IpcError::Map)?;
        match self.ipc.imports.lock() {
            Ok(mut imports) => {
                imports.insert(address, size);
                Ok(address)
            }
            Err(_) => {
                let _undone = vmm
                    .unmap(address, size)
                    .and_then(|()| vmm.free_address(address, size));
                Err(IpcError::Poisoned)
            }
        }
    }

    /// Unmaps and frees the imported range at `pointer` once the context's
    /// work is done; `None` where this process imported nothing there.
    pub(crate) fn close_ipc(&self, ctx: &Context, pointer: CUdeviceptr) -> Option<CUresult> {
        let mut imports = self.ipc.imports.lock().ok()?;
        let size = *imports.get(&pointer)?;
        let Some(vmm) = vmm(ctx) else {
            return Some(CUresult::ERROR_NOT_INITIALIZED);
        };
        let closed = vmm
            .synchronize()
            .and_then(|()| vmm.unmap(pointer, size))
            .and_then(|()| vmm.free_address(pointer, size));
        if let Err(error) = closed {
            return Some(error.code());
        }
        imports.remove(&pointer);
        Some(CUresult::SUCCESS)
    }

    /// Whether memory of this process is shared: a range of the book
    /// exported, or memory of another process imported. Neither path may
    /// swap such a process: its own copies would not be the importers',
    /// and the driver's checkpoint takes a process holding imported memory
    /// but cannot restore it (refused on an H200, driver 580).
    pub(super) fn shared(&self, book: &super::swap::Book<'_>) -> bool {
        book.values().any(|backed| backed.exported.is_some())
            || self
                .ipc
                .imports
                .lock()
                .map_or(true, |imports| !imports.is_empty())
    }

    /// [`Self::shared`], the book taken for the answer.
    pub(crate) fn shares_memory(&self) -> bool {
        match self.book.lock() {
            Ok(book) => self.shared(&book),
            Err(_) => true,
        }
    }
}

/// The server's abstract socket name for `server`.
fn address(server: u64) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("gpushare-ipc-{server:016x}"))
}

/// A random 64-bit value, from the kernel.
fn random() -> std::io::Result<u64> {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        filled +=
            rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(u64::from_le_bytes(bytes))
}

/// Binds a server of a random name and answers its requests on a thread
/// of its own; the name.
fn serve(exports: Exports) -> std::io::Result<u64> {
    let server = random()?;
    let listener = UnixListener::bind_addr(&address(server)?)?;
    std::thread::Builder::new()
        .name("gpushare-ipc".to_owned())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(error) = answer(&exports, stream) {
                    tracing::debug!(%error, "a CUDA IPC request was not answered");
                }
            }
        })?;
    Ok(server)
}

/// One request: an export's id in; its size and, for a live export, its
/// descriptor out (size 0 and none for any other).
fn answer(exports: &Exports, mut stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(ANSWER_WITHIN))?;
    stream.set_write_timeout(Some(ANSWER_WITHIN))?;
    let mut id = [0u8; 8];
    stream.read_exact(&mut id)?;
    let found = {
        let exports = exports
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        match exports.get(&u64::from_le_bytes(id)) {
            Some(export) => Some((export.fd.try_clone()?, export.size)),
            None => None,
        }
    };
    let Some((fd, size)) = found else {
        return stream.write_all(&0u64.to_le_bytes());
    };
    let size = size.to_le_bytes();
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the descriptor"));
    }
    let sent = rustix::net::sendmsg(
        &stream,
        &[IoSlice::new(&size)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != size.len() {
        return Err(std::io::Error::other("a short send"));
    }
    Ok(())
}

/// The descriptor and size `ticket`'s exporting process hands over.
fn fetch(ticket: Ticket) -> Result<(OwnedFd, u64), IpcError> {
    let stream = UnixStream::connect_addr(&address(ticket.server).map_err(IpcError::Fetch)?)
        .map_err(IpcError::Fetch)?;
    let asked = stream
        .set_read_timeout(Some(ANSWER_WITHIN))
        .and_then(|()| stream.set_write_timeout(Some(ANSWER_WITHIN)))
        .and_then(|()| (&stream).write_all(&ticket.export.to_le_bytes()));
    asked.map_err(IpcError::Fetch)?;
    let mut size = [0u8; 8];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(
        &stream,
        &mut [IoSliceMut::new(&mut size)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|error| IpcError::Fetch(error.into()))?;
    let fd = control.drain().find_map(|message| match message {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    let size = u64::from_le_bytes(size);
    match fd {
        Some(fd) if received.bytes == 8 && size == ticket.size && size > 0 => Ok((fd, size)),
        _ => Err(IpcError::Gone),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_survives_its_handle_and_other_handles_are_not_tickets() {
        let ticket = Ticket {
            server: 0x0123_4567_89ab_cdef,
            export: u64::MAX,
            size: 2 << 20,
        };
        let bytes = ticket.to_bytes();
        assert_eq!(Ticket::from_bytes(&bytes), Some(ticket));
        assert_eq!(Ticket::from_bytes(&[0u8; 64]), None, "the driver's handle");
        let mut driver_like = bytes;
        driver_like[40] = 1;
        assert_eq!(
            Ticket::from_bytes(&driver_like),
            None,
            "bytes beyond the values"
        );
        let mut other = bytes;
        other[0] ^= 1;
        assert_eq!(Ticket::from_bytes(&other), None, "another magic");
    }

    #[test]
    fn a_server_hands_over_a_live_export_and_nothing_for_another() {
        let ipc = Ipc::default();
        let server = ipc.server().expect("a server");
        let file = std::fs::File::open("/proc/self/exe").expect("a file");
        let length = file.metadata().expect("its metadata").len();
        ipc.exports.lock().expect("the table").insert(
            7,
            Export {
                fd: file.into(),
                size: 4096,
            },
        );
        let (fd, size) = fetch(Ticket {
            server,
            export: 7,
            size: 4096,
        })
        .expect("the export");
        assert_eq!(size, 4096);
        let received = std::fs::File::from(fd)
            .metadata()
            .expect("its metadata")
            .len();
        assert_eq!(received, length, "the same file");

        ipc.forget(7);
        let gone = fetch(Ticket {
            server,
            export: 7,
            size: 4096,
        });
        assert!(matches!(gone, Err(IpcError::Gone)), "{gone:?}");
        let unknown = fetch(Ticket {
            server: server ^ 1,
            export: 7,
            size: 4096,
        });
        assert!(matches!(unknown, Err(IpcError::Fetch(_))), "{unknown:?}");
    }
}
