//! What a swap of the memory the limiter backs (`backing::swap`) needs
//! besides the VMM functions: the calling thread's current context set and
//! restored (the link thread that swaps has none of its own), a context's
//! work waited for, host memory pinned as it is first copied into, and
//! copies between it and the device on a stream of the limiter's own.
//! Called from the limiter's own threads, under the detour guard, so the
//! gate's detours of the copies pass them straight to the driver.
//!
//! **Host buffers** ([`HostBuffer`]) are anonymous mappings the kernel is
//! asked to back with transparent huge pages, pinned by the driver
//! (`cuMemHostRegister`) one chunk ([`PIN_CHUNK`]) at a time: a swap pins a
//! chunk while the copy of the one before runs, so pinning, which costs
//! more than the copy the first time, overlaps it. The driver's own
//! `cuMemHostAlloc` allocates, zeroes and pins in one call, 3 to 5 s for
//! 8 GiB on an H200, against about 1.3 s to register the same memory
//! backed by huge pages.

use std::ffi::c_void;

use super::prefault::Span;
use super::{DriverError, symbol};
use crate::sys::{
    CU_LIMIT_STACK_SIZE, CU_MEMHOSTREGISTER_PORTABLE, CU_STREAM_NON_BLOCKING, CUcontext,
    CUdeviceptr, CUstream, CuCtxGetCurrent, CuCtxGetLimit, CuCtxSetCurrent, CuCtxSetLimit,
    CuCtxSynchronize, CuMemHostRegister, CuMemHostUnregister, CuMemcpyDtoHAsync, CuMemcpyHtoDAsync,
    CuStreamCreate, CuStreamDestroy, CuStreamSynchronize,
};

/// The bytes of a host buffer pinned at once.
pub(crate) const PIN_CHUNK: u64 = 256 << 20;

/// The alignment of host buffers: a huge page, so that the kernel can back
/// all of a buffer with them.
const HUGE_PAGE: usize = 2 << 20;

/// The driver's functions for copies to host memory and back; absent
/// (`None` from [`Copies::load`]) from drivers that lack any of them.
pub(crate) struct Copies {
    get_current: CuCtxGetCurrent,
    set_current: CuCtxSetCurrent,
    synchronize: CuCtxSynchronize,
    register: CuMemHostRegister,
    unregister: CuMemHostUnregister,
    stream_create: CuStreamCreate,
    stream_synchronize: CuStreamSynchronize,
    stream_destroy: CuStreamDestroy,
    to_host: CuMemcpyDtoHAsync,
    to_device: CuMemcpyHtoDAsync,
    /// The context limits, to give back the threads' stacks while a
    /// context's memory is away; absent from drivers that lack them.
    limits: Option<(CuCtxGetLimit, CuCtxSetLimit)>,
}

/// Host memory for one range's copy, of [`Copies::host_buffer`]: its
/// address, kept as a number so that the book that holds it can be shared
/// between threads, and how much of it is pinned. Given back only through
/// [`Copies::free_buffer`], which consumes it.
#[derive(Debug)]
pub(crate) struct HostBuffer {
    address: usize,
    bytes: u64,
    /// The bytes from the start pinned, in whole chunks (the last one may
    /// be short).
    pinned: u64,
}

impl HostBuffer {
    /// The bytes of it pinned.
    pub(crate) fn pinned(&self) -> u64 {
        self.pinned
    }

    /// Its chunks, as (offset, length), in order.
    pub(crate) fn chunks(&self) -> impl Iterator<Item = (u64, u64)> + use<> {
        let bytes = self.bytes;
        (0..bytes)
            .step_by(PIN_CHUNK as usize)
            .map(move |offset| (offset, PIN_CHUNK.min(bytes - offset)))
    }

    /// Its chunks not pinned yet, as spans of memory (they hold nothing:
    /// only pinned chunks are copied into), in the order they are pinned.
    pub(crate) fn unpinned_spans(&self) -> impl Iterator<Item = Span> + use<> {
        let (address, pinned) = (self.address, self.pinned);
        self.chunks()
            .filter(move |&(offset, _)| offset >= pinned)
            .filter_map(move |(offset, len)| {
                Some(Span {
                    address: address.checked_add(usize::try_from(offset).ok()?)?,
                    len: usize::try_from(len).ok()?,
                })
            })
    }

    /// The host address of `offset`, after checking that `offset..+len`
    /// lies in the pinned part.
    fn pinned_at(&self, offset: u64, len: u64) -> Result<usize, DriverError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.pinned => usize::try_from(offset)
                .ok()
                .and_then(|offset| self.address.checked_add(offset))
                .ok_or(DriverError::INVALID_VALUE),
            _ => Err(DriverError::INVALID_VALUE),
        }
    }
}

/// A stream of the limiter's own, in the context current when it was made,
/// for a swap's copies: the program's streams carry on (none of its work is
/// left, the swap waited for it), and one stream keeps the chunks of a
/// range in order. Synchronized and destroyed by [`Copies::finish`].
#[derive(Debug)]
pub(crate) struct CopyStream(usize);

impl Copies {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    ///
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                get_current: symbol(handle, c"cuCtxGetCurrent")?,
                set_current: symbol(handle, c"cuCtxSetCurrent")?,
                synchronize: symbol(handle, c"cuCtxSynchronize")?,
                register: symbol(handle, c"cuMemHostRegister_v2")?,
                unregister: symbol(handle, c"cuMemHostUnregister")?,
                stream_create: symbol(handle, c"cuStreamCreate")?,
                stream_synchronize: symbol(handle, c"cuStreamSynchronize")?,
                stream_destroy: symbol(handle, c"cuStreamDestroy_v2")?,
                to_host: symbol(handle, c"cuMemcpyDtoHAsync_v2")?,
                to_device: symbol(handle, c"cuMemcpyHtoDAsync_v2")?,
                limits: symbol(handle, c"cuCtxGetLimit").zip(symbol(handle, c"cuCtxSetLimit")),
            })
        }
    }

    /// The calling thread's current context, as a number (0: none).
    pub(crate) fn current(&self) -> Result<usize, DriverError> {
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        unsafe { (self.get_current)(&mut context) }.result()?;
        Ok(context as usize)
    }

    /// Makes `context` (a number [`Self::current`] returned; 0: none) the
    /// calling thread's current context.
    pub(crate) fn make_current(&self, context: usize) -> Result<(), DriverError> {
        // SAFETY: a context the driver handed out, or none; the driver
        // checks that it is alive.
        unsafe { (self.set_current)(context as CUcontext) }.result()
    }

    /// The stack of each thread of the calling thread's current context, in
    /// bytes; `None` where the driver cannot say or set it.
    pub(crate) fn stack_size(&self) -> Option<Result<usize, DriverError>> {
        let (get, _) = self.limits?;
        let mut bytes = 0usize;
        // SAFETY: a valid out-pointer and a limit every driver knows.
        Some(
            unsafe { get(&mut bytes, CU_LIMIT_STACK_SIZE) }
                .result()
                .map(|()| bytes),
        )
    }

    /// Sets the stack of each thread of the calling thread's current
    /// context (the driver takes at least what its kernels need, and
    /// sizes the memory it reserves for stacks by it).
    pub(crate) fn set_stack_size(&self, bytes: usize) -> Result<(), DriverError> {
        let (_, set) = self.limits.ok_or(DriverError::NOT_FOUND)?;
        // SAFETY: a limit every driver knows, at a size it checks.
        unsafe { set(CU_LIMIT_STACK_SIZE, bytes) }.result()
    }

    /// Waits for all the work of the calling thread's current context.
    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() }.result()
    }

    /// `bytes` of host memory, aligned to a huge page and asked to be
    /// backed by huge pages; none of it pinned yet, nor touched.
    pub(crate) fn host_buffer(&self, bytes: u64) -> Result<HostBuffer, DriverError> {
        let size = usize::try_from(bytes)
            .ok()
            .filter(|&size| size > 0)
            .ok_or(DriverError::INVALID_VALUE)?;
        let mapped = size
            .checked_add(HUGE_PAGE)
            .ok_or(DriverError::INVALID_VALUE)?;
        // SAFETY: a new private anonymous mapping; no existing memory is named.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        let base = base as usize;
        let address = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (address - base, mapped - size - (address - base));
        // SAFETY: the head and tail are parts of the mapping just made,
        // outside the buffer kept; unmapping them cannot fail but on
        // arguments, which are page-aligned here (mmap's base and a huge
        // page are).
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut c_void, head);
            }
            if tail > 0 {
                libc::munmap((address + size) as *mut c_void, tail);
            }
            // Only advice: a kernel without transparent huge pages backs the
            // buffer with small pages, which pin more slowly.
            libc::madvise(address as *mut c_void, size, libc::MADV_HUGEPAGE);
        }
        Ok(HostBuffer {
            address,
            bytes,
            pinned: 0,
        })
    }

    /// Pins `buffer`'s chunks up to the one that holds byte `end - 1`.
    pub(crate) fn pin_through(&self, buffer: &mut HostBuffer, end: u64) -> Result<(), DriverError> {
        let end = end.min(buffer.bytes);
        while buffer.pinned < end {
            let offset = buffer.pinned;
            let len = PIN_CHUNK.min(buffer.bytes - offset);
            let (at, size) = match (usize::try_from(offset), usize::try_from(len)) {
                (Ok(offset), Ok(len)) => (buffer.address + offset, len),
                _ => return Err(DriverError::INVALID_VALUE),
            };
            // SAFETY: `at..at + size` lies in the buffer's mapping, which
            // the limiter owns; the driver faults it in and pins it.
            unsafe { (self.register)(at as *mut c_void, size, CU_MEMHOSTREGISTER_PORTABLE) }
                .result()?;
            buffer.pinned = offset + len;
        }
        Ok(())
    }

    /// Unpins and unmaps `buffer`; the driver refusing to unpin a chunk
    /// hands it back with its answer (the chunks before are unpinned).
    pub(crate) fn free_buffer(
        &self,
        mut buffer: HostBuffer,
    ) -> Result<(), (HostBuffer, DriverError)> {
        while buffer.pinned > 0 {
            let last = (buffer.pinned - 1) / PIN_CHUNK * PIN_CHUNK;
            let Ok(offset) = usize::try_from(last) else {
                return Err((buffer, DriverError::INVALID_VALUE));
            };
            // SAFETY: the start of a chunk `pin_through` registered.
            let result = unsafe { (self.unregister)((buffer.address + offset) as *mut c_void) };
            if let Err(error) = result.result() {
                return Err((buffer, error));
            }
            buffer.pinned = last;
        }
        let size = usize::try_from(buffer.bytes).unwrap_or(0);
        // SAFETY: the mapping `host_buffer` made, nothing of it pinned now;
        // `buffer` is consumed, so it is unmapped once.
        unsafe { libc::munmap(buffer.address as *mut c_void, size) };
        Ok(())
    }

    /// A stream of the limiter's own in the calling thread's current context.
    pub(crate) fn stream(&self) -> Result<CopyStream, DriverError> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; a non-blocking stream does not wait
        // for the legacy default stream, which the swap already waited for.
        unsafe { (self.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING) }.result()?;
        Ok(CopyStream(stream as usize))
    }

    /// Waits for the copies queued on `stream`, then destroys it: the
    /// first failure of the two.
    pub(crate) fn finish(&self, stream: CopyStream) -> Result<(), DriverError> {
        let handle = stream.0 as CUstream;
        // SAFETY: a stream `stream` made, destroyed once here (consumed).
        let waited = unsafe { (self.stream_synchronize)(handle) }.result();
        // SAFETY: as above.
        let destroyed = unsafe { (self.stream_destroy)(handle) }.result();
        waited.and(destroyed)
    }

    /// Queues the copy of `len` bytes at `source` on the device into
    /// `buffer` at `offset`, which must be pinned.
    pub(crate) fn to_host(
        &self,
        buffer: &HostBuffer,
        offset: u64,
        len: u64,
        source: CUdeviceptr,
        stream: &CopyStream,
    ) -> Result<(), DriverError> {
        let at = buffer.pinned_at(offset, len)?;
        let size = usize::try_from(len).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: `at..at + size` is pinned memory of the buffer, which
        // lives until the stream is finished (the swap holds the book);
        // the driver checks the device range.
        unsafe { (self.to_host)(at as *mut c_void, source, size, stream.0 as CUstream) }.result()
    }

    /// Queues the copy of `len` bytes of `buffer` at `offset`, which must be
    /// pinned, to the device memory at `target`.
    pub(crate) fn to_device(
        &self,
        target: CUdeviceptr,
        buffer: &HostBuffer,
        offset: u64,
        len: u64,
        stream: &CopyStream,
    ) -> Result<(), DriverError> {
        let at = buffer.pinned_at(offset, len)?;
        let size = usize::try_from(len).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: as in `to_host`, the other way.
        unsafe { (self.to_device)(target, at as *const c_void, size, stream.0 as CUstream) }
            .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_pinned_and_copied_in_whole_chunks_the_last_one_short() {
        let buffer = HostBuffer {
            address: 0,
            bytes: 2 * PIN_CHUNK + 5,
            pinned: PIN_CHUNK,
        };
        let chunks: Vec<(u64, u64)> = buffer.chunks().collect();
        assert_eq!(
            chunks,
            [(0, PIN_CHUNK), (PIN_CHUNK, PIN_CHUNK), (2 * PIN_CHUNK, 5)]
        );
        // Only what is pinned may be copied.
        assert!(buffer.pinned_at(0, PIN_CHUNK).is_ok());
        assert!(buffer.pinned_at(PIN_CHUNK, 1).is_err());
        assert!(buffer.pinned_at(u64::MAX, 2).is_err());
        // What is left to pin, chunk by chunk.
        let spans: Vec<Span> = buffer.unpinned_spans().collect();
        let chunk = PIN_CHUNK as usize;
        assert_eq!(
            spans,
            [
                Span {
                    address: chunk,
                    len: chunk
                },
                Span {
                    address: 2 * chunk,
                    len: 5
                }
            ]
        );
    }
}
