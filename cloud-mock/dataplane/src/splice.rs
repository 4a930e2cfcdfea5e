//! Zero-copy TCP forwarding: bytes move socket → pipe → socket inside the kernel with
//! `splice(2)`, never through user-space buffers (what haproxy's `option splice-auto`
//! does). The calls are nix's safe wrappers; tokio's readiness drives them.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use nix::sys::socket::{Shutdown, shutdown};
use nix::unistd::pipe2;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// A new pipe's capacity (Linux's default, 16 pages): enough for requests and answers,
/// and nothing to set up per connection.
const FIRST_CAPACITY: usize = 64 << 10;
/// The capacity a pipe grows to once its direction has carried as much (a bulk transfer):
/// fewer, larger moves per byte. Linux caps it at `/proc/sys/fs/pipe-max-size` (1 MiB by
/// default). Growing every pipe at once costs short connections about 7% of their rate.
const BULK_CAPACITY: usize = 1 << 20;

fn flags() -> SpliceFFlags {
    SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE
}

/// A pipe that carries one direction of a connection.
pub(crate) struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// The most one move puts into it.
    capacity: usize,
    may_grow: bool,
}

impl Pipe {
    pub(crate) fn new() -> io::Result<Self> {
        let (read, write) = pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(Self {
            read,
            write,
            capacity: FIRST_CAPACITY,
            may_grow: true,
        })
    }

    /// Grows the pipe to [`BULK_CAPACITY`], once; where the kernel refuses (a lower
    /// `pipe-max-size`, the user's pipe quota) it keeps its size.
    fn grow(&mut self) {
        self.may_grow = false;
        #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
        match fcntl(&self.write, FcntlArg::F_SETPIPE_SZ(BULK_CAPACITY as i32)) {
            Ok(granted) => self.capacity = usize::try_from(granted).unwrap_or(FIRST_CAPACITY),
            Err(errno) => tracing::debug!(%errno, "pipe keeps its size"),
        }
    }
}

/// Copies both ways until both sides have closed their sending half (or either fails),
/// half-closing each direction as its source ends; returns the bytes moved
/// `(a → b, b → a)`. Needs two pipes (four descriptors).
pub(crate) async fn splice_bidirectional(
    a: &TcpStream,
    b: &TcpStream,
    a_to_b: Pipe,
    b_to_a: Pipe,
) -> io::Result<(u64, u64)> {
    tokio::try_join!(one_way(a, b, a_to_b), one_way(b, a, b_to_a))
}

/// Moves everything `from` sends to `to`, then shuts `to`'s sending half.
async fn one_way(from: &TcpStream, to: &TcpStream, mut pipe: Pipe) -> io::Result<u64> {
    let mut total: u64 = 0;
    loop {
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
        if moved == 0 {
            break;
        }
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
        total += moved as u64;
        if pipe.may_grow && total >= BULK_CAPACITY as u64 {
            pipe.grow();
        }
    }
    match shutdown(to.as_raw_fd(), Shutdown::Write) {
        // The peer went already: nothing left to tell it.
        Ok(()) | Err(Errno::ENOTCONN) => Ok(total),
        Err(errno) => Err(errno.into()),
    }
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
        let proxy = tokio::spawn(async move {
            splice_bidirectional(
                &proxy_front,
                &proxy_back,
                Pipe::new().unwrap(),
                Pipe::new().unwrap(),
            )
            .await
        });
        // More than one pipe's worth, in odd-sized writes.
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
        assert_eq!(proxy.await.unwrap().unwrap(), (1_000_003, 4));
    }
}
