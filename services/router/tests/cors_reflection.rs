//! What browsers and gRPC tools meet at the public ports: CORS on `/v1/*`
//! (`cors_allowed_origins`), and reflection in both versions (v1 for grpcurl,
//! v1alpha for Python's grpcio-reflection and older clients).

mod common;

use common::{start, MockConfig, TestRouter};
use reqwest::header::{HeaderMap, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN};
use reqwest::Method;

const APP: &str = "https://app.example";
const OTHER: &str = "https://other.example";

/// A browser's preflight for a POST with a key and a JSON body.
async fn preflight(router: &TestRouter, path: &str, origin: &str) -> reqwest::Response {
    reqwest::Client::new()
        .request(Method::OPTIONS, format!("{}{path}", router.http))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type,x-stainless-os")
        .send()
        .await
        .unwrap()
}

async fn get_models(router: &TestRouter, origin: &str, key: Option<&str>) -> reqwest::Response {
    let mut request = reqwest::Client::new().get(format!("{}/v1/models", router.http)).header("origin", origin);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.unwrap()
}

fn allowed_origin(headers: &HeaderMap) -> Option<&str> {
    headers.get(ACCESS_CONTROL_ALLOW_ORIGIN).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn allowed_origins_get_cors_headers_and_preflights_need_no_key() {
    let router = start(MockConfig::default(), |c| {
        c.cors_allowed_origins = vec![APP.into(), "http://localhost:3000".into()];
        c.api_key = Some("s3cret".into());
    })
    .await;

    let answer = preflight(&router, "/v1/chat/completions", APP).await;
    assert!(answer.status().is_success(), "{}", answer.status());
    let headers = answer.headers();
    assert_eq!(allowed_origin(headers), Some(APP));
    let methods = headers.get(ACCESS_CONTROL_ALLOW_METHODS).unwrap().to_str().unwrap().to_ascii_uppercase();
    assert!(methods.contains("POST") && methods.contains("GET"), "{methods}");
    let allowed = headers.get(ACCESS_CONTROL_ALLOW_HEADERS).unwrap().to_str().unwrap().to_ascii_lowercase();
    assert!(allowed.contains("authorization") && allowed.contains("content-type") && allowed.contains("x-stainless-os"), "{allowed}");

    // An origin not on the list: the preflight gets no permission.
    let answer = preflight(&router, "/v1/chat/completions", OTHER).await;
    assert_eq!(allowed_origin(answer.headers()), None);

    // Real requests: the allowed origin may read the answer, errors included.
    let answer = get_models(&router, APP, Some("s3cret")).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(allowed_origin(answer.headers()), Some(APP));
    let answer = get_models(&router, "http://localhost:3000", None).await;
    assert_eq!(answer.status(), 401);
    assert_eq!(allowed_origin(answer.headers()), Some("http://localhost:3000"));
    let answer = get_models(&router, OTHER, Some("s3cret")).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(allowed_origin(answer.headers()), None);

    // Only /v1/* is shared across origins.
    let health = reqwest::Client::new().get(format!("{}/health", router.http)).header("origin", APP).send().await.unwrap();
    assert_eq!(allowed_origin(health.headers()), None);
}

#[tokio::test]
async fn any_origin_with_a_star() {
    let router = start(MockConfig::default(), |c| c.cors_allowed_origins = vec!["*".into()]).await;
    assert_eq!(allowed_origin(preflight(&router, "/v1/completions", OTHER).await.headers()), Some("*"));
    let answer = get_models(&router, OTHER, None).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(allowed_origin(answer.headers()), Some("*"));
}

#[tokio::test]
async fn no_cors_headers_by_default() {
    let router = start(MockConfig::default(), |c| c.api_key = Some("s3cret".into())).await;
    let answer = preflight(&router, "/v1/chat/completions", APP).await;
    assert_eq!(allowed_origin(answer.headers()), None);
    assert_eq!(answer.status(), 401, "without CORS a preflight is an ordinary request");
    let answer = get_models(&router, APP, Some("s3cret")).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(allowed_origin(answer.headers()), None);
}

/// Both reflection versions list the public services and both reflection
/// services, describe `duplex.v1.Generation`, and know nothing of the
/// workers' protocol.
#[tokio::test]
async fn reflection_answers_in_v1_and_v1alpha() {
    let router = start(MockConfig::default(), |_| {}).await;
    let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone()).unwrap().connect().await.unwrap();

    macro_rules! ask {
        ($version:ident) => {{
            use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
            use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
            use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
            use tonic_reflection::pb::$version::ServerReflectionRequest;
            let ask = |m: MessageRequest| ServerReflectionRequest { host: String::new(), message_request: Some(m) };
            let requests = vec![ask(MessageRequest::ListServices(String::new())), ask(MessageRequest::FileContainingSymbol("duplex.v1.Generation".into()))];
            let mut client = ServerReflectionClient::new(channel.clone());
            let mut answers = client.server_reflection_info(tokio_stream::iter(requests)).await.unwrap().into_inner();
            let listed = match answers.message().await.unwrap().unwrap().message_response {
                Some(MessageResponse::ListServicesResponse(l)) => l.service.into_iter().map(|s| s.name).collect::<Vec<_>>(),
                other => panic!("{other:?}"),
            };
            let files = match answers.message().await.unwrap().unwrap().message_response {
                Some(MessageResponse::FileDescriptorResponse(f)) => f.file_descriptor_proto.len(),
                other => panic!("{other:?}"),
            };
            (listed, files)
        }};
    }

    for (version, (listed, files)) in [("v1", ask!(v1)), ("v1alpha", ask!(v1alpha))] {
        for service in ["duplex.v1.Generation", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"] {
            assert!(listed.iter().any(|s| s == service), "{version}: {service} not in {listed:?}");
        }
        assert!(!listed.iter().any(|s| s.contains("worker")), "{version}: {listed:?}");
        assert!(files > 0, "{version}: no descriptor for duplex.v1.Generation");
    }
}
