//! Why a claim could not be provisioned: one typed error, told on one line.

use std::path::PathBuf;

use hypervisor_core::file_error::FileError;
use hypervisor_core::spec::SpecError;

use crate::mps;

/// Why a claim could not be provisioned (one line each).
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// A file or folder of the node's state (checkpoint, pod files, CDI
    /// specs, regions) cannot be created, written or removed.
    #[error(transparent)]
    Io(#[from] FileError),
    /// The checkpoint cannot be parsed or written, is of another version,
    /// or lacks the token of a pod with claims. The agent does not start
    /// empty instead: it would forget claims whose containers run.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint file; the state folder for a missing token.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A claim names a GPU (its UUID) that the node does not have or no
    /// longer sees.
    #[error("no GPU {0} on this node")]
    NoSuchGpu(String),
    /// A claim asks more of a GPU than the claims already prepared leave:
    /// the scheduler's count and the node's disagree. Where the GPU
    /// overcommits, its memory counts times the overcommit ratio.
    #[error(
        "GPU {gpu}: {what} {asked} asked, but only {free} of {total} is left by the claims already prepared"
    )]
    OverCapacity {
        /// The GPU's UUID.
        gpu: String,
        /// `memory` (the amounts in bytes) or `compute` (in percent).
        what: &'static str,
        /// What the claim asks.
        asked: u64,
        /// What the prepared claims leave.
        free: u64,
        /// The whole GPU: the memory it offers to quotas (its own, or
        /// more where it overcommits), or 100.
        total: u64,
    },
    /// A claim would give its pod (quota identity) more of one GPU than
    /// the GPU's own memory. Quotas on a GPU that overcommits may add up
    /// past its memory, since idle pods are swapped out to make room, but
    /// no swapping makes room for one pod larger than the GPU.
    #[error(
        "GPU {gpu}: pod {pod} would hold {asked} bytes of it with this claim, more than its {memory} bytes of memory"
    )]
    PastTheGpu {
        /// The GPU's UUID.
        gpu: String,
        /// The pod (quota identity) the claim is for.
        pod: String,
        /// The pod's memory on the GPU with this claim: its other claims'
        /// parts and this claim's.
        asked: u64,
        /// The GPU's own memory.
        memory: u64,
    },
    /// A claim that cannot become limits ([`ClaimRequest::validate`]), or
    /// one whose edits are asked for but that is not prepared.
    #[error("claim {claim}: {message}")]
    Invalid {
        /// The claim's UID.
        claim: String,
        /// What is wrong.
        message: String,
    },
    /// A claim already prepared is asked for another pod (quota identity).
    #[error("claim {claim} is prepared for pod {prepared}, not {asked}")]
    OtherPod {
        /// The claim's UID.
        claim: String,
        /// The UID it was prepared for.
        prepared: String,
        /// The UID asked now.
        asked: String,
    },
    /// A pod's prepared claims do not make a hypervisor pod spec.
    #[error("pod {pod}: {source}")]
    Spec {
        /// The pod's UID (its quota identity).
        pod: String,
        /// Why the hypervisor's spec refuses it.
        #[source]
        source: SpecError,
    },
    /// `/dev/urandom` gave no bytes for a pod's token or a claim's UID.
    #[error("cannot draw a random token: {0}")]
    Random(#[source] std::io::Error),
    /// The hypervisor's Unix socket path has no folder or file name, so
    /// its folder cannot be mounted into the pods.
    #[error("the hypervisor's socket {} has no folder or file name", .0.display())]
    SocketPath(PathBuf),
    /// GPUs that cannot go to one pod in co-run mode.
    #[error("{subject}: {conflict}")]
    Corun {
        /// The claim (`claim <uid>`), or its pod with its other claims
        /// (`pod <namespace>/<name> (<uid>)`).
        subject: String,
        /// Which GPUs conflict, and why.
        #[source]
        conflict: mps::CorunConflict,
    },
}
