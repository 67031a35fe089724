//! A tokio serving loop driving one [`KvCacheManager`], as the crate docs' threading model
//! describes: client tasks send requests over an `mpsc` channel to the one scheduler task that
//! owns the manager, and each answer comes back through the `oneshot` channel sent with it.
//!
//! The model is simulated (its "forward" samples a token from the last one), so the example runs
//! in well under a second: eight clients share a 64-token system prompt, and one client holds a
//! three-turn chat session whose turns reuse the previous turn's KV. At the end it prints the
//! requests served and the prompt tokens the cache reused.
//!
//! ```text
//! cargo run -p radixkv-scheduler-api --example tokio_server
//! ```

use std::collections::VecDeque;

use radixkv_scheduler_api::{
    Admission, KvCacheManager, ManagerError, ReqId, Request, SessionBudget,
};
use tokio::sync::{mpsc, oneshot};

/// What a client asks for.
struct Job {
    /// The engine's id for the request, shown in the manager's spans and errors.
    name: String,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    session: Option<u64>,
    reply: oneshot::Sender<Result<Reply, String>>,
}

/// What a client gets back.
#[derive(Debug)]
struct Reply {
    output: Vec<u32>,
    /// Prompt tokens the cache already held (any tier).
    cached_tokens: usize,
}

/// A request inside the scheduler, waiting for admission or running.
struct Active {
    id: ReqId,
    job: Job,
    /// Tokens sampled so far (kept across a retraction).
    output: Vec<u32>,
    /// Prompt tokens its first admission found cached.
    cached_tokens: Option<usize>,
    /// Admitted this step: its prefill is in this step's forward.
    prefilling: bool,
}

/// What one run served.
#[derive(Debug, Default)]
struct Summary {
    requests: u64,
    steps: u64,
    prompt_tokens: u64,
    hit_tokens: u64,
    /// Prompt tokens reused by the turns of the session after the first.
    session_hit_tokens: Vec<usize>,
    /// Tokens still owned, locked or held by a session after shutdown (must be 0).
    leaked_tokens: usize,
}

const SYSTEM_PROMPT: std::ops::Range<u32> = 0..64;
const CLIENTS: u32 = 8;
const SESSION: u64 = 1;
/// New requests admitted per step (the rest wait for the next step).
const MAX_ADMIT_PER_STEP: usize = 4;

/// The simulated forward: the next token depends only on the last one.
fn sample(last: u32) -> u32 {
    last.wrapping_mul(31).wrapping_add(7) % 32_000
}

/// The scheduler task: owns the manager, runs one step per loop iteration while there is work,
/// and sleeps on the channel when there is none. Returns once every client has hung up.
async fn scheduler(
    mut kv: KvCacheManager,
    mut rx: mpsc::Receiver<Job>,
) -> Result<Summary, ManagerError> {
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut arrived: VecDeque<Active> = VecDeque::new();
    let mut running: Vec<Active> = Vec::new();
    let mut open = true;
    loop {
        // New requests: block only when there is nothing to do.
        if running.is_empty() && waiting.is_empty() && arrived.is_empty() {
            match rx.recv().await {
                Some(job) => waiting.push_back(job),
                None => break,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        for job in waiting.drain(..) {
            let mut req = Request::new(job.prompt.clone())
                .max_new_tokens(job.max_new_tokens)
                .engine_id(job.name.clone());
            req.session = job.session;
            match kv.arrive(req) {
                Ok(id) => arrived.push_back(Active {
                    id,
                    job,
                    output: Vec::new(),
                    cached_tokens: None,
                    prefilling: false,
                }),
                Err(e) => {
                    let _ = job.reply.send(Err(e.to_string()));
                }
            }
        }

        // Form the batch: decode tokens of the running requests, then admissions (FCFS).
        let mut i = 0;
        while i < running.len() {
            let a = &running[i];
            let last = *a.output.last().unwrap_or(&0);
            match kv.decode(a.id, last) {
                Ok(_) => i += 1,
                Err(ManagerError::OutOfMemory { .. }) => {
                    // Retract (its computed KV stays cached) and admit it again later.
                    let a = running.swap_remove(i);
                    kv.retract(a.id)?;
                    arrived.push_front(a);
                }
                Err(e) => return Err(e),
            }
        }
        let mut admitted = 0;
        while admitted < MAX_ADMIT_PER_STEP
            && let Some(mut r) = arrived.pop_front()
        {
            match kv.admit(r.id)? {
                Admission::Ready(a) => {
                    // The whole prompt (or, after a retraction, what was not cached) in one
                    // chunk.
                    kv.extend(r.id, a.extend_tokens)?;
                    r.cached_tokens.get_or_insert(a.cached_tokens());
                    r.prefilling = true;
                    running.push(r);
                    admitted += 1;
                }
                Admission::Wait(_) => {
                    arrived.push_front(r);
                    break;
                }
                Admission::Never(why) => {
                    kv.abort(r.id)?;
                    let _ = r.job.reply.send(Err(format!("{}: {why:?}", r.job.name)));
                }
            }
        }

        // The step: start its loads, run the forward layer by layer, then commit.
        let step = kv.begin_step();
        for layer in 0..kv.config().model.layers {
            step.wait_layer(layer)?;
        }
        let mut i = 0;
        while i < running.len() {
            let a = &mut running[i];
            if a.prefilling {
                kv.chunk_done(a.id)?;
                a.prefilling = false;
            }
            let last = a
                .output
                .last()
                .or(a.job.prompt.last())
                .copied()
                .unwrap_or(0);
            a.output.push(sample(last));
            if a.output.len() < a.job.max_new_tokens {
                i += 1;
                continue;
            }
            let a = running.swap_remove(i);
            kv.finish(a.id)?;
            let _ = a.job.reply.send(Ok(Reply {
                output: a.output,
                cached_tokens: a.cached_tokens.unwrap_or(0),
            }));
        }
        kv.end_step(step)?;
        // Let the clients run (on a current-thread runtime they would otherwise starve).
        tokio::task::yield_now().await;
    }
    kv.close_all_sessions()?;
    kv.drain()?;
    let c = kv.metrics().counters;
    let a = kv.accounting();
    Ok(Summary {
        requests: c.finished,
        steps: c.steps,
        prompt_tokens: c.prompt_tokens,
        hit_tokens: c.hit_tokens_device + c.hit_tokens_host,
        session_hit_tokens: Vec::new(),
        leaked_tokens: a.request_owned + a.protected + a.session_held,
    })
}

/// Sends one request and waits for its answer.
async fn ask(
    tx: &mpsc::Sender<Job>,
    name: String,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    session: Option<u64>,
) -> Result<Reply, String> {
    let (reply, answer) = oneshot::channel();
    let job = Job {
        name,
        prompt,
        max_new_tokens,
        session,
        reply,
    };
    tx.send(job)
        .await
        .map_err(|_| "scheduler gone".to_string())?;
    answer
        .await
        .map_err(|_| "scheduler dropped the request".to_string())?
}

/// Runs the clients against a fresh manager; returns what was served.
async fn serve() -> Result<Summary, String> {
    let kv = KvCacheManager::builder()
        .device_tokens(16 << 10)
        .page_size(16)
        .max_rows(64)
        .sessions(SessionBudget {
            max_held_tokens: 4 << 10,
            per_session_cap_tokens: 2 << 10,
            ..Default::default()
        })
        .build()
        .map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::channel(64);
    let server = tokio::spawn(scheduler(kv, rx));

    // Clients that share the system prompt, each with its own question.
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let tx = tx.clone();
        clients.push(tokio::spawn(async move {
            let mut prompt: Vec<u32> = SYSTEM_PROMPT.collect();
            prompt.extend((0..24).map(|t| 1_000 + c * 100 + t));
            let r = ask(&tx, format!("client-{c}"), prompt, 8, None).await?;
            if r.output.len() != 8 {
                return Err(format!("client-{c}: {} tokens, not 8", r.output.len()));
            }
            Ok(())
        }));
    }

    // A three-turn chat: each turn's prompt is the history so far, the reply, and a new message.
    let chat_tx = tx.clone();
    let chat = tokio::spawn(async move {
        let mut history: Vec<u32> = (20_000..20_040).collect();
        let mut hits = Vec::new();
        for turn in 0..3 {
            let r = ask(
                &chat_tx,
                format!("chat-turn-{turn}"),
                history.clone(),
                6,
                Some(SESSION),
            )
            .await?;
            hits.push(r.cached_tokens);
            history.extend(r.output);
            history.extend((0..10).map(|t| 21_000 + turn * 100 + t));
        }
        Ok::<_, String>(hits)
    });
    drop(tx);

    for c in clients {
        c.await.map_err(|e| e.to_string())??;
    }
    let session_hits = chat.await.map_err(|e| e.to_string())??;
    let mut summary = server
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    summary.session_hit_tokens = session_hits;
    Ok(summary)
}

/// Runs [`serve`] on a two-worker runtime: the manager really moves between threads (it is
/// `Send`), though only the scheduler task ever touches it.
fn run() -> Result<Summary, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .map_err(|e| e.to_string())?
        .block_on(serve())
}

fn main() {
    match run() {
        Ok(s) => println!(
            "served {} requests in {} steps: {} of {} prompt tokens reused from the cache \
             (session turns 2 and 3 reused {:?}); {} tokens held after shutdown",
            s.requests,
            s.steps,
            s.hit_tokens,
            s.prompt_tokens,
            &s.session_hit_tokens[1..],
            s.leaked_tokens
        ),
        Err(e) => {
            eprintln!("tokio_server: {e}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_every_client_and_reuses_shared_prefixes_and_the_session() {
        let s = run().unwrap();
        assert_eq!(s.requests, u64::from(CLIENTS) + 3);
        // At most four requests are admitted per step, so at least four of the eight that
        // share the system prompt are admitted after the first prefill cached it.
        assert!(s.hit_tokens >= 4 * SYSTEM_PROMPT.len() as u64, "{s:?}");
        // Each later turn reuses the whole history the session holds: the previous prompt and
        // every output token but the last (sampled by the final forward, never decoded).
        assert_eq!(
            s.session_hit_tokens,
            [0, 40 + 5, 40 + 5 + 1 + 10 + 5],
            "{s:?}"
        );
        assert_eq!(s.leaked_tokens, 0);
    }
}
