//! The checkpoint: every prepared claim and each pod's token, in
//! `state_dir/checkpoint.json` (mode 0600, replaced atomically), so an agent
//! that restarts answers the kubelet's repeated `NodePrepareResources` with
//! the same devices and gives the pods back their limits.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{ClaimRequest, ProvisionError, io, write_file};

const FILE: &str = "checkpoint.json";
const VERSION: u32 = 1;

/// A claim that was prepared, and what was answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    /// The claim as prepared: its pod (quota identity) and its part of each
    /// GPU.
    pub request: ClaimRequest,
    /// The CDI device IDs answered (`<vendor>/<class>=<claim uid>`), given
    /// again when the kubelet asks again.
    pub cdi_devices: Vec<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Checkpoint {
    version: u32,
    /// By claim UID.
    pub claims: BTreeMap<String, PreparedClaim>,
    /// Token of each pod with prepared claims, by pod UID.
    pub tokens: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Reads `dir/checkpoint.json`; none there is an empty checkpoint. A file
    /// that cannot be read is an error: starting empty would forget claims
    /// whose containers run.
    pub(crate) fn load(dir: &Path) -> Result<Self, ProvisionError> {
        let path = dir.join(FILE);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    version: VERSION,
                    ..Self::default()
                });
            }
            Err(e) => return Err(io("cannot read", &path)(e)),
        };
        let checkpoint: Self =
            serde_json::from_slice(&text).map_err(|e| ProvisionError::Checkpoint {
                path: path.clone(),
                message: e.to_string(),
            })?;
        if checkpoint.version != VERSION {
            return Err(ProvisionError::Checkpoint {
                path,
                message: format!(
                    "version {} (this agent reads {VERSION})",
                    checkpoint.version
                ),
            });
        }
        Ok(checkpoint)
    }

    pub(crate) fn save(&self, dir: &Path) -> Result<(), ProvisionError> {
        let path = dir.join(FILE);
        let json = serde_json::to_vec_pretty(self).map_err(|e| ProvisionError::Checkpoint {
            path: path.clone(),
            message: e.to_string(),
        })?;
        write_file(&path, &json, 0o600)
    }
}
