//! `duplex-prefill`: the prefill worker as its own process (`duplex serve`
//! starts it; so does the compose deployment).

use clap::Parser;

#[derive(Parser)]
#[command(name = "duplex-prefill", version, about = "Duplex prefill worker: long prompts into shared KV blocks")]
struct Cli {
    #[command(flatten)]
    args: duplex_prefill::config::PrefillArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    duplex_prefill::run(Cli::parse().args.resolve()?).await
}
