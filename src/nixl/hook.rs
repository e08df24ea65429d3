//! Registration that follows mapping: a [`MappingHook`] registering each physical chunk right
//! after it is mapped and deregistering it right before it is unmapped. [`crate::BlockBacking`]
//! calls it on every path (ensure, release, rollback, drop), so a registration never outlives
//! the memory under it. A block backing maps every page as whole chunks of its own, so the
//! registrations of one page never reach into another.

use std::sync::Arc;

use super::agent::AgentShared;
use crate::backing::RegionInfo;
use crate::error::Result;
use crate::layout::MemoryView;
use crate::MappingHook;

pub(crate) struct RegistrationHook {
    pub(crate) agent: Arc<AgentShared>,
}

impl MappingHook for RegistrationHook {
    fn mapped(&self, region: RegionInfo<'_>, at: u64, len: u64) -> Result<()> {
        let (kind, device) = (region.memory_kind(), region.device());
        let (start, end) = (region.addr() + at, region.addr() + at + len);
        let mut done: Vec<MemoryView> = Vec::new();
        for c in region.chunks_in(at, len) {
            let s = (region.addr() + c.offset).max(start);
            let e = (region.addr() + c.offset + c.size).min(end);
            let view = MemoryView {
                addr: s,
                len: e - s,
            };
            if let Err(err) = self.agent.register(view, kind, device) {
                for v in &done {
                    self.agent.deregister_range(v.addr, v.len);
                }
                return Err(err);
            }
            done.push(view);
        }
        Ok(())
    }

    fn unmapping(&self, region: RegionInfo<'_>, at: u64, len: u64) {
        self.agent.deregister_range(region.addr() + at, len);
    }
}
