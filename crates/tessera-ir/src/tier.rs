//! Memory tiers: where a buffer lives and where a node runs. Every value lives on the device
//! unless the plan puts it lower (ZeRO-Offload / Gemini / ZeRO-Infinity): in the host's memory
//! or on its NVMe. Values move between tiers only through [`Op::Transfer`](crate::Op::Transfer)
//! nodes, so a Program's transfers are instructions like any other: the memory simulation
//! charges each buffer to its tier and the cost model prices each transfer on its link.

use serde::{Deserialize, Serialize};

/// A level of the memory hierarchy, fastest first.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The accelerator's memory (the default): compute runs here.
    #[default]
    Device,
    /// The host's memory: the optimizer of offloaded chunks runs on the host's CPU.
    Host,
    /// Files on the host's NVMe: storage only, read into host memory before use.
    Nvme,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        }
    }

    /// Index into per-tier arrays (`[T; 3]`), in [`Tier::ALL`] order.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn is_device(&self) -> bool {
        *self == Tier::Device
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
