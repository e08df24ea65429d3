//! A NIXL agent with one backend, and the registrations it holds.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use nixl_sys::{MemType, OptArgs};
use parking_lot::Mutex;

use super::hook::RegistrationHook;
use super::registered::RegisteredLayout;
use super::registry::{NixlDescriptor, Registry};
use super::transfer::{self, Parked};
use crate::backend::MemoryKind;
use crate::error::{Error, Result};
use crate::layout::{Layout, MemoryView};
use crate::MappingHook;

/// Whether the NIXL library can be used. Without it every NIXL call aborts the process, so
/// each entry point of this module checks first and returns [`Error::NixlUnavailable`].
pub fn available() -> Result<()> {
    if nixl_sys::is_stub() {
        return Err(Error::NixlUnavailable {
            reason: "libnixl_capi.so could not be loaded (NIXL is not installed or its library \
                     folder is not on LD_LIBRARY_PATH; scripts/nixl-runtime.sh fetches it and \
                     prints the folder)"
                .into(),
        });
    }
    Ok(())
}

/// NIXL's memory type and device id for `kind` on `device`.
pub fn mem_type_of(kind: MemoryKind, device: Option<i32>) -> Result<(MemType, u64)> {
    match (kind, device) {
        (MemoryKind::Host, _) => Ok((MemType::Dram, 0)),
        (MemoryKind::Device, Some(d)) if d >= 0 => Ok((MemType::Vram, d as u64)),
        (MemoryKind::Device, d) => Err(Error::InvalidArgument(format!(
            "device memory needs a device ordinal, got {d:?}"
        ))),
    }
}

pub(crate) fn nixl_error(call: &'static str, detail: impl fmt::Display) -> Error {
    Error::Nixl {
        call,
        detail: detail.to_string(),
    }
}

/// What an agent shares with its hooks and registered layouts.
///
/// Lock order: `metadata_gate` (a `std` RwLock held across NIXL calls) before any of the
/// `parking_lot` mutexes (`registry`, `loaded`, `pending`), which guard bookkeeping only: each is
/// taken alone, never held across a NIXL call or a drop of a request or pin, and never while a
/// block backing's lock is held (hooks run with no backing lock held).
pub(crate) struct AgentShared {
    pub(crate) name: String,
    pub(crate) agent: nixl_sys::Agent,
    /// The backends, in creation order: a registration goes to every one that moves its
    /// memory type then (memory registered before a backend came is not registered with it). Taken alone, never across a NIXL call (the backend's `Arc` is cloned out).
    pub(crate) backends: Mutex<Vec<BackendEntry>>,
    pub(crate) registry: Mutex<Registry>,
    /// Per remote agent: the registry generation of its metadata we loaded last.
    pub(crate) loaded: Mutex<HashMap<String, u64>>,
    /// Transfers hold it shared while NIXL uses a remote's metadata (posting, waiting, polling
    /// parked requests); reloading metadata takes it exclusively. A gate for NIXL calls, not
    /// bookkeeping: hence `std`, not parking_lot.
    pub(crate) metadata_gate: std::sync::RwLock<()>,
    /// Timed-out transfers NIXL may still be running, with the pins that keep their memory
    /// and registrations; reaped once NIXL reports them finished.
    pub(crate) pending: Mutex<Vec<Parked>>,
}

/// One backend of an agent and the memory types it moves.
pub(crate) struct BackendEntry {
    pub(crate) plugin: String,
    pub(crate) mems: Vec<MemType>,
    pub(crate) backend: Arc<nixl_sys::Backend>,
}

/// What each known plugin moves, where NIXL's plugin parameters list none.
fn known_mems(plugin: &str) -> Vec<MemType> {
    match plugin {
        "UCX" | "UCX_MO" => vec![MemType::Dram, MemType::Vram],
        "POSIX" => vec![MemType::Dram, MemType::File],
        "GDS" | "GDS_MT" => vec![MemType::Dram, MemType::Vram, MemType::File],
        _ => Vec::new(),
    }
}

/// Which plugins move `mem`, for messages.
fn movers_of(mem: MemType) -> &'static str {
    match mem {
        MemType::File => "POSIX or GDS_MT",
        MemType::Vram => "UCX or GDS_MT",
        _ => "UCX or POSIX",
    }
}

fn make_backend(agent: &nixl_sys::Agent, name: &str, plugin: &str) -> Result<BackendEntry> {
    let (mems, params) = agent
        .get_plugin_params(plugin)
        .map_err(|e| nixl_error("get_plugin_params", format!("{e} (plugin {plugin:?})")))?;
    let mut mems: Vec<MemType> = mems.iter().filter_map(|m| m.ok()).collect();
    if mems.is_empty() {
        mems = known_mems(plugin);
    }
    let backend = agent.create_backend(plugin, &params).map_err(|e| {
        nixl_error(
            "create_backend",
            format!(
                "{e} (plugin {plugin:?}, agent {name:?}; with UCX, never set an empty UCX_TLS)"
            ),
        )
    })?;
    tracing::debug!(agent = name, plugin, ?mems, "NIXL backend created");
    Ok(BackendEntry {
        plugin: plugin.to_owned(),
        mems,
        backend: Arc::new(backend),
    })
}

impl AgentShared {
    /// Every backend that moves `mem`.
    fn backends_for(&self, mem: MemType) -> Vec<Arc<nixl_sys::Backend>> {
        self.backends
            .lock()
            .iter()
            .filter(|b| b.mems.contains(&mem))
            .map(|b| b.backend.clone())
            .collect()
    }

    /// Refuse `mem` unless a backend moves it; for files, create the POSIX backend first when
    /// none does (a FILE registration needs one: Dynamo had to learn it, their #8806).
    pub(crate) fn ensure_backend_for(&self, mem: MemType) -> Result<()> {
        if !self.backends_for(mem).is_empty() {
            return Ok(());
        }
        if mem == MemType::File {
            available()?;
            let entry = make_backend(&self.agent, &self.name, "POSIX")?;
            tracing::info!(agent = %self.name, "POSIX backend created for a FILE layout");
            self.backends.lock().push(entry);
            return Ok(());
        }
        Err(Error::NixlNoBackend {
            agent: self.name.clone(),
            mem: format!("{mem:?}"),
            have: self
                .backends
                .lock()
                .iter()
                .map(|b| b.plugin.clone())
                .collect(),
            need: movers_of(mem),
        })
    }

    /// Register `view` (one physical chunk of `kind` memory) with NIXL.
    pub(crate) fn register(
        &self,
        view: MemoryView,
        kind: MemoryKind,
        device: Option<i32>,
    ) -> Result<()> {
        available()?;
        let (mem_type, device_id) = mem_type_of(kind, device)?;
        self.register_in(0, view, mem_type, device_id)
    }

    /// Register `view` of address space `space` (0: memory; a file's own otherwise) as
    /// `mem_type` of `device_id` with every backend of the agent that moves it (a transfer
    /// needs one backend holding both sides: DRAM to FILE goes through POSIX).
    pub(crate) fn register_in(
        &self,
        space: u64,
        view: MemoryView,
        mem_type: MemType,
        device_id: u64,
    ) -> Result<()> {
        available()?;
        let backends = self.backends_for(mem_type);
        if backends.is_empty() {
            return Err(Error::NixlNoBackend {
                agent: self.name.clone(),
                mem: format!("{mem_type:?}"),
                have: self
                    .backends
                    .lock()
                    .iter()
                    .map(|b| b.plugin.clone())
                    .collect(),
                need: movers_of(mem_type),
            });
        }
        self.registry
            .lock()
            .claim(&self.name, space, view, mem_type, device_id)?;
        let desc = NixlDescriptor {
            addr: view.addr,
            len: view.len,
            mem_type,
            device_id,
        };
        let result = OptArgs::new()
            .and_then(|mut args| {
                for b in &backends {
                    args.add_backend(b)?;
                }
                Ok(args)
            })
            .and_then(|args| self.agent.register_memory(&desc, Some(&args)));
        match result {
            Ok(handle) => {
                self.registry.lock().complete(space, view.addr, handle);
                tracing::trace!(agent = %self.name, addr = view.addr, len = view.len, ?mem_type, device_id, "registered with NIXL");
                Ok(())
            }
            Err(e) => {
                self.registry.lock().abandon(space, view.addr);
                Err(nixl_error(
                    "register_memory",
                    format!(
                        "{e} ([{:#x}, +{}) as {mem_type:?} of device {device_id} with agent {:?})",
                        view.addr, view.len, self.name
                    ),
                ))
            }
        }
    }

    /// Deregister every registration starting in `[addr, addr + len)`; returns how many.
    pub(crate) fn deregister_range(&self, addr: u64, len: u64) -> usize {
        self.deregister_range_in(0, addr, len)
    }

    /// [`Self::deregister_range`] in address space `space`.
    pub(crate) fn deregister_range_in(&self, space: u64, addr: u64, len: u64) -> usize {
        let taken = self
            .registry
            .lock()
            .take_range(space, addr, addr.saturating_add(len));
        let n = taken.len();
        for (a, entry) in taken {
            if let Some(mut handle) = entry.handle {
                if let Err(e) = handle.deregister() {
                    tracing::error!(agent = %self.name, addr = a, len = entry.len, error = %e, "NIXL deregistration failed");
                }
            }
            tracing::trace!(agent = %self.name, addr = a, len = entry.len, "deregistered from NIXL");
        }
        n
    }

    /// Descriptors for `view`, split where registrations end.
    pub(crate) fn descriptors_into(
        &self,
        space: u64,
        view: MemoryView,
        out: &mut Vec<NixlDescriptor>,
    ) -> Result<()> {
        self.registry
            .lock()
            .descriptors(&self.name, space, view, out)
    }
}

/// A NIXL agent with one backend (UCX by default), registering pool memory one physical chunk
/// at a time. Cheap to clone; the agent lives while any clone, hook or registered layout does.
#[derive(Clone)]
pub struct NixlAgent {
    pub(crate) shared: Arc<AgentShared>,
}

impl NixlAgent {
    /// An agent named `name` with the UCX backend.
    pub fn new(name: &str) -> Result<Self> {
        Self::with_backend(name, "UCX")
    }

    /// An agent named `name` with the backend plugin `plugin` (e.g. `"UCX"`, `"POSIX"`) and
    /// its default parameters.
    pub fn with_backend(name: &str, plugin: &str) -> Result<Self> {
        available()?;
        let agent = nixl_sys::Agent::new(name)
            .map_err(|e| nixl_error("create agent", format!("{e} (name {name:?})")))?;
        let entry = make_backend(&agent, name, plugin)?;
        tracing::debug!(agent = name, plugin, "NIXL agent created");
        Ok(NixlAgent {
            shared: Arc::new(AgentShared {
                name: name.to_owned(),
                agent,
                backends: Mutex::new(vec![entry]),
                registry: Mutex::new(Registry::default()),
                loaded: Mutex::new(HashMap::new()),
                metadata_gate: std::sync::RwLock::new(()),
                pending: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Add the backend plugin `plugin` (e.g. `"POSIX"` for files) with its default
    /// parameters; a plugin the agent has already is refused.
    pub fn add_backend(&self, plugin: &str) -> Result<()> {
        available()?;
        if self.has_backend(plugin) {
            return Err(Error::InvalidArgument(format!(
                "NIXL agent {:?} has a {plugin} backend already",
                self.shared.name
            )));
        }
        let entry = make_backend(&self.shared.agent, &self.shared.name, plugin)?;
        self.shared.backends.lock().push(entry);
        Ok(())
    }

    /// Whether the agent has a backend of plugin `plugin`.
    pub fn has_backend(&self, plugin: &str) -> bool {
        self.shared
            .backends
            .lock()
            .iter()
            .any(|b| b.plugin == plugin)
    }

    /// The agent's backends (plugin names) and the memory types each moves.
    pub fn backends(&self) -> Vec<(String, Vec<MemType>)> {
        self.shared
            .backends
            .lock()
            .iter()
            .map(|b| (b.plugin.clone(), b.mems.clone()))
            .collect()
    }

    /// The underlying nixl-sys agent, for calls this crate does not wrap. Check
    /// [`available`] first: any call aborts the process when the library is missing.
    pub fn raw(&self) -> &nixl_sys::Agent {
        &self.shared.agent
    }

    /// Registrations alive now (one per physical chunk registered).
    pub fn registrations(&self) -> usize {
        self.shared.registry.lock().live()
    }

    /// Bytes under live registrations.
    pub fn registered_bytes(&self) -> u64 {
        self.shared.registry.lock().bytes()
    }

    /// A hook for [`crate::layout::LayoutBuilder::hook`] (elastic layouts) or
    /// [`crate::BlockBacking::new`]: every chunk is registered right after it is mapped and
    /// deregistered right before it is unmapped.
    pub fn mapping_hook(&self) -> Arc<dyn MappingHook> {
        Arc::new(RegistrationHook {
            agent: self.shared.clone(),
        })
    }

    /// Register every physical chunk under `layout` (see [`Layout::chunks`]). The result owns
    /// the layout and drops the registrations before the memory. On failure the registrations
    /// made are dropped, then the layout.
    pub fn register(&self, layout: Layout) -> Result<RegisteredLayout> {
        RegisteredLayout::new(self.shared.clone(), layout)
    }

    /// NIXL descriptors for `view`: one per registration it touches (a view across two
    /// chunks gives two), each derived from its registration. Unregistered bytes, and a view
    /// whose end does not fit in 64 bits, are errors with the numbers.
    pub fn descriptors(&self, view: MemoryView) -> Result<Vec<NixlDescriptor>> {
        let mut out = Vec::new();
        self.shared.descriptors_into(0, view, &mut out)?;
        Ok(out)
    }

    /// Transfers initiated by this agent that timed out and that NIXL has not reported
    /// finished yet. Their blocks stay pinned (and their memory and registrations alive) until
    /// it does; see [`crate::nixl::transfer_blocks`].
    pub fn pending_transfers(&self) -> usize {
        self.shared.pending.lock().len()
    }

    /// Ask NIXL about every pending transfer (this also drives its progress) and let go of the
    /// finished ones, unpinning their blocks. Returns how many are still running. Every
    /// [`crate::nixl::transfer_blocks`] this agent initiates does this first.
    pub fn reap_transfers(&self) -> usize {
        if available().is_err() {
            return self.pending_transfers();
        }
        transfer::reap(&self.shared)
    }
}

impl Drop for AgentShared {
    fn drop(&mut self) {
        let parked = std::mem::take(self.pending.get_mut());
        for p in parked {
            if p.still_running(&self.agent) {
                // NIXL cannot say it stopped: leak the request, its pins and so its memory and
                // registrations, rather than free memory a transfer may still write.
                tracing::error!(agent = %self.name, "{p}: still running as its agent goes; its memory is leaked");
                std::mem::forget(p);
            }
        }
    }
}

impl fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.shared.name)
            .field("registrations", &self.registrations())
            .field("registered_bytes", &self.registered_bytes())
            .finish()
    }
}
