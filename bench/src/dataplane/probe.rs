//! Do: timed HTTP requests to the pod echo, each on a new connection. Blocking std sockets
//! on a thread that has entered the client's namespace (see `Netns::run_in_thread`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A request to the echo that asks it to close the connection after answering.
const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: tandem-bench\r\nConnection: close\r\n\r\n";
/// Give up on a path after this many failures in a row: it is broken, not slow.
const MAX_FAILURES_IN_A_ROW: usize = 10;

/// Times of the successful requests, and the failed ones by error.
#[derive(Debug, Default)]
pub struct RequestTimes {
    pub latencies: Vec<Duration>,
    pub failures: BTreeMap<String, usize>,
    /// Set when the run stopped early after too many failures in a row.
    pub gave_up: bool,
}

/// Sends `count` requests to `target` one after another, each bounded by `timeout`.
pub fn time_requests(target: SocketAddr, count: u32, timeout: Duration) -> RequestTimes {
    let mut times = RequestTimes::default();
    let mut failures_in_a_row = 0;
    for _ in 0..count {
        match one_request(target, timeout) {
            Ok(elapsed) => {
                times.latencies.push(elapsed);
                failures_in_a_row = 0;
            }
            Err(error) => {
                *times.failures.entry(error).or_default() += 1;
                failures_in_a_row += 1;
                if failures_in_a_row >= MAX_FAILURES_IN_A_ROW {
                    times.gave_up = true;
                    break;
                }
            }
        }
    }
    times
}

/// Requests to `target` one after another, one every `pace` at most, until `stop` is set,
/// `max_count` were sent or `max_time` passed, whichever comes first; every failure is
/// counted (none ends the run). The steady traffic of the edge churn measurement.
pub fn requests_until(
    target: SocketAddr,
    stop: &AtomicBool,
    pace: Duration,
    max_count: u32,
    max_time: Duration,
    timeout: Duration,
) -> RequestTimes {
    let mut times = RequestTimes::default();
    let start = Instant::now();
    for _ in 0..max_count {
        if stop.load(Ordering::Relaxed) || start.elapsed() > max_time {
            break;
        }
        let sent = Instant::now();
        match one_request(target, timeout) {
            Ok(elapsed) => times.latencies.push(elapsed),
            Err(error) => *times.failures.entry(error).or_default() += 1,
        }
        std::thread::sleep(pace.saturating_sub(sent.elapsed()));
    }
    times
}

/// The time from `since` until `target` first answers a request, trying every `pace`;
/// `None` if it has not answered by `bound` after `since`.
pub fn first_answer(
    target: SocketAddr,
    since: Instant,
    pace: Duration,
    bound: Duration,
    timeout: Duration,
) -> Option<Duration> {
    loop {
        let tried = Instant::now();
        if one_request(target, timeout).is_ok() {
            return Some(since.elapsed());
        }
        if since.elapsed() > bound {
            return None;
        }
        std::thread::sleep(pace.saturating_sub(tried.elapsed()));
    }
}

/// Connect, send, read the whole reply; the error says which step failed.
fn one_request(target: SocketAddr, timeout: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    let mut stream =
        TcpStream::connect_timeout(&target, timeout).map_err(|e| format!("connect: {e}"))?;
    let step = |what: &str, e: std::io::Error| format!("{what}: {e}");
    stream
        .set_nodelay(true)
        .map_err(|e| step("TCP_NODELAY", e))?;
    let remaining = timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| step("read timeout", e))?;
    stream.write_all(REQUEST).map_err(|e| step("send", e))?;
    let mut reply = Vec::with_capacity(512);
    stream
        .read_to_end(&mut reply)
        .map_err(|e| step("read", e))?;
    let elapsed = start.elapsed();
    if !reply.starts_with(b"HTTP/1.1 200") {
        let head = String::from_utf8_lossy(&reply[..reply.len().min(40)]).into_owned();
        return Err(format!("unexpected reply {head:?}"));
    }
    Ok(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// An HTTP server on loopback answering `replies` connections with `answer`.
    fn serve(answer: &'static [u8], replies: usize) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(replies) {
                let mut stream = stream.unwrap();
                let mut request = [0u8; 256];
                let _ = stream.read(&mut request).unwrap();
                stream.write_all(answer).unwrap();
            }
        });
        addr
    }

    #[test]
    fn every_answered_request_is_timed() {
        let addr = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 5);
        let times = time_requests(addr, 5, Duration::from_secs(2));
        assert_eq!(times.latencies.len(), 5);
        assert!(times.failures.is_empty() && !times.gave_up);
    }

    #[test]
    fn a_wrong_answer_is_a_failure_not_a_sample() {
        let addr = serve(b"HTTP/1.1 503 Service Unavailable\r\n\r\n", 1);
        let times = time_requests(addr, 1, Duration::from_secs(2));
        assert!(times.latencies.is_empty());
        assert_eq!(times.failures.values().sum::<usize>(), 1, "{times:?}");
    }

    #[test]
    fn steady_requests_stop_when_asked_and_count_failures() {
        let addr = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 3);
        let stop = AtomicBool::new(false);
        // Three answers, then nothing listens to the rest: bounded by the count.
        let times = requests_until(
            addr,
            &stop,
            Duration::ZERO,
            5,
            Duration::from_secs(10),
            Duration::from_millis(200),
        );
        assert_eq!(times.latencies.len(), 3);
        assert_eq!(times.failures.values().sum::<usize>(), 2, "{times:?}");
        stop.store(true, Ordering::Relaxed);
        let none = requests_until(
            addr,
            &stop,
            Duration::ZERO,
            5,
            Duration::from_secs(10),
            Duration::from_millis(200),
        );
        assert!(none.latencies.is_empty() && none.failures.is_empty());
    }

    #[test]
    fn the_first_answer_is_timed_and_silence_is_bounded() {
        let addr = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 1);
        let since = Instant::now();
        let took = first_answer(
            addr,
            since,
            Duration::from_millis(1),
            Duration::from_secs(5),
            Duration::from_millis(200),
        );
        assert!(took.is_some_and(|t| t <= since.elapsed()));
        let dead = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let never = first_answer(
            dead,
            Instant::now(),
            Duration::from_millis(10),
            Duration::from_millis(100),
            Duration::from_millis(50),
        );
        assert_eq!(never, None);
    }

    #[test]
    fn a_dead_target_is_given_up_on_early() {
        // Bound and dropped: nothing listens there any more, so connects are refused.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let times = time_requests(addr, 1000, Duration::from_millis(200));
        assert!(times.gave_up);
        assert_eq!(
            times.failures.values().sum::<usize>(),
            MAX_FAILURES_IN_A_ROW
        );
    }
}
