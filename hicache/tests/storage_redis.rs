//! `RedisStore` against a real Redis server.
//!
//! Where the server comes from:
//! - `RADIXKV_REDIS_URL` (e.g. `redis://127.0.0.1:6379`): the tests that only read and write
//!   use that server, each under its own key prefix, and delete what they wrote;
//! - otherwise `redis-server` from `PATH`, started per test on a free 127.0.0.1 port without
//!   persistence (`--save "" --appendonly no`) and killed when the test ends. The tests that
//!   kill, restart or stop the server always start their own, so they need `redis-server`;
//!   so do the Redis Cluster tests, which start three cluster-mode servers and join them with
//!   `redis-cli --cluster create` (`redis-cli` ships with `redis-server`).
//!
//! Without either (or without the `redis` feature), the tests that need a server return at
//! once and `redis_tests_ran_or_skipped` says so (run it with `--nocapture` to read why); under
//! `CI=true` it fails instead, so CI never skips them silently.

#[path = "common/redis_server.rs"]
mod redis_server;
#[cfg(feature = "redis")]
#[path = "common/storage.rs"]
mod storage_suite;

use redis_server::have_redis_server;

const URL_VAR: &str = "RADIXKV_REDIS_URL";

#[test]
fn redis_tests_ran_or_skipped() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let url = std::env::var(URL_VAR).ok().filter(|u| !u.is_empty());
    let spawn = have_redis_server();
    let mut skipped = Vec::new();
    if !cfg!(feature = "redis") {
        skipped.push(
            "every Redis test: radixkv-hicache was built without its `redis` feature".to_owned(),
        );
    } else {
        if url.is_none() && !spawn {
            skipped.push(format!(
                "the read/write tests: neither {URL_VAR} is set nor redis-server is on PATH"
            ));
        }
        if !spawn {
            skipped.push(
                "the kill/restart, SIGSTOP and cluster tests: they start their own servers \
                 and redis-server is not on PATH"
                    .to_owned(),
            );
        }
    }
    if skipped.is_empty() {
        let source = match &url {
            Some(u) => format!("{URL_VAR}={u} (read/write tests) and redis-server from PATH"),
            None => "redis-server from PATH, one server per test".to_owned(),
        };
        println!("redis tests: all ran, against {source}");
        return;
    }
    for s in &skipped {
        println!("redis tests SKIPPED: {s}");
    }
    assert!(
        !ci,
        "CI=true but Redis tests were skipped: {}",
        skipped.join("; ")
    );
}

#[cfg(feature = "redis")]
mod with_redis {
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use radixkv_hicache::storage::{
        PageFormat, RedisConfig, RedisStore, StorageBackend, StoreError,
    };
    use radixkv_hicache::{KvGeometry, PoolName};
    use radixkv_radix::{KeySeed, KvIdentity, Namespace, PageKey};

    use super::URL_VAR;
    use super::redis_server::{Server, free_port, have_redis_server, spawn_redis, wait_ready};
    use super::storage_suite::{Suite, conformance};

    /// Where a read/write test's pages go: the URL's server under a prefix of its own, or a
    /// server of its own.
    struct Target {
        url: String,
        prefix: String,
        _server: Option<Server>,
    }

    fn target(test: &str) -> Option<Target> {
        static N: AtomicU32 = AtomicU32::new(0);
        let prefix = format!(
            "radixkv-test:{test}:{}:{}:",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        if let Some(url) = std::env::var(URL_VAR).ok().filter(|u| !u.is_empty()) {
            return Some(Target {
                url,
                prefix,
                _server: None,
            });
        }
        if !have_redis_server() {
            return None;
        }
        let server = Server::start();
        Some(Target {
            url: server.url(),
            prefix,
            _server: Some(server),
        })
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    }

    fn format() -> PageFormat {
        let g = KvGeometry::new(3, 4, 16).expect("geometry");
        PageFormat::new(g, &identity(), &[(PoolName::Mamba, 40)]).expect("format")
    }

    fn identity() -> KvIdentity {
        KvIdentity::new("test-model@1", "3 layers, 4 tokens/page, 16 B/token/layer")
    }

    /// `n` chained keys of namespace `ns` and their encoded pages (KV bytes a function of the
    /// page index; every other page carries a Mamba section).
    fn pages(ns: &str, n: usize) -> Vec<(PageKey, Vec<u8>)> {
        let f = format();
        let tokens: Vec<u32> = (0..(n * 4) as u32).collect();
        let keys = KeySeed::new(&Namespace::new(ns), &identity()).chain(&tokens, 4);
        keys.into_iter()
            .enumerate()
            .map(|(i, k)| {
                let kv: Vec<u8> = (0..f.kv_bytes()).map(|j| (i * 31 + j * 7) as u8).collect();
                let mamba = vec![i as u8; 40];
                let sections: &[(PoolName, &[u8])] = if i % 2 == 0 {
                    &[(PoolName::Mamba, &mamba)]
                } else {
                    &[]
                };
                let mut out = Vec::new();
                f.encode(&k, &kv, sections, &mut out).expect("encode");
                (k, out)
            })
            .collect()
    }

    fn keys_of(p: &[(PageKey, Vec<u8>)]) -> Vec<PageKey> {
        p.iter().map(|(k, _)| *k).collect()
    }

    #[test]
    fn round_trip_of_encoded_pages_is_byte_exact() {
        let Some(t) = target("roundtrip") else { return };
        rt().block_on(async {
            let s = RedisStore::connect(RedisConfig::new(&t.url).with_key_prefix(&t.prefix))
                .await
                .expect("connect");
            assert_eq!(s.name(), "redis");
            let p = pages("tenant-a", 20);
            let keys = keys_of(&p);
            assert_eq!(s.put(&p).await.unwrap(), vec![true; 20]);
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 20);
            let got = s.get(&keys).await.unwrap();
            let f = format();
            for ((k, want), got) in p.iter().zip(&got) {
                let got = got.as_ref().expect("stored page");
                assert_eq!(got, want, "page bytes differ");
                f.decode(k, got).expect("a stored page decodes");
            }
            // A key never written is a miss in place, not a shifted answer.
            let missing = pages("tenant-zzz", 1)[0].0;
            let got = s.get(&[keys[0], missing, keys[1]]).await.unwrap();
            assert_eq!(got[0].as_ref(), Some(&p[0].1));
            assert_eq!(got[1], None);
            assert_eq!(got[2].as_ref(), Some(&p[1].1));
            let st = s.stats();
            let bytes: u64 = p.iter().map(|(_, b)| b.len() as u64).sum();
            assert_eq!((st.put_pages, st.put_bytes), (20, bytes));
            assert_eq!((st.get_pages, st.get_hits, st.errors), (23, 22, 0));
            assert_eq!((st.pages, st.bytes), (0, 0), "not tracked: see the docs");
            assert_eq!(s.count_pages().await.unwrap(), 20);
            assert_eq!(s.delete(&keys).await.unwrap(), 20);
            assert_eq!(s.count_pages().await.unwrap(), 0);
        });
    }

    /// The suite every store passes. The server may be shared: sizes are not exact, and a
    /// Redis store has no cap of its own.
    fn shared_suite(seed: u64) -> Suite {
        Suite {
            seed,
            exact_sizes: false,
            exact_lru: false,
        }
    }

    #[test]
    fn the_store_conformance_suite_on_one_server() {
        let Some(t) = target("conformance") else {
            return;
        };
        rt().block_on(async {
            // Pipelines smaller than the suite's batches, and the default.
            for max_batch in [5, 128] {
                let s = RedisStore::connect(
                    RedisConfig::new(&t.url)
                        .with_key_prefix(format!("{}{max_batch}:", t.prefix))
                        .with_max_batch(max_batch),
                )
                .await
                .expect("connect");
                conformance(&s, &shared_suite(max_batch as u64)).await;
                assert_eq!(s.count_pages().await.unwrap(), 0, "the suite cleans up");
                assert_eq!(s.stats().errors, 0);
            }
        });
    }

    #[test]
    fn exists_prefix_stops_at_the_first_gap() {
        let Some(t) = target("prefix") else { return };
        rt().block_on(async {
            let p = pages("tenant-a", 9);
            let keys = keys_of(&p);
            // Pipelines of 1, 2, 3 (a gap at a pipeline's edge and inside one) and more
            // than the batch.
            for max_batch in [1, 2, 3, 100] {
                let cfg = RedisConfig::new(&t.url)
                    .with_key_prefix(format!("{}{max_batch}:", t.prefix))
                    .with_max_batch(max_batch);
                let s = RedisStore::connect(cfg).await.expect("connect");
                // Everything but page 6.
                let stored: Vec<_> = p
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != 6)
                    .map(|(_, x)| x.clone())
                    .collect();
                s.put(&stored).await.unwrap();
                assert_eq!(s.exists_prefix(&keys).await.unwrap(), 6, "{max_batch}");
                assert_eq!(s.exists_prefix(&keys[..6]).await.unwrap(), 6);
                assert_eq!(s.exists_prefix(&keys[7..]).await.unwrap(), 2);
                assert_eq!(s.exists_prefix(&keys[6..]).await.unwrap(), 0);
                assert_eq!(s.exists_prefix(&[]).await.unwrap(), 0);
                // A gap at the front hides everything after it.
                assert_eq!(s.delete(&keys[..1]).await.unwrap(), 1);
                assert_eq!(s.exists_prefix(&keys).await.unwrap(), 0);
                assert_eq!(s.exists_prefix(&keys[1..]).await.unwrap(), 5);
                // Deleting pages that are not stored counts only those that were.
                assert_eq!(s.delete(&keys).await.unwrap(), 7);
                assert_eq!(s.count_pages().await.unwrap(), 0);
            }
        });
    }

    #[test]
    fn key_prefixes_isolate_caches() {
        let Some(t) = target("isolation") else { return };
        rt().block_on(async {
            let a = RedisStore::connect(
                RedisConfig::new(&t.url).with_key_prefix(format!("{}a:", t.prefix)),
            )
            .await
            .expect("connect");
            let b = RedisStore::connect(
                RedisConfig::new(&t.url).with_key_prefix(format!("{}b:", t.prefix)),
            )
            .await
            .expect("connect");
            let p = pages("tenant-a", 3);
            let keys = keys_of(&p);
            // The same page keys, other bytes, in b.
            let other: Vec<_> = p
                .iter()
                .map(|(k, v)| (*k, v.iter().map(|x| x ^ 0xff).collect()))
                .collect();
            a.put(&p).await.unwrap();
            assert_eq!(b.exists_prefix(&keys).await.unwrap(), 0, "b sees none of a");
            assert_eq!(b.get(&keys).await.unwrap(), vec![None; 3]);
            b.put(&other).await.unwrap();
            let ga = a.get(&keys).await.unwrap();
            let gb = b.get(&keys).await.unwrap();
            for i in 0..3 {
                assert_eq!(ga[i].as_ref(), Some(&p[i].1));
                assert_eq!(gb[i].as_ref(), Some(&other[i].1));
            }
            assert_eq!(a.delete(&keys).await.unwrap(), 3);
            assert_eq!(
                b.exists_prefix(&keys).await.unwrap(),
                3,
                "a's delete spared b"
            );
            assert_eq!(
                (a.count_pages().await, b.count_pages().await),
                (Ok(0), Ok(3))
            );
            // The namespace is in the key itself: another tenant's chain shares no key.
            let q = pages("tenant-b", 3);
            assert_eq!(b.exists_prefix(&keys_of(&q)).await.unwrap(), 0);
            b.delete(&keys).await.unwrap();
        });
    }

    #[test]
    fn batches_larger_than_a_pipeline() {
        let Some(t) = target("batches") else { return };
        rt().block_on(async {
            let s = RedisStore::connect(
                RedisConfig::new(&t.url)
                    .with_key_prefix(&t.prefix)
                    .with_max_batch(7),
            )
            .await
            .expect("connect");
            let p = pages("tenant-a", 100);
            let keys = keys_of(&p);
            assert_eq!(s.put(&p).await.unwrap(), vec![true; 100]);
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 100);
            let got = s.get(&keys).await.unwrap();
            assert!(got.iter().zip(&p).all(|(g, (_, w))| g.as_ref() == Some(w)));
            assert_eq!(s.count_pages().await.unwrap(), 100);
            assert_eq!(s.delete(&keys).await.unwrap(), 100);
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 0);
        });
    }

    #[test]
    fn ttl_is_set_only_when_configured() {
        let Some(t) = target("ttl") else { return };
        rt().block_on(async {
            let p = pages("tenant-a", 2);
            let plain = RedisStore::connect(
                RedisConfig::new(&t.url).with_key_prefix(format!("{}plain:", t.prefix)),
            )
            .await
            .expect("connect");
            let ttl = RedisStore::connect(
                RedisConfig::new(&t.url)
                    .with_key_prefix(format!("{}ttl:", t.prefix))
                    .with_ttl(Duration::from_secs(3600)),
            )
            .await
            .expect("connect");
            plain.put(&p).await.unwrap();
            ttl.put(&p).await.unwrap();
            let client = redis::Client::open(t.url.as_str()).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let pttl = |k: String| redis::cmd("PTTL").arg(k).clone();
            let none: i64 = pttl(plain.redis_key(&p[0].0))
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(none, -1, "no TTL without one configured");
            let some: i64 = pttl(ttl.redis_key(&p[1].0))
                .query_async(&mut c)
                .await
                .unwrap();
            assert!(some > 0 && some <= 3_600_000, "PTTL {some}");
            plain.delete(&keys_of(&p)).await.unwrap();
            ttl.delete(&keys_of(&p)).await.unwrap();
        });
    }

    #[test]
    fn nothing_listening_is_unavailable() {
        rt().block_on(async {
            let url = format!("redis://127.0.0.1:{}", free_port());
            let r = RedisStore::connect(RedisConfig::new(url)).await;
            assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        });
    }

    /// Retries `exists_prefix` until the store answers again (the server was restarted or
    /// resumed); panics after many tries.
    async fn until_answers(s: &RedisStore, keys: &[PageKey]) -> usize {
        for _ in 0..200 {
            if let Ok(n) = s.exists_prefix(keys).await {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the store never answered again");
    }

    #[test]
    fn a_killed_server_gives_typed_errors_and_the_store_reconnects_after_restart() {
        if !have_redis_server() {
            return;
        }
        let mut server = Server::start();
        rt().block_on(async {
            let cfg = RedisConfig::new(server.url()).with_op_timeout(Duration::from_secs(10));
            let s = RedisStore::connect(cfg).await.expect("connect");
            let p = pages("tenant-a", 8);
            let keys = keys_of(&p);
            s.put(&p).await.unwrap();
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 8);

            server.kill();
            // The lost connection, then the refused reconnections: Unavailable every time.
            for round in 0..3 {
                let e = s.get(&keys).await.unwrap_err();
                assert!(matches!(e, StoreError::Unavailable(_)), "{round}: {e:?}");
                let e = s.put(&p).await.unwrap_err();
                assert!(matches!(e, StoreError::Unavailable(_)), "{round}: {e:?}");
                let e = s.exists_prefix(&keys).await.unwrap_err();
                assert!(matches!(e, StoreError::Unavailable(_)), "{round}: {e:?}");
                let e = s.delete(&keys).await.unwrap_err();
                assert!(matches!(e, StoreError::Unavailable(_)), "{round}: {e:?}");
            }
            assert_eq!(s.stats().errors, 12);

            server.restart();
            // No persistence: the restarted server is empty, and the same store object works.
            assert_eq!(until_answers(&s, &keys).await, 0);
            assert_eq!(s.put(&p).await.unwrap(), vec![true; 8]);
            let got = s.get(&keys).await.unwrap();
            assert!(got.iter().zip(&p).all(|(g, (_, w))| g.as_ref() == Some(w)));
        });
    }

    #[test]
    fn a_stopped_server_times_out_and_answers_rightly_after_it_resumes() {
        if !have_redis_server() {
            return;
        }
        let server = Server::start();
        rt().block_on(async {
            let cfg = RedisConfig::new(server.url()).with_op_timeout(Duration::from_millis(300));
            let s = RedisStore::connect(cfg).await.expect("connect");
            let p = pages("tenant-a", 6);
            let keys = keys_of(&p);
            s.put(&p[..3]).await.unwrap();

            server.signal("-STOP");
            let r = s.get(&keys).await;
            let w = s.put(&p[3..]).await;
            let x = s.exists_prefix(&keys).await;
            let d = s.delete(&keys[..1]).await;
            server.signal("-CONT");
            assert_eq!(r, Err(StoreError::Timeout));
            assert_eq!(w, Err(StoreError::Timeout));
            assert_eq!(x, Err(StoreError::Timeout));
            assert_eq!(d, Err(StoreError::Timeout));
            assert_eq!(s.stats().errors, 4);

            // The server then runs the requests it had queued (the put of pages 3..6, the
            // delete of page 0); their late answers must not be taken for the answers of
            // later requests.
            until_answers(&s, &keys).await;
            let got = s.get(&keys).await.unwrap();
            for (i, g) in got.iter().enumerate() {
                if let Some(g) = g {
                    assert_eq!(g, &p[i].1, "page {i} is another page's bytes");
                }
            }
            assert_eq!(got[1].as_ref(), Some(&p[1].1));
            assert_eq!(s.exists_prefix(&keys[1..3]).await.unwrap(), 2);
        });
    }

    /// A port that is free, and whose cluster bus port (+10000) is free too.
    fn free_cluster_port() -> u16 {
        for _ in 0..1000 {
            let p = free_port();
            if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
                return p;
            }
        }
        panic!("no free port pair for a cluster node");
    }

    /// Three cluster-mode `redis-server`s (no replicas) joined into one cluster; killed, and
    /// their directory removed, on drop.
    struct Cluster {
        nodes: Vec<Child>,
        ports: Vec<u16>,
        dir: PathBuf,
    }

    impl Cluster {
        fn start() -> Cluster {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "radixkv-redis-cluster-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("cluster directory");
            let mut c = Cluster {
                nodes: Vec::new(),
                ports: Vec::new(),
                dir,
            };
            for _ in 0..15 {
                if c.ports.len() == 3 {
                    break;
                }
                let port = free_cluster_port();
                let conf = format!("nodes-{port}.conf");
                let args: [&std::ffi::OsStr; 6] = [
                    "--cluster-enabled".as_ref(),
                    "yes".as_ref(),
                    "--cluster-config-file".as_ref(),
                    conf.as_ref(),
                    "--dir".as_ref(),
                    c.dir.as_os_str(),
                ];
                if let Some(child) = wait_ready(spawn_redis(port, &args), port) {
                    c.nodes.push(child);
                    c.ports.push(port);
                }
            }
            assert_eq!(
                c.ports.len(),
                3,
                "cluster nodes did not start on 15 free ports"
            );
            let addrs: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
            let out = Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", "0", "--cluster-yes"])
                .stdin(Stdio::null())
                .output()
                .expect("run redis-cli --cluster create");
            assert!(
                out.status.success(),
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            // Every node must see the whole cluster up before the test starts.
            for &p in &c.ports {
                let mut ok = false;
                for _ in 0..400 {
                    let info = Command::new("redis-cli")
                        .args(["-p", &p.to_string(), "cluster", "info"])
                        .output()
                        .expect("redis-cli cluster info");
                    if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                        ok = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(25));
                }
                assert!(ok, "cluster node {p} never reached cluster_state:ok");
            }
            c
        }

        fn urls(&self) -> Vec<String> {
            self.ports
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}"))
                .collect()
        }

        /// Keys stored on node `i` (`DBSIZE`).
        fn dbsize(&self, i: usize) -> u64 {
            let out = Command::new("redis-cli")
                .args(["-p", &self.ports[i].to_string(), "dbsize"])
                .output()
                .expect("redis-cli dbsize");
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .expect("a number")
        }
    }

    impl Drop for Cluster {
        fn drop(&mut self) {
            for c in &mut self.nodes {
                let _ = c.kill();
                let _ = c.wait();
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn a_cluster_store_spreads_pages_over_the_nodes_and_round_trips_them() {
        if !have_redis_server() {
            return;
        }
        let cluster = Cluster::start();
        rt().block_on(async {
            let s = RedisStore::connect(
                RedisConfig::cluster(cluster.urls())
                    .with_key_prefix("radixkv-cluster-test:")
                    .with_max_batch(16),
            )
            .await
            .expect("connect to the cluster");
            let p = pages("tenant-a", 60);
            let keys = keys_of(&p);
            assert_eq!(s.put(&p).await.unwrap(), vec![true; 60]);
            // Pages land on every node: the batches crossed slots and nodes.
            let per_node: Vec<u64> = (0..3).map(|i| cluster.dbsize(i)).collect();
            assert_eq!(per_node.iter().sum::<u64>(), 60, "{per_node:?}");
            assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 60);
            let got = s.get(&keys).await.unwrap();
            let f = format();
            for ((k, want), got) in p.iter().zip(&got) {
                let got = got.as_ref().expect("stored page");
                assert_eq!(got, want);
                f.decode(k, got).expect("decodes");
            }
            // A gap on whichever node holds page 37 stops the prefix there.
            assert_eq!(s.delete(&keys[37..38]).await.unwrap(), 1);
            assert_eq!(s.exists_prefix(&keys).await.unwrap(), 37);
            let got = s.get(&keys[36..39]).await.unwrap();
            assert_eq!(got[0].as_ref(), Some(&p[36].1));
            assert_eq!(got[1], None);
            assert_eq!(got[2].as_ref(), Some(&p[38].1));
            // DEL over keys of every node, split by the client.
            assert_eq!(s.delete(&keys).await.unwrap(), 59);
            assert_eq!((0..3).map(|i| cluster.dbsize(i)).sum::<u64>(), 0);
            assert!(matches!(s.count_pages().await, Err(StoreError::Config(_))));
            assert_eq!(s.stats().errors, 0);
            conformance(&s, &shared_suite(11)).await;
            assert_eq!((0..3).map(|i| cluster.dbsize(i)).sum::<u64>(), 0);
        });
    }

    #[test]
    fn a_single_server_store_on_a_cluster_node_fails_without_wrong_pages() {
        if !have_redis_server() {
            return;
        }
        let cluster = Cluster::start();
        rt().block_on(async {
            let p = pages("tenant-a", 30);
            let keys = keys_of(&p);
            // Write through a cluster store, read through a single-server one on node 0.
            let c = RedisStore::connect(RedisConfig::cluster(cluster.urls()))
                .await
                .expect("connect to the cluster");
            c.put(&p).await.unwrap();
            let single = RedisStore::connect(RedisConfig::new(cluster.urls()[0].clone()))
                .await
                .expect("connect to node 0");
            let e = single.get(&keys).await.unwrap_err();
            assert!(matches!(e, StoreError::Protocol(_)), "{e:?}");
            let e = single.put(&p).await.unwrap_err();
            assert!(matches!(e, StoreError::Protocol(_)), "{e:?}");
            let e = single.exists_prefix(&keys).await.unwrap_err();
            assert!(matches!(e, StoreError::Protocol(_)), "{e:?}");
            let e = single.delete(&keys).await.unwrap_err();
            assert!(matches!(e, StoreError::Protocol(_)), "{e:?}");
            // Nothing was lost or changed by the refused batches.
            assert_eq!(c.exists_prefix(&keys).await.unwrap(), 30);
            let got = c.get(&keys).await.unwrap();
            assert!(got.iter().zip(&p).all(|(g, (_, w))| g.as_ref() == Some(w)));
        });
    }
}
