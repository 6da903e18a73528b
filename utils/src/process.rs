//! Processes as `/proc` and `kill(2)` see them: this process's pid and pid
//! namespace, `/proc/<pid>/stat`, the one pid-liveness check of the
//! workspace, and whether a process maps a given file (`/proc/<pid>/maps`).

use std::collections::HashSet;
use std::io::{self, BufRead};
use std::os::unix::fs::MetadataExt;

/// This process's pid, in its own pid namespace.
pub fn current_pid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

/// Inode of this process's pid namespace, 0 if `/proc` cannot tell.
pub fn own_pid_ns() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |meta| meta.ino())
}

/// The two fields of `/proc/<pid>/stat` the ledger needs.
pub struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// Field 22: start time in clock ticks after boot.
    pub start_time: u64,
}

/// Reads the state and start time from a `/proc/<pid>/stat` file at `path`.
pub fn read_proc_stat(path: &str) -> io::Result<ProcStat> {
    let text = std::fs::read_to_string(path)?;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat");
    // Field 2 (comm) is parenthesised and may contain spaces and ')'.
    let (_, rest) = text.rsplit_once(')').ok_or_else(malformed)?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields
        .next()
        .and_then(|field| field.chars().next())
        .ok_or_else(malformed)?;
    let start_time = fields
        .nth(22 - 4)
        .and_then(|field| field.parse().ok())
        .ok_or_else(malformed)?;
    Ok(ProcStat { state, start_time })
}

/// Whether the process registered as (`pid`, `start_time`) has exited: no such
/// pid, a zombie (the driver has freed its memory), or a different process
/// that reuses the pid. `start_time` 0 (unknown) checks only existence.
/// Anything `/proc` cannot tell counts as alive.
pub fn process_is_gone(pid: i32, start_time: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that the pid exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    match read_proc_stat(&format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.state == 'Z'
                || stat.state == 'X'
                || (start_time != 0 && stat.start_time != start_time)
        }
        Err(err) => err.kind() == io::ErrorKind::NotFound,
    }
}

/// A file as `/proc/<pid>/maps` tells it apart from every other: its
/// device and inode, whatever name or mount it is reached by. Taken from a
/// maps line, never from `stat`, whose device number may differ (btrfs
/// subvolumes, overlay).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// The device's major number.
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
    /// The inode on that device.
    pub ino: u64,
}

impl FileId {
    /// The file a line of `/proc/<pid>/maps` maps (`start-end perms offset
    /// major:minor inode [path]`, the device in hexadecimal); `None` for an
    /// anonymous mapping or a line it cannot read.
    fn of_maps_line(line: &str) -> Option<Self> {
        let mut fields = line.split_ascii_whitespace().skip(3);
        let (major, minor) = fields.next()?.split_once(':')?;
        let ino = fields.next()?.parse().ok().filter(|&ino| ino != 0)?;
        Some(Self {
            major: u32::from_str_radix(major, 16).ok()?,
            minor: u32::from_str_radix(minor, 16).ok()?,
            ino,
        })
    }
}

/// The files process `pid` (of this process's pid namespace) maps, each
/// once, as the kernel lists its mappings in `/proc/<pid>/maps`. A process
/// that has exited, a zombie (its mappings are gone), one this process may
/// not inspect, or pid 0 maps nothing.
pub fn mapped_files(pid: u32) -> HashSet<FileId> {
    mappings(pid).map(Iterator::collect).unwrap_or_default()
}

/// The file this process maps at `address`, from its own
/// `/proc/self/maps`; `None` for an anonymous mapping, or where `/proc`
/// cannot tell.
pub fn mapped_at(address: usize) -> Option<FileId> {
    let maps = std::fs::File::open("/proc/self/maps").ok()?;
    io::BufReader::new(maps)
        .lines()
        .map_while(Result::ok)
        .find(|line| {
            line.split(' ')
                .next()
                .and_then(|range| range.split_once('-'))
                .and_then(|(start, end)| {
                    Some((
                        usize::from_str_radix(start, 16).ok()?,
                        usize::from_str_radix(end, 16).ok()?,
                    ))
                })
                .is_some_and(|(start, end)| (start..end).contains(&address))
        })
        .and_then(|line| FileId::of_maps_line(&line))
}

/// The files of `/proc/<pid>/maps`, line by line; `None` where it cannot
/// be read.
fn mappings(pid: u32) -> Option<impl Iterator<Item = FileId>> {
    if pid == 0 {
        return None;
    }
    let maps = std::fs::File::open(format!("/proc/{pid}/maps")).ok()?;
    Some(
        io::BufReader::new(maps)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| FileId::of_maps_line(&line)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maps_line_names_its_file_by_device_and_inode() {
        let line = "7f3a1c000000-7f3a1c01c000 rw-s 00000000 00:1a 123456   /dev/shm/gpushare-pod-a";
        assert_eq!(
            FileId::of_maps_line(line),
            Some(FileId {
                major: 0,
                minor: 0x1a,
                ino: 123_456
            })
        );
        let anonymous = "7ffd5c1e8000-7ffd5c209000 rw-p 00000000 00:00 0      [stack]";
        assert_eq!(FileId::of_maps_line(anonymous), None);
        assert_eq!(FileId::of_maps_line("garbage"), None);
    }

    #[test]
    fn a_mapping_of_this_process_is_found_by_its_address_and_in_its_maps() {
        let dir = crate::test_dir::Dir::new("maps");
        let path = dir.0.join("mapped");
        std::fs::write(&path, [0u8; 8192]).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        // SAFETY: a fresh private read-only mapping of an open file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let id = mapped_at(base as usize + 4096).expect("mapped");
        assert_eq!(id.ino, file.metadata().expect("stat").ino());
        assert!(mapped_files(std::process::id()).contains(&id));
        assert!(mapped_files(0).is_empty());
        // SAFETY: the mapping made above, unused from here on.
        unsafe { libc::munmap(base, 8192) };
        assert!(!mapped_files(std::process::id()).contains(&id), "unmapped");
        let stack = 0u8;
        assert_eq!(mapped_at(&raw const stack as usize), None, "anonymous");
    }
}
