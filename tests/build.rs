//! Generates the gRPC client the end-to-end tests use, from the `grpc` example's proto.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../examples/proto/payments.proto");
    let descriptors = protox::compile(["payments.proto"], ["../examples/proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
