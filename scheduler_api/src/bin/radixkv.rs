//! `radixkv`: replays a workload through the reference scheduler and a `KvCacheManager`, and
//! reports hit ratios, recomputation, transfers and simulated latency.
//!
//! `radixkv` (or `radixkv demo`) runs the built-in synthetic multi-turn chat workload;
//! `radixkv replay --trace FILE --format mooncake|weka|azure` replays a trace file;
//! `radixkv analyze --trace FILE --format ... [--capacity-tokens N ...] [--json]` analyses one
//! offline (ideal hit ratio, block reuse, conversation structure, bounds for any policy);
//! `radixkv config [--example]` prints the effective manager configuration as TOML, or a
//! commented example of every key.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use radixkv_radix::PolicyKind;
use radixkv_scheduler_api::config::{Eviction, policy_names};
use radixkv_scheduler_api::sim::{self, CompareOutcome, Progress, Report, SimConfig};
use radixkv_scheduler_api::trace::{self, ReadOptions, SyntheticChat, Trace, TraceFormat};
use radixkv_scheduler_api::{
    CacheKind, HostTier, ManagerConfig, ManagerError, Result, SessionBudget, WritePolicy, analysis,
    plot,
};

#[derive(Parser, Debug)]
#[command(
    name = "radixkv",
    version,
    about = "Replay LLM serving workloads through the radixkv KV cache manager"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the built-in synthetic multi-turn chat workload (the default).
    Demo {
        /// Conversations to generate (at least 1; a workload that could take more than
        /// 256 MiB is refused).
        #[arg(long, default_value_t = SyntheticChat::default().conversations)]
        conversations: u32,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Replay a trace file.
    Replay {
        /// The trace file (`.gz` is decompressed).
        #[arg(long)]
        trace: PathBuf,
        /// mooncake | weka (agentic multi-turn) | azure.
        #[arg(long)]
        format: String,
        /// Read at most this many requests (conversations for weka).
        #[arg(long)]
        limit: Option<usize>,
        /// Keep only the first this many requests (by arrival).
        #[arg(long)]
        max_requests: Option<usize>,
        /// Mean gap between conversation starts for weka traces (seconds).
        #[arg(long, default_value_t = 2.0)]
        conversation_gap_s: f64,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Analyse a trace offline for capacity planning: the infinite-cache ideal, block reuse,
    /// conversation structure, and LRU / Belady / oracle / shipped-policy hit ratios per
    /// capacity. Print as JSON with --json.
    Analyze {
        /// The trace file (`.gz` is decompressed).
        #[arg(long)]
        trace: PathBuf,
        /// mooncake | weka (agentic multi-turn) | azure.
        #[arg(long)]
        format: String,
        /// Cache capacity to simulate, in tokens (repeatable; default 1048576 and 5242880).
        #[arg(long = "capacity-tokens")]
        capacity_tokens: Vec<u64>,
        /// Read at most this many requests (conversations for weka).
        #[arg(long)]
        limit: Option<usize>,
        /// Keep only the first this many requests (by arrival).
        #[arg(long)]
        max_requests: Option<usize>,
        /// Mean gap between conversation starts for weka traces (seconds).
        #[arg(long, default_value_t = 2.0)]
        conversation_gap_s: f64,
    },
    /// Print a manager configuration as TOML: the effective one (defaults, then --config,
    /// then the flags), or with --example a commented example naming every key.
    Config {
        /// Print the commented example configuration (every key, its default and valid values).
        #[arg(long)]
        example: bool,
    },
}

#[derive(Args, Debug, Clone, Default)]
struct RunArgs {
    /// Manager configuration file (TOML, or JSON by extension); flags override it.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Device KV pool in tokens.
    #[arg(long, global = true)]
    device_tokens: Option<usize>,
    /// Tokens per page.
    #[arg(long, global = true)]
    page_size: Option<usize>,
    /// Eviction policy.
    #[arg(long, global = true)]
    policy: Option<String>,
    /// disabled | radix | hicache.
    #[arg(long, global = true)]
    cache: Option<String>,
    /// Host tier in tokens (implies --cache hicache; default with --cache hicache: 4× the
    /// device pool). HostSim copies a tiny simulated geometry; reported bytes are modeled.
    #[arg(long, global = true)]
    host_tokens: Option<usize>,
    /// `write_through` | `write_through_selective[:N]` | `write_back`.
    #[arg(long, global = true)]
    write_policy: Option<String>,
    /// Eviction policy of the host tier (default: the device tier's --policy).
    #[arg(long, global = true)]
    host_policy: Option<String>,
    /// Enable sessions holding at most this many tokens.
    #[arg(long, global = true)]
    session_tokens: Option<usize>,
    /// Maximum running requests.
    #[arg(long, global = true)]
    max_running: Option<usize>,
    /// Prefill tokens per step (chunk size).
    #[arg(long, global = true)]
    prefill_budget: Option<usize>,
    /// Host↔device bandwidth in GB/s.
    #[arg(long, global = true)]
    bandwidth_gbps: Option<f64>,
    /// Seed of synthetic workloads and arrival processes.
    #[arg(long, global = true)]
    seed: Option<u64>,
    /// Run every configuration (no cache, each eviction policy, + sessions, HiCache under each
    /// write policy, HiCache + sessions) on the same workload and print one table.
    #[arg(long, global = true)]
    compare: bool,
    /// Write the report(s) as JSON and plots (SVG + PNG) into this directory.
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    /// Print the report as JSON on stdout.
    #[arg(long, global = true)]
    json: bool,
    /// No progress bar.
    #[arg(long, global = true)]
    quiet: bool,
    /// Audit every invariant of the manager and its cache every N scheduler steps; a violation
    /// fails the run.
    #[arg(long, global = true, value_name = "N")]
    check_invariants_every: Option<u64>,
    /// Fail the run as soon as the resident memory has grown by more than this many MiB since
    /// warm-up (a quarter of the requests done), or by the end of the replay.
    #[arg(long, global = true, value_name = "MIB")]
    max_rss_growth_mib: Option<u64>,
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("radixkv: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Where a replay's requests come from, checked before anything runs.
enum Workload {
    /// The built-in synthetic chat.
    Synthetic(SyntheticChat),
    /// A trace file.
    File {
        path: PathBuf,
        format: TraceFormat,
        opts: ReadOptions,
    },
}

impl Workload {
    fn load(self) -> Result<Trace> {
        match self {
            Workload::Synthetic(s) => s.generate(),
            Workload::File { path, format, opts } => trace::read_trace(&path, format, &opts),
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let (workload, run) = match cli.cmd {
        Some(Cmd::Analyze {
            trace,
            format,
            capacity_tokens,
            limit,
            max_requests,
            conversation_gap_s,
        }) => {
            let opts = ReadOptions {
                limit,
                max_requests: at_least_one("--max-requests", max_requests)?,
                seed: cli.run.seed.unwrap_or(7),
                conversation_gap_s: gap(conversation_gap_s)?,
            };
            return analyze(&trace, &format, &capacity_tokens, &opts, &cli.run);
        }
        Some(Cmd::Config { example }) => {
            if example {
                print!("{}", radixkv_scheduler_api::config::EXAMPLE_TOML);
            } else {
                let cfg = sim_config(&cli.run)?;
                let text = toml::to_string(&cfg.manager)
                    .map_err(|e| ManagerError::Config(format!("TOML: {e}")))?;
                print!("{text}");
            }
            return Ok(());
        }
        None => {
            let w = demo(SyntheticChat::default().conversations, &cli.run)?;
            (w, cli.run)
        }
        Some(Cmd::Demo { conversations, run }) => {
            let run = merge(cli.run, run);
            (demo(conversations, &run)?, run)
        }
        Some(Cmd::Replay {
            trace,
            format,
            limit,
            max_requests,
            conversation_gap_s,
            run,
        }) => {
            let run = merge(cli.run, run);
            let format = TraceFormat::from_name(&format)?;
            let opts = ReadOptions {
                limit,
                max_requests: at_least_one("--max-requests", max_requests)?,
                seed: run.seed.unwrap_or(7),
                conversation_gap_s: gap(conversation_gap_s)?,
            };
            let w = Workload::File {
                path: trace,
                format,
                opts,
            };
            (w, run)
        }
    };
    let cfg = sim_config(&run)?;
    // Everything that can be checked is checked before the workload is read and replayed: a
    // long replay must not end in an error about its output directory.
    if let Some(dir) = &run.out {
        prepare_out(dir)?;
    }
    let trace = workload.load()?;
    eprintln!(
        "radixkv: {} requests, {} prompt tokens from {}",
        trace.requests.len(),
        trace.prompt_tokens(),
        trace.name
    );
    let reports = if run.compare {
        compare(&trace, &cfg, &run)?
    } else {
        let mut bar = bar(trace.requests.len() as u64, &cfg.manager.label(), run.quiet);
        let r = sim::replay(&trace, &cfg, &mut bar)?;
        bar.0.finish_and_clear();
        if run.json {
            println!("{}", to_json(&r)?);
        } else {
            println!("{r}");
        }
        vec![r]
    };
    if let Some(dir) = &run.out {
        write_out(dir, &reports)?;
        eprintln!("radixkv: wrote report.json and plots to {}", dir.display());
    }
    reports.iter().try_for_each(leak_check)
}

/// Fails a run that leaked: pages still held after the drain, sessions still open, or
/// accounting that does not balance.
fn leak_check(r: &Report) -> Result<()> {
    if r.leaked_tokens == 0 && r.open_sessions_at_end == 0 && r.accounting_balanced {
        return Ok(());
    }
    Err(ManagerError::Invariant(radixkv_radix::InvariantViolation(
        format!(
            "{}: leak check failed: {} tokens still held, {} sessions open, accounting {}",
            r.config,
            r.leaked_tokens,
            r.open_sessions_at_end,
            if r.accounting_balanced {
                "balanced"
            } else {
                "unbalanced"
            }
        ),
    )))
}

/// Refuses a count of 0 where it would mean an empty workload (the readers would otherwise keep
/// one request, silently).
fn at_least_one(flag: &str, n: Option<usize>) -> Result<Option<usize>> {
    if n == Some(0) {
        return Err(ManagerError::Config(format!(
            "{flag} must be at least 1: an empty workload has nothing to replay"
        )));
    }
    Ok(n)
}

fn gap(conversation_gap_s: f64) -> Result<f64> {
    if !conversation_gap_s.is_finite() || conversation_gap_s < 0.0 {
        return Err(ManagerError::Config(
            "--conversation-gap-s must be a non-negative number".into(),
        ));
    }
    Ok(conversation_gap_s)
}

/// `radixkv analyze`: reads the trace, analyses it, prints text or JSON.
fn analyze(
    path: &Path,
    format: &str,
    capacities: &[u64],
    opts: &ReadOptions,
    run: &RunArgs,
) -> Result<()> {
    // The replay flags are global to every subcommand; none of them means anything here, so
    // refuse them rather than ignore them silently.
    let replay_only = [
        ("--config", run.config.is_some()),
        ("--device-tokens", run.device_tokens.is_some()),
        ("--page-size", run.page_size.is_some()),
        ("--policy", run.policy.is_some()),
        ("--cache", run.cache.is_some()),
        ("--host-tokens", run.host_tokens.is_some()),
        ("--write-policy", run.write_policy.is_some()),
        ("--host-policy", run.host_policy.is_some()),
        ("--session-tokens", run.session_tokens.is_some()),
        ("--max-running", run.max_running.is_some()),
        ("--prefill-budget", run.prefill_budget.is_some()),
        ("--bandwidth-gbps", run.bandwidth_gbps.is_some()),
        ("--compare", run.compare),
        ("--out", run.out.is_some()),
        (
            "--check-invariants-every",
            run.check_invariants_every.is_some(),
        ),
        ("--max-rss-growth-mib", run.max_rss_growth_mib.is_some()),
    ];
    if let Some((flag, _)) = replay_only.iter().find(|(_, set)| *set) {
        return Err(ManagerError::Config(format!(
            "{flag} applies to replays, not to analyze (analyze takes --capacity-tokens)"
        )));
    }
    let format = TraceFormat::from_name(format)?;
    let capacities = if capacities.is_empty() {
        &analysis::DEFAULT_CAPACITIES[..]
    } else {
        capacities
    };
    let trace = trace::read_trace(path, format, opts)?;
    let a = analysis::analyze(&trace, capacities)?;
    if run.json {
        println!("{}", to_json(&a)?);
    } else {
        print!("{a}");
    }
    Ok(())
}

/// The synthetic chat workload of `radixkv demo`, checked (not generated yet).
fn demo(conversations: u32, run: &RunArgs) -> Result<Workload> {
    let chat = SyntheticChat {
        conversations,
        seed: run.seed.unwrap_or(42),
        ..Default::default()
    };
    chat.validate().map_err(|e| match e {
        ManagerError::Config(m) => {
            ManagerError::Config(format!("--conversations {conversations}: {m}"))
        }
        e => e,
    })?;
    Ok(Workload::Synthetic(chat))
}

/// Subcommand flags win over the same flags given before the subcommand.
fn merge(top: RunArgs, sub: RunArgs) -> RunArgs {
    RunArgs {
        config: sub.config.or(top.config),
        device_tokens: sub.device_tokens.or(top.device_tokens),
        page_size: sub.page_size.or(top.page_size),
        policy: sub.policy.or(top.policy),
        cache: sub.cache.or(top.cache),
        host_tokens: sub.host_tokens.or(top.host_tokens),
        write_policy: sub.write_policy.or(top.write_policy),
        host_policy: sub.host_policy.or(top.host_policy),
        session_tokens: sub.session_tokens.or(top.session_tokens),
        max_running: sub.max_running.or(top.max_running),
        prefill_budget: sub.prefill_budget.or(top.prefill_budget),
        bandwidth_gbps: sub.bandwidth_gbps.or(top.bandwidth_gbps),
        seed: sub.seed.or(top.seed),
        compare: sub.compare || top.compare,
        out: sub.out.or(top.out),
        json: sub.json || top.json,
        quiet: sub.quiet || top.quiet,
        check_invariants_every: sub.check_invariants_every.or(top.check_invariants_every),
        max_rss_growth_mib: sub.max_rss_growth_mib.or(top.max_rss_growth_mib),
    }
}

fn sim_config(run: &RunArgs) -> Result<SimConfig> {
    let mut m = match &run.config {
        Some(p) => ManagerConfig::from_file(p)?,
        None => ManagerConfig::default(),
    };
    if let Some(n) = run.device_tokens {
        m.device_tokens = n;
    }
    if let Some(p) = run.page_size {
        m.model.page_size = p;
    }
    if let Some(name) = &run.policy {
        m.eviction = Eviction(PolicyKind::from_name(name).ok_or_else(|| {
            ManagerError::Config(format!(
                "unknown eviction policy {name:?}; known: {}",
                policy_names()
            ))
        })?);
    }
    let write_policy = match &run.write_policy {
        Some(w) => Some(WritePolicy::from_name(w).ok_or_else(|| {
            ManagerError::Config(format!(
                "unknown write policy {w:?}; known: write_through, write_through_selective[:N], write_back"
            ))
        })?),
        None => None,
    };
    match run.cache.as_deref() {
        None => {}
        Some("disabled") => m.cache = CacheKind::Disabled,
        Some("radix") => m.cache = CacheKind::Radix,
        Some("hicache") => {
            m.cache = CacheKind::HiCache(HostTier::ratio(m.device_tokens, 4.0));
        }
        Some(other) => {
            return Err(ManagerError::Config(format!(
                "unknown cache kind {other:?}; known: disabled, radix, hicache"
            )));
        }
    }
    if let Some(h) = run.host_tokens {
        let mut tier = match &m.cache {
            CacheKind::HiCache(t) => t.clone(),
            _ => HostTier::ratio(0, 0.0),
        };
        tier.host_tokens = h;
        m.cache = CacheKind::HiCache(tier);
    }
    if let (Some(w), CacheKind::HiCache(t)) = (write_policy, &mut m.cache) {
        t.write_policy = w;
    }
    if let Some(name) = &run.host_policy {
        let p = PolicyKind::from_name(name).ok_or_else(|| {
            ManagerError::Config(format!(
                "unknown host eviction policy {name:?}; known: {}",
                policy_names()
            ))
        })?;
        match &mut m.cache {
            CacheKind::HiCache(t) => t.eviction = Some(Eviction(p)),
            _ => {
                return Err(ManagerError::Config(
                    "--host-policy needs a host tier (--cache hicache or --host-tokens)".into(),
                ));
            }
        }
    }
    if let Some(s) = run.session_tokens {
        m.sessions = Some(SessionBudget {
            max_held_tokens: s,
            ..Default::default()
        });
    }
    m.validate()?;
    let mut cfg = SimConfig {
        manager: m,
        ..Default::default()
    };
    cfg.cost.layers = cfg.manager.model.layers;
    if let Some(n) = run.max_running {
        if n > u32::MAX as usize {
            return Err(ManagerError::Config(format!(
                "--max-running must be at most {} (one request-pool row each)",
                u32::MAX
            )));
        }
        cfg.max_running = n;
        cfg.manager.max_rows = cfg.manager.max_rows.max(n);
    }
    if let Some(n) = run.prefill_budget {
        cfg.prefill_budget = n;
    }
    if let Some(b) = run.bandwidth_gbps {
        if !b.is_finite() || b <= 0.0 {
            return Err(ManagerError::Config(
                "--bandwidth-gbps must be positive".into(),
            ));
        }
        cfg.cost.transfer_gbps = b;
    }
    if let Some(n) = run.check_invariants_every {
        if n == 0 {
            return Err(ManagerError::Config(
                "--check-invariants-every must be positive".into(),
            ));
        }
        cfg.check_invariants_every = n;
    }
    cfg.max_rss_growth_mib = run.max_rss_growth_mib;
    if cfg.max_running == 0 || cfg.prefill_budget == 0 {
        return Err(ManagerError::Config(
            "--max-running and --prefill-budget must be positive".into(),
        ));
    }
    Ok(cfg)
}

fn compare(trace: &Trace, cfg: &SimConfig, run: &RunArgs) -> Result<Vec<Report>> {
    let configs = sim::compare_configs(&cfg.manager);
    let n = trace.requests.len() as u64;
    let quiet = run.quiet;
    println!("{}", Report::table_header());
    let outcomes = sim::compare(
        trace,
        cfg,
        &configs,
        &mut |m| Box::new(bar(n, &m.label(), quiet)),
        &mut |o| match o {
            CompareOutcome::Ran(r) => println!("{}", r.table_row()),
            CompareOutcome::Skipped { config, reason } => {
                println!("{config:<34} skipped: {reason}");
            }
        },
    )?;
    let reports: Vec<Report> = outcomes
        .into_iter()
        .filter_map(|o| match o {
            CompareOutcome::Ran(r) => Some(*r),
            CompareOutcome::Skipped { .. } => None,
        })
        .collect();
    if let Some(r) = reports.first() {
        println!(
            "ideal (infinite cache) token hit ratio {:.4}; xfer = modeled bytes loaded + written; \
             cache-manager CPU in µs per request",
            r.ideal_hit_ratio
        );
    }
    if run.json {
        println!("{}", to_json(&reports)?);
    }
    Ok(reports)
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|e| ManagerError::Config(format!("JSON: {e}")))
}

/// Creates `dir` and checks that a file can be written into it.
fn prepare_out(dir: &Path) -> Result<()> {
    let io = |e: std::io::Error| ManagerError::Io {
        path: dir.display().to_string(),
        message: format!("--out is not a writable directory: {e}"),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let probe = dir.join(".radixkv-write-check");
    std::fs::write(&probe, b"").map_err(io)?;
    std::fs::remove_file(&probe).map_err(io)
}

fn write_out(dir: &Path, reports: &[Report]) -> Result<()> {
    let io = |e: std::io::Error| ManagerError::Io {
        path: dir.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let json = match reports {
        [r] => to_json(r)?,
        rs => to_json(&rs)?,
    };
    std::fs::write(dir.join("report.json"), json).map_err(io)?;
    let refs: Vec<&Report> = reports.iter().collect();
    for (name, chart) in plot::report_charts(&refs) {
        plot::write_chart(dir, name, &chart)?;
    }
    Ok(())
}

/// A progress bar on stderr, hidden when stderr is not a terminal or `--quiet` is given.
struct Bar(ProgressBar);

impl Progress for Bar {
    fn advance(&mut self, n: u64) {
        self.0.inc(n);
    }
}

fn bar(len: u64, label: &str, quiet: bool) -> Bar {
    if quiet || !std::io::stderr().is_terminal() {
        return Bar(ProgressBar::hidden());
    }
    let b = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>20} [{bar:40}] {pos}/{len} requests ({eta})")
    {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_prefix(label.to_string());
    Bar(b)
}
