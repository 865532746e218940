//! What the zero-copy guard costs: the page-generation check (one load before, an acquire
//! fence and one load after) against the copy of a 2.5 MiB page out of the shared region that
//! it brackets, measured in the same run.
//!
//! - `guard/check`: `occupant` + `still_held` on one page (ns per view).
//! - `guard/copy_out 2.5MiB`: the copy alone, pages cycled through a 256 MiB region so that the
//!   data comes from memory.
//! - `guard/copy_out 2.5MiB + check`: the copy bracketed by the check, as `Client::read` does.
//!
//! Run: `cargo bench -p kvd-bench --bench views`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use transport::local::{HugePages, PageGenerations, SharedRegion};

const PAGE: usize = 2560 * 1024;
const REGION: usize = 256 * 1024 * 1024;

fn guard(c: &mut Criterion) {
    let pages = (REGION / PAGE) as u32;
    let region =
        SharedRegion::create("bench-region", pages as usize * PAGE, HugePages::Off).unwrap();
    let table = PageGenerations::create("bench-pages", pages).unwrap();
    let reader =
        PageGenerations::map_read_only(table.fd().try_clone_to_owned().unwrap(), pages).unwrap();
    for p in 0..pages {
        table.mark_occupied(p, u64::from(p) + 1);
    }
    let mut dst = vec![0u8; PAGE];
    let mut g = c.benchmark_group("guard");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("check", |b| {
        let mut p = 0u32;
        b.iter(|| {
            p = (p + 1) % pages;
            let occupant = reader.occupant(black_box(p)).unwrap();
            black_box(reader.still_held(p, occupant))
        })
    });
    g.throughput(Throughput::Bytes(PAGE as u64));
    g.bench_function("copy_out 2.5MiB", |b| {
        let mut p = 0u32;
        b.iter(|| {
            p = (p + 1) % pages;
            // SAFETY: nothing writes the region while the benchmark runs.
            unsafe { region.copy_out(u64::from(p) * PAGE as u64, &mut dst, false) }.unwrap();
            black_box(&dst[PAGE / 2]);
        })
    });
    g.bench_function("copy_out 2.5MiB + check", |b| {
        let mut p = 0u32;
        b.iter(|| {
            p = (p + 1) % pages;
            let occupant = reader.occupant(p).unwrap();
            // SAFETY: as above.
            unsafe { region.copy_out(u64::from(p) * PAGE as u64, &mut dst, false) }.unwrap();
            black_box(reader.still_held(p, occupant))
        })
    });
    g.finish();
}

criterion_group!(benches, guard);
criterion_main!(benches);
