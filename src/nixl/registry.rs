//! The registrations of one agent, by address: one per physical chunk, each a live NIXL
//! registration handle. Descriptors for any view come from the registrations that contain it.

use std::collections::BTreeMap;

use nixl_sys::{MemType, RegistrationHandle};

use crate::error::{Error, Result};
use crate::layout::MemoryView;

/// A NIXL descriptor: `len` bytes at `addr` of one memory type and device, inside one
/// registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlDescriptor {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// `Dram` for host memory, `Vram` for device memory.
    pub mem_type: MemType,
    /// The device ordinal (0 for host memory).
    pub device_id: u64,
}

impl nixl_sys::MemoryRegion for NixlDescriptor {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len as usize
    }
}

impl nixl_sys::NixlDescriptor for NixlDescriptor {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.device_id
    }
}

/// One registration: pending while NIXL registers it (no descriptor comes from it then).
pub(crate) struct Entry {
    pub(crate) len: u64,
    pub(crate) mem_type: MemType,
    pub(crate) device_id: u64,
    pub(crate) handle: Option<RegistrationHandle>,
}

/// Registrations by address space and start address; they never overlap within a space. Space
/// 0 is memory (addresses); a file's registrations live in a space of their own (offsets in
/// it), so two files' offsets never collide.
#[derive(Default)]
pub(crate) struct Registry {
    entries: BTreeMap<(u64, u64), Entry>,
    /// Bumped whenever a registration appears or goes: remote agents reload our metadata when
    /// it changed.
    pub(crate) generation: u64,
    live: usize,
    bytes: u64,
}

impl Registry {
    /// Live registrations (pending ones not counted).
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Bytes under live registrations.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The first entry overlapping `[addr, end)`, if any.
    fn overlapping(&self, space: u64, addr: u64, end: u64) -> Option<(u64, u64)> {
        let before = self
            .entries
            .range((space, 0)..=(space, addr))
            .next_back()
            .filter(|(&(_, a), e)| a + e.len > addr);
        before
            .or_else(|| self.entries.range((space, addr)..(space, end)).next())
            .map(|(&(_, a), e)| (a, e.len))
    }

    /// Claim `view` for a registration in progress; refused if it overlaps one.
    pub(crate) fn claim(
        &mut self,
        agent: &str,
        space: u64,
        view: MemoryView,
        mem_type: MemType,
        device_id: u64,
    ) -> Result<()> {
        let end = view.end()?;
        if view.len == 0 {
            return Err(Error::ZeroSize {
                what: "NIXL registration",
            });
        }
        if let Some((a, l)) = self.overlapping(space, view.addr, end) {
            return Err(Error::InvalidArgument(format!(
                "[{:#x}, {end:#x}) overlaps [{a:#x}, {:#x}), registered already with NIXL agent {agent:?}",
                view.addr,
                a + l
            )));
        }
        self.entries.insert(
            (space, view.addr),
            Entry {
                len: view.len,
                mem_type,
                device_id,
                handle: None,
            },
        );
        Ok(())
    }

    /// Complete a claimed registration with its handle.
    pub(crate) fn complete(&mut self, space: u64, addr: u64, handle: RegistrationHandle) {
        if let Some(e) = self.entries.get_mut(&(space, addr)) {
            e.handle = Some(handle);
            self.live += 1;
            self.bytes += e.len;
            self.generation += 1;
        }
    }

    /// Drop a claim whose registration failed.
    pub(crate) fn abandon(&mut self, space: u64, addr: u64) {
        if self
            .entries
            .get(&(space, addr))
            .is_some_and(|e| e.handle.is_none())
        {
            self.entries.remove(&(space, addr));
        }
    }

    /// Take every live registration starting in `[addr, end)`; the caller drops their handles
    /// (deregisters) after letting go of the lock.
    pub(crate) fn take_range(&mut self, space: u64, addr: u64, end: u64) -> Vec<(u64, Entry)> {
        let keys: Vec<(u64, u64)> = self
            .entries
            .range((space, addr)..(space, end))
            .filter(|(_, e)| e.handle.is_some())
            .map(|(&k, _)| k)
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(e) = self.entries.remove(&k) {
                self.live -= 1;
                self.bytes -= e.len;
                out.push((k.1, e));
            }
        }
        if !out.is_empty() {
            self.generation += 1;
        }
        out
    }

    /// Descriptors for `view`, one per registration it touches, each derived from its
    /// registration (its start plus an offset, its memory type and device). A byte of `view`
    /// under no live registration is an error naming the hole.
    pub(crate) fn descriptors(
        &self,
        agent: &str,
        space: u64,
        view: MemoryView,
        out: &mut Vec<NixlDescriptor>,
    ) -> Result<()> {
        let end = view.end()?;
        let mut pos = view.addr;
        while pos < end {
            let hit = self
                .entries
                .range((space, 0)..=(space, pos))
                .next_back()
                .filter(|(&(_, a), e)| e.handle.is_some() && a + e.len > pos);
            let Some((&(_, base), e)) = hit else {
                let next = self
                    .entries
                    .range((space, pos)..(space, end))
                    .find(|(_, e)| e.handle.is_some())
                    .map_or(end, |(&(_, a), _)| a);
                return Err(Error::NotRegistered {
                    agent: agent.to_owned(),
                    addr: view.addr,
                    len: view.len,
                    hole_addr: pos,
                    hole_len: next.max(pos + 1).min(end) - pos,
                });
            };
            let offset = pos - base;
            let len = (e.len - offset).min(end - pos);
            out.push(NixlDescriptor {
                addr: base + offset,
                len,
                mem_type: e.mem_type,
                device_id: e.device_id,
            });
            pos += len;
        }
        Ok(())
    }
}
