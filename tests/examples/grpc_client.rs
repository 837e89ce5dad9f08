//! A small gRPC client of Duplex's public API: stream one generation and
//! print every message as it arrives.
//!
//! ```sh
//! cargo run -p duplex-tests --example grpc_client -- http://127.0.0.1:50051 "Hello, who are you?"
//! ```

use duplex_proto::v1::{self, generation_client::GenerationClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let target = args.next().unwrap_or_else(|| "http://127.0.0.1:50051".into());
    let content = args.next().unwrap_or_else(|| "Hello, who are you?".into());
    let mut client = GenerationClient::connect(target).await?;
    println!("{:?}", client.model_info(v1::ModelInfoRequest {}).await?.into_inner());
    let request = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Chat(v1::ChatMessages { messages: vec![v1::ChatMessage { role: "user".into(), content }], ..Default::default() })),
        sampling: Some(v1::SamplingParameters { temperature: Some(0.0), logprobs: true, ..Default::default() }),
        stopping: Some(v1::StoppingCriteria { max_tokens: 8, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await?.into_inner();
    while let Some(message) = stream.message().await? {
        println!("{:?}", message.event);
    }
    Ok(())
}
