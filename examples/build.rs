//! Generates the gRPC code of the `grpc` example from `proto/payments.proto`.
//!
//! The proto is parsed by `protox`, a protobuf compiler in pure Rust, so no `protoc` binary is
//! needed on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/payments.proto");
    let descriptors = protox::compile(["payments.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
