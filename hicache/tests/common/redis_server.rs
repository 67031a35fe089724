//! A `redis-server` started by a test: the one helper the Redis tests of `radixkv-hicache`
//! and `radixkv-scheduler-api` share (the latter includes this file by its path in the
//! repository). Only `std`: it starts `redis-server` from `PATH` on 127.0.0.1 without
//! persistence, waits until it answers `PING`, and kills and reaps it on drop.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Whether `redis-server` is on `PATH` and runs.
pub fn have_redis_server() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
}

/// A `redis-server` this test started; killed (and reaped) on drop.
pub struct Server {
    child: Option<Child>,
    port: u16,
}

impl Server {
    /// A server on a free port, answering `PING`.
    pub fn start() -> Server {
        // Another test may take the port between the probe and the start: try others.
        for _ in 0..5 {
            let mut s = Server {
                child: None,
                port: free_port(),
            };
            if s.try_restart() {
                return s;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The running server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// Starts the server on its port again and waits until it answers `PING`.
    pub fn restart(&mut self) {
        assert!(
            self.try_restart(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    fn try_restart(&mut self) -> bool {
        assert!(self.child.is_none(), "the server is already running");
        let child = spawn_redis(self.port, &[]);
        self.child = wait_ready(child, self.port);
        self.child.is_some()
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `sig` (as `kill` takes it: `-STOP`, `-CONT`) to the server.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} failed");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `redis-server` on 127.0.0.1:`port` without persistence, with `extra` arguments.
pub fn spawn_redis(port: u16, extra: &[&std::ffi::OsStr]) -> Child {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--protected-mode", "no", "--loglevel", "warning"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server")
}

/// `child` once it answers `PING` on `port`; `None` (reaped) if it exited first (the port was
/// taken) or never answered.
pub fn wait_ready(mut child: Child, port: u16) -> Option<Child> {
    for _ in 0..400 {
        if child.try_wait().ok().flatten().is_some() {
            return None;
        }
        if ping(port) {
            return Some(child);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Whether a server on `port` answers `PING` with `+PONG`.
pub fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}
