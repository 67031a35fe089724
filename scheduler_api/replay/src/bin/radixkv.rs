//! `radixkv`: replays a workload through the reference scheduler and a `KvCacheManager`, and
//! reports hit ratios, recomputation, transfers and simulated latency.
//!
//! `radixkv` (or `radixkv demo`) runs the built-in synthetic multi-turn chat workload;
//! `radixkv replay --trace FILE --format mooncake|weka|azure` replays a trace file;
//! `radixkv analyze --trace FILE --format ... [--capacity-tokens N ...] [--json]` analyses one
//! offline (ideal hit ratio, block reuse, conversation structure, bounds for any policy);
//! `radixkv config [--example]` prints the effective manager configuration as TOML, or a
//! commented example of every key.
//! Each command takes only its own flags; `--help` on each lists them with their defaults and
//! valid values.

use std::ffi::OsStr;
use std::fmt::Display;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::builder::{PossibleValue, TypedValueParser};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, Parser, Subcommand};
use indicatif::{HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle};
use radixkv_radix::PolicyKind;
use radixkv_replay::sim::{
    self, Arrivals, CompareOutcome, CostModel, PageHashMode, Progress, Report, ReportFile,
    SimConfig, fmt_bytes, fmt_count, fmt_pool,
};
use radixkv_replay::trace::{self, ReadOptions, SyntheticChat, Trace, TraceFormat};
use radixkv_replay::{analysis, plot};
use radixkv_scheduler_api::config::{Eviction, MambaPolicyKind, ModelGeometry, Pools, Preset};
use radixkv_scheduler_api::{
    CacheKind, HostTier, ManagerConfig, ManagerError, PrefetchStopPolicy, Result, SessionBudget,
    StorageBackendKind, StorageTier, WritePolicy,
};

#[derive(Parser, Debug)]
#[command(
    name = "radixkv",
    version,
    about = "Replay LLM serving workloads through the radixkv KV cache manager",
    after_help = "Without a command, runs `demo` with the options above.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    demo: DemoArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the built-in synthetic multi-turn chat workload (the default).
    Demo(DemoArgs),
    /// Replay a trace file.
    ///
    /// The report's manager CPU per request is the replay thread's CPU time inside the
    /// manager's calls: the calls are timed with the monotonic clock and the time the thread
    /// waited for a core, which its CPU clock gives once a step, is taken out ("thread clock";
    /// where the platform has no thread CPU clock, wall-clock time: "wall clock").
    Replay {
        #[command(flatten)]
        input: TraceArgs,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Analyse a trace offline for capacity planning: the infinite-cache ideal, block reuse,
    /// conversation structure, and LRU / Belady / oracle / shipped-policy hit ratios per
    /// capacity.
    Analyze {
        #[command(flatten)]
        input: TraceArgs,
        #[arg(long = "capacity-tokens", value_name = "TOKENS", help = with_default(
            "Cache capacity to simulate, in tokens (repeatable)",
            analysis::DEFAULT_CAPACITIES.map(|c| c.to_string()).join(" ")))]
        capacity_tokens: Vec<u64>,
        /// Print the analysis as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Print a manager configuration as TOML: the effective one (defaults, then --config, then
    /// the flags), or with --example a commented example naming every key.
    Config {
        /// Print the commented example configuration (every key, its default and valid values).
        #[arg(long, conflicts_with_all = ["config", "model", "mamba_bytes", "swa_bytes", "mamba_policy", "device_tokens", "page_size",
            "total_bytes", "mamba_full_memory_ratio", "split_running",
            "policy", "cache", "host_tokens", "write_policy", "host_policy", "session_tokens",
            "storage", "storage_tokens"])]
        example: bool,
        #[command(flatten)]
        manager: ManagerArgs,
    },
}

/// The synthetic chat workload and the replay flags.
#[derive(Args, Debug, Clone)]
struct DemoArgs {
    /// Conversations to generate (at least 1; a workload that could take more than 256 MiB is
    /// refused).
    #[arg(long, default_value_t = SyntheticChat::default().conversations)]
    conversations: u32,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = SyntheticChat::default().seed)]
    seed: u64,
    #[command(flatten)]
    run: RunArgs,
}

/// Where a trace file is and how much of it to read.
#[derive(Args, Debug, Clone)]
struct TraceArgs {
    /// The trace file (`.gz` is decompressed).
    #[arg(long)]
    trace: PathBuf,
    /// The trace's format (weka: agentic multi-turn, gzip'd JSONL).
    #[arg(long, value_parser = Named {
        what: "trace format",
        shown: vec!["mooncake", "weka", "azure"],
        parse: |s| TraceFormat::from_name(s).ok(),
    })]
    format: TraceFormat,
    /// Read at most this many requests (conversations for weka) [default: all]
    #[arg(long)]
    limit: Option<usize>,
    /// Keep only the first this many requests (by arrival) [default: all]
    #[arg(long)]
    max_requests: Option<usize>,
    #[arg(long, value_name = "SECONDS", help = with_default(
        "Mean gap between conversation starts for weka traces (seconds); giving it replays that \
         timing as is (no --load default)",
        ReadOptions::default().conversation_gap_s))]
    conversation_gap_s: Option<f64>,
    /// Seed of the arrival process of weka conversations.
    #[arg(long, default_value_t = ReadOptions::default().seed)]
    seed: u64,
}

/// The cache kind of `--cache`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum CacheFlag {
    Disabled,
    Radix,
    HiCache,
}

/// A flag's value parsed by `parse`, with `shown` listed as its valid values in `--help` and in
/// the error for any other value.
#[derive(Clone)]
struct Named<T> {
    /// What the value names, for the error: `unknown {what} "x"; known: ...`.
    what: &'static str,
    shown: Vec<&'static str>,
    parse: fn(&str) -> Option<T>,
}

impl<T: Clone + Send + Sync + 'static> TypedValueParser for Named<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> std::result::Result<T, clap::Error> {
        let flag = arg.map_or_else(|| "a value".to_string(), |a| a.to_string());
        let s = value.to_str().ok_or_else(|| {
            clap::Error::raw(ErrorKind::InvalidUtf8, format!("{flag}: not UTF-8\n")).with_cmd(cmd)
        })?;
        (self.parse)(s).ok_or_else(|| {
            let (what, known) = (self.what, self.shown.join(", "));
            clap::Error::raw(
                ErrorKind::InvalidValue,
                format!("{flag}: unknown {what} {s:?}; known: {known}\n"),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(self.shown.iter().map(|&n| PossibleValue::new(n))))
    }
}

fn policy_parser(what: &'static str) -> Named<PolicyKind> {
    Named {
        what,
        shown: PolicyKind::ALL.map(PolicyKind::name).to_vec(),
        parse: PolicyKind::from_name,
    }
}

fn page_hash_parser() -> Named<PageHashMode> {
    Named {
        what: "page-hash mode",
        shown: PageHashMode::ALL.map(PageHashMode::name).to_vec(),
        parse: PageHashMode::from_name,
    }
}

fn cache_parser() -> Named<CacheFlag> {
    Named {
        what: "cache kind",
        shown: vec!["disabled", "radix", "hicache"],
        parse: |s| match s {
            "disabled" => Some(CacheFlag::Disabled),
            "radix" => Some(CacheFlag::Radix),
            "hicache" => Some(CacheFlag::HiCache),
            _ => None,
        },
    }
}

fn model_parser() -> Named<Preset> {
    Named {
        what: "model preset",
        shown: Preset::ALL.map(Preset::name).to_vec(),
        parse: Preset::from_name,
    }
}

fn mamba_policy_parser() -> Named<MambaPolicyKind> {
    Named {
        what: "Mamba policy",
        shown: MambaPolicyKind::ALL.map(MambaPolicyKind::name).to_vec(),
        parse: MambaPolicyKind::from_name,
    }
}

fn write_policy_parser() -> Named<WritePolicy> {
    Named {
        what: "write policy",
        shown: vec!["write_through", "write_through_selective[:N]", "write_back"],
        parse: WritePolicy::from_name,
    }
}

/// `text [default: value]`, as clap writes a default.
fn with_default(text: &str, value: impl Display) -> String {
    format!("{text} [default: {value}]")
}

/// The flags that make the manager's configuration (`demo`, `replay` and `config`). Each is
/// optional: one not given keeps the `--config` file's value, or the default shown in `--help`
/// without a file.
#[derive(Args, Debug, Clone, Default)]
struct ManagerArgs {
    /// Manager configuration file (TOML, or JSON by extension); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model geometry preset; replaces the --config file's model section, keeping its page size.
    /// jamba-like (Mamba layers) and gemma-like (sliding-window layers) run on every cache kind
    /// (disabled, radix, hicache), with or without sessions [default: the --config file's
    /// model, else dense]
    #[arg(long, value_parser = model_parser())]
    model: Option<Preset>,
    /// Bytes of the Mamba state slot pool (models with Mamba layers; `[pools] mamba_bytes`)
    /// [default: the full-attention pool's bytes]
    #[arg(long, value_name = "BYTES")]
    mamba_bytes: Option<u64>,
    /// Total device bytes of the KV pool and the Mamba state pool together, split by the
    /// Mamba policy's rule (models with Mamba layers and no sliding-window layers; `[pools]
    /// total_bytes`; replaces --device-tokens and --mamba-bytes): sglang by
    /// --mamba-full-memory-ratio, marconi with 4 state slots per running request
    /// (--split-running, else --max-running in demo and replay, else max_rows)
    #[arg(long, value_name = "BYTES", conflicts_with_all = ["device_tokens", "mamba_bytes"])]
    total_bytes: Option<u64>,
    /// The sglang split's state bytes over KV bytes (`[pools] mamba_full_memory_ratio`)
    /// [default: 0.9, SGLang's]
    #[arg(long, value_name = "R", requires = "total_bytes")]
    mamba_full_memory_ratio: Option<f64>,
    /// Running requests the marconi split provisions state slots for (`[pools]
    /// running_requests`) [default: --max-running in demo and replay, else max_rows]
    #[arg(long, value_name = "N", requires = "total_bytes")]
    split_running: Option<usize>,
    /// Bytes of the sliding-window KV pool (models with sliding-window layers; `[pools]
    /// swa_bytes`) [default: the full-attention pool's bytes]
    #[arg(long, value_name = "BYTES")]
    swa_bytes: Option<u64>,
    /// How Mamba states are admitted and evicted (models with Mamba layers; `mamba_policy`):
    /// marconi (branch-point and prompt-end checkpoints, FLOPs-per-byte eviction) or sglang
    /// (request-end checkpoints, LRU) [default: the --config file's, else marconi]
    #[arg(long, value_parser = mamba_policy_parser())]
    mamba_policy: Option<MambaPolicyKind>,
    #[arg(long, value_name = "TOKENS",
        help = with_default("Device KV pool in tokens (the full-attention KV pool)", ManagerConfig::default().device_tokens))]
    device_tokens: Option<usize>,
    #[arg(long, value_name = "TOKENS",
        help = with_default("Tokens per KV page", ModelGeometry::default().page_size))]
    page_size: Option<usize>,
    #[arg(long, value_parser = policy_parser("eviction policy"),
        help = with_default("Eviction policy of the device tier", Eviction::default().0.name()))]
    policy: Option<PolicyKind>,
    #[arg(long, value_parser = cache_parser(),
        help = with_default("Cache kind (hicache adds a host tier)", "radix, or hicache with --host-tokens"))]
    cache: Option<CacheFlag>,
    /// Host tier in tokens (implies --cache hicache). HostSim copies a tiny simulated
    /// geometry; reported bytes are modeled [default with --cache hicache: 4× the device pool]
    #[arg(long, value_name = "TOKENS")]
    host_tokens: Option<usize>,
    #[arg(long, value_parser = write_policy_parser(),
        help = with_default("When the host tier gets a copy of device pages", HostTier::ratio(0, 0.0).write_policy))]
    write_policy: Option<WritePolicy>,
    /// Eviction policy of the host tier [default: the device tier's --policy]
    #[arg(long, value_parser = policy_parser("host eviction policy"))]
    host_policy: Option<PolicyKind>,
    /// Enable streaming sessions holding at most this many tokens [default: no sessions]
    #[arg(long, value_name = "TOKENS")]
    session_tokens: Option<usize>,
    /// Storage tier (L3) under the host tier (implies --cache hicache): file:DIR (segment files
    /// in DIR, kept after the run: a second replay over DIR starts with a warm store),
    /// memory, or redis://HOST:PORT (a Redis server). Host KV is backed up to it; a request
    /// whose prefix is stored waits for its prefetch (stop policy wait_complete) and takes it
    /// as a host hit [default: the --config file's [cache.storage], else none]
    #[arg(long, value_name = "SPEC")]
    storage: Option<String>,
    /// Capacity of the storage tier in tokens (file and memory stores; least recently used
    /// pages are evicted past it) [default: no cap]
    #[arg(long, value_name = "TOKENS")]
    storage_tokens: Option<usize>,
}

/// The model id a replay keys its stored pages with (with the modeled and simulated KV
/// geometry, which the manager adds).
const REPLAY_MODEL_ID: &str = "radixkv-replay";

/// The backend `--storage SPEC` names.
fn storage_backend(spec: &str, capacity_tokens: Option<usize>) -> Result<StorageBackendKind> {
    let bad = |m: String| Err(ManagerError::Config(m));
    if let Some(dir) = spec.strip_prefix("file:") {
        if dir.is_empty() {
            return bad("--storage file:DIR needs a directory".into());
        }
        Ok(StorageBackendKind::File {
            dir: dir.into(),
            capacity_tokens,
            sync: Default::default(),
        })
    } else if spec == "memory" {
        Ok(StorageBackendKind::Memory { capacity_tokens })
    } else if spec.starts_with("redis://") {
        if capacity_tokens.is_some() {
            return bad(
                "--storage-tokens applies to file and memory stores: a Redis server's capacity \
                 is its maxmemory"
                    .into(),
            );
        }
        Ok(StorageBackendKind::Redis {
            url: spec.into(),
            cluster: false,
            key_prefix: "radixkv:".into(),
        })
    } else {
        bad(format!(
            "--storage {spec:?}: expected file:DIR, memory or redis://HOST:PORT"
        ))
    }
}

/// The flags of a replay (`demo` and `replay`): the manager's, the scheduler's and the
/// output's. Each is optional, as in [`ManagerArgs`].
#[derive(Args, Debug, Clone, Default)]
struct RunArgs {
    #[command(flatten)]
    manager: ManagerArgs,
    #[arg(long, value_name = "N",
        help = with_default("Maximum running requests (the decode batch)", SimConfig::default().max_running))]
    max_running: Option<usize>,
    #[arg(long, value_name = "TOKENS",
        help = with_default("Prefill tokens per step (chunk size)", SimConfig::default().prefill_budget))]
    prefill_budget: Option<usize>,
    #[arg(long, value_name = "GB/S",
        help = with_default("Host↔device bandwidth in GB/s", CostModel::default().transfer_gbps))]
    bandwidth_gbps: Option<f64>,
    #[arg(long, value_name = "GB/S",
        help = with_default("Storage→host read bandwidth of the storage tier in GB/s (a local \
            NVMe SSD; charged in full, before the step, to the step that admits a storage hit)",
            CostModel::default().storage_gbps))]
    storage_gbps: Option<f64>,
    /// Spread the conversations' starts (each keeps its own turn timing) so that the simulated
    /// GPU's busiest minutes are this busy: the busier of compute and KV memory, estimated from
    /// the trace with ideal hits (the report shows the load measured too). 0.7 keeps the server
    /// busy without a queue that grows for hours [default: 0.7 for weka traces without
    /// --conversation-gap-s, whose conversation starts are synthetic; else the workload's own
    /// timing]
    #[arg(long, value_name = "LOAD", conflicts_with = "arrival_scale")]
    load: Option<f64>,
    /// Spread the conversations' starts by this factor instead (> 1: further apart; 1: the
    /// workload's own timing, e.g. to measure a weka trace under saturation)
    #[arg(long, value_name = "FACTOR")]
    arrival_scale: Option<f64>,
    /// How the prompts carry match hashes, as an engine hands them over: `off` (every match
    /// compares tokens), `whole` (each prompt hashed when admitted) or `conversation` (hashes
    /// kept per conversation, a turn hashes its new pages only; the kept hashes are held to
    /// the pools' bookkeeping in bytes, least recently used forgotten first; prompts outside a
    /// conversation carry none). Hashing is timed as the engine's work, apart from the
    /// manager's CPU [default: conversation]
    #[arg(long, value_name = "MODE", value_parser = page_hash_parser())]
    page_hashes: Option<PageHashMode>,
    /// Running requests keep their whole prompts. By default a running request keeps only
    /// the prompt tokens past its cached prefix wherever the cache allows (radix or hicache,
    /// sessions or not, without Mamba or sliding-window layers): the tree holds the rest
    #[arg(long)]
    keep_running_prompts: bool,
    /// Run every configuration (no cache, each eviction policy, + sessions, HiCache under each
    /// write policy, HiCache + sessions; with Mamba layers, the radix row under the other Mamba
    /// policy too) on the same workload and print one table.
    #[arg(long)]
    compare: bool,
    /// Write report.json and plots (SVG + PNG) into this directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Print the report as JSON on stdout (the same document as report.json).
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Audit every invariant of the manager and its cache every N scheduler steps; a violation
    /// fails the run [default: only at the end]
    #[arg(long, value_name = "N")]
    check_invariants_every: Option<u64>,
    /// Fail the run as soon as the resident memory has grown by more than this many MiB since
    /// warm-up (a quarter of the requests done), or by the end of the replay [default: no
    /// limit]
    #[arg(long, value_name = "MIB")]
    max_rss_growth_mib: Option<u64>,
}

/// A hint after clap's error when a replay flag was given to `analyze`.
fn analyze_hint(e: &clap::Error) -> Option<String> {
    let analyze = std::env::args_os().nth(1).is_some_and(|a| a == "analyze");
    if e.kind() != ErrorKind::UnknownArgument || !analyze {
        return None;
    }
    let Some(ContextValue::String(flag)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let name = flag
        .split('=')
        .next()
        .unwrap_or(flag)
        .trim_start_matches('-');
    RunArgs::augment_args(clap::Command::new("run"))
        .get_arguments()
        .any(|a| a.get_long() == Some(name))
        .then(|| {
            format!(
                "radixkv: --{name} applies to replays (demo, replay), not to analyze \
                 (analyze takes --capacity-tokens)"
            )
        })
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Opening and closing spans are logged too: `RUST_LOG=radixkv_scheduler_api=debug`
        // shows each request's and each step's span with its fields and duration.
        .with_span_events(
            tracing_subscriber::fmt::format::FmtSpan::NEW
                | tracing_subscriber::fmt::format::FmtSpan::CLOSE,
        )
        .try_init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            if let Some(hint) = analyze_hint(&e) {
                eprintln!("{hint}");
            }
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
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

impl TraceArgs {
    fn read_options(&self) -> Result<ReadOptions> {
        Ok(ReadOptions {
            limit: self.limit,
            max_requests: at_least_one("--max-requests", self.max_requests)?,
            seed: self.seed,
            conversation_gap_s: gap(self
                .conversation_gap_s
                .unwrap_or(ReadOptions::default().conversation_gap_s))?,
        })
    }
}

fn run(cli: Cli) -> Result<()> {
    // Whether the user set the workload's timing (a weka replay then keeps it).
    let mut own_timing = false;
    let (workload, run) = match cli.cmd {
        Some(Cmd::Analyze {
            input,
            capacity_tokens,
            json,
        }) => {
            let opts = input.read_options()?;
            return analyze(&input.trace, input.format, &capacity_tokens, &opts, json);
        }
        Some(Cmd::Config { example, manager }) => {
            if example {
                print!("{}", radixkv_scheduler_api::config::EXAMPLE_TOML);
            } else {
                let m = manager_config(&manager, None)?;
                let text =
                    toml::to_string(&m).map_err(|e| ManagerError::Config(format!("TOML: {e}")))?;
                print!("{text}");
                print!("{}", pools_comment(&m.pools()?));
            }
            return Ok(());
        }
        None => (demo(&cli.demo)?, cli.demo.run),
        Some(Cmd::Demo(d)) => (demo(&d)?, d.run),
        Some(Cmd::Replay { input, run }) => {
            let opts = input.read_options()?;
            own_timing = input.conversation_gap_s.is_some();
            let w = Workload::File {
                path: input.trace,
                format: input.format,
                opts,
            };
            (w, run)
        }
    };
    let mut cfg = sim_config(&run)?;
    if run.compare && matches!(&cfg.manager.cache, CacheKind::HiCache(t) if t.storage.is_some()) {
        // Its rows are built configurations of their own, none with a storage tier: the tier
        // would be silently left out.
        return Err(ManagerError::Config(
            "--compare has no storage-tier rows: replay a storage tier on its own (drop \
             --compare, or --storage and the config's [cache.storage])"
                .into(),
        ));
    }
    if matches!(
        workload,
        Workload::File {
            format: TraceFormat::Weka,
            ..
        }
    ) && run.load.is_none()
        && run.arrival_scale.is_none()
        && !own_timing
    {
        // The agentic traces' conversation starts are made up (a Poisson process), and at any
        // gap short enough to finish in reasonable simulated time the server saturates: the
        // default aims for a sustainable load instead.
        cfg.arrivals = Arrivals::Load(DEFAULT_AGENTIC_LOAD);
    }
    // Everything that can be checked is checked before the workload is read and replayed: a
    // long replay must not end in an error about its output directory.
    if let Some(dir) = &run.out {
        prepare_out(dir)?;
    }
    let trace = workload.load()?;
    eprintln!(
        "radixkv: {} requests, {} prompt tokens from {}",
        fmt_count(trace.requests.len() as u64),
        fmt_count(trace.prompt_tokens()),
        trace.name
    );
    let reports = if run.compare {
        compare(trace, &cfg, &run)?
    } else {
        let mut bar = bar(trace.requests.len() as u64, &cfg.manager.label(), run.quiet);
        // Given, not lent: a retimed replay then holds one copy of the trace, not two.
        let r = sim::replay(trace, &cfg, &mut bar)?;
        drop(bar);
        if !run.json {
            println!("{r}");
        }
        vec![r]
    };
    let file = ReportFile::new(reports);
    if run.json {
        println!("{}", to_json(&file)?);
    }
    if let Some(dir) = &run.out {
        write_out(dir, &file)?;
        eprintln!("radixkv: wrote report.json and plots to {}", dir.display());
    }
    file.runs.iter().try_for_each(leak_check)
}

/// The device pools a configuration derives, as TOML comments after `radixkv config`'s
/// output.
fn pools_comment(p: &Pools) -> String {
    let paged = |what: &str, pool: &radixkv_scheduler_api::config::PagedPool| {
        format!(
            "#   {what}: {} pages, {} tokens, {} per token, {} per page, {}\n",
            fmt_count(pool.pages),
            fmt_count(pool.tokens),
            fmt_bytes(pool.bytes_per_token),
            fmt_bytes(pool.page_bytes),
            fmt_bytes(pool.bytes)
        )
    };
    let mut s = String::from("\n# Device pools derived from [model], device_tokens and [pools]:\n");
    s += &paged("full-attention KV", &p.full);
    if let (Some(swa), Some(w)) = (&p.swa, p.sliding_window) {
        s += &paged(&format!("sliding-window KV (window {w} tokens)"), swa);
    }
    if let Some(m) = &p.mamba {
        s += &format!(
            "#   Mamba states: {} slots of {}, {}\n",
            fmt_count(m.slots),
            fmt_bytes(m.slot_bytes),
            fmt_bytes(m.bytes)
        );
    }
    s += &format!("#   total: {}\n", fmt_bytes(p.total_bytes()));
    s
}

/// Fails a run that leaked: pages still held after the drain, sessions still open, or
/// accounting that does not balance.
fn leak_check(r: &Report) -> Result<()> {
    let slots = r.mamba.map_or(0, |m| m.leaked_slots);
    let swa_pages = r.swa.map_or(0, |s| s.leaked_pages);
    if r.leaked_tokens == 0
        && slots == 0
        && swa_pages == 0
        && r.open_sessions_at_end == 0
        && r.accounting_balanced
    {
        return Ok(());
    }
    Err(ManagerError::Invariant(radixkv_radix::InvariantViolation(
        format!(
            "{}: leak check failed: {} tokens, {slots} Mamba slots and {swa_pages} SWA pages \
             still held, {} sessions open, accounting {}",
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
    format: TraceFormat,
    capacities: &[u64],
    opts: &ReadOptions,
    json: bool,
) -> Result<()> {
    let capacities = if capacities.is_empty() {
        &analysis::DEFAULT_CAPACITIES[..]
    } else {
        capacities
    };
    let trace = trace::read_trace(path, format, opts)?;
    let a = analysis::analyze(&trace, capacities)?;
    if json {
        println!("{}", to_json(&a)?);
    } else {
        print!("{a}");
    }
    Ok(())
}

/// The synthetic chat workload of `radixkv demo`, checked (not generated yet).
fn demo(d: &DemoArgs) -> Result<Workload> {
    let chat = SyntheticChat {
        conversations: d.conversations,
        seed: d.seed,
        ..Default::default()
    };
    chat.validate().map_err(|e| match e {
        ManagerError::Config(m) => {
            ManagerError::Config(format!("--conversations {}: {m}", d.conversations))
        }
        e => e,
    })?;
    Ok(Workload::Synthetic(chat))
}

/// The target load of a weka replay that names neither `--load` nor `--arrival-scale`.
const DEFAULT_AGENTIC_LOAD: f64 = 0.7;

fn sim_config(run: &RunArgs) -> Result<SimConfig> {
    let running = run.max_running.unwrap_or(SimConfig::default().max_running);
    let m = manager_config(&run.manager, Some(running))?;
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
    if let Some(b) = run.storage_gbps {
        if !b.is_finite() || b <= 0.0 {
            return Err(ManagerError::Config(
                "--storage-gbps must be positive".into(),
            ));
        }
        cfg.cost.storage_gbps = b;
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
    if let Some(m) = run.page_hashes {
        cfg.page_hashes = m;
    }
    cfg.keep_running_prompts = run.keep_running_prompts;
    if cfg.manager.release_cached_prompts {
        return Err(ManagerError::Config(
            "release_cached_prompts in --config: the replay releases running prompts wherever \
             the cache allows, and --keep-running-prompts turns that off"
                .into(),
        ));
    }
    cfg.arrivals = match (run.load, run.arrival_scale) {
        (Some(l), _) => Arrivals::Load(l),
        (None, Some(s)) => Arrivals::Scale(s),
        (None, None) => Arrivals::Trace,
    };
    cfg.arrivals
        .validate()
        .map_err(|e| ManagerError::Config(format!("--load / --arrival-scale: {e}")))?;
    if cfg.max_running == 0 || cfg.prefill_budget == 0 {
        return Err(ManagerError::Config(
            "--max-running and --prefill-budget must be positive".into(),
        ));
    }
    Ok(cfg)
}

/// The manager configuration the flags describe: the `--config` file (or the defaults), then
/// each flag given over it, validated. `running` is the scheduler's running batch (demo and
/// replay): the Marconi split of a total budget provisions it unless the split names its own.
fn manager_config(run: &ManagerArgs, running: Option<usize>) -> Result<ManagerConfig> {
    let mut m = match &run.config {
        Some(p) => ManagerConfig::from_file(p)?,
        None => ManagerConfig::default(),
    };
    if let Some(preset) = run.model {
        m.model = ModelGeometry {
            page_size: m.model.page_size,
            ..preset.geometry()
        };
    }
    if let Some(n) = run.device_tokens {
        m.device_tokens = n;
    }
    if let Some(b) = run.mamba_bytes {
        m.pools.mamba_bytes = Some(b);
    }
    if let Some(b) = run.swa_bytes {
        m.pools.swa_bytes = Some(b);
    }
    if let Some(p) = run.mamba_policy {
        m.mamba_policy = Some(p);
    }
    if let Some(p) = run.page_size {
        m.model.page_size = p;
    }
    if let Some(p) = run.policy {
        m.eviction = Eviction(p);
    }
    if let Some(b) = run.total_bytes {
        m.pools.total_bytes = Some(b);
    }
    if let Some(r) = run.mamba_full_memory_ratio {
        m.pools.mamba_full_memory_ratio = Some(r);
    }
    if let Some(n) = run.split_running {
        m.pools.running_requests = Some(n);
    }
    if m.pools.total_bytes.is_some() {
        if run.device_tokens.is_some() {
            return Err(ManagerError::Config(
                "--device-tokens and a total budget (pools.total_bytes) are both given: the \
                 split of the total sets the KV pool"
                    .into(),
            ));
        }
        if m.pools.running_requests.is_none()
            && m.mamba_policy_kind() == Some(MambaPolicyKind::Marconi)
        {
            m.pools.running_requests = running;
        }
        // Before the host tier is sized from the device pool.
        m.apply_total_bytes()?;
    }
    match run.cache {
        None => {}
        Some(CacheFlag::Disabled) => m.cache = CacheKind::Disabled,
        Some(CacheFlag::Radix) => m.cache = CacheKind::Radix,
        Some(CacheFlag::HiCache) => {
            m.cache = CacheKind::HiCache(HostTier::ratio(m.device_tokens, 4.0));
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
    if let (Some(w), CacheKind::HiCache(t)) = (&run.write_policy, &mut m.cache) {
        t.write_policy = *w;
    }
    if let Some(p) = run.host_policy {
        match &mut m.cache {
            CacheKind::HiCache(t) => t.eviction = Some(Eviction(p)),
            _ => {
                return Err(ManagerError::Config(
                    "--host-policy needs a host tier (--cache hicache or --host-tokens)".into(),
                ));
            }
        }
    }
    if let Some(spec) = &run.storage {
        let backend = storage_backend(spec, run.storage_tokens)?;
        if !matches!(m.cache, CacheKind::HiCache(_)) {
            m.cache = CacheKind::HiCache(HostTier::ratio(m.device_tokens, 4.0));
        }
        if let CacheKind::HiCache(t) = &mut m.cache {
            match &mut t.storage {
                Some(st) => st.backend = backend,
                None => {
                    t.storage = Some(
                        StorageTier::new(backend, REPLAY_MODEL_ID)
                            .stop(PrefetchStopPolicy::WaitComplete {}),
                    )
                }
            }
        }
    } else if let Some(n) = run.storage_tokens {
        let cap = match &mut m.cache {
            CacheKind::HiCache(HostTier {
                storage: Some(st), ..
            }) => match &mut st.backend {
                StorageBackendKind::File {
                    capacity_tokens, ..
                }
                | StorageBackendKind::Memory { capacity_tokens } => Some(capacity_tokens),
                _ => None,
            },
            _ => None,
        };
        match cap {
            Some(c) => *c = Some(n),
            None => {
                return Err(ManagerError::Config(
                    "--storage-tokens needs a file or memory storage tier (--storage file:DIR \
                     or memory)"
                        .into(),
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
    Ok(m)
}

fn compare(trace: Trace, cfg: &SimConfig, run: &RunArgs) -> Result<Vec<Report>> {
    let configs = sim::compare_configs(&cfg.manager);
    let n = trace.requests.len() as u64;
    let quiet = run.quiet;
    // With --json, stdout holds the JSON document only.
    let table = !run.json;
    let m = &cfg.manager;
    if table {
        let page_bytes = m.model.page_bytes();
        let pool = |tokens: usize| fmt_pool(tokens, m.model.page_size, page_bytes);
        let host = configs.iter().find_map(|c| match &c.cache {
            CacheKind::HiCache(t) => Some(t.host_tokens),
            _ => None,
        });
        println!(
            "pages of {} tokens = {} modeled; device pool {}{}",
            m.model.page_size,
            fmt_bytes(page_bytes),
            pool(m.device_tokens),
            host.map_or(String::new(), |h| format!(
                "; hicache rows add a host pool {}",
                pool(h)
            ))
        );
        println!(
            "{}",
            Report::table_header_for(m.model.layer_counts().mamba > 0)
        );
    }
    // Configurations this build cannot run the model with are said once, grouped by reason,
    // after the table (a hybrid model skips every host-tier and session row).
    let mut skipped: Vec<(String, Vec<String>)> = Vec::new();
    let outcomes = sim::compare(
        trace,
        cfg,
        &configs,
        &mut |m| Box::new(bar(n, &m.label(), quiet)),
        &mut |o| match o {
            CompareOutcome::Ran(r) if table => println!("{}", r.table_row()),
            CompareOutcome::Skipped { config, reason } if table => {
                match skipped.iter_mut().find(|(r, _)| r == reason) {
                    Some((_, configs)) => configs.push(config.clone()),
                    None => skipped.push((reason.clone(), vec![config.clone()])),
                }
            }
            _ => {}
        },
    )?;
    for (reason, configs) in &skipped {
        let names = match configs.as_slice() {
            [one] => one.clone(),
            [first, .., last] => format!("{first} … {last}"),
            [] => String::new(),
        };
        println!("skipped {} ({names}): {reason}", configs.len());
    }
    let reports: Vec<Report> = outcomes
        .into_iter()
        .filter_map(|o| match o {
            CompareOutcome::Ran(r) => Some(*r),
            CompareOutcome::Skipped { .. } => None,
        })
        .collect();
    if table {
        print!("{}", compare_footer(&reports));
    }
    Ok(reports)
}

/// What every row of the comparison shares, said once: the requests, the ideal (one
/// computation for every row), and the output throughput when it is the same everywhere (the
/// arrivals set it, not the cache); then what the columns mean.
fn compare_footer(reports: &[Report]) -> String {
    let Some(first) = reports.first() else {
        return String::new();
    };
    let range = |f: &dyn Fn(&Report) -> String| {
        let lo = reports.iter().map(f).min().unwrap_or_default();
        let hi = reports.iter().map(f).max().unwrap_or_default();
        if lo == hi {
            lo
        } else {
            format!("{lo} to {hi}")
        }
    };
    let ideal = range(&|r| format!("{:.4}", r.ideal_hit_ratio));
    let tok_s = reports
        .iter()
        .map(|r| r.throughput_tok_s)
        .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let throughput = if format!("{:.0}", tok_s.0) == format!("{:.0}", tok_s.1) {
        format!("{:.0} output tok/s in every configuration", tok_s.1)
    } else {
        format!("{:.0} to {:.0} output tok/s", tok_s.0, tok_s.1)
    };
    format!(
        "every row: {} requests; ideal (infinite cache) token hit ratio {ideal}; {throughput}\n\
         /ideal = hit / ideal; host, xfer: - without a host tier; xfer = modeled bytes loaded + \
         written; cpu µs/r = cache-manager CPU per request ({} clock){}\n",
        fmt_count(first.requests),
        first.cache_cpu_clock,
        if first.mamba.is_some() {
            "\nhit = usable hit (up to the deepest cached Mamba state); kv match = how far the KV \
             matched; saved = share of the prompts' prefill FLOPs the hits saved"
        } else {
            ""
        }
    )
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

fn write_out(dir: &Path, file: &ReportFile) -> Result<()> {
    let io = |e: std::io::Error| ManagerError::Io {
        path: dir.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("report.json"), to_json(file)?).map_err(io)?;
    let refs: Vec<&Report> = file.runs.iter().collect();
    for (name, chart) in plot::report_charts(&refs) {
        plot::write_chart(dir, name, &chart)?;
    }
    Ok(())
}

/// A progress bar on stderr, hidden when stderr is not a terminal or `--quiet` is given.
struct Bar {
    bar: ProgressBar,
    /// When the first request finished, and the count then: the pace is measured from there,
    /// so the replay's set-up (the ideal's pass over the trace) does not inflate the ETA.
    first: Option<(Instant, u64)>,
    /// The ETA last shown.
    eta: String,
}

impl Progress for Bar {
    fn advance(&mut self, n: u64) {
        self.bar.inc(n);
        let pos = self.bar.position();
        let len = self.bar.length().unwrap_or(0);
        let (t0, p0) = *self.first.get_or_insert((Instant::now(), pos));
        let eta = eta(
            pos.saturating_sub(p0),
            len.saturating_sub(pos),
            len,
            t0.elapsed(),
        );
        if eta != self.eta {
            self.bar.set_message(eta.clone());
            self.eta = eta;
        }
    }
}

impl Drop for Bar {
    /// A finished or abandoned replay leaves no bar behind.
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The time left for `left` of `len` requests at the pace of the last `done` in `elapsed`,
/// once that pace says something: at least 1% of the requests and a second (before that the
/// first estimates would be wild).
fn eta(done: u64, left: u64, len: u64, elapsed: Duration) -> String {
    if done == 0 || done.saturating_mul(100) < len || elapsed < Duration::from_secs(1) {
        return "ETA -".into();
    }
    let secs = elapsed.as_secs_f64() * left as f64 / done as f64;
    format!("ETA {:#}", HumanDuration(Duration::from_secs_f64(secs)))
}

/// The bar's layout: the configuration's name cut to 30 columns, the bar filling what the
/// terminal has left, the count and the ETA. It fits any terminal of 80 columns or more.
const TEMPLATE: &str = "{prefix:30!} [{wide_bar}] {pos}/{len} {msg}";

fn bar(len: u64, label: &str, quiet: bool) -> Bar {
    let target = if quiet || !std::io::stderr().is_terminal() {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    bar_on(len, label, target)
}

fn bar_on(len: u64, label: &str, target: ProgressDrawTarget) -> Bar {
    let eta = eta(0, len, len, Duration::ZERO);
    let mut bar = ProgressBar::with_draw_target(Some(len), target)
        .with_prefix(label.to_string())
        .with_message(eta.clone());
    if let Ok(style) = ProgressStyle::with_template(TEMPLATE) {
        bar = bar.with_style(style.progress_chars("=> "));
    }
    Bar {
        bar,
        first: None,
        eta,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// An 80-column terminal that records what is written to it.
    #[derive(Debug, Clone, Default)]
    struct Term80(Arc<Mutex<Vec<String>>>);

    impl indicatif::TermLike for Term80 {
        fn width(&self) -> u16 {
            80
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if !s.is_empty() {
                self.0
                    .lock()
                    .map_err(|_| std::io::ErrorKind::Other)?
                    .push(s.into());
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_progress_bar_fits_80_columns_and_hides_its_first_eta() {
        let term = Term80::default();
        // The longest label a comparison prints, and a trace of a million requests.
        let label = "hicache-lru/reuse-wts2+host4M+sessions";
        let mut b = bar_on(
            1_000_000,
            label,
            ProgressDrawTarget::term_like(Box::new(term.clone())),
        );
        b.bar.tick();
        b.advance(1);
        b.advance(499_999);
        b.bar.tick();
        let lines = term.0.lock().unwrap().clone();
        assert!(!lines.is_empty());
        for l in &lines {
            assert!(
                l.chars().count() <= 80,
                "{} columns: {l:?}",
                l.chars().count()
            );
            assert!(l.contains("/1000000"), "{l:?}");
        }
        // Fresh, the bar shows no estimate (the run is a few microseconds old).
        assert!(lines[0].ends_with("ETA -"), "{:?}", lines[0]);
        assert!(lines[0].starts_with(&label[..30]), "{:?}", lines[0]);
    }

    #[test]
    fn the_eta_waits_for_a_percent_and_a_second_then_extrapolates() {
        let s = Duration::from_secs;
        assert_eq!(eta(0, 100, 100, s(10)), "ETA -");
        assert_eq!(eta(5, 995, 1000, s(10)), "ETA -");
        assert_eq!(eta(50, 50, 100, Duration::from_millis(200)), "ETA -");
        assert_eq!(eta(50, 50, 100, s(60)), "ETA 60s");
        assert_eq!(eta(25, 75, 100, s(60)), "ETA 3m");
        // The pace since the first finish: 20 more done in 10 s, 40 left.
        assert_eq!(eta(20, 40, 100, s(10)), "ETA 20s");
    }
}
