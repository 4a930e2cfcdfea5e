//! TCP forwarding as haproxy's `splice-auto` does it: small messages are copied through a
//! user-space buffer (cheapest for a request or an answer); once a read fills the buffer
//! the direction is a bulk transfer, and its bytes move socket → pipe → socket inside the
//! kernel with `splice(2)`, never through user space. The calls are nix's safe wrappers;
//! tokio's readiness drives them.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use nix::sys::socket::{Shutdown, shutdown};
use nix::unistd::pipe2;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// User-space buffer of a direction; a read that fills it starts splicing.
const COPY_BUFFER: usize = 16 << 10;
/// Capacity asked for a bulk direction's pipe, and the most one move puts into it: fewer,
/// larger moves per byte. Linux caps it at `/proc/sys/fs/pipe-max-size` (1 MiB by
/// default); a pipe left at its default 64 KiB only means shorter moves.
const PIPE_CAPACITY: usize = 1 << 20;
/// A new pipe's capacity (Linux's default, 16 pages).
const DEFAULT_PIPE_CAPACITY: usize = 64 << 10;

fn flags() -> SpliceFFlags {
    SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE
}

/// The pipe that carries a bulk direction.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// The most one move puts into it.
    capacity: usize,
}

impl Pipe {
    fn new() -> io::Result<Self> {
        let (read, write) = pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
        let capacity = match fcntl(&write, FcntlArg::F_SETPIPE_SZ(PIPE_CAPACITY as i32)) {
            Ok(granted) => usize::try_from(granted).unwrap_or(DEFAULT_PIPE_CAPACITY),
            Err(errno) => {
                tracing::debug!(%errno, "pipe keeps its default size");
                DEFAULT_PIPE_CAPACITY
            }
        };
        Ok(Self {
            read,
            write,
            capacity,
        })
    }
}

/// The bytes one direction moved, by the path they took (so tests can tell that a bulk
/// transfer really was spliced).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Moved {
    /// Through the user-space buffer.
    pub copied: u64,
    /// Socket → pipe → socket, inside the kernel.
    pub spliced: u64,
}

impl Moved {
    pub fn total(self) -> u64 {
        self.copied + self.spliced
    }
}

/// Copies both ways until both sides have closed their sending half (or either fails),
/// half-closing each direction as its source ends; returns what moved
/// `(a → b, b → a)`.
pub(crate) async fn forward_both_ways(a: &TcpStream, b: &TcpStream) -> io::Result<(Moved, Moved)> {
    tokio::try_join!(one_way(a, b), one_way(b, a))
}

/// Moves everything `from` sends to `to`, then shuts `to`'s sending half.
async fn one_way(from: &TcpStream, to: &TcpStream) -> io::Result<Moved> {
    let mut buffer = vec![0_u8; COPY_BUFFER];
    let mut pipe: Option<Pipe> = None;
    let mut moved = Moved::default();
    loop {
        match &pipe {
            Some(pipe) => {
                let spliced = splice_once(from, to, pipe).await?;
                if spliced == 0 {
                    break;
                }
                moved.spliced += spliced as u64;
            }
            None => {
                let copied = copy_once(from, to, &mut buffer).await?;
                if copied == 0 {
                    break;
                }
                if copied == buffer.len() {
                    // Out of pipes (descriptors): keep copying.
                    pipe = Pipe::new()
                        .inspect_err(|error| tracing::debug!(%error, "no pipe for splice"))
                        .ok();
                }
                moved.copied += copied as u64;
            }
        }
    }
    match shutdown(to.as_raw_fd(), Shutdown::Write) {
        // The peer went already: nothing left to tell it.
        Ok(()) | Err(Errno::ENOTCONN) => Ok(moved),
        Err(errno) => Err(errno.into()),
    }
}

/// One read from `from`, written whole to `to`; 0 at the end of `from`'s stream.
async fn copy_once(from: &TcpStream, to: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
    let read = loop {
        from.readable().await?;
        match from.try_read(buffer) {
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            other => break other?,
        }
    };
    let mut written = 0;
    while written < read {
        to.writable().await?;
        match to.try_write(&buffer[written..read]) {
            Ok(count) => written += count,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(read)
}

/// One move from `from` into the (empty) pipe, drained whole into `to`; 0 at the end of
/// `from`'s stream.
async fn splice_once(from: &TcpStream, to: &TcpStream, pipe: &Pipe) -> io::Result<usize> {
    let moved = loop {
        from.readable().await?;
        match from.try_io(Interest::READABLE, || {
            splice(
                from.as_fd(),
                None,
                pipe.write.as_fd(),
                None,
                pipe.capacity,
                flags(),
            )
            .map_err(io::Error::from)
        }) {
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            other => break other?,
        }
    };
    let mut pending = moved;
    while pending > 0 {
        to.writable().await?;
        match to.try_io(Interest::WRITABLE, || {
            splice(pipe.read.as_fd(), None, to.as_fd(), None, pending, flags())
                .map_err(io::Error::from)
        }) {
            Ok(written) => pending -= written,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    async fn connected_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn moves_every_byte_both_ways_and_passes_half_close_on() {
        // client ⇄ (proxy_front, proxy_back) ⇄ server
        let (mut client, proxy_front) = connected_pair().await;
        let (proxy_back, mut server) = connected_pair().await;
        let proxy = tokio::spawn(async move { forward_both_ways(&proxy_front, &proxy_back).await });
        // Small writes first (copied), then more than one pipe's worth (spliced), in
        // odd sizes.
        let upload: Vec<u8> = (0..1_000_003_u32).map(|i| (i % 251) as u8).collect();
        let expected = upload.clone();
        let sender = tokio::spawn(async move {
            for chunk in upload.chunks(7_777) {
                client.write_all(chunk).await.unwrap();
            }
            client.shutdown().await.unwrap();
            let mut answer = Vec::new();
            client.read_to_end(&mut answer).await.unwrap();
            answer
        });
        let mut received = Vec::new();
        server.read_to_end(&mut received).await.unwrap();
        assert_eq!(
            received, expected,
            "the server saw the client's bytes, then EOF"
        );
        server.write_all(b"done").await.unwrap();
        server.shutdown().await.unwrap();
        assert_eq!(sender.await.unwrap(), b"done");
        let (upstream, downstream) = proxy.await.unwrap().unwrap();
        assert_eq!((upstream.total(), downstream.total()), (1_000_003, 4));
        // The upload filled the buffer at least once, then went through the pipe.
        assert!(
            upstream.copied >= COPY_BUFFER as u64 && upstream.spliced > 0,
            "upload moved as {upstream:?}"
        );
        assert_eq!(
            downstream,
            Moved {
                copied: 4,
                spliced: 0
            },
            "a small answer is copied"
        );
    }
}
