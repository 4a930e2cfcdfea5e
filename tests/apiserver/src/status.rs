//! Kubernetes `Status` errors: every failed request answers with one of these.

use serde_json::{Value, json};

use crate::resources::ResourceType;

/// Why one field of an object is rejected (one entry of `details.causes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub kind: FieldErrorKind,
    /// Path of the field, as the real API server spells it: `spec.ports[0].nodePort`.
    pub field: String,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldErrorKind {
    Invalid(Value),
    Duplicate(Value),
    NotSupported(Value, Vec<&'static str>),
    Required,
    Forbidden,
}

impl FieldError {
    pub fn invalid(
        field: impl Into<String>,
        value: impl Into<Value>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            kind: FieldErrorKind::Invalid(value.into()),
            field: field.into(),
            detail: detail.into(),
        }
    }

    pub fn duplicate(field: impl Into<String>, value: impl Into<Value>) -> Self {
        Self {
            kind: FieldErrorKind::Duplicate(value.into()),
            field: field.into(),
            detail: String::new(),
        }
    }

    pub fn not_supported(
        field: impl Into<String>,
        value: impl Into<Value>,
        supported: &[&'static str],
    ) -> Self {
        Self {
            kind: FieldErrorKind::NotSupported(value.into(), supported.to_vec()),
            field: field.into(),
            detail: String::new(),
        }
    }

    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            kind: FieldErrorKind::Required,
            field: field.into(),
            detail: detail.into(),
        }
    }

    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            kind: FieldErrorKind::Forbidden,
            field: field.into(),
            detail: detail.into(),
        }
    }

    /// The `reason` of the cause (`FieldValueInvalid`, ...).
    pub fn reason(&self) -> &'static str {
        match self.kind {
            FieldErrorKind::Invalid(_) => "FieldValueInvalid",
            FieldErrorKind::Duplicate(_) => "FieldValueDuplicate",
            FieldErrorKind::NotSupported(..) => "FieldValueNotSupported",
            FieldErrorKind::Required => "FieldValueRequired",
            FieldErrorKind::Forbidden => "FieldValueForbidden",
        }
    }

    /// The cause message without the field, as apimachinery's `field.Error.ErrorBody`.
    pub fn body(&self) -> String {
        let with_detail = |head: String| {
            if self.detail.is_empty() {
                head
            } else {
                format!("{head}: {}", self.detail)
            }
        };
        match &self.kind {
            FieldErrorKind::Invalid(v) => with_detail(format!("Invalid value: {v}")),
            FieldErrorKind::Duplicate(v) => with_detail(format!("Duplicate value: {v}")),
            FieldErrorKind::NotSupported(v, supported) => {
                let list: Vec<String> = supported.iter().map(|s| format!("\"{s}\"")).collect();
                format!(
                    "Unsupported value: {v}: supported values: {}",
                    list.join(", ")
                )
            }
            FieldErrorKind::Required => with_detail("Required value".to_string()),
            FieldErrorKind::Forbidden => format!("Forbidden: {}", self.detail),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// A failed API request: HTTP code, `reason` and message of a `Status` object.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    pub fn not_found(rt: &ResourceType, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", rt.group_resource()),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": rt.plural}))
    }

    pub fn namespace_not_found(namespace: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("namespaces \"{namespace}\" not found"),
        )
        .with_details(json!({"name": namespace, "kind": "namespaces"}))
    }

    pub fn namespace_terminating(rt: &ResourceType, name: &str, namespace: &str) -> Self {
        Self::new(
            403,
            "Forbidden",
            format!(
                "{} \"{name}\" is forbidden: unable to create new content in namespace {namespace} because it is being terminated",
                rt.group_resource()
            ),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": rt.plural}))
    }

    pub fn already_exists(rt: &ResourceType, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", rt.group_resource()),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": rt.plural}))
    }

    pub fn conflict(rt: &ResourceType, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                rt.group_resource()
            ),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": rt.plural}))
    }

    pub fn precondition_failed(rt: &ResourceType, name: &str, what: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {what}",
                rt.group_resource()
            ),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": rt.plural}))
    }

    /// 422 Invalid listing every field cause, as `apierrors.NewInvalid` does.
    pub fn invalid(rt: &ResourceType, name: &str, causes: &[FieldError]) -> Self {
        let summary = match causes {
            [one] => one.to_string(),
            many => format!(
                "[{}]",
                many.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|c| json!({"reason": c.reason(), "message": c.body(), "field": c.field}))
            .collect();
        let kind = rt.kind;
        Self::new(
            422,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: {summary}"),
        )
        .with_details(json!({"name": name, "group": rt.group, "kind": kind, "causes": causes}))
    }

    /// 422 for a patch that cannot be applied (a failed JSON-patch `test`, a bad path).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn path_not_found() -> Self {
        Self::new(404, "NotFound", "the server could not find the requested resource")
            .with_details(json!({"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]}))
    }

    pub fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource: {method}"),
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/vnd.kubernetes.protobuf, application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json; got {content_type:?}"
            ),
        )
    }

    /// 415 for a body in a known media type that this server cannot read.
    pub fn unreadable_body(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    /// 410 Gone: the requested resourceVersion is older than the kept history.
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// The `Status` object sent as the response body (or inside a watch ERROR event).
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(details), Some(map)) = (&self.details, status.as_object_mut()) {
            map.insert("details".to_string(), details.clone());
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources;

    #[test]
    fn invalid_status_lists_causes_with_fields() {
        let rt = resources::SERVICES;
        let err = ApiError::invalid(
            rt,
            "web",
            &[
                FieldError::invalid(
                    "spec.ports[0].nodePort",
                    99,
                    "provided port is not in the valid range",
                ),
                FieldError::not_supported("spec.type", "Bogus", &["ClusterIP", "NodePort"]),
            ],
        );
        let status = err.to_status();
        assert_eq!(status["code"], 422);
        assert_eq!(status["reason"], "Invalid");
        assert_eq!(status["details"]["kind"], "Service");
        assert_eq!(
            status["details"]["causes"][0]["field"],
            "spec.ports[0].nodePort"
        );
        assert_eq!(
            status["details"]["causes"][0]["reason"],
            "FieldValueInvalid"
        );
        assert_eq!(
            status["details"]["causes"][1]["reason"],
            "FieldValueNotSupported"
        );
        assert_eq!(
            status["details"]["causes"][1]["message"],
            "Unsupported value: \"Bogus\": supported values: \"ClusterIP\", \"NodePort\""
        );
        assert!(
            status["message"].as_str().unwrap().starts_with(
                "Service \"web\" is invalid: [spec.ports[0].nodePort: Invalid value: 99"
            )
        );
    }

    #[test]
    fn not_found_names_group_resource() {
        let err = ApiError::not_found(resources::LEASES, "x");
        assert_eq!(err.message, "leases.coordination.k8s.io \"x\" not found");
        assert_eq!(err.to_status()["code"], 404);
    }
}
