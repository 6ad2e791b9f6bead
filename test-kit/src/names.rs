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
/// Chosen at random from the upper half below the range's start (by default 16384 to 32767),
/// reserved for this process until it exits, and checked free by binding it; [`free_port`]'s
/// when the range starts too low to leave such a half or no port there is free.
///
/// The reservation is an exclusive `flock` on a file named after the port in
/// `$TMPDIR/idempotent-test-ports`, held open until the process exits: another test process
/// never picks the same port while this one may still start its server on it (a private
/// RabbitMQ binds its ports seconds after they were chosen), and the kernel drops the lock
/// when the process ends, however it ends. The files stay (empty, one a port at most).
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
        let Some(reservation) = reserve(port) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            RESERVED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(reservation);
            return port;
        }
    }
    free_port()
}

/// The files whose locks reserve this process's ports ([`restartable_port`]).
static RESERVED: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// `port`'s reservation: its file, locked by this process; `None` if another process holds
/// it. Without a place for the files, a port is not reserved (the bind check still runs).
fn reserve(port: u16) -> Option<Option<std::fs::File>> {
    let dir = std::env::temp_dir().join("idempotent-test-ports");
    let file = std::fs::create_dir_all(&dir).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))
    });
    let Ok(file) = file else {
        return Some(None);
    };
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .ok()
        .map(|()| Some(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first port of the kernel's ephemeral range, read here on its own (not by the code
    /// under test, which falls back when it cannot read it).
    fn first_ephemeral() -> u16 {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    #[test]
    fn a_restartable_port_is_free_and_below_the_ephemeral_range() {
        let first_ephemeral = first_ephemeral();
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

    /// A port once chosen stays reserved: no other lock on its file is granted while this
    /// process lives (`flock` locks of two opens conflict as those of two processes do), so
    /// no other test process chooses it.
    #[test]
    fn a_restartable_port_stays_reserved_for_this_process() {
        let first_ephemeral = first_ephemeral();
        if first_ephemeral < 2048 {
            return;
        }
        let port = restartable_port();
        assert!(reserve(port).is_none(), "{port} could be reserved twice");
        // A port nobody chose can be.
        let other = (first_ephemeral / 2..first_ephemeral)
            .find(|&p| p != port && reserve(p).is_some())
            .expect("some port of the range is free to reserve");
        assert_ne!(other, port);
    }
}
