//! Whether the real-cluster tests can run is known when they are built: `TANDEM_K3S` (and
//! `TANDEM_KUBE_PROXY`) set enable them; unset, they are compiled `#[ignore]`d, so that the
//! test summary reports them as ignored (skipped) rather than as passed.

fn main() {
    for (var, cfg) in [
        ("TANDEM_K3S", "tandem_k3s"),
        ("TANDEM_KUBE_PROXY", "tandem_kube_proxy"),
    ] {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        println!("cargo::rerun-if-env-changed={var}");
        if std::env::var_os(var).is_some_and(|value| !value.is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}
