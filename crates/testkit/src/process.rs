//! A service binary under test, run as a child process: its stderr collected line by line, its
//! stdout read to the end, real signals sent to it.

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// A running child process and what it printed.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    stdout: Option<JoinHandle<String>>,
}

impl ChildProcess {
    /// Spawns `command` with piped stdout and stderr; the process is killed if this is dropped
    /// while it still runs.
    ///
    /// # Panics
    /// When the process cannot be spawned.
    pub fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the service under test");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&stderr);
        let pipe = child.stderr.take().expect("stderr");
        tokio::spawn(async move {
            let mut reader = BufReader::new(pipe).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                lines.lock().unwrap().push(line);
            }
        });
        let mut out = child.stdout.take().expect("stdout");
        let stdout = tokio::spawn(async move {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text).await;
            text
        });
        Self {
            child,
            stderr,
            stdout: Some(stdout),
        }
    }

    /// Everything it printed on stderr so far.
    ///
    /// # Panics
    /// When the collecting task panicked.
    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits for a stderr line containing `needle` and returns it.
    ///
    /// # Panics
    /// When no such line comes within `timeout`; the message holds the stderr so far.
    pub async fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self
                .stderr
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return line.clone();
            }
            assert!(
                start.elapsed() < timeout,
                "no stderr line with {needle:?}; got:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Sends the signal `name` (`TERM`, `INT`, `KILL`...) with `kill`.
    ///
    /// # Panics
    /// When the process has exited or `kill` fails.
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{name} {pid}");
    }

    /// Its exit status, if it has exited; does not wait.
    ///
    /// # Panics
    /// When its status cannot be read.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("child status")
    }

    /// Waits for the process to exit; returns its status and how long the wait took.
    ///
    /// # Panics
    /// When it does not exit within `timeout`; the message holds its stderr.
    pub async fn exit(&mut self, timeout: Duration) -> (ExitStatus, Duration) {
        let start = Instant::now();
        let status = tokio::time::timeout(timeout, self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "service did not exit within {timeout:?}; stderr:\n{}",
                    self.log()
                )
            })
            .expect("wait");
        (status, start.elapsed())
    }

    /// Everything it printed on stdout, once it has exited; taken once.
    ///
    /// # Panics
    /// When taken twice.
    pub async fn stdout(&mut self) -> String {
        self.stdout
            .take()
            .expect("stdout taken once")
            .await
            .expect("stdout reader")
    }
}
