//! The GPU a co-run GPU's MPS control daemon serves, as the node daemon
//! tells that daemon's clients.
//!
//! The node daemon runs one MPS control daemon per co-run GPU, started with
//! `CUDA_VISIBLE_DEVICES=<UUID>`: its servers serve that GPU alone, and a
//! client's CUDA enumerates it alone, as device 0. NVML knows nothing of
//! MPS: it shows every GPU of the node, and programs that count GPUs
//! through NVML before or beside CUDA (PyTorch's `torch.cuda.device_count`)
//! narrow that list only by `CUDA_VISIBLE_DEVICES`. A client whose
//! environment does not name the GPU is then shown GPUs its server does not
//! serve. So the node daemon writes the GPU's UUID in [`FILE_NAME`] in the
//! GPU's folder (`<dir>/<UUID>/`, 0755, only the node daemon writes there),
//! beside the pipe folder (`<dir>/<UUID>/pipe`, the clients'
//! `CUDA_MPS_PIPE_DIRECTORY`); the limiter of a client whose
//! `CUDA_VISIBLE_DEVICES` is unset reads it at load ([`read_beside`]) and
//! sets the variable to it before the program reads its environment.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::shm::Trust;
use crate::small_file::{self, Links, SmallFileError};

/// The file's name in the GPU's folder.
pub const FILE_NAME: &str = "gpu";

/// The most the file may hold: a UUID (`GPU-` and 36 characters) and a
/// line end, with room to spare.
const MAX_BYTES: u64 = 128;

/// Why the served GPU could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ServedGpuError {
    /// The pipe folder's path has no parent folder.
    #[error("{} has no parent folder", .0.display())]
    NoParent(PathBuf),
    /// The file is missing, not a regular file, too large or not text.
    #[error("{}: {source}", .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SmallFileError,
    },
    /// The file is owned by a uid that is not trusted to name the GPU.
    #[error("{} is owned by uid {uid}, not by the node daemon", .path.display())]
    Owner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        uid: u32,
    },
    /// The file does not hold one GPU UUID.
    #[error("{} does not hold a GPU UUID", .0.display())]
    NotAUuid(PathBuf),
}

/// Where the served GPU's file is for the pipe folder `pipe`.
pub fn path_beside(pipe: &Path) -> Option<PathBuf> {
    Some(pipe.parent()?.join(FILE_NAME))
}

/// Writes `uuid` as the GPU served from the GPU folder `gpu_dir` (whole or
/// not at all: through a file renamed into place), readable by every uid.
pub fn write(gpu_dir: &Path, uuid: &str) -> std::io::Result<()> {
    let part = gpu_dir.join(format!(".{FILE_NAME}.part"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(&part)?;
    file.write_all(format!("{uuid}\n").as_bytes())?;
    std::fs::set_permissions(&part, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::rename(&part, gpu_dir.join(FILE_NAME))
}

/// The UUID of the GPU the MPS control daemon of the pipe folder `pipe`
/// serves, from its file, owned by a uid `trust` allows (a link is not
/// followed).
pub fn read_beside(pipe: &Path, trust: &Trust) -> Result<String, ServedGpuError> {
    let path = path_beside(pipe).ok_or_else(|| ServedGpuError::NoParent(pipe.to_owned()))?;
    let file_error = |source| ServedGpuError::File {
        path: path.clone(),
        source,
    };
    let (file, meta) = small_file::open(&path, Links::Refuse).map_err(file_error)?;
    if !trust.allows(meta.uid()) {
        return Err(ServedGpuError::Owner {
            path,
            uid: meta.uid(),
        });
    }
    let bytes = small_file::read_open(file, &meta, MAX_BYTES).map_err(file_error)?;
    let text = String::from_utf8(bytes).map_err(|_| file_error(SmallFileError::NotUtf8))?;
    let uuid = text.trim();
    if is_gpu_uuid(uuid) {
        Ok(uuid.to_owned())
    } else {
        Err(ServedGpuError::NotAUuid(path))
    }
}

/// Whether `text` reads as a GPU UUID as NVML prints it: `GPU-`, then hex
/// digits and dashes.
fn is_gpu_uuid(text: &str) -> bool {
    text.strip_prefix("GPU-").is_some_and(|rest| {
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::effective_uid;

    #[test]
    fn written_beside_the_pipe_folder_and_read_back_by_a_trusted_owner_only() {
        let root = std::env::temp_dir().join(format!("served-gpu-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let gpu_dir = root.join("GPU-1234");
        let pipe = gpu_dir.join("pipe");
        std::fs::create_dir_all(&pipe).unwrap();
        let own = Trust::own_or_root(None);
        let missing = read_beside(&pipe, &own);
        write(&gpu_dir, "GPU-12ab-34cd").unwrap();
        let read = read_beside(&pipe, &own);
        let stranger = Trust::only(&[effective_uid().wrapping_add(1)]);
        let untrusted = read_beside(&pipe, &stranger);
        std::fs::write(gpu_dir.join(FILE_NAME), "nvidia\n").unwrap();
        let garbage = read_beside(&pipe, &own);
        let _ = std::fs::remove_dir_all(&root);
        assert!(
            matches!(missing, Err(ServedGpuError::File { .. })),
            "{missing:?}"
        );
        assert_eq!(read.unwrap(), "GPU-12ab-34cd");
        assert!(
            matches!(untrusted, Err(ServedGpuError::Owner { .. })),
            "{untrusted:?}"
        );
        assert!(
            matches!(garbage, Err(ServedGpuError::NotAUuid(_))),
            "{garbage:?}"
        );
        assert!(matches!(
            read_beside(Path::new("/"), &own),
            Err(ServedGpuError::NoParent(_))
        ));
    }

    #[test]
    fn a_uuid_is_gpu_and_hex() {
        assert!(is_gpu_uuid("GPU-3430f778-7a25-704c-9090-8b0bb2478114"));
        for bad in ["", "GPU-", "MIG-12", "GPU-12 34", "gpu-12"] {
            assert!(!is_gpu_uuid(bad), "{bad:?}");
        }
    }
}
