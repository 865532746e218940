//! The GPU check: on a machine with an NVIDIA GPU, register a memfd pool (as the daemon makes
//! it) with the chunked plan, then measure host→device and device→host copies of 2.5 MiB blocks,
//! whole and as 64-layer scatter lists, between device memory and the registered pool; next to
//! them, in the same run, plain `cuMemcpy*Async` between device memory and `cuMemHostAlloc`
//! memory (the bound: what the link and the copy engines give pinned memory). Prints a table
//! (case, GB/s, × bound) and exits non-zero on any byte mismatch after the round trips.
//!
//! ```text
//! cargo run --release -p kvd-transport --features cuda --example gpu_check [-- SECONDS_PER_CASE]
//! ```
//!
//! Bounded: each case runs at most `MAX_ROUNDS` rounds and at most the given seconds (default 1).

use std::ffi::c_void;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use transport::cuda::{CudaDriver, Driver, EventId, Fill, Layer, PinnedRegistration};
use transport::local::{HugePages, SharedRegion};

/// One block: 2.5 MiB.
const BLOCK: usize = 5 << 19;
/// Blocks per round (one copy each), and per half of the pool.
const BLOCKS: usize = 64;
/// Layers of a scatter-listed block.
const LAYERS: usize = 64;
/// The most rounds a case runs.
const MAX_ROUNDS: usize = 1000;

type Fail = Box<dyn std::error::Error>;

fn cu(r: sys::CUresult, what: &str) -> Result<(), Fail> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}").into())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    HostToDevice,
    DeviceToHost,
}

/// Run `round` (which moves `bytes` and waits for them) for at most `budget` / `MAX_ROUNDS`;
/// GB/s.
fn measure(
    budget: Duration,
    bytes: usize,
    mut round: impl FnMut() -> Result<(), Fail>,
) -> Result<f64, Fail> {
    round()?; // warm-up
    let started = Instant::now();
    let mut rounds = 0usize;
    while rounds < MAX_ROUNDS && (rounds == 0 || started.elapsed() < budget) {
        round()?;
        rounds += 1;
    }
    Ok((bytes * rounds) as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// The device slices of block `b`: the whole block at `b * BLOCK`, or layer `l` of block `b` at
/// `(l * BLOCKS + b) * layer` (layer-major, as an engine's KV cache lays them out).
fn layers(device: u64, b: usize, scatter: bool) -> Vec<Layer> {
    if !scatter {
        return vec![Layer {
            device_ptr: device + (b * BLOCK) as u64,
            len: BLOCK as u64,
        }];
    }
    let layer = BLOCK / LAYERS;
    (0..LAYERS)
        .map(|l| Layer {
            device_ptr: device + ((l * BLOCKS + b) * layer) as u64,
            len: layer as u64,
        })
        .collect()
}

/// One round of pool copies: block `b` of the pool's half `half` to or from the device.
fn pool_round(
    reg: &PinnedRegistration,
    device: u64,
    stream: u64,
    dir: Dir,
    half: usize,
    scatter: bool,
) -> Result<(), Fail> {
    let mut ids: Vec<EventId> = Vec::with_capacity(BLOCKS);
    for b in 0..BLOCKS {
        let offset = ((half * BLOCKS + b) * BLOCK) as u64;
        let l = layers(device, b, scatter);
        // SAFETY: the pool and the device buffer outlive the round (waited for below), and
        // nothing else touches either while it runs; `stream` is live.
        let id = unsafe {
            match dir {
                Dir::HostToDevice => {
                    reg.copy_from_pool(offset, BLOCK as u64, &l, Fill::Exact, stream)
                }
                Dir::DeviceToHost => {
                    reg.copy_to_pool(offset, BLOCK as u64, &l, Fill::Exact, stream)
                }
            }
        }?;
        ids.push(id);
    }
    let last = *ids.last().expect("BLOCKS > 0");
    reg.event_wait(last, None)?;
    for id in ids {
        reg.event_release(id)?;
    }
    Ok(())
}

/// One round of the bound: the same bytes between device memory and `cuMemHostAlloc` memory.
fn bound_round(host: *mut u8, device: u64, stream: u64, dir: Dir) -> Result<(), Fail> {
    let s = stream as usize as sys::CUstream;
    for b in 0..BLOCKS {
        // SAFETY: `host` holds BLOCKS blocks of pinned memory, `device` as many; both outlive
        // the round (synchronized below).
        let r = unsafe {
            let h = host.add(b * BLOCK).cast::<c_void>();
            let d = device + (b * BLOCK) as u64;
            match dir {
                Dir::HostToDevice => sys::cuMemcpyHtoDAsync_v2(d, h, BLOCK, s),
                Dir::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(h, d, BLOCK, s),
            }
        };
        cu(r, "cuMemcpyAsync (bound)")?;
    }
    // SAFETY: a live stream.
    cu(
        unsafe { sys::cuStreamSynchronize(s) },
        "cuStreamSynchronize",
    )
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(151) ^ (i >> 11) ^ (i >> 19)) as u8
}

fn run() -> Result<bool, Fail> {
    let budget = Duration::from_secs_f64(
        std::env::args()
            .nth(1)
            .map(|s| s.parse::<f64>())
            .transpose()?
            .unwrap_or(1.0)
            .clamp(0.05, 30.0),
    );
    let driver = Arc::new(CudaDriver::open(0)?);
    let pool_len = 2 * BLOCKS * BLOCK;
    let pool = SharedRegion::create("kvd-gpu-check", pool_len, HugePages::Try)?;
    let device = driver.mem_alloc(BLOCKS * BLOCK)?;
    // The primary context is current on this thread now (mem_alloc made it so).
    let mut stream: sys::CUstream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: a valid out-pointer; a context is current.
    let r = unsafe { sys::cuStreamCreate(&mut stream, flags) };
    cu(r, "cuStreamCreate")?;
    let stream_id = stream as usize as u64;
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; plain (not write-combined) pinned memory.
    let r =
        unsafe { sys::cuMemHostAlloc(&mut host, BLOCKS * BLOCK, sys::CU_MEMHOSTALLOC_PORTABLE) };
    cu(r, "cuMemHostAlloc")?;
    let host = host.cast::<u8>();

    // SAFETY: `pool` outlives `reg` (dropped at the end of this function, `reg` first).
    let reg = unsafe { PinnedRegistration::new(driver.clone(), pool.base_ptr(), pool.len()) }?;
    println!(
        "pool: {} MiB memfd ({:?}), registered in {} chunk(s); blocks of {} KiB, {} per round, {} layers when scattered",
        pool_len >> 20,
        pool.backing(),
        reg.chunks().len(),
        BLOCK >> 10,
        BLOCKS,
        LAYERS
    );
    // GPUDirect RDMA's first way in: can this driver export device memory as a dma-buf?
    match transport::cuda::dmabuf_of(&*driver, device, BLOCKS * BLOCK) {
        Ok(_fd) => println!("dma-buf export of device memory: ok (ibv_reg_dmabuf_mr can take it)"),
        Err(e) => {
            println!("dma-buf export of device memory: no ({e}); RDMA would need nvidia-peermem")
        }
    }
    let half = BLOCKS * BLOCK;
    let mut ok = true;
    let mut rows: Vec<(String, f64, f64)> = Vec::new();

    let bound_h2d = measure(budget, half, || {
        bound_round(host, device, stream_id, Dir::HostToDevice)
    })?;
    let bound_d2h = measure(budget, half, || {
        bound_round(host, device, stream_id, Dir::DeviceToHost)
    })?;
    rows.push(("bound: cuMemHostAlloc -> device".into(), bound_h2d, 1.0));
    rows.push(("bound: device -> cuMemHostAlloc".into(), bound_d2h, 1.0));

    for scatter in [false, true] {
        let shape = if scatter {
            "64-layer scatter"
        } else {
            "whole block"
        };
        {
            // SAFETY: no copy is in flight (every round waits for its copies), and this slice
            // ends before the next round starts.
            let bytes = unsafe { std::slice::from_raw_parts_mut(pool.base_ptr(), pool_len) };
            for (i, b) in bytes[..half].iter_mut().enumerate() {
                *b = pattern(i + usize::from(scatter));
            }
            bytes[half..].fill(0);
        }
        let h2d = measure(budget, half, || {
            pool_round(&reg, device, stream_id, Dir::HostToDevice, 0, scatter)
        })?;
        let d2h = measure(budget, half, || {
            pool_round(&reg, device, stream_id, Dir::DeviceToHost, 1, scatter)
        })?;
        // Round trip done: the second half must now equal the first, byte for byte.
        // SAFETY: no copy is in flight; read only until the next round.
        let bytes = unsafe { std::slice::from_raw_parts(pool.base_ptr(), pool_len) };
        let (src, dst) = bytes.split_at(half);
        if let Some(at) = src.iter().zip(dst).position(|(a, b)| a != b) {
            eprintln!(
                "MISMATCH ({shape}): byte {at} (block {}, offset {}) is {:#04x}, expected {:#04x}",
                at / BLOCK,
                at % BLOCK,
                dst[at],
                src[at]
            );
            ok = false;
        }
        rows.push((format!("pool -> device, {shape}"), h2d, h2d / bound_h2d));
        rows.push((format!("device -> pool, {shape}"), d2h, d2h / bound_d2h));
    }

    println!("{:<40} {:>8} {:>9}", "case", "GB/s", "x bound");
    for (case, gbs, x) in &rows {
        println!("{case:<40} {gbs:>8.2} {x:>9.2}");
    }
    drop(reg);
    // SAFETY: no copy is in flight (every round waited); allocated above, freed once.
    unsafe {
        let _ = sys::cuMemFreeHost(host.cast::<c_void>());
        let _ = sys::cuStreamDestroy_v2(stream);
        driver.mem_free(device);
    }
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => {
            println!("gpu_check: every byte verified");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            eprintln!("gpu_check: byte mismatch");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("gpu_check: {e}");
            ExitCode::from(2)
        }
    }
}
