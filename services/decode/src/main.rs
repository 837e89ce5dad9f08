//! `duplex-decode`: the decode worker as its own process (`duplex serve`
//! starts it; so does the compose deployment).

use clap::Parser;

#[derive(Parser)]
#[command(name = "duplex-decode", version, about = "Duplex decode worker: continuous batching over the shared KV pool")]
struct Cli {
    #[command(flatten)]
    args: duplex_decode::config::DecodeArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    duplex_decode::run(Cli::parse().args.resolve()?).await
}
