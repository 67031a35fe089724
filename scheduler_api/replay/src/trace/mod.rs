//! Workloads: trace readers and the built-in synthetic chat generator.
//!
//! Public traces carry no text, only hash ids of fixed-size token blocks. A reader turns every
//! block id into a deterministic pseudo-random token run ([`block_tokens`]), so equal ids give
//! equal tokens and the cache sees real token sequences with exactly the trace's sharing. A
//! partial last block is a prefix of its block's run. Traces whose ids are local to one
//! conversation get an id offset per conversation, so ids never alias across conversations.
//!
//! A prompt is stored as a few [`Segment`]s (runs of consecutive block ids), not as tokens:
//! tokens are generated when the request is admitted.

mod azure;
mod mooncake;
mod synthetic;
mod weka;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use radixkv_radix::{Namespace, PageHasher, PageHashes, TokenId};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

use radixkv_scheduler_api::error::{ManagerError, Result};
use radixkv_scheduler_api::{TokenSource, TokenSourceError};

pub use synthetic::SyntheticChat;

/// Tags keep the id spaces of the different token sources apart.
const TAG_SHIFT: u32 = 56;
/// Ids of output tokens.
pub(crate) const TAG_OUTPUT: u64 = 1 << TAG_SHIFT;
/// Ids of per-request unique tails (tokens not covered by any hash block).
pub(crate) const TAG_TAIL: u64 = 2 << TAG_SHIFT;
/// Ids of the synthetic generator's blocks.
pub(crate) const TAG_SYNTH: u64 = 3 << TAG_SHIFT;

/// A run of `len` tokens made of consecutive blocks `first, first + 1, ...` of `block` tokens
/// each (the last one possibly partial).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Id of the first block.
    pub first: u64,
    /// Tokens per block.
    pub block: u32,
    /// Tokens in the segment.
    pub len: u64,
}

impl Segment {
    /// Appends the segment's tokens to `out`.
    pub fn append_tokens(&self, out: &mut Vec<TokenId>) {
        let mut left = self.len;
        let mut id = self.first;
        while left > 0 {
            let n = left.min(u64::from(self.block));
            block_tokens(id, n as usize, out);
            left -= n;
            id = id.wrapping_add(1);
        }
    }
}

/// Appends the first `n` tokens of block `id`'s deterministic run to `out`.
pub fn block_tokens(id: u64, n: usize, out: &mut Vec<TokenId>) {
    // A SplitMix64 stream seeded by the id: two tokens per draw.
    let mut rng = SplitMix64::seed_from_u64(id ^ 0x5851_f42d_4c95_7f2d);
    out.reserve(n);
    for _ in 0..n / 2 {
        let z = rng.next_u64();
        out.push(z as u32);
        out.push((z >> 32) as u32);
    }
    if n % 2 == 1 {
        out.push(rng.next_u64() as u32);
    }
}

/// Builds a segment list from a block-id list: consecutive ids merge into one segment.
pub(crate) fn segments_from_blocks(ids: &[u64], block: u32, len: u64, out: &mut Vec<Segment>) {
    let mut left = len;
    let mut i = 0;
    while i < ids.len() && left > 0 {
        let mut j = i + 1;
        while j < ids.len() && ids[j] == ids[j - 1].wrapping_add(1) {
            j += 1;
        }
        let n = (((j - i) as u64) * u64::from(block)).min(left);
        out.push(Segment {
            first: ids[i],
            block,
            len: n,
        });
        left -= n;
        i = j;
    }
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time in microseconds since the start of the workload.
    pub arrival_us: u64,
    /// The prompt as segments.
    pub prompt: Vec<Segment>,
    /// Prompt length in tokens.
    pub prompt_len: u64,
    /// Output tokens to generate (at least 1).
    pub output_len: u32,
    /// Output tokens are block `output_id`'s run.
    pub output_id: u64,
    /// The conversation (session) this request belongs to, if the workload has them.
    pub session: Option<u64>,
}

impl TraceRequest {
    /// The prompt tokens.
    pub fn prompt_tokens(&self) -> Vec<TokenId> {
        self.prompt_tokens_with_room(0)
    }

    /// The prompt tokens in a vector with room for `extra` more (the decoded tokens), so
    /// appending them never reallocates.
    pub fn prompt_tokens_with_room(&self, extra: usize) -> Vec<TokenId> {
        let mut v = Vec::with_capacity(self.prompt_len as usize + extra);
        for s in &self.prompt {
            s.append_tokens(&mut v);
        }
        v
    }

    /// The prompt as a lazy token source ([`radixkv_scheduler_api::Request::lazy`]): a copy
    /// of its segments, so that a waiting request costs its segments, not its tokens, and
    /// its tokens are generated when the manager admits it. It gives no match hashes.
    pub fn prompt_source(&self) -> Arc<dyn TokenSource> {
        self.prompt_source_with(PageHashing::Off)
    }

    /// [`TraceRequest::prompt_source`], giving the prompt's match hashes as `hashing` says.
    pub fn prompt_source_with(&self, hashing: PageHashing) -> Arc<dyn TokenSource> {
        Arc::new(PromptSource {
            segments: self.prompt.clone().into_boxed_slice(),
            len: self.prompt_len as usize,
            hashing,
        })
    }

    /// The output tokens the simulated model generates.
    pub fn output_tokens(&self) -> Vec<TokenId> {
        let mut v = Vec::with_capacity(self.output_len as usize);
        block_tokens(self.output_id, self.output_len as usize, &mut v);
        v
    }
}

/// Whether and how a prompt source gives its prompt's match hashes
/// ([`TokenSource::fill_page_hashes`]), as an engine would.
#[derive(Clone, Debug, Default)]
pub enum PageHashing {
    /// None: the manager matches by tokens.
    #[default]
    Off,
    /// Hashes of the whole prompt, computed when the manager asks (an engine that hashes each
    /// prompt as it arrives).
    Whole,
    /// Hashes kept per conversation: the pages the prompt shares with one of the
    /// conversation's kept prompts ([`HashMemo`]) are taken from it and only the rest are
    /// hashed (an engine that extends its hashes as a conversation grows).
    Conversation(Arc<Mutex<HashMemo>>),
}

/// A conversation's last hashed prompts ([`PageHashing::Conversation`]; up to
/// [`HashMemo::PROMPTS`], so that a main thread and the sub-agents interleaved with it each
/// keep theirs): their segments and hashes, under the hasher and namespace that made them.
/// The hashes are [`PageHashes`], whose clones share their chunks: a turn takes the pages it
/// shares with a kept prompt without copying them.
///
/// A memo made by [`HashMemo::counted`] reports what it holds to a [`MemoLedger`] shared
/// with the other conversations' memos, so that their owner can hold them all to a bound
/// ([`HashMemo::forget`] the least recently used); one made by `default` counts nowhere.
#[derive(Debug, Default)]
pub struct HashMemo {
    prompts: Vec<MemoPrompt>,
    made_by: Option<(PageHasher, Namespace)>,
    uses: u64,
    ledger: Option<Arc<MemoLedger>>,
    /// Bytes of hashes this memo has reported to the ledger.
    held: usize,
    /// The ledger's clock at this memo's last use.
    last_use: u64,
}

/// What the memos sharing it hold in all, and a clock that orders their uses
/// ([`HashMemo::counted`]).
#[derive(Debug, Default)]
pub struct MemoLedger {
    /// Bytes of hashes the memos hold ([`PageHashes::bytes_together`] of each memo's
    /// prompts: whole chunks, each once per memo).
    bytes: AtomicUsize,
    clock: AtomicU64,
}

impl MemoLedger {
    /// Bytes of hashes the memos hold.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A memo that goes (its conversation's last turn done) takes what it held off the count.
impl Drop for HashMemo {
    fn drop(&mut self) {
        self.forget();
    }
}

#[derive(Debug)]
struct MemoPrompt {
    segments: Vec<Segment>,
    hashes: PageHashes,
    last_use: u64,
}

impl HashMemo {
    /// Prompts kept per conversation.
    pub const PROMPTS: usize = 4;

    /// Locks a shared memo; a poisoned one only means a panic elsewhere: its contents are
    /// whole.
    pub fn lock(memo: &Mutex<HashMemo>) -> std::sync::MutexGuard<'_, HashMemo> {
        memo.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty memo that reports what it holds to `ledger`.
    pub fn counted(ledger: Arc<MemoLedger>) -> Self {
        let mut m = HashMemo::default();
        m.ledger = Some(ledger);
        m
    }

    /// Bytes of hashes held (its kept prompts' chunks, each once).
    pub fn held(&self) -> usize {
        self.held
    }

    /// When it was last used, on its ledger's clock (0 for a memo never used or uncounted).
    pub fn last_use(&self) -> u64 {
        self.last_use
    }

    /// Drops every kept prompt (the conversation's next turn hashes its whole prompt) and
    /// takes them off the ledger's count.
    pub fn forget(&mut self) {
        self.prompts.clear();
        self.recount();
    }

    /// Brings the ledger's count of this memo up to date.
    fn recount(&mut self) {
        let held = PageHashes::bytes_together(self.prompts.iter().map(|m| &m.hashes));
        if let Some(l) = &self.ledger {
            if held >= self.held {
                l.bytes.fetch_add(held - self.held, Ordering::Relaxed);
            } else {
                l.bytes.fetch_sub(self.held - held, Ordering::Relaxed);
            }
        }
        self.held = held;
    }

    /// Gives `out` the hashes of `tokens` (whose segments are `segments`): the leading pages
    /// shared with the kept prompt that shares the most are taken from it, the rest are
    /// hashed. The prompt is then kept in place of the one it extends, or of the least
    /// recently used.
    fn hash(
        &mut self,
        segments: &[Segment],
        hasher: &PageHasher,
        namespace: &Namespace,
        tokens: &[TokenId],
        out: &mut PageHashes,
    ) {
        let p = hasher.page_size();
        if self
            .made_by
            .as_ref()
            .is_none_or(|(h, ns)| h != hasher || ns != namespace)
        {
            self.prompts.clear();
            self.made_by = Some((*hasher, namespace.clone()));
        }
        let best = self
            .prompts
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let common = common_tokens(segments, &m.segments) as usize;
                (i, (common / p).min(m.hashes.len()))
            })
            .max_by_key(|&(_, pages)| pages);
        *out = PageHashes::new();
        if let Some((i, pages)) = best {
            *out = self.prompts[i].hashes.clone();
            out.truncate(pages);
        }
        hasher.extend_chain(namespace, tokens, out);
        self.uses += 1;
        // The kept prompt this one extends (all of its pages reused) makes way for it;
        // otherwise it takes a free place or the least recently used one.
        let slot = best
            .filter(|&(i, pages)| pages == self.prompts[i].hashes.len())
            .map(|(i, _)| i)
            .or_else(|| (self.prompts.len() < Self::PROMPTS).then_some(self.prompts.len()))
            .unwrap_or_else(|| {
                (0..self.prompts.len())
                    .min_by_key(|&i| self.prompts[i].last_use)
                    .unwrap_or(0)
            });
        let entry = MemoPrompt {
            segments: segments.to_vec(),
            hashes: out.clone(),
            last_use: self.uses,
        };
        if slot == self.prompts.len() {
            self.prompts.push(entry);
        } else {
            self.prompts[slot] = entry;
        }
        self.recount();
        if let Some(l) = &self.ledger {
            self.last_use = l.clock.fetch_add(1, Ordering::Relaxed) + 1;
        }
    }
}

/// Tokens two segment lists agree on from the start (a lower bound: runs that agree only by
/// chance are not counted).
fn common_tokens(a: &[Segment], b: &[Segment]) -> u64 {
    let mut n = 0;
    for (x, y) in a.iter().zip(b) {
        if x == y {
            n += x.len;
            continue;
        }
        if x.first == y.first && x.block == y.block {
            // The same blocks from the same id: one is a prefix of the other.
            n += x.len.min(y.len);
        }
        break;
    }
    n
}

/// A trace request's prompt as a [`TokenSource`] ([`TraceRequest::prompt_source`]).
#[derive(Debug)]
struct PromptSource {
    segments: Box<[Segment]>,
    len: usize,
    hashing: PageHashing,
}

impl TokenSource for PromptSource {
    fn len(&self) -> usize {
        self.len
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> std::result::Result<(), TokenSourceError> {
        for s in &self.segments {
            s.append_tokens(out);
        }
        Ok(())
    }

    fn fill_page_hashes(
        &self,
        hasher: &PageHasher,
        namespace: &Namespace,
        tokens: &[TokenId],
        out: &mut PageHashes,
    ) {
        match &self.hashing {
            PageHashing::Off => {}
            PageHashing::Whole => hasher.extend_chain(namespace, tokens, out),
            PageHashing::Conversation(memo) => {
                HashMemo::lock(memo).hash(&self.segments, hasher, namespace, tokens, out);
            }
        }
    }
}

/// A workload: requests sorted by arrival.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// A short name (file stem or generator).
    pub name: String,
    /// The requests, sorted by arrival time.
    pub requests: Vec<TraceRequest>,
    /// No block of one conversation's prompts appears in another conversation's, and every
    /// request belongs to a conversation ([`TraceRequest::session`]). The agentic reader's
    /// block ids are local to their conversation, so it sets this; the other readers and the
    /// synthetic chat (whose conversations share a system prompt) do not. The replay's
    /// infinite-cache ideal then follows one conversation at a time and holds one
    /// conversation's blocks instead of the whole trace's. Set on a trace whose conversations
    /// do share blocks, the ideal would miss those hits.
    pub conversations_disjoint: bool,
}

/// A trace lent to [`crate::sim::replay`] or [`crate::sim::compare`]: they copy it only if they
/// retime it.
impl<'a> From<&'a Trace> for std::borrow::Cow<'a, Trace> {
    fn from(t: &'a Trace) -> Self {
        std::borrow::Cow::Borrowed(t)
    }
}

/// A trace given to [`crate::sim::replay`] or [`crate::sim::compare`]: a retiming rewrites its
/// arrivals in place instead of copying the requests.
impl From<Trace> for std::borrow::Cow<'_, Trace> {
    fn from(t: Trace) -> Self {
        std::borrow::Cow::Owned(t)
    }
}

impl Trace {
    /// Sorts by arrival (stable, so equal times keep file order).
    pub(crate) fn finish(mut self) -> Self {
        self.requests.sort_by_key(|r| r.arrival_us);
        self
    }

    /// Gives back the room the readers' growing vectors left over: a trace is held for the
    /// whole replay (on the whole agentic trace, the request list alone had 0.6 MB to spare).
    fn shrink_to_fit(&mut self) {
        self.requests.shrink_to_fit();
        for r in &mut self.requests {
            r.prompt.shrink_to_fit();
        }
    }

    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt_len).sum()
    }
}

/// Trace file formats.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token
    /// blocks, global ids).
    Mooncake,
    /// Agentic multi-turn JSONL (optionally gzip'd): one conversation per line, 64-token blocks
    /// with ids local to the conversation, sub-agents, think times.
    Weka,
    /// Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens` (no prefix info).
    Azure,
}

impl TraceFormat {
    /// Parses a format name.
    ///
    /// # Errors
    /// [`ManagerError::Config`] listing the known formats.
    pub fn from_name(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "mooncake" => Ok(TraceFormat::Mooncake),
            "weka" | "agentic" | "claude_code" => Ok(TraceFormat::Weka),
            "azure" => Ok(TraceFormat::Azure),
            _ => Err(ManagerError::Config(format!(
                "unknown trace format {s:?}; known: mooncake, weka (agentic), azure"
            ))),
        }
    }
}

/// Options of the trace readers.
#[derive(Copy, Clone, Debug)]
pub struct ReadOptions {
    /// Read at most this many requests (Mooncake, Azure) or conversations (agentic).
    pub limit: Option<usize>,
    /// Keep only the first this many requests by arrival time (after reading).
    pub max_requests: Option<usize>,
    /// Seed of the arrival process for traces without absolute times (agentic).
    pub seed: u64,
    /// Mean gap between conversation starts in seconds (agentic).
    pub conversation_gap_s: f64,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            limit: None,
            max_requests: None,
            seed: 7,
            conversation_gap_s: 2.0,
        }
    }
}

/// How the bytes of a trace are compressed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Plain text.
    None,
    /// gzip (the agentic traces ship as `.jsonl.gz`).
    Gzip,
}

impl Compression {
    /// What a file's extension says: `.gz` is gzip, anything else plain text.
    pub fn from_path(path: &Path) -> Self {
        if path.extension().is_some_and(|e| e == "gz") {
            Compression::Gzip
        } else {
            Compression::None
        }
    }
}

/// Reads a trace file: [`decode_trace`] over the file, gzip'd when its name ends in `.gz`.
///
/// # Errors
/// [`ManagerError::Io`] for a missing or unreadable file, [`ManagerError::Trace`] with the
/// line number for malformed content.
pub fn read_trace(path: &Path, format: TraceFormat, opts: &ReadOptions) -> Result<Trace> {
    let file = std::fs::File::open(path).map_err(|e| io_err(path, &e))?;
    let source = path.display().to_string();
    let mut trace = decode_trace(file, Compression::from_path(path), &source, format, opts)?;
    if let Some(name) = path.file_name() {
        trace.name = name.to_string_lossy().into_owned();
    }
    Ok(trace)
}

/// Decodes a trace from any byte source (a file, a network stream, bytes in memory). The one
/// decoding path: [`read_trace`] calls it too. `source` names the input in error messages and
/// becomes the trace's name.
///
/// # Errors
/// [`ManagerError::Trace`] with the 1-based line number for malformed content (including
/// corrupt gzip and read errors of `reader`), and with line 0 for a trace without requests.
pub fn decode_trace(
    reader: impl Read,
    compression: Compression,
    source: &str,
    format: TraceFormat,
    opts: &ReadOptions,
) -> Result<Trace> {
    let reader: Box<dyn Read + '_> = match compression {
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(reader)),
        Compression::None => Box::new(reader),
    };
    let reader = BufReader::with_capacity(1 << 20, reader);
    let ctx = Ctx { source };
    let trace = match format {
        TraceFormat::Mooncake => mooncake::read(reader, &ctx, opts),
        TraceFormat::Weka => weka::read(reader, &ctx, opts),
        TraceFormat::Azure => azure::read(reader, &ctx, opts),
    }?;
    if trace.requests.is_empty() {
        return Err(ctx.err(0, "the trace has no requests"));
    }
    let mut trace = trace.finish();
    if let Some(n) = opts.max_requests {
        trace.requests.truncate(n.max(1));
    }
    trace.shrink_to_fit();
    Ok(trace)
}

/// What a decoder knows of its input: the name that errors and the trace carry.
pub(crate) struct Ctx<'a> {
    pub source: &'a str,
}

impl Ctx<'_> {
    pub fn err(&self, line: usize, message: impl Into<String>) -> ManagerError {
        ManagerError::Trace {
            path: self.source.to_string(),
            line,
            message: message.into(),
        }
    }
}

fn io_err(path: &Path, e: &std::io::Error) -> ManagerError {
    ManagerError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Iterates non-empty lines with their 1-based numbers; IO errors (including gzip corruption)
/// become trace errors on that line.
pub(crate) fn lines<'a>(
    reader: impl BufRead + 'a,
    ctx: &'a Ctx<'a>,
) -> impl Iterator<Item = Result<(usize, String)>> + 'a {
    reader
        .lines()
        .enumerate()
        .map(move |(i, l)| match l {
            Ok(s) => Ok((i + 1, s)),
            Err(e) => Err(ctx.err(i + 1, format!("cannot read: {e}"))),
        })
        .filter(|r| !matches!(r, Ok((_, s)) if s.trim().is_empty()))
}

/// The deterministic draws of the arrival processes and the synthetic generator: a seeded
/// SplitMix64 stream (whose sequence the seeded workloads, and so their documented figures,
/// depend on) with the few distributions they need.
#[derive(Clone, Debug)]
pub(crate) struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed ^ 0x2545_f491_4f6c_dd1d))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

#[cfg(test)]
pub(crate) mod test_memo {
    //! Conversation turns and their hashes through a memo, for the memo tests here and in
    //! the scheduler.
    use super::*;

    /// A request of conversation `s` whose prompt is `blocks` blocks of 512 tokens.
    pub(crate) fn turn(s: u64, blocks: u64) -> TraceRequest {
        TraceRequest {
            arrival_us: 0,
            prompt: vec![Segment {
                first: s << 20,
                block: 512,
                len: blocks * 512,
            }],
            prompt_len: blocks * 512,
            output_len: 1,
            output_id: 1 << 40,
            session: Some(s),
        }
    }

    /// The hashes `r`'s source gives through `memo`, checked against hashing it whole.
    pub(crate) fn hashed(
        r: &TraceRequest,
        memo: &Arc<Mutex<HashMemo>>,
        hasher: &PageHasher,
    ) -> PageHashes {
        let source = r.prompt_source_with(PageHashing::Conversation(memo.clone()));
        let mut tokens = Vec::new();
        source.fill(&mut tokens).unwrap();
        let ns = Namespace::default();
        let mut out = PageHashes::new();
        source.fill_page_hashes(hasher, &ns, &tokens, &mut out);
        assert_eq!(
            out,
            hasher.hashes(&ns, &tokens),
            "a memo never changes the hashes"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::test_memo::{hashed, turn};
    use super::*;

    #[test]
    fn a_counted_memo_reports_its_chunks_once_and_takes_them_back_when_forgotten_or_dropped() {
        let kv = radixkv_scheduler_api::KvCacheManager::builder()
            .device_tokens(1 << 16)
            .page_size(16)
            .build()
            .unwrap();
        let hasher = kv.page_hasher();
        let chunk = PageHashes::CHUNK * std::mem::size_of::<radixkv_radix::PageHash>();
        let ledger = Arc::new(MemoLedger::default());
        let memo = Arc::new(Mutex::new(HashMemo::counted(ledger.clone())));
        // 10 blocks of 512 tokens: 320 pages of 16, two chunks.
        let first = hashed(&turn(1, 10), &memo, &hasher);
        assert_eq!(first.len(), 320);
        assert_eq!(ledger.bytes(), 2 * chunk);
        // The next turn extends it: the memo keeps the longer prompt in its place, and the
        // chunks the two share are counted once (the first is shared, the second was copied
        // when it grew, the third is new).
        let second = hashed(&turn(1, 20), &memo, &hasher);
        assert_eq!(second.len(), 640);
        assert_eq!(ledger.bytes(), 3 * chunk);
        assert_eq!(memo.lock().unwrap().held(), 3 * chunk);
        let used = memo.lock().unwrap().last_use();
        assert!(used > 0);
        // Forgotten, it holds nothing, and the next turn hashes its whole prompt (still right).
        memo.lock().unwrap().forget();
        assert_eq!(ledger.bytes(), 0);
        hashed(&turn(1, 4), &memo, &hasher);
        assert_eq!(ledger.bytes(), chunk);
        assert!(memo.lock().unwrap().last_use() > used);
        // A second conversation's memo counts on the same ledger; dropped, each takes its
        // share back.
        let other = Arc::new(Mutex::new(HashMemo::counted(ledger.clone())));
        hashed(&turn(1, 10), &other, &hasher);
        assert_eq!(ledger.bytes(), 3 * chunk);
        drop(memo);
        assert_eq!(ledger.bytes(), 2 * chunk);
        drop(other);
        assert_eq!(ledger.bytes(), 0);
        // An uncounted memo reports nowhere.
        let free = Arc::new(Mutex::new(HashMemo::default()));
        hashed(&turn(1, 10), &free, &hasher);
        assert_eq!((ledger.bytes(), free.lock().unwrap().last_use()), (0, 0));
    }

    #[test]
    fn equal_ids_give_equal_tokens_and_partial_blocks_are_prefixes() {
        let mut a = Vec::new();
        block_tokens(5, 512, &mut a);
        let mut b = Vec::new();
        block_tokens(5, 100, &mut b);
        assert_eq!(&a[..100], &b[..]);
        let mut c = Vec::new();
        block_tokens(6, 512, &mut c);
        assert_ne!(a, c);
    }

    #[test]
    fn consecutive_ids_merge_into_segments() {
        let mut s = Vec::new();
        segments_from_blocks(&[0, 14, 15, 16], 512, 1800, &mut s);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].len, 512);
        assert_eq!(s[1].len, 1800 - 512);
        let mut t = Vec::new();
        for seg in &s {
            seg.append_tokens(&mut t);
        }
        let mut expect = Vec::new();
        for (id, n) in [(0, 512), (14, 512), (15, 512), (16, 264)] {
            block_tokens(id, n, &mut expect);
        }
        assert_eq!(t, expect);
    }

    #[test]
    fn decoding_bytes_plain_or_gzip_gives_the_same_trace() {
        use std::io::Write;
        let text = concat!(
            r#"{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}"#,
            "\n\n",
            r#"{"timestamp": 1, "input_length": 20, "output_length": 0, "hash_ids": [0]}"#,
            "\n",
        );
        let opts = ReadOptions::default();
        let plain = decode_trace(
            text.as_bytes(),
            Compression::None,
            "mem",
            TraceFormat::Mooncake,
            &opts,
        )
        .unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(text.as_bytes()).unwrap();
        let gz = gz.finish().unwrap();
        let unzipped = decode_trace(
            &gz[..],
            Compression::Gzip,
            "mem",
            TraceFormat::Mooncake,
            &opts,
        )
        .unwrap();
        assert_eq!(plain, unzipped);
        assert_eq!(plain.name, "mem");
        // Sorted by arrival; the output length is at least one token.
        assert_eq!(plain.requests[0].prompt_len, 20);
        assert_eq!(plain.requests[0].output_len, 1);
        // A malformed line is reported with its 1-based number (blank lines count).
        let bad = text.replace("\"hash_ids\": [0]", "\"hash_ids\": []");
        let e = decode_trace(
            bad.as_bytes(),
            Compression::None,
            "mem",
            TraceFormat::Mooncake,
            &opts,
        )
        .unwrap_err();
        assert!(matches!(e, ManagerError::Trace { line: 3, .. }), "{e}");
        // Plain text read as gzip is a trace error, not a panic.
        assert!(matches!(
            decode_trace(
                text.as_bytes(),
                Compression::Gzip,
                "mem",
                TraceFormat::Mooncake,
                &opts
            ),
            Err(ManagerError::Trace { .. })
        ));
    }

    #[test]
    fn unknown_format_is_a_clear_error() {
        let e = TraceFormat::from_name("parquet").unwrap_err().to_string();
        assert!(
            e.contains("unknown trace format") && e.contains("mooncake"),
            "{e}"
        );
    }
}
