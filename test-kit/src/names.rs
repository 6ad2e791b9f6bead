//! Names no other test uses, in this process, in a concurrent one or in an earlier run (tables,
//! databases, keys, streams, queues, directories), and free loopback ports.

use std::sync::atomic::{AtomicU64, Ordering};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// `prefix` and a suffix no other call of any test process makes: lowercase ASCII letters,
/// digits and underscores after `prefix`, at most 34 characters of them, so that it is a
/// PostgreSQL identifier (with a short prefix in the same alphabet), a NATS stream name, a
/// RabbitMQ queue name and a file name as it is.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{prefix}_{:x}_{:x}_{n}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff_ffff
    )
}

/// A port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
