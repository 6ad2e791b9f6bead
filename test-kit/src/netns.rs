//! Network partitions for tests: a network namespace of a test's own, joined to the host by a
//! veth pair with addresses that exist only on that pair. A server started in it (see
//! [`PrivateRedis::start_in`](crate::redis::PrivateRedis::start_in) and
//! [`PrivatePostgres::start_in`](crate::postgres::PrivatePostgres::start_in)) is reached at
//! [`Netns::address`]; [`Netns::cut`] takes the host's end of the pair down, so that packets
//! to it vanish and its connections hang (unlike a stopped process or a refused connection),
//! and [`Netns::heal`] brings it back.
//!
//! Needs `ip` (iproute2) and root. Where either is missing, [`Netns::create`] says so and
//! returns `None`, or fails where backend tests are required (see
//! [`crate::backend::installed`]).

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::backend::installed;
use crate::process::find_program;

/// Namespaces made by this process so far: part of each one's names and addresses.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A network namespace and the veth pair that joins it to the host; both are deleted when
/// dropped (also when the test fails). Drop the servers running in it first: they are killed
/// by their own guards, by pid.
pub struct Netns {
    name: String,
    host_dev: String,
    ns_dev: String,
    host_addr: Ipv4Addr,
    ns_addr: Ipv4Addr,
}

impl Netns {
    /// Makes a namespace named after this process (`idempotent-PID-N`), a veth pair between
    /// it and the host, and a private /30 on the pair (`10.200.X.Y`, host side first, chosen
    /// from the pid and unused on this machine), with loopback and both ends up. `None` when
    /// `ip` is missing or the tests do not run as root (see the module's docs).
    pub fn create() -> Option<Netns> {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|out| out.stdout.starts_with(b"0\n"));
        installed(
            "a network namespace (`ip` of iproute2, and root to run `ip netns`)",
            find_program("ip").filter(|_| root),
        )?;
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // 16,384 /30 subnets of 10.200.0.0/16; one that some address of this machine is
        // already in (a namespace of a concurrent run) is skipped.
        let first = (pid.wrapping_mul(8).wrapping_add(n)) % 16_384;
        let (host_addr, ns_addr) = (0..16_384)
            .map(|i| (first + i) % 16_384)
            .map(|subnet| {
                let base = 0x0ac8_0000 + subnet * 4;
                (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
            })
            .find(|(host, _)| !address_in_use(*host))
            .expect("a free /30 of 10.200.0.0/16");
        // Interface names are at most 15 bytes.
        let netns = Netns {
            name: format!("idempotent-{pid}-{n}"),
            host_dev: format!("ih{pid:x}x{n:x}"),
            ns_dev: format!("in{pid:x}x{n:x}"),
            host_addr,
            ns_addr,
        };
        let ns_dev = netns.ns_dev.clone();
        let (name, host_dev) = (netns.name.as_str(), netns.host_dev.as_str());
        // From here on the guard deletes whatever was made, should a step fail.
        ip(&["netns", "add", name]);
        // Fixed hardware addresses, each end's neighbour entry for the other permanent: no
        // ARP, whose queue would hold packets through a partition and flush them at once
        // when it heals. Locally administered, from the subnet's number.
        let [_, _, high, low] = host_addr.octets();
        let (host_mac, ns_mac) = (
            format!("02:1d:{high:02x}:{low:02x}:00:01"),
            format!("02:1d:{high:02x}:{low:02x}:00:02"),
        );
        ip(&[
            "link", "add", host_dev, "address", &host_mac, "type", "veth", "peer", "name", &ns_dev,
            "address", &ns_mac,
        ]);
        ip(&["link", "set", &ns_dev, "netns", name]);
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", host_dev]);
        ip(&["link", "set", host_dev, "up"]);
        ip(&[
            "neigh",
            "replace",
            &ns_addr.to_string(),
            "lladdr",
            &ns_mac,
            "nud",
            "permanent",
            "dev",
            host_dev,
        ]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{ns_addr}/30"), "dev", &ns_dev]);
        inside(&["link", "set", &ns_dev, "up"]);
        inside(&[
            "neigh",
            "replace",
            &host_addr.to_string(),
            "lladdr",
            &host_mac,
            "nud",
            "permanent",
            "dev",
            &ns_dev,
        ]);
        Some(netns)
    }

    /// The namespace's address on the pair: where a server in it listens.
    pub fn address(&self) -> Ipv4Addr {
        self.ns_addr
    }

    /// The host's address on the pair.
    pub fn host_address(&self) -> Ipv4Addr {
        self.host_addr
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `program` run inside the namespace (`ip netns exec NAME program`, which executes it in
    /// place: a child spawned from this command has the program's own pid).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    /// Cuts the link: from now on packets between the host and the namespace vanish, in
    /// both directions, new connections included (their `SYN`s get no answer), and open
    /// connections hang.
    ///
    /// It takes the namespace's end of the pair down, not the host's: with the host's end
    /// down, its route goes too, and the host sends the namespace's packets by its default
    /// route instead, where (in some sandboxes) a gateway refuses new connections at once.
    /// With the far end down the host keeps its route and its end of the pair, which drops
    /// what it is given (no carrier); the permanent neighbour entries keep ARP from queuing
    /// packets until the heal.
    pub fn cut(&self) {
        self.set_link("down");
    }

    /// Brings the link back up.
    pub fn heal(&self) {
        self.set_link("up");
    }

    fn set_link(&self, state: &str) {
        ip(&[
            "netns",
            "exec",
            &self.name,
            "ip",
            "link",
            "set",
            &self.ns_dev,
            state,
        ]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting either end deletes the pair; deleting the namespace deletes its end too.
        for args in [
            ["link", "del", self.host_dev.as_str()].as_slice(),
            ["netns", "del", self.name.as_str()].as_slice(),
        ] {
            let _ = Command::new("ip")
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Runs `ip ARGS`, asserting it succeeded.
fn ip(args: &[&str]) {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ip");
    assert!(
        output.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Whether some interface of this machine's namespace has an address in `address`'s /30.
fn address_in_use(address: Ipv4Addr) -> bool {
    Command::new("ip")
        .args(["-o", "addr", "show", "to", &format!("{address}/30")])
        .output()
        .is_ok_and(|out| !out.stdout.is_empty())
}
