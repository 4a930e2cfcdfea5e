//! Mock-cloud errors as provider errors, their metric outcome, and the retry delay.

use std::net::Ipv4Addr;
use std::time::Duration;

use cloud_mock_sdk as sdk;

use crate::provider::{Operation, ProviderError};

/// The SDK error as a provider error; `requested_ip` tells a VIP conflict from others.
pub fn classify(
    err: &sdk::Error,
    operation: Operation,
    id: Option<&str>,
    requested_ip: Option<Ipv4Addr>,
) -> ProviderError {
    let mentions_vip = |message: &str| {
        let lower = message.to_lowercase();
        lower.contains("vip") || lower.contains("pool") || lower.contains("address")
    };
    match err {
        sdk::Error::NotFound { .. } => ProviderError::NotFound {
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Conflict { message } | sdk::Error::Invalid { message }
            if requested_ip.is_some() && mentions_vip(message) =>
        {
            ProviderError::IpUnavailable {
                ip: requested_ip.unwrap_or(Ipv4Addr::UNSPECIFIED),
                message: message.clone(),
            }
        }
        sdk::Error::Conflict { .. } => ProviderError::Conflict {
            operation,
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Invalid { message } => ProviderError::Invalid {
            operation,
            message: message.clone(),
        },
        sdk::Error::RateLimited { retry_after } => ProviderError::RateLimited {
            operation,
            retry_after: *retry_after,
        },
        sdk::Error::Unauthorized => ProviderError::Unauthorized {
            operation,
            message: err.to_string(),
        },
        sdk::Error::Unavailable { .. } | sdk::Error::Transport(_) | sdk::Error::Decode(_) => {
            ProviderError::Unavailable {
                operation,
                message: err.to_string(),
            }
        }
    }
}

pub fn outcome(result: &Result<impl Sized, sdk::Error>) -> &'static str {
    match result {
        Ok(_) => "success",
        Err(sdk::Error::NotFound { .. }) => "not_found",
        Err(sdk::Error::Conflict { .. }) => "conflict",
        Err(sdk::Error::Invalid { .. }) => "invalid",
        Err(sdk::Error::RateLimited { .. }) => "rate_limited",
        Err(sdk::Error::Unauthorized) => "unauthorized",
        Err(sdk::Error::Unavailable { .. }) => "unavailable",
        Err(sdk::Error::Transport(_)) => "transport",
        Err(sdk::Error::Decode(_)) => "decode",
    }
}

/// Backoff before retry `attempt` (0-based) of a retryable failure.
pub fn retry_delay(base: Duration, attempt: u32, err: &sdk::Error) -> Duration {
    match err {
        // The bucket pause already makes us wait; no extra sleep on top.
        sdk::Error::RateLimited { .. } => Duration::ZERO,
        _ => base
            .saturating_mul(1 << attempt.min(6))
            .min(Duration::from_secs(5)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classified() {
        let vip = Some(Ipv4Addr::new(198, 51, 100, 9));
        let taken = sdk::Error::Conflict {
            message: "VIP 198.51.100.9 is already in use".into(),
        };
        assert!(matches!(
            classify(&taken, Operation::Create, None, vip),
            ProviderError::IpUnavailable { .. }
        ));
        let outside = sdk::Error::Invalid {
            message: "vip 10.0.0.1 is outside the pool 198.51.100.0/24".into(),
        };
        assert!(matches!(
            classify(
                &outside,
                Operation::Create,
                None,
                Some(Ipv4Addr::new(10, 0, 0, 1))
            ),
            ProviderError::IpUnavailable { .. }
        ));
        assert!(matches!(
            classify(&taken, Operation::Update, Some("lb-1"), None),
            ProviderError::Conflict { .. }
        ));
        assert!(matches!(
            classify(
                &sdk::Error::RateLimited {
                    retry_after: Duration::from_secs(2)
                },
                Operation::Get,
                None,
                None
            ),
            ProviderError::RateLimited { .. }
        ));
        assert!(
            classify(
                &sdk::Error::Unavailable {
                    message: "x".into()
                },
                Operation::Get,
                None,
                None
            )
            .category()
                == "unavailable"
        );
    }

    #[test]
    fn retry_delay_doubles_and_is_capped() {
        let err = sdk::Error::Unavailable {
            message: String::new(),
        };
        let base = Duration::from_millis(200);
        assert_eq!(retry_delay(base, 0, &err), Duration::from_millis(200));
        assert_eq!(retry_delay(base, 2, &err), Duration::from_millis(800));
        assert_eq!(retry_delay(base, 10, &err), Duration::from_secs(5));
        let limited = sdk::Error::RateLimited {
            retry_after: Duration::from_secs(3),
        };
        assert_eq!(retry_delay(base, 0, &limited), Duration::ZERO);
    }
}
