//! Request extractors that answer every rejection as a JSON [`ApiError`].

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Most bytes a request body may have.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// A JSON body of type `T`.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        check_json_content_type(req.headers())?;
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        parse_json(&bytes).map(JsonBody)
    }
}

fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|essence| {
            let essence = essence.trim().to_ascii_lowercase();
            essence == "application/json" || essence.ends_with("+json")
        })
        .unwrap_or(false);
    if is_json {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "the body must be JSON with Content-Type: application/json",
        ))
    }
}

fn body_rejection(rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            format!("the body is larger than {MAX_BODY_BYTES} bytes"),
        )
    } else {
        ApiError::bad_request(
            "unreadable-body",
            format!("cannot read the body: {}", rejection.body_text()),
        )
    }
}

/// Parses `bytes` as one JSON `T`, naming the offending field in the error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        match inner.classify() {
            serde_json::error::Category::Data => ApiError::bad_request(
                "invalid-field",
                if path == "." {
                    format!("the body does not match the schema: {inner}")
                } else {
                    format!("{path}: {inner}")
                },
            ),
            _ => ApiError::bad_request(
                "malformed-json",
                format!("the body is not valid JSON: {inner}"),
            ),
        }
    })?;
    deserializer.end().map_err(|err| {
        ApiError::bad_request(
            "malformed-json",
            format!("the body is not valid JSON: {err}"),
        )
    })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use cloud_mock_sdk::LoadBalancerSpec;
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn junk_bytes_never_panic_and_always_get_a_4xx(
            bytes in proptest::collection::vec(any::<u8>(), 0..512)
        ) {
            if let Err(err) = parse_json::<LoadBalancerSpec>(&bytes) {
                prop_assert!(err.status.is_client_error());
            }
        }

        #[test]
        fn mangled_valid_bodies_get_a_4xx_naming_the_problem(cut in 0usize..200) {
            let body = br#"{"name": "a", "mode": "proxy", "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}], "backends": [{"ip": "198.18.0.11"}]}"#;
            let cut = cut.min(body.len() - 1);
            let err = parse_json::<LoadBalancerSpec>(&body[..cut]).unwrap_err();
            prop_assert_eq!(err.status, StatusCode::BAD_REQUEST);
            prop_assert!(!err.message.is_empty());
        }
    }

    fn error_of(body: &str) -> ApiError {
        match parse_json::<LoadBalancerSpec>(body.as_bytes()) {
            Err(err) => err,
            Ok(spec) => panic!("accepted {spec:?}"),
        }
    }

    #[test]
    fn syntax_errors_are_malformed_json() {
        let err = error_of(r#"{"name": "a","#);
        assert_eq!(
            (err.status, err.code),
            (StatusCode::BAD_REQUEST, "malformed-json")
        );
        let err = error_of(r#"{"name": "a", "mode": "proxy", "listeners": [], "backends": []} x"#);
        assert_eq!(err.code, "malformed-json");
    }

    #[test]
    fn type_errors_name_the_field() {
        let err = error_of(
            r#"{"name": "a", "mode": "proxy", "listeners": [{"protocol": "TCP", "port": 70000, "backendPort": 1}], "backends": []}"#,
        );
        assert_eq!(
            (err.status, err.code),
            (StatusCode::BAD_REQUEST, "invalid-field")
        );
        assert!(
            err.message.starts_with("listeners[0].port: "),
            "{}",
            err.message
        );
        assert!(err.message.contains("70000"), "{}", err.message);

        let err = error_of(r#"{"name": 5, "mode": "proxy", "listeners": [], "backends": []}"#);
        assert!(err.message.starts_with("name: "), "{}", err.message);
        let err = error_of(r#"{"name": "a", "mode": "bridge", "listeners": [], "backends": []}"#);
        assert!(err.message.starts_with("mode: "), "{}", err.message);
        let err = error_of(
            r#"{"name": "a", "mode": "proxy", "listeners": [], "backends": [{"ip": "300.1.1.1"}]}"#,
        );
        assert!(
            err.message.starts_with("backends[0].ip: "),
            "{}",
            err.message
        );
        let err = error_of(r#"[1, 2]"#);
        assert_eq!(err.code, "invalid-field");
    }

    #[test]
    fn content_type_must_be_json() {
        let mut headers = HeaderMap::new();
        assert!(check_json_content_type(&headers).is_err());
        headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert!(check_json_content_type(&headers).is_err());
        headers.insert(
            header::CONTENT_TYPE,
            "Application/JSON; charset=utf-8".parse().unwrap(),
        );
        assert!(check_json_content_type(&headers).is_ok());
    }
}
