//! Do: the programs the data plane drives (`ip`, `nft`), run without blocking the runtime.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Stdio;

use tracing::debug;

use crate::error::{CommandError, DeviceError};

#[derive(Debug, Clone)]
pub(crate) struct Program {
    program: PathBuf,
}

impl Program {
    pub fn new(program: PathBuf) -> Self {
        Self { program }
    }

    /// Runs `PROGRAM ARGS`; its standard output on success.
    pub async fn run(&self, args: &[String]) -> Result<String, CommandError> {
        self.run_with_input(args, "").await
    }

    /// Runs `PROGRAM ARGS` with `input` on its standard input; its standard output on
    /// success.
    pub async fn run_with_input(
        &self,
        args: &[String],
        input: &str,
    ) -> Result<String, CommandError> {
        let command = format!("{} {}", self.program.display(), args.join(" "));
        debug!(%command, "running");
        let spawn_error = |source| CommandError::Spawn {
            command: command.clone(),
            source,
        };
        let mut child = tokio::process::Command::new(&self.program)
            .args(args)
            .stdin(if input.is_empty() {
                Stdio::null()
            } else {
                Stdio::piped()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(spawn_error)?;
        let stdin = child.stdin.take();
        // Written while the output is read, so that neither side waits on a full pipe;
        // dropped after writing, so that the program reads to its end. A program that
        // stops reading early says why on its standard error.
        let feed = async move {
            if let Some(mut stdin) = stdin {
                let _ = tokio::io::AsyncWriteExt::write_all(&mut stdin, input.as_bytes()).await;
            }
        };
        let ((), output) = tokio::join!(feed, child.wait_with_output());
        let output = output.map_err(spawn_error)?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(CommandError::Failed {
                command,
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            })
        }
    }
}

/// The `ip` program's flag for the family of `ip`: `-4` or `-6`.
pub(crate) fn family_flag(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "-4" } else { "-6" }
}

/// `ip` as a host prefix: `/32` or `/128`.
pub(crate) fn host_prefix(ip: IpAddr) -> String {
    let len = if ip.is_ipv4() { 32 } else { 128 };
    format!("{ip}/{len}")
}

/// `ip` arguments that make `vip` a local host address on `device` (idempotent). An IPv6
/// one skips duplicate address detection (`nodad`): until DAD ends the address is
/// tentative and binding the listeners to it fails.
pub(crate) fn add_address_args(vip: IpAddr, device: &str) -> Vec<String> {
    let mut args: Vec<String> = [family_flag(vip), "address", "replace"]
        .map(str::to_owned)
        .to_vec();
    args.extend([host_prefix(vip), "dev".to_owned(), device.to_owned()]);
    if vip.is_ipv6() {
        args.push("nodad".to_owned());
    }
    args
}

pub(crate) fn delete_address_args(vip: IpAddr, device: &str) -> Vec<String> {
    vec![
        family_flag(vip).to_owned(),
        "address".to_owned(),
        "delete".to_owned(),
        host_prefix(vip),
        "dev".to_owned(),
        device.to_owned(),
    ]
}

/// Whether a failed delete failed only because the thing is already gone (a nexthop
/// object: `No such file or directory`).
pub(crate) fn already_gone(error: &CommandError) -> bool {
    let stderr = error.stderr();
    stderr.contains("No such process")
        || stderr.contains("Cannot assign requested address")
        || stderr.contains("No such file or directory")
}

/// `ip` arguments asking which way `gateway` is reached.
pub(crate) fn route_get_args(gateway: IpAddr) -> Vec<String> {
    [family_flag(gateway), "route", "get", &gateway.to_string()]
        .map(str::to_owned)
        .to_vec()
}

/// The value after `key` among the tokens of a line of `ip` output.
pub(crate) fn value_of<'a>(tokens: &[&'a str], key: &str) -> Option<&'a str> {
    tokens
        .windows(2)
        .find(|pair| pair[0] == key)
        .map(|pair| pair[1])
}

/// The device in `ip route get` output.
pub(crate) fn parse_route_device(output: &str) -> Option<String> {
    let tokens: Vec<&str> = output.split_whitespace().collect();
    value_of(&tokens, "dev").map(str::to_owned)
}

/// The device `gateway` is reached on (a nexthop object or a route in a table of its own
/// needs it).
pub(crate) async fn device_towards(ip: &Program, gateway: IpAddr) -> Result<String, DeviceError> {
    let output = ip.run(&route_get_args(gateway)).await?;
    parse_route_device(&output).ok_or(DeviceError::NoDevice { gateway, output })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_args() {
        let vip: IpAddr = "198.51.100.7".parse().unwrap();
        assert_eq!(
            add_address_args(vip, "lo").join(" "),
            "-4 address replace 198.51.100.7/32 dev lo"
        );
        assert_eq!(
            delete_address_args(vip, "edge0").join(" "),
            "-4 address delete 198.51.100.7/32 dev edge0"
        );
        let vip6: IpAddr = "2001:db8:51:100::7".parse().unwrap();
        assert_eq!(
            add_address_args(vip6, "lo").join(" "),
            "-6 address replace 2001:db8:51:100::7/128 dev lo nodad"
        );
        assert_eq!(
            delete_address_args(vip6, "lo").join(" "),
            "-6 address delete 2001:db8:51:100::7/128 dev lo"
        );
    }

    #[test]
    fn gone_is_recognised_from_stderr() {
        let failed = |stderr: &str| CommandError::Failed {
            command: "ip".to_owned(),
            status: "exit status: 2".to_owned(),
            stderr: stderr.to_owned(),
        };
        assert!(already_gone(&failed("RTNETLINK answers: No such process")));
        assert!(already_gone(&failed(
            "RTNETLINK answers: Cannot assign requested address"
        )));
        assert!(already_gone(&failed(
            "RTNETLINK answers: No such file or directory"
        )));
        assert!(!already_gone(&failed(
            "RTNETLINK answers: Operation not permitted"
        )));
    }

    #[tokio::test]
    async fn failures_carry_stderr_and_missing_programs_are_spawn_errors() {
        let ip = Program::new(PathBuf::from("ip"));
        let error = ip
            .run(&["route".to_owned(), "frobnicate".to_owned()])
            .await
            .unwrap_err();
        assert!(matches!(&error, CommandError::Failed { stderr, .. } if !stderr.is_empty()));
        let missing = Program::new(PathBuf::from("/nonexistent/ip"));
        let error = missing.run(&[]).await.unwrap_err();
        assert!(matches!(error, CommandError::Spawn { .. }));
    }
}
