#!/usr/bin/env python3
"""Fails if a package the workspace builds declares a newer rust-version than the workspace
crate that builds it: the part of the MSRV claim that holds without an old toolchain.

    python3 scripts/check_msrv.py

For each workspace member, every package it compiles with all features on this host (its
normal, build and dev dependencies, then their normal and build dependencies, as locked in
Cargo.lock) must declare a rust-version no newer than the member's, or none. Cargo refuses to
build a package whose rust-version is newer than the toolchain, so one that declares more than
ours would make our rust-version a false promise.

What this does not prove (see the rust-version comment in Cargo.toml): that our own code uses
no language feature newer than our rust-version (no compiler here is that old; clippy's
`incompatible_msrv`, run with warnings denied by scripts/test.sh, covers standard-library
APIs only), nor anything about packages that declare no rust-version (listed, not failed).

`--filter-platform` leaves out the bench crate's peer crates: they are compiled only under
`--cfg idempotent_bench_peers`, which scripts/bench.sh sets along with
`--ignore-rust-version`.
"""

import json
import subprocess
import sys


def version(text):
    """`1.85` and `1.85.0` alike, as a comparable tuple."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    host = next(
        line.split(":", 1)[1].strip()
        for line in subprocess.run(
            ["rustc", "-vV"], check=True, capture_output=True, text=True
        ).stdout.splitlines()
        if line.startswith("host:")
    )
    metadata = json.loads(
        subprocess.run(
            [
                "cargo", "metadata", "--format-version", "1", "--locked",
                "--all-features", "--filter-platform", host,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    packages = {package["id"]: package for package in metadata["packages"]}
    nodes = {node["id"]: node for node in metadata["resolve"]["nodes"]}
    failures = []
    undeclared = set()
    for member in metadata["workspace_members"]:
        ours = packages[member].get("rust_version")
        name = packages[member]["name"]
        if not ours:
            failures.append(f"{name} declares no rust-version")
            continue
        newest = ("", None)
        seen = {member}
        stack = [(member, True)]
        while stack:
            package, is_member = stack.pop()
            for dependency in nodes[package]["deps"]:
                kinds = {kind["kind"] for kind in dependency["dep_kinds"]}
                # Only the member's own dev-dependencies are built; theirs are not.
                if not is_member and not kinds & {None, "build"}:
                    continue
                if dependency["pkg"] in seen:
                    continue
                seen.add(dependency["pkg"])
                stack.append((dependency["pkg"], False))
                theirs = packages[dependency["pkg"]].get("rust_version")
                label = f'{packages[dependency["pkg"]]["name"]} {packages[dependency["pkg"]]["version"]}'
                if not theirs:
                    undeclared.add(label)
                    continue
                if version(theirs) > version(ours):
                    failures.append(f"{name} (rust-version {ours}) builds {label}, which declares {theirs}")
                external = dependency["pkg"] not in metadata["workspace_members"]
                if external and (not newest[1] or version(theirs) > version(newest[1])):
                    newest = (label, theirs)
        print(f"{name}: rust-version {ours}; {len(seen) - 1} packages built, the newest declared: {newest[0]} ({newest[1]})")
    if undeclared:
        print(f"{len(undeclared)} packages declare no rust-version (not checked): {', '.join(sorted(undeclared))}")
    if failures:
        print("\n".join(["rust-version check failed:"] + failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
