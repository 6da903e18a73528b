//! What a CUDA code image will take on the device when it is loaded: the
//! bytes of its `__device__` globals. The CUDA runtime registers a
//! program's kernels as libraries from memory images and the driver takes
//! their globals only at the first use in a context (a first launch), which
//! cannot be undone; reading the sizes from the image lets that first use
//! be reserved, or refused, before the driver takes anything.
//!
//! An image is a fat binary (`0xBA55ED50`, directly or behind the
//! runtime's `__fatBinC_Wrapper_t`), an ELF cubin, or PTX text. A fat
//! binary holds entries for several architectures, each an ELF cubin or
//! PTX, possibly compressed (zstd or LZ4); the cubin for the device's
//! architecture says what its globals take (the sizes of its `.nv.global*`
//! sections), PTX says it in its `.global` declarations. Every read is
//! bounds-checked: an image is the caller's.

use std::io::Read;

/// A fat binary's first word.
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// The runtime's wrapper around a fat binary (`__fatBinC_Wrapper_t`).
const WRAPPER_MAGIC: u32 = 0x4662_43B1;
const ELF_MAGIC: [u8; 4] = *b"\x7fELF";
/// A fat binary's header: magic, version, header size, then the bytes of
/// its entries.
const FATBIN_HEADER: usize = 16;
/// An entry's fixed part (some entries have a longer header).
const ENTRY_HEADER: usize = 64;
const KIND_PTX: u16 = 1;
const KIND_ELF: u16 = 2;
/// Entry flags: the payload is zstd-compressed, or LZ4-compressed.
const FLAG_ZSTD: u64 = 0x8000;
const FLAG_LZ4: u64 = 0x2000;
/// A payload larger than this is not decompressed (nothing a real cubin
/// needs; it bounds what a malformed entry can make us allocate).
const MAX_PAYLOAD: usize = 1 << 30;
/// ELF section type of a section with no bytes in the file (`.nv.global`).
const SHT_NOBITS: u32 = 8;
/// PTX is read up to this many bytes (a NUL ends it sooner).
const MAX_PTX: usize = 64 << 20;

/// The bytes of an image whose length its own headers say; `None` when the
/// pointer holds none of the formats above.
///
/// # Safety
///
/// `image` is null or points at a code image the driver accepts (a fat
/// binary or its wrapper, a cubin, or NUL-terminated PTX), valid for reads
/// for as long as the returned slice is used.
pub(crate) unsafe fn extent<'a>(image: *const u8) -> Option<&'a [u8]> {
    if image.is_null() {
        return None;
    }
    // SAFETY: every image format starts with at least 4 readable bytes.
    let head = unsafe { std::slice::from_raw_parts(image, 4) };
    let magic = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    match magic {
        WRAPPER_MAGIC => {
            // SAFETY: the wrapper is {int magic; int version; const
            // unsigned long long *data; void *filename}, 8-byte aligned.
            let data = unsafe { image.add(8).cast::<*const u8>().read_unaligned() };
            // SAFETY: the wrapper's data is the fat binary it wraps.
            unsafe { fatbin_extent(data) }
        }
        // SAFETY: forwarded.
        FATBIN_MAGIC => unsafe { fatbin_extent(image) },
        // SAFETY: forwarded.
        _ if head == ELF_MAGIC => unsafe { elf_extent(image) },
        // PTX is text; anything else (LTO IR, unknown formats) is left
        // alone, its length being its own format's business.
        _ if head
            .iter()
            .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace()) =>
        {
            // PTX: text up to its NUL.
            let mut len = 0;
            // SAFETY: PTX is NUL-terminated; read byte by byte up to it.
            while len < MAX_PTX && unsafe { image.add(len).read() } != 0 {
                len += 1;
            }
            // SAFETY: the `len` bytes just read.
            let text = unsafe { std::slice::from_raw_parts(image, len) };
            std::str::from_utf8(text)
                .ok()
                .filter(|text| text.contains(".version"))
                .map(str::as_bytes)
        }
        _ => None,
    }
}

/// # Safety
///
/// `image` points at a whole cubin (ELF64).
unsafe fn elf_extent<'a>(image: *const u8) -> Option<&'a [u8]> {
    // SAFETY: an ELF64 header is 64 bytes.
    let header = unsafe { std::slice::from_raw_parts(image, 64) };
    if header[4] != 2 || header[5] != 1 {
        return None;
    }
    let shoff = usize::try_from(read_u64(header, 0x28)?).ok()?;
    let entsize = usize::from(read_u16(header, 0x3a)?);
    let count = usize::from(read_u16(header, 0x3c)?);
    let phoff = usize::try_from(read_u64(header, 0x20)?).ok()?;
    let phend = phoff
        .checked_add(usize::from(read_u16(header, 0x36)?) * usize::from(read_u16(header, 0x38)?))?;
    let shend = shoff.checked_add(entsize.checked_mul(count)?)?;
    let mut end = shend.max(phend).max(64);
    if entsize >= 64 {
        // SAFETY: the section headers the ELF header locates.
        let sections = unsafe { std::slice::from_raw_parts(image.add(shoff), shend - shoff) };
        for section in sections.chunks_exact(entsize) {
            if read_u32(section, 4)? != SHT_NOBITS {
                let at = usize::try_from(read_u64(section, 0x18)?).ok()?;
                let size = usize::try_from(read_u64(section, 0x20)?).ok()?;
                end = end.max(at.checked_add(size)?);
            }
        }
    }
    (end <= MAX_PAYLOAD).then(|| {
        // SAFETY: a cubin holds its headers and its sections' bytes.
        unsafe { std::slice::from_raw_parts(image, end) }
    })
}

/// Whether `address` lies in an object the dynamic loader mapped (the
/// program or a shared library): an image there lives as long as that
/// object, as the runtime's fat binaries do.
pub(crate) fn in_loaded_object(address: *const u8) -> bool {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::uninit();
    // SAFETY: dladdr only reads the loader's tables and writes `info`.
    unsafe { libc::dladdr(address.cast(), info.as_mut_ptr()) != 0 }
}

/// # Safety
///
/// `data` points at a fat binary.
unsafe fn fatbin_extent<'a>(data: *const u8) -> Option<&'a [u8]> {
    if data.is_null() {
        return None;
    }
    // SAFETY: a fat binary starts with its 16-byte header.
    let header = unsafe { std::slice::from_raw_parts(data, FATBIN_HEADER) };
    if read_u32(header, 0)? != FATBIN_MAGIC {
        return None;
    }
    let header_size = usize::from(read_u16(header, 6)?);
    let entries = usize::try_from(read_u64(header, 8)?).ok()?;
    let len = header_size.checked_add(entries)?;
    // SAFETY: the header says how many bytes follow it.
    Some(unsafe { std::slice::from_raw_parts(data, len) })
}

/// The bytes of `__device__` globals `image` takes when loaded on a device
/// of compute capability `arch` (major × 10 + minor); `None` when the image
/// says nothing this can read for that device.
pub(crate) fn globals(image: &[u8], arch: u32) -> Option<u64> {
    match read_u32(image, 0)? {
        FATBIN_MAGIC => fatbin_globals(image, arch),
        _ if image.starts_with(&ELF_MAGIC) => elf_globals(image),
        _ => ptx_globals(std::str::from_utf8(image).ok()?),
    }
}

/// A fat binary's globals: from its cubin for `arch`, else from the PTX
/// the driver would compile for it (the newest not above `arch`).
fn fatbin_globals(image: &[u8], arch: u32) -> Option<u64> {
    let header_size = usize::from(read_u16(image, 6)?);
    let end = header_size.checked_add(usize::try_from(read_u64(image, 8)?).ok()?)?;
    let body = image.get(..end)?;
    let mut ptx: Option<(u32, Entry<'_>)> = None;
    let mut at = header_size;
    while at + ENTRY_HEADER <= body.len() {
        let entry = Entry::at(body, at)?;
        at = entry.next;
        match entry.kind {
            KIND_ELF if entry.arch == arch => return elf_globals(&entry.payload()?),
            KIND_PTX if entry.arch <= arch && ptx.as_ref().is_none_or(|(a, _)| *a < entry.arch) => {
                ptx = Some((entry.arch, entry));
            }
            _ => {}
        }
    }
    let (_, entry) = ptx?;
    let payload = entry.payload()?;
    let text = payload.split(|&b| b == 0).next()?;
    ptx_globals(std::str::from_utf8(text).ok()?)
}

/// One entry of a fat binary.
struct Entry<'a> {
    kind: u16,
    arch: u32,
    flags: u64,
    /// The payload as stored (compressed or not).
    stored: &'a [u8],
    uncompressed: usize,
    next: usize,
}

impl<'a> Entry<'a> {
    fn at(body: &'a [u8], at: usize) -> Option<Self> {
        let header = body.get(at..at + ENTRY_HEADER)?;
        let header_size = usize::try_from(read_u32(header, 4)?).ok()?;
        let padded = usize::try_from(read_u64(header, 8)?).ok()?;
        let compressed = usize::try_from(read_u32(header, 16)?).ok()?;
        let start = at.checked_add(header_size.max(ENTRY_HEADER))?;
        let next = start.checked_add(padded)?;
        let flags = read_u64(header, 40)?;
        let compressed_flags = flags & (FLAG_ZSTD | FLAG_LZ4) != 0;
        let stored_len = if compressed_flags && compressed > 0 {
            compressed.min(padded)
        } else {
            padded
        };
        Some(Self {
            kind: read_u16(header, 0)?,
            arch: read_u32(header, 28)?,
            flags,
            stored: body.get(start..start.checked_add(stored_len)?)?,
            uncompressed: usize::try_from(read_u64(header, 56)?).ok()?,
            next,
        })
    }

    /// The payload, decompressed when stored compressed.
    fn payload(&self) -> Option<std::borrow::Cow<'a, [u8]>> {
        if self.flags & FLAG_ZSTD != 0 {
            let limit = self.uncompressed.min(MAX_PAYLOAD) as u64;
            let mut decoder = ruzstd::decoding::StreamingDecoder::new(self.stored).ok()?;
            let mut out = Vec::with_capacity(limit as usize);
            (&mut decoder).take(limit).read_to_end(&mut out).ok()?;
            Some(out.into())
        } else if self.flags & FLAG_LZ4 != 0 {
            if self.uncompressed > MAX_PAYLOAD {
                return None;
            }
            lz4_flex::block::decompress(self.stored, self.uncompressed)
                .ok()
                .map(Into::into)
        } else {
            Some(self.stored.into())
        }
    }
}

/// The sum of a cubin's `.nv.global*` sections (`.nv.global` holds the
/// uninitialised globals, `.nv.global.init` the initialised ones).
fn elf_globals(elf: &[u8]) -> Option<u64> {
    if !elf.starts_with(&ELF_MAGIC) || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return None; // only little-endian ELF64
    }
    let shoff = usize::try_from(read_u64(elf, 0x28)?).ok()?;
    let entsize = usize::from(read_u16(elf, 0x3a)?);
    let count = usize::from(read_u16(elf, 0x3c)?);
    let names_index = usize::from(read_u16(elf, 0x3e)?);
    if entsize < 64 {
        return None;
    }
    let section = |index: usize| elf.get(shoff + index * entsize..shoff + (index + 1) * entsize);
    let names = section(names_index)?;
    let names_at = usize::try_from(read_u64(names, 0x18)?).ok()?;
    let names_len = usize::try_from(read_u64(names, 0x20)?).ok()?;
    let names = elf.get(names_at..names_at.checked_add(names_len)?)?;
    let mut total = 0u64;
    for index in 0..count {
        let header = section(index)?;
        let name_at = usize::try_from(read_u32(header, 0)?).ok()?;
        let name = names.get(name_at..)?.split(|&b| b == 0).next()?;
        if name.starts_with(b".nv.global") {
            let kind = read_u32(header, 4)?;
            let size = read_u64(header, 0x20)?;
            if kind == SHT_NOBITS || name == b".nv.global.init" {
                total = total.saturating_add(size);
            }
        }
    }
    Some(total)
}

/// The bytes of the `.global` variables PTX declares (not those it only
/// names with `.extern`).
fn ptx_globals(text: &str) -> Option<u64> {
    if !text.contains(".version") {
        return None;
    }
    let mut total = 0u64;
    for statement in text.split(';') {
        let tokens: Vec<&str> = statement.split_whitespace().collect();
        if !tokens.contains(&".global") || tokens.contains(&".extern") {
            continue;
        }
        // `.visible .global .align 8 .b8 name[4096]`: a type, then the name.
        let Some(at) = tokens.iter().position(|t| element_size(t).is_some()) else {
            continue;
        };
        let Some(size) = element_size(tokens[at]) else {
            continue;
        };
        let Some(declarator) = tokens.get(at + 1) else {
            continue;
        };
        let declarator = declarator.split('=').next().unwrap_or_default();
        let mut count = 1u64;
        for dimension in declarator.split('[').skip(1) {
            let digits = dimension.trim_end_matches(']');
            count = count.saturating_mul(digits.parse().unwrap_or(0));
        }
        total = total.saturating_add(count.saturating_mul(size));
    }
    Some(total)
}

/// The bytes of a PTX fundamental type, e.g. `.b8` or `.f64`.
fn element_size(token: &str) -> Option<u64> {
    let kind = token.strip_prefix('.')?;
    let (class, bits) = kind.split_at_checked(1)?;
    if !matches!(class, "b" | "u" | "s" | "f") {
        return None;
    }
    let bits: u64 = bits.parse().ok()?;
    matches!(bits, 8 | 16 | 32 | 64).then_some(bits / 8)
}

fn read_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal little-endian ELF64 with a `.nv.global` of `bytes` and a
    /// `.nv.global.init` of `init` bytes (and an unrelated `.text`).
    fn cubin(bytes: u64, init: u64) -> Vec<u8> {
        let names = b"\0.shstrtab\0.nv.global\0.nv.global.init\0.text\0";
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(&ELF_MAGIC);
        elf[4] = 2;
        elf[5] = 1;
        let names_at = elf.len() as u64;
        elf.extend_from_slice(names);
        let init_at = elf.len() as u64;
        elf.extend(std::iter::repeat_n(7u8, init as usize));
        while !elf.len().is_multiple_of(8) {
            elf.push(0);
        }
        let shoff = elf.len() as u64;
        // (name offset, type, file offset, size)
        let sections: [(u32, u32, u64, u64); 5] = [
            (0, 0, 0, 0),
            (1, 3, names_at, names.len() as u64),
            (11, SHT_NOBITS, 0, bytes),
            (22, 1, init_at, init),
            (38, 1, names_at, 8),
        ];
        for (name, kind, offset, size) in sections {
            let mut header = [0u8; 64];
            header[0..4].copy_from_slice(&name.to_le_bytes());
            header[4..8].copy_from_slice(&kind.to_le_bytes());
            header[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
            header[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            elf.extend_from_slice(&header);
        }
        elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&5u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf
    }

    /// A fat binary of (kind, arch, flags, payload as stored, uncompressed size).
    fn fatbin(entries: &[(u16, u32, u64, Vec<u8>, usize)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (kind, arch, flags, stored, uncompressed) in entries {
            let padded = stored.len().next_multiple_of(8);
            let compressed = if flags & (FLAG_ZSTD | FLAG_LZ4) != 0 {
                stored.len()
            } else {
                0
            };
            let mut header = [0u8; ENTRY_HEADER];
            header[0..2].copy_from_slice(&kind.to_le_bytes());
            header[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
            header[4..8].copy_from_slice(&(ENTRY_HEADER as u32).to_le_bytes());
            header[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
            header[16..20].copy_from_slice(&(compressed as u32).to_le_bytes());
            header[28..32].copy_from_slice(&arch.to_le_bytes());
            header[40..48].copy_from_slice(&flags.to_le_bytes());
            header[56..64].copy_from_slice(&(*uncompressed as u64).to_le_bytes());
            body.extend_from_slice(&header);
            body.extend_from_slice(stored);
            body.resize(body.len() + padded - stored.len(), 0);
        }
        let mut image = Vec::new();
        image.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        image.extend_from_slice(&1u16.to_le_bytes());
        image.extend_from_slice(&(FATBIN_HEADER as u16).to_le_bytes());
        image.extend_from_slice(&(body.len() as u64).to_le_bytes());
        image.extend_from_slice(&body);
        image
    }

    const PTX: &str = ".version 9.0\n.target sm_90\n.address_size 64\n\
        .visible .global .align 1 .b8 big[3221225472];\n\
        .global .align 8 .u64 counters[4][16];\n\
        .extern .global .align 4 .b32 elsewhere[1024];\n\
        .visible .global .align 4 .f32 scale = 0f3F800000;\n\
        .visible .entry touch(.param .u64 n) { ret; }\n";

    #[test]
    fn a_cubin_takes_its_nv_global_sections() {
        assert_eq!(globals(&cubin(3 << 30, 24), 90), Some((3 << 30) + 24));
        assert_eq!(globals(&cubin(0, 0), 90), Some(0));
    }

    #[test]
    fn ptx_takes_what_it_declares_not_what_it_names() {
        assert_eq!(
            globals(PTX.as_bytes(), 90),
            Some((3 << 30) + 4 * 16 * 8 + 4)
        );
        assert_eq!(globals(b"not code at all", 90), None);
    }

    #[test]
    fn a_fat_binary_answers_from_the_cubin_for_the_device() {
        let image = fatbin(&[
            (KIND_ELF, 80, 0, cubin(1 << 20, 0), 0),
            (KIND_ELF, 90, 0, cubin(2 << 20, 0), 0),
            (KIND_PTX, 90, 0, PTX.as_bytes().to_vec(), 0),
        ]);
        assert_eq!(globals(&image, 90), Some(2 << 20));
        assert_eq!(globals(&image, 80), Some(1 << 20));
        // No cubin for sm_100: the PTX the driver would compile for it.
        assert_eq!(globals(&image, 100), Some((3 << 30) + 4 * 16 * 8 + 4));
        // Nothing the driver could load on sm_75.
        assert_eq!(globals(&image, 75), None);
    }

    #[test]
    fn compressed_entries_are_read_zstd_and_lz4() {
        let elf = cubin(5 << 20, 40);
        let zstd = ruzstd::encoding::compress_to_vec(
            &elf[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let lz4 = lz4_flex::block::compress(&elf);
        let image = fatbin(&[
            (KIND_ELF, 90, FLAG_ZSTD, zstd, elf.len()),
            (KIND_ELF, 89, FLAG_LZ4, lz4, elf.len()),
        ]);
        assert_eq!(globals(&image, 90), Some((5 << 20) + 40));
        assert_eq!(globals(&image, 89), Some((5 << 20) + 40));
    }

    /// What nvcc 13.0 writes for a translation unit with a 3 GiB
    /// `__device__` array (`nvcc -c -arch=sm_90`, and with
    /// `-gencode arch=compute_80,code=sm_80 -gencode
    /// arch=compute_90,code=[sm_90,compute_90]`): uncompressed cubins and
    /// zstd-compressed PTX, its `.nv_fatbin` section as the runtime hands it
    /// to `cuLibraryLoadData`.
    #[test]
    fn nvcc_fat_binaries_are_read() {
        const GIB3: u64 = 3 << 30;
        let one = include_bytes!("../tests/data/nvcc13_sm90_3gib_global.fatbin");
        let two = include_bytes!("../tests/data/nvcc13_sm80_sm90_3gib_global.fatbin");
        assert_eq!(globals(one, 90), Some(GIB3));
        assert_eq!(globals(two, 80), Some(GIB3));
        assert_eq!(globals(two, 90), Some(GIB3));
        // A newer GPU compiles the compressed compute_90 PTX.
        assert_eq!(globals(two, 100), Some(GIB3));
        assert_eq!(globals(two, 75), None);
        // SAFETY: the fat binary in this test's static data.
        let found = unsafe { extent(two.as_ptr()) };
        assert_eq!(found.map(<[u8]>::len), Some(two.len()));
    }

    #[test]
    fn malformed_images_say_nothing_and_never_panic() {
        let elf = cubin(1 << 20, 0);
        let image = fatbin(&[(KIND_ELF, 90, 0, elf.clone(), 0)]);
        // Every truncation of the fat binary and of the cubin.
        for len in 0..image.len() {
            let _ = globals(&image[..len], 90);
        }
        for len in 0..elf.len() {
            let _ = globals(&elf[..len], 90);
        }
        // A compressed payload that is garbage, and one whose stated size lies.
        let garbage = fatbin(&[(
            KIND_ELF,
            90,
            FLAG_ZSTD,
            vec![0x28, 0xb5, 0x2f, 0xfd, 1, 2, 3],
            1 << 20,
        )]);
        assert_eq!(globals(&garbage, 90), None);
        let lz4 = fatbin(&[(KIND_ELF, 90, FLAG_LZ4, vec![0xff; 64], usize::MAX)]);
        assert_eq!(globals(&lz4, 90), None);
        // Every byte flipped in turn: an answer or none, never a panic.
        for at in 0..image.len() {
            let mut bent = image.clone();
            bent[at] ^= 0xff;
            let _ = globals(&bent, 90);
        }
    }

    #[test]
    fn extent_reads_each_format_to_its_end() {
        let image = fatbin(&[(KIND_ELF, 90, 0, cubin(1 << 20, 0), 0)]);
        let mut padded = image.clone();
        padded.extend_from_slice(&[0xee; 32]);
        // SAFETY: a fat binary in a live vector.
        let read = unsafe { extent(padded.as_ptr()) };
        assert_eq!(read, Some(&image[..]));
        // Behind the runtime's wrapper.
        let mut wrapper = [0u8; 24];
        wrapper[0..4].copy_from_slice(&WRAPPER_MAGIC.to_le_bytes());
        wrapper[8..16].copy_from_slice(&(padded.as_ptr() as u64).to_le_bytes());
        // SAFETY: the wrapper points at the fat binary above.
        assert_eq!(unsafe { extent(wrapper.as_ptr()) }, Some(&image[..]));
        let elf = cubin(4096, 16);
        // SAFETY: a cubin in a live vector.
        assert_eq!(unsafe { extent(elf.as_ptr()) }, Some(&elf[..]));
        let ptx = format!("{PTX}\0trailing");
        // SAFETY: NUL-terminated PTX.
        assert_eq!(unsafe { extent(ptx.as_ptr()) }, Some(PTX.as_bytes()));
        // SAFETY: null is allowed.
        assert_eq!(unsafe { extent(std::ptr::null()) }, None);
    }
}
