//! A plain HTTP/1.0 `GET` for tests and benchmarks: the status and body of a metrics,
//! health or API endpoint, one connection per request, nothing pooled.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::NetlabError;

/// `GET path` from `addr`: the status code and the body, all within `timeout`.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), NetlabError> {
    let context = || format!("GET http://{addr}{path}");
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))
        .and_then(|read| read)
        .map_err(|source| NetlabError::Io {
            context: context(),
            source,
        })?;
    parse(&String::from_utf8_lossy(&response)).ok_or_else(|| NetlabError::Io {
        context: context(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not an HTTP response with a status and a body",
        ),
    })
}

fn parse(response: &str) -> Option<(u16, String)> {
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_and_body() {
        assert_eq!(
            parse("HTTP/1.0 503 Service Unavailable\r\nA: b\r\n\r\nnot ready"),
            Some((503, "not ready".to_owned()))
        );
        assert_eq!(parse("HTTP/1.0 200 OK\r\n"), None, "no body separator");
        assert_eq!(parse("garbage\r\n\r\n"), None);
    }
}
