//! Compile the protos with protox (pure Rust, so no system `protoc`), then
//! generate prost messages and tonic services. The encoded descriptor set is
//! kept for server reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["duplex/v1/generation.proto", "duplex/worker/v1/worker.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("duplex_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
