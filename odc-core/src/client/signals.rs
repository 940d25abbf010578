//! Pure signals (no data) of one value into one word of every shard-group
//! rank's control region: versions, releases, done.

use std::sync::Arc;

use crate::engine::{Core, Registered};
use crate::region::{Bell, RegionDesc, SignalRef};
use crate::transport::Transport;
use crate::Result;

/// Signals sent now or later by work on a stream. Building one allocates
/// nothing (two reference counts).
pub(crate) struct Signals {
    transport: Arc<dyn Transport>,
    targets: Arc<[(usize, RegionDesc)]>,
    sig: SignalRef,
    value: u64,
}

impl Signals {
    pub(crate) fn new(core: &Core, reg: &Registered, offset: usize, value: u64) -> Signals {
        Signals {
            transport: Arc::clone(&core.transport),
            targets: Arc::clone(&reg.group_ctrl),
            sig: SignalRef {
                offset,
                bell: Bell::Client,
            },
            value,
        }
    }

    /// A signal of `value` into the word at `offset` of each of `targets`.
    pub(crate) fn to(
        core: &Core,
        targets: &Arc<[(usize, RegionDesc)]>,
        offset: usize,
        value: u64,
    ) -> Signals {
        Signals {
            transport: Arc::clone(&core.transport),
            targets: Arc::clone(targets),
            sig: SignalRef {
                offset,
                bell: Bell::Client,
            },
            value,
        }
    }

    pub(crate) fn send(&self) -> Result<()> {
        self.transport
            .put_signals(&self.targets, self.sig, self.value)
    }
}
