//! The manager's `tracing` spans (one per request, one per step) and the request identity in
//! its errors: both name the engine's own id for a request.

mod common;

use common::admitted;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use radixkv_scheduler_api::{KvCacheManager, ManagerError, Request};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// One span as the capturing layer saw it.
#[derive(Clone, Debug, Default)]
struct SpanRec {
    name: &'static str,
    fields: BTreeMap<String, String>,
    /// Messages of the events recorded inside it.
    events: Vec<String>,
    closed: bool,
}

#[derive(Default)]
struct Captured {
    spans: Vec<SpanRec>,
    /// Live span id → index in `spans` (the registry reuses ids of closed spans).
    live: BTreeMap<u64, usize>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Captured>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut rec = SpanRec {
            name: attrs.metadata().name(),
            ..Default::default()
        };
        attrs.record(&mut Fields(&mut rec.fields));
        let mut c = self.0.lock().unwrap();
        c.spans.push(rec);
        let i = c.spans.len() - 1;
        c.live.insert(id.into_u64(), i);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut c = self.0.lock().unwrap();
        let i = c.live[&id.into_u64()];
        values.record(&mut Fields(&mut c.spans[i].fields));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let mut c = self.0.lock().unwrap();
        let i = c.live[&span.id().into_u64()];
        c.spans[i]
            .events
            .push(fields.remove("message").unwrap_or_default());
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        let mut c = self.0.lock().unwrap();
        if let Some(i) = c.live.remove(&id.into_u64()) {
            c.spans[i].closed = true;
        }
    }
}

/// Serializes the tests of this file. `tracing` caches per call site whether any subscriber
/// wants it, when the site is first hit: a test hitting a site without a subscriber while
/// another installs its own could leave that site off for the other. So every test here runs
/// the manager under [`capture`], one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `f` with the capturing layer installed on this thread; returns the spans it saw.
fn capture(f: impl FnOnce()) -> Vec<SpanRec> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cap = Capture::default();
    let subscriber = tracing_subscriber::registry().with(cap.clone());
    tracing::subscriber::with_default(subscriber, f);
    let c = cap.0.lock().unwrap();
    c.spans.clone()
}

fn manager() -> KvCacheManager {
    KvCacheManager::builder()
        .device_tokens(256)
        .page_size(4)
        .build()
        .unwrap()
}

#[test]
fn request_and_step_spans_carry_the_engine_id_and_the_step() {
    let spans = capture(|| {
        let mut kv = manager();
        let r = kv
            .arrive(
                Request::new((0..10).collect())
                    .max_new_tokens(2)
                    .engine_id("chat-42"),
            )
            .unwrap();
        let a = admitted(&mut kv, r);
        kv.extend(r, a.extend_tokens).unwrap();
        let step = kv.begin_step();
        kv.chunk_done(r).unwrap();
        kv.end_step(step).unwrap();
        kv.decode(r, 7).unwrap();
        let step = kv.begin_step();
        kv.finish(r).unwrap();
        kv.end_step(step).unwrap();
    });
    let req: Vec<_> = spans.iter().filter(|s| s.name == "kv_request").collect();
    assert_eq!(req.len(), 1, "{spans:?}");
    let req = req[0];
    assert_eq!(req.fields["engine_id"], "chat-42");
    assert_eq!(req.fields["id"], "#0");
    assert_eq!(req.fields["prompt_tokens"], "10");
    assert_eq!(req.fields["outcome"], "finished");
    assert_eq!(req.events, ["admitted"]);
    assert!(req.closed, "the request span closes at finish");

    let steps: Vec<_> = spans.iter().filter(|s| s.name == "kv_step").collect();
    assert_eq!(steps.len(), 2, "{spans:?}");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.fields["step"], (i + 1).to_string());
        assert_eq!(s.events, ["step ended"]);
        assert!(s.closed, "the step span closes with its handle at end_step");
    }
}

#[test]
fn retract_and_abort_show_in_the_request_span() {
    let spans = capture(|| {
        let mut kv = manager();
        let r = kv
            .arrive(
                Request::new((0..8).collect())
                    .max_new_tokens(4)
                    .engine_id("r-1"),
            )
            .unwrap();
        let a = admitted(&mut kv, r);
        kv.extend(r, a.extend_tokens).unwrap();
        kv.retract(r).unwrap();
        kv.abort(r).unwrap();
    });
    let req = spans.iter().find(|s| s.name == "kv_request").unwrap();
    assert_eq!(req.fields["engine_id"], "r-1");
    assert_eq!(req.events, ["admitted", "retracted"]);
    assert_eq!(req.fields["outcome"], "aborted");
    assert!(req.closed);
}

#[test]
fn errors_name_the_engine_id_not_the_packed_handle() {
    capture(errors_name_the_engine_id);
}

fn errors_name_the_engine_id() {
    let mut kv = manager();
    // Slot 0 is used once, so the next request's handle packs generation 1 into its high bits.
    let first = kv.arrive(Request::new(vec![1, 2, 3])).unwrap();
    kv.abort(first).unwrap();
    let r = kv
        .arrive(Request::new((0..10).collect()).engine_id("chat-7"))
        .unwrap();
    assert_eq!(r.get(), 1 << 32);
    let packed = r.get().to_string();

    let e = kv.extend(r, 4).unwrap_err();
    assert!(
        matches!(&e, ManagerError::Lifecycle { engine_id: Some(id), .. } if id == "chat-7"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert_eq!(
        msg,
        r#"request "chat-7" (#0.1): not running (admit it first)"#
    );
    assert!(!msg.contains(&packed), "{msg}");

    // Without an engine id, the handle is shown as slot and generation.
    let e = kv.pages(first).unwrap_err().to_string();
    assert_eq!(e, "unknown request #0");
    admitted(&mut kv, r);
    kv.abort(r).unwrap();
    let e = kv.finish(r).unwrap_err().to_string();
    assert_eq!(e, "unknown request #0.1");
    let e = kv
        .arrive(Request::new(vec![]).engine_id("empty-1"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with(r#"request "empty-1" "#), "{e}");
    assert!(e.ends_with("empty prompt"), "{e}");
}
