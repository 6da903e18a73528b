//! The daemon's flags that choose its observer: NVML or simulated GPUs, and
//! which health events make a GPU unhealthy.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::health::HealthPolicy;
use super::{GpuObserver, NvmlObserver, ObserverError, SimulatedGpus};

/// `serve`'s GPU flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ObserverArgs {
    /// Simulate N GPUs instead of asking NVML (tests, demos).
    #[arg(long, value_name = "N")]
    pub simulate_gpus: Option<u32>,
    /// Do not watch GPU health (XID and ECC events, lost GPUs): every GPU
    /// stays healthy.
    #[arg(long, env = "GPUSHARE_DISABLE_HEALTH_CHECKS")]
    pub disable_health_checks: bool,
    /// XIDs that leave a GPU healthy, being the application's fault:
    /// comma-separated, or `none`. Default: 13,31,43,45,68,109 (as NVIDIA's
    /// device plugin).
    #[arg(
        long,
        env = "GPUSHARE_HEALTH_IGNORE_XIDS",
        value_name = "XIDS",
        value_parser = HealthPolicy::parse_xids
    )]
    pub health_ignore_xids: Option<BTreeSet<u64>>,
}

impl ObserverArgs {
    /// The health policy the flags say.
    pub fn policy(&self) -> HealthPolicy {
        let default = HealthPolicy::default();
        HealthPolicy {
            enabled: !self.disable_health_checks,
            ignored_xids: self
                .health_ignore_xids
                .clone()
                .unwrap_or(default.ignored_xids),
        }
    }

    /// The simulated GPUs, or NVML (which fails where it is not installed).
    pub fn observer(&self) -> Result<Arc<dyn GpuObserver>, ObserverError> {
        let policy = self.policy();
        if !policy.enabled {
            tracing::warn!("GPU health checks are off: every GPU is published healthy");
        }
        Ok(match self.simulate_gpus {
            Some(n) => Arc::new(SimulatedGpus::with_health(n, policy)),
            None => Arc::new(NvmlObserver::with_health(policy)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        gpus: ObserverArgs,
    }

    #[test]
    fn flags_make_the_policy() {
        let default = Cli::try_parse_from(["hv"]).unwrap().gpus.policy();
        assert_eq!(default, HealthPolicy::default());
        let cli = Cli::try_parse_from([
            "hv",
            "--health-ignore-xids",
            "13,79",
            "--disable-health-checks",
        ])
        .unwrap();
        let policy = cli.gpus.policy();
        assert!(!policy.enabled);
        assert_eq!(policy.ignored_xids, BTreeSet::from([13, 79]));
        let none = Cli::try_parse_from(["hv", "--health-ignore-xids", "none"]).unwrap();
        assert!(none.gpus.policy().ignored_xids.is_empty());
        assert!(Cli::try_parse_from(["hv", "--health-ignore-xids", "13,x"]).is_err());
    }
}
