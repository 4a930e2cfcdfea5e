//! Mock-cloud errors as provider errors, their metric outcome, and the retry delay.

use std::time::Duration;

use cloud_mock_sdk as sdk;

use tandem_controller::provider::{AddressRefusal, Operation, ProviderError};

/// The cloud's error code for each address refusal.
const ADDRESS_REFUSALS: [(&str, AddressRefusal); 8] = [
    ("unknown-pool", AddressRefusal::UnknownPool),
    ("pool-exhausted", AddressRefusal::PoolExhausted),
    ("vip-outside-pool", AddressRefusal::OutsidePools),
    ("vip-taken", AddressRefusal::Taken),
    ("port-conflict", AddressRefusal::PortConflict),
    ("sharing-mode-mismatch", AddressRefusal::SharingModeMismatch),
    ("pool-lacks-family", AddressRefusal::PoolLacksFamily),
    // 403: the credential's tenant may not draw VIPs from the pool.
    ("pool-not-permitted", AddressRefusal::PoolNotPermitted),
];

/// The cloud's error codes for what its balancer cannot serve (a UDP listener of a proxy-mode
/// LB on an HAProxy edge; a passthrough LB on an edge in the L2 mode), answered with 422
/// before anything is stored.
const UNSUPPORTED: [&str; 2] = ["unsupported-protocol", "unsupported-mode"];

/// An LB names a node pool the cloud does not have.
const NODE_POOL_NOT_FOUND: &str = "node-pool-not-found";
/// A node pool that LBs still reference cannot be deleted.
const NODE_POOL_IN_USE: &str = "node-pool-in-use";
/// A create or update would pass a quota of the credential's tenant (403).
const QUOTA_EXCEEDED: &str = "quota-exceeded";

/// The address refusal an SDK error carries, by the cloud's error code.
fn address_refusal(err: &sdk::Error) -> Option<AddressRefusal> {
    let code = err.code()?;
    ADDRESS_REFUSALS
        .iter()
        .find(|(known, _)| *known == code)
        .map(|(_, refusal)| *refusal)
}

pub fn is_address_refusal(err: &sdk::Error) -> bool {
    address_refusal(err).is_some()
}

/// The SDK error as a provider error.
pub fn classify(err: &sdk::Error, operation: Operation, id: Option<&str>) -> ProviderError {
    if let sdk::Error::Conflict { message, .. }
    | sdk::Error::Invalid { message, .. }
    | sdk::Error::Forbidden { message, .. } = err
        && let Some(refusal) = address_refusal(err)
    {
        return ProviderError::AddressRefused {
            refusal,
            message: message.clone(),
        };
    }
    if let sdk::Error::Invalid { message, .. } = err
        && err.code().is_some_and(|code| UNSUPPORTED.contains(&code))
    {
        return ProviderError::Unsupported {
            operation,
            message: message.clone(),
        };
    }
    match (err, err.code()) {
        (sdk::Error::Invalid { message, .. }, Some(NODE_POOL_NOT_FOUND)) => {
            return ProviderError::NodePoolMissing {
                message: message.clone(),
            };
        }
        (sdk::Error::Conflict { .. }, Some(NODE_POOL_IN_USE)) => {
            return ProviderError::NodePoolInUse {
                name: id.unwrap_or_default().to_owned(),
            };
        }
        _ => {}
    }
    match err {
        sdk::Error::NotFound { .. } => ProviderError::NotFound {
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Conflict { .. } => ProviderError::Conflict {
            operation,
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Invalid { message, .. } => ProviderError::Invalid {
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
        sdk::Error::Forbidden { code, message } => match code.as_deref() {
            Some(QUOTA_EXCEEDED) => ProviderError::QuotaExceeded {
                message: message.clone(),
            },
            // `cluster-not-permitted`, `forbidden`, and codes to come: the code stays in
            // the message, as the user's clue to what the tenant lacks.
            Some(code) => ProviderError::Forbidden {
                operation,
                message: format!("{code}: {message}"),
            },
            None => ProviderError::Forbidden {
                operation,
                message: message.clone(),
            },
        },
        sdk::Error::Unavailable { .. }
        | sdk::Error::Transport(_)
        | sdk::Error::Unreachable(_)
        | sdk::Error::Decode(_)
        | sdk::Error::Tls(_) => ProviderError::Unavailable {
            operation,
            message: err.to_string(),
        },
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
        Err(sdk::Error::Forbidden { .. }) => "forbidden",
        Err(sdk::Error::Unavailable { .. }) => "unavailable",
        // Every edge refused the connection: a transport failure, as with one edge.
        Err(sdk::Error::Transport(_) | sdk::Error::Unreachable(_)) => "transport",
        Err(sdk::Error::Decode(_)) => "decode",
        Err(sdk::Error::Tls(_)) => "tls",
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

    fn refusal_of(err: &sdk::Error) -> Option<AddressRefusal> {
        match classify(err, Operation::Create, None) {
            ProviderError::AddressRefused { refusal, .. } => Some(refusal),
            _ => None,
        }
    }

    #[test]
    fn every_address_code_is_its_own_refusal() {
        for (code, refusal) in ADDRESS_REFUSALS {
            let message = "pool blue (198.51.100.128/25) says no".to_owned();
            let wire_code = Some(code.to_owned());
            let as_conflict = sdk::Error::Conflict {
                code: wire_code.clone(),
                message: message.clone(),
            };
            let as_invalid = sdk::Error::Invalid {
                code: wire_code,
                message,
            };
            assert_eq!(refusal_of(&as_conflict), Some(refusal), "{code}");
            assert_eq!(refusal_of(&as_invalid), Some(refusal), "{code}");
        }
        let taken = sdk::Error::Conflict {
            code: Some("vip-taken".into()),
            message: "VIP 198.51.100.9 is in use by lb-1".into(),
        };
        assert_eq!(
            classify(&taken, Operation::Create, None).to_string(),
            "address refused: VIP 198.51.100.9 is in use by lb-1"
        );
    }

    #[test]
    fn what_the_cloud_cannot_serve_is_unsupported_and_permanent() {
        let udp = sdk::Error::Invalid {
            code: Some("unsupported-protocol".into()),
            message: "listeners[1]: this cloud's proxy-mode load balancers serve TCP only; UDP port 53 cannot be served (passthrough mode routes UDP)".into(),
        };
        let error = classify(&udp, Operation::Create, None);
        assert!(
            matches!(&error, ProviderError::Unsupported { message, .. } if message.contains("UDP port 53")),
            "{error:?}"
        );
        assert!(error.is_permanent());
        assert_eq!(error.category(), "unsupported");
        // Another 422 stays invalid.
        let other = sdk::Error::Invalid {
            code: Some("invalid".into()),
            message: "listeners: empty".into(),
        };
        assert!(matches!(
            classify(&other, Operation::Create, None),
            ProviderError::Invalid { .. }
        ));
    }

    #[test]
    fn other_errors_are_classified() {
        let stale = sdk::Error::Conflict {
            code: Some("version-mismatch".into()),
            message: "load balancer lb-1 is at version 3, not 2".into(),
        };
        assert!(matches!(
            classify(&stale, Operation::Update, Some("lb-1")),
            ProviderError::Conflict { .. }
        ));
        let invalid = sdk::Error::Invalid {
            code: Some("invalid".into()),
            message: "listeners: empty".into(),
        };
        assert!(matches!(
            classify(&invalid, Operation::Create, None),
            ProviderError::Invalid { .. }
        ));
        assert!(matches!(
            classify(
                &sdk::Error::RateLimited {
                    retry_after: Duration::from_secs(2)
                },
                Operation::Get,
                None,
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
            )
            .category()
                == "unavailable"
        );
    }

    #[test]
    fn forbidden_answers_are_told_apart_by_their_code() {
        let forbidden = |code: Option<&str>, message: &str| sdk::Error::Forbidden {
            code: code.map(str::to_owned),
            message: message.to_owned(),
        };
        let quota =
            r#"tenant "team-a" reached its quota of 5 load balancers (quota loadBalancers)"#;
        let error = classify(
            &forbidden(Some("quota-exceeded"), quota),
            Operation::Create,
            None,
        );
        assert_eq!(
            error,
            ProviderError::QuotaExceeded {
                message: quota.into()
            }
        );
        assert_eq!(error.category(), "quota_exceeded");
        assert!(error.is_permanent());

        let pool = r#"tenant "team-a" may not draw VIPs from pool "dmz" (its pools: default)"#;
        let error = classify(
            &forbidden(Some("pool-not-permitted"), pool),
            Operation::Update,
            Some("lb-1"),
        );
        assert_eq!(
            error,
            ProviderError::AddressRefused {
                refusal: AddressRefusal::PoolNotPermitted,
                message: pool.into()
            }
        );
        assert_eq!(error.category(), "pool_not_permitted");
        assert!(is_address_refusal(&forbidden(
            Some("pool-not-permitted"),
            pool
        )));

        for (code, want) in [
            (
                Some("cluster-not-permitted"),
                "cloud create forbidden: cluster-not-permitted: not bound to cluster prod",
            ),
            (
                Some("forbidden"),
                "cloud create forbidden: forbidden: not bound to cluster prod",
            ),
            (None, "cloud create forbidden: not bound to cluster prod"),
        ] {
            let error = classify(
                &forbidden(code, "not bound to cluster prod"),
                Operation::Create,
                None,
            );
            assert!(
                matches!(error, ProviderError::Forbidden { .. }),
                "{code:?}: {error:?}"
            );
            assert_eq!(error.to_string(), want);
            assert_eq!(error.category(), "forbidden");
            assert!(error.is_permanent());
        }
        // A 401 stays unauthorized: the token, not the tenant.
        assert!(matches!(
            classify(&sdk::Error::Unauthorized, Operation::Get, None),
            ProviderError::Unauthorized { .. }
        ));
        assert_eq!(
            outcome(&Err::<(), _>(forbidden(Some("quota-exceeded"), quota))),
            "forbidden"
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
