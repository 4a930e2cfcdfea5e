//! API errors: a status, a bounded code and a clear message, answered as
//! `{"error": {"code": ..., "message": ...}}`.

use axum::Json;
use axum::response::{IntoResponse, Response};
use cloud_mock_sdk::{ErrorBody, ErrorDetail};
use http::{HeaderValue, StatusCode, header};

use crate::store::StoreError;
use crate::tenants::Refusal;
use crate::validate::SpecError;

/// The refusal of an address family the pool has no CIDR for (like `unknown-pool`, a
/// pool that cannot serve the request as it stands).
const POOL_LACKS_FAMILY: &str = "pool-lacks-family";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", message)
    }

    /// A 503 the client retries after a second: nothing was written.
    fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            retry_after_secs: Some(1),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }
}

impl From<SpecError> for ApiError {
    fn from(err: SpecError) -> Self {
        match err {
            SpecError::VipOutsidePool { .. }
            | SpecError::VipOutsidePools { .. }
            | SpecError::VipsInTwoPools { .. } => {
                Self::bad_request("vip-outside-pool", err.to_string())
            }
            SpecError::UnknownPool { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown-pool",
                err.to_string(),
            ),
            SpecError::PoolLacksFamily { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                POOL_LACKS_FAMILY,
                err.to_string(),
            ),
            SpecError::BackendsAndNodePool { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "backends-and-node-pool",
                err.to_string(),
            ),
            SpecError::UdpUnserved { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unsupported-protocol",
                err.to_string(),
            ),
            SpecError::PassthroughUnserved => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unsupported-mode",
                err.to_string(),
            ),
            SpecError::Invalid { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", err.to_string())
            }
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        let message = err.to_string();
        match err {
            StoreError::NotFound { .. } => Self::not_found(message),
            StoreError::VipTaken { .. } => Self::new(StatusCode::CONFLICT, "vip-taken", message),
            StoreError::IdTaken { .. } => Self::new(StatusCode::CONFLICT, "id-taken", message),
            StoreError::PortConflict { .. } => {
                Self::new(StatusCode::CONFLICT, "port-conflict", message)
            }
            StoreError::SharingModeMismatch { .. } => {
                Self::new(StatusCode::CONFLICT, "sharing-mode-mismatch", message)
            }
            StoreError::PoolExhausted { .. } => {
                Self::new(StatusCode::CONFLICT, "pool-exhausted", message)
            }
            StoreError::UnknownPool { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown-pool", message)
            }
            StoreError::PoolLacksFamily { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, POOL_LACKS_FAMILY, message)
            }
            StoreError::Deleting { .. } => Self::new(StatusCode::CONFLICT, "deleting", message),
            StoreError::UnknownNodePool { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "node-pool-not-found",
                message,
            ),
            StoreError::NodePoolInUse { .. } => {
                Self::new(StatusCode::CONFLICT, "node-pool-in-use", message)
            }
            StoreError::VersionMismatch { .. } | StoreError::NodePoolVersionMismatch { .. } => {
                Self::new(
                    StatusCode::PRECONDITION_FAILED,
                    "version-mismatch",
                    format!("{message}; read it again and retry"),
                )
            }
            StoreError::Unavailable { .. } => {
                tracing::warn!(error = %message, "write refused: the store is unavailable");
                Self::unavailable("store-unavailable", message)
            }
            StoreError::Contended { .. } => Self::unavailable("store-contended", message),
            StoreError::Refused(refusal) => refusal.into(),
            StoreError::Poisoned { .. } | StoreError::Etcd(_) => {
                tracing::error!(error = %message, "store failure");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
            StoreError::Open { .. }
            | StoreError::NeedsEtcd { .. }
            | StoreError::Database(_)
            | StoreError::Corrupt { .. }
            | StoreError::Encode { .. }
            | StoreError::Task(_) => {
                tracing::error!(error = %message, "store failure");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the store failed; see the server log",
                )
            }
        }
    }
}

impl From<Refusal> for ApiError {
    /// 403, as the clouds answer a quota (Octavia, GCE) and a resource outside the
    /// caller's project.
    fn from(refusal: Refusal) -> Self {
        let code = match refusal {
            Refusal::Cluster { .. } => "cluster-not-permitted",
            Refusal::Pool { .. } => "pool-not-permitted",
            Refusal::Quota { .. } => "quota-exceeded",
        };
        Self::new(StatusCode::FORBIDDEN, code, refusal.to_string())
    }
}

/// The error code of an answer, for the audit log.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        response.extensions_mut().insert(ErrorCode(self.code));
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
