//! `duplex-router`: serve the public APIs in front of the workers. (`duplex
//! router` runs the same thing from the main binary.)

use clap::Parser;
use duplex_router::config::RouterArgs;

#[derive(Parser)]
#[command(name = "duplex-router", version, about = "The Duplex router: public gRPC and OpenAI-compatible HTTP in front of the workers")]
struct Cli {
    #[command(flatten)]
    args: RouterArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    duplex_router::run(Cli::parse().args.resolve()?).await
}
