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

/// A port free on loopback right now, from the kernel's ephemeral range: for a server that
/// keeps it while it runs, or for a port nothing should listen on.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A port free on loopback right now, for a server that is killed and started again on the
/// same port: one below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), so that
/// while the server is down no process's outbound connection (its source port) and no
/// `bind(0)` ([`free_port`]) can take it. A port that [`free_port`] returned can be taken so,
/// and the restart then fails to bind.
///
/// Chosen at random from the upper half below the range's start (by default 16384 to 32767)
/// and checked free by binding it; [`free_port`]'s when the range starts too low to leave such
/// a half or no port there is free.
pub fn restartable_port() -> u16 {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (first_ephemeral / 2, first_ephemeral);
    if low < 1024 {
        return free_port();
    }
    for _ in 0..1000 {
        let port = fastrand::u16(low..high);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    free_port()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restartable_port_is_free_and_below_the_ephemeral_range() {
        let first_ephemeral: u16 =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .unwrap()
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
        for _ in 0..20 {
            let port = restartable_port();
            // Below 2048 there is no room below the range, and the port comes from it.
            if first_ephemeral >= 2048 {
                assert!(port < first_ephemeral, "{port} >= {first_ephemeral}");
                assert!(port >= first_ephemeral / 2, "{port}");
            }
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
