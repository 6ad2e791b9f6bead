//! Declares the cfg that compiles the peer crates in, so rustc's check-cfg accepts it.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(idempotent_bench_peers)");
}
