package transporttest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// The suite's tables: what each consumer applied (written in the inbox
// transaction, so a row exists if and only if the event was applied) and
// which events the side effect fails.
const schema = `
CREATE TABLE applied (n bigserial PRIMARY KEY, consumer text NOT NULL, event_id uuid NOT NULL,
    aggregate_type text NOT NULL, aggregate_id text NOT NULL, seq bigint NOT NULL, event_type text NOT NULL);
CREATE TABLE fail_plan (event_id uuid PRIMARY KEY, remaining int NOT NULL, permanent boolean NOT NULL DEFAULT false,
    crash boolean NOT NULL DEFAULT false)`

// world is one test's database, deployment and consumers.
type world struct {
	t   *testing.T
	h   Harness
	dep Deployment
	db  *pgtest.DB
	// planDB reads the fail plan on connections of its own: a side effect
	// waiting for a second connection of the inbox's pool could wait for
	// ever with every lane holding one.
	planDB *pgxpool.Pool

	mu      sync.Mutex
	settled []inbox.Settlement
}

func newWorld(t *testing.T, h Harness, opts Options) *world {
	t.Helper()
	opts.defaults()
	w := openWorld(t, h)
	w.dep = h.New(t, opts)
	return w
}

// openWorld is a world without its deployment yet.
func openWorld(t *testing.T, h Harness) *world {
	t.Helper()
	w := &world{t: t, h: h, db: pgtest.New(t)}
	if _, err := w.db.Pool.Exec(context.Background(), schema); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(w.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	cfg.MaxConns = 2
	if w.planDB, err = pgxpool.NewWithConfig(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.planDB.Close)
	return w
}

// sideEffect records e as applied by consumer, after sleeping delay, and
// fails it as fail_plan says: permanently, or transiently while its
// remaining count lasts (counted down outside the inbox transaction, so
// the count survives the rollback of the failed attempt), or, in a child
// consumer process, by ending the process (crash: an event that kills its
// consumer every time). plan nil: no plan.
func sideEffect(consumer string, delay time.Duration, plan *pgxpool.Pool) inbox.Apply {
	return func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if delay > 0 {
			time.Sleep(delay)
		}
		if plan != nil {
			var permanent, crash bool
			err := plan.QueryRow(ctx, `UPDATE fail_plan SET remaining = remaining - 1 WHERE event_id = $1 AND (remaining > 0 OR permanent OR crash)
RETURNING permanent, crash`, e.ID).Scan(&permanent, &crash)
			switch {
			case err == nil && crash && os.Getenv(envChild) == "1":
				os.Exit(3)
			case err == nil && crash:
				return fmt.Errorf("event %d of %s would end a consumer process (planned)", e.Sequence, e.AggregateID)
			case err == nil && permanent:
				return envelope.Permanent(fmt.Errorf("event %d of %s rejected (planned)", e.Sequence, e.AggregateID))
			case err == nil:
				return fmt.Errorf("event %d of %s failed (planned)", e.Sequence, e.AggregateID)
			case err != pgx.ErrNoRows:
				return fmt.Errorf("read the fail plan: %w", err)
			}
		}
		_, err := tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_type, aggregate_id, seq, event_type)
VALUES ($1, $2, $3, $4, $5, $6)`, consumer, e.ID, e.AggregateType, e.AggregateID, e.Sequence, e.Type)
		return err
	}
}

// plan makes the side effect fail e: times transient failures, or for
// ever with a permanent error if times < 0.
func (w *world) plan(e envelope.Envelope, times int) {
	w.t.Helper()
	if _, err := w.db.Pool.Exec(context.Background(), `INSERT INTO fail_plan (event_id, remaining, permanent) VALUES ($1, $2, $3)
ON CONFLICT (event_id) DO UPDATE SET remaining = EXCLUDED.remaining, permanent = EXCLUDED.permanent`, e.ID, max(times, 0), times < 0); err != nil {
		w.t.Fatal(err)
	}
}

// planCrash makes the side effect end the consumer process every time it
// runs e (in a child process; in the test process it fails instead).
func (w *world) planCrash(e envelope.Envelope) {
	w.t.Helper()
	if _, err := w.db.Pool.Exec(context.Background(), `INSERT INTO fail_plan (event_id, remaining, crash) VALUES ($1, 0, true)`, e.ID); err != nil {
		w.t.Fatal(err)
	}
}

// fix removes every planned failure.
func (w *world) fix() {
	w.t.Helper()
	if _, err := w.db.Pool.Exec(context.Background(), `DELETE FROM fail_plan`); err != nil {
		w.t.Fatal(err)
	}
}

// consumerConfig is cc with the world's OnSettle recorder.
func (w *world) consumerConfig(cc inbox.ConsumerConfig) inbox.ConsumerConfig {
	next := cc.OnSettle
	cc.OnSettle = func(s inbox.Settlement) {
		w.mu.Lock()
		w.settled = append(w.settled, s)
		w.mu.Unlock()
		if next != nil {
			next(s)
		}
	}
	return cc
}

// start runs the deployment's Runner for consumer over db until the test
// ends (or the returned stop is called), applying with delay and the plan.
func (w *world) start(consumer string, db inbox.DB, delay time.Duration, cc inbox.ConsumerConfig) (stop func()) {
	w.t.Helper()
	return w.run(consumer, db, sideEffect(consumer, delay, w.planDB), cc)
}

// run runs the deployment's Runner for consumer over db, applying with
// apply, until the test ends (or the returned stop is called).
func (w *world) run(consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (stop func()) {
	w.t.Helper()
	cc.Consumer = consumer
	r, err := w.dep.Runner(consumer, db, apply, w.consumerConfig(cc))
	if err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	w.t.Cleanup(stop)
	return stop
}

// settlements returns the recorded settlements that match.
func (w *world) settlements(match func(inbox.Settlement) bool) []inbox.Settlement {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []inbox.Settlement
	for _, s := range w.settled {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// events returns n events of aggregate agg, sequences from..from+n-1.
func events(agg string, from int64, n int) []envelope.Envelope {
	out := make([]envelope.Envelope, n)
	for i := range out {
		out[i] = Event("thing", agg, "thing.changed", from+int64(i))
	}
	return out
}

// Event returns a new event (UUIDv7 id, tenant acme) of one aggregate with
// sequence seq (0: the outbox numbers it).
func Event(aggType, aggID, evType string, seq int64) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{ID: id.String(), Type: evType, OccurredAt: time.Now().UTC(), AggregateType: aggType,
		AggregateID: aggID, Sequence: seq, TenantID: "acme", SchemaVersion: 1, Payload: json.RawMessage(fmt.Sprintf(`{"seq":%d}`, seq))}
}

// BenchEvents returns n holdco events over n/2 aggregates (two each: only
// one event per aggregate can be in flight, so deeper aggregates measure
// rounds, not speed), ~300-byte bodies: what the transports' throughput
// benchmarks publish.
func BenchEvents(n int) []envelope.Envelope {
	kinds := Holdco.Kinds
	aggs := max(n/2, 1)
	out := make([]envelope.Envelope, 0, n)
	for i := 0; i < n; i++ {
		k := kinds[(i%aggs)%len(kinds)]
		e := Event(k.Type, fmt.Sprintf("%s-%07d", k.Type, i%aggs), k.Events[(i/aggs)%len(k.Events)], int64(i/aggs+1))
		e.Payload = []byte(fmt.Sprintf(`{"amount_cents":%d,"currency":"EUR","note":"%0200d"}`, i, i))
		out = append(out, e)
	}
	return out
}

// interleave merges per-aggregate event lists round-robin (each list keeps
// its order), as concurrent producers would commit them.
func interleave(lists ...[]envelope.Envelope) []envelope.Envelope {
	var out []envelope.Envelope
	for i := 0; ; i++ {
		added := false
		for _, l := range lists {
			if i < len(l) {
				out = append(out, l[i])
				added = true
			}
		}
		if !added {
			return out
		}
	}
}

// Message is e as the dispatcher hands it to a publisher.
func Message(e envelope.Envelope) outbox.Message {
	body, err := e.Encode()
	if err != nil {
		panic(err)
	}
	return outbox.Message{EventID: e.ID, GroupID: e.AggregateID, AggregateType: e.AggregateType,
		Sequence: e.Sequence, EventType: e.Type, Body: body, Attributes: e.Attributes(), Attempt: 1}
}

// publish sends evs through the deployment's publisher as the dispatcher
// would: calls of at most 10 messages, never two of one aggregate in a
// call, an aggregate's next event only after the previous one was
// acknowledged. A failed publish is retried (the broker connection may be
// being cut).
func (w *world) publish(evs ...envelope.Envelope) {
	w.t.Helper()
	ctx := context.Background()
	pub := w.dep.Publisher()
	for len(evs) > 0 {
		var batch []outbox.Message
		var rest []envelope.Envelope
		inBatch := map[string]bool{}
		for _, e := range evs {
			if len(batch) < 10 && !inBatch[e.AggregateID] {
				inBatch[e.AggregateID] = true
				batch = append(batch, Message(e))
			} else {
				inBatch[e.AggregateID] = true // later events of it wait for the next call
				rest = append(rest, e)
			}
		}
		deadline := time.Now().Add(60 * time.Second)
		for {
			var failed []outbox.Message
			var lastErr error
			for i, err := range pub.Publish(ctx, batch) {
				if err != nil {
					failed, lastErr = append(failed, batch[i]), err
				}
			}
			if len(failed) == 0 {
				break
			}
			if time.Now().After(deadline) {
				w.t.Fatalf("publish: %v", lastErr)
			}
			batch = failed
			time.Sleep(100 * time.Millisecond)
		}
		evs = rest
	}
}

type appliedRow struct {
	consumer, eventID, agg string
	aggType, eventType     string
	seq                    int64
}

func (w *world) applied() []appliedRow {
	w.t.Helper()
	rows, err := w.db.Pool.Query(context.Background(), `SELECT consumer, event_id::text, aggregate_type, aggregate_id, seq, event_type FROM applied ORDER BY n`)
	if err != nil {
		w.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (appliedRow, error) {
		var a appliedRow
		return a, r.Scan(&a.consumer, &a.eventID, &a.aggType, &a.agg, &a.seq, &a.eventType)
	})
	if err != nil {
		w.t.Fatal(err)
	}
	return out
}

// seqs is the order in which consumer applied agg's events.
func (w *world) seqs(consumer, agg string) []int64 {
	var out []int64
	for _, r := range w.applied() {
		if r.consumer == consumer && r.agg == agg {
			out = append(out, r.seq)
		}
	}
	return out
}

func (w *world) count(q string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.db.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		w.t.Fatal(err)
	}
	return n
}

// eventually polls cond every 50ms until it holds or timeout passes.
func (w *world) eventually(timeout time.Duration, what string, cond func() bool) {
	w.t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			w.t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitApplied waits until consumer applied n events.
func (w *world) waitApplied(consumer string, n int, timeout time.Duration) {
	w.t.Helper()
	w.eventually(timeout, fmt.Sprintf("%s to apply %d events", consumer, n), func() bool {
		return w.count(`SELECT count(*) FROM applied WHERE consumer = $1`, consumer) >= n
	})
}

// checkOnceInOrder checks that consumer applied exactly evs, each once, and
// every aggregate's events in sequence order.
func (w *world) checkOnceInOrder(consumer string, evs []envelope.Envelope) {
	w.t.Helper()
	want := map[string]bool{}
	for _, e := range evs {
		want[e.ID] = true
	}
	var rows []appliedRow
	for _, r := range w.applied() {
		if r.consumer == consumer {
			rows = append(rows, r)
		}
	}
	checkOnceInOrder(w.t, rows, map[string]map[string]bool{consumer: want})
}

// checkOnceInOrder checks rows, in the order they were applied, against
// want (consumer -> the ids of the events routed to it): every consumer
// applied exactly its events, each once, every aggregate's in sequence
// order.
func checkOnceInOrder(t *testing.T, rows []appliedRow, want map[string]map[string]bool) {
	t.Helper()
	seen := map[string]bool{}
	got := map[string]int{}
	last := map[string]int64{}
	for _, r := range rows {
		k := r.consumer + "/" + r.eventID
		if seen[k] {
			t.Errorf("%s applied event %s (%s/%d) twice", r.consumer, r.eventID, r.agg, r.seq)
		}
		seen[k] = true
		if !want[r.consumer][r.eventID] {
			t.Errorf("%s applied %s (%s of %s/%d), which was not routed to it", r.consumer, r.eventID, r.eventType, r.agg, r.seq)
		}
		got[r.consumer]++
		ak := r.consumer + "/" + r.aggType + "/" + r.agg
		if r.seq <= last[ak] {
			t.Errorf("%s applied %s/%d after %s/%d", r.consumer, r.agg, r.seq, r.agg, last[ak])
		}
		last[ak] = r.seq
	}
	for c, ids := range want {
		if got[c] != len(ids) {
			t.Errorf("%s applied %d events, want %d", c, got[c], len(ids))
		}
	}
}

// depth is consumer's queue figures.
func (w *world) depth(consumer string) transport.QueueDepth {
	w.t.Helper()
	ds, err := w.dep.Operations().Depths(context.Background(), consumer)
	if err != nil || len(ds) != 1 {
		w.t.Fatalf("depths of %s: %v %v", consumer, ds, err)
	}
	return ds[0]
}

// proxiedPool is a pool on the world's schema whose connections go
// through a Proxy the test can cut (the machine's PostgreSQL is never
// stopped).
func (w *world) proxiedPool() (*pgxpool.Pool, *Proxy) {
	w.t.Helper()
	u, err := url.Parse(w.db.URL)
	if err != nil {
		w.t.Fatal(err)
	}
	px := NewProxy(w.t, u.Host)
	u.Host = px.Addr()
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		w.t.Fatal(err)
	}
	cfg.MaxConns = 6
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(pool.Close)
	return pool, px
}

// runChild is a consumer process for the kill test: the deployment from
// the environment, a pool of its own, the suite's side effect; it runs
// until it is killed (or SIGTERM).
func runChild(h Harness) error {
	dep, err := h.Rebuild(os.Getenv(envSpec))
	if err != nil {
		return fmt.Errorf("rebuild the deployment: %w", err)
	}
	cfg, err := pgxpool.ParseConfig(os.Getenv(envDB))
	if err != nil {
		return err
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	cfg.MaxConns = 6 // a lane holds one for its batch
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	// The fail plan is read on connections of its own: a side effect that
	// waits for a second connection of the inbox's pool could wait for ever.
	pcfg := cfg.Copy()
	pcfg.MaxConns = 2
	plan, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return err
	}
	defer plan.Close()
	delay, _ := strconv.Atoi(os.Getenv(envDelay))
	consumer := os.Getenv(envConsumer)
	r, err := dep.Runner(consumer, pool, sideEffect(consumer, time.Duration(delay)*time.Millisecond, plan), inbox.ConsumerConfig{Consumer: consumer})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	return r.Run(ctx)
}

// countingDB is the inbox database with its transactions counted and its
// first failCommits commits failed (rolled back instead).
type countingDB struct {
	*pgxpool.Pool
	mu                    sync.Mutex
	begins, commits, fail int
}

func (c *countingDB) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := c.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.begins++
	c.mu.Unlock()
	return &countingTx{Tx: tx, db: c}, nil
}

func (c *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return c.Pool.Exec(ctx, sql, args...)
}

func (c *countingDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return c.Pool.SendBatch(ctx, b)
}

type countingTx struct {
	pgx.Tx
	db *countingDB
}

func (t *countingTx) Commit(ctx context.Context) error {
	t.db.mu.Lock()
	t.db.commits++
	failing := t.db.commits <= t.db.fail
	t.db.mu.Unlock()
	if failing {
		_ = t.Tx.Rollback(ctx)
		return fmt.Errorf("injected commit failure")
	}
	return t.Tx.Commit(ctx)
}
