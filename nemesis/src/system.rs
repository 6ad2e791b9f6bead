//! The processes of the system: the examples (`payments`, `ledger`, `relay`) run as real
//! processes, started again after a kill, with their stderr in a log file of the run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::history::{Event, Recorder};

/// Where the example binaries are: `--bin-dir`, else `examples/` beside this binary (both are
/// built into `target/<profile>/`).
pub(crate) fn examples_dir(given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(dir) = given {
        return Ok(dir.to_owned());
    }
    let exe = std::env::current_exe().map_err(|e| format!("this binary's path: {e}"))?;
    let dir = exe
        .parent()
        .map(|profile| profile.join("examples"))
        .ok_or("this binary has no directory")?;
    Ok(dir)
}

/// An example run as a process of the system: started, killed, started again with the same
/// settings (the same port).
pub(crate) struct Proc {
    pub(crate) name: String,
    program: PathBuf,
    env: Vec<(String, String)>,
    /// The start of the line on stdout that says it is ready.
    ready: &'static str,
    log: PathBuf,
    child: Option<Child>,
    /// The port it listens on (`PORT`), the same after every start.
    pub(crate) port: Option<String>,
}

impl Proc {
    pub(crate) fn new(
        name: &str,
        program: PathBuf,
        env: Vec<(String, String)>,
        ready: &'static str,
        logs: &Path,
    ) -> Proc {
        Proc {
            name: name.to_owned(),
            program,
            env,
            ready,
            log: logs.join(format!("{name}.log")),
            child: None,
            port: None,
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// `http://127.0.0.1:PORT`, for a server.
    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port.as_deref().unwrap_or("0"))
    }

    /// Starts it and waits for its ready line. A process that exits first (an example exits
    /// when its store or database is unreachable at start) is started again, until `within`.
    pub(crate) async fn start(
        &mut self,
        recorder: &Recorder,
        within: Duration,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match self.start_once(recorder).await {
                Ok(()) => return Ok(()),
                Err(error) if tokio::time::Instant::now() >= deadline => {
                    return Err(format!(
                        "{} did not start within {within:?}: {error}",
                        self.name
                    ));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    async fn start_once(&mut self, recorder: &Recorder) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let mut child = Command::new(&self.program)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{}: {e}", self.program.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        match ready {
            Ok(Ok(Some(line))) if line.starts_with(self.ready) => {}
            other => {
                let _ = child.start_kill();
                let status = child.wait().await.ok();
                return Err(format!("{other:?}, then {status:?}"));
            }
        }
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        if let Some(pid) = child.id() {
            recorder.record(Event::Spawn {
                t: recorder.now(),
                process: self.name.clone(),
                pid,
            });
        }
        self.child = Some(child);
        Ok(())
    }

    /// `SIGKILL`, and waits for the process to be gone.
    pub(crate) async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// `SIGTERM`, and waits up to 15 s for it to stop (then `SIGKILL`).
    pub(crate) async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            idempotent_test_kit::process::signal(pid, "TERM");
        }
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}
